//! What a worker process prints as its last stdout line, which `launch`
//! merges into the job's summary, and the latency quantiles it holds.

use serde::Serialize;

/// Latency quantiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize)]
pub struct LatencyMs {
    pub p50: f64,
    pub p99: f64,
    pub count: usize,
}

impl LatencyMs {
    pub fn of(secs: &[f32]) -> LatencyMs {
        if secs.is_empty() {
            return LatencyMs::default();
        }
        let mut sorted = secs.to_vec();
        sorted.sort_by(f32::total_cmp);
        let at = |q: f64| f64::from(sorted[((sorted.len() - 1) as f64 * q).round() as usize]) * 1e3;
        LatencyMs { p50: at(0.5), p99: at(0.99), count: sorted.len() }
    }
}

/// What a worker process prints as its last stdout line (launch merges them).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct WorkerSummary {
    pub worker: usize,
    pub test_auc: Option<f64>,
    pub test_logloss: Option<f64>,
    pub test_rows: u64,
    /// Test rows whose prediction was NaN (ranked last by `test_auc`).
    pub test_nan_predictions: u64,
    /// Every task's test figures by name (worker 0).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tasks: std::collections::BTreeMap<String, sparrow_core::metrics::tasks::TaskFigures>,
    pub train_rows: u64,
    #[serde(default)]
    pub truncated_sequences: u64,
    pub batches: u64,
    pub steps: u64,
    pub train_secs: f64,
    pub eval_secs: f64,
    pub train_logloss: Option<f64>,
    /// Shard rows after training (worker 0 asks the shards).
    pub embedding_rows: Option<u64>,
    /// The shards' SSD tier and filter counters, summed (worker 0).
    pub table: Option<sparrow_trainer::run::TableReport>,
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
    pub keys: u64,
    pub unique_keys: u64,
    pub pull_latency_ms: LatencyMs,
    pub push_latency_ms: LatencyMs,
    pub dense_checksum: String,
    pub peak_rss_bytes: u64,
    pub phase_secs: crate::worker::WorkerPhaseSecs,
    /// The loader's malformed-row count as of this worker's last batch.
    pub bad_rows: u64,
    /// Worker 0 writes the model here when `checkpoint.dir` is set.
    pub checkpoint: Option<String>,
    /// Bytes sent and received to agree on the dense weights.
    pub dense_sync_bytes: u64,
    /// `sync = "round"`: rounds merged and every worker's items over them.
    pub rounds: u64,
    pub round_items: Vec<u64>,
    /// `sync = "lazy"`: what the scheduler counted (from the final weights),
    /// and the seconds this worker spent asking for and waiting on instructions.
    pub lazy: Option<crate::lazy::LazyReport>,
    pub lazy_wait_secs: f64,
    /// `[data.weighting]`: the loader's merged and dropped counts, this worker's weight sum.
    pub merged_samples: u64,
    pub dropped_samples: u64,
    pub sample_weight_sum: f64,
    /// Batches skipped for a non-finite loss or gradient (`train.on_non_finite = "skip_batch"`).
    #[serde(default)]
    pub skipped_batches: u64,
    /// `cluster.mode = "collocated"`: the shards' second levels (worker 0),
    /// the loader's pass counters, and row bytes from other nodes' shards.
    pub second_level: Option<crate::second_level::SecondLevelStats>,
    pub passes: crate::messages::PassCounters,
    pub bytes_from_remote_shards: u64,
    /// `[data.stream]`: the mark after this worker's furthest batch.
    pub stream: Option<sparrow_core::batch::StreamMark>,
    /// Progressive validation over this worker's batches, as figures and
    /// as counts that launch adds up across workers.
    pub online: sparrow_trainer::online::OnlineReport,
    #[serde(default)]
    pub online_tally: Option<sparrow_trainer::online::OnlineTally>,
}
