//! An aggregator process over gRPC: workers send it their contributions
//! (`Aggregator.Contribute`, the scheduler's `LazyRequest`); the
//! [`AggregatorClient`] is how a worker reaches it.

use std::sync::Arc;
use std::time::Instant;

use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::lazy_wire::{aggregated_from, aggregated_reply, contribution_from, contribution_request};
use super::{AuthedChannel, CheckToken, NetSettings, Peer, blocking, connect};
use crate::aggregator::AggregatorServer;
use crate::lazy::{Aggregated, Contribution};
use crate::metrics::RoleMetrics;
use crate::transport::{ClusterError, Serving};

struct AggregatorGrpc {
    aggregator: Arc<Serving<AggregatorServer>>,
    metrics: RoleMetrics,
}

#[tonic::async_trait]
impl pb::aggregator_server::Aggregator for AggregatorGrpc {
    async fn contribute(&self, request: Request<pb::LazyRequest>) -> Result<Response<pb::LazyReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.values.len());
        let c = contribution_from(r)?;
        let aggregator = self.aggregator.get().map_err(|e| super::to_status(&e))?;
        let done = blocking(move || aggregator.contribute(c)).await?;
        let reply = aggregated_reply(done, None);
        self.metrics.count_bytes("out", "worker", reply.weights.len());
        self.metrics.observe("server", "contribute", start.elapsed().as_secs_f64());
        Ok(Response::new(reply))
    }
}

pub fn service(
    aggregator: Arc<Serving<AggregatorServer>>,
    settings: &NetSettings,
    metrics: RoleMetrics,
) -> InterceptedService<pb::aggregator_server::AggregatorServer<impl pb::aggregator_server::Aggregator>, CheckToken> {
    let inner = pb::aggregator_server::AggregatorServer::new(AggregatorGrpc { aggregator, metrics })
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    InterceptedService::new(inner, CheckToken::new(settings))
}

type Client = pb::aggregator_client::AggregatorClient<AuthedChannel>;

/// A remote aggregator, as a worker calls it.
pub struct AggregatorClient {
    peer: Peer<Client>,
}

impl AggregatorClient {
    pub fn connect(
        index: usize,
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<AggregatorClient, ClusterError> {
        let name = format!("aggregator {index} at {addr}");
        let channels = handle.block_on(connect(addr, &name, settings))?;
        let make = |channel| {
            pb::aggregator_client::AggregatorClient::with_interceptor(channel, channels.token.clone())
                .max_decoding_message_size(settings.max_message_bytes)
                .max_encoding_message_size(settings.max_message_bytes)
        };
        let (client, untimed) = (make(channels.timed.clone()), make(channels.untimed.clone()));
        Ok(AggregatorClient {
            peer: Peer::new(name, "aggregator", client, handle.clone(), metrics, settings).with_untimed(untimed),
        })
    }

    /// Sends a contribution; blocks until the aggregation is done (no RPC
    /// deadline: it lasts as long as the slowest worker's iterations).
    pub fn contribute(&self, c: Contribution) -> Result<Aggregated, ClusterError> {
        let reply = self.peer.call_unbounded("contribute", contribution_request(c), |mut client, r| async move {
            client.contribute(r).await
        })?;
        aggregated_from(reply, &self.peer.name)
    }
}
