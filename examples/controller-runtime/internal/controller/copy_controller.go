// Package controller is the sample operator's one reconciler: it copies each ConfigMap labelled
// sample.fencedlease.io/source into a protected ConfigMap <name>-copy, by server-side apply.
// Nothing in it knows of fencing: the manager runs it only while this replica leads, and its
// client stamps every write (cmd/main.go).
package controller

import (
	"context"

	"github.com/fencedlease/fencedlease/examples/controller-runtime/internal/events"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	applycorev1 "k8s.io/client-go/applyconfigurations/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
)

// SourceLabel marks the ConfigMaps to copy.
const SourceLabel = "sample.fencedlease.io/source"

// CopyReconciler copies sources into protected copies.
type CopyReconciler struct {
	client.Client
	// Lease names the FencedLease that protects the copies (their fencedlease.io/lease label).
	Lease string
	// Identity is this replica's, written into each copy's data.
	Identity string
}

// Reconcile applies the copy of one source.
func (r *CopyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	events.Emit(r.Identity, "reconcile-start", map[string]any{"name": req.Name})
	defer events.Emit(r.Identity, "reconcile-end", map[string]any{"name": req.Name})
	var src corev1.ConfigMap
	if err := r.Get(ctx, req.NamespacedName, &src); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	name := req.Name + "-copy"
	value := src.Data["value"]
	copyOf := applycorev1.ConfigMap(name, req.Namespace).
		WithLabels(map[string]string{"fencedlease.io/lease": r.Lease}).
		WithData(map[string]string{"value": value, "by": r.Identity})
	err := r.Apply(ctx, copyOf, client.FieldOwner("fenced-operator"), client.ForceOwnership)
	switch {
	case err == nil:
		events.Emit(r.Identity, "wrote", map[string]any{"name": name, "value": value})
	case apierrors.IsForbidden(err):
		events.Emit(r.Identity, "refused", map[string]any{"name": name, "message": err.Error()})
	default:
		events.Emit(r.Identity, "not-sent", map[string]any{"name": name, "why": err.Error()})
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil
}

// SetupWithManager watches the labelled ConfigMaps.
func (r *CopyReconciler) SetupWithManager(mgr ctrl.Manager) error {
	sources := predicate.NewPredicateFuncs(func(o client.Object) bool {
		_, ok := o.GetLabels()[SourceLabel]
		return ok
	})
	return ctrl.NewControllerManagedBy(mgr).
		For(&corev1.ConfigMap{}, builder.WithPredicates(sources)).
		Complete(r)
}
