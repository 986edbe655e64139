//! Generations (recovery): the job's attempts, what each restores, the
//! committed checkpoints, the restart budget and what recovery cost. One
//! lock, `recovery`; while it is held only leaf locks are taken (the
//! rendezvous and per-generation slots a new generation advances). No disk
//! I/O runs under it: callers read manifests before and after.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::lock_order::{OrderedMutex, Rank};

use super::{Attempt, RoleId, RoleKind};
use crate::generation::Generation;

struct Recovery {
    generation: Generation,
    /// What the current generation restores (none: the job's start).
    restore: Option<PathBuf>,
    /// `checkpoint.resume_from`: where the job started.
    start: Option<(PathBuf, u64)>,
    /// The newest committed checkpoint and its step.
    committed: Option<(PathBuf, u64)>,
    /// Incremental checkpoints since the last full one.
    deltas_since_full: u64,
    restarts: HashMap<RoleId, u32>,
    /// Each role's restarts within `cluster.restart_window_secs`.
    budgets: HashMap<RoleId, crate::restart_budget::RestartBudget>,
    /// The highest step a worker reported in the current generation.
    high_step: u64,
    /// Generations given up → the step up to which their replayed steps
    /// are counted (a worker's last report of one may come late).
    counted_to: BTreeMap<Generation, u64>,
    /// When the current generation was started, until every role serves
    /// it, and whether it was planned (`data.validation`'s next stretch,
    /// not a death's recovery).
    noticed: Option<(Instant, bool)>,
    // Totals of this coordinator's life, for its summary.
    checkpoints_committed: u64,
    steps_replayed: u64,
    recovery_secs: f64,
}

/// A generation that just started.
#[derive(Clone, Debug)]
pub struct Started {
    pub number: Generation,
    pub reason: String,
    /// Steps that will be trained again.
    pub replayed: u64,
    pub restore: Option<PathBuf>,
}

/// What a role that outlived the previous coordinator knew, its checkpoint's
/// manifest already read (`committed`: its directory and step).
pub struct Adopted {
    pub kind: RoleKind,
    pub generation: Generation,
    pub committed: Option<(PathBuf, u64)>,
    pub step: u64,
}

/// The recovery totals of the final report.
pub struct Totals {
    pub restarts: Vec<(RoleKind, u32)>,
    pub checkpoints_committed: u64,
    pub steps_replayed: u64,
    pub recovery_secs: f64,
    pub committed: Option<PathBuf>,
}

pub struct Generations {
    recovery: OrderedMutex<Recovery>,
    /// `recovery.generation`, readable without the lock.
    current: AtomicU64,
}

impl Generations {
    /// Generation 1, from `start` (`checkpoint.resume_from`: directory, step).
    pub fn new(start: Option<(PathBuf, u64)>) -> Self {
        Generations {
            recovery: OrderedMutex::new(
                Rank::Generations,
                "generations.recovery",
                Recovery {
                    generation: Generation::FIRST,
                    restore: start.as_ref().map(|(d, _)| d.clone()),
                    start,
                    committed: None,
                    deltas_since_full: 0,
                    restarts: HashMap::new(),
                    budgets: HashMap::new(),
                    high_step: 0,
                    counted_to: BTreeMap::new(),
                    noticed: None,
                    checkpoints_committed: 0,
                    steps_replayed: 0,
                    recovery_secs: 0.0,
                },
            ),
            current: AtomicU64::new(Generation::FIRST.number()),
        }
    }

    pub fn current(&self) -> Generation {
        Generation(self.current.load(Ordering::SeqCst))
    }

    /// The current generation as roles learn it.
    pub fn attempt(&self) -> Attempt {
        let r = self.recovery.lock();
        Attempt {
            number: r.generation,
            restore: r.restore.clone(),
            committed: r.committed.as_ref().map(|(d, _)| d.clone()),
        }
    }

    /// Counts a restart of `role` against its budget (`fresh` for a
    /// role's first): an error saying how it is spent.
    pub fn count_restart(
        &self,
        role: RoleId,
        fresh: impl FnOnce() -> crate::restart_budget::RestartBudget,
    ) -> Result<(), String> {
        let mut r = self.recovery.lock();
        *r.restarts.entry(role).or_insert(0) += 1;
        let budget = r.budgets.entry(role).or_insert_with(fresh);
        budget.spend(Instant::now()).map_err(|spent| budget.spent(spent))
    }

    /// Starts the next generation: every role goes back to the last
    /// committed checkpoint. `advance` is told the new number before any
    /// role can learn it (it releases the old generation's waiters).
    /// `planned`: training goes on after a validation point; its seconds
    /// are no recovery's.
    pub fn next(&self, reason: String, planned: bool, advance: impl FnOnce(Generation)) -> Started {
        let mut r = self.recovery.lock();
        Self::next_locked(&mut r, &self.current, (reason, planned), advance)
    }

