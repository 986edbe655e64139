//! The loader (S0.1–S0.3): reads and batches, numbers the batches, sends each
//! shard the unique keys it owns, and keeps the rest for a worker.

use std::sync::Arc;

use sparrow_core::key::mix64;
use sparrow_data::BatchStream;
use sparrow_embedding::KeyPlan;

use crate::messages::{Mode, WorkerBatch};
use crate::transport::{ClusterError, ShardService};

/// Which shard owns a key (S3.1): by hash, on bits independent of the ones a
/// shard's own table uses for its lock shards and buckets.
pub fn owner(key: u64, shards: usize) -> usize {
    ((mix64(key) >> 40) % shards as u64) as usize
}

pub struct Loader {
    stream: BatchStream,
    shards: Vec<Arc<dyn ShardService>>,
    mode: Mode,
    next_id: u64,
}

impl Loader {
    /// `first_id` keeps batch ids unique across loaders (train and eval).
    pub fn new(stream: BatchStream, shards: Vec<Arc<dyn ShardService>>, mode: Mode, first_id: u64) -> Self {
        Loader { stream, shards, mode, next_id: first_id }
    }

    /// The next batch: its keys go to their shards, the rest is returned.
    pub fn next_batch(&mut self) -> Result<Option<WorkerBatch>, ClusterError> {
        let Some(batch) = self.stream.next().transpose()? else { return Ok(None) };
        let batch_id = self.next_id;
        self.next_id += 1;
        let n = self.shards.len();
        // First dedup (S3.2) and partition by owner, counts first (S3.3).
        let plan = KeyPlan::new(&batch.keys, n, |k| owner(k, n));
        let mut shard_counts = Vec::with_capacity(n);
        for (s, shard) in self.shards.iter().enumerate() {
            let keys = plan.shard_keys(s);
            shard_counts.push(keys.len() as u32);
            if !keys.is_empty() {
                shard.enqueue(batch_id, keys.to_vec(), self.mode)?;
            }
        }
        Ok(Some(WorkerBatch {
            batch_id,
            rows: batch.rows(),
            num_fields: batch.num_fields,
            num_dense: batch.num_dense,
            labels: batch.labels,
            dense: batch.dense,
            bag_offsets: batch.bag_offsets,
            key_weights: batch.key_weights,
            inverse: plan.inverse,
            shard_counts,
            end: batch.end,
        }))
    }
}
