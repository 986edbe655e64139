//! `sync = "lazy"` (S4) on the worker's side: local iterations until the
//! scheduler's instruction, then a contribution and the aggregated weights.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sparrow_trainer::TrainError;
use sparrow_trainer::engine::StepEngine;

use std::sync::Arc;

use parking_lot::Mutex;
use sparrow_core::config::{LazyConfig, LazySend};
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};

use super::policy::SyncPolicy;
use super::remote::RemoteRows;
use super::{JobCount, Worker};
use crate::faults;
use crate::lazy::{Contribution as LazyContribution, LazyLink};
use crate::messages::Mode;
use crate::transport::{ClusterError, LoaderService};

/// `sync = "lazy"` (S4): this replica steps on its own; the scheduler (at
/// `link`, directly or through an aggregator) has the workers aggregate.
pub struct LazyPolicy {
    link: Arc<dyn LazyLink>,
    cfg: LazyConfig,
    /// `send = "round_gradient"`: each iteration's mean gradient since the
    /// last aggregation, as the dense step computed it.
    recorded: Option<Arc<Mutex<Vec<Vec<f32>>>>>,
}

impl LazyPolicy {
    pub fn new(link: Arc<dyn LazyLink>, cfg: &LazyConfig) -> Self {
        let recorded = (cfg.send == LazySend::RoundGradient).then(Arc::default);
        LazyPolicy { link, cfg: cfg.clone(), recorded }
    }
}

/// The step engine's dense policy for a replica of its own that keeps each
/// step's mean gradient (`cluster.lazy.send = "round_gradient"`).
struct RecordingSync(Arc<Mutex<Vec<Vec<f32>>>>);

impl DenseSync for RecordingSync {
    fn combine(
        &mut self,
        params: &sparrow_model::ParamStore,
        grads: sparrow_model::DenseGrads,
    ) -> Result<Option<sparrow_model::DenseGrads>, TrainError> {
        if grads.rows > 0 {
            let mut flat = grads.flat_sum_terms(params);
            let inv = 1.0 / grads.rows as f32;
            flat.iter_mut().for_each(|g| *g *= inv);
            self.0.lock().push(flat);
        }
        LocalSync.combine(params, grads)
    }
}

