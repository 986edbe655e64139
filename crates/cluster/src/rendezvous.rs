//! The one meeting point of the cluster's rendezvous: a worker's gradient
//! round (S0.6), a round merge (S2), a checkpoint cut, an aggregator's
//! share of a lazy instruction (S4: only the instruction's participants
//! meet, [`Rendezvous::arrive_among`]). Members arrive at a
//! meeting (keyed by round or step) with a value; once every member has made
//! its last arrival, the member that completed it *closes* the meeting — it
//! computes the result from every member's value, outside the lock (a close
//! may write a checkpoint) — and every member receives the same result.
//!
//! It knows the job's generation: an arrival of another generation is
//! refused ([`Parted::Stale`]); a new generation releases every waiter
//! ([`Parted::NewGeneration`]) and drops the old meetings; a failure fails
//! every waiter ([`Parted::Failed`]). A waiter can tell these apart from a
//! refusal of its own arrival ([`Parted::Refused`]).
//!
//! Lock order: the rendezvous' lock is a leaf. No closure runs under it, and
//! nothing is called while it is held, so callers may hold their own locks
//! while they arrive (the coordinator advances it under `recovery`).

use std::collections::BTreeMap;
use std::time::Instant;

use parking_lot::Condvar;

use crate::lock_order::{OrderedMutex, Rank};

use crate::generation::Generation;
use crate::transport::ClusterError;

/// Why a member left a meeting without its result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parted {
    /// Its arrival was of generation `found`; the rendezvous serves `serving`.
    Stale { found: Generation, serving: Generation },
    /// Its arrival was refused: an unknown member, one arriving after its
    /// last arrival, or values that do not fit the others'.
    Refused(String),
    /// It was accepted, but generation `.0` started before the meeting closed.
    NewGeneration(Generation),
    /// The job failed.
    Failed(String),
    /// The meeting's close failed: every member of it gets the error.
    CloseFailed(String),
}

impl Parted {
    /// The cluster's error for a request of `what` (say "worker 1's
    /// gradients"), answered by `peer`.
    pub fn into_cluster_error(self, peer: &str, what: impl FnOnce() -> String) -> ClusterError {
        match self {
            Parted::Stale { found, serving } => {
                ClusterError::StaleGeneration { peer: peer.into(), what: what(), found, serving }
            }
            Parted::Refused(reason) => ClusterError::Setup(reason),
            Parted::NewGeneration(generation) => ClusterError::GenerationChanged { generation },
            Parted::Failed(reason) => ClusterError::JobFailed(reason),
            Parted::CloseFailed(reason) => ClusterError::Setup(format!("{}: {reason}", what())),
        }
    }
}

struct Meeting<A, R> {
    arrivals: Vec<Option<A>>,
    last: Vec<bool>,
    /// The members this meeting waits for (all, unless its first arrival
    /// named them: [`Rendezvous::arrive_among`]).
    expected: Vec<bool>,
    /// Set once closed; every member takes a copy.
    outcome: Option<Result<R, String>>,
    taken: usize,
}

impl<A, R> Meeting<A, R> {
    fn new(members: usize) -> Self {
        Meeting {
            arrivals: (0..members).map(|_| None).collect(),
            last: vec![false; members],
            expected: vec![true; members],
            outcome: None,
            taken: 0,
        }
    }

    /// Every expected member made its last arrival.
    fn complete(&self) -> bool {
        self.last.iter().zip(&self.expected).all(|(&last, &expected)| last || !expected)
    }

    fn all_arrived(&self) -> bool {
        self.arrivals.iter().zip(&self.expected).all(|(a, &expected)| a.is_some() || !expected)
    }

    fn expected_count(&self) -> usize {
        self.expected.iter().filter(|&&e| e).count()
    }
}

struct State<A, R> {
    generation: Generation,
    meetings: BTreeMap<u64, Meeting<A, R>>,
    failed: Option<String>,
}

/// A generation-aware, failable meeting of `members` members, keyed by a
/// number (a round, a step). `A`: what a member brings; `R`: what each gets.
pub struct Rendezvous<A, R> {
    /// What a meeting is, for errors ("round", "checkpoint").
    what: &'static str,
    members: usize,
    /// At most one meeting open at a time (a checkpoint: every worker at
    /// the same step).
    one_at_a_time: bool,
    state: OrderedMutex<State<A, R>>,
    changed: Condvar,
}

