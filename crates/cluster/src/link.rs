//! A role's link to the coordinator: its registration, and a heartbeat
//! thread that keeps what the coordinator last said (the job's state and
//! generation), registers the role again with a coordinator that does not
//! know it (restarted, or one that took the role for dead), and treats a
//! silent coordinator as a possible death: it keeps trying to rejoin for
//! `cluster.connect_timeout_ms` past the heartbeat timeout, then gives up
//! (exit 75, [`crate::transport::EXIT_REJOIN`]). A doorbell thread holds a
//! call the coordinator answers when the job's generation or state changes,
//! and asks for a heartbeat then: a role hears a new generation (a
//! recovery, the next stretch after a validation point) or the job's end at
//! once, not up to an interval later.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sparrow_core::config::ClusterConfig;

use crate::coordinator::{Attempt, JobState, Known, RoleId, RoleKind};
use crate::generation::Generation;
use crate::grpc::coordinator::CoordinatorClient;
use crate::transport::ClusterError;

/// A role's link to the coordinator: its registration, and heartbeats on a
/// thread of their own that keep what the coordinator last said (the job's
/// state and generation). A role that outlives a coordinator registers
/// again with the next one (same index), telling it what it knew.
pub(crate) struct Link {
    client: CoordinatorClient,
    pub(crate) role: RoleId,
    pub(crate) shared: Arc<LinkShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the heartbeat thread last heard, and what it is to tell next.
struct Heard {
    state: JobState,
    attempt: Attempt,
    /// The generation served before and the step reached in it.
    previous: (u64, u64),
    /// Beat at once (a role's news), not at the next interval.
    beat_now: bool,
}

pub(crate) struct LinkShared {
    heard: parking_lot::Mutex<Heard>,
    /// The job state or attempt heard changed.
    changed: parking_lot::Condvar,
    /// The generation number last heard (read by a worker between steps).
    pub(crate) generation: Arc<AtomicU64>,
    /// The generation this role serves (0: restoring).
    ready: AtomicU64,
    pub(crate) step: Arc<AtomicU64>,
    pub(crate) progress: Arc<AtomicU64>,
    /// A beat is asked for (or the link stops).
    wake: parking_lot::Condvar,
    stop: AtomicBool,
    /// When the coordinator last answered (milliseconds since `epoch`).
    /// Silent past the heartbeat timeout, it takes this role for dead; the
    /// heartbeat thread keeps trying, to rejoin once the network is back.
    last_answer_ms: AtomicU64,
    epoch: Instant,
    /// The silence was reported (logged once, and once when it ends).
    silent: AtomicBool,
    /// The heartbeat thread gave up rejoining (the job state then says why).
    gave_up: AtomicBool,
}

impl Link {
    pub(crate) fn register(
        client: CoordinatorClient,
        kind: RoleKind,
        advertise: &str,
        index: Option<usize>,
    ) -> Result<(Link, crate::grpc::coordinator::Registration), ClusterError> {
        let reg = client.register(kind, advertise, index, None)?;
        let role = RoleId::new(kind, reg.index);
        let shared = Arc::new(LinkShared {
            heard: parking_lot::Mutex::new(Heard {
                state: JobState::Running,
                attempt: reg.generation.clone(),
                previous: (0, 0),
                beat_now: false,
            }),
            changed: parking_lot::Condvar::new(),
            generation: Arc::new(AtomicU64::new(reg.generation.number.number())),
            ready: AtomicU64::new(0),
            step: Arc::default(),
            progress: Arc::default(),
            wake: parking_lot::Condvar::new(),
            stop: AtomicBool::new(false),
            last_answer_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            silent: AtomicBool::new(false),
            gave_up: AtomicBool::new(false),
        });
        let thread = {
            let (client, shared, cluster) = (client.clone(), shared.clone(), reg.config.cluster.clone());
            let advertise = advertise.to_string();
            std::thread::Builder::new()
                .name("sparrow-heartbeat".into())
                .spawn(move || heartbeats(&client, role, &advertise, &cluster, &shared))
                .map_err(|e| ClusterError::Io { what: "starting the heartbeat thread".into(), source: e })?
        };
        // Not joined: it ends within one wait of the link's end (a role
        // does not wait for it to exit).
        {
            let (client, shared, cluster) = (client.clone(), shared.clone(), reg.config.cluster.clone());
            std::thread::Builder::new()
                .name("sparrow-doorbell".into())
                .spawn(move || doorbell(&client, &cluster, &shared))
                .map_err(|e| ClusterError::Io { what: "starting the doorbell thread".into(), source: e })?;
        }
        Ok((Link { client, role, shared, thread: Some(thread) }, reg))
    }

