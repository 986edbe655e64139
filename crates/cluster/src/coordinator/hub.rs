//! The sync hub: where the workers' dense updates meet, per sync mode —
//! the gradient rounds (`step`), the round merges (`round`) and the lazy
//! scheduler with its aggregators and backups (`lazy`). Locks: the two
//! rendezvous' and the scheduler's slot (leaves), and `backups`, which is
//! never held while another is taken. A new generation advances the
//! rendezvous and marks the scheduler pending (under the generations
//! lock); the next scheduler is built from the restored checkpoint outside
//! every lock ([`SyncHub::rebuild`]).

use std::path::Path;
use std::sync::Arc;

use crate::lock_order::{OrderedMutex, Rank};
use sparrow_core::Config;
use sparrow_core::config::SyncMode;

use super::per_generation::{OtherGeneration, PerGeneration};
use crate::generation::Generation;
use crate::lazy::{Backup, BackupCommitter, Lazy};
use crate::rounds::{MergedRound, RoundMerge, RoundUpdate};
use crate::sync::{Contribution, RoundReply, RoundSum};
use crate::transport::ClusterError;

/// Where a lazy job's backups go, and what commits each as a checkpoint.
struct Backups {
    sink: crossbeam_channel::Sender<Backup>,
    committer: BackupCommitter,
}

/// A generation's scheduler: none unless `sync = "lazy"`; an error when it
/// could not be built from the restored checkpoint.
type Scheduler = Result<Option<Arc<Lazy>>, String>;

pub struct SyncHub {
    workers: usize,
    aggregators: usize,
    rounds: RoundSum,
    merges: RoundMerge,
    lazy: PerGeneration<Scheduler>,
    backups: OrderedMutex<Option<Backups>>,
}

impl SyncHub {
    /// The hub of generation `generation`, restoring `restore` (none: the
    /// job's start), with `aggregators` lazy aggregators.
    pub fn new(
        config: &Config,
        workers: usize,
        aggregators: usize,
        generation: Generation,
        restore: Option<&Path>,
    ) -> Result<SyncHub, ClusterError> {
        let lazy = lazy_for(config, workers, aggregators, restore)?;
        Ok(SyncHub {
            workers,
            aggregators,
            rounds: RoundSum::in_generation(workers, generation),
            merges: RoundMerge::in_generation(workers, config.cluster.round_merge, generation),
            lazy: PerGeneration::new(generation, Ok(lazy)),
            backups: OrderedMutex::new(Rank::Leaf, "hub.backups", None),
        })
    }

    pub fn aggregators(&self) -> usize {
        self.aggregators
    }

    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        self.rounds.sum(c)
    }

    /// The gradient rounds' meeting point.
    pub fn rounds(&self) -> &RoundSum {
        &self.rounds
    }

    pub fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        self.merges.merge_round(u)
    }

    /// The newest generation's scheduler (`sync = "lazy"`).
    pub fn lazy(&self) -> Option<Arc<Lazy>> {
        self.lazy.latest(|s| s.as_ref().ok().cloned().flatten()).flatten()
    }

    /// Generation `generation`'s scheduler, for worker `worker`'s request.
    pub fn lazy_in(&self, worker: usize, generation: Generation) -> Result<Arc<Lazy>, ClusterError> {
        let scheduler = self.lazy.with(generation, |s| s.clone()).map_err(|OtherGeneration(serving)| {
            ClusterError::StaleGeneration {
                peer: "the scheduler".into(),
                what: format!("worker {worker}'s request"),
                found: generation,
                serving,
            }
        })?;
        match scheduler {
            Ok(Some(lazy)) => Ok(lazy),
            Ok(None) => Err(ClusterError::Setup("this job's cluster.sync is not \"lazy\"".into())),
            Err(e) => {
                Err(ClusterError::Setup(format!("generation {generation}: the scheduler could not restart: {e}")))
            }
        }
    }

    /// Backs every scheduler, this one and the next generations', up to
    /// `sink` and commits each backup with `committer`.
    pub fn back_up(&self, sink: crossbeam_channel::Sender<Backup>, committer: BackupCommitter) {
        if let Some(lazy) = self.lazy() {
            lazy.back_up_to(sink.clone());
            lazy.commit_backups_with(committer.clone());
        }
        *self.backups.lock() = Some(Backups { sink, committer });
    }

    /// Generation `generation` started (under the generations lock): every
    /// waiter of the old one is released.
    pub fn advance(&self, generation: Generation) {
        self.rounds.advance(generation);
        self.merges.advance(generation);
        if let Some(Ok(Some(old))) = self.lazy.pending(generation) {
            old.fail(format!("generation {generation} started"));
        }
    }

    /// Builds generation `generation`'s scheduler from `restore` (outside
    /// every lock: it reads the checkpoint) and installs it.
    pub fn rebuild(&self, config: &Config, generation: Generation, restore: Option<&Path>) {
        let next = lazy_for(config, self.workers, self.aggregators, restore).map_err(|e| e.to_string());
        // The targets are copied out: `backups` is a leaf, and the
        // scheduler's own lock is taken to set them (the lock-order check
        // caught this nesting).
        let targets = self.backups.lock().as_ref().map(|b| (b.sink.clone(), b.committer.clone()));
        if let (Ok(Some(lazy)), Some((sink, committer))) = (&next, targets) {
            lazy.back_up_to(sink);
            lazy.commit_backups_with(committer);
        }
        if let Err(e) = &next {
            tracing::error!("generation {generation}: the scheduler could not restart: {e}");
        }
        if let Err(Ok(Some(overtaken))) = self.lazy.install(generation, next) {
            overtaken.fail(format!("generation {generation} is over"));
        }
    }

    /// The job failed: every waiting worker is released with `reason`.
    pub fn fail(&self, reason: &str) {
        self.rounds.fail(reason.to_string());
        self.merges.fail(reason.to_string());
        if let Some(lazy) = self.lazy() {
            lazy.fail(reason.to_string());
        }
    }

    /// Tests: blocks until `n` workers contributed to `round`.
    pub fn wait_for_contributions(&self, round: u64, n: usize) {
        self.rounds.wait_for_contributions(round, n);
    }
}

/// The scheduler and aggregators for `sync = "lazy"` (none otherwise),
/// holding every replica's starting weights: the checkpoint's, or the
/// config's seed's.
fn lazy_for(
    config: &Config,
    workers: usize,
    aggregators: usize,
    restore: Option<&Path>,
) -> Result<Option<Arc<Lazy>>, ClusterError> {
    if config.cluster.sync != SyncMode::Lazy {
        return Ok(None);
    }
    Lazy::check_mapping(&config.cluster.lazy, workers, aggregators)?;
    let model = match restore {
        Some(dir) => crate::checkpoint::restore_dense(config, dir)?.model,
        None => {
            let layout = sparrow_data::DataLayout::from_config(&config.data);
            sparrow_trainer::initial_model(config, &layout)?
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
