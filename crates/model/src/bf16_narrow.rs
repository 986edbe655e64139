//! bf16 products with few output columns (`n` ≤ [`MAX_COLUMNS`]: a layer
//! of one to a few outputs, a gate's logits; a lane per output row, an
//! accumulator per column) or few values along k (`k` ≤ 2·[`MAX_ROW_PAIRS`]:
//! the gradient at a gate's input, `k = 1` an outer product; a row's
//! pairs broadcast against 16 columns a vector), on `vdpbf16ps`. The tile
//! kernel ran them at a tile's cost, 16 or 32 columns computed for a few,
//! or a tile's sums loaded and stored for two pairs, after both operands
//! were packed (two to four times fp32's time). Each output is the same
//! chain over its pairs, in order, as in the tile kernel and
//! [`gemm_bf16_portable`](crate::bf16::gemm_bf16_portable), so the bits
//! are theirs (`bf16`'s tests).

use crate::matrix::Operand;

/// The most output columns the lane kernel takes (an accumulator a
/// column): at 32 the tile kernel was faster (13.7 against 8.4 µs for
/// `[512, 64]·[64, 32]` on one thread), at 22 the lane kernel.
pub(crate) const MAX_COLUMNS: usize = 24;

/// Pairs along k the row kernel takes: a product's `k` up to twice this
/// (a gate's input gradient, `[rows, experts]·[experts, inputs]`).
pub(crate) const MAX_ROW_PAIRS: usize = 8;

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` where `n` ≤ `max_columns` (at
/// most [`MAX_COLUMNS`]) or `k` ≤ 2·[`MAX_ROW_PAIRS`] (`max_columns` 1:
/// only one column or one value along k, as AMX's path takes them) and the
/// CPU has AVX-512-BF16 (false, nothing written, otherwise); on this
/// thread alone where `threads` is 1.
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    a: &Operand<'_>,
    b: &Operand<'_>,
    dst: &mut [f32],
    threads: Option<usize>,
    max_columns: usize,
) -> bool {
    let Some(columns) = kernel((m, n, k), a.transposed, max_columns) else { return false };
    #[cfg(target_arch = "x86_64")]
    if crate::pairs::available() {
        assert!(a.data.len() >= m * k && b.data.len() >= k * n && dst.len() >= m * n);
        let min_len = if threads == Some(1) { usize::MAX } else { 1 };
        if columns {
            x86::columns((m, n, k), a, b, &mut dst[..m * n], min_len);
        } else {
            x86::rows((m, n, k), a, b, &mut dst[..m * n], min_len);
        }
        return true;
    }
    let _ = (a, b, dst, threads, columns);
    false
}

/// Which of [`gemm`]'s kernels takes a product of that shape: `Some(true)`
/// the lane kernel (a lane per output row), `Some(false)` the row kernel,
/// None neither (the tile kernel's then).
fn kernel((m, n, k): (usize, usize, usize), a_transposed: bool, max_columns: usize) -> Option<bool> {
    // A transposed `a` (a weight gradient's `xᵀ`, many pairs along k) reads
    // its pairs across two stored rows each, 16 rows a block: for more than
    // one column the tile kernel's packing is faster.
    let columns = n == 1 || (n <= max_columns.min(MAX_COLUMNS) && k > 2 * MAX_ROW_PAIRS && !a_transposed);
    let rows = !columns && k <= 2 * MAX_ROW_PAIRS && (k == 1 || max_columns > 1);
    (m > 0 && n > 0 && k > 0 && (columns || rows)).then_some(columns)
}

/// Whether [`gemm`] takes a product of that shape (where the CPU has
/// AVX-512-BF16), so the tile kernel does not.
pub(crate) fn takes(shape: (usize, usize, usize), a_transposed: bool, max_columns: usize) -> bool {
    kernel(shape, a_transposed, max_columns).is_some()
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

    /// `dst[i][j] = Σ_p a_i,p · b_p,j` for `n` ≤ [`MAX_COLUMNS`](super::MAX_COLUMNS):
    /// tasks of [`PER_TASK`] rows, blocks of 16 rows a lane each.
    pub fn columns(
        (m, n, k): (usize, usize, usize),
        a: &Operand<'_>,
        b: &Operand<'_>,
        dst: &mut [f32],
        min_len: usize,
    ) {
        // Column j of op(b), its k values in order, as pairs: chunk c's
        // columns side by side (`w_pairs[c·n + j]`).
        let column = |j: usize| -> Vec<f32> {
            if b.transposed { b.data[j * k..(j + 1) * k].to_vec() } else { (0..k).map(|p| b.data[p * n + j]).collect() }
        };
        let columns: Vec<Vec<f32>> = (0..n).map(column).collect();
        let w_pairs: Vec<[u32; 16]> = (0..k.div_ceil(32))
            .flat_map(|c| {
                columns.iter().map(move |col| {
                    // SAFETY: `gemm` checked AVX-512F and AVX-512-BF16.
                    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                    dwords(unsafe { pairs_of(&col[32 * c..(32 * c + 32).min(k)]) })
                })
            })
            .collect();
        dst.par_chunks_mut(PER_TASK * n).with_min_len(min_len).enumerate().for_each(|(task, out)| {
            for (g, out) in out.chunks_mut(16 * n).enumerate() {
                let i0 = task * PER_TASK + 16 * g;
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    block((m, n, k), a, &w_pairs, i0, out)
                };
            }
        });
    }

    /// [`lanes_block`] for `n` columns (1 to 24), its accumulators in registers
    /// (from 16 on with some of a block's pairs spilled).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn block((m, n, k): (usize, usize, usize), a: &Operand<'_>, w: &[[u32; 16]], i0: usize, out: &mut [f32]) {
        // One build a column count: `N` accumulators held in registers.
        macro_rules! by_columns {
            ($($c:literal)*) => {
                match n {
                    $($c => lanes_block::<$c>((m, k), a, w, i0, out),)*
                    _ => unreachable!("bf16_narrow: {n} columns"),
                }
            };
        }
        by_columns!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24)
    }

    /// Output rows `i0..i0 + out.len() / N` (≤ 16) of [`columns`], a lane
    /// each: a plain `a`'s rows read 32 values at a time and transposed to
    /// pairs, a transposed one's pairs read across two stored rows; each
    /// block of pairs then serves all `N` columns.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn lanes_block<const N: usize>(
        (m, k): (usize, usize),
        a: &Operand<'_>,
        w_pairs: &[[u32; 16]],
        i0: usize,
        out: &mut [f32],
    ) {
        let (rows, pairs) = (out.len() / N, k.div_ceil(2));
        let mut acc = [_mm512_setzero_ps(); N];
        for (c, w_lanes) in w_pairs.chunks_exact(N).enumerate() {
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
            for (p, v) in v.iter().enumerate().take(pairs - 16 * c) {
                // SAFETY: 64 bytes: 32 bf16 as 16 pairs.
                #[expect(unsafe_code, reason = "reinterpreting pairs as bf16 vectors")]
                let x = unsafe { std::mem::transmute::<__m512i, __m512bh>(*v) };
                for (acc, w) in acc.iter_mut().zip(w_lanes) {
                    // SAFETY: as above, a broadcast pair.
                    #[expect(unsafe_code, reason = "reinterpreting pairs as bf16 vectors")]
                    let y = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w[p] as i32)) };
                    *acc = _mm512_dpbf16_ps(*acc, x, y);
                }
            }
        }
        if N == 1 {
            // SAFETY: the masked store writes `rows` ≤ 16 floats of `out`.
            #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
            unsafe {
                _mm512_mask_storeu_ps(out.as_mut_ptr(), lanes(rows), acc[0])
            };
            return;
        }
        // Lanes are rows: the columns' vectors written out, then read across.
        let mut by_column = [[0f32; 16]; N];
        for (column, acc) in by_column.iter_mut().zip(&acc) {
            // SAFETY: `column` holds 16 floats, one 16-float store.
            #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
            unsafe {
                _mm512_storeu_ps(column.as_mut_ptr(), *acc)
            };
        }
        for (r, row) in out.chunks_exact_mut(N).enumerate() {
            for (o, column) in row.iter_mut().zip(&by_column) {
                *o = column[r];
            }
        }
    }

    /// `dst[i][j] = Σ_p a_i,p · b_p,j` for `k` ≤ 2·[`MAX_ROW_PAIRS`](super::MAX_ROW_PAIRS):
    /// a row's few pairs broadcast, each against op(b)'s pairs 16 columns
    /// a vector (`k` = 1: an outer product, each output the chain of one
    /// pair `(·, 0)`).
    pub fn rows((m, n, k): (usize, usize, usize), a: &Operand<'_>, b: &Operand<'_>, dst: &mut [f32], min_len: usize) {
        let (pairs, blocks) = (k.div_ceil(2), n.div_ceil(16));
        // op(b)'s row p, then its pairs a block of 16 columns each
        // (`b_pairs[q·blocks + block]`).
        let b_row = |p: usize| -> Vec<f32> {
            if b.transposed { (0..n).map(|j| b.data[j * k + p]).collect() } else { b.data[p * n..(p + 1) * n].to_vec() }
        };
        let b_rows: Vec<Vec<f32>> = (0..k).map(b_row).collect();
        let b_pairs: Vec<[u32; 16]> = (0..pairs)
            .flat_map(|q| {
                let (even, odd) = (&b_rows[2 * q], b_rows.get(2 * q + 1));
                (0..blocks).map(move |block| {
                    let (j0, len) = (16 * block, (n - 16 * block).min(16));
                    // SAFETY: `gemm` checked AVX-512F and AVX-512-BF16.
                    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                    dwords(unsafe { pairs_across(&even[j0..], odd.map(|o| &o[j0..]), len) })
                })
            })
            .collect();
        // a's pairs, a row's together (`a_pairs[i·pairs + q]`).
        let mut a_pairs = vec![0u32; m * pairs];
        if k == 1 {
            // One value a row, in order either way: 16 rows to a conversion.
            for (out, a) in a_pairs.chunks_mut(16).zip(a.data.chunks(16)) {
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                let lone = dwords(unsafe { pairs_across(a, None, out.len()) });
                out.copy_from_slice(&lone[..out.len()]);
            }
        } else if a.transposed {
            for (block, out) in a_pairs.chunks_mut(16 * pairs).enumerate() {
                let (i0, len) = (16 * block, out.len() / pairs);
                for q in 0..pairs {
                    let odd = (2 * q + 1 < k).then(|| &a.data[(2 * q + 1) * m + i0..]);
                    // SAFETY: as above.
                    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                    let across = dwords(unsafe { pairs_across(&a.data[2 * q * m + i0..], odd, len) });
                    for (r, &pair) in across.iter().enumerate().take(len) {
                        out[r * pairs + q] = pair;
                    }
                }
            }
        } else {
            for (i, out) in a_pairs.chunks_mut(pairs).enumerate() {
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                let row = dwords(unsafe { pairs_of(&a.data[i * k..(i + 1) * k]) });
                out.copy_from_slice(&row[..pairs]);
            }
        }
        dst.par_chunks_mut(n * 16).with_min_len(min_len).enumerate().for_each(|(g, rows)| {
            for (row, a) in rows.chunks_mut(n).zip(a_pairs[16 * g * pairs..].chunks(pairs)) {
                // SAFETY: as above.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    one_row(a, (&b_pairs, blocks), row)
                };
            }
        });
    }

    /// One row of [`rows`]: its pairs `a` against op(b)'s, a chain a column
    /// over the pairs in order.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn one_row(a: &[u32], (b_pairs, blocks): (&[[u32; 16]], usize), row: &mut [f32]) {
        for (block, out) in row.chunks_mut(16).enumerate() {
            let mut acc = _mm512_setzero_ps();
            for (q, &aq) in a.iter().enumerate() {
                // SAFETY: 16 dwords are one 64-byte vector; both are 32
                // bf16 as 16 pairs.
                #[expect(unsafe_code, reason = "SIMD loads and reinterpretation behind run-time feature detection")]
                unsafe {
                    let y = _mm512_loadu_si512(b_pairs[q * blocks + block].as_ptr().cast());
                    let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(aq as i32));
                    acc = _mm512_dpbf16_ps(acc, x, std::mem::transmute::<__m512i, __m512bh>(y));
                }
            }
            // SAFETY: writes `out.len()` ≤ 16 floats: 16 unmasked (a
            // masked store is slow on AMD's cores whatever its mask: a
            // third of this kernel's time), fewer masked.
            #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
            unsafe {
                match out.len() {
                    16 => _mm512_storeu_ps(out.as_mut_ptr(), acc),
                    len => _mm512_mask_storeu_ps(out.as_mut_ptr(), lanes(len), acc),
                }
            };
        }
    }
}
