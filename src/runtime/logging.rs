//! Log output of every role: human-readable text (the default) or one JSON object per line for
//! log collectors, chosen with `--log-format` or `FENCEDLEASE_LOG_FORMAT`. The level filter is
//! `RUST_LOG` (tracing's EnvFilter syntax), `info` when unset.
//!
//! In JSON, an event's fields sit at the top level beside `timestamp`, `level`, `target` and
//! `message`, so the structured fields the roles log (`lease`, `ns`, `token`, `holder`, ...)
//! can be queried as they are.
//!
//! [`error_line`] is how every role prints an error that ends it: the causes on one line, each
//! said once.

use tracing_subscriber::EnvFilter;

/// The environment variable that chooses the format when `--log-format` is not given.
pub(crate) const FORMAT_ENV: &str = "FENCEDLEASE_LOG_FORMAT";

/// How log lines are written (to standard error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    #[default]
    Text,
    /// One JSON object per event, its fields at the top level.
    Json,
}

impl LogFormat {
    /// The value as `--log-format` takes it.
    #[cfg(feature = "operator")]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Installs the global subscriber. Call once, before anything logs.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

/// An error and its causes on one line, as `{:#}` prints them, less each cause whose text the
/// line already holds: kube's errors print their source in their own message, so `{:#}` said
/// the same cause up to four times ("failed to infer config: ..." after "Failed to infer
/// configuration: failed to infer config: ...").
pub fn error_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::error_line;

    /// An error that prints its source in its own message, as kube's do.
    #[derive(Debug)]
    struct Wraps(&'static str, Option<Box<Wraps>>);

    impl std::fmt::Display for Wraps {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match &self.1 {
                Some(inner) => write!(f, "{}: {inner}", self.0),
                None => f.write_str(self.0),
            }
        }
    }

    impl std::error::Error for Wraps {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn a_cause_already_in_the_line_is_said_once() {
        let root = Wraps("no such file", None);
        let mid = Wraps("failed to read kubeconfig", Some(Box::new(root)));
        let top = Wraps("failed to infer config", Some(Box::new(mid)));
        let err = anyhow::Error::new(top).context("connecting to Kubernetes");
        assert_eq!(
            format!("{err:#}").matches("no such file").count(),
            3,
            "the repetition this guards against"
        );
        assert_eq!(
            error_line(&err),
            "connecting to Kubernetes: failed to infer config: failed to read kubeconfig: no such file"
        );
    }

    #[test]
    fn causes_that_do_not_repeat_are_kept_as_alternate_display_prints_them() {
        let err = anyhow::anyhow!("disk full")
            .context("writing the token file")
            .context("handing the app its token");
        assert_eq!(error_line(&err), format!("{err:#}"));
    }
}
