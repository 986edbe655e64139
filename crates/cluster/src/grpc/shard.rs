//! A shard over gRPC: the server wraps [`ShardServer`]; [`ShardClient`] is a
//! [`ShardService`] for the loader and the workers.

use std::sync::Arc;
use std::time::Instant;

use sparrow_proto::v1 as pb;
use tokio::runtime::Handle;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::{
    AuthedChannel, CheckToken, NetSettings, Peer, blocking, bytes_to_f32s, bytes_to_u64s, connect, f32s_to_bytes,
    u64s_to_bytes,
};
use crate::generation::Generation;
use crate::messages::{Mode, SecondLevelStats};
use crate::metrics::RoleMetrics;
use crate::shard::ShardServer;
use crate::transport::{
    ClusterError, ExportPage, PartRequest, PartWritten, PassStaging, Serving, ShardReport, ShardService,
};
use sparrow_embedding::{EmbeddingDtype, FilterStats, RowFormat, Simd, TierStats};

/// A pull reply: the vectors as the shard's table stores them (half the
/// bytes in f16 or bf16; exact, since they were decoded from those words).
fn encode_rows(vectors: &[f32], format: RowFormat) -> pb::Rows {
    if format.dtype == EmbeddingDtype::F32 || format.dim == 0 {
        return pb::Rows { rows: f32s_to_bytes(vectors), dtype: String::new(), width: 0 };
    }
    let mut words = vec![0.0f32; format.vector_words()];
    let mut rows = Vec::with_capacity(vectors.len() / format.dim * words.len() * 4);
    for v in vectors.chunks_exact(format.dim) {
        format.encode_vector(v, &mut words);
        rows.extend(words.iter().flat_map(|w| w.to_le_bytes()));
    }
    pb::Rows { rows, dtype: format.dtype.name().to_string(), width: format.dim as u32 }
}

fn decode_rows(reply: &pb::Rows, peer: &str, simd: Simd) -> Result<Vec<f32>, ClusterError> {
    let dtype = match reply.dtype.as_str() {
        "" | "f32" => return bytes_to_f32s(&reply.rows, peer, "rows"),
        "f16" => EmbeddingDtype::F16,
        "bf16" => EmbeddingDtype::Bf16,
        other => {
            return Err(ClusterError::Malformed {
                peer: peer.to_string(),
                what: format!("rows in unknown dtype `{other}`"),
            });
        }
    };
    let format = RowFormat { dtype, dim: reply.width as usize, state_len: 0, simd };
    let words = bytes_to_f32s(&reply.rows, peer, "rows")?;
    if format.dim == 0 || !words.len().is_multiple_of(format.vector_words()) {
        let what =
            format!("rows: {} words are not whole {} vectors of width {}", words.len(), dtype.name(), format.dim);
        return Err(ClusterError::Malformed { peer: peer.to_string(), what });
    }
    let mut out = vec![0.0f32; words.len() / format.vector_words() * format.dim];
    for (v, w) in out.chunks_exact_mut(format.dim).zip(words.chunks_exact(format.vector_words())) {
        format.decode_vector(w, v);
    }
    Ok(out)
}

struct ShardGrpc {
    shard: Arc<Serving<ShardServer>>,
    metrics: RoleMetrics,
    peer: String,
}

impl ShardGrpc {
    fn done(&self, method: &str, start: Instant) {
        self.metrics.observe("server", method, start.elapsed().as_secs_f64());
        if let Ok(shard) = self.shard.get() {
            self.metrics.batches_in_flight.set(shard.pending_batches() as i64);
        }
    }

    fn shard(&self) -> Result<Arc<ShardServer>, Status> {
        self.shard.get().map_err(|e| super::to_status(&e))
    }
}

