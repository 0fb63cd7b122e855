#!/usr/bin/env python3
"""bench/resume.py - the client side of bench/resume.sh (issue 24): a
persistent QoS 1 subscriber (MQTT 3.1.1, Clean Session 0: nats-server's
MQTT speaks 3.1.1 only) subscribes to `resume/#` on --sub-url and
disconnects; a publisher publishes --values QoS 1 values on --pub-url and
waits for every PUBACK; then (after the caller's hook, --between) the
subscriber connects again with Clean Session 0 on --resume-url and the
time from its CONNECT to its last value is measured.

Prints one JSON line: values, received (distinct), again (duplicates),
in_order, session_present, connack_s, first_s, last_s (from the CONNECT)
or null when not every value came within --timeout seconds.

Needs paho-mqtt 2.x (the system python3 here has 2.2).
"""
import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.parse

import paho.mqtt.client as mqtt


def hostport(url):
    u = urllib.parse.urlparse(url)
    return u.hostname, u.port


def client(cid, clean):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean, protocol=mqtt.MQTTv311)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    return c


def connect(c, url, timeout=30):
    done = threading.Event()
    out = {}

    def on_connect(_c, _u, flags, rc, _p):
        out["rc"], out["present"] = rc, flags.session_present
        done.set()

    c.on_connect = on_connect
    host, port = hostport(url)
    c.connect(host, port, keepalive=600)
    c.loop_start()
    if not done.wait(timeout) or out["rc"] != 0:
        raise SystemExit(f"resume.py: CONNECT to {url} refused or unanswered: {out}")
    return out["present"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sub-url", required=True)
    ap.add_argument("--pub-url", required=True)
    ap.add_argument("--resume-url", required=True)
    ap.add_argument("--values", type=int, default=10_000)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--between", help="a command run after the publishes, before the resume")
    ap.add_argument("--id", default=f"resume-{int(time.time() * 1000)}")
    a = ap.parse_args()

    sub = client(a.id, False)
    connect(sub, a.sub_url)
    subscribed = threading.Event()
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.subscribe("resume/#", qos=1)
    if not subscribed.wait(30):
        raise SystemExit("resume.py: no SUBACK")
    sub.disconnect()
    sub.loop_stop()

    pub = client(a.id + "-pub", True)
    connect(pub, a.pub_url)
    infos = [pub.publish("resume/v", str(n).encode(), qos=1) for n in range(a.values)]
    for info in infos:
        info.wait_for_publish(60)
    pub.disconnect()
    pub.loop_stop()
    if a.between:
        subprocess.run(a.between, shell=True, check=True)

    got, again, order_ok = set(), 0, True
    last_seen = -1
    first_at = last_at = None
    all_in = threading.Event()
    lock = threading.Lock()

    def on_message(_c, _u, m):
        nonlocal again, order_ok, last_seen, first_at, last_at
        n = int(m.payload)
        now = time.monotonic()
        with lock:
            first_at = first_at or now
            if n in got:
                again += 1
                return
            if n < last_seen:
                order_ok = False
            last_seen = n
            got.add(n)
            if len(got) == a.values:
                last_at = now
                all_in.set()

    sub = client(a.id, False)
    sub.on_message = on_message
    started = time.monotonic()
    present = connect(sub, a.resume_url)
    connack_at = time.monotonic()
    all_in.wait(a.timeout)
    sub.disconnect()
    sub.loop_stop()
    rel = lambda t: None if t is None else round(t - started, 4)
    print(json.dumps(separators=(",", ":"), obj={
        "values": a.values, "received": len(got), "again": again, "in_order": order_ok,
        "session_present": bool(present), "connack_s": rel(connack_at), "first_s": rel(first_at), "last_s": rel(last_at),
    }))
    return 0 if last_at is not None else 1


if __name__ == "__main__":
    sys.exit(main())
