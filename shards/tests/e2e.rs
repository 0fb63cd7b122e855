//! End-to-end tests: the real `fleetmq` binary on free ports, used by real
//! clients (rumqttc for MQTT 3.1.1 and 5, mosquitto_pub/mosquitto_sub from
//! the Debian package mosquitto-clients) and by a raw socket for what real
//! clients will not send. One test binary; one submodule per area.

/// Starting and stopping the broker; admin HTTP; mosquitto processes.
#[path = "e2e/harness.rs"]
mod harness;

/// A raw-socket client and packet builders.
#[path = "e2e/raw.rs"]
mod raw;

/// rumqttc clients with awaitable packets.
#[path = "e2e/clients.rs"]
mod clients;

/// QoS 0/1/2 delivery and the downgrade to the subscription's QoS.
#[path = "e2e/qos.rs"]
mod qos;

/// Overlapping subscriptions and subscription identifiers.
#[path = "e2e/overlap.rs"]
mod overlap;

/// Retained messages: set, replace, clear, RETAIN flag on delivery.
#[path = "e2e/retained.rs"]
mod retained;

/// Persistent and clean sessions, take-over across shards.
#[path = "e2e/sessions.rs"]
mod sessions;

/// Wills: killed clients, clean DISCONNECT, Will Delay, 0x04, keep alive.
#[path = "e2e/wills.rs"]
mod wills;

/// CONNECT handling and malformed input.
#[path = "e2e/protocol.rs"]
mod protocol;

/// Many clients at once.
#[path = "e2e/scale.rs"]
mod scale;

/// Admin HTTP, settings refused at start, SIGTERM.
#[path = "e2e/operations.rs"]
mod operations;

/// Flow control towards subscribers: queued QoS 1 messages and PUBACKs.
#[path = "e2e/flow.rs"]
mod flow;

/// MQTT 5 features byte by byte (topic aliases, properties, limits, $SYS),
/// the 3.1.1 rules, and the raw client the next modules share.
#[path = "e2e/mqtt5.rs"]
mod mqtt5;

/// Shared subscriptions: exactly once, strategies, members away.
#[path = "e2e/shared.rs"]
mod shared;

/// A subscriber that never reads: publisher and others unaffected, memory
/// bounded, drops counted.
#[path = "e2e/robustness.rs"]
mod robustness;

/// paho-mqtt (Python) and MQTT.js (Node) against the broker.
#[path = "e2e/interop.rs"]
mod interop;

/// TLS (server, mutual, reload, certificate names), WebSocket and WSS; the
/// password file and `fleetmq passwd`; JWTs; the ACL file; workspaces.
#[path = "e2e/security.rs"]
mod security;

/// Every connection and abuse limit reached, with its refusal and count.
#[path = "e2e/limits.rs"]
mod limits;

/// Failed sign-ins: no lock-out of known devices, slow guessing, bounded
/// memory, from distinct loopback source addresses.
#[path = "e2e/lockout.rs"]
mod lockout;

/// Floods of silent, stalled and slow connections and of wrong passwords:
/// devices still get in, and the broker's resources come back.
#[path = "e2e/floods.rs"]
mod floods;

/// Publishers moving to their subscribers' shard: order, take-over,
/// resume, clean start and wills across the move.
#[path = "e2e/placement.rs"]
mod placement;

/// CONNECTs read whole at accept on a shard that does not own their client
/// identifier: handed over at once, answered and taken over as any other.
#[path = "e2e/arrivals.rs"]
mod arrivals;

/// `fleetmq cert`: the mesh CA and replica certificates, proven by a
/// mutual TLS 1.3 handshake.
#[path = "e2e/cert.rs"]
mod cert;

/// The broker's last packet (DISCONNECT, refusing CONNACK) reaches a client
/// that keeps writing, over TCP, TLS and WebSocket; a flood of closings.
#[path = "e2e/closing.rs"]
mod closing;

/// The cluster harness: a real nats-server cluster with JetStream (start,
/// stop, kill, restart, pause), the fault proxy in front of it, and the
/// harness's own tests.
#[path = "e2e/nats.rs"]
mod nats;

/// The durable local store: restart after SIGKILL, no acknowledged value
/// lost under load, damaged logs, the lock, a full disk.
#[path = "e2e/store.rs"]
mod store;

/// A QoS 2 packet identifier whose PUBREC was refused is free again:
/// its reuse is stored and forwarded once (full disk, restart, 3.1.1).
#[path = "e2e/qos2_refused.rs"]
mod qos2_refused;

/// The local store compacted while serving: the log stays near what is
/// live, `store.max_bytes` refuses publishes and recovers by itself, and
/// SIGKILL in a loop during compactions loses nothing acknowledged.
#[path = "e2e/compaction.rs"]
mod compaction;

/// What a restart after SIGKILL resumes: deliveries in flight, inbound QoS
/// 2 identifiers, wills, CONNACK after the store, QoS 2 exactly once.
#[path = "e2e/restart.rs"]
mod restart;

/// paho-mqtt QoS 2 clients across a SIGKILL: a publisher's backlog sent
/// all at once after the restart reaches a persistent subscriber once.
#[path = "e2e/paho_restart.rs"]
mod paho_restart;

/// Retained messages for a SUBSCRIBE paced, not dropped: 80,000 to one
/// subscriber at each QoS, a slow reader, a thousand subscribers at once.
#[path = "e2e/retained_paced.rs"]
mod retained_paced;

/// Cluster mode against a real 3-server NATS cluster: take-over across
/// replicas, racing CONNECTs, fencing and recovery, retained messages and
/// wills, start-up refusals.
#[path = "e2e/cluster.rs"]
mod cluster;

