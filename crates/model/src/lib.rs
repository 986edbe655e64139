//! Dense models on candle: the kinds (`kinds/`, one file each, found
//! through `kinds::KINDS`), the stable logistic loss, and a dense Adam/SGD whose state can be saved.
//!
//! A model sees pooled embeddings `[batch, fields, width]` and dense values
//! `[batch, num_dense]`; it never knows how embeddings are stored. The gradient
//! with respect to the pooled embeddings is handed back to the caller.

mod activation;
pub mod amx;
pub mod awake;
mod batch_norm;
pub mod bf16;
mod bf16_narrow;
mod bf16_rounded;
mod columns;
mod cross;
mod dropout;
mod exp;
pub mod fused;
pub mod heads;
mod input_grad;
pub mod kinds;
mod layer_norm;
mod logistic;
pub mod matrix;
mod meet;
pub mod mlp;
pub mod models;
pub mod optimizer;
mod own_threads;
#[cfg(target_arch = "x86_64")]
mod pairs;
pub mod params;
pub mod peak;
pub mod spec;
pub mod step;

pub use heads::Heads;
pub use input_grad::InputGrad;
pub use models::{DenseModel, ModelShape, Sequences, StepOutput};
pub use optimizer::{DenseGrads, DenseOptimizer, check_finite};
pub use params::ParamStore;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("model.kind = \"{kind}\" is not a kind; the kinds are {known}")]
    UnknownKind { kind: String, known: String },
    #[error("a `{kind}` model takes packed input on the CPU only")]
    NotPacked { kind: &'static str },
    #[error("{what}: {len} values are not {rows} rows of {per_row}")]
    BadInput { what: &'static str, len: usize, rows: usize, per_row: usize },
    #[error("model.kind = \"{kind}\" has one output, not {outputs} (several tasks need a kind with a deep part)")]
    Heads { kind: &'static str, outputs: usize },
    /// A label no task can take (a batch off the wire is not trusted).
    #[error("task `{task}`: label {label} is not 0/1, a class id below {outputs}, or masked")]
    BadLabel { task: String, label: f32, outputs: usize },
    /// A model that attends over behaviour sequences given the wrong number of them.
    #[error("the model attends over {expected} behaviour sequence(s) (model.kind = \"din\"); the batch gave {found}")]
    Sequences { expected: usize, found: usize },
    #[error("a thread panicked while holding the model's step buffers")]
    Poisoned,
    #[error("dense weights: parameter `{name}` is missing from the file")]
    MissingParam { name: String },
    #[error("dense weights: parameter `{name}` has shape {found:?}, the model expects {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize> },
    /// A NaN or an infinity where training needs numbers; nothing was updated.
    #[error("non-finite {what}")]
    NonFinite { what: String },
    /// A bug: the two halves of a step in halves met unevenly.
    #[error("a step's two halves: {what}")]
    Halves { what: &'static str },
}
