// Package fencedkube fences Go operators in-process, with no sidecar: [Lock] is a FencedLease
// lock for client-go's leader election (leaderelection.RunOrDie, and controller-runtime's
// manager through Options.LeaderElectionResourceLockInterface), and it hands out the tenure's
// fencing token; [WrapConfig] and [NewClient] stamp every write with it.
//
// The lock speaks the FencedLease protocol as the Rust elector does (elector/src/lease): a
// change of holder is a spec write with a resourceVersion precondition, so the API server
// raises metadata.generation, the token; renewals are status writes and never change it. A
// process that finds the lease still naming its identity from an earlier run clears it first,
// so that it leads under a new token, never under the old one.
package fencedkube

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	fencedlease "github.com/fencedlease/fencedlease/clients/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// FencedLeases is the resource of the FencedLease custom resource.
var FencedLeases = schema.GroupVersionResource{Group: "fencedlease.io", Version: "v1alpha1", Resource: "fencedleases"}

// incarnationAnnotation names the process that acquired the lease (elector/src/api.rs).
const incarnationAnnotation = "fencedlease.io/holder-incarnation"

// Lock is a FencedLease as a client-go resourcelock.Interface, and the [fencedlease.TokenSource]
// of the tenure it holds. Make it with [NewLock].
type Lock struct {
	namespace, name, identity string
	leases                    dynamic.ResourceInterface
	incarnation               string
	// Recorder, if set, gets the leader election's events (on the FencedLease).
	Recorder resourcelock.EventRecorder

	mu     sync.Mutex
	seen   *unstructured.Unstructured // the lease as last read or written
	tenure *tenure                    // this process's current tenure, if any
	// When the holder's renewTime and the preferred holder last changed, on [boottime]: a
	// lease naming this identity from another process is taken over only once it stops
	// renewing for a lease duration, and a handover waits for the preferred holder as long.
	renewSeen, preferredSeen     string
	renewSeenAt, preferredSeenAt time.Duration
	now                          func() time.Duration
}

type tenure struct {
	token      fencedlease.Token
	validUntil time.Duration // on [boottime]: time suspended counts, as the Rust elector's does
}

// NewLock is the lock of FencedLease namespace/name for identity, through cfg's API server.
func NewLock(cfg *rest.Config, namespace, name, identity string) (*Lock, error) {
	if namespace == "" || name == "" || identity == "" {
		return nil, errors.New("fencedkube: the lease's namespace and name and the identity must not be empty")
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("fencedkube: a client for FencedLeases: %w", err)
	}
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return &Lock{
		namespace: namespace, name: name, identity: identity,
		leases:      dc.Resource(FencedLeases).Namespace(namespace),
		incarnation: hex.EncodeToString(b),
		now:         boottime,
	}, nil
}

// Identity is this participant's identity.
func (l *Lock) Identity() string { return l.identity }

// Describe names the lease: namespace/name.
func (l *Lock) Describe() string { return l.namespace + "/" + l.name }

// RecordEvent records an event of the leader election on the FencedLease, if a Recorder is set.
func (l *Lock) RecordEvent(s string) {
	l.mu.Lock()
	obj := l.seen
	l.mu.Unlock()
	if l.Recorder == nil || obj == nil {
		return
	}
	l.Recorder.Eventf(obj, "Normal", "LeaderElection", "%s %s", l.identity, s)
}

// Get reads the lease as a leader election record; the raw bytes change with every write.
func (l *Lock) Get(ctx context.Context) (*resourcelock.LeaderElectionRecord, []byte, error) {
	obj, err := l.leases.Get(ctx, l.name, metav1.GetOptions{})
	if err != nil {
		return nil, nil, err
	}
	l.saw(obj)
	if obj.GetDeletionTimestamp() != nil {
		// Being deleted (it waits for a finalizer): it elects nobody. The holder cannot renew,
		// so client-go ends its leadership; nobody acquires it.
		return nil, nil, fmt.Errorf("fencedkube: %s is being deleted: it elects nobody until it is gone and made again", l.Describe())
	}
	rec := recordOf(obj)
	// The record and the exact renewTime (the record's times have whole seconds), not the
	// resourceVersion: the controller's own status writes (conditions) move that but are no
	// renewal, and must not restart client-go's expiry clock.
	renewed, _, _ := unstructured.NestedString(obj.Object, "status", "renewTime")
	raw, err := json.Marshal(struct {
		Record    resourcelock.LeaderElectionRecord
		RenewTime string
	}{rec, renewed})
	return &rec, raw, err
}

