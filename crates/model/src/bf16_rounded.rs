//! `model.precision = "bf16"` on a CPU without a bf16 dot product
//! ([`Bf16Path::Rounded`](crate::bf16::Bf16Path)): the fp32 kernels on
//! operands rounded to bf16. The products of bf16 values are exact in
//! fp32, as in `vdpbf16ps`; only the order of the sums differs. The
//! rounding is a pass over each operand, so an MLP rounds each of its
//! operands once a step ([`RoundedOperands`]): a layer's input and
//! weights in the forward pass, kept for the backward one, and each
//! layer's output gradient once for its two products.

use std::cell::Cell;

use rayon::prelude::*;
use sparrow_core::simd::Simd;

use crate::matrix::{Operand, sgemm, sgemm_threads};

/// `x` rounded to bf16 and widened back: `bf16_daz(round_bf16(x))` (the
/// test checks every kind of float), written without branches so a loop
/// of it vectorises.
#[inline(always)]
pub(crate) fn rounded_f32(x: f32) -> f32 {
    let bits = x.to_bits();
    let nearest = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    let quiet_nan = (bits | 0x0040_0000) & 0xffff_0000;
    let signed_zero = bits & 0x8000_0000;
    let out = if bits & 0x7fff_ffff > 0x7f80_0000 { quiet_nan } else { nearest };
    f32::from_bits(if bits & 0x7f80_0000 == 0 { signed_zero } else { out })
}

/// `data` rounded into `out` (resized), in parallel blocks when large.
pub(crate) fn round_into(data: &[f32], out: &mut Vec<f32>) {
    // Every element is written below: only a longer buffer's new tail is
    // filled first (a cleared one was zeroed whole, every call).
    out.resize(data.len(), 0.0);
    let round = |o: &mut [f32], d: &[f32]| o.iter_mut().zip(d).for_each(|(o, &x)| *o = rounded_f32(x));
    const BLOCK: usize = 1 << 15;
    if data.len() <= BLOCK {
        round(out, data);
    } else {
        out.par_chunks_mut(BLOCK).zip(data.par_chunks(BLOCK)).for_each(|(o, d)| round(o, d));
    }
}

thread_local! {
    /// Rounded operands' buffers, reused call to call (taken while in use:
    /// a product started by work stealing inside another finds them gone
    /// and allocates its own).
    static ROUNDED: Cell<(Vec<f32>, Vec<f32>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// The fp32 product of the operands rounded to bf16 (widened back exactly;
/// denormals read as zero, as `vdpbf16ps` reads them).
#[expect(clippy::too_many_arguments, reason = "a matrix product's kernels, shape, operands and threads")]
pub(crate) fn gemm(
    simd: Simd,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
    threads: Option<usize>,
) {
    let (mut ra, mut rb) = ROUNDED.with(|r| r.take());
    round_into(a.data, &mut ra);
    round_into(b.data, &mut rb);
    let (a, b) = (Operand { data: &ra, transposed: a.transposed }, Operand { data: &rb, transposed: b.transposed });
    match threads {
        Some(t) => crate::matrix::sgemm_threads(simd, m, n, k, a, b, dst, t),
        None => crate::matrix::sgemm(simd, m, n, k, a, b, dst),
    }
    ROUNDED.with(|r| r.set((ra, rb)));
}

/// An MLP's operands rounded in its forward pass, kept for its backward
/// pass (the weights do not change in between), and a buffer for the
/// rounded output gradient of a layer.
#[derive(Default)]
pub struct RoundedOperands {
    inputs: Vec<Vec<f32>>,
    weights: Vec<Vec<f32>>,
    grad: Vec<f32>,
}

impl RoundedOperands {
    /// Forward pass of layer `layer`: `out = bf16(input)·bf16(w)` (`rows ×
    /// fan_in` by `fan_in × fan_out`), keeping both rounded operands.
    pub(crate) fn forward(
        &mut self,
        simd: Simd,
        layer: usize,
        (rows, fan_in, fan_out): (usize, usize, usize),
        input: &[f32],
        w: &[f32],
        out: &mut [f32],
    ) {
        if self.inputs.len() <= layer {
            self.inputs.resize_with(layer + 1, Vec::new);
            self.weights.resize_with(layer + 1, Vec::new);
        }
        round_into(input, &mut self.inputs[layer]);
        round_into(w, &mut self.weights[layer]);
        sgemm(
            simd,
            rows,
            fan_out,
            fan_in,
            Operand::plain(&self.inputs[layer]),
            Operand::plain(&self.weights[layer]),
            out,
        );
    }

    /// Backward products of layer `layer` (after its forward pass): `dW =
    /// bf16(x)ᵀ·bf16(g)`, `db += Σ_rows g`, `dx = bf16(g)·bf16(W)ᵀ`, the two
    /// products side by side as the fp32 path runs them.
    pub(crate) fn backward(
        &mut self,
        simd: Simd,
        layer: usize,
        (rows, fan_in, fan_out): (usize, usize, usize),
        g: &[f32],
        (dw, db): (&mut [f32], &mut [f32]),
        dx: &mut [f32],
    ) {
        round_into(g, &mut self.grad);
        let (x, w, rg) = (&self.inputs[layer], &self.weights[layer], &self.grad);
        rayon::join(
            || {
                sgemm_threads(simd, fan_in, fan_out, rows, Operand::t(x), Operand::plain(rg), dw, 1);
                for row in g.chunks_exact(fan_out) {
                    db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
                }
            },
            || sgemm_threads(simd, rows, fan_in, fan_out, Operand::plain(rg), Operand::t(w), dx, 1),
        );
    }
}
