//! `sync = "step"` (S0.6 with S2.2): one dense step for all workers, their
//! gradients summed every step (alone: this worker's own). The next batch
//! is fetched from the loader while this one trains (it carries no
//! embeddings, so fetching early changes nothing in the model).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use sparrow_core::simd::Simd;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};
use sparrow_trainer::engine::{StepEngine, idle_step};

use super::Worker;
use super::policy::SyncPolicy;
use super::remote::RemoteRows;
use crate::generation::Generation;
use crate::messages::{Mode, WorkerBatch};
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

    fn dense_sync(&mut self) -> Box<dyn DenseSync> {
        match &self.summer {
            Some(summer) => Box::new(
                RoundSync::new(self.index, summer.clone(), self.simd)
                    .in_generation(self.generation)
                    .counting_bytes(self.bytes.clone()),
            ),
            None => Box::new(LocalSync),
        }
    }

    /// Trains until no worker has a batch left. The last update is pushed
    /// before the worker joins the rounds idle, so the shards hold every
    /// update when training ends.
    fn train(&mut self, w: &mut Worker, loader: &dyn LoaderService, rows: &RemoteRows<'_>) -> Result<(), ClusterError> {
        let index = w.index;
        let generation = w.generation;
        std::thread::scope(|scope| {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let prefetch = scope.spawn(move || -> Result<(), ClusterError> {
                loop {
                    let batch = loader.next_batch(index, Mode::Train, generation)?;
                    let end = batch.is_none();
                    if tx.send(batch).is_err() || end {
                        return Ok(());
                    }
                }
            });
            let trained = w.train_steps(rows, &rx).and_then(|()| {
                // Joins the rounds with nothing until every worker is out of data.
                while idle_step(&w.model, &mut w.optimizer, w.sync.as_mut())? {
                    w.progress.fetch_add(1, Ordering::Relaxed);
                    w.after_step::<RemoteRows<'_>>(None)?;
                }
                // The job's last checkpoint (unless the last step made one).
                let end = w.checkpoints.as_ref().is_some_and(|c| w.optimizer.step > c.last_step);
                if end { w.checkpoint_now() } else { Ok(()) }
            });
            drop(rx);
            // A loader error ends the prefetch thread first; report it over the
            // symptom (the queue closing early).
            let fetched =
                prefetch.join().unwrap_or_else(|_| Err(ClusterError::Setup("the prefetch thread panicked".into())));
            fetched.and(trained)
        })?;
        w.stats.dense_sync_bytes += self.bytes.swap(0, Ordering::Relaxed);
        Ok(())
    }
}

impl Worker {
    /// Every batch of `batches` through the step engine, then the update left waiting.
    pub(super) fn train_steps(
        &mut self,
        rows: &RemoteRows<'_>,
        batches: &crossbeam_channel::Receiver<Option<WorkerBatch>>,
    ) -> Result<(), ClusterError> {
        let mut engine = StepEngine::new(self.pipeline_depth);
        let mut next_batch_secs = 0.0;
        loop {
            let mut next = |_: usize| {
                let waited = Instant::now();
                // `None` at the end of the data, or when the prefetch thread
                // stopped on an error it reports itself.
                let next = batches.recv().ok().flatten();
                next_batch_secs += waited.elapsed().as_secs_f64();
                next.map(Ok)
            };
            let stepped = engine.step(rows, &mut next, |looked| {
                let (_, grads) = self.dense(looked)?;
                Ok(((), Some(grads)))
            })?;
            let Some(stepped) = stepped else { break };
            self.record_phases(stepped)?;
            self.after_step(Some((&mut engine, rows)))?;
        }
        self.stats.phase_secs.push += engine.flush(rows)?;
        self.stats.phase_secs.next_batch += next_batch_secs;
        Ok(())
    }
}
