package fencedlease_test

// These examples are compiled by `go test` (they have no Output comment, so they are not run:
// they need a sidecar). README.md shows the same code.

import (
	"context"
	"errors"
	"log"
	"net/http"
	"strings"

	fencedlease "github.com/fencedlease/fencedlease/clients/go"
)

func ExampleClient_Token() {
	ctx := context.Background()
	sidecar, err := fencedlease.NewClient("") // $FENCEDLEASE_URL, else http://127.0.0.1:8787
	if err != nil {
		log.Fatal(err)
	}
	tok, err := sidecar.Token(ctx)
	if errors.Is(err, fencedlease.ErrNotLeading) {
		log.Print("following: ", err)
		return
	}
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("leading with token %s of lease %s", tok, tok.LeaseUID)
}

func ExampleClient_Watch() {
	ctx := context.Background()
	sidecar, err := fencedlease.NewClient("")
	if err != nil {
		log.Fatal(err)
	}
	for st, err := range sidecar.Watch(ctx) {
		if err != nil {
			log.Print(err) // it reconnects by itself; until then, act as a follower
			continue
		}
		if tok, ok := st.LeadingToken(); ok {
			log.Printf("leading with token %s", tok)
		} else {
			log.Printf("following %q", st.HolderName())
		}
	}
}

func ExampleTransport() {
	ctx := context.Background()
	sidecar, err := fencedlease.NewClient("")
	if err != nil {
		log.Fatal(err)
	}
	// Base is the transport that carries the credentials: with client-go, wrap the one it
	// builds (rest.Config.Wrap); here the default, for an API server that needs none.
	kube := &http.Client{Transport: &fencedlease.Transport{Source: sidecar, Base: http.DefaultTransport}}
	patch := `{"data":{"stock":"42"}}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPatch,
		"https://kubernetes.default.svc/api/v1/namespaces/shop/configmaps/inventory", strings.NewReader(patch))
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/merge-patch+json")
	resp, err := kube.Do(req) // sent with the token, the lease UID and a new write id
	if errors.Is(err, fencedlease.ErrNotLeading) {
		return // not sent: this pod does not lead
	}
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	log.Print(resp.Status) // 403 if leadership moved before the webhook judged the write
}

func ExampleRunnable() {
	ctx := context.Background()
	sidecar, err := fencedlease.NewClient("")
	if err != nil {
		log.Fatal(err)
	}
	r := &fencedlease.Runnable{Client: sidecar, Run: func(ctx context.Context, tok fencedlease.Token) error {
		log.Printf("leading with token %s", tok)
		<-ctx.Done() // the leader's work goes here, until ctx is done
		log.Print("stopped: ", context.Cause(ctx))
		return nil
	}}
	// With controller-runtime: mgr.Add(r). Alone:
	if err := r.Start(ctx); err != nil {
		log.Fatal(err)
	}
}
