//! The dense step alone, every model kind: forward, backward and the dense
//! optimizer on one batch already pooled into the model's input rows, as
//! the step engine hands it over (batch 1024, 26 fields of dim 16,
//! 13 dense values, `hidden = [256, 128]`, the defaults otherwise), on two
//! threads. The kinds for several tasks and sequences take the behaviour
//! data's shape instead (`sparrow bench`'s): 5 fields of dim 16 and a
//! price, three tasks (a binary, a weighted binary, 4 classes; ESMM its two
//! binary ones), and DIN a history of 0 to 20 items a row (10 on average),
//! its flops counted per item. Prints the best and the median step time of 15 runs of 10 steps (`BENCH_RUNS` runs where set)
//! and the floor flops (`DenseModel::step_flops_per_sample`) over the best
//! (a busy neighbour only ever adds time), beside the machine's fp32 and
//! bf16 ceilings measured in the same run, on as many threads as the step.
//!
//! `cargo bench -p sparrow-model --bench dense_step [-- KIND... f32|bf16 ROWS
//! dropout=R norm=auto|none|layer|batch activation=prelu|dice|gelu|silu
//! attention_activation=prelu|dice|gelu|silu dim=D
//! hidden=H,H…]` (ROWS: the batch, 1024 unless a number is given; D: the
//! embedding dimension, 16 unless given; H: the MLP's layers, 256,128
//! unless given; the norm each kind's own, `auto`, unless given: batch
//! norm for DIN). `BENCH_THREADS=1` runs the step on one thread (2 unless set);
//! each step runs in a hold of the pool's other thread, as a training
//! step does (`awake::through_step`); `BENCH_EVICT_KB=N` writes N KiB of
//! other memory before each step inside it, as a training step's
//! embedding phases do;
//! `SPARROW_SIMD=portable` takes every kernel's portable build;
//! `SPARROW_SIMD=avx2` every kernel's build for a CPU without AVX-512 (and
//! the ceilings of 256-bit FMAs).

use std::time::{Duration, Instant};

