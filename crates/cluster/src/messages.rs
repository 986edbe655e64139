//! What crosses the wire between roles.

use crate::generation::Generation;
use sparrow_core::batch::DataPosition;

/// Why a batch's keys are queued on a shard: a training batch inserts unseen
/// keys and expects a gradient push; an evaluation batch only reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

/// The worker's part of a batch (S0.1): dense values, labels and the bag
/// structure, with every key replaced by its index among the batch's unique
/// keys. The unique keys are ordered by owning shard; `shard_counts[s]` of
/// them belong to shard `s`, in the order that shard will return their rows.
#[derive(Clone, Debug, Default)]
pub struct WorkerBatch {
    pub batch_id: u64,
    pub rows: usize,
    pub num_fields: usize,
    pub num_dense: usize,
    /// Labels a row holds, one per task.
    pub num_tasks: usize,
    /// `rows × num_tasks` (NaN: the task is masked for the row).
    pub labels: Vec<f32>,
    pub dense: Vec<f32>,
    pub bag_offsets: Vec<u32>,
    pub key_weights: Option<Vec<f32>>,
    pub inverse: Vec<u32>,
    pub shard_counts: Vec<u32>,
    /// The raw keys, in `cluster.mode = "worker_lookup"` only (the baseline
    /// S0 improves on); then `inverse` and `shard_counts` are left to the worker.
    pub keys: Vec<u64>,
    /// Where the loader's input continues after this batch, and where the batch starts.
    pub end: DataPosition,
    pub start: DataPosition,
    /// Malformed rows the loader skipped so far (train and test data).
    pub bad_rows: u64,
    /// Each sample's weight in the loss (`[data.weighting]`); `None`: all 1.
    pub sample_weights: Option<Vec<f32>>,
    /// Samples `[data.weighting]` merged and dropped so far.
    pub merged_samples: u64,
    pub dropped_samples: u64,
    /// `cluster.mode = "collocated"`: the loader's pass counters so far.
    pub passes: PassCounters,
    /// `[data.stream]`: the stream's mark after this batch.
    pub stream: Option<sparrow_core::batch::StreamMark>,
    /// Its rows' behaviour sequences cut to their `max_len`.
    pub truncated_sequences: u64,
    /// Evaluation batches under `eval.group_by`: each row's group number
    /// (`evaluation::group_keys`, not a key a shard holds); else empty.
    pub groups: Vec<u64>,
}

/// What the loader's pass staging cost so far (S1.1, collocated mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PassCounters {
    pub passes: u64,
    /// Seconds spent staging passes (the stage calls to every node).
    pub staging_secs: f64,
    /// Of those, seconds the batches waited for: staging not hidden behind training.
    pub exposed_secs: f64,
}

impl WorkerBatch {
    /// A stream's batch: its newest record's time (Unix ms).
    pub fn newest_record_ms(&self) -> Option<i64> {
        self.stream.as_ref().and_then(|m| m.newest_record_ms)
    }

    /// The sum of the batch's sample weights (each weighs 1 without `[data.weighting]`).
    pub fn weight_sum(&self) -> f64 {
        match &self.sample_weights {
            Some(w) => w.iter().map(|&w| f64::from(w)).sum(),
            None => self.rows as f64,
        }
    }

    pub fn num_unique(&self) -> usize {
        self.shard_counts.iter().map(|&c| c as usize).sum()
    }

    /// True when every bag holds exactly one key (one-hot fields): the bag
    /// offsets are then `0, 1, 2, …` and are not sent.
    pub fn one_key_per_bag(&self) -> bool {
        self.bag_offsets.iter().enumerate().all(|(i, &o)| o as usize == i)
    }

    /// Bytes of this message's payload on the wire (for the bytes-per-sample accounting).
    pub fn payload_bytes(&self) -> usize {
        let offsets = if self.one_key_per_bag() { 0 } else { self.bag_offsets.len() };
        4 * (self.labels.len()
            + self.dense.len()
            + offsets
            + self.key_weights.as_ref().map_or(0, Vec::len)
            + self.inverse.len()
            + self.shard_counts.len())
            + 8 * self.keys.len()
            + 16
    }
}

/// Bits 40..62 of a batch id hold the job's generation (one attempt of the
/// job, see [`crate::coordinator`]): a shard serves the batches of its own
/// generation only, so a batch of an attempt that was given up (a stale
/// enqueue, pull or push still in the network) never touches a restored table.
const GENERATION_SHIFT: u32 = 40;
const GENERATION_MASK: u64 = (1 << 22) - 1;

/// The first batch id of a generation's stream starting at `first` (the
/// sequence number, with the evaluation bit when it is one).
pub fn first_batch_id(generation: Generation, first: u64) -> u64 {
    first | ((generation.number() & GENERATION_MASK) << GENERATION_SHIFT)
}

/// The generation a batch id belongs to.
pub fn generation_of(batch_id: u64) -> Generation {
    Generation((batch_id >> GENERATION_SHIFT) & GENERATION_MASK)
}

/// What a shard's second level did (the final JSON sums them over shards).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SecondLevelStats {
    /// Passes staged, and passes whose batches were all pushed (flushed).
    pub passes_staged: u64,
    pub passes_flushed: u64,
    /// Rows copied from level 1 while staging, and rows initialised here.
    pub rows_from_l1: u64,
    pub rows_initialised: u64,
    /// Rows written back into level 1 when their last pass ended.
    pub rows_flushed: u64,
    /// The most rows held at once.
    pub peak_rows: u64,
    /// Level-1 reads outside staging while a pass was staged (must stay 0:
    /// every training read goes to this level).
    pub l1_reads_during_pass: u64,
    pub staging_secs: f64,
    pub flush_secs: f64,
}
