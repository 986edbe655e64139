//! The loader over gRPC: the server hands out [`LoaderServer`]'s queued
//! batches; [`LoaderClient`] is a [`LoaderService`] for the workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sparrow_core::batch::DataPosition;
use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::{
    AuthedChannel, CheckToken, NetSettings, Peer, blocking, bytes_to_f32s, bytes_to_u32s, bytes_to_u64s, connect,
    f32s_to_bytes, u32s_to_bytes, u64s_to_bytes,
};
use crate::generation::Generation;
use crate::loader::LoaderServer;
use crate::messages::{Mode, WorkerBatch};
use crate::metrics::RoleMetrics;
use crate::transport::{ClusterError, LoaderService, Polled, RoundQueueService, Serving};

/// A worker batch on the wire.
pub fn to_proto(b: WorkerBatch) -> pb::WorkerBatch {
    let one_key_per_bag = b.one_key_per_bag();
    pb::WorkerBatch {
        one_key_per_bag,
        batch_id: b.batch_id,
        rows: b.rows as u32,
        num_fields: b.num_fields as u32,
        num_dense: b.num_dense as u32,
        num_tasks: b.num_tasks as u32,
        truncated_sequences: b.truncated_sequences,
        groups: u64s_to_bytes(&b.groups),
        labels: f32s_to_bytes(&b.labels),
        dense: f32s_to_bytes(&b.dense),
        bag_offsets: if one_key_per_bag { Vec::new() } else { u32s_to_bytes(&b.bag_offsets) },
        has_key_weights: b.key_weights.is_some(),
        key_weights: b.key_weights.as_deref().map(f32s_to_bytes).unwrap_or_default(),
        inverse: u32s_to_bytes(&b.inverse),
        shard_counts: b.shard_counts,
        keys: u64s_to_bytes(&b.keys),
        end: Some(pb::DataPosition { epoch: b.end.epoch, offset: b.end.offset, line: b.end.line, skip: b.end.skip }),
        start: Some(pb::DataPosition {
            epoch: b.start.epoch,
            offset: b.start.offset,
            line: b.start.line,
            skip: b.start.skip,
        }),
        bad_rows: b.bad_rows,
        has_sample_weights: b.sample_weights.is_some(),
        sample_weights: b.sample_weights.as_deref().map(f32s_to_bytes).unwrap_or_default(),
        merged_samples: b.merged_samples,
        dropped_samples: b.dropped_samples,
        passes: b.passes.passes,
        pass_staging_secs: b.passes.staging_secs,
        pass_staging_exposed_secs: b.passes.exposed_secs,
        stream: b.stream.as_ref().map(super::coordinator::mark_to_proto),
    }
}

