#!/usr/bin/env python3
"""A store full of live values left idle: how many compactions it runs.

Usage: python3 perf/store-full-idle.py BINARY PORT IDLE_SECONDS (PORT and
PORT+1, MQTT and admin, must be free). Starts BINARY serve with
store.max_bytes=4MiB, subscribes an MQTT 5 persistent session (expiry
3600) to f/# at QoS 1 and leaves it offline, publishes 1 KB values at QoS 1
until PUBACK 0x97, counts fleetmq_store_compactions_total over IDLE_SECONDS,
then resumes the session, waits for /health/ready 200 and publishes once
more. Needs paho-mqtt 2.x."""
import sys, time, subprocess, os, shutil, re, paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
binary, port, idle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
import tempfile
d = tempfile.mkdtemp(prefix="fleetmq-full-")
log = open(d + "-broker.log", "w")
b = subprocess.Popen([binary, "serve", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{port+1}",
    "--set", f"store.dir={d}", "--set", "store.max_bytes=4MiB"], stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, RUST_LOG="info"))
time.sleep(3)
def client(cid, clean):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    p = Properties(PacketTypes.CONNECT); p.SessionExpiryInterval = 3600
    c.connect("127.0.0.1", port, clean_start=clean, properties=p); c.loop_start(); time.sleep(0.5); return c
s = client("fsub", True); s.subscribe("f/#", qos=1); time.sleep(0.5); s.disconnect(); s.loop_stop()
pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fpub", protocol=mqtt.MQTTv5)
codes = []
pub.on_publish = lambda c, u, mid, rc, props: codes.append(rc.value if hasattr(rc, "value") else rc)
pub.connect("127.0.0.1", port); pub.loop_start(); time.sleep(0.5)
n = 0
while True:
    info = pub.publish("f/x", b"x" * 1000, qos=1); info.wait_for_publish(10); n += 1
    if codes and codes[-1] == 0x97: break
    if n > 20000: break
print("published", n, "last code", hex(codes[-1]))
def compactions():
    import urllib.request
    t = urllib.request.urlopen(f"http://127.0.0.1:{port+1}/metrics").read().decode()
    return float(re.search(r"^fleetmq_store_compactions_total (\S+)", t, re.M).group(1))
c0 = compactions(); t0 = time.time(); time.sleep(idle)
print(f"idle {idle:.0f} s full: {compactions() - c0:.0f} compactions")
import urllib.request
def ready():
    try: return urllib.request.urlopen(f"http://127.0.0.1:{port+1}/health/ready").status
    except Exception as e: return getattr(e, "code", e)
print("ready while full", ready())
got = []
s = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fsub", protocol=mqtt.MQTTv5)
s.on_message = lambda c, u, m: got.append(m.mid)
p = Properties(PacketTypes.CONNECT); p.SessionExpiryInterval = 3600
s.connect("127.0.0.1", port, clean_start=False, properties=p); s.loop_start()
for i in range(100):
    time.sleep(0.2)
    if ready() == 200: break
print("drained", len(got), "ready after drain", ready(), f"in {0.2*(i+1):.1f} s")
codes.clear(); pub.publish("f/x", b"after", qos=1).wait_for_publish(5); time.sleep(0.3)
print("publish after drain: code", codes)
b.terminate(); b.wait()
shutil.rmtree(d, ignore_errors=True)
print("store compacted lines:", open(d + "-broker.log").read().count("store compacted"))
os.remove(d + "-broker.log")
