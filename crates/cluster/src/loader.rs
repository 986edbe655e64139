//! The loader (S0.1–S0.3): reads and batches, numbers the batches, sends each
//! shard the unique keys it owns, and queues the rest for the workers, who
//! take batches one at a time at their own pace (S2.2).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, bounded};
use parking_lot::Mutex;
use sparrow_core::Config;
use sparrow_core::config::{ClusterMode, PassRequest, SyncMode};
use sparrow_data::{BadRows, BatchStream, DataError};
use sparrow_embedding::{KeyPlan, owner};

use crate::faults;
use crate::generation::Generation;
use crate::messages::{Mode, PassCounters, WorkerBatch, first_batch_id};
use crate::transport::{ClusterError, LoaderService, Polled, RoundQueueService, ShardService};

/// Batch ids of evaluation batches start here, so they never collide with training ones.
pub const FIRST_EVAL_BATCH_ID: u64 = 1 << 62;

/// Turns one batch stream into worker batches.
pub struct Loader {
    stream: BatchStream,
    shards: Vec<Arc<dyn ShardService>>,
    mode: Mode,
    cluster_mode: ClusterMode,
    next_id: u64,
    bad_rows: BadRows,
    /// Where the next batch starts (the previous one's end).
    next_start: sparrow_core::batch::DataPosition,
    /// Batches (by start) a restored checkpoint says were trained already,
    /// out of order: read and dropped.
    skip: std::collections::HashSet<(u64, u64, u64)>,
    /// Evaluation under `eval.group_by`: the field whose first ID groups rows.
    group_field: Option<usize>,
    /// `data.validation`: this stream gives one epoch (see [`Loader::one_epoch`]).
    one_epoch: Option<OneEpoch>,
}

/// A stream cut at the end of one epoch.
#[derive(Clone, Copy, Debug, Default)]
struct OneEpoch {
    epoch: Option<u64>,
    /// A batch of the next epoch was read (and dropped): the stream ended.
    passed: bool,
}

impl Loader {
    /// `first_id` keeps batch ids unique across streams (train and eval).
    pub fn new(
        stream: BatchStream,
        shards: Vec<Arc<dyn ShardService>>,
        mode: Mode,
        cluster_mode: ClusterMode,
        first_id: u64,
        bad_rows: BadRows,
    ) -> Self {
        Loader {
            stream,
            shards,
            mode,
            cluster_mode,
            next_id: first_id,
            bad_rows,
            next_start: Default::default(),
            skip: Default::default(),
            group_field: None,
            one_epoch: None,
        }
    }

    /// `data.validation` in a cluster: the stream ends with one epoch, so
    /// the job validates there before the next (a generation of its own,
    /// restored from the epoch's checkpoint). `Some(Some(e))`: epoch `e`,
    /// where the stream starts (a stream restored at the end of an epoch
    /// not yet validated then ends at once: its validation comes first);
    /// `Some(None)`: the epoch of its first batch (restored at the end of
    /// one validated: the next).
    pub fn one_epoch(mut self, epoch: Option<Option<u64>>) -> Self {
        self.one_epoch = epoch.map(|epoch| OneEpoch { epoch, passed: false });
        self
    }

    /// Each batch carries its rows' group numbers (GAUC under `eval.group_by`).
    pub fn grouping(mut self, field: Option<usize>) -> Self {
        self.group_field = field;
        self
    }

    /// The stream starts at `start` (a restored checkpoint's position) and
    /// the batches starting at `skip` were trained already.
    pub fn resuming(
        mut self,
        start: sparrow_core::batch::DataPosition,
        skip: &[sparrow_core::batch::DataPosition],
    ) -> Self {
        self.next_start = start;
        self.skip = skip.iter().map(|p| p.key()).collect();
        self
    }

    /// The next batch: in S0 mode its keys go to their shards and the worker
    /// gets only their positions; in worker_lookup mode the worker gets the keys.
    pub fn next_batch(&mut self) -> Result<Option<WorkerBatch>, ClusterError> {
        let Some((batch, keys)) = self.next_planned()? else { return Ok(None) };
        for (shard, keys) in self.shards.iter().zip(keys) {
            if !keys.is_empty() {
                shard.enqueue(batch.batch_id, keys, self.mode, batch.newest_record_ms())?;
            }
        }
        Ok(Some(batch))
    }

