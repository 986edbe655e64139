//! An embedding shard (S0.5, S3.4): its part of the key space, and the keys of
//! the batches queued for it by batch id (S0.2). Where its training rows
//! live is its kind (`shard/rows.rs`): level 1, or a second level (S1).

mod cut;
mod rows;

pub use self::rows::{LevelOne, TrainingRows};

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Instant;

use sparrow_core::Config;
use sparrow_embedding::{Deletion, EmbeddingTable, KeyPlan, RowSlots, Staged};
use sparrow_trainer::bounds::TableBounds;

use crate::faults;
use crate::generation::Generation;
use crate::messages::{Mode, generation_of};
use crate::second_level::SecondLevel;
use crate::transport::{ClusterError, ExportPage, PartRequest, PartWritten, PassStaging, ShardReport, ShardService};

/// A shard role's table, built from the config the way every shard builds
/// it (an SSD tier goes to `embedding.path/shard-<index>`), with the same
/// `ttl_steps` floor as `sparrow train`'s table.
pub fn shard_table(config: &Config, index: usize) -> Result<EmbeddingTable, ClusterError> {
    shard_table_in(config, index, &format!("shard-{index}"))
}

/// [`shard_table`] with its SSD tier in `embedding.path/<subdir>`: a
/// restarted generation builds a fresh tier beside the old one (whose files
/// a request of the abandoned attempt may still be writing).
pub fn shard_table_in(config: &Config, index: usize, subdir: &str) -> Result<EmbeddingTable, ClusterError> {
    sparrow_trainer::trainer::model_table(config, Some(subdir))
        .map_err(|source| ClusterError::Table { shard: index, source })
}

enum Pending {
    Queued {
        keys: Vec<u64>,
        mode: Mode,
        /// The second dedup, made at enqueue when the rows were prefetched.
        plan: Option<KeyPlan>,
        /// Keeps the prefetched rows cached until the pull has looked them up.
        staged: Staged,
        newest_record_ms: Option<i64>,
    },
    /// Pulled for training: the second dedup's plan and the rows it found
    /// (level 1's slots; none from a second level).
    Pulled { plan: KeyPlan, slots: Option<RowSlots>, newest_record_ms: Option<i64> },
}

pub struct ShardServer {
    index: usize,
    table: EmbeddingTable,
    pending: Mutex<HashMap<u64, Pending>>,
    /// `cluster.max_message_bytes`: a pull whose reply would not fit is
    /// refused from its key count, before any row is copied.
    max_reply_bytes: usize,
    /// The job's attempt this table belongs to: batch ids of another are refused.
    generation: Generation,
    /// Enqueue, pull, push and stage are work; writing a checkpoint part is
    /// a walk that excludes them, so the part is a cut (no row moves while
    /// the walk runs), without a lock held across its disk writes.
    cut: cut::Cut,
    /// The job's config, for checkpoint parts (none: this shard writes none).
    config: Option<Config>,
    /// Where training reads and updates rows: level 1, or (S1) a second level.
    training: Box<dyn TrainingRows>,
    /// This shard's part of `embedding.max_rows` (0: unbounded): past it,
    /// each push evicts the least recently used rows.
    max_rows: usize,
    /// A bound below one batch was warned of.
    small_bound_warned: std::sync::atomic::AtomicBool,
    /// `embedding.ttl_secs`: the shard's lookup clock against the time of
    /// the records it trained, advanced after each push.
    ttl: Mutex<Option<TableBounds>>,
}

/// Bytes a pull reply of `keys` rows of `dim` floats takes on the wire (the
/// rows plus protobuf's field header).
fn pull_reply_bytes(keys: usize, dim: usize) -> usize {
    keys.saturating_mul(dim).saturating_mul(4).saturating_add(16)
}

