//! Membership and liveness: the job's slots by role kind, what each
//! registered role last told the coordinator, and which went silent. One
//! lock, a leaf: nothing else is locked or called while it is held.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::lock_order::{OrderedMutex, Rank};

use super::{RoleId, RoleKind, View};
use crate::generation::Generation;
use crate::lazy::ProbeTarget;
use crate::transport::ClusterError;

struct Member {
    address: String,
    last_seen: Instant,
    /// The generation in which a worker finished its work (0: none).
    finished_in: Generation,
    /// The role's progress count, and when it last moved.
    progress: u64,
    progress_at: Instant,
    /// The generation it has restored and serves (0: none yet).
    ready: Generation,
    /// Its payload bytes so far, when it reported them, and its bytes per
    /// second between its last two reports (S4.2 utilisation).
    bytes: u64,
    bytes_at: Instant,
    byte_rate: f64,
    /// Where it answers the scheduler's probes.
    probe: Option<String>,
    /// Its process id (0: not given), see `vacate`.
    pid: u32,
}

struct Members {
    shards: Vec<Option<Member>>,
    loader: Option<Member>,
    workers: Vec<Option<Member>>,
    /// `sync = "lazy"` with aggregator processes (none: aggregators in process).
    aggregators: Vec<Option<Member>>,
    /// Bytes last reported by roles that were replaced.
    retired_bytes: u64,
    /// When a lost role's slot fell vacant (its replacement must register
    /// within `cluster.connect_timeout_ms` of it).
    vacant_since: HashMap<RoleId, Instant>,
}

impl Members {
    fn slots(&mut self, kind: RoleKind) -> &mut [Option<Member>] {
        match kind {
            RoleKind::Shard => &mut self.shards,
            RoleKind::Loader => std::slice::from_mut(&mut self.loader),
            RoleKind::Worker => &mut self.workers,
            RoleKind::Aggregator => &mut self.aggregators,
        }
    }

    fn groups(&self) -> [(RoleKind, &[Option<Member>]); 4] {
        [
            (RoleKind::Shard, &self.shards[..]),
            (RoleKind::Loader, std::slice::from_ref(&self.loader)),
            (RoleKind::Worker, &self.workers[..]),
            (RoleKind::Aggregator, &self.aggregators[..]),
        ]
    }
}

/// What a liveness check found.
#[derive(Default)]
pub struct Liveness {
    /// A slot nobody took within `cluster.connect_timeout_ms`.
    pub missing: Option<String>,
    /// Registered roles that went silent or stopped progressing.
    pub lost: Vec<(RoleId, String)>,
}

/// How long roles may be silent or stuck.
pub struct Timeouts {
    pub heartbeat: Duration,
    pub progress: Duration,
    pub connect: Duration,
    /// The first registrations' deadline.
    pub registration: Instant,
}

pub struct Membership {
    members: OrderedMutex<Members>,
}

impl Membership {
    pub fn new(num_shards: usize, num_workers: usize) -> Self {
        Membership {
            members: OrderedMutex::new(
                Rank::Leaf,
                "membership.members",
                Members {
                    shards: (0..num_shards).map(|_| None).collect(),
                    loader: None,
                    workers: (0..num_workers).map(|_| None).collect(),
                    aggregators: Vec::new(),
                    retired_bytes: 0,
                    vacant_since: HashMap::new(),
                },
            ),
        }
    }

    /// `k` aggregator processes register like any role.
    pub fn expect_aggregators(&self, k: usize) {
        self.members.lock().aggregators = (0..k).map(|_| None).collect();
    }

    pub fn slot_count(&self, kind: RoleKind) -> usize {
        self.members.lock().slots(kind).len()
    }

    pub fn free_slot(&self, kind: RoleKind) -> Option<usize> {
        self.members.lock().slots(kind).iter().position(Option::is_none)
    }

    pub fn is_taken(&self, role: RoleId) -> bool {
        self.members.lock().slots(role.kind).get(role.index).is_some_and(Option::is_some)
    }

