#!/usr/bin/env python3
"""Interop test: paho-mqtt 2.x (Python) against a running fleetmq broker.

Usage: paho_test.py PORT

Runs every check over MQTT 3.1.1 and over MQTT 5: connect / subscribe /
publish at QoS 0, 1 and 2, retained messages, a will published when a
client's socket is closed without DISCONNECT, a persistent session that
gets the messages published while it was away, and, over MQTT 5, the
features paho exposes: user properties, response topic and correlation
data, content type and payload format, message expiry (reduced value and
expiry while queued), subscription identifiers, a topic alias sent by the
client, No Local, and shared subscriptions.

Exits 0 when everything passed; otherwise prints which check failed and
why, and exits 1. Run by shards/tests/e2e/interop.rs; scripts/test.sh
installs paho-mqtt.
"""

import os
import queue
import sys
import threading
import time
import traceback

try:
    import paho.mqtt
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions
except ImportError as e:
    sys.exit(f"paho_test: paho-mqtt 2.x is not installed ({e}); run scripts/test.sh")

if not paho.mqtt.__version__.startswith("2."):
    sys.exit(f"paho_test: paho-mqtt 2.x needed, found {paho.mqtt.__version__}")

WAIT = 5.0
QUIET = 0.5
HOST = "127.0.0.1"
RUN = f"paho{os.getpid()}"


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def props(packet_type, **values):
    p = Properties(packet_type)
    for name, value in values.items():
        setattr(p, name, value)
    return p


class Conn:
    """A connected paho client whose messages land in a queue."""

    def __init__(self, port, cid, v5, clean=True, expiry=None, will=None):
        self.v5 = v5
        self.cid = cid
        self.messages = queue.Queue()
        self.acks = {}
        self.cond = threading.Condition()
        self.connack = None
        protocol = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        self.c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=cid,
            protocol=protocol,
            clean_session=None if v5 else clean,
        )
        self.c.on_connect = self._on_connect
        self.c.on_message = lambda c, u, m: self.messages.put(m)
        self.c.on_subscribe = self._on_subscribe
        if will:
            topic, payload = will
            self.c.will_set(topic, payload, qos=1)
        kwargs = {}
        if v5:
            kwargs["clean_start"] = clean
            if expiry is not None:
                kwargs["properties"] = props(PacketTypes.CONNECT, SessionExpiryInterval=expiry)
        self.c.connect(HOST, port, keepalive=30, **kwargs)
        self.c.loop_start()
        with self.cond:
            self.cond.wait_for(lambda: self.connack is not None, WAIT)
        check(self.connack is not None, f"{cid}: no CONNACK within {WAIT}s")
        check(not self.connack[1].is_failure, f"{cid}: CONNACK {self.connack[1]}")

    def _on_connect(self, client, userdata, flags, reason, properties):
        with self.cond:
            self.connack = (flags, reason, properties)
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reasons, properties):
        with self.cond:
            self.acks[mid] = reasons
            self.cond.notify_all()

    @property
    def session_present(self):
        return self.connack[0].session_present

    def subscribe(self, topic, qos, no_local=False, sub_id=None):
        if self.v5:
            p = props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=sub_id) if sub_id else None
            _, mid = self.c.subscribe(topic, options=SubscribeOptions(qos=qos, noLocal=no_local), properties=p)
        else:
            _, mid = self.c.subscribe(topic, qos)
        with self.cond:
            self.cond.wait_for(lambda: mid in self.acks, WAIT)
        check(mid in self.acks, f"{self.cid}: no SUBACK for {topic}")
        granted = [r.value for r in self.acks[mid]]
        check(granted == [qos], f"{self.cid}: SUBACK for {topic} granted {granted}, wanted [{qos}]")

    def publish(self, topic, payload, qos=0, retain=False, properties=None):
        info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(WAIT)
        check(info.is_published(), f"{self.cid}: PUBLISH to {topic!r} at QoS {qos} not acknowledged")

    def expect(self, what):
        try:
            return self.messages.get(timeout=WAIT)
        except queue.Empty:
            raise Failure(f"{self.cid}: no message within {WAIT}s ({what})") from None

    def expect_none(self, what, wait=QUIET):
        try:
            m = self.messages.get(timeout=wait)
        except queue.Empty:
            return
        raise Failure(f"{self.cid}: unexpected message on {m.topic}: {m.payload!r} ({what})")

    def drain(self):
        out = []
        while True:
            try:
                out.append(self.messages.get(timeout=QUIET))
            except queue.Empty:
                return out

    def disconnect(self):
        self.c.disconnect()
        self.c.loop_stop()

    def kill(self):
        """Drops the TCP connection without DISCONNECT."""
        self.c.loop_stop()
        self.c.socket().close()


