//! All roles in one process over the in-process transport: the harness that
//! tests the distributed logic before any network is involved.

use std::sync::Arc;

use candle_core::Device;
use sparrow_core::Config;
use sparrow_core::metrics::{auc, log_loss_from_logits};
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, Initializer};
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};
use sparrow_trainer::TrainError;
use sparrow_trainer::dense_sync::{DenseSync, LocalSync};
use sparrow_trainer::trainer::seeds;

use crate::loader::LoaderServer;
use crate::shard::ShardServer;
use crate::sync::{RoundSum, RoundSync};
use crate::transport::{ClusterError, LoaderService, ShardReport, ShardService};
use crate::worker::{Worker, WorkerStats};

/// Logits and labels of the test data.
type Evaluation = (Vec<f32>, Vec<f32>);

#[derive(Clone, Debug)]
pub struct LocalSummary {
    pub test_auc: Option<f64>,
    pub test_logloss: Option<f64>,
    pub train_rows: u64,
    pub embedding_rows: u64,
    /// The shards' SSD tier and feature-filter counters, summed.
    pub table: sparrow_trainer::run::TableReport,
    /// Each worker's counters, in worker order.
    pub workers: Vec<WorkerStats>,
    /// Each worker's dense weights fingerprint (equal for replicas in sync).
    pub dense_checksums: Vec<u64>,
}

/// A shard role's table, built from the config the way every shard builds
/// it (an SSD tier goes to `embedding.path/shard-<index>`), with the same
/// `ttl_steps` floor as `sparrow train`'s table.
pub fn shard_table(config: &Config, index: usize) -> Result<EmbeddingTable, ClusterError> {
    let (emb_seed, _) = seeds(config.train.seed);
    let width = DenseModel::embedding_width(config.model.kind, config.model.embedding_dim);
    let table = EmbeddingTable::from_config(
        width,
        &config.embedding,
        Initializer::new(config.embedding.init, emb_seed),
        Some(&format!("shard-{index}")),
        sparrow_trainer::ttl_floor(config),
    )
    .map_err(|source| ClusterError::Table { shard: index, source })?;
    Ok(table)
}

/// A worker role, built from the config (every worker starts from the same
/// dense weights); with `summer`, its dense sync sums across workers each step.
pub fn new_worker(
    config: &Config,
    layout: &DataLayout,
    index: usize,
    summer: Option<Arc<dyn crate::sync::RoundSummer>>,
) -> Result<Worker, ClusterError> {
    let (_, dense_seed) = seeds(config.train.seed);
    let shape = ModelShape {
        num_fields: layout.num_fields,
        num_dense: layout.num_dense,
        embedding_dim: config.model.embedding_dim,
    };
    let model = DenseModel::new(&config.model, shape, dense_seed, Device::Cpu).map_err(TrainError::from)?;
    let sync: Box<dyn DenseSync> = match summer {
        Some(summer) => Box::new(RoundSync::new(index, summer)),
        None => Box::new(LocalSync),
    };
    let optimizer = DenseOptimizer::new(config.dense_optimizer.clone());
    Ok(Worker::new(index, model, optimizer, sync, config.model.pooling)
        .with_pipeline_depth(config.train.pipeline_depth))
}

/// Trains with `num_shards` in-process shards and `num_workers` worker
/// threads, then worker 0 evaluates on `data.test`. With one worker and the
/// same config and seed it ends with the same model as
/// `sparrow_trainer::train` (tested).
pub fn train_local(config: &Config, num_shards: usize, num_workers: usize) -> Result<LocalSummary, ClusterError> {
    let num_workers = num_workers.max(1);
    let servers: Vec<Arc<ShardServer>> = (0..num_shards.max(1))
        .map(|i| Ok(Arc::new(ShardServer::new(i, shard_table(config, i)?))))
        .collect::<Result<_, ClusterError>>()?;
    let shards: Vec<Arc<dyn ShardService>> = servers.iter().map(|s| s.clone() as Arc<dyn ShardService>).collect();
    let layout = DataLayout::from_config(&config.data);
    let loader = LoaderServer::start(config, shards.clone())?;
    let rounds = Arc::new(RoundSum::new(num_workers));
    let summer = (num_workers > 1).then(|| rounds.clone() as Arc<dyn crate::sync::RoundSummer>);

    let results: Vec<Result<(Worker, Option<Evaluation>), ClusterError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..num_workers)
            .map(|index| {
                let (loader, shards, layout, summer, rounds) = (&loader, &shards, &layout, summer.clone(), &rounds);
                scope.spawn(move || {
                    let result = (|| {
                        let pool = sparrow_trainer::run::compute_pool(config.train.threads)?;
                        pool.install(|| {
                            let mut worker = new_worker(config, layout, index, summer)?;
                            worker.run_training(loader as &dyn LoaderService, shards)?;
                            let eval = match (index, &config.data.test) {
                                (0, Some(_)) => Some(worker.run_eval(loader as &dyn LoaderService, shards)?),
                                _ => None,
                            };
                            Ok((worker, eval))
                        })
                    })();
                    if let Err(e) = &result {
                        rounds.fail(format!("worker {index}: {e}"));
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(ClusterError::Setup("a worker thread panicked".into()))))
            .collect()
    });
    let mut workers = Vec::with_capacity(num_workers);
    let (mut test_auc, mut test_logloss) = (None, None);
    for result in results {
        let (worker, eval) = result?;
        if let Some((logits, labels)) = eval {
            test_auc = Some(auc(&logits, &labels));
            test_logloss = Some(log_loss_from_logits(&logits, &labels));
        }
        workers.push(worker);
    }
    let reports = ShardReport::sum(&servers.iter().map(|s| s.report()).collect::<Result<Vec<_>, _>>()?);
    Ok(LocalSummary {
        test_auc,
        test_logloss,
        train_rows: workers.iter().map(|w| w.stats.rows).sum(),
        embedding_rows: reports.rows,
        table: reports.table_report(),
        dense_checksums: workers.iter().map(Worker::dense_checksum).collect::<Result<_, _>>()?,
        workers: workers.into_iter().map(|w| w.stats).collect(),
    })
}
