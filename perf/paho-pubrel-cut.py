#!/usr/bin/env python3
"""perf/paho-pubrel-cut.py — paho-mqtt 2.2 publishing a QoS 2 value again after
its PUBREL, against any broker that stays up (tests/interop/paho_pubrel.py).

Usage: perf/paho-pubrel-cut.py BROKER_PORT on|off CUT_SECONDS

A persistent paho QoS 2 publisher (MQTT 3.1.1 Clean Session 0, window 20,
kept full) reaches the broker on 127.0.0.1:BROKER_PORT through a TCP proxy;
a persistent QoS 2 subscriber connects directly. Three times, the proxy
drops what the broker sends for 0.2 s (PUBCOMPs lost, as a SIGKILL loses
those waiting for the store), then cuts the connection and refuses new
ones for CUT_SECONDS (more than paho's 1 s reconnect delay: two attempts
fail). Prints values published, completed, received, distinct, duplicates
and how many values paho would publish again after their PUBREL ("caught");
"on" runs paho with the guard, "off" as it is. E.g. with Mosquitto:
`mosquitto -p 18830 & perf/paho-pubrel-cut.py 18830 off 2.5`.
"""
import os, socket, sys, threading, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests', 'interop'))
from paho_pubrel import guard_pubrel_resends
broker_port, guard, cut = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
tag = f"pc{int(time.time())%100000}"
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); ls.bind(("127.0.0.1", 0)); ls.listen(16)
pport = ls.getsockname()[1]
state = {"open": True, "conns": []}
def pump(a, b, down=False):
    try:
        while True:
            d = a.recv(65536)
            if not d: break
            if down and state.get("hold"): continue  # broker -> client lost
            b.sendall(d)
    except OSError: pass
    for s in (a, b):
        try: s.close()
        except OSError: pass
def accept():
    while True:
        c, _ = ls.accept()
        if not state["open"]:
            c.close(); continue
        u = socket.create_connection(("127.0.0.1", broker_port))
        state["conns"] += [c, u]
        threading.Thread(target=pump, args=(c, u), daemon=True).start()
        threading.Thread(target=pump, args=(u, c, True), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
lock = threading.Lock(); got = []
sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{tag}-sub", protocol=mqtt.MQTTv311, clean_session=False)
def on_msg(c, u, m):
    with lock: got.append(int(m.payload))
sub.on_message = on_msg
sub.connect("127.0.0.1", broker_port); sub.loop_start(); sub.subscribe(f"{tag}/v", qos=2); time.sleep(0.5)
pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{tag}-pub", protocol=mqtt.MQTTv311, clean_session=False)
pub.reconnect_delay_set(1, 1); pub.max_inflight_messages_set(20)
caught = guard_pubrel_resends(pub, fix=guard == "on")
pub.connect("127.0.0.1", pport); pub.loop_start()
infos = []; stop = threading.Event()
def publishing():
    while not stop.is_set():
        if pub.is_connected() and len(infos) - sum(1 for i in infos if i._published) < 60:
            infos.append(pub.publish(f"{tag}/v", str(len(infos)).encode(), qos=2))
        else: time.sleep(0.0005)
t = threading.Thread(target=publishing, daemon=True); t.start()
for r in range(3):
    time.sleep(1.0)
    state["hold"] = True
    time.sleep(0.2)
    state["open"] = False
    for s in state["conns"]:
        try: s.shutdown(socket.SHUT_RDWR)
        except OSError: pass
    state["conns"] = []
    time.sleep(cut)
    state["open"] = True
    state["hold"] = False
    time.sleep(1.5)
stop.set(); t.join()
deadline = time.time() + 20
while time.time() < deadline and not (all(i._published for i in infos) and len(set(got)) >= len(infos)): time.sleep(0.1)
time.sleep(1)
with lock: vals = list(got)
dups = sorted({v for v in vals if vals.count(v) > 1})
print(f"guard {guard}: published {len(infos)} completed {sum(1 for i in infos if i._published)} received {len(vals)} distinct {len(set(vals))} duplicates {len(dups)} {dups[:8]} caught {len(caught)}")