    fn next_locked(
        r: &mut Recovery,
        current: &AtomicU64,
        (reason, planned): (String, bool),
        advance: impl FnOnce(Generation),
    ) -> Started {
        let r_prev = r.generation;
        let number = r.generation.next();
        advance(number);
        r.generation = number;
        current.store(number.number(), Ordering::SeqCst);
        let (restore, step) = match (&r.committed, &r.start) {
            (Some((dir, step)), _) | (None, Some((dir, step))) => (Some(dir.clone()), *step),
            (None, None) => (None, 0),
        };
        let replayed = r.high_step.saturating_sub(step);
        r.steps_replayed += replayed;
        let counted = r.high_step.max(step);
        r.counted_to.insert(r_prev, counted);
        while r.counted_to.len() > 64 {
            r.counted_to.pop_first();
        }
        (r.restore, r.high_step) = (restore.clone(), step);
        // A death during a planned start makes it a recovery from then.
        match &mut r.noticed {
            Some((_, was_planned)) => *was_planned &= planned,
            none => *none = Some((Instant::now(), planned)),
        }
        Started { number, reason, replayed, restore }
    }

    /// A role that outlived the previous coordinator registers: its
    /// generation is over (this coordinator cannot know what the others did
    /// since); the job's committed checkpoint is the newest any such role
    /// knew. Returns the generation that starts, if one does, and steps
    /// found replayed.
    pub fn adopt(&self, known: Adopted, reason: String, advance: impl FnOnce(Generation)) -> (Option<Started>, u64) {
        let mut r = self.recovery.lock();
        if let Some((dir, step)) = known.committed
            && r.committed.as_ref().is_none_or(|(_, newest)| step > *newest)
        {
            r.committed = Some((dir, step));
        }
        let mut replayed = 0;
        if known.kind == RoleKind::Worker {
            if known.generation < r.generation {
                // Its generation was already given up (another role registered first).
                replayed = Self::late_step_locked(&mut r, known.generation, known.step);
            } else {
                r.high_step = r.high_step.max(known.step);
            }
        }
        if known.generation < r.generation {
            return (None, replayed);
        }
        r.generation = known.generation;
        (Some(Self::next_locked(&mut r, &self.current, (reason, false), advance)), replayed)
    }

    /// A worker's step in the current generation (heartbeats).
    pub fn worker_step(&self, ready: Generation, step: u64) {
        let mut r = self.recovery.lock();
        if ready == r.generation {
            r.high_step = r.high_step.max(step);
        }
    }

    /// A worker's last step in an earlier `generation` (reported once it
    /// moved on): the steps past what was counted at the rollback were
    /// trained twice. Returns how many more were found.
    pub fn late_step(&self, generation: Generation, step: u64) -> u64 {
        Self::late_step_locked(&mut self.recovery.lock(), generation, step)
    }

    fn late_step_locked(r: &mut Recovery, generation: Generation, step: u64) -> u64 {
        let Some(counted) = r.counted_to.get_mut(&generation) else { return 0 };
        let extra = step.saturating_sub(*counted);
        if extra > 0 {
            *counted = step;
            r.steps_replayed += extra;
        }
        extra
    }

    /// Every role serves `generation`: the start under way, if any, is
    /// over; its seconds, and whether it was planned (those are not
    /// counted as recovering).
    pub fn resumed(&self, generation: Generation) -> Option<(f64, bool)> {
        let mut r = self.recovery.lock();
        if r.generation != generation {
            return None;
        }
        let (since, planned) = r.noticed.take()?;
        let secs = since.elapsed().as_secs_f64();
        if !planned {
            r.recovery_secs += secs;
        }
        Some((secs, planned))
    }

    /// Whether a generation's start is under way (not every role back).
    pub fn recovering(&self) -> bool {
        self.recovery.lock().noticed.is_some()
    }

    /// The newest committed checkpoint, and how many incremental ones
    /// followed its last full one.
    pub fn committed(&self) -> (Option<(PathBuf, u64)>, u64) {
        let r = self.recovery.lock();
        (r.committed.clone(), r.deltas_since_full)
    }

    pub fn record_commit(&self, dir: PathBuf, step: u64, incremental: bool) {
        let mut r = self.recovery.lock();
        r.committed = Some((dir, step));
        r.checkpoints_committed += 1;
        r.deltas_since_full = if incremental { r.deltas_since_full + 1 } else { 0 };
    }

    pub fn totals(&self) -> Totals {
        let r = self.recovery.lock();
        Totals {
            restarts: r.restarts.iter().map(|(role, n)| (role.kind, *n)).collect(),
            checkpoints_committed: r.checkpoints_committed,
            steps_replayed: r.steps_replayed,
            recovery_secs: r.recovery_secs,
            committed: r.committed.as_ref().map(|(d, _)| d.clone()),
        }
    }
}
