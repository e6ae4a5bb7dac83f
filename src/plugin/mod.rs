//! `kubectl fencedlease`: the operator's view of leases, and handover, release and an install
//! check. The binary answers as this plugin when it is called `kubectl-fencedlease` (a symlink
//! or copy on PATH), and as `fencedlease kubectl ...` otherwise.
//!
//! Decisions are pure ([`view`], [`check`]); this module does the I/O around them.

mod check;
mod delete;
mod view;

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::api::FencedLease;
use crate::lease::Revocation;

/// The name the binary answers to as a kubectl plugin.
pub const PLUGIN_BINARY: &str = "kubectl-fencedlease";

/// `kubectl fencedlease`, when the binary is called `kubectl-fencedlease`.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl fencedlease",
    version,
    about = "See and steer FencedLeases: who leads, hand over, release, check the install."
)]
pub struct PluginCli {
    #[command(flatten)]
    pub args: PluginArgs,
}

#[derive(Debug, Args)]
pub struct PluginArgs {
    /// The kubeconfig context to use (default: the current one).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// The namespace (default: the context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    #[command(subcommand)]
    pub command: PluginCommand,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Every lease: holder, token, time since renewal, duration, conditions, candidates' pods.
    Status {
        /// Leases of every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        #[arg(short = 'o', long, value_enum, default_value_t)]
        output: Output,
    },
    /// Print `HOLDER TOKEN` of a lease; exit 1 when nobody holds it.
    Who { lease: String },
    /// Ask the holder to hand the lease over to a candidate (spec.preferredHolder): it steps
    /// down and the candidate gets the first chance; if it never comes, the others take the
    /// lease one lease duration later.
    Handover {
        lease: String,
        /// The candidate's identity (for injected sidecars: its pod's name).
        #[arg(long)]
        to: Option<String>,
    },
    /// Revoke the lease now: clear the holder, which moves the token on (the old holder's
    /// writes are refused from then on); the candidates compete again.
    Release {
        lease: String,
        /// Do not ask for confirmation (needed when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Check the install: CRD, webhook configurations and their caBundle, Deployments, and that
    /// the fence answers: a dry-run write of a protected ConfigMap without a token in the
    /// namespace (-n) must be refused. And in that namespace, that each ServiceAccount of pods
    /// (or Deployment, StatefulSet, DaemonSet templates) annotated fencedlease.io/lease may do
    /// what the sidecar does to its lease (asked with SubjectAccessReviews).
    Check,
    /// Delete a protected object as its lease's holder (deletes are fenced: only the holder's
    /// announced delete lands): take the lease under an identity of this command's own,
    /// announce the delete under its token, delete, and give the lease back.
    Delete {
        /// RESOURCE/NAME, as kubectl takes it: `configmap/inventory`, `deployments.apps/web`.
        target: String,
        /// Ask the current holder to hand the lease over (spec.preferredHolder) instead of
        /// waiting until it is free.
        #[arg(long)]
        handover: bool,
        /// How long to wait to hold the lease.
        #[arg(long, default_value_t = 60)]
        timeout_seconds: u64,
    },
}

/// What went wrong, with what to do.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("reading the kubeconfig: {0} (set KUBECONFIG or use --context)")]
    Config(String),
    #[error("{action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("FencedLease {0} not found (list them: kubectl fencedlease status -A)")]
    NotFound(String),
    #[error(transparent)]
    NoHolder(#[from] view::NoHolder),
    #[error("handover needs --to CANDIDATE: fencedlease hands over to a named candidate only (to let anyone take the lease, release it)")]
    HandoverNeedsTarget,
    #[error("refusing to revoke without confirmation: stdin is not a terminal; pass --yes")]
    NeedsConfirmation,
    #[error("the lease kept changing while revoking it; try again")]
    KeptRacing,
    #[error(
        "{0:?} is not RESOURCE/NAME (for example configmap/inventory or deployments.apps/web)"
    )]
    Target(String),
    #[error("no namespaced resource {0:?} in this cluster (see kubectl api-resources)")]
    UnknownResource(String),
    #[error("{0} is not protected (no fencedlease.io/lease label): delete it with kubectl delete")]
    NotProtected(String),
    #[error("did not get to hold FencedLease {0} in time: pass --handover to ask the holder to hand it over, revoke it (kubectl fencedlease release), or wait longer (--timeout-seconds)")]
    NeverLed(String),
    #[error("campaigning for the lease: {0}")]
    Elector(String),
    #[error(transparent)]
    Check(#[from] check::CheckError),
    #[error("writing the output: {0}")]
    Io(#[from] std::io::Error),
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
}

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> PluginError {
    let action = action.into();
    move |source| PluginError::Kube { action, source }
}

/// Whether the program was called by the plugin's name (`argv[0]`'s file name).
pub fn called_as_plugin(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_stem()
        .is_some_and(|s| s == PLUGIN_BINARY)
}

async fn connect(args: &PluginArgs) -> Result<(Client, String), PluginError> {
    let config = match &args.context {
        None => Config::infer()
            .await
            .map_err(|e| PluginError::Config(e.to_string()))?,
        Some(ctx) => {
            let kc = Kubeconfig::read().map_err(|e| PluginError::Config(e.to_string()))?;
            let opts = KubeConfigOptions {
                context: Some(ctx.clone()),
                ..Default::default()
            };
            Config::from_custom_kubeconfig(kc, &opts)
                .await
                .map_err(|e| PluginError::Config(e.to_string()))?
        }
    };
    let ns = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(kube_err("building a Kubernetes client"))?;
    Ok((client, ns))
}

/// Runs a plugin subcommand.
pub async fn run(args: PluginArgs) -> Result<ExitCode, PluginError> {
    let (client, ns) = connect(&args).await?;
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns);
    match args.command {
        PluginCommand::Status {
            all_namespaces,
            output,
        } => status(&client, &ns, all_namespaces, output).await,
        PluginCommand::Who { lease } => {
            let l = get(&leases, &ns, &lease).await?;
            println!("{}", view::who(&l)?);
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::Handover { lease, to } => {
            let to = to.ok_or(PluginError::HandoverNeedsTarget)?;
            handover(&client, &leases, &ns, &lease, &to).await
        }
        PluginCommand::Release { lease, yes } => release(&leases, &ns, &lease, yes).await,
        PluginCommand::Delete {
            target,
            handover,
            timeout_seconds,
        } => {
            let patience = std::time::Duration::from_secs(timeout_seconds);
            delete::delete(&client, &ns, &target, handover, patience).await
        }
        PluginCommand::Check => {
            let findings = check::gather(&client, &ns).await?;
            print!("{}", check::render(&findings));
            Ok(if findings.iter().all(|f| f.ok) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

async fn get(api: &Api<FencedLease>, ns: &str, name: &str) -> Result<FencedLease, PluginError> {
    api.get_opt(name)
        .await
        .map_err(kube_err(format!("reading FencedLease {ns}/{name}")))?
        .ok_or_else(|| PluginError::NotFound(format!("{ns}/{name}")))
}

async fn status(
    client: &Client,
    ns: &str,
    all: bool,
    output: Output,
) -> Result<ExitCode, PluginError> {
    let (leases, pods): (Api<FencedLease>, Api<Pod>) = if all {
        (Api::all(client.clone()), Api::all(client.clone()))
    } else {
        (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        )
    };
    let lp = ListParams::default();
    let leases = leases
        .list(&lp)
        .await
        .map_err(kube_err("listing FencedLeases"))?
        .items;
    let pods = pods
        .list(&lp)
        .await
        .map_err(kube_err("listing pods"))?
        .items;
    let rows = view::lease_rows(&leases, &pods, jiff::Timestamp::now());
    let mut out = std::io::stdout().lock();
    match output {
        Output::Json => {
            serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "items": rows }))?;
            writeln!(out)?;
        }
        Output::Table if rows.is_empty() => {
            let scope = if all {
                "any namespace".to_string()
            } else {
                format!("namespace {ns}")
            };
            eprintln!("No FencedLeases in {scope}.");
        }
        Output::Table => out.write_all(view::table(&rows, all).as_bytes())?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn handover(
    client: &Client,
    leases: &Api<FencedLease>,
    ns: &str,
    name: &str,
    to: &str,
) -> Result<ExitCode, PluginError> {
    let lease = get(leases, ns, name).await?;
    if lease.holder() == Some(to) {
        println!("{to} already holds {ns}/{name}");
        return Ok(ExitCode::SUCCESS);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = pods
        .list(&ListParams::default())
        .await
        .map_err(kube_err("listing pods"))?
        .items;
    if !view::candidates(&lease, &pods).iter().any(|c| c.name == to) {
        eprintln!("note: no pod in {ns} is annotated for lease {name} with the name {to}; if no candidate of that identity campaigns, the others take the lease one lease duration after the holder steps down");
    }
    // The preferred holder is part of the spec, so this write also moves the token on.
    let patch = serde_json::json!({"spec": {"preferredHolder": to}});
    leases
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_err(format!(
            "setting spec.preferredHolder of {ns}/{name}"
        )))?;
    match lease.holder() {
        Some(h) => println!(
            "asked {h} to hand {ns}/{name} over to {to}: it steps down at its next renewal"
        ),
        None => println!("{ns}/{name} is free: {to} gets the first chance to take it"),
    }
    Ok(ExitCode::SUCCESS)
}

fn confirm(question: &str) -> Result<bool, PluginError> {
    if !std::io::stdin().is_terminal() {
        return Err(PluginError::NeedsConfirmation);
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// How many times `release` re-reads and retries when a renewal lands between its read and
/// its write (holders renew every few seconds).
const RELEASE_ATTEMPTS: usize = 5;

async fn release(
    leases: &Api<FencedLease>,
    ns: &str,
    name: &str,
    yes: bool,
) -> Result<ExitCode, PluginError> {
    let lease = get(leases, ns, name).await?;
    let Some(holder) = lease.holder().map(str::to_string) else {
        println!("nobody holds {ns}/{name}: nothing to release");
        return Ok(ExitCode::SUCCESS);
    };
    let question =
        format!("Revoke {ns}/{name} from {holder}? Its token stops being accepted at once.");
    if !yes && !confirm(&question)? {
        eprintln!("not revoked");
        return Ok(ExitCode::FAILURE);
    }
    let incarnation = lease.holder_incarnation().map(str::to_string);
    let mut current = lease;
    for _ in 0..RELEASE_ATTEMPTS {
        let action = format!("revoking {ns}/{name}");
        match crate::lease::revoke(leases, &current)
            .await
            .map_err(kube_err(action))?
        {
            Revocation::Revoked(r) => {
                let token = r.token().unwrap_or_default();
                println!("revoked {ns}/{name} from {holder}: token now {token}");
                return Ok(ExitCode::SUCCESS);
            }
            Revocation::Raced => current = get(leases, ns, name).await?,
        }
        // Revoke only the tenure that was confirmed: the same holder, and the same process of
        // it (a StatefulSet pod re-created under its name is another tenure).
        if current.holder() != Some(holder.as_str())
            || current.holder_incarnation() != incarnation.as_deref()
        {
            let now = current.holder().unwrap_or("nobody");
            println!("{ns}/{name} changed hands meanwhile ({now} holds it now): not revoked");
            return Ok(ExitCode::FAILURE);
        }
    }
    Err(PluginError::KeptRacing)
}
