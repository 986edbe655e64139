//! The interfaces roles call each other through. The in-process transport is
//! a direct call on the role itself (`ShardServer` implements
//! [`ShardService`], `LoaderServer` implements [`LoaderService`]); the gRPC
//! clients in [`crate::grpc`] implement the same traits.

use crate::messages::{Mode, WorkerBatch};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    #[error("shard {shard}: batch {batch_id} is not queued (never sent, or already pulled/pushed)")]
    UnknownBatch { shard: usize, batch_id: u64 },
    #[error("shard {shard}: batch {batch_id}: {what}: got {found} floats, expected {expected}")]
    WrongSize { shard: usize, batch_id: u64, what: &'static str, expected: usize, found: usize },
    #[error("shard {shard}: {source}")]
    Table { shard: usize, source: sparrow_embedding::TableError },
    /// A call to another role failed: `peer` names it (`shard 1 at 10.0.0.5:7001`).
    #[error("{peer}: {method}: {message}")]
    Rpc { peer: String, method: &'static str, message: String },
    #[error("{peer}: {method}: a {bytes}-byte message is too large: the cap is cluster.max_message_bytes = {limit}")]
    TooLarge { peer: String, method: &'static str, bytes: usize, limit: usize },
    #[error("{peer}: unreachable after {waited_ms} ms of retries: {message}")]
    Unreachable { peer: String, waited_ms: u64, message: String },
    #[error("malformed message from {peer}: {what}")]
    Malformed { peer: String, what: String },
    #[error("the loader stopped: {0}")]
    Loader(String),
    #[error("the job failed: {0}")]
    JobFailed(String),
    #[error("{0}")]
    Setup(String),
    #[error("interrupted (Ctrl-C): every role was stopped")]
    Interrupted,
    #[error(transparent)]
    Data(#[from] sparrow_data::DataError),
    #[error(transparent)]
    Train(#[from] sparrow_trainer::TrainError),
    #[error(transparent)]
    Model(#[from] sparrow_model::ModelError),
    #[error(transparent)]
    Config(#[from] sparrow_core::config::ConfigError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

/// Rows exported from a shard: keys and their full rows, and where to go on.
#[derive(Clone, Debug, Default)]
pub struct ExportPage {
    pub keys: Vec<u64>,
    pub rows: Vec<f32>,
    pub next: Option<(usize, usize)>,
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
    /// Rows the shard holds.
    fn num_rows(&self) -> Result<u64, ClusterError>;
    /// A page of at most `max_rows` full rows (vector + optimizer state) from
    /// `cursor`, and the cursor after it (`None`: done).
    fn export(&self, cursor: (usize, usize), max_rows: usize) -> Result<ExportPage, ClusterError>;
}

/// The loader as seen by the workers: a queue of batches each worker pulls
/// from at its own pace (S2.2), training data first, then evaluation data.
pub trait LoaderService: Send + Sync {
    /// The next batch of the phase, `None` once its data is exhausted.
    fn next_batch(&self, worker: usize, mode: Mode) -> Result<Option<WorkerBatch>, ClusterError>;
}
