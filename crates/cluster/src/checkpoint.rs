//! Cluster checkpoints in `sparrow train`'s format, in parts: each shard
//! streams its own rows into the version's staging directory
//! ([`sparrow_trainer::checkpoint::write_part`]), worker 0 its dense model
//! and optimizer state, and the coordinator checks every file and commits the
//! version ([`crate::coordinator`]). `sparrow eval`, `predict` and
//! `train --resume` read it like any other; a shard restores its own part,
//! a worker the dense part, the loader the data position.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sparrow_core::Config;
use sparrow_core::batch::{DataPosition, StreamMark};
use sparrow_data::DataLayout;
use sparrow_model::{DenseModel, DenseOptimizer};
use sparrow_trainer::Trainer;
use sparrow_trainer::checkpoint::{FORMAT_VERSION, FileEntry, Manifest, TrainedBatch, hash_file, stored_config};

use crate::generation::Generation;
use crate::transport::{ClusterError, PartWritten};

/// A worker's part of a checkpoint: its dense model, the optimizer's state
/// (steps and samples behind them) and where the data continues.
pub struct DenseState {
    pub model: DenseModel,
    pub optimizer: DenseOptimizer,
    pub position: DataPosition,
    /// The checkpoint's step (in rounds: the batches the job trained).
    pub step: u64,
    /// `[data.stream]`: the checkpoint's mark.
    pub stream: Option<StreamMark>,
}

/// A worker at a checkpoint step, its updates pushed.
#[derive(Clone, Debug)]
pub struct WorkerCut {
    pub worker: usize,
    pub generation: Generation,
    pub step: u64,
    pub samples_trained: u64,
    pub dense_optimizer_step: u64,
    pub position: DataPosition,
    /// Worker 0 wrote `dense.safetensors` into the staging directory.
    pub wrote_dense: bool,
    /// The batches it trained since its last checkpoint (where each starts
    /// and ends): the coordinator finds where the data continues from them.
    pub trained: Vec<TrainedBatch>,
    /// `[data.stream]`: the mark after the batch that ends at `position`.
    pub stream: Option<StreamMark>,
    /// The worker's last meeting (its training ended): a checkpoint, always.
    pub last: bool,
    /// `[train.early_stopping]` (worker 0's, which validates): where it
    /// stands after this step, kept in the manifest.
    pub early_stopping: Option<sparrow_trainer::early_stopping::StoppingState>,
}

/// Where the job's training data stands: every batch before `position` was
/// trained, and so were the batches in `ahead` (by start) past it. Workers
/// take batches in any order and hold some untrained (prefetched) while
/// another trains later ones, so no single position says it; a resumed
/// loader reads from `position` and drops the batches in `ahead`.
#[derive(Clone, Debug, Default)]
pub struct DataProgress {
    pub generation: Generation,
    pub position: DataPosition,
    pub ahead: BTreeMap<(u64, u64, u64), TrainedBatch>,
    /// `[data.stream]`: the mark at `position`. Batches trained ahead of it
    /// go into the checkpoint as its `skip` ranges (by offset: a resumed
    /// reader may cut new records differently, so not by position).
    pub stream: Option<StreamMark>,
}

impl DataProgress {
    /// The progress a generation starts from: its restored checkpoint's.
    pub fn restored(generation: Generation, manifest: Option<&Manifest>) -> DataProgress {
        let mut p = DataProgress { generation, ..Default::default() };
        if let Some(m) = manifest {
            p.position = m.position;
            p.ahead = m.skip.iter().map(|b| (b.start.key(), b.clone())).collect();
            p.stream = m.stream.clone();
        }
        p
    }

    /// Adds trained batches and moves `position` past every batch trained
    /// without a gap.
    pub fn add(&mut self, trained: impl IntoIterator<Item = TrainedBatch>) {
        for b in trained {
            if b.start.key() >= self.position.key() {
                self.ahead.insert(b.start.key(), b);
            }
        }
        while let Some(b) = self.ahead.remove(&self.position.key()) {
            self.position = b.end;
            if b.stream.is_some() {
                self.stream = b.stream;
            }
        }
    }