/// A worker batch off the wire, its array sizes checked against each other
/// (a worker must not index out of bounds on a bad message).
pub fn from_proto(b: pb::WorkerBatch, peer: &str) -> Result<WorkerBatch, ClusterError> {
    let malformed = |what: String| ClusterError::Malformed { peer: peer.to_string(), what };
    let (rows, num_fields, num_dense) = (b.rows as usize, b.num_fields as usize, b.num_dense as usize);
    let num_tasks = (b.num_tasks as usize).max(1);
    let out = WorkerBatch {
        batch_id: b.batch_id,
        rows,
        num_fields,
        num_dense,
        num_tasks,
        truncated_sequences: b.truncated_sequences,
        groups: bytes_to_u64s(&b.groups, peer, "groups")?,
        labels: bytes_to_f32s(&b.labels, peer, "labels")?,
        dense: bytes_to_f32s(&b.dense, peer, "dense")?,
        bag_offsets: if b.one_key_per_bag {
            // Sized by the message's own key positions, never by a claimed count.
            let positions = if b.keys.is_empty() { b.inverse.len() / 4 } else { b.keys.len() / 8 };
            if rows.checked_mul(num_fields) != Some(positions) {
                return Err(malformed(format!(
                    "batch {}: {positions} keys for {rows} rows × {num_fields} one-key bags",
                    b.batch_id
                )));
            }
            (0..=positions as u32).collect()
        } else {
            bytes_to_u32s(&b.bag_offsets, peer, "bag_offsets")?
        },
        key_weights: if b.has_key_weights { Some(bytes_to_f32s(&b.key_weights, peer, "key_weights")?) } else { None },
        inverse: bytes_to_u32s(&b.inverse, peer, "inverse")?,
        shard_counts: b.shard_counts,
        keys: bytes_to_u64s(&b.keys, peer, "keys")?,
        end: b
            .end
            .map(|e| DataPosition { epoch: e.epoch, offset: e.offset, line: e.line, skip: e.skip })
            .unwrap_or_default(),
        start: b
            .start
            .map(|e| DataPosition { epoch: e.epoch, offset: e.offset, line: e.line, skip: e.skip })
            .unwrap_or_default(),
        bad_rows: b.bad_rows,
        sample_weights: match b.has_sample_weights {
            true => Some(bytes_to_f32s(&b.sample_weights, peer, "sample_weights")?),
            false => None,
        },
        merged_samples: b.merged_samples,
        dropped_samples: b.dropped_samples,
        passes: crate::messages::PassCounters {
            passes: b.passes,
            staging_secs: b.pass_staging_secs,
            exposed_secs: b.pass_staging_exposed_secs,
        },
        stream: b.stream.map(super::coordinator::mark_from),
    };
    if out.sample_weights.as_ref().is_some_and(|w| w.len() != rows) {
        return Err(malformed(format!("batch {}: sample weights for another row count", out.batch_id)));
    }
    if !out.groups.is_empty() && out.groups.len() != rows {
        return Err(malformed(format!("batch {}: {} group numbers for {rows} rows", out.batch_id, out.groups.len())));
    }
    let keys = out.bag_offsets.last().copied().unwrap_or(0) as usize;
    // Bag b of the batch holds keys bag_offsets[b]..bag_offsets[b + 1].
    if rows.checked_mul(num_tasks) != Some(out.labels.len())
        || out.dense.len() != rows * num_dense
        || out.bag_offsets.len() != rows * num_fields + 1
        || out.bag_offsets.first() != Some(&0)
    {
        return Err(malformed(format!(
            "batch {}: {} labels, {} dense values, {} bag offsets (from 0) for {rows} rows × {num_tasks} tasks, {num_fields} fields, {num_dense} dense",
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
    loader: Arc<Serving<LoaderServer>>,
    metrics: RoleMetrics,
}

#[tonic::async_trait]
impl pb::loader_server::Loader for LoaderGrpc {
    async fn next_batch(&self, request: Request<pb::NextBatchRequest>) -> Result<Response<pb::NextBatchReply>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        let mode = if r.eval { Mode::Eval } else { Mode::Train };
        let loader = self.loader.get().map_err(|e| super::to_status(&e))?;
        let queued = loader.clone();
        let polled = blocking(move || {
            let (worker, generation) = (r.worker as usize, Generation(r.generation));
            let got = match (r.in_round, r.wait_ms) {
                (true, 0) => loader.next_round_item(worker, generation, r.round)?,
                (true, ms) => {
                    let wait = Duration::from_millis(ms.into());
                    return loader.next_round_item_within(worker, generation, r.round, wait);
                }
                (false, 0) => loader.next_batch(worker, mode, generation)?,
                (false, ms) => return loader.next_batch_within(worker, generation, Duration::from_millis(ms.into())),
            };
            Ok(got.map_or(Polled::End, |b| Polled::Batch(Box::new(b))))
        })
        .await?;
        let reply = match polled {
            Polled::Batch(batch) => pb::NextBatchReply { batch: Some(to_proto(*batch)), waiting: false },
            Polled::End => pb::NextBatchReply { batch: None, waiting: false },
            Polled::Waiting => pb::NextBatchReply { batch: None, waiting: true },
        };
        self.metrics.count_bytes("out", "worker", prost::Message::encoded_len(&reply));
        self.metrics.observe("server", "next_batch", start.elapsed().as_secs_f64());
        self.metrics.batches_in_flight.set(queued.queued() as i64);
        Ok(Response::new(reply))
    }

    async fn training_end(
        &self,
        request: Request<pb::TrainingEndRequest>,
    ) -> Result<Response<pb::TrainingEndReply>, Status> {
        let loader = self.loader.get().map_err(|e| super::to_status(&e))?;
        let generation = Generation(request.into_inner().generation);
        let epoch_end = blocking(move || loader.training_ended_at_epoch_end(generation)).await?;
        Ok(Response::new(pb::TrainingEndReply { epoch_end }))
    }
}

pub fn service(
    loader: Arc<Serving<LoaderServer>>,
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
    /// How long the loader may wait for a batch before it answers that it
    /// is waiting: half the call's deadline.
    poll: Duration,
}

impl LoaderClient {
    pub fn connect(
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<LoaderClient, ClusterError> {
        let name = format!("loader at {addr}");
        let channels = handle.block_on(connect(addr, &name, settings))?;
        let make = |channel| {
            pb::loader_client::LoaderClient::with_interceptor(channel, channels.token.clone())
                .max_decoding_message_size(settings.max_message_bytes)
                .max_encoding_message_size(settings.max_message_bytes)
        };
        let (client, untimed) = (make(channels.timed.clone()), make(channels.untimed.clone()));
        Ok(LoaderClient {
            peer: Peer::new(name, "loader", client, handle.clone(), metrics, settings).with_untimed(untimed),
            poll: settings.rpc_timeout / 2,
        })
    }
}

impl LoaderClient {
    /// One `NextBatch` call that may answer `waiting`.
    fn polled(&self, request: pb::NextBatchRequest) -> Result<Polled, ClusterError> {
        let reply = self.peer.call("next_batch", request, |mut c, r| async move { c.next_batch(r).await })?;
        Ok(match (reply.batch, reply.waiting) {
            (Some(b), _) => Polled::Batch(Box::new(from_proto(b, &self.peer.name)?)),
            (None, true) => Polled::Waiting,
            (None, false) => Polled::End,
        })
    }

    /// One `NextBatch` call (a phase's batch, or a round's item).
    fn fetch(&self, request: pb::NextBatchRequest) -> Result<Option<WorkerBatch>, ClusterError> {
        let reply = self.peer.call("next_batch", request, |mut c, r| async move { c.next_batch(r).await })?;
        reply.batch.map(|b| from_proto(b, &self.peer.name)).transpose()
    }
}

impl LoaderService for LoaderClient {
    fn next_batch(
        &self,
        worker: usize,
        mode: Mode,
        generation: Generation,
    ) -> Result<Option<WorkerBatch>, ClusterError> {
        self.fetch(pb::NextBatchRequest {
            worker: worker as u32,
            eval: mode == Mode::Eval,
            generation: generation.number(),
            ..Default::default()
        })
    }

    /// Asks the loader to answer within half the call's deadline: an idle
    /// stream is [`Polled::Waiting`], never a deadline run out.
    fn poll_batch(&self, worker: usize, generation: Generation) -> Result<Polled, ClusterError> {
        let request = pb::NextBatchRequest {
            worker: worker as u32,
            generation: generation.number(),
            wait_ms: self.poll.as_millis().clamp(1, u32::MAX.into()) as u32,
            ..Default::default()
        };
        self.polled(request)
    }

    fn training_ended_at_epoch_end(&self, generation: Generation) -> Result<bool, ClusterError> {
        let request = pb::TrainingEndRequest { generation: generation.number() };
        let reply = self.peer.call("training_end", request, |mut c, r| async move { c.training_end(r).await })?;
        Ok(reply.epoch_end)
    }

    /// A remote loader answers whether it serves a round queue itself.
    fn round_queue(&self) -> Option<&dyn RoundQueueService> {
        Some(self)
    }
}

impl RoundQueueService for LoaderClient {
    fn next_round_item(
        &self,
        worker: usize,
        generation: Generation,
        round: u64,
    ) -> Result<Option<WorkerBatch>, ClusterError> {
        self.fetch(pb::NextBatchRequest {
            worker: worker as u32,
            eval: false,
            generation: generation.number(),
            in_round: true,
            round,
            wait_ms: 0,
        })
    }

    /// Asks the loader to answer within half the call's deadline, as
    /// [`LoaderService::poll_batch`] does.
    fn poll_round_item(&self, worker: usize, generation: Generation, round: u64) -> Result<Polled, ClusterError> {
        let request = pb::NextBatchRequest {
            worker: worker as u32,
            eval: false,
            generation: generation.number(),
            in_round: true,
            round,
            wait_ms: self.poll.as_millis().clamp(1, u32::MAX.into()) as u32,
        };
        self.polled(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn batch(rows: usize, fields: usize, bag: usize, unique: usize, weights: bool) -> WorkerBatch {
        let keys = rows * fields * bag;
        WorkerBatch {
            batch_id: 3,
            rows,
            num_fields: fields,
            num_dense: 2,
            // Two tasks when weighted: the second masked in odd rows.
            num_tasks: if weights { 2 } else { 1 },
            truncated_sequences: rows as u64 / 3,
            groups: if weights { (0..rows as u64).map(|r| r * 7919).collect() } else { Vec::new() },
            labels: if weights {
                (0..rows).flat_map(|r| [1.0, if r % 2 == 1 { f32::NAN } else { 0.0 }]).collect()
            } else {
                vec![1.0; rows]
            },
            dense: vec![0.5; rows * 2],
            bag_offsets: (0..=rows * fields).map(|b| (b * bag) as u32).collect(),
            key_weights: weights.then(|| vec![2.0; keys]),
            inverse: (0..keys).map(|i| (i % unique.max(1)) as u32).collect(),
            shard_counts: vec![unique as u32],
            keys: Vec::new(),
            end: DataPosition { epoch: 1, offset: 2, line: 3, skip: 4 },
            start: DataPosition { epoch: 1, offset: 1, line: 2, skip: 0 },
            bad_rows: 5,
            sample_weights: weights.then(|| (0..rows).map(|r| 0.25 * r as f32).collect()),
            merged_samples: 6,
            dropped_samples: 2,
            passes: crate::messages::PassCounters { passes: 7, staging_secs: 0.5, exposed_secs: 0.25 },
            stream: weights.then(|| sparrow_core::batch::StreamMark {
                offsets: [(0, 9), (2, 4)].into(),
                next_partition: 2,
                records: 13,
                bad_records: 1,
                future_records: 2,
                gap_records: 44,
                offset_resets: 1,
                tails: [(0, u64::MAX - 5), (2, 17)].into(),
                lag_records: 3,
                newest_record_ms: Some(1_700_000_000_000),
                clock_ms: Some(1_700_000_000_500),
                from: [(0, 7)].into(),
                skip: [(2, vec![(6, 8), (9, 11)])].into(),
            }),
        }
    }

    proptest! {
        #[test]
        fn a_batch_survives_the_wire(rows in 0usize..20, fields in 1usize..5, bag in 1usize..3, unique in 1usize..30, weights: bool) {
            let b = batch(rows, fields, bag, unique.min((rows * fields * bag).max(1)), weights);
            let bytes = prost::Message::encode_to_vec(&to_proto(b.clone()));
            let back = from_proto(prost::Message::decode(bytes.as_slice()).expect("decode"), "test").expect("valid");
            prop_assert_eq!(back.bag_offsets, b.bag_offsets);
            prop_assert_eq!(back.inverse, b.inverse);
            prop_assert_eq!(back.key_weights, b.key_weights);
            let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&back.labels), bits(&b.labels));
            prop_assert_eq!((back.num_tasks, back.truncated_sequences), (b.num_tasks, b.truncated_sequences));
            prop_assert_eq!(&back.groups, &b.groups);
            prop_assert_eq!(back.end, b.end);
            prop_assert_eq!(back.sample_weights, b.sample_weights);
            prop_assert_eq!((back.merged_samples, back.dropped_samples), (6, 2));
            prop_assert_eq!(back.passes, b.passes);
            prop_assert_eq!(back.stream, b.stream);
        }

        /// A damaged or hostile message is refused with an error, never a panic
        /// or an allocation sized by a claimed count.
        #[test]
        fn a_mangled_batch_is_an_error_not_a_panic(
            rows in 0u32..1 << 31, fields in 0u32..1 << 31, dense in 0u32..64, one_key: bool,
            inverse in proptest::collection::vec(any::<u8>(), 0..64),
            offsets in proptest::collection::vec(any::<u8>(), 0..64),
            counts in proptest::collection::vec(any::<u32>(), 0..4),
        ) {
            let message = pb::WorkerBatch {
                rows, num_fields: fields, num_dense: dense, one_key_per_bag: one_key,
                inverse, bag_offsets: offsets, shard_counts: counts, labels: vec![0; 4], ..Default::default()
            };
            let _ = from_proto(message, "test");
        }
    }

    #[test]
    fn positions_past_the_unique_keys_are_refused() {
        let mut b = batch(4, 2, 1, 3, false);
        b.inverse[5] = 3;
        let err = from_proto(to_proto(b), "loader at x").expect_err("out of range");
        assert!(err.to_string().contains("loader at x"), "{err}");
    }
}
