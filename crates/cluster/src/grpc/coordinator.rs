//! The coordinator over gRPC: the service converts requests and forwards
//! them to the [`Coordinator`] role on the blocking pool; the client is how
//! the other roles call it.

use sparrow_core::Overrides;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sparrow_core::Config;
use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::lazy_wire::{aggregated_from, aggregated_reply, contribution_from, contribution_request, f64s_to_bytes};
use super::lazy_wire::{lazy_report_from_pb, lazy_report_to_pb, partial_from};
use super::stopping_wire::{stopping_from, stopping_to_proto};
use super::{AuthedChannel, CheckToken, NetSettings, Peer, blocking, bytes_to_f32s, connect, f32s_to_bytes};
use crate::checkpoint::{CheckpointSink, WorkerCut};
use crate::coordinator::{Attempt, Coordinator, JobState, Known, RoleId, RoleKind, View};
use crate::generation::Generation;
use crate::lazy::{Aggregated, Contribution as LazyContribution, FinalWeights, Instruction, LazyLink};
use crate::metrics::RoleMetrics;
use crate::rounds::{MergedRound, RoundMerger, RoundUpdate};
use crate::sync::{Contribution, RoundReply, RoundSummer};
use crate::transport::ClusterError;

/// The longest a doorbell call (`WaitChange`) is held.
const MAX_DOORBELL_WAIT_MS: u64 = 60_000;

fn generation_to_proto(g: &Attempt) -> pb::Generation {
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|d| d.display().to_string()).unwrap_or_default();
    pb::Generation { number: g.number.number(), restore: path(&g.restore), committed: path(&g.committed) }
}

fn generation_from(g: Option<pb::Generation>) -> Attempt {
    let g = g.unwrap_or_default();
    let path = |p: String| (!p.is_empty()).then(|| std::path::PathBuf::from(p));
    Attempt { number: Generation(g.number), restore: path(g.restore), committed: path(g.committed) }
}

pub(super) fn position_to_proto(p: sparrow_core::batch::DataPosition) -> pb::DataPosition {
    pb::DataPosition { epoch: p.epoch, offset: p.offset, line: p.line, skip: p.skip }
}

pub(super) fn position_from(p: Option<pb::DataPosition>) -> sparrow_core::batch::DataPosition {
    let p = p.unwrap_or_default();
    sparrow_core::batch::DataPosition { epoch: p.epoch, offset: p.offset, line: p.line, skip: p.skip }
}

pub(crate) fn mark_to_proto(m: &sparrow_core::batch::StreamMark) -> pb::StreamMark {
    pb::StreamMark {
        offsets: m.offsets.iter().map(|(&p, &o)| (p, o)).collect(),
        next_partition: m.next_partition,
        records: m.records,
        bad_records: m.bad_records,
        future_records: m.future_records,
        gap_records: m.gap_records,
        offset_resets: m.offset_resets,
        tails: m.tails.iter().map(|(&p, &t)| (p, t)).collect(),
        lag_records: m.lag_records,
        newest_record_ms: m.newest_record_ms,
        clock_ms: m.clock_ms,
        from: m.from.iter().map(|(&p, &o)| (p, o)).collect(),
        skip: m
            .skip
            .iter()
            .map(|(&p, ranges)| {
                (
                    p,
                    pb::OffsetRanges {
                        from: ranges.iter().map(|r| r.0).collect(),
                        to: ranges.iter().map(|r| r.1).collect(),
                    },
                )
            })
            .collect(),
    }
}

pub(crate) fn mark_from(m: pb::StreamMark) -> sparrow_core::batch::StreamMark {
    sparrow_core::batch::StreamMark {
        offsets: m.offsets.into_iter().collect(),
        next_partition: m.next_partition,
        records: m.records,
        bad_records: m.bad_records,
        future_records: m.future_records,
        gap_records: m.gap_records,
        offset_resets: m.offset_resets,
        tails: m.tails.into_iter().collect(),
        lag_records: m.lag_records,
        newest_record_ms: m.newest_record_ms,
        clock_ms: m.clock_ms,
        from: m.from.into_iter().collect(),
        skip: m.skip.into_iter().map(|(p, r)| (p, r.from.into_iter().zip(r.to).collect())).collect(),
    }
}

