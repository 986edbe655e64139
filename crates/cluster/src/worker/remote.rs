//! The worker's side of the shards: pulling a batch's rows by batch id,
//! pushing its gradients, and what those calls carried and took. The step
//! engine sees the shards as a [`RowSource`] ([`RemoteRows`]).

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use sparrow_embedding::{KeyPlan, owner};
use sparrow_trainer::engine::{Looked, RowGrads, RowSource};

use super::WorkerStats;
use crate::messages::{Mode, WorkerBatch};
use crate::transport::{ClusterError, ShardService};

/// Runs `call` for every shard with a non-empty part, concurrently when
/// there are several, and returns the results in shard order with each
/// call's seconds.
pub(super) fn each_shard<T: Send>(
    shards: &[Arc<dyn ShardService>],
    counts: &[u32],
    call: impl Fn(usize, &dyn ShardService) -> Result<T, ClusterError> + Sync,
) -> Result<Vec<(T, f32)>, ClusterError> {
    let timed = |s: usize| {
        let t = Instant::now();
        call(s, shards[s].as_ref()).map(|v| (v, t.elapsed().as_secs_f32()))
    };
    let busy: Vec<usize> = (0..shards.len()).filter(|&s| counts[s] > 0).collect();
    if busy.len() <= 1 {
        return busy.into_iter().map(timed).collect();
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = busy.iter().map(|&s| scope.spawn(move || timed(s))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(ClusterError::Setup("a shard call panicked".into()))))
            .collect()
    })
}

/// What the shard calls of a step carried and took (merged into
/// [`WorkerStats`] by the worker's thread).
#[derive(Default)]
pub(super) struct ShardTraffic {
    /// Bytes a shard sends per vector (set by the caller; 0 in a merged total).
    pub(super) vector_bytes: usize,
    pub(super) bytes_from_loader: u64,
    pub(super) bytes_from_shards: u64,
    pub(super) bytes_from_remote_shards: u64,
    pub(super) pull_secs: Vec<f32>,
    pub(super) push_secs: Vec<f32>,
}

impl ShardTraffic {
    pub(super) fn merge(&mut self, other: ShardTraffic) {
        self.bytes_from_loader += other.bytes_from_loader;
        self.bytes_from_shards += other.bytes_from_shards;
        self.bytes_from_remote_shards += other.bytes_from_remote_shards;
        self.pull_secs.extend(other.pull_secs);
        self.push_secs.extend(other.push_secs);
    }

    pub(super) fn add_to(self, stats: &mut WorkerStats) {
        stats.bytes_from_loader += self.bytes_from_loader;
        stats.bytes_from_shards += self.bytes_from_shards;
        stats.bytes_from_remote_shards += self.bytes_from_remote_shards;
        stats.pull_secs.extend(self.pull_secs);
        stats.push_secs.extend(self.push_secs);
    }
}

/// In worker_lookup mode the worker does the loader's S0 work itself:
/// dedup, partition, and sending each shard its keys.
pub(super) fn look_up_keys(
    batch: &mut WorkerBatch,
    shards: &[Arc<dyn ShardService>],
    mode: Mode,
) -> Result<(), ClusterError> {
    if batch.keys.is_empty() {
        return Ok(());
    }
    let n = shards.len();
    let plan = KeyPlan::new(&batch.keys, n, |k| owner(k, n));
    batch.shard_counts = (0..n).map(|s| plan.shard_keys(s).len() as u32).collect();
    each_shard(shards, &batch.shard_counts, |s, shard| {
        shard.enqueue(batch.batch_id, plan.shard_keys(s).to_vec(), mode, batch.newest_record_ms())
    })?;
    batch.inverse = plan.inverse;
    Ok(())
}

