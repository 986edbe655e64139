//! `sync = "lazy"` (S4) on the worker's side: local iterations until the
//! scheduler's instruction, then a contribution and the aggregated weights.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sparrow_trainer::TrainError;
use sparrow_trainer::engine::StepEngine;

use super::remote::RemoteRows;
use super::{JobCount, Worker};
use crate::faults;
use crate::lazy::Contribution as LazyContribution;
use crate::messages::Mode;
use crate::transport::{ClusterError, LoaderService};

impl Worker {
    /// `sync = "lazy"` (S4): trains batch after batch on this replica,
    /// asking the scheduler after each whether to aggregate (waiting at
    /// `max_local_iterations`, or once its data is finished and it still has
    /// iterations to send); sends its delta or round gradient for each
    /// instruction and takes the new weights. After the last, every worker
    /// takes the final weights (the model the job evaluates and saves).
    pub(super) fn train_lazy(&mut self, loader: &dyn LoaderService, rows: &RemoteRows<'_>) -> Result<(), ClusterError> {
        let (index, generation) = (self.index, self.generation);
        let Some(part) = &self.lazy else { return Ok(()) };
        let (link, max_local, recorded) = (part.link.clone(), part.cfg.max_local_iterations, part.recorded.clone());
        let mut at_last = self.model.params.flat_values().map_err(TrainError::from)?;
        let (mut since, mut coefficient, mut samples, mut finished) = (0u64, 0f64, 0u64, false);
        let mut engine = StepEngine::new(self.pipeline_depth);
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
                    let (_, grads) = self.dense(looked)?;
                    Ok(((), Some(grads)))
                })?;
                match stepped {
                    Some(stepped) => {
                        self.record_phases(stepped)?;
                        since += 1;
                        samples += trained.0;
                        coefficient += trained.1;
                        faults::point("worker.step");
                        faults::worker_step(index);
                        self.check_generation()?;
                    }
                    None => {
                        finished = true;
                        self.stats.phase_secs.push += engine.flush(rows)?;
                    }
                }
            }
            let wait = finished || since >= max_local;
            let waited = Instant::now();
            let instruction = link.poll(index, generation, since, finished, wait)?;
            self.stats.lazy_wait_secs += waited.elapsed().as_secs_f64();
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
                    let now = self.model.params.flat_values().map_err(TrainError::from)?;
                    now.iter().zip(&at_last).map(|(w, x)| w - x).collect()
                }
            };
            self.stats.dense_sync_bytes += 4 * values.len() as u64;
            // Every update pushed first: an aggregation may be a backup, committed as a checkpoint.
            self.stats.phase_secs.push += engine.flush(rows)?;
            let done = link.contribute(LazyContribution {
                worker: index,
                generation,
                instruction: instruction.id,
                participants: instruction.participants.clone(),
                values,
                coefficient,
                finished,
                position: self.stats.last_end,
                iterations: since,
                samples,
            })?;
            self.stats.aggregations += 1;
            (since, coefficient, samples) = (0, 0.0, 0);
            self.job = Some(JobCount { batches: done.job_batches, samples: done.job_samples });
            // A backup committed as a checkpoint: the job's last one need not repeat it.
            if let (Some(step), Some(c)) = (done.committed, self.checkpoints.as_mut()) {
                c.last_step = c.last_step.max(step);
            }
            self.reported_step.store(self.job_step(), Ordering::Relaxed);
            match done.weights {
                Some(w) => {
                    self.stats.dense_sync_bytes += 4 * w.len() as u64;
                    self.model.params.set_flat(&w).map_err(TrainError::from)?;
                    at_last = w.to_vec();
                }
                None => break,
            }
            self.progress.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.phase_secs.push += engine.flush(rows)?;
        self.stats.phase_secs.next_batch += next_batch_secs;
        // Every worker ends with the aggregated model.
        let done = link.final_weights(generation)?;
        self.stats.dense_sync_bytes += 4 * done.weights.len() as u64;
        self.model.params.set_flat(&done.weights).map_err(TrainError::from)?;
        if let Some(j) = &mut self.job {
            (j.batches, j.samples) = (done.job_batches, done.job_samples);
        }
        // The job's newest committed backup, as every worker learns it: all
        // decide alike whether the end needs a checkpoint (one asked for by
        // a worker alone waits for the others' cuts forever).
        if let (Some(step), Some(c)) = (done.committed, self.checkpoints.as_mut()) {
            c.last_step = c.last_step.max(step);
        }
        self.lazy_report = Some(done.report);
        let end = self.checkpoints.as_ref().is_some_and(|c| self.job_step() > c.last_step);
        if end { self.checkpoint_now() } else { Ok(()) }
    }
}
