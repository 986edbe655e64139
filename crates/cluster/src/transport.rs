//! The interfaces roles call each other through. The in-process transport is
//! a direct call on the role itself (`ShardServer` implements
//! [`ShardService`]); a network transport implements the same trait.

use crate::messages::Mode;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    #[error("shard {shard}: batch {batch_id} is not queued (never sent, or already pulled/pushed)")]
    UnknownBatch { shard: usize, batch_id: u64 },
    #[error("shard {shard}: batch {batch_id}: {what}: got {found} floats, expected {expected}")]
    WrongSize { shard: usize, batch_id: u64, what: &'static str, expected: usize, found: usize },
    #[error("shard {shard}: {source}")]
    Table { shard: usize, source: sparrow_embedding::TableError },
    #[error(transparent)]
    Data(#[from] sparrow_data::DataError),
    #[error(transparent)]
    Train(#[from] sparrow_trainer::TrainError),
}

/// An embedding shard as seen by the loader and the workers.
pub trait ShardService: Send + Sync {
    /// Queues a batch's keys owned by this shard (unique, in the order the
    /// rows will be returned).
    fn enqueue(&self, batch_id: u64, keys: Vec<u64>, mode: Mode) -> Result<(), ClusterError>;
    /// The rows of a queued batch, `keys × dim`, in enqueue order. A training
    /// batch inserts unseen keys; an evaluation batch reads them as their
    /// initial vectors and is forgotten after the pull.
    fn pull(&self, batch_id: u64) -> Result<Vec<f32>, ClusterError>;
    /// Applies the summed gradients of a pulled training batch (enqueue
    /// order) once per key, then forgets the batch.
    fn push(&self, batch_id: u64, grads: Vec<f32>) -> Result<(), ClusterError>;
}
