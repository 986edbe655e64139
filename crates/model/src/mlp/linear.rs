//! A layer's products: `dst = op(a)·op(b)` in the model's precision, and
//! the gradients of `y = x·W + b`.

use crate::bf16::{Arith, PackedLeft};
use crate::matrix::{Operand, sgemm, sgemm_threads};
use sparrow_core::simd::Simd;

/// `dst = op(a)·op(b)` in the model's precision; `threads`: at most that
/// many threads (fp32; the bf16 kernel splits rows over the current pool).
#[expect(clippy::too_many_arguments, reason = "a matrix product's shape, operands and where it runs")]
pub(crate) fn matmul(
    arith: Arith,
    threads: Option<usize>,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
) {
    match (arith, threads) {
        (Arith::F32(simd), None) => sgemm(simd, m, n, k, a, b, dst),
        (Arith::F32(simd), Some(t)) => sgemm_threads(simd, m, n, k, a, b, dst, t),
        (Arith::Bf16(path), t) => crate::bf16::gemm_bf16_threads(path, m, n, k, a, b, dst, t),
    }
}

/// The gradients of `y = x·W + b` (`x: [rows, fan_in]`, `W: [fan_in,
/// fan_out]`) from `g = d loss / d y`: `dW = xᵀ·g`, `db += Σ_rows g`, and
/// `dx = g·Wᵀ`. The two products are independent and equally large: two
/// single-threaded gemms side by side scale better than two two-threaded
/// gemms one after the other (the bf16 kernel splits over the pool anyway).
/// `x` comes with its bf16 pairs for `xᵀ` where its caller packed them.
pub(crate) fn linear_grads(
    (arith, simd): (Arith, Simd),
    (rows, fan_in, fan_out): (usize, usize, usize),
    x: (&[f32], Option<&PackedLeft>),
    w: &[f32],
    g: &[f32],
    (dw, db): (&mut [f32], &mut [f32]),
    dx: &mut [f32],
) {
    // A head's few outputs (`NARROW_OUTPUTS`): both on this thread. Split,
    // `d x` landed in the other core's cache, and the layer below read it
    // back from there: the reference MLP's head (128 → 1, batch 1024) took
    // 72 µs on two threads against 46 on one (an AMX Xeon, bf16 step).
    if fan_out <= super::NARROW_OUTPUTS {
        weight_grads((arith, simd), (rows, fan_in, fan_out), x, g, (dw, db));
        matmul(arith, Some(1), rows, fan_in, fan_out, Operand::plain(g), Operand::t(w), dx);
        return;
    }
    rayon::join(
        || weight_grads((arith, simd), (rows, fan_in, fan_out), x, g, (dw, db)),
        || matmul(arith, Some(1), rows, fan_in, fan_out, Operand::plain(g), Operand::t(w), dx),
    );
}

/// [`linear_grads`] without d x: `dW = xᵀ·g`, `db += Σ_rows g` (each
/// column in row order, a tile of columns in registers: `columns.rs`).
pub(super) fn weight_grads(
    (arith, simd): (Arith, Simd),
    (rows, fan_in, fan_out): (usize, usize, usize),
    (x, packed): (&[f32], Option<&PackedLeft>),
    g: &[f32],
    (dw, db): (&mut [f32], &mut [f32]),
) {
    let (xt, g_op) = (Operand::t(x), Operand::plain(g));
    match (arith, packed) {
        // Pairs packed for the tile kernel, which is where this product runs.
        (Arith::Bf16(path), Some(packed)) => {
            let epilogue = crate::bf16::Epilogue::default();
            crate::bf16::gemm_bf16_lent(path, (fan_in, fan_out, rows), (xt, Some(packed)), g_op, dw, epilogue);
        }
        _ => matmul(arith, Some(1), fan_in, fan_out, rows, xt, g_op, dw),
    }
    crate::columns::add_column_sums(simd, g, fan_out, db);
}