    /// Where the data continues, for a manifest: the position and the
    /// batches trained past it (a stream's as ranges in its mark).
    fn resume_point(&self) -> (DataPosition, Vec<TrainedBatch>, Option<StreamMark>) {
        let ahead = self.ahead.values().filter_map(|b| b.stream.as_ref());
        match &self.stream {
            Some(mark) => (self.position, Vec::new(), Some(mark.clone().with_skipped(ahead))),
            // A stream whose first batch is still held: no offsets yet (the
            // resumed reader starts where `start` says), the batches past it
            // as skip ranges all the same.
            None if self.ahead.values().any(|b| b.stream.is_some()) => {
                (self.position, Vec::new(), Some(StreamMark::default().with_skipped(ahead)))
            }
            None => (self.position, self.ahead.values().cloned().collect(), None),
        }
    }
}

/// The staging directory of the checkpoint at `step` of `generation`
/// (worker 0 writes the dense part there, the shards their parts).
pub fn staging_dir(root: &Path, step: u64, generation: Generation) -> PathBuf {
    root.join(format!(".tmp-ckpt-{step:012}-g{generation}"))
}

/// Where a worker's checkpoints go: the coordinator gathers every worker at
/// the step and commits the version once the shards wrote their parts.
pub trait CheckpointSink: Send + Sync {
    fn checkpoint(&self, cut: WorkerCut) -> Result<Committed, ClusterError>;
}

/// A committed checkpoint, as every worker of it hears.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    pub dir: PathBuf,
    /// Timed meetings (`checkpoint.every_secs`, `export_every_secs`): the
    /// step of the next one, the same for every worker (the coordinator
    /// picks it from the pace of the steps so far).
    pub next_step: Option<u64>,
    /// The meeting wrote a checkpoint (false: a serving export alone, and
    /// `dir` is the last checkpoint before it).
    pub checkpoint: bool,
}

/// `config` with its table in memory: for the helper tables of save and
/// restore, which must not touch a shard's SSD files.
fn in_memory(config: &Config) -> Config {
    let mut c = config.clone();
    c.embedding.storage = sparrow_core::config::Storage::Memory;
    c
}

/// The manifest of a version whose parts the shards wrote into `staging`:
/// every file is checked against the size its writer reported and
/// checksummed here (a part whose writer died before reporting is never
/// listed). `base`: the version an incremental one adds to.
pub fn manifest(
    config: &Config,
    cuts: &[WorkerCut],
    parts: &[PartWritten],
    base: Option<&Path>,
    staging: &Path,
    progress: Option<&DataProgress>,
) -> Result<Manifest, ClusterError> {
    let first = cuts.first().ok_or_else(|| ClusterError::Setup("a checkpoint without workers".into()))?;
    let shape = parts.first().ok_or_else(|| ClusterError::Setup("a checkpoint without shards".into()))?;
    let mut files = BTreeMap::new();
    let dense = cuts.iter().any(|c| c.wrote_dense);
    if !dense {
        return Err(ClusterError::Setup("no worker wrote the dense part".into()));
    }
    files.insert("dense.safetensors".to_string(), hash_file(&staging.join("dense.safetensors"))?);
    let written = parts
        .iter()
        .map(|p| p.written.as_ref().ok_or_else(|| ClusterError::Setup("a shard wrote no checkpoint part".into())))
        .collect::<Result<Vec<_>, _>>()?;
    for part in &written {
        for (name, bytes) in &part.files {
            let entry: FileEntry = hash_file(&staging.join(name))?;
            if entry.bytes != *bytes {
                return Err(ClusterError::Setup(format!(
                    "{}: {} bytes on disk, its shard wrote {bytes}",
                    staging.join(name).display(),
                    entry.bytes
                )));
            }
            files.insert(name.clone(), entry);
        }
    }
    let layout = DataLayout::from_config(&config.data);
    let (position, skip, stream) = resume_point(cuts, progress);
    Ok(Manifest {
        format_version: FORMAT_VERSION,
        model_kind: config.model.kind.name().to_string(),
        num_fields: layout.num_fields,
        num_dense: layout.num_dense,
        embedding_dim: config.model.embedding_dim,
        embedding_width: shape.dim,
        embedding_dtype: config.embedding.dtype,
        embedding_rounding: config.embedding.rounding,
        row_len: shape.row_len,
        sparse_optimizer: sparrow_embedding::SparseOptimizer::from_config(&config.embedding).name().to_string(),
        step: first.step,
        samples_trained: first.samples_trained,
        dense_optimizer_step: first.dense_optimizer_step,
        position,
        embedding_rows: parts.iter().map(|p| p.total_rows).sum(),
        files,
        config: stored_config(config),
        created_unix_secs: sparrow_trainer::checkpoint::unix_secs(),
        parts: written.iter().map(|p| p.part.clone()).collect(),
        base: base.and_then(|b| b.file_name()).map(|n| n.to_string_lossy().to_string()),
        skip,
        stream,
        event_clock: Vec::new(),
        early_stopping: cuts.iter().find(|c| c.wrote_dense).and_then(|c| c.early_stopping.clone()),
    })
}