fn role_to_proto(kind: RoleKind) -> pb::Role {
    match kind {
        RoleKind::Shard => pb::Role::Shard,
        RoleKind::Loader => pb::Role::Loader,
        RoleKind::Worker => pb::Role::Worker,
        RoleKind::Aggregator => pb::Role::Aggregator,
    }
}

fn role_from_proto(role: i32) -> Result<RoleKind, Status> {
    match pb::Role::try_from(role) {
        Ok(pb::Role::Shard) => Ok(RoleKind::Shard),
        Ok(pb::Role::Loader) => Ok(RoleKind::Loader),
        Ok(pb::Role::Worker) => Ok(RoleKind::Worker),
        Ok(pb::Role::Aggregator) => Ok(RoleKind::Aggregator),
        _ => Err(Status::invalid_argument(format!("unknown role {role}"))),
    }
}

struct CoordinatorGrpc {
    coordinator: Arc<Coordinator>,
    metrics: RoleMetrics,
}

pub(super) fn status(e: ClusterError) -> Status {
    super::to_status(&e)
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for CoordinatorGrpc {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterReply>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role)?;
        let index = usize::try_from(r.index).ok();
        let known = (r.generation > 0).then(|| Known {
            generation: Generation(r.generation),
            committed: (!r.committed.is_empty()).then(|| std::path::PathBuf::from(&r.committed)),
            step: r.step,
        });
        let coordinator = self.coordinator.clone();
        let pid = r.pid;
        let (index, generation) =
            blocking(move || coordinator.register_process(kind, r.address, index, known, pid)).await?;
        Ok(Response::new(pb::RegisterReply {
            index: index as u32,
            num_shards: self.coordinator.num_shards() as u32,
            num_workers: self.coordinator.num_workers() as u32,
            num_aggregators: self.coordinator.num_aggregators() as u32,
            config_toml: self.coordinator.config_toml().to_string(),
            generation: Some(generation_to_proto(&generation)),
        }))
    }

    async fn heartbeat(&self, request: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatReply>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role)?;
        let role = RoleId::new(kind, r.index as usize);
        let coordinator = self.coordinator.clone();
        let (state, generation) = blocking(move || {
            let answer = coordinator.heartbeat(role, r.progress, Generation(r.ready_generation), r.step)?;
            coordinator.traffic(role, r.bytes, &r.probe_address);
            coordinator.previous_step(kind, Generation(r.previous_generation), r.previous_step);
            Ok(answer)
        })
        .await?;
        let mut reply = state_reply(&state);
        reply.generation = Some(generation_to_proto(&generation));
        Ok(Response::new(reply))
    }

    async fn wait_change(
        &self,
        request: Request<pb::WaitChangeRequest>,
    ) -> Result<Response<pb::WaitChangeReply>, Status> {
        let r = request.into_inner();
        let mut changes = self.coordinator.changes();
        // Bounded: an answer within the caller's RPC timeout, never a parked task.
        let wait = Duration::from_millis(u64::from(r.wait_ms).min(MAX_DOORBELL_WAIT_MS));
        let _ = tokio::time::timeout(wait, changes.wait_for(|&n| n != r.seen)).await;
        let changes = *changes.borrow();
        Ok(Response::new(pb::WaitChangeReply { changes }))
    }

    async fn view(&self, request: Request<pb::ViewRequest>) -> Result<Response<pb::ViewReply>, Status> {
        let asked = request.into_inner().generation;
        let coordinator = self.coordinator.clone();
        let (view, state, current) = blocking(move || {
            Ok((coordinator.view(Generation(asked)), coordinator.state(), coordinator.generation().number))
        })
        .await?;
        let state = state_reply(&state);
        Ok(Response::new(pb::ViewReply {
            complete: view.complete,
            shards: view.shards,
            loader: view.loader,
            state: state.state,
            message: state.message,
            shards_ready: view.shards_ready,
            generation: current.number(),
            aggregators: view.aggregators,
        }))
    }

    async fn checkpoint(
        &self,
        request: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointReply>, Status> {
        let r = request.into_inner();
        let cut = WorkerCut {
            worker: r.worker as usize,
            generation: Generation(r.generation),
            step: r.step,
            samples_trained: r.samples_trained,
            dense_optimizer_step: r.dense_optimizer_step,
            position: position_from(r.position),
            wrote_dense: r.wrote_dense,
            trained: r
                .trained
                .into_iter()
                .map(|b| sparrow_trainer::checkpoint::TrainedBatch {
                    start: position_from(b.start),
                    end: position_from(b.end),
                    stream: b.stream.map(mark_from),
                })
                .collect(),
            stream: r.stream.map(mark_from),
            last: r.last,
            early_stopping: r.early_stopping.map(stopping_from),
        };
        let coordinator = self.coordinator.clone();
        let committed = blocking(move || coordinator.checkpoint(cut)).await?;
        Ok(Response::new(pb::CheckpointReply {
            committed: committed.dir.display().to_string(),
            next_step: committed.next_step,
            export_only: !committed.checkpoint,
        }))
    }

    async fn sum_gradients(&self, request: Request<pb::SumRequest>) -> Result<Response<pb::SumReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.grads.len());
        let grads = bytes_to_f32s(&r.grads, &format!("worker {}", r.worker), "gradients").map_err(status)?;
        let coordinator = self.coordinator.clone();
        let patience = Duration::from_micros(r.patience_us);
        let wait = (r.wait_ms > 0).then(|| Duration::from_millis(r.wait_ms.into()));
        let (worker, generation, round) = (r.worker as usize, Generation(r.generation), r.round);
        let c = Contribution { worker, generation, round, grads, rows: r.rows, patience, wait };
        let answered = match r.awaiting {
            true => {
                let wait = wait.unwrap_or(Duration::from_secs(1));
                blocking(move || coordinator.rounds().await_round(worker, generation, round, wait)).await?
            }
            false => blocking(move || coordinator.sum(c)).await?,
        };
        let reply = match answered {
            RoundReply::Open => pb::SumReply { open: true, ..Default::default() },
            RoundReply::Pending => pb::SumReply { pending: true, ..Default::default() },
            RoundReply::Closed(result) => {
                pb::SumReply { grads: f32s_to_bytes(&result.0), rows: result.1, ..Default::default() }
            }
        };
        self.metrics.count_bytes("out", "worker", reply.grads.len());
        self.metrics.observe("server", "sum_gradients", start.elapsed().as_secs_f64());
        Ok(Response::new(reply))
    }

    async fn merge_round(&self, request: Request<pb::MergeRequest>) -> Result<Response<pb::MergeReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.delta.len());
        let delta = bytes_to_f32s(&r.delta, &format!("worker {}", r.worker), "round update").map_err(status)?;
        let update = RoundUpdate {
            worker: r.worker as usize,
            generation: Generation(r.generation),
            round: r.round,
            delta,
            items: r.items,
            samples: r.samples,
        };
        let coordinator = self.coordinator.clone();
        let merged = blocking(move || coordinator.merge_round(update)).await?;
        let reply = pb::MergeReply {
            delta: f32s_to_bytes(&merged.delta),
            items: merged.items.clone(),
            samples: merged.samples,
        };
        self.metrics.count_bytes("out", "worker", reply.delta.len());
        self.metrics.observe("server", "merge_round", start.elapsed().as_secs_f64());
        Ok(Response::new(reply))
    }

    async fn lazy(&self, request: Request<pb::LazyRequest>) -> Result<Response<pb::LazyReply>, Status> {
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.values.len() + r.partial.len());
        let coordinator = self.coordinator.clone();
        let (worker, generation) = (r.worker as usize, Generation(r.generation));
        let kind = pb::lazy_request::Kind::try_from(r.kind)
            .map_err(|_| Status::invalid_argument(format!("worker {worker}: unknown lazy request kind {}", r.kind)))?;
        let reply = match kind {
            pb::lazy_request::Kind::Poll => {
                let (since, finished, wait) = (r.since, r.finished, r.wait);
                let i =
                    blocking(move || LazyLink::poll(&*coordinator, worker, generation, since, finished, wait)).await?;
                pb::LazyReply {
                    instruction: i.as_ref().map_or(0, |i| i.id),
                    round: i.as_ref().map_or(0, |i| i.round),
                    participants: i.map(|i| i.participants.iter().map(|&w| w as u32).collect()).unwrap_or_default(),
                    ..Default::default()
                }
            }
            pb::lazy_request::Kind::Contribute => {
                let c = contribution_from(r)?;
                let done = blocking(move || LazyLink::contribute(&*coordinator, c)).await?;
                aggregated_reply(done, None)
            }
            pb::lazy_request::Kind::Partial => {
                let p = partial_from(r)?;
                let (done, weights) = blocking(move || coordinator.contribute_partial(p)).await?;
                aggregated_reply(done, Some(weights))
            }
            pb::lazy_request::Kind::Final => {
                let done = blocking(move || LazyLink::final_weights(&*coordinator, generation)).await?;
                pb::LazyReply {
                    has_weights: true,
                    weights: f32s_to_bytes(&done.weights),
                    report: Some(lazy_report_to_pb(&done.report)),
                    job_batches: done.job_batches,
                    job_samples: done.job_samples,
                    committed: done.committed.is_some(),
                    committed_step: done.committed.unwrap_or(0),
                    ..Default::default()
                }
            }
        };
        self.metrics.count_bytes("out", "worker", reply.weights.len());
        Ok(Response::new(reply))
    }

    async fn finish(&self, request: Request<pb::FinishRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role).unwrap_or(RoleKind::Worker);
        let coordinator = self.coordinator.clone();
        let error = (!r.error.is_empty()).then_some(r.error);
        blocking(move || {
            coordinator.finish(RoleId::new(kind, r.worker as usize), error, Generation(r.generation));
            Ok(())
        })
        .await?;
        Ok(Response::new(pb::Empty {}))
    }
}

