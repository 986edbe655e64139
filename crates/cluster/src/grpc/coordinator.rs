//! The coordinator over gRPC: the service converts requests and forwards
//! them to the [`Coordinator`] role on the blocking pool; the client is how
//! the other roles call it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sparrow_core::Config;
use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::{AuthedChannel, CheckToken, NetSettings, Peer, blocking, bytes_to_f32s, connect, f32s_to_bytes};
use crate::coordinator::{Coordinator, JobState, RoleKind};
use crate::metrics::RoleMetrics;
use crate::sync::{Contribution, RoundReply, RoundSummer};
use crate::transport::ClusterError;

fn role_to_proto(kind: RoleKind) -> pb::Role {
    match kind {
        RoleKind::Shard => pb::Role::Shard,
        RoleKind::Loader => pb::Role::Loader,
        RoleKind::Worker => pb::Role::Worker,
    }
}

fn role_from_proto(role: i32) -> Result<RoleKind, Status> {
    match pb::Role::try_from(role) {
        Ok(pb::Role::Shard) => Ok(RoleKind::Shard),
        Ok(pb::Role::Loader) => Ok(RoleKind::Loader),
        Ok(pb::Role::Worker) => Ok(RoleKind::Worker),
        _ => Err(Status::invalid_argument(format!("unknown role {role}"))),
    }
}

struct CoordinatorGrpc {
    coordinator: Arc<Coordinator>,
    metrics: RoleMetrics,
}

