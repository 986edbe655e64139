//! bf16 products with one output column (`n = 1`: a layer of one output,
//! and its weight gradient) or one value along k (`k = 1`: the gradient
//! at such a layer's input, an outer product), on `vdpbf16ps` with a lane
//! per output. The tile kernel ran them at a tile's cost, 16 or 32
//! columns computed for one after both operands were packed. Each output
//! is the same chain over its pairs, in order, as in the tile kernel and
//! [`gemm_bf16_portable`](crate::bf16::gemm_bf16_portable), so the bits
//! are theirs (`bf16`'s tests).

use crate::matrix::Operand;

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` where `n` or `k` is 1 and the
/// CPU has AVX-512-BF16 (false, nothing written, otherwise); on this
/// thread alone where `threads` is 1.
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    a: &Operand<'_>,
    b: &Operand<'_>,
    dst: &mut [f32],
    threads: Option<usize>,
) -> bool {
    if m == 0 || n == 0 || k == 0 || (n != 1 && k != 1) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::pairs::available() {
        assert!(a.data.len() >= m * k && b.data.len() >= k * n && dst.len() >= m * n);
        let min_len = if threads == Some(1) { usize::MAX } else { 1 };
        // A column of `b` (n = 1) or a row of it (k = 1) is its values in
        // order, stored plain or transposed; as are a row or column of `a`
        // where k = 1.
        if n == 1 {
            x86::column((m, k), a, b.data, &mut dst[..m], min_len);
        } else {
            x86::outer((m, n), a.data, b.data, &mut dst[..m * n], min_len);
        }
        return true;
    }
    let _ = (a, b, dst, threads);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use crate::matrix::Operand;
    use crate::pairs::{lanes, pairs_across, pairs_of, transpose};

    /// Outputs a task computes (16 to a lane group).
    const PER_TASK: usize = 256;

    /// A vector's 16 dwords.
    fn dwords(v: __m512i) -> [u32; 16] {
        // SAFETY: both are 64 bytes of plain data.
        #[expect(unsafe_code, reason = "a vector's lanes")]
        unsafe {
            std::mem::transmute(v)
        }
    }

    /// `dst[i] = Σ_p a_i,p · w_p`: tasks of [`PER_TASK`] outputs.
    pub fn column((m, k): (usize, usize), a: &Operand<'_>, w: &[f32], dst: &mut [f32], min_len: usize) {
        // SAFETY: `gemm` checked AVX-512F and AVX-512-BF16.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        let w_pairs: Vec<[u32; 16]> = w[..k].chunks(32).map(|c| dwords(unsafe { pairs_of(c) })).collect();
        dst.par_chunks_mut(PER_TASK).with_min_len(min_len).enumerate().for_each(|(task, out)| {
            for (g, out) in out.chunks_mut(16).enumerate() {
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    column_lanes((m, k), a, &w_pairs, task * PER_TASK + 16 * g, out)
                };
            }
        });
    }

    /// Outputs `i0..i0 + out.len()` (≤ 16) of [`column`], a lane each: a
    /// plain `a`'s rows read 32 values at a time and transposed to pairs,
    /// a transposed one's pairs read across two stored rows.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn column_lanes((m, k): (usize, usize), a: &Operand<'_>, w_pairs: &[[u32; 16]], i0: usize, out: &mut [f32]) {
        let (rows, pairs) = (out.len(), k.div_ceil(2));
        let mut acc = _mm512_setzero_ps();
        for (c, w_lane) in w_pairs.iter().enumerate() {
            let mut v = [_mm512_setzero_si512(); 16];
            if a.transposed {
                for (p, v) in v.iter_mut().enumerate() {
                    let kk = 2 * (16 * c + p);
                    if kk < k {
                        let odd = (kk + 1 < k).then(|| &a.data[(kk + 1) * m + i0..]);
                        *v = pairs_across(&a.data[kk * m + i0..], odd, rows);
                    }
                }
            } else {
                let (k0, k1) = (32 * c, (32 * c + 32).min(k));
                for (r, v) in v.iter_mut().enumerate().take(rows) {
                    *v = pairs_of(&a.data[(i0 + r) * k + k0..(i0 + r) * k + k1]);
                }
                transpose(&mut v);
            }
            // The chain's pairs exactly: a padded one would make a −0 sum +0.
            for (v, &w) in v.iter().zip(w_lane).take(pairs - 16 * c) {
                let w = _mm512_set1_epi32(w as i32);
                // SAFETY: both are 64 bytes: 32 bf16 as 16 pairs.
                #[expect(unsafe_code, reason = "reinterpreting pairs as bf16 vectors")]
                let (x, y) = unsafe {
                    (std::mem::transmute::<__m512i, __m512bh>(*v), std::mem::transmute::<__m512i, __m512bh>(w))
                };
                acc = _mm512_dpbf16_ps(acc, x, y);
            }
        }
        // SAFETY: the masked store writes `rows` ≤ 16 floats of `out`.
        #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
        unsafe {
            _mm512_mask_storeu_ps(out.as_mut_ptr(), lanes(rows), acc)
        };
    }

    /// `dst[i][j] = a_i · b_j`, each the chain of one pair `(·, 0)`.
    pub fn outer((m, n): (usize, usize), a: &[f32], b: &[f32], dst: &mut [f32], min_len: usize) {
        // SAFETY: `gemm` checked AVX-512F and AVX-512-BF16.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        let lone = |c: &[f32]| dwords(unsafe { pairs_across(c, None, c.len()) });
        let b_pairs: Vec<[u32; 16]> = b[..n].chunks(16).map(lone).collect();
        let a_pairs: Vec<u32> = a[..m].chunks(16).flat_map(|c| lone(c).into_iter().take(c.len())).collect();
        dst.par_chunks_mut(n * 16).with_min_len(min_len).enumerate().for_each(|(g, rows)| {
            for (row, &ai) in rows.chunks_mut(n).zip(&a_pairs[16 * g..]) {
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    outer_row(ai, &b_pairs, row)
                };
            }
        });
    }

    /// One row of [`outer`]: `a_i`'s pair against each column's.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn outer_row(ai: u32, b_pairs: &[[u32; 16]], row: &mut [f32]) {
        let ai = _mm512_set1_epi32(ai as i32);
        for (bj, out) in b_pairs.iter().zip(row.chunks_mut(16)) {
            // SAFETY: 16 dwords are one 64-byte vector; both are 32 bf16 as
            // 16 pairs; the masked store writes `out.len()` ≤ 16 floats.
            #[expect(unsafe_code, reason = "SIMD loads, arithmetic and stores behind run-time feature detection")]
            unsafe {
                let bj = _mm512_loadu_si512(bj.as_ptr().cast());
                let x = std::mem::transmute::<__m512i, __m512bh>(ai);
                let y = std::mem::transmute::<__m512i, __m512bh>(bj);
                _mm512_mask_storeu_ps(out.as_mut_ptr(), lanes(out.len()), _mm512_dpbf16_ps(_mm512_setzero_ps(), x, y));
            }
        }
    }
}
