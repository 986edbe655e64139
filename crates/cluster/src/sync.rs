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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sparrow_model::{DenseGrads, ParamStore};
use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::DenseSync;

use crate::generation::Generation;
use crate::rendezvous::{Parted, Rendezvous};
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
    pub generation: Generation,
    pub round: u64,
    pub grads: Vec<f32>,
    pub rows: u64,
    pub patience: Duration,
    /// How long the coordinator may wait for the round to close once this
    /// contribution is the worker's last, before it answers
    /// [`RoundReply::Pending`] (`None`: until it closes). Across a network it
    /// is within the call's deadline, so a long round is a wait that is
    /// alive (the worker asks again), not a deadline run out.
    pub wait: Option<Duration>,
}

/// What a contribution to a round gets back.
#[derive(Clone, Debug)]
pub enum RoundReply {
    /// Not every worker has contributed: train another batch at these weights.
    Open,
    /// This worker's contribution was its last and the round has not closed
    /// within the contribution's `wait` (another worker is still training,
    /// or waiting on an idle stream): ask again ([`RoundSummer::await_round`]).
    Pending,
    Closed(RoundResult),
}

/// The meeting point of the workers' rounds (the coordinator holds one):
/// each worker's contributions accumulate in its slot of the round's meeting.
pub struct RoundSum {
    meet: Rendezvous<(Vec<f32>, u64), RoundResult>,
}

impl RoundSum {
    /// Rounds of `workers` workers in generation 0 (a job in one process).
    pub fn new(workers: usize) -> Self {
        RoundSum::in_generation(workers, Generation::NONE)
    }

    pub fn in_generation(workers: usize, generation: Generation) -> Self {
        RoundSum { meet: Rendezvous::new("round", workers, generation) }
    }

    /// Adds a worker's contribution to its round. Returns `Open` if another
    /// worker has still not contributed after `patience` (and `rows > 0`);
    /// otherwise waits for the round to close and returns its sum.
    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        let Contribution { worker, generation, round, grads, rows, patience, wait } = c;
        let parted = |p: Parted| p.into_cluster_error("the coordinator", || format!("worker {worker}'s gradients"));
        self.meet
            .add(generation, round, worker, |mine, other| {
                if let Some((first, _)) = other.or(mine.as_ref())
                    && first.len() != grads.len()
                {
                    return Err(format!(
                        "worker {worker}: round {round}: {} gradient values, other workers sent {}",
                        grads.len(),
                        first.len()
                    ));
                }
                match mine {
                    Some((acc, acc_rows)) => {
                        acc.iter_mut().zip(&grads).for_each(|(a, g)| *a += g);
                        *acc_rows += rows;
                    }
                    None => *mine = Some((grads, rows)),
                }
                Ok(())
            })
            .map_err(parted)?;
        if rows > 0 && !self.meet.wait_all_arrived(generation, round, Instant::now() + patience).map_err(parted)? {
            return Ok(RoundReply::Open);
        }
        // Formed once, in worker order: every worker receives the same bits.
        let close = |parts: Vec<(Vec<f32>, u64)>| {
            let mut parts = parts.into_iter();
            let (mut total, mut total_rows) = parts.next().unwrap_or_default();
            for (g, r) in parts {
                total.iter_mut().zip(&g).for_each(|(t, g)| *t += g);
                total_rows += r;
            }
            Ok(Arc::new((total, total_rows)))
        };
        let closed = match wait {
            Some(wait) => self.meet.finish_within(generation, round, worker, Instant::now() + wait, close),
            None => self.meet.finish(generation, round, worker, close).map(Some),
        };
        Ok(closed.map_err(parted)?.map_or(RoundReply::Pending, RoundReply::Closed))
    }

    /// The sum of `round`, after worker `worker`'s last contribution was
    /// answered [`RoundReply::Pending`]: waits up to `wait` for it to close.
    pub fn await_round(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
        wait: Duration,
    ) -> Result<RoundReply, ClusterError> {
        let parted = |p: Parted| p.into_cluster_error("the coordinator", || format!("worker {worker}'s round {round}"));
        let closed = self.meet.outcome_by(generation, round, Instant::now() + wait).map_err(parted)?;
        Ok(closed.map_or(RoundReply::Pending, RoundReply::Closed))
    }

    /// Wakes every waiting worker with an error (a worker or a shard is gone).
    pub fn fail(&self, reason: String) {
        self.meet.fail(reason);
    }

    /// Generation `generation` starts: waiting workers are released.
    pub fn advance(&self, generation: Generation) {
        self.meet.advance(generation);
    }

    /// How many workers contributed to `round` so far (tests wait on it).
    pub fn wait_for_contributions(&self, round: u64, n: usize) {
        self.meet.wait_for_arrivals(round, n);
    }
}

