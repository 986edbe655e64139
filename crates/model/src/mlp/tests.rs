//! The MLP stack's tests: its products in every transpose and against
//! candle and f64 references in each precision, its fused CPU path against
//! candle's ops, gradient buffers reused without a trace, and its
//! gradients against finite differences with dropout, norms and each
//! activation.

use super::*;
use sparrow_core::config::Precision;
use sparrow_core::simd::Simd;

fn arith(p: Precision) -> Arith {
    Arith::new(p, Simd::Auto)
}
use candle_core::Device;
use sparrow_core::rng::Rng;

#[test]
fn sgemm_handles_every_transpose() {
    let (m, n, k) = (3, 4, 5);
    let mut rng = Rng::new(1);
    let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
    let naive = |i: usize, j: usize| (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
    // aᵀ stored as k×m, bᵀ stored as n×k.
    let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
    let bt: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
    for (lhs, lt, rhs, rt) in
        [(&a, false, &b, false), (&at, true, &b, false), (&a, false, &bt, true), (&at, true, &bt, true)]
    {
        let mut dst = vec![9.0; m * n];
        sgemm(
            Simd::Auto,
            m,
            n,
            k,
            Operand { data: lhs, transposed: lt },
            Operand { data: rhs, transposed: rt },
            &mut dst,
        );
        for i in 0..m {
            for j in 0..n {
                assert!((dst[i * n + j] - naive(i, j)).abs() < 1e-5, "a_t={lt} b_t={rt}");
            }
        }
    }
}

/// DCN-v2's product op: in f32 it equals candle's matmul (values and
/// both gradients, through autograd); in bf16 it matches the f64
/// product of bf16-rounded inputs, forward and backward.
#[test]
fn precision_matmul_matches_candle_in_f32_and_an_f64_reference_in_bf16() {
    let bf = |x: f32| f64::from(f32::from_bits(u32::from(crate::bf16::round_bf16(x)) << 16));
    let (rows, k, n) = (9, 37, 13);
    let mut rng = Rng::new(8);
    let mut draw = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
    let (xv, wv, seedv) = (draw(rows * k), draw(k * n), draw(rows * n));
    let dev = Device::Cpu;
    let grads = |precision: Option<Precision>| {
        let x = Var::from_tensor(&Tensor::from_vec(xv.clone(), (rows, k), &dev).expect("x")).expect("var");
        let w = Var::from_tensor(&Tensor::from_vec(wv.clone(), (k, n), &dev).expect("w")).expect("var");
        let y = match precision {
            Some(p) => matmul_in(arith(p), x.as_tensor(), w.as_tensor()).expect("op"),
            None => x.as_tensor().matmul(w.as_tensor()).expect("matmul"),
        };
        let seed = Tensor::from_vec(seedv.clone(), (rows, n), &dev).expect("seed");
        let g = (&y * &seed).expect("mul").sum_all().expect("sum").backward().expect("backward");
        let flat = |t: &Tensor| t.flatten_all().expect("flat").to_vec1::<f32>().expect("vec");
        let gx = flat(g.get(x.as_tensor()).expect("grad x"));
        let gw = flat(g.get(w.as_tensor()).expect("grad w"));
        (flat(&y), gx, gw)
    };
    let candle = grads(None);
    let ours = grads(Some(Precision::F32));
    for (what, a, b) in [("y", &ours.0, &candle.0), ("dx", &ours.1, &candle.1), ("dw", &ours.2, &candle.2)] {
        for (x, y) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "f32 {what}: {x} vs {y}");
        }
    }
    let (y, gx, gw) = grads(Some(Precision::Bf16));
    let close = |got: f32, want: f64, what: &str| {
        assert!((f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()), "bf16 {what}: {got} vs {want}");
    };
    for r in 0..rows {
        for j in 0..n {
            let want: f64 = (0..k).map(|p| bf(xv[r * k + p]) * bf(wv[p * n + j])).sum();
            close(y[r * n + j], want, "y");
        }
        for p in 0..k {
            let want: f64 = (0..n).map(|j| bf(seedv[r * n + j]) * bf(wv[p * n + j])).sum();
            close(gx[r * k + p], want, "dx");
        }
    }
    for p in 0..k {
        for j in 0..n {
            let want: f64 = (0..rows).map(|r| bf(xv[r * k + p]) * bf(seedv[r * n + j])).sum();
            close(gw[p * n + j], want, "dw");
        }
    }
}

