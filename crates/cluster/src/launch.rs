//! `sparrow launch`: a coordinator, a loader, N shards and M workers as child
//! processes of this one on loopback, their logs forwarded with a `[role]`
//! prefix, their summaries merged into one JSON object. Every child is killed
//! and reaped when this returns, however it returns (success, a child's
//! failure, Ctrl-C); each child also exits on its own if this process dies
//! (it watches its stdin, see [`EXIT_WITH_PARENT_ENV`]).
//!
//! A child that dies (killed by a signal, or crashed) is started again with
//! the same arguments, at most `cluster.max_restarts` times per role: the
//! coordinator is told on its stdin (`lost shard 1`) and takes the job to its
//! next generation, every role back to the last committed checkpoint; a
//! restarted coordinator listens on the same address and the others register
//! with it again. A role the coordinator reports as hung (`event` lines on its
//! stdout) is killed and restarted the same way. A child that exits with an
//! error (the job failed, bad input) is not restarted.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use sparrow_core::Config;
use sparrow_trainer::run::RunSummary;

use crate::coordinator::Event;
use crate::grpc::TOKEN_ENV;
use crate::roles::{LatencyMs, WorkerRunSummary};
use crate::transport::ClusterError;

/// Set on children: they exit when their stdin (a pipe from the launcher) closes.
pub const EXIT_WITH_PARENT_ENV: &str = "SPARROW_EXIT_WITH_PARENT";

pub struct LaunchOptions {
    pub config_path: PathBuf,
    pub set: Vec<String>,
    pub shards: usize,
    pub workers: usize,
    /// `sync = "lazy"`: aggregator processes (`sparrow aggregator`).
    pub aggregators: usize,
    /// `cluster.mode = "collocated"`: N `sparrow node` processes (a shard and
    /// a worker each) in place of the shards and workers.
    pub nodes: Option<usize>,
    /// Do not forward the children's logs.
    pub quiet: bool,
    /// Hand `FAILPOINTS` to restarted roles too (the binary sets it from
    /// `SPARROW_FAILPOINTS_ON_RESTART`; see `faults`).
    pub failpoints_on_restart: bool,
}

struct Running {
    name: String,
    /// The role kind (`coordinator`, `shard`, `loader`, `worker`) and index.
    kind: &'static str,
    index: usize,
    args: Vec<String>,
    restarts: u32,
    /// The child's end of the pipe it watches (the coordinator reads notices from it).
    stdin: Option<ChildStdin>,
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// Closed once the child's stderr is read to its end.
    stderr_read: crossbeam_channel::Receiver<()>,
    status: Option<ExitStatus>,
}

impl Running {
    fn last_error(&self) -> String {
        // An exited child's last lines may still be in the pipe: read them
        // first (bounded: a pipe some other process holds open never ends).
        if self.status.is_some() {
            let _ = self.stderr_read.recv_timeout(std::time::Duration::from_secs(2));
        }
        let tail = self.stderr_tail.lock();
        let line = tail.iter().rev().find(|l| l.contains("error") || l.contains("ERROR"));
        line.cloned().unwrap_or_else(|| "no error message (killed or crashed)".into())
    }
}

/// The children; dropping it kills and reaps whatever still runs.
struct Children {
    list: Vec<Running>,
    /// The job's shared token, handed to every child in its environment
    /// (never on a command line, which every local user can read).
    token: String,
    /// Whether a restarted role keeps `FAILPOINTS` ([`LaunchOptions::failpoints_on_restart`]).
    failpoints_on_restart: bool,
}

impl Drop for Children {
    fn drop(&mut self) {
        for r in &mut self.list {
            if r.status.is_none() {
                let _ = r.child.kill();
                let _ = r.child.wait();
            }
        }
    }
}

/// Whether a child's end was a death (killed by a signal it does not
/// handle, a crash, a failpoint's exit, or a role that lost its peers and
/// gave up: exit 75) rather than a stop: an error exit, or
/// SIGTERM/SIGINT/SIGHUP, which a role handles by stopping the job.
fn died(status: ExitStatus) -> bool {
    let rejoin = i32::from(crate::transport::EXIT_REJOIN);
    status.signal().is_some() || status.code().is_some_and(|c| matches!(c, 101 | 134 | 137) || c == rejoin)
}

