//! Shared vocabulary of Sparrow: feature keys, batches, the typed config and a
//! small deterministic RNG. No I/O happens here (the config parser reads text
//! handed to it by the caller).

pub mod batch;
pub mod config;
pub mod key;
pub mod metrics;
pub mod printable;
pub mod rng;
pub mod simd;
pub mod token;

pub use batch::{Batch, BatchBuilder, DataPosition};
pub use config::{Config, ConfigError, Overrides};
pub use key::feature_key;
pub use printable::printable;
