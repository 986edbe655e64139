//! The roles as processes: `sparrow coordinator | shard | loader | worker`.
//! Each runs a tokio runtime for its gRPC server and clients; role code runs
//! on plain threads and calls peers through blocking clients.
//!
//! Life cycle: every role but the coordinator registers with the coordinator
//! (receiving its index, the job's config and its generation) and heartbeats
//! every `cluster.heartbeat_interval_ms` from a thread of its own
//! (`link::Link`).
//! It serves one generation of the job at a time, set up from that
//! generation's checkpoint; when the coordinator starts the next one (a role
//! died, see [`crate::coordinator`]) it drops its work and sets up again. The
//! job is done when every worker finished in the current generation; it fails
//! when a role reports an error or the restart budget is spent. Either way
//! every role learns it from its next heartbeat and exits (0 when done, an
//! error naming the cause otherwise); a role that cannot reach the coordinator
//! for `cluster.heartbeat_timeout_ms` exits too.

mod links;
mod summary;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sparrow_core::Config;
use sparrow_core::config::ClusterConfig;
use sparrow_core::config::SyncMode;
use sparrow_data::DataLayout;
use tokio::runtime::Runtime;

use self::links::RoleLinks;
pub use self::summary::{LatencyMs, WorkerFields, WorkerRunSummary};
use crate::coordinator::{Attempt, Coordinator, Event, JobState, RoleId, RoleKind};
use crate::faults;
use crate::generation::Generation;
use crate::grpc::coordinator::CoordinatorClient;
use crate::grpc::loader::LoaderClient;
use crate::grpc::shard::ShardClient;
use crate::grpc::{NetSettings, bind, server_builder};
use crate::link::Link;
use crate::loader::LoaderServer;
use crate::metrics::RoleMetrics;
use crate::shard::{ShardServer, shard_table_in};
use crate::transport::{ClusterError, PassStaging, Serving, ShardReport, ShardService};
use crate::worker::{new_worker_in, sync_policy};

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
    /// Looks up an environment variable the job's config names (the SASL
    /// password's `data.stream.sasl.password_env`): the binary passes the
    /// process's environment.
    pub env: fn(&str) -> Option<std::ffi::OsString>,
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
) -> Result<Option<SocketAddr>, ClusterError> {
    let Some(addr) = addr else { return Ok(None) };
    let bound = metrics.serve(addr, settings, rt.handle())?;
    tracing::info!("{role}: metrics on http://{bound}/metrics");
    Ok(Some(bound))
}

/// The coordinator's shard clients for checkpoints, connected per shard map.
struct GrpcDialer {
    settings: NetSettings,
    handle: tokio::runtime::Handle,
    metrics: RoleMetrics,
    cached: parking_lot::Mutex<Option<Dialed>>,
}

/// A shard map and the clients connected to it.
type Dialed = (Vec<String>, Vec<Arc<dyn ShardService>>);

impl crate::coordinator::ShardDialer for GrpcDialer {
    fn dial(&self, addresses: &[String]) -> Result<Vec<Arc<dyn ShardService>>, ClusterError> {
        if let Some((known, shards)) = self.cached.lock().as_ref()
            && known == addresses
        {
            return Ok(shards.clone());
        }
        // Connected without the lock (a connect may wait on the network);
        // two commits racing both connect, and the later map is kept.
        let shards = addresses
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                ShardClient::connect(i, addr, &self.settings, &self.handle, self.metrics.clone())
                    .map(|c| Arc::new(c) as Arc<dyn ShardService>)
            })
            .collect::<Result<Vec<_>, _>>()?;
        *self.cached.lock() = Some((addresses.to_vec(), shards.clone()));
        Ok(shards)
    }
}