impl ShardServer {
    pub fn new(index: usize, table: EmbeddingTable) -> Self {
        ShardServer {
            index,
            table,
            pending: Mutex::new(HashMap::new()),
            max_reply_bytes: usize::MAX,
            generation: Generation::NONE,
            cut: cut::Cut::default(),
            config: None,
            training: Box::new(LevelOne { shard: index }),
            max_rows: 0,
            small_bound_warned: std::sync::atomic::AtomicBool::new(false),
            ttl: Mutex::new(None),
        }
    }

    /// Bounds the table as `sparrow train` does: within its part of
    /// `embedding.max_rows` over `num_shards` shards (keys spread evenly
    /// over them), and rows expiring `embedding.ttl_secs` after their last
    /// use by the records' time, from `event_clock` (a restored part's).
    pub fn with_bounds(mut self, config: &Config, num_shards: usize, event_clock: &[(u64, i64)]) -> Self {
        let max_rows = usize::try_from(config.embedding.max_rows).unwrap_or(usize::MAX);
        self.max_rows = max_rows.div_ceil(num_shards.max(1));
        let ttl_only = sparrow_core::config::EmbeddingConfig { max_rows: 0, ..config.embedding.clone() };
        let mut ttl = TableBounds::new(&ttl_only);
        if let Some(t) = ttl.as_mut() {
            t.restore(event_clock);
        }
        self.ttl = Mutex::new(ttl);
        self
    }

    /// After a training push: rows past the TTL or the bound deleted.
    fn bound(&self, newest_record_ms: Option<i64>) -> Result<(), ClusterError> {
        let table_error = |source| ClusterError::Table { shard: self.index, source };
        // The cutoff under the lock; the deletion (disk I/O on an SSD tier) outside it.
        let cutoff = self.ttl.lock().as_mut().and_then(|t| t.ttl_cutoff(self.table.clock(), newest_record_ms));
        if let Some(cutoff) = cutoff {
            self.table.delete_used_before(cutoff, Deletion::Expired).map_err(table_error)?;
        }
        sparrow_trainer::bounds::evict_over(&self.table, self.max_rows, &self.small_bound_warned)
            .map_err(table_error)?;
        Ok(())
    }

    /// Serves training from a second level of at most `capacity` rows (0: no
    /// limit) staged pass by pass (`cluster.mode = "collocated"`, S1).
    pub fn with_second_level(mut self, capacity: u64) -> Self {
        self.training = Box::new(SecondLevel::over(self.index, &self.table, capacity));
        self
    }

    /// As the job's config says: a second level in collocated mode.
    pub fn for_mode(self, config: &Config) -> Self {
        match config.cluster.mode {
            sparrow_core::config::ClusterMode::Collocated => self.with_second_level(config.cluster.l2_capacity_rows),
            _ => self,
        }
    }

    /// This server's generation is over (the next one has its own server):
    /// nothing it does may keep a caller waiting.
    pub fn retire(&self) {
        self.training.retire();
    }

    /// Serves generation `generation` of the job, writing checkpoint parts as
    /// `config` says.
    pub fn for_generation(mut self, generation: Generation, config: &Config) -> Self {
        self.generation = generation;
        self.config = Some(config.clone());
        self
    }

    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Its index among the job's shards.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Refuses a batch id of another generation (a request of an abandoned attempt).
    fn check_generation(&self, batch_id: u64) -> Result<(), ClusterError> {
        let found = generation_of(batch_id);
        if found != self.generation {
            return Err(ClusterError::StaleGeneration {
                peer: format!("shard {}", self.index),
                what: format!("batch {batch_id}"),
                found,
                serving: self.generation,
            });
        }
        Ok(())
    }

    /// Caps pull replies at `bytes` (the job's `cluster.max_message_bytes`).
    pub fn with_max_reply_bytes(mut self, bytes: usize) -> Self {
        self.max_reply_bytes = bytes;
        self
    }

    /// Batches queued or pulled and not yet pushed.
    pub fn pending_batches(&self) -> usize {
        self.pending.lock().len()
    }

    pub fn table(&self) -> &EmbeddingTable {
        &self.table
    }

