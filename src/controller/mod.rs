//! `fencedlease controller`: keeps every FencedLease's status true, revokes expired leases,
//! and emits Events. It is not on the critical path: candidates fail over without it.

mod args;
pub mod certs;
mod conditions;
mod error;
mod events;
#[cfg(test)]
mod fixtures;
pub mod holder;
mod index;
mod metrics;
mod owners;
pub(crate) mod pods;
pub mod policy;
mod reconcile;
#[cfg(test)]
mod sequences;
mod streams;
mod term;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use prometheus_client::metrics::gauge::Gauge;
use tracing::{info, warn};

use crate::runtime::admin::RenewalGauge;
use crate::runtime::admin_port::ReadyFlag;
use crate::runtime::Runtime;

use crate::api::FencedLease;
use crate::lease::elector::{Elector, ElectorConfig};

pub(crate) use args::ControllerArgs;
use error::short;
use metrics::ControllerMetrics;
use reconcile::Context;
use term::{Active, TermEnd};

fn cert_config(args: &ControllerArgs) -> Option<crate::controller::certs::CertConfig> {
    Some(crate::controller::certs::CertConfig {
        namespace: args.election_namespace.clone(),
        secret: args.webhook_cert_secret.clone()?,
        service: args.webhook_service.clone()?,
        configurations: args.webhook_configurations.clone(),
    })
}

/// Keeps the webhook certificate and caBundles current while this replica is active. The
/// first check that finds nothing to write says so at info, the later ones at debug.
async fn keep_certificates(client: Client, cfg: crate::controller::certs::CertConfig) {
    let mut said_current = false;
    loop {
        let wait = match crate::controller::certs::reconcile(&client, &cfg).await {
            Ok(false) if !said_current => {
                info!(secret = %cfg.secret, "the webhook certificate and caBundles are current: nothing written");
                said_current = true;
                Duration::from_secs(60)
            }
            Ok(false) => {
                tracing::debug!(secret = %cfg.secret, "the webhook certificate and caBundles are current");
                Duration::from_secs(60)
            }
            Ok(true) => Duration::from_secs(60),
            Err(e) => {
                warn!(error = %e, kind = e.metric_label(), "keeping the webhook certificate failed; retrying");
                Duration::from_secs(2)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// Gives an election lease created without an owner (by an earlier version) its owner. A
/// metadata change: the generation, so the token, stays.
async fn adopt_election_lease(
    client: &Client,
    namespace: &str,
    name: &str,
    owner: &OwnerReference,
) {
    let api: Api<FencedLease> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(Some(lease))
            if lease
                .metadata
                .owner_references
                .as_ref()
                .is_none_or(|o| o.is_empty()) =>
        {
            let patch = serde_json::json!({"metadata": {"ownerReferences": [owner]}});
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    info!(lease = name, service = %owner.name, "the election FencedLease is now owned by the Service")
                }
                Err(e) => {
                    warn!(lease = name, error = %e, "could not give the election FencedLease its owner")
                }
            }
        }
        Ok(_) => {}
        Err(e) => warn!(lease = name, error = %e, "could not read the election FencedLease"),
    }
}

/// Policy mode, while this replica is active: removes the per-lease bindings of releases up to
/// 0.2.0 (see [`crate::controller::policy::remove_legacy_bindings`]), retrying until it has;
/// then every `period` checks that the chart's binding is still there as the chart renders it,
/// in `intact` and, when it is not, in a warning saying what is wrong.
async fn keep_policy_mode(client: Client, policy: String, intact: Option<Gauge>, period: Duration) {
    let mut wait = Duration::from_secs(1);
    while let Err(e) = crate::controller::policy::remove_legacy_bindings(&client, &policy).await {
        warn!(error = %short(&e), "removing the per-lease fencing bindings of an earlier release failed; retrying");
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(60));
    }
    loop {
        match crate::controller::policy::binding_problem_now(&client, &policy).await {
            Ok(None) => {
                if let Some(g) = &intact {
                    g.set(1);
                }
            }
            Ok(Some(problem)) => {
                if let Some(g) = &intact {
                    g.set(0);
                }
                warn!(binding = %policy, %problem, "the fencing binding is not as the chart renders it: no lease is fenced in policy mode until it is; run helm upgrade to restore it");
            }
            Err(e) => warn!(error = %short(&e), "could not read the fencing binding; retrying"),
        }
        tokio::time::sleep(period).await;
    }
}

