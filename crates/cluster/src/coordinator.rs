//! The coordinator role (S0.5): membership, the shard map, heartbeats and
//! liveness, the job's state, the workers' gradient rounds (S0.6), the
//! job's checkpoints and its recovery. Every other role registers here first
//! and receives the job's config. Transport-free: `grpc::coordinator` serves
//! it over the network.
//!
//! It is made of parts, each a type with its own state and at most two
//! locks of its own: [`membership`] (slots, heartbeats, liveness),
//! [`generations`] (attempts, restarts, committed checkpoints), [`hub`]
//! (where the sync modes meet), [`commit`] (checkpoint cuts, data progress,
//! exports). [`Coordinator`] holds them and the job's state, and says the
//! lock order.
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
//! **Checkpoints.** Every `checkpoint.every_steps` steps, at the steps
//! each commit names for `checkpoint.every_secs` (its reply carries the
//! next one), and at the end, each worker, its updates pushed, calls [`Coordinator::checkpoint`]; when
//! all have, the coordinator asks every shard to write its part into a
//! staging directory (worker 0 wrote the dense part there), checks each
//! file's size and checksum, and commits the version (manifest, then
//! `LATEST`, both by rename). The workers go on only after the commit, so
//! the version is a cut: every shard's rows, the dense state and the data
//! position at the same step, no update in flight.

mod checks;
mod commit;
mod generations;
mod hub;
mod membership;
mod per_generation;

use crate::restart_budget::RestartBudget;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lock_order::{OrderedMutex, Rank};
use serde::Serialize;
use sparrow_core::Config;
use sparrow_core::config::SyncMode;

use self::checks::check_cluster_config;
use self::commit::Commits;
use self::generations::{Adopted, Generations, Started};
use self::hub::SyncHub;
use self::membership::{Membership, Timeouts};
use crate::checkpoint::{CheckpointSink, WorkerCut};
use crate::faults;
use crate::generation::Generation;
use crate::lazy::{Backup, BackupCommitter, FinalWeights, Instruction, Lazy, LazyLink};
use crate::rounds::{MergedRound, RoundUpdate};
use crate::sync::{Contribution, RoundReply};
use crate::transport::{ClusterError, ShardService};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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

/// One role of the job: its kind and its slot among that kind's
/// (displayed as the errors and logs name it: "worker 1").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RoleId {
    pub kind: RoleKind,
    pub index: usize,
}

impl RoleId {
    pub fn new(kind: RoleKind, index: usize) -> Self {
        RoleId { kind, index }
    }
}

impl std::fmt::Display for RoleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind.name(), self.index)
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
pub struct Attempt {
    pub number: Generation,
    pub restore: Option<PathBuf>,
    /// The newest checkpoint the job committed (a role that outlives a
    /// coordinator hands it to the next one).
    pub committed: Option<PathBuf>,
}

/// What a role that outlived a coordinator tells the next one when it
/// registers again.
#[derive(Clone, Debug, Default)]
pub struct Known {
    pub generation: Generation,
    pub committed: Option<PathBuf>,
    /// A worker's step.
    pub step: u64,
}

/// What the coordinator reports as it goes (`sparrow launch` reads them
/// from its stdout and sums them over coordinator restarts).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A new generation: `replayed` steps will be trained again.
    Generation { number: Generation, reason: String, replayed: u64, restore: Option<String> },
    /// A worker that outlived the coordinator had trained `steps` more steps
    /// than the generation it goes back from was known to have.
    Replayed { steps: u64 },
    /// A role stopped answering: its process must be restarted.
    Lost { role: RoleKind, index: usize },
    /// Every role serves the new generation, `secs` after the death was
    /// noticed (`planned`: after training went on from a validation point).
    Resumed {
        number: Generation,
        secs: f64,
        #[serde(default)]
        planned: bool,
    },
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

