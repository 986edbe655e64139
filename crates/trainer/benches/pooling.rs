//! Pooling and its adjoint on generated batches of 1024 rows (26 fields, one
//! key each, the keys the generator's power law draws), for the vector widths
//! the model kinds use: 1 (LR), 16 (MLP, DLRM, DCN-v2), 17 (FM, Wide&Deep,
//! DeepFM: a first-order column and the factors). The input rows are the
//! packed `[pooled | 13 dense]` layout the engine pools into.
//!
//! `cargo bench -p sparrow-trainer --bench pooling`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sparrow_core::config::Pooling;
use sparrow_core::{Batch, Config};
use sparrow_data::{BadRows, BatchStream};
use sparrow_embedding::KeyPlan;
use sparrow_trainer::pooling::{Bags, pool_into, unpool_strided};

fn bench(c: &mut Criterion) {
    let dir = std::env::temp_dir().join("sparrow-pooling-bench");
    sparrow_data::synth::generate(&dir, 16 * 1024, 1, 1).expect("generate");
    let config = Config::default();
    let batches: Vec<Batch> =
        BatchStream::spawn(&dir.join("train.tsv"), &config, 1024, Default::default(), 1, BadRows::new(0, 1))
            .expect("open")
            .collect::<Result<_, _>>()
            .expect("read");
    let plans: Vec<KeyPlan> = batches.iter().map(|b| KeyPlan::new(&b.keys, 2, |k| (k & 1) as usize)).collect();
    let pool = sparrow_trainer::run::compute_pool(2).expect("pool");
    let mut group = c.benchmark_group("pooling");
    group.throughput(Throughput::Elements(1024));
    for width in [1, 16, 17] {
        let stride = 26 * width + 13;
        let mut packed = vec![0.0f32; 1024 * stride];
        let unique: Vec<Vec<f32>> =
            plans.iter().map(|p| (0..p.num_unique() * width).map(|i| (i % 7) as f32 * 0.25 - 0.75).collect()).collect();
        let mut i = 0;
        group.bench_function(format!("pool_width{width}"), |b| {
            b.iter(|| {
                let k = i % batches.len();
                let bags = Bags::of(&batches[k], &plans[k]);
                pool.install(|| pool_into(&bags, &unique[k], width, Pooling::Sum, (&mut packed, stride), None));
                i += 1;
            })
        });
        let grad: Vec<f32> = (0..1024 * stride).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        group.bench_function(format!("unpool_width{width}"), |b| {
            b.iter(|| {
                let k = i % batches.len();
                let bags = Bags::of(&batches[k], &plans[k]);
                std::hint::black_box(unpool_strided(&bags, &grad, stride, width, Pooling::Sum));
                i += 1;
            })
        });
    }
    group.finish();
}

criterion_group! { name = benches; config = Criterion::default().sample_size(30); targets = bench }
criterion_main!(benches);
