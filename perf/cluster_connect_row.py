"""perf/cluster-connect.sh's helper: one JSON row from a loadgen report
(plus fleetmq's refusal counters before and after, and the CPU ticks and
load average in the environment), or (--summary FILE) the medians per
scenario and broker."""
import json
import os
import statistics
import sys


def counters(path):
    """`fleetmq_connect_refused_total{...reason="R"...} N` lines -> {R: N}."""
    out = {}
    for line in open(path):
        labels, _, value = line.rpartition(" ")
        reason = labels.split('reason="', 1)[-1].split('"', 1)[0]
        out[reason] = out.get(reason, 0) + int(float(value))
    return out


def nats_counts(ports):
    """Summed over the NATS servers of `ports` (monitoring): messages in
    and out (/varz: clients and routes), JetStream API requests (/jsz), and
    the last sequence of each stream (the highest any server reports: the
    writes it took so far)."""
    import urllib.request
    out = {"in_msgs": 0, "out_msgs": 0, "api": 0, "streams": {}}
    for port in ports:
        get = lambda path: json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5))
        varz = get("/varz")
        out["in_msgs"] += varz.get("in_msgs", 0)
        out["out_msgs"] += varz.get("out_msgs", 0)
        jsz = get("/jsz?accounts=true&streams=true")
        out["api"] += (jsz.get("api") or {}).get("total", 0)
        for account in jsz.get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                name, last = stream["name"], stream["state"]["last_seq"]
                out["streams"][name] = max(out["streams"].get(name, 0), last)
    return out


def nats_per_connect(before, after, connected):
    """What the NATS servers did per CONNECT between two `nats_counts`."""
    row = {k: round((after[k] - before[k]) / connected, 2) for k in ("in_msgs", "out_msgs", "api")}
    row["stream_writes"] = {
        name: round((last - before["streams"].get(name, 0)) / connected, 2)
        for name, last in after["streams"].items()
        if last != before["streams"].get(name, 0)
    }
    return row


def placement(ports):
    """Which server (n0, n1, ...: index in `ports`) has fleetmq's state
    connection, and which leads KV_mqtt-sessions."""
    import urllib.request
    get = lambda port, path: json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5))
    state = [f"n{i}" for i, port in enumerate(ports)
             if any((c.get("name") or "").endswith("-state") for c in get(port, "/connz?limit=100000").get("connections") or [])]
    leader = None
    for account in get(ports[0], "/jsz?accounts=true&streams=true").get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            if stream["name"] == "KV_mqtt-sessions":
                leader = (stream.get("cluster") or {}).get("leader")
    return f"fleetmq state connection on {','.join(state) or '?'}, KV_mqtt-sessions leader {leader}"


if sys.argv[1] == "--placement":
    print(placement(sys.argv[2:]))
elif sys.argv[1] == "--nats-counts":
    print(json.dumps(nats_counts(sys.argv[2:])))
elif sys.argv[1] == "--summary":
    rows = [json.loads(line) for line in open(sys.argv[2])]
    by = {}
    for r in rows:
        by.setdefault((r["kind"], r["broker"]), []).append(r)
    print("kind        broker   runs  CONNACK/s (median)  p99 ms (median)  failed  bridge CPU/CONNECT us  load")
    rates = {}
    for (kind, broker), rs in sorted(by.items()):
        rate = statistics.median(r["connect_per_s"] or 0 for r in rs)
        rates[(kind, broker)] = rate
        p99 = statistics.median(r["p99_us"] or 0 for r in rs) / 1000
        failed = sum(r["failed"] or 0 for r in rs)
        bridge = statistics.median(r.get("bridge_cpu_us_per_connect") or 0 for r in rs)
        load = statistics.median(r.get("load") or 0 for r in rs)
        print(f"{kind:11} {broker:8} {len(rs):4}  {rate:18.0f}  {p99:15.1f}  {failed:6}  {bridge:21.1f}  {load:4.1f}")
        kib = [r["kib_per_connection"] for r in rs if r.get("kib_per_connection") is not None]
        if kib:
            rss = statistics.median(r.get("rss_after_kib") or 0 for r in rs)
            print(f"{'':11} held: broker RSS per connection {statistics.median(kib):.2f} KiB (median), RSS after {rss / 1024:.1f} MiB")
        per = [r["nats_per_connect"] for r in rs if r.get("nats_per_connect")]
        if per:
            cpu = statistics.median(r.get("nats_cpu_us_per_connect") or 0 for r in rs)
            own = statistics.median(r.get("fleetmq_cpu_us_per_connect") or 0 for r in rs)
            writes = {n: statistics.median(p["stream_writes"].get(n, 0) for p in per) for n in sorted({n for p in per for n in p["stream_writes"]})}
            print(f"{'':11} per CONNECT (medians): NATS msgs in {statistics.median(p['in_msgs'] for p in per):.1f}"
                  f" out {statistics.median(p['out_msgs'] for p in per):.1f}, JS API {statistics.median(p['api'] for p in per):.2f},"
                  f" stream writes {writes}, NATS CPU {cpu:.0f} us, fleetmq CPU {own:.0f} us")
    for kind in sorted({k for k, _ in by}):
        f, n = rates.get((kind, "fleetmq")), rates.get((kind, "nats"))
        if f and n:
            print(f"{kind}: fleetmq / nats-server = {f / n:.2f}")
        s = rates.get((kind, "single"))
        if s and n:
            print(f"{kind}: fleetmq single node (no NATS) / nats-server = {s / n:.2f}")
else:
    report = json.load(open(sys.argv[1]))
    c = report.get("connections") or {}
    row = {
        "broker": sys.argv[2], "kind": sys.argv[3], "round": int(sys.argv[4]),
        "connected": c.get("connected"), "failed": c.get("failed"),
        "connect_per_s": c.get("connect_per_s"),
        "p50_us": report["latency_us"].get("p50"), "p99_us": report["latency_us"].get("p99"),
        "errors": report.get("errors") or {},
    }
    if c.get("broker_kib_per_connection") is not None:
        row["kib_per_connection"] = c["broker_kib_per_connection"]
        row["rss_after_kib"] = c.get("broker_rss_after_kib")
    if len(sys.argv) > 6 and sys.argv[2] == "fleetmq":
        before, after = counters(sys.argv[5]), counters(sys.argv[6])
        row["refused"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    tick = float(os.environ.get("TICK", "100"))
    connected = max(c.get("connected") or 0, 1)
    for name in ("FLEETMQ", "BRIDGE", "NATS"):
        if f"CPU_{name}" in os.environ:
            row[f"cpu_{name.lower()}_s"] = int(os.environ[f"CPU_{name}"]) / tick
    if sys.argv[2] in ("fleetmq", "single") and "CPU_BRIDGE" in os.environ:
        row["bridge_cpu_us_per_connect"] = int(os.environ["CPU_BRIDGE"]) / tick / connected * 1e6
        row["fleetmq_cpu_us_per_connect"] = int(os.environ["CPU_FLEETMQ"]) / tick / connected * 1e6
    if "CPU_NATS" in os.environ:
        row["nats_cpu_us_per_connect"] = int(os.environ["CPU_NATS"]) / tick / connected * 1e6
    if os.environ.get("NATS_BEFORE") and os.environ.get("NATS_AFTER"):
        before, after = (json.load(open(os.environ[k])) for k in ("NATS_BEFORE", "NATS_AFTER"))
        row["nats_per_connect"] = nats_per_connect(before, after, connected)
    if "LOAD" in os.environ:
        row["load"] = float(os.environ["LOAD"])
    print(json.dumps(row))