// Create makes the lease held by ler.HolderIdentity (this participant) and records the tenure.
func (l *Lock) Create(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	if err := checkDuration(ler); err != nil {
		return err
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "fencedlease.io/v1alpha1",
		"kind":       "FencedLease",
		"metadata": map[string]any{
			"name": l.name, "namespace": l.namespace,
			"annotations": map[string]any{incarnationAnnotation: l.incarnation},
		},
		"spec": map[string]any{
			"holderIdentity":       ler.HolderIdentity,
			"leaseDurationSeconds": int64(max(ler.LeaseDurationSeconds, 1)),
		},
	}}
	created, err := l.leases.Create(ctx, obj, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	return l.renew(ctx, created, ler, true)
}

// Update acquires, renews or (with an empty HolderIdentity) releases the lease.
func (l *Lock) Update(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	l.mu.Lock()
	cur, held := l.seen, l.tenure != nil
	l.mu.Unlock()
	if cur == nil {
		return errors.New("fencedkube: Update before Get")
	}
	if ler.HolderIdentity == "" {
		return l.release(ctx, cur)
	}
	if err := checkDuration(ler); err != nil {
		return err
	}
	holder, _, _ := unstructured.NestedString(cur.Object, "spec", "holderIdentity")
	preferred, _, _ := unstructured.NestedString(cur.Object, "spec", "preferredHolder")
	if holder == ler.HolderIdentity && held {
		if preferred != "" && preferred != l.identity {
			// A handover asked for: step down (a new token), so the preferred holder takes over.
			if err := l.release(ctx, cur); err != nil {
				return err
			}
			return fmt.Errorf("fencedkube: handed %s over to %q (spec.preferredHolder)", l.Describe(), preferred)
		}
		return l.renew(ctx, cur, ler, false)
	}
	if err := l.mayAcquire(cur, holder, preferred); err != nil {
		return err
	}
	if holder == ler.HolderIdentity {
		// Named from an earlier tenure of this process: clear it first, so that it leads under
		// a new token (a reused identity never inherits a token).
		cleared, err := l.writeHolder(ctx, cur, "")
		if err != nil {
			return err
		}
		cur = cleared
	}
	before := cur.GetGeneration()
	acquired, err := l.writeHolder(ctx, cur, ler.HolderIdentity)
	if err != nil {
		return err
	}
	if acquired.GetGeneration() <= before {
		return fmt.Errorf("fencedkube: acquiring %s did not raise the generation (%d after %d)", l.Describe(), acquired.GetGeneration(), before)
	}
	return l.renew(ctx, acquired, ler, true)
}

// mayAcquire refuses what the FencedLease protocol does not allow a candidate, where
// client-go would go ahead: a lease naming this identity from another process that still
// renews it (client-go compares names only), and a handover to another preferred holder that
// has not had a lease duration to take over.
func (l *Lock) mayAcquire(cur *unstructured.Unstructured, holder, preferred string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	wait := time.Duration(recordOf(cur).LeaseDurationSeconds) * time.Second
	now := l.now()
	if holder == l.identity && cur.GetAnnotations()[incarnationAnnotation] != l.incarnation && now-l.renewSeenAt < wait {
		return fmt.Errorf("fencedkube: %s names this identity, held by another process (incarnation %q) that renewed it %v ago; waiting for it to expire (%v)",
			l.Describe(), cur.GetAnnotations()[incarnationAnnotation], (now - l.renewSeenAt).Round(time.Millisecond), wait)
	}
	if preferred != "" && preferred != l.identity && now-l.preferredSeenAt < wait {
		return fmt.Errorf("fencedkube: %s is handed over to %q (spec.preferredHolder); others may take it only after %v", l.Describe(), preferred, wait)
	}
	return nil
}

