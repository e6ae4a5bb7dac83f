package fencedkube

import (
	"net/http"

	fencedlease "github.com/fencedlease/fencedlease/clients/go"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// WrapConfig is a copy of cfg whose every write is stamped with the token of lock's current
// tenure, and refused unsent (an error matching [fencedlease.ErrNotLeading]) while this
// process does not lead: creates, updates, merge, strategic merge and JSON patches, server-side
// apply in JSON (apply with force: the write id changes with every write), the /status of
// built-in types (a custom resource's /status keeps the stored metadata: no token can be
// presented there); a delete of a protected object is announced first. Reads and
// watches pass untouched. Requests are sent as JSON (protobuf cannot be stamped). Use it for
// the writes a leader makes; the lock itself and the watches need no wrapping.
func WrapConfig(cfg *rest.Config, lock *Lock) *rest.Config {
	out := rest.CopyConfig(cfg)
	out.ContentType = "application/json"
	out.AcceptContentTypes = "application/json"
	out.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return &fencedlease.Transport{Source: lock, Base: rt}
	})
	return out
}

// NewClient is a controller-runtime client constructor (manager.Options.NewClient) whose
// client stamps every write with lock's token, as [WrapConfig] says; reads still come from the
// manager's cache. With it, mgr.GetClient() in a reconciler writes fenced:
//
//	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
//		LeaderElection:                      true,
//		LeaderElectionID:                    "my-operator",
//		LeaderElectionResourceLockInterface: lock,
//		LeaderElectionReleaseOnCancel:       true,
//		NewClient:                           fencedkube.NewClient(lock),
//	})
func NewClient(lock *Lock) func(*rest.Config, client.Options) (client.Client, error) {
	return func(cfg *rest.Config, opts client.Options) (client.Client, error) {
		wrapped := WrapConfig(cfg, lock)
		// The manager hands over its shared HTTP client, which a client uses instead of the
		// config's transport: the fenced client needs one of its own.
		hc, err := rest.HTTPClientFor(wrapped)
		if err != nil {
			return nil, err
		}
		opts.HTTPClient = hc
		return client.New(wrapped, opts)
	}
}
