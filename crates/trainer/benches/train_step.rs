//! One training step of the reference model (MLP 429-256-128-1, dim 16,
//! Adagrad + Adam, batch 1024) on batches already parsed into memory.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sparrow_core::config::ModelKind;
use sparrow_core::{Batch, Config};
use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_trainer::Trainer;

fn bench(c: &mut Criterion) {
    let dir = std::env::temp_dir().join("sparrow-train-step-bench");
    sparrow_data::synth::generate(&dir, 64 * 1024, 1, 1).expect("generate");
    let mut config = Config::default();
    config.model.kind = ModelKind::named("mlp");
    let batches: Vec<Batch> =
        BatchStream::spawn(&dir.join("train.tsv"), &config, 1024, Default::default(), 1, BadRows::new(0, 1))
            .expect("open")
            .collect::<Result<_, _>>()
            .expect("read");
    let pool = sparrow_trainer::run::compute_pool(2).expect("pool");
    let mut trainer = Trainer::new(&config, DataLayout::from_config(&config.data)).expect("trainer");
    let mut group = c.benchmark_group("train_step");
    group.throughput(Throughput::Elements(1024));
    let mut i = 0;
    group.bench_function("mlp_ref_batch1024", |b| {
        b.iter(|| {
            pool.install(|| trainer.train_batch(&batches[i % batches.len()]).expect("step"));
            i += 1;
        })
    });
    group.finish();
}

criterion_group! { name = benches; config = Criterion::default().sample_size(20); targets = bench }
criterion_main!(benches);
