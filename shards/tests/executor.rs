//! glommio's executor, as patched in `vendor/glommio` (see its
//! FLEETMQ-PATCH.md): a shard must never go to sleep while tasks are
//! queued. A latency timer kept from an earlier turn can fire between
//! the executor's poll for I/O and its run of the task queues; the run
//! then gave up before running anything and the executor slept with the
//! woken tasks still queued and, when one of them was the task whose
//! timer had just fired, no timer left to wake it: the shard stopped for
//! good (the rare hang of a shard under QoS 1 ping-pong).

use std::net::UdpSocket as StdUdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A task on a short timer and a UDP ping-pong with another thread keep
/// one executor waking, running and sleeping tens of thousands of times a
/// second, so that timers come due while it is awake; both must keep
/// making progress for the whole run.
#[test]
fn an_executor_keeps_running_its_tasks_while_timers_fire_around_its_turns() {
    const RUN: Duration = Duration::from_secs(5);
    // Long enough for a busy CI machine to deschedule the thread a while.
    const STALL: Duration = Duration::from_millis(1500);
    let echo = StdUdpSocket::bind("127.0.0.1:0").expect("bind echo socket");
    echo.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let echo_addr = echo.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ticks = Arc::new(AtomicU64::new(0));
    let pongs = Arc::new(AtomicU64::new(0));

    let echo_stop = stop.clone();
    let echo_thread = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        while !echo_stop.load(Ordering::Relaxed) {
            if let Ok((n, from)) = echo.recv_from(&mut buf) {
                let _ = echo.send_to(&buf[..n], from);
            }
        }
    });

    let (ex_stop, ex_ticks, ex_pongs) = (stop.clone(), ticks.clone(), pongs.clone());
    // Detached: if the executor hangs, the test fails below rather than
    // waiting for it.
    std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::default()
            .make()
            .expect("executor")
            .run(async move {
                let timer_stop = ex_stop.clone();
                let timer = glommio::spawn_local(async move {
                    while !timer_stop.load(Ordering::Relaxed) {
                        glommio::timer::sleep(Duration::from_micros(150)).await;
                        ex_ticks.fetch_add(1, Ordering::Relaxed);
                    }
                });
                let socket = glommio::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
                let mut buf = [0u8; 16];
                while !ex_stop.load(Ordering::Relaxed) {
                    socket.send_to(b"ping", echo_addr).await.expect("send");
                    // No timeout here: a timer would wake a stopped
                    // executor and hide the hang this test looks for.
                    let reply = socket.recv_from(&mut buf).await;
                    if reply.is_ok() {
                        ex_pongs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                timer.await;
            });
    });

    let started = Instant::now();
    let (mut last_ticks, mut last_pongs, mut moved) = (0, 0, Instant::now());
    let mut stalled = None;
    while started.elapsed() < RUN {
        std::thread::sleep(Duration::from_millis(10));
        let (t, p) = (ticks.load(Ordering::Relaxed), pongs.load(Ordering::Relaxed));
        if t != last_ticks && p != last_pongs {
            (last_ticks, last_pongs, moved) = (t, p, Instant::now());
        } else if moved.elapsed() > STALL {
            stalled = Some(started.elapsed());
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    echo_thread.join().unwrap();
    assert!(
        stalled.is_none(),
        "the executor stopped at {stalled:?}: {last_ticks} timer ticks and {last_pongs} pongs, then nothing for {STALL:?}"
    );
    assert!(last_ticks > 100 && last_pongs > 100, "{last_ticks} ticks, {last_pongs} pongs");
}
