// Load generator of the many-leases benchmark (bench/many_leases.py, issue 21): N Leases with C
// candidates each, as N×C client-go LeaderElectors in one process. One clientset, its client-side
// rate limiter opened wide, so that the API server receives what N×C separate candidates (each
// with its own client and its own default limit of 5 requests/s, which a candidate never
// reaches) would send. A candidate whose leadership ends campaigns again, as a restarted pod
// would. Timings as the single-lease peer's flags (client-go's usual 15s/10s/2s by default).
//
//	many-peer -kubeconfig F -namespace NS -leases N [-candidates 2] [-prefix lease]
//
// It prints "started N×C" once every elector runs, and stops (releasing what it holds) on
// SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file")
	namespace := flag.String("namespace", "", "namespace of the Leases")
	leases := flag.Int("leases", 0, "how many Leases")
	candidates := flag.Int("candidates", 2, "candidates per Lease")
	prefix := flag.String("prefix", "lease", "Lease names are PREFIX-0 ... PREFIX-(N-1)")
	leaseDuration := flag.Duration("lease-duration", 15*time.Second, "LeaseDuration")
	renewDeadline := flag.Duration("renew-deadline", 10*time.Second, "RenewDeadline")
	retryPeriod := flag.Duration("retry-period", 2*time.Second, "RetryPeriod")
	flag.Parse()
	if *namespace == "" || *leases <= 0 || *candidates <= 0 {
		fmt.Fprintln(os.Stderr, "usage: many-peer -kubeconfig F -namespace NS -leases N [-candidates C]")
		os.Exit(2)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "reading %s: %v\n", *kubeconfig, err)
		os.Exit(1)
	}
	cfg.QPS, cfg.Burst = 1e6, 1e6
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()

	var wg sync.WaitGroup
	var terms atomic.Int64
	for i := 0; i < *leases; i++ {
		for c := 0; c < *candidates; c++ {
			lock := &resourcelock.LeaseLock{
				LeaseMeta:  metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", *prefix, i), Namespace: *namespace},
				Client:     client.CoordinationV1(),
				LockConfig: resourcelock.ResourceLockConfig{Identity: fmt.Sprintf("c%d-%d", c, os.Getpid())},
			}
			config := leaderelection.LeaderElectionConfig{
				Lock:            lock,
				ReleaseOnCancel: true,
				LeaseDuration:   *leaseDuration,
				RenewDeadline:   *renewDeadline,
				RetryPeriod:     *retryPeriod,
				Callbacks: leaderelection.LeaderCallbacks{
					OnStartedLeading: func(ctx context.Context) { terms.Add(1); <-ctx.Done() },
					OnStoppedLeading: func() {},
				},
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					leaderelection.RunOrDie(ctx, config)
				}
			}()
		}
	}
	fmt.Printf("started %d×%d\n", *leases, *candidates)
	<-ctx.Done()
	wg.Wait()
	fmt.Printf("stopped; %d terms began\n", terms.Load())
}
