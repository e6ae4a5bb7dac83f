package fencedkube

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	fencedlease "github.com/fencedlease/fencedlease/clients/go"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// The lock is a resourcelock.Interface, and a TokenSource for the Transport.
var (
	_ resourcelock.Interface  = (*Lock)(nil)
	_ fencedlease.TokenSource = (*Lock)(nil)
)

func TestValidityKeepsTheElectorsSafetyMargin(t *testing.T) {
	for _, tc := range []struct{ lease, want time.Duration }{
		{15 * time.Second, 13 * time.Second},
		{time.Second, 800 * time.Millisecond},
		{60 * time.Second, 58 * time.Second},
		{80 * time.Millisecond, 40 * time.Millisecond},
	} {
		if got := validity(tc.lease); got != tc.want {
			t.Errorf("validity(%v) = %v, want %v", tc.lease, got, tc.want)
		}
	}
}

// integration is the API server and namespace tests/adoption_controller_runtime.rs gives.
func integration(t *testing.T) (*rest.Config, string) {
	t.Helper()
	ns := os.Getenv("FENCEDKUBE_IT_NAMESPACE")
	if ns == "" {
		if os.Getenv("FENCEDKUBE_IT_REQUIRED") == "1" {
			t.Fatal("FENCEDKUBE_IT_REQUIRED=1 but $FENCEDKUBE_IT_NAMESPACE is not set")
		}
		t.Skip("no API server ($FENCEDKUBE_IT_NAMESPACE unset): `cargo test --test adoption_controller_runtime` runs this against a real one")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv("KUBECONFIG"))
	if err != nil {
		t.Fatalf("the kubeconfig: %v", err)
	}
	return cfg, ns
}

