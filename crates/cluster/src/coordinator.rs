//! The coordinator role (S0.5): membership, the shard map, heartbeats and
//! liveness, the job's state, the workers' gradient rounds (S0.6), the
//! job's checkpoints and its recovery. Every other role registers here first
//! and receives the job's config. Transport-free: `grpc::coordinator` serves
//! it over the network.
//!
//! **Generations.** The job runs in attempts numbered from 1. When a role
//! dies (its process exits, `sparrow launch` says so; or it goes silent for
//! `cluster.heartbeat_timeout_ms`; or it registers again, restarted from
//! outside), a new generation starts: every role learns it from its next
//! heartbeat, drops what it was doing and restores the last committed
//! checkpoint (the job's start if none), and training goes on once every
//! role serves the new generation. Requests carry their generation, so
//! nothing of an abandoned attempt reaches a restored role. Each role may be
//! restarted `cluster.max_restarts` times; past that the job fails as it
//! would without recovery, its last checkpoint intact.
//!
//! **Checkpoints.** Every `checkpoint.every_steps` steps (and at the end)
//! each worker, its updates pushed, calls [`Coordinator::checkpoint`]; when
//! all have, the coordinator asks every shard to write its part into a
//! staging directory (worker 0 wrote the dense part there), checks each
//! file's size and checksum, and commits the version (manifest, then
//! `LATEST`, both by rename). The workers go on only after the commit, so
//! the version is a cut: every shard's rows, the dense state and the data
//! position at the same step, no update in flight.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use sparrow_core::Config;
use sparrow_core::config::SyncMode;

use crate::checkpoint::{CheckpointSink, DataProgress, WorkerCut, staging_dir};
use crate::faults;
use crate::lazy::{Backup, BackupCommitter, BackupCut, FinalWeights, Instruction, Lazy, LazyLink};
use crate::rounds::{MergedRound, RoundMerge, RoundUpdate};
use crate::sync::{Contribution, RoundReply, RoundSum};
use crate::transport::{ClusterError, PartWritten, ShardService};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RoleKind {
    Shard,
    Loader,
    Worker,
    /// `sync = "lazy"`: an aggregator process (S4).
    Aggregator,
}

impl RoleKind {
    pub fn name(self) -> &'static str {
        match self {
            RoleKind::Shard => "shard",
            RoleKind::Loader => "loader",
            RoleKind::Worker => "worker",
            RoleKind::Aggregator => "aggregator",
        }
    }

    pub fn parse(name: &str) -> Option<RoleKind> {
        match name {
            "shard" => Some(RoleKind::Shard),
            "loader" => Some(RoleKind::Loader),
            "worker" => Some(RoleKind::Worker),
            "aggregator" => Some(RoleKind::Aggregator),
            _ => None,
        }
    }
}

/// Where the job stands, as every role learns it from its heartbeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    Done,
    Failed(String),
}

/// One attempt of the job, as roles learn it: restore `restore` (none: the
/// job's start) and serve requests of `number` only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Generation {
    pub number: u64,
    pub restore: Option<PathBuf>,
    /// The newest checkpoint the job committed (a role that outlives a
    /// coordinator hands it to the next one).
    pub committed: Option<PathBuf>,
}

/// What a role that outlived a coordinator tells the next one when it
/// registers again.
#[derive(Clone, Debug, Default)]
pub struct Known {
    pub generation: u64,
    pub committed: Option<PathBuf>,
    /// A worker's step.
    pub step: u64,
}

/// What the coordinator reports as it goes (`sparrow launch` reads them
/// from its stdout and sums them over coordinator restarts).
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A new generation: `replayed` steps will be trained again.
    Generation { number: u64, reason: String, replayed: u64, restore: Option<String> },
    /// A worker that outlived the coordinator had trained `steps` more steps
    /// than the generation it goes back from was known to have.
    Replayed { steps: u64 },
    /// A role stopped answering: its process must be restarted.
    Lost { role: String, index: usize },
    /// Every role serves the new generation, `secs` after the death was noticed.
    Resumed { number: u64, secs: f64 },
    /// A checkpoint was committed.
    Committed { step: u64, dir: String, bytes: u64, secs: f64, incremental: bool, shard_mb_per_sec: Vec<f64> },
    /// The coordinator's totals, as it stops.
    Report(RecoveryReport),
}

/// Connects to the shards of a generation (the coordinator writes
/// checkpoints through them).
pub trait ShardDialer: Send + Sync {
    fn dial(&self, addresses: &[String]) -> Result<Vec<Arc<dyn ShardService>>, ClusterError>;
}

struct Member {
    address: String,
    last_seen: Instant,
    /// A worker that finished its work in the current generation.
    finished: bool,
    /// The role's progress count, and when it last moved.
    progress: u64,
    progress_at: Instant,
    /// The generation it has restored and serves (0: none yet).
    ready: u64,
    /// Its payload bytes so far, when it reported them, and its bytes per
    /// second between its last two reports (S4.2 utilisation).
    bytes: u64,
    bytes_at: Instant,
    byte_rate: f64,
    /// Where it answers the scheduler's probes.
    probe: Option<String>,
    /// Its process id (0: not given), see `lost_process`.
    pid: u32,
}

struct Members {
    shards: Vec<Option<Member>>,
    loader: Option<Member>,
    workers: Vec<Option<Member>>,
    /// `sync = "lazy"` with aggregator processes (none: aggregators in process).
    aggregators: Vec<Option<Member>>,
    /// Bytes last reported by roles that were replaced.
    retired_bytes: u64,
    /// When a lost role's slot fell vacant (its replacement must register
    /// within `cluster.connect_timeout_ms` of it).
    vacant_since: HashMap<(RoleKind, usize), Instant>,
}

impl Members {
    fn slots(&mut self, kind: RoleKind) -> &mut [Option<Member>] {
        match kind {
            RoleKind::Shard => &mut self.shards,
            RoleKind::Loader => std::slice::from_mut(&mut self.loader),
            RoleKind::Worker => &mut self.workers,
            RoleKind::Aggregator => &mut self.aggregators,
        }
    }
}

/// The job's attempts, what they cost, and its committed checkpoints.
struct Recovery {
    generation: u64,
    /// What the current generation restores (none: the job's start).
    restore: Option<PathBuf>,
    restore_step: u64,
    /// `checkpoint.resume_from`: where the job started.
    start: Option<(PathBuf, u64)>,
    /// The newest committed checkpoint and its step.
    committed: Option<(PathBuf, u64)>,
    /// Incremental checkpoints since the last full one.
    deltas_since_full: u64,
    restarts: HashMap<(RoleKind, usize), u32>,
    /// The highest step a worker reported in the current generation.
    high_step: u64,
    /// Generations given up → the step up to which their replayed steps
    /// are counted (a worker's last report of one may come late).
    counted_to: BTreeMap<u64, u64>,
    /// When the death behind the current recovery was noticed (none: no recovery under way).
    noticed: Option<Instant>,
    // Totals of this coordinator's life, for its summary.
    checkpoints_committed: u64,
    steps_replayed: u64,
    recovery_secs: f64,
}

/// A checkpoint being gathered: the workers that arrived at `step`.
struct CheckpointRound {
    generation: u64,
    step: u64,
    cuts: Vec<Option<WorkerCut>>,
    /// Set once committed (or failed): every waiting worker takes it.
    outcome: Option<Result<PathBuf, String>>,
    taken: usize,
}

