//! `sync = "step"` (S0.6 with S2.2): one dense step for all workers, their
//! gradients summed every step (alone: this worker's own). The next batch
//! is fetched from the loader while this one trains (it carries no
//! embeddings, so fetching early changes nothing in the model).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::Scope;

use sparrow_core::simd::Simd;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};
use sparrow_trainer::engine::idle_step;

use super::Worker;
use super::drive::{Flow, StepDone, Unpushed};
use super::feed::{BatchFeed, Prefetched};
use super::policy::SyncPolicy;
use crate::generation::Generation;
use crate::sync::{RoundSummer, RoundSync};
use crate::transport::{ClusterError, LoaderService};

/// `sync = "step"`: every dense step summed across the workers at `summer`
/// (none: a worker alone).
pub struct StepPolicy {
    index: usize,
    generation: Generation,
    summer: Option<Arc<dyn RoundSummer>>,
    /// Bytes the step sums moved.
    bytes: Arc<AtomicU64>,
    /// `train.simd`, for the finiteness check of the gradients it sends.
    simd: Simd,
}

impl StepPolicy {
    /// A worker alone: its own gradients, no sums.
    pub fn alone(index: usize, generation: Generation) -> Self {
        StepPolicy { index, generation, summer: None, bytes: Arc::default(), simd: Simd::Auto }
    }

    /// Worker `index` of generation `generation`, summing at `summer`.
    pub fn summing(index: usize, generation: Generation, summer: Arc<dyn RoundSummer>, simd: Simd) -> Self {
        StepPolicy { summer: Some(summer), simd, ..StepPolicy::alone(index, generation) }
    }
}

impl SyncPolicy for StepPolicy {
    fn name(&self) -> &'static str {
        "step"
    }

    fn dense_sync(&mut self, progress: &Arc<std::sync::atomic::AtomicU64>) -> Box<dyn DenseSync> {
        match &self.summer {
            Some(summer) => Box::new(
                RoundSync::new(self.index, summer.clone(), self.simd)
                    .in_generation(self.generation)
                    .with_progress(progress.clone())
                    .counting_bytes(self.bytes.clone()),
            ),
            None => Box::new(LocalSync),
        }
    }

    /// The loader's batches, the next fetched while this one trains.
    fn open<'s, 'e: 's>(
        &mut self,
        w: &Worker,
        loader: &'e dyn LoaderService,
        scope: &'s Scope<'s, 'e>,
    ) -> Result<Box<dyn BatchFeed + 's>, ClusterError> {
        Ok(Box::new(Prefetched::spawn(scope, loader, w.index, w.generation, w.progress.clone())))
    }

    /// A checkpoint every `checkpoint.every_steps` dense steps.
    fn stepped(&mut self, w: &mut Worker, _: StepDone, unpushed: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError> {
        w.checkpoint_if_due(unpushed)?;
        Ok(Flow::Train)
    }

    /// This worker's data ended: the last update is pushed, then it joins
    /// the rounds with nothing until every worker is out of data, so the
    /// shards hold every update when training ends.
    fn ran_dry(&mut self, w: &mut Worker, unpushed: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError> {
        unpushed.push_all(w)?;
        while idle_step(&w.model, &mut w.optimizer, w.sync.as_mut())? {
            w.progress.fetch_add(1, Ordering::Relaxed);
            w.mark_step()?;
            unpushed.evaluate_if_due(w)?;
            w.checkpoint_if_due(unpushed)?;
        }
        Ok(Flow::Done)
    }

    fn finish(&mut self, w: &mut Worker) -> Result<(), ClusterError> {
        w.stats.dense_sync_bytes += self.bytes.swap(0, Ordering::Relaxed);
        Ok(())
    }
}
