//! A worker (S0.4): takes a batch from the loader, pulls its rows from the
//! shards by batch id, trains the dense model, pushes the embedding gradients.
//! The steps run through the same step engine as `sparrow train`
//! (`sparrow_trainer::engine`), with the shards as its row source; with
//! several workers its dense sync policy sums gradients across them every
//! step (S0.6, [`crate::sync::RoundSync`]).

mod drive;
mod evaluate;
mod feed;
mod lazy;
mod non_finite;
mod policy;
mod remote;
mod round;
mod step;
mod validation;

pub use self::lazy::LazyPolicy;
pub use self::policy::{SyncLinks, SyncPolicy, sync_policy};
pub use self::remote::RemoteRows;
use self::remote::{look_up_keys, pull_rows};
pub use self::round::RoundPolicy;
pub use self::step::StepPolicy;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use sparrow_core::Config;
use sparrow_core::config::Pooling;
use sparrow_core::metrics::online::ProgressiveEval;
use sparrow_core::simd::Simd;
use sparrow_data::DataLayout;
use sparrow_model::{DenseModel, DenseOptimizer};
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};
use sparrow_trainer::driver::{Observers, RunLog};
use sparrow_trainer::engine::{DenseInputs, Looked, RowGrads, Stepped, dense_apply, dense_grads, row_lr_scale};
use sparrow_trainer::evaluation::Scores;
use sparrow_trainer::pooling::{Bags, gather_sequences, pool};

use crate::checkpoint::{CheckpointSink, DenseState, WorkerCut};
use crate::faults;
use crate::generation::Generation;
use crate::lazy::LazyReport;
use crate::messages::{Mode, WorkerBatch};
use crate::transport::{ClusterError, LoaderService, ShardService};

/// What a worker counted while training.
#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    /// Batches this worker trained and their samples.
    pub batches: u64,
    pub rows: u64,
    /// Their behaviour sequences cut to `max_len`.
    pub truncated_sequences: u64,
    /// Of those batches, the ones skipped for a non-finite loss or gradient
    /// (`train.on_non_finite = "skip_batch"`): counted in `batches`, not in `rows`.
    pub skipped_batches: u64,
    /// Dense optimizer steps: with several workers, the rounds (a round may
    /// hold several of a worker's batches, or none).
    pub steps: u64,
    /// Payload bytes received while training, by source.
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
    /// Keys per batch position and unique keys (after the first dedup).
    pub keys: u64,
    pub unique_keys: u64,
    /// Seconds of each pull / push call to a shard.
    pub pull_secs: Vec<f32>,
    pub push_secs: Vec<f32>,
    pub train_secs: f64,
    /// The loader's count of malformed rows, as of the latest batch seen.
    pub bad_rows: u64,
    /// The furthest data position among the batches this worker trained.
    pub last_end: sparrow_core::batch::DataPosition,
    /// `[data.stream]`: the mark after the batch that ends at `last_end`.
    pub last_stream: Option<sparrow_core::batch::StreamMark>,
    /// Where the training time went (seconds), summed over steps.
    pub phase_secs: WorkerPhaseSecs,
    /// Bytes this worker sent and received to agree on the dense weights
    /// (gradients summed every step, round updates, lazy aggregations).
    pub dense_sync_bytes: u64,
    /// `sync = "round"`: rounds merged, and each worker's items over them
    /// (from the merges, so every worker holds the job's counts).
    pub rounds: u64,
    pub round_items: Vec<u64>,
    /// `sync = "lazy"`: aggregations this worker took part in, and seconds
    /// it spent asking for and waiting on instructions.
    pub aggregations: u64,
    pub lazy_wait_secs: f64,
    /// `[data.weighting]`: samples merged and dropped so far (the loader's
    /// counts as of the latest batch), and the weights this worker trained on.
    pub merged_samples: u64,
    pub dropped_samples: u64,
    pub sample_weight_sum: f64,
    /// Row bytes pulled from shards in other processes (collocated mode:
    /// rows fetched from other nodes' second level).
    pub bytes_from_remote_shards: u64,
    /// `cluster.mode = "collocated"`: the loader's pass counters, as of the latest batch.
    pub passes: crate::messages::PassCounters,
}

