//! `fleetmq-loadgen suback`: how long a SUBSCRIBE waits for its SUBACK,
//! and whether a value published elsewhere right after the SUBACK reaches
//! the subscriber (issue 25: once the client holds its SUBACK, a value
//! the server takes ownership of goes to it, [MQTT-4.5.0-1], whichever
//! replica or cluster server took it).
//!
//! A subscriber on `--sub-url` subscribes to `--filters` fresh filters
//! `{prefix}/{run}/<i>` one at a time (`run` random per process); as soon
//! as each SUBACK is read, a publisher on `--pub-url` publishes one value
//! on it at QoS 0. Values are read while the run goes on and for
//! `--drain` after it. It reports the SUBACK times (SUBSCRIBE written →
//! SUBACK read: median, p99, max) and how many first values never came.
//!
//! Plain TCP (`mqtt://`), MQTT 3.1.1, blocking sockets, as `retained`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::options::{parse_duration, parse_url, BrokerUrl};
use crate::retained::{packet, string, Conn};

/// `fleetmq-loadgen suback` options.
#[derive(Debug, clap::Args)]
pub struct SubackArgs {
    /// The subscriber's broker (`mqtt://HOST:PORT`).
    #[arg(long, value_parser = parse_url, default_value = "mqtt://127.0.0.1:1883")]
    pub sub_url: BrokerUrl,
    /// The publisher's broker (default: `--sub-url`).
    #[arg(long, value_parser = parse_url)]
    pub pub_url: Option<BrokerUrl>,
    /// Fresh filters to subscribe to, one after the other (1..=60000).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u16).range(1..=60_000))]
    pub filters: u16,
    /// First topic level of the filters.
    #[arg(long, default_value = "suback")]
    pub prefix: String,
    /// How long to read values after the last publish.
    #[arg(long, value_parser = parse_duration, default_value = "3s")]
    pub drain: Duration,
    /// Give up on a CONNACK or SUBACK after this long.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub timeout: Duration,
    /// Write the result as one JSON object to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What `suback` measured; times in milliseconds.
#[derive(Debug, Default, serde::Serialize)]
pub struct SubackReport {
    /// SUBSCRIBEs answered.
    pub subscribes: usize,
    /// SUBACK time, median.
    pub suback_median_ms: f64,
    /// SUBACK time, 99th percentile.
    pub suback_p99_ms: f64,
    /// SUBACK time, largest.
    pub suback_max_ms: f64,
    /// First values (published right after their SUBACK) that never came.
    pub missed: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile (0..=1) of `sorted`, nearest rank; 0 when empty.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Run `suback`.
///
/// # Errors
/// A broker cannot be reached, refused the CONNECT or a SUBSCRIBE, closed
/// a connection, or a SUBACK did not come within `--timeout`.
pub fn run(args: &SubackArgs) -> Result<SubackReport, String> {
    let id = std::process::id();
    // Fresh filters on every run (a broker may keep routes a while).
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() ^ d.as_secs() as u32)
        ^ id;
    let mut sub = Conn::connect(&args.sub_url, &format!("suback-sub-{id}"), None, args.timeout)?;
    let pub_url = args.pub_url.as_ref().unwrap_or(&args.sub_url);
    let mut publisher = Conn::connect(pub_url, &format!("suback-pub-{id}"), None, args.timeout)?;
    let topic = |i: u16| format!("{}/{run:08x}/{i}", args.prefix);
    let mut got = HashSet::new();
    let mut times = Vec::with_capacity(usize::from(args.filters));
    let note = |got: &mut HashSet<String>, header: u8, body: &[u8]| {
        if header >> 4 == 3 && body.len() >= 2 {
            let n = usize::from(u16::from_be_bytes([body[0], body[1]]));
            if let Some(t) = body.get(2..2 + n) {
                got.insert(String::from_utf8_lossy(t).into_owned());
            }
        }
    };
    for i in 0..args.filters {
        let mut body = (i + 1).to_be_bytes().to_vec();
        body.extend(string(topic(i).as_bytes()));
        body.push(0);
        let started = Instant::now();
        sub.write(&packet(0x82, &body))?;
        let deadline = started + args.timeout;
        loop {
            let (header, body) = sub.next(deadline)?;
            if header >> 4 == 9 {
                if body.last().is_some_and(|&code| code >= 0x80) {
                    return Err(format!("SUBACK refused: {body:02x?}"));
                }
                times.push(ms(started.elapsed()));
                break;
            }
            note(&mut got, header, &body);
        }
        let mut value = string(topic(i).as_bytes());
        value.extend_from_slice(b"first");
        publisher.write(&packet(0x30, &value))?;
    }
    let deadline = Instant::now() + args.drain;
    while let Ok((header, body)) = sub.next(deadline) {
        note(&mut got, header, &body);
    }
    times.sort_by(f64::total_cmp);
    Ok(SubackReport {
        subscribes: times.len(),
        suback_median_ms: quantile(&times, 0.5),
        suback_p99_ms: quantile(&times, 0.99),
        suback_max_ms: times.last().copied().unwrap_or(0.0),
        missed: (0..args.filters).filter(|i| !got.contains(&topic(*i))).count(),
    })
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 51.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