/// Runs the controller: campaigns for the controller lease and reconciles while active.
pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<std::process::ExitCode> {
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(crate::runtime::identity::default_identity);
    let mut rt = Runtime::start().await?;
    let client = rt.client().clone();
    if let Some(policy) = &args.fencing_policy {
        crate::controller::policy::require_policy(&client, policy).await?;
    }
    // The metrics server starts first, before the elector.
    let ready = ReadyFlag::default();
    let (metrics, renewals) = start_admin(&mut rt, &args, &ready);
    let owner = election_owner(&client, &args).await;
    let (elector, handle) = Elector::new(
        client.clone(),
        ElectorConfig {
            namespace: args.election_namespace.clone(),
            lease: args.election_lease.clone(),
            identity: identity.clone(),
            create_with_duration: Some(crate::api::DEFAULT_LEASE_DURATION_SECONDS),
            create_owner: owner.clone(),
            timing_override: None,
        },
    )?;
    renewals.follow(handle.state.clone());
    let elector = rt.spawn_elector(elector);
    let ctx = Arc::new(
        Context::new(client.clone(), metrics, &identity).with_unfenced(&args.unfenced_namespaces),
    );
    ready.set(true);
    let active = Active {
        args: &args,
        client: &client,
        ctx: &ctx,
        owner: owner.as_ref(),
        shutdown: rt.shutdown(),
    };
    let mut state = handle.state.clone();
    while let Some(term) = active.next_term(&mut state).await {
        if term.lead(&mut state).await == TermEnd::Stopped {
            break;
        }
        warn!("lost the controller lease: standing by");
    }
    info!("shutting down");
    ready.set(false);
    rt.shutdown().cancel();
    elector.stop_and_warn().await;
    rt.finish().await;
    Ok(std::process::ExitCode::SUCCESS)
}

/// Registers the controller's metrics, which the runtime serves with /livez and /readyz
/// (`ready`).
fn start_admin(
    rt: &mut Runtime,
    args: &ControllerArgs,
    ready: &ReadyFlag,
) -> (ControllerMetrics, RenewalGauge) {
    let mut metrics = ControllerMetrics::register(rt.registry());
    if args.fencing_policy.is_some() {
        metrics.register_policy(rt.registry());
    }
    let renewals = RenewalGauge::register(
        rt.registry(),
        "fencedlease_controller_last_renewal_timestamp_seconds",
    );
    rt.serve_admin(&args.admin, ready.readiness());
    (metrics, renewals)
}

