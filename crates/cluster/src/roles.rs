//! The roles as processes: `sparrow coordinator | shard | loader | worker`.
//! Each runs a tokio runtime for its gRPC server and clients; role code runs
//! on plain threads and calls peers through blocking clients.
//!
//! Life cycle: every role but the coordinator registers with the coordinator
//! (receiving its index and the job's config), waits for the shard map, then
//! sends heartbeats every `cluster.heartbeat_interval_ms`. The job is done
//! when every worker finished; it fails when a role reports an error or goes
//! silent past `cluster.heartbeat_timeout_ms`. Either way every role learns it
//! from its next heartbeat and exits (0 when done, an error naming the cause
//! otherwise); a role that cannot reach the coordinator for the timeout exits too.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sparrow_core::Config;
use sparrow_core::config::ClusterConfig;
use sparrow_core::metrics::{auc, log_loss_from_logits};
use sparrow_data::DataLayout;
use tokio::runtime::Runtime;

use crate::coordinator::{Coordinator, JobState, RoleKind};
use crate::grpc::coordinator::CoordinatorClient;
use crate::grpc::loader::LoaderClient;
use crate::grpc::shard::ShardClient;
use crate::grpc::{NetSettings, bind, server_builder};
use crate::loader::LoaderServer;
use crate::metrics::RoleMetrics;
use crate::shard::ShardServer;
use crate::shard::shard_table;
use crate::sync::RoundSummer;
use crate::transport::{ClusterError, LoaderService, ShardReport, ShardService};
use crate::worker::new_worker;

/// Where a role listens and whom it reports to.
#[derive(Clone, Debug)]
pub struct RoleArgs {
    /// The coordinator's address (`host:port`).
    pub coordinator: String,
    /// The gRPC address to bind (port 0: any free port). For a worker: its metrics endpoint.
    pub listen: SocketAddr,
    /// The address others use to reach this role (default: the bound address).
    pub advertise: Option<String>,
    /// Where to serve Prometheus metrics (shards, loader, coordinator); none if unset.
    pub metrics_listen: Option<SocketAddr>,
    /// Ask for this shard index (a StatefulSet ordinal) instead of the next free one.
    pub index: Option<usize>,
    /// How long to retry the coordinator before giving up (before its config is known).
    pub connect_timeout_ms: u64,
    /// The shared token (the binary reads it from `SPARROW_AUTH_TOKEN`); it
    /// takes precedence over the job's `cluster.auth_token`.
    pub token: Option<String>,
}

fn runtime() -> Result<Runtime, ClusterError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sparrow-rpc")
        .enable_all()
        .build()
        .map_err(|e| ClusterError::Io { what: "starting the async runtime".into(), source: e })
}

fn serve_metrics(
    metrics: &RoleMetrics,
    addr: Option<SocketAddr>,
    role: &str,
    settings: &NetSettings,
    rt: &Runtime,
) -> Result<(), ClusterError> {
    if let Some(addr) = addr {
        let bound = metrics.serve(addr, settings, rt.handle())?;
        tracing::info!("{role}: metrics on http://{bound}/metrics");
    }
    Ok(())
}

/// Runs the coordinator until the job ends; `on_bound` gets the bound
/// address (launch reads it from stdout). Errors if the job failed.
pub fn run_coordinator(
    config: &Config,
    num_shards: usize,
    num_workers: usize,
    listen: SocketAddr,
    metrics_listen: Option<SocketAddr>,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let settings = NetSettings::new(&config.cluster, None);
    let coordinator = Arc::new(Coordinator::new(config, num_shards, num_workers)?);
    let metrics = RoleMetrics::new("coordinator");
    serve_metrics(&metrics, metrics_listen, "coordinator", &settings, &rt)?;
    let (listener, bound) = rt.block_on(bind(listen, &settings))?;
    on_bound(bound);
    tracing::info!("coordinator: listening on {bound}, expecting {num_shards} shard(s) and {num_workers} worker(s)");
    let service = crate::grpc::coordinator::service(coordinator.clone(), &settings, metrics);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(server_builder().add_service(service).serve_with_incoming_shutdown(
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        async {
            let _ = stop_rx.await;
        },
    ));
    let interval = Duration::from_millis(config.cluster.heartbeat_interval_ms);
    let state = loop {
        std::thread::sleep(interval / 2);
        coordinator.check_liveness();
        if server.is_finished() {
            break JobState::Failed("the coordinator's server stopped".into());
        }
        match coordinator.state() {
            JobState::Running => {}
            ended => break ended,
        }
    };
    // Let every role see the end in a heartbeat before the server goes away.
    std::thread::sleep(interval * 2 + Duration::from_millis(300));
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    match state {
        JobState::Failed(reason) => Err(ClusterError::JobFailed(reason)),
        _ => Ok(()),
    }
}

