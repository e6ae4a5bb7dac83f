//! Log output of every role: human-readable text (the default) or one JSON object per line for
//! log collectors, chosen with `--log-format` or `FENCEDLEASE_LOG_FORMAT`. The level filter is
//! `RUST_LOG` (tracing's EnvFilter syntax), `info` when unset.
//!
//! In JSON, an event's fields sit at the top level beside `timestamp`, `level`, `target` and
//! `message`, so the structured fields the roles log (`lease`, `ns`, `token`, `holder`, ...)
//! can be queried as they are.

use tracing_subscriber::EnvFilter;

/// The environment variable that chooses the format when `--log-format` is not given.
pub const FORMAT_ENV: &str = "FENCEDLEASE_LOG_FORMAT";

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
    pub fn as_str(self) -> &'static str {
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
