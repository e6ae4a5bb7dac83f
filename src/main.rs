use clap::Parser;
use fencedlease::logging;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let result = if fencedlease::plugin::called_as_plugin(&argv0) {
        let cli = fencedlease::plugin::PluginCli::parse();
        logging::init(logging::LogFormat::Text);
        fencedlease::plugin::run(cli.args).await.map_err(Into::into)
    } else {
        let cli = fencedlease::cli::Cli::parse();
        logging::init(cli.log_format);
        fencedlease::cli::run(cli).await
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", logging::error_line(&err));
            std::process::ExitCode::FAILURE
        }
    }
}
