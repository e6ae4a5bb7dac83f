//! fencedlease: Kubernetes leader election with fencing tokens that the protected resource
//! enforces.
//!
//! One folder per role, each built on the layers below it and on nothing beside it except
//! through a module it names:
//!
//! - [`api`], [`lease`], [`stamp`]: the `FencedLease` resource, the election and the token a
//!   write carries (the `fencedlease-elector` crate in elector/, re-exported here).
//! - [`runtime`]: what every role runs on (client, shutdown, admin server, logging, TLS).
//! - the roles: `controller`, `webhook` (with `fence`, its pure rule), `sidecar`, `campaign`,
//!   `plugin` (`kubectl fencedlease`), the probe, `crdgen`.
//! - [`cli`]: the `fencedlease` command, which only wires the roles.
//!
//! The library exports what the binary, the tests and the benchmarks use; everything else is
//! `pub(crate)` at most (`unreachable_pub` makes that a build error under clippy's
//! `-D warnings`). Without the default `operator` feature the library has only the workload
//! side (sidecar, `campaign`, the probe): the sidecar's build.
#![warn(unreachable_pub)]

pub use fencedlease_elector::{api, lease, stamp};

pub mod runtime;

mod campaign;
#[cfg(feature = "operator")]
pub mod controller;
#[cfg(feature = "operator")]
pub mod crdgen;
#[cfg(feature = "operator")]
pub mod plugin;
mod probe;
pub mod sidecar;
#[cfg(feature = "operator")]
pub mod webhook;

pub mod cli;