/// The coordinator's state (the gRPC service is a thin layer over it).
pub struct Coordinator {
    config: Config,
    config_toml: String,
    num_shards: usize,
    num_workers: usize,
    heartbeat_timeout: Duration,
    progress_timeout: Duration,
    connect_timeout: Duration,
    registration_deadline: Instant,
    members: Mutex<Members>,
    state: Mutex<JobState>,
    /// The current generation's rounds (a new generation gets fresh ones).
    rounds: Mutex<Arc<RoundSum>>,
    /// The current generation's round merges (`sync = "round"`).
    merges: Mutex<Arc<RoundMerge>>,
    /// `sync = "lazy"`: the scheduler and the aggregators of the current generation.
    lazy: Mutex<Option<Arc<Lazy>>>,
    aggregators: usize,
    /// Where the aggregators' backups go (`checkpoint.dir` set, `sync = "lazy"`),
    /// and what commits each as a checkpoint.
    backup_sink: Mutex<Option<crossbeam_channel::Sender<Backup>>>,
    backup_committer: Mutex<Option<BackupCommitter>>,
    recovery: Mutex<Recovery>,
    /// `recovery.generation`, readable under other locks.
    current: AtomicU64,
    checkpoint: Mutex<Option<CheckpointRound>>,
    checkpoint_done: Condvar,
    /// Where the training data stands in the current generation (its
    /// checkpoints' positions), from its restored checkpoint on; an error
    /// if that checkpoint could not be read.
    progress: Mutex<Result<DataProgress, String>>,
    dialer: Option<Arc<dyn ShardDialer>>,
    events: Box<dyn Fn(&Event) + Send + Sync>,
    /// `checkpoint.export_every_steps`: serving exports of committed versions.
    exports: Mutex<Option<crate::checkpoint::ClusterExports>>,
}

impl Coordinator {
    /// The job's config, as registration hands it to every role.
    pub fn config_toml(&self) -> &str {
        &self.config_toml
    }

    pub fn num_shards(&self) -> usize {
        self.num_shards
    }

    pub fn num_workers(&self) -> usize {
        self.num_workers
    }

    /// `sync = "lazy"`: the aggregators (in process or as processes).
    pub fn num_aggregators(&self) -> usize {
        self.aggregators
    }

    pub fn new(config: &Config, num_shards: usize, num_workers: usize) -> Result<Coordinator, ClusterError> {
        if num_shards == 0 || num_workers == 0 {
            return Err(ClusterError::Setup("a job needs at least one shard and one worker".into()));
        }
        // Sizes beyond the machine fail here, before any role allocates.
        let layout = sparrow_data::DataLayout::from_config(&config.data);
        sparrow_trainer::sizes::check(config, &layout).map_err(|e| ClusterError::Train(e.into()))?;
        if config.train.on_non_finite == sparrow_core::config::OnNonFinite::SkipBatch {
            return Err(ClusterError::Setup(
                "train.on_non_finite = \"skip_batch\" is not available in a cluster job yet (a skipped batch \
                 would still owe its shards a push); use \"stop\", or sparrow train"
                    .into(),
            ));
        }
        if let (Some(every), Some(checkpoints)) =
            (config.checkpoint.export_every_steps.filter(|&n| n > 0), config.checkpoint.every_steps)
            && (checkpoints == 0 || every % checkpoints != 0)
        {
            return Err(ClusterError::Setup(format!(
                "checkpoint.export_every_steps = {every}: a cluster job exports its committed checkpoints, so it \
                 must be a multiple of checkpoint.every_steps = {checkpoints} (or leave every_steps unset: \
                 checkpoints are then taken every export_every_steps)"
            )));
        }
        for (key, set) in [
            ("train.tensorboard_dir", config.train.tensorboard_dir.is_some()),
            ("train.eval_every_steps", config.train.eval_every_steps.is_some()),
        ] {
            if set {
                tracing::warn!("{key} applies to sparrow train; a cluster job evaluates and logs at its end only");
            }
        }
        if config.cluster.sync == SyncMode::Lazy && config.checkpoint.export_every_steps.is_some() {
            return Err(ClusterError::Setup(
                "checkpoint.export_every_steps with cluster.sync = \"lazy\": a lazy job writes a serving export \
                 at every backup already (checkpoint.dir/exports/)"
                    .into(),
            ));
        }
        if config.cluster.sync == SyncMode::Lazy && config.checkpoint.every_steps.is_some() {
            return Err(ClusterError::Setup(
                "checkpoint.every_steps with cluster.sync = \"lazy\" is not available yet: a lazy job's checkpoint \
                 is taken at its end"
                    .into(),
            ));
        }
        let config_toml =
            toml::to_string(config).map_err(|e| ClusterError::Setup(format!("serializing the config: {e}")))?;
        let start = match sparrow_trainer::checkpoint::resume_dir(config)? {
            Some(dir) => {
                let step = sparrow_trainer::checkpoint::read_manifest(&dir)?.step;
                Some((dir, step))
            }
            None => None,
        };
        let progress = progress_from(1, start.as_ref().map(|(d, _)| d.as_path()));
        Ok(Coordinator {
            config: config.clone(),
            config_toml,
            num_shards,
            num_workers,
            heartbeat_timeout: Duration::from_millis(config.cluster.heartbeat_timeout_ms),
            progress_timeout: Duration::from_millis(config.cluster.progress_timeout_ms),
            connect_timeout: Duration::from_millis(config.cluster.connect_timeout_ms),
            registration_deadline: Instant::now() + Duration::from_millis(config.cluster.connect_timeout_ms),
            members: Mutex::new(Members {
                shards: (0..num_shards).map(|_| None).collect(),
                loader: None,
                workers: (0..num_workers).map(|_| None).collect(),
                aggregators: Vec::new(),
                retired_bytes: 0,
                vacant_since: HashMap::new(),
            }),
            state: Mutex::new(JobState::Running),
            rounds: Mutex::new(Arc::new(RoundSum::new(num_workers))),
            merges: Mutex::new(Arc::new(RoundMerge::new(num_workers, config.cluster.round_merge))),
            lazy: Mutex::new(lazy_for(config, num_workers, 1, start.as_ref().map(|(d, _)| d.as_path()))?),
            aggregators: 1,
            backup_sink: Mutex::new(None),
            backup_committer: Mutex::new(None),
            recovery: Mutex::new(Recovery {
                generation: 1,
                restore: start.as_ref().map(|(d, _)| d.clone()),
                restore_step: start.as_ref().map_or(0, |(_, s)| *s),
                start,
                committed: None,
                deltas_since_full: 0,
                restarts: HashMap::new(),
                high_step: 0,
                counted_to: BTreeMap::new(),
                noticed: None,
                checkpoints_committed: 0,
                steps_replayed: 0,
                recovery_secs: 0.0,
            }),
            current: AtomicU64::new(1),
            checkpoint: Mutex::new(None),
            checkpoint_done: Condvar::new(),
            exports: Mutex::new(crate::checkpoint::ClusterExports::new(config)),
            progress: Mutex::new(progress),
            dialer: None,
            events: Box::new(|_| {}),
        })
    }

    /// `sync = "lazy"` with `k` aggregators in this process (worker →
    /// aggregator by `cluster.lazy.aggregator_of`, checked here).
    pub fn with_aggregators(mut self, k: usize) -> Result<Self, ClusterError> {
        let restore = self.recovery.lock().restore.clone();
        self.lazy = Mutex::new(lazy_for(&self.config, self.num_workers, k, restore.as_deref())?);
        self.aggregators = k;
        Ok(self)
    }

    /// `sync = "lazy"` with `k` aggregator processes (`sparrow aggregator`),
    /// which register like any role and send the scheduler partial sums.
    /// Other modes have no aggregators.
    pub fn with_aggregator_processes(self, k: usize) -> Result<Self, ClusterError> {
        let this = self.with_aggregators(k)?;
        if this.config.cluster.sync == SyncMode::Lazy {
            this.members.lock().aggregators = (0..k).map(|_| None).collect();
        }
        Ok(this)
    }

    /// Aggregator `p.aggregator`'s partial sum of an instruction (see
    /// [`crate::aggregator`]): blocks until the aggregation is done.
    pub fn contribute_partial(
        &self,
        p: crate::lazy::Partial,
    ) -> Result<(crate::lazy::Aggregated, Arc<Vec<f32>>), ClusterError> {
        faults::point("coordinator.aggregate");
        let generation = p.generation;
        let lazy = self.lazy_in(p.aggregator, generation)?;
        lazy.contribute_partial(p).map_err(|e| self.woken(generation, e))
    }

