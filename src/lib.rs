//! fencedlease: Kubernetes leader election with fencing tokens that the protected resource
//! enforces.
//!
//! - [`api`]: the `FencedLease` custom resource; its `metadata.generation` is the fencing token.
//! - [`lease`]: the election (rules and elector).
//! - [`crdgen`]: the CRD YAML generated from those types.
//! - [`cli`]: the `fencedlease` command's subcommands.
//! - [`plugin`]: `kubectl fencedlease` (status, who, handover, release, check).
//!
//! `api` and `lease` live in the `fencedlease-elector` crate (elector/), a library for other
//! kube-rs programs; they are re-exported here under their old paths.

pub use fencedlease_elector::{api, lease};

pub mod admin;
pub mod campaign;
pub mod certs;
pub mod cli;
pub mod controller;
pub mod crdgen;
pub mod fencing;
pub mod holder;
pub mod identity;
pub mod logging;
pub mod owners;
pub mod plugin;
pub mod pods;
pub mod policy;
pub mod probe;
pub mod proxy;
pub mod runtime;
pub mod sidecar;
pub mod webhook;
