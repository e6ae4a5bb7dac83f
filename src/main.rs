use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let result = if fencedlease::plugin::called_as_plugin(&argv0) {
        let cli = fencedlease::plugin::PluginCli::parse();
        fencedlease::plugin::run(cli.args).await.map_err(Into::into)
    } else {
        fencedlease::cli::run(fencedlease::cli::Cli::parse()).await
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
