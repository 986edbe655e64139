//! Sparrow's cluster roles (SPEC S0): the loader, the embedding shards, the
//! workers and the coordinator, as library types that talk only through the
//! [`transport`] traits.
//!
//! The split data path (S0.1–S0.4): the loader reads and batches, gives every
//! batch an id, de-duplicates its keys and sends each shard only the keys it
//! owns; it keeps the batch's dense values, labels and bag structure queued for
//! the workers. A worker takes the next batch from the loader (never a raw ID),
//! pulls that batch's rows from the shards by batch id, trains, and pushes the
//! gradients of the batch's unique keys back to their shards. Workers sum
//! their dense gradients every step (S0.6).
//!
//! The same roles run in one process ([`local`], direct calls) or as
//! processes over gRPC ([`grpc`], [`roles`], [`launch`]).
//!
//! Checkpoints and recovery: the coordinator gathers the workers at a
//! checkpoint step, has every shard write its part and commits the version
//! ([`checkpoint`]); a role's death takes the job to its next generation, every
//! role back to the last committed checkpoint ([`coordinator`]). Failures can
//! be injected by name ([`faults`]).

pub mod aggregator;
pub mod checkpoint;
pub mod coordinator;
pub mod epochs;
pub mod exports;
pub mod faults;
pub mod generation;
pub mod grpc;
pub mod launch;
pub mod lazy;
mod link;
pub mod loader;
pub mod local;
pub mod lock_order;
pub mod messages;
pub mod metrics;
pub mod net;
pub mod rendezvous;
pub mod restart_budget;
pub mod roles;
pub mod rounds;
pub mod second_level;
pub mod shard;
pub mod stream_gauges;
pub mod sync;
pub mod transport;
pub mod worker;

pub use loader::{Loader, LoaderServer};
pub use local::{LocalSummary, train_local};
pub use messages::{Mode, WorkerBatch};
pub use shard::ShardServer;
pub use transport::{ClusterError, LoaderService, ShardService};
pub use worker::Worker;

/// What the in-process harness (`train_local`) does not do, refused
/// before it starts rather than silently left out: it runs one generation,
/// and a job that validates (`data.validation`, `[train.early_stopping]`)
/// runs one an epoch (`epochs.rs`), as `sparrow launch` and the roles do.
pub fn refuse_local_only_keys(config: &sparrow_core::Config) -> Result<(), ClusterError> {
    let key = if config.train.early_stopping.is_some() {
        "train.early_stopping"
    } else if config.data.validation.is_some() {
        "data.validation"
    } else {
        return Ok(());
    };
    Err(ClusterError::Setup(format!(
        "{key}: the in-process cluster does not validate; `sparrow launch` (or the roles) and `sparrow train` do"
    )))
}