/// A line from the launcher: `lost <role> <index> [<pid>]` (that role's
/// process exited; launch restarts it).
fn note_launcher(coordinator: &Coordinator, line: &str) {
    let mut words = line.split_whitespace();
    if let (Some("lost"), Some(kind), Some(index)) = (words.next(), words.next(), words.next())
        && let (Some(kind), Ok(index)) = (RoleKind::parse(kind), index.parse::<usize>())
        && let Ok(pid) = words.next().map_or(Ok(0), str::parse::<u32>)
    {
        coordinator.lost_process(RoleId::new(kind, index), pid, "exited (its process died)");
    } else {
        tracing::warn!("coordinator: ignoring `{line}` from the launcher");
    }
}

/// How the coordinator process runs (`sparrow coordinator`'s arguments).
pub struct CoordinatorArgs {
    pub num_shards: usize,
    pub num_workers: usize,
    /// `sync = "lazy"`: the aggregator processes that register.
    pub aggregators: usize,
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    /// Lines from the launcher (`lost <role> <index>`: that role's process
    /// exited, launch restarts it).
    pub notices: Option<crossbeam_channel::Receiver<String>>,
}

/// Runs the coordinator until the job ends; `on_bound` gets the bound
/// address (launch reads it from stdout). `on_event` gets the coordinator's
/// [`Event`]s, the last one its [`Event::Report`] (the binary prints them for
/// launch). Errors if the job failed.
pub fn run_coordinator(
    config: &Config,
    args: CoordinatorArgs,
    on_bound: impl FnOnce(SocketAddr),
    on_event: impl Fn(&Event) + Send + Sync + 'static,
) -> Result<(), ClusterError> {
    let CoordinatorArgs { num_shards, num_workers, aggregators, listen, metrics_listen, notices } = args;
    crate::epochs::check(config)?;
    // Every role takes the job's config from here: with the statistics.
    // No stop flag: a role process exits on a signal (`exit_on_signals`).
    let never = std::sync::atomic::AtomicBool::new(false);
    let config = &*sparrow_trainer::standardize::with_dense_statistics(config, &never)?;
    let on_event = Arc::new(on_event);
    let rt = runtime()?;
    let settings = NetSettings::new(&config.cluster, None);
    let metrics = RoleMetrics::new("coordinator");
    let dialer = GrpcDialer {
        settings: settings.clone(),
        handle: rt.handle().clone(),
        metrics: metrics.clone(),
        cached: parking_lot::Mutex::new(None),
    };
    let coordinator = Arc::new(
        Coordinator::new(config, num_shards, num_workers)?
            .with_aggregator_processes(aggregators)?
            .with_dialer(Arc::new(dialer))
            .with_events({
                let on_event = on_event.clone();
                move |e| on_event(e)
            }),
    );
    serve_metrics(&metrics, metrics_listen, "coordinator", &settings, &rt)?;
    let (listener, bound) = rt.block_on(bind(listen, &settings))?;
    on_bound(bound);
    tracing::info!("coordinator: listening on {bound}, expecting {num_shards} shard(s) and {num_workers} worker(s)");
    let service = crate::grpc::coordinator::service(coordinator.clone(), &settings, metrics.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(server_builder().add_service(service).serve_with_incoming_shutdown(
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        async {
            let _ = stop_rx.await;
        },
    ));
    let interval = Duration::from_millis(config.cluster.heartbeat_interval_ms);
    // The aggregators' backups, written beside training (S4.6).
    let backups = coordinator.start_backups().map(|rx| {
        let coordinator = coordinator.clone();
        std::thread::spawn(move || {
            for (number, weights) in rx {
                let written = coordinator.write_backup(number, &weights);
                match &written {
                    Ok(dir) => tracing::info!("backup {number}: exported to {}", dir.display()),
                    Err(e) => tracing::error!("backup {number}: {e}"),
                }
                if let Some(lazy) = coordinator.lazy() {
                    lazy.backup_done(written.is_ok());
                }
                if coordinator.state() != JobState::Running {
                    break;
                }
            }
        })
    });
    let scheduler = (config.cluster.sync == SyncMode::Lazy).then(|| {
        let (coordinator, cfg, token) = (coordinator.clone(), config.cluster.lazy.clone(), settings.token.clone());
        std::thread::spawn(move || measure_conditions(&coordinator, &cfg, token.as_deref()))
    });
    let state = loop {
        match &notices {
            Some(notices) => {
                if let Ok(line) = notices.recv_timeout(interval / 2) {
                    note_launcher(&coordinator, &line);
                }
            }
            None => std::thread::sleep(interval / 2),
        }
        coordinator.check_liveness();
        if server.is_finished() {
            break JobState::Failed("the coordinator's server stopped".into());
        }
        match coordinator.state() {
            JobState::Running => {}
            ended => break ended,
        }
    };
    if let Some(scheduler) = scheduler {
        let _ = scheduler.join();
    }
    drop(backups);
    let mut report = coordinator.recovery_report();
    report.role_bytes += metrics.total_bytes();
    tracing::info!(
        "coordinator: {} checkpoint(s) committed, restarts {:?}, {} step(s) replayed, {:.3} s recovering",
        report.checkpoints_committed,
        report.restarts,
        report.steps_replayed,
        report.recovery_secs
    );
    on_event(&Event::Report(report));
    // Let every role see the end in a heartbeat before the server goes away.
    std::thread::sleep(interval * 2 + Duration::from_millis(300));
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    match state {
        JobState::Failed(reason) => Err(ClusterError::JobFailed(reason)),
        _ => Ok(()),
    }
}

/// The scheduler's monitor (S4.2), while the job runs: every
/// `probe_interval_ms` it probes the roles and measures the network
/// utilisation over the roles' last heartbeat intervals, for the
/// instructions' conditions.
fn measure_conditions(coordinator: &Coordinator, cfg: &sparrow_core::config::LazyConfig, token: Option<&str>) {
    use crate::lazy::{Conditions, failure_rate, utilisation};
    let interval = Duration::from_millis(cfg.probe_interval_ms);
    let timeout = Duration::from_millis(cfg.probe_timeout_ms);
    let all = cfg.probe_roles == sparrow_core::config::ProbeRoles::All;
    while coordinator.state() == JobState::Running {
        let started = Instant::now();
        let failures = failure_rate(&coordinator.probe_targets(all), token, timeout);
        let net = utilisation(cfg.utilisation, &coordinator.byte_rates(), cfg.link_bytes_per_sec);
        if let Some(lazy) = coordinator.lazy() {
            lazy.set_conditions(Conditions { utilisation: net, failure_rate: failures });
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

/// Token and limits before the job's config is known: the defaults, the
/// token from the environment.
fn bootstrap_settings(args: &RoleArgs) -> NetSettings {
    let cluster = ClusterConfig { connect_timeout_ms: args.connect_timeout_ms, ..ClusterConfig::default() };
    NetSettings::new(&cluster, args.token.as_deref())
}

fn connect_shards(
    addresses: &[String],
    simd: sparrow_core::simd::Simd,
    settings: &NetSettings,
    rt: &Runtime,
    metrics: &RoleMetrics,
) -> Result<Vec<Arc<dyn ShardService>>, ClusterError> {
    addresses
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            ShardClient::connect(i, addr, settings, rt.handle(), metrics.clone())
                .map(|c| Arc::new(c.with_simd(simd)) as Arc<dyn ShardService>)
        })
        .collect()
}

/// Settings for connecting to peers the view says serve this generation:
/// they are up, so one that does not answer within the heartbeat timeout
/// died (the coordinator moves on to the next generation by then), and a
/// role must not spend the whole connect timeout retrying it.
fn peer_settings(settings: &NetSettings, cluster: &ClusterConfig) -> NetSettings {
    let mut peers = settings.clone();
    peers.connect_timeout = peers.connect_timeout.min(Duration::from_millis(cluster.heartbeat_timeout_ms));
    peers
}

/// The SSD tier's directory of shard `index` in `generation` (the first
/// keeps the plain name).
fn shard_subdir(index: usize, generation: Generation) -> String {
    if generation <= Generation::FIRST { format!("shard-{index}") } else { format!("shard-{index}-g{generation}") }
}

/// Removes the SSD tier directories of shard `index` other than `current`
/// (a dead process's or an abandoned generation's working files).
fn remove_stale_tiers(config: &Config, index: usize, current: &str) {
    let Some(root) = config.embedding.path.as_deref() else { return };
    let Ok(entries) = std::fs::read_dir(root) else { return };
    let plain = format!("shard-{index}");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name == plain || name.strip_prefix(&format!("{plain}-g")).is_some_and(|g| g.parse::<u64>().is_ok());
        if ours && name != current {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Serves the job's generations until it ends: `start` sets this role up for
/// each new one (then it reports it serves it). A start that fails as a
/// peer's death would (a shard gone while the loader connects) waits for the
/// next generation; any other failure, or no next generation within the
/// recovery wait, fails the job with it.
fn each_generation(
    link: &Link,
    cluster: &ClusterConfig,
    mut start: impl FnMut(&Attempt) -> Result<(), ClusterError>,
) -> Result<(), ClusterError> {
    let mut served = Generation::NONE;
    loop {
        let (state, generation) = link.heard();
        if state != JobState::Running {
            return link.ended(state);
        }
        if generation.number != served {
            match start(&generation) {
                Ok(()) => {
                    served = generation.number;
                    link.set_ready(served);
                }
                Err(e) if e.may_be_a_death() => {
                    tracing::warn!("{}: generation {}: {e}", link.role, generation.number);
                    if !link.await_recovery(generation.number, cluster) {
                        link.finish(Some(e.to_string()), generation.number);
                        return Err(e);
                    }
                    continue;
                }
                Err(e) => {
                    link.finish(Some(e.to_string()), generation.number);
                    return Err(e);
                }
            }
        }
        link.wait_change(served, Duration::from_secs(3600));
    }
}

/// Serves a shard until the job ends: each generation of the job gets a
/// table restored from its checkpoint (or a fresh one), with its SSD tier in
/// a fresh directory.
pub fn run_shard(args: &RoleArgs) -> Result<(), ClusterError> {
    run_shard_with(args, None)
}

/// What a node's shard hands its worker: its index and what it serves.
type LocalShardHandle = (usize, Arc<Serving<ShardServer>>);

/// [`run_shard`], telling `local` (a node's worker) its index and server.
fn run_shard_with(
    args: &RoleArgs,
    local: Option<crossbeam_channel::Sender<LocalShardHandle>>,
) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("shard");
    let boot = bootstrap_settings(args);
    let (listener, bound) = rt.block_on(bind(args.listen, &boot))?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    // Heartbeats start now: restoring a large table must not read as silence.
    let (link, reg) = Link::register(coordinator.clone(), RoleKind::Shard, &advertise, args.index)?;
    let (config, index) = (reg.config, reg.index);
    let settings = NetSettings::new(&config.cluster, args.token.as_deref());
    tracing::info!("shard {index}: listening on {bound} (advertised as {advertise})");
    let serving = Arc::new(Serving::new(format!("shard {index}")));
    if let Some(local) = local {
        let _ = local.send((index, serving.clone()));
    }
    let server = (|| -> Result<_, ClusterError> {
        if let Some(bound) = serve_metrics(&metrics, args.metrics_listen, "shard", &settings, &rt)? {
            coordinator.set_probe_address(bound);
        }
        let service = crate::grpc::shard::service(serving.clone(), &settings, metrics);
        Ok(rt.spawn(
            server_builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
        ))
    })();
    let server = match server {
        Ok(server) => server,
        Err(e) => {
            link.finish(Some(e.to_string()), Generation::NONE);
            return Err(e);
        }
    };
    let result = each_generation(&link, &config.cluster, |generation| {
        if let Some(old) = serving.set(None) {
            old.retire();
        }
        let subdir = shard_subdir(index, generation.number);
        let (table, event_clock) = match &generation.restore {
            Some(dir) => {
                faults::point("shard.restore");
                crate::checkpoint::restore_shard_table(&config, dir, index, reg.num_shards, &subdir)
                    .inspect(|t| tracing::info!("shard {index}: restored {} rows from {}", t.0.len(), dir.display()))
            }
            None => shard_table_in(&config, index, &subdir).map(|t| (t, Vec::new())),
        }?;
        let shard = ShardServer::new(index, table)
            .with_max_reply_bytes(config.cluster.max_message_bytes)
            .for_generation(generation.number, &config)
            .for_mode(&config)
            .with_bounds(&config, reg.num_shards, &event_clock);
        serving.set(Some(Arc::new(shard)));
        remove_stale_tiers(&config, index, &subdir);
        Ok(())
    });
    server.abort();
    result
}

/// Serves the loader until the job ends: each generation of the job reads
/// the data on from its checkpoint's position, once every shard serves it.
/// `notices`: lines from `sparrow launch` on stdin; `end data` ends the
/// training data at the next batch (a graceful stop: the job checkpoints).
pub fn run_loader(args: &RoleArgs, notices: Option<crossbeam_channel::Receiver<String>>) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("loader");
    let boot = bootstrap_settings(args);
    let (listener, bound) = rt.block_on(bind(args.listen, &boot))?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let (link, reg) = Link::register(coordinator.clone(), RoleKind::Loader, &advertise, None)?;
    let mut config = reg.config;
    // The config came from the coordinator without secrets: the loader
    // reads the Kafka password from its own environment or file.
    config.resolve_secrets(args.env).map_err(|e| ClusterError::Setup(format!("loader: {e}")))?;
    let settings = NetSettings::new(&config.cluster, args.token.as_deref());
    if let Some(bound) = serve_metrics(&metrics, args.metrics_listen, "loader", &settings, &rt)? {
        coordinator.set_probe_address(bound);
    }
    let serving = Arc::new(Serving::new("the loader".to_string()));
    let service = crate::grpc::loader::service(serving.clone(), &settings, metrics.clone());
    let server = rt.spawn(
        server_builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
    );
    tracing::info!("loader: listening on {bound}");
    let ending = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(notices) = notices {
        let (serving, ending) = (serving.clone(), ending.clone());
        std::thread::spawn(move || {
            for line in notices {
                if line == "end data" {
                    ending.store(true, std::sync::atomic::Ordering::SeqCst);
                    if let Ok(loader) = serving.get() {
                        loader.end_data();
                    }
                }
            }
        });
    }
    let result = each_generation(&link, &config.cluster, |generation| {
        drop(serving.set(None));
        let view = coordinator.wait_for_view(generation.number, true, settings.connect_timeout)?;
        let shards =
            connect_shards(&view.shards, config.train.simd, &peer_settings(&settings, &config.cluster), &rt, &metrics)?;
        let loader =
            LoaderServer::start_for(&config, shards, generation.number, generation.restore.clone(), reg.num_workers)?;
        // Told to end before this generation began: it ends at once too.
        if ending.load(std::sync::atomic::Ordering::SeqCst) {
            loader.end_data();
        }
        serving.set(Some(Arc::new(loader)));
        Ok(())
    });
    server.abort();
    result
}

/// Serves an aggregator (`sparrow aggregator`, S4) until the job ends: each
/// generation gets a fresh one, which sums its workers' contributions and
/// sends the scheduler one partial sum per instruction.
pub fn run_aggregator(args: &RoleArgs) -> Result<(), ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("aggregator");
    let boot = bootstrap_settings(args);
    let (listener, bound) = rt.block_on(bind(args.listen, &boot))?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let (link, reg) = Link::register(coordinator.clone(), RoleKind::Aggregator, &advertise, args.index)?;
    let (config, index) = (reg.config, reg.index);
    let settings = NetSettings::new(&config.cluster, args.token.as_deref());
    if config.cluster.sync != SyncMode::Lazy {
        let e = ClusterError::Setup(format!(
            "aggregator {index}: this job's cluster.sync is \"{}\"; aggregators serve only \"lazy\"",
            config.cluster.sync.name()
        ));
        link.finish(Some(e.to_string()), Generation::NONE);
        return Err(e);
    }
    if let Some(bound) = serve_metrics(&metrics, args.metrics_listen, "aggregator", &settings, &rt)? {
        coordinator.set_probe_address(bound);
    }
    let serving = Arc::new(Serving::new(format!("aggregator {index}")));
    let service = crate::grpc::aggregator::service(serving.clone(), &settings, metrics.clone());
    let server = rt.spawn(
        server_builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
    );
    tracing::info!("aggregator {index}: listening on {bound} (advertised as {advertise})");
    let upstream = Arc::new(coordinator.clone()) as Arc<dyn crate::aggregator::PartialSink>;
    let result = each_generation(&link, &config.cluster, |generation| {
        let next = crate::aggregator::AggregatorServer::new(
            index,
            generation.number,
            config.cluster.lazy.aggregator_of.clone(),
            (reg.num_workers, reg.num_aggregators),
            upstream.clone(),
        );
        if let Some(old) = serving.set(Some(Arc::new(next))) {
            old.fail(format!("generation {} started", generation.number));
        }
        Ok(())
    });
    server.abort();
    result
}

/// Trains as one worker of the job until it is done; worker 0 also
/// evaluates. When the job moves to a new generation (a role died) the
/// worker starts again from the checkpoint the generation restores.
pub fn run_worker(args: &RoleArgs) -> Result<WorkerRunSummary, ClusterError> {
    run_worker_with(args, None)
}

/// A node's own shard, called in process (S1: its second level is the
/// node's; only the other nodes' rows cross the network).
struct LocalShard(Arc<Serving<ShardServer>>);

impl ShardService for LocalShard {
    fn enqueue(
        &self,
        batch_id: u64,
        keys: Vec<u64>,
        mode: crate::Mode,
        newest_record_ms: Option<i64>,
    ) -> Result<(), ClusterError> {
        self.0.get()?.enqueue(batch_id, keys, mode, newest_record_ms)
    }
    fn pull(&self, batch_id: u64) -> Result<Vec<f32>, ClusterError> {
        self.0.get()?.pull(batch_id)
    }
    fn push(&self, batch_id: u64, grads: Vec<f32>, lr_scale: f32) -> Result<(), ClusterError> {
        self.0.get()?.push(batch_id, grads, lr_scale)
    }
    fn report(&self) -> Result<ShardReport, ClusterError> {
        self.0.get()?.report()
    }
    fn pass_staging(&self) -> Option<&dyn PassStaging> {
        Some(self)
    }
    fn export(&self, cursor: (usize, usize), max_rows: usize) -> Result<crate::transport::ExportPage, ClusterError> {
        self.0.get()?.export(cursor, max_rows)
    }
    fn write_part(
        &self,
        generation: Generation,
        request: &crate::transport::PartRequest,
    ) -> Result<crate::transport::PartWritten, ClusterError> {
        self.0.get()?.write_part(generation, request)
    }
    fn is_local(&self) -> bool {
        true
    }
}

impl PassStaging for LocalShard {
    fn stage(&self, pass: u64, keys: Vec<u64>, batches: Vec<u64>) -> Result<(), ClusterError> {
        let shard = self.0.get()?;
        let staging = shard
            .pass_staging()
            .ok_or_else(|| ClusterError::Setup(format!("node {}: its shard has no second level", shard.index())))?;
        staging.stage(pass, keys, batches)
    }
}

/// A node (`sparrow node`, `cluster.mode = "collocated"`, S1): a shard and a
/// worker of the same index in one process; the worker reads its own
/// shard's second level in process. `args.listen` is the shard's gRPC
/// address, `args.metrics_listen` the shard's metrics; the worker's metrics
/// go on a free port of the same host.
pub fn run_node(args: &RoleArgs) -> Result<WorkerRunSummary, ClusterError> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let shard_args = args.clone();
    let shard = std::thread::Builder::new()
        .name("sparrow-node-shard".into())
        .spawn(move || run_shard_with(&shard_args, Some(tx)))
        .map_err(|e| ClusterError::Io { what: "starting the node's shard".into(), source: e })?;
    let local = match rx.recv_timeout(Duration::from_millis(args.connect_timeout_ms.max(1000))) {
        Ok(local) => local,
        Err(_) => {
            return Err(match shard.join() {
                Ok(Err(e)) => e,
                _ => ClusterError::Setup("node: its shard did not start".into()),
            });
        }
    };
    let worker_args = RoleArgs {
        listen: SocketAddr::new(args.listen.ip(), 0),
        advertise: None,
        metrics_listen: None,
        index: Some(local.0),
        ..args.clone()
    };
    let result = run_worker_with(&worker_args, Some(local));
    let shard = shard.join().unwrap_or_else(|_| Err(ClusterError::Setup("node: its shard panicked".into())));
    let summary = result?;
    shard?;
    Ok(summary)
}