    /// Frees the slot of a role that died, for process `pid` (0: whichever
    /// holds it). False when there was nothing to free: the slot is empty,
    /// or a replacement (another pid) already took it.
    pub fn vacate(&self, role: RoleId, pid: u32) -> bool {
        let mut members = self.members.lock();
        let Some(slot) = members.slots(role.kind).get_mut(role.index) else { return false };
        if let Some(member) = slot.as_ref()
            && pid != 0
            && member.pid != 0
            && member.pid != pid
        {
            tracing::debug!("{role}: process {pid} is gone; {} already took its place", member.pid);
            return false;
        }
        let Some(gone) = slot.take() else { return false };
        members.retired_bytes += gone.bytes;
        members.vacant_since.insert(role, Instant::now());
        true
    }

    /// Role `role` registered at `address` (a previous holder is replaced).
    pub fn take(&self, role: RoleId, address: String, pid: u32) {
        let now = Instant::now();
        let mut members = self.members.lock();
        members.vacant_since.remove(&role);
        if let Some(old) = members.slots(role.kind)[role.index].take() {
            members.retired_bytes += old.bytes;
        }
        members.slots(role.kind)[role.index] = Some(Member {
            address,
            last_seen: now,
            finished_in: Generation::NONE,
            progress: 0,
            progress_at: now,
            ready: Generation::NONE,
            bytes: 0,
            bytes_at: now,
            byte_rate: 0.0,
            probe: None,
            pid,
        });
    }

    /// A heartbeat: the role is alive, at `progress`, serving `ready`.
    pub fn beat(&self, role: RoleId, progress: u64, ready: Generation) -> Result<(), ClusterError> {
        let mut members = self.members.lock();
        let Some(Some(m)) = members.slots(role.kind).get_mut(role.index) else {
            return Err(ClusterError::Setup(format!("{role} never registered")));
        };
        let now = Instant::now();
        m.last_seen = now;
        if progress != m.progress {
            (m.progress, m.progress_at) = (progress, now);
        }
        m.ready = ready;
        Ok(())
    }

    /// A role's traffic so far (`bytes`) and its probe address, from a heartbeat.
    pub fn traffic(&self, role: RoleId, bytes: u64, probe: &str) {
        let mut members = self.members.lock();
        if let Some(Some(m)) = members.slots(role.kind).get_mut(role.index) {
            let now = Instant::now();
            let secs = now.duration_since(m.bytes_at).as_secs_f64();
            if bytes >= m.bytes && secs > 0.0 {
                m.byte_rate = (bytes - m.bytes) as f64 / secs;
            }
            (m.bytes, m.bytes_at) = (bytes, now);
            if !probe.is_empty() {
                m.probe = Some(probe.to_string());
            }
        }
    }

    /// Payload bytes every role reported so far, replaced ones included.
    pub fn role_bytes(&self) -> u64 {
        let members = self.members.lock();
        let live: u64 = members.groups().iter().flat_map(|(_, s)| s.iter().flatten()).map(|m| m.bytes).sum();
        members.retired_bytes + live
    }

    /// Every registered role's bytes per second (S4.2 utilisation).
    pub fn byte_rates(&self) -> Vec<f64> {
        let members = self.members.lock();
        members.groups().iter().flat_map(|(_, s)| s.iter().flatten()).map(|m| m.byte_rate).collect()
    }

    /// The roles the scheduler probes (every kind, or workers only),
    /// workers finished in `generation` aside.
    pub fn probe_targets(&self, all: bool, generation: Generation) -> Vec<ProbeTarget> {
        let members = self.members.lock();
        let mut targets = Vec::new();
        for (kind, slots) in members.groups() {
            if !all && kind != RoleKind::Worker {
                continue;
            }
            for (i, m) in slots.iter().enumerate() {
                if m.as_ref().is_none_or(|m| m.finished_in != generation) {
                    targets.push(ProbeTarget {
                        name: RoleId::new(kind, i).to_string(),
                        vacant: m.is_none(),
                        address: m.as_ref().and_then(|m| m.probe.clone()),
                    });
                }
            }
        }
        targets
    }

    /// Whether every slot's role serves `generation`.
    pub fn all_ready(&self, generation: Generation) -> bool {
        let members = self.members.lock();
        members.groups().iter().all(|(_, s)| s.iter().all(|m| m.as_ref().is_some_and(|m| m.ready == generation)))
    }

