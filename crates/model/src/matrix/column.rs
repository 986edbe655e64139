//! The fp32 product with one output column (`n` = 1). With a row-major
//! left-hand side of more than 256 rows it is every output layer's forward
//! product at a large batch, and DIN's attention unit's, which scores each
//! of a batch's few thousand history items.
//!
//! `gemm` computes such a product as one dot product a row (its
//! `mixed_gemv_rowmajor`): the row's products in 16 lanes (eight 16-lane
//! accumulators over each 128 values, added as a tree, then one over each
//! 16 left), the lanes then added one after the other, and the last
//! `k mod 16` values fused into that sum one at a time. The 15 adds are a
//! chain a row: on an AVX-512 Xeon DIN's `[3270, 36]·[36, 1]` took 30 µs
//! there, 9 ns a row.
//!
//! Here each row's lane vector is computed by the same operations, then 16
//! rows' vectors are transposed in registers and their lanes added as
//! vectors, lane 0 first: each row's sum is the same adds in the same
//! order, so the product has `gemm`'s bits (tested against it). `gemm`
//! takes other paths, with other bits, at 256 rows or fewer (its
//! horizontal kernel) and at a `k` below 3; those, and every product on a
//! CPU without AVX-512F, stay with it.
//!
//! A transposed left-hand side with one output column is a layer's weight
//! gradient `xᵀ·g` for its one output (DIN's unit's last layer: `[36]`
//! over 3.3k items). `gemm` (`mixed_gemv_colmajor`) sums it as
//! `dst = x₀·g₀`, then `dst += x_p·g_p` fused, for each `p` in order, with
//! `dst` stored and loaded back at every step (16.6 µs for DIN's). Here
//! `dst` stays in registers, 64 outputs at a time, through the same
//! operations.

use rayon::prelude::*;

use sparrow_core::simd::Simd;

use super::GEMM_HORIZONTAL_MAX;

/// Rows a parallel task takes are a multiple of the transposed block.
const ROW_BLOCK: usize = 16;
/// The deepest: a block's 16 rows are gathered at offsets `r·k` in 32 bits.
const MAX_K: usize = 1 << 24;

/// Outputs of a transposed left-hand side's product held in registers at
/// once (four 16-lane accumulators).
const STRIP: usize = 64;

/// Whether a product of this shape is this module's to compute: with a
/// transposed `a`, one row is `gemm`'s horizontal kernel's.
pub(super) fn fits(m: usize, n: usize, k: usize, a_transposed: bool) -> bool {
    let rows = if a_transposed { m >= 2 } else { m > GEMM_HORIZONTAL_MAX };
    n == 1 && rows && (3..=MAX_K).contains(&k)
}

/// `dst (m×1) = a·b` (`a` `m×k` row-major, `b` `k` values) where [`fits`]
/// and the CPU has AVX-512F, on up to `threads` threads above the size
/// `gemm` would split a product at; false (nothing written) elsewhere.
pub(super) fn product(
    simd: Simd,
    (m, n, k): (usize, usize, usize),
    (a, a_transposed): (&[f32], bool),
    b: &[f32],
    dst: &mut [f32],
    threads: usize,
) -> bool {
    // AVX-512F's alone: under `avx2` the product goes on as on a CPU without it.
    if !fits(m, n, k, a_transposed) || !super::narrow::avx512f() || simd.products_at_most_avx2() {
        return false;
    }
    if a_transposed {
        let strip = |(s, d): (usize, &mut [f32])| strip_for_cpu((m, k), a, s * STRIP, b, d);
        if threads > 1 && m * k >= 1 << 20 {
            dst.par_chunks_mut(STRIP).enumerate().for_each(strip);
        } else {
            dst.chunks_mut(STRIP).enumerate().for_each(strip);
        }
        return true;
    }
    if threads > 1 && m * k >= 1 << 20 {
        let rows = m.div_ceil(threads).next_multiple_of(ROW_BLOCK);
        dst.par_chunks_mut(rows).enumerate().for_each(|(t, d)| rows_for_cpu(k, &a[t * rows * k..], b, d));
    } else {
        rows_for_cpu(k, a, b, dst);
    }
    true
}