/// Seconds of a worker's training time by phase.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct WorkerPhaseSecs {
    /// Waiting for the loader's next batch.
    pub next_batch: f64,
    /// Pulling rows (plus, in worker_lookup mode, dedup and sending keys).
    /// At `pipeline_depth ≥ 1`: the wait for the push-then-pull branch after
    /// the dense step (the part the overlap did not hide).
    pub pull: f64,
    /// Pool, dense forward/backward, gradient sum across workers, optimizer, unpool.
    pub dense: f64,
    /// Pushing gradients (beside the dense step at `pipeline_depth ≥ 1`).
    pub push: f64,
}

pub struct Worker {
    pub index: usize,
    pub model: DenseModel,
    pub optimizer: DenseOptimizer,
    /// How this worker agrees with the others on each dense step.
    sync: Box<dyn DenseSync>,
    pooling: Pooling,
    /// `train.pipeline_depth`.
    pipeline_depth: usize,
    packed_input: Vec<f32>,
    /// `embedding.dtype`: how the shards send vectors (traffic counts it).
    row_dtype: sparrow_embedding::EmbeddingDtype,
    /// `embedding.l2`, added to the gradients it pushes.
    row_l2: f32,
    /// `model.dropout`'s job-wide draw (`None`: off).
    dropout_base: Option<u64>,
    pub stats: WorkerStats,
    /// Moves with every batch trained or evaluated and every idle round: the
    /// heartbeat carries it, so a worker stuck in a loop is seen as stuck.
    pub progress: Arc<AtomicU64>,
    /// The job's attempt this worker trains in, and the newest generation
    /// its heartbeats heard of: when they differ the attempt was given up.
    generation: Generation,
    heard_generation: Option<Arc<AtomicU64>>,
    /// This worker's dense step, for its heartbeats.
    pub reported_step: Arc<AtomicU64>,
    checkpoints: Option<Checkpoints>,
    /// How this worker agrees with the others (`cluster.sync`): it set `sync`.
    policy: Box<dyn SyncPolicy>,
    pub lazy_report: Option<LazyReport>,
    /// With checkpoints: the batches trained since the last one (each
    /// checkpoint reports them, see `checkpoint::DataProgress`).
    trained_since_cut: Vec<sparrow_trainer::checkpoint::TrainedBatch>,
    job: Option<JobCount>,
    /// Progressive validation (`train.online_window_samples`): this
    /// worker's batches, scored before their update (a batch replayed after
    /// a recovery is scored again).
    pub online: Option<ProgressiveEval>,
    /// Where the online figures and the stream's lag are shown (the worker
    /// role's metrics endpoint), and every how many batches the figures are.
    pub gauges: Option<(crate::stream_gauges::OnlineGauges, u64)>,
    /// The log interval and its weight check, `train.metrics_path` and
    /// `train.tensorboard_dir`, periodic evaluation's cadence (`driver.rs`).
    observers: Observers,
    /// `train.eval_every_steps` (worker 0 of a job with `data.test`).
    periodic_eval: Option<evaluate::PeriodicEval>,
    /// `train.on_non_finite = "skip_batch"` (`worker/non_finite.rs`).
    skip_non_finite: bool,
    /// `data.validation`: the epochs' judgement (`worker/validation.rs`).
    epochs: Option<validation::EpochValidation>,
}

pub use sparrow_trainer::driver::start_metrics_file;

/// Batches and samples the job trained (all workers, the restored
/// checkpoint's included): the step of its checkpoints when workers step
/// their own replicas (rounds, lazy aggregation).
#[derive(Clone, Copy, Debug, Default)]
struct JobCount {
    batches: u64,
    samples: u64,
}

/// `checkpoint.every_steps` and the job's end, as a worker takes part in them.
struct Checkpoints {
    sink: Arc<dyn CheckpointSink>,
    root: PathBuf,
    every: Option<u64>,
    /// Timed checkpoints: the step of the next (each commit names it).
    next: Option<u64>,
    /// The step of the last meeting this worker took part in (or restored).
    last_step: u64,
    /// That meeting wrote a serving export alone: the end still checkpoints.
    export_only: bool,
    /// The last version committed.
    last: Option<PathBuf>,
}

