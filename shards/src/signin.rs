//! A shard's queue of credential checks (`limits.max_connects_authenticating`,
//! DESIGN.md §9; issue 28).
//!
//! A password check is an argon2 verification (19 MiB, tens of
//! milliseconds), run off the shard on its blocking thread, one at a
//! time. Handed to that thread in arrival order, a CONNECT with the right
//! password waited behind every check queued before it: a flood of wrong
//! passwords kept devices out for as long as it lasted, or had them
//! refused as busy while its checks held every slot.
//!
//! So the checks wait here, in lanes by source address, and the next one
//! to run is taken from the lanes in turn (round robin), a lane that had
//! nothing waiting going first (as a new flow does in fq_codel); within a
//! lane, from the user name with the fewest checks waiting (then the
//! oldest). An attacker behind one address gets one check in every round,
//! however many it queues, and a device from another address waits,
//! besides the check running, only for lanes that came before it with
//! nothing waiting either (within its own lane, for other user names with
//! no more waiting than its own). Lanes order checks only: addresses need
//! not be trusted (`limits.trust_client_addresses`) for that, as nothing
//! is refused by address; behind one proxy, everyone shares a lane and
//! the user names still take turns.
//!
//! A known device (one the failed sign-in guard recognises: the user name
//! and client identifier of a sign-in that succeeded, `crate::auth`) goes
//! before every lane: behind one address with a flood of made-up user
//! names, it would otherwise wait for all of them. Its checks are bounded
//! by the guard's budget for known devices, so an impostor who knows a
//! device's identifiers gets no more than that.
//!
//! When every slot is taken, a newcomer makes room by evicting the oldest
//! waiting check of the longest lane (within its own lane, of the user
//! name with the most checks waiting), when that lane would still be the
//! longer one; the evicted CONNECT gets CONNACK 0x89 Server busy, as a
//! refusal at the limit does (a known device evicts whenever a lane has a
//! check waiting). Otherwise the newcomer is refused. So the
//! queue never holds more than the limit, and a flood refuses itself.
//!
//! A check that has not started within [`TURN_WAIT_MAX`] gets 0x89 too:
//! under a flood that outruns the blocking thread, the queue serves whom
//! it can and the rest retry, rather than waiting without bound.
//!
//! Across shards, as for pending connections (see `crate::pending`): the
//! count is the process-wide atomic of [`Gate::authenticating`]; at the
//! limit the accepting shard evicts only among its own waiting checks.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::net::IpAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use crate::limits::{Gate, Slot};
use crate::signal::Signal;

/// The longest a check waits for its turn (see the module docs); the
/// caller gives up then and answers 0x89 Server busy.
pub(crate) const TURN_WAIT_MAX: Duration = Duration::from_secs(2);

/// Checks a shard runs at once: glommio gives each shard one blocking
/// thread (pinned to the shard's CPU), so more would only queue there, in
/// arrival order.
const RUNNING_MAX: usize = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    Evicted,
}

/// One CONNECT's credential check, waiting or running.
struct Ticket {
    peer: IpAddr,
    /// A known device's: in [`Lanes::known`], not a lane.
    known: bool,
    user: Option<Box<str>>,
    state: Cell<State>,
    /// Its `max_connects_authenticating` slot; taken by the newcomer that
    /// evicts it.
    slot: Cell<Option<Slot>>,
    wake: Signal,
}

#[derive(Default)]
struct Lanes {
    /// Waiting checks by source address, oldest first; no empty lane.
    lanes: HashMap<IpAddr, VecDeque<Rc<Ticket>>>,
    /// The addresses of `lanes`, each once, in turn order.
    turns: VecDeque<IpAddr>,
    /// Lanes that had nothing waiting when their check came, oldest
    /// first: each has its next turn before `turns` (as new flows do in
    /// fq_codel), then joins `turns` if it has more.
    fresh: VecDeque<IpAddr>,
    /// Known devices' checks, oldest first: they go before the lanes.
    known: VecDeque<Rc<Ticket>>,
    running: usize,
}