def qos_and_retained(port, v5, tag):
    t = f"{RUN}/{tag}/qos"
    sub = Conn(port, f"{RUN}-{tag}-sub", v5)
    sub.subscribe(f"{t}/#", 2)
    pub = Conn(port, f"{RUN}-{tag}-pub", v5)
    for qos in (0, 1, 2):
        pub.publish(f"{t}/{qos}", f"at {qos}", qos=qos)
        m = sub.expect(f"QoS {qos}")
        check((m.topic, m.payload, m.qos) == (f"{t}/{qos}", f"at {qos}".encode(), qos),
              f"QoS {qos}: got {m.topic} {m.payload!r} qos {m.qos}")
        check(not m.retain, "live delivery with RETAIN=1")

    retained = f"{RUN}/{tag}/retained"
    pub.publish(retained, "kept", qos=1, retain=True)
    late = Conn(port, f"{RUN}-{tag}-late", v5)
    late.subscribe(retained, 1)
    m = late.expect("retained on subscribe")
    check(m.retain and m.payload == b"kept", f"retained: {m.payload!r} retain={m.retain}")
    pub.publish(retained, b"", qos=1, retain=True)
    later = Conn(port, f"{RUN}-{tag}-later", v5)
    later.subscribe(retained, 1)
    later.expect_none("cleared retained message")
    for c in (sub, pub, late, later):
        c.disconnect()


def will(port, v5, tag):
    topic = f"{RUN}/{tag}/will"
    watcher = Conn(port, f"{RUN}-{tag}-watch", v5)
    watcher.subscribe(topic, 1)
    dying = Conn(port, f"{RUN}-{tag}-dying", v5, will=(topic, b"gone"))
    dying.kill()
    m = watcher.expect("will after an abnormal close")
    check(m.payload == b"gone", f"will payload {m.payload!r}")
    polite = Conn(port, f"{RUN}-{tag}-polite", v5, will=(topic, b"not sent"))
    polite.disconnect()
    watcher.expect_none("will after a clean DISCONNECT")
    watcher.disconnect()


def persistent_session(port, v5, tag):
    topic = f"{RUN}/{tag}/session"
    cid = f"{RUN}-{tag}-worker"
    expiry = 60 if v5 else None
    # 3.1.1 keeps the session only with clean session 0; MQTT 5 keeps it
    # for its Session Expiry Interval even after a clean start.
    first = Conn(port, cid, v5, clean=v5, expiry=expiry)
    first.subscribe(topic, 1)
    first.disconnect()
    pub = Conn(port, f"{RUN}-{tag}-spub", v5)
    for i in range(3):
        pub.publish(topic, f"while away {i}", qos=1)
    back = Conn(port, cid, v5, clean=False, expiry=expiry)
    check(back.session_present, "session present after reconnect")
    got = [m.payload.decode() for m in back.drain()]
    check(got == [f"while away {i}" for i in range(3)], f"resumed session got {got}")
    back.disconnect()
    pub.disconnect()


def shared_subscription(port, v5, tag):
    t = f"{RUN}/{tag}/shared"
    members = [Conn(port, f"{RUN}-{tag}-m{i}", v5) for i in range(2)]
    for m in members:
        m.subscribe(f"$share/{tag}workers/{t}", 1)
    pub = Conn(port, f"{RUN}-{tag}-shpub", v5)
    for i in range(10):
        pub.publish(t, str(i), qos=1)
    got = [[m.payload.decode() for m in member.drain()] for member in members]
    everything = sorted(p for g in got for p in g)
    check(everything == sorted(str(i) for i in range(10)), f"shared: each message once, got {got}")
    check(all(got), f"shared: every member gets some, got {got}")
    for c in members + [pub]:
        c.disconnect()