    /// Starts backing the aggregated weights up (S4.6) when the job runs
    /// lazy aggregation and has a `checkpoint.dir`: the caller writes what
    /// the receiver gets with [`write_backup`](Self::write_backup).
    /// Each backup is also committed as a checkpoint (a cut: the workers of
    /// the aggregation wait until it is), which a failure restarts from.
    pub fn start_backups(self: &Arc<Self>) -> Option<crossbeam_channel::Receiver<Backup>> {
        let lazy = self.lazy()?;
        self.config.checkpoint.dir.as_ref()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        lazy.back_up_to(tx.clone());
        *self.backup_sink.lock() = Some(tx);
        let me = Arc::downgrade(self);
        let committer: BackupCommitter = Arc::new(move |cut| match me.upgrade() {
            Some(coordinator) => coordinator.commit_backup(cut).map(|_| ()).map_err(|e| e.to_string()),
            None => Err("the coordinator is gone".into()),
        });
        lazy.commit_backups_with(committer.clone());
        *self.backup_committer.lock() = Some(committer);
        Some(rx)
    }

    /// Commits a lazy job's backup as a checkpoint: the aggregated weights
    /// (with fresh Adam state: replicas' moments are their own and are never
    /// aggregated), every shard's part, the furthest data position aggregated.
    pub fn commit_backup(&self, cut: &BackupCut) -> Result<PathBuf, ClusterError> {
        let root = PathBuf::from(
            self.config.checkpoint.dir.as_deref().ok_or_else(|| ClusterError::Setup("no checkpoint.dir".into()))?,
        );
        let generation = self.generation().number;
        let layout = sparrow_data::DataLayout::from_config(&self.config.data);
        let model = crate::worker::new_worker(&self.config, &layout, 0, None)?.model;
        model.params.set_flat(&cut.weights).map_err(sparrow_trainer::TrainError::from)?;
        let optimizer = sparrow_model::DenseOptimizer::new(self.config.dense_optimizer.clone());
        crate::checkpoint::write_dense(&root, cut.step, generation, &model, &optimizer)?;
        let worker_cut = WorkerCut {
            worker: 0,
            generation,
            step: cut.step,
            samples_trained: cut.samples,
            dense_optimizer_step: 0,
            position: cut.position,
            wrote_dense: true,
            trained: Vec::new(),
        };
        self.commit(&[worker_cut])
    }

    /// Writes backup `number` as a serving export under
    /// `checkpoint.dir/exports/`, the rows as the shards hold them now (not
    /// a cut: training goes on), and points `exports/LATEST` at it.
    pub fn write_backup(&self, number: u64, weights: &[f32]) -> Result<PathBuf, ClusterError> {
        let root = self.config.checkpoint.dir.as_ref().map(|d| PathBuf::from(d).join("exports"));
        let root = root.ok_or_else(|| ClusterError::Setup("backups need checkpoint.dir".into()))?;
        std::fs::create_dir_all(&root)
            .map_err(|e| ClusterError::Io { what: format!("creating {}", root.display()), source: e })?;
        let layout = sparrow_data::DataLayout::from_config(&self.config.data);
        let model = crate::worker::new_worker(&self.config, &layout, 0, None)?.model;
        model.params.set_flat(weights).map_err(sparrow_trainer::TrainError::from)?;
        let dialer = self.dialer.as_ref().ok_or_else(|| ClusterError::Setup("no way to reach the shards".into()))?;
        let generation = self.generation().number;
        let shards = dialer.dial(&self.view(generation).shards)?;
        let dim = self.config.model.embedding_dim;
        let (mut shard, mut cursor) = (0usize, Some((0usize, 0usize)));
        let pages = || -> Result<sparrow_trainer::export::RowPage, sparrow_trainer::TrainError> {
            while shard < shards.len() {
                let Some(at) = cursor else {
                    (shard, cursor) = (shard + 1, Some((0, 0)));
                    continue;
                };
                let page =
                    shards[shard].export(at, 4096).map_err(|e| sparrow_trainer::TrainError::DenseSync(Box::new(e)))?;
                cursor = page.next;
                let row_len = page.rows.len() / page.keys.len().max(1);
                let vectors = page.rows.chunks_exact(row_len.max(1)).flat_map(|r| r[..dim].iter().copied()).collect();
                return Ok(Some((page.keys, vectors)));
            }
            Ok(None)
        };
        let name = format!("{number:08}");
        let dir = root.join(&name);
        sparrow_trainer::export::write_export(&dir, &self.config, &layout, number, &model, pages)?;
        let tmp = root.join(".LATEST.tmp");
        std::fs::write(&tmp, format!("{name}\n"))
            .and_then(|()| std::fs::rename(&tmp, root.join("LATEST")))
            .map_err(|e| ClusterError::Io { what: format!("writing {}/LATEST", root.display()), source: e })?;
        Ok(dir)
    }

    /// The scheduler of the current generation (`sync = "lazy"`).
    pub fn lazy(&self) -> Option<Arc<Lazy>> {
        self.lazy.lock().clone()
    }

    fn lazy_in(&self, worker: usize, generation: u64) -> Result<Arc<Lazy>, ClusterError> {
        let current = self.recovery.lock().generation;
        if generation != current {
            return Err(ClusterError::StaleGeneration {
                peer: "the scheduler".into(),
                what: format!("worker {worker}'s request"),
                found: generation,
                serving: current,
            });
        }
        self.lazy().ok_or_else(|| ClusterError::Setup("this job's cluster.sync is not \"lazy\"".into()))
    }

    fn woken(&self, generation: u64, e: ClusterError) -> ClusterError {
        match self.current.load(Ordering::SeqCst) {
            now if now != generation => ClusterError::GenerationChanged { generation: now },
            _ => e,
        }
    }

    /// How checkpoints reach the shards (without one, none are written).
    pub fn with_dialer(mut self, dialer: Arc<dyn ShardDialer>) -> Self {
        self.dialer = Some(dialer);
        self
    }

    /// Where the coordinator's [`Event`]s go.
    pub fn with_events(mut self, events: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.events = Box::new(events);
        self
    }

    pub fn state(&self) -> JobState {
        self.state.lock().clone()
    }

    pub fn generation(&self) -> Generation {
        let r = self.recovery.lock();
        Generation {
            number: r.generation,
            restore: r.restore.clone(),
            committed: r.committed.as_ref().map(|(d, _)| d.clone()),
        }
    }

    /// Fails the job (the first reason wins) and wakes every waiting worker.
    pub fn fail(&self, reason: String) {
        let mut state = self.state.lock();
        if *state == JobState::Running {
            tracing::error!("job failed: {reason}");
            *state = JobState::Failed(reason.clone());
            drop(state);
            self.rounds.lock().fail(reason.clone());
            self.merges.lock().fail(reason.clone());
            if let Some(lazy) = self.lazy() {
                lazy.fail(reason.clone());
            }
            self.end_checkpoint_round(Err(reason));
        }
    }

