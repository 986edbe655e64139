//! One fp32 product alone, as the dense steps call it (`matrix::sgemm_threads`):
//! the narrow kernel where it takes the shape, `gemm` elsewhere. Prints the
//! best and median of `BENCH_RUNS` runs (15 unless set) of 50 products, and
//! GFLOP/s by the best.
//!
//! `cargo bench -p sparrow-model --bench products [-- M N K [t|nt] ...]`:
//! each shape `dst [M, N] = op(a)·op(b)` with a sum over K; `t` reads `a`
//! transposed (a weights' gradient `xᵀ·g`), `nt` reads `b` transposed (an
//! input's gradient `g·Wᵀ`). Without shapes, ESMM's first layers at a half
//! batch of 512 rows: forward, weights' gradient, input gradient.
//! `BENCH_THREADS` threads (1 unless set). `BENCH_COPIES=C` (1 unless set)
//! takes the 50 products in turn from C copies of the operands and
//! outputs, so that with enough copies each one's are out of the core's
//! caches when its turn comes, as in a training step, where each of a
//! step's many products reads what the ones before it pushed out (in
//! PLE's training step its main shapes ran up to a quarter slower than
//! here with one copy). `SPARROW_SIMD=avx2` takes the narrow kernel's
//! AVX2 build, as a CPU without AVX-512 does.

use std::time::Instant;

use sparrow_model::matrix::{Operand, sgemm_threads};

fn op(d: &[f32], transposed: bool) -> Operand<'_> {
    if transposed { Operand::t(d) } else { Operand::plain(d) }
}

/// A positive count from the environment variable `name` (`default` when
/// unset); anything else stops the bench, naming the variable.
fn count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("products: {name}={v:?} is not a positive whole number");
                std::process::exit(2)
            }
        },
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut shapes = Vec::new();
    let mut at = 0;
    while at + 2 < args.len() {
        let dim = |i: usize| {
            args[at + i].parse::<usize>().unwrap_or_else(|_| {
                eprintln!("products: {:?} is not a size", args[at + i]);
                std::process::exit(2)
            })
        };
        let (m, n, k) = (dim(0), dim(1), dim(2));
        at += 3;
        let how = match args.get(at).map(String::as_str) {
            Some(h @ ("t" | "nt")) => {
                at += 1;
                h.to_string()
            }
            _ => String::new(),
        };
        shapes.push((m, n, k, how));
    }
    if at != args.len() {
        eprintln!("products: {:?} is not a whole shape (M N K, then t or nt if transposed)", &args[at..]);
        std::process::exit(2)
    }
    if shapes.is_empty() {
        shapes = vec![(512, 64, 81, String::new()), (81, 64, 512, "t".into()), (512, 81, 64, "nt".into())];
    }
    let (threads, runs, copies) = (count("BENCH_THREADS", 1), count("BENCH_RUNS", 15), count("BENCH_COPIES", 1));
    let simd = sparrow_core::simd::Simd::parse(&std::env::var(sparrow_core::simd::VARIABLE).unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}"));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
    println!("shape                  best µs   med µs   GFLOP/s");
    for (m, n, k, how) in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
        let (a, b) = (vec![a; copies], vec![b; copies]);
        let mut dst = vec![vec![0.0f32; m * n]; copies];
        let (a_t, b_t) = (how == "t", how == "nt");
        let mut times = Vec::new();
        // The copies in turn across runs too: every one is used, however many.
        let mut turn = 0;
        pool.install(|| {
            for _ in 0..runs {
                let start = Instant::now();
                for _ in 0..50 {
                    let c = turn % copies;
                    turn += 1;
                    sgemm_threads(simd, m, n, k, op(&a[c], a_t), op(&b[c], b_t), &mut dst[c], threads);
                }
                times.push(start.elapsed().as_secs_f64() / 50.0);
            }
        });
        times.sort_by(f64::total_cmp);
        let (best, med) = (times[0], times[times.len() / 2]);
        let shape = format!("{m}x{n}x{k} {how}");
        println!("{shape:20} {:9.2} {:8.2} {:9.1}", best * 1e6, med * 1e6, 2.0 * (m * n * k) as f64 / best / 1e9);
    }
}
