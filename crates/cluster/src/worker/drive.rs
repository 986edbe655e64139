//! A worker as a [`Run`] of the one training loop (`sparrow_trainer::driver`),
//! whatever its sync policy: batches from the policy's feed through the
//! step engine with the shards as its row source; after each step the loop
//! logs and evaluates as `sparrow train` does, and the policy decides what
//! follows (a checkpoint, an aggregation); when the feed runs dry the policy
//! meets the others (idle rounds, a round merge, the last aggregations) and
//! says whether training goes on. What differs per policy lives in the
//! policy (`policy.rs`).

use std::sync::atomic::Ordering;

use sparrow_trainer::driver::{At, IntervalFigures, Line, Observers, Run};
pub use sparrow_trainer::driver::{Flow, StepDone};
use sparrow_trainer::engine::StepEngine;
use sparrow_trainer::evaluation::Figures;

use super::Worker;
use super::feed::BatchFeed;
use super::policy::SyncPolicy;
use super::remote::RemoteRows;
use crate::faults;
use crate::messages::WorkerBatch;
use crate::transport::{ClusterError, LoaderService};

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

    /// After a step that trained no batch (an idle round, a round's merge):
    /// a periodic evaluation if the job's step passed a multiple of
    /// `train.eval_every_steps`, every update pushed first so the figures
    /// are the model's after this step.
    pub fn evaluate_if_due(&mut self, w: &mut Worker) -> Result<(), ClusterError> {
        let at = w.at();
        if w.observers.evaluation_due(at.step)
            && let Some(figures) = self.evaluate(w)?
        {
            w.observers.log_eval(at, Some(&figures))?;
        }
        Ok(())
    }

    fn evaluate(&mut self, w: &mut Worker) -> Result<Option<Figures>, ClusterError> {
        self.push_all(w)?;
        w.evaluate_now(self.rows.shards)
    }
}

/// A worker training under its policy, as the loop drives it.
struct WorkerRun<'a, 'r> {
    worker: &'a mut Worker,
    policy: &'a mut dyn SyncPolicy,
    feed: &'a mut dyn BatchFeed,
    engine: StepEngine<WorkerBatch, ()>,
    rows: &'a RemoteRows<'r>,
}

impl WorkerRun<'_, '_> {
    fn unpushed(&mut self) -> (&mut Worker, &mut dyn SyncPolicy, Unpushed<'_, '_>) {
        (self.worker, self.policy, Unpushed { engine: &mut self.engine, rows: self.rows })
    }
}

impl Run for WorkerRun<'_, '_> {
    type Error = ClusterError;

    fn step(&mut self) -> Result<Option<StepDone>, ClusterError> {
        let (w, feed) = (&mut *self.worker, &mut *self.feed);
        let mut next = |ahead: usize| feed.next(ahead).transpose();
        let mut done = StepDone::default();
        let stepped = self.engine.step(self.rows, &mut next, |looked| {
            let batch = &looked.batch;
            let (loss, grads) = w.dense(looked)?;
            done.keys = batch.bag_offsets.last().copied().unwrap_or(0) as u64;
            done.unique_keys = batch.num_unique() as u64;
            // A skipped batch trained no samples (`non_finite.rs`).
            if grads.is_some() {
                (done.samples, done.weight, done.loss) = (batch.rows as u64, batch.weight_sum(), loss);
            }
            Ok(((), grads))
        });
        let Some(stepped) = stepped? else {
            // The step that found no batch left still waited for the loader to say so.
            w.stats.phase_secs.next_batch += self.engine.take_end_wait();
            return Ok(None);
        };
        w.record_phases(stepped)?;
        w.mark_step()?;
        Ok(Some(done))
    }

    fn at(&self) -> At {
        self.worker.at()
    }

    fn observers(&mut self) -> &mut Observers {
        &mut self.worker.observers
    }