func lock(t *testing.T, cfg *rest.Config, ns, name, id string) *Lock {
	t.Helper()
	l, err := NewLock(cfg, ns, name, id)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func mustToken(t *testing.T, l *Lock) fencedlease.Token {
	t.Helper()
	tok, err := l.Token(context.Background())
	if err != nil {
		t.Fatalf("%s: %v", l.Identity(), err)
	}
	return tok
}

// TestIntegrationLockMeetsClientGosExpectations: create, get, update (renew, take over,
// release), identity and describe, as client-go's LeaderElector uses them; and the token moves
// on with every change of holder, a reused identity included.
func TestIntegrationLockMeetsClientGosExpectations(t *testing.T) {
	cfg, ns := integration(t)
	ctx := context.Background()
	a := lock(t, cfg, ns, "lock", "a")
	if a.Identity() != "a" || a.Describe() != ns+"/lock" {
		t.Fatalf("identity %q, describe %q", a.Identity(), a.Describe())
	}
	if _, _, err := a.Get(ctx); !apierrors.IsNotFound(err) {
		t.Fatalf("Get of a missing lease: want NotFound (client-go then creates), got %v", err)
	}
	if _, err := a.Token(ctx); !errors.Is(err, fencedlease.ErrNotLeading) {
		t.Fatalf("a token before leading: %v", err)
	}
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: "a", LeaseDurationSeconds: 5}
	if err := a.Create(ctx, rec); err != nil {
		t.Fatalf("Create: %v", err)
	}
	first := mustToken(t, a)
	got, raw1, err := a.Get(ctx)
	if err != nil || got.HolderIdentity != "a" || got.LeaseDurationSeconds != 5 || got.RenewTime.IsZero() {
		t.Fatalf("Get after Create: %+v, %v", got, err)
	}
	// A renewal: a new record (raw bytes), the same token.
	if err := a.Update(ctx, rec); err != nil {
		t.Fatalf("renewal: %v", err)
	}
	if _, raw2, _ := a.Get(ctx); string(raw1) == string(raw2) {
		t.Fatal("a renewal left the raw record unchanged: client-go would see no renewal")
	}
	if tok := mustToken(t, a); tok != first {
		t.Fatalf("a renewal changed the token: %v -> %v", first, tok)
	}
	// Another participant takes over (as client-go does once the lease expired for it).
	b := lock(t, cfg, ns, "lock", "b")
	if _, _, err := b.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Update(ctx, resourcelock.LeaderElectionRecord{HolderIdentity: "b", LeaseDurationSeconds: 5}); err != nil {
		t.Fatalf("take over: %v", err)
	}
	second := mustToken(t, b)
	if second.Value <= first.Value || second.LeaseUID != first.LeaseUID {
		t.Fatalf("the token must move on: %v after %v", second, first)
	}
	if _, _, err := a.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Token(ctx); !errors.Is(err, fencedlease.ErrNotLeading) {
		t.Fatalf("a replaced holder still has a token: %v", err)
	}
	// A spec edit within the tenure (a new lease duration) moves the token on; b adopts it.
	patch := []byte(`{"spec":{"leaseDurationSeconds":6}}`)
	if _, err := b.leases.Patch(ctx, "lock", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if edited := mustToken(t, b); edited.Value <= second.Value {
		t.Fatalf("after a spec edit b still presents %v", edited)
	}
	if err := b.Update(ctx, resourcelock.LeaderElectionRecord{HolderIdentity: "b", LeaseDurationSeconds: 6}); err != nil {
		t.Fatalf("renewal after a spec edit: %v", err)
	}
	second = mustToken(t, b)
	// The same identity in another process (a restart, or a second replica given the same
	// name): client-go, comparing names, takes it for a renewal; the lock waits until the other
	// process stops renewing for a lease duration, then leads under a new token.
	b2 := lock(t, cfg, ns, "lock", "b")
	if _, _, err := b2.Get(ctx); err != nil {
		t.Fatal(err)
	}
	record := resourcelock.LeaderElectionRecord{HolderIdentity: "b", LeaseDurationSeconds: 6}
	if err := b2.Update(ctx, record); err == nil {
		t.Fatal("a second process of identity b took over a lease its first process still renews")
	}
	clock := b2.now
	b2.now = func() time.Duration { return clock() + 6*time.Second } // b stopped renewing since
	if err := b2.Update(ctx, record); err != nil {
		t.Fatalf("b's new process, once b's lease ran out: %v", err)
	}
	if third := mustToken(t, b2); third.Value <= second.Value {
		t.Fatalf("a reused identity inherited token %v (had %v)", third, second)
	}
	// The first process learns it and neither renews nor releases the newcomer's tenure.
	if _, _, err := b.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Token(ctx); !errors.Is(err, fencedlease.ErrNotLeading) {
		t.Fatalf("the replaced process of b still has a token: %v", err)
	}
	if err := b.Update(ctx, resourcelock.LeaderElectionRecord{LeaseDurationSeconds: 1}); err != nil {
		t.Fatalf("the replaced process's release: %v", err)
	}
	if got, _, _ := b2.Get(ctx); got.HolderIdentity != "b" {
		t.Fatalf("the replaced process released the newcomer's lease: %+v", got)
	}
	mustToken(t, b2)
	// Release, as client-go does with ReleaseOnCancel.
	// A handover asked for (spec.preferredHolder): the holder steps down at its next renewal.
	handover := []byte(`{"spec":{"preferredHolder":"c"}}`)
	if _, err := b2.leases.Patch(ctx, "lock", types.MergePatchType, handover, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b2.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b2.Update(ctx, record); err == nil {
		t.Fatal("the holder renewed over a handover to c")
	}
	if got, _, _ := b2.Get(ctx); got.HolderIdentity != "" {
		t.Fatalf("handed over, but held by %q", got.HolderIdentity)
	}
	// Others wait for c (a lease duration); c takes it at once.
	if _, _, err := a.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Update(ctx, resourcelock.LeaderElectionRecord{HolderIdentity: "a", LeaseDurationSeconds: 6}); err == nil {
		t.Fatal("a took a lease handed over to c")
	}
	c := lock(t, cfg, ns, "lock", "c")
	if _, _, err := c.Get(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Update(ctx, resourcelock.LeaderElectionRecord{HolderIdentity: "c", LeaseDurationSeconds: 6}); err != nil {
		t.Fatalf("the preferred holder: %v", err)
	}
	mustToken(t, c)
	if err := c.Update(ctx, resourcelock.LeaderElectionRecord{LeaseDurationSeconds: 1}); err != nil {
		t.Fatalf("release: %v", err)
	}
	if got, _, _ := c.Get(ctx); got.HolderIdentity != "" {
		t.Fatalf("released, but held by %q", got.HolderIdentity)
	}
	if _, err := c.Token(ctx); !errors.Is(err, fencedlease.ErrNotLeading) {
		t.Fatalf("a token after release: %v", err)
	}
}

// TestIntegrationALeaseBeingDeletedElectsNobody: a lease that waits for a finalizer after its
// delete (policy mode's controller holds it until the lease index drops it) ends the holder's
// tenure, and nobody can read it as a record to acquire.
func TestIntegrationALeaseBeingDeletedElectsNobody(t *testing.T) {
	cfg, ns := integration(t)
	ctx := context.Background()
	a := lock(t, cfg, ns, "doomed", "a")
	if err := a.Create(ctx, resourcelock.LeaderElectionRecord{HolderIdentity: "a", LeaseDurationSeconds: 30}); err != nil {
		t.Fatalf("Create: %v", err)
	}
	mustToken(t, a)
	hold := []byte(`{"metadata":{"finalizers":["example.com/hold"]}}`)
	if _, err := a.leases.Patch(ctx, "doomed", types.MergePatchType, hold, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		let := []byte(`{"metadata":{"finalizers":null}}`)
		_, _ = a.leases.Patch(ctx, "doomed", types.MergePatchType, let, metav1.PatchOptions{})
	}()
	if err := a.leases.Delete(ctx, "doomed", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Get(ctx); err == nil || !strings.Contains(err.Error(), "being deleted") {
		t.Fatalf("Get of a lease being deleted: want an error saying so, got %v", err)
	}
	if _, err := a.Token(ctx); !errors.Is(err, fencedlease.ErrNotLeading) {
		t.Fatalf("the holder of a lease being deleted still has a token: %v", err)
	}
	b := lock(t, cfg, ns, "doomed", "b")
	if _, _, err := b.Get(ctx); err == nil {
		t.Fatal("another participant read a lease being deleted as a record it could acquire")
	}
}

// TestIntegrationRunOrDieElectsThroughTheLock: two client-go LeaderElectors on one
// FencedLease; the first leader releases on cancel and the other takes over at once, under a
// larger token.
func TestIntegrationRunOrDieElectsThroughTheLock(t *testing.T) {
	cfg, ns := integration(t)
	type led struct {
		id  string
		tok fencedlease.Token
	}
	leading := make(chan led, 2)
	cancels := map[string]context.CancelFunc{}
	for _, id := range []string{"x", "y"} {
		l := lock(t, cfg, ns, "elect", id)
		ctx, cancel := context.WithCancel(context.Background())
		cancels[id] = cancel
		t.Cleanup(cancel)
		go leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
			Lock: l, LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second,
			RetryPeriod: 200 * time.Millisecond, ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					tok, err := l.Token(ctx)
					if err != nil {
						t.Errorf("%s leads without a token: %v", id, err)
					}
					leading <- led{id, tok}
				},
				OnStoppedLeading: func() {},
			},
		})
	}
	first := <-leading
	cancels[first.id]()
	second := <-leading
	if second.id == first.id || second.tok.Value <= first.tok.Value {
		t.Fatalf("after %+v came %+v", first, second)
	}
}
