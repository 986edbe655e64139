//! The MLP's bias-and-ReLU pass forward and its ReLU mask backward, in
//! blocks of rows across the pool.

use rayon::prelude::*;

use super::ROWS_PER_TASK;

/// `out += b` a row, then ReLU where `relu`.
pub(super) fn add_bias(out: &mut [f32], b: &[f32], relu: bool) {
    if b.is_empty() {
        return;
    }
    out.par_chunks_mut(b.len() * ROWS_PER_TASK).for_each(|rows| {
        for row in rows.chunks_exact_mut(b.len()) {
            if relu {
                row.iter_mut().zip(b).for_each(|(o, b)| *o = (*o + b).max(0.0));
            } else {
                row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
    });
}

/// `g` through a ReLU whose output was `a`: zero where `a` is not
/// positive. After dropout (`scale` ≠ 1) a dropped value is 0 too, and a
/// kept one was multiplied by `scale`, as its gradient is here.
pub(super) fn relu_mask(g: &mut [f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(a.par_chunks(block)).for_each(|(g, a)| {
        if scale == 1.0 {
            g.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g } else { 0.0 });
        } else {
            g.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g * scale } else { 0.0 });
        }
    });
}

/// [`relu_mask`] of `from`, written to `g`.
pub(super) fn relu_mask_from(g: &mut [f32], from: &[f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(from.par_chunks(block)).zip(a.par_chunks(block)).for_each(|((g, from), a)| {
        let pairs = g.iter_mut().zip(from).zip(a);
        if scale == 1.0 {
            pairs.for_each(|((g, &f), &a)| *g = if a > 0.0 { f } else { 0.0 });
        } else {
            pairs.for_each(|((g, &f), &a)| *g = if a > 0.0 { f * scale } else { 0.0 });
        }
    });
}