#[tonic::async_trait]
impl pb::shard_server::Shard for ShardGrpc {
    async fn enqueue(&self, request: Request<pb::EnqueueRequest>) -> Result<Response<pb::Empty>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "loader", r.keys.len());
        let keys = bytes_to_u64s(&r.keys, &self.peer, "keys").map_err(|e| super::to_status(&e))?;
        let mode = if r.eval { Mode::Eval } else { Mode::Train };
        // With an SSD tier the enqueue prefetches rows from disk: off the runtime.
        let shard = self.shard()?;
        blocking(move || shard.enqueue(r.batch_id, keys, mode, r.newest_record_ms)).await?;
        self.done("enqueue", start);
        Ok(Response::new(pb::Empty {}))
    }

    async fn pull(&self, request: Request<pb::PullRequest>) -> Result<Response<pb::Rows>, Status> {
        let start = Instant::now();
        let batch_id = request.into_inner().batch_id;
        let shard = self.shard()?;
        let format = shard.table().row_format();
        let rows = blocking(move || shard.pull(batch_id)).await?;
        let reply = encode_rows(&rows, format);
        self.metrics.count_bytes("out", "worker", reply.rows.len());
        self.done("pull", start);
        Ok(Response::new(reply))
    }

    async fn push(&self, request: Request<pb::PushRequest>) -> Result<Response<pb::Empty>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "worker", r.grads.len());
        let grads = bytes_to_f32s(&r.grads, &self.peer, "gradients").map_err(|e| super::to_status(&e))?;
        let shard = self.shard()?;
        // A peer that sends no factor pushes at the configured rate.
        let lr_scale = r.lr_scale.unwrap_or(1.0);
        blocking(move || shard.push(r.batch_id, grads, lr_scale)).await?;
        self.done("push", start);
        Ok(Response::new(pb::Empty {}))
    }

    async fn export(&self, request: Request<pb::ExportRequest>) -> Result<Response<pb::ExportReply>, Status> {
        let r = request.into_inner();
        let shard = self.shard()?;
        let cursor = (r.shard_cursor as usize, r.slot_cursor as usize);
        let page = blocking(move || shard.export(cursor, r.max_rows as usize)).await?;
        let (next_shard_cursor, next_slot_cursor) = page.next.unwrap_or_default();
        let filters = page.filters.unwrap_or_default();
        let reply = pb::ExportReply {
            keys: u64s_to_bytes(&page.keys),
            rows: f32s_to_bytes(&page.rows),
            done: page.next.is_none(),
            next_shard_cursor: next_shard_cursor as u64,
            next_slot_cursor: next_slot_cursor as u64,
            last_uses: u64s_to_bytes(&page.last_uses),
            has_filters: cursor == (0, 0),
            filter_tick: filters.tick,
            sketch_count: filters.sketches.len() as u32,
            sketches: filters.sketches.concat(),
        };
        self.metrics.count_bytes("out", "worker", reply.rows.len() + reply.keys.len());
        Ok(Response::new(reply))
    }

    async fn write_part(&self, request: Request<pb::WritePartRequest>) -> Result<Response<pb::WritePartReply>, Status> {
        let r = request.into_inner();
        let shard = self.shard()?;
        let part_request = PartRequest {
            checkpoint: (!r.no_checkpoint).then(|| std::path::PathBuf::from(&r.dir)),
            since: r.has_since.then_some(r.since),
            export: (!r.export_dir.is_empty())
                .then(|| (std::path::PathBuf::from(&r.export_dir), r.has_export_since.then_some(r.export_since))),
        };
        let p = blocking(move || shard.write_part(Generation(r.generation), &part_request)).await?;
        let mut reply = pb::WritePartReply {
            secs: p.secs,
            dim: p.dim as u32,
            row_len: p.row_len as u32,
            total_rows: p.total_rows,
            export: p.export.map(|e| pb::ExportPart {
                name: e.name,
                bytes: e.entry.bytes,
                xxh3: e.entry.xxh3,
                rows: e.rows,
                clock: e.clock,
            }),
            ..Default::default()
        };
        if let Some(written) = &p.written {
            let part = &written.part;
            reply.embeddings = part.embeddings.clone();
            reply.filters = part.filters.clone().unwrap_or_default();
            reply.rows = part.rows;
            reply.clock = part.clock;
            reply.files =
                written.files.iter().map(|(name, bytes)| pb::PartFile { name: name.clone(), bytes: *bytes }).collect();
            reply.event_ticks = part.event_clock.iter().map(|e| e.0).collect();
            reply.event_secs = part.event_clock.iter().map(|e| e.1).collect();
        }
        Ok(Response::new(reply))
    }

    async fn stats(&self, _: Request<pb::Empty>) -> Result<Response<pb::ShardStats>, Status> {
        let shard = self.shard()?;
        let (r, pending) = blocking(move || {
            let mut report = ShardReport::of(shard.table());
            report.second_level = shard.second_level_stats();
            Ok((report, shard.pending_batches() as u64))
        })
        .await?;
        let t = r.tier.unwrap_or_default();
        Ok(Response::new(pb::ShardStats {
            rows: r.rows,
            pending_batches: pending,
            cached_rows: r.cached_rows,
            tiered: r.tier.is_some(),
            hits: t.hits,
            loads: t.loads,
            inits: t.inits,
            writebacks: t.writebacks,
            prefetch_loads: t.prefetch_loads,
            prefetch_inits: t.prefetch_inits,
            admitted: r.filters.admitted,
            not_admitted: r.filters.not_admitted,
            expired: r.filters.expired,
            evicted: r.filters.evicted,
            second_level: r.second_level.map(|s| pb::SecondLevelStats {
                passes_staged: s.passes_staged,
                passes_flushed: s.passes_flushed,
                rows_from_l1: s.rows_from_l1,
                rows_initialised: s.rows_initialised,
                rows_flushed: s.rows_flushed,
                peak_rows: s.peak_rows,
                l1_reads_during_pass: s.l1_reads_during_pass,
                staging_secs: s.staging_secs,
                flush_secs: s.flush_secs,
            }),
        }))
    }

    async fn stage(&self, request: Request<pb::StageRequest>) -> Result<Response<pb::Empty>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        self.metrics.count_bytes("in", "loader", r.keys.len() + r.batches.len());
        let keys = bytes_to_u64s(&r.keys, &self.peer, "keys").map_err(|e| super::to_status(&e))?;
        let batches = bytes_to_u64s(&r.batches, &self.peer, "batch ids").map_err(|e| super::to_status(&e))?;
        let shard = self.shard()?;
        blocking(move || {
            let staging = shard.pass_staging().ok_or_else(|| {
                ClusterError::Setup(format!(
                    "shard {}: staging a pass needs a second level (cluster.mode = \"collocated\")",
                    shard.index()
                ))
            })?;
            staging.stage(r.pass, keys, batches)
        })
        .await?;
        self.done("stage", start);
        Ok(Response::new(pb::Empty {}))
    }
}

