#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod api;
pub mod client;
pub mod leading;
pub mod lease;
pub mod stamp;

pub use api::{FencedLease, FencedLeaseSpec, FencedLeaseStatus};
pub use lease::elector::{Elector, ElectorConfig, ElectorHandle, Error, LeaderState};
pub use lease::rules::{FencingToken, Timing};
