//! The gRPC transport (tonic + prost): servers that wrap the roles, and
//! clients that implement the role traits ([`ShardService`](crate::ShardService),
//! [`LoaderService`](crate::LoaderService), [`RoundSummer`](crate::sync::RoundSummer)).
//! Protobuf types stop here: everything past this module sees the role types.
//!
//! Every server and client caps message sizes at `cluster.max_message_bytes`;
//! with a token configured every RPC must carry it (`authorization: Bearer …`),
//! and a server refuses to listen off loopback without one.

pub mod aggregator;
pub mod coordinator;
mod lazy_wire;
pub mod loader;
pub mod shard;
mod stopping_wire;

use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::metrics::RoleMetrics;
use crate::transport::ClusterError;

pub use crate::net::{NetSettings, TOKEN_ENV};

/// Server side: refuses a request whose token is missing or wrong.
#[derive(Clone)]
pub struct CheckToken {
    expected: Option<Arc<str>>,
}

impl CheckToken {
    pub fn new(settings: &NetSettings) -> Self {
        CheckToken { expected: settings.token.clone() }
    }
}

impl Interceptor for CheckToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else { return Ok(request) };
        let given = request.metadata().get("authorization").map(|v| v.as_bytes());
        if sparrow_core::token::bearer_matches(given, expected) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(format!("missing or wrong auth token (cluster.auth_token / {TOKEN_ENV})")))
        }
    }
}

/// Client side: attaches the token to every request.
#[derive(Clone)]
pub struct AttachToken {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            request.metadata_mut().insert("authorization", header.clone());
        }
        Ok(request)
    }
}

pub type AuthedChannel = InterceptedService<Channel, AttachToken>;