use candle_core::Device;
use sparrow_core::config::{Activation, DenseOptimizerConfig, ModelConfig, ModelKind, NormSetting, Precision};
use sparrow_core::config::{Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::kinds::Family;
use sparrow_model::{DenseModel, DenseOptimizer, Heads, ModelShape, Sequences};

/// Stops the bench naming the setting and the value it cannot take.
fn refuse(what: &str, found: &str) -> ! {
    eprintln!("dense_step: {what} cannot be {found:?}");
    std::process::exit(2)
}

/// `found` parsed as setting `what` takes it, or the bench stops naming both.
fn value<T: std::str::FromStr>(what: &str, found: &str) -> T {
    found.parse().unwrap_or_else(|_| refuse(what, found))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let (numbers, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.parse::<usize>().is_ok());
    let rows = numbers.first().and_then(|n| n.parse().ok()).unwrap_or(1024);
    // `SPARROW_SIMD=portable`: every kernel's portable build, as `train.simd`
    // says; `avx2`: every kernel as on a CPU without AVX-512.
    let simd = sparrow_core::simd::Simd::parse(&std::env::var(sparrow_core::simd::VARIABLE).unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}"));
    // `dropout=0.2`: every step draws its masks (`model.dropout`).
    let (dropout, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.starts_with("dropout="));
    let dropout: f32 = dropout.first().map_or(0.0, |d| value("dropout", &d["dropout=".len()..]));
    // `norm=batch`: `model.norm`; each kind's own unless given, as in
    // training and `sparrow bench` (batch norm for DIN: timed without it,
    // DIN looked a third faster here than in the kinds table).
    let (norm, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.starts_with("norm="));
    let norm = match norm.first().map(|n| &n["norm=".len()..]) {
        Some("layer") => NormSetting::Layer,
        Some("batch") => NormSetting::Batch,
        Some("none") => NormSetting::None,
        Some("auto") | None => NormSetting::Auto,
        Some(other) => refuse("norm", other),
    };
    // `activation=gelu`: `model.activation`; `attention_activation=dice`:
    // DIN's unit's (ReLU unless given).
    let named = |what: &str, found: Option<&str>| match found {
        Some("prelu") => Activation::Prelu,
        Some("dice") => Activation::Dice,
        Some("gelu") => Activation::Gelu,
        Some("silu") => Activation::Silu,
        Some("relu") | None => Activation::Relu,
        Some(other) => refuse(what, other),
    };
    let (unit, args): (Vec<String>, Vec<String>) =
        args.into_iter().partition(|a| a.starts_with("attention_activation="));
    let attention_activation = named("attention_activation", unit.first().map(|a| &a["attention_activation=".len()..]));
    let (activation, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.starts_with("activation="));
    let activation = named("activation", activation.first().map(|a| &a["activation=".len()..]));
    // `hidden=64,32`: the MLP's layers ([256, 128] unless given).
    let (hidden, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.starts_with("hidden="));
    let hidden: Vec<usize> = hidden.first().map_or(vec![256, 128], |h| {
        let sizes: Vec<usize> = h["hidden=".len()..].split(',').map(|n| value("hidden", n)).collect();
        if sizes.contains(&0) {
            refuse("hidden", h);
        }
        sizes
    });
    // `dim=8`: the embedding dimension (16 unless given).
    let (dim, args): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a.starts_with("dim="));
    let dim: usize = dim.first().map_or(16, |d| value("dim", &d["dim=".len()..]));
    let (precisions, wanted): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a == "f32" || a == "bf16");
    if let Some(unknown) = wanted.iter().find(|w| !sparrow_model::kinds::KINDS.iter().any(|k| k.name() == w.as_str())) {
        refuse("a model kind", unknown);
    }
    let threads: usize = std::env::var("BENCH_THREADS").map_or(2, |t| value("BENCH_THREADS", &t));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
    // `BENCH_RUNS=500`: more timed runs (a profiler's samples fall mostly in the step).
    let runs: usize = std::env::var("BENCH_RUNS").map_or(15, |r| value("BENCH_RUNS", &r));
    if runs == 0 {
        refuse("BENCH_RUNS", "0");
    }
    // `BENCH_EVICT_KB=4096`: before each step, write that much memory of
    // its own, inside a hold of the pool (`awake::through_step`), as a
    // training step's lookup, pooling and update run before its dense
    // step and leave the caches to their rows; each step is timed alone.
    let evict_kb: usize = std::env::var("BENCH_EVICT_KB").map_or(0, |e| value("BENCH_EVICT_KB", &e));
    let mut evict = vec![0.0f32; evict_kb * 256];
    // The ceilings of as many threads as the step runs on: one thread's
    // share of two cores' ceiling read half what it is.
    let peaks = sparrow_model::peak::measure(simd, threads, Duration::from_millis(300));
    // bf16's share is of the ceiling of the path it takes here (AMX's, or
    // vdpbf16ps's; `SPARROW_SIMD=avx512` keeps AMX out).
    let bf16_path = sparrow_model::bf16::path(simd);
    let bf16_peak = bf16_path.ceiling(&peaks).map_or(f64::NAN, |p| p.gflops);
    println!(
        "ceilings on {threads} thread(s): fp32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s ({})",
        peaks.fp32_fma.gflops,
        bf16_peak,
        bf16_path.name()
    );
    println!("{:<10} {:<5} {:>8} {:>8} {:>9} {:>8}", "kind", "prec", "best ms", "med ms", "GFLOP/s", "share");
    for kind in sparrow_model::kinds::KINDS {
        let has_products = kind.has_products();
        let one_task = kind.family() == Family::OneTask;
        let shape = if one_task {
            ModelShape { num_fields: 26, num_dense: 13, embedding_dim: dim }
        } else {
            ModelShape { num_fields: 5, num_dense: 1, embedding_dim: dim }
        };
        let heads = heads(kind.name(), one_task);
        let pairs: &[(usize, usize)] = if kind.attends() { &[(4, 1)] } else { &[] };
        let kind = ModelKind::named(kind.name());
        if !wanted.is_empty() && !wanted.iter().any(|w| w == kind.name()) {
            continue;
        }
        for precision in [Precision::F32, Precision::Bf16] {
            let name = if precision == Precision::F32 { "f32" } else { "bf16" };
            let skipped = !precisions.is_empty() && !precisions.iter().any(|p| p == name);
            if skipped || precision == Precision::Bf16 && !has_products {
                continue;
            }
            let config = ModelConfig {
                kind: kind.clone(),
                embedding_dim: dim,
                hidden: hidden.clone(),
                precision,
                tasks: Vec::new(),
                dropout,
                norm,
                activation,
                attention_activation,
                ..Default::default()
            };
            let model =
                DenseModel::with_attention(&config, shape, heads.clone(), pairs, 7, Device::Cpu, simd).expect("model");
            let mut optimizer = DenseOptimizer::new(DenseOptimizerConfig::default(), simd);
            let mut rng = Rng::new(3);
            // A kind on candle's graph alone (NFM) has no direct step to time.
            let Some(row) = model.packed_row_len() else {
                println!("{:<10} {name:<5} no direct step (candle's graph): not timed", kind.name());
                continue;
            };
            let fields = shape.num_fields * model.width();
            let x: Vec<f32> = (0..rows * row)
                .map(|i| if i % row < fields { rng.uniform(-0.1, 0.1) } else { rng.uniform(0.0, 2.0) } as f32)
                .collect();
            let tasks = heads.tasks();
            let labels: Vec<f32> = (0..rows * tasks)
                .map(|i| if i % tasks == 2 { (i % 4) as f32 } else { (i % 4 == 0) as u8 as f32 })
                .collect();
            let sequences = (!pairs.is_empty()).then(|| history(rows, dim, &mut rng));
            let items = sequences.as_ref().map_or(0.0, |s| s.rows[0].len() as f64 / rows as f64);
            let mut draws = 0u64;
            let mut step = || {
                draws += 1;
                let draw = (dropout > 0.0).then_some(draws);
                let (loss, _, _, grads) = model
                    .forward_backward_packed_with(&x, &labels, None, sequences.clone(), draw, |g, _| g.len())
                    .expect("step");
                model.recycle(optimizer.apply(&model.params, grads).expect("optimizer"));
                std::hint::black_box(loss);
            };
            let mut times: Vec<f64> = pool.install(|| {
                (0..10).for_each(|_| step());
                // Each step in a hold of the pool's other thread, as a
                // training step holds it (`Trainer::step`): unheld, a step
                // whose optimizer runs on one thread (fewer than 16 Ki
                // weights, `own_threads.rs`) let that thread fall asleep
                // before the next, and timed its wake-up, which no training
                // step pays (ESMM's median 0.19 → 0.22–0.34 ms).
                (0..runs)
                    .map(|_| {
                        let mut secs = 0.0;
                        for _ in 0..10 {
                            secs += sparrow_model::awake::through_step(|| {
                                evict.iter_mut().for_each(|v| *v += 1.0);
                                let start = Instant::now();
                                step();
                                start.elapsed().as_secs_f64()
                            });
                        }
                        std::hint::black_box(&evict);
                        secs / 10.0
                    })
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let (best, median) = (times[0], times[times.len() / 2]);
            let found = sparrow_model::kinds::find(&kind).expect("a kind");
            let mut floor_config = config.clone();
            // The floor counts each task's tower.
            floor_config.tasks = (0..tasks).map(task_config).collect();
            let floor = found.step_flops_per_sample(&floor_config, shape)
                + items * found.step_flops_per_history_item(&floor_config, shape);
            let gflops = floor * rows as f64 / best / 1e9;
            let ceiling = if precision == Precision::F32 { peaks.fp32_fma.gflops } else { bf16_peak };
            let (best, median) = (best * 1e3, median * 1e3);
            println!(
                "{:<10} {:<5} {best:>8.3} {median:>8.3} {gflops:>9.1} {:>8.3}",
                kind.name(),
                name,
                gflops / ceiling
            );
        }
    }
}

/// One binary task for the one-task kinds; three for the others (ESMM: two binary).
fn heads(kind: &str, one_task: bool) -> Heads {
    let task = |name: &str, kind, outputs, weight| Task { name: name.into(), kind, outputs, weight };
    if one_task {
        return Heads::one_binary();
    }
    let mut tasks = vec![task("click", TaskKind::Binary, 1, 1.0), task("conversion", TaskKind::Binary, 1, 2.0)];
    if kind != "esmm" {
        tasks.push(task("ad_type", TaskKind::Multiclass, 4, 0.5));
    }
    Heads::of(&tasks)
}

/// A history of 0 to 20 items a row, 13.0 on average: the behaviour data
/// training reads (`gen --tasks --sequence`, `max_len = 20`) has 13.2, and
/// DIN's step grows with them (a uniform 0–20, 10 on average, left its
/// step here a fifth shorter than in training).
fn history(batch: usize, dim: usize, rng: &mut Rng) -> Sequences {
    let rows: Vec<u32> =
        (0..batch as u32).flat_map(|r| std::iter::repeat_n(r, rng.below(30).min(20) as usize)).collect();
    let items = (0..rows.len() * dim).map(|_| rng.uniform(-0.1, 0.1) as f32).collect();
    Sequences { rows: vec![rows], items: vec![items] }
}

/// A binary task of that name (the floor counts tasks, not their kinds).
fn task_config(t: usize) -> sparrow_core::config::TaskConfig {
    sparrow_core::config::TaskConfig { name: format!("t{t}"), kind: TaskKind::Binary, classes: None, weight: 1.0 }
}
