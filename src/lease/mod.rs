//! The election protocol: pure rules ([`rules`]) and their Kubernetes I/O.

pub mod elector;
pub mod rules;