    /// The next batch and each shard's unique keys of it (S0 and collocated
    /// modes; none in worker_lookup mode), not yet queued on the shards.
    fn next_planned(&mut self) -> Result<Option<PlannedBatch>, ClusterError> {
        if self.one_epoch.is_some_and(|o| o.passed) {
            return Ok(None);
        }
        let batch = loop {
            let Some(batch) = self.stream.next().transpose()? else { return Ok(None) };
            if let Some(one) = self.one_epoch.as_mut() {
                let epoch = *one.epoch.get_or_insert(batch.end.epoch);
                if batch.end.epoch != epoch {
                    one.passed = true;
                    return Ok(None);
                }
            }
            let start = std::mem::replace(&mut self.next_start, batch.end);
            if !self.skip.remove(&start.key()) {
                break (batch, start);
            }
        };
        let (batch, start) = batch;
        let batch_id = self.next_id;
        self.next_id += 1;
        let groups = match self.group_field {
            Some(field) => sparrow_trainer::evaluation::group_keys(&batch, field).collect(),
            None => Vec::new(),
        };
        let mut out = WorkerBatch {
            batch_id,
            rows: batch.rows(),
            num_fields: batch.num_fields,
            num_dense: batch.num_dense,
            num_tasks: batch.tasks(),
            truncated_sequences: batch.truncated_sequences,
            groups,
            labels: batch.labels,
            dense: batch.dense,
            bag_offsets: batch.bag_offsets,
            key_weights: batch.key_weights,
            inverse: Vec::new(),
            shard_counts: Vec::new(),
            keys: Vec::new(),
            end: batch.end,
            start,
            bad_rows: self.bad_rows.total(),
            sample_weights: batch.sample_weights,
            merged_samples: self.bad_rows.weighting.merged.load(std::sync::atomic::Ordering::Relaxed),
            dropped_samples: self.bad_rows.weighting.dropped.load(std::sync::atomic::Ordering::Relaxed),
            passes: Default::default(),
            stream: batch.stream.as_deref().cloned(),
        };
        let mut per_shard = vec![Vec::new(); self.shards.len()];
        match self.cluster_mode {
            ClusterMode::WorkerLookup => out.keys = batch.keys,
            ClusterMode::S0 | ClusterMode::Collocated => {
                let n = self.shards.len();
                // First dedup (S3.2) and partition by owner, counts first (S3.3).
                let plan = KeyPlan::new(&batch.keys, n, |k| owner(k, n));
                for (s, keys) in per_shard.iter_mut().enumerate() {
                    *keys = plan.shard_keys(s).to_vec();
                    out.shard_counts.push(keys.len() as u32);
                }
                out.inverse = plan.inverse;
            }
        }
        Ok(Some((out, per_shard)))
    }
}

/// A batch and its unique keys per shard, not yet queued on the shards.
type PlannedBatch = (WorkerBatch, Vec<Vec<u64>>);

/// One pass as read.
type PlannedPass = Vec<PlannedBatch>;

/// S1.1 (`cluster.mode = "collocated"`): a thread reads the training stream
/// a pass at a time (`cluster.pass_batches` batches, fewer where a node's
/// share of the pass would pass half of `cluster.l2_capacity_rows`), stages
/// it on every node (one ID list per node, or one per batch:
/// `cluster.pass_request`), queues its batches' keys, and hands it over. It
/// stages pass p+1 while pass p trains; a node keeps at most two passes in
/// its second level (its stage waits for the older one's flush).
pub struct PassFeed {
    passes: Receiver<Result<Vec<WorkerBatch>, ClusterError>>,
    ready: std::collections::VecDeque<WorkerBatch>,
    counters: Arc<Mutex<PassCounters>>,
    _thread: JoinHandle<()>,
}

