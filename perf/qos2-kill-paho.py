#!/usr/bin/env python3
"""perf/qos2-kill-paho.py — exactly once across SIGKILL with real paho-mqtt clients.

A paho-mqtt (2.x) persistent QoS 2 subscriber (MQTT 3.1.1 Clean Session 0, or
MQTT 5 Clean Start 0 with a Session Expiry Interval), a paho publisher sending
QoS 2 values numbered 0, 1, 2, ... on one topic, and the broker killed with
SIGKILL and started again on the same `store.dir` and port while the values
flow. Both clients reconnect by themselves (paho's network loop) and the
publisher's paho resends what it has not completed. At the end the publisher
stops, the subscriber drains, and the script prints, per run: values published,
completed (PUBCOMP seen by the publisher), received, distinct, duplicates (and
the runs of consecutive duplicated values), missing completed values, and
order violations (a value received after a higher one, first receipts only).

--publisher-session: "persistent" (Clean Session 0 / a Session Expiry
Interval), "clean" (a clean session at every connect) or "default" (paho's
own: 3.1.1 Clean Session 1, MQTT 5 Clean Start at the first connect and no
Session Expiry Interval). Only "persistent" makes exactly once possible: a
new session cannot know that a value paho sends again was taken before.
--publish-when connected: values are handed to paho only while it is
connected (paho sends a value published during a reconnect ahead of those it
resends, which the order check would count).

paho-mqtt 2.2 itself publishes a QoS 2 value again, as a new message, after
its PUBREL when two reconnect attempts in a row fail (the broker still down):
see tests/interop/paho_pubrel.py. The publisher runs with that guard (its
PUBREL is sent again instead), and each run prints how many values it caught
("paho PUBLISH after PUBREL"); --paho-as-is leaves paho as it is, to see those
duplicates (each duplicated value is then one of the caught ones).

A completed value can go missing by the broker's own documented rule: a
subscriber's session queue holds at most limits.max_subscriber_queue (10,000)
values and drops the oldest beyond it, which a long backlog reaches (raise it
with --set limits.max_subscriber_queue=1000000).

Exit status 0 when there is no duplicate, no completed value missing and
(with --check-order) no order violation; 1 otherwise. BROKER_RUST_LOG sets the
broker's RUST_LOG (default warn).

Usage: perf/qos2-kill-paho.py --broker target/release/fleetmq [--shards 1]
       [--kills 3] [--every 2.0] [--rate 2000] [--inflight 20]
       [--protocol 3.1.1|5] [--publisher-session persistent|clean|default]
       [--publish-when always|connected] [--sub-delay S] [--runs 1]
       [--set KEY=VALUE] [--dir /tmp/x] [--keep] [--paho-as-is]
"""

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "interop"))
from paho_pubrel import guard_pubrel_resends  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every broker started, stopped at exit (also on SIGTERM/SIGINT, e.g. from
# `timeout`), so none outlives the script.
BROKERS = []
# Work directories to remove at exit (not with --dir or --keep).
SCRATCH = []


class Broker:
    def __init__(self, binary, port, data, shards, log_dir, extra):
        self.binary, self.port, self.data, self.shards, self.log_dir, self.extra = binary, port, data, shards, log_dir, extra
        self.proc = None
        self.starts = 0
        BROKERS.append(self)

    def start(self):
        out = open(os.path.join(self.log_dir, f"broker-{self.starts}.out"), "w+")
        err = open(os.path.join(self.log_dir, f"broker-{self.starts}.err"), "w")
        self.starts += 1
        args = [self.binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--admin", "", "--shards", str(self.shards),
                "--set", "store.kind=local", "--set", f"store.dir={self.data}"] + sum((["--set", e] for e in self.extra), [])
        self.proc = subprocess.Popen(args, stdout=out, stderr=err, env=dict(os.environ, RUST_LOG=os.environ.get("BROKER_RUST_LOG", "warn")))
        deadline = time.time() + 60
        while time.time() < deadline:
            out.seek(0)
            if "fleetmq: ready" in out.read():
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"broker exited with {self.proc.returncode}, see {err.name}")
            time.sleep(0.01)
        raise SystemExit("broker not ready in 60 s")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def client(client_id, protocol, persistent):
    """`persistent`: True (Clean Session 0 / Clean Start 0 and a Session
    Expiry Interval), False (a clean session at every connect) or None
    (paho's defaults: 3.1.1 Clean Session 1; MQTT 5 Clean Start 1 at the
    first connect only, no Session Expiry Interval)."""
    if protocol == "5":
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    elif persistent is None:
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
    else:
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=not persistent)
    c.reconnect_delay_set(min_delay=1, max_delay=1)
    return c


