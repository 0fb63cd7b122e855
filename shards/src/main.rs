//! `fleetmq`: the broker's command line, a thin layer over
//! [`fleetmq_shards::server::run`] (DESIGN.md §15).
//!
//! Exit codes: 0 after a clean stop (or valid settings for `check-config`),
//! 1 when the server fails, 2 when the settings are refused.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fleetmq_shards::config::{self, ServeArgs};
use fleetmq_shards::shutdown::Shutdown;
use signal_hook::consts::{SIGINT, SIGTERM};
use tracing_subscriber::EnvFilter;

#[global_allocator]
static GLOBAL: fleetmq_shards::alloc::Allocator = fleetmq_shards::alloc::Allocator;

/// fleetmq: an MQTT broker for dense device fleets.
///
/// Settings come from (lowest to highest precedence) defaults, the --config
/// file, FLEETMQ_SECTION__KEY environment variables, --set, then --listen,
/// --admin and --shards. Logging follows RUST_LOG (default "info").
#[derive(Debug, Parser)]
#[command(name = "fleetmq", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the broker until SIGTERM or SIGINT.
    Serve(ServeArgs),
    /// Validate the settings and print the effective ones as TOML; exit 2
    /// when they are refused.
    CheckConfig(ServeArgs),
    /// Add or change a user in a password file (prompting for the password
    /// twice, or reading it from standard input), or delete one.
    Passwd(fleetmq_shards::auth::password::PasswdArgs),
    /// Print, one line per client identifier, the shard (0 to SHARDS-1)
    /// that owns it in a broker of this build started with --shards
    /// SHARDS: where its connections are served and its session kept,
    /// unless the session moved to its subscribers' shard (README, "Shards").
    /// With the shard label of the metrics, it says which core serves a
    /// device; benchmarks use it to place their subscribers.
    HomeShard(HomeShardArgs),
    /// Make the mesh CA (DIR/ca.pem, DIR/ca.key) and one certificate and
    /// key per replica (DIR/r1.pem, DIR/r1.key, ...) for the TLS 1.3
    /// links between replicas (DESIGN.md §11); keys are written mode 0600
    /// and existing files are kept unless --force.
    Cert(fleetmq_shards::cert::CertArgs),
}

/// Arguments of `fleetmq home-shard`.
#[derive(Debug, clap::Args)]
struct HomeShardArgs {
    /// The broker's shard count (`server.shards`, as started), 1 to 64; 0
    /// (the broker's default) is one per CPU this command may run on, as a
    /// broker started here with the same `taskset` would have.
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=64))]
    shards: u16,
    /// Client identifiers, 1 to 65,535 bytes each (an empty one gets an
    /// identifier the broker assigns, whose shard is not known before).
    #[arg(required = true)]
    client_ids: Vec<String>,
}

fn main() -> ExitCode {
    // No transparent huge pages: with them khugepaged fills 2 MiB ranges
    // back in around the pages a purge gave back, so an idle broker's RSS
    // grows again by megabytes (measured: +7 MiB with 10,000 parked
    // connections, at a random moment). Huge pages buy a broker little:
    // its hot data is small per connection. mimalloc is built with
    // `no_thp`, so it does not advise MADV_HUGEPAGE: it maps its first
    // arena before `main`, and a 4 MiB huge page taken then stayed after
    // the prctl below (found by a fresh-user pass). The prctl covers
    // systems whose THP mode is `always`. FLEETMQ_THP=1 skips it.
    let keep_huge_pages = match std::env::var("FLEETMQ_THP").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("" | "0" | "false" | "no") => false,
        Ok("1" | "true" | "yes") => true,
        _ => {
            tell(format_args!(
                "fleetmq: error: FLEETMQ_THP must be 1/true/yes (keep transparent huge pages) or 0/false/no (turn them off, the default)"
            ));
            return ExitCode::from(2);
        }
    };
    if !keep_huge_pages {
        // SAFETY: prctl with integer arguments only; it changes the
        // process's memory policy, not any memory Rust knows of.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve(&args),
        Command::CheckConfig(args) => check_config(&args),
        Command::Passwd(args) => passwd(&args),
        Command::HomeShard(args) => home_shard(&args),
        Command::Cert(args) => cert(&args),
    }
}

fn home_shard(args: &HomeShardArgs) -> ExitCode {
    // All checked before the first line: a listing is whole or refused.
    for id in &args.client_ids {
        if id.is_empty() {
            tell(format_args!(
                "fleetmq: error: an empty client identifier has no home shard: the broker assigns one (fleetmq-…) at CONNECT [MQTT-3.1.3-6], served where that one lands"
            ));
            return ExitCode::from(2);
        }
        if id.len() > usize::from(u16::MAX) {
            tell(format_args!(
                "fleetmq: error: a client identifier of {} bytes is longer than an MQTT string can be (65,535 bytes, MQTT 5.0 §1.5.4)",
                id.len()
            ));
            return ExitCode::from(2);
        }
    }
    let shards = match args.shards {
        0 => fleetmq_shards::server::shards_per_core(),
        n => usize::from(n),
    };
    let mut out = std::io::stdout().lock();
    for id in &args.client_ids {
        let shard = fleetmq_shards::home_shard(id, shards);
        // A closed stdout (e.g. `| head`) ends the listing, not an error.
        if writeln!(out, "{shard}").is_err() {
            break;
        }
    }
    ExitCode::SUCCESS
}

