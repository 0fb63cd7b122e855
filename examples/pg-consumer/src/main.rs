//! The `fleetmq-pg-consumer` binary: options, logging, signals; the work is
//! in [`fleetmq_pg_consumer::run`].

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use fleetmq_pg_consumer::{run, Options};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

fn main() -> ExitCode {
    let options = Options::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal, not in a log file or journal.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(why) => {
            eprintln!("fleetmq-pg-consumer: cannot start the runtime: {why}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            eprintln!("fleetmq-pg-consumer: cannot install the SIGTERM/SIGINT handlers");
            return ExitCode::FAILURE;
        };
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("stop requested: finishing the batch in hand");
            let _ = stop_tx.send(true);
        });
        match run(&options, stop_rx).await {
            Ok(_) => ExitCode::SUCCESS,
            Err(why) => {
                eprintln!("fleetmq-pg-consumer: {why}");
                ExitCode::FAILURE
            }
        }
    })
}
