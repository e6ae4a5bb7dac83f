// The sample controller-runtime operator, fenced (issue 35):
//
//	fenced-operator NAMESPACE LEASE IDENTITY [SECONDS]
//
// It elects through the FencedLease LEASE (fencedkube.Lock as the manager's lock) and writes
// through a client that stamps every write with the tenure's token (fencedkube.NewClient). The
// fencing is the lines marked "fencing" below. For the repository's test only: while the file
// named by $FENCEDLEASE_SAMPLE_STALL_FILE exists, the next write to a ConfigMap, already
// stamped, stops the process (SIGSTOP) just before it is sent, as a long pause would.
package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fencedlease/fencedlease/clients/go/kube"
	"github.com/fencedlease/fencedlease/examples/controller-runtime/internal/controller"
	"github.com/fencedlease/fencedlease/examples/controller-runtime/internal/events"
	"github.com/go-logr/logr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "fenced-operator:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 3 || len(args) > 4 {
		return fmt.Errorf("usage: fenced-operator NAMESPACE LEASE IDENTITY [SECONDS]")
	}
	ns, lease, id := args[0], args[1], args[2]
	seconds := 15
	if len(args) == 4 {
		n, err := strconv.Atoi(args[3])
		if err != nil || n < 2 {
			return fmt.Errorf("SECONDS must be a whole number of seconds, at least 2: %q", args[3])
		}
		seconds = n
	}
	ctrl.SetLogger(logr.Discard()) // the sample speaks in events
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return err
	}
	if stall := os.Getenv("FENCEDLEASE_SAMPLE_STALL_FILE"); stall != "" {
		cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &stallRT{rt, stall, id} })
	}
	lock, err := fencedkube.NewLock(cfg, ns, lease, id) // fencing
	if err != nil {
		return err
	}
	leaseDuration := time.Duration(seconds) * time.Second
	renewDeadline, retry := leaseDuration*3/4, leaseDuration/8
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Cache:                               cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Metrics:                             server.Options{BindAddress: "0"},
		LeaderElection:                      true,
		LeaderElectionID:                    lease,
		LeaderElectionNamespace:             ns,
		LeaderElectionResourceLockInterface: lock,                       // fencing
		NewClient:                           fencedkube.NewClient(lock), // fencing
		LeaderElectionReleaseOnCancel:       true,
		LeaseDuration:                       &leaseDuration,
		RenewDeadline:                       &renewDeadline,
		RetryPeriod:                         &retry,
	})
	if err != nil {
		return err
	}
	r := &controller.CopyReconciler{Client: mgr.GetClient(), Lease: lease, Identity: id}
	if err := r.SetupWithManager(mgr); err != nil {
		return err
	}
	// Says when this replica leads, with its token (a runnable that needs leader election).
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		tok, err := lock.Token(ctx)
		events.Emit(id, "leading", map[string]any{"token": tok.Value, "error": fmt.Sprint(err)})
		<-ctx.Done()
		return nil
	})); err != nil {
		return err
	}
	err = mgr.Start(ctrl.SetupSignalHandler())
	events.Emit(id, "stopped", map[string]any{"error": fmt.Sprint(err)})
	return err
}

// stopSelf stops the whole process with SIGSTOP sent to the calling thread itself. A stop sent
// to the process (kill(getpid())) may be taken by another thread first, and until the group
// stop reaches this one it runs on: the held write could go out before the pause.
func stopSelf() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	_ = syscall.Tgkill(os.Getpid(), syscall.Gettid(), syscall.SIGSTOP)
}

// stallRT is the test's pause: below the stamping, so a write it holds is already stamped.
type stallRT struct {
	base     http.RoundTripper
	file, id string
}

func (s *stallRT) RoundTrip(req *http.Request) (*http.Response, error) {
	write := req.Method != http.MethodGet && req.Method != http.MethodHead
	if _, err := os.Stat(s.file); err != nil || !write || !strings.Contains(req.URL.Path, "/configmaps/") {
		return s.base.RoundTrip(req)
	}
	_ = os.Remove(s.file)
	events.Emit(s.id, "stalling", nil)
	stopSelf()
	// Resumed: the stamped write goes out now, as one already on the wire would.
	resp, err := s.base.RoundTrip(req)
	status := 0
	if resp != nil {
		status = resp.StatusCode
	}
	events.Emit(s.id, "late-answer", map[string]any{"status": status})
	return resp, err
}
