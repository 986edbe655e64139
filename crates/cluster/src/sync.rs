//! Dense gradient combination across data-parallel workers (S0.6 with S2.2).
//!
//! A round is one dense optimizer step. A worker that contributed waits for
//! the others for a while (its `patience`: half its own batch time, so
//! workers of equal speed meet with one batch each); if some worker still has
//! not contributed, it takes another batch and adds its gradient, computed at
//! the same weights, to the round: a faster worker trains more batches
//! instead of waiting. A worker's contribution is
//! its last for the round once every worker has contributed (or when it has no
//! data left); the round closes when every worker made its last contribution.
//! The sum is formed once, per worker in contribution order and then in
//! worker order, and every worker receives the same bits: applying the same
//! optimizer step, they keep identical weights.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use sparrow_model::{DenseGrads, ParamStore};
use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::DenseSync;

use crate::transport::ClusterError;

/// The sum of one round: gradients and total rows.
pub type RoundResult = Arc<(Vec<f32>, u64)>;

/// A worker's gradient of the summed loss over its `rows` samples (0: no
/// batch left), for `round`; `patience`: how long to wait for the other
/// workers before answering `Open`.
#[derive(Clone, Debug)]
pub struct Contribution {
    pub worker: usize,
    /// The job's attempt the worker trains in (a coordinator refuses another).
    pub generation: u64,
    pub round: u64,
    pub grads: Vec<f32>,
    pub rows: u64,
    pub patience: Duration,
}

/// What a contribution to a round gets back.
#[derive(Clone, Debug)]
pub enum RoundReply {
    /// Not every worker has contributed: train another batch at these weights.
    Open,
    Closed(RoundResult),
}

struct Round {
    /// Each worker's accumulated contribution (None: nothing yet).
    parts: Vec<Option<(Vec<f32>, u64)>>,
    last_made: Vec<bool>,
    result: Option<RoundResult>,
    taken: usize,
}

#[derive(Default)]
struct State {
    rounds: HashMap<u64, Round>,
    failed: Option<String>,
}

/// The meeting point of the workers' rounds (the coordinator holds one).
pub struct RoundSum {
    workers: usize,
    state: Mutex<State>,
    ready: Condvar,
}

impl RoundSum {
    pub fn new(workers: usize) -> Self {
        RoundSum { workers, state: Mutex::new(State::default()), ready: Condvar::new() }
    }

    /// Adds a worker's contribution to its round. Returns `Open` if another
    /// worker has still not contributed after `patience` (and `rows > 0`);
    /// otherwise waits for the round to close and returns its sum.
    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        let Contribution { worker, round, grads, rows, patience, .. } = c;
        let workers = self.workers;
        if worker >= workers {
            return Err(ClusterError::Setup(format!("worker {worker}: only {workers} workers are expected")));
        }
        let mut state = self.state.lock();
        if let Some(reason) = &state.failed {
            return Err(ClusterError::JobFailed(reason.clone()));
        }
        let entry = state.rounds.entry(round).or_insert_with(|| Round {
            parts: (0..workers).map(|_| None).collect(),
            last_made: vec![false; workers],
            result: None,
            taken: 0,
        });
        if entry.last_made[worker] {
            return Err(ClusterError::Setup(format!("worker {worker} contributed to round {round} after its last")));
        }
        if let Some((first, _)) = entry.parts.iter().flatten().next()
            && first.len() != grads.len()
        {
            return Err(ClusterError::Setup(format!(
                "worker {worker}: round {round}: {} gradient values, other workers sent {}",
                grads.len(),
                first.len()
            )));
        }
        match &mut entry.parts[worker] {
            Some((acc, acc_rows)) => {
                acc.iter_mut().zip(&grads).for_each(|(a, g)| *a += g);
                *acc_rows += rows;
            }
            slot @ None => *slot = Some((grads, rows)),
        }
        self.ready.notify_all();
        let deadline = Instant::now() + patience;
        let missing = |state: &State| state.rounds.get(&round).is_some_and(|r| r.parts.iter().any(Option::is_none));
        while rows > 0 && missing(&state) && state.failed.is_none() {
            if self.ready.wait_until(&mut state, deadline).timed_out() {
                if missing(&state) {
                    return Ok(RoundReply::Open);
                }
                break;
            }
        }
        let entry = state.rounds.get_mut(&round).ok_or(ClusterError::Setup(format!("round {round} vanished")))?;
        entry.last_made[worker] = true;
        if entry.last_made.iter().all(|&d| d) {
            let mut parts = entry.parts.iter_mut().map(|p| p.take().unwrap_or_default());
            let (mut total, mut total_rows) = parts.next().unwrap_or_default();
            for (g, r) in parts {
                total.iter_mut().zip(&g).for_each(|(t, g)| *t += g);
                total_rows += r;
            }
            entry.result = Some(Arc::new((total, total_rows)));
            self.ready.notify_all();
        }
        loop {
            if let Some(reason) = &state.failed {
                return Err(ClusterError::JobFailed(reason.clone()));
            }
            let round_state =
                state.rounds.get_mut(&round).ok_or(ClusterError::Setup(format!("round {round} vanished")))?;
            if let Some(result) = round_state.result.clone() {
                round_state.taken += 1;
                if round_state.taken == workers {
                    state.rounds.remove(&round);
                }
                return Ok(RoundReply::Closed(result));
            }
            self.ready.wait(&mut state);
        }
    }

    /// Wakes every waiting worker with an error (a worker or a shard is gone).
    pub fn fail(&self, reason: String) {
        self.state.lock().failed.get_or_insert(reason);
        self.ready.notify_all();
    }
}

