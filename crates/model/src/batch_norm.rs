//! `model.norm = "batch"`: each activated layer of an MLP stack normalizes
//! each of its outputs over the batch's rows, as PyTorch's `BatchNorm1d`
//! does: y = (z − μ_B) / √(σ²_B + ε) · γ + β (σ²_B the batch's biased
//! variance, ε = 1e-5), then the ReLU. A training step hands the batch's
//! mean and unbiased variance on (`ParamStore::statistic`): the optimizer
//! moves the running statistics towards them, and evaluation, serving and
//! ONNX (a subtraction and a product per column) normalize by the running ones. Column sums
//! run over the rows in order, so any thread split gives the same bits.

use rayon::prelude::*;
use sparrow_core::simd::Simd;

use crate::ModelError;
use crate::columns::{Terms, avx512f, column_sums};
pub use crate::layer_norm::EPS;
use crate::meet::{Combine, Side};

/// Rows a task normalizes: both threads take part on a batch.
const ROWS_PER_TASK: usize = 128;

/// x̂ = (z − mean)·inv into `xhat`, and y = x̂·γ + β over `out`'s z (then
/// the ReLU, where `relu`, in the same pass: it was a pass of its own),
/// column by column of each row, a block of rows a task.
fn normalize(
    simd: Simd,
    (out, xhat): (&mut [f32], &mut [f32]),
    width: usize,
    (mean, inv): (&[f32], &[f32]),
    (gamma, beta): (&[f32], &[f32]),
    relu: bool,
) {
    let block = width.max(1) * ROWS_PER_TASK;
    let wide = avx512f(simd);
    out.par_chunks_mut(block).zip(xhat.par_chunks_mut(block)).for_each(|(out, xhat)| {
        let columns = (mean, inv, gamma, beta);
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn rows_avx512(out: &mut [f32], xhat: &mut [f32], width: usize, c: Columns<'_>, relu: bool) {
                normalize_rows(out, xhat, width, c, relu);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { rows_avx512(out, xhat, width, columns, relu) };
        }
        normalize_rows(out, xhat, width, columns, relu);
    });
}

/// Each column's mean, 1/σ̂, γ and β.
type Columns<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// [`normalize`] on a block of rows. (Its loops zip their columns rather
/// than index them: an indexed column is bounds-checked, and the check
/// kept each loop from being vectorised; the arithmetic is the same.)
#[inline(always)]
fn normalize_rows(out: &mut [f32], xhat: &mut [f32], width: usize, (mean, inv, gamma, beta): Columns<'_>, relu: bool) {
    for (z, x) in out.chunks_exact_mut(width).zip(xhat.chunks_exact_mut(width)) {
        let columns = mean.iter().zip(inv).zip(gamma.iter().zip(beta));
        for ((z, x), ((mean, inv), (gamma, beta))) in z.iter_mut().zip(x.iter_mut()).zip(columns) {
            *x = (*z - mean) * inv;
            let y = *x * gamma + beta;
            *z = if !relu || y > 0.0 { y } else { 0.0 };
        }
    }
}

