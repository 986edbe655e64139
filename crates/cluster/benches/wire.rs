//! Serialization cost of the cluster's messages per trained sample: a
//! worker batch (1024 samples × 26 fields + 13 dense) from the loader, and
//! the batch's embedding rows (pull reply) and gradients (push), dim 16 with
//! ~10.6k unique keys (the generated data's dedup ratio of ~2.5). Each is
//! role type → protobuf bytes → role type, as sender and receiver do it.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use prost::Message;
use sparrow_cluster::WorkerBatch;
use sparrow_cluster::grpc::loader::{from_proto, to_proto};
use sparrow_cluster::grpc::{bytes_to_f32s, f32s_to_bytes};
use sparrow_core::key::mix64;
use sparrow_proto::v1 as pb;

const ROWS: usize = 1024;
const FIELDS: usize = 26;
const UNIQUE: usize = 10_600;
const DIM: usize = 16;

fn batch() -> WorkerBatch {
    let keys = ROWS * FIELDS;
    WorkerBatch {
        batch_id: 7,
        rows: ROWS,
        num_fields: FIELDS,
        num_dense: 13,
        num_tasks: 1,
        truncated_sequences: 0,
        groups: Vec::new(),
        labels: (0..ROWS).map(|i| (i % 4 == 0) as u8 as f32).collect(),
        dense: (0..ROWS * 13).map(|i| i as f32 * 0.01).collect(),
        bag_offsets: (0..=keys as u32).collect(),
        key_weights: None,
        inverse: (0..keys).map(|i| (mix64(i as u64) % UNIQUE as u64) as u32).collect(),
        shard_counts: vec![UNIQUE as u32 / 2, UNIQUE as u32 - UNIQUE as u32 / 2],
        keys: Vec::new(),
        end: Default::default(),
        start: Default::default(),
        bad_rows: 0,
        sample_weights: None,
        merged_samples: 0,
        dropped_samples: 0,
        passes: Default::default(),
        stream: None,
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire");
    group.throughput(Throughput::Elements(ROWS as u64));
    let b = batch();
    group.bench_function("worker_batch_roundtrip", |bench| {
        bench.iter(|| {
            let bytes = to_proto(b.clone()).encode_to_vec();
            let decoded = pb::WorkerBatch::decode(bytes.as_slice()).expect("decode");
            from_proto(decoded, "bench").expect("valid")
        })
    });
    let rows: Vec<f32> = (0..UNIQUE * DIM).map(|i| i as f32 * 1e-4).collect();
    group.bench_function("rows_roundtrip_dim16", |bench| {
        bench.iter(|| {
            let bytes = pb::Rows { rows: f32s_to_bytes(&rows), ..Default::default() }.encode_to_vec();
            let decoded = pb::Rows::decode(bytes.as_slice()).expect("decode");
            bytes_to_f32s(&decoded.rows, "bench", "rows").expect("valid")
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