/// Anything that can sum a round: the in-process [`RoundSum`] or the
/// coordinator over gRPC.
pub trait RoundSummer: Send + Sync {
    fn sum_round(&self, c: Contribution) -> Result<RoundReply, ClusterError>;

    /// Asks again for `round`'s sum after a [`RoundReply::Pending`].
    fn await_round(&self, worker: usize, generation: Generation, round: u64) -> Result<RoundReply, ClusterError>;
}

impl RoundSummer for RoundSum {
    fn sum_round(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        self.sum(c)
    }

    fn await_round(&self, worker: usize, generation: Generation, round: u64) -> Result<RoundReply, ClusterError> {
        RoundSum::await_round(self, worker, generation, round, Duration::from_secs(1))
    }
}

/// A worker's side of the rounds: the step engine's [`DenseSync`] policy for
/// the every-step sum across workers (S0.6 with S2.2).
pub struct RoundSync {
    worker: usize,
    generation: Generation,
    round: u64,
    summer: Arc<dyn RoundSummer>,
    /// When this worker's previous contribution was answered: the time since
    /// is what one batch takes it.
    last_answer: Option<Instant>,
    /// Gradient bytes sent and sums received.
    bytes: Arc<AtomicU64>,
    /// `train.simd`, for the finiteness check of its gradients.
    simd: sparrow_core::simd::Simd,
    /// The worker's progress count: it moves each time the coordinator
    /// answers that the round is still waiting on another worker.
    progress: Arc<AtomicU64>,
}

impl RoundSync {
    pub fn new(worker: usize, summer: Arc<dyn RoundSummer>, simd: sparrow_core::simd::Simd) -> Self {
        RoundSync {
            worker,
            generation: Generation::NONE,
            round: 0,
            summer,
            last_answer: None,
            bytes: Arc::default(),
            simd,
            progress: Arc::default(),
        }
    }

    /// Moves `progress` while a round waits on the other workers.
    pub fn with_progress(mut self, progress: Arc<AtomicU64>) -> Self {
        self.progress = progress;
        self
    }

    /// Adds the bytes of every contribution and sum to `bytes`.
    pub fn counting_bytes(mut self, bytes: Arc<AtomicU64>) -> Self {
        self.bytes = bytes;
        self
    }

    /// Contributes to the rounds of the job's attempt `generation`.
    pub fn in_generation(mut self, generation: Generation) -> Self {
        self.generation = generation;
        self
    }
}

impl DenseSync for RoundSync {
    fn combine(&mut self, params: &ParamStore, grads: DenseGrads) -> Result<Option<DenseGrads>, TrainError> {
        // A non-finite gradient stops this worker before it reaches the others.
        grads.check_finite(self.simd, params)?;
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
            wait: None,
        });
        let mut reply = reply.map_err(|e| TrainError::DenseSync(Box::new(e)))?;
        while let RoundReply::Pending = reply {
            self.progress.fetch_add(1, Ordering::Relaxed);
            reply = self
                .summer
                .await_round(self.worker, self.generation, self.round)
                .map_err(|e| TrainError::DenseSync(Box::new(e)))?;
        }
        self.last_answer = Some(Instant::now());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn contribution(worker: usize, grads: Vec<f32>, rows: u64, wait: Option<Duration>) -> Contribution {
        Contribution { worker, generation: Generation::NONE, round: 0, grads, rows, patience: Duration::ZERO, wait }
    }

    /// A worker whose last contribution meets a round another worker has
    /// not reached is answered `Pending` within its wait (it cannot close:
    /// nobody else can arrive meanwhile), its contribution stands, and
    /// asking again once the other arrived gives the same sum the other got.
    #[test]
    fn a_round_that_cannot_close_yet_answers_pending_and_keeps_the_contribution() {
        let rounds = RoundSum::new(2);
        let wait = Some(Duration::from_millis(20));
        let first = rounds.sum(contribution(0, vec![1.0, 2.0], 0, wait)).expect("sum");
        assert!(matches!(first, RoundReply::Pending), "{first:?}");
        let second = rounds.sum(contribution(1, vec![10.0, 20.0], 3, None)).expect("sum");
        let RoundReply::Closed(closed) = second else { panic!("{second:?}") };
        assert_eq!((closed.0.clone(), closed.1), (vec![11.0, 22.0], 3));
        let again = rounds.await_round(0, Generation::NONE, 0, Duration::from_secs(60)).expect("await");
        let RoundReply::Closed(same) = again else { panic!("{again:?}") };
        assert!(Arc::ptr_eq(&same, &closed) || *same == *closed);
    }
}
