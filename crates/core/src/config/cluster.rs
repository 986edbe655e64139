//! `[cluster]` and `[cluster.lazy]`: how `sparrow launch` and the separate
//! roles run the job — the data path (S0, S1), how workers agree on the
//! dense weights (S0.6, S2, S4), and failure handling.

use serde::{Deserialize, Serialize};

/// How the split data path runs (SPEC S0).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ClusterMode {
    /// The loader sends each shard the keys it owns; workers get no raw IDs.
    #[default]
    S0,
    /// Baseline: workers receive whole samples (IDs included) and look the keys up themselves.
    WorkerLookup,
    /// S1: every node is a worker and a shard; a shard serves each pass
    /// from a second level holding only that pass's rows.
    Collocated,
}

/// S1.1: how a pass's IDs reach the nodes (`cluster.pass_request`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PassRequest {
    /// One ID list per node for the whole pass (seed claim 6).
    #[default]
    Whole,
    /// One ID list per node per batch of the pass (seed claim 7).
    PerBatch,
}

impl PassRequest {
    pub fn name(self) -> &'static str {
        match self {
            PassRequest::Whole => "whole",
            PassRequest::PerBatch => "per_batch",
        }
    }
}

impl ClusterMode {
    pub fn name(self) -> &'static str {
        match self {
            ClusterMode::S0 => "s0",
            ClusterMode::WorkerLookup => "worker_lookup",
            ClusterMode::Collocated => "collocated",
        }
    }
}

/// Settings of `sparrow launch` and of the separate roles.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The data path: `s0` (the split path: shards get the keys, workers
    /// only rows), `worker_lookup` (the baseline), `collocated` (S1).
    pub mode: ClusterMode,
    /// How often every role tells the coordinator it is alive.
    pub heartbeat_interval_ms: u64,
    /// A role silent for this long is reported dead and the job stops.
    pub heartbeat_timeout_ms: u64,
    /// How long a role keeps retrying (with backoff) a peer that is not up
    /// yet; also how long the coordinator keeps a lost role's slot for its
    /// replacement, and a role cut off from the coordinator (past the
    /// heartbeat timeout) keeps trying to rejoin before it exits 75.
    pub connect_timeout_ms: u64,
    /// Largest message a role sends or accepts; larger ones are refused with an error.
    pub max_message_bytes: usize,
    /// Shared secret checked on every RPC; required to listen on a non-loopback
    /// address. The environment variable `SPARROW_AUTH_TOKEN` overrides it.
    pub auth_token: Option<String>,
    /// Batches the loader prepares ahead of the workers (their keys already queued on the shards).
    pub loader_queue_batches: usize,
    /// A worker whose heartbeats go on but whose progress (steps, evaluated
    /// batches, checkpoints) has not moved for this long is lost (restarted,
    /// see `max_restarts`): a live heartbeat must not hide a hung role.
    pub progress_timeout_ms: u64,
    /// `sparrow launch` (and the coordinator of a multi-host job) restarts a
    /// role that died or stopped answering at most this many times per role
    /// within `restart_window_secs`; every role then goes back to the last
    /// committed checkpoint. 0: a dead role stops the job.
    pub max_restarts: u32,
    /// The window `max_restarts` counts a role's restarts in (sliding): a
    /// job that runs for days survives a death now and then, a role that
    /// keeps dying still fails it. 0: over the job's whole life.
    pub restart_window_secs: u64,
    /// How the workers' dense replicas agree (S0.6, S2, S4).
    pub sync: SyncMode,
    /// `sync = "round"`: items (batches) per worker per round; a round's
    /// queue holds workers × 1 batch per worker step × this many.
    pub round_iterations: u64,
    /// `sync = "round"`: how the coordinator merges the workers' updates.
    pub round_merge: RoundMergeRule,
    /// `sync = "lazy"`: the workers' local iterations, the scheduler, the aggregators.
    pub lazy: LazyConfig,
    /// `mode = "collocated"` (S1): batches per pass.
    pub pass_batches: u64,
    /// `mode = "collocated"`: one ID list per pass, or one per batch.
    pub pass_request: PassRequest,
    /// `mode = "collocated"`: rows a node's second level may hold (0: no
    /// limit). A pass ends early when its rows on a node would pass half of
    /// it (the next pass is staged beside the current one).
    pub l2_capacity_rows: u64,
}