    pub(crate) fn heard(&self) -> (JobState, Attempt) {
        let heard = self.shared.heard.lock();
        (heard.state.clone(), heard.attempt.clone())
    }

    /// A new attempt starts: what the last one served and reached is kept
    /// for the coordinator (a worker's steps past the checkpoint are replayed).
    pub(crate) fn begin_attempt(&self) {
        let ready = self.shared.ready.load(Ordering::Relaxed);
        if ready > 0 {
            self.shared.heard.lock().previous = (ready, self.shared.step.load(Ordering::Relaxed));
        }
    }

    /// This role serves `generation` now (the coordinator hears it at once).
    pub(crate) fn set_ready(&self, generation: Generation) {
        self.shared.ready.store(generation.number(), Ordering::Relaxed);
        self.beat();
    }

    fn beat(&self) {
        self.shared.beat();
    }

    /// After an attempt failed as a peer's death would make it fail: waits
    /// for the job's next generation (or its end). While the coordinator
    /// answers, at most the recovery wait (a death is noticed within the
    /// heartbeat timeout, so no new generation means the failure was this
    /// role's own); while it is silent (a network partition, or its own
    /// death), as long as the heartbeat thread tries to rejoin. True when
    /// the job moved on or ended.
    pub(crate) fn await_recovery(&self, number: Generation, cluster: &ClusterConfig) -> bool {
        loop {
            let (state, next) = self.wait_change(number, recovery_wait(cluster));
            if state != JobState::Running || next.number != number {
                return true;
            }
            if !self.shared.coordinator_silent(cluster) {
                return false;
            }
        }
    }

    /// What the job's end means for this role (`Ok` when done).
    pub(crate) fn ended(&self, state: JobState) -> Result<(), ClusterError> {
        match state {
            JobState::Failed(reason) => Err(self.failure(reason)),
            _ => Ok(()),
        }
    }

    /// A failed job, as this role's error: the job's failure, or this role's
    /// giving up on the coordinator (then a restart rejoins).
    pub(crate) fn failure(&self, reason: String) -> ClusterError {
        if self.shared.gave_up.load(Ordering::Relaxed) {
            ClusterError::CoordinatorLost(reason)
        } else {
            ClusterError::JobFailed(reason)
        }
    }

    /// Waits until the job leaves generation `number` or ends (or `timeout`
    /// passes); returns what was heard last.
    pub(crate) fn wait_change(&self, number: Generation, timeout: Duration) -> (JobState, Attempt) {
        let deadline = Instant::now() + timeout;
        let mut heard = self.shared.heard.lock();
        while heard.state == JobState::Running && heard.attempt.number == number {
            if self.shared.changed.wait_until(&mut heard, deadline).timed_out() {
                break;
            }
        }
        (heard.state.clone(), heard.attempt.clone())
    }

    /// Reports this role's end in `generation`, or its failure.
    pub(crate) fn finish(&self, error: Option<String>, generation: Generation) {
        if let Err(e) = self.client.finish(self.role, error, generation) {
            tracing::warn!("{}: reporting to the coordinator: {e}", self.role);
        }
    }
}

impl LinkShared {
    /// The heartbeat thread beats at once.
    fn beat(&self) {
        self.heard.lock().beat_now = true;
        self.wake.notify_all();
    }

    fn answered(&self) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_answer_ms.store(now, Ordering::Relaxed);
    }

