//! The coordinator role (S0.5): membership, the shard map, heartbeats and
//! liveness, the job's state, and the workers' gradient rounds (S0.6). Every
//! other role registers here first and receives the job's config; a role
//! silent for longer than `cluster.heartbeat_timeout_ms` (or a worker whose
//! progress stands still for `cluster.progress_timeout_ms`) fails the job,
//! naming it. Transport-free: `grpc::coordinator` serves it over the network.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sparrow_core::Config;

use crate::sync::{Contribution, RoundReply, RoundSum};
use crate::transport::ClusterError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    Shard,
    Loader,
    Worker,
}

impl RoleKind {
    pub fn name(self) -> &'static str {
        match self {
            RoleKind::Shard => "shard",
            RoleKind::Loader => "loader",
            RoleKind::Worker => "worker",
        }
    }
}

/// Where the job stands, as every role learns it from its heartbeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    Done,
    Failed(String),
}

struct Member {
    address: String,
    last_seen: Instant,
    /// A worker that finished stops sending heartbeats.
    finished: bool,
    /// The role's progress count, and when it last moved.
    progress: u64,
    progress_at: Instant,
}

struct Members {
    shards: Vec<Option<Member>>,
    loader: Option<Member>,
    workers: Vec<Option<Member>>,
}

impl Members {
    fn slots(&mut self, kind: RoleKind) -> &mut [Option<Member>] {
        match kind {
            RoleKind::Shard => &mut self.shards,
            RoleKind::Loader => std::slice::from_mut(&mut self.loader),
            RoleKind::Worker => &mut self.workers,
        }
    }
}

/// The coordinator's state (the gRPC service is a thin layer over it).
pub struct Coordinator {
    config_toml: String,
    num_shards: usize,
    num_workers: usize,
    heartbeat_timeout: Duration,
    progress_timeout: Duration,
    registration_deadline: Instant,
    members: Mutex<Members>,
    state: Mutex<JobState>,
    rounds: RoundSum,
}

impl Coordinator {
    /// The job's config, as registration hands it to every role.
    pub fn config_toml(&self) -> &str {
        &self.config_toml
    }

    pub fn num_shards(&self) -> usize {
        self.num_shards
    }

    pub fn num_workers(&self) -> usize {
        self.num_workers
    }

    pub fn new(config: &Config, num_shards: usize, num_workers: usize) -> Result<Coordinator, ClusterError> {
        if num_shards == 0 || num_workers == 0 {
            return Err(ClusterError::Setup("a job needs at least one shard and one worker".into()));
        }
        // Sizes beyond the machine fail here, before any role allocates.
        let layout = sparrow_data::DataLayout::from_config(&config.data);
        sparrow_trainer::sizes::check(config, &layout).map_err(|e| ClusterError::Train(e.into()))?;
        if config.train.on_non_finite == sparrow_core::config::OnNonFinite::SkipBatch {
            return Err(ClusterError::Setup(
                "train.on_non_finite = \"skip_batch\" is not available in a cluster job yet (a skipped batch \
                 would still owe its shards a push); use \"stop\", or sparrow train"
                    .into(),
            ));
        }
        let e = &config.embedding;
        if e.admit_min_count > 1 {
            // A shard's admission sketches travel in one export reply at checkpoint.
            let per_lock_shard = (e.admit_sketch_counters / e.table_shards).next_power_of_two().max(64);
            let sketch_bytes = per_lock_shard * e.table_shards;
            if 2 * sketch_bytes > config.cluster.max_message_bytes {
                return Err(ClusterError::Setup(format!(
                    "embedding.admit_sketch_counters = {} ({sketch_bytes} bytes per shard) must fit in half of \
                     cluster.max_message_bytes = {}: a shard sends its sketch in one message at checkpoint",
                    e.admit_sketch_counters, config.cluster.max_message_bytes
                )));
            }
        }
        let config_toml =
            toml::to_string(config).map_err(|e| ClusterError::Setup(format!("serializing the config: {e}")))?;
        Ok(Coordinator {
            config_toml,
            num_shards,
            num_workers,
            heartbeat_timeout: Duration::from_millis(config.cluster.heartbeat_timeout_ms),
            progress_timeout: Duration::from_millis(config.cluster.progress_timeout_ms),
            registration_deadline: Instant::now() + Duration::from_millis(config.cluster.connect_timeout_ms),
            members: Mutex::new(Members {
                shards: (0..num_shards).map(|_| None).collect(),
                loader: None,
                workers: (0..num_workers).map(|_| None).collect(),
            }),
            state: Mutex::new(JobState::Running),
            rounds: RoundSum::new(num_workers),
        })
    }

    pub fn state(&self) -> JobState {
        self.state.lock().clone()
    }

    /// Fails the job (the first reason wins) and wakes the workers' rounds.
    pub fn fail(&self, reason: String) {
        let mut state = self.state.lock();
        if *state == JobState::Running {
            tracing::error!("job failed: {reason}");
            *state = JobState::Failed(reason.clone());
            self.rounds.fail(reason);
        }
    }