fn state_reply(state: &JobState) -> pb::HeartbeatReply {
    let (state, message) = match state {
        JobState::Running => (pb::JobState::Running, String::new()),
        JobState::Done => (pb::JobState::Done, String::new()),
        JobState::Failed(m) => (pb::JobState::Failed, m.clone()),
    };
    pb::HeartbeatReply { state: state as i32, message, generation: None }
}

fn state_from(state: i32, message: String) -> JobState {
    match pb::JobState::try_from(state) {
        Ok(pb::JobState::Done) => JobState::Done,
        Ok(pb::JobState::Failed) => JobState::Failed(message),
        _ => JobState::Running,
    }
}

pub fn service(
    coordinator: Arc<Coordinator>,
    settings: &NetSettings,
    metrics: RoleMetrics,
) -> InterceptedService<pb::coordinator_server::CoordinatorServer<impl pb::coordinator_server::Coordinator>, CheckToken>
{
    let inner = pb::coordinator_server::CoordinatorServer::new(CoordinatorGrpc { coordinator, metrics })
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    InterceptedService::new(inner, CheckToken::new(settings))
}

type Client = pb::coordinator_client::CoordinatorClient<AuthedChannel>;

/// What registration returns to a role.
pub struct Registration {
    pub index: usize,
    pub num_shards: usize,
    pub num_workers: usize,
    pub num_aggregators: usize,
    pub config: Config,
    pub generation: Attempt,
}

