//! Matrix products in bf16 with fp32 accumulation (issue 17's
//! `model.precision = "bf16"`, not wired into the models yet): inputs are
//! rounded to bf16 (nearest even) and multiplied pairwise along `k`, each
//! output's pairs accumulated in order with [`dpbf16_portable`]'s
//! arithmetic. Where the CPU has AVX-512-BF16 the same sums run on
//! `vdpbf16ps`, bit for bit the same: each output keeps its own sequential
//! chain over the pairs, so neither the tile shape nor the threads change a
//! result.
//!
//! [`dpbf16_portable`]: crate::peak::dpbf16_portable

use rayon::prelude::*;

use crate::matrix::Operand;
use crate::peak::dpbf16_portable;

/// bf16 of an f32, rounded to nearest even (NaN stays a quiet NaN).
pub fn round_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Two bf16 (nearest even) in a dword, the first in the low half (as
/// `vdpbf16ps` reads a lane).
fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(round_bf16(lo)) | (u32::from(round_bf16(hi)) << 16)
}

/// `a` (m×k) as bf16 pairs along k: `rows_to × pairs` dwords (rows past m
/// are 0); an odd k is padded with 0. Rows in parallel; a plain operand is
/// read along its rows, a transposed one (stored k×m) down its columns.
fn pack_rows(m: usize, k: usize, a: &Operand<'_>, rows_to: usize) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let mut out = vec![0u32; rows_to * pairs];
    if pairs == 0 {
        return out;
    }
    let data = a.data;
    if a.transposed {
        out[..m * pairs].par_chunks_mut(pairs).enumerate().for_each(|(i, out)| {
            for (p, o) in out.iter_mut().enumerate() {
                let hi = if 2 * p + 1 < k { data[(2 * p + 1) * m + i] } else { 0.0 };
                *o = pair(data[2 * p * m + i], hi);
            }
        });
    } else {
        out[..m * pairs].par_chunks_mut(pairs).zip(data.par_chunks(k)).for_each(|(out, row)| {
            let mut two = row.chunks_exact(2);
            for (o, c) in out.iter_mut().zip(&mut two) {
                *o = pair(c[0], c[1]);
            }
            if let [last] = two.remainder() {
                out[pairs - 1] = pair(*last, 0.0);
            }
        });
    }
    out
}

/// `b` (k×n) as bf16 pairs along k: `pairs × cols_to` dwords (columns past
/// n are 0). A plain operand: rows 2p and 2p+1 side by side, pairs in
/// parallel; a transposed one (stored n×k): each column's pairs are
/// adjacent in memory.
fn pack_cols(k: usize, n: usize, b: &Operand<'_>, cols_to: usize) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let mut out = vec![0u32; pairs * cols_to];
    if n == 0 || pairs == 0 {
        return out;
    }
    let data = b.data;
    if b.transposed {
        for j in 0..n {
            let column = &data[j * k..(j + 1) * k];
            let mut two = column.chunks_exact(2);
            for (p, c) in (&mut two).enumerate() {
                out[p * cols_to + j] = pair(c[0], c[1]);
            }
            if let [last] = two.remainder() {
                out[(pairs - 1) * cols_to + j] = pair(*last, 0.0);
            }
        }
    } else {
        out.par_chunks_mut(cols_to).enumerate().for_each(|(p, out)| {
            let even = &data[2 * p * n..(2 * p + 1) * n];
            if 2 * p + 1 < k {
                let odd = &data[(2 * p + 1) * n..(2 * p + 2) * n];
                for ((o, &lo), &hi) in out.iter_mut().zip(even).zip(odd) {
                    *o = pair(lo, hi);
                }
            } else {
                for (o, &lo) in out.iter_mut().zip(even) {
                    *o = pair(lo, 0.0);
                }
            }
        });
    }
    out
}

/// The reference: every output's chain with the portable lane.
pub fn gemm_bf16_portable(m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>, dst: &mut [f32]) {
    check(m, n, k, &a, &b, dst);
    let pairs = k.div_ceil(2);
    let (pa, pb) = (pack_rows(m, k, &a, m), pack_cols(k, n, &b, n));
    dst.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        for (j, out) in row.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for p in 0..pairs {
                let (x, y) = (pa[i * pairs + p], pb[p * n + j]);
                acc = dpbf16_portable(acc, [x as u16, (x >> 16) as u16], [y as u16, (y >> 16) as u16]);
            }
            *out = acc;
        }
    });
}

