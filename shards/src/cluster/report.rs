//! The cluster on the admin port (DESIGN.md §12): readiness, the
//! `/api/v1/status` fields and the `/metrics` series of the bridge.

use std::fmt::Write as _;

use fleetmq_nats_bridge::OpKind;

use super::Node;

/// Upper bounds of the NATS round-trip histogram buckets, in seconds.
const ROUND_TRIP_BOUNDS: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0, 10.0];

impl Node {
    /// Why the replica is not ready (fenced, starting, duplicate replica
    /// ID; a live peer it has not linked to for the mesh's readiness
    /// grace), `None` when it is.
    pub(crate) fn not_ready(&self) -> Option<String> {
        self.status().not_ready().or_else(|| self.mesh.as_ref().and_then(|m| m.not_ready()))
    }

    /// The cluster's part of `/api/v1/status`, a JSON object.
    pub(crate) fn status_json(&self) -> serde_json::Value {
        let status = self.status();
        let stats = &status.stats;
        serde_json::json!({
            "replica": status.replica_id,
            "instance": status.instance,
            "fenced": status.is_fenced(),
            "reason": self.not_ready(),
            "members": status.members(),
            "mesh_links_up": self.mesh.as_ref().map_or(0, |m| m.stats.links_up.load(std::sync::atomic::Ordering::Relaxed)),
            "mesh": match &self.mesh {
                Some(mesh) => mesh.status_json(),
                None => serde_json::json!({"off": "no cluster.mesh_cert, mesh_key and mesh_ca configured"}),
            },
            "routes": {
                "local": stats.routes_local.load(std::sync::atomic::Ordering::Relaxed),
                "remote": stats.routes_remote.load(std::sync::atomic::Ordering::Relaxed),
                "late": stats.routes_late.load(std::sync::atomic::Ordering::Relaxed),
            },
            "store": if status.is_fenced() { "unavailable" } else { "ok" },
            "bridge": {
                "queue_depth": self.queue_depth(),
                "in_flight": stats.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                "reconnects": stats.reconnects.load(std::sync::atomic::Ordering::Relaxed),
                "reconnects_forced": {
                    "state": stats.reconnects_forced_state.load(std::sync::atomic::Ordering::Relaxed),
                    "lease": stats.reconnects_forced_lease.load(std::sync::atomic::Ordering::Relaxed),
                    "ingest": stats.reconnects_forced_ingest.load(std::sync::atomic::Ordering::Relaxed),
                },
                "ingest_connection_moves": stats.ingest_connection_moves.load(std::sync::atomic::Ordering::Relaxed),
                "connections": self.bridge.connections().into_iter()
                    .map(|(name, server, connected)| (name.to_owned(), serde_json::json!({"server": server, "connected": connected})))
                    .collect::<serde_json::Map<_, _>>(),
                "claim_p50_us": stats.quantile_us(OpKind::Claim, 0.5),
                "claim_p99_us": stats.quantile_us(OpKind::Claim, 0.99),
                "heartbeat_p99_us": stats.quantile_us(OpKind::Heartbeat, 0.99),
            },
        })
    }