/// A delayed will and a new connection with Clean Start 1 or 0, on one
/// node and across replicas (the serving replica, a take-over, the
/// sweeper).
#[path = "e2e/cluster_wills.rs"]
mod cluster_wills;

/// The format floor raised by the leader once the last old member is gone.
#[path = "e2e/cluster_floor.rs"]
mod cluster_floor;

/// Cluster mode: a retained value is acknowledged only once it is in
/// JetStream, refused when it cannot be, and carried byte-exact up to
/// NATS max_payload.
#[path = "e2e/cluster_retained.rs"]
mod cluster_retained;

/// The mesh: links over mutual TLS 1.3, values across replicas once and
/// in order, cuts, a full buffer, a foreign certificate, a restart.
#[path = "e2e/cluster_mesh.rs"]
mod cluster_mesh;

/// The mesh as an operator meets it: refusals counted by reason and
/// logged once a minute, a frozen peer's link down within seconds, the
/// handshake cap, `check-config` of the mesh settings, a replica added
/// with the existing CA.
#[path = "e2e/cluster_mesh_ops.rs"]
mod cluster_mesh_ops;

/// A shared group's values in the mesh buffer of a member replica that
/// was SIGKILLed go to the members still there (MQTT 5 §4.8.2): none
/// acknowledged is lost.
#[path = "e2e/cluster_mesh_shared.rs"]
mod cluster_mesh_shared;

/// Route announces over the mesh (version 3): a value published on
/// another replica right after the SUBACK reaches the subscriber; a
/// version-2 peer still links and learns routes from the watch.
#[path = "e2e/cluster_announce.rs"]
mod cluster_announce;

/// Cluster mode: 20,000 retained values reach a wildcard subscription on
/// every replica, and on one started after they exist.
#[path = "e2e/cluster_retained_many.rs"]
mod cluster_retained_many;

/// Cluster mode: CONNECTs waiting for their client identifier claim do
/// not hold the pending-connection limit.
#[path = "e2e/cluster_connect.rs"]
mod cluster_connect;

/// Cluster hand-over: delayed wills of a killed or fenced replica, gone
/// replicas' client identifier ownership, a clean stop, NATS slow.
#[path = "e2e/cluster_handover.rs"]
mod cluster_handover;

/// Cluster mode: a client identifier flapping between replicas is slowed
/// to about one take-over a second, never refused, and ends with one
/// connection.
#[path = "e2e/cluster_flapping.rs"]
mod cluster_flapping;

/// A replica flooded with retained values while NATS is down or slow keeps
/// what waits for NATS bounded (s36).
#[path = "e2e/cluster_outage.rs"]
mod cluster_outage;

/// `KV_mqtt-sessions` does not grow forever: released client identifiers
/// leave it for good after a bounded time (s36).
#[path = "e2e/cluster_sessions_bucket.rs"]
mod cluster_sessions_bucket;

/// `mqtt-routes`: one entry per filter per replica before the SUBACK,
/// deleted with the last subscriber; applied by the other replicas while
/// live; purged at a restart, swept once gone.
#[path = "e2e/cluster_routes.rs"]
mod cluster_routes;

/// Persistent sessions in `mqtt-session-state`: taken up at another
/// replica with their subscriptions, ended everywhere by Clean Start,
/// not taken up once expired.
#[path = "e2e/cluster_session_state.rs"]
mod cluster_session_state;

/// `store.kind = "jetstream"`: QoS 1/2 values in the ingest stream before
/// their PUBACK/PUBREC, refused when JetStream cannot take them (s39).
#[path = "e2e/cluster_ingest.rs"]
mod cluster_ingest;

/// Session logs: a QoS 1/2 value a persistent session of the cluster
/// wants is in its workspace's log before its PUBACK/PUBREC; a log capped
/// small drops its oldest; never acknowledged and then lost (s40).
#[path = "e2e/cluster_session_log.rs"]
mod cluster_session_log;

/// Exactly once: a QoS 2 publisher and a persistent QoS 2 subscriber,
/// either's replica SIGKILLed at each step of its handshake (s41).
#[path = "e2e/cluster_qos2.rs"]
mod cluster_qos2;

/// A value published on another replica right after a persistent
/// subscription's SUBACK is delivered (mesh version 4, s41).
#[path = "e2e/cluster_log_race.rs"]
mod cluster_log_race;

/// A 3,900-byte client identifier, a 4,000-byte filter and a retained
/// value on a 4,000-byte topic work across replicas as short ones do
/// (hashed KV keys, s40).
#[path = "e2e/cluster_long_names.rs"]
mod cluster_long_names;

/// Session expiry across replicas: the sweeper ends an expired session of
/// a killed replica (record, cursor, QoS 2 flows, interest); a client
/// back in time keeps it; a live replica ends one the same way (s41).
#[path = "e2e/cluster_session_expiry.rs"]
mod cluster_session_expiry;

/// One NATS server of three frozen under the replicas' connections: the
/// bridge leaves it before the fence deadline; no replica fences, no
/// acknowledged value is lost (s41).
#[path = "e2e/cluster_frozen.rs"]
mod cluster_frozen;

/// Workspace names are bounded (they become NATS subject tokens and
/// stream names): a password file breaking the rule stops the start, a
/// JWT workspace claim breaking it gets CONNACK 0x87 (s41).
#[path = "e2e/workspaces.rs"]
mod workspaces;

/// A rolling restart of three replicas (SIGTERM, one at a time) under a
/// steady QoS 1 publisher and a persistent subscriber: every
/// acknowledged value delivered, in order, duplicates only as DUP (s41).
#[path = "e2e/cluster_rolling.rs"]
mod cluster_rolling;
