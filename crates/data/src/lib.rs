//! Sparrow's data layer: streaming readers for Criteo TSV, CSV, Parquet,
//! libsvm and libffm; the bad-row budget; a background batch stream with
//! bounded memory; and the synthetic generator with a known Bayes-optimal AUC.
//!
//! Nothing here knows about networks or embeddings.

pub mod columns;
pub mod error;
pub mod holdout;
pub mod input;
pub mod label_groups;
pub mod labels;
pub mod layout;
pub mod parquet_source;
pub mod reader_thread;
pub mod regroup;
pub mod shuffle;
pub mod source;
pub mod stream;
pub mod synth;
pub mod synth_tasks;
pub mod text;
pub mod weighting;

pub use error::{BadRows, DataError};
pub use labels::LabelRules;
pub use layout::DataLayout;
pub use source::BatchSource;
pub use stream::{BatchStream, open_source};
