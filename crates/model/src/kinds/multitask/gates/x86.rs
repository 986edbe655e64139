//! The gates' adjoint in the AVX-512F build, with the portable code's bits
//! (`block_adjoint`). Each row's dots were taken one at a time, each
//! waiting on its own chain of eight-lane adds; here four run side by
//! side, each still multiplied then added in eight lanes and its lanes
//! summed in `dot`'s order. Each expert's row was written by the first gate
//! that pools it, added to by the others and masked by its ReLU in passes
//! over memory; here it is summed over its gates in registers, in the same
//! order, masked, and stored once.

use std::arch::x86_64::*;

use super::{Block, softmax_adjoint};
use crate::matrix::dot;

/// Floats in an AVX-512 vector.
pub(super) const LANES: usize = 16;

/// [`super::block_adjoint`]'s rows.
///
/// # Safety
/// AVX-512F; `block.width` is a multiple of [`LANES`].
#[target_feature(enable = "avx512f")]
#[expect(unsafe_code, reason = "AVX-512 kernels on slices of whole vectors")]
pub(super) unsafe fn block_adjoint(block: &Block<'_>, dls: &mut [&mut [f32]], des: &mut [&mut [f32]], rows: usize) {
    let Block { first, gates, outs, masks, width, .. } = *block;
    // Every (gate, pooled expert), gate by gate: a row's dots in this order.
    let pairs: Vec<(usize, usize)> =
        gates.iter().enumerate().flat_map(|(g, (_, _, pool))| pool.iter().map(move |&e| (g, e))).collect();
    // Each expert's (gate, place in the gate's pool), in the gates' order.
    let mut sources: Vec<Vec<(usize, usize)>> = vec![Vec::new(); des.len()];
    for (g, (_, _, pool)) in gates.iter().enumerate() {
        for (j, &e) in pool.iter().enumerate() {
            sources[e].push((g, j));
        }
    }
    let mut row_dots = vec![0.0f32; pairs.len()];
    for r in 0..rows {
        let row = first + r;
        let span = row * width..(row + 1) * width;
        let mut quads = pairs.chunks_exact(4);
        for (d, quad) in row_dots.chunks_exact_mut(4).zip(quads.by_ref()) {
            let a = std::array::from_fn(|i| gates[quad[i].0].1[span.clone()].as_ptr());
            let b = std::array::from_fn(|i| outs[quad[i].1][span.clone()].as_ptr());
            // SAFETY: each pointer starts `width` floats of a slice.
            d.copy_from_slice(&unsafe { dots4(a, b, width) });
        }
        let done = pairs.len() - quads.remainder().len();
        for (d, &(g, e)) in row_dots[done..].iter_mut().zip(quads.remainder()) {
            *d = dot(&gates[g].1[span.clone()], &outs[e][span.clone()]);
        }
        let mut taken = 0;
        for ((w, _, pool), dl) in gates.iter().zip(dls.iter_mut()) {
            let k = pool.len();
            let dl = &mut dl[r * k..(r + 1) * k];
            dl.copy_from_slice(&row_dots[taken..taken + k]);
            taken += k;
            softmax_adjoint(dl, &w[row * k..(row + 1) * k]);
        }
        for ((de, from), (out, mask)) in des.iter_mut().zip(&sources).zip(outs.iter().zip(masks)) {
            if from.is_empty() || de.is_empty() {
                continue;
            }
            let de = &mut de[r * width..(r + 1) * width];
            let terms = from.iter().map(|&(g, j)| {
                let (w, d_mix, pool) = gates[g];
                (w[row * pool.len() + j], &d_mix[span.clone()])
            });
            // SAFETY: every slice is `width` floats, a multiple of LANES.
            unsafe { expert_row(de, terms, &out[span.clone()], *mask) };
        }
    }
}

/// Four [`dot`]s of `width` floats from `a[i]` and `b[i]`, each with its bits.
///
/// # Safety
/// AVX-512F; each pointer starts `width` readable floats.
#[inline]
#[target_feature(enable = "avx512f")]
#[expect(unsafe_code, reason = "AVX loads through raw pointers")]
unsafe fn dots4(a: [*const f32; 4], b: [*const f32; 4], width: usize) -> [f32; 4] {
    let full = width / 8 * 8;
    let mut lanes = [_mm256_setzero_ps(); 4];
    let mut c = 0;
    while c < full {
        for n in 0..4 {
            // SAFETY: `c + 8 <= width`.
            let (x, y) = unsafe { (_mm256_loadu_ps(a[n].add(c)), _mm256_loadu_ps(b[n].add(c))) };
            lanes[n] = _mm256_add_ps(lanes[n], _mm256_mul_ps(x, y));
        }
        c += 8;
    }
    std::array::from_fn(|n| {
        let mut l = [0.0f32; 8];
        // SAFETY: `l` holds eight floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), lanes[n]) };
        // SAFETY: the last `width - full` of the `width` floats.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(a[n].add(full), width - full),
                std::slice::from_raw_parts(b[n].add(full), width - full),
            )
        };
        let tail: f32 = x.iter().zip(y).map(|(a, b)| a * b).sum();
        l.iter().sum::<f32>() + tail
    })
}

/// An expert's row of its output gradient: `Σ w · d_mix` over the gates
/// that pool it (the first product, then each added, in their order),
/// through its last ReLU where it has a mask (`scale` where the output is
/// above 0, else 0), stored once.
///
/// # Safety
/// AVX-512F; `de`, `out` and every `d_mix` hold
/// the same number of floats, a multiple of [`LANES`].
#[inline]
#[target_feature(enable = "avx512f")]
#[expect(unsafe_code, reason = "AVX-512 loads and stores within slices")]
unsafe fn expert_row<'a>(
    de: &mut [f32],
    terms: impl Iterator<Item = (f32, &'a [f32])> + Clone,
    out: &[f32],
    mask: Option<f32>,
) {
    // Up to four vectors of columns at a time, each term's weight read once.
    for start in (0..de.len()).step_by(4 * LANES) {
        let nv = ((de.len() - start) / LANES).min(4);
        let mut sum = [_mm512_setzero_ps(); 4];
        for (t, (w, d_mix)) in terms.clone().enumerate() {
            let w = _mm512_set1_ps(w);
            for (v, sum) in sum.iter_mut().enumerate().take(nv) {
                // SAFETY: `start + (v + 1)·LANES <= d_mix.len()`.
                let term = _mm512_mul_ps(w, unsafe { _mm512_loadu_ps(d_mix.as_ptr().add(start + v * LANES)) });
                *sum = if t == 0 { term } else { _mm512_add_ps(*sum, term) };
            }
        }
        for (v, &sum) in sum.iter().enumerate().take(nv) {
            let at = start + v * LANES;
            let mut sum = sum;
            if let Some(scale) = mask {
                // SAFETY: `at + LANES <= out.len()`.
                let o = unsafe { _mm512_loadu_ps(out.as_ptr().add(at)) };
                let above = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(o, _mm512_setzero_ps());
                if scale != 1.0 {
                    sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
                }
                sum = _mm512_maskz_mov_ps(above, sum);
            }
            // SAFETY: `at + LANES <= de.len()`.
            unsafe { _mm512_storeu_ps(de.as_mut_ptr().add(at), sum) };
        }
    }
}