/// A generation's view, as a role polls it.
pub struct ViewAnswer {
    pub view: View,
    pub state: JobState,
    /// The job's current generation.
    pub generation: Generation,
}

/// The coordinator as the other roles see it.
#[derive(Clone)]
pub struct CoordinatorClient {
    peer: Peer<Client>,
    /// Where this role answers the scheduler's probes (its metrics endpoint).
    probe_address: Arc<parking_lot::Mutex<String>>,
    metrics: RoleMetrics,
    /// The longest a gradient sum may wait for the other workers before it
    /// answers `Open`: well inside the call's deadline. A worker's "batch
    /// time" includes its wait for the batch, which on an idle stream is
    /// any length.
    max_patience: std::time::Duration,
}

impl CoordinatorClient {
    pub fn connect(
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<CoordinatorClient, ClusterError> {
        let name = format!("coordinator at {addr}");
        let channels = handle.block_on(connect(addr, &name, settings))?;
        let make = |channel| {
            pb::coordinator_client::CoordinatorClient::with_interceptor(channel, channels.token.clone())
                .max_decoding_message_size(settings.max_message_bytes)
                .max_encoding_message_size(settings.max_message_bytes)
        };
        let (client, untimed) = (make(channels.timed.clone()), make(channels.untimed.clone()));
        Ok(CoordinatorClient {
            peer: Peer::new(name, "coordinator", client, handle.clone(), metrics.clone(), settings)
                .with_untimed(untimed),
            probe_address: Arc::default(),
            metrics,
            max_patience: settings.rpc_timeout / 4,
        })
    }

    /// Heartbeats from now on tell the coordinator this role answers probes at `addr`.
    pub fn set_probe_address(&self, addr: std::net::SocketAddr) {
        *self.probe_address.lock() = addr.to_string();
    }

    pub fn name(&self) -> &str {
        &self.peer.name
    }

    /// Registers a role; `known`: what a role that outlived a coordinator knew.
    pub fn register(
        &self,
        kind: RoleKind,
        address: &str,
        index: Option<usize>,
        known: Option<&Known>,
    ) -> Result<Registration, ClusterError> {
        let request = pb::RegisterRequest {
            role: role_to_proto(kind) as i32,
            address: address.to_string(),
            index: index.map_or(-1, |i| i as i64),
            generation: known.map_or(0, |k| k.generation.number()),
            committed: known.and_then(|k| k.committed.as_ref()).map(|d| d.display().to_string()).unwrap_or_default(),
            step: known.map_or(0, |k| k.step),
            pid: std::process::id(),
        };
        let reply = self.peer.call("register", request, |mut c, r| async move { c.register(r).await })?;
        let config = Config::from_toml(&reply.config_toml, "the coordinator's config", &Overrides::none())?;
        Ok(Registration {
            index: reply.index as usize,
            num_shards: reply.num_shards as usize,
            num_workers: reply.num_workers as usize,
            num_aggregators: reply.num_aggregators as usize,
            config,
            generation: generation_from(reply.generation),
        })
    }

    /// A heartbeat: this role serves generation `ready` (0: none yet), a
    /// worker is at `step`. Answers the job's state and generation.
    pub fn heartbeat(
        &self,
        role: RoleId,
        progress: u64,
        ready: u64,
        step: u64,
        previous: (u64, u64),
    ) -> Result<(JobState, Attempt), ClusterError> {
        let request = pb::HeartbeatRequest {
            role: role_to_proto(role.kind) as i32,
            index: role.index as u32,
            progress,
            ready_generation: ready,
            step,
            previous_generation: previous.0,
            previous_step: previous.1,
            bytes: self.metrics.total_bytes(),
            probe_address: self.probe_address.lock().clone(),
        };
        let reply = self.peer.call("heartbeat", request, |mut c, r| async move { c.heartbeat(r).await })?;
        Ok((state_from(reply.state, reply.message), generation_from(reply.generation)))
    }

    /// The doorbell: waits (at most `wait`) until the job's generation or
    /// state changed from the count `seen`; the count now.
    pub fn wait_change(&self, seen: u64, wait: Duration) -> Result<u64, ClusterError> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        let request = pb::WaitChangeRequest { seen, wait_ms };
        let reply = self.peer.call("wait_change", request, |mut c, r| async move { c.wait_change(r).await })?;
        Ok(reply.changes)
    }

