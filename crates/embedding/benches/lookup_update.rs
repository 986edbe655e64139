//! Hot path of the embedding store: dedup + lookup + Adagrad update of one
//! batch (1024 samples × 26 fields) of power-law keys, at dim 16 and 64, and
//! the dedup + partition alone. `sparrow bench` prints the first
//! figure beside the gather ceiling.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sparrow_core::config::InitConfig;
use sparrow_core::key::mix64;
use sparrow_core::rng::Rng;
use sparrow_data::synth::Alias;
use sparrow_embedding::{EmbeddingTable, Initializer, SparseOptimizer};

const TABLE_ROWS: usize = 1_000_000;
const KEYS_PER_BATCH: usize = 1024 * 26;

fn bench(c: &mut Criterion) {
    let zipf = Alias::zipf(TABLE_ROWS, 1.05);
    let mut rng = Rng::new(1);
    let batches: Vec<Vec<u64>> =
        (0..32).map(|_| (0..KEYS_PER_BATCH).map(|_| mix64(zipf.draw(&mut rng) as u64)).collect()).collect();
    let mut group = c.benchmark_group("lookup_update");
    group.throughput(Throughput::Elements(KEYS_PER_BATCH as u64));
    let partitioner =
        EmbeddingTable::new(16, SparseOptimizer::Sgd { lr: 0.05 }, Initializer::new(InitConfig::default(), 1), 64)
            .partitioner();
    let mut i = 0;
    group.bench_function("plan_batch1024x26", |b| {
        b.iter(|| {
            i += 1;
            partitioner.plan(&batches[i % batches.len()]).num_unique()
        })
    });
    for dim in [16usize, 64] {
        let table = EmbeddingTable::new(
            dim,
            SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 },
            Initializer::new(InitConfig::default(), 1),
            64,
        );
        let all: Vec<u64> = (0..TABLE_ROWS as u64).map(mix64).collect();
        for chunk in all.chunks(1 << 16) {
            let plan = table.plan(chunk);
            let mut rows = vec![0.0; plan.num_unique() * dim];
            table.lookup_or_insert(&plan, &mut rows).expect("fill");
        }
        let mut i = 0;
        group.bench_function(format!("dim{dim}_batch1024x26"), |b| {
            b.iter(|| {
                let plan = table.plan(&batches[i % batches.len()]);
                i += 1;
                let mut rows = vec![0.0; plan.num_unique() * dim];
                let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
                table.apply_gradients_at(&plan, &slots, &rows).expect("update");
                plan.num_unique()
            })
        });
    }
    group.finish();
}

criterion_group! { name = benches; config = Criterion::default().sample_size(20); targets = bench }
criterion_main!(benches);
