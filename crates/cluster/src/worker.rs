//! A worker (S0.4): takes a batch from the loader, pulls its rows from the
//! shards by batch id, trains the dense model, pushes the embedding gradients.
//! With several workers the dense optimizer sums gradients across them every
//! step (S0.6, see [`crate::sync`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use sparrow_core::config::Pooling;
use sparrow_embedding::KeyPlan;
use sparrow_model::{DenseModel, DenseOptimizer};
use sparrow_trainer::pooling::{Bags, pool};
use sparrow_trainer::trainer::{DenseInputs, dense_step};

use crate::loader::owner;
use crate::messages::{Mode, WorkerBatch};
use crate::transport::{ClusterError, LoaderService, ShardService};

/// What a worker counted while training.
#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    /// Batches this worker trained and their samples.
    pub batches: u64,
    pub rows: u64,
    /// Dense optimizer steps: with several workers, the rounds (a round may
    /// hold several of a worker's batches, or none).
    pub steps: u64,
    /// Payload bytes received while training, by source.
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
    /// Keys per batch position and unique keys (after the first dedup).
    pub keys: u64,
    pub unique_keys: u64,
    /// Seconds of each pull / push call to a shard.
    pub pull_secs: Vec<f32>,
    pub push_secs: Vec<f32>,
    pub train_secs: f64,
    /// The loader's count of malformed rows, as of the latest batch seen.
    pub bad_rows: u64,
    /// The furthest data position among the batches this worker trained.
    pub last_end: sparrow_core::batch::DataPosition,
    /// Where the training time went (seconds), summed over steps.
    pub phase_secs: WorkerPhaseSecs,
    recent_losses: VecDeque<f64>,
}

impl WorkerStats {
    /// Mean training loss over the last batches.
    pub fn recent_loss(&self) -> Option<f64> {
        (!self.recent_losses.is_empty())
            .then(|| self.recent_losses.iter().sum::<f64>() / self.recent_losses.len() as f64)
    }
}

/// Seconds of a worker's training time by phase.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct WorkerPhaseSecs {
    /// Waiting for the loader's next batch.
    pub next_batch: f64,
    /// Pulling rows (plus, in worker_lookup mode, dedup and sending keys).
    pub pull: f64,
    /// Pool, dense forward/backward, gradient sum across workers, optimizer, unpool.
    pub dense: f64,
    pub push: f64,
}

pub struct Worker {
    pub index: usize,
    pub model: DenseModel,
    pub optimizer: DenseOptimizer,
    pooling: Pooling,
    packed_input: Vec<f32>,
    pub stats: WorkerStats,
}

fn bags(batch: &WorkerBatch) -> Bags<'_> {
    Bags {
        rows: batch.rows,
        num_fields: batch.num_fields,
        bag_offsets: &batch.bag_offsets,
        key_weights: batch.key_weights.as_deref(),
        inverse: &batch.inverse,
        num_unique: batch.num_unique(),
    }
}

/// Runs `call` for every shard with a non-empty part, concurrently when
/// there are several, and returns the results in shard order with each
/// call's seconds.
fn each_shard<T: Send>(
    shards: &[Arc<dyn ShardService>],
    counts: &[u32],
    call: impl Fn(usize, &dyn ShardService) -> Result<T, ClusterError> + Sync,
) -> Result<Vec<(T, f32)>, ClusterError> {
    let timed = |s: usize| {
        let t = Instant::now();
        call(s, shards[s].as_ref()).map(|v| (v, t.elapsed().as_secs_f32()))
    };
    let busy: Vec<usize> = (0..shards.len()).filter(|&s| counts[s] > 0).collect();
    if busy.len() <= 1 {
        return busy.into_iter().map(timed).collect();
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = busy.iter().map(|&s| scope.spawn(move || timed(s))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(ClusterError::Setup("a shard call panicked".into()))))
            .collect()
    })
}

impl Worker {
    pub fn new(index: usize, model: DenseModel, optimizer: DenseOptimizer, pooling: Pooling) -> Self {
        Worker { index, model, optimizer, pooling, packed_input: Vec::new(), stats: WorkerStats::default() }
    }

    /// In worker_lookup mode the worker does the loader's S0 work itself:
    /// dedup, partition, and sending each shard its keys.
    fn look_up_keys(batch: &mut WorkerBatch, shards: &[Arc<dyn ShardService>], mode: Mode) -> Result<(), ClusterError> {
        if batch.keys.is_empty() {
            return Ok(());
        }
        let n = shards.len();
        let plan = KeyPlan::new(&batch.keys, n, |k| owner(k, n));
        batch.shard_counts = (0..n).map(|s| plan.shard_keys(s).len() as u32).collect();
        each_shard(shards, &batch.shard_counts, |s, shard| {
            shard.enqueue(batch.batch_id, plan.shard_keys(s).to_vec(), mode)
        })?;
        batch.inverse = plan.inverse;
        Ok(())
    }

    /// The batch's unique rows, shard by shard (the loader's order).
    fn pull(
        &mut self,
        batch: &WorkerBatch,
        shards: &[Arc<dyn ShardService>],
        record: bool,
    ) -> Result<Vec<f32>, ClusterError> {
        let parts = each_shard(shards, &batch.shard_counts, |_, shard| shard.pull(batch.batch_id))?;
        let mut rows = Vec::with_capacity(batch.num_unique() * self.model.width());
        for (part, secs) in parts {
            if record {
                self.stats.bytes_from_shards += 4 * part.len() as u64;
                self.stats.pull_secs.push(secs);
            }
            rows.extend_from_slice(&part);
        }
        Ok(rows)
    }