fn run_worker_with(args: &RoleArgs, local: Option<LocalShardHandle>) -> Result<WorkerRunSummary, ClusterError> {
    let rt = runtime()?;
    let metrics = RoleMetrics::new("worker");
    let boot = bootstrap_settings(args);
    let coordinator = CoordinatorClient::connect(&args.coordinator, &boot, rt.handle(), metrics.clone())?;
    let advertise = args.advertise.clone().unwrap_or_else(|| "-".into());
    let (link, reg) = Link::register(coordinator.clone(), RoleKind::Worker, &advertise, args.index)?;
    let (config, index) = (reg.config, reg.index);
    let settings = NetSettings::new(&config.cluster, args.token.as_deref());
    if let Some(bound) = serve_metrics(&metrics, Some(args.listen), "worker", &settings, &rt)? {
        coordinator.set_probe_address(bound);
    }
    // Registered once: every generation's worker sets the same gauges.
    let gauges = crate::stream_gauges::OnlineGauges::new(&metrics);
    let pool = sparrow_trainer::run::compute_pool(config.train.threads)?;
    if index == 0 {
        sparrow_trainer::run::note_precision(&config.model, config.train.simd);
    }
    let mut done: Option<(Generation, WorkerRunSummary)> = None;
    // Seconds this process spent in attempts the job gave up.
    let mut given_up_secs = 0.0;
    loop {
        let (state, generation) = link.heard();
        match state {
            JobState::Done => {
                return done.filter(|(g, _)| *g == generation.number).map(|(_, summary)| summary).ok_or_else(|| {
                    ClusterError::Setup(format!("worker {index}: the job ended before this worker did"))
                });
            }
            JobState::Failed(reason) => return Err(link.failure(reason)),
            JobState::Running => {}
        }
        if done.as_ref().is_some_and(|(g, _)| *g == generation.number) {
            link.wait_change(generation.number, Duration::from_secs(3600));
            continue;
        }
        // A generation after one this worker finished (`data.validation`'s
        // next epoch): the job's training time includes the one before.
        if let Some((_, finished)) = done.take() {
            given_up_secs = finished.train_secs;
        }
        link.begin_attempt();
        let env = WorkerEnv {
            config: &config,
            index,
            num_workers: reg.num_workers,
            coordinator: &coordinator,
            link: &link,
            settings: &settings,
            rt: &rt,
            metrics: &metrics,
            gauges: &gauges,
            local: local.as_ref(),
        };
        let started = Instant::now();
        let attempt = pool.install(|| worker_generation(&env, &generation));
        match attempt {
            Ok(mut summary) => {
                // The job's training time includes the attempts given up.
                summary.train_secs += given_up_secs;
                link.finish(None, generation.number);
                done = Some((generation.number, summary));
            }
            Err(e) if e.may_be_a_death() || link.heard().1.number != generation.number => {
                given_up_secs += started.elapsed().as_secs_f64();
                tracing::warn!("worker {index}: generation {}: {e}", generation.number);
                if !link.await_recovery(generation.number, &config.cluster) {
                    link.finish(Some(e.to_string()), generation.number);
                    return Err(e);
                }
            }
            Err(e) => {
                link.finish(Some(e.to_string()), generation.number);
                return Err(e);
            }
        }
    }
}

