//! Sparrow's embedding engine: a sharded concurrent hash table whose rows keep
//! the vector and its optimizer state together, per-row sparse optimizers, and
//! the batch path (dedup with inverse index → partition by shard → lookup →
//! restore; backward: sum duplicate gradients → update once).
//!
//! Plain data structures and threads: no network, no async runtime.

pub mod disk;
pub mod dtype;
mod hint;
mod in_flight;
pub mod index;
pub mod optimizer;
pub mod partition;
pub mod plan;
pub mod table;

pub use dtype::{EmbeddingDtype, RowFormat, Simd};
pub use optimizer::SparseOptimizer;
pub use partition::{Partitioner, owner};
pub use plan::KeyPlan;
pub use table::{
    Deletion, EmbeddingTable, FeatureFilters, FilterState, FilterStats, Initializer, RowSlots, Staged, TableError,
    TierStats,
};