    /// The shard map and the loader's address, and whether they serve `generation`.
    pub fn view(&self, generation: Generation) -> View {
        let members = self.members.lock();
        let serves = |m: &Option<Member>| m.as_ref().is_some_and(|m| m.ready == generation);
        let shards_ready = members.shards.iter().all(serves);
        let address = |m: &Option<Member>| m.as_ref().map(|m| m.address.clone()).unwrap_or_default();
        View {
            complete: shards_ready && serves(&members.loader) && members.aggregators.iter().all(serves),
            shards_ready,
            shards: members.shards.iter().map(address).collect(),
            loader: address(&members.loader),
            aggregators: members.aggregators.iter().map(address).collect(),
        }
    }

    /// Worker `index` finished in `generation`: whether every worker has.
    pub fn worker_finished(&self, index: usize, generation: Generation) -> bool {
        let mut members = self.members.lock();
        if let Some(Some(m)) = members.workers.get_mut(index) {
            m.finished_in = generation;
        }
        members.workers.iter().all(|m| m.as_ref().is_some_and(|m| m.finished_in == generation))
    }

    /// Registered roles silent past the heartbeat timeout, workers whose
    /// progress stood still past the progress timeout (both unless finished
    /// in `generation`), and slots still empty past their deadline.
    pub fn check(&self, t: &Timeouts, generation: Generation) -> Liveness {
        let members = self.members.lock();
        let mut found = Liveness::default();
        for (kind, slots) in members.groups() {
            for (i, slot) in slots.iter().enumerate() {
                let role = RoleId::new(kind, i);
                match slot {
                    Some(m) if m.finished_in == generation => {}
                    Some(m) if m.last_seen.elapsed() > t.heartbeat => found.lost.push((
                        role,
                        format!(
                            "at {} stopped answering: no heartbeat for {} ms (cluster.heartbeat_timeout_ms = {})",
                            m.address,
                            m.last_seen.elapsed().as_millis(),
                            t.heartbeat.as_millis()
                        ),
                    )),
                    // Workers drive the job: one that answers but gets
                    // nothing done is as stuck as a silent one. Counted from
                    // its first batch (shards restoring a large checkpoint
                    // may keep a worker waiting before it).
                    Some(m) if kind == RoleKind::Worker && m.progress > 0 && m.progress_at.elapsed() > t.progress => {
                        found.lost.push((
                            role,
                            format!(
                                "at {} answers heartbeats but made no progress for {} ms (cluster.progress_timeout_ms = {}; progress count {})",
                                m.address,
                                m.progress_at.elapsed().as_millis(),
                                t.progress.as_millis(),
                                m.progress
                            ),
                        ))
                    }
                    Some(_) => {}
                    None => {
                        let deadline =
                            members.vacant_since.get(&role).map_or(t.registration, |at| *at + t.connect);
                        if Instant::now() > deadline {
                            found.missing = Some(format!("{role} never registered within cluster.connect_timeout_ms"));
                        }
                    }
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_death_notice_does_not_free_the_replacements_slot() {
        let m = Membership::new(1, 1);
        m.take(RoleId::new(RoleKind::Shard, 0), "a".into(), 100);
        m.take(RoleId::new(RoleKind::Shard, 0), "b".into(), 200);
        assert!(!m.vacate(RoleId::new(RoleKind::Shard, 0), 100), "process 100 was replaced");
        assert!(m.is_taken(RoleId::new(RoleKind::Shard, 0)));
        assert!(m.vacate(RoleId::new(RoleKind::Shard, 0), 200));
        assert!(!m.vacate(RoleId::new(RoleKind::Shard, 0), 200), "once");
        assert_eq!(m.free_slot(RoleKind::Shard), Some(0));
    }

    #[test]
    fn a_workers_finish_counts_in_its_generation_only() {
        let m = Membership::new(1, 2);
        m.take(RoleId::new(RoleKind::Worker, 0), "a".into(), 0);
        m.take(RoleId::new(RoleKind::Worker, 1), "b".into(), 0);
        assert!(!m.worker_finished(0, Generation(1)));
        assert!(m.worker_finished(1, Generation(1)));
        assert!(!m.worker_finished(1, Generation(2)), "worker 0 finished in generation 1, not 2");
    }
}