    /// A role joins; `index` asks for a slot (a StatefulSet ordinal), else the first free one.
    pub fn register(&self, kind: RoleKind, address: String, index: Option<usize>) -> Result<usize, ClusterError> {
        let mut members = self.members.lock();
        let slots = members.slots(kind);
        let n = slots.len();
        let slot = match index {
            Some(i) if i >= n => {
                return Err(ClusterError::Setup(format!("{} {i}: the job has only {n}", kind.name())));
            }
            Some(i) if slots[i].is_some() => {
                return Err(ClusterError::Setup(format!("{} {i} is already registered", kind.name())));
            }
            Some(i) => i,
            None => slots.iter().position(Option::is_none).ok_or_else(|| {
                ClusterError::Setup(format!(
                    "all {n} {} slots are taken (--shards/--workers of the coordinator)",
                    kind.name()
                ))
            })?,
        };
        tracing::info!("{} {slot} registered at {address}", kind.name());
        let now = Instant::now();
        slots[slot] = Some(Member { address, last_seen: now, finished: false, progress: 0, progress_at: now });
        Ok(slot)
    }

    /// A role is alive; `progress` is its work count (see `HeartbeatRequest`).
    pub fn heartbeat(&self, kind: RoleKind, index: usize, progress: u64) -> Result<JobState, ClusterError> {
        let mut members = self.members.lock();
        match members.slots(kind).get_mut(index) {
            Some(Some(m)) => {
                let now = Instant::now();
                m.last_seen = now;
                if progress != m.progress {
                    (m.progress, m.progress_at) = (progress, now);
                }
            }
            _ => return Err(ClusterError::Setup(format!("{} {index} never registered", kind.name()))),
        }
        Ok(self.state())
    }

    /// The shard map and the loader's address, once all of them registered.
    pub fn view(&self) -> (bool, Vec<String>, String) {
        let members = self.members.lock();
        let shards: Vec<String> = members.shards.iter().flatten().map(|m| m.address.clone()).collect();
        let loader = members.loader.as_ref().map(|m| m.address.clone()).unwrap_or_default();
        (shards.len() == self.num_shards && members.loader.is_some(), shards, loader)
    }

    /// A worker is done (or a role failed); the job is done once all workers are.
    pub fn finish(&self, kind: RoleKind, index: usize, error: Option<String>) {
        if let Some(error) = error {
            self.fail(format!("{} {index}: {error}", kind.name()));
            return;
        }
        if kind != RoleKind::Worker {
            return;
        }
        let worker = index;
        let mut members = self.members.lock();
        if let Some(Some(m)) = members.workers.get_mut(worker) {
            m.finished = true;
        }
        if members.workers.iter().all(|m| m.as_ref().is_some_and(|m| m.finished)) {
            let mut state = self.state.lock();
            if *state == JobState::Running {
                tracing::info!("all {} workers finished", self.num_workers);
                *state = JobState::Done;
            }
        }
    }

    /// Fails the job if a registered role went silent, or if roles are still
    /// missing after the connect timeout.
    pub fn check_liveness(&self) {
        if self.state() != JobState::Running {
            return;
        }
        let members = self.members.lock();
        let groups = [
            (RoleKind::Shard, &members.shards[..]),
            (RoleKind::Loader, std::slice::from_ref(&members.loader)),
            (RoleKind::Worker, &members.workers[..]),
        ];
        let mut problem = None;
        for (kind, slots) in groups {
            for (i, slot) in slots.iter().enumerate() {
                match slot {
                    Some(m) if !m.finished && m.last_seen.elapsed() > self.heartbeat_timeout => {
                        problem = Some(format!(
                            "{} {i} at {} stopped answering: no heartbeat for {} ms (cluster.heartbeat_timeout_ms = {})",
                            kind.name(),
                            m.address,
                            m.last_seen.elapsed().as_millis(),
                            self.heartbeat_timeout.as_millis()
                        ));
                    }
                    // Workers drive the job: one that answers but gets
                    // nothing done is as stuck as a silent one. Counted from
                    // its first batch (shards restoring a large checkpoint
                    // may keep a worker waiting before it).
                    Some(m)
                        if kind == RoleKind::Worker
                            && !m.finished
                            && m.progress > 0
                            && m.progress_at.elapsed() > self.progress_timeout =>
                    {
                        problem = Some(format!(
                            "{} {i} at {} answers heartbeats but made no progress for {} ms (cluster.progress_timeout_ms = {}; progress count {})",
                            kind.name(),
                            m.address,
                            m.progress_at.elapsed().as_millis(),
                            self.progress_timeout.as_millis(),
                            m.progress
                        ));
                    }
                    None if Instant::now() > self.registration_deadline => {
                        problem =
                            Some(format!("{} {i} never registered within cluster.connect_timeout_ms", kind.name()));
                    }
                    _ => {}
                }
            }
        }
        drop(members);
        if let Some(problem) = problem {
            self.fail(problem);
        }
    }

