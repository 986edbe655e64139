//! All roles in one process over the in-process transport: the harness that
//! tests the distributed logic before any network is involved.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use sparrow_core::Config;
use sparrow_core::metrics::{auc, log_loss_from_logits};
use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_embedding::{EmbeddingTable, Initializer, SparseOptimizer};
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};
use sparrow_trainer::TrainError;
use sparrow_trainer::trainer::seeds;

use crate::loader::Loader;
use crate::messages::Mode;
use crate::shard::ShardServer;
use crate::transport::{ClusterError, ShardService};
use crate::worker::Worker;

#[derive(Clone, Debug)]
pub struct LocalSummary {
    pub test_auc: Option<f64>,
    pub test_logloss: Option<f64>,
    pub train_rows: u64,
    pub steps: u64,
    pub embedding_rows: u64,
    /// Bytes a worker received per trained sample, from the loader and from the shards.
    pub worker_in_bytes_per_sample_loader: f64,
    pub worker_in_bytes_per_sample_shards: f64,
}

/// Trains with `num_shards` in-process shards and one worker, then evaluates
/// on `data.test`. With the same config and seed it ends with the same model
/// as `sparrow_trainer::train` (tested).
pub fn train_local(config: &Config, num_shards: usize) -> Result<LocalSummary, ClusterError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.train.threads)
        .build()
        .map_err(|e| TrainError::ThreadPool(e.to_string()))?;
    pool.install(|| run(config, num_shards.max(1)))
}

fn run(config: &Config, num_shards: usize) -> Result<LocalSummary, ClusterError> {
    let (emb_seed, dense_seed) = seeds(config.train.seed);
    let layout = DataLayout::from_config(&config.data);
    let width = DenseModel::embedding_width(config.model.kind, config.model.embedding_dim);
    let servers: Vec<Arc<ShardServer>> = (0..num_shards)
        .map(|i| {
            let table = EmbeddingTable::new(
                width,
                SparseOptimizer::from_config(&config.embedding),
                Initializer::new(config.embedding.init, emb_seed),
                config.embedding.table_shards,
            );
            Arc::new(ShardServer::new(i, table))
        })
        .collect();
    let shards: Vec<Arc<dyn ShardService>> = servers.iter().map(|s| s.clone() as Arc<dyn ShardService>).collect();
    let shape = ModelShape {
        num_fields: layout.num_fields,
        num_dense: layout.num_dense,
        embedding_dim: config.model.embedding_dim,
    };
    let model = DenseModel::new(&config.model, shape, dense_seed, Device::Cpu).map_err(TrainError::from)?;
    let mut worker = Worker::new(model, DenseOptimizer::new(config.dense_optimizer.clone()), config.model.pooling);

    let train_path = config
        .data
        .train
        .as_deref()
        .map(Path::new)
        .ok_or(sparrow_data::DataError::MissingPath { key: "train", what: "the training data file" })?;
    let bad = BadRows::new(config.data.max_bad_rows, config.data.report_bad_rows);
    let stream = BatchStream::spawn(
        train_path,
        &config.data,
        config.train.batch_size,
        Default::default(),
        config.train.epochs,
        bad.clone(),
    )?;
    let mut loader = Loader::new(stream, shards.clone(), Mode::Train, 0);
    let (mut steps, mut rows) = (0u64, 0u64);
    while let Some(batch) = loader.next_batch()? {
        if config.train.max_steps.is_some_and(|m| steps >= m) {
            break;
        }
        worker.train(&batch, &shards)?;
        steps += 1;
        rows += batch.rows as u64;
    }
    let (from_loader, from_shards) = (worker.bytes_from_loader, worker.bytes_from_shards);

    let (mut test_auc, mut test_logloss) = (None, None);
    if let Some(test) = config.data.test.as_deref() {
        let stream = BatchStream::spawn(
            Path::new(test),
            &config.data,
            config.train.batch_size.max(1024),
            Default::default(),
            1,
            bad,
        )?;
        let mut eval_loader = Loader::new(stream, shards.clone(), Mode::Eval, 1 << 62);
        let (mut logits, mut labels) = (Vec::new(), Vec::new());
        while let Some(batch) = eval_loader.next_batch()? {
            logits.extend(worker.predict(&batch, &shards)?);
            labels.extend_from_slice(&batch.labels);
        }
        test_auc = Some(auc(&logits, &labels));
        test_logloss = Some(log_loss_from_logits(&logits, &labels));
    }
    Ok(LocalSummary {
        test_auc,
        test_logloss,
        train_rows: rows,
        steps,
        embedding_rows: servers.iter().map(|s| s.table().len() as u64).sum(),
        worker_in_bytes_per_sample_loader: from_loader as f64 / rows.max(1) as f64,
        worker_in_bytes_per_sample_shards: from_shards as f64 / rows.max(1) as f64,
    })
}