/// How the workers' dense replicas agree on the weights (`cluster.sync`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SyncMode {
    /// Every dense step sums every worker's gradient (S0.6; a faster worker
    /// adds more batches to a step, S2.2).
    #[default]
    Step,
    /// Round queue on the loader, local updates, one summed push per round (S2).
    Round,
    /// Local iterations under a scheduler, weighted aggregation (S4).
    Lazy,
}

impl SyncMode {
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::Step => "step",
            SyncMode::Round => "round",
            SyncMode::Lazy => "lazy",
        }
    }
}

/// `cluster.round_merge`: what a round's merged update is.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RoundMergeRule {
    /// Σ M_k·Δ_k / Σ M_k: each worker's update weighted by the items it trained.
    #[default]
    Mean,
    /// Σ Δ_k: the seed's plain accumulation.
    Sum,
}

/// What a worker sends when an aggregation instruction names round r (S4.3).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LazySend {
    /// Its weights' change since the last aggregation (local SGD).
    #[default]
    Delta,
    /// The seed read literally: the gradient it computed at round r.
    RoundGradient,
}

/// How the scheduler's two conditions combine (S4.2).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Combine {
    #[default]
    And,
    Or,
}

/// How network utilisation is measured (S4.2).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Utilisation {
    /// All roles' bytes over all roles' link capacity.
    #[default]
    Total,
    /// The mean of per-role ratios, weighted by each role's bytes.
    Mean,
}

/// Which roles the scheduler's failure rate counts (S4.2).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProbeRoles {
    #[default]
    Workers,
    All,
}

/// `[cluster.lazy]`: lazy aggregation under a scheduler (S4).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LazyConfig {
    /// Iterations a worker trains since the last aggregation before it waits for one.
    pub max_local_iterations: u64,
    /// What a worker sends for an aggregation: `delta` or `round_gradient`.
    pub send: LazySend,
    /// Utilisation strictly below this lets an instruction go.
    pub max_net_utilisation: f64,
    /// Failure rate strictly below this lets an instruction go.
    pub max_failure_rate: f64,
    /// Whether an instruction needs both conditions (`and`) or either (`or`).
    pub combine: Combine,
    /// How network utilisation is measured: `total` or `mean`.
    pub utilisation: Utilisation,
    /// One role's link capacity (bytes per second, each way summed).
    pub link_bytes_per_sec: f64,
    /// How often the scheduler probes, measures and decides: at most one
    /// instruction per interval.
    pub probe_interval_ms: u64,
    /// A probe unanswered this long counts as a failure.
    pub probe_timeout_ms: u64,
    /// Which roles the failure rate counts: `workers` or `all`.
    pub probe_roles: ProbeRoles,
    /// Worker k sends to aggregator `aggregator_of[k]`; empty: worker k % aggregators.
    pub aggregator_of: Vec<usize>,
    /// A backup (and serving export) is written when the weights moved by at
    /// least this relative L2 distance since the last one.
    pub backup_min_change: f64,
}

impl Default for LazyConfig {
    fn default() -> Self {
        LazyConfig {
            max_local_iterations: 3,
            send: LazySend::Delta,
            max_net_utilisation: 0.3,
            max_failure_rate: 0.05,
            combine: Combine::And,
            utilisation: Utilisation::Total,
            link_bytes_per_sec: 1.25e9,
            probe_interval_ms: 50,
            probe_timeout_ms: 25,
            probe_roles: ProbeRoles::Workers,
            aggregator_of: Vec::new(),
            backup_min_change: 0.05,
        }
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            mode: ClusterMode::S0,
            heartbeat_interval_ms: 500,
            heartbeat_timeout_ms: 5000,
            connect_timeout_ms: 20_000,
            max_message_bytes: 64 << 20,
            auth_token: None,
            loader_queue_batches: 4,
            progress_timeout_ms: 300_000,
            max_restarts: 3,
            restart_window_secs: 3600,
            sync: SyncMode::Step,
            round_iterations: 4,
            round_merge: RoundMergeRule::Mean,
            lazy: LazyConfig::default(),
            pass_batches: 64,
            pass_request: PassRequest::Whole,
            l2_capacity_rows: 0,
        }
    }
}