// checkDuration refuses a lease duration the CRD does not take (1 to 3600 s).
func checkDuration(ler resourcelock.LeaderElectionRecord) error {
	if ler.LeaseDurationSeconds > maxLeaseSeconds {
		return fmt.Errorf("fencedkube: a lease duration of %d s is longer than a FencedLease takes (%d s)", ler.LeaseDurationSeconds, maxLeaseSeconds)
	}
	return nil
}

// maxLeaseSeconds is the longest spec.leaseDurationSeconds the CRD takes (elector/src/api.rs).
const maxLeaseSeconds = 3600

// writeHolder sets or clears spec.holderIdentity (an acquisition also clears the preferred
// holder, which had its chance) with the object's resourceVersion as precondition.
func (l *Lock) writeHolder(ctx context.Context, cur *unstructured.Unstructured, holder string) (*unstructured.Unstructured, error) {
	obj := cur.DeepCopy()
	ann := obj.GetAnnotations()
	if ann == nil {
		ann = map[string]string{}
	}
	if holder == "" {
		unstructured.RemoveNestedField(obj.Object, "spec", "holderIdentity")
		delete(ann, incarnationAnnotation)
	} else {
		_ = unstructured.SetNestedField(obj.Object, holder, "spec", "holderIdentity")
		ann[incarnationAnnotation] = l.incarnation
		// The preferred holder had its chance (or is us): nobody steps down again for it.
		unstructured.RemoveNestedField(obj.Object, "spec", "preferredHolder")
	}
	obj.SetAnnotations(ann)
	out, err := l.leases.Update(ctx, obj, metav1.UpdateOptions{})
	if err != nil {
		return nil, err
	}
	l.saw(out)
	return out, nil
}

// renew writes the status of this tenure (a renewal, or the first one after acquiring), and
// extends the tenure's validity from when the write was sent.
func (l *Lock) renew(ctx context.Context, cur *unstructured.Unstructured, ler resourcelock.LeaderElectionRecord, first bool) error {
	token := fencedlease.Token{Value: cur.GetGeneration(), LeaseUID: string(cur.GetUID())}
	if !first {
		l.mu.Lock()
		if l.tenure != nil {
			token = l.tenure.token
		}
		l.mu.Unlock()
	}
	duration := max(ler.LeaseDurationSeconds, 1)
	obj := cur.DeepCopy()
	status, _, _ := unstructured.NestedMap(obj.Object, "status")
	if status == nil {
		status = map[string]any{}
	}
	sent := l.now()
	stamp := time.Now().UTC().Format(time.RFC3339Nano)
	if prev, _ := status["holderIdentity"].(string); first || prev != l.identity {
		status["acquireTime"] = stamp
		if prev != "" && prev != l.identity {
			n, _ := status["leaseTransitions"].(int64)
			status["leaseTransitions"] = n + 1
		}
	}
	status["holderIdentity"] = l.identity
	status["token"] = token.Value
	status["renewTime"] = stamp
	status["leaseDurationSeconds"] = int64(duration)
	obj.Object["status"] = status
	out, err := l.leases.UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	if err != nil {
		if first {
			l.forget()
		}
		return err
	}
	l.saw(out)
	l.mu.Lock()
	l.tenure = &tenure{token: token, validUntil: sent + validity(time.Duration(duration)*time.Second)}
	l.mu.Unlock()
	return nil
}

// validity is how long after a successful renewal was sent this participant still leads: the
// lease duration less a safety margin of a fifth, between 50 ms and 2 s (elector/src/lease/
// rules.rs, Timing::for_lease), before any other participant may take over.
func validity(lease time.Duration) time.Duration {
	margin := min(max(lease/5, 50*time.Millisecond), 2*time.Second, lease/2)
	return lease - margin
}

