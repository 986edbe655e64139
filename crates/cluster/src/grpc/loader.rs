//! The loader over gRPC: the server hands out [`LoaderServer`]'s queued
//! batches; [`LoaderClient`] is a [`LoaderService`] for the workers.

use std::sync::Arc;
use std::time::Instant;

use sparrow_core::batch::DataPosition;
use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::{
    AuthedChannel, CheckToken, NetSettings, Peer, blocking, bytes_to_f32s, bytes_to_u32s, bytes_to_u64s, connect,
    f32s_to_bytes, u32s_to_bytes, u64s_to_bytes,
};
use crate::loader::LoaderServer;
use crate::messages::{Mode, WorkerBatch};
use crate::metrics::RoleMetrics;
use crate::transport::{ClusterError, LoaderService};

/// A worker batch on the wire.
pub fn to_proto(b: WorkerBatch) -> pb::WorkerBatch {
    pb::WorkerBatch {
        batch_id: b.batch_id,
        rows: b.rows as u32,
        num_fields: b.num_fields as u32,
        num_dense: b.num_dense as u32,
        labels: f32s_to_bytes(&b.labels),
        dense: f32s_to_bytes(&b.dense),
        bag_offsets: u32s_to_bytes(&b.bag_offsets),
        has_key_weights: b.key_weights.is_some(),
        key_weights: b.key_weights.as_deref().map(f32s_to_bytes).unwrap_or_default(),
        inverse: u32s_to_bytes(&b.inverse),
        shard_counts: b.shard_counts,
        keys: u64s_to_bytes(&b.keys),
        end: Some(pb::DataPosition { epoch: b.end.epoch, offset: b.end.offset, line: b.end.line }),
    }
}

/// A worker batch off the wire, its array sizes checked against each other
/// (a worker must not index out of bounds on a bad message).
pub fn from_proto(b: pb::WorkerBatch, peer: &str) -> Result<WorkerBatch, ClusterError> {
    let malformed = |what: String| ClusterError::Malformed { peer: peer.to_string(), what };
    let (rows, num_fields, num_dense) = (b.rows as usize, b.num_fields as usize, b.num_dense as usize);
    let out = WorkerBatch {
        batch_id: b.batch_id,
        rows,
        num_fields,
        num_dense,
        labels: bytes_to_f32s(&b.labels, peer, "labels")?,
        dense: bytes_to_f32s(&b.dense, peer, "dense")?,
        bag_offsets: bytes_to_u32s(&b.bag_offsets, peer, "bag_offsets")?,
        key_weights: if b.has_key_weights { Some(bytes_to_f32s(&b.key_weights, peer, "key_weights")?) } else { None },
        inverse: bytes_to_u32s(&b.inverse, peer, "inverse")?,
        shard_counts: b.shard_counts,
        keys: bytes_to_u64s(&b.keys, peer, "keys")?,
        end: b.end.map(|e| DataPosition { epoch: e.epoch, offset: e.offset, line: e.line }).unwrap_or_default(),
    };
    let keys = out.bag_offsets.last().copied().unwrap_or(0) as usize;
    // Bag b of the batch holds keys bag_offsets[b]..bag_offsets[b + 1].
    if out.labels.len() != rows
        || out.dense.len() != rows * num_dense
        || out.bag_offsets.len() != rows * num_fields + 1
        || out.bag_offsets.first() != Some(&0)
    {
        return Err(malformed(format!(
            "batch {}: {} labels, {} dense values, {} bag offsets (from 0) for {rows} rows × {num_fields} fields, {num_dense} dense",
            out.batch_id,
            out.labels.len(),
            out.dense.len(),
            out.bag_offsets.len()
        )));
    }
    if out.bag_offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(malformed(format!("batch {}: bag offsets decrease", out.batch_id)));
    }
    let positions = if out.keys.is_empty() { out.inverse.len() } else { out.keys.len() };
    if positions != keys || out.key_weights.as_ref().is_some_and(|w| w.len() != keys) {
        return Err(malformed(format!("batch {}: {positions} keys for bags that hold {keys}", out.batch_id)));
    }
    let unique = out.num_unique();
    if out.inverse.iter().any(|&i| i as usize >= unique) {
        return Err(malformed(format!("batch {}: a key position points past the {unique} unique keys", out.batch_id)));
    }
    Ok(out)
}

struct LoaderGrpc {
    loader: Arc<LoaderServer>,
    metrics: RoleMetrics,
}

#[tonic::async_trait]
impl pb::loader_server::Loader for LoaderGrpc {
    async fn next_batch(&self, request: Request<pb::NextBatchRequest>) -> Result<Response<pb::NextBatchReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        let mode = if r.eval { Mode::Eval } else { Mode::Train };
        let loader = self.loader.clone();
        let batch = blocking(move || loader.next_batch(r.worker as usize, mode)).await?;
        let reply = pb::NextBatchReply { batch: batch.map(to_proto) };
        self.metrics.count_bytes("out", "worker", prost::Message::encoded_len(&reply));
        self.metrics.observe("server", "next_batch", start.elapsed().as_secs_f64());
        self.metrics.batches_in_flight.set(self.loader.queued() as i64);
        Ok(Response::new(reply))
    }
}

pub fn service(
    loader: Arc<LoaderServer>,
    settings: &NetSettings,
    metrics: RoleMetrics,
) -> InterceptedService<pb::loader_server::LoaderServer<impl pb::loader_server::Loader>, CheckToken> {
    let inner = pb::loader_server::LoaderServer::new(LoaderGrpc { loader, metrics })
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    InterceptedService::new(inner, CheckToken::new(settings))
}

type Client = pb::loader_client::LoaderClient<AuthedChannel>;

/// The remote loader as a [`LoaderService`].
pub struct LoaderClient {
    peer: Peer<Client>,
}

impl LoaderClient {
    pub fn connect(
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<LoaderClient, ClusterError> {
        let name = format!("loader at {addr}");
        let (channel, token) = handle.block_on(connect(addr, &name, settings))?;
        let client = pb::loader_client::LoaderClient::with_interceptor(channel, token)
            .max_decoding_message_size(settings.max_message_bytes)
            .max_encoding_message_size(settings.max_message_bytes);
        Ok(LoaderClient { peer: Peer::new(name, "loader", client, handle.clone(), metrics, settings) })
    }
}

impl LoaderService for LoaderClient {
    fn next_batch(&self, worker: usize, mode: Mode) -> Result<Option<WorkerBatch>, ClusterError> {
        let request = pb::NextBatchRequest { worker: worker as u32, eval: mode == Mode::Eval };
        let reply = self.peer.call("next_batch", request, |mut c, r| async move { c.next_batch(r).await })?;
        reply.batch.map(|b| from_proto(b, &self.peer.name)).transpose()
    }
}