    /// Starts the next generation (the caller holds `recovery`): every role
    /// goes back to the last committed checkpoint.
    fn next_generation(&self, r: &mut Recovery, reason: String) {
        r.generation += 1;
        self.current.store(r.generation, Ordering::SeqCst);
        let (restore, step) = match (&r.committed, &r.start) {
            (Some((dir, step)), _) | (None, Some((dir, step))) => (Some(dir.clone()), *step),
            (None, None) => (None, 0),
        };
        let replayed = r.high_step.saturating_sub(step);
        r.steps_replayed += replayed;
        let given_up = r.generation - 1;
        let counted = r.high_step.max(step);
        r.counted_to.insert(given_up, counted);
        while r.counted_to.len() > 64 {
            r.counted_to.pop_first();
        }
        (r.restore, r.restore_step, r.high_step) = (restore, step, step);
        *self.progress.lock() = progress_from(r.generation, r.restore.as_deref());
        r.noticed.get_or_insert_with(Instant::now);
        tracing::warn!(
            "generation {}: {reason}; every role goes back to {}",
            r.generation,
            r.restore.as_ref().map_or("the job's start".to_string(), |d| d.display().to_string())
        );
        (self.events)(&Event::Generation {
            number: r.generation,
            reason,
            replayed,
            restore: r.restore.as_ref().map(|d| d.display().to_string()),
        });
        {
            let mut members = self.members.lock();
            for m in members.workers.iter_mut().flatten() {
                m.finished = false;
            }
        }
        let old = std::mem::replace(&mut *self.rounds.lock(), Arc::new(RoundSum::new(self.num_workers)));
        old.fail(format!("generation {} started", r.generation));
        let merges = Arc::new(RoundMerge::new(self.num_workers, self.config.cluster.round_merge));
        std::mem::replace(&mut *self.merges.lock(), merges).fail(format!("generation {} started", r.generation));
        match lazy_for(&self.config, self.num_workers, self.aggregators, r.restore.as_deref()) {
            Ok(next) => {
                if let (Some(lazy), Some(sink)) = (&next, self.backup_sink.lock().as_ref()) {
                    lazy.back_up_to(sink.clone());
                }
                if let (Some(lazy), Some(committer)) = (&next, self.backup_committer.lock().as_ref()) {
                    lazy.commit_backups_with(committer.clone());
                }
                if let Some(old) = std::mem::replace(&mut *self.lazy.lock(), next) {
                    old.fail(format!("generation {} started", r.generation));
                }
            }
            Err(e) => tracing::error!("generation {}: the scheduler could not restart: {e}", r.generation),
        }
        self.end_checkpoint_round(Err(format!("generation {} started", r.generation)));
    }

    /// Role `index` of `kind` died (its process exited, or it went silent):
    /// its slot waits for a replacement and every role goes back to the last
    /// committed checkpoint, unless its restart budget is spent (then the
    /// job fails). Idempotent until the replacement registers.
    pub fn lost(&self, kind: RoleKind, index: usize, reason: &str) {
        self.lost_process(kind, index, 0, reason);
    }

    /// `lost` for process `pid` (0: whichever holds the slot). A notice
    /// about a process whose replacement already registered is stale: its
    /// death was counted when the slot was taken again.
    pub fn lost_process(&self, kind: RoleKind, index: usize, pid: u32, reason: &str) {
        if self.state() != JobState::Running {
            return;
        }
        {
            let mut members = self.members.lock();
            let Some(slot) = members.slots(kind).get_mut(index) else { return };
            if let Some(member) = slot.as_ref()
                && pid != 0
                && member.pid != 0
                && member.pid != pid
            {
                tracing::debug!(
                    "{} {index}: process {pid} is gone; {} already took its place",
                    kind.name(),
                    member.pid
                );
                return;
            }
            let Some(gone) = slot.take() else { return };
            members.retired_bytes += gone.bytes;
            members.vacant_since.insert((kind, index), Instant::now());
        }
        self.count_restart(kind, index, reason);
    }

    fn count_restart(&self, kind: RoleKind, index: usize, reason: &str) {
        let max = self.config.cluster.max_restarts;
        let mut r = self.recovery.lock();
        let count = r.restarts.entry((kind, index)).or_insert(0);
        *count += 1;
        let count = *count;
        let what = format!("{} {index} {reason}", kind.name());
        if count > max {
            drop(r);
            self.fail(format!(
                "{what}; it was restarted {} time(s) already (cluster.max_restarts = {max}): the last committed \
                 checkpoint is intact",
                count - 1
            ));
            return;
        }
        self.next_generation(&mut r, what);
    }

    /// A role joins; `index` asks for a slot (a StatefulSet ordinal), else the
    /// first free one. A slot already held means its role was restarted: the
    /// job goes back to the last checkpoint. `known`: what a role that
    /// outlived the previous coordinator knew (this coordinator is a restart).
    pub fn register(
        &self,
        kind: RoleKind,
        address: String,
        index: Option<usize>,
        known: Option<Known>,
    ) -> Result<(usize, Generation), ClusterError> {
        self.register_process(kind, address, index, known, 0)
    }

    /// `register` for process `pid` (0: not given).
    pub fn register_process(
        &self,
        kind: RoleKind,
        address: String,
        index: Option<usize>,
        known: Option<Known>,
        pid: u32,
    ) -> Result<(usize, Generation), ClusterError> {
        if let JobState::Failed(reason) = self.state() {
            return Err(ClusterError::JobFailed(reason));
        }
        let n = self.members.lock().slots(kind).len();
        if kind == RoleKind::Aggregator && n == 0 {
            return Err(ClusterError::Setup(format!(
                "this job has no aggregator processes (cluster.sync is \"{}\"; aggregators serve \"lazy\")",
                self.config.cluster.sync.name()
            )));
        }
        let slot = match index {
            Some(i) if i >= n => {
                return Err(ClusterError::Setup(format!("{} {i}: the job has only {n}", kind.name())));
            }
            Some(i) => i,
            None => self.members.lock().slots(kind).iter().position(Option::is_none).ok_or_else(|| {
                ClusterError::Setup(format!(
                    "all {n} {} slots are taken (--shards/--workers of the coordinator)",
                    kind.name()
                ))
            })?,
        };
        let taken = self.members.lock().slots(kind)[slot].is_some();
        if taken {
            if self.config.cluster.max_restarts == 0 {
                return Err(ClusterError::Setup(format!("{} {slot} is already registered", kind.name())));
            }
            self.lost(kind, slot, "registered again (it was restarted)");
            if let JobState::Failed(reason) = self.state() {
                return Err(ClusterError::JobFailed(reason));
            }
        }
        if let Some(known) = known {
            self.adopt(kind, slot, known);
        }
        tracing::info!("{} {slot} registered at {address}", kind.name());
        let now = Instant::now();
        let mut members = self.members.lock();
        members.vacant_since.remove(&(kind, slot));
        if let Some(old) = members.slots(kind)[slot].take() {
            members.retired_bytes += old.bytes;
        }
        members.slots(kind)[slot] = Some(Member {
            address,
            last_seen: now,
            finished: false,
            progress: 0,
            progress_at: now,
            ready: 0,
            bytes: 0,
            bytes_at: now,
            byte_rate: 0.0,
            probe: None,
            pid,
        });
        drop(members);
        Ok((slot, self.generation()))
    }

    /// A role that outlived the previous coordinator: its generation is over
    /// (this coordinator cannot know what the others did since), the job's
    /// committed checkpoint is the newest any such role knew.
    fn adopt(&self, kind: RoleKind, index: usize, known: Known) {
        let mut r = self.recovery.lock();
        if let Some(dir) = known.committed
            && let Ok(m) = sparrow_trainer::checkpoint::read_manifest(&dir)
            && r.committed.as_ref().is_none_or(|(_, step)| m.step > *step)
        {
            r.committed = Some((dir, m.step));
        }
        if kind == RoleKind::Worker {
            if known.generation < r.generation {
                // Its generation was already given up (another role registered first).
                self.late_step(&mut r, known.generation, known.step);
            } else {
                r.high_step = r.high_step.max(known.step);
            }
        }
        if known.generation >= r.generation {
            r.generation = known.generation;
            let reason = format!("the coordinator restarted ({} {index} registered again)", kind.name());
            self.next_generation(&mut r, reason);
        }
    }

    /// A role is alive; `progress` is its work count (see
    /// `HeartbeatRequest`), `ready` the generation it serves, `step` a
    /// worker's step in it.
    pub fn heartbeat(
        &self,
        kind: RoleKind,
        index: usize,
        progress: u64,
        ready: u64,
        step: u64,
    ) -> Result<(JobState, Generation), ClusterError> {
        {
            let mut members = self.members.lock();
            match members.slots(kind).get_mut(index) {
                Some(Some(m)) => {
                    let now = Instant::now();
                    m.last_seen = now;
                    if progress != m.progress {
                        (m.progress, m.progress_at) = (progress, now);
                    }
                    m.ready = ready;
                }
                _ => return Err(ClusterError::Setup(format!("{} {index} never registered", kind.name()))),
            }
        }
        let mut r = self.recovery.lock();
        if kind == RoleKind::Worker && ready == r.generation {
            r.high_step = r.high_step.max(step);
        }
        if r.noticed.is_some() && self.all_ready(r.generation) {
            let secs = r.noticed.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
            r.recovery_secs += secs;
            tracing::info!("generation {}: every role is back, {secs:.3} s after the death was noticed", r.generation);
            (self.events)(&Event::Resumed { number: r.generation, secs });
        }
        drop(r);
        Ok((self.state(), self.generation()))
    }

