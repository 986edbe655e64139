//! The dense step alone, every model kind: forward, backward and the dense
//! optimizer on one batch already pooled into the model's input rows, as
//! the step engine hands it over (batch 1024, 26 fields of dim 16,
//! 13 dense values, `hidden = [256, 128]`, the defaults otherwise), on two
//! threads. Prints the best and the median step time of 15 runs of 10 steps
//! and the floor flops (`DenseModel::step_flops_per_sample`) over the best
//! (a busy neighbour only ever adds time), beside the machine's fp32 and
//! bf16 ceilings measured in the same run.
//!
//! `cargo bench -p sparrow-model --bench dense_step [-- KIND... f32|bf16]`

use std::time::{Duration, Instant};

use candle_core::Device;
use sparrow_core::config::{DenseOptimizerConfig, ModelConfig, ModelKind, Precision};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};

const ROWS: usize = 1024;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let (precisions, wanted): (Vec<String>, Vec<String>) = args.into_iter().partition(|a| a == "f32" || a == "bf16");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
    let peaks = sparrow_model::peak::measure(2, Duration::from_millis(300));
    let bf16_peak = peaks.bf16_dot.as_ref().map_or(f64::NAN, |p| p.gflops);
    println!("ceilings: fp32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s", peaks.fp32_fma.gflops, bf16_peak);
    println!("{:<10} {:<5} {:>8} {:>8} {:>9} {:>8}", "kind", "prec", "best ms", "med ms", "GFLOP/s", "share");
    let shape = ModelShape { num_fields: 26, num_dense: 13, embedding_dim: 16 };
    for kind in sparrow_model::kinds::of_family(sparrow_model::kinds::Family::OneTask) {
        let has_products = kind.has_products();
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
                embedding_dim: 16,
                hidden: vec![256, 128],
                precision,
                ..Default::default()
            };
            let model = DenseModel::new(&config, shape, 7, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
            let mut optimizer = DenseOptimizer::new(DenseOptimizerConfig::default(), sparrow_core::simd::Simd::Auto);
            let mut rng = Rng::new(3);
            let row = model.packed_row_len().expect("CPU models take packed rows");
            let fields = 26 * model.width();
            let x: Vec<f32> = (0..ROWS * row)
                .map(|i| if i % row < fields { rng.uniform(-0.1, 0.1) } else { rng.uniform(0.0, 2.0) } as f32)
                .collect();
            let labels: Vec<f32> = (0..ROWS).map(|i| (i % 4 == 0) as u8 as f32).collect();
            let mut step = || {
                let (loss, _, _, grads) = model.forward_backward_packed(&x, &labels, |g| g[0]).expect("step");
                model.recycle(optimizer.apply(&model.params, grads).expect("optimizer"));
                std::hint::black_box(loss);
            };
            let mut times: Vec<f64> = pool.install(|| {
                (0..10).for_each(|_| step());
                (0..15)
                    .map(|_| {
                        let start = Instant::now();
                        (0..10).for_each(|_| step());
                        start.elapsed().as_secs_f64() / 10.0
                    })
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let (best, median) = (times[0], times[times.len() / 2]);
            let gflops = DenseModel::step_flops_per_sample(&config, shape).expect("a kind") * ROWS as f64 / best / 1e9;
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