    /// Generation `generation`'s view, once.
    pub fn view(&self, generation: Generation) -> Result<ViewAnswer, ClusterError> {
        let request = pb::ViewRequest { generation: generation.number() };
        let view = self.peer.call("view", request, |mut c, r| async move { c.view(r).await })?;
        Ok(ViewAnswer {
            state: state_from(view.state, view.message),
            generation: Generation(view.generation),
            view: View {
                complete: view.complete,
                shards_ready: view.shards_ready,
                shards: view.shards,
                loader: view.loader,
                aggregators: view.aggregators,
            },
        })
    }

    /// Waits (polling with backoff, up to `timeout`) until every shard (and,
    /// unless `shards_only`, the loader) serves `generation`; returns its
    /// view. Gives up when the job moves to another generation or ends.
    pub fn wait_for_view(
        &self,
        generation: Generation,
        shards_only: bool,
        timeout: Duration,
    ) -> Result<View, ClusterError> {
        let start = Instant::now();
        let mut wait = Duration::from_millis(5);
        loop {
            let answer = self.view(generation)?;
            if let JobState::Failed(m) = answer.state {
                return Err(ClusterError::JobFailed(m));
            }
            if answer.generation != generation {
                return Err(ClusterError::GenerationChanged { generation: answer.generation });
            }
            let view = answer.view;
            if view.complete || (shards_only && view.shards_ready) {
                return Ok(view);
            }
            if start.elapsed() > timeout {
                let ready = view.shards.iter().filter(|a| !a.is_empty()).count();
                return Err(ClusterError::Setup(format!(
                    "{}: only {ready} shard(s){} serve generation {generation} after {} ms",
                    self.peer.name,
                    if view.loader.is_empty() { " and no loader" } else { "" },
                    start.elapsed().as_millis()
                )));
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(200));
        }
    }