/// The Service meant to own the election FencedLease (--election-owner-service), when it can
/// be read; otherwise a warning, and none.
async fn election_owner(client: &Client, args: &ControllerArgs) -> Option<OwnerReference> {
    let service = args.election_owner_service.as_ref()?;
    match crate::controller::owners::service_owner(client, &args.election_namespace, service).await
    {
        Ok(Some(owner)) => Some(owner),
        Ok(None) => {
            warn!(%service, "the Service meant to own the election FencedLease does not exist: the lease will outlive the operator");
            None
        }
        Err(e) => {
            warn!(%service, error = %e, "cannot read the Service meant to own the election FencedLease (it needs get on that Service): the lease will outlive the operator");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kube::runtime::controller::Action;
    use tokio::time::Instant;

    use super::events::LeaseEvent;
    use super::{conditions::*, error::*, reconcile::*, term::*};
    use crate::api::FencedLease;
    use crate::controller::holder::Death;
    use crate::lease::elector::LeaderState;
    use crate::lease::rules::FencingToken;

    #[test]
    fn a_lease_in_a_namespace_left_out_of_fencing_is_said_to_be_unfenced() {
        let mut lease = FencedLease::new("db", crate::api::FencedLeaseSpec::free());
        lease.metadata.namespace = Some("kube-system".into());
        lease.metadata.generation = Some(3);
        let out: std::collections::BTreeSet<String> =
            ["kube-system", "fencedlease"].map(String::from).into();
        let c = fenced_condition(&lease, Some(&out)).expect("known");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", NOT_FENCED)
        );
        assert!(
            c.message
                .contains("namespace kube-system is left out of fencing"),
            "{}",
            c.message
        );
        assert_eq!(c.observed_generation, Some(3));
        // Elsewhere no claim: the namespace selector may leave it out too.
        lease.metadata.namespace = Some("shop".into());
        assert!(fenced_condition(&lease, Some(&out)).is_none());
        // Not told which namespaces are left out: no claim either way.
        assert!(fenced_condition(&lease, None).is_none());
        assert!(desired_conditions(&lease, None, None)
            .iter()
            .all(|c| c.type_ != "Fenced"));
    }

    #[test]
    fn a_term_ends_when_leadership_does_by_news_or_by_deadline() {
        let now = Instant::now();
        let leading = |until| LeaderState::Leading {
            token: FencingToken {
                lease_uid: "u".into(),
                generation: 3,
            },
            valid_until: until,
            tenure: 1,
        };
        assert_eq!(
            term_end_of(&leading(now + Duration::from_secs(1)), now),
            None
        );
        assert_eq!(term_end_of(&leading(now), now), Some(TermEnd::Lost));
        let following = LeaderState::Following {
            holder: Some("b".into()),
            token: Some(4),
        };
        assert_eq!(term_end_of(&following, now), Some(TermEnd::Lost));
        assert_eq!(term_end_of(&LeaderState::Unknown, now), Some(TermEnd::Lost));
    }

    /// Steps that record the order they run in and answer what they were told to.
    struct Recorded {
        ran: Vec<&'static str>,
        expiry: Option<Result<Next, Error>>,
        label: Option<Result<(), Error>>,
    }

    impl Recorded {
        fn new(expiry: Result<Next, Error>, label: Result<(), Error>) -> Recorded {
            Recorded {
                ran: Vec::new(),
                expiry: Some(expiry),
                label: Some(label),
            }
        }
    }

    impl Steps for Recorded {
        async fn expiry(&mut self) -> Result<Next, Error> {
            self.ran.push("expiry");
            self.expiry.take().unwrap_or(Ok(Next::AwaitChange))
        }
        async fn announce(&mut self) {
            self.ran.push("announce");
        }
        async fn label(&mut self) -> Result<(), Error> {
            self.ran.push("label");
            self.label.take().unwrap_or(Ok(()))
        }
    }

    fn label_forbidden() -> Error {
        let status = serde_json::from_value(serde_json::json!({
            "code": 403, "reason": "Forbidden",
            "message": "pods \"pod-a\" is forbidden: cannot patch resource \"pods\""
        }))
        .expect("a Status");
        Error::LeaderLabel {
            pod: "pod-a".into(),
            source: kube::Error::Api(Box::new(status)),
        }
    }

    fn run(expiry: Result<Next, Error>, label: Result<(), Error>) -> (Vec<&'static str>, Outcome) {
        let mut steps = Recorded::new(expiry, label);
        let outcome = futures::executor::block_on(run_steps(&mut steps));
        (steps.ran, outcome)
    }

    #[test]
    fn revocation_and_status_come_first_and_a_failing_label_holds_up_nothing() {
        let (ran, outcome) = run(Ok(Next::AwaitChange), Err(label_forbidden()));
        assert_eq!(ran, ["expiry", "announce", "label"]);
        assert_eq!(outcome.metric_label(), "leader_label");
        // Not an error for the runtime: the expiry part succeeded; the label is retried soon.
        assert_eq!(
            outcome.into_result().expect("not an error"),
            Action::requeue(LABEL_RETRY)
        );
        // The label is still tried when the expiry part failed, and that error is what counts.
        let (ran, outcome) = run(Err(Error::NoNamespace), Err(label_forbidden()));
        assert_eq!(ran, ["expiry", "announce", "label"]);
        assert_eq!(outcome.metric_label(), "no_namespace");
        assert!(matches!(outcome.into_result(), Err(Error::NoNamespace)));
    }

    #[test]
    fn a_failed_label_only_brings_the_next_look_forward() {
        let ms = Duration::from_millis;
        // (expiry's next look, label ok) -> what the runtime gets
        let table = [
            (Next::AwaitChange, true, Action::await_change()),
            (Next::AwaitChange, false, Action::requeue(LABEL_RETRY)),
            (Next::Requeue(ms(200)), false, Action::requeue(ms(200))),
            (
                Next::Requeue(ms(60_000)),
                false,
                Action::requeue(LABEL_RETRY),
            ),
            (Next::Requeue(ms(60_000)), true, Action::requeue(ms(60_000))),
        ];
        for (next, label_ok, want) in table {
            let label = if label_ok {
                Ok(())
            } else {
                Err(label_forbidden())
            };
            let (_, outcome) = run(Ok(next), label);
            let want_label = if label_ok { "ok" } else { "leader_label" };
            assert_eq!(outcome.metric_label(), want_label, "{next:?}");
            assert_eq!(outcome.into_result().expect("ok"), want, "{next:?}");
        }
    }

    #[test]
    fn a_label_error_says_what_to_do_in_a_sentence() {
        let text = label_forbidden().to_string();
        assert_eq!(
            text,
            "moving the fencedlease.io/role label of pod pod-a: pods \"pod-a\" is forbidden: \
             cannot patch resource \"pods\" (403) (the controller needs patch on pods in that \
             namespace)"
        );
    }

    #[test]
    fn event_notes_fit_what_the_api_server_accepts() {
        assert_eq!(bounded_note("short".into()), "short");
        let exact = "x".repeat(MAX_EVENT_NOTE);
        assert_eq!(bounded_note(exact.clone()), exact);
        for filler in ["y", "é", "名"] {
            let cut = bounded_note(filler.repeat(2000));
            assert!(cut.len() <= MAX_EVENT_NOTE, "{filler}: {}", cut.len());
            assert!(cut.ends_with('…'));
        }
    }

    #[test]
    fn a_revocation_is_recognised_from_the_status_it_wrote() {
        use crate::controller::holder::Finished;
        for cause in [
            Cause::Expired,
            Cause::HolderDead(Death::PodGone),
            Cause::HolderDead(Death::PodFinished(Finished::Failed)),
            Cause::HolderDead(Death::ContainerTerminated),
            Cause::HolderDead(Death::ContainerRestarted),
        ] {
            let mut lease = FencedLease::new("db", crate::api::FencedLeaseSpec::free());
            lease.metadata.generation = Some(7);
            let conditions = holding_conditions(&lease, Some(cause));
            let held = conditions.iter().find(|c| c.type_ == "Held");
            assert!(held.is_some_and(|c| c.status == "False"), "{cause:?}");
            lease.status = Some(crate::api::FencedLeaseStatus {
                conditions,
                ..Default::default()
            });
            // After a restart (no memory), the same conditions again.
            assert_eq!(recorded_revocation(&lease), Some(cause));
            // A later generation (a new holder came and went) is no longer revoked.
            lease.metadata.generation = Some(8);
            assert_eq!(recorded_revocation(&lease), None, "{cause:?}");
        }
    }

    #[test]
    fn holder_changes_have_the_right_event() {
        let table = [
            (
                Some("a"),
                Some("b"),
                false,
                ("Acquired", LeaseEvent::Acquired),
                "b took the lease over from a with token 5",
            ),
            (
                None,
                Some("b"),
                false,
                ("Acquired", LeaseEvent::Acquired),
                "b acquired the lease with token 5",
            ),
            (
                Some("a"),
                Some("b"),
                true,
                ("HandedOver", LeaseEvent::HandedOver),
                "b, the preferred holder, took the lease over with token 5",
            ),
            (
                Some("a"),
                None,
                false,
                ("Released", LeaseEvent::Released),
                "a no longer holds the lease; token now 5",
            ),
        ];
        for (prev, holder, handover, reason, note) in table {
            let (r, n, e) = holder_change(prev, holder, handover, 5);
            assert_eq!(((r, e), n.as_str()), (reason, note));
        }
    }
}
