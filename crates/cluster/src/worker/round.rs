//! `sync = "round"` (S2) on the worker's side: the items of a round from the
//! loader's round queue, stepped on this replica, then one merge.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::Scope;

use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};

use super::Worker;
use super::drive::{Flow, StepDone, Unpushed};
use super::feed::BatchFeed;
use super::policy::SyncPolicy;
use crate::faults;
use crate::generation::Generation;
use crate::messages::WorkerBatch;
use crate::rounds::{RoundMerger, RoundUpdate};
use crate::transport::{ClusterError, LoaderService, Polled, RoundQueueService};

/// `sync = "round"` (S2): this replica steps on its own between round
/// merges at `merger`.
pub struct RoundPolicy {
    merger: Arc<dyn RoundMerger>,
    num_workers: usize,
    /// The round being trained (its feed reads it).
    round: Arc<AtomicU64>,
    /// The weights the round started from.
    begin: Vec<f32>,
    /// This round's items trained here, and their samples.
    items: u64,
    samples: u64,
}

impl RoundPolicy {
    pub fn new(merger: Arc<dyn RoundMerger>, num_workers: usize) -> Self {
        RoundPolicy { merger, num_workers, round: Arc::default(), begin: Vec::new(), items: 0, samples: 0 }
    }
}

/// The items of the current round from the loader's round queue, one at a
/// time: `None` once the round's queue is empty for this worker. A round
/// that waits on an idle stream is a live wait: each `waiting` answer moves
/// the worker's progress.
struct RoundItems<'e> {
    queue: &'e dyn RoundQueueService,
    index: usize,
    generation: Generation,
    round: Arc<AtomicU64>,
    progress: Arc<AtomicU64>,
}

impl BatchFeed for RoundItems<'_> {
    fn next(&mut self, _ahead: usize) -> Result<Option<WorkerBatch>, ClusterError> {
        loop {
            match self.queue.poll_round_item(self.index, self.generation, self.round.load(Ordering::Relaxed))? {
                Polled::Batch(item) => return Ok(Some(*item)),
                Polled::End => return Ok(None),
                Polled::Waiting => {
                    self.progress.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl SyncPolicy for RoundPolicy {
    fn name(&self) -> &'static str {
        "round"
    }

    fn dense_sync(&mut self, _: &Arc<std::sync::atomic::AtomicU64>) -> Box<dyn DenseSync> {
        Box::new(LocalSync)
    }

    fn counts_job_batches(&self) -> bool {
        true
    }

    /// Round 0's items, from `w`'s weights.
    fn open<'s, 'e: 's>(
        &mut self,
        w: &Worker,
        loader: &'e dyn LoaderService,
        _: &'s Scope<'s, 'e>,
    ) -> Result<Box<dyn BatchFeed + 's>, ClusterError> {
        let queue = loader.round_queue().ok_or_else(|| {
            ClusterError::Setup("this job's loader serves no round queue (cluster.sync is not \"round\")".into())
        })?;
        self.round.store(0, Ordering::Relaxed);
        self.begin = w.model.params.flat_values().map_err(TrainError::from)?;
        (self.items, self.samples) = (0, 0);
        Ok(Box::new(RoundItems {
            queue,
            index: w.index,
            generation: w.generation,
            round: self.round.clone(),
            progress: w.progress.clone(),
        }))
    }

    fn stepped(&mut self, _: &mut Worker, done: StepDone, _: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError> {
        self.items += 1;
        self.samples += done.samples;
        Ok(Flow::Train)
    }

    /// The round's items are trained: sends this replica's update (every
    /// row update pushed) and starts the next round from the merged
    /// weights, until a round in which no worker had an item.
    fn ran_dry(&mut self, w: &mut Worker, unpushed: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError> {
        unpushed.push_all(w)?;
        let (index, generation) = (w.index, w.generation);
        let round = self.round.load(Ordering::Relaxed);
        let now = w.model.params.flat_values().map_err(TrainError::from)?;
        let delta: Vec<f32> = now.iter().zip(&self.begin).map(|(w, s)| w - s).collect();
        faults::point("worker.round");
        let sent = 4 * delta.len() as u64;
        let (items, samples) = (std::mem::take(&mut self.items), std::mem::take(&mut self.samples));
        let merged =
            self.merger.merge_round(RoundUpdate { worker: index, generation, round, delta, items, samples })?;
        w.stats.dense_sync_bytes += sent + 4 * merged.delta.len() as u64;
        if merged.delta.len() != self.begin.len() {
            return Err(ClusterError::Setup(format!(
                "round {round}: the merged update has {} values, this worker has {}",
                merged.delta.len(),
                self.begin.len()
            )));
        }
        // Alone, a worker's weights are the merge (start + Δ could round
        // differently); replicas take start + merged Δ, the same bits each.
        if self.num_workers > 1 {
            let next: Vec<f32> = self.begin.iter().zip(&merged.delta).map(|(s, d)| s + d).collect();
            w.model.params.set_flat(&next).map_err(TrainError::from)?;
        }
        self.round.store(round + 1, Ordering::Relaxed);
        if merged.total_items() == 0 {
            return Ok(Flow::Done);
        }
        w.stats.rounds += 1;
        w.stats.round_items.resize(merged.items.len(), 0);
        w.stats.round_items.iter_mut().zip(&merged.items).for_each(|(t, m)| *t += m);
        if let Some(j) = &mut w.job {
            j.batches += merged.total_items();
            j.samples += merged.samples;
        }
        w.progress.fetch_add(1, Ordering::Relaxed);
        w.mark_step()?;
        // The merged model (the replicas agree here) is the one evaluated.
        unpushed.evaluate_if_due(w)?;
        w.checkpoint_if_due(unpushed)?;
        self.begin = w.model.params.flat_values().map_err(TrainError::from)?;
        Ok(Flow::Train)
    }
}
