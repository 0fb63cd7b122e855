#!/usr/bin/env python3
"""tests/interop/sigterm_writers.py — clients writing flat out through a SIGTERM read DISCONNECT 0x8B.

Starts `BROKER serve --shards SHARDS` (free ports, a temporary store) with a
TCP and a WebSocket listener, connects CLIENTS MQTT 5 clients on each (raw
sockets; WebSocket frames masked by hand, so only the standard library is
needed), makes every one write 1 KB QoS 0 PUBLISHes as fast as its socket
takes them while it reads, sends the broker SIGTERM, and checks that each
client read DISCONNECT with reason code 0x8B (Server shutting down,
[MQTT-3.14.4-1]: the broker's last packet) before its stream ended. With
two shards a WebSocket connection whose client identifier another shard
owns is bridged there: what that shard writes last crosses the bridge.

Prints one line per run and exits 1 when a client missed its DISCONNECT.
Usage: sigterm_writers.py BROKER [--shards 2] [--clients 2] [--runs 3]
"""

import argparse
import base64
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remaining_length(n):
    out = b""
    while True:
        digit, n = n % 128, n // 128
        out += bytes([digit | 0x80 if n else digit])
        if not n:
            return out


def packet(header, body):
    return bytes([header]) + remaining_length(len(body)) + body


def connect(client_id):
    # MQTT 5, Clean Start, Keep Alive 60, no properties.
    return packet(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x00" + struct.pack(">H", len(client_id)) + client_id)


def publish(size):
    topic = b"writers/x"
    return packet(0x30, struct.pack(">H", len(topic)) + topic + b"\x00" + b"y" * size)


def ws_frame(payload):
    mask = os.urandom(4)
    n = len(payload)
    length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
    return b"\x82" + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def open_ws(port, first):
    s = socket.create_connection(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            raise SystemExit("WebSocket upgrade refused")
        head += chunk
    s.sendall(ws_frame(first))
    return s, head.split(b"\r\n\r\n", 1)[1]


class Writer:
    def __init__(self, kind, sock, read, chunk):
        self.kind, self.sock, self.read, self.chunk = kind, sock, read, chunk
        self.unsent, self.end = b"", None
        sock.setblocking(False)

    def step(self):
        if self.end:
            return
        if not self.unsent:
            self.unsent = self.chunk
        try:
            self.unsent = self.unsent[self.sock.send(self.unsent):]
        except BlockingIOError:
            pass
        except OSError:
            pass
        try:
            data = self.sock.recv(65536)
            if data:
                self.read += data
            else:
                self.end = "end of stream"
        except BlockingIOError:
            pass
        except OSError as e:
            self.end = str(e)

    def heard(self):
        # DISCONNECT 0x8B with no properties; over WebSocket inside a frame.
        return b"\xe0\x02\x8b\x00" in self.read or b"\xe0\x01\x8b" in self.read


def one_run(broker, shards, clients, run):
    tcp, ws, admin = free_port(), free_port(), free_port()
    store = tempfile.mkdtemp(prefix="fleetmq-sigterm-")
    proc = subprocess.Popen(
        [broker, "serve", "--shards", str(shards), "--listen", f"127.0.0.1:{tcp}", "--admin", f"127.0.0.1:{admin}",
         "--set", f"store.dir={store}", "--set", f'listeners.ws=["127.0.0.1:{ws}"]'],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("fleetmq: ready"):
                break
        writers = []
        for i in range(clients):
            s = socket.create_connection(("127.0.0.1", tcp))
            s.sendall(connect(f"tcp-{run}-{i}".encode()))
            writers.append(Writer("tcp", s, b"", publish(1000) * 16))
            s, rest = open_ws(ws, connect(f"ws-{run}-{i}".encode()))
            writers.append(Writer("ws", s, rest, ws_frame(publish(1000)) * 16))
        start = time.time()
        stopped = False
        while time.time() - start < 6 and not all(w.end for w in writers):
            if not stopped and time.time() - start > 0.5:
                proc.send_signal(signal.SIGTERM)
                stopped = True
            for w in writers:
                w.step()
        missed = [f"{w.kind} ({w.end}, last bytes {w.read[-12:].hex()})" for w in writers if not w.heard()]
        print(f"run {run}: {len(writers) - len(missed)} of {len(writers)} read DISCONNECT 0x8B; exit {proc.wait(10)}"
              + (f"; missed: {missed}" if missed else ""), flush=True)
        return not missed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(store, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("broker")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    ok = all([one_run(a.broker, a.shards, a.clients, run) for run in range(a.runs)])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
