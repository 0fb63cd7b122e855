//! paho-mqtt 2.x (Python) QoS 2 clients across a SIGKILL of the broker
//! (`tests/interop/paho_qos2_restart.py`): a persistent MQTT 3.1.1
//! subscriber and a publisher whose values, published while the broker
//! was down, paho writes all at once after it reconnects. MQTT 3.1.1 has
//! no Receive Maximum, so the broker must take them all: closing the
//! connection at its MQTT 5 Receive Maximum (1,000 open QoS 2 flows) made
//! paho reconnect and send them again, for ever, and a publisher with a
//! clean session (paho's default) had the same values forwarded again each
//! round (a fresh-user pass counted the duplicates).

use std::io::Write;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use crate::harness::{line_channel, Broker};
use crate::interop::{python_with_paho, root};
use crate::store::TempDir;

/// Values the publisher queues while the broker is down: three times the
/// broker's Receive Maximum.
const QUEUED: u32 = 3000;

/// How long one step of the script may take.
const STEP: Duration = Duration::from_secs(90);

/// The script, killed if the test ends early.
struct Script {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Script {
    /// `tests/interop/{name}` with `args`.
    fn start(name: &str, args: &[String]) -> Script {
        let mut child = Command::new(python_with_paho())
            .arg(root().join("tests/interop").join(name))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 starts");
        let stdin = child.stdin.take().expect("stdin is piped");
        let lines = line_channel(child.stdout.take().expect("stdout is piped"));
        Script { child, stdin, lines, seen: Vec::new() }
    }

    /// Waits for the script's next line and checks it is `line`.
    fn expect(&mut self, line: &str) {
        match self.lines.recv_timeout(STEP) {
            Ok(got) if got.trim() == line => self.seen.push(got),
            Ok(got) => {
                self.seen.push(got);
                let rest: Vec<String> = self.lines.try_iter().collect();
                panic!("expected {line:?} from the script, got {:?} then {rest:?}", self.seen);
            }
            Err(e) => panic!("no {line:?} from the script within {STEP:?} ({e}); it printed {:?}", self.seen),
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("the script reads its stdin");
        self.stdin.flush().expect("the script reads its stdin");
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `--shards 2`, the local store in `dir`, listening on `listen` too when
/// given (a restart takes the port the clients reconnect to).
fn local(dir: &TempDir, listen: Option<&str>) -> Broker {
    let dir = format!("store.dir={}", dir.0.display());
    let mut args = vec!["--shards", "2", "--set", "store.kind=local", "--set", &dir];
    if let Some(listen) = listen {
        args.extend(["--listen", listen]);
    }
    Broker::start(&args)
}

/// The run for one kind of publisher session ("default": paho's own,
/// Clean Session 1; "persistent": Clean Session 0).
fn values_queued_while_down_reach_the_subscriber_exactly_once(publisher_session: &str) {
    let dir = TempDir::new("paho-q2");
    let broker = local(&dir, None);
    let port = broker.mqtt_port();
    let listen = format!("127.0.0.1:{port}");
    let mut script = Script::start("paho_qos2_restart.py", &[port.to_string(), publisher_session.into(), QUEUED.to_string()]);
    script.expect("kill");
    broker.signal(libc::SIGKILL);
    drop(broker);
    script.say("down");
    script.expect("queued");
    let _broker = local(&dir, Some(&listen));
    script.say("up");
    let result = script.lines.recv_timeout(STEP).unwrap_or_default();
    eprintln!("{publisher_session}: {result}");
    script.seen.push(result);
    script.expect("ok");
}

/// A paho-mqtt publisher with paho's default (clean) session sends its
/// 3,000 values queued while the broker was down all at once after the
/// restart: the broker takes them all on one connection (MQTT 3.1.1 has
/// no Receive Maximum) and the persistent QoS 2 subscriber gets each
/// exactly once, in order ([MQTT-4.3.3-8], [MQTT-4.3.3-10],
/// [MQTT-4.6.0-6]).
#[test]
fn a_paho_publishers_backlog_after_a_sigkill_reaches_a_persistent_qos2_subscriber_exactly_once() {
    values_queued_while_down_reach_the_subscriber_exactly_once("default");
}

/// The same with a publisher that keeps its session (Clean Session 0):
/// taken on one connection, not closed and resent round after round.
#[test]
fn a_persistent_paho_publishers_backlog_after_a_sigkill_is_taken_on_one_connection() {
    values_queued_while_down_reach_the_subscriber_exactly_once("persistent");
}

/// The shard that owns `client_id` on a broker with `shards` shards (as
/// `shard::owner_of` computes it).
fn owner_of(client_id: &str, shards: u64) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    client_id.hash(&mut h);
    h.finish() % shards
}

/// A client identifier starting with `prefix` that shard `shard` of 2 owns.
fn owned_by(prefix: &str, shard: u64) -> String {
    (0..).map(|i| format!("{prefix}-{i}")).find(|id| owner_of(id, 2) == shard).expect("some identifier")
}

/// Kill-and-restart rounds of `tests/interop/paho_qos2_kills.py`.
const ROUNDS: u32 = 3;

/// A persistent paho-mqtt QoS 2 publisher and subscriber on different
/// shards, the 2-shard broker killed with SIGKILL three times while the
/// publisher's window is full of QoS 2 flows (some between PUBREL and
/// PUBCOMP), and each time kept down until paho's reconnect failed twice:
/// every completed value reaches the subscriber exactly once
/// ([MQTT-4.3.3-10], [MQTT-4.4.0-1]). paho-mqtt 2.2 would publish the values
/// whose PUBREL it had sent again, as new messages with DUP 0, after two
/// failed reconnect attempts, which [MQTT-4.3.3-6] forbids and no broker can
/// tell from new ones; the script guards paho against that
/// (`tests/interop/paho_pubrel.py`) and checks a kill caught such a flow.
#[test]
fn paho_qos2_flows_in_flight_across_sigkills_with_failed_reconnects_reach_the_subscriber_exactly_once() {
    let dir = TempDir::new("paho-q2-kills");
    let broker = local(&dir, None);
    let port = broker.mqtt_port();
    let listen = format!("127.0.0.1:{port}");
    let (publisher, subscriber) = (owned_by(&format!("pq2k{port}-pub"), 0), owned_by(&format!("pq2k{port}-sub"), 1));
    let args = [port.to_string(), publisher, subscriber, ROUNDS.to_string(), "on".into()];
    let mut script = Script::start("paho_qos2_kills.py", &args);
    let mut broker = Some(broker);
    for _ in 0..ROUNDS {
        script.expect("kill");
        if let Some(b) = broker.take() {
            b.signal(libc::SIGKILL);
        }
        script.say("down");
        script.expect("start");
        broker = Some(local(&dir, Some(&listen)));
        script.say("up");
    }
    let result = script.lines.recv_timeout(STEP).unwrap_or_default();
    eprintln!("{result}");
    script.seen.push(result);
    script.expect("ok");
}