    /// A role's traffic so far (`bytes`) and its probe address, from a heartbeat.
    pub fn traffic(&self, kind: RoleKind, index: usize, bytes: u64, probe: &str) {
        let mut members = self.members.lock();
        if let Some(Some(m)) = members.slots(kind).get_mut(index) {
            let now = Instant::now();
            let secs = now.duration_since(m.bytes_at).as_secs_f64();
            if bytes >= m.bytes && secs > 0.0 {
                m.byte_rate = (bytes - m.bytes) as f64 / secs;
            }
            (m.bytes, m.bytes_at) = (bytes, now);
            if !probe.is_empty() {
                m.probe = Some(probe.to_string());
            }
        }
    }

    /// Payload bytes every role reported so far, replaced ones included.
    pub fn role_bytes(&self) -> u64 {
        let mut members = self.members.lock();
        let mut total = members.retired_bytes;
        for kind in [RoleKind::Shard, RoleKind::Loader, RoleKind::Worker, RoleKind::Aggregator] {
            total += members.slots(kind).iter().flatten().map(|m| m.bytes).sum::<u64>();
        }
        total
    }

    /// Every registered role's bytes per second (S4.2 utilisation).
    pub fn byte_rates(&self) -> Vec<f64> {
        let mut members = self.members.lock();
        let mut rates = Vec::new();
        for kind in [RoleKind::Shard, RoleKind::Loader, RoleKind::Worker, RoleKind::Aggregator] {
            rates.extend(members.slots(kind).iter().flatten().map(|m| m.byte_rate));
        }
        rates
    }

    /// The roles the scheduler probes (`cluster.lazy.probe_roles`), finished workers aside.
    pub fn probe_targets(&self, all: bool) -> Vec<crate::lazy::ProbeTarget> {
        let mut members = self.members.lock();
        let kinds: &[RoleKind] = if all {
            &[RoleKind::Shard, RoleKind::Loader, RoleKind::Worker, RoleKind::Aggregator]
        } else {
            &[RoleKind::Worker]
        };
        let mut targets = Vec::new();
        for &kind in kinds {
            for (i, m) in members.slots(kind).iter().enumerate() {
                if !m.as_ref().is_some_and(|m| m.finished) {
                    targets.push(crate::lazy::ProbeTarget {
                        name: format!("{} {i}", kind.name()),
                        vacant: m.is_none(),
                        address: m.as_ref().and_then(|m| m.probe.clone()),
                    });
                }
            }
        }
        targets
    }

    /// A worker's last step in an earlier `generation` (reported once it
    /// moved on): the steps past what was counted at the rollback were
    /// trained twice.
    pub fn previous_step(&self, kind: RoleKind, generation: u64, step: u64) {
        if kind == RoleKind::Worker && generation > 0 {
            let mut r = self.recovery.lock();
            self.late_step(&mut r, generation, step);
        }
    }

    fn late_step(&self, r: &mut Recovery, generation: u64, step: u64) {
        let Some(counted) = r.counted_to.get_mut(&generation) else { return };
        let extra = step.saturating_sub(*counted);
        if extra > 0 {
            *counted = step;
            r.steps_replayed += extra;
            (self.events)(&Event::Replayed { steps: extra });
        }
    }

    fn all_ready(&self, generation: u64) -> bool {
        let members = self.members.lock();
        let ready = |slots: &[Option<Member>]| slots.iter().all(|m| m.as_ref().is_some_and(|m| m.ready == generation));
        ready(&members.shards)
            && ready(std::slice::from_ref(&members.loader))
            && ready(&members.workers)
            && ready(&members.aggregators)
    }

    /// The shard map and the loader's address of `generation`, and whether
    /// they serve it: (every shard and the loader, every shard, the map, the
    /// loader's address).
    pub fn view(&self, generation: u64) -> View {
        let members = self.members.lock();
        let serves = |m: &Option<Member>| m.as_ref().is_some_and(|m| m.ready == generation);
        let shards_ready = members.shards.iter().all(serves);
        let address = |m: &Option<Member>| m.as_ref().map(|m| m.address.clone()).unwrap_or_default();
        View {
            complete: shards_ready && serves(&members.loader) && members.aggregators.iter().all(serves),
            shards_ready,
            shards: members.shards.iter().map(address).collect(),
            loader: address(&members.loader),
            aggregators: members.aggregators.iter().map(address).collect(),
        }
    }

    /// A worker is done in `generation` (or a role failed); the job is done
    /// once every worker is done in the current one.
    pub fn finish(&self, kind: RoleKind, index: usize, error: Option<String>, generation: u64) {
        if let Some(error) = error {
            self.fail(format!("{} {index}: {error}", kind.name()));
            return;
        }
        if kind != RoleKind::Worker || generation != self.recovery.lock().generation {
            return;
        }
        let mut members = self.members.lock();
        if let Some(Some(m)) = members.workers.get_mut(index) {
            m.finished = true;
        }
        if members.workers.iter().all(|m| m.as_ref().is_some_and(|m| m.finished)) {
            let mut state = self.state.lock();
            if *state == JobState::Running {
                tracing::info!("all {} workers finished", self.num_workers);
                *state = JobState::Done;
            }
        }
    }

