//! `model.norm = "layer"`: each activated layer of an MLP stack normalizes
//! its pre-activation over the layer's outputs, row by row, as PyTorch's
//! `LayerNorm` does: y = (z − μ) / √(σ² + ε) · γ + β (σ² the biased
//! variance, ε = 1e-5), then the ReLU. γ starts at 1 and β at 0; both are
//! learned. A row is normalized on its own, so a cluster's workers, a
//! resumed run, evaluation and serving all compute the same thing, and
//! ONNX lowers it to one `LayerNormalization`.

use rayon::prelude::*;

/// PyTorch's default.
pub const EPS: f32 = 1e-5;

/// Rows a task normalizes: both threads take part on a batch.
const ROWS_PER_TASK: usize = 128;

/// Normalizes each row of `out` (`width` a row) in place, keeping x̂ in
/// `xhat` and 1/√(σ² + ε) per row in `inv` for the backward pass.
pub(crate) fn forward(
    out: &mut [f32],
    width: usize,
    (gamma, beta): (&[f32], &[f32]),
    xhat: &mut Vec<f32>,
    inv: &mut Vec<f32>,
) {
    let rows = out.len() / width.max(1);
    xhat.resize(out.len(), 0.0);
    inv.resize(rows, 0.0);
    let block = width.max(1) * ROWS_PER_TASK;
    out.par_chunks_mut(block).zip(xhat.par_chunks_mut(block)).zip(inv.par_chunks_mut(ROWS_PER_TASK)).for_each(
        |((out, xhat), inv)| {
            for ((z, x), inv) in out.chunks_exact_mut(width).zip(xhat.chunks_exact_mut(width)).zip(inv) {
                let n = width as f32;
                let mean = z.iter().sum::<f32>() / n;
                let var = z.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
                *inv = 1.0 / (var + EPS).sqrt();
                for (((z, x), g), b) in z.iter_mut().zip(x.iter_mut()).zip(gamma).zip(beta) {
                    *x = (*z - mean) * *inv;
                    *z = *x * g + b;
                }
            }
        },
    );
}

/// From `g` = d loss / d y (replaced by d loss / d z): adds d γ and d β
/// into `dgamma` and `dbeta` (rows in order: the same sums on any thread
/// split). d z = (1/σ̂)·(d x̂ − mean(d x̂) − x̂·mean(d x̂ ⊙ x̂)), d x̂ = d y ⊙ γ.
pub(crate) fn backward(
    g: &mut [f32],
    width: usize,
    gamma: &[f32],
    (xhat, inv): (&[f32], &[f32]),
    (dgamma, dbeta): (&mut [f32], &mut [f32]),
) {
    for (gr, x) in g.chunks_exact(width).zip(xhat.chunks_exact(width)) {
        for (((dg, db), &gv), &xv) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(gr).zip(x) {
            *dg += gv * xv;
            *db += gv;
        }
    }
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(xhat.par_chunks(block)).zip(inv.par_chunks(ROWS_PER_TASK)).for_each(
        |((g, xhat), inv)| {
            for ((g, x), &inv) in g.chunks_exact_mut(width).zip(xhat.chunks_exact(width)).zip(inv) {
                let n = width as f32;
                let (mut sum, mut dot) = (0.0f32, 0.0f32);
                for ((gv, xv), gm) in g.iter().zip(x).zip(gamma) {
                    let d = gv * gm;
                    sum += d;
                    dot += d * xv;
                }
                let (mean, mean_dot) = (sum / n, dot / n);
                for ((gv, xv), gm) in g.iter_mut().zip(x).zip(gamma) {
                    *gv = inv * (*gv * gm - mean - xv * mean_dot);
                }
            }
        },
    );
}
