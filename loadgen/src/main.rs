//! `fleetmq-loadgen`: the command line over the [`fleetmq_loadgen`] library.
//!
//! Exit status: 0 on success; 1 when the broker could not be used or a
//! check failed (loss at QoS 1/2, a regression in `compare`); 2 for bad
//! options and for what is not implemented yet.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fleetmq_loadgen::compare::{compare, parse_fraction, Figures, Thresholds};
use fleetmq_loadgen::options::RunArgs;
use fleetmq_loadgen::scenario::{run, RunError};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// fleetmq-loadgen: MQTT load generator, result compare.
#[derive(Debug, Parser)]
#[command(name = "fleetmq-loadgen", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one scenario and print (and optionally write as JSON) its result.
    Run(Box<RunArgs>),
    /// Compare two `--json` results; exit 1 when the candidate regresses.
    Compare {
        /// The baseline result.
        baseline: PathBuf,
        /// The candidate result.
        candidate: PathBuf,
        /// Largest allowed p99 increase, e.g. 10% or 0.1.
        #[arg(long, value_parser = parse_fraction, default_value = "10%")]
        max_p99_regression: f64,
        /// Smallest allowed candidate/baseline throughput ratio.
        #[arg(long, value_parser = parse_fraction, default_value = "0.95")]
        min_throughput_ratio: f64,
    },
    /// Long run checking every message (not implemented yet).
    Soak,
    /// TCP fault-injection proxy (not implemented yet).
    Proxy,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(args) => run_command(*args),
        Command::Compare {
            baseline,
            candidate,
            max_p99_regression,
            min_throughput_ratio,
        } => {
            let t = Thresholds {
                max_p99_regression,
                min_throughput_ratio,
            };
            compare_command(&baseline, &candidate, &t)
        }
        Command::Soak => not_implemented("`soak`"),
        Command::Proxy => not_implemented("`proxy`"),
    }
}

fn not_implemented(what: &str) -> ExitCode {
    eprintln!("fleetmq-loadgen: {what} is not implemented yet");
    ExitCode::from(2)
}

fn run_command(args: RunArgs) -> ExitCode {
    let json = args.json.clone();
    let report = match run(args) {
        Ok(r) => r,
        Err(e @ (RunError::Usage(_) | RunError::NotImplemented(_))) => {
            eprintln!("fleetmq-loadgen: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("fleetmq-loadgen: error: {e}");
            return ExitCode::from(1);
        }
    };
    print!("{}", report.summary());
    if let Some(path) = json {
        if let Err(e) = report.write_json(&path) {
            eprintln!("fleetmq-loadgen: error: {e:#}");
            return ExitCode::from(1);
        }
    }
    if report.passed {
        ExitCode::SUCCESS
    } else {
        eprintln!("fleetmq-loadgen: check failed: {}", report.check);
        ExitCode::from(1)
    }
}

fn compare_command(baseline: &PathBuf, candidate: &PathBuf, t: &Thresholds) -> ExitCode {
    let read = |p: &PathBuf| -> Result<Figures, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", p.display()))?;
        Figures::from_json(&v).map_err(|e| format!("{}: {e}", p.display()))
    };
    let (b, c) = match (read(baseline), read(candidate)) {
        (Ok(b), Ok(c)) => (b, c),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("fleetmq-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let verdict = compare(&b, &c, t);
    print!("{}", verdict.table);
    if verdict.regressions.is_empty() {
        println!("no regression");
        ExitCode::SUCCESS
    } else {
        for r in &verdict.regressions {
            println!("REGRESSION: {r}");
        }
        ExitCode::from(1)
    }
}
