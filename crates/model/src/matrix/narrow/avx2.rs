//! The narrow product on a CPU with AVX2 and FMA but not AVX-512F (an AMD
//! Zen 3): the same sums as the AVX-512 kernel (`narrow.rs`), each output
//! one chain of fused multiply-adds over `k` in order from zero, so the
//! same bits (and `gemm`'s), on 8-lane vectors and 16 registers.
//!
//! With half the registers of AVX-512, the columns are taken in chunks of
//! two vectors, six rows a block (12 accumulators, 2 of `b`, a broadcast),
//! then what is left: a whole vector and the columns past it as one more
//! chunk of two (its second masked: `_mm256_maskload_ps`, AVX2 having no
//! masked lanes otherwise), or either alone, twelve rows a block (one
//! vector and the masked columns as chunks of one each ran 5–11% slower:
//! `[128, 64]·[64, 41]` 70 GFLOP/s against 73, `[128, 41]·[41, 12]` 55
//! against 62, `[41, 128]ᵀ·[128, 41]` 69 against 73). Every chunk
//! reads the same rows of `a`, which stay in the first-level cache. One
//! thread on an AVX-512 Xeon (model 207) running this build, best of 7×200
//! calls, GFLOP/s against `gemm`'s own AVX2 build there: `[128, 41]·[41,
//! 64]` 81–84 against 72–80, `[128, 64]·[64, 64]` 85 against 56–82,
//! `[41, 128]ᵀ·[128, 64]` 85 against 46–70, `[3379, 16]·[16, 36]` 73
//! against 53, a gate's `[128, 41]·[41, 5]` 44 against 14–21. Chunks of
//! four vectors (three or two rows a block) ran these at 52–77, of three
//! (four rows) at 57–67.

use std::arch::x86_64::*;

use super::{SLICE_BYTES, WHOLE_BYTES};

/// Columns a chunk of whole vectors takes at most.
const CHUNK: usize = 16;

/// How a chunk stores its sums: the bias at its first column (where
/// given), the ReLU, and whether the sums start from the outputs stored
/// (a slice of `k` after the first).
#[derive(Clone, Copy)]
struct Store {
    bias: Option<*const f32>,
    relu: bool,
    resume: bool,
}

/// `out[r] = a[r]·b` for each of `m` rows (`a.0` read at `r·a.1 + p·a.2`,
/// `b` `k×n`, `out` `m×n`), each output stored through the bias (`out.1`)
/// and the ReLU (`out.2`), as `narrow::x86::rows` does.
///
/// # Safety
/// AVX2 and FMA; `a.0` readable at `r·a.1 + p·a.2` for `r < m`, `p < k`;
/// `b` at `p·n + c`, a bias at `c`, and `out` writable at `r·n + c` for
/// `c < n`.
#[target_feature(enable = "avx2,fma")]
#[expect(unsafe_code, reason = "AVX2 loads and stores through raw pointers")]
pub(super) unsafe fn rows(
    (m, n, k): (usize, usize, usize),
    (a, rs, cs): (*const f32, usize, usize),
    b: *const f32,
    (out, bias, relu): (*mut f32, Option<*const f32>, bool),
) {
    // `b` a slice of `k` at a time, as the AVX-512 kernel takes it.
    let slice = if 4 * n * k <= WHOLE_BYTES { k } else { (SLICE_BYTES / (4 * n)).max(1) };
    let whole = n / 8 * 8;
    let mut p0 = 0;
    while p0 < k {
        let along = slice.min(k - p0);
        let last = p0 + along == k;
        let store = Store { bias: bias.filter(|_| last), relu: relu && last, resume: p0 > 0 };
        // SAFETY: each chunk's columns are below `n` and its `p` below
        // `k`, its rows below `m`, as the caller guarantees.
        unsafe {
            let (a, b) = ((a.add(p0 * cs), rs, cs), b.add(p0 * n));
            // Pairs of whole vectors, then the columns left: one whole
            // vector, the columns past the last whole vector (masked), or
            // both as one chunk of two, the second masked.
            let mut c0 = 0;
            let pairs_end = whole / 16 * 16;
            while c0 < pairs_end {
                let then = Store { bias: store.bias.map(|p| p.add(c0)), ..store };
                chunk::<2, 6>((m, n, along), a, b.add(c0), out.add(c0), None, then);
                c0 += CHUNK;
            }
            let lanes = std::array::from_fn::<i32, 8, _>(|l| if whole + l < n { -1 } else { 0 });
            let mask = (whole < n).then(|| _mm256_loadu_si256(lanes.as_ptr().cast()));
            let then = Store { bias: store.bias.map(|p| p.add(c0)), ..store };
            let (b, out) = (b.add(c0), out.add(c0));
            match (whole - c0, mask) {
                (8, Some(mask)) => chunk::<2, 6>((m, n, along), a, b, out, Some(mask), then),
                (8, None) => chunk::<1, 12>((m, n, along), a, b, out, None, then),
                (_, Some(mask)) => chunk::<1, 12>((m, n, along), a, b, out, Some(mask), then),
                (_, None) => {}
            }
        }
        p0 += along;
    }
}