fn status(e: ClusterError) -> Status {
    super::to_status(&e)
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for CoordinatorGrpc {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterReply>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role)?;
        let index = usize::try_from(r.index).ok();
        let coordinator = self.coordinator.clone();
        let index = blocking(move || coordinator.register(kind, r.address, index)).await?;
        Ok(Response::new(pb::RegisterReply {
            index: index as u32,
            num_shards: self.coordinator.num_shards() as u32,
            num_workers: self.coordinator.num_workers() as u32,
            config_toml: self.coordinator.config_toml().to_string(),
        }))
    }

    async fn heartbeat(&self, request: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatReply>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role)?;
        let coordinator = self.coordinator.clone();
        let state = blocking(move || coordinator.heartbeat(kind, r.index as usize, r.progress)).await?;
        Ok(Response::new(state_reply(&state)))
    }

    async fn view(&self, _: Request<pb::Empty>) -> Result<Response<pb::ViewReply>, Status> {
        let coordinator = self.coordinator.clone();
        let (complete, shards, loader, state) = blocking(move || {
            let (complete, shards, loader) = coordinator.view();
            Ok((complete, shards, loader, coordinator.state()))
        })
        .await?;
        let state = state_reply(&state);
        Ok(Response::new(pb::ViewReply { complete, shards, loader, state: state.state, message: state.message }))
    }

    async fn sum_gradients(&self, request: Request<pb::SumRequest>) -> Result<Response<pb::SumReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.grads.len());
        let grads = bytes_to_f32s(&r.grads, &format!("worker {}", r.worker), "gradients").map_err(status)?;
        let coordinator = self.coordinator.clone();
        let patience = Duration::from_micros(r.patience_us);
        let c = Contribution { worker: r.worker as usize, round: r.round, grads, rows: r.rows, patience };
        let reply = match blocking(move || coordinator.sum(c)).await? {
            RoundReply::Open => pb::SumReply { open: true, grads: Vec::new(), rows: 0 },
            RoundReply::Closed(result) => pb::SumReply { open: false, grads: f32s_to_bytes(&result.0), rows: result.1 },
        };
        self.metrics.count_bytes("out", "worker", reply.grads.len());
        self.metrics.observe("server", "sum_gradients", start.elapsed().as_secs_f64());
        Ok(Response::new(reply))
    }

    async fn finish(&self, request: Request<pb::FinishRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = request.into_inner();
        let kind = role_from_proto(r.role).unwrap_or(RoleKind::Worker);
        let coordinator = self.coordinator.clone();
        let error = (!r.error.is_empty()).then_some(r.error);
        blocking(move || {
            coordinator.finish(kind, r.worker as usize, error);
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
    pb::HeartbeatReply { state: state as i32, message }
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
    pub config: Config,
}

/// The coordinator as the other roles see it.
#[derive(Clone)]
pub struct CoordinatorClient {
    peer: Peer<Client>,
}

impl CoordinatorClient {
    pub fn connect(
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<CoordinatorClient, ClusterError> {
        let name = format!("coordinator at {addr}");
        let (channel, token) = handle.block_on(connect(addr, &name, settings))?;
        let client = pb::coordinator_client::CoordinatorClient::with_interceptor(channel, token)
            .max_decoding_message_size(settings.max_message_bytes)
            .max_encoding_message_size(settings.max_message_bytes);
        Ok(CoordinatorClient { peer: Peer::new(name, "coordinator", client, handle.clone(), metrics, settings) })
    }

    pub fn name(&self) -> &str {
        &self.peer.name
    }

    pub fn register(&self, kind: RoleKind, address: &str, index: Option<usize>) -> Result<Registration, ClusterError> {
        let request = pb::RegisterRequest {
            role: role_to_proto(kind) as i32,
            address: address.to_string(),
            index: index.map_or(-1, |i| i as i64),
        };
        let reply = self.peer.call("register", request, |mut c, r| async move { c.register(r).await })?;
        let config = Config::from_toml_with_overrides(&reply.config_toml, "the coordinator's config", &[])?;
        Ok(Registration {
            index: reply.index as usize,
            num_shards: reply.num_shards as usize,
            num_workers: reply.num_workers as usize,
            config,
        })
    }

    pub fn heartbeat(&self, kind: RoleKind, index: usize, progress: u64) -> Result<JobState, ClusterError> {
        let request = pb::HeartbeatRequest { role: role_to_proto(kind) as i32, index: index as u32, progress };
        let reply = self.peer.call("heartbeat", request, |mut c, r| async move { c.heartbeat(r).await })?;
        Ok(state_from(reply.state, reply.message))
    }

    /// Waits (polling with backoff, up to `timeout`) until every shard and
    /// the loader registered; returns the shard addresses and the loader's.
    pub fn wait_for_view(&self, timeout: Duration) -> Result<(Vec<String>, String), ClusterError> {
        let start = Instant::now();
        let mut wait = Duration::from_millis(20);
        loop {
            let view = self.peer.call("view", pb::Empty {}, |mut c, r| async move { c.view(r).await })?;
            if let JobState::Failed(m) = state_from(view.state, view.message) {
                return Err(ClusterError::JobFailed(m));
            }
            if view.complete {
                return Ok((view.shards, view.loader));
            }
            if start.elapsed() > timeout {
                return Err(ClusterError::Setup(format!(
                    "{}: only {} shard(s){} registered after {} ms",
                    self.peer.name,
                    view.shards.len(),
                    if view.loader.is_empty() { " and no loader" } else { " and the loader" },
                    start.elapsed().as_millis()
                )));
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(500));
        }
    }

    /// Reports a worker's end, or any role's failure (`error`).
    pub fn finish(&self, kind: RoleKind, index: usize, error: Option<String>) -> Result<(), ClusterError> {
        let request = pb::FinishRequest {
            worker: index as u32,
            error: error.unwrap_or_default(),
            role: role_to_proto(kind) as i32,
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
            patience_us: c.patience.as_micros() as u64,
        };
        let reply = self.peer.call("sum_gradients", request, |mut c, r| async move { c.sum_gradients(r).await })?;
        if reply.open {
            return Ok(RoundReply::Open);
        }
        Ok(RoundReply::Closed(Arc::new((
            bytes_to_f32s(&reply.grads, &self.peer.name, "summed gradients")?,
            reply.rows,
        ))))
    }
}