/// `model.precision = "bf16"`: the fused forward and backward against an
/// f64 reference that rounds every product's inputs to bf16 (activations,
/// weights, gradients), each layer's output kept in f32 as the fused
/// path keeps it; but the head's (3 outputs, [`NARROW_OUTPUTS`]), whose
/// products are fp32's. Only the accumulation differs (fp32 against f64).
#[test]
fn bf16_forward_and_backward_match_an_f64_reference_with_bf16_inputs() {
    let rounded = |x: f32| f64::from(f32::from_bits(u32::from(crate::bf16::round_bf16(x)) << 16));
    let dev = Device::Cpu;
    let (rows, sizes, input) = (9, [13usize, 5, 3], 11usize);
    // The layers in bf16: all but the head.
    let in_bf16 = |layer: usize| layer < 2;
    let mut ps = ParamStore::new(5, dev.clone());
    let mlp = Mlp::new(&mut ps, "m", input, &sizes, false, arith(Precision::Bf16)).expect("mlp");
    let f32_mlp = {
        let mut ps = ParamStore::new(5, dev);
        Mlp::new(&mut ps, "m", input, &sizes, false, arith(Precision::F32)).expect("mlp")
    };
    let mut rng = Rng::new(4);
    let x: Vec<f32> = (0..rows * input).map(|_| rng.normal() as f32).collect();
    let grad_out: Vec<f32> = (0..rows * 3).map(|_| rng.normal() as f32).collect();
    let p: Vec<f32> = mlp.params().as_tensor().to_vec1().expect("params");

    // The reference, layer by layer.
    let mut acts: Vec<Vec<f32>> = vec![x.clone()];
    for (li, l) in mlp.shape.layers.iter().enumerate() {
        let bf = |x: f32| if in_bf16(li) { rounded(x) } else { f64::from(x) };
        let a = acts.last().expect("input");
        let mut out = vec![0f32; rows * l.fan_out];
        for r in 0..rows {
            for j in 0..l.fan_out {
                let dot: f64 = (0..l.fan_in).map(|i| bf(a[r * l.fan_in + i]) * bf(p[l.w + i * l.fan_out + j])).sum();
                let v = (dot + f64::from(p[l.b + j])) as f32;
                out[r * l.fan_out + j] = if l.relu { v.max(0.0) } else { v };
            }
        }
        acts.push(out);
    }
    let mut g = grad_out.clone();
    let mut grad_p = vec![0f64; p.len()];
    for (li, l) in mlp.shape.layers.iter().enumerate().rev() {
        let bf = |x: f32| if in_bf16(li) { rounded(x) } else { f64::from(x) };
        let a = &acts[li];
        for i in 0..l.fan_in {
            for j in 0..l.fan_out {
                grad_p[l.w + i * l.fan_out + j] =
                    (0..rows).map(|r| bf(a[r * l.fan_in + i]) * bf(g[r * l.fan_out + j])).sum();
            }
        }
        for j in 0..l.fan_out {
            grad_p[l.b + j] = (0..rows).map(|r| f64::from(g[r * l.fan_out + j])).sum();
        }
        let mut gi = vec![0f32; rows * l.fan_in];
        for r in 0..rows {
            for i in 0..l.fan_in {
                let v: f64 = (0..l.fan_out).map(|j| bf(g[r * l.fan_out + j]) * bf(p[l.w + i * l.fan_out + j])).sum();
                let through = li == 0 || a[r * l.fan_in + i] > 0.0;
                gi[r * l.fan_in + i] = if through { v as f32 } else { 0.0 };
            }
        }
        g = gi;
    }

    let mut scratch = MlpScratch::default();
    mlp.forward_cpu(&x, rows, None, &mut scratch).expect("forward");
    let close = |got: f32, want: f64, what: &str| {
        assert!((f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()), "{what}: {got} vs {want}");
    };
    for (o, want) in scratch.output.iter().zip(&acts[3]) {
        close(*o, f64::from(*want), "output");
    }
    let got_p = mlp.backward_cpu(&x, &grad_out, &mut scratch).expect("backward");
    for (i, (got, want)) in got_p.iter().zip(&grad_p).enumerate() {
        close(*got, *want, &format!("d param {i}"));
    }
    for (got, want) in scratch.grad_input.iter().zip(&g) {
        close(*got, f64::from(*want), "d input");
    }
    // And bf16 is not f32: the same weights give other outputs.
    let mut f32_scratch = MlpScratch::default();
    f32_mlp.forward_cpu(&x, rows, None, &mut f32_scratch).expect("forward");
    assert!(f32_scratch.output.iter().zip(&scratch.output).any(|(a, b)| a != b));
}