/// `e` and its sources, one after another (tonic's own Display is terse).
pub fn error_chain(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// A peer's channels: one whose calls time out after `cluster`'s RPC
/// timeout, and one without a deadline (connected on first use) for calls
/// whose length grows with the table (writing a checkpoint part).
pub struct Channels {
    pub timed: Channel,
    pub untimed: Channel,
    pub token: AttachToken,
}

/// Connects to `addr`, retrying with exponential backoff (50 ms → 1 s) for
/// up to the connect timeout, then fails naming `peer`.
pub async fn connect(addr: &str, peer: &str, settings: &NetSettings) -> Result<Channels, ClusterError> {
    let untimed = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| ClusterError::Setup(format!("{peer}: bad address `{addr}`: {e}")))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20);
    let endpoint = untimed.clone().timeout(settings.rpc_timeout);
    let header = match &settings.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .map_err(|_| ClusterError::Setup("the auth token must be printable ASCII".into()))?,
        ),
        None => None,
    };
    let start = Instant::now();
    let mut wait = Duration::from_millis(50);
    loop {
        match endpoint.connect().await {
            Ok(timed) => {
                return Ok(Channels { timed, untimed: untimed.connect_lazy(), token: AttachToken { header } });
            }
            Err(e) if start.elapsed() >= settings.connect_timeout => {
                return Err(ClusterError::Unreachable {
                    peer: peer.to_string(),
                    waited_ms: start.elapsed().as_millis() as u64,
                    message: error_chain(&e),
                });
            }
            Err(e) => {
                tracing::debug!("{peer} at {addr} not reachable yet ({}), retrying in {wait:?}", error_chain(&e));
                tokio::time::sleep(wait.min(settings.connect_timeout.saturating_sub(start.elapsed()))).await;
                wait = (wait * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// A client error as a [`ClusterError`] naming the peer.
pub fn rpc_error(peer: &str, method: &'static str, status: &Status) -> ClusterError {
    let mut message = format!("{:?}: {}", status.code(), status.message());
    if matches!(status.code(), tonic::Code::OutOfRange | tonic::Code::ResourceExhausted)
        && status.message().contains("message length too large")
    {
        message.push_str(" (the cap is cluster.max_message_bytes)");
    }
    if let Some(source) = std::error::Error::source(status) {
        message = format!("{message}: {}", error_chain(source));
    }
    if status.code() == tonic::Code::Unavailable || status.message() == "transport error" {
        message = format!("unreachable (it stopped or the network failed): {message}");
    }
    ClusterError::Rpc { peer: peer.to_string(), method, message }
}

/// A role error as the status a server answers with.
pub fn to_status(e: &ClusterError) -> Status {
    match e {
        ClusterError::UnknownBatch { .. } => Status::failed_precondition(e.to_string()),
        ClusterError::WrongSize { .. } | ClusterError::Malformed { .. } => Status::invalid_argument(e.to_string()),
        ClusterError::JobFailed(_) => Status::aborted(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// A connected peer: blocking calls from the roles' plain threads, timed and
/// counted in the role's metrics.
#[derive(Clone)]
pub struct Peer<C> {
    pub name: String,
    /// The peer's kind for the byte counters (`shard`, `loader`, `coordinator`).
    kind: &'static str,
    client: C,
    /// The same peer without a deadline (see [`Channels`]).
    untimed: Option<C>,
    handle: Handle,
    metrics: RoleMetrics,
    max_message_bytes: usize,
}

impl<C: Clone> Peer<C> {
    pub fn new(
        name: String,
        kind: &'static str,
        client: C,
        handle: Handle,
        metrics: RoleMetrics,
        settings: &NetSettings,
    ) -> Self {
        Peer { name, kind, client, untimed: None, handle, metrics, max_message_bytes: settings.max_message_bytes }
    }

    /// Adds the client without a deadline for [`call_unbounded`](Self::call_unbounded).
    pub fn with_untimed(mut self, client: C) -> Self {
        self.untimed = Some(client);
        self
    }

    /// [`call`](Self::call) without the RPC deadline.
    pub fn call_unbounded<Req, Resp, Fut>(
        &self,
        method: &'static str,
        request: Req,
        rpc: impl FnOnce(C, Request<Req>) -> Fut,
    ) -> Result<Resp, ClusterError>
    where
        Req: prost::Message,
        Resp: prost::Message,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let client = self.untimed.clone().unwrap_or_else(|| self.client.clone());
        self.call_with(client, method, request, rpc)
    }

    /// Calls `method` and waits for the answer (must not run on a runtime thread).
    pub fn call<Req, Resp, Fut>(
        &self,
        method: &'static str,
        request: Req,
        rpc: impl FnOnce(C, Request<Req>) -> Fut,
    ) -> Result<Resp, ClusterError>
    where
        Req: prost::Message,
        Resp: prost::Message,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.call_with(self.client.clone(), method, request, rpc)
    }

    fn call_with<Req, Resp, Fut>(
        &self,
        client: C,
        method: &'static str,
        request: Req,
        rpc: impl FnOnce(C, Request<Req>) -> Fut,
    ) -> Result<Resp, ClusterError>
    where
        Req: prost::Message,
        Resp: prost::Message,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let _span = tracing::debug_span!("rpc", peer = %self.name, method).entered();
        let start = Instant::now();
        let size = request.encoded_len();
        // Checked here for a clear error (tonic's own check surfaces as an HTTP/2 error).
        if size > self.max_message_bytes {
            return Err(ClusterError::TooLarge {
                peer: self.name.clone(),
                method,
                bytes: size,
                limit: self.max_message_bytes,
            });
        }
        self.metrics.count_bytes("out", self.kind, size);
        let reply = self
            .handle
            .block_on(rpc(client, Request::new(request)))
            .map_err(|status| rpc_error(&self.name, method, &status))?
            .into_inner();
        self.metrics.count_bytes("in", self.kind, reply.encoded_len());
        self.metrics.observe("client", method, start.elapsed().as_secs_f64());
        Ok(reply)
    }
}

/// Runs `work` on the blocking pool (role code blocks: table lookups, queues, rounds).
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ClusterError> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_status(&e)),
        Err(e) => Err(Status::internal(format!("a request handler panicked: {e}"))),
    }
}

// Arrays travel as little-endian bytes.

pub fn f32s_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn u32s_to_bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn u64s_to_bytes(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn decode_array<const N: usize, T>(
    bytes: &[u8],
    peer: &str,
    what: &str,
    from: impl Fn([u8; N]) -> T,
) -> Result<Vec<T>, ClusterError> {
    if !bytes.len().is_multiple_of(N) {
        return Err(ClusterError::Malformed {
            peer: peer.to_string(),
            what: format!("{what}: {} bytes is not a whole number of {N}-byte values", bytes.len()),
        });
    }
    Ok(bytes.chunks_exact(N).map(|c| from(c.try_into().unwrap_or([0; N]))).collect())
}

pub fn bytes_to_f32s(bytes: &[u8], peer: &str, what: &str) -> Result<Vec<f32>, ClusterError> {
    decode_array(bytes, peer, what, f32::from_le_bytes)
}

pub fn bytes_to_u32s(bytes: &[u8], peer: &str, what: &str) -> Result<Vec<u32>, ClusterError> {
    decode_array(bytes, peer, what, u32::from_le_bytes)
}

pub fn bytes_to_u64s(bytes: &[u8], peer: &str, what: &str) -> Result<Vec<u64>, ClusterError> {
    decode_array(bytes, peer, what, u64::from_le_bytes)
}

/// Binds `addr` (port 0 picks a free one) for a gRPC server; returns the
/// listener and the address it got.
pub async fn bind(
    addr: SocketAddr,
    settings: &NetSettings,
) -> Result<(tokio::net::TcpListener, SocketAddr), ClusterError> {
    settings.check_listen(addr)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| ClusterError::Io { what: format!("binding {addr}"), source: e })?;
    let bound = listener.local_addr().map_err(|e| ClusterError::Io { what: format!("binding {addr}"), source: e })?;
    Ok((listener, bound))
}

/// The server options every role uses.
pub fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
}
