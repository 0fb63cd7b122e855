"""What the paho scripts driven by shards/tests/e2e/paho_restart.rs share:
the line protocol with the test (stdin/stdout) and the end of a run."""

import sys
import threading
import time


def fail(why):
    """Tell the test why the run failed, and exit 1."""
    print(f"failed: {why}", flush=True)
    sys.exit(1)


def wait_for(cond, what, timeout, or_fail=True):
    """Wait up to `timeout` s for `cond()`; on timeout fail with `what`
    (or return False when not `or_fail`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    if or_fail:
        fail(f"{what} within {timeout} s")
    return False


def expect(line):
    """Read the test's next line; fail unless it is `line`."""
    got = sys.stdin.readline().strip()
    if got != line:
        fail(f"expected {line!r} from the test, got {got!r}")


def stop_and_count(pub, sub, lock, received):
    """Stop both clients; returns the values received in order, each
    value's count and the values received more than once."""
    pub.loop_stop()
    sub.loop_stop()
    pub.disconnect()
    sub.disconnect()
    with lock:
        values = list(received)
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return values, counts, sorted(v for v, c in counts.items() if c > 1)


class Counted:
    """The clients' connections and drops by name ("sub", "pub"), the
    reasons of the drops, and the values the subscriber received, under
    one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.received = []
        self.connects = {"sub": 0, "pub": 0}
        self.drops = {"sub": 0, "pub": 0}
        self.why = []
        self.t0 = time.time()

    def count(self, c, name, topic):
        """Count the connections and drops of client `c` as `name`; the
        subscriber subscribes to `topic` at QoS 2 when its session is new."""

        def on_connect(c, userdata, flags, reason, props):
            with self.lock:
                self.connects[name] += 1
            if name == "sub" and not flags.session_present:
                c.subscribe(topic, qos=2)

        def on_disconnect(c, userdata, flags, reason, props):
            with self.lock:
                self.drops[name] += 1
                self.why.append(f"{name} dropped: {reason} ({time.time() - self.t0:.2f} s)")

        c.on_connect, c.on_disconnect = on_connect, on_disconnect

    def subscribe(self, sub, port, topic, timeout):
        """Connect the subscriber `sub` to `port` (reconnecting every second
        once it drops), keep the integer values it gets on `topic`, and wait
        up to `timeout` s for its SUBACK."""
        subscribed = threading.Event()
        self.count(sub, "sub", topic)
        sub.on_subscribe = lambda c, u, mid, reasons, props: subscribed.set()

        def on_message(c, userdata, m):
            with self.lock:
                self.received.append(int(m.payload))

        sub.on_message = on_message
        sub.reconnect_delay_set(min_delay=1, max_delay=1)
        sub.connect("127.0.0.1", port, keepalive=30)
        sub.loop_start()
        if not subscribed.wait(timeout):
            fail("the subscriber's SUBACK")
