#!/usr/bin/env python3
"""perf/nats-down-flood.py — a replica's memory while NATS is down and clients
keep publishing large values (run by perf/nats-down-flood.sh).

Usage: nats-down-flood.py PORT BROKER_PID NATS_PIDS MODE
  MODE retained: each of 4 MQTT 3.1.1 connections sends 399 retained QoS 1
                 PUBLISHes of 1,000,000 bytes on new topics, without reading.
  MODE held:     one retained QoS 1 value each, then 398 QoS 0 (not
                 retained) values of 1,000,000 bytes (they wait behind it).
The NATS servers (comma-separated PIDs) are killed after the CONNACKs;
prints the broker's RSS every second for 20 s and the peak.
"""
import os, signal, socket, struct, sys, threading, time

port, pid, nats_pids, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


def rss_mb():
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024


def s(x):
    return struct.pack("!H", len(x)) + x


def vbi(n):
    out = b""
    while True:
        b, n = n % 128, n // 128
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


socks = []
for k in range(4):
    x = socket.create_connection(("127.0.0.1", port))
    body = s(b"MQTT") + bytes([4, 2]) + b"\x00\x3c" + s(b"flood%d" % k)
    x.sendall(bytes([0x10, len(body)]) + body)
    assert x.recv(4)[3] == 0, "CONNACK refused"
    socks.append(x)
print("rss before", rss_mb(), "MB", flush=True)
for p in nats_pids.split(","):
    os.kill(int(p), signal.SIGKILL)
t0, sent = time.time(), [0] * 4


def blast(k):
    x = socks[k]
    x.settimeout(30)
    for i in range(1, 400):
        if mode == "retained" or i == 1:
            body = s(b"flood/%d/%d" % (k, i)) + struct.pack("!H", i) + (bytes([k]) * 1_000_000 if mode == "retained" else b"r")
            packet = b"\x33" + vbi(len(body)) + body
        else:
            body = s(b"flood/%d/%d" % (k, i)) + bytes([k]) * 1_000_000
            packet = b"\x30" + vbi(len(body)) + body
        try:
            x.sendall(packet)
            sent[k] += 1
        except OSError:
            return


for k in range(4):
    threading.Thread(target=blast, args=(k,), daemon=True).start()
peak = 0
while time.time() - t0 < 20:
    r = rss_mb()
    peak = max(peak, r)
    print("t=%.0f s rss=%d MB sent=%s" % (time.time() - t0, r, sent), flush=True)
    time.sleep(1)
print("peak", peak, "MB")
