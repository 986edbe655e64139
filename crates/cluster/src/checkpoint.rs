//! Cluster checkpoints in `sparrow train`'s format: worker 0 gathers every
//! shard's rows (paged, within the message cap) and its own dense model and
//! optimizer state, and writes one checkpoint version. `sparrow eval`,
//! `predict` and `train --resume` read it like any other.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sparrow_core::Config;
use sparrow_core::batch::DataPosition;
use sparrow_data::DataLayout;
use sparrow_trainer::Trainer;

use crate::transport::{ClusterError, ShardService};
use crate::worker::Worker;

/// Writes the job's model under `checkpoint.dir`; returns the version's directory.
pub fn save(
    config: &Config,
    root: &Path,
    worker: Worker,
    shards: &[Arc<dyn ShardService>],
) -> Result<PathBuf, ClusterError> {
    let layout = DataLayout::from_config(&config.data);
    // The gathered rows sit in memory while they are written (never in the
    // shards' SSD files).
    let mut trainer = Trainer::new(&in_memory(config), layout)?;
    let position = worker.stats.last_end;
    let progress = worker.progress.clone();
    trainer.model = worker.model;
    trainer.dense_optimizer = worker.optimizer;
    trainer.step = trainer.dense_optimizer.step;
    trainer.samples_trained = trainer.dense_optimizer.samples_stepped;
    trainer.position = position;
    // Pages of about a quarter of the message cap.
    let row_bytes = 8 + 4 * trainer.table.row_len();
    let page = (config.cluster.max_message_bytes / 4 / row_bytes).max(1);
    for shard in shards {
        let mut cursor = Some((0, 0));
        while let Some(at) = cursor {
            let exported = shard.export(at, page)?;
            // Each shard's filter state is merged in (the later clock, the
            // larger admission counters) before its rows.
            if let Some(filters) = &exported.filters {
                trainer.table.restore_filter_state(filters);
            }
            let rows = exported.rows.chunks_exact(trainer.table.row_len());
            for ((key, row), &last_use) in exported.keys.iter().zip(rows).zip(&exported.last_uses) {
                trainer.table.put_row_used(*key, row, last_use).map_err(|e| ClusterError::Train(e.into()))?;
            }
            cursor = exported.next;
            progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    Ok(sparrow_trainer::checkpoint::save(&trainer, root, config.checkpoint.keep)?)
}

/// `config` with its table in memory: for the helper tables of save and
/// restore, which must not touch a shard's SSD files.
fn in_memory(config: &Config) -> Config {
    let mut c = config.clone();
    c.embedding.storage = sparrow_core::config::Storage::Memory;
    c
}

/// The later of two data positions (workers see batches in any order).
pub fn later(a: DataPosition, b: DataPosition) -> DataPosition {
    if (b.epoch, b.offset) > (a.epoch, a.offset) { b } else { a }
}

/// The checkpoint version to resume from, if `checkpoint.resume_from` is set.
pub fn resume_dir(config: &Config) -> Result<Option<PathBuf>, ClusterError> {
    match &config.checkpoint.resume_from {
        Some(from) => Ok(Some(sparrow_trainer::checkpoint::resolve(Path::new(from))?)),
        None => Ok(None),
    }
}

/// Shard `index` of `num_shards`, restored from a checkpoint: only the keys it
/// owns (whatever the shard count that wrote it).
pub fn restore_shard_table(
    config: &Config,
    dir: &Path,
    index: usize,
    num_shards: usize,
) -> Result<sparrow_embedding::EmbeddingTable, ClusterError> {
    let mut trainer = Trainer::new(&in_memory(config), DataLayout::from_config(&config.data))?;
    trainer.table = crate::local::shard_table(config, index)?;
    sparrow_trainer::checkpoint::load_into_filtered(&mut trainer, dir, |key| {
        crate::loader::owner(key, num_shards) == index
    })?;
    Ok(trainer.table)
}

/// A worker's dense model and optimizer state, restored from a checkpoint.
pub fn restore_worker(config: &Config, dir: &Path, worker: &mut Worker) -> Result<(), ClusterError> {
    let mut trainer = Trainer::new(&in_memory(config), DataLayout::from_config(&config.data))?;
    let manifest = sparrow_trainer::checkpoint::load_into_filtered(&mut trainer, dir, |_| false)?;
    worker.model = trainer.model;
    worker.optimizer.take_state_from(trainer.dense_optimizer);
    worker.optimizer.samples_stepped = manifest.samples_trained;
    worker.stats.last_end = manifest.position;
    Ok(())
}