impl Children {
    fn spawn(
        &mut self,
        name: String,
        (kind, index): (&'static str, usize),
        args: &[String],
        quiet: bool,
    ) -> Result<usize, ClusterError> {
        let running = self.start(name, kind, index, args, quiet, false)?;
        self.list.push(running);
        Ok(self.list.len() - 1)
    }

    /// Starts child `i` again with its arguments (`args` when given).
    fn restart(&mut self, i: usize, args: Option<Vec<String>>, quiet: bool) -> Result<(), ClusterError> {
        let old = &self.list[i];
        let (name, kind, index) = (old.name.clone(), old.kind, old.index);
        let args = args.unwrap_or_else(|| old.args.clone());
        let mut running = self.start(name, kind, index, &args, quiet, true)?;
        running.restarts = old.restarts + 1;
        self.list[i] = running;
        Ok(())
    }

    fn start(
        &self,
        name: String,
        kind: &'static str,
        index: usize,
        args: &[String],
        quiet: bool,
        restarted: bool,
    ) -> Result<Running, ClusterError> {
        let exe = std::env::current_exe()
            .map_err(|e| ClusterError::Io { what: "finding the sparrow binary".into(), source: e })?;
        let mut command = Command::new(exe);
        command
            .args(args)
            .env(EXIT_WITH_PARENT_ENV, "1")
            // Its own process group: a terminal's Ctrl-C reaches launch
            // alone, which stops the job with a checkpoint.
            .process_group(0)
            .env(TOKEN_ENV, &self.token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Injected failures hit the first process of a role only (see `faults`).
        if restarted && !self.failpoints_on_restart {
            command.env_remove("FAILPOINTS");
        }
        let mut child =
            command.spawn().map_err(|e| ClusterError::Io { what: format!("starting {name}"), source: e })?;
        tracing::info!("launch: {name} is pid {}", child.id());
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (read_to_end, stderr_read) = crossbeam_channel::bounded::<()>(0);
        if let Some(out) = child.stdout.take() {
            let lines = stdout.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    lines.lock().push(line);
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            let (tail, prefix) = (stderr_tail.clone(), format!("[{name}] "));
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if !quiet {
                        let _ = writeln!(std::io::stderr().lock(), "{prefix}{line}");
                    }
                    let mut tail = tail.lock();
                    if tail.len() == 40 {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
                drop(read_to_end);
            });
        }
        let stdin = child.stdin.take();
        Ok(Running {
            name,
            kind,
            index,
            args: args.to_vec(),
            restarts: 0,
            stdin,
            child,
            stdout,
            stderr_tail,
            stderr_read,
            status: None,
        })
    }

    /// Reaps children that exited; returns those that failed.
    fn poll(&mut self) -> Vec<usize> {
        let mut failed = Vec::new();
        for (i, r) in self.list.iter_mut().enumerate() {
            if r.status.is_none()
                && let Ok(Some(status)) = r.child.try_wait()
            {
                r.status = Some(status);
                if !status.success() {
                    failed.push(i);
                }
            }
        }
        failed
    }

    /// Tells the coordinator (child 0) a line; it may be restarting.
    fn tell_coordinator(&mut self, line: &str) {
        self.tell(0, line);
    }

    /// A line to child `i` on its stdin (the roles' `notices`).
    fn tell(&mut self, i: usize, line: &str) {
        if let Some(stdin) = self.list[i].stdin.as_mut() {
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }

    fn describe_failure(&self, i: usize) -> String {
        let r = &self.list[i];
        let status = r.status.map(|s| s.to_string()).unwrap_or_default();
        let mut out = format!("{} exited ({status}): {}", r.name, r.last_error());
        for other in self.list.iter().filter(|o| o.name != r.name && o.status.is_some_and(|s| !s.success())) {
            out.push_str(&format!("\n  {} then exited: {}", other.name, other.last_error()));
        }
        out
    }
}

/// 128 random bits from the kernel, as hex.
fn random_token() -> Result<String, ClusterError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| ClusterError::Io { what: "reading /dev/urandom for the job's token".into(), source: e })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Runs the job; returns `train`'s summary fields plus the cluster's.
pub fn launch(
    options: &LaunchOptions,
    config: &Config,
    interrupted: &AtomicBool,
) -> Result<LaunchSummary, ClusterError> {
    let wall = Instant::now();
    crate::epochs::check(config)?;
    // Found now, not after training: a checkpoint directory we cannot write,
    // or one another run is using (held until the job ends).
    let _lock = config
        .checkpoint
        .dir
        .as_deref()
        .map(|dir| sparrow_trainer::dir_lock::DirLock::acquire(std::path::Path::new(dir), "checkpoint.dir"))
        .transpose()?;
    // Emptied (unless the job resumes) before any worker appends to it.
    crate::worker::start_metrics_file(config)?;
    // Loopback is no trust boundary on a shared host: without a configured
    // token the job gets a fresh random one, so no other local user can call
    // its roles.
    let collocated = config.cluster.mode == sparrow_core::config::ClusterMode::Collocated;
    if options.nodes.is_some() && !collocated {
        return Err(ClusterError::Setup(format!(
            "--nodes runs collocated nodes: it needs cluster.mode = \"collocated\" (this job's is \"{}\")",
            config.cluster.mode.name()
        )));
    }
    if options.nodes == Some(0) {
        return Err(ClusterError::Setup("--nodes must be at least 1".into()));
    }
    let (num_shards, num_workers) = options.nodes.map_or((options.shards, options.workers), |n| (n, n));
    let token = config.cluster.auth_token.clone().filter(|t| !t.is_empty()).map_or_else(random_token, Ok)?;
    let mut children = Children { list: Vec::new(), token, failpoints_on_restart: options.failpoints_on_restart };
    let local = "127.0.0.1:0".to_string();
    let mut args: Vec<String> =
        vec!["coordinator".into(), "--config".into(), options.config_path.display().to_string()];
    for s in &options.set {
        args.extend(["--set".into(), s.clone()]);
    }
    args.extend([
        "--shards".into(),
        num_shards.to_string(),
        "--workers".into(),
        num_workers.to_string(),
        "--aggregators".into(),
        options.aggregators.to_string(),
        "--listen".into(),
        local.clone(),
        "--metrics-listen".into(),
        local.clone(),
    ]);
    let coordinator = children.spawn("coordinator".into(), ("coordinator", 0), &args, options.quiet)?;
    // The coordinator prints `listening on ADDR` first.
    let deadline = Instant::now() + Duration::from_secs(30);
    let address = loop {
        if let Some(addr) =
            children.list[coordinator].stdout.lock().iter().find_map(|l| l.strip_prefix("listening on "))
        {
            break addr.to_string();
        }
        if let Some(&i) = children.poll().first() {
            return Err(ClusterError::Setup(children.describe_failure(i)));
        }
        if Instant::now() > deadline {
            return Err(ClusterError::Setup("the coordinator did not start within 30 s".into()));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let role = |kind: &str, index: Option<usize>| {
        let mut a = vec![kind.to_string(), "--coordinator".into(), address.clone(), "--listen".into(), local.clone()];
        if kind != "worker" {
            a.extend(["--metrics-listen".into(), local.clone()]);
        }
        if let Some(i) = index {
            a.extend(["--index".into(), i.to_string()]);
        }
        a
    };
    for i in 0..options.nodes.map_or(options.shards, |_| 0) {
        children.spawn(format!("shard {i}"), ("shard", i), &role("shard", Some(i)), options.quiet)?;
    }
    children.spawn("loader".into(), ("loader", 0), &role("loader", None), options.quiet)?;
    if config.cluster.sync == sparrow_core::config::SyncMode::Lazy {
        for i in 0..options.aggregators {
            let args = role("aggregator", Some(i));
            children.spawn(format!("aggregator {i}"), ("aggregator", i), &args, options.quiet)?;
        }
    }
    let workers: Vec<usize> = match options.nodes {
        Some(n) => (0..n)
            .map(|i| children.spawn(format!("node {i}"), ("node", i), &role("node", Some(i)), options.quiet))
            .collect::<Result<_, _>>()?,
        None => (0..options.workers)
            .map(|w| children.spawn(format!("worker {w}"), ("worker", w), &role("worker", Some(w)), options.quiet))
            .collect::<Result<_, _>>()?,
    };
    // A restarted coordinator must be where the others look for it.
    let coordinator_args: Vec<String> = {
        let mut a = children.list[coordinator].args.clone();
        if let Some(at) = a.iter().position(|x| x == "--listen") {
            a[at + 1] = address.clone();
        }
        a
    };
    let mut events = Events::default();
    let mut budgets = vec![crate::restart_budget::RestartBudget::new(config); children.list.len()];
    let loader = children.list.iter().position(|r| r.kind == "loader");
    let mut ending = false;

    // Until every worker is done, a death is recovered from (within the
    // budget) and any other failure ends the job.
    while !workers.iter().all(|&w| children.list[w].status.is_some_and(|s| s.success())) {
        // A stop signal ends the data where it is (the loader's `end data`):
        // the job trains what was read, checkpoints and ends as at its end.
        if interrupted.load(Ordering::SeqCst) && !ending {
            ending = true;
            match loader {
                Some(i) => {
                    tracing::warn!("launch: stopping: the training data ends here; the job checkpoints and stops");
                    children.tell(i, "end data");
                }
                None => return Err(ClusterError::Interrupted),
            }
        }
        for lost in events.read(&children.list[coordinator]) {
            // A role the coordinator found hung: kill it, the restart follows.
            // A node is its shard and its worker.
            let is = |r: &Running| r.kind == lost.0 || (r.kind == "node" && matches!(lost.0, "shard" | "worker"));
            if let Some(r) = children.list.iter_mut().find(|r| is(r) && r.index == lost.1 && r.status.is_none()) {
                tracing::warn!("launch: {} stopped answering; killing it", r.name);
                let _ = r.child.kill();
            }
        }
        let failed = children.poll();
        for &i in &failed {
            let r = &children.list[i];
            let status = r.status.unwrap_or_default();
            if interrupted.load(Ordering::SeqCst) {
                return Err(ClusterError::Interrupted);
            }
            let spent = if died(status) { budgets[i].spend(Instant::now()).err() } else { None };
            if !died(status) || spent.is_some() {
                // Let the others report what they saw (a worker names the shard it lost).
                std::thread::sleep(Duration::from_millis(300));
                children.poll();
                let mut message = children.describe_failure(i);
                if died(status) {
                    message.push_str(&format!(
                        "\n  {} died {} time(s): {}{}",
                        children.list[i].name,
                        children.list[i].restarts + 1,
                        budgets[i].spent(spent.unwrap_or_default()),
                        events
                            .last_committed
                            .as_ref()
                            .map_or(String::new(), |d| format!("; the last committed checkpoint is {d}"))
                    ));
                }
                return Err(ClusterError::JobFailed(message));
            }
            tracing::warn!("launch: {} died ({status}); restarting it", r.name);
            events.restarts.entry(r.kind.to_string()).and_modify(|n| *n += 1).or_insert(1);
            if i == coordinator {
                children.restart(i, Some(coordinator_args.clone()), options.quiet)?;
                events.coordinator_restarted();
            } else {
                let (kind, index, pid) = (r.kind, r.index, r.child.id());
                let kinds: &[&str] = if kind == "node" { &["shard", "worker"] } else { &[kind] };
                for kind in kinds {
                    children.tell_coordinator(&format!("lost {kind} {index} {pid}"));
                }
                children.restart(i, None, options.quiet)?;
                if ending && Some(i) == loader {
                    children.tell(i, "end data");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The other roles leave after their next heartbeat sees the job done.
    let grace = Instant::now() + Duration::from_millis(config.cluster.heartbeat_interval_ms * 4 + 3000);
    while children.list.iter().any(|r| r.status.is_none()) && Instant::now() < grace {
        if let Some(&i) = children.poll().first() {
            return Err(ClusterError::JobFailed(children.describe_failure(i)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    events.read(&children.list[coordinator]);
    let summaries: Vec<WorkerRunSummary> = workers
        .iter()
        .map(|&w| {
            let r = &children.list[w];
            let line = r.stdout.lock().last().cloned().unwrap_or_default();
            serde_json::from_str(&line)
                .map_err(|e| ClusterError::Setup(format!("{}: no summary on stdout ({e}): `{line}`", r.name)))
        })
        .collect::<Result<_, _>>()?;
    drop(children);
    let rows: u64 = summaries.iter().map(|w| w.train_rows).sum();
    if rows == 0 && config.checkpoint.resume_from.is_none() && !ending {
        let bad = summaries.iter().map(|w| w.bad_rows).max().unwrap_or(0);
        let source = match &config.data.stream {
            Some(s) => format!("kafka topic {}", s.topic),
            None => format!("data.train = {}", config.data.train.as_deref().unwrap_or_default()),
        };
        let why = match (bad, config.data.stream.is_some()) {
            (0, false) => sparrow_core::config::no_row_left(&config.data),
            (0, true) => sparrow_trainer::input::NO_RECORD.to_string(),
            (bad, _) => format!("all {bad} rows were malformed"),
        };
        return Err(ClusterError::Setup(format!("no training row in {source}: {why}")));
    }
    Ok(merge(config, options, &summaries, &events, wall.elapsed().as_secs_f64()))
}

/// What the coordinator reported on stdout (`event {json}` lines), summed
/// over its restarts, and what launch restarted.
#[derive(Default)]
struct Events {
    /// Lines of the current coordinator process already read.
    read_lines: usize,
    restarts: BTreeMap<String, u64>,
    checkpoints_committed: u64,
    checkpoints: Vec<CommittedCheckpoint>,
    steps_replayed: u64,
    recovery_secs: f64,
    last_committed: Option<String>,
    /// Payload bytes every role sent and received (the coordinator's report).
    role_bytes: u64,
}

impl Events {
    /// Reads the coordinator's new event lines; returns the roles it reported hung.
    fn read(&mut self, coordinator: &Running) -> Vec<(&'static str, usize)> {
        let lines = coordinator.stdout.lock();
        let mut lost = Vec::new();
        for line in lines.iter().skip(self.read_lines) {
            let Some(json) = line.strip_prefix("event ") else { continue };
            // An event this launcher does not know (a newer coordinator's) is skipped.
            let Ok(event) = serde_json::from_str::<Event>(json) else { continue };
            match event {
                Event::Generation { replayed, .. } => self.steps_replayed += replayed,
                Event::Replayed { steps } => self.steps_replayed += steps,
                // A planned generation (`data.validation`) is no recovery.
                Event::Resumed { secs, planned: false, .. } => self.recovery_secs += secs,
                Event::Resumed { .. } => {}
                Event::Report(report) => self.role_bytes = report.role_bytes,
                Event::Committed { step, dir, bytes, secs, incremental, shard_mb_per_sec } => {
                    self.checkpoints_committed += 1;
                    self.last_committed = Some(dir);
                    self.checkpoints.push(CommittedCheckpoint { step, bytes, secs, incremental, shard_mb_per_sec });
                }
                Event::Lost { role, index } => lost.push((role.name(), index)),
            }
        }
        self.read_lines = lines.len();
        lost
    }

    /// A new coordinator process: its stdout starts afresh.
    fn coordinator_restarted(&mut self) {
        self.read_lines = 0;
    }
}

/// What `sparrow launch` prints: `train`'s summary (fields a cluster run
/// cannot know are null) with worker 0's phases and the cluster's fields.
pub type LaunchSummary = RunSummary<crate::worker::WorkerPhaseSecs, ClusterFields>;

/// A committed checkpoint, as the final JSON lists it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommittedCheckpoint {
    pub step: u64,
    pub bytes: u64,
    pub secs: f64,
    pub incremental: bool,
    pub shard_mb_per_sec: Vec<f64>,
}

/// The fields only a cluster run has.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterFields {
    pub shards: usize,
    pub workers: usize,
    /// `cluster.mode = "collocated"` (S1): `--nodes`, the passes staged,
    /// level-1 reads while a pass was staged (0 by design), the second
    /// levels' peak rows (summed over nodes), row bytes fetched from other
    /// nodes' second level per trained sample, the loader's staging seconds
    /// and the share of them hidden behind training.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub l1_reads_during_pass: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub l2_peak_rows: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub l2_fetch_bytes_per_sample: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_staging_secs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_staging_hidden: Option<f64>,
    /// Payload bytes that crossed the network between roles (all roles,
    /// each byte counted once), per trained sample, as of the roles' last
    /// heartbeats; calls inside a process (a node's own shard) are not network.
    pub network_bytes_per_sample: f64,
    pub mode: &'static str,
    /// `cluster.sync`: step, round or lazy.
    pub sync: &'static str,
    /// Bytes the workers sent and received to agree on the dense weights,
    /// all workers, per sample trained.
    pub dense_sync_bytes_per_sample: f64,
    /// `sync = "round"`: rounds merged, and each worker's mean items per round.
    pub rounds: Option<u64>,
    pub items_per_round: Option<Vec<f64>>,
    /// `sync = "lazy"`: aggregators, aggregations, the iterations the
    /// workers trained locally, and how often each scheduler condition held
    /// an instruction back.
    pub aggregators: Option<usize>,
    pub aggregations: Option<u64>,
    pub local_iterations: Option<u64>,
    /// Per worker: seconds spent asking the scheduler and waiting for instructions.
    pub lazy_wait_secs: Option<Vec<f64>>,
    /// Backups the aggregator wrote (each also a serving export under `checkpoint.dir/exports/`).
    pub backups: Option<u64>,
    pub scheduler: Option<crate::lazy::LazyReport>,
    /// What a worker received per sample trained, by source.
    pub worker_in_bytes_per_sample: InBytes,
    /// Per worker: quantiles of different processes do not combine.
    pub pull_latency_ms: Vec<LatencyMs>,
    pub push_latency_ms: Vec<LatencyMs>,
    pub batches_per_worker: Vec<u64>,
    pub dense_checksums: Vec<String>,
    pub replicas_identical: bool,
    /// Role kind → how many times launch restarted it (`cluster.max_restarts`).
    pub restarts: BTreeMap<String, u64>,
    pub checkpoints_committed: u64,
    /// Each committed checkpoint: step, bytes written, full or incremental,
    /// seconds from the workers' meeting to the commit, each shard's MB/s.
    pub checkpoints: Vec<CommittedCheckpoint>,
    /// Training steps done twice because of failures.
    pub steps_replayed: u64,
    /// From each death being noticed to every role serving the job's next
    /// generation, summed.
    pub recovery_secs: f64,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct InBytes {
    pub loader: f64,
    pub shards: f64,
}

/// The job's summary from its workers'.
fn merge(
    config: &Config,
    options: &LaunchOptions,
    workers: &[WorkerRunSummary],
    events: &Events,
    wall_secs: f64,
) -> LaunchSummary {
    let first = workers.first().cloned().unwrap_or_default();
    let rows: u64 = workers.iter().map(|w| w.train_rows).sum();
    let train_secs = workers.iter().map(|w| w.train_secs).fold(0.0, f64::max);
    let per_sample = |bytes: u64| bytes as f64 / rows.max(1) as f64;
    let (keys, unique): (u64, u64) =
        workers.iter().fold((0, 0), |(k, u), w| (k + w.extra.keys, u + w.extra.unique_keys));
    let bayes = config.data.test.as_deref().and_then(|t| sparrow_trainer::run::read_truth(std::path::Path::new(t)));
    let checksums: Vec<String> = workers.iter().map(|w| w.extra.dense_checksum.clone()).collect();
    let collocated = config.cluster.mode == sparrow_core::config::ClusterMode::Collocated;
    RunSummary {
        test_auc: first.test_auc,
        tasks: first.tasks.clone(),
        test_logloss: first.test_logloss,
        train_rows: rows,
        truncated_sequences: workers.iter().map(|w| w.truncated_sequences).sum(),
        samples_per_sec: rows as f64 / train_secs.max(1e-9),
        wall_secs,
        peak_rss_bytes: workers.iter().map(|w| w.peak_rss_bytes).max().unwrap_or(0),
        embedding_rows: first.embedding_rows,
        bad_rows: workers.iter().map(|w| w.bad_rows).max().unwrap_or(0),
        model: config.model.kind.name().to_string(),
        steps: workers.iter().map(|w| w.steps).max().unwrap_or(0),
        train_secs,
        eval_secs: first.eval_secs,
        test_rows: first.test_rows,
        test_nan_predictions: first.test_nan_predictions,
        skipped_batches: workers.iter().map(|w| w.skipped_batches).sum(),
        merged_samples: workers.iter().map(|w| w.merged_samples).max().unwrap_or(0),
        dropped_samples: workers.iter().map(|w| w.dropped_samples).max().unwrap_or(0),
        sample_weight_sum: workers.iter().map(|w| w.sample_weight_sum).sum(),
        train_logloss: first.train_logloss,
        dedup_ratio: keys as f64 / unique.max(1) as f64,
        // Keys the loader sent to the shards per sample (8 bytes per unique key).
        shuffle_bytes_per_sample: 8.0 * unique as f64 / rows.max(1) as f64,
        // The shards' SSD tiers and feature filters, summed.
        table: first.table.clone(),
        embedding_bytes_per_row: None,
        checkpoint: first.checkpoint.clone().or_else(|| events.last_committed.clone()),
        resumed_from_step: None,
        // Worker 0's training time by phase (next_batch, pull, dense, push).
        step_phase_secs: first.step_phase_secs,
        bayes_auc: bayes.as_ref().map(|t| t.bayes_auc),
        bayes_logloss: bayes.as_ref().map(|t| t.bayes_logloss),
        // The furthest worker's mark (at the end every batch was trained).
        stream: sparrow_trainer::input::StreamReport::of(
            workers.iter().filter_map(|w| w.extra.stream_mark.as_ref()).max_by_key(|m| m.records),
        ),
        // Each worker scores its own batches: one worker's figures, or every
        // worker's counts added up.
        online: match workers.iter().map(|w| w.extra.online_tally.as_ref()).collect::<Option<Vec<_>>>() {
            Some(tallies) if tallies.len() > 1 => sparrow_trainer::online::OnlineReport::merged(&tallies),
            _ => first.online,
        },
        validation: first.validation.clone(),
        extra: ClusterFields {
            shards: options.nodes.unwrap_or(options.shards),
            workers: options.nodes.unwrap_or(options.workers),
            nodes: options.nodes,
            passes: collocated.then_some(first.extra.passes.passes),
            l1_reads_during_pass: first.extra.second_level.map(|l| l.l1_reads_during_pass),
            l2_peak_rows: first.extra.second_level.map(|l| l.peak_rows),
            l2_fetch_bytes_per_sample: collocated
                .then(|| per_sample(workers.iter().map(|w| w.extra.bytes_from_remote_shards).sum())),
            pass_staging_secs: collocated.then_some(first.extra.passes.staging_secs),
            pass_staging_hidden: collocated.then(|| {
                let p = first.extra.passes;
                if p.staging_secs > 0.0 { (1.0 - p.exposed_secs / p.staging_secs).clamp(0.0, 1.0) } else { 1.0 }
            }),
            mode: config.cluster.mode.name(),
            sync: config.cluster.sync.name(),
            dense_sync_bytes_per_sample: per_sample(workers.iter().map(|w| w.extra.dense_sync_bytes).sum()),
            rounds: (config.cluster.sync == sparrow_core::config::SyncMode::Round).then_some(first.extra.rounds),
            items_per_round: (config.cluster.sync == sparrow_core::config::SyncMode::Round).then(|| {
                first.extra.round_items.iter().map(|&m| m as f64 / first.extra.rounds.max(1) as f64).collect()
            }),
            aggregators: first.extra.lazy.as_ref().map(|_| options.aggregators),
            aggregations: first.extra.lazy.as_ref().map(|r| r.aggregations),
            local_iterations: first.extra.lazy.as_ref().map(|r| r.local_iterations),
            backups: first.extra.lazy.as_ref().map(|r| r.backups),
            lazy_wait_secs: first.extra.lazy.as_ref().map(|_| workers.iter().map(|w| w.extra.lazy_wait_secs).collect()),
            scheduler: first.extra.lazy.clone(),
            worker_in_bytes_per_sample: InBytes {
                loader: per_sample(workers.iter().map(|w| w.extra.bytes_from_loader).sum()),
                shards: per_sample(workers.iter().map(|w| w.extra.bytes_from_shards).sum()),
            },
            network_bytes_per_sample: per_sample(events.role_bytes / 2),
            pull_latency_ms: workers.iter().map(|w| w.extra.pull_latency_ms).collect(),
            push_latency_ms: workers.iter().map(|w| w.extra.push_latency_ms).collect(),
            batches_per_worker: workers.iter().map(|w| w.extra.batches).collect(),
            replicas_identical: checksums.windows(2).all(|w| w[0] == w[1]),
            dense_checksums: checksums,
            restarts: ["coordinator", "loader", "shard", "worker", "aggregator", "node"]
                .iter()
                .map(|k| (k.to_string(), events.restarts.get(*k).copied().unwrap_or(0)))
                .collect(),
            checkpoints_committed: events.checkpoints_committed,
            checkpoints: events.checkpoints.clone(),
            steps_replayed: events.steps_replayed,
            recovery_secs: events.recovery_secs,
        },
    }
}
