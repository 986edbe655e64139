//! `sync = "lazy"` (S4) on the worker's side: local iterations until the
//! scheduler's instruction, then a contribution and the aggregated weights.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::Scope;
use std::time::Instant;

use parking_lot::Mutex;
use sparrow_core::config::{LazyConfig, LazySend};
use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};

use super::drive::{Flow, StepDone, Unpushed};
use super::feed::{BatchFeed, LoaderStream};
use super::policy::SyncPolicy;
use super::{JobCount, Worker};
use crate::lazy::{Contribution as LazyContribution, LazyLink};
use crate::transport::{ClusterError, LoaderService};

/// `sync = "lazy"` (S4): this replica steps on its own; the scheduler (at
/// `link`, directly or through an aggregator) has the workers aggregate.
pub struct LazyPolicy {
    link: Arc<dyn LazyLink>,
    cfg: LazyConfig,
    /// `send = "round_gradient"`: each iteration's mean gradient since the
    /// last aggregation, as the dense step computed it.
    recorded: Option<Arc<Mutex<Vec<Vec<f32>>>>>,
    /// The weights of the last aggregation (or the start).
    at_last: Vec<f32>,
    /// What this worker trained since then.
    since: Since,
}

/// A lazy worker's training since its last aggregation.
#[derive(Clone, Copy, Debug, Default)]
struct Since {
    iterations: u64,
    samples: u64,
    /// Its samples' weights (the aggregation's coefficient).
    coefficient: f64,
}

impl LazyPolicy {
    pub fn new(link: Arc<dyn LazyLink>, cfg: &LazyConfig) -> Self {
        let recorded = (cfg.send == LazySend::RoundGradient).then(Arc::default);
        LazyPolicy { link, cfg: cfg.clone(), recorded, at_last: Vec::new(), since: Since::default() }
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

    fn dense_sync(&mut self, _: &Arc<std::sync::atomic::AtomicU64>) -> Box<dyn DenseSync> {
        match &self.recorded {
            Some(r) => Box::new(RecordingSync(Arc::clone(r))),
            None => Box::new(LocalSync),
        }
    }

    fn counts_job_batches(&self) -> bool {
        true
    }

    /// The loader's batches, each fetched when the step asks, from `w`'s weights.
    fn open<'s, 'e: 's>(
        &mut self,
        w: &Worker,
        loader: &'e dyn LoaderService,
        _: &'s Scope<'s, 'e>,
    ) -> Result<Box<dyn BatchFeed + 's>, ClusterError> {
        self.at_last = w.model.params.flat_values().map_err(TrainError::from)?;
        self.since = Since::default();
        Ok(Box::new(LoaderStream::new(loader, w.index, w.generation, w.progress.clone())))
    }

    /// Asks the scheduler whether to aggregate (waiting for its answer at
    /// `max_local_iterations`).
    fn stepped(
        &mut self,
        w: &mut Worker,
        done: StepDone,
        unpushed: &mut Unpushed<'_, '_>,
    ) -> Result<Flow, ClusterError> {
        let since = &mut self.since;
        since.iterations += 1;
        since.samples += done.samples;
        since.coefficient += done.weight;
        let wait = since.iterations >= self.cfg.max_local_iterations;
        Ok(match self.ask(w, unpushed, false, wait)? {
            Asked::Nothing | Asked::Weights => Flow::Train,
            Asked::End => Flow::Done,
        })
    }

    /// This worker's data ended: it answers each instruction left (it may
    /// still have iterations to send) until the scheduler has none for it.
    fn ran_dry(&mut self, w: &mut Worker, unpushed: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError> {
        unpushed.push_all(w)?;
        while self.ask(w, unpushed, true, true)? == Asked::Weights {}
        Ok(Flow::Done)
    }

    /// Every worker takes the final weights (the model the job evaluates and saves).
    fn finish(&mut self, w: &mut Worker) -> Result<(), ClusterError> {
        let done = self.link.final_weights(w.generation)?;
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
        Ok(())
    }
}

/// What asking the scheduler came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// No instruction for this worker now.
    Nothing,
    /// An aggregation: this worker took its weights.
    Weights,
    /// The scheduler is done with this worker.
    End,
}

impl LazyPolicy {
    /// Asks the scheduler for an instruction (`finished`: this worker's data
    /// ended; `wait`: until it has one). For one, sends this worker's delta
    /// or round gradient, every row update pushed first (the aggregation may
    /// be a backup, committed as a checkpoint), and takes the new weights.
    fn ask(
        &mut self,
        w: &mut Worker,
        unpushed: &mut Unpushed<'_, '_>,
        finished: bool,
        wait: bool,
    ) -> Result<Asked, ClusterError> {
        let (index, generation) = (w.index, w.generation);
        let waited = Instant::now();
        let instruction = self.link.poll(index, generation, self.since.iterations, finished, wait)?;
        w.stats.lazy_wait_secs += waited.elapsed().as_secs_f64();
        let Some(instruction) = instruction else { return Ok(Asked::Nothing) };
        let values = match &self.recorded {
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
                now.iter().zip(&self.at_last).map(|(w, x)| w - x).collect()
            }
        };
        w.stats.dense_sync_bytes += 4 * values.len() as u64;
        unpushed.push_all(w)?;
        let since = std::mem::take(&mut self.since);
        let done = self.link.contribute(LazyContribution {
            worker: index,
            generation,
            instruction: instruction.id,
            participants: instruction.participants.clone(),
            values,
            coefficient: since.coefficient,
            finished,
            position: w.stats.last_end,
            iterations: since.iterations,
            samples: since.samples,
        })?;
        w.stats.aggregations += 1;
        w.job = Some(JobCount { batches: done.job_batches, samples: done.job_samples });
        // A backup committed as a checkpoint: the job's last one need not repeat it.
        if let (Some(step), Some(c)) = (done.committed, w.checkpoints.as_mut()) {
            c.last_step = c.last_step.max(step);
        }
        w.reported_step.store(w.job_step(), Ordering::Relaxed);
        let Some(weights) = done.weights else { return Ok(Asked::End) };
        w.stats.dense_sync_bytes += 4 * weights.len() as u64;
        w.model.params.set_flat(&weights).map_err(TrainError::from)?;
        self.at_last = weights.to_vec();
        w.progress.fetch_add(1, Ordering::Relaxed);
        Ok(Asked::Weights)
    }
}
