//! Lazy aggregation under a scheduler (S4, `cluster.sync = "lazy"`).
//!
//! Workers train on their own replicas, iteration after iteration, and ask
//! the scheduler after each whether an aggregation instruction is out
//! ([`Lazy::poll`]); at `cluster.lazy.max_local_iterations` since the last
//! aggregation they wait for one. The scheduler issues an instruction naming
//! a round only when (a) every worker still in the job has finished at least
//! one iteration since the last instruction and (b) the cluster's conditions
//! pass ([`conditions_pass`]: network utilisation and/or probe failure rate
//! strictly below their thresholds). It decides once per monitoring interval
//! (`probe_interval_ms`): at most one instruction per interval, except that
//! a worker whose data is finished is not kept waiting. The round r it names is the newest
//! iteration every worker has (iterations since the last aggregation count
//! from 1).
//!
//! For an instruction each worker sends ([`Lazy::contribute`], a meeting of
//! the instruction's participants on the one [`Rendezvous`]) either its
//! weights' change since the last aggregation (`send = "delta"`) or the
//! gradient it computed at iteration r (`send = "round_gradient"`, the seed
//! read literally), with its coefficient (the sum of its kept samples'
//! weights since the last aggregation) and whether its data is finished.
//! Aggregator j (worker k belongs to `aggregator_of[k]`, or k mod K) sums
//! c_k·v_k over its workers; aggregator 0 adds the partial sums in
//! aggregator order and divides by Σ c_k: with coefficients that are
//! sample-weight sums an undivided sum would scale the step by the sample
//! count (the seed's 0.8·g_a + 0.7·g_b + 0.5·g_c has coefficients below 1).
//! New weights: x + mean Δ (`delta`), or x − α·mean g (`round_gradient`, α
//! the dense learning rate); they go to every worker that has not finished.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Condvar;

use crate::lock_order::{OrderedMutex, Rank};
use serde::Serialize;
use sparrow_core::config::{Combine, LazyConfig, LazySend, Utilisation};

use crate::generation::Generation;
use crate::rendezvous::{Parted, Rendezvous};
use crate::transport::ClusterError;

/// What the scheduler measured last.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Conditions {
    pub utilisation: f64,
    pub failure_rate: f64,
}

/// Why an instruction was held back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldBack {
    Utilisation,
    FailureRate,
    Both,
}

/// S4.2(b): utilisation strictly below `max_net_utilisation` and/or failure
/// rate strictly below `max_failure_rate`, as `combine` says.
pub fn conditions_pass(cfg: &LazyConfig, c: Conditions) -> Result<(), HeldBack> {
    let net = c.utilisation < cfg.max_net_utilisation;
    let failures = c.failure_rate < cfg.max_failure_rate;
    let pass = match cfg.combine {
        Combine::And => net && failures,
        Combine::Or => net || failures,
    };
    match (pass, net, failures) {
        (true, _, _) => Ok(()),
        (false, false, false) => Err(HeldBack::Both),
        (false, false, true) => Err(HeldBack::Utilisation),
        (false, true, _) => Err(HeldBack::FailureRate),
    }
}

/// S4.2 network utilisation from each role's bytes per second (sent +
/// received): `total` is Σ rate / (link × roles); `mean` is the mean of the
/// per-role ratios rate / link weighted by each role's rate (busy roles
/// count more; no traffic at all is 0).
pub fn utilisation(kind: Utilisation, rates: &[f64], link_bytes_per_sec: f64) -> f64 {
    if rates.is_empty() {
        return 0.0;
    }
    let total: f64 = rates.iter().sum();
    match kind {
        Utilisation::Total => total / (link_bytes_per_sec * rates.len() as f64),
        Utilisation::Mean if total <= 0.0 => 0.0,
        Utilisation::Mean => rates.iter().map(|r| r / link_bytes_per_sec * r).sum::<f64>() / total,
    }
}

/// The aggregators' sum: aggregator `of[k]` sums c_k·v_k (f64, worker
/// order), aggregator 0 adds the partial sums in aggregator order, and the
/// result is divided by Σ c_k. `None` when Σ c_k is 0.
pub fn aggregate(
    contributions: &[(usize, &[f32], f64)],
    of: &dyn Fn(usize) -> usize,
    aggregators: usize,
) -> Option<Vec<f64>> {
    let len = contributions.iter().map(|(_, v, _)| v.len()).max().unwrap_or(0);
    let partials: Vec<(Vec<f64>, f64)> = (0..aggregators.max(1))
        .map(|a| {
            let mine: Vec<(&[f32], f64)> = contributions
                .iter()
                .filter(|(w, _, _)| of(*w).min(aggregators.max(1) - 1) == a)
                .map(|&(_, v, c)| (v, c))
                .collect();
            partial_sum(&mine, len)
        })
        .collect();
    combine(partials.iter().map(|(s, w)| (s.as_slice(), *w)))
}

/// One aggregator's part: Σ c_k·v_k over its workers (f64, in the order
/// given: worker order) and Σ c_k.
pub fn partial_sum(contributions: &[(&[f32], f64)], len: usize) -> (Vec<f64>, f64) {
    let mut sum = vec![0f64; len];
    let mut weight = 0f64;
    for &(values, c) in contributions {
        sum.iter_mut().zip(values).for_each(|(s, &v)| *s += c * f64::from(v));
        weight += c;
    }
    (sum, weight)
}

