//! Dense gradient combination across data-parallel workers (S0.6): every
//! round each worker contributes its gradient (zeros and 0 rows when it had
//! no batch); the sum is formed in worker order, so all workers receive the
//! same bits and, applying the same optimizer step, keep identical weights.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use sparrow_model::{GradientSync, ModelError};

use crate::transport::ClusterError;

/// The sum of one round: gradients and total rows.
pub type RoundResult = Arc<(Vec<f32>, u64)>;

struct Round {
    parts: Vec<Option<(Vec<f32>, u64)>>,
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

    /// Adds `worker`'s part of `round` and waits for the sum of all parts.
    pub fn sum(&self, worker: usize, round: u64, grads: Vec<f32>, rows: u64) -> Result<RoundResult, ClusterError> {
        if worker >= self.workers {
            return Err(ClusterError::Setup(format!("worker {worker}: only {} workers are expected", self.workers)));
        }
        let mut state = self.state.lock();
        let workers = self.workers;
        let entry = state.rounds.entry(round).or_insert_with(|| Round {
            parts: (0..workers).map(|_| None).collect(),
            result: None,
            taken: 0,
        });
        if entry.parts[worker].is_some() || entry.result.is_some() {
            return Err(ClusterError::Setup(format!("worker {worker} sent round {round} twice")));
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
        entry.parts[worker] = Some((grads, rows));
        if entry.parts.iter().all(Option::is_some) {
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
                return Ok(result);
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
    fn sum_round(&self, worker: usize, round: u64, grads: Vec<f32>, rows: u64) -> Result<RoundResult, ClusterError>;
}

impl RoundSummer for RoundSum {
    fn sum_round(&self, worker: usize, round: u64, grads: Vec<f32>, rows: u64) -> Result<RoundResult, ClusterError> {
        self.sum(worker, round, grads, rows)
    }
}

/// A worker's side of the rounds, as the dense optimizer's [`GradientSync`].
pub struct WorkerSync {
    worker: usize,
    round: u64,
    summer: Arc<dyn RoundSummer>,
}

impl WorkerSync {
    pub fn new(worker: usize, summer: Arc<dyn RoundSummer>) -> Self {
        WorkerSync { worker, round: 0, summer }
    }
}

impl GradientSync for WorkerSync {
    fn sum(&mut self, grads: &mut [f32], rows: u64) -> Result<u64, ModelError> {
        let result = self
            .summer
            .sum_round(self.worker, self.round, grads.to_vec(), rows)
            .map_err(|e| ModelError::GradientSync(e.to_string()))?;
        self.round += 1;
        if result.0.len() != grads.len() {
            return Err(ModelError::GradientSync(format!(
                "round {}: the sum has {} values, this worker has {}",
                self.round - 1,
                result.0.len(),
                grads.len()
            )));
        }
        grads.copy_from_slice(&result.0);
        Ok(result.1)
    }
}