    /// `cluster.mode = "collocated"`: the second level's counters.
    pub fn second_level_stats(&self) -> Option<crate::second_level::SecondLevelStats> {
        self.training.second_level().map(SecondLevel::stats)
    }

    fn take(&self, batch_id: u64) -> Result<Pending, ClusterError> {
        self.pending.lock().remove(&batch_id).ok_or(ClusterError::UnknownBatch { shard: self.index, batch_id })
    }
}

impl ShardService for ShardServer {
    fn enqueue(
        &self,
        batch_id: u64,
        keys: Vec<u64>,
        mode: Mode,
        newest_record_ms: Option<i64>,
    ) -> Result<(), ClusterError> {
        self.check_generation(batch_id)?;
        let _cut = self.cut.work();
        let (plan, staged) = match mode {
            Mode::Train => self.training.queued(&self.table, &keys)?,
            Mode::Eval => (None, Staged::default()),
        };
        self.pending.lock().insert(batch_id, Pending::Queued { keys, mode, plan, staged, newest_record_ms });
        Ok(())
    }

    fn pull(&self, batch_id: u64) -> Result<Vec<f32>, ClusterError> {
        faults::point("shard.pull");
        self.check_generation(batch_id)?;
        let _cut = self.cut.work();
        let dim = self.table.dim();
        let (keys, mode, plan, _staged, newest_record_ms) = match self.take(batch_id)? {
            Pending::Queued { keys, .. } if pull_reply_bytes(keys.len(), dim) > self.max_reply_bytes => {
                return Err(ClusterError::TooLarge {
                    peer: format!("shard {}", self.index),
                    method: "pull",
                    bytes: pull_reply_bytes(keys.len(), dim),
                    limit: self.max_reply_bytes,
                });
            }
            Pending::Queued { keys, mode, plan, staged, newest_record_ms } => {
                (keys, mode, plan, staged, newest_record_ms)
            }
            pulled @ Pending::Pulled { .. } => {
                self.pending.lock().insert(batch_id, pulled);
                return Err(ClusterError::UnknownBatch { shard: self.index, batch_id });
            }
        };
        // Second dedup (S3.4): keys from several loaders may repeat.
        let plan = plan.unwrap_or_else(|| self.table.plan(&keys));
        let mut unique_rows = vec![0.0f32; plan.num_unique() * dim];
        let mut rows = Vec::new();
        match mode {
            Mode::Eval => {
                self.training.before_level_one_read(&self.table, true)?;
                self.table
                    .lookup(&plan, &mut unique_rows)
                    .map_err(|source| ClusterError::Table { shard: self.index, source })?;
                plan.restore(&unique_rows, dim, &mut rows);
            }
            Mode::Train => {
                let slots = self.training.pull(&self.table, &plan, &mut unique_rows)?;
                plan.restore(&unique_rows, dim, &mut rows);
                self.pending.lock().insert(batch_id, Pending::Pulled { plan, slots, newest_record_ms });
            }
        }
        Ok(rows)
    }

