//! The worker's one training loop, whatever its sync policy: batches from
//! the policy's feed through the step engine; after each step the loop
//! counts it and the policy decides what follows (a checkpoint, an
//! aggregation); when the feed runs dry the policy meets the others (idle
//! rounds, a round merge, the last aggregations) and says whether training
//! goes on. What differs per policy lives in the policy (`policy.rs`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use sparrow_trainer::engine::StepEngine;

use super::Worker;
use super::feed::BatchFeed;
use super::policy::SyncPolicy;
use super::remote::RemoteRows;
use crate::faults;
use crate::messages::WorkerBatch;
use crate::transport::{ClusterError, LoaderService};

/// What the loop does after a policy's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Take the feed's next batch.
    Train,
    /// Training is over (the policy's last meeting was held).
    Done,
}

/// The batch a step just trained, as a policy counts it.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepDone {
    pub samples: u64,
    /// Its samples' weights (`[data.weighting]`; the samples otherwise).
    pub weight: f64,
}

/// The step engine's updates still waiting (`train.pipeline_depth` ≥ 1): a
/// policy pushes them before the shards' rows are read as trained (a
/// checkpoint, an aggregation that may be committed as one).
pub struct Unpushed<'a, 'r> {
    engine: &'a mut StepEngine<WorkerBatch, ()>,
    rows: &'a RemoteRows<'r>,
}

impl Unpushed<'_, '_> {
    /// Pushes every update left waiting, counting the seconds in `w`'s stats.
    pub fn push_all(&mut self, w: &mut Worker) -> Result<(), ClusterError> {
        w.stats.phase_secs.push += self.engine.flush(self.rows)?;
        Ok(())
    }

    /// After a step (trained, idle or a round's merge): a periodic
    /// evaluation if the job's step passed a multiple of
    /// `train.eval_every_steps`, every update pushed first so the figures
    /// are the model's after this step.
    pub fn evaluate_if_due(&mut self, w: &mut Worker) -> Result<(), ClusterError> {
        if w.evaluation_due() {
            self.push_all(w)?;
            w.evaluate_now(self.rows.shards)?;
        }
        Ok(())
    }
}

impl Worker {
    /// Trains under `policy` until it says training is over, then takes the
    /// job's last checkpoint (unless the last step made one).
    pub(super) fn train_under(
        &mut self,
        policy: &mut dyn SyncPolicy,
        loader: &dyn LoaderService,
        rows: &RemoteRows<'_>,
    ) -> Result<(), ClusterError> {
        std::thread::scope(|scope| {
            let mut feed = policy.open(self, loader, scope)?;
            let trained = self.drive(policy, feed.as_mut(), rows);
            feed.close().and(trained)
        })?;
        policy.finish(self)?;
        let end = self.checkpoints.as_ref().is_some_and(|c| self.job_step() > c.last_step);
        if end { self.checkpoint_now() } else { Ok(()) }
    }

    fn drive(
        &mut self,
        policy: &mut dyn SyncPolicy,
        feed: &mut dyn BatchFeed,
        rows: &RemoteRows<'_>,
    ) -> Result<(), ClusterError> {
        let mut engine = StepEngine::new(self.pipeline_depth);
        let mut next_batch_secs = 0.0;
        loop {
            let mut next = |ahead: usize| {
                let waited = Instant::now();
                let next = feed.next(ahead).transpose();
                next_batch_secs += waited.elapsed().as_secs_f64();
                next
            };
            let mut done = StepDone::default();
            let stepped = engine.step(rows, &mut next, |looked| {
                let (_, grads) = self.dense(looked)?;
                // A skipped batch trained no samples (`non_finite.rs`).
                if grads.is_some() {
                    done = StepDone { samples: looked.batch.rows as u64, weight: looked.batch.weight_sum() };
                }
                Ok(((), grads))
            })?;
            let mut unpushed = Unpushed { engine: &mut engine, rows };
            let flow = match stepped {
                Some(stepped) => {
                    self.record_phases(stepped)?;
                    self.mark_step()?;
                    self.log_step()?;
                    unpushed.evaluate_if_due(self)?;
                    policy.stepped(self, done, &mut unpushed)?
                }
                None => policy.ran_dry(self, &mut unpushed)?,
            };
            if flow == Flow::Done {
                break;
            }
        }
        self.stats.phase_secs.push += engine.flush(rows)?;
        self.stats.phase_secs.next_batch += next_batch_secs;
        Ok(())
    }

    /// After a step (a trained batch, an idle round, a merge): reports it
    /// to the heartbeats, and gives up if the job moved on.
    pub(super) fn mark_step(&mut self) -> Result<(), ClusterError> {
        self.reported_step.store(self.job_step(), Ordering::Relaxed);
        faults::point("worker.step");
        faults::worker_step(self.index);
        self.check_generation()
    }

    /// Takes part in a checkpoint if the step just made is due one, every
    /// update pushed first.
    pub(super) fn checkpoint_if_due(&mut self, unpushed: &mut Unpushed<'_, '_>) -> Result<(), ClusterError> {
        if self.checkpoint_due() {
            unpushed.push_all(self)?;
            self.checkpoint_now()?;
        }
        Ok(())
    }
}
