//! A single-threaded wake-up signal between tasks of one shard.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::task::{Context, Poll, Waker};

/// Wakes one waiting task: `notify` sets a flag and wakes the waiter;
/// `wait` returns once the flag is set and clears it. Notifications before
/// the wait are not lost; several coalesce into one wake-up (which is what
/// batches a connection's writes).
#[derive(Default)]
pub(crate) struct Signal {
    set: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Signal {
    /// Set the flag and wake the waiter, if any.
    pub(crate) fn notify(&self) {
        self.set.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Wait for a notification (returns at once if one is pending).
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is consumed only when this returns.
    pub(crate) async fn wait(&self) {
        poll_fn(|cx| self.poll_wait(cx)).await
    }

    /// Poll form of [`Signal::wait`]: `Ready` consumes the pending
    /// notification; `Pending` registers `cx`'s waker for the next one.
    pub(crate) fn poll_wait(&self, cx: &Context<'_>) -> Poll<()> {
        if self.set.replace(false) {
            return Poll::Ready(());
        }
        let mut waker = self.waker.borrow_mut();
        match &*waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => *waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