/// An export page off the wire, its arrays checked (a page from a bad peer
/// is an error, never a panic).
pub fn export_page_from_proto(reply: pb::ExportReply, peer: &str) -> Result<ExportPage, ClusterError> {
    let next = (!reply.done).then_some((reply.next_shard_cursor as usize, reply.next_slot_cursor as usize));
    let filters = match reply.has_filters {
        false => None,
        true => {
            let count = reply.sketch_count as usize;
            if count > 0 && !reply.sketches.len().is_multiple_of(count) {
                return Err(ClusterError::Setup(format!(
                    "{peer}: {} sketch bytes do not split into {count} sketches",
                    reply.sketches.len()
                )));
            }
            let len = reply.sketches.len().checked_div(count).unwrap_or(0);
            let sketches = reply.sketches.chunks(len.max(1)).take(count).map(<[u8]>::to_vec).collect();
            Some(sparrow_embedding::FilterState { tick: reply.filter_tick, sketches })
        }
    };
    let page = ExportPage {
        keys: bytes_to_u64s(&reply.keys, peer, "keys")?,
        rows: bytes_to_f32s(&reply.rows, peer, "rows")?,
        last_uses: bytes_to_u64s(&reply.last_uses, peer, "last uses")?,
        filters,
        next,
    };
    // `n.is_multiple_of(0)` holds only for 0: no keys, no rows.
    let rows_fit = page.rows.len().is_multiple_of(page.keys.len());
    if page.last_uses.len() != page.keys.len() || !rows_fit {
        return Err(ClusterError::Malformed {
            peer: peer.to_string(),
            what: format!(
                "export page of {} keys with {} last uses and {} row values",
                page.keys.len(),
                page.last_uses.len(),
                page.rows.len()
            ),
        });
    }
    Ok(page)
}

/// The shard's gRPC service, size-capped and token-checked.
pub fn service(
    shard: Arc<Serving<ShardServer>>,
    settings: &NetSettings,
    metrics: RoleMetrics,
) -> InterceptedService<pb::shard_server::ShardServer<impl pb::shard_server::Shard>, CheckToken> {
    let peer = "a client of this shard".to_string();
    let inner = pb::shard_server::ShardServer::new(ShardGrpc { shard, metrics, peer })
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    InterceptedService::new(inner, CheckToken::new(settings))
}

type Client = pb::shard_client::ShardClient<AuthedChannel>;

/// A remote shard as a [`ShardService`].
pub struct ShardClient {
    peer: Peer<Client>,
    /// `train.simd`: how half rows received are widened (the same values either way).
    simd: Simd,
}

