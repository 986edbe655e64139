//! Dice's passes over a layer's rows, a block of rows a task, each pass
//! fused: forward, p = σ(x̂) and y = z·(α + (1 − α)·p) in one pass (they
//! were a parallel map a value, then a pass over the rows); backward, each
//! block's share of d α, h = g·z·(1 − α)·p·(1 − p) and g·(α + (1 − α)·p)
//! in one pass (d α was summed over every row on one thread first), and
//! after the normalization's adjoint g + h a block at a time. The sigmoid
//! takes `exp::exp_f32`, plain arithmetic the AVX-512 build (taken where
//! `train.simd` allows and the CPU has AVX-512F) turns into vectors; the
//! graph's Dice takes the same exponential (`exp::Exp`), so both give one
//! function. Every value is computed by the same operations on every
//! build: the same bits.

use rayon::prelude::*;
use sparrow_core::simd::Simd;

use crate::columns::avx512f;
use crate::exp::exp_f32;

/// Rows a task of a pass takes.
const ROWS_PER_TASK: usize = 128;

/// σ(x) = 1 / (1 + e^(−x)).
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// `p` (x̂ in, σ(x̂) out) and `out` (z in, y out), `rows × width` both.
pub(super) fn gate(simd: Simd, out: &mut [f32], p: &mut [f32], width: usize, alpha: &[f32]) {
    let wide = avx512f(simd);
    let block = width.max(1) * ROWS_PER_TASK;
    out.par_chunks_mut(block).zip(p.par_chunks_mut(block)).for_each(|(y, p)| {
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn gate_avx512(y: &mut [f32], p: &mut [f32], width: usize, alpha: &[f32]) {
                gate_rows(y, p, width, alpha);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { gate_avx512(y, p, width, alpha) };
        }
        gate_rows(y, p, width, alpha);
    });
}

/// A block's σ first, sixteen values at a time whatever the width (a
/// row's 36 values a loop did not become vectors), then its gates, while
/// the block is in L1.
#[inline(always)]
fn gate_rows(y: &mut [f32], p: &mut [f32], width: usize, alpha: &[f32]) {
    let (lanes, tail) = p.as_chunks_mut::<16>();
    for lane in lanes {
        lane.iter_mut().for_each(|v| *v = sigmoid(*v));
    }
    tail.iter_mut().for_each(|v| *v = sigmoid(*v));
    for (y, p) in y.chunks_exact_mut(width).zip(p.chunks_exact(width)) {
        // Zipped, not indexed: bounds checks kept such loops scalar.
        for ((y, p), &a) in y.iter_mut().zip(p).zip(alpha) {
            *y *= a + (1.0 - a) * p;
        }
    }
}

/// From `g` = d loss / d y: `h` = the part of d loss / d z through ẑ's
/// normalization, still to be taken through its adjoint, `g` becomes the
/// part through the gate, and each column's g·z·(1 − p) summed over the
/// rows is added to `dalpha` (a block's rows in order, then the blocks').
pub(super) fn through_gate(
    simd: Simd,
    (g, h): (&mut [f32], &mut [f32]),
    (z, p): (&[f32], &[f32]),
    width: usize,
    (alpha, dalpha): (&[f32], &mut [f32]),
) {
    let wide = avx512f(simd);
    let block = width.max(1) * ROWS_PER_TASK;
    let parts: Vec<Vec<f32>> = (g.par_chunks_mut(block).zip(h.par_chunks_mut(block)))
        .zip(z.par_chunks(block).zip(p.par_chunks(block)))
        .map(|((g, h), (z, p))| {
            let mut part = vec![0.0f32; width];
            #[cfg(target_arch = "x86_64")]
            if wide {
                #[target_feature(enable = "avx512f")]
                fn rows_avx512(
                    gh: (&mut [f32], &mut [f32]),
                    zp: (&[f32], &[f32]),
                    width: usize,
                    ad: (&[f32], &mut [f32]),
                ) {
                    through_rows(gh, zp, width, ad);
                }
                // SAFETY: `wide` is true only where AVX-512F was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    rows_avx512((g, h), (z, p), width, (alpha, &mut part))
                };
                return part;
            }
            through_rows((g, h), (z, p), width, (alpha, &mut part));
            part
        })
        .collect();
    for part in parts {
        dalpha.iter_mut().zip(part).for_each(|(d, s)| *d += s);
    }
}