/// Where the data continues after the workers' `cuts`: from the data
/// progress where batches were reported, else the furthest cut's position
/// (and its stream's mark).
pub fn resume_point(
    cuts: &[WorkerCut],
    progress: Option<&DataProgress>,
) -> (DataPosition, Vec<TrainedBatch>, Option<StreamMark>) {
    match (progress, cuts.first()) {
        (Some(p), _) => p.resume_point(),
        (None, Some(first)) => {
            let furthest =
                cuts.iter().fold(first, |f, c| if c.position.later(f.position) == c.position { c } else { f });
            (furthest.position, Vec::new(), furthest.stream.clone())
        }
        (None, None) => Default::default(),
    }
}

/// Shard `index` of `num_shards`, restored from a checkpoint: only the keys it
/// owns (whatever the shard count that wrote it; from a version written by as
/// many shards, its own part, filter state included), and its part's event
/// clock (`embedding.ttl_secs`; empty from a version of another shard
/// count, whose lookup clocks were other tables'). `subdir`: where its SSD
/// tier goes (a fresh one: never the files of a dead process).
pub fn restore_shard_table(
    config: &Config,
    dir: &Path,
    index: usize,
    num_shards: usize,
    subdir: &str,
) -> Result<(sparrow_embedding::EmbeddingTable, Vec<(u64, i64)>), ClusterError> {
    let mut trainer = Trainer::new(&in_memory(config), DataLayout::from_config(&config.data))?;
    trainer.table = crate::shard::shard_table_in(config, index, subdir)?;
    let manifest = sparrow_trainer::checkpoint::load_shard_into(&mut trainer, dir, index, num_shards, |key| {
        sparrow_embedding::owner(key, num_shards) == index
    })?;
    let event_clock = match manifest.parts.get(index) {
        Some(part) if manifest.parts.len() == num_shards => part.event_clock.clone(),
        _ => Vec::new(),
    };
    Ok((trainer.table, event_clock))
}

/// A worker's dense model and optimizer state, restored from a checkpoint.
pub fn restore_dense(config: &Config, dir: &Path) -> Result<DenseState, ClusterError> {
    let mut c = in_memory(config);
    // The helper's table is never filled: keep it small.
    c.embedding.table_shards = 1;
    let mut trainer = Trainer::new(&c, DataLayout::from_config(&config.data))?;
    let manifest = sparrow_trainer::checkpoint::load_dense_into(&mut trainer, dir)?;
    let mut optimizer = trainer.dense_optimizer;
    optimizer.samples_stepped = manifest.samples_trained;
    Ok(DenseState {
        model: trainer.model,
        optimizer,
        position: manifest.position,
        step: manifest.step,
        stream: manifest.stream,
    })
}

/// Worker 0's part of the checkpoint at `step` of `generation`: the dense
/// model and optimizer state, written into the staging directory.
pub fn write_dense(
    root: &Path,
    step: u64,
    generation: Generation,
    model: &DenseModel,
    optimizer: &DenseOptimizer,
) -> Result<PathBuf, ClusterError> {
    let staging = staging_dir(root, step, generation);
    std::fs::create_dir_all(&staging)
        .map_err(|e| ClusterError::Io { what: format!("creating {}", staging.display()), source: e })?;
    sparrow_trainer::checkpoint::write_dense(model, optimizer, &staging)?;
    Ok(staging)
}

