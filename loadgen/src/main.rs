//! `fleetmq-loadgen`: the command line over the [`fleetmq_loadgen`] library.
//!
//! Exit status: 0 on success; 1 when the broker could not be used or a
//! check failed (loss at QoS 1/2, a regression in `compare`); 2 for bad
//! options (a `--json` path that cannot be written included), for what is
//! not implemented yet, and for input `compare` cannot compare.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fleetmq_loadgen::compare::{
    compare_files, parse_p99_regression, parse_throughput_ratio, Thresholds,
};
use fleetmq_loadgen::options::{RunArgs, SoakArgs};
use fleetmq_loadgen::report::{JsonFile, Report};
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
    /// Compare two `--json` results of the same workload; exit 1 when the
    /// candidate regresses, 2 when they cannot be compared.
    Compare {
        /// The baseline result.
        baseline: PathBuf,
        /// The candidate result.
        candidate: PathBuf,
        /// Largest allowed p99 increase: at least 0 %, as a percentage
        /// (10%) or a fraction from 0 to 1 (0.1).
        // A value may start with '-', so that `-5%` reaches the parser and
        // gets its range in the error rather than clap's "unexpected argument".
        #[arg(long, allow_hyphen_values = true, value_parser = parse_p99_regression, default_value = "10%")]
        max_p99_regression: f64,
        /// Smallest allowed candidate/baseline throughput ratio: above 0 and
        /// at most 1 (0.95 or 95%).
        #[arg(long, allow_hyphen_values = true, value_parser = parse_throughput_ratio, default_value = "0.95")]
        min_throughput_ratio: f64,
    },
    /// Long run checking every message (QoS 1/2: no loss, per-publisher
    /// order, duplicates counted), one report line per --report-every.
    Soak(Box<SoakArgs>),
    /// TCP fault-injection proxy: --delay, --bandwidth, --hold-upstream
    /// (SIGUSR2 toggles), --cut-after, SIGUSR1 cuts every connection.
    Proxy(Box<fleetmq_loadgen::proxy::ProxyArgs>),
    /// Store --store retained messages (QoS 1), and/or subscribe to a
    /// filter and time the SUBACK and the last retained message.
    Retained(Box<fleetmq_loadgen::retained::RetainedArgs>),
    /// Subscribe to fresh filters one at a time on --sub-url, publish on
    /// each at once on --pub-url: SUBACK times and first values missed.
    Suback(Box<fleetmq_loadgen::suback::SubackArgs>),
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
        Command::Soak(args) => soak_command(&args),
        Command::Retained(args) => retained_command(&args),
        Command::Suback(args) => suback_command(&args),
        Command::Proxy(args) => match fleetmq_loadgen::proxy::run(*args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("fleetmq-loadgen: proxy: {e}");
                ExitCode::from(1)
            }
        },
    }
}

fn retained_command(args: &fleetmq_loadgen::retained::RetainedArgs) -> ExitCode {
    let report = match fleetmq_loadgen::retained::run(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fleetmq-loadgen: retained: {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(code) = print_report(&report, args.json.as_deref()) {
        return code;
    }
    let complete = report.distinct == report.expected && report.mismatched == 0;
    if complete { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

fn suback_command(args: &fleetmq_loadgen::suback::SubackArgs) -> ExitCode {
    let report = match fleetmq_loadgen::suback::run(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fleetmq-loadgen: suback: {e}");
            return ExitCode::from(1);
        }
    };
    // A missed value is a finding, not a failure of the tool.
    match print_report(&report, args.json.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Print `report` as one JSON line, and write it to `json` when given
/// (exit status 2 when that fails).
fn print_report(report: &impl serde::Serialize, json: Option<&Path>) -> Result<(), ExitCode> {
    let text = serde_json::to_string(report).expect("a report serializes");
    println!("{text}");
    if let Some(path) = json {
        if let Err(e) = std::fs::write(path, format!("{text}\n")) {
            eprintln!("fleetmq-loadgen: --json: {e}");
            return Err(ExitCode::from(2));
        }
    }
    Ok(())
}

fn soak_command(args: &SoakArgs) -> ExitCode {
    let cfg = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fleetmq-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let json = match open_json(args.json.as_deref()) {
        Ok(j) => j,
        Err(code) => return code,
    };
    match fleetmq_loadgen::verify::run(cfg) {
        Ok(report) => finish(report, json),
        Err(e) => {
            if let Some(json) = json {
                json.discard();
            }
            eprintln!("fleetmq-loadgen: error: setup failed: {e}");
            ExitCode::from(1)
        }
    }
}

fn run_command(args: RunArgs) -> ExitCode {
    // `run` checks them too; first here, so that bad options do not create
    // the --json file.
    if let Err(e) = args.check() {
        eprintln!("fleetmq-loadgen: {e}");
        return ExitCode::from(2);
    }
    let json = match open_json(args.json.as_deref()) {
        Ok(j) => j,
        Err(code) => return code,
    };
    let report = match run(args) {
        Ok(r) => r,
        Err(e) => {
            if let Some(json) = json {
                json.discard();
            }
            return match e {
                RunError::Usage(_) | RunError::NotImplemented(_) => {
                    eprintln!("fleetmq-loadgen: {e}");
                    ExitCode::from(2)
                }
                e => {
                    eprintln!("fleetmq-loadgen: error: {e}");
                    ExitCode::from(1)
                }
            };
        }
    };
    finish(report, json)
}

/// Opens the `--json` file before the run, so that a path that cannot be
/// written fails at once (exit status 2).
fn open_json(path: Option<&Path>) -> Result<Option<JsonFile>, ExitCode> {
    path.map(JsonFile::create).transpose().map_err(|e| {
        eprintln!("fleetmq-loadgen: --json: {e:#}");
        ExitCode::from(2)
    })
}

fn finish(report: Report, json: Option<JsonFile>) -> ExitCode {
    print!("{}", report.summary());
    if let Some(json) = json {
        if let Err(e) = json.write(&report) {
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

fn compare_command(baseline: &Path, candidate: &Path, t: &Thresholds) -> ExitCode {
    let verdict = match compare_files(baseline, candidate, t) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("fleetmq-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
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
