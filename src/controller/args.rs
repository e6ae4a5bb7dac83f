//! The controller's command-line arguments.

use crate::runtime::args::{AdminArgs, Tailor, Tailored};

/// The controller's admin server listens on 9090 unless told otherwise.
#[derive(Debug, Clone)]
pub struct ControllerAdmin;

impl Tailor for ControllerAdmin {
    fn tailor(cmd: clap::Command) -> clap::Command {
        cmd.mut_arg("metrics_addr", |a| {
            a.default_value("127.0.0.1:9090").required(false)
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub admin: Tailored<AdminArgs, ControllerAdmin>,
    /// Namespace of the FencedLease that elects the active controller replica.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub election_namespace: String,
    /// Name of that FencedLease.
    #[arg(long, default_value = "fencedlease-controller")]
    pub election_lease: String,
    /// A Service in the election namespace that owns the election FencedLease, so that
    /// uninstalling the operator removes the lease with it (the chart passes its webhook
    /// Service). Needs `get` on that Service.
    #[arg(long)]
    pub election_owner_service: Option<String>,
    /// Identity of this replica (default: hostname and process id).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Self-managed webhook certificates: keep this TLS Secret (in the election namespace)
    /// issued and renewed for the webhook Service. Only the active replica writes it.
    #[arg(long, requires = "webhook_service")]
    pub webhook_cert_secret: Option<String>,
    /// The webhook's Service name (its DNS names go into the certificate).
    #[arg(long, requires = "webhook_cert_secret")]
    pub webhook_service: Option<String>,
    /// Webhook configurations (validating or mutating) whose caBundle to keep in step.
    #[arg(long, value_delimiter = ',')]
    pub webhook_configurations: Vec<String>,
    /// At most this many leases are reconciled at once. Bounds memory and the burst of
    /// requests after a restart with many leases; expiries are still noticed on time because a
    /// reconcile makes at most a few requests.
    #[arg(long, env = "FENCEDLEASE_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// Policy mode: the chart's fencing ValidatingAdmissionPolicy, whose one binding (of the
    /// same name, also the chart's) makes the API server itself refuse stale writes to every
    /// lease's protected objects. Needs Kubernetes 1.30 or later: the controller refuses to
    /// start without the API, the policy or its binding. While active it removes the per-lease
    /// bindings of releases up to 0.2.0.
    #[arg(long, value_name = "POLICY")]
    pub fencing_policy: Option<String>,
    /// Policy mode: how often, in seconds, the active controller checks that the chart's binding
    /// is still as the chart renders it (`fencedlease_controller_fencing_binding_intact`).
    #[arg(long, default_value_t = 30, requires = "fencing_policy",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub fencing_policy_check_seconds: u64,
    /// A namespace the fencing leaves out (the chart passes fencing.excludeNamespaces and, by
    /// default, its own): FencedLeases there get the condition Fenced=False and a Warning
    /// Event, since their tokens guard nothing. Repeat for each; none given: no Fenced
    /// condition at all (the controller cannot tell).
    #[arg(long = "unfenced-namespace", value_name = "NAMESPACE")]
    pub unfenced_namespaces: Vec<String>,
}