impl SyncPolicy for LazyPolicy {
    fn name(&self) -> &'static str {
        "lazy"
    }

    fn dense_sync(&mut self) -> Box<dyn DenseSync> {
        match &self.recorded {
            Some(r) => Box::new(RecordingSync(Arc::clone(r))),
            None => Box::new(LocalSync),
        }
    }

    fn counts_job_batches(&self) -> bool {
        true
    }

    /// `sync = "lazy"` (S4): trains batch after batch on this replica,
    /// asking the scheduler after each whether to aggregate (waiting at
    /// `max_local_iterations`, or once its data is finished and it still has
    /// iterations to send); sends its delta or round gradient for each
    /// instruction and takes the new weights. After the last, every worker
    /// takes the final weights (the model the job evaluates and saves).
    fn train(&mut self, w: &mut Worker, loader: &dyn LoaderService, rows: &RemoteRows<'_>) -> Result<(), ClusterError> {
        let (index, generation) = (w.index, w.generation);
        let (link, max_local, recorded) = (self.link.clone(), self.cfg.max_local_iterations, self.recorded.clone());
        let mut at_last = w.model.params.flat_values().map_err(TrainError::from)?;
        let (mut since, mut coefficient, mut samples, mut finished) = (0u64, 0f64, 0u64, false);
        let mut engine = StepEngine::new(w.pipeline_depth);
        let mut next_batch_secs = 0.0;
        loop {
            if !finished {
                let mut next = |_: usize| {
                    let waited = Instant::now();
                    let next = loader.next_batch(index, Mode::Train, generation).transpose();
                    next_batch_secs += waited.elapsed().as_secs_f64();
                    next
                };
                let mut trained = (0u64, 0f64);
                let stepped = engine.step(rows, &mut next, |looked| {
                    trained = (looked.batch.rows as u64, looked.batch.weight_sum());
                    let (_, grads) = w.dense(looked)?;
                    Ok(((), Some(grads)))
                })?;
                match stepped {
                    Some(stepped) => {
                        w.record_phases(stepped)?;
                        since += 1;
                        samples += trained.0;
                        coefficient += trained.1;
                        faults::point("worker.step");
                        faults::worker_step(index);
                        w.check_generation()?;
                    }
                    None => {
                        finished = true;
                        w.stats.phase_secs.push += engine.flush(rows)?;
                    }
                }
            }
            let wait = finished || since >= max_local;
            let waited = Instant::now();
            let instruction = link.poll(index, generation, since, finished, wait)?;
            w.stats.lazy_wait_secs += waited.elapsed().as_secs_f64();
            let Some(instruction) = instruction else {
                if finished {
                    break;
                }
                continue;
            };
            let values = match &recorded {
                Some(grads) => {
                    let mut grads = grads.lock();
                    let at = (instruction.round as usize).clamp(1, grads.len().max(1)) - 1;
                    let g = grads.get(at).cloned().ok_or_else(|| {
                        ClusterError::Setup(format!("worker {index}: no gradient for round {}", instruction.round))
                    })?;
                    grads.clear();
                    g
                }
                None => {
                    let now = w.model.params.flat_values().map_err(TrainError::from)?;
                    now.iter().zip(&at_last).map(|(w, x)| w - x).collect()
                }
            };
            w.stats.dense_sync_bytes += 4 * values.len() as u64;
            // Every update pushed first: an aggregation may be a backup, committed as a checkpoint.
            w.stats.phase_secs.push += engine.flush(rows)?;
            let done = link.contribute(LazyContribution {
                worker: index,
                generation,
                instruction: instruction.id,
                participants: instruction.participants.clone(),
                values,
                coefficient,
                finished,
                position: w.stats.last_end,
                iterations: since,
                samples,
            })?;
            w.stats.aggregations += 1;
            (since, coefficient, samples) = (0, 0.0, 0);
            w.job = Some(JobCount { batches: done.job_batches, samples: done.job_samples });
            // A backup committed as a checkpoint: the job's last one need not repeat it.
            if let (Some(step), Some(c)) = (done.committed, w.checkpoints.as_mut()) {
                c.last_step = c.last_step.max(step);
            }
            w.reported_step.store(w.job_step(), Ordering::Relaxed);
            match done.weights {
                Some(weights) => {
                    w.stats.dense_sync_bytes += 4 * weights.len() as u64;
                    w.model.params.set_flat(&weights).map_err(TrainError::from)?;
                    at_last = weights.to_vec();
                }
                None => break,
            }
            w.progress.fetch_add(1, Ordering::Relaxed);
        }
        w.stats.phase_secs.push += engine.flush(rows)?;
        w.stats.phase_secs.next_batch += next_batch_secs;
        // Every worker ends with the aggregated model.
        let done = link.final_weights(generation)?;
        w.stats.dense_sync_bytes += 4 * done.weights.len() as u64;
        w.model.params.set_flat(&done.weights).map_err(TrainError::from)?;
        if let Some(j) = &mut w.job {
            (j.batches, j.samples) = (done.job_batches, done.job_samples);
        }
        // The job's newest committed backup, as every worker learns it: all
        // decide alike whether the end needs a checkpoint (one asked for by
        // a worker alone waits for the others' cuts forever).
        if let (Some(step), Some(c)) = (done.committed, w.checkpoints.as_mut()) {
            c.last_step = c.last_step.max(step);
        }
        w.lazy_report = Some(done.report);
        let end = w.checkpoints.as_ref().is_some_and(|c| w.job_step() > c.last_step);
        if end { w.checkpoint_now() } else { Ok(()) }
    }
}