/// The batch's unique rows, shard by shard (the loader's order).
pub(super) fn pull_rows(
    batch: &WorkerBatch,
    width: usize,
    shards: &[Arc<dyn ShardService>],
    mut traffic: Option<&mut ShardTraffic>,
) -> Result<Vec<f32>, ClusterError> {
    let vector_bytes = traffic.as_ref().map_or(4 * width, |t| t.vector_bytes) as u64;
    let parts =
        each_shard(shards, &batch.shard_counts, |_, shard| shard.pull(batch.batch_id).map(|p| (p, shard.is_local())))?;
    let mut rows = Vec::with_capacity(batch.num_unique() * width);
    for ((part, local), secs) in parts {
        if let Some(t) = traffic.as_deref_mut() {
            // A shard sends each vector as its table stores it (f32 or half).
            let bytes = (part.len() / width.max(1)) as u64 * vector_bytes;
            t.bytes_from_shards += bytes;
            if !local {
                t.bytes_from_remote_shards += bytes;
            }
            t.pull_secs.push(secs);
        }
        rows.extend_from_slice(&part);
    }
    Ok(rows)
}

/// The shards as the step engine's [`RowSource`]: a lookup sends the keys
/// (worker_lookup mode) and pulls the rows by batch id; an update pushes
/// each shard its part of the gradients. Network calls: they run beside the
/// dense step on a thread of their own.
pub struct RemoteRows<'a> {
    pub(super) shards: &'a [Arc<dyn ShardService>],
    pub(super) width: usize,
    /// Bytes a shard sends per vector.
    pub(super) vector_bytes: usize,
    pub(super) traffic: Mutex<ShardTraffic>,
}

impl RowSource for RemoteRows<'_> {
    type Batch = WorkerBatch;
    type Ticket = ();
    type Error = ClusterError;

    fn look_up(&self, mut batch: WorkerBatch) -> Result<Looked<WorkerBatch, ()>, ClusterError> {
        let loader_bytes = batch.payload_bytes() as u64;
        look_up_keys(&mut batch, self.shards, Mode::Train)?;
        let mut traffic = ShardTraffic {
            bytes_from_loader: loader_bytes,
            vector_bytes: self.vector_bytes,
            ..ShardTraffic::default()
        };
        let unique_rows = pull_rows(&batch, self.width, self.shards, Some(&mut traffic))?;
        self.traffic.lock().merge(traffic);
        Ok(Looked { batch, unique_rows, ticket: () })
    }

    fn update(&self, batch: &WorkerBatch, _: (), grads: RowGrads) -> Result<(), ClusterError> {
        let mut traffic = ShardTraffic::default();
        push_grads(batch, &grads, self.width, self.shards, &mut traffic)?;
        self.traffic.lock().merge(traffic);
        Ok(())
    }

    fn release(&self, batch: &WorkerBatch, _: ()) -> Result<(), ClusterError> {
        each_shard(self.shards, &batch.shard_counts, |_, shard| shard.release(batch.batch_id))?;
        Ok(())
    }

    fn blocks(&self) -> bool {
        true
    }
}

/// Pushes each shard its part of a batch's summed gradients (per unique
/// key, shard by shard, `width` floats each).
pub(super) fn push_grads(
    batch: &WorkerBatch,
    grads: &RowGrads,
    width: usize,
    shards: &[Arc<dyn ShardService>],
    traffic: &mut ShardTraffic,
) -> Result<(), ClusterError> {
    // Where each shard's part starts: the counts before it.
    let starts: Vec<usize> = batch
        .shard_counts
        .iter()
        .scan(0, |at, &count| {
            let start = *at;
            *at += count as usize * width;
            Some(start)
        })
        .collect();
    let pushed = each_shard(shards, &batch.shard_counts, |s, shard| {
        let part = &grads.values[starts[s]..starts[s] + batch.shard_counts[s] as usize * width];
        shard.push(batch.batch_id, part.to_vec(), grads.lr_scale)
    })?;
    traffic.push_secs.extend(pushed.iter().map(|(_, secs)| secs));
    Ok(())
}
