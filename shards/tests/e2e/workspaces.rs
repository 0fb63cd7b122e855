//! Workspace names are bounded (DESIGN.md §4, §9): a workspace becomes a
//! NATS subject token and the stream name `LOG_mqtt-sessions-<workspace>`,
//! so a name is 1 to 64 bytes with no whitespace, control characters,
//! `.` `*` `>` `/` `\` `+` `#` (core `cluster::names::check_workspace`).
//! A password file naming another stops the start, naming the key and the
//! rule; a JWT whose workspace claim breaks it is refused at CONNECT.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::{run_with_timeout, wait_timeout};
use crate::clients::unique;
use crate::security::{jwt, passwd, set, set_str, start, unix_now, Login, TempDir, JWT_SECRET};

/// `fleetmq serve` with `args`, expected to refuse to start: its exit
/// status and standard error.
fn serve_refused(args: &[String]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetmq"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]).args(args);
    let out = run_with_timeout(&mut cmd, Duration::from_secs(20));
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_password_file_naming_a_workspace_that_breaks_the_rule_stops_the_start_naming_the_key_and_the_rule() {
    let dir = TempDir::new("ws-passwd");
    let file = dir.path("passwd");
    passwd(&file, "good", "pw", Some("acme"));
    let hash = std::fs::read_to_string(&file).unwrap().trim().split(':').nth(1).unwrap().to_owned();
    for (workspace, rule) in [
        ("plant.north", "contains '.'"),
        ("a/b", "contains '/'"),
        ("sensors>", "contains '>'"),
        (&"w".repeat(65), "is 65 bytes long; a workspace name has at most 64 bytes"),
    ] {
        let text = std::fs::read_to_string(&file).unwrap();
        let bad = dir.put("bad-passwd", format!("{}\nbob:{hash}:{workspace}\n", text.trim()));
        let mut args = Vec::new();
        set_str(&mut args, "auth.password_file", &bad);
        let (ok, stderr) = serve_refused(&args);
        assert!(!ok, "started with workspace {workspace:?}");
        assert!(stderr.contains("auth.password_file"), "{stderr}");
        assert!(stderr.contains(&format!("the workspace {workspace:?} {rule}")), "{stderr}");
        assert!(stderr.contains("line 2"), "{stderr}");
    }
    // `fleetmq passwd` does not write one either.
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetmq"))
        .arg("passwd")
        .arg(&file)
        .args(["carol", "--password-stdin", "--workspace", "a*b"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(b"pw\n");
    let status = wait_timeout(&mut child, Duration::from_secs(20)).expect("fleetmq passwd ends");
    let mut stderr = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(!status.success());
    assert!(stderr.contains("the workspace \"a*b\" contains '*'"), "{stderr}");
    assert!(!std::fs::read_to_string(&file).unwrap().contains("carol"));
}

#[test]
fn a_jwt_whose_workspace_claim_breaks_the_rule_gets_connack_not_authorized() {
    let dir = TempDir::new("ws-jwt");
    let mut secret = JWT_SECRET.to_vec();
    secret.push(b'\n');
    let mut args = Vec::new();
    set_str(&mut args, "auth.jwt.secret_file", &dir.put("secret", secret));
    set(&mut args, "auth.jwt.workspace_claim", "\"tenant\"");
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.auth_failure_threshold", "1000");
    set(&mut args, "limits.auth_check_rate_per_credential", "1000");
    let broker = start(&args);
    let token = |tenant: &str| jwt(JWT_SECRET, serde_json::json!({ "sub": "dev-1", "tenant": tenant, "exp": unix_now() + 600 }));
    Login::v5(&unique("ws")).user("dev-1", &token("acme")).accepted(broker.mqtt);
    // The token is genuine and names a workspace the broker cannot keep
    // (its name would be a NATS subject token and stream name). 0x87 Not
    // authorized: the client is who it says and is not let in as that
    // identity. Not 0x86 (the user name or password malformed or wrong:
    // the client cannot mend this, the token's issuer must), not 0x85
    // (about the Client Identifier), not 0x8C (the AUTH method of enhanced
    // authentication, unused here). A CONNACK of 0x80 or more ends the
    // connection [MQTT-3.2.2-7]; 3.1.1 answers return code 5 (Not
    // authorized) and closes it too [MQTT-3.2.2-5].
    for bad in ["acme.north", "acme/north", "a b", "*", &"t".repeat(65)] {
        let mut client = Login::v5(&unique("ws")).user("dev-1", &token(bad)).open(broker.mqtt);
        assert_eq!(client.connack.reason, 0x87, "{bad:?}");
        // Closed, with no DISCONNECT after the CONNACK.
        assert_eq!(client.closed_with(Duration::from_secs(2)), None, "{bad:?}");
    }
    assert_eq!(Login::v311(&unique("ws")).user("dev-1", &token("a.b")).reason(broker.mqtt), 5);
    crate::security::assert_refused(&broker, "not_authorized", 6.0);
}