fn passwd(args: &fleetmq_shards::auth::password::PasswdArgs) -> ExitCode {
    match fleetmq_shards::auth::password::run_passwd(args) {
        Ok(done) => {
            tell(format_args!("fleetmq: {done}"));
            ExitCode::SUCCESS
        }
        Err(err) => {
            tell(format_args!("fleetmq: error: {err:#}"));
            ExitCode::from(1)
        }
    }
}

fn cert(args: &fleetmq_shards::cert::CertArgs) -> ExitCode {
    match fleetmq_shards::cert::run_cert(args) {
        Ok(lines) => {
            for line in lines {
                tell(format_args!("fleetmq: {line}"));
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            tell(format_args!("fleetmq: error: {err:#}"));
            ExitCode::from(1)
        }
    }
}

fn serve(args: &ServeArgs) -> ExitCode {
    init_tracing();
    let settings = match config::load(args) {
        Ok(settings) => settings,
        Err(err) => return refused(&err),
    };
    for key in settings.store.unused_keys() {
        tracing::warn!(target: "broker", "{}", settings.store.unused_warning(key));
    }
    let shutdown = Shutdown::new();
    if let Err(err) = watch_signals(shutdown.clone()) {
        tell(format_args!("fleetmq: error: {err:#}"));
        return ExitCode::from(1);
    }
    match fleetmq_shards::server::run(settings, shutdown) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tell(format_args!("fleetmq: error: {err:#}"));
            ExitCode::from(1)
        }
    }
}

fn check_config(args: &ServeArgs) -> ExitCode {
    let printed = config::load(args).and_then(|s| {
        fleetmq_shards::check_mesh(&s)?;
        for key in s.store.unused_keys() {
            tell(format_args!("fleetmq: warning: {}", s.store.unused_warning(key)));
        }
        config::to_toml(&s)
    });
    match printed {
        Ok(text) => {
            // A closed stdout (e.g. `| head`) is not a settings problem.
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(err) => refused(&err),
    }
}

/// Writes one line to stderr; a closed stderr drops it (`eprintln!` would
/// panic, and the exit status would be 101 instead of the documented one).
fn tell(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn refused(err: &anyhow::Error) -> ExitCode {
    tell(format_args!("fleetmq: error: {err:#}"));
    ExitCode::from(2)
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`, with
/// `async_nats=warn` added unless it names `async_nats`; one that does
/// not parse is named in a warning and `info` is used); colours only on a
/// terminal and when `NO_COLOR` is unset or empty (no-color.org), so that
/// files, journald and Kubernetes get plain lines. A log line that cannot
/// be written (stderr closed: a log collector gone, `| head`) is dropped:
/// tracing-subscriber would otherwise report it with `eprintln!`, which
/// panics on that same closed stderr, in whichever thread logged (found by
/// a fresh-user pass: the signal thread died, and SIGTERM no longer
/// stopped the broker).
fn init_tracing() {
    use std::io::IsTerminal;
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(spec) => match EnvFilter::try_new(with_quiet_nats(&spec)) {
            Ok(filter) => (filter, None),
            Err(e) => (EnvFilter::new(with_quiet_nats("info")), Some((spec, e))),
        },
        Err(_) => (EnvFilter::new(with_quiet_nats("info")), None),
    };
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false)
        .with_ansi(std::io::stderr().is_terminal() && !no_color)
        .init();
    if let Some((spec, e)) = bad {
        tracing::warn!("RUST_LOG={spec:?} does not parse ({e}); logging at info");
    }
}

/// `spec` with async-nats' own lines at `warn` unless `spec` names
/// `async_nats`: its INFO lines (every connect, every event) carry no part
/// name; the bridge logs what matters as `bridge:` lines.
fn with_quiet_nats(spec: &str) -> String {
    if spec.contains("async_nats") {
        spec.to_owned()
    } else if spec.trim().is_empty() {
        "async_nats=warn".to_owned()
    } else {
        format!("{spec},async_nats=warn")
    }
}

/// Triggers `shutdown` on the first SIGTERM or SIGINT; a second one exits at
/// once (status 130), for a stop that hangs.
fn watch_signals(shutdown: Shutdown) -> anyhow::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
    std::thread::Builder::new()
        .name("fleetmq-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if shutdown.is_triggered() {
                    tracing::warn!("broker: signal {signal} again, exiting now");
                    std::process::exit(130);
                }
                // Triggered before the log line: the stop must not depend
                // on stderr.
                shutdown.trigger();
                tracing::info!("broker: signal {signal}, shutting down");
            }
        })?;
    Ok(())
}