/// The coordinator: the job's parts, each with its own state and locks
/// (see each module), and the calls that go from one to the next.
///
/// **Lock order.** `generations` (its `recovery` lock) may be held while
/// the sync hub's and the commits' rendezvous and per-generation slots are
/// advanced; those are leaves. `members`, `state`, the hub's `backups` and
/// the commits' `exports` are leaves too: no other lock is taken while one
/// is held. No disk I/O runs under any lock an RPC waits for: manifests and
/// checkpoints are read before a part is locked, or after, by the caller
/// that starts a generation. Every one of these locks is a
/// [`lock_order::OrderedMutex`](crate::lock_order::OrderedMutex) ranked as
/// said here (the lazy scheduler's state ranks between: it reads its
/// conditions and backup targets under it): a thread that takes them out
/// of order panics naming both, in every test that runs the coordinator.
/// `crates/cli/tests/locks.rs` checks that no struct takes more than three
/// locks and that none is held across disk I/O, a network call or a join.
pub struct Coordinator {
    config: Config,
    config_toml: String,
    num_shards: usize,
    num_workers: usize,
    timeouts: Timeouts,
    state: OrderedMutex<JobState>,
    members: Membership,
    generations: Generations,
    hub: SyncHub,
    commits: Commits,
    dialer: Option<Arc<dyn ShardDialer>>,
    events: Box<dyn Fn(&Event) + Send + Sync>,
    /// How many times the job's generation or state changed: the roles'
    /// doorbell (`WaitChange`), so that they hear a change at once.
    changes: tokio::sync::watch::Sender<u64>,
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
        self.hub.aggregators()
    }

    pub fn new(config: &Config, num_shards: usize, num_workers: usize) -> Result<Coordinator, ClusterError> {
        if num_shards == 0 || num_workers == 0 {
            return Err(ClusterError::Setup("a job needs at least one shard and one worker".into()));
        }
        check_cluster_config(config)?;
        let config_toml =
            toml::to_string(config).map_err(|e| ClusterError::Setup(format!("serializing the config: {e}")))?;
        let start = match sparrow_trainer::checkpoint::resume_dir(config)? {
            Some(dir) => {
                let step = sparrow_trainer::checkpoint::read_manifest(&dir)?.step;
                Some((dir, step))
            }
            None => None,
        };
        let restore = start.as_ref().map(|(d, _)| d.as_path());
        let connect = Duration::from_millis(config.cluster.connect_timeout_ms);
        Ok(Coordinator {
            config: config.clone(),
            config_toml,
            num_shards,
            num_workers,
            timeouts: Timeouts {
                heartbeat: Duration::from_millis(config.cluster.heartbeat_timeout_ms),
                progress: Duration::from_millis(config.cluster.progress_timeout_ms),
                connect,
                registration: Instant::now() + connect,
            },
            state: OrderedMutex::new(Rank::Leaf, "coordinator.state", JobState::Running),
            members: Membership::new(num_shards, num_workers),
            hub: SyncHub::new(config, num_workers, 1, Generation::FIRST, restore)?,
            commits: Commits::new(config, num_workers, Generation::FIRST, restore),
            generations: Generations::new(start),
            dialer: None,
            changes: tokio::sync::watch::Sender::new(0),
            events: Box::new(|_| {}),
        })
    }

    /// `sync = "lazy"` with `k` aggregators in this process (worker →
    /// aggregator by `cluster.lazy.aggregator_of`, checked here).
    pub fn with_aggregators(mut self, k: usize) -> Result<Self, ClusterError> {
        let attempt = self.generations.attempt();
        self.hub = SyncHub::new(&self.config, self.num_workers, k, attempt.number, attempt.restore.as_deref())?;
        Ok(self)
    }

    /// `sync = "lazy"` with `k` aggregator processes (`sparrow aggregator`),
    /// which register like any role and send the scheduler partial sums.
    /// Other modes have no aggregators.
    pub fn with_aggregator_processes(self, k: usize) -> Result<Self, ClusterError> {
        let this = self.with_aggregators(k)?;
        if this.config.cluster.sync == SyncMode::Lazy {
            this.members.expect_aggregators(k);
        }
        Ok(this)
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

    pub fn generation(&self) -> Attempt {
        self.generations.attempt()
    }

    /// Fails the job (the first reason wins) and wakes every waiting worker.
    pub fn fail(&self, reason: String) {
        let mut state = self.state.lock();
        if *state != JobState::Running {
            return;
        }
        tracing::error!("job failed: {reason}");
        *state = JobState::Failed(reason.clone());
        drop(state);
        self.hub.fail(&reason);
        self.commits.fail(&reason);
        self.ring();
    }

    /// Starts the next generation: every role goes back to the last
    /// committed checkpoint (after a failure: said as a warning).
    fn start_generation(&self, reason: String) {
        let started = self.generations.next(reason, false, |n| self.advance_parts(n));
        self.after_generation(started, true);
    }

    /// Starts the next generation as planned (`data.validation`: training
    /// goes on after a validation point), said as information.
    fn plan_generation(&self, reason: String) {
        let started = self.generations.next(reason, true, |n| self.advance_parts(n));
        self.after_generation(started, false);
    }

    /// Under the generations lock: the parts release the old generation's waiters.
    fn advance_parts(&self, generation: Generation) {
        self.hub.advance(generation);
        self.commits.advance(generation);
    }

    /// Outside every lock: the parts read what the new generation restores.
    fn after_generation(&self, s: Started, after_a_failure: bool) {
        let restore = s.restore.as_ref().map(|d| d.display().to_string());
        let said = format!(
            "generation {}: {}; every role goes back to {}",
            s.number,
            s.reason,
            restore.as_deref().unwrap_or("the job's start")
        );
        if after_a_failure {
            tracing::warn!("{said}");
        } else {
            tracing::info!("{said}");
        }
        (self.events)(&Event::Generation { number: s.number, reason: s.reason, replayed: s.replayed, restore });
        self.commits.restore_progress(s.number, s.restore.as_deref());
        // A best model committed just before a death is kept now.
        if let Some(dir) = s.restore.as_deref()
            && let Err(e) = crate::epochs::keep_best(&self.config, dir)
        {
            self.fail(format!("keeping the best model of {}: {e}", dir.display()));
        }
        self.hub.rebuild(&self.config, s.number, s.restore.as_deref());
        self.ring();
    }

    /// The job's generation or state changed: every role's doorbell rings.
    fn ring(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// The doorbell: how many changes so far, and a way to wait for the next.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Role `role` died (its process exited, or it went silent): its slot
    /// waits for a replacement and every role goes back to the last
    /// committed checkpoint, unless its restart budget is spent (then the
    /// job fails). Idempotent until the replacement registers.
    pub fn lost(&self, role: RoleId, reason: &str) {
        self.lost_process(role, 0, reason);
    }

    /// `lost` for process `pid` (0: whichever holds the slot). A notice
    /// about a process whose replacement already registered is stale: its
    /// death was counted when the slot was taken again.
    pub fn lost_process(&self, role: RoleId, pid: u32, reason: &str) {
        if self.state() != JobState::Running || !self.members.vacate(role, pid) {
            return;
        }
        let what = format!("{role} {reason}");
        let counted = self.generations.count_restart(role, || RestartBudget::new(&self.config));
        if let Err(spent) = counted {
            self.fail(format!("{what}; {spent}: the last committed checkpoint is intact"));
            return;
        }
        self.start_generation(what);
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
    ) -> Result<(usize, Attempt), ClusterError> {
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
    ) -> Result<(usize, Attempt), ClusterError> {
        if let JobState::Failed(reason) = self.state() {
            return Err(ClusterError::JobFailed(reason));
        }
        let n = self.members.slot_count(kind);
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
            None => self.members.free_slot(kind).ok_or_else(|| {
                ClusterError::Setup(format!(
                    "all {n} {} slots are taken (--shards/--workers of the coordinator)",
                    kind.name()
                ))
            })?,
        };
        let role = RoleId::new(kind, slot);
        if self.members.is_taken(role) {
            if self.config.cluster.max_restarts == 0 {
                return Err(ClusterError::Setup(format!("{role} is already registered")));
            }
            self.lost(role, "registered again (it was restarted)");
            if let JobState::Failed(reason) = self.state() {
                return Err(ClusterError::JobFailed(reason));
            }
        }
        if let Some(known) = known {
            self.adopt(role, known);
        }
        tracing::info!("{role} registered at {address}");
        self.members.take(role, address, pid);
        Ok((slot, self.generation()))
    }

    /// A role that outlived the previous coordinator (see [`Generations::adopt`]).
    fn adopt(&self, role: RoleId, known: Known) {
        // Read before any lock is taken.
        let committed = known.committed.and_then(|dir| {
            let step = sparrow_trainer::checkpoint::read_manifest(&dir).ok()?.step;
            Some((dir, step))
        });
        let adopted = Adopted { kind: role.kind, generation: known.generation, committed, step: known.step };
        let reason = format!("the coordinator restarted ({role} registered again)");
        let (started, replayed) = self.generations.adopt(adopted, reason, |n| self.advance_parts(n));
        if replayed > 0 {
            (self.events)(&Event::Replayed { steps: replayed });
        }
        if let Some(started) = started {
            self.after_generation(started, true);
        }
    }

    /// A role is alive; `progress` is its work count (see
    /// `HeartbeatRequest`), `ready` the generation it serves, `step` a
    /// worker's step in it.
    pub fn heartbeat(
        &self,
        role: RoleId,
        progress: u64,
        ready: Generation,
        step: u64,
    ) -> Result<(JobState, Attempt), ClusterError> {
        self.members.beat(role, progress, ready)?;
        if role.kind == RoleKind::Worker {
            self.generations.worker_step(ready, step);
        }
        let generation = self.generations.current();
        if self.generations.recovering()
            && self.members.all_ready(generation)
            && let Some((secs, planned)) = self.generations.resumed(generation)
        {
            let since = if planned { "it was planned" } else { "the death was noticed" };
            tracing::info!("generation {generation}: every role is back, {secs:.3} s after {since}");
            (self.events)(&Event::Resumed { number: generation, secs, planned });
        }
        Ok((self.state(), self.generation()))
    }

    /// A role's traffic so far (`bytes`) and its probe address, from a heartbeat.
    pub fn traffic(&self, role: RoleId, bytes: u64, probe: &str) {
        self.members.traffic(role, bytes, probe);
    }

    /// Payload bytes every role reported so far, replaced ones included.
    pub fn role_bytes(&self) -> u64 {
        self.members.role_bytes()
    }

    /// Every registered role's bytes per second (S4.2 utilisation).
    pub fn byte_rates(&self) -> Vec<f64> {
        self.members.byte_rates()
    }

    /// The roles the scheduler probes (`cluster.lazy.probe_roles`), finished workers aside.
    pub fn probe_targets(&self, all: bool) -> Vec<crate::lazy::ProbeTarget> {
        self.members.probe_targets(all, self.generations.current())
    }

    /// A worker's last step in an earlier `generation` (reported once it
    /// moved on): the steps past what was counted at the rollback were
    /// trained twice.
    pub fn previous_step(&self, kind: RoleKind, generation: Generation, step: u64) {
        if kind == RoleKind::Worker && generation > Generation::NONE {
            let extra = self.generations.late_step(generation, step);
            if extra > 0 {
                (self.events)(&Event::Replayed { steps: extra });
            }
        }
    }

    /// The shard map and the loader's address of `generation`, and whether
    /// they serve it.
    pub fn view(&self, generation: Generation) -> View {
        self.members.view(generation)
    }

    /// A worker is done in `generation` (or a role failed); the job is done
    /// once every worker is done in the current one.
    pub fn finish(&self, role: RoleId, error: Option<String>, generation: Generation) {
        if let Some(error) = error {
            self.fail(format!("{role}: {error}"));
            return;
        }
        if role.kind != RoleKind::Worker || generation != self.generations.current() {
            return;
        }
        if self.members.worker_finished(role.index, generation) {
            // `data.validation`: an epoch (or `train.eval_every_steps`
            // steps) validated, training goes on as a generation of its own
            // from its checkpoint (`epochs.rs`); only after one this
            // generation committed (one that trained nothing, as after a
            // stop, ends the job).
            let Attempt { restore, committed, .. } = self.generations.attempt();
            if let Some((step, epoch)) = crate::epochs::after(&self.config, committed.as_deref(), restore.as_deref())
                && self.state() == JobState::Running
            {
                let why = match self.config.train.eval_every_steps.filter(|&n| n > 0) {
                    None => format!("epoch {epoch} validated; epoch {} starts", epoch + 1),
                    Some(_) => format!("step {step} (epoch {epoch}) validated; training goes on"),
                };
                self.plan_generation(why);
                return;
            }
            let mut state = self.state.lock();
            if *state == JobState::Running {
                tracing::info!("all {} workers finished", self.num_workers);
                *state = JobState::Done;
                drop(state);
                self.ring();
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
        let found = self.members.check(&self.timeouts, self.generations.current());
        if let Some(problem) = found.missing {
            self.fail(problem);
            return;
        }
        for (role, problem) in found.lost {
            if self.config.cluster.max_restarts == 0 {
                self.fail(format!("{role} {problem}"));
                return;
            }
            (self.events)(&Event::Lost { role: role.kind, index: role.index });
            self.lost(role, &problem);
        }
    }

    /// A worker's gradients of a round (`sync = "step"`), see [`RoundSum`](crate::sync::RoundSum).
    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        faults::point("coordinator.sum");
        self.hub.sum(c)
    }

    /// The gradient rounds (`sync = "step"`): where a worker asks again for
    /// a round's sum after a `Pending` answer.
    pub fn rounds(&self) -> &crate::sync::RoundSum {
        self.hub.rounds()
    }

    /// A worker's end of a round (`sync = "round"`): waits for every
    /// worker's and returns the merged round.
    pub fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        faults::point("coordinator.merge");
        self.hub.merge_round(u)
    }

    /// Tests: blocks until `n` workers contributed to gradient round `round`.
    pub fn wait_for_contributions(&self, round: u64, n: usize) {
        self.hub.wait_for_contributions(round, n);
    }

    /// Aggregator `p.aggregator`'s partial sum of an instruction (see
    /// [`crate::aggregator`]): blocks until the aggregation is done.
    pub fn contribute_partial(
        &self,
        p: crate::lazy::Partial,
    ) -> Result<(crate::lazy::Aggregated, Arc<Vec<f32>>), ClusterError> {
        faults::point("coordinator.aggregate");
        let generation = p.generation;
        let lazy = self.hub.lazy_in(p.aggregator, generation)?;
        lazy.contribute_partial(p).map_err(|e| self.woken(generation, e))
    }

    /// Starts backing the aggregated weights up (S4.6) when the job runs
    /// lazy aggregation and has a `checkpoint.dir`: the caller writes what
    /// the receiver gets with [`write_backup`](Self::write_backup).
    /// Each backup is also committed as a checkpoint (a cut: the workers of
    /// the aggregation wait until it is), which a failure restarts from.
    pub fn start_backups(self: &Arc<Self>) -> Option<crossbeam_channel::Receiver<Backup>> {
        self.hub.lazy()?;
        self.config.checkpoint.dir.as_ref()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let me = Arc::downgrade(self);
        let committer: BackupCommitter = Arc::new(move |cut| match me.upgrade() {
            Some(coordinator) => coordinator.commit_backup(cut).map(|_| ()).map_err(|e| e.to_string()),
            None => Err("the coordinator is gone".into()),
        });
        self.hub.back_up(tx, committer);
        Some(rx)
    }

    /// The scheduler of the current generation (`sync = "lazy"`).
    pub fn lazy(&self) -> Option<Arc<Lazy>> {
        self.hub.lazy()
    }

    /// A lazy call woken because the job moved on, not because it failed.
    fn woken(&self, generation: Generation, e: ClusterError) -> ClusterError {
        match self.generations.current() {
            now if now != generation => ClusterError::GenerationChanged { generation: now },
            _ => e,
        }
    }

    /// Restarts by role kind, checkpoints committed, steps replayed and
    /// recovery seconds over this coordinator's life.
    pub fn recovery_report(&self) -> RecoveryReport {
        let totals = self.generations.totals();
        let mut restarts: BTreeMap<String, u64> =
            ["coordinator", "loader", "shard", "worker"].iter().map(|k| (k.to_string(), 0)).collect();
        for (kind, n) in totals.restarts {
            *restarts.entry(kind.name().to_string()).or_default() += u64::from(n);
        }
        RecoveryReport {
            restarts,
            checkpoints_committed: totals.checkpoints_committed,
            steps_replayed: totals.steps_replayed,
            recovery_secs: totals.recovery_secs,
            role_bytes: self.role_bytes(),
            checkpoint: totals.committed.map(|d| d.display().to_string()),
        }
    }
}