/// A shard's credential checks (see the module docs).
#[derive(Default)]
pub(crate) struct SignInQueue {
    lanes: RefCell<Lanes>,
}

/// The right to run one credential check now; dropping it ends the turn
/// (or, before it came, leaves the queue) and gives the slot back.
pub(crate) struct Turn {
    queue: Rc<SignInQueue>,
    ticket: Rc<Ticket>,
}

impl SignInQueue {
    /// Wait for the turn of a check for `user` from `peer` (a `known`
    /// device's, see the module docs). `None` when
    /// every slot is taken and none can be freed for it, or when a later
    /// CONNECT evicted it while it waited: answer CONNACK 0x89 Server busy.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped wait leaves the queue.
    pub(crate) async fn turn(
        self: &Rc<Self>,
        gate: &Arc<Gate>,
        peer: IpAddr,
        user: Option<&str>,
        known: bool,
    ) -> Option<Turn> {
        let slot = match gate.authenticating() {
            Some(slot) => slot,
            None => self.evict_for(peer, user, known)?,
        };
        let ticket = Rc::new(Ticket {
            peer,
            known,
            user: user.map(Box::from),
            state: Cell::new(State::Waiting),
            slot: Cell::new(Some(slot)),
            wake: Signal::default(),
        });
        {
            let mut lanes = self.lanes.borrow_mut();
            let Lanes {
                lanes,
                fresh,
                known: first,
                ..
            } = &mut *lanes;
            if known {
                first.push_back(ticket.clone());
            } else {
                let lane = lanes.entry(peer).or_insert_with(|| {
                    fresh.push_back(peer);
                    VecDeque::new()
                });
                lane.push_back(ticket.clone());
            }
        }
        let turn = Turn {
            queue: self.clone(),
            ticket,
        };
        self.dispatch();
        poll_fn(|cx| loop {
            if turn.ticket.state.get() != State::Waiting {
                return Poll::Ready(());
            }
            if turn.ticket.wake.poll_wait(cx).is_pending() {
                return Poll::Pending;
            }
        })
        .await;
        (turn.ticket.state.get() == State::Running).then_some(turn)
    }

    /// Start waiting checks while fewer than [`RUNNING_MAX`] run: a known
    /// device's, else the next lane in turn, its user name with the fewest
    /// waiting.
    fn dispatch(&self) {
        let mut lanes = self.lanes.borrow_mut();
        while lanes.running < RUNNING_MAX {
            let Some(ticket) = lanes.known.pop_front().or_else(|| lanes.next_in_turn()) else {
                return;
            };
            lanes.running += 1;
            ticket.state.set(State::Running);
            ticket.wake.notify();
        }
    }

    /// At the limit: evict the oldest waiting check of the longest lane
    /// (of its user name with the most waiting) for a newcomer from
    /// `peer` as `user`, when that lane, or that user name within the
    /// newcomer's own lane, has more waiting than the newcomer's would
    /// with it, or when the newcomer is a `known` device; return its slot.
    fn evict_for(&self, peer: IpAddr, user: Option<&str>, known: bool) -> Option<Slot> {
        let mut lanes = self.lanes.borrow_mut();
        let (victim_peer, index) = {
            let (&victim_peer, lane) = lanes.lanes.iter().max_by_key(|(_, lane)| lane.len())?;
            let counts = user_counts(lane);
            let most = counts.values().copied().max()?;
            let fewer = if known {
                true
            } else if victim_peer == peer {
                counts.get(&user).copied().unwrap_or(0) + 1 < most
            } else {
                lanes.lanes.get(&peer).map_or(0, VecDeque::len) + 1 < lane.len()
            };
            if !fewer {
                return None;
            }
            // The oldest of the user names with the most waiting.
            let heaviest = |t: &Rc<Ticket>| counts[&t.user.as_deref()] == most;
            (victim_peer, lane.iter().position(heaviest)?)
        };
        let victim = lanes.leave(victim_peer, index);
        victim.state.set(State::Evicted);
        victim.wake.notify();
        victim.slot.take()
    }
}

