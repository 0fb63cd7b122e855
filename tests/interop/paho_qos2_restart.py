#!/usr/bin/env python3
"""paho-mqtt 2.x QoS 2 publisher and persistent subscriber across a broker SIGKILL.

Usage: paho_qos2_restart.py PORT PUBLISHER_SESSION QUEUED

Driven by shards/tests/e2e/paho_restart.rs over stdin/stdout, one line each:

1. A persistent MQTT 3.1.1 subscriber (Clean Session 0) subscribes at QoS 2;
   a MQTT 3.1.1 publisher (PUBLISHER_SESSION "default": paho's defaults,
   Clean Session 1; "persistent": Clean Session 0) publishes 100 QoS 2
   values and waits until each is completed (PUBCOMP) and received. Prints
   `kill`.
2. The test kills the broker with SIGKILL and writes `down`. Once paho has
   seen its connections drop, the publisher publishes QUEUED more values,
   which paho queues. Prints `queued`.
3. The test starts the broker again on the same port and `store.dir` and
   writes `up`. Both clients reconnect by themselves; paho then writes every
   queued value at once (its in-flight window restarts from zero after a
   reconnect), far more than the broker's Receive Maximum (1,000), which MQTT
   3.1.1 does not have.

Checks: every value reaches the subscriber exactly once ([MQTT-4.3.3-8],
[MQTT-4.3.3-10]: nothing was in flight at the kill, so even a publisher whose
session is clean has nothing to send twice), in order ([MQTT-4.6.0-6]:
first receipts), and the broker never closed the publisher's connection
(it dropped once: the kill). Prints one `result ...` line and exits 0, or
prints `failed: why` and exits 1.
"""

import sys
import time

try:
    import paho.mqtt
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
except ImportError as e:
    sys.exit(f"paho_qos2_restart: paho-mqtt 2.x is not installed ({e}); run scripts/test.sh")

from scripted import Counted, expect, fail, stop_and_count
from scripted import wait_for as wait_up_to

WARM = 100
WAIT = 60.0


def wait_for(cond, what, timeout=WAIT, or_fail=True):
    return wait_up_to(cond, what, timeout, or_fail)


def main():
    port, publisher_session, queued = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    tag = f"pq2r{port}"
    topic = f"{tag}/values"
    n = Counted()
    lock, received, connects, drops, why = n.lock, n.received, n.connects, n.drops, n.why
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{tag}-sub", clean_session=False)
    n.subscribe(sub, port, topic, WAIT)

    if publisher_session == "default":
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{tag}-pub")
    else:
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{tag}-pub", clean_session=False)
    n.count(pub, "pub", topic)
    pub.reconnect_delay_set(min_delay=1, max_delay=1)
    pub.connect("127.0.0.1", port, keepalive=30)
    pub.loop_start()
    wait_for(lambda: connects["pub"] == 1, "the publisher's CONNACK")

    infos = []

    def publish(n):
        for _ in range(n):
            infos.append(pub.publish(topic, str(len(infos)).encode(), qos=2))

    def completed():
        # is_published() raises for a value queued while disconnected.
        return sum(1 for i in infos if i._published)

    def distinct():
        with lock:
            return len(set(received))

    publish(WARM)
    wait_for(lambda: completed() == WARM and distinct() == WARM, f"{WARM} values completed and received before the kill")
    print("kill", flush=True)
    expect("down")
    wait_for(lambda: drops["pub"] == 1 and drops["sub"] == 1, "both clients to see the connection drop")
    publish(queued)
    print("queued", flush=True)
    expect("up")
    total = WARM + queued
    done = wait_for(lambda: completed() == total and distinct() == total, "", or_fail=False)
    time.sleep(1.0)  # a duplicate would come now
    with lock:
        pub_connects, pub_drops, drop_log = connects["pub"], drops["pub"], list(why)
    values, counts, duplicates = stop_and_count(pub, sub, lock, received)
    seen, first = set(), []
    for v in values:
        if v not in seen:
            seen.add(v)
            first.append(v)
    print(
        f"result received {len(values)} distinct {len(counts)} duplicates {len(duplicates)} "
        f"publisher connections {pub_connects} drops {pub_drops}: {drop_log[:4]}",
        flush=True,
    )
    if not done:
        fail(f"{total} values not completed and received within {WAIT} s after the restart: {completed()} completed, "
             f"{len(counts)} received, {len(duplicates)} of them more than once, the publisher connected {pub_connects} times")
    if duplicates:
        fail(f"{len(duplicates)} values received more than once, e.g. {duplicates[:10]}")
    if sorted(counts) != list(range(total)):
        fail(f"values missing: {sorted(set(range(total)) - set(counts))[:10]}")
    if first != list(range(total)):
        fail("values out of order")
    if pub_drops != 1 or pub_connects != 2:
        fail(f"the broker closed the publisher's connection: {pub_connects} connections, {pub_drops} drops (1 expected: the kill)")
    print("ok", flush=True)


if __name__ == "__main__":
    main()