fn check(m: usize, n: usize, k: usize, a: &Operand<'_>, b: &Operand<'_>, dst: &[f32]) {
    assert_eq!(a.data.len(), m * k, "gemm_bf16: lhs size");
    assert_eq!(b.data.len(), k * n, "gemm_bf16: rhs size");
    assert_eq!(dst.len(), m * n, "gemm_bf16: dst size");
}

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` with fp32 accumulation (see the
/// module's text), on the current rayon pool: `vdpbf16ps` where the CPU has
/// it, the portable lane otherwise; the same bits either way.
pub fn gemm_bf16(m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        check(m, n, k, &a, &b, dst);
        simd::gemm(m, n, k, &a, &b, dst);
        return;
    }
    gemm_bf16_portable(m, n, k, a, b, dst);
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use super::{pack_cols, pack_rows};
    use crate::matrix::Operand;

    /// A tile: 8 rows × 32 columns, 16 accumulators.
    const MR: usize = 8;
    const NR: usize = 32;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")
    }

    /// One tile: `c[r][0..32] = Σ_p dot(a[r][p], b[p][0..32])`, p in order.
    #[target_feature(enable = "avx512bf16,avx512f")]
    fn tile(pairs: usize, a: &[u32], b: &[u32], b_stride: usize, c: &mut [f32; MR * NR]) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..pairs {
            // SAFETY: `row` is a bounds-checked slice of exactly NR = 32
            // dwords, read as two unaligned 16-dword vectors.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let (b0, b1) = unsafe {
                let row = &b[p * b_stride..p * b_stride + NR];
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row.as_ptr().cast())),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row[16..].as_ptr().cast())),
                )
            };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: a broadcast dword reinterpreted as bf16 pairs;
                // every bit pattern is a valid __m512bh.
                #[expect(unsafe_code, reason = "SIMD reinterpretation behind run-time feature detection")]
                let x = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a[r * pairs + p] as i32)) };
                acc_r[0] = _mm512_dpbf16_ps(acc_r[0], x, b0);
                acc_r[1] = _mm512_dpbf16_ps(acc_r[1], x, b1);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let out = &mut c[r * NR..(r + 1) * NR];
            // SAFETY: `out` holds NR = 32 f32, two 16-float stores.
            #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr(), acc_r[0]);
                _mm512_storeu_ps(out[16..].as_mut_ptr(), acc_r[1]);
            }
        }
    }

    pub fn gemm(m: usize, n: usize, k: usize, a: &Operand<'_>, b: &Operand<'_>, dst: &mut [f32]) {
        if m == 0 || n == 0 {
            return;
        }
        let pairs = k.div_ceil(2);
        let (rows_to, cols_to) = (m.div_ceil(MR) * MR, n.div_ceil(NR) * NR);
        let pa = pack_rows(m, k, a, rows_to);
        let pb = pack_cols(k, n, b, cols_to);
        // Row blocks in parallel; each writes its own rows of dst.
        dst.par_chunks_mut(MR * n).enumerate().for_each(|(block, out)| {
            let a_block = &pa[block * MR * pairs..(block + 1) * MR * pairs];
            let mut c = [0f32; MR * NR];
            for col in (0..cols_to).step_by(NR) {
                // SAFETY: the CPU has AVX-512F and AVX-512-BF16 (`available`
                // was checked by the caller before this path was taken).
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    tile(pairs, a_block, &pb[col..], cols_to, &mut c)
                };
                let rows = out.len() / n;
                let width = NR.min(n - col);
                for r in 0..rows {
                    out[r * n + col..r * n + col + width].copy_from_slice(&c[r * NR..r * NR + width]);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s % 20_001) as f32 - 10_000.0) / 10_000.0 * scale
            })
            .collect()
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(round_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(f32::from_bits(u32::from(round_bf16(f32::NAN)) << 16).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), 0x7f80);
    }

    /// The SIMD kernel (where the CPU has it) and the portable reference
    /// give the same bits, on shapes off the tile sizes, odd k, and every
    /// operand layout; and both are close to the f64 product of the
    /// bf16-rounded inputs.
    #[test]
    fn simd_and_portable_agree_bit_for_bit_and_match_f64() {
        for &(m, n, k) in &[(1, 1, 1), (7, 33, 5), (17, 40, 64), (64, 256, 429), (9, 1, 128)] {
            for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = random(m * k, (m * 31 + k) as u64, 1.5);
                let b = random(k * n, (n * 17 + k) as u64, 0.7);
                let (opa, opb) = (Operand { data: &a, transposed: at }, Operand { data: &b, transposed: bt });
                let mut fast = vec![0f32; m * n];
                let mut reference = vec![0f32; m * n];
                gemm_bf16(m, n, k, opa, opb, &mut fast);
                gemm_bf16_portable(m, n, k, opa, opb, &mut reference);
                for (i, (x, y)) in fast.iter().zip(&reference).enumerate() {
                    assert_eq!(x.to_bits(), y.to_bits(), "{m}x{n}x{k} t=({at},{bt}) [{i}]: {x} vs {y}");
                }
                let bf = |x: f32| f64::from(f32::from_bits(u32::from(round_bf16(x)) << 16));
                for i in 0..m {
                    for j in 0..n {
                        let exact: f64 = (0..k)
                            .map(|p| {
                                let x = if at { a[p * m + i] } else { a[i * k + p] };
                                let y = if bt { b[j * k + p] } else { b[p * n + j] };
                                bf(x) * bf(y)
                            })
                            .sum();
                        let got = f64::from(reference[i * n + j]);
                        assert!((got - exact).abs() <= 1e-5 * (1.0 + exact.abs()) * k as f64, "{got} vs {exact}");
                    }
                }
            }
        }
    }
}