#[test]
fn a_reused_gradient_buffer_leaves_no_trace() {
    // Its stale values are NaN: any the backward pass does not overwrite
    // or zero would show.
    for precision in [Precision::F32, Precision::Bf16] {
        let mut ps = ParamStore::new(3, Device::Cpu);
        let mlp = Mlp::new(&mut ps, "m", 19, &[33, 17, 1], false, arith(precision)).expect("mlp");
        let mut rng = Rng::new(4);
        let rows = 9;
        let x: Vec<f32> = (0..rows * 19).map(|_| rng.normal() as f32).collect();
        let grad_out: Vec<f32> = (0..rows).map(|_| rng.normal() as f32).collect();
        let mut scratch = MlpScratch::default();
        let backward = |scratch: &mut MlpScratch| {
            mlp.forward_cpu(&x, rows, None, scratch).expect("forward");
            mlp.backward_cpu(&x, &grad_out, scratch).expect("backward")
        };
        let fresh = backward(&mut scratch);
        let fresh_dx = scratch.grad_input.clone();
        scratch.spare_grad = vec![f32::NAN; fresh.len()];
        // The layers' gradient buffers, longer than any layer needs.
        scratch.grad_input = vec![f32::NAN; rows * 40];
        scratch.grad_next = vec![f32::NAN; rows * 40];
        let reused = backward(&mut scratch);
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fresh), bits(&reused), "{precision:?}");
        assert!(fresh.iter().any(|&g| g != 0.0), "{precision:?}: a gradient at all");
        assert_eq!(fresh_dx.len(), rows * 19, "{precision:?}: d x is [rows, fan_in]");
        assert_eq!(bits(&fresh_dx), bits(&scratch.grad_input), "{precision:?}: d x");
    }
}

