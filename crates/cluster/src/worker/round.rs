//! `sync = "round"` (S2) on the worker's side: the items of a round from the
//! loader's round queue, stepped on this replica, then one merge.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sparrow_trainer::TrainError;
use sparrow_trainer::engine::StepEngine;

use super::Worker;
use super::remote::RemoteRows;
use crate::faults;
use crate::messages::WorkerBatch;
use crate::rounds::RoundUpdate;
use crate::transport::{ClusterError, LoaderService};

impl Worker {
    /// `sync = "round"` (S2): takes items of each round from the loader's
    /// round queue one at a time, stepping this replica after each; at the
    /// round's end sends its update and starts the next round from the
    /// merged weights, until a round in which no worker had an item.
    pub(super) fn train_rounds(
        &mut self,
        loader: &dyn LoaderService,
        rows: &RemoteRows<'_>,
    ) -> Result<(), ClusterError> {
        let (index, generation) = (self.index, self.generation);
        let mut round = 0u64;
        loop {
            let begin = self.model.params.flat_values().map_err(TrainError::from)?;
            let (items, samples) =
                self.train_round_items(rows, |_| loader.next_round_item(index, generation, round))?;
            let now = self.model.params.flat_values().map_err(TrainError::from)?;
            let delta: Vec<f32> = now.iter().zip(&begin).map(|(w, s)| w - s).collect();
            faults::point("worker.round");
            let Some(r) = &self.rounds else { return Ok(()) };
            let (merger, num_workers) = (r.merger.clone(), r.num_workers);
            let sent = 4 * delta.len() as u64;
            let merged = merger.merge_round(RoundUpdate { worker: index, generation, round, delta, items, samples })?;
            self.stats.dense_sync_bytes += sent + 4 * merged.delta.len() as u64;
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
                self.model.params.set_flat(&next).map_err(TrainError::from)?;
            }
            round += 1;
            if merged.total_items() == 0 {
                break;
            }
            self.stats.rounds += 1;
            self.stats.round_items.resize(merged.items.len(), 0);
            self.stats.round_items.iter_mut().zip(&merged.items).for_each(|(t, m)| *t += m);
            if let Some(j) = &mut self.job {
                j.batches += merged.total_items();
                j.samples += merged.samples;
            }
            self.progress.fetch_add(1, Ordering::Relaxed);
            self.after_step::<RemoteRows<'_>>(None)?;
        }
        let end = self.checkpoints.as_ref().is_some_and(|c| self.job_step() > c.last_step);
        if end { self.checkpoint_now() } else { Ok(()) }
    }

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