/// Heartbeats until the job ends (`Ok` when done) or `stop` is set.
fn heartbeat_until_end(
    coordinator: &CoordinatorClient,
    kind: RoleKind,
    index: usize,
    cluster: &ClusterConfig,
    stop: &AtomicBool,
    progress: &AtomicU64,
) -> Result<(), ClusterError> {
    let interval = Duration::from_millis(cluster.heartbeat_interval_ms);
    let timeout = Duration::from_millis(cluster.heartbeat_timeout_ms);
    let mut last_answer = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(interval);
        match coordinator.heartbeat(kind, index, progress.load(Ordering::Relaxed)) {
            Ok(JobState::Running) => last_answer = Instant::now(),
            Ok(JobState::Done) => return Ok(()),
            Ok(JobState::Failed(reason)) => return Err(ClusterError::JobFailed(reason)),
            Err(e) if last_answer.elapsed() > timeout => {
                return Err(ClusterError::Setup(format!(
                    "{}: no answer for {} ms, stopping: {e}",
                    coordinator.name(),
                    last_answer.elapsed().as_millis()
                )));
            }
            Err(e) => tracing::warn!("heartbeat: {e}"),
        }
    }
    Ok(())
}

/// Token and limits before the job's config is known: the defaults, the
/// token from the environment.
fn bootstrap_settings(args: &RoleArgs) -> NetSettings {
    let cluster = ClusterConfig { connect_timeout_ms: args.connect_timeout_ms, ..ClusterConfig::default() };
    NetSettings::new(&cluster, args.token.as_deref())
}

fn connect_shards(
    addresses: &[String],
    settings: &NetSettings,
    rt: &Runtime,
    metrics: &RoleMetrics,
) -> Result<Vec<Arc<dyn ShardService>>, ClusterError> {
    addresses
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            ShardClient::connect(i, addr, settings, rt.handle(), metrics.clone())
                .map(|c| Arc::new(c) as Arc<dyn ShardService>)
        })
        .collect()
}

/// Serves a shard until the job ends.
pub fn run_shard(args: &RoleArgs) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("shard");
    let boot = bootstrap_settings(args);
    let (listener, bound) = rt.block_on(bind(args.listen, &boot))?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let reg = coordinator.register(RoleKind::Shard, &advertise, args.index)?;
    let settings = NetSettings::new(&reg.config.cluster, args.token.as_deref());
    tracing::info!("shard {}: listening on {bound} (advertised as {advertise})", reg.index);
    // Heartbeats start now: restoring a large table must not read as silence.
    let stop = Arc::new(AtomicBool::new(false));
    let heartbeat = {
        let (coordinator, cluster, stop, index) =
            (coordinator.clone(), reg.config.cluster.clone(), stop.clone(), reg.index);
        std::thread::spawn(move || {
            heartbeat_until_end(&coordinator, RoleKind::Shard, index, &cluster, &stop, &AtomicU64::new(0))
        })
    };
    let started = (|| -> Result<_, ClusterError> {
        serve_metrics(&metrics, args.metrics_listen, "shard", &settings, &rt)?;
        let table = match sparrow_trainer::checkpoint::resume_dir(&reg.config)? {
            Some(dir) => {
                let table = crate::checkpoint::restore_shard_table(&reg.config, &dir, reg.index, reg.num_shards)?;
                tracing::info!("shard {}: restored {} rows from {}", reg.index, table.len(), dir.display());
                table
            }
            None => shard_table(&reg.config, reg.index)?,
        };
        let shard =
            Arc::new(ShardServer::new(reg.index, table).with_max_reply_bytes(reg.config.cluster.max_message_bytes));
        let service = crate::grpc::shard::service(shard, &settings, metrics);
        Ok(rt.spawn(
            server_builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
        ))
    })();
    let server = match started {
        Ok(server) => server,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            let _ = coordinator.finish(RoleKind::Shard, reg.index, Some(e.to_string()));
            return Err(e);
        }
    };
    let result = heartbeat.join().unwrap_or_else(|_| Err(ClusterError::Setup("the heartbeat thread panicked".into())));
    server.abort();
    result
}