/// With dropout too (a draw, or none): the ops path multiplies by the
/// mask the fused step drops and scales by.
#[test]
fn fused_path_equals_candle_ops_forward_and_backward() {
    let dev = Device::Cpu;
    // 300 rows: the bias and ReLU passes split into blocks of
    // ROWS_PER_TASK rows, the last one partial.
    let (none, layer, batch) = (Norm::None, Norm::Layer, Norm::Batch);
    let relu = Activation::Relu;
    for (relu_last, rows, dropout, draw, (norm, activation)) in [
        (false, 7, 0.0, None, (none, relu)),
        (true, 7, 0.0, None, (none, relu)),
        (true, 300, 0.0, None, (none, relu)),
        (false, 300, 0.3, Some(11), (none, relu)),
        (true, 7, 0.5, Some(12), (none, relu)),
        (false, 7, 0.5, None, (none, relu)),
        (false, 300, 0.0, None, (layer, relu)),
        (true, 7, 0.3, Some(13), (layer, relu)),
        // Batch norm: by the batch where a step draws, else by the
        // running statistics.
        (false, 300, 0.0, Some(0), (batch, relu)),
        (true, 7, 0.3, Some(14), (batch, relu)),
        (false, 300, 0.0, None, (batch, relu)),
        // The other activations, with and without dropout and norms;
        // Dice by the batch or by the running statistics.
        (false, 300, 0.3, Some(15), (none, Activation::Prelu)),
        (true, 7, 0.0, Some(0), (layer, Activation::Gelu)),
        (false, 300, 0.2, Some(16), (batch, Activation::Silu)),
        (true, 7, 0.0, Some(0), (none, Activation::Dice)),
        (false, 300, 0.3, Some(17), (batch, Activation::Dice)),
        (true, 300, 0.0, None, (none, Activation::Dice)),
    ] {
        let mut ps = ParamStore::new(7, dev.clone());
        let normalization = StackStyle { norm, activation, ..StackStyle::PLAIN };
        let mlp =
            Mlp::new_normed(&mut ps, "m", 6, &[5, 4, 3], relu_last, arith(Precision::F32), normalization).expect("mlp");
        let mlp = mlp.with_dropout(dropout, Default::default());
        let mut rng = Rng::new(2);
        if let Some((running, _)) = &mlp.running {
            // Running statistics other than the initial ones.
            let values: Vec<f32> = (0..running.elem_count()).map(|i| (i % 5) as f32 * 0.3 + 0.2).collect();
            running.set(&Tensor::from_vec(values, running.elem_count(), &dev).expect("t")).expect("set");
        }
        let x: Vec<f32> = (0..rows * 6).map(|_| rng.normal() as f32).collect();
        let x = Var::from_tensor(&Tensor::from_vec(x, (rows, 6), &dev).expect("x")).expect("var");
        let fused = mlp.forward(x.as_tensor(), draw).expect("fused");
        let plain = mlp.forward_ops(x.as_tensor(), draw).expect("plain");
        crate::fused::assert_same_forward_and_backward(&fused, &plain, &[&x, mlp.params()]);
        let undropped = mlp.forward_ops(x.as_tensor(), None).expect("no draw");
        let differs = |a: &Tensor, b: &Tensor| {
            a.ne(b).and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.sum_all()).and_then(|t| t.to_scalar::<f32>())
        };
        let changed = differs(&plain, &undropped).expect("compare") > 0.0;
        let by_batch = norm == batch || activation == Activation::Dice;
        assert_eq!(changed, draw.is_some() && (dropout > 0.0 || by_batch), "dropout {dropout}, draw {draw:?}");
        if let (Some((_, slot)), Some(_)) = (&mlp.running, draw) {
            // Both paths handed the batch's statistics on: the same ones.
            let fused_stats = {
                mlp.forward(x.as_tensor(), draw).expect("fused");
                slot.lock().expect("slot").take().expect("fused stats")
            };
            mlp.forward_ops(x.as_tensor(), draw).expect("ops");
            let ops_stats = slot.lock().expect("slot").take().expect("ops stats");
            for (a, b) in fused_stats.iter().zip(&ops_stats) {
                assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}

/// The fused step with dropout, with a layer norm, and with both is
/// the derivative of its forward (the same draw each time): central
/// differences on every parameter and input of a small stack.
#[test]
fn dropout_and_layer_norm_gradients_match_finite_differences() {
    for (norm, dropout) in [(Norm::None, 0.4), (Norm::Layer, 0.0), (Norm::Layer, 0.4)] {
        dropout_and_norm_gradients(norm, dropout, Activation::Relu);
    }
}

/// A training pass's batch norm couples the rows: each column's mean
/// and variance move with every row's input.
#[test]
fn batch_norm_gradients_match_finite_differences() {
    for dropout in [0.0, 0.4] {
        dropout_and_norm_gradients(Norm::Batch, dropout, Activation::Relu);
    }
}

/// Each activation (its learned slopes included), alone, after dropout
/// is drawn, and after a norm; Dice by the batch.
#[test]
fn activation_gradients_match_finite_differences() {
    use Activation::{Dice, Gelu, Prelu, Silu};
    for (norm, dropout, activation) in [
        (Norm::None, 0.0, Prelu),
        (Norm::Batch, 0.4, Prelu),
        (Norm::None, 0.4, Gelu),
        (Norm::Layer, 0.0, Silu),
        (Norm::None, 0.0, Dice),
        (Norm::Batch, 0.4, Dice),
    ] {
        dropout_and_norm_gradients(norm, dropout, activation);
    }
}

fn dropout_and_norm_gradients(kind: Norm, dropout: f32, activation: Activation) {
    let norm = kind != Norm::None;
    let (rows, input, sizes) = (9, 5, [6usize, 4, 2]);
    // A norm over the 2 outputs would be ±γ + β by the sign of their
    // difference, a step no finite difference follows: the output
    // layer stays linear with a norm.
    let relu_last = !norm;
    let mut ps = ParamStore::new(3, Device::Cpu);
    let mlp = Mlp::new_normed(
        &mut ps,
        "m",
        input,
        &sizes,
        relu_last,
        arith(Precision::F32),
        StackStyle { norm: kind, activation, ..StackStyle::PLAIN },
    )
    .expect("mlp")
    .with_dropout(dropout, Default::default());
    let mut rng = Rng::new(5);
    let x: Vec<f32> = (0..rows * input).map(|_| rng.normal() as f32).collect();
    let g: Vec<f32> = (0..rows * 2).map(|_| rng.normal() as f32).collect();
    let draw = Some(77);
    let loss = |mlp: &Mlp, x: &[f32]| {
        let mut s = MlpScratch::default();
        mlp.forward_cpu(x, rows, draw, &mut s).expect("forward");
        s.output.iter().zip(&g).map(|(o, g)| f64::from(*o) * f64::from(*g)).sum::<f64>()
    };
    let mut s = MlpScratch::default();
    mlp.forward_cpu(&x, rows, draw, &mut s).expect("forward");
    let dp = mlp.backward_cpu(&x, &g, &mut s).expect("backward");
    let dx = s.grad_input.clone();
    let p0 = mlp.params().as_tensor().to_vec1::<f32>().expect("params");
    // The central difference, or a one-sided one where a ReLU's kink
    // lies within h on the other side (a batch norm moves every row of
    // a column, so a smaller h is tried too).
    let matches = |f: &dyn Fn(f32) -> f64, want: f64| {
        let at0 = f(0.0);
        [1e-3f32, 3e-4].iter().any(|&h| {
            let (right, left) = ((f(h) - at0) / f64::from(h), (at0 - f(-h)) / f64::from(h));
            [(right + left) / 2.0, right, left].iter().any(|d| (d - want).abs() < 2e-3)
        })
    };
    let mut checked = 0;
    for i in 0..p0.len() {
        let at = |d: f32| {
            let mut p = p0.clone();
            p[i] += d;
            mlp.params().set(&Tensor::from_vec(p, p0.len(), &Device::Cpu).expect("p")).expect("set");
            loss(&mlp, &x)
        };
        assert!(
            matches(&at, f64::from(dp[i])),
            "norm {kind:?}, dropout {dropout}, {activation:?}: param {i}: {} vs {}",
            dp[i],
            (at(1e-3) - at(-1e-3)) / 2e-3
        );
        checked += usize::from(dp[i] != 0.0);
    }
    mlp.params().set(&Tensor::from_vec(p0.clone(), p0.len(), &Device::Cpu).expect("p")).expect("set");
    for i in 0..x.len() {
        let at = |d: f32| {
            let mut x = x.clone();
            x[i] += d;
            loss(&mlp, &x)
        };
        assert!(
            matches(&at, f64::from(dx[i])),
            "norm {kind:?}, dropout {dropout}, {activation:?}: input {i}: {} vs {}",
            dx[i],
            (at(1e-3) - at(-1e-3)) / 2e-3
        );
    }
    assert!(checked > p0.len() / 3, "{checked} of {} parameters have a gradient", p0.len());
    // Something was dropped: the output is not the undropped one.
    let mut plain = MlpScratch::default();
    mlp.forward_cpu(&x, rows, None, &mut plain).expect("forward");
    let by_batch = kind == Norm::Batch || activation == Activation::Dice;
    assert_eq!(plain.output != s.output, dropout > 0.0 || by_batch);
    // A norm adds γ and β to each activated layer, PReLU a slope, Dice an α an output.
    let activated: &[usize] = if relu_last { &[6, 4, 2] } else { &[6, 4] };
    let learned: usize = activated.iter().map(|&n| crate::activation::learned(activation, n).len()).sum();
    let normed = if norm { 2 * (6 + 4) } else { 0 };
    assert_eq!(p0.len(), 5 * 6 + 6 + 6 * 4 + 4 + 4 * 2 + 2 + normed + learned);
}
