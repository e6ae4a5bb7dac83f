// Package fencedlease is the Go client of the fencedlease sidecar: leader election with a
// fencing token that the Kubernetes API server checks on every protected write.
//
// Import it as
//
//	import fencedlease "github.com/fencedlease/fencedlease/clients/go"
//
// It uses the standard library only. The pieces:
//
//   - [Client] talks to the sidecar's loopback API ($FENCEDLEASE_URL, default
//     http://127.0.0.1:8787): [Client.Status], [Client.Token], [Client.Watch] (the
//     /v1/watch event stream, reconnecting) and [Client.Release].
//   - [TokenFiles] reads the token files the sidecar keeps while the pod leads.
//   - [Transport] is an [net/http.RoundTripper] for the Kubernetes API that stamps the
//     current token, the lease UID and a new write id into the body of every create, update
//     and merge patch, and refuses writes while the pod does not lead.
//   - [Runnable] runs a function only while the pod leads and cancels its context when
//     leadership ends. It has the method set of controller-runtime's manager.Runnable and
//     LeaderElectionRunnable, so mgr.Add takes it without this package importing
//     controller-runtime.
//
// Errors say what to do next. A pod that does not lead gets a [*NotLeadingError] (matching
// [ErrNotLeading] with errors.Is); a write the Transport cannot stamp gets an
// [*UnstampableError].
package fencedlease
