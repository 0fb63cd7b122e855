//! A CONNECT's requests to JetStream (its claim, the reads of a session
//! taken up) asked again while JetStream does not answer — a bucket
//! electing its leader after a NATS server was lost, or after every one
//! came back — within the CONNECT's budget and while it still waits
//! (DESIGN.md §8): the CONNECT is answered late, not refused 0x88.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::bridge::Shared;

/// The first pause before a request JetStream did not answer is asked
/// again; each next one doubles, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest pause between two attempts of a request JetStream did not
/// answer: a CONNECT storm while a bucket elects its leader asks at most
/// once a second per CONNECT.
const RETRY_MAX: Duration = Duration::from_secs(1);

/// How long a request of a CONNECT (its claim, the reads of a session
/// taken up) is asked again while JetStream does not answer: pauses of
/// [`RETRY_FIRST`], doubling up to [`RETRY_MAX`], while
/// `cluster.connect_budget` from its start lasts (DESIGN.md §8).
pub(crate) struct Patience {
    until: Instant,
    pause: Duration,
}

impl Patience {
    /// From now, with `shared`'s `cluster.connect_budget`.
    pub(crate) fn of(shared: &Shared) -> Patience {
        Patience { until: Instant::now() + shared.config.cluster.connect_budget, pause: RETRY_FIRST }
    }

    /// The pause before the next attempt; `None` (give up) when it would
    /// end past the budget, the CONNECT no longer waits (`abandoned`), or
    /// the replica fenced.
    pub(crate) fn next(&mut self, shared: &Shared, abandoned: bool) -> Option<Duration> {
        let wait = self.pause;
        self.pause = (self.pause * 2).min(RETRY_MAX);
        (Instant::now() + wait < self.until && !abandoned && !shared.status.is_fenced()).then_some(wait)
    }
}

/// `read()` (a read of a CONNECT that takes a session up), asked again
/// while JetStream does not answer (a bucket electing its leader), while
/// the CONNECT waits for `reply` and its budget lasts
/// ([`Patience`]): answered late, not refused 0x88 (fresh-user
/// pass s47: a take-up refused after 5 s while `KV_mqtt-session-state`'s
/// leader was frozen, within a 20 s budget).
pub(crate) async fn patiently<T, F>(shared: &Shared, reply: &oneshot::Sender<Result<T, String>>, mut read: impl FnMut() -> F) -> Result<T, String>
where
    F: std::future::Future<Output = Result<T, String>>,
{
    let mut patience = Patience::of(shared);
    loop {
        match read().await {
            Ok(got) => return Ok(got),
            Err(e) => match patience.next(shared, reply.is_closed()) {
                Some(wait) => {
                    tracing::debug!(target: "cluster", error = %e, ?wait, "cluster: session read not answered: asking again");
                    tokio::time::sleep(wait).await;
                }
                None => return Err(e),
            },
        }
    }
}
