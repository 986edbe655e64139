//! The gates of a level that all read one input (every gate of MMoE, and
//! of PLE's bottom level) as one product each way: their weights side by
//! side (`[fan_in, Σ k]`), so the input is read once for all of them. A
//! gate's few columns (MMoE's 4 of `[512, 81]·[81, 4]`) filled a quarter
//! of the product's sixteen lanes, and each gate read the whole input
//! again: three gates took as long as one product three times as wide.
//!
//! A kernel sums each output column on its own, over the input's columns
//! in order, as a product a gate does, so the logits and the weights'
//! gradients have the same bits (tested) wherever one kernel takes each
//! gate's width and their sum ([`columns_alike`]; elsewhere the caller
//! runs a product a gate); d input stays a product a gate, so its sums
//! are the same too.

use rayon::prelude::*;

use super::gates::copy_few;
use crate::amx;
use crate::bf16::{Arith, Bf16Path};
use crate::matrix::{Operand, narrow_takes};
use crate::mlp::{matmul, sized};
use sparrow_core::simd::Simd;

/// A gate's weights' gradient and its bias's.
pub(super) type GateGrads = (Vec<f32>, Vec<f32>);

/// Buffers kept between steps: the weights side by side, and the logits
/// (forward) or their gradients (backward) side by side, and the weights'
/// gradients side by side.
#[derive(Default)]
pub(super) struct SideBySide {
    weights: Vec<f32>,
    values: Vec<f32>,
    weight_grads: Vec<f32>,
}

/// Whether every gate reads the same input (and there are several).
pub(super) fn share_an_input(inputs: &[&[f32]]) -> bool {
    inputs.len() > 1 && inputs.iter().all(|i| std::ptr::eq(*i, inputs[0]))
}

/// Whether `[m, k]·[k, n]` (`a` stored transposed: `a_t`) is taken by one
/// kernel at each gate's `n` and at their sum, so that each column of the
/// product side by side is the sum the gate's own product gives: AMX
/// takes products of 16 columns or more (fewer: `vdpbf16ps`), the fp32
/// narrow kernel up to 64 (`gemm` itself may sum a small product in
/// lanes), and one column or one value along k has kernels of its own.
/// `vdpbf16ps` (and its portable form) sums each output in one chain.
pub(super) fn columns_alike(arith: Arith, (m, k, a_t): (usize, usize, bool), ns: &[usize]) -> bool {
    let total: usize = ns.iter().sum();
    let widths = || ns.iter().copied().chain([total]);
    if m < 2 || k < 2 || ns.iter().any(|&n| n < 2) {
        return false;
    }
    match arith {
        Arith::F32(simd) | Arith::Bf16(Bf16Path::Rounded(simd)) => widths().all(|n| narrow_takes(simd, m, n, k, a_t)),
        Arith::Bf16(Bf16Path::Amx) => widths().all(|n| amx::takes(m, n, k) == amx::takes(m, total, k)),
        Arith::Bf16(Bf16Path::Native | Bf16Path::Portable) => true,
    }
}

/// `to[.., at..at + k] = from` for each row (`from` `[rows, k]`, `to`
/// `[rows, width]`), or the other way (`back`).
fn columns(to: &mut [f32], width: usize, from: &mut [f32], (at, k): (usize, usize), back: bool) {
    for (wide, narrow) in to.chunks_exact_mut(width).zip(from.chunks_exact_mut(k)) {
        match back {
            false => copy_few(&mut wide[at..at + k], narrow),
            true => copy_few(narrow, &wide[at..at + k]),
        }
    }
}

impl SideBySide {
    /// The gates' weights (`[fan_in, k]` each) side by side.
    fn lay(&mut self, fan_in: usize, weights: &[(&[f32], usize)]) -> usize {
        let width: usize = weights.iter().map(|w| w.1).sum();
        let laid = sized(&mut self.weights, fan_in * width);
        let mut at = 0;
        for &(w, k) in weights {
            assert_eq!(w.len(), fan_in * k, "a gate's weights are not [{fan_in}, {k}]");
            for (wide, row) in laid.chunks_exact_mut(width).zip(w.chunks_exact(k)) {
                copy_few(&mut wide[at..at + k], row);
            }
            at += k;
        }
        width
    }

