//! A worker (S0.4): takes a batch from the loader, pulls its rows from the
//! shards by batch id, trains the dense model, pushes the embedding gradients.

use std::sync::Arc;

use sparrow_core::config::Pooling;
use sparrow_model::{DenseModel, DenseOptimizer};
use sparrow_trainer::pooling::{Bags, pool};
use sparrow_trainer::trainer::{DenseInputs, dense_step};

use crate::messages::WorkerBatch;
use crate::transport::{ClusterError, ShardService};

pub struct Worker {
    pub model: DenseModel,
    pub optimizer: DenseOptimizer,
    pooling: Pooling,
    packed_input: Vec<f32>,
    /// Bytes received from the loader and from the shards.
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
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

impl Worker {
    pub fn new(model: DenseModel, optimizer: DenseOptimizer, pooling: Pooling) -> Self {
        Worker { model, optimizer, pooling, packed_input: Vec::new(), bytes_from_loader: 0, bytes_from_shards: 0 }
    }

    /// The batch's unique rows, shard by shard (the loader's order).
    fn pull(&mut self, batch: &WorkerBatch, shards: &[Arc<dyn ShardService>]) -> Result<Vec<f32>, ClusterError> {
        self.bytes_from_loader += batch.payload_bytes() as u64;
        let mut rows = Vec::with_capacity(batch.num_unique() * self.model.width());
        for (shard, &count) in shards.iter().zip(&batch.shard_counts) {
            if count > 0 {
                let part = shard.pull(batch.batch_id)?;
                self.bytes_from_shards += 4 * part.len() as u64;
                rows.extend_from_slice(&part);
            }
        }
        Ok(rows)
    }

    /// One training step; returns the batch's mean loss.
    pub fn train(&mut self, batch: &WorkerBatch, shards: &[Arc<dyn ShardService>]) -> Result<f64, ClusterError> {
        let unique_rows = self.pull(batch, shards)?;
        let inputs =
            DenseInputs { bags: bags(batch), unique_rows: &unique_rows, dense: &batch.dense, labels: &batch.labels };
        let out = dense_step(&self.model, &mut self.optimizer, &mut self.packed_input, inputs, self.pooling)?;
        let width = self.model.width();
        let mut grads = out.grads.as_slice();
        for (shard, &count) in shards.iter().zip(&batch.shard_counts) {
            if count > 0 {
                let (mine, rest) = grads.split_at(count as usize * width);
                shard.push(batch.batch_id, mine.to_vec())?;
                grads = rest;
            }
        }
        Ok(out.loss)
    }

    /// Logits of an evaluation batch.
    pub fn predict(&mut self, batch: &WorkerBatch, shards: &[Arc<dyn ShardService>]) -> Result<Vec<f32>, ClusterError> {
        let unique_rows = self.pull(batch, shards)?;
        let pooled = pool(&bags(batch), &unique_rows, self.model.width(), self.pooling);
        Ok(self.model.predict(pooled, batch.dense.clone(), batch.rows).map_err(sparrow_trainer::TrainError::from)?)
    }
}
