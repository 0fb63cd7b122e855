//! The bridge measured from a glommio shard, as the broker uses it
//! (perf/RESULTS.md): pipelined JetStream writes per second through the
//! bridge (retained puts and client identifier claims), and the wake
//! latency from the bridge's answer to the waiting glommio task.
//!
//! ```sh
//! nats-server -js -sd /tmp/js -p 4222 &
//! cargo run --release -p fleetmq-nats-bridge --example bridge_bench -- nats://127.0.0.1:4222 [OPS]
//! ```

use std::rc::Rc;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::settings::Cluster;
use fleetmq_nats_bridge::{Bridge, BridgeConfig, Request};
use hdrhistogram::Histogram;

fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let ops: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(50_000);
    let cluster = Cluster {
        replica_id: "bench".into(),
        nats_urls: vec![url],
        nats_replicas: 1,
        ..Cluster::default()
    };
    let bridge = Bridge::start(BridgeConfig {
        cluster,
        replica_id: "bench".into(),
        instance: format!("{:016x}", rand::random::<u64>()),
        started_at_ms: 0,
        shards: 1,
        owner_of: |_, _| 0,
        mesh: String::new(),
        mesh_versions: Vec::new(),
        ingest: None,
        session_log_max_age: std::time::Duration::from_secs(3600),
    })
    .expect("the bridge starts");
    let bridge = std::sync::Arc::new(bridge);
    let b = bridge.clone();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move { run(b, ops).await })
        .expect("executor")
        .join()
        .expect("bench ran");
    bridge.stop();
}

async fn run(bridge: std::sync::Arc<Bridge>, ops: usize) {
    // Wake latency: the bridge answers at once; the task measures from the
    // bridge's answer to its own wake-up.
    let mut wake = Histogram::<u64>::new(3).unwrap();
    for _ in 0..5_000 {
        let (reply, answer) = tokio::sync::oneshot::channel();
        bridge.send(Request::Ping { reply }).expect("queue");
        let answered = answer.await.expect("answer");
        let _ = wake.record(answered.elapsed().as_nanos() as u64);
        glommio::timer::sleep(Duration::from_micros(200)).await;
    }
    println!(
        "wake latency (bridge answer -> glommio task), idle shard: p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        wake.value_at_quantile(0.5) as f64 / 1e3,
        wake.value_at_quantile(0.99) as f64 / 1e3,
        wake.max() as f64 / 1e3
    );
    for (name, make) in [
        ("retained put", 0u8),
        ("client id claim (read + compare-and-set)", 1u8),
    ] {
        let started = Instant::now();
        let done = Rc::new(std::cell::Cell::new(0usize));
        let window = Rc::new(glommio::sync::Semaphore::new(4096));
        for i in 0..ops {
            let permit = window.acquire_static_permit(1).await.unwrap();
            let (bridge, done) = (bridge.clone(), done.clone());
            glommio::spawn_local(async move {
                match make {
                    0 => {
                        let (reply, answer) = tokio::sync::oneshot::channel();
                        let record = bytes::Bytes::from(format!("{{\"format\":1,\"i\":{i}}}"));
                        let topic = format!("bench/{}", i % 10_000);
                        let wait = Duration::from_secs(10);
                        bridge.send(Request::RetainedPut { topic, record: Some(record), previous: None, wait, reply: Some(reply) }).ok();
                        let _ = answer.await;
                    }
                    _ => {
                        let (reply, answer) = tokio::sync::oneshot::channel();
                        bridge.send(Request::Claim { client_id: format!("bench-{i}"), conn: i as u64, clean_start: true, reply }).ok();
                        let _ = answer.await;
                    }
                }
                done.set(done.get() + 1);
                drop(permit);
            })
            .detach();
        }
        while done.get() < ops {
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        let took = started.elapsed();
        println!("{name}: {ops} in {:.2} s = {:.0} ops/s (window 4096)", took.as_secs_f64(), ops as f64 / took.as_secs_f64());
    }
}