    /// The cluster's `/metrics` series, in the text format, without the
    /// final `# EOF`.
    pub(crate) fn render_metrics(&self, out: &mut String) {
        let status = self.status();
        let stats = &status.stats;
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let gauge = |out: &mut String, name: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP fleetmq_{name} {help}\n# TYPE fleetmq_{name} gauge\nfleetmq_{name} {value}");
        };
        if let Some(mesh) = &self.mesh {
            mesh.render_metrics(out);
        }
        gauge(out, "cluster_members", "Live replicas, this one included while it serves", status.members().len().to_string());
        gauge(out, "cluster_fenced", "1 while this replica is fenced (DESIGN.md §5)", u8::from(status.is_fenced()).to_string());
        gauge(out, "bridge_queue_depth", "Requests queued for the NATS bridge", self.queue_depth().to_string());
        gauge(out, "bridge_requests_in_flight", "Bridge requests taken and not yet completed", stats.in_flight.load(relaxed).to_string());
        gauge(
            out,
            "routes_local",
            "Distinct topic filters this replica's clients subscribe to: its entries in mqtt-routes",
            stats.routes_local.load(relaxed).to_string(),
        );
        gauge(
            out,
            "routes_remote",
            "Other replicas' entries of mqtt-routes applied (their replica live)",
            stats.routes_remote.load(relaxed).to_string(),
        );
        let (waiting, waiting_bytes) = self.bridge.retained_waiting();
        gauge(
            out,
            "cluster_retained_waiting",
            "Retained writes waiting for NATS (queued or in flight); at most 4,096",
            waiting.to_string(),
        );
        gauge(
            out,
            "cluster_retained_waiting_bytes",
            "Bytes of the retained writes waiting for NATS (records and topics, plus 1 KiB each); at most 32 MiB",
            waiting_bytes.to_string(),
        );
        gauge(
            out,
            "session_log_appends_held",
            "QoS 1/2 values waiting for the ingest stream (store.kind = \"jetstream\") or a session log, queued for NATS or in flight; their PUBACK/PUBREC waits. At most 65,536",
            self.bridge.ingest_waiting().to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP fleetmq_session_log_appends_refused QoS 1/2 publishes refused because the ingest stream or the session log did not take them: unavailable (not within session_log_append_wait, 0x80), full (store.max_bytes, 0x97), queue (65,536 appends or 256 MiB already waiting for NATS, 0x97), too_large (the value with its headers does not fit NATS max_payload, or its headers exceed 64 KiB, 0x97)\n# TYPE fleetmq_session_log_appends_refused counter"
        );
        for (reason, value) in [
            ("unavailable", &stats.ingest_refused_unavailable),
            ("full", &stats.ingest_refused_full),
            ("queue", &stats.ingest_refused_queue),
            ("too_large", &stats.ingest_refused_too_large),
        ] {
            let _ = writeln!(out, "fleetmq_session_log_appends_refused_total{{reason=\"{reason}\"}} {}", value.load(relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP fleetmq_session_log_appends Values appended, acknowledged by JetStream: to the ingest stream (stream=\"ingest\", store.kind = \"jetstream\") and to a workspace's session log (stream=\"log\": a persistent session wanted it)\n# TYPE fleetmq_session_log_appends counter\nfleetmq_session_log_appends_total{{stream=\"ingest\"}} {}\nfleetmq_session_log_appends_total{{stream=\"log\"}} {}",
            stats.ingest_appended.load(relaxed),
            stats.log_appended.load(relaxed)
        );
        counter(out, "fleetmq_session_log_values_missed", "Values of a session log that a persistent session had not read when the log dropped them (cluster.session_log_max_bytes, limits.max_session_expiry), found when it resumed", stats.log_missed.load(relaxed));
        let _ = writeln!(
            out,
            "# HELP fleetmq_cluster_nats_reconnects_forced NATS connections of the bridge forced to reconnect to another server because the one they used answered no echo for member_ttl/2 (a frozen server, DESIGN.md §6)\n# TYPE fleetmq_cluster_nats_reconnects_forced counter\nfleetmq_cluster_nats_reconnects_forced_total{{connection=\"state\"}} {}\nfleetmq_cluster_nats_reconnects_forced_total{{connection=\"lease\"}} {}\nfleetmq_cluster_nats_reconnects_forced_total{{connection=\"ingest\"}} {}",
            stats.reconnects_forced_state.load(relaxed),
            stats.reconnects_forced_lease.load(relaxed),
            stats.reconnects_forced_ingest.load(relaxed)
        );
        counter(out, "fleetmq_cluster_ingest_connection_moves", "Moves of the ingest connection to the server that leads mqtt-ingest (after the leader or the connection moved)", stats.ingest_connection_moves.load(relaxed));
        counter(out, "fleetmq_cluster_nats_reconnects", "NATS connections of the bridge re-established, forced or not", stats.reconnects.load(relaxed));
        counter(out, "fleetmq_bridge_queue_full", "Requests refused because the bridge queue was full", stats.queue_full.load(relaxed));
        for (name, help, value) in [
            ("cluster_wills_sent", "Wills of stopped, fenced or gone replicas' connections this replica sent as sweeper", &stats.wills_sent),
            ("cluster_wills_withheld", "Such wills withheld: the client came back within will_stop_grace", &stats.wills_withheld),
            (
                "cluster_sessions_swept",
                "Persistent sessions of stopped, fenced or gone replicas this replica ended as sweeper once their Session Expiry Interval passed (record, cursor and QoS 2 flows deleted)",
                &stats.sessions_swept,
            ),
            (
                "cluster_retained_refused",
                "QoS 1/2 retained values refused to their publisher: not in mqtt-retained within session_log_append_wait (0x80), larger than NATS max_payload, or 4,096 retained writes or 32 MiB of them already waiting for NATS (0x97)",
                &stats.retained_refused,
            ),
            ("cluster_retained_failed", "QoS 0 retained values and retained wills that mqtt-retained did not take (lost)", &stats.retained_failed),
            (
                "cluster_retained_dropped",
                "QoS 0 retained values and retained wills not written to mqtt-retained because 4,096 retained writes or 32 MiB of them already waited for NATS (delivered live, not retained)",
                &stats.retained_dropped,
            ),
            ("cluster_retained_undone", "Refused retained values that landed in mqtt-retained late and were undone", &stats.retained_undone),
            (
                "cluster_retained_not_undone",
                "Refused retained values that may land in mqtt-retained late and are not looked for (4,096 undos already were)",
                &stats.retained_not_undone,
            ),
            (
                "routes_late",
                "SUBACKs sent without their route written to mqtt-routes within 2 s (DESIGN.md §10)",
                &stats.routes_late,
            ),
            (
                "cluster_claims_delayed",
                "Client identifier claims that waited up to 1 s before taking the identifier from another replica that claimed it less than 1 s before (a flapping client identifier)",
                &stats.claims_delayed,
            ),
            (
                "cluster_session_records_stale",
                "Session records not written to mqtt-session-state because another replica wrote the record since and owns the client identifier now (a late write of the replica the client left)",
                &stats.session_records_stale,
            ),
        ] {
            let _ = writeln!(out, "# HELP fleetmq_{name} {help}\n# TYPE fleetmq_{name} counter\nfleetmq_{name}_total {}", value.load(relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP fleetmq_nats_round_trip_seconds NATS JetStream round trips by operation\n# TYPE fleetmq_nats_round_trip_seconds histogram"
        );
        for kind in OpKind::ALL {
            let (count, sum, below) = stats.round_trips(kind, &ROUND_TRIP_BOUNDS);
            let op = kind.name();
            for (bound, n) in ROUND_TRIP_BOUNDS.iter().zip(below) {
                let _ = writeln!(out, "fleetmq_nats_round_trip_seconds_bucket{{op=\"{op}\",le=\"{bound}\"}} {n}");
            }
            let _ = writeln!(out, "fleetmq_nats_round_trip_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {count}");
            let _ = writeln!(out, "fleetmq_nats_round_trip_seconds_sum{{op=\"{op}\"}} {sum}");
            let _ = writeln!(out, "fleetmq_nats_round_trip_seconds_count{{op=\"{op}\"}} {count}");
        }
    }
}

/// One counter without labels, Prometheus text: its HELP and TYPE lines
/// and `<name>_total value`.
fn counter(out: &mut String, name: &str, help: &str, value: u64) {
    use std::fmt::Write as _;
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}_total {value}");
}