/// What a worker process keeps across generations.
struct WorkerEnv<'a> {
    config: &'a Config,
    index: usize,
    num_workers: usize,
    coordinator: &'a CoordinatorClient,
    link: &'a Link,
    settings: &'a NetSettings,
    rt: &'a Runtime,
    metrics: &'a RoleMetrics,
    gauges: &'a crate::stream_gauges::OnlineGauges,
    /// A node's own shard (called in process).
    local: Option<&'a LocalShardHandle>,
}

/// One generation of a worker: waits for the shards and the loader to serve
/// it, restores the dense state, trains, takes part in checkpoints, and
/// (worker 0) evaluates.
fn worker_generation(env: &WorkerEnv<'_>, generation: &Attempt) -> Result<WorkerRunSummary, ClusterError> {
    let WorkerEnv { config, index, num_workers, coordinator, link, settings, rt, metrics, gauges, local } = *env;
    let view = coordinator.wait_for_view(generation.number, false, settings.connect_timeout)?;
    let settings = &peer_settings(settings, &config.cluster);
    let mut shards = connect_shards(&view.shards, config.train.simd, settings, rt, metrics)?;
    if let Some((own, serving)) = local
        && let Some(slot) = shards.get_mut(*own)
    {
        *slot = Arc::new(LocalShard(serving.clone()));
    }
    let loader = LoaderClient::connect(&view.loader, settings, rt.handle(), metrics.clone())?;
    let layout = DataLayout::from_config(&config.data);
    let links = RoleLinks { config, coordinator, aggregators: &view.aggregators, settings, rt, metrics };
    let policy = sync_policy(config, index, num_workers, generation.number, &links)?;
    let mut worker = new_worker_in(config, &layout, index, generation.number)?;
    worker.progress = link.shared.progress.clone();
    let mut worker = worker.with_policy(policy);
    worker.reported_step = link.shared.step.clone();
    worker.watch_generation(link.shared.generation.clone());
    worker.gauges = Some((gauges.clone(), config.train.log_interval_steps));
    if let Some(dir) = &config.checkpoint.dir {
        let sink = Arc::new(coordinator.clone()) as Arc<dyn crate::checkpoint::CheckpointSink>;
        let timed = crate::checkpoint::meet_every_secs(config).is_some();
        worker.with_checkpoints(sink, PathBuf::from(dir), crate::checkpoint::checkpoint_every(config), timed);
    }
    if let Some(dir) = &generation.restore {
        worker.resume(crate::checkpoint::restore_dense(config, dir)?);
        worker.restore_validation(dir)?;
        // After a recovery worker 0 counts what the job trained before the
        // checkpoint (not what a resumed job's earlier run trained).
        if index == 0 {
            let before = |d: &std::path::Path| {
                sparrow_trainer::checkpoint::read_manifest(d).map(|m| (m.samples_trained, m.step))
            };
            let (rows, steps) = before(dir)?;
            let (start_rows, start_steps) = match sparrow_trainer::checkpoint::resume_dir(config)? {
                Some(start) => before(&start)?,
                None => (0, 0),
            };
            worker.count_trained_before(rows.saturating_sub(start_rows), steps.saturating_sub(start_steps));
        }
    }
    link.set_ready(generation.number);
    worker.run_training(&loader, &shards)?;
    let (mut figures, mut eval_secs, mut shards_total) = (None, 0.0, None);
    let mut validation = Default::default();
    // The test set is scored once, at the job's end: not in a generation
    // a validation point ends when training goes on after it.
    if index == 0 && !worker.job_goes_on(config, generation.restore.as_deref()) {
        let start = Instant::now();
        let (f, report) = worker.final_figures(config, &loader, &shards)?;
        if let Some(f) = &f {
            worker.log_evaluation(f)?;
        }
        (figures, validation) = (f, report);
        eval_secs = start.elapsed().as_secs_f64();
        let reports = shards.iter().map(|s| s.report()).collect::<Result<Vec<_>, _>>()?;
        shards_total = Some(ShardReport::sum(&reports));
    }
    let mut summary = summary::of_worker(config, &worker, figures, eval_secs, shards_total)?;
    summary.validation = validation;
    Ok(summary)
}
