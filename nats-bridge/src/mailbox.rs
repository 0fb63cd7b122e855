//! A bounded queue paired with a wake signal, from one thread to a task
//! on another runtime (DESIGN.md §3: "pair every queue with a wake
//! signal").
//!
//! A glommio shard parked in io_uring wakes only through its own eventfd:
//! a plain channel send from the bridge thread would sit unseen until the
//! shard's next tick. The receiving task registers its waker here;
//! [`Mailbox::push`] wakes it. glommio wakers are safe to wake from a
//! foreign thread (they queue the task on its executor and write the
//! executor's eventfd), so the wake costs one eventfd write when the shard
//! sleeps and nothing more when it is awake.

use std::future::poll_fn;
use std::task::Poll;

use atomic_waker::AtomicWaker;
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};

/// A bounded multi-producer queue with one waiting consumer task.
#[derive(Debug)]
pub struct Mailbox<T> {
    tx: Sender<T>,
    rx: Receiver<T>,
    waker: AtomicWaker,
}

impl<T> Mailbox<T> {
    /// A mailbox holding at most `capacity` items (at least 1).
    pub fn new(capacity: usize) -> Mailbox<T> {
        let (tx, rx) = bounded(capacity.max(1));
        Mailbox { tx, rx, waker: AtomicWaker::new() }
    }

    /// Queue `item` and wake the consumer.
    ///
    /// # Errors
    /// The mailbox is full: the item is handed back, for the producer to
    /// hold and offer again (credit-based backpressure).
    pub fn push(&self, item: T) -> Result<(), T> {
        match self.tx.try_send(item) {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(TrySendError::Full(item) | TrySendError::Disconnected(item)) => {
                // Wake anyway: the consumer may be behind.
                self.waker.wake();
                Err(item)
            }
        }
    }

    /// Move every queued item to `out`; returns how many.
    pub fn drain(&self, out: &mut Vec<T>) -> usize {
        let before = out.len();
        out.extend(self.rx.try_iter());
        out.len() - before
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.rx.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Resolves once at least one item is queued.
    ///
    /// # Cancel safety
    /// Cancel safe: it takes nothing from the queue.
    pub async fn ready(&self) {
        poll_fn(|cx| {
            if !self.rx.is_empty() {
                return Poll::Ready(());
            }
            self.waker.register(cx.waker());
            // Checked again after registering: a push in between woke the
            // old waker, or none.
            if self.rx.is_empty() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_push_from_another_thread_wakes_the_waiting_task() {
        let mailbox = Arc::new(Mailbox::new(4));
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let producer = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                mailbox.push(7u32).unwrap();
            })
        };
        let got = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), mailbox.ready()).await.expect("woken");
            let mut out = Vec::new();
            mailbox.drain(&mut out);
            out
        });
        producer.join().unwrap();
        assert_eq!(got, vec![7]);
    }

    #[test]
    fn a_full_mailbox_hands_the_item_back() {
        let mailbox = Mailbox::new(1);
        mailbox.push(1u8).unwrap();
        assert_eq!(mailbox.push(2), Err(2));
        let mut out = Vec::new();
        assert_eq!(mailbox.drain(&mut out), 1);
        assert_eq!(out, vec![1]);
        assert!(mailbox.is_empty());
    }
}