/// A training step's normalization of `out` (`rows × width`) in place by
/// the batch's statistics (then the ReLU, where `relu`): x̂ is kept in
/// `xhat` and 1/√(σ²_B + ε) per column in `inv`, for the backward pass;
/// `stats` (`2·width`) gets the batch's mean, then its unbiased variance
/// (the biased one for one row). The columns' sums run a tile of columns
/// a task (`columns.rs`), each over the rows in order. A half of a batch
/// (`meet`) takes its own rows' mean and squared deviations, and the
/// whole batch's from the other half's (`meet.rs`).
pub(crate) async fn forward_train_met(
    simd: Simd,
    (out, width, relu): (&mut [f32], usize, bool),
    (gamma, beta): (&[f32], &[f32]),
    (xhat, inv): (&mut Vec<f32>, &mut Vec<f32>),
    (stats, meet): (&mut [f32], Option<Side<'_>>),
) -> Result<(), ModelError> {
    let mut rows = moments(simd, out, width, stats);
    if let Some(side) = meet {
        rows = side.exchange(Combine::Moments, stats, rows).await?;
    }
    by_moments(simd, (out, width, relu), (gamma, beta), (xhat, inv), (stats, rows));
    Ok(())
}

/// `stats = [mean | M2]` of `out`'s columns (M2: the squared deviations
/// from the mean, summed); returns `out`'s rows.
fn moments(simd: Simd, out: &[f32], width: usize, stats: &mut [f32]) -> usize {
    let rows = out.len() / width.max(1);
    let (mean, var) = stats.split_at_mut(width);
    let n = rows.max(1) as f32;
    column_sums(simd, out, width, Terms::Values, mean, &mut []);
    mean.iter_mut().for_each(|m| *m /= n);
    column_sums(simd, out, width, Terms::Squares(mean), var, &mut []);
    rows
}

/// `out` normalized by `[mean | M2]` of `rows` rows, `stats` turned into
/// `[mean | unbiased variance]`.
fn by_moments(
    simd: Simd,
    (out, width, relu): (&mut [f32], usize, bool),
    (gamma, beta): (&[f32], &[f32]),
    (xhat, inv): (&mut Vec<f32>, &mut Vec<f32>),
    (stats, rows): (&mut [f32], usize),
) {
    xhat.resize(out.len(), 0.0);
    inv.resize(width, 0.0);
    let (mean, var) = stats.split_at_mut(width);
    let n = rows.max(1) as f32;
    for (i, v) in inv.iter_mut().zip(var.iter_mut()) {
        *i = 1.0 / (*v / n + EPS).sqrt();
        // PyTorch keeps the unbiased variance as the running one.
        *v /= if rows > 1 { (rows - 1) as f32 } else { n };
    }
    normalize(simd, (out, xhat), width, (mean, inv), (gamma, beta), relu);
}

/// Outside training: `out` normalized by the running statistics
/// `(mean, var)` (then the ReLU, where `relu`), row by row (a row's output
/// depends on nothing else); x̂ and the columns' 1/√(var + ε) are kept as
/// in training.
pub(crate) fn forward_running(
    simd: Simd,
    (out, width, relu): (&mut [f32], usize, bool),
    (gamma, beta): (&[f32], &[f32]),
    (xhat, inv): (&mut Vec<f32>, &mut Vec<f32>),
    (mean, var): (&[f32], &[f32]),
) {
    xhat.resize(out.len(), 0.0);
    inv.clear();
    inv.extend(var.iter().map(|v| 1.0 / (v + EPS).sqrt()));
    normalize(simd, (out, xhat), width, (mean, inv), (gamma, beta), relu);
}

/// From `g` = d loss / d y (replaced by d loss / d z): adds d γ = Σ_rows
/// g·x̂ and d β = Σ_rows g into `dgamma` and `dbeta`; then, after a
/// training pass (`by_batch`), d z = γ/σ̂ · (g − (d β + x̂·d γ)/rows), each
/// column's batch statistics depending on every row; after one by the
/// running statistics, d z = γ/σ̂ · g. A half of a batch (`meet`) takes
/// its d γ and d β of its own rows (the step sums the halves' gradients) and
/// its d z from the whole batch's sums.
pub(crate) async fn backward_met(
    simd: Simd,
    (g, width): (&mut [f32], usize),
    gamma: &[f32],
    (xhat, inv): (&[f32], &[f32]),
    (dgamma, dbeta): (&mut [f32], &mut [f32]),
    (by_batch, meet): (bool, Option<Side<'_>>),
) -> Result<(), ModelError> {
    let (mut sums, mut rows) = sums(simd, (g, width), xhat, (dgamma, dbeta));
    if let (Some(side), true) = (meet, by_batch) {
        rows = side.exchange(Combine::Sum, &mut sums, rows).await?;
    }
    by_sums(simd, (g, width), gamma, (xhat, inv), (sums, rows), by_batch);
    Ok(())
}

/// `[Σ g | Σ g·x̂]` of each column, added to d β and d γ; and `g`'s rows.
fn sums(
    simd: Simd,
    (g, width): (&[f32], usize),
    xhat: &[f32],
    (dgamma, dbeta): (&mut [f32], &mut [f32]),
) -> (Vec<f32>, usize) {
    let mut sums = vec![0.0f32; 2 * width];
    let (sum_g, sum_gx) = sums.split_at_mut(width);
    column_sums(simd, g, width, Terms::WithProducts(xhat), sum_g, sum_gx);
    dgamma.iter_mut().zip(&*sum_gx).for_each(|(d, s)| *d += s);
    dbeta.iter_mut().zip(&*sum_g).for_each(|(d, s)| *d += s);
    (sums, g.len() / width.max(1))
}

/// d z from `g`, given the columns' `[Σ g | Σ g·x̂]` over `rows` rows.
fn by_sums(
    simd: Simd,
    (g, width): (&mut [f32], usize),
    gamma: &[f32],
    (xhat, inv): (&[f32], &[f32]),
    (mut sums, rows): (Vec<f32>, usize),
    by_batch: bool,
) {
    let (sum_g, sum_gx) = sums.split_at_mut(width);
    let n = rows.max(1) as f32;
    if !by_batch {
        sum_g.fill(0.0);
        sum_gx.fill(0.0);
    }
    let scale: Vec<f32> = gamma.iter().zip(inv).map(|(g, i)| g * i).collect();
    let block = width.max(1) * ROWS_PER_TASK;
    let wide = avx512f(simd);
    g.par_chunks_mut(block).zip(xhat.par_chunks(block)).for_each(|(g, xhat)| {
        let columns = (&scale[..], &sum_g[..], &sum_gx[..]);
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn rows_avx512(g: &mut [f32], xhat: &[f32], width: usize, c: (&[f32], &[f32], &[f32]), n: f32) {
                backward_rows(g, xhat, width, c, n);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { rows_avx512(g, xhat, width, columns, n) };
        }
        backward_rows(g, xhat, width, columns, n);
    });
}

/// [`backward_met`]'s d z on a block of rows, from each column's γ/σ̂, Σ g and Σ g·x̂.
#[inline(always)]
fn backward_rows(g: &mut [f32], xhat: &[f32], width: usize, (scale, sum_g, sum_gx): (&[f32], &[f32], &[f32]), n: f32) {
    for (g, x) in g.chunks_exact_mut(width).zip(xhat.chunks_exact(width)) {
        let columns = scale.iter().zip(sum_g).zip(sum_gx);
        for ((g, &x), ((scale, sum_g), sum_gx)) in g.iter_mut().zip(x).zip(columns) {
            *g = scale * (*g - (sum_g + x * sum_gx) / n);
        }
    }
}
