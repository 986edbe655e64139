//! The loader (S0.1–S0.3): reads and batches, numbers the batches, sends each
//! shard the unique keys it owns, and queues the rest for the workers, who
//! take batches one at a time at their own pace (S2.2).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, bounded};
use parking_lot::Mutex;
use sparrow_core::Config;
use sparrow_core::config::{ClusterMode, SyncMode};
use sparrow_data::{BadRows, BatchStream, DataError};
use sparrow_embedding::{KeyPlan, owner};

use crate::faults;
use crate::messages::{Mode, WorkerBatch, first_batch_id};
use crate::transport::{ClusterError, LoaderService, ShardService};

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
        Loader { stream, shards, mode, cluster_mode, next_id: first_id, bad_rows }
    }

    /// The next batch: in S0 mode its keys go to their shards and the worker
    /// gets only their positions; in worker_lookup mode the worker gets the keys.
    pub fn next_batch(&mut self) -> Result<Option<WorkerBatch>, ClusterError> {
        let Some(batch) = self.stream.next().transpose()? else { return Ok(None) };
        let batch_id = self.next_id;
        self.next_id += 1;
        let mut out = WorkerBatch {
            batch_id,
            rows: batch.rows(),
            num_fields: batch.num_fields,
            num_dense: batch.num_dense,
            labels: batch.labels,
            dense: batch.dense,
            bag_offsets: batch.bag_offsets,
            key_weights: batch.key_weights,
            inverse: Vec::new(),
            shard_counts: Vec::new(),
            keys: Vec::new(),
            end: batch.end,
            bad_rows: self.bad_rows.total(),
            sample_weights: batch.sample_weights,
            merged_samples: self.bad_rows.weighting.merged.load(std::sync::atomic::Ordering::Relaxed),
            dropped_samples: self.bad_rows.weighting.dropped.load(std::sync::atomic::Ordering::Relaxed),
        };
        match self.cluster_mode {
            ClusterMode::WorkerLookup => out.keys = batch.keys,
            ClusterMode::S0 => {
                let n = self.shards.len();
                // First dedup (S3.2) and partition by owner, counts first (S3.3).
                let plan = KeyPlan::new(&batch.keys, n, |k| owner(k, n));
                for (s, shard) in self.shards.iter().enumerate() {
                    let keys = plan.shard_keys(s);
                    out.shard_counts.push(keys.len() as u32);
                    if !keys.is_empty() {
                        shard.enqueue(batch_id, keys.to_vec(), self.mode)?;
                    }
                }
                out.inverse = plan.inverse;
            }
        }
        Ok(Some(out))
    }
}

/// The loader role: a thread runs the training stream (then the evaluation
/// stream) through a [`Loader`] into bounded queues the workers take from.
pub struct LoaderServer {
    /// The job's attempt this stream belongs to (its batch ids carry it).
    generation: u64,
    train: Receiver<WorkerBatch>,
    eval: Receiver<WorkerBatch>,
    /// Set when the reading thread stopped on an error (bad data, a shard
    /// down): every worker that asks then gets it, as itself.
    error: Arc<Mutex<Option<Arc<ClusterError>>>>,
    /// `sync = "round"`: the round queue over the training stream.
    rounds: Option<Mutex<RoundQueue>>,
    _thread: JoinHandle<()>,
}

/// One round's share of the training stream (S2.1–S2.2): `capacity` items,
/// one at a time to whichever worker asks, each worker at least one.
#[derive(Debug)]
pub struct RoundQueue {
    capacity: u64,
    round: u64,
    /// Items each worker took in `round`.
    taken: Vec<u64>,
    /// The training data ended.
    ended: bool,
}

impl RoundQueue {
    /// `workers` × 1 batch per worker step × `round_iterations`.
    pub fn new(workers: usize, round_iterations: u64) -> RoundQueue {
        let workers = workers.max(1);
        RoundQueue {
            capacity: workers as u64 * round_iterations.max(1),
            round: 0,
            taken: vec![0; workers],
            ended: false,
        }
    }

    /// Whether `worker` may take another item of `round` (moving the queue
    /// to `round` if it is the next one). An item is held back for every
    /// other worker that has none yet, so each gets at least one (M ≥ 1).
    pub fn may_take(&mut self, worker: usize, round: u64) -> Result<bool, ClusterError> {
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
        let left = self.capacity.saturating_sub(total);
        let mine = if self.taken[worker] == 0 { 1 } else { 0 };
        Ok(!self.ended && left > 0 && left + mine > waiting)
    }

    pub fn took(&mut self, worker: usize) {
        self.taken[worker] += 1;
    }
}

impl LoaderServer {
    /// Opens the data files (errors here are the caller's) and starts reading
    /// where `checkpoint.resume_from` continues (or at the start).
    pub fn start(config: &Config, shards: Vec<Arc<dyn ShardService>>) -> Result<LoaderServer, ClusterError> {
        let restore = sparrow_trainer::checkpoint::resume_dir(config)?;
        LoaderServer::start_generation(config, shards, 0, restore)
    }

    /// [`start`](Self::start) for one attempt of the job: `generation` goes
    /// into every batch id, and the data continues where the checkpoint
    /// `restore` stopped (the job's start if none).
    pub fn start_generation(
        config: &Config,
        shards: Vec<Arc<dyn ShardService>>,
        generation: u64,
        restore: Option<PathBuf>,
    ) -> Result<LoaderServer, ClusterError> {
        Self::start_for(config, shards, generation, restore, 1)
    }