    /// Each gate's `logits = x·W` (`[rows, k]`), from one product.
    pub(super) fn logits(
        &mut self,
        arith: Arith,
        (x, rows): (&[f32], usize),
        weights: &[(&[f32], usize)],
        logits: &mut [Vec<f32>],
    ) {
        let fan_in = x.len() / rows.max(1);
        let width = self.lay(fan_in, weights);
        let (laid, values) = (&self.weights[..], sized(&mut self.values, rows * width));
        matmul(arith, None, rows, width, fan_in, Operand::plain(x), Operand::plain(laid), values);
        let mut at = 0;
        for (&(_, k), l) in weights.iter().zip(logits) {
            columns(values, width, sized(l, rows * k), (at, k), true);
            at += k;
        }
    }

    /// Each gate's `dW = xᵀ·d logits` (one product) and `db = Σ_rows d
    /// logits`, and its `d x = d logits·Wᵀ` (a product a gate, side by side
    /// on the pool's threads beside the one).
    pub(super) fn grads(
        &mut self,
        (arith, simd): (Arith, Simd),
        (x, rows): (&[f32], usize),
        weights: &[(&[f32], usize)],
        d_logits: &mut [Vec<f32>],
        d_inputs: &mut [Vec<f32>],
    ) -> Vec<GateGrads> {
        let fan_in = x.len() / rows.max(1);
        let width: usize = weights.iter().map(|w| w.1).sum();
        let values = sized(&mut self.values, rows * width);
        let mut at = 0;
        for (&(_, k), d) in weights.iter().zip(d_logits.iter_mut()) {
            columns(values, width, d, (at, k), false);
            at += k;
        }
        let (values, dw) = (&self.values[..], sized(&mut self.weight_grads, fan_in * width));
        let d_logits = &*d_logits;
        let (_, db) = rayon::join(
            || matmul(arith, Some(1), fan_in, width, rows, Operand::t(x), Operand::plain(values), dw),
            || {
                (weights.par_iter().zip(d_logits).zip(d_inputs.par_iter_mut()))
                    .map(|((&(w, k), d), d_in)| {
                        let d_in = sized(d_in, rows * fan_in);
                        matmul(arith, Some(1), rows, fan_in, k, Operand::plain(d), Operand::t(w), d_in);
                        let mut db = vec![0.0f32; k];
                        crate::columns::add_column_sums(simd, d, k, &mut db);
                        db
                    })
                    .collect::<Vec<_>>()
            },
        );
        let mut at = 0;
        weights
            .iter()
            .zip(db)
            .map(|(&(_, k), db)| {
                let mut w = vec![0.0f32; fan_in * k];
                columns(&mut self.weight_grads, width, &mut w, (at, k), true);
                at += k;
                (w, db)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::path;
    use crate::mlp::linear_grads;
    use sparrow_core::rng::Rng;

    fn values(n: usize, rng: &mut Rng) -> Vec<f32> {
        (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect()
    }

    fn same_bits(x: &[f32], y: &[f32]) -> bool {
        x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
    }

    /// Every path this CPU has: fp32, and bf16 on AMX (where granted),
    /// AVX-512-BF16 (where present), fp32 kernels on rounded inputs and
    /// the portable form.
    fn ariths() -> Vec<Arith> {
        let mut all =
            vec![Arith::F32(Simd::Auto), Arith::Bf16(Bf16Path::Rounded(Simd::Auto)), Arith::Bf16(Bf16Path::Portable)];
        for p in [path(Simd::Auto), path(Simd::Avx512)] {
            if !all.contains(&Arith::Bf16(p)) {
                all.push(Arith::Bf16(p));
            }
        }
        all
    }

    #[test]
    fn gates_side_by_side_give_each_gates_own_bits() {
        let mut rng = Rng::new(11);
        // MMoE's three gates of 4; PLE's bottom (three of 5, the shared
        // one of 7: 22 columns, AMX's on that CPU, refused there); gates
        // of 16 and 20 (AMX's each and together).
        let mut checked = 0;
        for arith in ariths() {
            for ks in [&[4, 4, 4][..], &[5, 5, 5, 7], &[16, 20]] {
                for (rows, fan_in) in [(150, 41), (512, 81), (37, 16)] {
                    let x = values(rows * fan_in, &mut rng);
                    let ws: Vec<Vec<f32>> = ks.iter().map(|&k| values(fan_in * k, &mut rng)).collect();
                    let weights: Vec<(&[f32], usize)> = ws.iter().zip(ks).map(|(w, &k)| (&w[..], k)).collect();
                    let mut side = SideBySide::default();
                    if columns_alike(arith, (rows, fan_in, false), ks) {
                        let mut logits = vec![Vec::new(); ks.len()];
                        side.logits(arith, (&x, rows), &weights, &mut logits);
                        for (g, &(w, k)) in weights.iter().enumerate() {
                            let mut own = vec![0.0f32; rows * k];
                            matmul(arith, None, rows, k, fan_in, Operand::plain(&x), Operand::plain(w), &mut own);
                            assert!(same_bits(&own, &logits[g]), "{arith:?} {ks:?} {rows}x{fan_in}: gate {g}'s logits");
                        }
                        checked += 1;
                    }
                    if columns_alike(arith, (fan_in, rows, true), ks) {
                        let mut d_logits: Vec<Vec<f32>> = ks.iter().map(|&k| values(rows * k, &mut rng)).collect();
                        let mut d_inputs = vec![Vec::new(); ks.len()];
                        let got = side.grads((arith, Simd::Auto), (&x, rows), &weights, &mut d_logits, &mut d_inputs);
                        for (g, &(w, k)) in weights.iter().enumerate() {
                            let (mut dw, mut db, mut dx) =
                                (vec![0.0; fan_in * k], vec![0.0; k], vec![0.0; rows * fan_in]);
                            let shape = (rows, fan_in, k);
                            linear_grads(
                                (arith, Simd::Auto),
                                shape,
                                (&x, None),
                                w,
                                &d_logits[g],
                                (&mut dw, &mut db),
                                &mut dx,
                            );
                            let what = format!("{arith:?} {ks:?} {rows}x{fan_in}: gate {g}'s");
                            assert!(same_bits(&dw, &got[g].0), "{what} dW");
                            assert!(same_bits(&db, &got[g].1), "{what} db");
                            assert!(same_bits(&dx, &d_inputs[g]), "{what} d input");
                        }
                        checked += 1;
                    }
                }
            }
        }
        // The fp32 narrow kernel (AVX-512F) or bf16's one chain an output
        // (the portable form, on every CPU) took some.
        assert!(checked > 0);
    }

    #[test]
    fn a_width_that_would_change_the_kernel_is_refused() {
        // One column, one input value or one row: kernels of their own.
        assert!(!columns_alike(Arith::Bf16(Bf16Path::Portable), (512, 81, false), &[1, 4]));
        assert!(!columns_alike(Arith::Bf16(Bf16Path::Portable), (1, 81, false), &[4, 4]));
        // AMX takes 22 columns, and not 5 or 7.
        assert!(!columns_alike(Arith::Bf16(Bf16Path::Amx), (512, 81, false), &[5, 5, 5, 7]));
        assert!(columns_alike(Arith::Bf16(Bf16Path::Amx), (512, 81, false), &[4, 4, 4]));
        assert!(columns_alike(Arith::Bf16(Bf16Path::Amx), (512, 81, false), &[16, 20]));
        // Past 64 columns fp32 leaves the narrow kernel for `gemm`.
        assert!(!columns_alike(Arith::F32(Simd::Auto), (512, 81, false), &[40, 30]));
        // The weights' gradient sums over the rows: past 512, `gemm` cuts them.
        assert!(!columns_alike(Arith::F32(Simd::Auto), (81, 1024, true), &[4, 4, 4]));
        assert_eq!(
            columns_alike(Arith::F32(Simd::Auto), (81, 512, true), &[4, 4, 4]),
            crate::matrix::narrow_takes(Simd::Auto, 81, 12, 512, true)
        );
    }
}