impl Lanes {
    /// Take the next lane's check out: its user name with the fewest
    /// waiting, the oldest of those; the lane goes to the back of the
    /// turns.
    fn next_in_turn(&mut self) -> Option<Rc<Ticket>> {
        let peer = self.fresh.pop_front().or_else(|| self.turns.pop_front())?;
        let lane = self.lanes.get_mut(&peer).expect("a lane in turn has checks waiting");
        let ticket = lane.remove(least_waiting_user(lane)).expect("a check of the lane");
        if lane.is_empty() {
            self.lanes.remove(&peer);
        } else {
            self.turns.push_back(peer);
        }
        Some(ticket)
    }

    /// Take the waiting ticket at `index` of `peer`'s lane out.
    fn leave(&mut self, peer: IpAddr, index: usize) -> Rc<Ticket> {
        let lane = self.lanes.get_mut(&peer).expect("a waiting ticket's lane");
        let ticket = lane.remove(index).expect("a waiting ticket");
        if lane.is_empty() {
            self.lanes.remove(&peer);
            self.turns.retain(|p| *p != peer);
            self.fresh.retain(|p| *p != peer);
        }
        ticket
    }
}

/// How many checks wait in `lane` for each user name.
fn user_counts(lane: &VecDeque<Rc<Ticket>>) -> HashMap<Option<&str>, usize> {
    let mut counts = HashMap::new();
    for ticket in lane {
        *counts.entry(ticket.user.as_deref()).or_insert(0) += 1;
    }
    counts
}

/// The index of the oldest check in `lane` of a user name with the
/// fewest checks waiting.
fn least_waiting_user(lane: &VecDeque<Rc<Ticket>>) -> usize {
    let counts = user_counts(lane);
    (0..lane.len())
        .min_by_key(|&i| (counts[&lane[i].user.as_deref()], i))
        .unwrap_or(0)
}

impl Drop for Turn {
    fn drop(&mut self) {
        let ticket = &self.ticket;
        match ticket.state.get() {
            State::Waiting if ticket.known => {
                let mut lanes = self.queue.lanes.borrow_mut();
                lanes.known.retain(|t| !Rc::ptr_eq(t, ticket));
            }
            State::Waiting => {
                let mut lanes = self.queue.lanes.borrow_mut();
                let index = lanes.lanes[&ticket.peer]
                    .iter()
                    .position(|t| Rc::ptr_eq(t, ticket))
                    .expect("a waiting ticket is in its lane");
                lanes.leave(ticket.peer, index);
            }
            State::Running => {
                self.queue.lanes.borrow_mut().running -= 1;
                drop(ticket.slot.take());
                self.queue.dispatch();
            }
            State::Evicted => {}
        }
        drop(ticket.slot.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::future::{block_on, poll_once};

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// Polls a turn once: `Some(Some(turn))` if it came, `Some(None)` if
    /// refused or evicted, `None` while it waits (the future is returned
    /// boxed to poll again).
    type Waiting<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Option<Turn>> + 'a>>;

    fn ask<'a>(
        q: &'a Rc<SignInQueue>,
        gate: &'a Arc<Gate>,
        peer: IpAddr,
        user: &'a str,
    ) -> Waiting<'a> {
        Box::pin(q.turn(gate, peer, Some(user), false))
    }

    fn poll(w: &mut Waiting<'_>) -> Option<Option<Turn>> {
        block_on(poll_once(w.as_mut()))
    }

    #[test]
    fn a_device_waits_for_one_check_of_a_flooding_address_not_for_all_of_them() {
        let gate = Gate::new(10, 100, None, 1);
        let q = Rc::new(SignInQueue::default());
        let mut flood: Vec<Waiting> = (0..50).map(|_| ask(&q, &gate, ip(2), "mallory")).collect();
        let first = poll(&mut flood[0])
            .expect("the first runs at once")
            .unwrap();
        assert!(
            flood[1..].iter_mut().all(|w| poll(w).is_none()),
            "the others wait"
        );
        drop(first);
        let second = poll(&mut flood[1]).expect("the flood's next").unwrap();
        let mut device = ask(&q, &gate, ip(1), "device");
        assert!(poll(&mut device).is_none());
        drop(second);
        // The device's lane had nothing waiting: it goes before the
        // flood's, which has.
        let turn = poll(&mut device).expect("the device is next").unwrap();
        assert!(flood[2..].iter_mut().all(|w| poll(w).is_none()));
        drop(turn);
        assert!(poll(&mut flood[2]).is_some());
    }