fn bags(batch: &WorkerBatch) -> Bags<'_> {
    Bags {
        rows: batch.rows,
        num_fields: batch.num_fields,
        bag_offsets: &batch.bag_offsets,
        key_weights: batch.key_weights.as_deref(),
        inverse: &batch.inverse,
        num_unique: batch.num_unique(),
    }
}

/// A worker role alone (`sync = "step"` without peers; see
/// [`Worker::with_policy`]), built from the config: every worker starts from
/// the same dense weights.
pub fn new_worker(config: &Config, layout: &DataLayout, index: usize) -> Result<Worker, ClusterError> {
    new_worker_in(config, layout, index, Generation::NONE)
}

/// [`new_worker`] for generation `generation` of the job.
pub fn new_worker_in(
    config: &Config,
    layout: &DataLayout,
    index: usize,
    generation: Generation,
) -> Result<Worker, ClusterError> {
    let model = sparrow_trainer::initial_model(config, layout)?;
    let optimizer = DenseOptimizer::new(config.dense_optimizer.clone(), config.train.simd)
        .with_schedule(config.train.schedule.clone());
    let mut worker =
        Worker::new(index, model, optimizer, config.model.pooling).with_pipeline_depth(config.train.pipeline_depth);
    worker.generation = generation;
    worker.row_dtype = config.embedding.dtype;
    worker.row_l2 = config.embedding.l2;
    worker.dropout_base = sparrow_trainer::engine::dropout_base(config);
    worker.online = config.online_window().map(ProgressiveEval::new);
    worker.periodic_eval = evaluate::PeriodicEval::new(config, index);
    worker.epochs = validation::EpochValidation::new(config, index);
    let log = RunLog::open(config, Some(index), worker.at())?;
    worker.observers = Observers::new(config, worker.at(), worker.periodic_eval.is_some(), log);
    worker.skip_non_finite = config.train.on_non_finite == sparrow_core::config::OnNonFinite::SkipBatch;
    Ok(worker)
}

impl Worker {
    /// A worker alone (its own dense steps); see [`with_policy`](Self::with_policy).
    pub fn new(index: usize, model: DenseModel, optimizer: DenseOptimizer, pooling: Pooling) -> Self {
        Worker {
            index,
            model,
            optimizer,
            sync: Box::new(LocalSync),
            pooling,
            pipeline_depth: 0,
            packed_input: Vec::new(),
            row_dtype: Default::default(),
            row_l2: 0.0,
            dropout_base: None,
            stats: WorkerStats::default(),
            progress: Arc::default(),
            generation: Generation::NONE,
            heard_generation: None,
            reported_step: Arc::default(),
            checkpoints: None,
            policy: Box::new(StepPolicy::alone(index, Generation::NONE)),
            lazy_report: None,
            trained_since_cut: Vec::new(),
            job: None,
            online: None,
            gauges: None,
            observers: Observers::default(),
            periodic_eval: None,
            skip_non_finite: false,
            epochs: None,
        }
    }

    /// Trains under `policy` (see [`sync_policy`]): it gives the step
    /// engine's dense sync and says how the job's step is counted. Set
    /// `progress` first: a sync that waits on the others moves it.
    pub fn with_policy(mut self, mut policy: Box<dyn SyncPolicy>) -> Self {
        self.sync = policy.dense_sync(&self.progress);
        self.job = policy.counts_job_batches().then(JobCount::default);
        self.policy = policy;
        self
    }

    /// The training loss of the last log interval (of the batches since,
    /// if any), as `sparrow train` reports it.
    pub fn train_logloss(&self) -> Option<f64> {
        self.observers.last_loss()
    }

    /// The job's evaluation, in the metrics file and on TensorBoard.
    pub fn log_evaluation(&mut self, figures: &sparrow_trainer::evaluation::Figures) -> Result<(), ClusterError> {
        let at = self.at();
        Ok(self.observers.log_eval(at, Some(figures))?)
    }

    /// The job's step as its checkpoints count it: dense steps, or (each
    /// worker stepping its own replica) the batches every worker trained.
    fn job_step(&self) -> u64 {
        self.job.map_or(self.optimizer.step, |j| j.batches)
    }