/// Anything that can sum a round: the in-process [`RoundSum`] or the
/// coordinator over gRPC.
pub trait RoundSummer: Send + Sync {
    fn sum_round(&self, c: Contribution) -> Result<RoundReply, ClusterError>;
}

impl RoundSummer for RoundSum {
    fn sum_round(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        self.sum(c)
    }
}

/// A worker's side of the rounds: the step engine's [`DenseSync`] policy for
/// the every-step sum across workers (S0.6 with S2.2).
pub struct RoundSync {
    worker: usize,
    generation: u64,
    round: u64,
    summer: Arc<dyn RoundSummer>,
    /// When this worker's previous contribution was answered: the time since
    /// is what one batch takes it.
    last_answer: Option<Instant>,
    /// Gradient bytes sent and sums received.
    bytes: Arc<AtomicU64>,
}

impl RoundSync {
    pub fn new(worker: usize, summer: Arc<dyn RoundSummer>) -> Self {
        RoundSync { worker, generation: 0, round: 0, summer, last_answer: None, bytes: Arc::default() }
    }

    /// Adds the bytes of every contribution and sum to `bytes`.
    pub fn counting_bytes(mut self, bytes: Arc<AtomicU64>) -> Self {
        self.bytes = bytes;
        self
    }

    /// Contributes to the rounds of the job's attempt `generation`.
    pub fn in_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }
}

impl DenseSync for RoundSync {
    fn combine(&mut self, params: &ParamStore, grads: DenseGrads) -> Result<Option<DenseGrads>, TrainError> {
        // A non-finite gradient stops this worker before it reaches the others.
        grads.check_finite(params)?;
        let batch_time = self.last_answer.map_or(Duration::ZERO, |t| t.elapsed());
        let flat = grads.flat_sum_terms(params);
        self.bytes.fetch_add(4 * flat.len() as u64, Ordering::Relaxed);
        let reply = self.summer.sum_round(Contribution {
            worker: self.worker,
            generation: self.generation,
            round: self.round,
            grads: flat,
            rows: grads.rows,
            patience: batch_time / 2,
        });
        self.last_answer = Some(Instant::now());
        let reply = reply.map_err(|e| TrainError::DenseSync(Box::new(e)))?;
        let RoundReply::Closed(result) = reply else { return Ok(None) };
        let (sum, rows) = (&result.0, result.1);
        self.bytes.fetch_add(4 * sum.len() as u64, Ordering::Relaxed);
        if sum.len() != params.num_params() {
            return Err(TrainError::DenseSync(Box::new(ClusterError::Setup(format!(
                "round {}: the sum has {} values, this worker has {}",
                self.round,
                sum.len(),
                params.num_params()
            )))));
        }
        self.round += 1;
        Ok((rows > 0).then(|| DenseGrads::from_flat_sum(params, sum, rows)))
    }
}