#[inline(always)]
fn through_rows(
    (g, h): (&mut [f32], &mut [f32]),
    (z, p): (&[f32], &[f32]),
    width: usize,
    (alpha, dalpha): (&[f32], &mut [f32]),
) {
    let rows = g.chunks_exact_mut(width).zip(h.chunks_exact_mut(width));
    for ((g, h), (z, p)) in rows.zip(z.chunks_exact(width).zip(p.chunks_exact(width))) {
        let columns = g.iter_mut().zip(h.iter_mut()).zip(z.iter().zip(p)).zip(alpha.iter().zip(dalpha.iter_mut()));
        for (((g, h), (&z, &p)), (&a, d)) in columns {
            *d += *g * z * (1.0 - p);
            *h = *g * z * (1.0 - a) * p * (1.0 - p);
            *g *= a + (1.0 - a) * p;
        }
    }
}

/// `g += h`, a block of rows a task.
pub(super) fn add(g: &mut [f32], h: &[f32], width: usize) {
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(h.par_chunks(block)).for_each(|(g, h)| {
        g.iter_mut().zip(h).for_each(|(g, h)| *g += h);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::rng::Rng;

    fn values(n: usize, rng: &mut Rng) -> Vec<f32> {
        (0..n).map(|_| rng.uniform(-3.0, 3.0) as f32).collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Both passes, on the AVX-512 build (where the CPU has it) and the
    /// portable one, give the bits of the formulas a value at a time (d α:
    /// a block's rows in order, then the blocks'), over a width of no whole
    /// vector and rows of a part block; σ is 0.5 at 0 and near 0 and 1 far out.
    #[test]
    fn the_passes_give_the_formulas_bits_on_every_build() {
        let mut rng = Rng::new(4);
        let (rows, width) = (2 * ROWS_PER_TASK + 37, 36);
        let n = rows * width;
        let alpha = values(width, &mut rng);
        let (z, mut xhat, g) = (values(n, &mut rng), values(n, &mut rng), values(n, &mut rng));
        xhat[..3].copy_from_slice(&[0.0, 90.0, -90.0]);
        let p_want: Vec<f32> = xhat.iter().map(|&x| 1.0 / (1.0 + exp_f32(-x))).collect();
        let y_want: Vec<f32> = z
            .iter()
            .zip(&p_want)
            .enumerate()
            .map(|(i, (&z, &p))| z * (alpha[i % width] + (1.0 - alpha[i % width]) * p))
            .collect();
        assert_eq!((p_want[0], p_want[1], p_want[2]), (0.5, 1.0, 0.0));
        let mut d_want = vec![0.0f32; width];
        for block in 0..rows.div_ceil(ROWS_PER_TASK) {
            let mut part = vec![0.0f32; width];
            for r in block * ROWS_PER_TASK..rows.min((block + 1) * ROWS_PER_TASK) {
                for (c, part) in part.iter_mut().enumerate() {
                    let i = r * width + c;
                    *part += g[i] * z[i] * (1.0 - p_want[i]);
                }
            }
            d_want.iter_mut().zip(part).for_each(|(d, s)| *d += s);
        }
        let at = |i: usize| (alpha[i % width], p_want[i]);
        let h_want: Vec<f32> = (0..n).map(|i| g[i] * z[i] * (1.0 - at(i).0) * at(i).1 * (1.0 - at(i).1)).collect();
        let g_want: Vec<f32> = (0..n).map(|i| g[i] * (at(i).0 + (1.0 - at(i).0) * at(i).1) + h_want[i]).collect();
        for simd in [Simd::Auto, Simd::Portable] {
            let (mut y, mut p) = (z.clone(), xhat.clone());
            gate(simd, &mut y, &mut p, width, &alpha);
            assert_eq!(bits(&p), bits(&p_want), "{simd:?}: p");
            assert_eq!(bits(&y), bits(&y_want), "{simd:?}: y");
            let (mut g_got, mut h, mut d) = (g.clone(), vec![0.0f32; n], vec![0.0f32; width]);
            through_gate(simd, (&mut g_got, &mut h), (&z, &p), width, (&alpha, &mut d));
            assert_eq!(bits(&h), bits(&h_want), "{simd:?}: h");
            assert_eq!(bits(&d), bits(&d_want), "{simd:?}: d α");
            add(&mut g_got, &h, width);
            assert_eq!(bits(&g_got), bits(&g_want), "{simd:?}: g");
        }
    }
}