/// The partial sums added in aggregator order and divided by Σ c; `None`
/// when Σ c is 0 (or there are none).
pub fn combine<'a>(partials: impl IntoIterator<Item = (&'a [f64], f64)>) -> Option<Vec<f64>> {
    let mut parts = partials.into_iter();
    let (first, mut weight) = parts.next()?;
    let mut total = first.to_vec();
    for (sum, w) in parts {
        total.iter_mut().zip(sum).for_each(|(t, s)| *t += s);
        weight += w;
    }
    (weight > 0.0).then(|| total.into_iter().map(|t| t / weight).collect())
}

/// A role the scheduler probes.
#[derive(Clone, Debug)]
pub struct ProbeTarget {
    pub name: String,
    /// Its slot is empty: the role died and was not replaced yet (a failure).
    pub vacant: bool,
    /// Where it answers (its metrics endpoint); `None`: not known yet (not probed).
    pub address: Option<String>,
}

/// One probe (S4.2): `GET /metrics` at `address`; true when the first byte
/// of an answer arrives within `timeout`.
pub fn probe(address: &str, token: Option<&str>, timeout: Duration) -> bool {
    use std::io::{Read, Write};
    let start = std::time::Instant::now();
    let Ok(addr) = address.parse::<std::net::SocketAddr>() else { return false };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, timeout) else { return false };
    let left = |start: std::time::Instant| timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: sparrow\r\n{auth}Connection: close\r\n\r\n");
    if stream.set_write_timeout(Some(left(start))).is_err() || stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut first = [0u8; 1];
    stream.set_read_timeout(Some(left(start))).is_ok() && matches!(stream.read(&mut first), Ok(1))
}

