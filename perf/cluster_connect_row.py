"""perf/cluster-connect.sh's helper: one JSON row from a loadgen report, or
(--summary FILE) the medians per scenario and broker."""
import json
import statistics
import sys

if sys.argv[1] == "--summary":
    rows = [json.loads(line) for line in open(sys.argv[2])]
    by = {}
    for r in rows:
        by.setdefault((r["kind"], r["broker"]), []).append(r)
    print("kind        broker   runs  CONNACK/s (median)  p99 us (median)  failed")
    for (kind, broker), rs in sorted(by.items()):
        rate = statistics.median(r["connect_per_s"] or 0 for r in rs)
        p99 = statistics.median(r["p99_us"] or 0 for r in rs)
        failed = sum(r["failed"] or 0 for r in rs)
        print(f"{kind:11} {broker:8} {len(rs):4}  {rate:18.0f}  {p99:15.0f}  {failed}")
else:
    report = json.load(open(sys.argv[1]))
    c = report.get("connections") or {}
    print(json.dumps({
        "broker": sys.argv[2], "kind": sys.argv[3], "round": int(sys.argv[4]),
        "connected": c.get("connected"), "failed": c.get("failed"),
        "connect_per_s": c.get("connect_per_s"),
        "p50_us": report["latency_us"].get("p50"), "p99_us": report["latency_us"].get("p99"),
    }))