/// How often a cluster job's workers stop for a checkpoint:
/// `checkpoint.every_steps`, or `checkpoint.export_every_steps` without it
/// (a cluster job's serving exports are written from its committed
/// checkpoints, see [`ClusterExports`]).
pub fn checkpoint_every(config: &Config) -> Option<u64> {
    config.checkpoint.every_steps.or(config.checkpoint.export_every_steps.filter(|&n| n > 0))
}

/// Timed checkpoints of a cluster job: `checkpoint.every_secs`, or
/// `checkpoint.export_every_secs` when no checkpoint cadence is set.
pub fn checkpoint_every_secs(config: &Config) -> Option<u64> {
    let c = &config.checkpoint;
    let export = c.export_every_secs.filter(|_| c.every_steps.is_none() && c.export_every_steps.is_none());
    c.every_secs.or(export).filter(|&s| s > 0)
}

/// How often the workers meet, in seconds: for a timed checkpoint, or
/// more often for a serving export alone (`export_every_secs` below the
/// checkpoints' interval: a cut without a checkpoint, see
/// [`crate::exports`]). The workers meet at a step, not a moment: the first
/// meeting is at step 1, and each names the step of the next, as many
/// steps on as the job made in that many seconds before it ([`Pace`]).
pub fn meet_every_secs(config: &Config) -> Option<u64> {
    let export = config.checkpoint.export_every_secs.filter(|&s| s > 0);
    match (checkpoint_every_secs(config), export) {
        (Some(c), Some(e)) => Some(c.min(e)),
        (c, e) => c.or(e),
    }
}

/// The pace of a job's steps between meetings: where the next timed one
/// falls, and whether a timed checkpoint is due. Meetings are one at a
/// time, so plain atomics do.
pub struct Pace {
    every_secs: Option<u64>,
    /// Timed checkpoints (meetings may be more frequent, for exports).
    checkpoint_secs: Option<u64>,
    started: std::time::Instant,
    /// The step and the time (ns after `started`) of the last meeting, and
    /// the step it named for the next.
    last_step: std::sync::atomic::AtomicU64,
    last_nanos: std::sync::atomic::AtomicU64,
    expected: std::sync::atomic::AtomicU64,
    /// Steps between the last two meetings named (0: none yet): the next
    /// is at most twice it and at least half.
    interval: std::sync::atomic::AtomicU64,
    /// When (ns after `started`) the last checkpoint was committed.
    checkpoint_nanos: std::sync::atomic::AtomicU64,
}

impl Pace {
    pub fn new(config: &Config) -> Pace {
        let every_secs = meet_every_secs(config);
        Pace {
            every_secs,
            checkpoint_secs: checkpoint_every_secs(config),
            started: std::time::Instant::now(),
            last_step: Default::default(),
            last_nanos: Default::default(),
            expected: std::sync::atomic::AtomicU64::new(1),
            interval: Default::default(),
            checkpoint_nanos: Default::default(),
        }
    }

    /// Whether meetings are timed.
    pub fn timed(&self) -> bool {
        self.every_secs.is_some()
    }

    fn nanos(&self) -> u64 {
        self.started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64
    }

    /// Whether `step` is the one the last meeting named (always, untimed):
    /// a meeting off it is the job's last, or the first after a recovery.
    pub fn named(&self, step: u64) -> bool {
        self.every_secs.is_none() || self.expected.load(std::sync::atomic::Ordering::Relaxed) == step
    }

    /// Whether a meeting on schedule is for a timed checkpoint: always
    /// when the meetings are timed for checkpoints; when they are timed for
    /// exports, once `checkpoint.every_secs` passed since the last one;
    /// never when checkpoints are not timed.
    pub fn checkpoint_due(&self) -> bool {
        match (self.every_secs, self.checkpoint_secs) {
            (Some(every), Some(secs)) if secs <= every => true,
            (_, Some(secs)) => {
                let last = self.checkpoint_nanos.load(std::sync::atomic::Ordering::Relaxed);
                self.nanos().saturating_sub(last) >= secs.saturating_mul(1_000_000_000)
            }
            (_, None) => false,
        }
    }

    /// A checkpoint was committed now.
    pub fn checkpointed(&self) {
        self.checkpoint_nanos.store(self.nanos(), std::sync::atomic::Ordering::Relaxed);
    }

