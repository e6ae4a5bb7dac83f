//! Command-line interface: one binary, one subcommand per role.

#[cfg(feature = "operator")]
use std::io::Write;

#[cfg(feature = "operator")]
use anyhow::Context;
use clap::{Parser, Subcommand};

/// Leader election for Kubernetes workloads with fencing tokens the protected resource enforces.
#[derive(Debug, Parser)]
#[command(name = "fencedlease", version, about)]
pub struct Cli {
    /// Log lines as text or as one JSON object each (for log collectors).
    #[arg(long, global = true, env = crate::runtime::logging::FORMAT_ENV, value_enum, default_value_t)]
    pub log_format: crate::runtime::logging::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    #[cfg(feature = "operator")]
    /// Print the FencedLease CustomResourceDefinition as YAML: by default the one with CEL
    /// validation rules, for Kubernetes 1.25 and later (what `crds/` holds).
    Crd {
        /// The CRD without validation rules, for servers before 1.25 (what `crds/pre-1.25/`
        /// holds).
        #[arg(long, conflicts_with = "for_server")]
        without_validation_rules: bool,
        /// Ask the API server in the kubeconfig for its version and print the CRD it takes.
        #[arg(long)]
        for_server: bool,
    },
    /// Run a command only while this process holds a FencedLease, with the fencing token in
    /// FENCEDLEASE_TOKEN; stop it as soon as leadership is lost; release when it exits.
    Campaign(crate::campaign::CampaignArgs),
    #[cfg(feature = "operator")]
    /// Run the controller: keeps FencedLease status true, revokes expired leases, emits
    /// Events. Several replicas may run; one is active.
    Controller(crate::controller::ControllerArgs),
    #[cfg(feature = "operator")]
    /// Run the fencing admission webhook: the API server refuses writes to protected objects
    /// that carry a stale, missing or forged token.
    Webhook(crate::webhook::WebhookArgs),
    /// Run beside an app: campaign for a lease and hand the app the token over a loopback
    /// HTTP API and a file.
    Sidecar(crate::sidecar::SidecarArgs),
    /// Internal: what `campaign` runs its command under (see src/campaign/keeper.rs).
    #[command(hide = true)]
    Keep(crate::campaign::keeper::KeepArgs),
    /// Exit 0 if an http:// URL answers 2xx within two seconds (for exec probes).
    Probe {
        /// The URL to GET, for example http://127.0.0.1:8787/readyz.
        url: String,
    },
    #[cfg(feature = "operator")]
    /// Generate a local CA and webhook serving certificate; print the caBundle (base64).
    Certs(crate::webhook::CertsArgs),
    #[cfg(feature = "operator")]
    /// The kubectl plugin's commands (status, who, handover, release, check), as `kubectl
    /// fencedlease` runs them when this binary is on PATH as `kubectl-fencedlease`.
    Kubectl(crate::plugin::PluginArgs),
}

/// Runs the chosen subcommand.
pub async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    match cli.command {
        #[cfg(feature = "operator")]
        Command::Crd {
            without_validation_rules,
            for_server,
        } => {
            let with_rules = if for_server {
                let client = crate::runtime::client().await?;
                let v = client
                    .apiserver_version()
                    .await
                    .context("asking the API server for its version")?;
                crate::crdgen::version_takes_rules(&v.major, &v.minor)
            } else {
                !without_validation_rules
            };
            let yaml = if with_rules {
                crate::crdgen::crd_yaml()?
            } else {
                crate::crdgen::crd_yaml_without_rules()?
            };
            std::io::stdout().lock().write_all(yaml.as_bytes())?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Campaign(args) => crate::campaign::run(args).await,
        Command::Keep(args) => crate::campaign::keeper::run(args),
        #[cfg(feature = "operator")]
        Command::Controller(args) => crate::controller::run(args).await,
        #[cfg(feature = "operator")]
        Command::Webhook(args) => crate::webhook::run(args).await,
        #[cfg(feature = "operator")]
        Command::Certs(args) => crate::webhook::certs(args),
        Command::Sidecar(args) => crate::sidecar::run(args).await,
        #[cfg(feature = "operator")]
        Command::Kubectl(args) => Ok(crate::plugin::run(args).await?),
        Command::Probe { url } => {
            let url = crate::probe::parse_http_url(&url)?;
            let ok = crate::probe::check_health(&url, std::time::Duration::from_secs(2)).await;
            Ok(if ok {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            })
        }
    }
}