def connect(c, port, protocol, persistent):
    if protocol == "5" and persistent is None:
        c.connect("127.0.0.1", port, keepalive=30)
    elif protocol == "5":
        from paho.mqtt.properties import Properties
        from paho.mqtt.packettypes import PacketTypes
        props = Properties(PacketTypes.CONNECT)
        if persistent:
            props.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", port, keepalive=30, clean_start=not persistent, properties=props)
    else:
        c.connect("127.0.0.1", port, keepalive=30)


def one_run(a, run):
    work = a.dir or tempfile.mkdtemp(prefix="fleetmq-q2-paho-")
    if not a.dir and not a.keep:
        SCRATCH.append(work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    port = free_port()
    broker = Broker(a.broker, port, os.path.join(work, "data"), a.shards, work, a.set)
    broker.start()
    topic = f"q2kill/{run}"
    lock = threading.Lock()
    received = []  # (value, dup flag)
    subscribed = threading.Event()

    sub = client(f"q2-sub-{run}", a.protocol, True)

    def on_sub_connect(c, userdata, flags, reason, props):
        if not flags.session_present:
            c.subscribe(topic, qos=2)
        else:
            subscribed.set()

    def on_subscribe(c, userdata, mid, reasons, props):
        subscribed.set()

    def on_message(c, userdata, m):
        with lock:
            received.append((int(m.payload), m.dup))
        if a.sub_delay:
            time.sleep(a.sub_delay)

    sub.on_connect, sub.on_subscribe, sub.on_message = on_sub_connect, on_subscribe, on_message
    connect(sub, port, a.protocol, True)
    sub.loop_start()
    if not subscribed.wait(10):
        raise SystemExit("subscriber not subscribed in 10 s")

    pub_session = {"persistent": True, "clean": False, "default": None}[a.publisher_session]
    pub = client(f"q2-pub-{run}", a.protocol, pub_session)
    pub.max_inflight_messages_set(a.inflight)
    # Payloads paho would have published again after their PUBREL.
    caught = guard_pubrel_resends(pub, fix=not a.paho_as_is)
    # The MQTTMessageInfo of every value, by value: is_published() once
    # its PUBCOMP came (no callback: paho calls on_publish holding its own
    # lock, which publish() takes too).
    infos = []
    # --publish-when connected: values are handed to paho only while it is
    # connected and 0.5 s after its CONNACK (paho sends a value published
    # before that ahead of the ones it resends, so the order check would
    # count paho's reordering).
    up = threading.Event()

    def on_pub_connect(c, userdata, flags, reason, props):
        threading.Timer(0.5, up.set).start()

    def on_pub_disconnect(c, userdata, flags, reason, props):
        up.clear()

    pub.on_connect, pub.on_disconnect = on_pub_connect, on_pub_disconnect
    connect(pub, port, a.protocol, pub_session)
    pub.loop_start()

    stop = threading.Event()
    published = [0]

    def publish():
        interval = 1.0 / a.rate
        next_at = time.time()
        n = 0
        while not stop.is_set():
            if a.publish_when == "connected" and not up.is_set():
                up.wait(0.1)
                next_at = time.time()
                continue
            infos.append(pub.publish(topic, str(n).encode(), qos=2))
            n += 1
            published[0] = n
            next_at += interval
            delay = next_at - time.time()
            if delay > 0:
                time.sleep(delay)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    for k in range(a.kills):
        time.sleep(a.every)
        broker.kill()
        time.sleep(a.down)
        broker.start()
    time.sleep(a.every)
    stop.set()
    t.join()
    # Drain: the publisher completes what it has, the subscriber receives it.
    deadline = time.time() + a.drain
    while time.time() < deadline:
        completed = {n for n, info in enumerate(infos) if info._published}
        with lock:
            done = len(completed) == published[0] and len(set(v for v, _ in received)) >= published[0]
        if done:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # late duplicates
    pub.loop_stop()
    sub.loop_stop()
    pub.disconnect()
    sub.disconnect()
    broker.stop()

    completed = {n for n, info in enumerate(infos) if info._published}
    with lock:
        values = [v for v, _ in received]
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    dups = sorted(v for v, c in counts.items() if c > 1)
    extra = sum(c - 1 for c in counts.values())
    runs, start = [], None
    for i, v in enumerate(dups):
        if start is None:
            start = v
        if i + 1 == len(dups) or dups[i + 1] != v + 1:
            runs.append((start, v))
            start = None
    missing_completed = sorted(completed - counts.keys())
    missing_any = published[0] - len(counts)
    order, first_late = 0, []
    seen, high = set(), -1
    for i, v in enumerate(values):
        if v in seen:
            continue
        seen.add(v)
        if v < high:
            order += 1
            if len(first_late) < 3:
                first_late.append((v, high, values[max(0, i - 3):i + 3]))
        high = max(high, v)
    dup_flags = sum(1 for v, d in received if d)
    unexplained = sorted(set(dups) - {int(p) for p in caught})
    print(f"run {run}: shards {a.shards}, MQTT {a.protocol}, publisher {a.publisher_session}, {a.kills} kills: "
          f"published {published[0]}, completed {len(completed)}, received {len(values)}, distinct {len(counts)}, "
          f"duplicates {extra} (values {len(dups)}, runs {runs[:8]}{'...' if len(runs) > 8 else ''}), "
          f"missing completed {len(missing_completed)} {missing_completed[:10]}, missing any {missing_any}, "
          f"order violations {order} {first_late}, DUP-flagged receipts {dup_flags}, "
          f"paho PUBLISH after PUBREL {len(caught)}{' (published again: paho as it is)' if a.paho_as_is else ' (kept from being published again)'}"
          f"{f', duplicates not among them {unexplained}' if a.paho_as_is else ''}", flush=True)
    if not a.dir and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  logs and store in {work}")
    return extra == 0 and not missing_completed and (order == 0 or not a.check_order)


def stop_all(*_):
    for b in BROKERS:
        b.kill()
    for d in SCRATCH:
        shutil.rmtree(d, ignore_errors=True)
    if _:
        os._exit(130)


def main():
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--broker", required=True)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--every", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--down", type=float, default=0.0, help="seconds the broker stays down")
    p.add_argument("--rate", type=float, default=2000.0, help="values per second")
    p.add_argument("--inflight", type=int, default=20, help="publisher's max inflight (paho default 20)")
    p.add_argument("--protocol", choices=["3.1.1", "5"], default="3.1.1")
    p.add_argument("--publisher-session", choices=["persistent", "clean", "default"], default="persistent")
    p.add_argument("--sub-delay", type=float, default=0.0, help="seconds the subscriber spends per value")
    p.add_argument("--publish-when", choices=["always", "connected"], default="always")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--drain", type=float, default=30.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--check-order", action="store_true")
    p.add_argument("--set", action="append", default=[], help="extra broker --set KEY=VALUE")
    p.add_argument("--paho-as-is", action="store_true",
                   help="no guard: paho publishes a value again after its PUBREL (see tests/interop/paho_pubrel.py)")
    a = p.parse_args()
    ok = all([one_run(a, r) for r in range(a.runs)])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