    /// A meeting at `step`: the step of the next timed one (none: not
    /// timed), and whether `step` was the one named.
    pub fn committed(&self, step: u64) -> (Option<u64>, bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(every) = self.every_secs else { return (None, true) };
        let nanos = self.nanos();
        let (last_step, last_nanos) = (self.last_step.swap(step, Relaxed), self.last_nanos.swap(nanos, Relaxed));
        let next = if step <= last_step || nanos <= last_nanos {
            // After a recovery the steps start over from the restored one: measure anew.
            self.interval.store(0, Relaxed);
            step + 1
        } else {
            let per_sec = (step - last_step) as f64 / ((nanos - last_nanos) as f64 / 1e9);
            let measured = ((per_sec * every as f64).round() as u64).clamp(1, 1 << 40);
            let steps = bounded_interval(measured, self.interval.load(Relaxed));
            self.interval.store(steps, Relaxed);
            step + steps
        };
        let on_schedule = self.expected.swap(next, Relaxed) == step;
        (Some(next), on_schedule)
    }
}

/// The steps to the next meeting: as `measured`, but one interval's pace
/// is noisy (a backlog worked off after a slow meeting runs fast), so at
/// most twice and at least half the interval `before` (0: none yet).
fn bounded_interval(measured: u64, before: u64) -> u64 {
    if before == 0 { measured } else { measured.clamp(before.div_ceil(2), before.saturating_mul(2)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(offset: u64) -> DataPosition {
        DataPosition { epoch: 0, offset, line: offset + 1, skip: 0 }
    }

    fn batch(start: u64, end: u64) -> TrainedBatch {
        TrainedBatch { start: at(start), end: at(end), stream: None }
    }

    /// Timed checkpoints: the first at step 1 is on schedule and names a
    /// later step; a commit off the named step (the job's end) says so; a
    /// step at or before the last one (a recovery) measures anew.
    #[test]
    fn the_pace_names_the_next_step_and_tells_the_last_commit() {
        let config: Config =
            Config::from_toml("[checkpoint]\ndir = \"c\"\nevery_secs = 1\n", "test", &Default::default())
                .expect("config");
        let pace = Pace::new(&config);
        assert!(pace.timed());
        let (next, on_schedule) = pace.committed(1);
        assert!(on_schedule && next.is_some_and(|n| n >= 2), "{next:?}");
        let (_, on_schedule) = pace.committed(next.expect("next") + 3);
        assert!(!on_schedule, "off the named step: the job's last");
        assert_eq!(pace.committed(1).0, Some(2), "after a recovery");
        // Meetings a moment apart measure a huge pace: the interval at most doubles.
        let (second, _) = pace.committed(2);
        assert!(second.is_some_and(|n| n > 3), "{second:?}");
        let first = second.expect("named") - 2;
        let third = pace.committed(4).0.expect("named") - 4;
        assert!(third <= 2 * first && third >= first / 2, "{third} steps after {first}: a factor of two at most");
        assert_eq!(bounded_interval(20, 2), 4, "a backlog's pace: twice the interval before");
        assert_eq!(bounded_interval(1, 9), 5, "half, rounded up");
        assert_eq!((bounded_interval(7, 5), bounded_interval(7, 0)), (7, 7));
        let untimed = Pace::new(&Config::default());
        assert_eq!(untimed.committed(10), (None, true));
        // export_every_secs alone times the checkpoints too; a step cadence wins over it.
        let export = Config::from_toml("[checkpoint]\ndir = \"c\"\nexport_every_secs = 2\n", "t", &Default::default())
            .expect("c");
        assert_eq!(checkpoint_every_secs(&export), Some(2));
        let both = Config::from_toml(
            "[checkpoint]\ndir = \"c\"\nexport_every_secs = 2\nevery_steps = 5\n",
            "t",
            &Default::default(),
        )
        .expect("c");
        assert_eq!(checkpoint_every_secs(&both), None);
    }

    /// Worker B holds batch [20, 30) untrained (prefetched) while worker A
    /// trained [30, 40): the checkpoint continues at 20 and skips [30, 40)
    /// (taking the furthest end, 40, would lose [20, 30) on recovery).
    #[test]
    fn a_batch_held_untrained_stops_the_position_and_later_ones_are_skipped() {
        let mut p = DataProgress::restored(Generation(1), None);
        p.add([batch(0, 10), batch(30, 40), batch(10, 20)]);
        assert_eq!(p.position, at(20));
        assert_eq!(p.ahead.values().cloned().collect::<Vec<_>>(), vec![batch(30, 40)]);
        // The next checkpoint: B trained [20, 30) meanwhile.
        p.add([batch(20, 30), batch(40, 50)]);
        assert_eq!(p.position, at(50));
        assert!(p.ahead.is_empty());
        // A restored generation starts from the manifest's position and skip list.
        let m = Manifest { position: at(20), skip: vec![batch(30, 40)], ..manifest_for_tests() };
        let mut restored = DataProgress::restored(Generation(2), Some(&m));
        restored.add([batch(20, 30)]);
        assert_eq!(restored.position, at(40), "the skipped batch counts as trained");
    }

    /// A stream batch over one partition: records `from..to`, `records`
    /// consumed after it.
    fn stream_batch(start: u64, end: u64, from: i64, to: i64) -> TrainedBatch {
        let mark =
            StreamMark { offsets: [(0, to)].into(), from: [(0, from)].into(), records: end, ..Default::default() };
        TrainedBatch { stream: Some(mark), ..batch(start, end) }
    }

    /// On a stream the same held batch leaves the checkpoint at the held
    /// batch's start offsets, and the batch trained past it goes in as a
    /// skip range (not by position: a resumed reader cuts new records
    /// anew); a restored generation takes the ranges from the mark.
    #[test]
    fn a_stream_batch_held_untrained_leaves_a_skip_range_in_the_mark() {
        let mut p = DataProgress::restored(Generation(1), None);
        p.add([stream_batch(0, 10, 0, 10), stream_batch(20, 30, 20, 30)]);
        let (position, skip, mark) = p.resume_point();
        assert_eq!((position, skip), (at(10), Vec::new()));
        let mark = mark.expect("a stream's mark");
        assert_eq!(mark.offsets, [(0, 10)].into());
        assert_eq!(mark.skip, [(0, vec![(20, 30)])].into());
        // Restored: the ranges travel in the mark, the positions start over.
        let m = Manifest { position, stream: Some(mark), ..manifest_for_tests() };
        let mut restored = DataProgress::restored(Generation(2), Some(&m));
        assert!(restored.ahead.is_empty());
        // The resumed reader dropped 20..30 and still lists nothing past 35.
        let mut next = stream_batch(10, 25, 10, 35);
        next.stream.as_mut().expect("mark").skip = Default::default();
        restored.add([next]);
        let (_, _, mark) = restored.resume_point();
        let mark = mark.expect("mark");
        assert_eq!(mark.offsets, [(0, 35)].into());
        assert!(mark.skip.is_empty(), "ranges behind the offsets are gone: {:?}", mark.skip);
        // The first batch still held: no offsets, the later one skipped.
        let mut first_held = DataProgress::restored(Generation(3), None);
        first_held.add([stream_batch(10, 20, 10, 20)]);
        let (position, skip, mark) = first_held.resume_point();
        assert_eq!((position, skip), (DataPosition::default(), Vec::new()));
        let mark = mark.expect("a stream's mark");
        assert!(mark.offsets.is_empty());
        assert_eq!(mark.skip, [(0, vec![(10, 20)])].into());
    }

    fn manifest_for_tests() -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            model_kind: String::new(),
            num_fields: 0,
            num_dense: 0,
            embedding_dim: 0,
            embedding_width: 0,
            embedding_dtype: Default::default(),
            embedding_rounding: Default::default(),
            row_len: 0,
            sparse_optimizer: String::new(),
            step: 0,
            samples_trained: 0,
            dense_optimizer_step: 0,
            position: DataPosition::default(),
            embedding_rows: 0,
            files: BTreeMap::new(),
            config: String::new(),
            created_unix_secs: 0,
            parts: Vec::new(),
            base: None,
            skip: Vec::new(),
            stream: None,
            event_clock: Vec::new(),
            early_stopping: None,
        }
    }
}