    pub fn sum(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        self.rounds.sum(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(overrides: &[&str]) -> Config {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Config::from_toml_with_overrides("", "test", &overrides).expect("config")
    }

    #[test]
    fn an_admission_sketch_larger_than_half_a_message_is_refused_naming_both_keys() {
        let big = ["embedding.admit_min_count=2", "cluster.max_message_bytes=4194304"];
        let Err(e) = Coordinator::new(&config(&big), 1, 1) else { panic!("accepted") };
        let msg = e.to_string();
        assert!(msg.contains("embedding.admit_sketch_counters") && msg.contains("cluster.max_message_bytes"), "{msg}");
        assert!(Coordinator::new(&config(&["embedding.admit_min_count=2"]), 1, 1).is_ok(), "the defaults fit");
    }

    #[test]
    fn a_silent_role_fails_the_job_naming_it_after_the_timeout() {
        let c =
            Coordinator::new(&config(&["cluster.heartbeat_interval_ms=20", "cluster.heartbeat_timeout_ms=150"]), 2, 1)
                .expect("coordinator");
        assert_eq!(c.register(RoleKind::Shard, "10.0.0.5:7001".into(), Some(1)).expect("shard 1"), 1);
        assert_eq!(c.register(RoleKind::Shard, "10.0.0.4:7001".into(), None).expect("shard 0"), 0);
        assert!(c.register(RoleKind::Shard, "x".into(), None).is_err(), "only two shard slots");
        c.register(RoleKind::Loader, "l".into(), None).expect("loader");
        c.register(RoleKind::Worker, "w".into(), None).expect("worker");
        assert!(c.view().0, "complete");
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(400) {
            // Everyone but shard 1 keeps beating.
            for (kind, i) in [(RoleKind::Shard, 0), (RoleKind::Loader, 0), (RoleKind::Worker, 0)] {
                c.heartbeat(kind, i, start.elapsed().as_millis() as u64).expect("beat");
            }
            c.check_liveness();
            if c.state() != JobState::Running {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        match c.state() {
            JobState::Failed(m) => assert!(m.contains("shard 1 at 10.0.0.5:7001 stopped answering"), "{m}"),
            other => panic!("still {other:?} after {:?}", start.elapsed()),
        }
        assert!(start.elapsed() >= Duration::from_millis(140), "reported before the timeout");
        // Waiting workers are released with the reason.
        let contribution = Contribution { worker: 0, round: 0, grads: vec![1.0], rows: 1, patience: Duration::ZERO };
        let err = c.sum(contribution).expect_err("the job failed");
        assert!(err.to_string().contains("shard 1"), "{err}");
    }

    #[test]
    fn a_worker_that_beats_but_makes_no_progress_fails_the_job_naming_it() {
        // The hang of a NaN evaluation: the heartbeat thread beats on while
        // the worker's loop is stuck. Worker 0 progresses, worker 1 does not.
        let c = Coordinator::new(
            &config(&[
                "cluster.heartbeat_interval_ms=20",
                "cluster.heartbeat_timeout_ms=5000",
                "cluster.progress_timeout_ms=300",
            ]),
            1,
            2,
        )
        .expect("coordinator");
        c.register(RoleKind::Shard, "s".into(), None).expect("shard");
        c.register(RoleKind::Loader, "l".into(), None).expect("loader");
        c.register(RoleKind::Worker, "10.0.0.7:9101".into(), Some(0)).expect("worker 0");
        c.register(RoleKind::Worker, "10.0.0.8:9101".into(), Some(1)).expect("worker 1");
        let start = Instant::now();
        let mut steps = 0;
        while start.elapsed() < Duration::from_millis(1500) && c.state() == JobState::Running {
            steps += 1;
            c.heartbeat(RoleKind::Shard, 0, 0).expect("beat");
            c.heartbeat(RoleKind::Loader, 0, 0).expect("beat");
            c.heartbeat(RoleKind::Worker, 0, steps).expect("beat");
            c.heartbeat(RoleKind::Worker, 1, 7).expect("beat");
            c.check_liveness();
            std::thread::sleep(Duration::from_millis(20));
        }
        match c.state() {
            JobState::Failed(m) => {
                assert!(m.contains("worker 1 at 10.0.0.8:9101") && m.contains("no progress"), "{m}");
                assert!(m.contains("cluster.progress_timeout_ms"), "{m}");
            }
            other => panic!("still {other:?} after {:?}", start.elapsed()),
        }
        assert!(start.elapsed() >= Duration::from_millis(290), "reported before the timeout");
    }

    #[test]
    fn the_job_is_done_when_every_worker_finished() {
        let c = Coordinator::new(&config(&[]), 1, 2).expect("coordinator");
        c.register(RoleKind::Worker, "a".into(), None).expect("w0");
        c.register(RoleKind::Worker, "b".into(), None).expect("w1");
        c.finish(RoleKind::Worker, 0, None);
        assert_eq!(c.state(), JobState::Running);
        c.finish(RoleKind::Worker, 1, None);
        assert_eq!(c.state(), JobState::Done);
    }
}
