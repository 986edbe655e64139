//! The interfaces roles call each other through. The in-process transport is
//! a direct call on the role itself (`ShardServer` implements
//! [`ShardService`], `LoaderServer` implements [`LoaderService`]); the gRPC
//! clients in [`crate::grpc`] implement the same traits.

use crate::generation::Generation;
use crate::messages::{Mode, WorkerBatch};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    #[error("shard {shard}: batch {batch_id} is not queued (never sent, or already pulled/pushed)")]
    UnknownBatch { shard: usize, batch_id: u64 },
    #[error("shard {shard}: batch {batch_id}: {what}: got {found} floats, expected {expected}")]
    WrongSize { shard: usize, batch_id: u64, what: &'static str, expected: usize, found: usize },
    #[error("shard {shard}: {source}")]
    Table { shard: usize, source: sparrow_embedding::TableError },
    /// A call to another role failed: `peer` names it (`shard 1 at 10.0.0.5:7001`).
    #[error("{peer}: {method}: {message}")]
    Rpc { peer: String, method: &'static str, message: String },
    #[error("{peer}: {method}: a {bytes}-byte message is too large: the cap is cluster.max_message_bytes = {limit}")]
    TooLarge { peer: String, method: &'static str, bytes: usize, limit: usize },
    #[error("{peer}: unreachable after {waited_ms} ms of retries: {message}")]
    Unreachable { peer: String, waited_ms: u64, message: String },
    #[error("malformed message from {peer}: {what}")]
    Malformed { peer: String, what: String },
    /// The loader's reading thread stopped on this error (shared by every
    /// worker that asks for a batch after it).
    #[error("the loader stopped: {0}")]
    Loader(std::sync::Arc<ClusterError>),
    /// The coordinator's verdict on the job, as every role receives it: the
    /// text of a failure that happened in another role (another process),
    /// naming that role.
    #[error("the job failed: {0}")]
    JobFailed(String),
    /// This role lost the coordinator (no answer past the heartbeat
    /// timeout) and could not rejoin within `cluster.connect_timeout_ms`
    /// more: a restart registers again (exit code [`EXIT_REJOIN`]).
    #[error("{0} (a restart of this role registers again and rejoins the job)")]
    CoordinatorLost(String),
    #[error("{0}")]
    Setup(String),
    #[error("interrupted (Ctrl-C): every role was stopped")]
    Interrupted,
    /// `sparrow launch` was stopped by a signal and ended the job as its
    /// data's end would: every batch read was trained and checkpointed.
    #[error("stopped by a signal: the training data ended here and the job checkpointed ({0}); continue with --resume")]
    Stopped(String),
    /// A request of an attempt the job gave up (a role died; every role went
    /// back to the last committed checkpoint).
    #[error("{peer}: {what} belongs to generation {found}, this role serves generation {serving}")]
    StaleGeneration { peer: String, what: String, found: Generation, serving: Generation },
    /// This role's attempt was given up while it worked: the job goes on in
    /// `generation`, from the last committed checkpoint.
    #[error("the job moved to generation {generation} (a role died): going back to the last checkpoint")]
    GenerationChanged { generation: Generation },
    #[error(transparent)]
    Data(#[from] sparrow_data::DataError),
    #[error(transparent)]
    Train(#[from] sparrow_trainer::TrainError),
    #[error(transparent)]
    Model(#[from] sparrow_model::ModelError),
    #[error(transparent)]
    Config(#[from] sparrow_core::config::ConfigError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

/// The exit code of a role that lost its peers and gave up waiting
/// (EX_TEMPFAIL): not a failure of the job; restarted, the role rejoins.
pub const EXIT_REJOIN: u8 = 75;

impl ClusterError {
    /// The process's exit code for this error: [`EXIT_REJOIN`] where a
    /// peer could not be reached (restart the role), 2 otherwise (the job
    /// or its input is wrong: a restart would fail the same way).
    pub fn exit_code(&self) -> u8 {
        match self {
            ClusterError::CoordinatorLost(_) | ClusterError::Unreachable { .. } => EXIT_REJOIN,
            _ => 2,
        }
    }

    /// Whether this error may be the symptom of another role's death (a
    /// peer gone, a request of an abandoned attempt): a role that gets it
    /// waits for the job's next generation before calling it a failure.
    pub fn may_be_a_death(&self) -> bool {
        match self {
            ClusterError::Rpc { .. }
            | ClusterError::Unreachable { .. }
            | ClusterError::UnknownBatch { .. }
            | ClusterError::StaleGeneration { .. }
            | ClusterError::GenerationChanged { .. } => true,
            ClusterError::Loader(inner) => inner.may_be_a_death(),
            ClusterError::Train(sparrow_trainer::TrainError::DenseSync(e)) => {
                e.downcast_ref::<ClusterError>().is_some_and(ClusterError::may_be_a_death)
            }
            _ => false,
        }
    }
}

/// Rows exported from a shard: keys and their full rows, and where to go on.
#[derive(Clone, Debug, Default)]
pub struct ExportPage {
    pub keys: Vec<u64>,
    pub rows: Vec<f32>,
    /// Each row's last use, in the shard's lookup clock (`ttl_steps`).
    pub last_uses: Vec<u64>,
    /// The shard's feature-filter state (clock, admission sketches): on
    /// the first page only.
    pub filters: Option<sparrow_embedding::FilterState>,
    pub next: Option<(usize, usize)>,
}

/// A shard's table counters (rows, SSD tier, feature filters).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ShardReport {
    pub rows: u64,
    pub cached_rows: u64,
    /// `None` for a table in memory.
    pub tier: Option<sparrow_embedding::TierStats>,
    pub filters: sparrow_embedding::FilterStats,
    /// `cluster.mode = "collocated"`: the second level's counters.
    pub second_level: Option<crate::messages::SecondLevelStats>,
}

impl ShardReport {
    pub fn of(table: &sparrow_embedding::EmbeddingTable) -> ShardReport {
        ShardReport {
            rows: table.len() as u64,
            cached_rows: table.cached_rows() as u64,
            tier: table.tier_stats(),
            filters: table.filter_stats(),
            second_level: None,
        }
    }

    /// The counters of several shards, summed.
    pub fn sum(reports: &[ShardReport]) -> ShardReport {
        let mut total = ShardReport::default();
        for r in reports {
            total.rows += r.rows;
            total.cached_rows += r.cached_rows;
            if let Some(t) = r.tier {
                *total.tier.get_or_insert_default() += t;
            }
            total.filters += r.filters;
            if let Some(l2) = r.second_level {
                let t = total.second_level.get_or_insert_default();
                t.passes_staged = t.passes_staged.max(l2.passes_staged);
                t.passes_flushed = t.passes_flushed.max(l2.passes_flushed);
                t.rows_from_l1 += l2.rows_from_l1;
                t.rows_initialised += l2.rows_initialised;
                t.rows_flushed += l2.rows_flushed;
                t.peak_rows += l2.peak_rows;
                t.l1_reads_during_pass += l2.l1_reads_during_pass;
                t.staging_secs += l2.staging_secs;
                t.flush_secs += l2.flush_secs;
            }
        }
        total
    }

    /// As `train`'s JSON reports a table.
    pub fn table_report(&self) -> sparrow_trainer::run::TableReport {
        sparrow_trainer::run::TableReport::new(self.tier, self.cached_rows, self.filters)
    }
}

/// An embedding shard as seen by the loader and the workers.
pub trait ShardService: Send + Sync {
    /// Queues a batch's keys owned by this shard (unique, in the order the
    /// rows will be returned).
    /// `newest_record_ms`: a stream's batch, its newest record's time (the
    /// shard's event time for `embedding.ttl_secs`).
    fn enqueue(
        &self,
        batch_id: u64,
        keys: Vec<u64>,
        mode: Mode,
        newest_record_ms: Option<i64>,
    ) -> Result<(), ClusterError>;
    /// The rows of a queued batch, `keys × dim`, in enqueue order. A training
    /// batch inserts unseen keys; an evaluation batch reads them as their
    /// initial vectors and is forgotten after the pull.
    fn pull(&self, batch_id: u64) -> Result<Vec<f32>, ClusterError>;
    /// Applies the summed gradients of a pulled training batch (enqueue
    /// order) once per key, at the rows' learning rate times `lr_scale` (the
    /// step's `[train.schedule]` factor; 1 without one), then forgets the
    /// batch. No gradients at all for a batch that has keys here is
    /// [`release`](Self::release).
    fn push(&self, batch_id: u64, grads: Vec<f32>, lr_scale: f32) -> Result<(), ClusterError>;
    /// Forgets a pulled training batch without updating a row: its worker
    /// skipped it (`train.on_non_finite = "skip_batch"`). On the wire it is
    /// a push with no gradients.
    fn release(&self, batch_id: u64) -> Result<(), ClusterError> {
        self.push(batch_id, Vec::new(), 1.0)
    }
    /// The shard table's counters: rows held, SSD tier, feature filters.
    fn report(&self) -> Result<ShardReport, ClusterError>;
    /// Its second level (`cluster.mode = "collocated"`, S1), if it serves
    /// one: a capability of its own.
    fn pass_staging(&self) -> Option<&dyn PassStaging> {
        None
    }
    /// In the caller's process (a node's own shard): its rows cross no network.
    fn is_local(&self) -> bool {
        false
    }
    /// A page of at most `max_rows` full rows (vector + optimizer state) from
    /// `cursor`, and the cursor after it (`None`: done).
    fn export(&self, cursor: (usize, usize), max_rows: usize) -> Result<ExportPage, ClusterError>;
    /// Writes this shard's part of a checkpoint and, if asked, of a
    /// serving export, in one cut: no update runs meanwhile.
    fn write_part(&self, generation: Generation, request: &PartRequest) -> Result<PartWritten, ClusterError>;
}

/// What a shard writes in one cut ([`ShardService::write_part`]).
#[derive(Clone, Debug, Default)]
pub struct PartRequest {
    /// The checkpoint's staging directory (none: no checkpoint part, a
    /// serving export's cut alone).
    pub checkpoint: Option<std::path::PathBuf>,
    /// The checkpoint part holds the rows used after this clock (none: every row).
    pub since: Option<u64>,
    /// A serving export's part: its staging directory, and the clock after
    /// which a row was used to be in it (none: every row).
    pub export: Option<(std::path::PathBuf, Option<u64>)>,
}

/// A shard's second level (`cluster.mode = "collocated"`, S1.1): the loader
/// stages each pass into it before the pass's batches train.
pub trait PassStaging: Send + Sync {
    /// Copies the rows of `keys` (this shard's IDs of pass `pass`, or of one
    /// of its batches) into the second level, for the training batches `batches`.
    fn stage(&self, pass: u64, keys: Vec<u64>, batches: Vec<u64>) -> Result<(), ClusterError>;
}

/// A shard's reply to [`ShardService::write_part`].
#[derive(Clone, Debug)]
pub struct PartWritten {
    /// The checkpoint's part (none: not asked for).
    pub written: Option<sparrow_trainer::checkpoint::WrittenPart>,
    /// The serving export's part (none: not asked for).
    pub export: Option<sparrow_trainer::export::RowsPart>,
    pub secs: f64,
    pub dim: usize,
    pub row_len: usize,
    /// Rows the shard holds (the part may hold fewer: incremental).
    pub total_rows: u64,
}

/// The loader as seen by the workers: a queue of batches each worker pulls
/// from at its own pace (S2.2), training data first, then evaluation data.
pub trait LoaderService: Send + Sync {
    /// The next batch of the phase, `None` once its data is exhausted.
    /// `generation`: the worker's; a loader serving another refuses.
    fn next_batch(
        &self,
        worker: usize,
        mode: Mode,
        generation: Generation,
    ) -> Result<Option<WorkerBatch>, ClusterError>;

    /// The next training batch as [`next_batch`](Self::next_batch), or
    /// [`Polled::Waiting`] when a loader across a network has none yet
    /// (its data has not ended: an idle stream): a wait that is alive, not a
    /// call that runs into its deadline. One in this process blocks instead.
    fn poll_batch(&self, worker: usize, generation: Generation) -> Result<Polled, ClusterError> {
        Ok(self.next_batch(worker, Mode::Train, generation)?.map_or(Polled::End, |b| Polled::Batch(Box::new(b))))
    }

    /// Whether generation `generation`'s training batches, all handed
    /// out, ended at an epoch's end (`data.validation` validates there):
    /// not at `train.max_steps`, nor on a stop. Asked once a worker's
    /// training data ended.
    fn training_ended_at_epoch_end(&self, generation: Generation) -> Result<bool, ClusterError>;

    /// The loader's round queue (`sync = "round"`), if it serves one.
    fn round_queue(&self) -> Option<&dyn RoundQueueService> {
        None
    }
}

/// A loader's answer to [`LoaderService::poll_batch`].
#[derive(Debug)]
pub enum Polled {
    Batch(Box<WorkerBatch>),
    /// The phase's data is exhausted.
    End,
    /// No batch yet; the loader is alive and its data goes on.
    Waiting,
}

/// A loader's round queue (`sync = "round"`, S2.1–S2.2), a capability of
/// its own: only a loader that serves one has it.
pub trait RoundQueueService: Send + Sync {
    /// The next training item of `round`, `None` once the round's queue is
    /// empty for this worker (or the data ended).
    fn next_round_item(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
    ) -> Result<Option<WorkerBatch>, ClusterError>;

    /// The same within a bounded wait: [`Polled::Waiting`] while the round
    /// waits on an idle stream (a remote queue, whose call has a deadline).
    /// In one process, the wait itself.
    fn poll_round_item(&self, worker: usize, generation: Generation, round: u64) -> Result<Polled, ClusterError> {
        Ok(self.next_round_item(worker, generation, round)?.map_or(Polled::End, |b| Polled::Batch(Box::new(b))))
    }
}

/// What a role's server answers with: the role object of the generation it
/// serves, swapped when the job moves to a new one (none while it restores).
pub struct Serving<T> {
    what: String,
    current: parking_lot::RwLock<Option<std::sync::Arc<T>>>,
}

impl<T> Serving<T> {
    /// `what` names the role in the error a request gets while it restores.
    pub fn new(what: String) -> Self {
        Serving { what, current: parking_lot::RwLock::new(None) }
    }

    pub fn get(&self) -> Result<std::sync::Arc<T>, ClusterError> {
        self.current.read().clone().ok_or_else(|| ClusterError::Rpc {
            peer: self.what.clone(),
            method: "serve",
            message: "restoring the last checkpoint, not serving yet".into(),
        })
    }

    /// Replaces what is served; returns the previous one.
    pub fn set(&self, next: Option<std::sync::Arc<T>>) -> Option<std::sync::Arc<T>> {
        std::mem::replace(&mut *self.current.write(), next)
    }
}