    /// One training step on `batch`; returns its mean loss.
    pub fn train(&mut self, mut batch: WorkerBatch, shards: &[Arc<dyn ShardService>]) -> Result<f64, ClusterError> {
        self.stats.bytes_from_loader += batch.payload_bytes() as u64;
        self.stats.bad_rows = self.stats.bad_rows.max(batch.bad_rows);
        self.stats.keys += batch.bag_offsets.last().copied().unwrap_or(0) as u64;
        let t0 = Instant::now();
        Self::look_up_keys(&mut batch, shards, Mode::Train)?;
        self.stats.unique_keys += batch.num_unique() as u64;
        let unique_rows = self.pull(&batch, shards, true)?;
        let t1 = Instant::now();
        let inputs =
            DenseInputs { bags: bags(&batch), unique_rows: &unique_rows, dense: &batch.dense, labels: &batch.labels };
        let out = dense_step(&self.model, &mut self.optimizer, &mut self.packed_input, inputs, self.pooling)?;
        let t2 = Instant::now();
        let width = self.model.width();
        let mut parts = Vec::with_capacity(shards.len());
        let mut grads = out.grads.as_slice();
        for &count in &batch.shard_counts {
            let (mine, rest) = grads.split_at(count as usize * width);
            parts.push(mine);
            grads = rest;
        }
        let pushed = each_shard(shards, &batch.shard_counts, |s, shard| shard.push(batch.batch_id, parts[s].to_vec()))?;
        self.stats.push_secs.extend(pushed.iter().map(|(_, secs)| secs));
        let phases = &mut self.stats.phase_secs;
        phases.pull += (t1 - t0).as_secs_f64();
        phases.dense += (t2 - t1).as_secs_f64();
        phases.push += t2.elapsed().as_secs_f64();
        self.stats.batches += 1;
        self.stats.last_end = crate::checkpoint::later(self.stats.last_end, batch.end);
        self.stats.rows += batch.rows as u64;
        if self.stats.recent_losses.len() == 100 {
            self.stats.recent_losses.pop_front();
        }
        self.stats.recent_losses.push_back(out.loss);
        Ok(out.loss)
    }

    /// Trains until no worker has a batch left. The next batch is fetched
    /// from the loader while this one trains (it carries no embeddings, so
    /// fetching early changes nothing in the model).
    pub fn run_training(
        &mut self,
        loader: &dyn LoaderService,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<(), ClusterError> {
        let start = Instant::now();
        let index = self.index;
        std::thread::scope(|scope| {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let prefetch = scope.spawn(move || -> Result<(), ClusterError> {
                loop {
                    let batch = loader.next_batch(index, Mode::Train)?;
                    let end = batch.is_none();
                    if tx.send(batch).is_err() || end {
                        return Ok(());
                    }
                }
            });
            let trained = (|| {
                let mut exhausted = false;
                loop {
                    let waited = Instant::now();
                    let next = if exhausted { None } else { rx.recv().ok().flatten() };
                    self.stats.phase_secs.next_batch += waited.elapsed().as_secs_f64();
                    match next {
                        Some(batch) => {
                            self.train(batch, shards)?;
                        }
                        // Joins the rounds with nothing until every worker is out of data.
                        None => {
                            exhausted = true;
                            if !self.model.idle_step(&mut self.optimizer)? {
                                return Ok(());
                            }
                        }
                    }
                }
            })();
            drop(rx);
            // A loader error ends the prefetch thread first; report it over the
            // symptom (the queue closing early).
            let fetched =
                prefetch.join().unwrap_or_else(|_| Err(ClusterError::Setup("the prefetch thread panicked".into())));
            fetched.and(trained)
        })?;
        self.stats.train_secs = start.elapsed().as_secs_f64();
        self.stats.steps = self.optimizer.step;
        Ok(())
    }

    /// Logits of an evaluation batch.
    pub fn predict(
        &mut self,
        mut batch: WorkerBatch,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<Vec<f32>, ClusterError> {
        Self::look_up_keys(&mut batch, shards, Mode::Eval)?;
        let unique_rows = self.pull(&batch, shards, false)?;
        let pooled = pool(&bags(&batch), &unique_rows, self.model.width(), self.pooling);
        Ok(self.model.predict(pooled, batch.dense, batch.rows).map_err(sparrow_trainer::TrainError::from)?)
    }

    /// Logits and labels of the loader's evaluation data.
    pub fn run_eval(
        &mut self,
        loader: &dyn LoaderService,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<(Vec<f32>, Vec<f32>), ClusterError> {
        let (mut logits, mut labels) = (Vec::new(), Vec::new());
        while let Some(batch) = loader.next_batch(self.index, Mode::Eval)? {
            self.stats.bad_rows = self.stats.bad_rows.max(batch.bad_rows);
            labels.extend_from_slice(&batch.labels);
            logits.extend(self.predict(batch, shards)?);
        }
        Ok((logits, labels))
    }

    /// A fingerprint of the dense weights (replicas must agree bit for bit).
    pub fn dense_checksum(&self) -> Result<u64, ClusterError> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for (name, var) in self.model.params.vars() {
            hasher.update(name.as_bytes());
            let values = var
                .as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(sparrow_model::ModelError::from)?;
            for v in values {
                hasher.update(&v.to_bits().to_le_bytes());
            }
        }
        Ok(hasher.digest())
    }
}
