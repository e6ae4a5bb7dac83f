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
	now    func() time.Time
}

type tenure struct {
	token      fencedlease.Token
	validUntil time.Time // on the monotonic clock (time.Now keeps one)
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
		now:         time.Now,
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
	rec := recordOf(obj)
	raw, err := json.Marshal(struct {
		Record          resourcelock.LeaderElectionRecord
		ResourceVersion string
	}{rec, obj.GetResourceVersion()})
	return &rec, raw, err
}

// Create makes the lease held by ler.HolderIdentity (this participant) and records the tenure.
func (l *Lock) Create(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
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
	holder, _, _ := unstructured.NestedString(cur.Object, "spec", "holderIdentity")
	if holder == ler.HolderIdentity && held {
		return l.renew(ctx, cur, ler, false)
	}
	if holder == ler.HolderIdentity {
		// Named from an earlier run of this identity: clear it first, so that this process
		// leads under a new token (a reused identity never inherits a token).
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

// writeHolder sets spec.holderIdentity (clearing the preferred holder, which had its chance)
// with the object's resourceVersion as precondition.
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
	}
	unstructured.RemoveNestedField(obj.Object, "spec", "preferredHolder")
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
	now := l.now()
	stamp := now.UTC().Format(time.RFC3339Nano)
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
	l.tenure = &tenure{token: token, validUntil: now.Add(validity(time.Duration(duration) * time.Second))}
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
	if holder != l.identity {
		return nil
	}
	_, err := l.writeHolder(ctx, cur, "")
	return err
}

func (l *Lock) forget() {
	l.mu.Lock()
	l.tenure = nil
	l.mu.Unlock()
}

func (l *Lock) saw(obj *unstructured.Unstructured) {
	l.mu.Lock()
	l.seen = obj
	if holder, _, _ := unstructured.NestedString(obj.Object, "spec", "holderIdentity"); holder != l.identity {
		l.tenure = nil // lost: someone else holds it, or nobody
	}
	l.mu.Unlock()
}

// Token is the current tenure's token while it is valid; else a [*fencedlease.NotLeadingError].
func (l *Lock) Token(context.Context) (fencedlease.Token, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.tenure != nil && l.now().Before(l.tenure.validUntil) {
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
