use clap::Parser;
use fencedlease::runtime::logging;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", logging::error_line(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The kubectl plugin when this binary runs as `kubectl-fencedlease` (only in the default
/// build: the sidecar's build, without the `operator` feature, has no plugin), else the
/// `fencedlease` command.
async fn run() -> anyhow::Result<std::process::ExitCode> {
    #[cfg(feature = "operator")]
    {
        let argv0 = std::env::args_os().next().unwrap_or_default();
        if fencedlease::plugin::called_as_plugin(&argv0) {
            let cli = fencedlease::plugin::PluginCli::parse();
            logging::init(logging::LogFormat::Text);
            return fencedlease::plugin::run(cli.args).await.map_err(Into::into);
        }
    }
    let cli = fencedlease::cli::Cli::parse();
    logging::init(cli.log_format);
    fencedlease::cli::run(cli).await
}