impl ShardClient {
    /// Connects (with retries) to shard `index` at `addr`.
    pub fn connect(
        index: usize,
        addr: &str,
        settings: &NetSettings,
        handle: &Handle,
        metrics: RoleMetrics,
    ) -> Result<ShardClient, ClusterError> {
        let name = format!("shard {index} at {addr}");
        let channels = handle.block_on(connect(addr, &name, settings))?;
        let make = |channel| {
            pb::shard_client::ShardClient::with_interceptor(channel, channels.token.clone())
                .max_decoding_message_size(settings.max_message_bytes)
                .max_encoding_message_size(settings.max_message_bytes)
        };
        let (client, untimed) = (make(channels.timed.clone()), make(channels.untimed.clone()));
        Ok(ShardClient {
            peer: Peer::new(name, "shard", client, handle.clone(), metrics, settings).with_untimed(untimed),
            simd: Simd::Auto,
        })
    }

    /// Widens the half rows it receives as `simd` allows (`train.simd`).
    pub fn with_simd(mut self, simd: Simd) -> Self {
        self.simd = simd;
        self
    }
}

impl ShardService for ShardClient {
    fn enqueue(
        &self,
        batch_id: u64,
        keys: Vec<u64>,
        mode: Mode,
        newest_record_ms: Option<i64>,
    ) -> Result<(), ClusterError> {
        let request =
            pb::EnqueueRequest { batch_id, keys: u64s_to_bytes(&keys), eval: mode == Mode::Eval, newest_record_ms };
        self.peer.call("enqueue", request, |mut c, r| async move { c.enqueue(r).await })?;
        Ok(())
    }

    fn pull(&self, batch_id: u64) -> Result<Vec<f32>, ClusterError> {
        let reply = self.peer.call("pull", pb::PullRequest { batch_id }, |mut c, r| async move { c.pull(r).await })?;
        decode_rows(&reply, &self.peer.name, self.simd)
    }

    fn push(&self, batch_id: u64, grads: Vec<f32>, lr_scale: f32) -> Result<(), ClusterError> {
        let lr_scale = (lr_scale != 1.0).then_some(lr_scale);
        let request = pb::PushRequest { batch_id, grads: f32s_to_bytes(&grads), lr_scale };
        self.peer.call("push", request, |mut c, r| async move { c.push(r).await })?;
        Ok(())
    }

    fn report(&self) -> Result<ShardReport, ClusterError> {
        let s = self.peer.call("stats", pb::Empty {}, |mut c, r| async move { c.stats(r).await })?;
        let tier = s.tiered.then_some(TierStats {
            hits: s.hits,
            loads: s.loads,
            inits: s.inits,
            writebacks: s.writebacks,
            prefetch_loads: s.prefetch_loads,
            prefetch_inits: s.prefetch_inits,
        });
        let filters =
            FilterStats { admitted: s.admitted, not_admitted: s.not_admitted, expired: s.expired, evicted: s.evicted };
        let second_level = s.second_level.map(|l| SecondLevelStats {
            passes_staged: l.passes_staged,
            passes_flushed: l.passes_flushed,
            rows_from_l1: l.rows_from_l1,
            rows_initialised: l.rows_initialised,
            rows_flushed: l.rows_flushed,
            peak_rows: l.peak_rows,
            l1_reads_during_pass: l.l1_reads_during_pass,
            staging_secs: l.staging_secs,
            flush_secs: l.flush_secs,
        });
        Ok(ShardReport { rows: s.rows, cached_rows: s.cached_rows, tier, filters, second_level })
    }

    /// The remote shard says whether it has a second level (it refuses a stage otherwise).
    fn pass_staging(&self) -> Option<&dyn PassStaging> {
        Some(self)
    }

    fn export(&self, cursor: (usize, usize), max_rows: usize) -> Result<ExportPage, ClusterError> {
        let request = pb::ExportRequest {
            shard_cursor: cursor.0 as u64,
            slot_cursor: cursor.1 as u64,
            max_rows: max_rows as u32,
        };
        let reply = self.peer.call("export", request, |mut c, r| async move { c.export(r).await })?;
        export_page_from_proto(reply, &self.peer.name)
    }