/// Serves the loader until the job ends.
pub fn run_loader(args: &RoleArgs) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("loader");
    let boot = bootstrap_settings(args);
    let (listener, bound) = rt.block_on(bind(args.listen, &boot))?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let reg = coordinator.register(RoleKind::Loader, &advertise, None)?;
    let settings = NetSettings::new(&reg.config.cluster, args.token.as_deref());
    serve_metrics(&metrics, args.metrics_listen, "loader", &settings, &rt)?;
    let (shard_addresses, _) = coordinator.wait_for_view(settings.connect_timeout)?;
    let shards = connect_shards(&shard_addresses, &settings, &rt, &metrics)?;
    let loader = match LoaderServer::start(&reg.config, shards) {
        Ok(loader) => Arc::new(loader),
        Err(e) => {
            // Workers are waiting for this loader: fail the job with the cause.
            let _ = coordinator.finish(RoleKind::Loader, 0, Some(e.to_string()));
            return Err(e);
        }
    };
    tracing::info!("loader: listening on {bound}, {} shard(s)", shard_addresses.len());
    let service = crate::grpc::loader::service(loader, &settings, metrics);
    let server = rt.spawn(
        server_builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
    );
    let result = heartbeat_until_end(
        &coordinator,
        RoleKind::Loader,
        0,
        &reg.config.cluster,
        &AtomicBool::new(false),
        &AtomicU64::new(0),
    );
    server.abort();
    result
}

/// Latency quantiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize)]
pub struct LatencyMs {
    pub p50: f64,
    pub p99: f64,
    pub count: usize,
}

impl LatencyMs {
    pub fn of(secs: &[f32]) -> LatencyMs {
        if secs.is_empty() {
            return LatencyMs::default();
        }
        let mut sorted = secs.to_vec();
        sorted.sort_by(f32::total_cmp);
        let at = |q: f64| f64::from(sorted[((sorted.len() - 1) as f64 * q).round() as usize]) * 1e3;
        LatencyMs { p50: at(0.5), p99: at(0.99), count: sorted.len() }
    }
}

/// What a worker process prints as its last stdout line (launch merges them).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct WorkerSummary {
    pub worker: usize,
    pub test_auc: Option<f64>,
    pub test_logloss: Option<f64>,
    pub test_rows: u64,
    /// Test rows whose prediction was NaN (ranked last by `test_auc`).
    pub test_nan_predictions: u64,
    pub train_rows: u64,
    pub batches: u64,
    pub steps: u64,
    pub train_secs: f64,
    pub eval_secs: f64,
    pub train_logloss: Option<f64>,
    /// Shard rows after training (worker 0 asks the shards).
    pub embedding_rows: Option<u64>,
    /// The shards' SSD tier and filter counters, summed (worker 0).
    pub table: Option<sparrow_trainer::run::TableReport>,
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
    pub keys: u64,
    pub unique_keys: u64,
    pub pull_latency_ms: LatencyMs,
    pub push_latency_ms: LatencyMs,
    pub dense_checksum: String,
    pub peak_rss_bytes: u64,
    pub phase_secs: crate::worker::WorkerPhaseSecs,
    /// The loader's malformed-row count as of this worker's last batch.
    pub bad_rows: u64,
    /// Worker 0 writes the model here when `checkpoint.dir` is set.
    pub checkpoint: Option<String>,
}

