//! The election protocol: pure rules ([`rules`]) and their Kubernetes I/O, on the clock of
//! [`clock`] (CLOCK_BOOTTIME: time in suspend counts).

pub mod clock;
pub mod elector;
pub mod rules;

use kube::api::PostParams;
use kube::{Api, ResourceExt};

use crate::api::FencedLease;

/// What a revocation write came to.
#[derive(Debug)]
pub enum Revocation {
    /// The holder was cleared: the lease as written, with the next token (generation).
    Revoked(Box<FencedLease>),
    /// The lease changed since it was read (a renewal came in, or it is gone): nothing was
    /// written; read it again and decide again.
    Raced,
}

/// Revokes `lease` as read: clears `spec.holderIdentity` with the read's resourceVersion as
/// precondition, so the write happens only if nothing (a renewal, a new holder) came in since.
/// The spec change moves the token on, which fences off the old holder even if it still runs.
/// Used by the controller (expired or dead holders) and by `kubectl fencedlease release`.
pub async fn revoke(
    api: &Api<FencedLease>,
    lease: &FencedLease,
) -> Result<Revocation, kube::Error> {
    let mut desired = lease.clone();
    desired.clear_holder();
    match api
        .replace(&lease.name_any(), &PostParams::default(), &desired)
        .await
    {
        Ok(revoked) => Ok(Revocation::Revoked(Box::new(revoked))),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(Revocation::Raced),
        Err(e) => Err(e),
    }
}