// release clears the holder (a new token) if this process holds the lease; the tenure ends
// before the write.
func (l *Lock) release(ctx context.Context, cur *unstructured.Unstructured) error {
	l.forget()
	holder, _, _ := unstructured.NestedString(cur.Object, "spec", "holderIdentity")
	if holder != l.identity || cur.GetAnnotations()[incarnationAnnotation] != l.incarnation {
		return nil // not ours: another holder, or this identity in another process
	}
	_, err := l.writeHolder(ctx, cur, "")
	return err
}

func (l *Lock) forget() {
	l.mu.Lock()
	l.tenure = nil
	l.mu.Unlock()
}

// saw takes in the lease as read or written: the tenure lasts while the lease names this
// identity, this process (its incarnation) and the lease the token is of; a spec edit within
// it (a new lease duration) moves the token on, and the tenure adopts it, as the Rust elector
// does. It also notes when the holder's renewals and the preferred holder last changed.
func (l *Lock) saw(obj *unstructured.Unstructured) {
	holder, _, _ := unstructured.NestedString(obj.Object, "spec", "holderIdentity")
	renewed, _, _ := unstructured.NestedString(obj.Object, "status", "renewTime")
	preferred, _, _ := unstructured.NestedString(obj.Object, "spec", "preferredHolder")
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seen = obj
	now := l.now()
	if key := holder + "/" + renewed; key != l.renewSeen {
		l.renewSeen, l.renewSeenAt = key, now
	}
	if preferred != l.preferredSeen {
		l.preferredSeen, l.preferredSeenAt = preferred, now
	}
	ours := holder == l.identity && obj.GetAnnotations()[incarnationAnnotation] == l.incarnation
	if l.tenure == nil {
		return
	}
	if !ours || string(obj.GetUID()) != l.tenure.token.LeaseUID || obj.GetDeletionTimestamp() != nil {
		l.tenure = nil // lost: someone else holds it, nobody does, the lease was replaced or is being deleted
		return
	}
	if g := obj.GetGeneration(); g > l.tenure.token.Value {
		l.tenure.token.Value = g
	}
}

// Token is the current tenure's token while it is valid; else a [*fencedlease.NotLeadingError].
func (l *Lock) Token(context.Context) (fencedlease.Token, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.tenure != nil && l.now() < l.tenure.validUntil {
		return l.tenure.token, nil
	}
	holder := ""
	if l.seen != nil {
		holder, _, _ = unstructured.NestedString(l.seen.Object, "spec", "holderIdentity")
	}
	return fencedlease.Token{}, &fencedlease.NotLeadingError{Holder: holder, Source: "FencedLease " + l.Describe()}
}

// recordOf reads a FencedLease as a leader election record. The duration is the longer of
// the spec's and the one the holder last renewed under, as the FencedLease protocol asks.
func recordOf(obj *unstructured.Unstructured) resourcelock.LeaderElectionRecord {
	holder, _, _ := unstructured.NestedString(obj.Object, "spec", "holderIdentity")
	spec, _, _ := unstructured.NestedInt64(obj.Object, "spec", "leaseDurationSeconds")
	renewed, _, _ := unstructured.NestedInt64(obj.Object, "status", "leaseDurationSeconds")
	transitions, _, _ := unstructured.NestedInt64(obj.Object, "status", "leaseTransitions")
	preferred, _, _ := unstructured.NestedString(obj.Object, "spec", "preferredHolder")
	rec := resourcelock.LeaderElectionRecord{
		HolderIdentity:       holder,
		LeaseDurationSeconds: int(max(spec, renewed, 1)),
		LeaderTransitions:    int(transitions),
		PreferredHolder:      preferred,
	}
	for field, dst := range map[string]*metav1.Time{"renewTime": &rec.RenewTime, "acquireTime": &rec.AcquireTime} {
		if s, _, _ := unstructured.NestedString(obj.Object, "status", field); s != "" {
			if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
				*dst = metav1.NewTime(t)
			}
		}
	}
	return rec
}