/// `out[r] = a[r]·b` for as many rows as `out` holds.
fn rows_for_cpu(k: usize, a: &[f32], b: &[f32], out: &mut [f32]) {
    assert!(k > 0, "one-column product: k {k}");
    assert_eq!(b.len(), k, "one-column product: rhs size");
    assert!(a.len() >= out.len() * k, "one-column product: lhs size");
    if out.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        assert!(super::narrow::avx512f(), "one-column product without AVX-512F");
        // SAFETY: AVX-512F was detected just above. The kernel reads `a` at
        // `r·k + p` for `r < out.len()`, `p < k` (asserted inside `a`), `b`
        // at `p < k` (`b` is `k` long) and writes `out` at `r < out.len()`.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            x86::rows(out.len(), k, a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("one-column product without AVX-512F");
}

/// Outputs `first..` (as many as `out` holds, at most [`STRIP`]) of
/// `aᵀ·b`, `a` stored `k×m`.
fn strip_for_cpu((m, k): (usize, usize), a: &[f32], first: usize, b: &[f32], out: &mut [f32]) {
    assert!(k > 0 && out.len() <= STRIP && first + out.len() <= m, "one-column product: strip");
    assert_eq!(b.len(), k, "one-column product: rhs size");
    assert_eq!(a.len(), m * k, "one-column product: lhs size");
    if out.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        assert!(super::narrow::avx512f(), "one-column product without AVX-512F");
        // SAFETY: AVX-512F was detected just above. The kernel reads `a` at
        // `p·m + first + i` for `p < k`, `i < out.len()` (so below `m·k`,
        // asserted), `b` at `p < k` and writes `out` at `i < out.len()`;
        // `NV` is `out.len()`'s count of 16-lane vectors, as it requires.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let a = a.as_ptr().add(first);
            match out.len().div_ceil(16) {
                1 => x86::strip::<1>((m, k), a, b.as_ptr(), out),
                2 => x86::strip::<2>((m, k), a, b.as_ptr(), out),
                3 => x86::strip::<3>((m, k), a, b.as_ptr(), out),
                _ => x86::strip::<4>((m, k), a, b.as_ptr(), out),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("one-column product without AVX-512F");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Lanes of an accumulator.
    const LANES: usize = 16;
    /// `gemm`'s accumulators over each 128 values.
    const UNROLL: usize = 8;

    /// Row `r`'s lane vector, as `gemm` computes it before adding its lanes.
    ///
    /// # Safety
    /// AVX-512F; `a` and `b` readable at `p < k`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads through raw pointers")]
    #[inline]
    unsafe fn lanes(k: usize, a: *const f32, b: *const f32) -> __m512 {
        let (k_lane, k_lane8) = (k / LANES * LANES, k / (LANES * UNROLL) * (LANES * UNROLL));
        // SAFETY: every load is of 16 values at `depth + 16·i` below
        // `k_lane8` or `k_lane`, both at most `k`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); UNROLL];
            let mut depth = 0;
            while depth < k_lane8 {
                for (i, acc) in acc.iter_mut().enumerate() {
                    let at = depth + LANES * i;
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(at)), _mm512_loadu_ps(b.add(at)), *acc);
                }
                depth += LANES * UNROLL;
            }
            let (a01, a23) = (_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            let (a45, a67) = (_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7]));
            let mut sum = _mm512_add_ps(_mm512_add_ps(a01, a23), _mm512_add_ps(a45, a67));
            while depth < k_lane {
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(depth)), _mm512_loadu_ps(b.add(depth)), sum);
                depth += LANES;
            }
            sum
        }
    }

    /// `out[i] = Σ_p a[p·m + i]·b[p]` for `i < out.len()`: the first
    /// product alone, then each next one fused in, in order.
    ///
    /// # Safety
    /// AVX-512F; `NV = ⌈out.len()/16⌉`; `a` readable at `p·m + i` and `b`
    /// at `p` for `p < k`, `i < out.len()`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads through raw pointers")]
    pub(super) unsafe fn strip<const NV: usize>((m, k): (usize, usize), a: *const f32, b: *const f32, out: &mut [f32]) {
        let mut masks = [u16::MAX; NV];
        let tail = out.len() - (NV - 1) * LANES;
        masks[NV - 1] = if tail == LANES { u16::MAX } else { (1u16 << tail) - 1 };
        // SAFETY: every load is of a row `p < k` of `a` at `v·16` below
        // `out.len()` (the last vector masked to it), and of `b` at `p < k`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); NV];
            let g = _mm512_set1_ps(*b);
            for v in 0..NV {
                acc[v] = _mm512_mul_ps(_mm512_maskz_loadu_ps(masks[v], a.add(v * LANES)), g);
            }
            for p in 1..k {
                let g = _mm512_set1_ps(*b.add(p));
                for v in 0..NV {
                    let x = _mm512_maskz_loadu_ps(masks[v], a.add(p * m + v * LANES));
                    acc[v] = _mm512_fmadd_ps(x, g, acc[v]);
                }
            }
            for v in 0..NV {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(v * LANES), masks[v], acc[v]);
            }
        }
    }

    /// `v[c]` becomes column `c` of the 16×16 matrix whose rows were `v`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose(v: &mut [__m512; LANES]) {
        // Rows 2i and 2i+1 interleaved: lane j of `t[2i]` holds their
        // columns 4j, 4j+1, of `t[2i+1]` their columns 4j+2, 4j+3.
        let mut t = [_mm512_setzero_ps(); LANES];
        for i in 0..LANES / 2 {
            t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
        }
        // `u[4g + c]`: lane j holds rows 4g..4g+3 of column 4j + c.
        let mut u = [_mm512_setzero_ps(); LANES];
        for g in 0..LANES / 4 {
            let t = &t[4 * g..4 * g + 4];
            u[4 * g] = _mm512_shuffle_ps::<0x44>(t[0], t[2]);
            u[4 * g + 1] = _mm512_shuffle_ps::<0xEE>(t[0], t[2]);
            u[4 * g + 2] = _mm512_shuffle_ps::<0x44>(t[1], t[3]);
            u[4 * g + 3] = _mm512_shuffle_ps::<0xEE>(t[1], t[3]);
        }
        // Column 4j + c: lane j of `u[c]`, `u[4 + c]`, `u[8 + c]`, `u[12 + c]`.
        for c in 0..4 {
            let low = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
            let high = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
            let low2 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
            let high2 = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
            v[c] = _mm512_shuffle_f32x4::<0x88>(low, low2);
            v[4 + c] = _mm512_shuffle_f32x4::<0xDD>(low, low2);
            v[8 + c] = _mm512_shuffle_f32x4::<0x88>(high, high2);
            v[12 + c] = _mm512_shuffle_f32x4::<0xDD>(high, high2);
        }
    }

    /// `out[r] = a[r]·b` for each of `m` rows (`a` row-major, `k` a row).
    ///
    /// # Safety
    /// AVX-512F; `a` readable at `r·k + p` and `b` at `p` for `r < m`,
    /// `p < k`; `out` writable at `r < m`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn rows(m: usize, k: usize, a: *const f32, b: *const f32, out: *mut f32) {
        let k_lane = k / LANES * LANES;
        // A block's rows' offsets from its first, for the gathers below
        // (`k` ≤ 2²⁴ keeps 15·k in 32 bits).
        let offsets = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(k as i32),
        );
        let mut r0 = 0;
        while r0 < m {
            let block = (m - r0).min(LANES);
            let mut v = [_mm512_setzero_ps(); LANES];
            for (r, v) in v.iter_mut().enumerate().take(block) {
                // SAFETY: row `r0 + r` is below `m`.
                *v = unsafe { lanes(k, a.add((r0 + r) * k), b) };
            }
            transpose(&mut v);
            // Each row's lanes added in order, 16 rows at a time.
            let mut sum = v[0];
            for lane in &v[1..] {
                sum = _mm512_add_ps(sum, *lane);
            }
            // The values past the last 16 are fused in one at a time, each
            // a column of the block's rows gathered into one vector.
            let mask: __mmask16 = if block == LANES { u16::MAX } else { (1u16 << block) - 1 };
            for p in k_lane..k {
                // SAFETY: the gather reads `a` at `(r0 + r)·k + p` for the
                // block's rows `r` (the mask leaves the others), each below
                // `m` with `p < k`; `b` at `p < k`.
                unsafe {
                    let column =
                        _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, offsets, a.add(r0 * k + p).cast());
                    sum = _mm512_fmadd_ps(column, _mm512_set1_ps(*b.add(p)), sum);
                }
            }
            // SAFETY: the mask writes the block's rows, each below `m`.
            unsafe { _mm512_mask_storeu_ps(out.add(r0), mask, sum) };
            r0 += block;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::tests::{same_bits, values};
    use crate::matrix::{Operand, sgemm_threads};

    fn by_gemm(m: usize, k: usize, (a, a_t): (&[f32], bool), b: &[f32]) -> Vec<f32> {
        let mut dst = vec![f32::NAN; m];
        super::super::gemm_product((m, 1, k), (a, a_t), (b, false), &mut dst, 1);
        dst
    }

    #[test]
    fn a_one_column_product_has_the_bits_of_gemm() {
        let mut products = 0;
        let plain = [257, 258, 271, 272, 300, 1024, 3270].map(|m| (m, false));
        let transposed = [2, 3, 15, 16, 17, 36, 63, 64, 65, 100, 300].map(|m| (m, true));
        for (m, a_t) in plain.into_iter().chain(transposed) {
            for k in [3, 4, 15, 16, 17, 31, 32, 36, 64, 100, 127, 128, 129, 143, 144, 256, 300, 1000, 3270] {
                let (a, b) = (values(m * k, 1), values(k, 2));
                let expected = by_gemm(m, k, (&a, a_t), &b);
                let mut dst = vec![f32::NAN; m];
                let taken = product(Simd::Auto, (m, 1, k), (&a, a_t), &b, &mut dst, 1);
                assert_eq!(taken, narrow_cpu(), "m {m} k {k} transposed a {a_t}");
                if taken {
                    products += 1;
                    assert!(same_bits(&expected, &dst), "m {m} k {k} transposed a {a_t}: not gemm's bits");
                }
            }
        }
        assert_eq!(products > 0, narrow_cpu(), "products taken: {products}");
    }

    fn narrow_cpu() -> bool {
        super::super::narrow::avx512f()
    }

    #[test]
    fn through_sgemm_a_transposed_right_hand_side_is_the_same_column() {
        // One column stored as `1×k` (transposed) or `k×1` is the same `k` values.
        let (m, k) = (700, 36);
        let (a, b) = (values(m * k, 3), values(k, 4));
        let (mut plain, mut t) = (vec![f32::NAN; m], vec![f32::NAN; m]);
        sgemm_threads(Simd::Auto, m, 1, k, Operand::plain(&a), Operand::plain(&b), &mut plain, 1);
        sgemm_threads(Simd::Auto, m, 1, k, Operand::plain(&a), Operand::t(&b), &mut t, 1);
        assert!(same_bits(&plain, &t) && same_bits(&plain, &by_gemm(m, k, (&a, false), &b)));
    }

    #[test]
    fn a_nan_or_an_infinity_reaches_the_rows_it_reaches_in_gemm() {
        let (m, k) = (300, 40);
        for a_t in [false, true] {
            let mut a = values(m * k, 5);
            let b = values(k, 6);
            // Element (i, p) of op(a).
            let at = |i: usize, p: usize| if a_t { p * m + i } else { i * k + p };
            a[at(3, 5)] = f32::NAN;
            a[at(17, 38)] = f32::INFINITY;
            a[at(18, 2)] = f32::NEG_INFINITY;
            let expected = by_gemm(m, k, (&a, a_t), &b);
            let mut dst = vec![0.0; m];
            if !product(Simd::Auto, (m, 1, k), (&a, a_t), &b, &mut dst, 1) {
                assert!(!narrow_cpu());
                return;
            }
            for (i, (x, y)) in expected.iter().zip(&dst).enumerate() {
                assert_eq!(x.is_nan(), y.is_nan(), "row {i}: {y} against gemm's {x}");
                assert!(x.is_nan() || x.to_bits() == y.to_bits(), "row {i}: {y} against gemm's {x}");
            }
            assert!(dst[3].is_nan() && !dst[17].is_finite() && !dst[18].is_finite());
        }
    }

    #[test]
    fn split_over_threads_it_has_the_same_bits() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool of 3 threads");
        for ((m, k), a_t) in [((40_000, 36), false), ((1000, 1100), true)] {
            let (a, b) = (values(m * k, 7), values(k, 8));
            let expected = by_gemm(m, k, (&a, a_t), &b);
            let mut dst = vec![f32::NAN; m];
            let taken = pool.install(|| product(Simd::Auto, (m, 1, k), (&a, a_t), &b, &mut dst, 3));
            assert_eq!(taken, narrow_cpu());
            if taken {
                assert!(same_bits(&expected, &dst), "m {m} k {k} transposed a {a_t}");
            }
        }
    }

    #[test]
    fn shapes_gemm_sums_otherwise_stay_with_it() {
        assert!(!fits(GEMM_HORIZONTAL_MAX, 1, 36, false), "256 rows or fewer: gemm's horizontal kernel");
        assert!(!fits(1000, 1, 2, false), "k below 3: gemm's outer product");
        assert!(!fits(1, 1, 36, true), "one row: gemm's horizontal kernel");
        assert!(!fits(1000, 2, 36, false), "two columns: not one");
        assert!(!fits(1000, 1, MAX_K + 1, false), "offsets past 32 bits");
        assert!(fits(GEMM_HORIZONTAL_MAX + 1, 1, 3, false) && fits(100_000, 1, 5000, false) && fits(2, 1, 3, true));
    }
}