/// One chunk of `NV` vectors' columns (its last vector masked by `mask`
/// where that one covers the columns past the last whole vector) for
/// every row, `R` rows a block, the rows left as a block of their own.
///
/// # Safety
/// As [`rows`], for the chunk's columns.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[expect(unsafe_code, reason = "AVX2 loads and stores through raw pointers")]
unsafe fn chunk<const NV: usize, const R: usize>(
    (m, n, k): (usize, usize, usize),
    (a, rs, cs): (*const f32, usize, usize),
    b: *const f32,
    out: *mut f32,
    mask: Option<__m256i>,
    then: Store,
) {
    const { assert!(R <= 12, "a remainder past 11 rows has no block below") };
    let full = m / R * R;
    let shape = (n, k, mask);
    // SAFETY: every block's rows are below `m`, as the caller guarantees.
    unsafe {
        for r0 in (0..full).step_by(R) {
            block::<NV, R>(shape, (a.add(r0 * rs), rs, cs), b, out.add(r0 * n), then);
        }
        let (a, out) = ((a.add(full * rs), rs, cs), out.add(full * n));
        match m - full {
            0 => {}
            1 => block::<NV, 1>(shape, a, b, out, then),
            2 => block::<NV, 2>(shape, a, b, out, then),
            3 => block::<NV, 3>(shape, a, b, out, then),
            4 => block::<NV, 4>(shape, a, b, out, then),
            5 => block::<NV, 5>(shape, a, b, out, then),
            6 => block::<NV, 6>(shape, a, b, out, then),
            7 => block::<NV, 7>(shape, a, b, out, then),
            8 => block::<NV, 8>(shape, a, b, out, then),
            9 => block::<NV, 9>(shape, a, b, out, then),
            10 => block::<NV, 10>(shape, a, b, out, then),
            // Fewer than `R` ≤ 12 rows are left (asserted above).
            _ => block::<NV, 11>(shape, a, b, out, then),
        }
    }
}

/// A vector of a chunk at `at`: the masked columns where `mask` is given
/// (the chunk's last vector, past the last whole one), else eight.
///
/// # Safety
/// AVX2; `at` readable for the eight floats, or for the mask's lanes.
#[target_feature(enable = "avx2")]
#[inline]
#[expect(unsafe_code, reason = "AVX2 loads through raw pointers")]
unsafe fn load(at: *const f32, mask: Option<__m256i>) -> __m256 {
    // SAFETY: as the caller guarantees.
    unsafe {
        match mask {
            Some(mask) => _mm256_maskload_ps(at, mask),
            None => _mm256_loadu_ps(at),
        }
    }
}