    fn job_samples(&self) -> u64 {
        self.job.map_or(self.optimizer.samples_stepped, |j| j.samples)
    }

    /// Takes a checkpoint's dense state (a resumed job, or a generation
    /// restarted from it).
    /// Early stopping's state as the checkpoint `dir` left it (`data.validation`).
    pub fn restore_validation(&mut self, dir: &Path) -> Result<(), ClusterError> {
        self.epochs.as_mut().map_or(Ok(()), |v| v.restore(dir))
    }

    pub fn resume(&mut self, dense: DenseState) {
        self.model = dense.model;
        self.optimizer.take_state_from(dense.optimizer);
        self.stats.last_end = dense.position;
        self.stats.last_stream = dense.stream;
        if let Some(j) = &mut self.job {
            (j.batches, j.samples) = (dense.step, self.optimizer.samples_stepped);
        }
        let step = self.job_step();
        if let Some(c) = &mut self.checkpoints {
            c.last_step = step;
        }
        self.reported_step.store(step, Ordering::Relaxed);
    }

    /// Counts `rows` samples in `batches` batches as trained by this job
    /// before its current generation (worker 0 after a recovery: the job's
    /// totals stay those of an uninterrupted run).
    pub fn count_trained_before(&mut self, rows: u64, batches: u64) {
        self.stats.rows += rows;
        self.stats.batches += batches;
    }

    /// Gives up training when `heard` (the newest generation the heartbeats
    /// heard of) leaves this worker's generation.
    pub fn watch_generation(&mut self, heard: Arc<AtomicU64>) {
        self.heard_generation = Some(heard);
    }

    /// Takes part in the job's checkpoints under `root`: every `every`
    /// steps, at the steps each commit names when `timed` (the first right
    /// after the start), and at the end of training.
    pub fn with_checkpoints(&mut self, sink: Arc<dyn CheckpointSink>, root: PathBuf, every: Option<u64>, timed: bool) {
        let last_step = self.job_step();
        let next = timed.then_some(last_step + 1);
        self.checkpoints = Some(Checkpoints { sink, root, every, next, last_step, export_only: false, last: None });
    }

    /// The last checkpoint this worker took part in.
    pub fn last_checkpoint(&self) -> Option<&PathBuf> {
        self.checkpoints.as_ref().and_then(|c| c.last.as_ref())
    }

    fn check_generation(&self) -> Result<(), ClusterError> {
        match &self.heard_generation {
            Some(heard) if Generation(heard.load(Ordering::Relaxed)) != self.generation => {
                Err(ClusterError::GenerationChanged { generation: Generation(heard.load(Ordering::Relaxed)) })
            }
            _ => Ok(()),
        }
    }

    /// Whether the step just made reached a multiple of `every_steps` (a
    /// round may pass one: its end is the checkpoint).
    fn checkpoint_due(&self) -> bool {
        let step = self.job_step();
        self.checkpoints.as_ref().is_some_and(|c| {
            c.every.is_some_and(|every| every > 0 && step / every > c.last_step / every)
                || c.next.is_some_and(|next| step >= next && step > c.last_step)
        })
    }