impl CheckpointSink for Coordinator {
    fn checkpoint(&self, cut: WorkerCut) -> Result<crate::checkpoint::Committed, ClusterError> {
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

impl LazyLink for Coordinator {
    fn poll(
        &self,
        worker: usize,
        generation: Generation,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError> {
        let lazy = self.hub.lazy_in(worker, generation)?;
        lazy.poll(worker, since, finished, wait).map_err(|e| self.woken(generation, e))
    }

    fn contribute(&self, c: crate::lazy::Contribution) -> Result<crate::lazy::Aggregated, ClusterError> {
        faults::point("coordinator.aggregate");
        let generation = c.generation;
        let lazy = self.hub.lazy_in(c.worker, generation)?;
        LazyLink::contribute(&*lazy, c).map_err(|e| self.woken(generation, e))
    }

    fn final_weights(&self, generation: Generation) -> Result<FinalWeights, ClusterError> {
        let lazy = self.hub.lazy_in(0, generation)?;
        lazy.final_weights().map_err(|e| self.woken(generation, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use sparrow_core::Overrides;

    fn config(overrides: &[&str]) -> Config {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Overrides::parse(&overrides).and_then(|o| Config::from_toml("", "test", &o)).expect("config")
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
        assert!(c.view(Generation(1)).shards.iter().all(|a| !a.is_empty()), "every shard registered");
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(400) {
            // Everyone but shard 1 keeps beating.
            for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
                c.heartbeat(RoleId::new(kind, i), start.elapsed().as_millis() as u64, Generation(0), 0).expect("beat");
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
        let contribution = Contribution {
            worker: 0,
            generation: Generation(1),
            round: 0,
            grads: vec![1.0],
            rows: 1,
            patience: Duration::ZERO,
            wait: None,
        };
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
            c.heartbeat(RoleId::new(RoleKind::Shard, 0), 0, Generation(0), 0).expect("beat");
            c.heartbeat(RoleId::new(RoleKind::Loader, 0), 0, Generation(0), 0).expect("beat");
            c.heartbeat(RoleId::new(RoleKind::Worker, 0), steps, Generation(0), 0).expect("beat");
            c.heartbeat(RoleId::new(RoleKind::Worker, 1), 7, Generation(0), 0).expect("beat");
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
        c.finish(RoleId::new(RoleKind::Worker, 0), None, Generation(1));
        assert_eq!(c.state(), JobState::Running);
        c.finish(RoleId::new(RoleKind::Worker, 1), None, Generation(1));
        assert_eq!(c.state(), JobState::Done);
    }

    fn beat_all(c: &Coordinator, generation: Generation, except: Option<RoleId>) {
        for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Shard, 1), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
            if Some(RoleId::new(kind, i)) != except {
                c.heartbeat(RoleId::new(kind, i), 1, generation, 0).expect("beat");
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
            assert_eq!(generation.number, Generation(1));
        }
        beat_all(&c, Generation(1), None);
        assert!(c.view(Generation(1)).complete);
        // Shard 1 goes silent.
        let start = Instant::now();
        while c.generation().number == Generation(1) {
            assert!(start.elapsed() < Duration::from_secs(5), "never noticed");
            beat_all(&c, Generation(1), Some(RoleId::new(RoleKind::Shard, 1)));
            c.check_liveness();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(c.state(), JobState::Running, "recovered, not failed");
        assert!(events.lock().iter().any(|e| e.contains("\"lost\"") && e.contains("\"shard\"")), "{:?}", events.lock());
        assert!(!c.view(Generation(2)).complete, "the old roles serve generation 1");
        // Its replacement registers; every role serves generation 2.
        let (_, generation) = c.register(RoleKind::Shard, "shard-1b".into(), Some(1), None).expect("replacement");
        assert_eq!(generation.number, Generation(2));
        beat_all(&c, Generation(2), None);
        assert!(c.view(Generation(2)).complete);
        assert!(events.lock().iter().any(|e| e.contains("\"resumed\"")), "{:?}", events.lock());
        let report = c.recovery_report();
        assert_eq!(report.restarts["shard"], 1);
        // A second death of the same shard is past the budget.
        c.lost(RoleId::new(RoleKind::Shard, 1), "exited (its process died)");
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
                    generation: Generation(1),
                    round: 0,
                    grads: vec![1.0],
                    rows: 1,
                    patience: Duration::from_secs(60),
                    wait: None,
                })
            })
        };
        // Ordered by the round's state, not by time: the contribution is in.
        c.wait_for_contributions(0, 1);
        c.lost(RoleId::new(RoleKind::Worker, 1), "exited (its process died)");
        // Released by the new generation, which it is told; not refused as
        // stale (that is the answer to an arrival after the change, below).
        let err = waiting.join().expect("thread").expect_err("released");
        assert!(matches!(err, ClusterError::GenerationChanged { generation: Generation(2) }), "{err}");
        let stale = Contribution {
            worker: 0,
            generation: Generation(1),
            round: 0,
            grads: vec![1.0],
            rows: 1,
            patience: Duration::ZERO,
            wait: None,
        };
        assert!(matches!(c.sum(stale), Err(ClusterError::StaleGeneration { .. })));
    }

    /// `launch` reads back every event the coordinator writes, typed; the
    /// JSON names are the ones scripts see.
    #[test]
    fn every_event_reads_back_as_it_was_written() {
        let events = [
            Event::Generation { number: Generation(3), reason: "shard 1 died".into(), replayed: 4, restore: None },
            Event::Replayed { steps: 2 },
            Event::Lost { role: RoleKind::Aggregator, index: 1 },
            Event::Resumed { number: Generation(3), secs: 0.25, planned: false },
            Event::Resumed { number: Generation(4), secs: 0.5, planned: true },
            Event::Committed {
                step: 8,
                dir: "/c/v8".into(),
                bytes: 10,
                secs: 0.5,
                incremental: true,
                shard_mb_per_sec: vec![1.5],
            },
            Event::Report(RecoveryReport { steps_replayed: 4, role_bytes: 99, ..RecoveryReport::default() }),
        ];
        for event in events {
            let json = serde_json::to_string(&event).expect("json");
            assert_eq!(serde_json::from_str::<Event>(&json).expect("read back"), event, "{json}");
        }
        let lost = serde_json::to_string(&Event::Lost { role: RoleKind::Shard, index: 0 }).expect("json");
        assert_eq!(lost, r#"{"lost":{"role":"shard","index":0}}"#);
        let resumed = Event::Resumed { number: Generation(2), secs: 1.0, planned: false };
        let generation = serde_json::to_value(resumed).expect("json");
        assert_eq!(generation["resumed"]["number"], 2, "a generation is a plain number on the wire");
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
        assert_eq!((index, generation.number), (0, Generation(2)));
        assert_eq!(c.recovery_report().restarts["shard"], 1);
        assert_eq!(c.view(Generation(2)).shards, ["b"], "the new address is the shard map");
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
        c.lost_process(RoleId::new(RoleKind::Shard, 0), 100, "exited (its process died)");
        assert_eq!(c.state(), JobState::Running, "one death, within the budget");
        assert_eq!(c.recovery_report().restarts["shard"], 1);
        assert_eq!(c.view(Generation(2)).shards, ["b"], "the replacement keeps its slot");
        // The replacement's own death is the second one.
        c.lost_process(RoleId::new(RoleKind::Shard, 0), 200, "exited (its process died)");
        assert!(matches!(c.state(), JobState::Failed(_)), "{:?}", c.state());
    }
}