impl<A, R: Clone> Rendezvous<A, R> {
    /// Meetings of `members` members (at least one) in `generation`.
    pub fn new(what: &'static str, members: usize, generation: Generation) -> Self {
        Rendezvous {
            what,
            members: members.max(1),
            one_at_a_time: false,
            state: OrderedMutex::new(
                Rank::Leaf,
                "rendezvous",
                State { generation, meetings: BTreeMap::new(), failed: None },
            ),
            changed: Condvar::new(),
        }
    }

    /// An arrival at another meeting while one is open is refused.
    pub fn one_at_a_time(mut self) -> Self {
        self.one_at_a_time = true;
        self
    }

    pub fn members(&self) -> usize {
        self.members
    }

    pub fn generation(&self) -> Generation {
        self.state.lock().generation
    }

    /// Generation `generation` starts: every waiter of an older one is
    /// released with [`Parted::NewGeneration`] and the old meetings are
    /// dropped. An older or equal number changes nothing.
    pub fn advance(&self, generation: Generation) {
        let mut state = self.state.lock();
        if generation > state.generation {
            state.generation = generation;
            state.meetings.clear();
            self.changed.notify_all();
        }
    }

    /// The job failed: every waiter, and every later arrival, gets
    /// [`Parted::Failed`] (the first reason wins).
    pub fn fail(&self, reason: String) {
        self.state.lock().failed.get_or_insert(reason);
        self.changed.notify_all();
    }

    /// How many members have arrived at meeting `key` (and not yet taken
    /// its result): tests wait on it instead of sleeping.
    pub fn arrived(&self, key: u64) -> usize {
        let state = self.state.lock();
        state.meetings.get(&key).map_or(0, |m| m.arrivals.iter().filter(|a| a.is_some()).count())
    }

    /// Blocks until `n` members have arrived at `key` (tests).
    pub fn wait_for_arrivals(&self, key: u64, n: usize) {
        let mut state = self.state.lock();
        while state.meetings.get(&key).map_or(0, |m| m.arrivals.iter().filter(|a| a.is_some()).count()) < n {
            self.changed.wait(state.raw());
        }
    }

    /// Blocks until `n` members made their last arrival at `key` and wait
    /// for its result (tests).
    pub fn wait_for_waiters(&self, key: u64, n: usize) {
        let mut state = self.state.lock();
        while state.meetings.get(&key).map_or(0, |m| m.last.iter().filter(|&&l| l).count()) < n {
            self.changed.wait(state.raw());
        }
    }