    /// Takes part in a checkpoint at the current step (every update pushed;
    /// `last`: training ended).
    fn checkpoint_now(&mut self, last: bool) -> Result<(), ClusterError> {
        faults::point("worker.checkpoint");
        let Some(c) = &self.checkpoints else { return Ok(()) };
        let step = self.job_step();
        let wrote_dense = self.index == 0;
        if wrote_dense {
            crate::checkpoint::write_dense(&c.root, step, self.generation, &self.model, &self.optimizer)?;
        }
        let cut = WorkerCut {
            worker: self.index,
            generation: self.generation,
            step,
            samples_trained: self.job_samples(),
            dense_optimizer_step: self.optimizer.step,
            position: self.stats.last_end,
            wrote_dense,
            trained: std::mem::take(&mut self.trained_since_cut),
            stream: self.stats.last_stream.clone(),
            last,
            early_stopping: self.epochs.as_ref().map(|v| v.state.clone()),
        };
        let committed = c.sink.checkpoint(cut)?;
        if let Some(c) = &mut self.checkpoints {
            c.last_step = step;
            c.export_only = !committed.checkpoint;
            c.last = Some(committed.dir);
            c.next = c.next.and(committed.next_step);
        }
        self.progress.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Adds a step's phase times to the stats; the error the step deferred (a failed push), if any.
    fn record_phases<R>(&mut self, stepped: Stepped<R, ClusterError>) -> Result<(), ClusterError> {
        let phases = &mut self.stats.phase_secs;
        phases.next_batch += stepped.next_batch_secs;
        phases.pull += stepped.lookup_secs;
        phases.dense += stepped.dense_secs;
        phases.push += stepped.update_secs;
        stepped.deferred.map_or(Ok(()), Err)
    }

    /// `train.pipeline_depth`: how many batches ahead of its dense step a
    /// batch's rows are pulled (see [`run_training`](Self::run_training)).
    pub fn with_pipeline_depth(mut self, depth: usize) -> Self {
        self.pipeline_depth = depth;
        self
    }

    /// The dense half of a pulled batch (the step engine's `dense`): its
    /// loss, and the gradients to push (`None`: skipped, see `non_finite.rs`).
    fn dense(&mut self, looked: &Looked<WorkerBatch, ()>) -> Result<(f64, Option<RowGrads>), ClusterError> {
        let batch = &looked.batch;
        let inputs = DenseInputs {
            bags: bags(batch),
            unique_rows: &looked.unique_rows,
            dense: &batch.dense,
            labels: &batch.labels,
            weights: batch.sample_weights.as_deref(),
            row_l2: self.row_l2,
            dropout: sparrow_trainer::engine::dropout_draw(self.dropout_base, self.optimizer.step, self.index),
        };
        let step = self.stats.batches + 1;
        // Named with the step, as `sparrow train` does; the model was not updated.
        let named = |e: sparrow_trainer::TrainError| match e {
            sparrow_trainer::TrainError::Model(sparrow_model::ModelError::NonFinite { what }) => {
                sparrow_trainer::TrainError::NonFinite { step, what }
            }
            other => other,
        };
        let half = match dense_grads(&self.model, &mut self.packed_input, inputs, self.pooling) {
            Ok(half) => half,
            Err(e) => return self.skip_or_fail(batch, named(e)).map(|()| (0.0, None)),
        };
        // Skipped only before the sync: the others are not met twice.
        if let Some(e) = self.non_finite_dense_grads(&half.dense_grads, step) {
            return self.skip_or_fail(batch, e).map(|()| (0.0, None));
        }
        // The step's rate factor, before the step counts itself.
        let lr_scale = row_lr_scale(self.optimizer.schedule(), self.optimizer.lr_factor());
        let out = dense_apply(&self.model, &mut self.optimizer, self.sync.as_mut(), half).map_err(named)?;
        self.consumed(batch);
        let stats = &mut self.stats;
        stats.sample_weight_sum += batch.weight_sum();
        stats.rows += batch.rows as u64;
        stats.truncated_sequences += batch.truncated_sequences;
        if let Some(online) = self.online.as_mut() {
            self.model.heads().with_first_binary(&out.logits, &batch.labels, |x, y| online.add(x, y));
        }
        if let Some((gauges, every)) = &self.gauges {
            if let Some(mark) = &batch.stream {
                gauges.set_lag_of(mark);
            }
            // The window's AUC sorts its samples: at the logging interval only.
            if let Some(online) = &self.online
                && self.stats.batches.is_multiple_of((*every).max(1))
            {
                gauges.set_online(&sparrow_trainer::online::OnlineFigures::of(online));
            }
        }
        Ok((out.loss, Some(RowGrads { values: out.grads, lr_scale })))
    }

    /// A batch this worker is done with, trained or skipped: the loader's
    /// counters as of it, its keys, and how far the data is consumed (its
    /// checkpoint position).
    fn consumed(&mut self, batch: &WorkerBatch) {
        self.progress.fetch_add(1, Ordering::Relaxed);
        let stats = &mut self.stats;
        stats.bad_rows = stats.bad_rows.max(batch.bad_rows);
        stats.merged_samples = stats.merged_samples.max(batch.merged_samples);
        if batch.passes.passes >= stats.passes.passes {
            stats.passes = batch.passes;
        }
        stats.dropped_samples = stats.dropped_samples.max(batch.dropped_samples);
        stats.keys += batch.bag_offsets.last().copied().unwrap_or(0) as u64;
        stats.unique_keys += batch.num_unique() as u64;
        stats.batches += 1;
        if stats.last_end.later(batch.end) == batch.end {
            (stats.last_end, stats.last_stream) = (batch.end, batch.stream.clone());
        }
        if self.checkpoints.is_some() {
            self.trained_since_cut.push(sparrow_trainer::checkpoint::TrainedBatch {
                start: batch.start,
                end: batch.end,
                stream: batch.stream.clone(),
            });
        }
    }

    /// Trains under this worker's sync policy until the job's training is
    /// done (`drive.rs`), through the step engine at `train.pipeline_depth`
    /// (at d ≥ 1 a batch's rows are pulled d batches ahead, the staleness
    /// of `sparrow train` at the same depth). The shards hold every update
    /// when it returns.
    pub fn run_training(
        &mut self,
        loader: &dyn LoaderService,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<(), ClusterError> {
        let start = Instant::now();
        let index = self.index;
        let width = self.model.width();
        let vector_bytes =
            sparrow_embedding::RowFormat { dtype: self.row_dtype, dim: width, state_len: 0, simd: Simd::Auto }
                .stored_bytes();
        let rows = RemoteRows { shards, width, vector_bytes, traffic: Mutex::default() };
        let mut policy = std::mem::replace(&mut self.policy, Box::new(StepPolicy::alone(index, self.generation)));
        let trained = self.train_under(policy.as_mut(), loader, &rows);
        self.policy = policy;
        trained?;
        std::mem::take(&mut *rows.traffic.lock()).add_to(&mut self.stats);
        self.stats.train_secs = start.elapsed().as_secs_f64();
        self.stats.steps = self.optimizer.step;
        Ok(())
    }

    /// Logits of an evaluation batch.
    pub fn predict(
        &mut self,
        mut batch: WorkerBatch,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<Vec<f32>, ClusterError> {
        look_up_keys(&mut batch, shards, Mode::Eval)?;
        let unique_rows = pull_rows(&batch, self.model.width(), shards, None)?;
        let (bags, width) = (bags(&batch), self.model.width());
        let pooled = pool(&bags, &unique_rows, width, self.pooling);
        let pairs = self.model.attention();
        let sequences = (!pairs.is_empty()).then(|| gather_sequences(&bags, &unique_rows, width, pairs));
        let logits = self.model.predict_with(pooled, batch.dense, batch.rows, sequences.as_ref());
        Ok(logits.map_err(sparrow_trainer::TrainError::from)?)
    }

    /// Logits and labels of the loader's evaluation data, and under
    /// `eval.group_by` each row's group number (the loader's: a worker sees
    /// no IDs).
    pub fn run_eval(
        &mut self,
        loader: &dyn LoaderService,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<Scores, ClusterError> {
        let mut s = Scores::default();
        // Group numbers come with every batch under `eval.group_by`, with none otherwise.
        let (mut groups, mut grouped) = (Vec::new(), true);
        while let Some(mut batch) = loader.next_batch(self.index, Mode::Eval, self.generation)? {
            self.stats.bad_rows = self.stats.bad_rows.max(batch.bad_rows);
            grouped &= batch.groups.len() == batch.rows && (batch.rows == 0 || !batch.groups.is_empty());
            groups.append(&mut batch.groups);
            s.labels.extend_from_slice(&batch.labels);
            s.logits.extend(self.predict(batch, shards)?);
            self.progress.fetch_add(1, Ordering::Relaxed);
        }
        s.groups = (grouped && !groups.is_empty()).then_some(groups);
        Ok(s)
    }

    /// A fingerprint of the dense weights (replicas must agree bit for bit).
    pub fn dense_checksum(&self) -> Result<u64, ClusterError> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for (name, var) in self.model.params.vars() {
            hasher.update(name.as_bytes());
            let values = var
                .as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(sparrow_model::ModelError::from)?;
            for v in values {
                hasher.update(&v.to_bits().to_le_bytes());
            }
        }
        Ok(hasher.digest())
    }
}