    /// Whether the coordinator has not answered for longer than the
    /// heartbeat timeout (then it takes this role for dead).
    fn coordinator_silent(&self, cluster: &ClusterConfig) -> bool {
        let since =
            self.epoch.elapsed().as_millis().saturating_sub(u128::from(self.last_answer_ms.load(Ordering::Relaxed)));
        since > u128::from(cluster.heartbeat_timeout_ms)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The heartbeat thread: beats every `heartbeat_interval_ms` (or at once
/// when asked), keeps the answers. A coordinator that does not know this
/// role (it restarted, or it took this role for dead) gets it registered
/// again. One silent for `heartbeat_timeout_ms` takes this role for dead
/// (a partition looks the same from either side): the thread keeps trying
/// for `connect_timeout_ms` more (as long as the coordinator keeps a lost
/// role's slot for its replacement), so that a healed network rejoins the
/// role to the job's next generation; then it gives up (exit code 75: a
/// restart registers again).
fn heartbeats(client: &CoordinatorClient, role: RoleId, advertise: &str, cluster: &ClusterConfig, shared: &LinkShared) {
    let interval = Duration::from_millis(cluster.heartbeat_interval_ms);
    let timeout = Duration::from_millis(cluster.heartbeat_timeout_ms);
    let rejoin = timeout + Duration::from_millis(cluster.connect_timeout_ms);
    let mut last_answer = Instant::now();
    let set = |state: JobState, generation: Attempt| {
        shared.generation.store(generation.number.number(), Ordering::Relaxed);
        {
            let mut heard = shared.heard.lock();
            heard.state = state;
            heard.attempt = generation;
        }
        shared.changed.notify_all();
    };
    // The job ends for this role with `reason`, in the generation last heard.
    let fail = |reason: String| {
        let mut heard = shared.heard.lock();
        heard.state = JobState::Failed(reason);
        drop(heard);
        shared.changed.notify_all();
    };
    // No answer for longer than the rejoin budget: this role gives up.
    let give_up = |since: Instant, e: &ClusterError| {
        shared.gave_up.store(true, Ordering::Relaxed);
        fail(format!("{}: no answer for {} ms, giving up: {e}", client.name(), since.elapsed().as_millis()));
    };
    while !shared.stop.load(Ordering::Relaxed) {
        let previous = {
            let mut heard = shared.heard.lock();
            if !heard.beat_now {
                shared.wake.wait_for(&mut heard, interval);
            }
            heard.beat_now = false;
            heard.previous
        };
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let (ready, step) = (shared.ready.load(Ordering::Relaxed), shared.step.load(Ordering::Relaxed));
        match client.heartbeat(role, shared.progress.load(Ordering::Relaxed), ready, step, previous) {
            Ok((state, generation)) => {
                last_answer = Instant::now();
                shared.answered();
                if shared.silent.swap(false, Ordering::Relaxed) {
                    tracing::info!("{role}: {} answers again", client.name());
                }
                let ended = state != JobState::Running;
                set(state, generation);
                if ended {
                    return;
                }
            }
            Err(ClusterError::Rpc { message, .. }) if message.contains("never registered") => {
                let known = {
                    let heard = shared.heard.lock();
                    Known { generation: heard.attempt.number, committed: heard.attempt.committed.clone(), step }
                };
                match client.register(role.kind, advertise, Some(role.index), Some(&known)) {
                    Ok(reg) => {
                        tracing::info!("{role}: registered again with the coordinator");
                        last_answer = Instant::now();
                        shared.answered();
                        shared.silent.store(false, Ordering::Relaxed);
                        set(JobState::Running, reg.generation);
                    }
                    Err(e) if matches!(e, ClusterError::Rpc { .. }) && last_answer.elapsed() <= rejoin => {
                        tracing::warn!("{role}: registering again: {e}");
                    }
                    // Refused (the job failed, the slot is gone) or too long without an answer.
                    Err(e) => {
                        fail(format!("{}: registering again: {e}", client.name()));
                        return;
                    }
                }
            }
            Err(e) if last_answer.elapsed() > rejoin => {
                give_up(last_answer, &e);
                return;
            }
            Err(e) if last_answer.elapsed() > timeout => {
                if !shared.silent.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{role}: {}: no answer for {} ms: it takes this role for dead; trying to rejoin for {} \
                         ms more: {e}",
                        client.name(),
                        last_answer.elapsed().as_millis(),
                        (rejoin - last_answer.elapsed()).as_millis()
                    );
                }
                shared.changed.notify_all();
            }
            Err(e) => tracing::warn!("heartbeat: {e}"),
        }
    }
}

/// The doorbell thread: holds a `WaitChange` call (half the heartbeat
/// timeout at most, well inside the RPC timeout); when the coordinator
/// answers with a change this role has not seen (or for the first time, since
/// a change may have come before), the heartbeat thread beats at once and
/// learns it. The heartbeats stay the one source of what the role knows: a
/// spurious ring costs one beat. An unreachable coordinator, or one without
/// the call, leaves the role to its heartbeats' interval.
fn doorbell(client: &CoordinatorClient, cluster: &ClusterConfig, shared: &LinkShared) {
    let interval = Duration::from_millis(cluster.heartbeat_interval_ms);
    let wait = Duration::from_millis(cluster.heartbeat_timeout_ms / 2).max(interval);
    let mut seen: Option<u64> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        match client.wait_change(seen.unwrap_or(u64::MAX), wait) {
            Ok(changes) => {
                if seen != Some(changes) {
                    shared.beat();
                }
                seen = Some(changes);
            }
            Err(ClusterError::Rpc { message, .. }) if message.starts_with("Unimplemented") => return,
            Err(_) => {
                // Silent or restarting: heartbeats handle it; try again later.
                seen = None;
                let mut heard = shared.heard.lock();
                if !shared.stop.load(Ordering::Relaxed) {
                    shared.wake.wait_for(&mut heard, interval);
                }
            }
        }
    }
}

