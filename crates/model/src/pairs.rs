//! bf16 pairs in AVX-512 registers, as `vdpbf16ps` and AMX's tiles read
//! them: a lane holds two bf16, the even element in its low half.

use std::arch::x86_64::*;

/// Whether this CPU has AVX-512F and AVX-512-BF16.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
}

/// 16 dwords: the bf16 pairs of up to 32 floats in order (zeros past
/// the end), as `vcvtne2ps2bf16` rounds them.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) fn pairs_of(src: &[f32]) -> __m512i {
    let (lo, hi) = (src.len().min(16), src.len().saturating_sub(16).min(16));
    // SAFETY: the masked loads read lanes 0..lo and lo..lo+hi of `src`
    // (within it); masked-off lanes are not accessed.
    #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
    unsafe {
        let low = _mm512_maskz_loadu_ps(lanes(lo), src.as_ptr());
        let high = _mm512_maskz_loadu_ps(lanes(hi), src.as_ptr().add(lo));
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low))
    }
}

/// 16 dwords: the pairs `(even[j], odd[j])` of up to 16 columns (zeros
/// past `len`; `odd` None: zero high halves).
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) fn pairs_across(even: &[f32], odd: Option<&[f32]>, len: usize) -> __m512i {
    let mask = lanes(len);
    let widen = |src: &[f32]| {
        assert!(src.len() >= len);
        // SAFETY: the masked load reads lanes 0..len of `src` (within
        // it, asserted); a bf16 vector reinterpreted as 16-bit integers.
        #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
        let halves = unsafe {
            let v = _mm512_maskz_loadu_ps(mask, src.as_ptr());
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
        };
        _mm512_cvtepu16_epi32(halves)
    };
    let low = widen(even);
    match odd {
        Some(odd) => _mm512_or_si512(low, _mm512_slli_epi32::<16>(widen(odd))),
        None => low,
    }
}

pub(crate) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
}

/// Rows of 16 dwords made columns (`v[r][c]` becomes `v[c][r]`): 64
/// shuffles for 256 dwords.
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose(v: &mut [__m512i; 16]) {
    // Per 128-bit lane L, rows 4g..4g+3 at column 4L+e land in u[4g+e].
    let mut t = [_mm512_setzero_si512(); 16];
    for g in 0..8 {
        t[2 * g] = _mm512_unpacklo_epi32(v[2 * g], v[2 * g + 1]);
        t[2 * g + 1] = _mm512_unpackhi_epi32(v[2 * g], v[2 * g + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let (t0, t1, t2, t3) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        u[4 * g] = _mm512_unpacklo_epi64(t0, t2);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    // Column 4L+e is lane L of u[e], u[4+e], u[8+e], u[12+e] in turn.
    for e in 0..4 {
        let x0 = _mm512_shuffle_i32x4::<0x44>(u[e], u[4 + e]);
        let x1 = _mm512_shuffle_i32x4::<0xee>(u[e], u[4 + e]);
        let y0 = _mm512_shuffle_i32x4::<0x44>(u[8 + e], u[12 + e]);
        let y1 = _mm512_shuffle_i32x4::<0xee>(u[8 + e], u[12 + e]);
        v[e] = _mm512_shuffle_i32x4::<0x88>(x0, y0);
        v[4 + e] = _mm512_shuffle_i32x4::<0xdd>(x0, y0);
        v[8 + e] = _mm512_shuffle_i32x4::<0x88>(x1, y1);
        v[12 + e] = _mm512_shuffle_i32x4::<0xdd>(x1, y1);
    }
}