    fn push(&self, batch_id: u64, grads: Vec<f32>, lr_scale: f32) -> Result<(), ClusterError> {
        faults::point("shard.push");
        self.check_generation(batch_id)?;
        // A schedule's factor is in [0, 1]; a NaN, an infinity or a negative
        // one (a corrupt or hostile push) would poison every row it touched.
        // Refused before the batch is taken: it stays queued.
        if !(lr_scale.is_finite() && lr_scale >= 0.0) {
            return Err(ClusterError::Malformed {
                peer: format!("the worker pushing to shard {}", self.index),
                what: format!("batch {batch_id}: learning-rate factor {lr_scale} (must be finite and >= 0)"),
            });
        }
        let _cut = self.cut.work();
        let dim = self.table.dim();
        let (plan, slots, newest_record_ms) = {
            let mut pending = self.pending.lock();
            // Checked before the batch is taken: a bad push leaves it queued.
            let expected = match pending.get(&batch_id) {
                Some(Pending::Pulled { plan, .. }) => plan.inverse.len() * dim,
                _ => return Err(ClusterError::UnknownBatch { shard: self.index, batch_id }),
            };
            // No gradients for a batch with rows here: its worker skipped it.
            let released = grads.is_empty() && expected > 0;
            if grads.len() != expected && !released {
                return Err(ClusterError::WrongSize {
                    shard: self.index,
                    batch_id,
                    what: "gradients",
                    expected,
                    found: grads.len(),
                });
            }
            match pending.remove(&batch_id) {
                Some(Pending::Pulled { plan, slots, newest_record_ms }) => (plan, slots, newest_record_ms),
                _ => return Err(ClusterError::UnknownBatch { shard: self.index, batch_id }),
            }
        };
        if grads.is_empty() && !plan.inverse.is_empty() {
            self.training.release(&self.table, batch_id, &plan, slots)?;
            return self.bound(newest_record_ms);
        }
        // Back to this shard's unique order, duplicates summed (S3.7).
        let mut summed = vec![0.0f32; plan.num_unique() * dim];
        for (i, &u) in plan.inverse.iter().enumerate() {
            let u = u as usize;
            summed[u * dim..(u + 1) * dim].iter_mut().zip(&grads[i * dim..(i + 1) * dim]).for_each(|(s, g)| *s += g);
        }
        self.training.push(&self.table, batch_id, &plan, slots, (&summed, lr_scale))?;
        // After the update, as `sparrow train` deletes after a step.
        self.bound(newest_record_ms)
    }

    fn report(&self) -> Result<ShardReport, ClusterError> {
        self.training.before_level_one_read(&self.table, false)?;
        // Rows past ttl_steps are gone for every reader: count without them.
        self.table.sweep_expired().map_err(|source| ClusterError::Table { shard: self.index, source })?;
        let mut report = ShardReport::of(&self.table);
        report.second_level = self.second_level_stats();
        Ok(report)
    }

    fn pass_staging(&self) -> Option<&dyn PassStaging> {
        self.training.second_level().map(|_| self as &dyn PassStaging)
    }

    fn export(&self, cursor: (usize, usize), max_rows: usize) -> Result<ExportPage, ClusterError> {
        if cursor == (0, 0) {
            self.training.before_level_one_read(&self.table, true)?;
        }
        let (mut keys, mut rows, mut last_uses) = (Vec::new(), Vec::new(), Vec::new());
        let next = self
            .table
            .rows_from(cursor, max_rows, |key, last_use, row| {
                keys.push(key);
                last_uses.push(last_use);
                rows.extend_from_slice(row);
            })
            .map_err(|source| ClusterError::Table { shard: self.index, source })?;
        let filters = (cursor == (0, 0)).then(|| self.table.filter_state());
        Ok(ExportPage { keys, rows, last_uses, filters, next })
    }

    fn write_part(&self, generation: Generation, request: &PartRequest) -> Result<PartWritten, ClusterError> {
        if generation != self.generation {
            return Err(ClusterError::StaleGeneration {
                peer: format!("shard {}", self.index),
                what: "a checkpoint request".into(),
                found: generation,
                serving: self.generation,
            });
        }
        let config = self
            .config
            .as_ref()
            .ok_or_else(|| ClusterError::Setup(format!("shard {}: not set up to write checkpoints", self.index)))?;
        faults::point("shard.write_part");
        let start = Instant::now();
        let (written, export) = {
            let _cut = self.cut.walk();
            // A checkpoint between passes: level 1 takes the second level's rows first.
            self.training.before_level_one_read(&self.table, false)?;
            let written = match &request.checkpoint {
                Some(dir) => {
                    let mut written =
                        sparrow_trainer::checkpoint::write_part(&self.table, dir, self.index, request.since, config)?;
                    written.part.event_clock = self.ttl.lock().as_ref().map(TableBounds::saved).unwrap_or_default();
                    Some(written)
                }
                None => None,
            };
            // The serving export's rows, in the same cut as the checkpoint's.
            let dtype = sparrow_trainer::export::VectorType::of_rows(config.embedding.dtype);
            let export = match &request.export {
                Some((dir, since)) => {
                    Some(sparrow_trainer::export::write_rows_part(&self.table, dir, self.index, *since, dtype)?)
                }
                None => None,
            };
            (written, export)
        };
        let secs = start.elapsed().as_secs_f64();
        faults::point("shard.part_written");
        if let (Some(written), Some(dir)) = (&written, &request.checkpoint) {
            tracing::info!(
                "shard {}: wrote {} rows ({} bytes) into {} in {secs:.3} s",
                self.index,
                written.part.rows,
                written.files.iter().map(|(_, b)| b).sum::<u64>(),
                dir.display()
            );
        }
        if let Some(export) = &export {
            tracing::debug!("shard {}: {} rows for the serving export", self.index, export.rows);
        }
        Ok(PartWritten {
            written,
            export,
            secs,
            dim: self.table.dim(),
            row_len: self.table.row_len(),
            total_rows: self.table.len() as u64,
        })
    }
}