    fn admit<'s>(
        &self,
        state: &'s mut State<A, R>,
        generation: Generation,
        key: u64,
        member: usize,
        among: Option<&[usize]>,
    ) -> Result<&'s mut Meeting<A, R>, Parted> {
        if let Some(reason) = &state.failed {
            return Err(Parted::Failed(reason.clone()));
        }
        if generation != state.generation {
            return Err(Parted::Stale { found: generation, serving: state.generation });
        }
        if member >= self.members {
            return Err(Parted::Refused(format!("worker {member}: only {} workers are expected", self.members)));
        }
        if self.one_at_a_time
            && let Some((open, _)) = state.meetings.iter().find(|(k, m)| **k != key && m.outcome.is_none())
        {
            return Err(Parted::Refused(format!(
                "worker {member}: {} at {key} while the workers gather at {open} (generation {generation})",
                self.what
            )));
        }
        let members = self.members;
        let meeting = state.meetings.entry(key).or_insert_with(|| {
            let mut meeting = Meeting::new(members);
            if let Some(among) = among {
                meeting.expected = (0..members).map(|m| among.contains(&m)).collect();
            }
            meeting
        });
        if !meeting.expected[member] {
            return Err(Parted::Refused(format!("worker {member} is not expected at {} {key}", self.what)));
        }
        if meeting.last[member] {
            return Err(Parted::Refused(format!(
                "worker {member} arrived at {} {key} after its last arrival",
                self.what
            )));
        }
        Ok(meeting)
    }

    /// Member `member` adds to its value at meeting `key`: `add` gets its
    /// value so far (none on its first arrival) and may refuse (its error
    /// becomes [`Parted::Refused`]); `others` is another member's value, to
    /// check against.
    pub fn add(
        &self,
        generation: Generation,
        key: u64,
        member: usize,
        add: impl FnOnce(&mut Option<A>, Option<&A>) -> Result<(), String>,
    ) -> Result<(), Parted> {
        let mut state = self.state.lock();
        let meeting = self.admit(&mut state, generation, key, member, None)?;
        let other = meeting.arrivals.iter().enumerate().find(|(i, a)| *i != member && a.is_some());
        let other_index = other.map(|(i, _)| i);
        let (mine, other) = match other_index {
            Some(o) if o < member => {
                let (left, right) = meeting.arrivals.split_at_mut(member);
                (&mut right[0], left[o].as_ref())
            }
            Some(o) => {
                let (left, right) = meeting.arrivals.split_at_mut(o);
                (&mut left[member], right[0].as_ref())
            }
            None => (&mut meeting.arrivals[member], None),
        };
        add(mine, other).map_err(Parted::Refused)?;
        self.changed.notify_all();
        Ok(())
    }

    /// Waits until every member has arrived at `key`, or `deadline`:
    /// whether every member has.
    pub fn wait_all_arrived(&self, generation: Generation, key: u64, deadline: Instant) -> Result<bool, Parted> {
        let mut state = self.state.lock();
        loop {
            if let Some(reason) = &state.failed {
                return Err(Parted::Failed(reason.clone()));
            }
            if state.generation != generation {
                return Err(Parted::NewGeneration(state.generation));
            }
            let all = state.meetings.get(&key).is_none_or(Meeting::all_arrived);
            if all {
                return Ok(true);
            }
            if self.changed.wait_until(state.raw(), deadline).timed_out() {
                let all = state.meetings.get(&key).is_none_or(Meeting::all_arrived);
                return Ok(all);
            }
        }
    }

    /// Member `member`'s arrival at `key` was its last: waits for every
    /// member's, and returns the meeting's result. The member whose last
    /// arrival completes the meeting runs `close` over every member's value
    /// (in member order; a member that never added one is absent), outside
    /// the lock; a close that fails or panics fails the meeting.
    pub fn finish(
        &self,
        generation: Generation,
        key: u64,
        member: usize,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
    ) -> Result<R, Parted> {
        let finished = self.finish_among(generation, key, &[member], None, close, None)?;
        finished.ok_or_else(|| Parted::Refused(format!("{} {key}: no outcome", self.what)))
    }

    /// [`finish`](Self::finish), waiting for the outcome no later than
    /// `deadline`: `None` if the meeting has not closed by then (the member's
    /// last arrival stands; [`outcome_by`](Self::outcome_by) takes the
    /// result later).
    pub fn finish_within(
        &self,
        generation: Generation,
        key: u64,
        member: usize,
        deadline: Instant,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
    ) -> Result<Option<R>, Parted> {
        self.finish_among(generation, key, &[member], None, close, Some(deadline))
    }

    /// The outcome of meeting `key`, at which one member already made its
    /// last arrival ([`finish_within`](Self::finish_within) ran out of
    /// time), waiting no later than `deadline` (`None`: not closed yet).
    pub fn outcome_by(&self, generation: Generation, key: u64, deadline: Instant) -> Result<Option<R>, Parted> {
        let state = self.state.lock();
        self.take_outcome(state, generation, key, 1, Some(deadline))
    }

    /// The last arrivals of `members` (one caller arriving for each of
    /// them), then as [`finish`](Self::finish): the caller takes the result
    /// once for all of them.
    fn finish_among(
        &self,
        generation: Generation,
        key: u64,
        members: &[usize],
        among: Option<&[usize]>,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
        deadline: Option<Instant>,
    ) -> Result<Option<R>, Parted> {
        let mut state = self.state.lock();
        for &member in members {
            self.admit(&mut state, generation, key, member, among)?;
        }
        let Some(meeting) = state.meetings.get_mut(&key) else {
            return Err(Parted::Refused(format!("{} {key}: no member arrived", self.what)));
        };
        for &member in members {
            meeting.last[member] = true;
        }
        self.changed.notify_all();
        if meeting.complete() {
            let values: Vec<A> = meeting.arrivals.iter_mut().filter_map(Option::take).collect();
            drop(state);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| close(values)))
                .unwrap_or_else(|_| Err(format!("closing {} {key} panicked", self.what)));
            state = self.state.lock();
            let current = state.generation == generation;
            match state.meetings.get_mut(&key) {
                Some(meeting) if current => meeting.outcome = Some(outcome),
                // The generation moved on while it closed: a result that
                // was made (a checkpoint written) is still its closer's.
                _ => {
                    return match (outcome, &state.failed) {
                        (_, Some(reason)) => Err(Parted::Failed(reason.clone())),
                        (Ok(result), None) => Ok(Some(result)),
                        (Err(_), None) => Err(Parted::NewGeneration(state.generation)),
                    };
                }
            }
            self.changed.notify_all();
        }
        self.take_outcome(state, generation, key, members.len(), deadline)
    }

    /// Waits for meeting `key`'s outcome (until `deadline`, if any) and
    /// takes it for `taking` members.
    fn take_outcome(
        &self,
        mut state: crate::lock_order::OrderedGuard<'_, State<A, R>>,
        generation: Generation,
        key: u64,
        taking: usize,
        deadline: Option<Instant>,
    ) -> Result<Option<R>, Parted> {
        loop {
            if let Some(reason) = &state.failed {
                return Err(Parted::Failed(reason.clone()));
            }
            if state.generation != generation {
                return Err(Parted::NewGeneration(state.generation));
            }
            let Some(meeting) = state.meetings.get_mut(&key) else {
                return Err(Parted::Refused(format!("{} {key} vanished", self.what)));
            };
            if let Some(outcome) = meeting.outcome.clone() {
                meeting.taken += taking;
                if meeting.taken >= meeting.expected_count() {
                    state.meetings.remove(&key);
                }
                return outcome.map(Some).map_err(Parted::CloseFailed);
            }
            match deadline {
                Some(deadline) if self.changed.wait_until(state.raw(), deadline).timed_out() => return Ok(None),
                Some(_) => {}
                None => self.changed.wait(state.raw()),
            }
        }
    }

    /// One arrival, the member's last, at a meeting of only the members
    /// `among` (the first arrival names them; a member outside them is
    /// refused): it closes once each of them arrived, and is dropped once
    /// each took the result.
    pub fn arrive_among(
        &self,
        generation: Generation,
        key: u64,
        member: usize,
        among: &[usize],
        value: A,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
    ) -> Result<R, Parted> {
        self.arrive_for(generation, key, &[member], among, value, close)
    }

    /// [`arrive_among`](Self::arrive_among) for several members at once
    /// (an aggregator bringing its workers' sum): `value` is theirs
    /// together, and the caller takes the result once for all of them.
    pub fn arrive_for(
        &self,
        generation: Generation,
        key: u64,
        members: &[usize],
        among: &[usize],
        value: A,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
    ) -> Result<R, Parted> {
        let Some(&first) = members.first() else {
            return Err(Parted::Refused(format!("an arrival at {} {key} for no member", self.what)));
        };
        {
            let what = self.what;
            let mut state = self.state.lock();
            for &member in members {
                let meeting = self.admit(&mut state, generation, key, member, Some(among))?;
                if meeting.arrivals[member].is_some() || members.iter().filter(|&&m| m == member).count() > 1 {
                    return Err(Parted::Refused(format!("worker {member} arrived at {what} {key} twice")));
                }
            }
            if let Some(meeting) = state.meetings.get_mut(&key) {
                meeting.arrivals[first] = Some(value);
            }
            self.changed.notify_all();
        }
        let finished = self.finish_among(generation, key, members, Some(among), close, None)?;
        finished.ok_or_else(|| Parted::Refused(format!("{} {key}: no outcome", self.what)))
    }

    /// One arrival that is also the member's last: `add`'s check, then [`finish`](Self::finish).
    pub fn arrive(
        &self,
        generation: Generation,
        key: u64,
        member: usize,
        value: A,
        fits: impl FnOnce(&A, Option<&A>) -> Result<(), String>,
        close: impl FnOnce(Vec<A>) -> Result<R, String>,
    ) -> Result<R, Parted> {
        let what = self.what;
        self.add(generation, key, member, |slot, other| {
            if slot.is_some() {
                return Err(format!("worker {member} arrived at {what} {key} twice"));
            }
            fits(&value, other)?;
            *slot = Some(value);
            Ok(())
        })?;
        self.finish(generation, key, member, close)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    type Sum = Rendezvous<u64, u64>;

    fn sum(values: Vec<u64>) -> Result<u64, String> {
        Ok(values.iter().sum())
    }

    fn any(_: &u64, _: Option<&u64>) -> Result<(), String> {
        Ok(())
    }

    /// Every member gets the same result, computed once, by the member that
    /// completed the meeting.
    #[test]
    fn every_member_gets_the_one_result_of_a_single_close() {
        let r = Arc::new(Sum::new("round", 3, Generation(1)));
        let closes = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..3)
            .map(|m| {
                let (r, closes) = (r.clone(), closes.clone());
                std::thread::spawn(move || {
                    r.arrive(Generation(1), 7, m, 10 + m as u64, any, |v| {
                        closes.fetch_add(1, Ordering::SeqCst);
                        sum(v)
                    })
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
        assert_eq!(results, vec![Ok(33), Ok(33), Ok(33)]);
        assert_eq!(closes.load(Ordering::SeqCst), 1);
        assert_eq!(r.arrived(7), 0, "a meeting every member took is gone");
    }

    /// The case a sleep-ordered test cannot see: a member already waiting
    /// when a new generation starts is *released* (NewGeneration, naming the
    /// new one), while an arrival of the old generation after that is
    /// *refused* (Stale). They are different answers.
    #[test]
    fn a_waiter_released_by_a_new_generation_is_told_apart_from_a_refused_arrival() {
        let r = Arc::new(Sum::new("round", 2, Generation(1)));
        let waiter = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 0, 0, 5, any, sum))
        };
        r.wait_for_waiters(0, 1);
        r.advance(Generation(2));
        assert_eq!(waiter.join().expect("thread"), Err(Parted::NewGeneration(Generation(2))));
        assert_eq!(
            r.arrive(Generation(1), 0, 1, 5, any, sum),
            Err(Parted::Stale { found: Generation(1), serving: Generation(2) })
        );
        assert_eq!(r.arrived(0), 0, "the old generation's meeting was dropped");
        // The new generation meets afresh.
        let other = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(2), 0, 0, 1, any, sum))
        };
        assert_eq!(r.arrive(Generation(2), 0, 1, 2, any, sum), Ok(3));
        assert_eq!(other.join().expect("thread"), Ok(3));
    }

    /// A meeting of some members only (a lazy instruction's participants
    /// at their aggregator): it closes once they all arrived, refuses any
    /// other member, and an answered meeting stays for a member that has
    /// not taken its result while the next one gathers.
    #[test]
    fn a_meeting_among_some_members_waits_for_them_only() {
        let r = Arc::new(Sum::new("instruction", 4, Generation(1)).one_at_a_time());
        let slow = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive_among(Generation(1), 1, 3, &[1, 3], 30, sum))
        };
        r.wait_for_waiters(1, 1);
        assert!(
            matches!(r.arrive_among(Generation(1), 1, 0, &[1, 3], 5, sum), Err(Parted::Refused(m)) if m.contains("not expected")),
            "member 0 is not among the meeting's"
        );
        assert_eq!(r.arrive_among(Generation(1), 1, 1, &[1, 3], 10, sum), Ok(40));
        // Member 1 goes on to the next meeting, whether or not member 3 has
        // taken its result yet (an answered meeting is no open one).
        let next = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive_among(Generation(1), 2, 1, &[1, 2], 1, sum))
        };
        r.wait_for_waiters(2, 1);
        assert_eq!(slow.join().expect("thread"), Ok(40), "the answered meeting waited for its last taker");
        assert_eq!(r.arrive_among(Generation(1), 2, 2, &[1, 2], 2, sum), Ok(3));
        assert_eq!(next.join().expect("thread"), Ok(3));
        assert_eq!((r.arrived(1), r.arrived(2)), (0, 0), "no arrivals are left behind");
    }

    #[test]
    fn a_failure_fails_every_waiter_and_every_later_arrival() {
        let r = Arc::new(Sum::new("round", 3, Generation(1)));
        let waiters: Vec<_> = (0..2)
            .map(|m| {
                let r = r.clone();
                std::thread::spawn(move || r.arrive(Generation(1), 4, m, 1, any, sum))
            })
            .collect();
        r.wait_for_waiters(4, 2);
        r.fail("worker 2 died".into());
        for w in waiters {
            assert_eq!(w.join().expect("thread"), Err(Parted::Failed("worker 2 died".into())));
        }
        assert_eq!(r.arrive(Generation(1), 5, 2, 1, any, sum), Err(Parted::Failed("worker 2 died".into())));
        r.fail("second reason".into());
        assert_eq!(
            r.arrive(Generation(1), 5, 2, 1, any, sum),
            Err(Parted::Failed("worker 2 died".into())),
            "the first wins"
        );
    }

    #[test]
    fn bad_arrivals_are_refused_without_disturbing_the_meeting() {
        let r = Arc::new(Sum::new("round", 2, Generation(3)));
        assert!(matches!(r.arrive(Generation(3), 0, 2, 1, any, sum), Err(Parted::Refused(e)) if e.contains("only 2")));
        let mismatch = |v: &u64, o: Option<&u64>| match o {
            Some(o) if o % 2 != v % 2 => Err(format!("{v} does not fit {o}")),
            _ => Ok(()),
        };
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(3), 0, 0, 2, mismatch, sum))
        };
        r.wait_for_waiters(0, 1);
        assert_eq!(r.arrive(Generation(3), 0, 1, 3, mismatch, sum), Err(Parted::Refused("3 does not fit 2".into())));
        assert_eq!(
            r.arrive(Generation(3), 0, 0, 4, any, sum),
            Err(Parted::Refused("worker 0 arrived at round 0 after its last arrival".into()))
        );
        assert_eq!(r.arrive(Generation(3), 0, 1, 4, mismatch, sum), Ok(6), "the meeting goes on");
        assert_eq!(first.join().expect("thread"), Ok(6));
    }

    /// After its last arrival a member may not add to the meeting again
    /// (it is waiting for the others).
    #[test]
    fn an_addition_after_a_members_last_arrival_is_refused() {
        let r = Arc::new(Sum::new("round", 2, Generation(1)));
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 9, 0, 1, any, sum))
        };
        r.wait_for_waiters(9, 1);
        let late = r.add(Generation(1), 9, 0, |v, _| {
            *v = Some(2);
            Ok(())
        });
        assert!(matches!(&late, Err(Parted::Refused(e)) if e.contains("after its last")), "{late:?}");
        assert_eq!(r.arrive(Generation(1), 9, 1, 1, any, sum), Ok(2));
        assert_eq!(first.join().expect("thread"), Ok(2));
    }

    /// A checkpoint meeting: every worker at the same step, and a close that
    /// fails gives every member its error.
    #[test]
    fn one_at_a_time_refuses_another_key_and_a_failed_close_reaches_everyone() {
        let r = Arc::new(Rendezvous::<u64, u64>::new("checkpoint", 2, Generation(1)).one_at_a_time());
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 100, 0, 1, any, |_| Err("disk full".into())))
        };
        r.wait_for_waiters(100, 1);
        let other = r.arrive(Generation(1), 200, 1, 1, any, sum);
        assert!(
            matches!(&other, Err(Parted::Refused(e)) if e.contains("checkpoint at 200 while the workers gather at 100")),
            "{other:?}"
        );
        assert_eq!(
            r.arrive(Generation(1), 100, 1, 1, any, |_| Err("disk full".into())),
            Err(Parted::CloseFailed("disk full".into()))
        );
        assert_eq!(first.join().expect("thread"), Err(Parted::CloseFailed("disk full".into())));
        // Closed meetings do not block the next step.
        let next = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 200, 0, 1, any, sum))
        };
        assert_eq!(r.arrive(Generation(1), 200, 1, 1, any, sum), Ok(2));
        assert_eq!(next.join().expect("thread"), Ok(2));
    }

    #[test]
    fn a_close_that_panics_fails_the_meeting_instead_of_hanging_it() {
        let r = Arc::new(Sum::new("checkpoint", 2, Generation(1)));
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 1, 0, 1, any, sum))
        };
        r.wait_for_waiters(1, 1);
        let closed = r.arrive(Generation(1), 1, 1, 1, any, |_| -> Result<u64, String> { panic!("boom") });
        assert!(matches!(&closed, Err(Parted::CloseFailed(e)) if e.contains("panicked")), "{closed:?}");
        assert!(matches!(first.join().expect("thread"), Err(Parted::CloseFailed(_))));
    }

    /// A result made while the generation moved on stays its closer's (a
    /// checkpoint that was committed is committed); the others were released.
    #[test]
    fn a_close_overtaken_by_a_new_generation_keeps_its_result_for_the_closer() {
        let r = Arc::new(Sum::new("checkpoint", 2, Generation(1)));
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.arrive(Generation(1), 1, 0, 1, any, sum))
        };
        r.wait_for_waiters(1, 1);
        let closer = r.arrive(Generation(1), 1, 1, 2, any, |v| {
            r.advance(Generation(2));
            sum(v)
        });
        assert_eq!(closer, Ok(3));
        assert_eq!(first.join().expect("thread"), Err(Parted::NewGeneration(Generation(2))));
    }

    /// Several additions per member, waiting until every member has arrived
    /// or a deadline (the round sum's patience).
    #[test]
    fn members_add_several_times_and_wait_for_the_others_or_a_deadline() {
        let r = Arc::new(Sum::new("round", 2, Generation(1)));
        let add = |v: &mut Option<u64>, _: Option<&u64>| {
            *v = Some(v.unwrap_or(0) + 1);
            Ok(())
        };
        r.add(Generation(1), 0, 0, add).expect("add");
        r.add(Generation(1), 0, 0, add).expect("add again");
        let soon = Instant::now() + Duration::from_millis(1);
        assert_eq!(r.wait_all_arrived(Generation(1), 0, soon), Ok(false), "member 1 is missing");
        r.add(Generation(1), 0, 1, add).expect("add");
        assert_eq!(r.wait_all_arrived(Generation(1), 0, Instant::now()), Ok(true));
        let first = {
            let r = r.clone();
            std::thread::spawn(move || r.finish(Generation(1), 0, 0, sum))
        };
        assert_eq!(r.finish(Generation(1), 0, 1, sum), Ok(3));
        assert_eq!(first.join().expect("thread"), Ok(3));
        r.advance(Generation(2));
        assert_eq!(r.wait_all_arrived(Generation(1), 0, Instant::now()), Err(Parted::NewGeneration(Generation(2))));
    }

    /// One arrival for several members (an aggregator bringing its
    /// workers' sum): it counts as each of them, none of them may arrive
    /// again, and its caller takes the result once for all.
    #[test]
    fn one_arrival_for_several_members_counts_as_each_of_them() {
        let r = Arc::new(Sum::new("instruction", 4, Generation(1)));
        let closes = Arc::new(AtomicUsize::new(0));
        let group = {
            let (r, closes) = (r.clone(), closes.clone());
            std::thread::spawn(move || {
                r.arrive_for(Generation(1), 5, &[0, 2], &[0, 1, 2], 10, |v| {
                    closes.fetch_add(1, Ordering::SeqCst);
                    sum(v)
                })
            })
        };
        r.wait_for_waiters(5, 2);
        assert!(
            matches!(r.arrive_among(Generation(1), 5, 2, &[0, 1, 2], 1, sum), Err(Parted::Refused(m)) if m.contains("after its last arrival")),
            "member 2 came with the group"
        );
        assert!(
            matches!(r.arrive_for(Generation(1), 5, &[1, 1], &[0, 1, 2], 1, sum), Err(Parted::Refused(m)) if m.contains("twice")),
            "one member named twice in one arrival"
        );
        let closes_too = closes.clone();
        let mine = r.arrive_among(Generation(1), 5, 1, &[0, 1, 2], 5, |v| {
            closes_too.fetch_add(1, Ordering::SeqCst);
            sum(v)
        });
        assert_eq!(mine, Ok(15));
        assert_eq!(group.join().expect("thread"), Ok(15));
        assert_eq!(closes.load(Ordering::SeqCst), 1, "closed once");
        assert_eq!(r.arrived(5), 0, "taken by the group once and by member 1: gone");
    }
}
