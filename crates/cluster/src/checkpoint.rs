//! Cluster checkpoints in `sparrow train`'s format: worker 0 gathers every
//! shard's rows (paged, within the message cap) and its own dense model and
//! optimizer state, and writes one checkpoint version. `sparrow eval`,
//! `predict` and `train --resume` read it like any other.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use sparrow_core::Config;
use sparrow_core::batch::DataPosition;
use sparrow_data::DataLayout;
use sparrow_model::{DenseModel, DenseOptimizer};
use sparrow_trainer::Trainer;

use crate::transport::{ClusterError, ShardService};

/// A worker's part of a checkpoint: its dense model, the optimizer's state
/// (steps and samples behind them) and where the data continues.
pub struct DenseState {
    pub model: DenseModel,
    pub optimizer: DenseOptimizer,
    pub position: DataPosition,
}

/// Writes the job's model (`dense` from worker 0, the rows from every
/// shard) under `checkpoint.dir`; returns the version's directory. Each page
/// gathered moves `progress` (the worker's heartbeat progress).
pub fn save(
    config: &Config,
    root: &Path,
    dense: DenseState,
    progress: &AtomicU64,
    shards: &[Arc<dyn ShardService>],
) -> Result<PathBuf, ClusterError> {
    let layout = DataLayout::from_config(&config.data);
    // The gathered rows sit in memory while they are written (never in the
    // shards' SSD files).
    let mut trainer = Trainer::new(&in_memory(config), layout)?;
    trainer.model = dense.model;
    trainer.dense_optimizer = dense.optimizer;
    trainer.step = trainer.dense_optimizer.step;
    trainer.samples_trained = trainer.dense_optimizer.samples_stepped;
    trainer.position = dense.position;
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

/// Shard `index` of `num_shards`, restored from a checkpoint: only the keys it
/// owns (whatever the shard count that wrote it).
pub fn restore_shard_table(
    config: &Config,
    dir: &Path,
    index: usize,
    num_shards: usize,
) -> Result<sparrow_embedding::EmbeddingTable, ClusterError> {
    let mut trainer = Trainer::new(&in_memory(config), DataLayout::from_config(&config.data))?;
    trainer.table = crate::shard::shard_table(config, index)?;
    sparrow_trainer::checkpoint::load_into_filtered(&mut trainer, dir, |key| {
        sparrow_embedding::owner(key, num_shards) == index
    })?;
    Ok(trainer.table)
}

/// A worker's dense model and optimizer state, restored from a checkpoint.
pub fn restore_dense(config: &Config, dir: &Path) -> Result<DenseState, ClusterError> {
    let mut trainer = Trainer::new(&in_memory(config), DataLayout::from_config(&config.data))?;
    let manifest = sparrow_trainer::checkpoint::load_into_filtered(&mut trainer, dir, |_| false)?;
    let mut optimizer = trainer.dense_optimizer;
    optimizer.samples_stepped = manifest.samples_trained;
    Ok(DenseState { model: trainer.model, optimizer, position: manifest.position })
}