/// Trains as one worker of the job; worker 0 also evaluates.
pub fn run_worker(args: &RoleArgs) -> Result<WorkerSummary, ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("worker");
    let boot = bootstrap_settings(args);
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let advertise = args.advertise.clone().unwrap_or_else(|| "-".into());
    let reg = coordinator.register(RoleKind::Worker, &advertise, args.index)?;
    let index = reg.index;
    let result = (|| {
        let settings = NetSettings::new(&reg.config.cluster, args.token.as_deref());
        serve_metrics(&metrics, Some(args.listen), "worker", &settings, &rt)?;
        let (shard_addresses, loader_address) = coordinator.wait_for_view(settings.connect_timeout)?;
        let shards = connect_shards(&shard_addresses, &settings, &rt, &metrics)?;
        let loader = LoaderClient::connect(&loader_address, &settings, rt.handle(), metrics.clone())?;
        let summer = (reg.num_workers > 1).then(|| Arc::new(coordinator.clone()) as Arc<dyn RoundSummer>);
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let heartbeat = {
            let (coordinator, cluster, stop) = (coordinator.clone(), reg.config.cluster.clone(), stop.clone());
            let progress = progress.clone();
            std::thread::spawn(move || {
                heartbeat_until_end(&coordinator, RoleKind::Worker, index, &cluster, &stop, &progress)
            })
        };
        let pool = sparrow_trainer::run::compute_pool(reg.config.train.threads)?;
        let summary = pool.install(|| worker_job(&reg.config, index, summer, &loader, &shards, progress));
        stop.store(true, Ordering::Relaxed);
        if let Ok(Err(e)) = heartbeat.join() {
            tracing::warn!("worker {index}: {e}");
        }
        summary
    })();
    // The coordinator learns the outcome either way (an error fails the job).
    let _ = coordinator.finish(RoleKind::Worker, index, result.as_ref().err().map(ToString::to_string));
    result
}

fn worker_job(
    config: &Config,
    index: usize,
    summer: Option<Arc<dyn RoundSummer>>,
    loader: &dyn LoaderService,
    shards: &[Arc<dyn ShardService>],
    progress: Arc<AtomicU64>,
) -> Result<WorkerSummary, ClusterError> {
    let layout = DataLayout::from_config(&config.data);
    let mut worker = new_worker(config, &layout, index, summer)?;
    worker.progress = progress;
    if let Some(dir) = sparrow_trainer::checkpoint::resume_dir(config)? {
        worker.resume(crate::checkpoint::restore_dense(config, &dir)?);
    }
    worker.run_training(loader, shards)?;
    let mut summary = WorkerSummary { worker: index, ..Default::default() };
    if index == 0 {
        let start = Instant::now();
        if config.data.test.is_some() {
            let (logits, labels) = worker.run_eval(loader, shards)?;
            summary.test_auc = Some(auc(&logits, &labels));
            summary.test_logloss = Some(log_loss_from_logits(&logits, &labels));
            summary.test_rows = labels.len() as u64;
            summary.test_nan_predictions = sparrow_core::metrics::count_nan(&logits);
        }
        summary.eval_secs = start.elapsed().as_secs_f64();
        let reports = shards.iter().map(|s| s.report()).collect::<Result<Vec<_>, _>>()?;
        let total = ShardReport::sum(&reports);
        summary.embedding_rows = Some(total.rows);
        summary.table = Some(total.table_report());
    }
    let s = &worker.stats;
    summary.train_rows = s.rows;
    summary.batches = s.batches;
    summary.steps = s.steps;
    summary.train_secs = s.train_secs;
    summary.train_logloss = s.recent_loss();
    summary.bytes_from_loader = s.bytes_from_loader;
    summary.bytes_from_shards = s.bytes_from_shards;
    summary.keys = s.keys;
    summary.unique_keys = s.unique_keys;
    summary.pull_latency_ms = LatencyMs::of(&s.pull_secs);
    summary.push_latency_ms = LatencyMs::of(&s.push_secs);
    summary.phase_secs = s.phase_secs;
    summary.bad_rows = s.bad_rows;
    summary.dense_checksum = format!("{:016x}", worker.dense_checksum()?);
    if let (0, Some(dir)) = (index, &config.checkpoint.dir) {
        let progress = worker.progress.clone();
        let saved = crate::checkpoint::save(config, Path::new(dir), worker.into_dense_state(), &progress, shards)?;
        tracing::info!("worker 0: checkpoint written to {}", saved.display());
        summary.checkpoint = Some(saved.display().to_string());
    }
    summary.peak_rss_bytes = sparrow_trainer::peak_rss_bytes();
    Ok(summary)
}