    /// Reports a worker's end in `generation`, or any role's failure (`error`).
    pub fn finish(&self, role: RoleId, error: Option<String>, generation: Generation) -> Result<(), ClusterError> {
        let request = pb::FinishRequest {
            worker: role.index as u32,
            error: error.unwrap_or_default(),
            role: role_to_proto(role.kind) as i32,
            generation: generation.number(),
        };
        self.peer.call("finish", request, |mut c, r| async move { c.finish(r).await })?;
        Ok(())
    }
}

impl RoundSummer for CoordinatorClient {
    fn sum_round(&self, c: Contribution) -> Result<RoundReply, ClusterError> {
        let request = pb::SumRequest {
            worker: c.worker as u32,
            round: c.round,
            grads: f32s_to_bytes(&c.grads),
            rows: c.rows,
            patience_us: c.patience.min(self.max_patience).as_micros() as u64,
            generation: c.generation.number(),
            wait_ms: self.wait_ms(),
            awaiting: false,
        };
        self.summed(request)
    }

    fn await_round(&self, worker: usize, generation: Generation, round: u64) -> Result<RoundReply, ClusterError> {
        let (worker, generation) = (worker as u32, generation.number());
        self.summed(pb::SumRequest {
            worker,
            round,
            generation,
            wait_ms: self.wait_ms(),
            awaiting: true,
            ..Default::default()
        })
    }
}

impl CoordinatorClient {
    /// How long the coordinator may hold a sum before it answers `pending`:
    /// half the call's deadline.
    fn wait_ms(&self) -> u32 {
        (self.max_patience * 2).as_millis().clamp(1, u32::MAX.into()) as u32
    }

    fn summed(&self, request: pb::SumRequest) -> Result<RoundReply, ClusterError> {
        let reply = self.peer.call("sum_gradients", request, |mut c, r| async move { c.sum_gradients(r).await })?;
        if reply.open {
            return Ok(RoundReply::Open);
        }
        if reply.pending {
            return Ok(RoundReply::Pending);
        }
        Ok(RoundReply::Closed(Arc::new((
            bytes_to_f32s(&reply.grads, &self.peer.name, "summed gradients")?,
            reply.rows,
        ))))
    }
}

impl RoundMerger for CoordinatorClient {
    fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        let request = pb::MergeRequest {
            worker: u.worker as u32,
            generation: u.generation.number(),
            round: u.round,
            delta: f32s_to_bytes(&u.delta),
            items: u.items,
            samples: u.samples,
        };
        // A round lasts as long as its slowest worker: no RPC deadline (a
        // dead worker ends the wait through the next generation).
        let reply =
            self.peer.call_unbounded("merge_round", request, |mut c, r| async move { c.merge_round(r).await })?;
        Ok(Arc::new(MergedRound {
            delta: bytes_to_f32s(&reply.delta, &self.peer.name, "merged round")?,
            items: reply.items,
            samples: reply.samples,
        }))
    }
}

