//! fencedlease: Kubernetes leader election with fencing tokens that the protected resource
//! enforces.
//!
//! - [`api`]: the `FencedLease` custom resource; its `metadata.generation` is the fencing token.
//! - [`lease`]: the election (rules and elector).
//! - `crdgen`: the CRD YAML generated from those types (with the `operator` feature).
//! - [`cli`]: the `fencedlease` command's subcommands.
//! - `plugin`: `kubectl fencedlease` (status, who, handover, release, check; with `operator`).
//!
//! Without the default `operator` feature the library has only what the workload side needs
//! (the sidecar, `campaign`, the probe, the API proxy and what they share): the sidecar's build.
//!
//! `api` and `lease` live in the `fencedlease-elector` crate (elector/), a library for other
//! kube-rs programs; they are re-exported here under their old paths.

pub use fencedlease_elector::{api, lease};

pub mod admin;
pub mod campaign;
#[cfg(feature = "operator")]
pub mod certs;
pub mod cli;
#[cfg(feature = "operator")]
pub mod controller;
#[cfg(feature = "operator")]
pub mod crdgen;
pub mod fencing;
#[cfg(feature = "operator")]
pub mod holder;
pub mod identity;
pub mod logging;
pub mod memtrim;
#[cfg(feature = "operator")]
pub mod owners;
#[cfg(feature = "operator")]
pub mod plugin;
#[cfg(feature = "operator")]
pub mod pods;
#[cfg(feature = "operator")]
pub mod policy;
pub mod probe;
pub mod proxy;
pub mod proxy_tls;
pub mod runtime;
pub mod secret;
pub mod sidecar;
#[cfg(feature = "operator")]
pub mod webhook;