/// Probes every target at once; the failure rate is failed / probed
/// (a vacant slot counts as failed, a role with no address yet is not probed).
pub fn failure_rate(targets: &[ProbeTarget], token: Option<&str>, timeout: Duration) -> f64 {
    let results: Vec<Option<bool>> = std::thread::scope(|scope| {
        let handles: Vec<_> = targets
            .iter()
            .map(|t| {
                scope.spawn(move || match (&t.address, t.vacant) {
                    (_, true) => Some(false),
                    (Some(a), false) => Some(probe(a, token, timeout)),
                    (None, false) => None,
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(Some(false))).collect()
    });
    let probed = results.iter().flatten().count();
    let failed = results.iter().flatten().filter(|ok| !**ok).count();
    if probed == 0 { 0.0 } else { failed as f64 / probed as f64 }
}

/// An aggregation instruction: its number, the round it names, and the
/// workers it waits for (an aggregator process sends once its own are in).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instruction {
    pub id: u64,
    pub round: u64,
    pub participants: Vec<usize>,
}

/// What the scheduler counted (the final JSON).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct LazyReport {
    pub aggregations: u64,
    /// Iterations (batches) the workers trained locally and sent, and their samples.
    pub local_iterations: u64,
    pub samples: u64,
    /// Times an instruction that (a) allowed was held back, by condition.
    pub held_by_utilisation: u64,
    pub held_by_failure_rate: u64,
    /// Backups (serving exports) the aggregator wrote.
    pub backups: u64,
    /// The conditions when the last instruction went out.
    pub last_utilisation: f64,
    pub last_failure_rate: f64,
}

struct Pending {
    instruction: Instruction,
    /// Workers the instruction waits for.
    participants: Vec<bool>,
    /// Workers whose share was sent (themselves, or summed by their aggregator).
    sent: Vec<bool>,
}

struct State {
    /// Iterations each worker reported since its last aggregation.
    since: Vec<u64>,
    /// Workers whose data is finished and whose work is all aggregated.
    gone: Vec<bool>,
    /// Workers whose data is finished (still owing their last iterations).
    finished: Vec<bool>,
    pending: Option<Pending>,
    next_id: u64,
    /// The aggregated weights (every worker's replica after an aggregation).
    weights: Vec<f32>,
    /// Held back now (counted once per episode).
    held: Option<HeldBack>,
    /// When the last instruction went out (or the scheduler started).
    last_issued: std::time::Instant,
    /// The weights of the last backup, and backups queued but not written.
    last_backup: Option<Vec<f32>>,
    /// The step of the newest backup committed as a checkpoint.
    last_committed: Option<u64>,
    backups_pending: u64,
    /// The furthest data position among the contributions so far.
    position: sparrow_core::batch::DataPosition,
    report: LazyReport,
    failed: Option<String>,
}

/// What the scheduler is told from outside: the cluster's conditions, and
/// where its backups go.
#[derive(Default)]
struct Told {
    conditions: Conditions,
    /// Where backups go to be written (S4.6); none: not backed up.
    sink: Option<crossbeam_channel::Sender<Backup>>,
    /// Commits each backup as a checkpoint before the workers go on.
    committer: Option<BackupCommitter>,
}

/// The scheduler and the aggregators of one generation of the job.
pub struct Lazy {
    cfg: LazyConfig,
    workers: usize,
    aggregators: usize,
    learning_rate: f64,
    state: OrderedMutex<State>,
    changed: Condvar,
    /// The conditions, where backups go and what commits them.
    told: OrderedMutex<Told>,
    /// Where an instruction's participants meet with their shares (keyed
    /// by instruction): the last share in computes the new weights.
    meet: Rendezvous<Share, Submitted>,
    /// The job's batches and samples before this scheduler started (the restored checkpoint's).
    base: (u64, u64),
}

/// New weights to back up (and export for serving): the aggregation's number and the weights.
pub type Backup = (u64, Arc<Vec<f32>>);

/// What a contribution gets back: the new weights (none once its data is
/// finished) and the job's totals after the aggregation (the checkpoints'
/// step counts batches the job trained, the restored checkpoint's included).
#[derive(Clone, Debug)]
pub struct Aggregated {
    pub weights: Option<Arc<Vec<f32>>>,
    pub job_batches: u64,
    pub job_samples: u64,
    /// The aggregation was a backup committed as the checkpoint of this step.
    pub committed: Option<u64>,
}

/// A backup as a checkpoint, taken while every worker still training waits
/// in its contribution (every update pushed): a cut the job can resume from.
#[derive(Clone, Debug)]
pub struct BackupCut {
    /// The job's batches and samples trained (its checkpoint step).
    pub step: u64,
    pub samples: u64,
    /// The furthest data position among the aggregated batches.
    pub position: sparrow_core::batch::DataPosition,
    pub weights: Arc<Vec<f32>>,
}

/// Commits a [`BackupCut`] (the coordinator's checkpoint machinery).
pub type BackupCommitter = Arc<dyn Fn(&BackupCut) -> Result<(), String> + Send + Sync>;

/// ‖x − b‖₂ / ‖b‖₂, the weights' relative change since the last backup b
/// (infinite without one; a zero b counts any change as infinite).
pub fn relative_change(x: &[f32], last: Option<&[f32]>) -> f64 {
    let Some(b) = last else { return f64::INFINITY };
    let diff: f64 = x.iter().zip(b).map(|(&x, &b)| (f64::from(x) - f64::from(b)).powi(2)).sum();
    let norm: f64 = b.iter().map(|&b| f64::from(b).powi(2)).sum();
    match (diff, norm) {
        (0.0, _) => 0.0,
        (_, 0.0) => f64::INFINITY,
        (d, n) => (d / n).sqrt(),
    }
}

impl Lazy {
    /// `weights`: every replica's starting weights (flat).
    pub fn new(cfg: &LazyConfig, workers: usize, aggregators: usize, learning_rate: f64, weights: Vec<f32>) -> Self {
        let workers = workers.max(1);
        Lazy {
            cfg: cfg.clone(),
            workers,
            aggregators: aggregators.max(1),
            learning_rate,
            state: OrderedMutex::new(
                Rank::LazyState,
                "lazy.state",
                State {
                    since: vec![0; workers],
                    gone: vec![false; workers],
                    finished: vec![false; workers],
                    pending: None,
                    next_id: 1,
                    weights,
                    held: None,
                    last_issued: std::time::Instant::now(),
                    last_backup: None,
                    last_committed: None,
                    backups_pending: 0,
                    position: Default::default(),
                    report: LazyReport::default(),
                    failed: None,
                },
            ),
            changed: Condvar::new(),
            told: OrderedMutex::new(Rank::Leaf, "lazy.told", Told::default()),
            meet: Rendezvous::new("lazy instruction", workers, Generation::NONE),
            base: (0, 0),
        }
    }

    /// The job trained `batches` batches of `samples` samples before (a restored checkpoint).
    pub fn after(mut self, batches: u64, samples: u64) -> Self {
        self.base = (batches, samples);
        self
    }

    /// Commits every backup as a checkpoint through `committer` (before the
    /// workers of the aggregation go on, so it is a cut).
    pub fn commit_backups_with(&self, committer: BackupCommitter) {
        self.told.lock().committer = Some(committer);
    }

    /// Backs the aggregated weights up through `sink` when they moved by at
    /// least `backup_min_change` since the last backup.
    pub fn back_up_to(&self, sink: crossbeam_channel::Sender<Backup>) {
        self.told.lock().sink = Some(sink);
    }

    /// A queued backup was written (or failed: not counted).
    pub fn backup_done(&self, written: bool) {
        let mut state = self.state.lock();
        state.backups_pending = state.backups_pending.saturating_sub(1);
        if written {
            state.report.backups += 1;
        }
        self.changed.notify_all();
    }

    /// Checks `aggregator_of` against the job's workers and aggregators.
    pub fn check_mapping(cfg: &LazyConfig, workers: usize, aggregators: usize) -> Result<(), ClusterError> {
        let bad = |m: String| Err(ClusterError::Setup(format!("cluster.lazy.aggregator_of: {m}")));
        if aggregators == 0 {
            return Err(ClusterError::Setup("--aggregators must be at least 1".into()));
        }
        if cfg.aggregator_of.is_empty() {
            return Ok(());
        }
        if cfg.aggregator_of.len() != workers {
            return bad(format!(
                "names {} workers, the job has {workers} (every worker needs one aggregator)",
                cfg.aggregator_of.len()
            ));
        }
        if let Some((w, a)) = cfg.aggregator_of.iter().enumerate().find(|(_, a)| **a >= aggregators) {
            return bad(format!("worker {w} goes to aggregator {a}, the job has {aggregators} (0..{aggregators})"));
        }
        Ok(())
    }

    fn aggregator_of(&self, worker: usize) -> usize {
        self.cfg.aggregator_of.get(worker).copied().unwrap_or(worker % self.aggregators)
    }

    /// The scheduler's latest measurements.
    pub fn set_conditions(&self, c: Conditions) {
        self.told.lock().conditions = c;
        self.changed.notify_all();
    }

    pub fn report(&self) -> LazyReport {
        self.state.lock().report.clone()
    }

    /// A worker reports `since` iterations since its last aggregation and
    /// whether its data is `finished`; answers the instruction it must
    /// follow, if any. With `wait`, blocks until there is one (or, for a
    /// finished worker with nothing to send, returns at once: it leaves).
    pub fn poll(
        &self,
        worker: usize,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError> {
        if worker >= self.workers {
            return Err(ClusterError::Setup(format!("worker {worker}: only {} workers are expected", self.workers)));
        }
        let mut state = self.state.lock();
        state.since[worker] = since;
        state.finished[worker] |= finished;
        loop {
            if let Some(reason) = &state.failed {
                return Err(ClusterError::JobFailed(reason.clone()));
            }
            // Finished with nothing to send and owing no contribution: it leaves.
            let owes = state.pending.as_ref().is_some_and(|p| p.participants[worker] && !p.sent[worker]);
            if finished && since == 0 && !owes {
                state.gone[worker] = true;
                self.changed.notify_all();
                return Ok(None);
            }
            if let Some(p) = &state.pending {
                if p.participants[worker] && !p.sent[worker] {
                    return Ok(Some(p.instruction.clone()));
                }
            } else if let Some(i) = self.try_issue(&mut state)
                && i.participants.contains(&worker)
            {
                return Ok(Some(i));
            }
            if !wait {
                return Ok(None);
            }
            let tick = Duration::from_millis(self.cfg.probe_interval_ms.max(1));
            self.changed.wait_for(state.raw(), tick);
        }
    }

    /// Issues an instruction when (a) every worker still in has an
    /// iteration since the last one and (b) the conditions pass.
    fn try_issue(&self, state: &mut State) -> Option<Instruction> {
        let active: Vec<usize> = (0..self.workers).filter(|&w| !state.gone[w]).collect();
        if active.is_empty() || active.iter().any(|&w| state.since[w] == 0) {
            return None;
        }
        // The scheduler decides once per monitoring interval, on what it
        // measured: at most one instruction per `probe_interval_ms` (a
        // worker whose data is finished is never kept waiting for it).
        let finishing = active.iter().any(|&w| state.finished[w]);
        if !finishing && state.last_issued.elapsed() < Duration::from_millis(self.cfg.probe_interval_ms) {
            return None;
        }
        let c = self.told.lock().conditions;
        if let Err(why) = conditions_pass(&self.cfg, c) {
            if state.held != Some(why) {
                state.held = Some(why);
                match why {
                    HeldBack::Utilisation => state.report.held_by_utilisation += 1,
                    HeldBack::FailureRate => state.report.held_by_failure_rate += 1,
                    HeldBack::Both => {
                        state.report.held_by_utilisation += 1;
                        state.report.held_by_failure_rate += 1;
                    }
                }
            }
            return None;
        }
        state.held = None;
        state.last_issued = std::time::Instant::now();
        let round = active.iter().map(|&w| state.since[w]).min().unwrap_or(1);
        let participants: Vec<bool> = (0..self.workers).map(|w| !state.gone[w]).collect();
        let instruction = Instruction { id: state.next_id, round, participants: active };
        state.next_id += 1;
        state.report.last_utilisation = c.utilisation;
        state.report.last_failure_rate = c.failure_rate;
        state.pending =
            Some(Pending { instruction: instruction.clone(), participants, sent: vec![false; self.workers] });
        self.changed.notify_all();
        Some(instruction)
    }

    /// A worker's contribution to instruction `id`: blocks until every
    /// participant's is in; returns the new weights, or `None` to a worker
    /// whose data is finished (it gets none, S4.5/S4.7).
    pub fn contribute(&self, c: Contribution) -> Result<Aggregated, ClusterError> {
        let member = Member::of(&c);
        let who = format!("worker {}", c.worker);
        let done = self.submit(c.instruction, &who, vec![member], Part::Values(c.values))?;
        Ok(Aggregated { weights: (!c.finished).then_some(done.weights), ..done.aggregated })
    }

    /// Aggregator `p.aggregator`'s partial sum over its workers of an
    /// instruction (an aggregator process): blocks like [`Lazy::contribute`]
    /// and returns the new weights, which the aggregator hands to its
    /// members that have not finished.
    pub fn contribute_partial(&self, p: Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError> {
        let who = format!("aggregator {}", p.aggregator);
        if p.aggregator >= self.aggregators {
            return Err(ClusterError::Setup(format!("{who}: the job has {} aggregators", self.aggregators)));
        }
        if let Some(m) =
            p.members.iter().find(|m| m.worker >= self.workers || self.aggregator_of(m.worker) != p.aggregator)
        {
            return Err(ClusterError::Setup(format!("{who}: worker {} does not belong to it", m.worker)));
        }
        let done = self.submit(p.instruction, &who, p.members, Part::Sum(p.aggregator, p.sum, p.weight))?;
        Ok((done.aggregated, done.weights))
    }

    /// Records `members`' share of instruction `id` (their values, or their
    /// aggregator's sum of them) and meets the other participants: the last
    /// share in computes the new weights (and commits a backup, the others
    /// waiting meanwhile: a cut); every caller gets them.
    fn submit(&self, id: u64, who: &str, members: Vec<Member>, part: Part) -> Result<Submitted, ClusterError> {
        let among = {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            if let Some(reason) = &state.failed {
                return Err(ClusterError::JobFailed(reason.clone()));
            }
            let Some(p) = state.pending.as_mut().filter(|p| p.instruction.id == id) else {
                return Err(ClusterError::Setup(format!("{who}: instruction {id} is not the one out")));
            };
            for m in &members {
                if !p.participants.get(m.worker).copied().unwrap_or(false) || p.sent[m.worker] {
                    return Err(ClusterError::Setup(format!(
                        "{who}: worker {} is not expected for instruction {id}",
                        m.worker
                    )));
                }
                if !(m.coefficient.is_finite() && m.coefficient >= 0.0) {
                    return Err(ClusterError::Setup(format!(
                        "{who}: worker {} coefficient {}",
                        m.worker, m.coefficient
                    )));
                }
            }
            let len = match &part {
                Part::Values(v) => v.len(),
                Part::Sum(_, v, _) => v.len(),
            };
            if len != state.weights.len() {
                return Err(ClusterError::Setup(format!(
                    "{who}: {len} values for {} dense weights",
                    state.weights.len()
                )));
            }
            for m in &members {
                p.sent[m.worker] = true;
                state.since[m.worker] = 0;
                state.position = state.position.later(m.position);
                state.report.local_iterations += m.iterations;
                state.report.samples += m.samples;
            }
            p.instruction.participants.clone()
        };
        let ids: Vec<usize> = members.iter().map(|m| m.worker).collect();
        let share = Share { part, members };
        self.meet.arrive_for(Generation::NONE, id, &ids, &among, share, |shares| self.close(shares)).map_err(|parted| {
            match parted {
                Parted::Refused(reason) => ClusterError::Setup(format!("{who}: {reason}")),
                other => {
                    other.into_cluster_error("the lazy scheduler", || format!("{who}'s share of instruction {id}"))
                }
            }
        })
    }

    /// Every participant's share is in: the new weights (and a backup,
    /// committed as a checkpoint before anyone goes on); the instruction is
    /// done, so the next may go out.
    fn close(&self, shares: Vec<Share>) -> Result<Submitted, String> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        // By worker and by aggregator, whatever order the shares came in:
        // the sums run in that order on every run.
        let mut values: Vec<Option<(Vec<f32>, f64)>> = (0..self.workers).map(|_| None).collect();
        let mut partials: Vec<Option<(Vec<f64>, f64)>> = vec![None; self.aggregators];
        for share in shares {
            for m in &share.members {
                if m.finished {
                    state.gone[m.worker] = true;
                }
            }
            match share.part {
                Part::Values(v) => {
                    let m = share.members.first().ok_or("a worker's share names no worker")?;
                    values[m.worker] = Some((v, m.coefficient));
                }
                Part::Sum(a, sum, weight) => partials[a] = Some((sum, weight)),
            }
        }
        let mean = if partials.iter().any(Option::is_some) {
            combine(partials.iter().flatten().map(|(s, w)| (s.as_slice(), *w)))
        } else {
            let of = |w: usize| self.aggregator_of(w);
            let list: Vec<(usize, &[f32], f64)> =
                values.iter().enumerate().filter_map(|(w, v)| v.as_ref().map(|(v, c)| (w, v.as_slice(), *c))).collect();
            aggregate(&list, &of, self.aggregators)
        };
        if let Some(mean) = mean {
            let lr = self.learning_rate;
            for (x, m) in state.weights.iter_mut().zip(&mean) {
                *x = match self.cfg.send {
                    LazySend::Delta => (f64::from(*x) + m) as f32,
                    LazySend::RoundGradient => (f64::from(*x) - lr * m) as f32,
                };
            }
        }
        state.report.aggregations += 1;
        let weights = Arc::new(state.weights.clone());
        let back_up = self.told.lock().sink.is_some()
            && relative_change(&state.weights, state.last_backup.as_deref()) >= self.cfg.backup_min_change;
        let mut committed = None;
        if back_up {
            state.last_backup = Some(state.weights.clone());
            let cut = BackupCut {
                step: self.base.0 + state.report.local_iterations,
                samples: self.base.1 + state.report.samples,
                position: state.position,
                weights: weights.clone(),
            };
            // The others wait in the meeting meanwhile: a cut.
            drop(guard);
            let committer = self.told.lock().committer.clone();
            committed = match committer.map(|commit| commit(&cut)) {
                Some(Ok(())) => Some(cut.step),
                Some(Err(e)) => {
                    tracing::error!("backup at step {}: committing it as a checkpoint: {e}", cut.step);
                    None
                }
                None => None,
            };
            guard = self.state.lock();
            if let Some(step) = committed {
                guard.last_committed = Some(guard.last_committed.map_or(step, |s| s.max(step)));
            }
            let number = guard.report.aggregations;
            if let Some(sink) = self.told.lock().sink.as_ref()
                && sink.send((number, cut.weights)).is_ok()
            {
                guard.backups_pending += 1;
            }
        }
        guard.pending = None;
        self.changed.notify_all();
        Ok(Submitted {
            weights,
            aggregated: Aggregated {
                weights: None,
                job_batches: self.base.0 + guard.report.local_iterations,
                job_samples: self.base.1 + guard.report.samples,
                committed,
            },
        })
    }

    /// Blocks until `n` shares of instruction `id` wait for the others
    /// (an aggregator's counts once per worker it brings); tests order by it.
    pub fn wait_for_shares(&self, id: u64, n: usize) {
        self.meet.wait_for_waiters(id, n);
    }

    /// Waits until every worker has left (data finished, work aggregated)
    /// and returns the final weights: the job's model.
    pub fn final_weights(&self) -> Result<FinalWeights, ClusterError> {
        let mut state = self.state.lock();
        loop {
            if let Some(reason) = &state.failed {
                return Err(ClusterError::JobFailed(reason.clone()));
            }
            if state.gone.iter().all(|&g| g) && state.pending.is_none() && state.backups_pending == 0 {
                return Ok(FinalWeights {
                    weights: state.weights.clone(),
                    report: state.report.clone(),
                    job_batches: self.base.0 + state.report.local_iterations,
                    job_samples: self.base.1 + state.report.samples,
                    committed: state.last_committed,
                });
            }
            self.changed.wait(state.raw());
        }
    }

    /// Wakes every waiting worker with an error (a role died, the job failed).
    pub fn fail(&self, reason: String) {
        self.state.lock().failed.get_or_insert(reason.clone());
        self.meet.fail(reason);
        self.changed.notify_all();
    }
}

/// The job's model after every worker left, and what the scheduler counted.
#[derive(Clone, Debug)]
pub struct FinalWeights {
    pub weights: Vec<f32>,
    pub report: LazyReport,
    /// The job's batches and samples (the restored checkpoint's included).
    pub job_batches: u64,
    pub job_samples: u64,
    /// The step of the job's newest backup committed as a checkpoint: every
    /// worker decides from it whether the job's end needs one more
    /// checkpoint (a worker that left before that backup's aggregation
    /// must not ask for a checkpoint the others will never join).
    pub committed: Option<u64>,
}

/// One worker's share of an aggregation, as its aggregator reports it.
#[derive(Clone, Debug)]
pub struct Member {
    pub worker: usize,
    pub finished: bool,
    pub position: sparrow_core::batch::DataPosition,
    pub iterations: u64,
    pub samples: u64,
    pub coefficient: f64,
}

impl Member {
    /// A contribution's share (its values aside).
    pub fn of(c: &Contribution) -> Member {
        Member {
            worker: c.worker,
            finished: c.finished,
            position: c.position,
            iterations: c.iterations,
            samples: c.samples,
            coefficient: c.coefficient,
        }
    }
}

/// An aggregator process's part of an instruction: Σ c_k·v_k over its
/// participating workers (f64, worker order), Σ c_k, and each worker's share.
#[derive(Clone, Debug)]
pub struct Partial {
    pub aggregator: usize,
    pub generation: Generation,
    pub instruction: u64,
    pub sum: Vec<f64>,
    pub weight: f64,
    pub members: Vec<Member>,
}

/// What a share of an instruction brings: one worker's values, or an
/// aggregator's (index, Σ c·v, Σ c).
enum Part {
    Values(Vec<f32>),
    Sum(usize, Vec<f64>, f64),
}

/// A share of an instruction at its meeting, and the workers it is for.
struct Share {
    part: Part,
    members: Vec<Member>,
}

/// The new weights and the job's totals after an aggregation.
#[derive(Clone)]
struct Submitted {
    weights: Arc<Vec<f32>>,
    aggregated: Aggregated,
}

/// A worker's contribution to an instruction (S4.3).
#[derive(Clone, Debug)]
pub struct Contribution {
    pub worker: usize,
    pub generation: Generation,
    pub instruction: u64,
    /// The instruction's participants (an aggregator process waits for its own).
    pub participants: Vec<usize>,
    /// Its delta or its round gradient (flat, `ParamStore` order).
    pub values: Vec<f32>,
    /// The sum of its kept samples' weights since the last aggregation.
    pub coefficient: f64,
    /// Its data is finished (S4.7): it gets no weights back.
    pub finished: bool,
    /// Where the data continues after its last trained batch.
    pub position: sparrow_core::batch::DataPosition,
    /// Iterations and samples since its last aggregation.
    pub iterations: u64,
    pub samples: u64,
}

/// Anything that schedules and aggregates: [`Lazy`] in process, or the
/// coordinator over gRPC.
pub trait LazyLink: Send + Sync {
    fn poll(
        &self,
        worker: usize,
        generation: Generation,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError>;
    fn contribute(&self, c: Contribution) -> Result<Aggregated, ClusterError>;
    fn final_weights(&self, generation: Generation) -> Result<FinalWeights, ClusterError>;
}

impl LazyLink for Lazy {
    fn poll(
        &self,
        worker: usize,
        _: Generation,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError> {
        Lazy::poll(self, worker, since, finished, wait)
    }

    fn contribute(&self, c: Contribution) -> Result<Aggregated, ClusterError> {
        Lazy::contribute(self, c)
    }

    fn final_weights(&self, _: Generation) -> Result<FinalWeights, ClusterError> {
        Lazy::final_weights(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contribution(
        worker: usize,
        id: u64,
        values: Vec<f32>,
        c: f64,
        finished: bool,
        trained: (u64, u64),
    ) -> Contribution {
        Contribution {
            worker,
            generation: Generation(1),
            instruction: id,
            participants: Vec::new(),
            values,
            coefficient: c,
            finished,
            position: Default::default(),
            iterations: trained.0,
            samples: trained.1,
        }
    }

    /// A scheduler with no monitoring interval: it decides at every poll
    /// (the interval has its own test).
    fn quick(workers: usize, weights: Vec<f32>) -> Lazy {
        Lazy::new(&LazyConfig { probe_interval_ms: 0, ..LazyConfig::default() }, workers, 1, 0.1, weights)
    }

    fn cfg(combine: Combine) -> LazyConfig {
        LazyConfig { combine, max_net_utilisation: 0.3, max_failure_rate: 0.05, ..LazyConfig::default() }
    }

    #[test]
    fn the_scheduler_passes_strictly_below_the_thresholds_by_and_or_or() {
        let at = |u: f64, f: f64| Conditions { utilisation: u, failure_rate: f };
        // (utilisation, failure rate) → and, or
        let table = [
            (at(0.29, 0.04), Ok(()), Ok(())),
            (at(0.30, 0.04), Err(HeldBack::Utilisation), Ok(())),
            (at(0.29, 0.05), Err(HeldBack::FailureRate), Ok(())),
            (at(0.30, 0.05), Err(HeldBack::Both), Err(HeldBack::Both)),
            (at(0.0, 0.0), Ok(()), Ok(())),
            (at(0.31, 0.06), Err(HeldBack::Both), Err(HeldBack::Both)),
        ];
        for (c, and, or) in table {
            assert_eq!(conditions_pass(&cfg(Combine::And), c), and, "and at {c:?}");
            assert_eq!(conditions_pass(&cfg(Combine::Or), c), or, "or at {c:?}");
        }
    }

    #[test]
    fn utilisation_is_total_over_capacity_or_the_busy_weighted_mean() {
        // Two roles at 30 and 10 bytes/s on 100 bytes/s links.
        let total = utilisation(Utilisation::Total, &[30.0, 10.0], 100.0);
        assert!((total - 0.2).abs() < 1e-12, "{total}");
        // (0.3·30 + 0.1·10) / 40 = 0.25
        let mean = utilisation(Utilisation::Mean, &[30.0, 10.0], 100.0);
        assert!((mean - 0.25).abs() < 1e-12, "{mean}");
        assert_eq!(utilisation(Utilisation::Mean, &[0.0, 0.0], 100.0), 0.0);
    }

    #[test]
    fn one_or_two_aggregators_give_the_same_weighted_mean() {
        let mut rng = sparrow_core::rng::Rng::new(7);
        let values: Vec<Vec<f32>> =
            (0..4).map(|_| (0..1000).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()).collect();
        let coefficients = [0.8, 0.7, 0.5, 2.25];
        let list: Vec<(usize, &[f32], f64)> =
            values.iter().enumerate().map(|(w, v)| (w, v.as_slice(), coefficients[w])).collect();
        let one = aggregate(&list, &|_| 0, 1).expect("sum");
        let two = aggregate(&list, &|w| w % 2, 2).expect("sum");
        let as_f32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
        assert_eq!(as_f32(&one), as_f32(&two), "K = 1 and K = 2");
        // The seed's example, by hand: (0.8·1 + 0.7·2 + 0.5·4) / 2.0 = 2.1.
        let (a, b, c) = ([1.0f32], [2.0f32], [4.0f32]);
        let seed = aggregate(&[(0, &a, 0.8), (1, &b, 0.7), (2, &c, 0.5)], &|w| w % 2, 2).expect("sum");
        assert!((seed[0] - 2.1).abs() < 1e-12, "{seed:?}");
        assert!(aggregate(&[(0, &a, 0.0)], &|_| 0, 1).is_none(), "no weight, no step");
    }

    /// The job's newest committed backup reaches every worker with the
    /// final weights, one that left before that backup's aggregation
    /// included: all decide alike whether the job's end needs a checkpoint.
    /// (A worker that decided alone asked for a checkpoint the others never
    /// joined, and waited until the progress timeout restarted the job.)
    #[test]
    fn the_final_weights_name_the_newest_committed_backup() {
        let lazy = quick(2, vec![1.0]);
        let (tx, rx) = crossbeam_channel::unbounded();
        lazy.back_up_to(tx);
        lazy.commit_backups_with(Arc::new(|_: &BackupCut| Ok(())));
        // Worker 1's data ends with nothing to send: it leaves.
        assert_eq!(lazy.poll(1, 0, true, false).expect("poll"), None);
        // Worker 0 aggregates alone; a first aggregation is always backed up.
        let i = lazy.poll(0, 2, true, false).expect("poll").expect("issued");
        let done = lazy.contribute(contribution(0, i.id, vec![0.5], 1.0, true, (2, 4))).expect("contribute");
        assert_eq!(done.committed, Some(2), "the backup was committed at the job's step 2");
        for _ in rx.try_iter() {
            lazy.backup_done(true);
        }
        let end = lazy.final_weights().expect("final weights");
        assert_eq!(end.committed, Some(2), "what worker 1 learns at the end");
        assert_eq!(end.job_batches, 2);
    }

    #[test]
    fn an_instruction_waits_for_every_worker_and_a_finished_worker_gets_no_weights() {
        let lazy = Arc::new(quick(2, vec![1.0, 1.0]));
        // (a): worker 1 has no iteration yet.
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), None);
        let i = lazy.poll(1, 2, false, false).expect("poll").expect("issued");
        assert_eq!(i.round, 1, "the newest iteration both have");
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), Some(i.clone()));
        let other = {
            let lazy = lazy.clone();
            std::thread::spawn(move || lazy.contribute(contribution(1, i.id, vec![0.3, 0.3], 3.0, true, (2, 6))))
        };
        let mine = lazy
            .contribute(contribution(0, i.id, vec![-0.1, 0.1], 1.0, false, (1, 2)))
            .expect("weights")
            .weights
            .expect("not finished");
        // x + (1·(−0.1) + 3·0.3)/4 = 1.2, x + (0.1 + 0.9)/4 = 1.25
        assert!((mine[0] - 1.2).abs() < 1e-6 && (mine[1] - 1.25).abs() < 1e-6, "{mine:?}");
        let theirs = other.join().expect("thread").expect("ok");
        assert!(theirs.weights.is_none(), "finished: no weights");
        assert_eq!((theirs.job_batches, theirs.job_samples), (3, 8), "the job's totals after the aggregation");
        assert_eq!(lazy.report().aggregations, 1);
        // Worker 1 left: worker 0 alone makes the next instruction.
        assert!(lazy.poll(0, 1, false, false).expect("poll").is_some());
    }

    #[test]
    fn the_scheduler_decides_at_most_once_per_monitoring_interval() {
        let cfg = LazyConfig { probe_interval_ms: 400, ..LazyConfig::default() };
        let lazy = Lazy::new(&cfg, 1, 1, 0.1, vec![0.0]);
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), None, "too soon after the start");
        let started = std::time::Instant::now();
        let i = lazy.poll(0, 3, false, true).expect("poll").expect("issued after waiting");
        assert!(started.elapsed() >= Duration::from_millis(300), "waited for the interval");
        assert_eq!(i.round, 3);
        lazy.contribute(contribution(0, i.id, vec![0.5], 1.0, false, (3, 3))).expect("ok");
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), None, "the next interval has not begun");
        // A worker whose data is finished is not kept waiting for the interval.
        assert!(lazy.poll(0, 1, true, false).expect("poll").is_some());
    }

    #[test]
    fn a_worker_that_finishes_right_after_an_aggregation_leaves_while_others_still_take_it() {
        let lazy = Arc::new(quick(2, vec![0.0]));
        lazy.poll(0, 1, false, false).expect("poll");
        let i = lazy.poll(1, 1, false, false).expect("poll").expect("issued");
        // Both sent their shares and the instruction is not closed yet (its
        // closer's thread not scheduled): it is still pending.
        {
            let mut state = lazy.state.lock();
            let p = state.pending.as_mut().expect("pending");
            p.sent = vec![true, true];
            state.since = vec![0, 0];
        }
        // Worker 0's data ends at once: it leaves without waiting (it would
        // hold every later instruction back forever otherwise: (a) needs an
        // iteration from every worker still in).
        let (tx, rx) = crossbeam_channel::bounded(1);
        let leaving = {
            let lazy = lazy.clone();
            std::thread::spawn(move || tx.send(lazy.poll(0, 0, true, true).map_err(|e| e.to_string())))
        };
        let left =
            rx.recv_timeout(Duration::from_secs(5)).expect("a finished worker with nothing to send leaves at once");
        assert_eq!(left, Ok(None));
        leaving.join().expect("thread").expect("sent");
        assert!(lazy.state.lock().gone[0]);
        let _ = i;
    }

    #[test]
    fn held_back_instructions_are_counted_by_condition() {
        let lazy = quick(1, vec![0.0]);
        lazy.set_conditions(Conditions { utilisation: 0.5, failure_rate: 0.0 });
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), None);
        assert_eq!(lazy.poll(0, 2, false, false).expect("poll"), None);
        lazy.set_conditions(Conditions { utilisation: 0.0, failure_rate: 0.0 });
        assert!(lazy.poll(0, 2, false, false).expect("poll").is_some());
        let r = lazy.report();
        assert_eq!((r.held_by_utilisation, r.held_by_failure_rate), (1, 0), "one episode");
    }

    fn member(worker: usize, coefficient: f64, iterations: u64) -> Member {
        Member {
            worker,
            finished: false,
            position: Default::default(),
            iterations,
            samples: 2 * iterations,
            coefficient,
        }
    }

    /// Aggregator `aggregator`'s partial of Σ c·v = 4 over Σ c = 2 for instruction `id`.
    fn sum_of_four(aggregator: usize, id: u64, members: Vec<Member>) -> Partial {
        Partial { aggregator, generation: Generation(1), instruction: id, sum: vec![4.0], weight: 2.0, members }
    }

    /// Aggregator processes meet the scheduler once each for the workers
    /// they bring: the instruction closes when every participant's share is
    /// in, whichever way it came, and a worker whose aggregator sent for it
    /// cannot send again.
    #[test]
    fn an_aggregators_sum_counts_for_each_worker_it_brings() {
        // No monitoring interval: the scheduler may issue at once.
        let cfg = LazyConfig { probe_interval_ms: 0, ..LazyConfig::default() };
        let lazy = Arc::new(Lazy::new(&cfg, 3, 2, 0.1, vec![1.0]));
        for w in 0..2 {
            assert_eq!(lazy.poll(w, 1, false, false).expect("poll"), None, "worker 2 has no iteration yet");
        }
        let i = lazy.poll(2, 1, false, false).expect("poll").expect("issued");
        // Aggregator 0 brings workers 0 and 2 (1·1 + 1·3 over 2), aggregator 1 worker 1 (2·2 over 2).
        let first = {
            let lazy = lazy.clone();
            let partial = sum_of_four(0, i.id, vec![member(0, 1.0, 1), member(2, 1.0, 3)]);
            std::thread::spawn(move || lazy.contribute_partial(partial))
        };
        lazy.wait_for_shares(i.id, 2);
        let again = lazy.contribute(contribution(2, i.id, vec![9.0], 1.0, false, (1, 1))).expect_err("sent for");
        assert!(again.to_string().contains("worker 2 is not expected for instruction"), "{again}");
        let (done, weights) = lazy.contribute_partial(sum_of_four(1, i.id, vec![member(1, 2.0, 2)])).expect("closed");
        // 1 + (4 + 4) / (2 + 2) = 3
        assert_eq!(weights.as_slice(), &[3.0]);
        assert_eq!((done.job_batches, done.job_samples), (6, 12), "every member's iterations, once each");
        let (_, theirs) = first.join().expect("thread").expect("closed");
        assert_eq!(theirs.as_slice(), &[3.0], "the aggregator of two took the same weights");
        assert_eq!(lazy.report().aggregations, 1);
    }

    /// A failure (a role died) wakes a participant waiting for the others
    /// with the job's error, not a hang.
    #[test]
    fn a_failure_wakes_a_participant_waiting_for_the_others() {
        let lazy = Arc::new(quick(2, vec![1.0]));
        assert_eq!(lazy.poll(0, 1, false, false).expect("poll"), None);
        let i = lazy.poll(1, 1, false, false).expect("poll").expect("issued");
        let waiting = {
            let lazy = lazy.clone();
            std::thread::spawn(move || lazy.contribute(contribution(0, i.id, vec![0.5], 1.0, false, (1, 1))))
        };
        lazy.wait_for_shares(i.id, 1);
        lazy.fail("worker 1 died".into());
        let err = waiting.join().expect("thread").expect_err("failed");
        assert!(matches!(&err, ClusterError::JobFailed(r) if r.contains("worker 1 died")), "{err}");
        let late = lazy.contribute(contribution(1, i.id, vec![0.5], 1.0, false, (1, 1))).expect_err("failed");
        assert!(matches!(late, ClusterError::JobFailed(_)), "{late}");
    }
}
