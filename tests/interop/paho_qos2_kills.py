#!/usr/bin/env python3
"""paho-mqtt 2.x QoS 2 flows in flight across SIGKILLs, the broker down long
enough for paho's reconnect to fail twice.

Usage: paho_qos2_kills.py PORT PUBLISHER_ID SUBSCRIBER_ID ROUNDS GUARD

Driven by shards/tests/e2e/paho_restart.rs over stdin/stdout, one line each.
A persistent MQTT 3.1.1 subscriber (Clean Session 0) on QoS 2 and a
persistent publisher (Clean Session 0) whose paho window (20 in flight) is
kept full of QoS 2 values 0, 1, 2, ... while it is connected. ROUNDS times:

1. once values flow and some of them wait for their PUBCOMP (PUBREL sent),
   prints `kill`; the test kills the broker with SIGKILL and writes `down`;
2. once the publisher's reconnect failed twice (connection refused), prints
   `start`; the test starts the broker again on the same port and
   `store.dir` and writes `up`; both clients reconnect by themselves.

Then the publisher stops and both drain. Checks: every value completed
(PUBCOMP) reached the subscriber, and none more than once ([MQTT-4.3.3-10],
[MQTT-4.4.0-1]: what was in flight is resumed, PUBLISH with DUP or PUBREL,
and the broker forwards a value once), and a kill did catch a PUBREL in
flight (else nothing was tested). GUARD "on" installs paho_pubrel's guard:
paho 2.2 otherwise publishes those values again after their PUBREL, as new
messages, once two reconnect attempts failed (see paho_pubrel.py); "off"
shows it. Prints one `result ...` line and `ok`, or `failed: why` (exit 1).
"""

import sys
import threading
import time

try:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
except ImportError as e:
    sys.exit(f"paho_qos2_kills: paho-mqtt 2.x is not installed ({e}); run scripts/test.sh")

from paho_pubrel import guard_pubrel_resends
from scripted import Counted, expect, fail, stop_and_count
from scripted import wait_for as wait_up_to

WAIT = 30.0
WINDOW = 20
# Values paho may hold unfinished: the window plus what waits behind it.
BACKLOG = 60


def wait_for(cond, what):
    wait_up_to(cond, what, WAIT)


def main():
    port, pub_id, sub_id, rounds, guard = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    topic = f"{pub_id}/values"
    n = Counted()
    lock, connects, drops = n.lock, n.connects, n.drops
    refused = [0]

    def client(client_id):
        return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=False)

    sub = client(sub_id)
    n.subscribe(sub, port, topic, WAIT)

    pub = client(pub_id)
    n.count(pub, "pub", topic)
    pub.reconnect_delay_set(min_delay=1, max_delay=1)
    pub.max_inflight_messages_set(WINDOW)
    caught = guard_pubrel_resends(pub, fix=guard == "on")

    def on_connect_fail(c, userdata):
        with lock:
            refused[0] += 1

    pub.on_connect_fail = on_connect_fail
    pub.connect("127.0.0.1", port, keepalive=30)
    pub.loop_start()
    wait_for(lambda: connects["pub"] == 1, "the publisher's CONNACK")

    infos = []
    stop = threading.Event()

    def completed():
        return sum(1 for i in infos if i._published)

    def publishing():
        # Keep paho's window full while it is connected.
        while not stop.is_set():
            if pub.is_connected() and len(infos) - completed() < BACKLOG:
                infos.append(pub.publish(topic, str(len(infos)).encode(), qos=2))
            else:
                time.sleep(0.001)

    def awaiting_pubcomp():
        with pub._out_message_mutex:
            return sum(1 for m in pub._out_messages.values() if m.state == mqtt.mqtt_ms_wait_for_pubcomp)

    publisher = threading.Thread(target=publishing, daemon=True)
    publisher.start()
    for _ in range(rounds):
        done_before = completed()
        wait_for(lambda: completed() >= done_before + 200 and awaiting_pubcomp() > 0, "values flowing, some PUBRELs in flight")
        with lock:
            pub_drops, sub_drops = drops["pub"], drops["sub"]
        print("kill", flush=True)
        expect("down")
        wait_for(lambda: drops["pub"] > pub_drops and drops["sub"] > sub_drops, "both clients to see the connection drop")
        with lock:
            refused_before = refused[0]
        wait_for(lambda: refused[0] >= refused_before + 2, "two failed reconnect attempts of the publisher")
        with lock:
            pub_connects, sub_connects = connects["pub"], connects["sub"]
        print("start", flush=True)
        expect("up")
        wait_for(lambda: connects["pub"] > pub_connects and connects["sub"] > sub_connects, "both clients back")
    stop.set()
    publisher.join()
    total = len(infos)

    def distinct():
        with lock:
            return len(set(n.received))

    wait_for(lambda: completed() == total and distinct() >= total, f"all {total} values completed and received")
    time.sleep(1.0)  # a duplicate would come now
    values, counts, duplicates = stop_and_count(pub, sub, lock, n.received)
    missing = sorted(set(range(total)) - set(counts))
    # Duplicates paho did not cause by publishing again after a PUBREL.
    others = sorted(set(duplicates) - {int(p) for p in caught})
    print(
        f"result published {total} received {len(values)} distinct {len(counts)} duplicates {len(duplicates)} "
        f"{duplicates[:10]} (not caught below: {others[:10]}) missing {len(missing)} "
        f"PUBLISH-after-PUBREL caught {len(caught)} (guard {guard})",
        flush=True,
    )
    if duplicates:
        fail(f"{len(duplicates)} values received more than once, e.g. {duplicates[:10]}")
    if missing:
        fail(f"{len(missing)} completed values never received, e.g. {missing[:10]}")
    if not caught:
        fail("no kill caught a QoS 2 flow between PUBREL and PUBCOMP: nothing tested")
    print("ok", flush=True)


if __name__ == "__main__":
    main()
