//! All roles in one process over the in-process transport: the harness that
//! tests the distributed logic before any network is involved.

use std::sync::Arc;

use sparrow_core::Config;
use sparrow_data::DataLayout;
use sparrow_trainer::evaluation::Figures;

use crate::generation::Generation;
use crate::lazy::{Lazy, LazyLink};
use crate::loader::LoaderServer;
use crate::rounds::{RoundMerge, RoundMerger};
use crate::shard::{ShardServer, shard_table};
use crate::sync::{RoundSum, RoundSummer};
use crate::transport::{ClusterError, LoaderService, ShardReport, ShardService};
use crate::worker::{SyncLinks, Worker, WorkerStats, new_worker, sync_policy};
use sparrow_core::config::SyncMode;
use sparrow_trainer::TrainError;

/// Logits and labels of the test data.
type Evaluation = sparrow_trainer::evaluation::Scores;

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
    /// `cluster.mode = "collocated"`: the shards' second levels, summed.
    pub second_level: Option<crate::second_level::SecondLevelStats>,
}

/// Trains with `num_shards` in-process shards and `num_workers` worker
/// threads, then worker 0 evaluates on `data.test`. With one worker and the
/// same config and seed it ends with the same model as
/// `sparrow_trainer::train` (tested).
pub fn train_local(config: &Config, num_shards: usize, num_workers: usize) -> Result<LocalSummary, ClusterError> {
    let num_workers = num_workers.max(1);
    let num_shards = num_shards.max(1);
    crate::refuse_local_only_keys(config)?;
    // No stop flag: a role process exits on a signal (`exit_on_signals`).
    let never = std::sync::atomic::AtomicBool::new(false);
    let config = &*sparrow_trainer::standardize::with_dense_statistics(config, &never)?;
    crate::worker::start_metrics_file(config)?;
    let servers: Vec<Arc<ShardServer>> = (0..num_shards)
        .map(|i| {
            let server = ShardServer::new(i, shard_table(config, i)?).for_mode(config);
            Ok(Arc::new(server.with_bounds(config, num_shards, &[])))
        })
        .collect::<Result<_, ClusterError>>()?;
    let shards: Vec<Arc<dyn ShardService>> = servers.iter().map(|s| s.clone() as Arc<dyn ShardService>).collect();
    let layout = DataLayout::from_config(&config.data);
    let restore = sparrow_trainer::checkpoint::resume_dir(config)?;
    let loader = LoaderServer::start_for(config, shards.clone(), Generation::NONE, restore, num_workers)?;
    let rounds = Arc::new(RoundSum::new(num_workers));
    let merges = Arc::new(RoundMerge::new(num_workers, config.cluster.round_merge));
    let lazy = match config.cluster.sync {
        SyncMode::Lazy => {
            let start =
                sparrow_trainer::initial_model(config, &layout)?.params.flat_values().map_err(TrainError::from)?;
            let lr = config.dense_optimizer.learning_rate;
            Some(Arc::new(Lazy::new(&config.cluster.lazy, num_workers, 1, lr, start)))
        }
        _ => None,
    };
    let links = InProcess { rounds: rounds.clone(), merges: merges.clone(), lazy: lazy.clone() };

    let results: Vec<Result<(Worker, Option<Evaluation>), ClusterError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..num_workers)
            .map(|index| {
                let (loader, shards, layout, links, rounds, merges, lazy) =
                    (&loader, &shards, &layout, &links, &rounds, &merges, &lazy);
                scope.spawn(move || {
                    let result = (|| {
                        let pool = sparrow_trainer::run::compute_pool(config.train.threads)?;
                        pool.install(|| {
                            let policy = sync_policy(config, index, num_workers, Generation::NONE, links)?;
                            let mut worker = new_worker(config, layout, index)?.with_policy(policy);
                            worker.run_training(loader as &dyn LoaderService, shards)?;
                            let eval = match (index, &config.data.test) {
                                (0, Some(_)) => Some(worker.run_eval(loader as &dyn LoaderService, shards)?),
                                _ => None,
                            };
                            if let Some(scores) = &eval {
                                worker.log_evaluation(&Figures::of(config, scores))?;
                            }
                            Ok((worker, eval))
                        })
                    })();
                    if let Err(e) = &result {
                        rounds.fail(format!("worker {index}: {e}"));
                        merges.fail(format!("worker {index}: {e}"));
                        if let Some(lazy) = lazy {
                            lazy.fail(format!("worker {index}: {e}"));
                        }
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
        if let Some(scores) = eval {
            let f = Figures::of(config, &scores);
            (test_auc, test_logloss) = (Some(f.auc), Some(f.logloss));
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
        second_level: reports.second_level,
        dense_checksums: workers.iter().map(Worker::dense_checksum).collect::<Result<_, _>>()?,
        workers: workers.into_iter().map(|w| w.stats).collect(),
    })
}

/// The job's rendezvous in this process, as each sync policy needs them.
pub struct InProcess {
    pub rounds: Arc<RoundSum>,
    pub merges: Arc<RoundMerge>,
    pub lazy: Option<Arc<Lazy>>,
}

impl SyncLinks for InProcess {
    fn summer(&self) -> Arc<dyn RoundSummer> {
        self.rounds.clone()
    }

    fn merger(&self) -> Arc<dyn RoundMerger> {
        self.merges.clone()
    }

    fn lazy_link(&self, _: usize) -> Result<Arc<dyn LazyLink>, ClusterError> {
        let lazy =
            self.lazy.clone().ok_or_else(|| ClusterError::Setup("this job's cluster.sync is not \"lazy\"".into()))?;
        Ok(lazy)
    }
}