/// How long a role whose peer failed waits for the job's next generation
/// before it calls the failure its own: a death is noticed within the
/// heartbeat timeout, and the new generation follows at once.
pub(crate) fn recovery_wait(cluster: &ClusterConfig) -> Duration {
    Duration::from_millis(2 * cluster.heartbeat_timeout_ms + cluster.heartbeat_interval_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::Coordinator;
    use crate::grpc::{NetSettings, bind, server_builder};
    use crate::metrics::RoleMetrics;
    use sparrow_core::{Config, Overrides};

    /// Heartbeats a minute apart: a shard's link still hears the generation
    /// a worker's death starts at once (the doorbell rings), where before it
    /// heard it only at its next heartbeat.
    #[test]
    fn a_new_generation_is_heard_at_once_not_at_the_next_heartbeat() {
        let sets = ["cluster.heartbeat_interval_ms=60000", "cluster.heartbeat_timeout_ms=600000"];
        let overrides = Overrides::parse(&sets.map(String::from)).expect("overrides");
        let config = Config::from_toml("", "test", &overrides).expect("config");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let settings = NetSettings::new(&config.cluster, None);
        let coordinator = Arc::new(Coordinator::new(&config, 1, 1).expect("coordinator"));
        let (listener, bound) = rt.block_on(bind("127.0.0.1:0".parse().expect("addr"), &settings)).expect("bind");
        let service =
            crate::grpc::coordinator::service(coordinator.clone(), &settings, RoleMetrics::new("coordinator"));
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        rt.spawn(server_builder().add_service(service).serve_with_incoming(incoming));
        let client =
            |role| CoordinatorClient::connect(&bound.to_string(), &settings, rt.handle(), RoleMetrics::new(role));
        let (shard, _) = Link::register(client("shard").expect("client"), RoleKind::Shard, "127.0.0.1:9", None)
            .expect("shard registers");
        let (_worker, _) =
            Link::register(client("worker").expect("client"), RoleKind::Worker, "-", None).expect("worker registers");
        let first = shard.heard().1.number;
        coordinator.lost(RoleId::new(RoleKind::Worker, 0), "stopped answering");
        // The bound is for a failure only: a minute's heartbeat would come later.
        let (state, heard) = shard.wait_change(first, Duration::from_secs(30));
        assert_eq!(state, JobState::Running);
        assert_eq!(heard.number, first.next(), "the new generation, heard at once");
    }
}