impl PassFeed {
    pub fn spawn(
        mut loader: Loader,
        cluster: &sparrow_core::config::ClusterConfig,
        max_batches: Option<u64>,
    ) -> Result<PassFeed, ClusterError> {
        let (tx, rx) = bounded(0);
        let counters = Arc::new(Mutex::new(PassCounters::default()));
        let (pass_batches, request, half) =
            (cluster.pass_batches.max(1) as usize, cluster.pass_request, cluster.l2_capacity_rows / 2);
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name("sparrow-passes".into())
            .spawn(move || {
                let mut carried = None;
                let mut read = 0u64;
                for pass in 0u64.. {
                    let planned = match read_pass(&mut loader, &mut carried, &mut read, pass_batches, half, max_batches)
                    {
                        Ok(p) if p.is_empty() => return,
                        Ok(p) => p,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let start = std::time::Instant::now();
                    let staged = stage_pass(&loader.shards, pass, &planned, request);
                    {
                        let mut c = thread_counters.lock();
                        c.passes += 1;
                        c.staging_secs += start.elapsed().as_secs_f64();
                    }
                    let out = staged.map(|()| planned.into_iter().map(|(b, _)| b).collect());
                    let failed = out.is_err();
                    if tx.send(out).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| ClusterError::Io { what: "starting the pass thread".into(), source: e })?;
        Ok(PassFeed { passes: rx, ready: Default::default(), counters, _thread: thread })
    }

    /// The next batch of the current pass (the next pass once it is staged).
    pub fn next_batch(&mut self) -> Result<Option<WorkerBatch>, ClusterError> {
        if self.ready.is_empty() {
            let start = std::time::Instant::now();
            match self.passes.recv() {
                Ok(pass) => self.ready = pass?.into(),
                Err(_) => return Ok(None),
            }
            self.counters.lock().exposed_secs += start.elapsed().as_secs_f64();
        }
        let Some(mut batch) = self.ready.pop_front() else { return Ok(None) };
        batch.passes = *self.counters.lock();
        Ok(Some(batch))
    }
}

/// Reads the next pass: up to `pass_batches` batches (and `max_batches` in
/// all), ended early when a shard's unique keys would pass `half` (0: no
/// limit); a batch that ends a pass early starts the next one.
fn read_pass(
    loader: &mut Loader,
    carried: &mut Option<PlannedBatch>,
    read: &mut u64,
    pass_batches: usize,
    half: u64,
    max_batches: Option<u64>,
) -> Result<PlannedPass, ClusterError> {
    let mut pass: PlannedPass = Vec::new();
    let mut unique: Vec<std::collections::HashSet<u64>> = vec![Default::default(); loader.shards.len()];
    while pass.len() < pass_batches && max_batches.is_none_or(|m| *read < m) {
        let next = match carried.take() {
            Some(next) => next,
            None => match loader.next_planned()? {
                Some(next) => next,
                None => break,
            },
        };
        if half > 0 {
            let over = next.1.iter().zip(&unique).find_map(|(keys, seen)| {
                let new = keys.iter().filter(|k| !seen.contains(k)).count() as u64;
                (seen.len() as u64 + new > half).then_some(seen.len() as u64 + new)
            });
            if let Some(rows) = over {
                if pass.is_empty() {
                    return Err(ClusterError::Setup(format!(
                        "one batch puts {rows} rows on a node, over half of cluster.l2_capacity_rows = {} (a pass \
                         is staged beside the one training): lower train.batch_size or raise cluster.l2_capacity_rows",
                        2 * half
                    )));
                }
                *carried = Some(next);
                break;
            }
        }
        for (keys, seen) in next.1.iter().zip(unique.iter_mut()) {
            seen.extend(keys.iter().copied());
        }
        pass.push(next);
        *read += 1;
    }
    Ok(pass)
}

/// S1.1: each node gets its IDs of the pass (one list, or one per batch) and
/// the batches they serve; then the batches' keys are queued as in S0.
fn stage_pass(
    shards: &[Arc<dyn ShardService>],
    pass: u64,
    planned: &PlannedPass,
    request: PassRequest,
) -> Result<(), ClusterError> {
    for (s, shard) in shards.iter().enumerate() {
        let shard = shard
            .pass_staging()
            .ok_or_else(|| ClusterError::Setup(format!("shard {s} has no second level to stage pass {pass} into")))?;
        let mine = || planned.iter().filter(|(_, keys)| !keys[s].is_empty());
        match request {
            PassRequest::Whole => {
                let mut keys: Vec<u64> = mine().flat_map(|(_, keys)| keys[s].iter().copied()).collect();
                keys.sort_unstable();
                keys.dedup();
                let batches: Vec<u64> = mine().map(|(b, _)| b.batch_id).collect();
                if !batches.is_empty() {
                    shard.stage(pass, keys, batches)?;
                }
            }
            PassRequest::PerBatch => {
                for (b, keys) in mine() {
                    shard.stage(pass, keys[s].clone(), vec![b.batch_id])?;
                }
            }
        }
    }
    for (batch, keys) in planned {
        for (shard, keys) in shards.iter().zip(keys) {
            if !keys.is_empty() {
                shard.enqueue(batch.batch_id, keys.clone(), Mode::Train, batch.newest_record_ms())?;
            }
        }
    }
    Ok(())
}

/// The loader role: a thread runs the training stream (then the evaluation
/// stream) through a [`Loader`] into bounded queues the workers take from.
pub struct LoaderServer {
    /// The job's attempt this stream belongs to (its batch ids carry it).
    generation: Generation,
    train: Receiver<WorkerBatch>,
    eval: Receiver<WorkerBatch>,
    /// Set when the reading thread stopped on an error (bad data, a shard
    /// down): every worker that asks then gets it, as itself.
    error: Arc<Mutex<Option<Arc<ClusterError>>>>,
    /// `sync = "round"`: the round queue over the training stream.
    rounds: Option<Rounds>,
    /// `waiting` answers since the last training batch handed out (a quiet
    /// stream: logged, the first at info, so an operator and a test see it).
    waiting_answers: std::sync::atomic::AtomicU64,
    /// The training reader's stop flag: set, the data ends at the next
    /// batch (`end_data`).
    stop_reading: Arc<std::sync::atomic::AtomicBool>,
    /// The training batches ran out at an epoch's end (the stream's end, or
    /// `data.validation`'s one epoch): not at `train.max_steps`, nor on a
    /// stop. Set before the workers hear of the end.
    epoch_end: Arc<std::sync::atomic::AtomicBool>,
    /// [`end_data`](Self::end_data) was called (`stop_reading` is also
    /// set when a stream is dropped: a collocated job's pass thread ends).
    told_to_end: Arc<std::sync::atomic::AtomicBool>,
    _thread: JoinHandle<()>,
}

/// The round queue, and whether a worker is reading the stream ahead for
/// it: one at a time, so items keep the stream's order, and without the
/// lock, which a slow stream would otherwise hold for every worker.
struct Rounds {
    queue: Mutex<(RoundQueue<WorkerBatch>, bool)>,
    /// A read ahead ended (the next reader may go).
    read: parking_lot::Condvar,
}

/// One round's share of the training stream (S2.1–S2.2): `capacity` items,
/// one at a time to whichever worker asks, each worker at least one. The
/// queue reads up to one item per worker ahead of the stream (`ahead`), so
/// that near the data's end it still holds one back for each worker without
/// one: a short last round is shared too.
#[derive(Debug)]
pub struct RoundQueue<T> {
    capacity: u64,
    round: u64,
    /// Items each worker took in `round`.
    taken: Vec<u64>,
    /// Items read from the stream and not taken yet, in its order.
    ahead: std::collections::VecDeque<T>,
    /// The training data ended (after `ahead`).
    ended: bool,
}

impl<T> RoundQueue<T> {
    /// `workers` × 1 batch per worker step × `round_iterations`.
    pub fn new(workers: usize, round_iterations: u64) -> RoundQueue<T> {
        let workers = workers.max(1);
        RoundQueue {
            capacity: workers as u64 * round_iterations.max(1),
            round: 0,
            taken: vec![0; workers],
            ahead: std::collections::VecDeque::new(),
            ended: false,
        }
    }

    /// Whether the queue wants another item of the stream read ahead.
    pub fn wants_more(&self) -> bool {
        !self.ended && self.ahead.len() < self.taken.len()
    }

    /// An item read ahead (`None`: the stream ended).
    pub fn read(&mut self, item: Option<T>) {
        match item {
            Some(item) => self.ahead.push_back(item),
            None => self.ended = true,
        }
    }

    /// `worker`'s next item of `round`, if it may take one (moving the
    /// queue to `round` if it is the next one). An item is held back for
    /// every other worker that has none yet, so each gets at least one
    /// (M ≥ 1) while the round and the data last. Read ahead first
    /// ([`wants_more`](Self::wants_more)).
    pub fn take(&mut self, worker: usize, round: u64) -> Result<Option<T>, ClusterError> {
        if worker >= self.taken.len() {
            return Err(ClusterError::Setup(format!(
                "worker {worker}: the round queue serves {} workers",
                self.taken.len()
            )));
        }
        if round < self.round {
            return Err(ClusterError::Setup(format!(
                "worker {worker} asked for round {round}, the queue is at round {}",
                self.round
            )));
        }
        if round > self.round {
            self.round = round;
            self.taken.iter_mut().for_each(|t| *t = 0);
        }
        let total: u64 = self.taken.iter().sum();
        let waiting = self.taken.iter().enumerate().filter(|&(w, &t)| w != worker && t == 0).count() as u64;
        // What is left of the round: its capacity, and no more than the data holds.
        let mut left = self.capacity.saturating_sub(total);
        if self.ended {
            left = left.min(self.ahead.len() as u64);
        }
        let mine = if self.taken[worker] == 0 { 1 } else { 0 };
        if left == 0 || left + mine <= waiting {
            return Ok(None);
        }
        let item = self.ahead.pop_front();
        if item.is_some() {
            self.taken[worker] += 1;
        }
        Ok(item)
    }
}

impl LoaderServer {
    /// Opens the data files (errors here are the caller's) and starts reading
    /// where `checkpoint.resume_from` continues (or at the start).
    pub fn start(config: &Config, shards: Vec<Arc<dyn ShardService>>) -> Result<LoaderServer, ClusterError> {
        let restore = sparrow_trainer::checkpoint::resume_dir(config)?;
        LoaderServer::start_generation(config, shards, Generation::NONE, restore)
    }

    /// [`start`](Self::start) for one attempt of the job: `generation` goes
    /// into every batch id, and the data continues where the checkpoint
    /// `restore` stopped (the job's start if none).
    pub fn start_generation(
        config: &Config,
        shards: Vec<Arc<dyn ShardService>>,
        generation: Generation,
        restore: Option<PathBuf>,
    ) -> Result<LoaderServer, ClusterError> {
        Self::start_for(config, shards, generation, restore, 1)
    }

    /// [`start_generation`](Self::start_generation) for a job of
    /// `num_workers` workers (the size of a round queue, `sync = "round"`).
    pub fn start_for(
        config: &Config,
        shards: Vec<Arc<dyn ShardService>>,
        generation: Generation,
        restore: Option<PathBuf>,
        num_workers: usize,
    ) -> Result<LoaderServer, ClusterError> {
        let bad = BadRows::from_config(&config.data);
        // Resuming: the data continues where the checkpoint's run stopped.
        // A checkpoint whose epoch's validation said stop trains no more.
        let (start, skip, steps_done, mark, stopped, validated) = match restore {
            Some(dir) => {
                let m = sparrow_trainer::checkpoint::read_manifest(&dir)?;
                let (stopped, validated) = (crate::epochs::stops_at(config, &m), crate::epochs::validated_at(&m));
                (m.position, m.skip.iter().map(|s| s.start).collect::<Vec<_>>(), m.step, m.stream, stopped, validated)
            }
            None => (Default::default(), Vec::new(), 0, None, false, false),
        };
        let train_stream = match &config.data.stream {
            // A topic, from the checkpoint's offsets (its skip ranges are
            // the reader's to drop: batches there are cut anew).
            Some(_) => sparrow_stream::spawn(config, config.train.batch_size, mark.as_ref(), bad.clone())?,
            None => {
                let train_path = config
                    .data
                    .train
                    .as_deref()
                    .map(Path::new)
                    .ok_or(DataError::MissingPath { key: "train", what: "the training data file" })?;
                BatchStream::spawn(
                    train_path,
                    config,
                    config.train.batch_size,
                    start,
                    config.train.epochs,
                    bad.clone(),
                )?
            }
        };
        let stop_reading = train_stream.stop_flag();
        let cluster_mode = config.cluster.mode;
        let first_train_id = first_batch_id(generation, 0);
        let first_eval_id = first_batch_id(generation, FIRST_EVAL_BATCH_ID);
        let train = Loader::new(train_stream, shards.clone(), Mode::Train, cluster_mode, first_train_id, bad.clone())
            .resuming(start, &skip)
            .one_epoch(config.data.validation.as_ref().map(|_| (!validated).then_some(start.epoch)));
        let depth = config.cluster.loader_queue_batches;
        let (train_tx, train_rx) = bounded(depth);
        let (eval_tx, eval_rx) = bounded(depth);
        let error = Arc::new(Mutex::new(None));
        // train.max_steps counts the resumed run's steps too; with
        // train.eval_every_steps the stream also ends at the next
        // validation point (`epochs.rs`).
        let to_validation = crate::epochs::batches_to_validation(config, steps_done, validated, num_workers);
        let max_batches = if stopped {
            Some(0)
        } else {
            match (config.train.max_steps.map(|m| m.saturating_sub(steps_done)), to_validation) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        let mut train = match cluster_mode {
            ClusterMode::Collocated => TrainFeed::Passes(PassFeed::spawn(train, &config.cluster, max_batches)?),
            _ => TrainFeed::Batches(Box::new(train)),
        };
        let test = config.data.test.clone();
        let (job, eval_batch) = (config.clone(), config.train.batch_size.max(1024));
        let (thread_error, thread_bad) = (error.clone(), bad.clone());
        let epoch_end = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let told_to_end = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ended_at_epoch_end, stopped) = (epoch_end.clone(), told_to_end.clone());
        let thread = std::thread::Builder::new()
            .name("sparrow-loader".into())
            .spawn(move || {
                let result = (|| -> Result<(), ClusterError> {
                    let (mut ran_out, mut sent) = (false, 0u64);
                    let mut next = || {
                        let next = train.next_batch();
                        ran_out |= matches!(next, Ok(None));
                        sent += matches!(next, Ok(Some(_))) as u64;
                        next
                    };
                    if !pump(&mut next, &train_tx, max_batches)? {
                        return Ok(());
                    }
                    // An epoch's end, or the next multiple of
                    // train.eval_every_steps (also where train.max_steps cuts
                    // right there: `train` validates at it).
                    let stop = stopped.load(std::sync::atomic::Ordering::Relaxed);
                    let at_point = ran_out || to_validation == Some(sent);
                    ended_at_epoch_end.store(at_point && !stop, std::sync::atomic::Ordering::Relaxed);
                    drop(train_tx);
                    if let Some(test) = test {
                        // Evaluation reads rows as they are: weighting (and
                        // its counters) is training's, even on the same file.
                        let unweighted = sparrow_core::Config { data: job.data.for_scoring(), ..job };
                        let groups = sparrow_trainer::evaluation::group_field(&unweighted);
                        let stream = BatchStream::spawn(
                            Path::new(&test),
                            &unweighted,
                            eval_batch,
                            Default::default(),
                            1,
                            thread_bad.clone(),
                        )?;
                        let mut eval = Loader::new(stream, shards, Mode::Eval, cluster_mode, first_eval_id, thread_bad)
                            .grouping(groups);
                        pump(&mut || eval.next_batch(), &eval_tx, None)?;
                    }
                    Ok(())
                })();
                if let Err(e) = result {
                    tracing::error!("loader: {e}");
                    *thread_error.lock() = Some(Arc::new(e));
                }
            })
            .map_err(|e| ClusterError::Io { what: "starting the loader thread".into(), source: e })?;
        let rounds = (config.cluster.sync == SyncMode::Round).then(|| Rounds {
            queue: Mutex::new((RoundQueue::new(num_workers, config.cluster.round_iterations), false)),
            read: parking_lot::Condvar::new(),
        });
        Ok(LoaderServer {
            generation,
            train: train_rx,
            eval: eval_rx,
            error,
            rounds,
            waiting_answers: Default::default(),
            stop_reading,
            epoch_end,
            told_to_end,
            _thread: thread,
        })
    }

    /// Batches ready in the queues (for the metrics).
    pub fn queued(&self) -> usize {
        self.train.len() + self.eval.len()
    }
}

/// The training batches: one at a time, or pass by pass (collocated mode).
enum TrainFeed {
    Batches(Box<Loader>),
    Passes(PassFeed),
}

impl TrainFeed {
    fn next_batch(&mut self) -> Result<Option<WorkerBatch>, ClusterError> {
        match self {
            TrainFeed::Batches(loader) => loader.next_batch(),
            TrainFeed::Passes(feed) => feed.next_batch(),
        }
    }
}

type NextBatch<'a> = dyn FnMut() -> Result<Option<WorkerBatch>, ClusterError> + 'a;

/// Moves batches into the queue; false if the workers went away.
fn pump(next: &mut NextBatch<'_>, tx: &Sender<WorkerBatch>, max_batches: Option<u64>) -> Result<bool, ClusterError> {
    let mut sent = 0u64;
    while max_batches.is_none_or(|m| sent < m) {
        let Some(batch) = next()? else { break };
        if tx.send(batch).is_err() {
            return Ok(false);
        }
        sent += 1;
    }
    Ok(true)
}

impl LoaderServer {
    fn check_generation(&self, generation: Generation) -> Result<(), ClusterError> {
        if generation != self.generation {
            return Err(ClusterError::StaleGeneration {
                peer: "the loader".into(),
                what: "a batch request".into(),
                found: generation,
                serving: self.generation,
            });
        }
        Ok(())
    }

    fn take(&self, queue: &Receiver<WorkerBatch>) -> Result<Option<WorkerBatch>, ClusterError> {
        match queue.recv() {
            Ok(batch) => Ok(Some(batch)),
            Err(_) => self.ended(),
        }
    }

    /// The queue closed: the reader's error, or the end of the data.
    fn ended<T>(&self) -> Result<Option<T>, ClusterError> {
        match self.error.lock().as_ref() {
            Some(e) => Err(ClusterError::Loader(e.clone())),
            None => Ok(None),
        }
    }

    /// `worker`'s next training batch within `wait` (the remote form of
    /// [`LoaderService::poll_batch`]): [`Polled::Waiting`] if none came and
    /// the data goes on (an idle stream).
    pub fn next_batch_within(
        &self,
        worker: usize,
        generation: Generation,
        wait: std::time::Duration,
    ) -> Result<Polled, ClusterError> {
        if self.rounds.is_some() {
            return self
                .next_batch(worker, Mode::Train, generation)
                .map(|b| b.map_or(Polled::End, |b| Polled::Batch(Box::new(b))));
        }
        faults::point("loader.next_batch");
        self.check_generation(generation)?;
        match self.train.recv_timeout(wait) {
            Ok(batch) => Ok(self.handed_out(batch)),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(self.answered_waiting(worker, wait)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                self.ended::<()>()?;
                Ok(Polled::End)
            }
        }
    }

    /// Ends the training data here, as its end would (a stream's
    /// `stop_when_idle_secs`): the batches read are handed out, then the
    /// workers are told the data ended, and the job checkpoints and ends.
    /// How `sparrow launch` stops a job on its first SIGTERM or Ctrl-C.
    pub fn end_data(&self) {
        self.told_to_end.store(true, std::sync::atomic::Ordering::Relaxed);
        self.stop_reading.store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!("loader: asked to end the training data here: the batches read are trained, then the job ends");
    }

    fn handed_out(&self, batch: WorkerBatch) -> Polled {
        self.waiting_answers.store(0, std::sync::atomic::Ordering::Relaxed);
        Polled::Batch(Box::new(batch))
    }

    /// No batch within `wait` and the data goes on: said in the log (the
    /// first of a quiet stretch at info, each at debug with its count).
    fn answered_waiting(&self, worker: usize, wait: std::time::Duration) -> Polled {
        let n = self.waiting_answers.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n == 1 {
            tracing::info!("the training data is quiet: the workers wait for batches (answered `waiting`)");
        }
        tracing::debug!("worker {worker}: no batch within {wait:?}: answered `waiting` ({n} since the last batch)");
        Polled::Waiting
    }

    /// `worker`'s next item of `round` from the round queue (S2.1), waiting
    /// for the stream up to `wait` (none: as long as it takes); past it,
    /// [`Polled::Waiting`] and the queue as it was. `End`: the round's queue
    /// is empty for this worker, or the data ended.
    fn round_item(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
        wait: Option<std::time::Duration>,
    ) -> Result<Polled, ClusterError> {
        let deadline = wait.map(|w| std::time::Instant::now() + w);
        faults::point("loader.next_batch");
        self.check_generation(generation)?;
        let Some(rounds) = &self.rounds else {
            return Err(ClusterError::Setup(
                "this job's loader serves no round queue (cluster.sync is not \"round\")".into(),
            ));
        };
        let mut state = rounds.queue.lock();
        while state.0.wants_more() {
            if state.1 {
                // Another worker is reading ahead: its item comes first.
                match deadline {
                    Some(at) if rounds.read.wait_until(&mut state, at).timed_out() => {
                        return Ok(self.answered_waiting(worker, wait.unwrap_or_default()));
                    }
                    Some(_) => {}
                    None => rounds.read.wait(&mut state),
                }
                continue;
            }
            state.1 = true;
            drop(state);
            let item = match deadline {
                None => self.train.recv().map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
                Some(at) => self.train.recv_deadline(at),
            };
            state = rounds.queue.lock();
            state.1 = false;
            rounds.read.notify_all();
            match item {
                Ok(batch) => {
                    self.waiting_answers.store(0, std::sync::atomic::Ordering::Relaxed);
                    state.0.read(Some(batch));
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    return Ok(self.answered_waiting(worker, wait.unwrap_or_default()));
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => state.0.read(self.ended()?),
            }
        }
        Ok(state.0.take(worker, round)?.map_or(Polled::End, |b| Polled::Batch(Box::new(b))))
    }

    /// [`Self::round_item`] within `wait`: the remote form, whose call has
    /// a deadline (an idle stream answers `waiting`).
    pub fn next_round_item_within(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
        wait: std::time::Duration,
    ) -> Result<Polled, ClusterError> {
        self.round_item(worker, generation, round, Some(wait))
    }
}

impl LoaderService for LoaderServer {
    fn next_batch(
        &self,
        _worker: usize,
        mode: Mode,
        generation: Generation,
    ) -> Result<Option<WorkerBatch>, ClusterError> {
        faults::point("loader.next_batch");
        self.check_generation(generation)?;
        match mode {
            Mode::Train if self.rounds.is_some() => {
                Err(ClusterError::Setup("cluster.sync = \"round\": training items come from the round queue".into()))
            }
            Mode::Train => self.take(&self.train),
            Mode::Eval => self.take(&self.eval),
        }
    }

    fn training_ended_at_epoch_end(&self, generation: Generation) -> Result<bool, ClusterError> {
        self.check_generation(generation)?;
        Ok(self.epoch_end.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn round_queue(&self) -> Option<&dyn RoundQueueService> {
        self.rounds.as_ref().map(|_| self as &dyn RoundQueueService)
    }
}

impl RoundQueueService for LoaderServer {
    fn next_round_item(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
    ) -> Result<Option<WorkerBatch>, ClusterError> {
        Ok(match self.round_item(worker, generation, round, None)? {
            Polled::Batch(b) => Some(*b),
            Polled::End | Polled::Waiting => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loader(
        data: &sparrow_core::config::DataConfig,
        path: &Path,
        start: sparrow_core::batch::DataPosition,
    ) -> Loader {
        let bad = BadRows::from_config(data);
        let job = sparrow_core::Config { data: data.clone(), ..Default::default() };
        let stream = BatchStream::spawn(path, &job, 100, start, 1, bad.clone()).expect("stream");
        Loader::new(stream, Vec::new(), Mode::Train, ClusterMode::WorkerLookup, 0, bad)
    }

    /// Each batch says where it starts (the previous one's end); a loader
    /// resumed at a checkpoint's position drops the batches its skip list
    /// says were trained already, and reads the others as before.
    #[test]
    fn a_resumed_loader_reads_from_the_position_and_drops_the_batches_trained_ahead() {
        let tmp = tempfile::tempdir().expect("tmp");
        sparrow_data::synth::generate(tmp.path(), 500, 10, 1).expect("data");
        let data = sparrow_core::config::DataConfig::default();
        let path = tmp.path().join("train.tsv");
        let mut whole = loader(&data, &path, Default::default());
        let mut batches = Vec::new();
        while let Some(b) = whole.next_batch().expect("batch") {
            batches.push(b);
        }
        assert_eq!(batches.len(), 5);
        assert!(batches.windows(2).all(|w| w[1].start == w[0].end), "each starts where the last ended");
        // Resumed after batch 1, batch 3 trained ahead: batches 2 and 4 follow.
        let mut resumed = loader(&data, &path, batches[1].end).resuming(batches[1].end, &[batches[3].start]);
        let next: Vec<WorkerBatch> = std::iter::from_fn(|| resumed.next_batch().expect("batch")).collect();
        assert_eq!(next.len(), 2);
        assert_eq!((next[0].start, next[0].labels.clone()), (batches[2].start, batches[2].labels.clone()));
        assert_eq!((next[1].start, next[1].labels.clone()), (batches[4].start, batches[4].labels.clone()));
    }

    /// Reads ahead as the loader does, from `data` items.
    fn take(q: &mut RoundQueue<u32>, data: &mut std::ops::Range<u32>, worker: usize, round: u64) -> Option<u32> {
        while q.wants_more() {
            q.read(data.next());
        }
        q.take(worker, round).expect("round queue")
    }

    #[test]
    fn a_round_holds_workers_times_iterations_items_and_each_worker_gets_one() {
        let mut q = RoundQueue::new(2, 3);
        let mut data = 0..100;
        // Worker 0 is fast: it may take 5 of the 6, the last is worker 1's.
        let fast: Vec<u32> = std::iter::from_fn(|| take(&mut q, &mut data, 0, 0)).collect();
        assert_eq!(fast, [0, 1, 2, 3, 4]);
        assert_eq!(take(&mut q, &mut data, 1, 0), Some(5));
        assert_eq!(take(&mut q, &mut data, 1, 0), None, "the round is over");
        // The next round starts full again.
        assert_eq!(take(&mut q, &mut data, 1, 1), Some(6));
        assert!(q.take(0, 0).is_err(), "round 0 is over");
        assert!(q.take(2, 1).is_err(), "no worker 2");
    }

    /// A last round shorter than the round: the fast worker still leaves
    /// one item for the worker without one (it took all of them before).
    #[test]
    fn a_short_last_round_still_holds_an_item_for_each_worker() {
        let mut q = RoundQueue::new(2, 4);
        let mut data = 0..3;
        let fast: Vec<u32> = std::iter::from_fn(|| take(&mut q, &mut data, 0, 0)).collect();
        assert_eq!(fast, [0, 1]);
        assert_eq!(take(&mut q, &mut data, 1, 0), Some(2));
        assert_eq!(take(&mut q, &mut data, 1, 0), None);
        assert_eq!(take(&mut q, &mut data, 0, 1), None, "the data ended");
    }
}
