//! Following a KV bucket: one watch, made again after an error and resumed
//! after the last revision seen, with a backoff (watchers made in a tight
//! loop leak consumers on the server: notes/jetstream.md §2.3).

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::kv::Entry;
use futures_util::StreamExt;
use tracing::debug;

use crate::bridge::Shared;

/// Where the first watch of [`follow`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// The last value of every key (delete markers included), then every
    /// change.
    History,
    /// Changes after the bucket's current end only.
    New,
}

/// What [`follow`] hands its callback.
pub(crate) enum Seen {
    /// An entry, in revision order.
    Entry(Entry),
    /// Nothing arrived for the `quiet` period given to [`follow`].
    Quiet,
}

/// First backoff after a failed watch; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Follow `bucket` on the state connection until the bridge stops, calling
/// `seen` for every entry (and for every `quiet` period without one).
pub(crate) async fn follow(
    shared: &Shared,
    bucket: &str,
    start: Start,
    quiet: Option<Duration>,
    mut seen: impl FnMut(Seen),
) {
    let mut from: Option<u64> = None;
    let mut backoff = FIRST_BACKOFF;
    while !shared.stopping.load(Ordering::Acquire) {
        let watch = async {
            let kv = shared.state.get_key_value(bucket).await.map_err(|e| e.to_string())?;
            let watch = match (from, start) {
                (Some(revision), _) => kv.watch_all_from_revision(revision).await,
                (None, Start::History) => kv.watch_with_history(">").await,
                (None, Start::New) => {
                    let mut stream = shared.state.get_stream(format!("KV_{bucket}")).await.map_err(|e| e.to_string())?;
                    let end = stream.info().await.map_err(|e| e.to_string())?.state.last_sequence;
                    kv.watch_all_from_revision(end + 1).await
                }
            };
            watch.map_err(|e| e.to_string())
        }
        .await;
        match watch {
            Ok(mut watch) => {
                backoff = FIRST_BACKOFF;
                loop {
                    // What a slow shard has not taken bounds what is read;
                    // membership (fencing, peers) never waits behind a shard.
                    if bucket != fleetmq_core::cluster::records::bucket::MEMBERS {
                        shared.room_for_events().await;
                    }
                    let next = match quiet {
                        Some(quiet) => match tokio::time::timeout(quiet, watch.next()).await {
                            Ok(next) => next,
                            Err(_) => {
                                seen(Seen::Quiet);
                                continue;
                            }
                        },
                        None => watch.next().await,
                    };
                    let Some(Ok(entry)) = next else { break };
                    from = Some(entry.revision + 1);
                    seen(Seen::Entry(entry));
                }
            }
            Err(e) => debug!(target: "cluster", bucket, error = %e, "cluster: watch failed"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
