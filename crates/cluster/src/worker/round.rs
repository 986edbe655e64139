//! `sync = "round"` (S2) on the worker's side: the items of a round from the
//! loader's round queue, stepped on this replica, then one merge.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};
use sparrow_trainer::engine::StepEngine;

use super::Worker;
use super::policy::SyncPolicy;
use super::remote::RemoteRows;
use crate::faults;
use crate::messages::WorkerBatch;
use crate::rounds::{RoundMerger, RoundUpdate};
use crate::transport::{ClusterError, LoaderService};

/// `sync = "round"` (S2): this replica steps on its own between round
/// merges at `merger`.
pub struct RoundPolicy {
    merger: Arc<dyn RoundMerger>,
    num_workers: usize,
}

impl RoundPolicy {
    pub fn new(merger: Arc<dyn RoundMerger>, num_workers: usize) -> Self {
        RoundPolicy { merger, num_workers }
    }
}

impl SyncPolicy for RoundPolicy {
    fn name(&self) -> &'static str {
        "round"
    }

    fn dense_sync(&mut self) -> Box<dyn DenseSync> {
        Box::new(LocalSync)
    }

    fn counts_job_batches(&self) -> bool {
        true
    }

    /// `sync = "round"` (S2): takes items of each round from the loader's
    /// round queue one at a time, stepping this replica after each; at the
    /// round's end sends its update and starts the next round from the
    /// merged weights, until a round in which no worker had an item.
    fn train(&mut self, w: &mut Worker, loader: &dyn LoaderService, rows: &RemoteRows<'_>) -> Result<(), ClusterError> {
        let (index, generation) = (w.index, w.generation);
        let queue = loader.round_queue().ok_or_else(|| {
            ClusterError::Setup("this job's loader serves no round queue (cluster.sync is not \"round\")".into())
        })?;
        let mut round = 0u64;
        loop {
            let begin = w.model.params.flat_values().map_err(TrainError::from)?;
            let (items, samples) = w.train_round_items(rows, |_| queue.next_round_item(index, generation, round))?;
            let now = w.model.params.flat_values().map_err(TrainError::from)?;
            let delta: Vec<f32> = now.iter().zip(&begin).map(|(w, s)| w - s).collect();
            faults::point("worker.round");
            let (merger, num_workers) = (self.merger.clone(), self.num_workers);
            let sent = 4 * delta.len() as u64;
            let merged = merger.merge_round(RoundUpdate { worker: index, generation, round, delta, items, samples })?;
            w.stats.dense_sync_bytes += sent + 4 * merged.delta.len() as u64;
            if merged.delta.len() != begin.len() {
                return Err(ClusterError::Setup(format!(
                    "round {round}: the merged update has {} values, this worker has {}",
                    merged.delta.len(),
                    begin.len()
                )));
            }
            // Alone, a worker's weights are the merge (start + Δ could round
            // differently); replicas take start + merged Δ, the same bits each.
            if num_workers > 1 {
                let next: Vec<f32> = begin.iter().zip(&merged.delta).map(|(s, d)| s + d).collect();
                w.model.params.set_flat(&next).map_err(TrainError::from)?;
            }
            round += 1;
            if merged.total_items() == 0 {
                break;
            }
            w.stats.rounds += 1;
            w.stats.round_items.resize(merged.items.len(), 0);
            w.stats.round_items.iter_mut().zip(&merged.items).for_each(|(t, m)| *t += m);
            if let Some(j) = &mut w.job {
                j.batches += merged.total_items();
                j.samples += merged.samples;
            }
            w.progress.fetch_add(1, Ordering::Relaxed);
            w.after_step::<RemoteRows<'_>>(None)?;
        }
        let end = w.checkpoints.as_ref().is_some_and(|c| w.job_step() > c.last_step);
        if end { w.checkpoint_now() } else { Ok(()) }
    }
}

impl Worker {
    /// The items of one round through the step engine (every update pushed
    /// at its end): how many, and their samples.
    fn train_round_items(
        &mut self,
        rows: &RemoteRows<'_>,
        mut take: impl FnMut(usize) -> Result<Option<WorkerBatch>, ClusterError>,
    ) -> Result<(u64, u64), ClusterError> {
        let mut engine = StepEngine::new(self.pipeline_depth);
        let (mut items, mut samples) = (0u64, 0u64);
        let mut next_batch_secs = 0.0;
        loop {
            let mut next = |i: usize| {
                let waited = Instant::now();
                let next = take(i).transpose();
                next_batch_secs += waited.elapsed().as_secs_f64();
                next
            };
            let stepped = engine.step(rows, &mut next, |looked| {
                items += 1;
                samples += looked.batch.rows as u64;
                let (_, grads) = self.dense(looked)?;
                Ok(((), Some(grads)))
            })?;
            let Some(stepped) = stepped else { break };
            self.record_phases(stepped)?;
            self.reported_step.store(self.job_step(), Ordering::Relaxed);
            faults::point("worker.step");
            faults::worker_step(self.index);
            self.check_generation()?;
        }
        self.stats.phase_secs.push += engine.flush(rows)?;
        self.stats.phase_secs.next_batch += next_batch_secs;
        Ok((items, samples))
    }
}
