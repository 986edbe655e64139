//! The step engine every training step runs through ([`engine`]: lookup →
//! pool → forward/backward → [`dense_sync`] → optimizer → unpool → update,
//! with a lookahead of `train.pipeline_depth`), and the single-process
//! trainer built on it: the data stream, the local table as the engine's row
//! source, checkpoints, evaluation, prediction and the built-in benchmark.
//! Cluster workers run the same engine with the shards as their row source.

pub mod bench;
pub mod bounds;
pub mod checkpoint;
pub mod confined;
pub mod dense_sync;
pub mod dir_lock;
pub mod driver;
pub mod early_stopping;
pub mod engine;
pub mod error;
pub mod evaluation;
pub mod export;
pub mod inference;
pub mod input;
pub mod local_run;
pub mod new_dir;
pub mod online;
pub mod onnx_export;
pub mod pipeline;
pub mod pooling;
pub mod progress;
pub mod run;
pub mod sizes;
pub mod standardize;
pub mod tensorboard;
pub mod trainer;
pub mod validation;

pub use error::TrainError;
pub use inference::Model;
pub use run::{EvalSummary, TrainSummary, evaluate_checkpoint, predict_checkpoint, train, train_until};
pub use trainer::{Trainer, initial_model, ttl_floor};

/// Peak resident set size of this process (VmHWM), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    proc_status_kb("VmHWM:") * 1024
}

/// Current resident set size (VmRSS), 0 where unknown.
pub fn rss_bytes() -> u64 {
    proc_status_kb("VmRSS:") * 1024
}

fn proc_status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}