impl CoordinatorClient {
    fn lazy_call(&self, request: pb::LazyRequest) -> Result<pb::LazyReply, ClusterError> {
        // Waiting for an instruction or for the other workers has no deadline.
        self.peer.call_unbounded("lazy", request, |mut c, r| async move { c.lazy(r).await })
    }
}

impl LazyLink for CoordinatorClient {
    fn poll(
        &self,
        worker: usize,
        generation: Generation,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<Instruction>, ClusterError> {
        let request = pb::LazyRequest {
            worker: worker as u32,
            generation: generation.number(),
            kind: pb::lazy_request::Kind::Poll as i32,
            since,
            finished,
            wait,
            ..Default::default()
        };
        let reply = self.lazy_call(request)?;
        Ok((reply.instruction > 0).then(|| Instruction {
            id: reply.instruction,
            round: reply.round,
            participants: reply.participants.iter().map(|&w| w as usize).collect(),
        }))
    }

    fn contribute(&self, c: LazyContribution) -> Result<Aggregated, ClusterError> {
        let reply = self.lazy_call(contribution_request(c))?;
        aggregated_from(reply, &self.peer.name)
    }

    fn final_weights(&self, generation: Generation) -> Result<FinalWeights, ClusterError> {
        let request = pb::LazyRequest {
            generation: generation.number(),
            kind: pb::lazy_request::Kind::Final as i32,
            ..Default::default()
        };
        let reply = self.lazy_call(request)?;
        Ok(FinalWeights {
            weights: bytes_to_f32s(&reply.weights, &self.peer.name, "final weights")?,
            report: reply.report.map(lazy_report_from_pb).unwrap_or_default(),
            job_batches: reply.job_batches,
            job_samples: reply.job_samples,
            committed: reply.committed.then_some(reply.committed_step),
        })
    }
}

impl CheckpointSink for CoordinatorClient {
    fn checkpoint(&self, cut: WorkerCut) -> Result<crate::checkpoint::Committed, ClusterError> {
        let request = pb::CheckpointRequest {
            worker: cut.worker as u32,
            generation: cut.generation.number(),
            step: cut.step,
            samples_trained: cut.samples_trained,
            dense_optimizer_step: cut.dense_optimizer_step,
            position: Some(position_to_proto(cut.position)),
            wrote_dense: cut.wrote_dense,
            trained: cut
                .trained
                .iter()
                .map(|b| pb::TrainedBatch {
                    start: Some(position_to_proto(b.start)),
                    end: Some(position_to_proto(b.end)),
                    stream: b.stream.as_ref().map(mark_to_proto),
                })
                .collect(),
            stream: cut.stream.as_ref().map(mark_to_proto),
            last: cut.last,
            early_stopping: cut.early_stopping.map(stopping_to_proto),
        };
        // Writing every part takes as long as the table is large: no RPC deadline.
        let reply = self.peer.call_unbounded("checkpoint", request, |mut c, r| async move { c.checkpoint(r).await })?;
        Ok(crate::checkpoint::Committed {
            dir: std::path::PathBuf::from(reply.committed),
            next_step: reply.next_step,
            checkpoint: !reply.export_only,
        })
    }
}

impl crate::aggregator::PartialSink for CoordinatorClient {
    fn contribute_partial(&self, p: crate::lazy::Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError> {
        let request = pb::LazyRequest {
            worker: p.aggregator as u32,
            generation: p.generation.number(),
            kind: pb::lazy_request::Kind::Partial as i32,
            instruction: p.instruction,
            partial: f64s_to_bytes(&p.sum),
            coefficient: p.weight,
            members: p
                .members
                .iter()
                .map(|m| pb::LazyMember {
                    worker: m.worker as u32,
                    finished: m.finished,
                    position: Some(position_to_proto(m.position)),
                    iterations: m.iterations,
                    samples: m.samples,
                    coefficient: m.coefficient,
                })
                .collect(),
            ..Default::default()
        };
        let reply = self.lazy_call(request)?;
        let done = aggregated_from(reply, &self.peer.name)?;
        let weights = done.weights.clone().ok_or_else(|| ClusterError::Malformed {
            peer: self.peer.name.clone(),
            what: "an aggregation answered without weights".into(),
        })?;
        Ok((Aggregated { weights: None, ..done }, weights))
    }
}