/// `out[r] = a[r]·b` for `R` rows of the chunk, summed over `k` in order,
/// one fused multiply-add a step from zero (or from the sums stored),
/// then through `then` as stored.
///
/// # Safety
/// As [`rows`], for `R` rows and the chunk's columns.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[expect(unsafe_code, reason = "AVX2 loads and stores through raw pointers")]
#[expect(clippy::needless_range_loop, reason = "row and vector indices pick registers in step")]
unsafe fn block<const NV: usize, const R: usize>(
    (n, k, mask): (usize, usize, Option<__m256i>),
    (a, rs, cs): (*const f32, usize, usize),
    b: *const f32,
    out: *mut f32,
    then: Store,
) {
    // SAFETY: the rows read and written are below `R` and `p < k`, the
    // columns the chunk's (a masked vector's lanes past `n` not accessed).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NV]; R];
        if then.resume {
            for r in 0..R {
                for v in 0..NV {
                    acc[r][v] = load(out.add(r * n + v * 8), mask.filter(|_| v + 1 == NV));
                }
            }
        }
        for p in 0..k {
            let mut bv = [_mm256_setzero_ps(); NV];
            for v in 0..NV {
                bv[v] = load(b.add(p * n + v * 8), mask.filter(|_| v + 1 == NV));
            }
            for r in 0..R {
                let x = _mm256_set1_ps(*a.add(r * rs + p * cs));
                for v in 0..NV {
                    acc[r][v] = _mm256_fmadd_ps(x, bv[v], acc[r][v]);
                }
            }
        }
        let add: [__m256; NV] = match then.bias {
            Some(bias) => std::array::from_fn(|v| load(bias.add(v * 8), mask.filter(|_| v + 1 == NV))),
            None => [_mm256_setzero_ps(); NV],
        };
        for r in 0..R {
            for v in 0..NV {
                let mut sum = acc[r][v];
                if then.bias.is_some() {
                    sum = _mm256_add_ps(sum, add[v]);
                }
                if then.relu {
                    // +0 where `sum` is NaN or either zero: `vmaxps`
                    // returns its second operand there, as `f32::max`.
                    sum = _mm256_max_ps(sum, _mm256_setzero_ps());
                }
                let at = out.add(r * n + v * 8);
                match mask.filter(|_| v + 1 == NV) {
                    Some(mask) => _mm256_maskstore_ps(at, mask, sum),
                    None => _mm256_storeu_ps(at, sum),
                }
            }
        }
    }
}

/// `laid[p·n + j] = b[j·k + p]` for `j < n`, `p < k`: whole 8×8 tiles
/// transposed in registers (AVX2 has no masked lanes, so the columns and
/// rows past the last whole tile are moved a value at a time). Only values
/// move: the same result as the AVX-512 build and the portable loop. A
/// value at a time, the portable loop took 5% of PLE's step on this build's
/// products (`[64, 41]` and `[64, 64]` laid out a layer each way).
///
/// # Safety
/// AVX2; `b` readable for `n·k` values, `laid` writable for `k·n`.
#[target_feature(enable = "avx2")]
#[expect(unsafe_code, reason = "AVX2 loads and stores through raw pointers")]
pub(super) unsafe fn transpose(b: *const f32, (n, k): (usize, usize), laid: *mut f32) {
    let (whole_n, whole_k) = (n / 8 * 8, k / 8 * 8);
    // SAFETY: every row read is below `n` and every column below `k`
    // (`b` is `n×k`); every row written below `k` and column below `n`.
    unsafe {
        for j0 in (0..whole_n).step_by(8) {
            for p0 in (0..whole_k).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(b.add((j0 + i) * k + p0)));
                for (l, t) in transpose8(r).into_iter().enumerate() {
                    _mm256_storeu_ps(laid.add((p0 + l) * n + j0), t);
                }
            }
        }
        // The columns past the last whole tile, for every row; then the
        // rows past it, for the columns of whole tiles.
        for j in 0..n {
            for p in whole_k..k {
                *laid.add(p * n + j) = *b.add(j * k + p);
            }
        }
        for j in whole_n..n {
            for p in 0..whole_k {
                *laid.add(p * n + j) = *b.add(j * k + p);
            }
        }
    }
}

/// Eight rows of eight floats as the eight columns: pairs of rows
/// interleaved, then pairs of pairs, then the 128-bit halves swapped.
#[target_feature(enable = "avx2")]
#[inline]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let q = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x20>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x20>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x20>(q[3], q[7]),
        _mm256_permute2f128_ps::<0x31>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x31>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x31>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x31>(q[3], q[7]),
    ]
}