def v5_properties(port, tag):
    t = f"{RUN}/{tag}/props"
    sub = Conn(port, f"{RUN}-{tag}-psub", True)
    sub.subscribe(f"{t}/#", 1, sub_id=42)
    pub = Conn(port, f"{RUN}-{tag}-ppub", True)
    request = props(
        PacketTypes.PUBLISH,
        UserProperty=[("k", "v1"), ("a", "x"), ("k", "v2")],
        ResponseTopic=f"{t}/reply",
        CorrelationData=b"\x00\x01corr",
        ContentType="text/plain",
        PayloadFormatIndicator=1,
        MessageExpiryInterval=60,
    )
    pub.publish(f"{t}/req", "ping", qos=1, properties=request)
    m = sub.expect("request with properties")
    p = m.properties
    check(p.UserProperty == [("k", "v1"), ("a", "x"), ("k", "v2")], f"user properties {p.UserProperty}")
    check(p.ResponseTopic == f"{t}/reply", f"response topic {p.ResponseTopic!r}")
    check(p.CorrelationData == b"\x00\x01corr", f"correlation data {p.CorrelationData!r}")
    check(p.ContentType == "text/plain", f"content type {p.ContentType!r}")
    check(p.PayloadFormatIndicator == 1, f"payload format {p.PayloadFormatIndicator!r}")
    check(58 <= p.MessageExpiryInterval <= 60, f"message expiry {p.MessageExpiryInterval}")
    check(p.SubscriptionIdentifier == [42], f"subscription identifier {p.SubscriptionIdentifier}")

    # A reply to the response topic, carrying the correlation data back.
    sub.subscribe(f"{t}/reply", 0)
    pub.subscribe(f"{t}/reply", 0)
    sub.publish(p.ResponseTopic, "pong", qos=0,
                properties=props(PacketTypes.PUBLISH, CorrelationData=p.CorrelationData))
    r = pub.expect("reply on the response topic")
    check((r.payload, r.properties.CorrelationData) == (b"pong", b"\x00\x01corr"), "reply")
    sub.drain()

    # A topic alias set by the client, then used with an empty topic.
    pub.publish(f"{t}/aliased", "set", qos=1, properties=props(PacketTypes.PUBLISH, TopicAlias=3))
    pub.publish("", "used", qos=1, properties=props(PacketTypes.PUBLISH, TopicAlias=3))
    got = [(m.topic, m.payload.decode()) for m in (sub.expect("alias set"), sub.expect("alias used"))]
    check(got == [(f"{t}/aliased", "set"), (f"{t}/aliased", "used")], f"topic alias: {got}")

    # No Local: a client does not get its own messages back.
    sub.c.unsubscribe(f"{t}/#")
    time.sleep(0.1)
    nl = f"{t}/nolocal"
    sub.subscribe(nl, 1, no_local=True)
    sub.publish(nl, "mine", qos=1)
    pub.publish(nl, "theirs", qos=1)
    m = sub.expect("No Local")
    check(m.payload == b"theirs", f"No Local: got {m.payload!r}")
    sub.expect_none("own message with No Local")
    sub.disconnect()

    # Message expiry: a message that expires while queued is never sent.
    cid = f"{RUN}-{tag}-expiring"
    away = Conn(port, cid, True, expiry=60)
    away.subscribe(f"{t}/exp", 1)
    away.disconnect()
    pub.publish(f"{t}/exp", "short", qos=1, properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=1))
    pub.publish(f"{t}/exp", "long", qos=1, properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=100))
    time.sleep(2.1)
    back = Conn(port, cid, True, clean=False, expiry=60)
    got = back.drain()
    check([m.payload for m in got] == [b"long"], f"expiry: got {[m.payload for m in got]}")
    left = got[0].properties.MessageExpiryInterval
    check(1 <= left <= 98, f"expiry left after 2 s: {left}")
    back.disconnect()
    pub.disconnect()


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: paho_test.py PORT")
    port = int(sys.argv[1])
    checks = []
    for v5, name in ((False, "v311"), (True, "v5")):
        checks += [
            (f"{name} QoS 0/1/2 and retained", lambda v5=v5, n=name: qos_and_retained(port, v5, n)),
            (f"{name} will", lambda v5=v5, n=name: will(port, v5, n)),
            (f"{name} persistent session", lambda v5=v5, n=name: persistent_session(port, v5, n)),
            (f"{name} shared subscription", lambda v5=v5, n=name: shared_subscription(port, v5, n)),
        ]
    checks.append(("v5 properties, alias, No Local, expiry", lambda: v5_properties(port, "v5")))
    # The checks share nothing (own client ids and topics): run them at once.
    results = {}

    def run_one(name, run):
        started = time.monotonic()
        try:
            run()
            results[name] = f"ok   {name} ({time.monotonic() - started:.1f}s)"
        except Exception as e:  # noqa: BLE001 - report every failure the same way
            detail = "" if isinstance(e, Failure) else "\n" + traceback.format_exc()
            results[name] = f"FAIL {name}: {e}{detail}"

    threads = [threading.Thread(target=run_one, args=c) for c in checks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    failed = 0
    for name, _ in checks:
        line = results.get(name, f"FAIL {name}: did not finish within 60 s")
        failed += not line.startswith("ok")
        print(line)
    print(f"paho-mqtt {paho.mqtt.__version__}: {len(checks) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