impl PassStaging for ShardServer {
    fn stage(&self, pass: u64, keys: Vec<u64>, batches: Vec<u64>) -> Result<(), ClusterError> {
        if let Some(&b) = batches.first() {
            self.check_generation(b)?;
        }
        let l2 = self.training.second_level().ok_or_else(|| {
            ClusterError::Setup(format!("shard {}: staging a pass needs cluster.mode = \"collocated\"", self.index))
        })?;
        // Outside the cut: a checkpoint may have to run before the pass that makes room ends.
        l2.wait_for_room(pass)?;
        let _cut = self.cut.work();
        l2.stage(&self.table, pass, &keys, &batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::config::InitConfig;
    use sparrow_embedding::{Initializer, SparseOptimizer};

    /// A 503 MB reply used to be built in full before tonic refused it.
    #[test]
    fn a_pull_too_large_for_a_message_is_refused_from_its_key_count() {
        let optimizer = SparseOptimizer::Sgd { lr: 0.1 };
        let table = EmbeddingTable::new(16, optimizer, Initializer::new(InitConfig::default(), 1), 4);
        let shard = ShardServer::new(3, table).with_max_reply_bytes(64 * 1024);
        // 1024 keys × 16 floats × 4 bytes = 64 KiB of rows, plus the header: one key too many.
        shard.enqueue(7, (0..1024).collect(), Mode::Train, None).expect("queued");
        let err = shard.pull(7).expect_err("too large");
        let msg = err.to_string();
        assert!(msg.contains("shard 3") && msg.contains("pull") && msg.contains("cluster.max_message_bytes"), "{msg}");
        assert_eq!(shard.table().len(), 0, "no row was looked up or inserted");
        shard.enqueue(8, (0..1000).collect(), Mode::Train, None).expect("queued");
        assert_eq!(shard.pull(8).expect("fits").len(), 1000 * 16);
    }

    /// A batch its worker skipped (`train.on_non_finite = "skip_batch"`) is
    /// let go with no row updated; a push of the wrong size, or with a
    /// learning-rate factor that is not a finite number >= 0, is refused.
    #[test]
    fn a_released_batch_is_forgotten_without_an_update() {
        let optimizer = SparseOptimizer::Adagrad { lr: 0.5, eps: 1e-8 };
        let table = EmbeddingTable::new(4, optimizer, Initializer::new(InitConfig::default(), 1), 4);
        let shard = ShardServer::new(0, table);
        shard.enqueue(1, vec![10, 11, 10], Mode::Train, None).expect("queued");
        let before = shard.pull(1).expect("pulled");
        assert!(shard.push(1, vec![0.5; 4], 1.0).is_err(), "a wrong-sized push is refused");
        for bad in [f32::NAN, f32::INFINITY, -1.0] {
            let err = shard.push(1, vec![0.5; 12], bad).expect_err("a bad factor").to_string();
            assert!(err.contains("learning-rate factor"), "{err}");
        }
        assert_eq!(shard.pending_batches(), 1, "and leaves the batch held");
        shard.release(1).expect("released");
        assert_eq!(shard.pending_batches(), 0, "the batch is forgotten");
        assert!(shard.push(1, vec![0.5; 12], 1.0).is_err(), "a released batch takes no push");
        shard.enqueue(2, vec![10, 11, 10], Mode::Train, None).expect("queued");
        assert_eq!(shard.pull(2).expect("pulled"), before, "no row moved");
        shard.push(2, vec![0.5; 12], 1.0).expect("pushed");
        shard.enqueue(3, vec![10, 11, 10], Mode::Train, None).expect("queued");
        assert_ne!(shard.pull(3).expect("pulled"), before, "a push moves them");
    }

    const DIM: usize = 4;

    fn skew_shard(ssd: Option<&std::path::Path>) -> ShardServer {
        let optimizer = SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 };
        let init = Initializer::new(InitConfig::default(), 3);
        let table = match ssd {
            None => EmbeddingTable::new(DIM, optimizer, init, 4),
            Some(dir) => {
                let ssd = sparrow_embedding::table::SsdOptions {
                    dir: dir.to_path_buf(),
                    cache_capacity_rows: 16,
                    policy: sparrow_core::config::CachePolicy::Lru,
                };
                EmbeddingTable::with_ssd(DIM, optimizer, init, 4, &ssd).expect("ssd table")
            }
        };
        ShardServer::new(0, table)
    }

    /// Batch `b`'s keys: 24 of 400 (batches 1000 on: of the next 400), with repeats.
    fn skew_keys(b: u64) -> Vec<u64> {
        let base = if b >= 1000 { 400 } else { 0 };
        (0..24).map(|i| sparrow_core::key::mix64(base + (b * 7 + i * 13) % 400)).collect()
    }

    /// A gradient that depends on the rows pulled, so a row read or updated
    /// in the wrong place changes the model.
    fn skew_grads(rows: &[f32]) -> Vec<f32> {
        rows.iter().enumerate().map(|(i, w)| 0.5 * w + 0.01 * (i % 5) as f32 - 0.02).collect()
    }

    fn train_batches(shard: &ShardServer, batches: std::ops::Range<u64>) {
        for b in batches {
            shard.enqueue(b, skew_keys(b), Mode::Train, None).expect("queued");
            let rows = shard.pull(b).expect("pulled");
            shard.push(b, skew_grads(&rows), 1.0).expect("pushed");
        }
    }

    /// S2.2 lets a fast worker take any number of batches while a slow one
    /// holds its rows: batch 0 is pulled, 300 batches are pulled and pushed
    /// through a 16-row cache, then batch 0 is pushed. Its rows stayed in
    /// place (protected while in flight), so the SSD shard ends with exactly
    /// the model of a shard in memory. A count of protected lookups (the old
    /// rule) let them be evicted and the push land on other keys' rows.
    #[test]
    fn a_stalled_workers_rows_stay_its_own_while_another_trains_hundreds_of_batches() {
        let tmp = tempfile::tempdir().expect("tmp");
        let tiered = skew_shard(Some(tmp.path()));
        let memory = skew_shard(None);
        for shard in [&tiered, &memory] {
            train_batches(shard, 500..600);
            shard.enqueue(0, skew_keys(0), Mode::Train, None).expect("queued");
            let stalled = shard.pull(0).expect("pulled");
            train_batches(shard, 1..301);
            shard.push(0, skew_grads(&stalled), 1.0).expect("the stalled batch's push lands on its own rows");
            // Eviction goes on once nothing is in flight.
            train_batches(shard, 1000..1100);
        }
        let writebacks = tiered.table().tier_stats().expect("tiered").writebacks;
        assert!(writebacks > 100, "the cache evicted: {writebacks} write-backs");
        assert_eq!(tiered.table().len(), memory.table().len());
        for k in 0..800 {
            let key = sparrow_core::key::mix64(k);
            assert_eq!(tiered.table().get_row(key), memory.table().get_row(key), "row of key {k}");
        }
    }
}
