//! The interop matrix: real client libraries of other languages against
//! the broker binary, each over MQTT 3.1.1 and 5 (issue 4): paho-mqtt 2.x
//! (Python, `tests/interop/paho_test.py`) and MQTT.js 5.x (Node,
//! `tests/interop/mqttjs_test.mjs`). Each script covers QoS 0/1/2,
//! retained, will, persistent session resume, shared subscriptions and the
//! MQTT 5 properties its library exposes, and exits non-zero naming what
//! failed. `scripts/test.sh` installs both libraries; when one is missing
//! these tests fail and say so, they never pass silently.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::harness::{run_with_timeout, Broker};

/// How long one script may run (each takes ~4 s).
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(90);

/// The workspace root.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("shards/ is in the workspace")
        .to_path_buf()
}

/// Runs `program args... PORT` against a fresh two-shard broker; panics
/// with the script's output unless it exits 0.
fn run_script(program: &Path, args: &[&Path]) {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port().to_string();
    let out = run_with_timeout(
        Command::new(program)
            .args(args)
            .arg(&port)
            .current_dir(root().join("tests/interop")),
        SCRIPT_TIMEOUT,
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{} {:?} failed ({:?}):\n{text}",
        program.display(),
        args,
        out.status
    );
    eprintln!("{text}");
}

/// The Python with paho-mqtt 2.x: `$FLEETMQ_INTEROP_PYTHON`, else the venv
/// scripts/test.sh makes under target/ when pip refuses system installs,
/// else `python3`.
///
/// # Panics
///
/// None of them can import paho-mqtt 2.x.
pub(crate) fn python_with_paho() -> PathBuf {
    let mut candidates: Vec<PathBuf> = std::env::var_os("FLEETMQ_INTEROP_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    candidates.push(root().join("target/interop-venv/bin/python"));
    candidates.push(PathBuf::from("python3"));
    let probe = "import paho.mqtt, sys; sys.exit(not paho.mqtt.__version__.startswith('2.'))";
    candidates
        .into_iter()
        .find(|python| {
            Command::new(python)
                .args(["-c", probe])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .unwrap_or_else(|| {
            panic!(
                "paho-mqtt 2.x is not installed for python3 nor in target/interop-venv: \
                 run scripts/test.sh (it installs tests/interop/requirements.txt)"
            )
        })
}

/// paho-mqtt (Python) over MQTT 3.1.1 and 5 interoperates with the broker.
#[test]
fn paho_mqtt_python_client_interoperates() {
    let python = python_with_paho();
    run_script(&python, &[&root().join("tests/interop/paho_test.py")]);
}

/// MQTT.js (Node) over MQTT 3.1.1 and 5 interoperates with the broker.
#[test]
fn mqtt_js_client_interoperates() {
    let dir = root().join("tests/interop");
    assert!(
        dir.join("node_modules/mqtt/package.json").exists(),
        "MQTT.js is not installed in tests/interop/node_modules: run scripts/test.sh \
         (it runs `npm install` there)"
    );
    let node = PathBuf::from("node");
    assert!(
        Command::new(&node)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "node is not installed (Node 18+ is needed for MQTT.js)"
    );
    run_script(&node, &[&dir.join("mqttjs_test.mjs")]);
}