    fn check_weights(&mut self) -> Result<(), ClusterError> {
        let step = self.worker.job_step();
        let w = &self.worker;
        w.model.check_finite(&w.optimizer).map_err(|e| match e {
            sparrow_model::ModelError::NonFinite { what } => sparrow_trainer::TrainError::NonFinite { step, what },
            other => other.into(),
        })?;
        Ok(())
    }

    fn describe(&mut self, _: &IntervalFigures) -> Line {
        let stats = &self.worker.stats;
        let online = self.worker.online.as_ref().map(sparrow_trainer::online::OnlineFigures::of);
        let mut line =
            Line { phase_secs: serde_json::to_value(stats.phase_secs).unwrap_or_default(), ..Line::default() };
        line.fields.insert("bad_rows".into(), stats.bad_rows.into());
        // `[data.stream]`: where this worker's newest batch left the stream.
        if let Some(m) = &stats.last_stream {
            let lag_secs = sparrow_trainer::input::lag_secs(m);
            line.fields.insert("stream_records".into(), m.records.into());
            line.fields.insert("stream_lag_records".into(), m.lag_records.into());
            line.fields.insert("stream_lag_secs".into(), serde_json::to_value(lag_secs).unwrap_or_default());
            line.fields
                .insert("stream_newest_record_ms".into(), serde_json::to_value(m.newest_record_ms).unwrap_or_default());
            line.fields.insert("future_records".into(), m.future_records.into());
            line.fields.insert("stream_gap_records".into(), m.gap_records.into());
            line.fields.insert("stream_offset_resets".into(), m.offset_resets.into());
        }
        if let Some(online) = online {
            line.fields.insert("online_window".into(), serde_json::to_value(online.window).unwrap_or_default());
            line.fields.insert("online_run".into(), serde_json::to_value(online.run).unwrap_or_default());
            line.scalars.extend(online.scalars().into_iter().map(|(t, v)| (t.to_string(), v)));
        }
        line
    }

    fn evaluate(&mut self) -> Result<Option<Figures>, ClusterError> {
        let (w, _, mut unpushed) = self.unpushed();
        unpushed.evaluate(w)
    }

    fn stepped(&mut self, done: StepDone) -> Result<Flow, ClusterError> {
        let (w, policy, mut unpushed) = self.unpushed();
        policy.stepped(w, done, &mut unpushed)
    }

    fn ran_dry(&mut self) -> Result<Flow, ClusterError> {
        let (w, policy, mut unpushed) = self.unpushed();
        policy.ran_dry(w, &mut unpushed)
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
        // Intervals and evaluations count from where this training starts
        // (a resumed job, a recovered generation).
        let at = self.at();
        self.observers.start(at);
        let engine = StepEngine::new(self.pipeline_depth);
        std::thread::scope(|scope| {
            let mut feed = policy.open(self, loader, scope)?;
            let mut run = WorkerRun { worker: self, policy, feed: feed.as_mut(), engine, rows };
            let trained = sparrow_trainer::driver::drive(&mut run);
            let flushed = trained.and_then(|()| {
                let secs = run.engine.flush(rows)?;
                run.worker.stats.phase_secs.push += secs;
                Ok(())
            });
            feed.close().and(flushed)
        })?;
        policy.finish(self)?;
        // `data.validation`: an epoch's end is judged before its checkpoint
        // (`epochs.rs`), which every worker then takes part in.
        let epoch_end = self.epochs.is_some() && loader.training_ended_at_epoch_end(self.generation)?;
        let validated = self.validate_epoch(epoch_end, rows.shards)?;
        let end =
            validated || self.checkpoints.as_ref().is_some_and(|c| self.job_step() > c.last_step || c.export_only);
        if end { self.checkpoint_now(true) } else { Ok(()) }
    }

    /// Where this worker stands, for its observers.
    pub(super) fn at(&self) -> At {
        At {
            step: self.job_step(),
            batches: self.stats.batches,
            samples: self.stats.rows,
            job_samples: self.job_samples(),
            epoch: self.stats.last_end.epoch,
        }
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
            self.checkpoint_now(false)?;
        }
        Ok(())
    }
}
