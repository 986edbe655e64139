//! Sync as a worker policy: how a worker's replica agrees with the others
//! (`cluster.sync`). One factory, [`sync_policy`], called by the job in one
//! process (`local.rs`) and by the worker role (`roles.rs`) alike; what
//! differs per mode lives in its policy's file (`step.rs`, `round.rs`,
//! `lazy.rs`), never in a branch of the worker.
//!
//! A fourth policy is one new file in `worker/` with a type implementing
//! [`SyncPolicy`] (its feed and its hooks), and one line in
//! [`sync_policy`] (and its `cluster.sync` name in the config's
//! `SyncMode`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::thread::Scope;

use sparrow_core::Config;
use sparrow_core::config::SyncMode;
use sparrow_trainer::dense_sync::DenseSync;

use super::Worker;
use super::drive::{Flow, StepDone, Unpushed};
use super::feed::BatchFeed;
use super::lazy::LazyPolicy;
use super::round::RoundPolicy;
use super::step::StepPolicy;
use crate::generation::Generation;
use crate::lazy::LazyLink;
use crate::rounds::RoundMerger;
use crate::sync::RoundSummer;
use crate::transport::{ClusterError, LoaderService};

/// How a worker trains with the others. The worker's one loop
/// (`drive.rs`) takes batches from the policy's feed through the step
/// engine and calls the policy's hooks; the policy holds what its mode
/// keeps between them (a round's starting weights, a lazy worker's
/// iterations since its last aggregation).
pub trait SyncPolicy: Send {
    /// Its `cluster.sync` name.
    fn name(&self) -> &'static str;

    /// The step engine's dense policy for each step (a sum across the
    /// workers, or this replica's own step).
    /// (`progress`: the worker's progress count, which a sync that waits on
    /// the others moves while it waits.)
    fn dense_sync(&mut self, progress: &Arc<AtomicU64>) -> Box<dyn DenseSync>;

    /// Whether the job's step (its checkpoints' count) is the batches every
    /// worker trained, each stepping a replica of its own, rather than this
    /// worker's dense steps.
    fn counts_job_batches(&self) -> bool {
        false
    }

    /// Where `w`'s batches come from, as training starts from its current
    /// weights (a thread the feed needs runs in `scope`).
    fn open<'s, 'e: 's>(
        &mut self,
        w: &Worker,
        loader: &'e dyn LoaderService,
        scope: &'s Scope<'s, 'e>,
    ) -> Result<Box<dyn BatchFeed + 's>, ClusterError>;

    /// After a step the loop has counted (and checked the job's generation):
    /// what follows it (a checkpoint when due, an aggregation).
    fn stepped(
        &mut self,
        w: &mut Worker,
        done: StepDone,
        unpushed: &mut Unpushed<'_, '_>,
    ) -> Result<Flow, ClusterError>;

    /// The feed ran dry (this worker's data ended, or its round's items):
    /// meets the others; [`Flow::Train`] when the feed has more to give.
    fn ran_dry(&mut self, w: &mut Worker, unpushed: &mut Unpushed<'_, '_>) -> Result<Flow, ClusterError>;

    /// Every update pushed, the last meeting held: the job's final state
    /// (before the job's last checkpoint).
    fn finish(&mut self, _w: &mut Worker) -> Result<(), ClusterError> {
        Ok(())
    }
}

/// Where a worker meets the others, as each policy needs: the job's
/// in-process rendezvous, or the coordinator's (and an aggregator's) clients.
pub trait SyncLinks {
    /// `step`: where gradient rounds are summed.
    fn summer(&self) -> Arc<dyn RoundSummer>;
    /// `round`: where round updates are merged.
    fn merger(&self) -> Arc<dyn RoundMerger>;
    /// `lazy`: worker `worker`'s way to the scheduler.
    fn lazy_link(&self, worker: usize) -> Result<Arc<dyn LazyLink>, ClusterError>;
}

/// The policy of worker `index` of `num_workers` in generation `generation`.
pub fn sync_policy(
    config: &Config,
    index: usize,
    num_workers: usize,
    generation: Generation,
    links: &dyn SyncLinks,
) -> Result<Box<dyn SyncPolicy>, ClusterError> {
    Ok(match config.cluster.sync {
        SyncMode::Step if num_workers > 1 => {
            Box::new(StepPolicy::summing(index, generation, links.summer(), config.train.simd))
        }
        SyncMode::Step => Box::new(StepPolicy::alone(index, generation)),
        SyncMode::Round => Box::new(RoundPolicy::new(links.merger(), num_workers)),
        SyncMode::Lazy => Box::new(LazyPolicy::new(links.lazy_link(index)?, &config.cluster.lazy)),
    })
}