    /// A registered role that went silent (or a worker whose progress stands
    /// still) is lost: restarted within the budget (an [`Event::Lost`] asks
    /// the launcher to), else the job fails naming it. Roles still missing
    /// after the connect timeout fail the job.
    pub fn check_liveness(&self) {
        if self.state() != JobState::Running {
            return;
        }
        let mut problems = Vec::new();
        let mut missing = None;
        {
            let members = self.members.lock();
            let groups = [
                (RoleKind::Shard, &members.shards[..]),
                (RoleKind::Loader, std::slice::from_ref(&members.loader)),
                (RoleKind::Worker, &members.workers[..]),
                (RoleKind::Aggregator, &members.aggregators[..]),
            ];
            for (kind, slots) in groups {
                for (i, slot) in slots.iter().enumerate() {
                    match slot {
                        Some(m) if !m.finished && m.last_seen.elapsed() > self.heartbeat_timeout => {
                            problems.push((kind, i, format!(
                                "at {} stopped answering: no heartbeat for {} ms (cluster.heartbeat_timeout_ms = {})",
                                m.address,
                                m.last_seen.elapsed().as_millis(),
                                self.heartbeat_timeout.as_millis()
                            )));
                        }
                        // Workers drive the job: one that answers but gets
                        // nothing done is as stuck as a silent one. Counted from
                        // its first batch (shards restoring a large checkpoint
                        // may keep a worker waiting before it).
                        Some(m)
                            if kind == RoleKind::Worker
                                && !m.finished
                                && m.progress > 0
                                && m.progress_at.elapsed() > self.progress_timeout =>
                        {
                            problems.push((kind, i, format!(
                                "at {} answers heartbeats but made no progress for {} ms (cluster.progress_timeout_ms = {}; progress count {})",
                                m.address,
                                m.progress_at.elapsed().as_millis(),
                                self.progress_timeout.as_millis(),
                                m.progress
                            )));
                        }
                        None => {
                            let deadline = members
                                .vacant_since
                                .get(&(kind, i))
                                .map_or(self.registration_deadline, |t| *t + self.connect_timeout);
                            if Instant::now() > deadline {
                                missing = Some(format!(
                                    "{} {i} never registered within cluster.connect_timeout_ms",
                                    kind.name()
                                ));
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        if let Some(problem) = missing {
            self.fail(problem);
            return;
        }
        for (kind, index, problem) in problems {
            if self.config.cluster.max_restarts == 0 {
                self.fail(format!("{} {index} {problem}", kind.name()));
                return;
            }
            (self.events)(&Event::Lost { role: kind.name().to_string(), index });
            self.lost(kind, index, &problem);
        }
    }

    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        faults::point("coordinator.sum");
        let generation = self.recovery.lock().generation;
        if c.generation != generation {
            return Err(ClusterError::StaleGeneration {
                peer: "the coordinator".into(),
                what: format!("worker {}'s gradients", c.worker),
                found: c.generation,
                serving: generation,
            });
        }
        let rounds = self.rounds.lock().clone();
        rounds.sum(c).map_err(|e| match self.current.load(Ordering::SeqCst) {
            // Woken because the job moved on, not because it failed.
            now if now != generation => ClusterError::GenerationChanged { generation: now },
            _ => e,
        })
    }

    /// A worker's end of a round (`sync = "round"`): waits for every
    /// worker's and returns the merged round.
    pub fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        faults::point("coordinator.merge");
        let generation = self.recovery.lock().generation;
        if u.generation != generation {
            return Err(ClusterError::StaleGeneration {
                peer: "the coordinator".into(),
                what: format!("worker {}'s round update", u.worker),
                found: u.generation,
                serving: generation,
            });
        }
        let merges = self.merges.lock().clone();
        merges.merge_round(u).map_err(|e| match self.current.load(Ordering::SeqCst) {
            now if now != generation => ClusterError::GenerationChanged { generation: now },
            _ => e,
        })
    }

    fn end_checkpoint_round(&self, outcome: Result<PathBuf, String>) {
        let mut round = self.checkpoint.lock();
        if let Some(r) = round.as_mut()
            && r.outcome.is_none()
        {
            r.outcome = Some(outcome);
        }
        self.checkpoint_done.notify_all();
    }

    /// A worker at a checkpoint step: returns the committed version once every
    /// worker reached the step and every shard wrote its part.
    pub fn checkpoint(&self, cut: WorkerCut) -> Result<PathBuf, ClusterError> {
        let current = self.recovery.lock().generation;
        if cut.generation != current {
            return Err(ClusterError::GenerationChanged { generation: current });
        }
        let mut round = self.checkpoint.lock();
        if let Some(r) = round.as_ref()
            && (r.generation != cut.generation || r.step != cut.step)
            && r.outcome.is_none()
        {
            return Err(ClusterError::Setup(format!(
                "worker {}: checkpoint at step {} while the workers gather at step {} (generation {})",
                cut.worker, cut.step, r.step, r.generation
            )));
        }
        if round.as_ref().is_none_or(|r| r.outcome.is_some()) {
            *round = Some(CheckpointRound {
                generation: cut.generation,
                step: cut.step,
                cuts: vec![None; self.num_workers],
                outcome: None,
                taken: 0,
            });
        }
        let r = round.as_mut().expect("just set");
        let worker = cut.worker;
        if worker >= self.num_workers {
            return Err(ClusterError::Setup(format!("worker {worker}: only {} workers", self.num_workers)));
        }
        r.cuts[worker] = Some(cut);
        if r.cuts.iter().all(Option::is_some) {
            let cuts: Vec<WorkerCut> = r.cuts.iter().flatten().cloned().collect();
            drop(round);
            let outcome = self.commit(&cuts).map_err(|e| e.to_string());
            if let Err(e) = &outcome {
                tracing::error!("checkpoint at step {}: {e}", cuts[0].step);
            }
            self.end_checkpoint_round(outcome);
            round = self.checkpoint.lock();
        }
        loop {
            let r = round.as_mut().ok_or_else(|| ClusterError::Setup("the checkpoint round vanished".into()))?;
            if let Some(outcome) = r.outcome.clone() {
                r.taken += 1;
                if r.taken == self.num_workers {
                    *round = None;
                }
                let generation = self.current.load(Ordering::SeqCst);
                return match outcome {
                    Ok(dir) => Ok(dir),
                    Err(_) if generation != current => Err(ClusterError::GenerationChanged { generation }),
                    Err(e) => Err(ClusterError::Setup(format!("the checkpoint failed: {e}"))),
                };
            }
            let generation = self.current.load(Ordering::SeqCst);
            if generation != current {
                return Err(ClusterError::GenerationChanged { generation });
            }
            self.checkpoint_done.wait(&mut round);
        }
    }

    /// Writes and commits the checkpoint the workers' `cuts` describe.
    /// The generation's data progress with the cuts' trained batches added.
    fn data_progress(&self, generation: u64, cuts: &[WorkerCut]) -> Result<DataProgress, ClusterError> {
        let mut progress = self.progress.lock();
        let progress = progress.as_mut().map_err(|e| ClusterError::Setup(e.clone()))?;
        if progress.generation != generation {
            return Err(ClusterError::StaleGeneration {
                peer: "the coordinator".into(),
                what: "a checkpoint".into(),
                found: generation,
                serving: progress.generation,
            });
        }
        progress.add(cuts.iter().flat_map(|c| c.trained.iter().copied()));
        Ok(progress.clone())
    }

    fn commit(&self, cuts: &[WorkerCut]) -> Result<PathBuf, ClusterError> {
        let start = Instant::now();
        let first = &cuts[0];
        let (generation, step) = (first.generation, first.step);
        let root = PathBuf::from(
            self.config.checkpoint.dir.as_deref().ok_or_else(|| ClusterError::Setup("no checkpoint.dir".into()))?,
        );
        let dialer = self.dialer.as_ref().ok_or_else(|| ClusterError::Setup("no way to reach the shards".into()))?;
        let staging = staging_dir(&root, step, generation);
        std::fs::create_dir_all(&staging)
            .map_err(|e| ClusterError::Io { what: format!("creating {}", staging.display()), source: e })?;
        let addresses = self.view(generation).shards;
        let shards = dialer.dial(&addresses)?;
        // Incremental on the last commit when it has a part per shard and
        // the full version is not due.
        let (base, since) = {
            let r = self.recovery.lock();
            let incremental =
                self.config.checkpoint.incremental && r.deltas_since_full + 1 < self.config.checkpoint.full_every;
            match (&r.committed, incremental) {
                (Some((dir, _)), true) => match sparrow_trainer::checkpoint::read_manifest(dir) {
                    Ok(m) if m.parts.len() == self.num_shards => {
                        (Some(dir.clone()), m.parts.iter().map(|p| Some(p.clock)).collect::<Vec<_>>())
                    }
                    _ => (None, vec![None; self.num_shards]),
                },
                _ => (None, vec![None; self.num_shards]),
            }
        };
        let written: Vec<PartWritten> = std::thread::scope(|scope| {
            let handles: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(i, shard)| {
                    let (staging, since) = (&staging, since[i]);
                    scope.spawn(move || shard.write_part(generation, staging, since))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(ClusterError::Setup("a part writer panicked".into()))))
                .collect::<Result<Vec<_>, _>>()
        })?;
        let progress = match cuts.iter().any(|c| !c.trained.is_empty()) {
            true => Some(self.data_progress(generation, cuts)?),
            false => None,
        };
        let manifest =
            crate::checkpoint::manifest(&self.config, cuts, &written, base.as_deref(), &staging, progress.as_ref())?;
        faults::point("coordinator.commit");
        let dir = sparrow_trainer::checkpoint::commit(&root, &staging, &manifest, self.config.checkpoint.keep)?;
        let bytes: u64 = manifest.files.values().map(|f| f.bytes).sum();
        let secs = start.elapsed().as_secs_f64();
        let shard_mb_per_sec: Vec<f64> = written
            .iter()
            .map(|w| w.written.files.iter().map(|(_, b)| *b).sum::<u64>() as f64 / 1e6 / w.secs.max(1e-9))
            .collect();
        let mut r = self.recovery.lock();
        r.committed = Some((dir.clone(), step));
        r.checkpoints_committed += 1;
        r.deltas_since_full = if base.is_some() { r.deltas_since_full + 1 } else { 0 };
        drop(r);
        if let Some(exports) = self.exports.lock().as_mut() {
            let every = crate::checkpoint::checkpoint_every(&self.config).unwrap_or(step.max(1));
            exports.committed(&dir, step, every);
        }
        tracing::info!(
            "checkpoint at step {step} committed: {} ({bytes} bytes{}, {secs:.3} s)",
            dir.display(),
            if base.is_some() { ", incremental" } else { "" }
        );
        (self.events)(&Event::Committed {
            step,
            dir: dir.display().to_string(),
            bytes,
            secs,
            incremental: base.is_some(),
            shard_mb_per_sec,
        });
        Ok(dir)
    }

    /// Waits for the serving export being written, if any (the job's end).
    pub fn finish_exports(&self) {
        if let Some(exports) = self.exports.lock().as_mut() {
            exports.wait();
        }
    }

    /// Restarts by role kind, checkpoints committed, steps replayed and
    /// recovery seconds over this coordinator's life.
    pub fn recovery_report(&self) -> RecoveryReport {
        let r = self.recovery.lock();
        let mut restarts: BTreeMap<String, u64> =
            ["coordinator", "loader", "shard", "worker"].iter().map(|k| (k.to_string(), 0)).collect();
        for ((kind, _), n) in &r.restarts {
            *restarts.entry(kind.name().to_string()).or_default() += u64::from(*n);
        }
        RecoveryReport {
            restarts,
            checkpoints_committed: r.checkpoints_committed,
            steps_replayed: r.steps_replayed,
            recovery_secs: r.recovery_secs,
            role_bytes: self.role_bytes(),
            checkpoint: r.committed.as_ref().map(|(d, _)| d.display().to_string()),
        }
    }
}

impl CheckpointSink for Coordinator {
    fn checkpoint(&self, cut: WorkerCut) -> Result<PathBuf, ClusterError> {
        Coordinator::checkpoint(self, cut)
    }
}

/// Shards in this process, as the coordinator reaches them (tests, `local`).
pub struct LocalShards(pub Vec<Arc<dyn ShardService>>);

impl ShardDialer for LocalShards {
    fn dial(&self, _: &[String]) -> Result<Vec<Arc<dyn ShardService>>, ClusterError> {
        Ok(self.0.clone())
    }
}

/// What the job's recovery did (the final JSON's fields).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct RecoveryReport {
    /// Role kind → restarts (`coordinator`, `loader`, `shard`, `worker`).
    pub restarts: BTreeMap<String, u64>,
    pub checkpoints_committed: u64,
    /// Training steps done twice because of failures.
    pub steps_replayed: u64,
    /// From each death being noticed to every role serving the next generation, summed.
    pub recovery_secs: f64,
    /// Payload bytes every role sent and received, from their heartbeats
    /// (replaced roles' last counts included; the coordinator's own added by its process).
    pub role_bytes: u64,
    /// The newest committed checkpoint.
    #[serde(skip)]
    pub checkpoint: Option<String>,
}

/// A generation's shard map (see [`Coordinator::view`]).
#[derive(Clone, Debug, Default)]
pub struct View {
    pub complete: bool,
    pub shards_ready: bool,
    pub shards: Vec<String>,
    pub loader: String,
    /// Aggregator processes' addresses, by index (empty: aggregators in process).
    pub aggregators: Vec<String>,
}

/// A generation's data progress, from the checkpoint it restores (read now:
/// later commits may prune it).
fn progress_from(generation: u64, restore: Option<&std::path::Path>) -> Result<DataProgress, String> {
    let manifest = restore.map(sparrow_trainer::checkpoint::read_manifest).transpose().map_err(|e| e.to_string())?;
    Ok(DataProgress::restored(generation, manifest.as_ref()))
}

/// The scheduler and aggregators for `sync = "lazy"` (none otherwise),
/// holding every replica's starting weights: the checkpoint's, or the
/// config's seed's.
fn lazy_for(
    config: &Config,
    workers: usize,
    aggregators: usize,
    restore: Option<&std::path::Path>,
) -> Result<Option<Arc<Lazy>>, ClusterError> {
    if config.cluster.sync != SyncMode::Lazy {
        return Ok(None);
    }
    Lazy::check_mapping(&config.cluster.lazy, workers, aggregators)?;
    let model = match restore {
        Some(dir) => crate::checkpoint::restore_dense(config, dir)?.model,
        None => {
            let layout = sparrow_data::DataLayout::from_config(&config.data);
            crate::worker::new_worker(config, &layout, 0, None)?.model
        }
    };
    let weights = model.params.flat_values().map_err(sparrow_trainer::TrainError::from)?;
    let lr = config.dense_optimizer.learning_rate;
    let (batches, samples) = match restore {
        Some(dir) => {
            let m = sparrow_trainer::checkpoint::read_manifest(dir)?;
            (m.step, m.samples_trained)
        }
        None => (0, 0),
    };
    let lazy = Lazy::new(&config.cluster.lazy, workers, aggregators, lr, weights).after(batches, samples);
    Ok(Some(Arc::new(lazy)))
}

impl LazyLink for Coordinator {
    fn poll(
        &self,
        worker: usize,
        generation: u64,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError> {
        let lazy = self.lazy_in(worker, generation)?;
        lazy.poll(worker, since, finished, wait).map_err(|e| self.woken(generation, e))
    }

    fn contribute(&self, c: crate::lazy::Contribution) -> Result<crate::lazy::Aggregated, ClusterError> {
        faults::point("coordinator.aggregate");
        let generation = c.generation;
        let lazy = self.lazy_in(c.worker, generation)?;
        LazyLink::contribute(&*lazy, c).map_err(|e| self.woken(generation, e))
    }

    fn final_weights(&self, generation: u64) -> Result<FinalWeights, ClusterError> {
        let lazy = self.lazy_in(0, generation)?;
        lazy.final_weights().map_err(|e| self.woken(generation, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(overrides: &[&str]) -> Config {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Config::from_toml_with_overrides("", "test", &overrides).expect("config")
    }

    #[test]
    fn a_silent_role_fails_the_job_naming_it_after_the_timeout() {
        let c = Coordinator::new(
            &config(&[
                "cluster.heartbeat_interval_ms=20",
                "cluster.heartbeat_timeout_ms=150",
                "cluster.max_restarts=0",
            ]),
            2,
            1,
        )
        .expect("coordinator");
        assert_eq!(c.register(RoleKind::Shard, "10.0.0.5:7001".into(), Some(1), None).expect("shard 1").0, 1);
        assert_eq!(c.register(RoleKind::Shard, "10.0.0.4:7001".into(), None, None).expect("shard 0").0, 0);
        assert!(c.register(RoleKind::Shard, "x".into(), None, None).is_err(), "only two shard slots");
        c.register(RoleKind::Loader, "l".into(), None, None).expect("loader");
        c.register(RoleKind::Worker, "w".into(), None, None).expect("worker");
        assert!(c.view(1).shards.iter().all(|a| !a.is_empty()), "every shard registered");
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(400) {
            // Everyone but shard 1 keeps beating.
            for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
                c.heartbeat(kind, i, start.elapsed().as_millis() as u64, 0, 0).expect("beat");
            }
            c.check_liveness();
            if c.state() != JobState::Running {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        match c.state() {
            JobState::Failed(m) => assert!(m.contains("shard 1 at 10.0.0.5:7001 stopped answering"), "{m}"),
            other => panic!("still {other:?} after {:?}", start.elapsed()),
        }
        assert!(start.elapsed() >= Duration::from_millis(140), "reported before the timeout");
        // Waiting workers are released with the reason.
        let contribution =
            Contribution { worker: 0, generation: 1, round: 0, grads: vec![1.0], rows: 1, patience: Duration::ZERO };
        let err = c.sum(contribution).expect_err("the job failed");
        assert!(err.to_string().contains("shard 1"), "{err}");
    }

    #[test]
    fn a_worker_that_beats_but_makes_no_progress_fails_the_job_naming_it() {
        // The hang of a NaN evaluation: the heartbeat thread beats on while
        // the worker's loop is stuck. Worker 0 progresses, worker 1 does not.
        let c = Coordinator::new(
            &config(&[
                "cluster.heartbeat_interval_ms=20",
                "cluster.heartbeat_timeout_ms=5000",
                "cluster.progress_timeout_ms=300",
                "cluster.max_restarts=0",
            ]),
            1,
            2,
        )
        .expect("coordinator");
        c.register(RoleKind::Shard, "s".into(), None, None).expect("shard");
        c.register(RoleKind::Loader, "l".into(), None, None).expect("loader");
        c.register(RoleKind::Worker, "10.0.0.7:9101".into(), Some(0), None).expect("worker 0");
        c.register(RoleKind::Worker, "10.0.0.8:9101".into(), Some(1), None).expect("worker 1");
        let start = Instant::now();
        let mut steps = 0;
        while start.elapsed() < Duration::from_millis(1500) && c.state() == JobState::Running {
            steps += 1;
            c.heartbeat(RoleKind::Shard, 0, 0, 0, 0).expect("beat");
            c.heartbeat(RoleKind::Loader, 0, 0, 0, 0).expect("beat");
            c.heartbeat(RoleKind::Worker, 0, steps, 0, 0).expect("beat");
            c.heartbeat(RoleKind::Worker, 1, 7, 0, 0).expect("beat");
            c.check_liveness();
            std::thread::sleep(Duration::from_millis(20));
        }
        match c.state() {
            JobState::Failed(m) => {
                assert!(m.contains("worker 1 at 10.0.0.8:9101") && m.contains("no progress"), "{m}");
                assert!(m.contains("cluster.progress_timeout_ms"), "{m}");
            }
            other => panic!("still {other:?} after {:?}", start.elapsed()),
        }
        assert!(start.elapsed() >= Duration::from_millis(290), "reported before the timeout");
    }

    #[test]
    fn the_job_is_done_when_every_worker_finished() {
        let c = Coordinator::new(&config(&[]), 1, 2).expect("coordinator");
        c.register(RoleKind::Worker, "a".into(), None, None).expect("w0");
        c.register(RoleKind::Worker, "b".into(), None, None).expect("w1");
        c.finish(RoleKind::Worker, 0, None, 1);
        assert_eq!(c.state(), JobState::Running);
        c.finish(RoleKind::Worker, 1, None, 1);
        assert_eq!(c.state(), JobState::Done);
    }

    fn beat_all(c: &Coordinator, generation: u64, except: Option<(RoleKind, usize)>) {
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Shard, 1), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
            if Some((kind, i)) != except {
                c.heartbeat(kind, i, 1, generation, 0).expect("beat");
            }
        }
    }

    /// Within the restart budget a silent role starts the next generation
    /// (the launcher is asked to restart it), its replacement brings the
    /// job back; the death after the budget fails the job naming the key.
    #[test]
    fn a_lost_role_starts_a_generation_until_its_restart_budget_is_spent() {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let c = Coordinator::new(
            &config(&[
                "cluster.heartbeat_interval_ms=20",
                "cluster.heartbeat_timeout_ms=100",
                "cluster.max_restarts=1",
            ]),
            2,
            1,
        )
        .expect("coordinator")
        .with_events(move |e| sink.lock().push(serde_json::to_string(e).expect("json")));
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Shard, 1), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
            let (_, generation) = c.register(kind, format!("{}-{i}", kind.name()), Some(i), None).expect("register");
            assert_eq!(generation.number, 1);
        }
        beat_all(&c, 1, None);
        assert!(c.view(1).complete);
        // Shard 1 goes silent.
        let start = Instant::now();
        while c.generation().number == 1 {
            assert!(start.elapsed() < Duration::from_secs(5), "never noticed");
            beat_all(&c, 1, Some((RoleKind::Shard, 1)));
            c.check_liveness();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(c.state(), JobState::Running, "recovered, not failed");
        assert!(events.lock().iter().any(|e| e.contains("\"lost\"") && e.contains("\"shard\"")), "{:?}", events.lock());
        assert!(!c.view(2).complete, "the old roles serve generation 1");
        // Its replacement registers; every role serves generation 2.
        let (_, generation) = c.register(RoleKind::Shard, "shard-1b".into(), Some(1), None).expect("replacement");
        assert_eq!(generation.number, 2);
        beat_all(&c, 2, None);
        assert!(c.view(2).complete);
        assert!(events.lock().iter().any(|e| e.contains("\"resumed\"")), "{:?}", events.lock());
        let report = c.recovery_report();
        assert_eq!(report.restarts["shard"], 1);
        // A second death of the same shard is past the budget.
        c.lost(RoleKind::Shard, 1, "exited (its process died)");
        match c.state() {
            JobState::Failed(m) => assert!(m.contains("shard 1") && m.contains("cluster.max_restarts = 1"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    /// A gradient round of an abandoned generation is refused; a worker
    /// waiting in one is woken when the next generation starts.
    #[test]
    fn a_new_generation_releases_waiting_rounds_and_refuses_stale_ones() {
        let c = Arc::new(Coordinator::new(&config(&[]), 1, 2).expect("coordinator"));
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0), (RoleKind::Worker, 1)] {
            c.register(kind, "a".into(), Some(i), None).expect("register");
        }
        let waiting = {
            let c = c.clone();
            std::thread::spawn(move || {
                c.sum(Contribution {
                    worker: 0,
                    generation: 1,
                    round: 0,
                    grads: vec![1.0],
                    rows: 1,
                    patience: Duration::from_secs(60),
                })
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        c.lost(RoleKind::Worker, 1, "exited (its process died)");
        let err = waiting.join().expect("thread").expect_err("released");
        assert!(err.may_be_a_death(), "{err}");
        let stale =
            Contribution { worker: 0, generation: 1, round: 0, grads: vec![1.0], rows: 1, patience: Duration::ZERO };
        assert!(matches!(c.sum(stale), Err(ClusterError::StaleGeneration { .. })));
    }

    /// A role restarted from outside (Kubernetes) registers again before its
    /// silence was noticed: that is its death, and the job's next generation.
    #[test]
    fn a_role_registering_again_starts_the_next_generation() {
        let c = Coordinator::new(&config(&[]), 1, 1).expect("coordinator");
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
            c.register(kind, "a".into(), Some(i), None).expect("register");
        }
        let (index, generation) = c.register(RoleKind::Shard, "b".into(), Some(0), None).expect("again");
        assert_eq!((index, generation.number), (0, 2));
        assert_eq!(c.recovery_report().restarts["shard"], 1);
        assert_eq!(c.view(2).shards, ["b"], "the new address is the shard map");
        // Without a budget the slot is simply taken.
        let strict = Coordinator::new(&config(&["cluster.max_restarts=0"]), 1, 1).expect("coordinator");
        strict.register(RoleKind::Shard, "a".into(), Some(0), None).expect("register");
        let err = strict.register(RoleKind::Shard, "b".into(), Some(0), None).expect_err("taken");
        assert!(err.to_string().contains("already registered"), "{err}");
    }

    /// The launcher's notice that a process died may arrive after its
    /// replacement registered (the two travel different ways): that death
    /// was counted once, when the slot was taken again.
    #[test]
    fn a_death_notice_after_the_replacement_registered_counts_once() {
        let c = Coordinator::new(&config(&["cluster.max_restarts=1"]), 1, 1).expect("coordinator");
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
            c.register_process(kind, "a".into(), Some(i), None, 100 + i as u32).expect("register");
        }
        c.register_process(RoleKind::Shard, "b".into(), Some(0), None, 200).expect("replacement");
        c.lost_process(RoleKind::Shard, 0, 100, "exited (its process died)");
        assert_eq!(c.state(), JobState::Running, "one death, within the budget");
        assert_eq!(c.recovery_report().restarts["shard"], 1);
        assert_eq!(c.view(2).shards, ["b"], "the replacement keeps its slot");
        // The replacement's own death is the second one.
        c.lost_process(RoleKind::Shard, 0, 200, "exited (its process died)");
        assert!(matches!(c.state(), JobState::Failed(_)), "{:?}", c.state());
    }
}