    #[test]
    fn within_one_address_the_user_name_with_fewer_checks_goes_first() {
        let gate = Gate::new(10, 100, None, 1);
        let q = Rc::new(SignInQueue::default());
        let mut flood: Vec<Waiting> = (0..20).map(|_| ask(&q, &gate, ip(2), "mallory")).collect();
        let first = poll(&mut flood[0]).unwrap().unwrap();
        for w in &mut flood[1..] {
            assert!(poll(w).is_none());
        }
        let mut device = ask(&q, &gate, ip(2), "device");
        assert!(poll(&mut device).is_none());
        drop(first);
        assert!(poll(&mut device)
            .expect("behind one NAT, the lone user first")
            .is_some());
    }

    #[test]
    fn at_the_limit_the_longest_lane_makes_room_and_a_flood_refuses_itself() {
        let gate = Gate::new(10, 4, None, 1);
        let q = Rc::new(SignInQueue::default());
        let mut flood: Vec<Waiting> = (0..4).map(|_| ask(&q, &gate, ip(2), "mallory")).collect();
        let _running = poll(&mut flood[0]).unwrap().unwrap();
        for w in &mut flood[1..] {
            assert!(poll(w).is_none());
        }
        let mut more = ask(&q, &gate, ip(2), "mallory");
        assert!(
            matches!(poll(&mut more), Some(None)),
            "the flood's own newcomer is refused"
        );
        let mut device = ask(&q, &gate, ip(1), "device");
        assert!(poll(&mut device).is_none(), "admitted, waiting");
        assert!(
            matches!(poll(&mut flood[1]), Some(None)),
            "the oldest waiting one was evicted"
        );
        let mut second = ask(&q, &gate, ip(1), "device");
        assert!(
            matches!(poll(&mut second), Some(None)),
            "its lane would be as long as the flood's"
        );
    }

    #[test]
    fn a_known_device_goes_before_a_flood_of_made_up_user_names_from_its_own_address() {
        let gate = Gate::new(10, 20, None, 1);
        let q = Rc::new(SignInQueue::default());
        let names: Vec<String> = (0..20).map(|i| format!("guess-{i}")).collect();
        let mut flood: Vec<Waiting> = names.iter().map(|n| ask(&q, &gate, ip(2), n)).collect();
        let first = poll(&mut flood[0]).unwrap().unwrap();
        for w in &mut flood[1..] {
            assert!(poll(w).is_none());
        }
        let mut stranger = ask(&q, &gate, ip(2), "device");
        assert!(matches!(poll(&mut stranger), Some(None)), "full, and its line is the longest");
        let mut device: Waiting = Box::pin(q.turn(&gate, ip(2), Some("device"), true));
        assert!(poll(&mut device).is_none(), "in, evicting the oldest waiting guess");
        assert!(matches!(poll(&mut flood[1]), Some(None)));
        drop(first);
        assert!(poll(&mut device).expect("the known device is next").is_some());
    }

    #[test]
    fn a_dropped_wait_leaves_the_queue_and_gives_its_slot_back() {
        let gate = Gate::new(10, 2, None, 1);
        let q = Rc::new(SignInQueue::default());
        let mut a = ask(&q, &gate, ip(1), "a");
        let running = poll(&mut a).unwrap().unwrap();
        let mut b = ask(&q, &gate, ip(2), "b");
        assert!(poll(&mut b).is_none());
        drop(b);
        let lanes = q.lanes.borrow();
        assert!(lanes.lanes.is_empty() && lanes.turns.is_empty() && lanes.fresh.is_empty());
        drop(lanes);
        let mut c = ask(&q, &gate, ip(3), "c");
        assert!(poll(&mut c).is_none(), "b's slot is free again");
        drop(running);
        assert!(poll(&mut c).unwrap().is_some());
    }
}
