//! The flag groups several roles share, each defined once and flattened into the roles'
//! arguments: [`ElectionArgs`] (campaign, sidecar) and [`AdminArgs`] (controller, webhook).
//! What differs by role, the environment variables a flag reads, a default, a help text, a
//! role says in a [`Tailor`], and flattens the group as [`Tailored`]`<Group, ItsTailor>`:
//! the flags keep their names and meaning everywhere.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::ops::Deref;

use clap::{ArgMatches, Args, Command, FromArgMatches};

use crate::api::DEFAULT_LEASE_DURATION_SECONDS;
use crate::runtime::lease_duration_parser;

/// The flags of a candidate for a lease.
#[derive(Debug, Clone, clap::Args)]
pub struct ElectionArgs {
    /// Name of the FencedLease to campaign for.
    #[arg(long)]
    pub lease: String,
    /// Namespace of the FencedLease.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Identity of this candidate.
    #[arg(long)]
    pub identity: Option<String>,
    /// leaseDurationSeconds to use when the FencedLease does not exist yet and is created.
    #[arg(long, default_value_t = DEFAULT_LEASE_DURATION_SECONDS,
          value_parser = lease_duration_parser())]
    pub lease_duration: i32,
}

impl ElectionArgs {
    /// `--identity`, or the default one (`HOSTNAME-PID`).
    pub(crate) fn identity_or_default(&self) -> String {
        self.identity
            .clone()
            .unwrap_or_else(crate::runtime::identity::default_identity)
    }
}

/// The flags of the plain-HTTP admin server (`/metrics`, `/livez`, `/readyz`).
#[derive(Debug, Clone, clap::Args)]
pub struct AdminArgs {
    /// Address of the plain-HTTP /metrics, /livez and /readyz server.
    #[arg(long, env = "FENCEDLEASE_METRICS_ADDR")]
    pub metrics_addr: SocketAddr,
}

/// What one role changes of a shared group's flags.
pub trait Tailor {
    fn tailor(cmd: Command) -> Command;
}

/// A shared group `A` with a role's changes `T`; reads as `A`.
#[derive(Debug, Clone)]
pub struct Tailored<A, T> {
    args: A,
    role: PhantomData<T>,
}

impl<A, T> Deref for Tailored<A, T> {
    type Target = A;

    fn deref(&self) -> &A {
        &self.args
    }
}

impl<A: FromArgMatches, T> FromArgMatches for Tailored<A, T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Tailored {
            args: A::from_arg_matches(matches)?,
            role: PhantomData,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.args.update_from_arg_matches(matches)
    }
}

impl<A: Args, T: Tailor> Args for Tailored<A, T> {
    fn augment_args(cmd: Command) -> Command {
        T::tailor(A::augment_args(cmd))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        T::tailor(A::augment_args_for_update(cmd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone)]
    struct Pod;
    impl Tailor for Pod {
        fn tailor(cmd: Command) -> Command {
            cmd.mut_arg("namespace", |a| a.env("FL_TEST_POD_NAMESPACE"))
                .mut_arg("identity", |a| a.help("The pod's name."))
        }
    }

    #[derive(Debug, Clone)]
    struct Port9;
    impl Tailor for Port9 {
        fn tailor(cmd: Command) -> Command {
            cmd.mut_arg("metrics_addr", |a| {
                a.default_value("127.0.0.1:9").required(false)
            })
        }
    }

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        election: Tailored<ElectionArgs, Pod>,
        #[command(flatten)]
        admin: Tailored<AdminArgs, Port9>,
    }

    #[test]
    fn a_tailored_group_parses_as_the_group_with_the_roles_changes() {
        use clap::{CommandFactory, Parser};
        let cli = Cli::try_parse_from(["x", "--lease", "db", "--identity", "db-0"]).expect("parse");
        assert_eq!(
            (
                cli.election.lease.as_str(),
                cli.election.identity.as_deref(),
                cli.election.lease_duration
            ),
            ("db", Some("db-0"), DEFAULT_LEASE_DURATION_SECONDS)
        );
        let cmd = Cli::command();
        let arg = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .cloned()
                .expect("the flag")
        };
        assert_eq!(
            arg("namespace").get_env(),
            Some(std::ffi::OsStr::new("FL_TEST_POD_NAMESPACE"))
        );
        assert_eq!(
            arg("identity").get_help().map(ToString::to_string),
            Some("The pod's name.".to_string())
        );
        assert!(Cli::try_parse_from(["x", "--lease", "db", "--lease-duration", "0"]).is_err());
        // A default given by the role makes the flag optional.
        assert_eq!(
            cli.admin.metrics_addr,
            SocketAddr::from(([127, 0, 0, 1], 9))
        );
    }
}