    fn write_part(&self, generation: Generation, request: &PartRequest) -> Result<PartWritten, ClusterError> {
        let (export_dir, export_since) = request.export.clone().unzip();
        let export_since = export_since.flatten();
        let pb_request = pb::WritePartRequest {
            generation: generation.number(),
            dir: request.checkpoint.as_ref().map(|d| d.display().to_string()).unwrap_or_default(),
            has_since: request.since.is_some(),
            since: request.since.unwrap_or(0),
            no_checkpoint: request.checkpoint.is_none(),
            export_dir: export_dir.map(|d| d.display().to_string()).unwrap_or_default(),
            has_export_since: export_since.is_some(),
            export_since: export_since.unwrap_or(0),
        };
        let r = self.peer.call_unbounded("write_part", pb_request, |mut c, r| async move { c.write_part(r).await })?;
        // File names come back into a path under the checkpoint directory: plain names only.
        let plain = |name: &String| {
            if name.is_empty() || name.contains('/') || name.contains("..") {
                return Err(ClusterError::Malformed {
                    peer: self.peer.name.clone(),
                    what: format!("part file name `{name}`"),
                });
            }
            Ok(())
        };
        let written = match request.checkpoint {
            Some(_) => {
                let part = sparrow_trainer::checkpoint::Part {
                    embeddings: r.embeddings,
                    filters: (!r.filters.is_empty()).then_some(r.filters),
                    rows: r.rows,
                    clock: r.clock,
                    since: request.since,
                    event_clock: r.event_ticks.into_iter().zip(r.event_secs).collect(),
                };
                let mut names =
                    std::iter::once(&part.embeddings).chain(part.filters.iter()).chain(r.files.iter().map(|f| &f.name));
                names.try_for_each(plain)?;
                let files = r.files.into_iter().map(|f| (f.name, f.bytes)).collect();
                Some(sparrow_trainer::checkpoint::WrittenPart { part, files })
            }
            None => None,
        };
        let export = match (&request.export, r.export) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(ClusterError::Malformed {
                    peer: self.peer.name.clone(),
                    what: "a reply without the serving export's part it was asked for".into(),
                });
            }
            (Some(_), Some(e)) => {
                plain(&e.name)?;
                let entry = sparrow_trainer::checkpoint::FileEntry { bytes: e.bytes, xxh3: e.xxh3 };
                Some(sparrow_trainer::export::RowsPart { name: e.name, entry, rows: e.rows, clock: e.clock })
            }
        };
        Ok(PartWritten {
            written,
            export,
            secs: r.secs,
            dim: r.dim as usize,
            row_len: r.row_len as usize,
            total_rows: r.total_rows,
        })
    }
}

impl PassStaging for ShardClient {
    fn stage(&self, pass: u64, keys: Vec<u64>, batches: Vec<u64>) -> Result<(), ClusterError> {
        let request = pb::StageRequest { pass, keys: u64s_to_bytes(&keys), batches: u64s_to_bytes(&batches) };
        // Staging copies as many rows as the pass has: no RPC deadline.
        self.peer.call_unbounded("stage", request, |mut c, r| async move { c.stage(r).await })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_pull_replies_carry_the_stored_vectors_exactly_in_half_the_bytes() {
        let vectors: Vec<f32> = (0..15).map(|i| (i as f32 * 0.37).sin()).collect();
        for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
            let format = RowFormat { dtype, dim: 5, state_len: 0, simd: Simd::Auto };
            let mut stored = vectors.clone();
            format.round(&mut stored);
            let reply = encode_rows(&stored, format);
            assert_eq!(reply.rows.len(), 3 * 3 * 4, "3 vectors of 3 words");
            assert_eq!(decode_rows(&reply, "shard 0", Simd::Auto).expect("decode"), stored);
            let cut = pb::Rows { rows: reply.rows[..8].to_vec(), ..reply.clone() };
            let err = decode_rows(&cut, "shard 0", Simd::Auto).expect_err("partial vector").to_string();
            assert!(err.contains("shard 0") && err.contains("width 5"), "{err}");
        }
        let f32s =
            encode_rows(&vectors, RowFormat { dtype: EmbeddingDtype::F32, dim: 5, state_len: 0, simd: Simd::Auto });
        assert_eq!(f32s.rows.len(), 60);
        assert_eq!(decode_rows(&f32s, "shard 0", Simd::Auto).expect("decode"), vectors);
        let odd = pb::Rows { dtype: "f8".into(), ..f32s };
        assert!(decode_rows(&odd, "shard 0", Simd::Auto).expect_err("dtype").to_string().contains("`f8`"));
    }
}