    /// [`start_generation`](Self::start_generation) for a job of
    /// `num_workers` workers (the size of a round queue, `sync = "round"`).
    pub fn start_for(
        config: &Config,
        shards: Vec<Arc<dyn ShardService>>,
        generation: u64,
        restore: Option<PathBuf>,
        num_workers: usize,
    ) -> Result<LoaderServer, ClusterError> {
        let train_path = config
            .data
            .train
            .as_deref()
            .map(Path::new)
            .ok_or(DataError::MissingPath { key: "train", what: "the training data file" })?;
        let bad = BadRows::from_config(&config.data);
        // Resuming: the data continues where the checkpoint's run stopped.
        let (start, steps_done) = match restore {
            Some(dir) => {
                let m = sparrow_trainer::checkpoint::read_manifest(&dir)?;
                (m.position, m.step)
            }
            None => (Default::default(), 0),
        };
        let train_stream = BatchStream::spawn(
            train_path,
            &config.data,
            config.train.batch_size,
            start,
            config.train.epochs,
            bad.clone(),
        )?;
        let cluster_mode = config.cluster.mode;
        let first_train_id = first_batch_id(generation, 0);
        let first_eval_id = first_batch_id(generation, FIRST_EVAL_BATCH_ID);
        let mut train =
            Loader::new(train_stream, shards.clone(), Mode::Train, cluster_mode, first_train_id, bad.clone());
        let depth = config.cluster.loader_queue_batches;
        let (train_tx, train_rx) = bounded(depth);
        let (eval_tx, eval_rx) = bounded(depth);
        let error = Arc::new(Mutex::new(None));
        // train.max_steps counts the resumed run's steps too.
        let max_batches = config.train.max_steps.map(|m| m.saturating_sub(steps_done));
        let test = config.data.test.clone();
        let (data, eval_batch) = (config.data.clone(), config.train.batch_size.max(1024));
        let (thread_error, thread_bad) = (error.clone(), bad.clone());
        let thread = std::thread::Builder::new()
            .name("sparrow-loader".into())
            .spawn(move || {
                let result = (|| -> Result<(), ClusterError> {
                    if !pump(&mut train, &train_tx, max_batches)? {
                        return Ok(());
                    }
                    drop(train_tx);
                    if let Some(test) = test {
                        let stream = BatchStream::spawn(
                            Path::new(&test),
                            &data,
                            eval_batch,
                            Default::default(),
                            1,
                            thread_bad.clone(),
                        )?;
                        let mut eval = Loader::new(stream, shards, Mode::Eval, cluster_mode, first_eval_id, thread_bad);
                        pump(&mut eval, &eval_tx, None)?;
                    }
                    Ok(())
                })();
                if let Err(e) = result {
                    tracing::error!("loader: {e}");
                    *thread_error.lock() = Some(Arc::new(e));
                }
            })
            .map_err(|e| ClusterError::Io { what: "starting the loader thread".into(), source: e })?;
        let rounds = (config.cluster.sync == SyncMode::Round)
            .then(|| Mutex::new(RoundQueue::new(num_workers, config.cluster.round_iterations)));
        Ok(LoaderServer { generation, train: train_rx, eval: eval_rx, error, rounds, _thread: thread })
    }

    /// Batches ready in the queues (for the metrics).
    pub fn queued(&self) -> usize {
        self.train.len() + self.eval.len()
    }
}

/// Moves batches into the queue; false if the workers went away.
fn pump(loader: &mut Loader, tx: &Sender<WorkerBatch>, max_batches: Option<u64>) -> Result<bool, ClusterError> {
    let mut sent = 0u64;
    while max_batches.is_none_or(|m| sent < m) {
        let Some(batch) = loader.next_batch()? else { break };
        if tx.send(batch).is_err() {
            return Ok(false);
        }
        sent += 1;
    }
    Ok(true)
}

impl LoaderServer {
    fn check_generation(&self, generation: u64) -> Result<(), ClusterError> {
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
            Err(_) => match self.error.lock().as_ref() {
                Some(e) => Err(ClusterError::Loader(e.clone())),
                None => Ok(None),
            },
        }
    }
}

impl LoaderService for LoaderServer {
    fn next_batch(&self, _worker: usize, mode: Mode, generation: u64) -> Result<Option<WorkerBatch>, ClusterError> {
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

    fn next_round_item(&self, worker: usize, generation: u64, round: u64) -> Result<Option<WorkerBatch>, ClusterError> {
        faults::point("loader.next_batch");
        self.check_generation(generation)?;
        let Some(rounds) = &self.rounds else {
            return Err(ClusterError::Setup(
                "this job's loader serves no round queue (cluster.sync is not \"round\")".into(),
            ));
        };
        // Held while the item is taken: the count and the item move together.
        let mut queue = rounds.lock();
        if !queue.may_take(worker, round)? {
            return Ok(None);
        }
        match self.take(&self.train)? {
            Some(batch) => {
                queue.took(worker);
                Ok(Some(batch))
            }
            None => {
                queue.ended = true;
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RoundQueue;

    #[test]
    fn a_round_holds_workers_times_iterations_items_and_each_worker_gets_one() {
        let mut q = RoundQueue::new(2, 3);
        // Worker 0 is fast: it may take 5 of the 6, the last is worker 1's.
        let mut fast = 0;
        while q.may_take(0, 0).expect("round queue") {
            q.took(0);
            fast += 1;
        }
        assert_eq!(fast, 5);
        assert!(q.may_take(1, 0).expect("round queue"));
        q.took(1);
        assert!(!q.may_take(1, 0).expect("round queue"), "the queue is empty");
        // The next round starts full again.
        assert!(q.may_take(1, 1).expect("round queue"));
        assert!(q.may_take(0, 0).is_err(), "round 0 is over");
        assert!(q.may_take(2, 1).is_err(), "no worker 2");
    }
}
