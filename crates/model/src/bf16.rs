//! Matrix products in bf16 with fp32 accumulation (`model.precision =
//! "bf16"`): inputs are rounded to bf16 ([`round_bf16`]) and multiplied
//! pairwise along `k`, each output's pairs accumulated in order with
//! [`dpbf16_portable`]'s arithmetic. Where the CPU has AVX-512-BF16 the same
//! sums run on `vdpbf16ps`, bit for bit the same: each output keeps its own
//! sequential chain over the pairs (carried across the kernel's passes), so
//! neither the tile shape nor the threads change a result.
//!
//! The fast path packs the left operand as pairs (row by row, or pair by
//! pair when it is transposed, so both read memory in order) and the right
//! one in panels of 32 columns (`vcvtne2ps2bf16`, then `vpermw` where two
//! rows make the pairs: `bf16/pack.rs`), into buffers each thread keeps;
//! 8×32 tiles then run passes of 128 pairs over a task's row blocks while
//! a panel slice stays in L1, the last pass storing straight into the
//! output (a tile at an edge, its rows and columns inside it).
//!
//! [`dpbf16_portable`]: crate::peak::dpbf16_portable

use std::cell::Cell;

use rayon::prelude::*;

use sparrow_core::config::Precision;
use sparrow_core::simd::Simd;

mod lent;
mod pack;
pub(crate) use lent::{PackedLeft, Read, pack_once};
use pack::{Convert, PackedRows, pack_cols, pack_rows};

pub use crate::matrix::Epilogue;
use crate::matrix::Operand;
use crate::peak::{bf16_daz, dpbf16_lane};

/// bf16 of an f32 as AVX-512-BF16's `vcvtneps2bf16` rounds it: to nearest
/// even; a zero or denormal becomes a zero of the same sign (the dot
/// product reads denormal bf16 as zero anyway); NaN stays a quiet NaN.
pub fn round_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7f80_0000 == 0 {
        return ((bits >> 16) & 0x8000) as u16;
    }
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Two bf16 in a dword, the first in the low half (as `vdpbf16ps` reads a lane).
fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(round_bf16(lo)) | (u32::from(round_bf16(hi)) << 16)
}

thread_local! {
    /// Packing buffers reused by this thread's products (a step makes the
    /// same ones every time; fresh ones cost page faults and zero-filling).
    /// Taken while in use: a product nested on the same thread (rayon runs
    /// stolen work while it waits) allocates its own.
    static BUFFERS: Cell<(Vec<u32>, Vec<u32>)> = const { Cell::new((Vec::new(), Vec::new())) };
    /// The partial sums of a task's tiles (`simd::gemm`), reused likewise.
    static TILE_SUMS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// The portable product: every output's chain of pairs in order with
/// [`dpbf16_portable`](crate::peak::dpbf16_portable)'s arithmetic, run
/// along a row of outputs at a time (each pair of a row of `a` against the
/// pairs of all n columns, which lie side by side) so that the compiler
/// vectorises it; the right operand's halves are widened once. Where the
/// CPU has AVX2 (but no AVX-512-BF16) the same code is compiled for it:
/// twice the lanes, the same bits (every step is an IEEE multiply, add,
/// conversion or select).
pub fn gemm_bf16_portable(simd: Simd, m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>, dst: &mut [f32]) {
    check(m, n, k, &a, &b, dst);
    let pairs = k.div_ceil(2);
    let convert = Convert::Portable;
    let (pa, pb) = (pack_rows(m, k, &a, m, convert, Vec::new()), pack_cols(k, n, &b, n, convert, Vec::new()));
    // Pair p of column j at p·n + j: its high halves, then its low ones.
    let (b_hi, b_lo): (Vec<f32>, Vec<f32>) = pb.iter().map(|&y| widen_pair(y)).unzip();
    let wide = wide_portable(simd);
    dst.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        let a_row = (0..pairs).map(|p| widen_pair(pa.at(i, p)));
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` is true only where AVX2 was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                portable_x86::chain_row_avx2(row, a_row, &b_hi, &b_lo)
            };
            return;
        }
        let _ = wide;
        chain_row(row, a_row, &b_hi, &b_lo);
    });
}

/// A bf16 pair widened (denormals read as zero): `(high, low)`.
fn widen_pair(x: u32) -> (f32, f32) {
    (bf16_daz((x >> 16) as u16), bf16_daz(x as u16))
}

/// One row of outputs: `row[j]` = the chain over the row's pairs `a_row`
/// against column j's (pair p of all columns at `b_*[p·n..][..n]`).
#[inline(always)]
fn chain_row(row: &mut [f32], a_row: impl Iterator<Item = (f32, f32)>, b_hi: &[f32], b_lo: &[f32]) {
    let n = row.len();
    row.fill(0.0);
    if n == 0 {
        return;
    }
    for ((a_pair, b_hi), b_lo) in a_row.zip(b_hi.chunks_exact(n)).zip(b_lo.chunks_exact(n)) {
        for ((acc, &bh), &bl) in row.iter_mut().zip(b_hi).zip(b_lo) {
            *acc = dpbf16_lane(*acc, a_pair, (bh, bl));
        }
    }
}

/// Whether the portable product may run its AVX2 build.
fn wide_portable(simd: Simd) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd.allows() && std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = simd;
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod portable_x86 {
    /// [`super::chain_row`] compiled for AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) fn chain_row_avx2(row: &mut [f32], a_row: impl Iterator<Item = (f32, f32)>, b_hi: &[f32], b_lo: &[f32]) {
        super::chain_row(row, a_row, b_hi, b_lo);
    }
}

fn check(m: usize, n: usize, k: usize, a: &Operand<'_>, b: &Operand<'_>, dst: &[f32]) {
    assert_eq!(a.data.len(), m * k, "gemm_bf16: lhs size");
    assert_eq!(b.data.len(), k * n, "gemm_bf16: rhs size");
    assert_eq!(dst.len(), m * n, "gemm_bf16: dst size");
}

/// How `model.precision = "bf16"` products run on this CPU ([`path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX's tiles (`tdpbf16ps`, [`crate::amx`]): each output's fp32 sum
    /// over chunks of 32 products, in the instruction's own order within
    /// a chunk; the bits differ from the other paths', the accuracy is the
    /// same. Products smaller than 16×16 take [`Bf16Path::Native`]'s kernel.
    Amx,
    /// AVX-512-BF16's `vdpbf16ps`: bf16 pairs, each output's fp32 chain.
    Native,
    /// No bf16 dot product on this CPU (or `train.simd = "avx2"`): the fp32
    /// kernels on bf16-rounded operands, those `simd` allows. The products
    /// are exact in fp32 as in `vdpbf16ps`, so the accuracy is the same and
    /// the speed fp32's; the sums' order is the fp32 kernel's, so the bits
    /// differ from [`Bf16Path::Native`]'s.
    Rounded(Simd),
    /// `SPARROW_SIMD=portable`: `vdpbf16ps`'s arithmetic written out, bit
    /// for bit the native path, ten or more times slower than fp32.
    Portable,
}

impl Bf16Path {
    /// One line for the user: what bf16 runs on here, and what it costs.
    pub fn describe(self) -> &'static str {
        match self {
            Bf16Path::Amx => {
                "bf16 products on AMX's tiles (tdpbf16ps; the bits differ from AVX-512-BF16's, which \
                 train.simd = \"avx512\" takes)"
            }
            Bf16Path::Native => "bf16 products on AVX-512-BF16 (vdpbf16ps)",
            Bf16Path::Rounded(_) => {
                "no AVX-512-BF16 here (the CPU lacks it, or train.simd = \"avx2\" keeps it out): bf16 runs the \
                 fp32 kernels on bf16-rounded inputs (fp32's speed, the same accuracy; the bits differ from an \
                 AVX-512-BF16 machine's, SPARROW_SIMD=portable gives those)"
            }
            Bf16Path::Portable => {
                "SPARROW_SIMD=portable: bf16 runs the portable kernel, bit for bit AVX-512-BF16's and ten or \
                 more times slower than fp32"
            }
        }
    }

    /// The ceiling of the kernels a bf16 product takes on this path:
    /// AMX's, `vdpbf16ps`'s (the portable kernel emulates it), or fp32's
    /// FMA (the fp32 kernels on rounded inputs).
    pub fn ceiling(self, peaks: &crate::peak::Peaks) -> Option<&crate::peak::Peak> {
        match self {
            Bf16Path::Amx => peaks.amx_bf16.as_ref(),
            Bf16Path::Native | Bf16Path::Portable => peaks.bf16_dot.as_ref(),
            Bf16Path::Rounded(_) => Some(&peaks.fp32_fma),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx_bf16",
            Bf16Path::Native => "avx512_bf16",
            Bf16Path::Rounded(_) => "f32_kernels_on_bf16_inputs",
            Bf16Path::Portable => "portable",
        }
    }
}

/// The path bf16 products take on this CPU under `train.simd`.
pub fn path(simd: Simd) -> Bf16Path {
    #[cfg(target_arch = "x86_64")]
    if simd::available(simd) && crate::amx::available(simd) {
        return Bf16Path::Amx;
    }
    #[cfg(target_arch = "x86_64")]
    if simd::available(simd) {
        return Bf16Path::Native;
    }
    if simd.allows() { Bf16Path::Rounded(simd) } else { Bf16Path::Portable }
}

/// How a model's matrix products run: `model.precision`, and for bf16 the
/// [`Bf16Path`] this CPU and `train.simd` give it (chosen once, when the
/// model is built, and handed to every product). fp32 products carry
/// `train.simd` too: `avx2` keeps their narrow kernel to its AVX2 build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arith {
    F32(Simd),
    Bf16(Bf16Path),
}

impl Arith {
    pub fn new(precision: Precision, simd: Simd) -> Arith {
        match precision {
            Precision::F32 => Arith::F32(simd),
            Precision::Bf16 => Arith::Bf16(path(simd)),
        }
    }

    /// The `train.simd` its fp32 products take their kernels by (bf16 on
    /// `vdpbf16ps` or AMX: a CPU with AVX-512, whose widest they take).
    pub fn simd(self) -> Simd {
        match self {
            Arith::F32(simd) | Arith::Bf16(Bf16Path::Rounded(simd)) => simd,
            Arith::Bf16(_) => Simd::Auto,
        }
    }

    /// fp32 on the kernels this one's fp32 products take: a part kept in
    /// fp32 whatever `model.precision` says (the gates, a narrow head).
    pub fn in_f32(self) -> Arith {
        Arith::F32(self.simd())
    }

    pub fn is_f32(self) -> bool {
        matches!(self, Arith::F32(_))
    }
}

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` with fp32 accumulation (see the
/// module's text), on the current rayon pool, along `path`: `vdpbf16ps`,
/// the fp32 kernel on rounded operands, or the portable kernel ([`Bf16Path`]).
pub fn gemm_bf16(path: Bf16Path, m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>, dst: &mut [f32]) {
    gemm_bf16_then(path, m, n, k, a, b, dst, Epilogue::default());
}

/// [`gemm_bf16`] on at most `threads` threads where it runs the fp32
/// kernel or AMX's (`vdpbf16ps` and the portable kernel split rows over
/// the current pool).
#[expect(clippy::too_many_arguments, reason = "a matrix product's path, shape, operands and threads")]
pub fn gemm_bf16_threads(
    path: Bf16Path,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
    threads: Option<usize>,
) {
    // A few output columns or one value along k: a lane per output row
    // (AMX's tiles take more than one column).
    if matches!(path, Bf16Path::Amx | Bf16Path::Native) {
        check(m, n, k, &a, &b, dst);
        let columns = if path == Bf16Path::Native { crate::bf16_narrow::MAX_COLUMNS } else { 1 };
        if crate::bf16_narrow::gemm((m, n, k), &a, &b, dst, threads, columns) {
            return;
        }
    }
    match path {
        Bf16Path::Rounded(simd) => {
            check(m, n, k, &a, &b, dst);
            crate::bf16_rounded::gemm(simd, m, n, k, a, b, dst, threads);
        }
        Bf16Path::Amx => {
            check(m, n, k, &a, &b, dst);
            // On this thread alone where `threads` is 1 (the caller runs
            // another product beside it); too small for AMX: vdpbf16ps.
            if !crate::amx::gemm(m, n, k, &a, &b, dst, Epilogue::default(), threads) {
                gemm_bf16(Bf16Path::Native, m, n, k, a, b, dst);
            }
        }
        _ => gemm_bf16(path, m, n, k, a, b, dst),
    }
}

/// [`gemm_bf16`], each output then passed through `epilogue`.
#[expect(clippy::too_many_arguments, reason = "a matrix product's path, shape, operands and epilogue")]
pub fn gemm_bf16_then(
    path: Bf16Path,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
    epilogue: Epilogue<'_>,
) {
    gemm_bf16_lent(path, (m, n, k), (a, None), b, dst, epilogue);
}

/// [`gemm_bf16_then`] with `a`'s bf16 pairs packed beforehand ([`pack_once`]:
/// an input several products read), which the tile kernel reads where they
/// are `a`'s; the same bits.
pub(crate) fn gemm_bf16_lent(
    path: Bf16Path,
    (m, n, k): (usize, usize, usize),
    (a, packed): (Operand<'_>, Option<&PackedLeft>),
    b: Operand<'_>,
    dst: &mut [f32],
    epilogue: Epilogue<'_>,
) {
    check(m, n, k, &a, &b, dst);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = packed;
    if let Some(bias) = epilogue.bias {
        assert_eq!(bias.len(), n, "gemm_bf16: bias size");
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Bf16Path::Amx | Bf16Path::Native => {
            if path == Bf16Path::Amx && crate::amx::gemm(m, n, k, &a, &b, dst, epilogue, None) {
                return;
            }
            if !crate::bf16_narrow::gemm((m, n, k), &a, &b, dst, None, crate::bf16_narrow::MAX_COLUMNS) {
                simd::gemm(m, n, k, (&a, packed), &b, dst, epilogue);
                return;
            }
        }
        Bf16Path::Rounded(simd) => crate::bf16_rounded::gemm(simd, m, n, k, a, b, dst, None),
        // Portable: the caller's choice, so no SIMD build of it either.
        _ => gemm_bf16_portable(Simd::Portable, m, n, k, a, b, dst),
    }
    dst.chunks_mut(n.max(1)).for_each(|row| epilogue.row(0, row));
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use super::{Convert, Epilogue, PackedRows, pack_cols, pack_rows};
    use crate::matrix::Operand;

    /// A tile: 8 rows × 32 columns, 16 accumulators.
    pub(super) const MR: usize = 8;
    pub(super) const NR: usize = 32;

    pub fn available(simd: sparrow_core::simd::Simd) -> bool {
        // AVX-512BW for the packing's word permutes (every CPU with
        // AVX-512-BF16 has it).
        simd.allows_avx512()
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    }

    /// Where a tile's last pass stores its sums: rows `stride` apart in the
    /// output, through the product's epilogue (`bias` from the tile's
    /// first column); its first `rows` rows and `cols` columns, the rest
    /// past the output's edge (a tile at an edge went through a buffer and
    /// was copied a row at a time: 2% of MMoE's bf16 step).
    struct Store<'a> {
        dst: &'a mut [f32],
        stride: usize,
        bias: Option<&'a [f32]>,
        relu: bool,
        rows: usize,
        cols: usize,
    }

    /// Lanes `0..n` of a 16-lane mask.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
    }

    /// Pairs per pass over a tile: a panel slice of KB×NR dwords (16 KB)
    /// stays in L1 while the task's row blocks use it.
    const KB: usize = 128;

    /// One tile over `pairs` pairs: `c[r][0..16·H] += Σ_p dot(a[r·rs + p·ps],
    /// b[p][0..16·H])`, p in order (`c` read first only if `accumulate`),
    /// `H` the tile's 16-column halves: 2, or 1 for a tile at the right
    /// edge of 16 columns or fewer (a product of 36 columns computed 64;
    /// now 48: each column's chain is the same either way). The sums go
    /// back to `c`, or to `dst` (rows `stride` apart) when given: the last
    /// pass of a whole tile stores straight into the output.
    #[target_feature(enable = "avx512bf16,avx512f")]
    fn tile<const H: usize>(
        pairs: usize,
        a: &[u32],
        (rs, ps): (usize, usize),
        b: &[u32],
        c: &mut [f32],
        accumulate: bool,
        dst: Option<Store<'_>>,
    ) {
        assert!(c.len() == MR * NR && b.len() >= pairs * NR && pairs > 0 && (1..=2).contains(&H));
        assert!(a.len() > (MR - 1) * rs + (pairs - 1) * ps);
        let mut acc = [[_mm512_setzero_ps(); H]; MR];
        if accumulate {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                for (h, acc) in acc_r.iter_mut().enumerate() {
                    // SAFETY: row r of `c` holds NR = 32 floats (asserted
                    // above), of which this reads 16 from 16·h ≤ 16.
                    #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
                    unsafe {
                        *acc = _mm512_loadu_ps(c[r * NR + 16 * h..].as_ptr())
                    };
                }
            }
        }
        for p in 0..pairs {
            let row = &b[p * NR..p * NR + NR];
            // SAFETY: `row` is a bounds-checked slice of exactly NR = 32
            // dwords; half h is read as one unaligned 16-dword vector.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let bh: [__m512bh; H] = std::array::from_fn(|h| unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row[16 * h..].as_ptr().cast()))
            });
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: a broadcast dword reinterpreted as bf16 pairs;
                // every bit pattern is a valid __m512bh.
                #[expect(unsafe_code, reason = "SIMD reinterpretation behind run-time feature detection")]
                let x =
                    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a[r * rs + p * ps] as i32)) };
                for (acc, &b) in acc_r.iter_mut().zip(&bh) {
                    *acc = _mm512_dpbf16_ps(*acc, x, b);
                }
            }
        }
        let (out, stride, bias, relu, (rows, cols)) = match dst {
            Some(Store { dst, stride, bias, relu, rows, cols }) => (dst, stride, bias, relu, (rows, cols)),
            None => (c, NR, None, false, (MR, 16 * H)),
        };
        assert!((1..=MR).contains(&rows) && (1..=16 * H).contains(&cols));
        assert!(out.len() >= (rows - 1) * stride + cols);
        // Each half's columns below `cols`: a whole vector stored unmasked
        // (a masked store is slow on AMD's cores whatever its mask).
        let masks: [__mmask16; H] = std::array::from_fn(|h| lanes(cols.saturating_sub(16 * h)));
        // The epilogue (see `Epilogue::apply`), on the final sums only.
        let bias: Option<[__m512; H]> = bias.map(|bias| {
            let bias = &bias[..cols];
            // SAFETY: the masked load reads the lanes of the half's columns
            // below `cols`, within `bias`; the others are not accessed.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            std::array::from_fn(|h| unsafe { _mm512_maskz_loadu_ps(masks[h], bias.as_ptr().add(16 * h)) })
        });
        let zero = _mm512_setzero_ps();
        for (r, acc_r) in acc.iter().enumerate().take(rows) {
            for (h, &acc) in acc_r.iter().enumerate() {
                let mut v = acc;
                if let Some(bias) = &bias {
                    v = _mm512_add_ps(v, bias[h]);
                }
                if relu {
                    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, zero), v);
                }
                let at = r * stride + 16 * h;
                // SAFETY: row r < rows holds `cols` floats from r·stride
                // (asserted above): a whole half's 16, or its masked lanes
                // below `cols` (none: nothing is written).
                #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
                unsafe {
                    match masks[h] {
                        0xffff => _mm512_storeu_ps(out[at..at + 16].as_mut_ptr(), v),
                        0 => {}
                        mask => _mm512_mask_storeu_ps(out[at..].as_mut_ptr(), mask, v),
                    }
                };
            }
        }
    }

    /// [`tile`] with the halves a tile `width` columns wide needs.
    #[target_feature(enable = "avx512bf16,avx512f")]
    fn tile_of(
        width: usize,
        (pairs, a, strides): (usize, &[u32], (usize, usize)),
        b: &[u32],
        c: &mut [f32],
        accumulate: bool,
        dst: Option<Store<'_>>,
    ) {
        if width <= 16 {
            tile::<1>(pairs, a, strides, b, c, accumulate, dst);
        } else {
            tile::<2>(pairs, a, strides, b, c, accumulate, dst);
        }
    }

    pub fn gemm(
        m: usize,
        n: usize,
        k: usize,
        (a, packed): (&Operand<'_>, Option<&super::PackedLeft>),
        b: &Operand<'_>,
        dst: &mut [f32],
        epilogue: Epilogue<'_>,
    ) {
        if m == 0 || n == 0 {
            return;
        }
        if n < NR && m > n {
            // A narrow product (a layer of one output): as dstᵀ = op(b)ᵀ·op(a)ᵀ
            // its long side fills the tiles' columns. Every output keeps its
            // chain (a product of two bf16 is the same either way round).
            let (at, bt) = (
                Operand { data: b.data, transposed: !b.transposed },
                Operand { data: a.data, transposed: !a.transposed },
            );
            if n == 1 {
                gemm(n, m, k, (&at, None), &bt, dst, Epilogue::default());
            } else {
                let mut transposed = vec![0f32; m * n];
                gemm(n, m, k, (&at, None), &bt, &mut transposed, Epilogue::default());
                for (j, column) in transposed.chunks_exact(m).enumerate() {
                    for (i, &v) in column.iter().enumerate() {
                        dst[i * n + j] = v;
                    }
                }
            }
            dst.chunks_exact_mut(n).for_each(|row| epilogue.row(0, row));
            return;
        }
        let pairs = k.div_ceil(2);
        if pairs == 0 {
            dst.fill(0.0);
            dst.chunks_exact_mut(n).for_each(|row| epilogue.row(0, row));
            return;
        }
        let (row_blocks, tiles) = (m.div_ceil(MR), n.div_ceil(NR));
        let (buf_a, buf_b) = super::BUFFERS.take();
        // The left operand as the caller packed it (`lent.rs`), or packed here.
        let packed = packed.filter(|p| p.fits(a, m, k));
        let own = match packed {
            Some(_) => PackedRows { data: buf_a, row_stride: 0, pair_stride: 0 },
            None => pack_rows(m, k, a, row_blocks * MR, Convert::Simd, buf_a),
        };
        let pa = packed.map_or(&own, |p| &p.rows);
        let pb = pack_cols(k, n, b, NR, Convert::Simd, buf_b);
        if row_blocks == 1 && tiles > 1 {
            // One row block (the narrow products, turned round): the panels
            // in parallel instead, each into its own tile of `c`.
            let mut c = vec![0f32; tiles * MR * NR];
            c.par_chunks_mut(MR * NR).enumerate().for_each(|(t, c_tile)| {
                for k0 in (0..pairs).step_by(KB) {
                    let kl = KB.min(pairs - k0);
                    let panel = &pb[(t * pairs + k0) * NR..][..kl * NR];
                    let a_block = &pa.data[k0 * pa.pair_stride..];
                    // SAFETY: the CPU has AVX-512F and AVX-512-BF16
                    // (`available` was checked before this path was taken).
                    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                    unsafe {
                        let width = NR.min(n - t * NR);
                        let a = (kl, a_block, (pa.row_stride, pa.pair_stride));
                        tile_of(width, a, panel, c_tile, k0 > 0, None)
                    };
                }
            });
            for (r, row) in dst.chunks_exact_mut(n).enumerate() {
                for (t, c_tile) in c.chunks_exact(MR * NR).enumerate() {
                    let width = NR.min(n - t * NR);
                    row[t * NR..][..width].copy_from_slice(&c_tile[r * NR..][..width]);
                }
                epilogue.row(0, row);
            }
            super::BUFFERS.set((own.data, pb));
            return;
        }
        // Tasks of a few row blocks, about four per thread. In a task, each
        // panel of NR columns is done in passes of KB pairs over all the
        // task's row blocks, the partial sums kept in `c` between passes
        // (each output's chain stays in order).
        let per_task = row_blocks.div_ceil(4 * rayon::current_num_threads()).clamp(1, 16);
        dst.par_chunks_mut(per_task * MR * n).enumerate().for_each(|(task, out)| {
            let rows = out.len() / n;
            let blocks = rows.div_ceil(MR);
            let first = task * per_task;
            // Partial sums: only where a tile takes more than one pass;
            // else every tile stores straight to `out` (at an edge, its
            // rows and columns inside it) and one scratch tile (never
            // read) stands in (zeroing the task's
            // whole buffer cost 1.5% of MMoE's bf16 step).
            let partial = pairs > KB;
            // The thread's own, not zeroed: a tile's first pass writes its
            // sums without reading them (a fresh zeroed buffer a task, its
            // allocation, zeroing and freeing, was 1.6% of MMoE's bf16 step).
            let mut c = super::TILE_SUMS.take();
            c.resize(c.len().max(if partial { blocks } else { 1 } * MR * NR), 0.0);
            for t in 0..tiles {
                let width = NR.min(n - t * NR);
                for k0 in (0..pairs).step_by(KB) {
                    let kl = KB.min(pairs - k0);
                    let panel = &pb[(t * pairs + k0) * NR..][..kl * NR];
                    for rb in 0..blocks {
                        let c_tile = &mut c[if partial { rb } else { 0 } * MR * NR..][..MR * NR];
                        let a_block = &pa.data[(first + rb) * MR * pa.row_stride + k0 * pa.pair_stride..];
                        let dst = (k0 + kl == pairs).then(|| Store {
                            dst: &mut out[rb * MR * n + t * NR..],
                            stride: n,
                            bias: epilogue.bias.map(|b| &b[t * NR..]),
                            relu: epilogue.relu,
                            rows: MR.min(rows - rb * MR),
                            cols: width,
                        });
                        // SAFETY: the CPU has AVX-512F and AVX-512-BF16
                        // (`available` was checked before this path was taken).
                        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                        unsafe {
                            let a = (kl, a_block, (pa.row_stride, pa.pair_stride));
                            tile_of(width, a, panel, c_tile, k0 > 0, dst)
                        };
                    }
                }
            }
            super::TILE_SUMS.set(c);
        });
        super::BUFFERS.set((own.data, pb));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift stream of `seed`.
    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut next = xorshift(seed);
        (0..len).map(|_| ((next() % 20_001) as f32 - 10_000.0) / 10_000.0 * scale).collect()
    }

    /// The definition: each output's chain of `dpbf16_portable` over its
    /// pairs, one output at a time (what the portable product was).
    fn chain_reference(m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>) -> Vec<f32> {
        let convert = Convert::Portable;
        let (pa, pb) = (pack_rows(m, k, &a, m, convert, Vec::new()), pack_cols(k, n, &b, n, convert, Vec::new()));
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k.div_ceil(2)).fold(0.0, |acc, p| {
                    let (x, y) = (pa.at(i, p), pb[p * n + j]);
                    crate::peak::dpbf16_portable(acc, [x as u16, (x >> 16) as u16], [y as u16, (y >> 16) as u16])
                });
            }
        }
        out
    }

    /// Values whose products fall below f32's normal range, beyond its
    /// range, cancel, or are denormal themselves: the portable product
    /// in its baseline and its AVX2 build, and the SIMD kernel where the CPU
    /// has it, give the chain of `dpbf16_portable` bit for bit.
    #[test]
    fn every_build_of_the_product_keeps_the_lanes_arithmetic_on_extreme_values() {
        let magnitudes = [0.0f32, 1e-39, 1e-30, 3e-20, 1e-19, 0.5, 1.0, 3.0, 1e19, 3e19, 1e30, f32::INFINITY];
        let pick = |seed: u64, len: usize| -> Vec<f32> {
            let mut next = xorshift(seed);
            (0..len)
                .map(|_| {
                    let s = next();
                    let m = magnitudes[(s % magnitudes.len() as u64) as usize] * (1.0 + (s >> 40) as f32 / 2e7);
                    if s & (1 << 20) == 0 { m } else { -m }
                })
                .collect()
        };
        let mut extremes = 0;
        for &(m, n, k) in &[(3, 19, 7), (16, 40, 64), (9, 33, 130)] {
            let (a, b) = (pick(m as u64 * 7 + 1, m * k), pick(n as u64 * 13 + 5, k * n));
            let (opa, opb) = (Operand { data: &a, transposed: false }, Operand { data: &b, transposed: false });
            let want = chain_reference(m, n, k, opa, opb);
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut portable = vec![f32::NAN; m * n];
            gemm_bf16_portable(Simd::Auto, m, n, k, opa, opb, &mut portable);
            assert_eq!(bits(&portable), bits(&want), "portable {m}x{n}x{k}");
            // The baseline build, whatever this CPU has.
            let pairs = k.div_ceil(2);
            let (pa, pb) = (
                pack_rows(m, k, &opa, m, Convert::Portable, Vec::new()),
                pack_cols(k, n, &opb, n, Convert::Portable, Vec::new()),
            );
            let (b_hi, b_lo): (Vec<f32>, Vec<f32>) = pb.iter().map(|&y| widen_pair(y)).unzip();
            let mut baseline = vec![f32::NAN; m * n];
            for (i, row) in baseline.chunks_mut(n).enumerate() {
                chain_row(row, (0..pairs).map(|p| widen_pair(pa.at(i, p))), &b_hi, &b_lo);
            }
            assert_eq!(bits(&baseline), bits(&want), "baseline build {m}x{n}x{k}");
            extremes += want.iter().filter(|x| !x.is_finite()).count();
            // The lanes' arithmetic is vdpbf16ps's: AMX's sums are its own.
            let mut fast = vec![f32::NAN; m * n];
            gemm_bf16(path(Simd::Avx512), m, n, k, opa, opb, &mut fast);
            if matches!(path(Simd::Avx512), Bf16Path::Rounded(_)) {
                // The fp32 kernel's arithmetic by design (no flush to zero).
                continue;
            }
            // NaNs (inf - inf) may differ in payload between the instruction and the lane: compare them as NaN.
            for (i, (x, y)) in fast.iter().zip(&want).enumerate() {
                assert!(x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan(), "simd {m}x{n}x{k} [{i}]: {x} vs {y}");
            }
        }
        assert!(extremes > 0, "no product reached an infinity");
    }

    /// The fp32 path's branchless rounding (`bf16_rounded`) is `bf16_daz(round_bf16(x))`
    /// on every kind of float.
    #[test]
    fn the_fp32_paths_rounding_is_the_definition() {
        let specials = [0.0f32, -0.0, 1e-40, -1e-40, 1.0, -1.5, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY];
        let mut next = xorshift(99);
        let randoms: Vec<f32> = (0..100_000).map(|_| f32::from_bits(next() as u32)).collect();
        for x in specials.into_iter().chain([f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)]).chain(randoms) {
            let (got, want) = (crate::bf16_rounded::rounded_f32(x), bf16_daz(round_bf16(x)));
            assert!(
                got.to_bits() == want.to_bits(),
                "{x:e} ({:#x}): {:#x} vs {:#x}",
                x.to_bits(),
                got.to_bits(),
                want.to_bits()
            );
        }
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

    /// Zeros, denormals (flushed to a signed zero, as `vcvtneps2bf16` does),
    /// ties, infinities and NaNs, then a sweep of bit patterns: the SIMD
    /// conversions (where the CPU has them) give the portable bits, in both
    /// layouts, at every tail length.
    #[test]
    fn simd_and_portable_conversions_agree_on_every_kind_of_float() {
        let mut values = vec![0.0f32, -0.0, 1e-40, -1e-40, f32::MIN_POSITIVE, -f32::MIN_POSITIVE * 0.999];
        values.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN]);
        values.extend([
            f32::MAX,
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x0080_8000),
            f32::from_bits(0x7fc0_0001),
        ]);
        values.extend((0..20_000u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        assert_eq!(round_bf16(1e-40), 0);
        assert_eq!(round_bf16(-1e-40), 0x8000);
        #[cfg(target_arch = "x86_64")]
        if simd::available(Simd::Auto) {
            for len in [values.len(), 1, 15, 16, 17, 31, 33, 47] {
                let src = &values[values.len() - len..];
                let mut fast = vec![0u32; len.div_ceil(2)];
                let mut reference = vec![1u32; len.div_ceil(2)];
                Convert::Simd.row_pairs(src, &mut fast);
                Convert::Portable.row_pairs(src, &mut reference);
                assert_eq!(fast, reference, "row_pairs, {len} values");
                let (even, odd) = src.split_at(len / 2);
                let mut fast = vec![0u32; len / 2];
                let mut reference = vec![1u32; len / 2];
                for with_odd in [true, false] {
                    let odd = with_odd.then_some(odd);
                    Convert::Simd.interleave(even, odd, &mut fast);
                    Convert::Portable.interleave(even, odd, &mut reference);
                    assert_eq!(fast, reference, "interleave, {len} values, odd: {with_odd}");
                }
            }
        }
    }

    /// The SIMD kernel (where the CPU has it) and the portable reference
    /// give the same bits, on shapes off the tile sizes, odd k, and every
    /// operand layout; and both are close to the f64 product of the
    /// bf16-rounded inputs.
    #[test]
    fn simd_and_portable_agree_bit_for_bit_and_match_f64() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 33, 5),
            (17, 40, 64),
            (20, 48, 37),
            (20, 49, 37),
            (64, 256, 429),
            (9, 1, 128),
            (300, 1, 33),
            (1024, 1, 128),
            (128, 1, 1024),
            (1024, 128, 1),
            (33, 17, 1),
            (17, 1, 1),
            (40, 3, 300),
            (512, 4, 32),
            (81, 12, 512),
            (300, 16, 81),
            (37, 7, 33),
            (130, 22, 81),
            (64, 24, 17),
            (64, 25, 40),
            (512, 81, 4),
            (70, 64, 7),
            (17, 40, 16),
            (20, 5, 3),
            (5, 0, 4),
            (6, 7, 0),
        ] {
            for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = random(m * k, (m * 31 + k) as u64, 1.5);
                let b = random(k * n, (n * 17 + k) as u64, 0.7);
                let (opa, opb) = (Operand { data: &a, transposed: at }, Operand { data: &b, transposed: bt });
                let mut reference = vec![0f32; m * n];
                gemm_bf16_portable(Simd::Auto, m, n, k, opa, opb, &mut reference);
                let chain = chain_reference(m, n, k, opa, opb);
                assert!(reference.iter().zip(&chain).all(|(x, y)| x.to_bits() == y.to_bits()), "{m}x{n}x{k} chain");
                // This CPU's path (AMX's where it has it), and AVX-512-BF16's.
                let mut fasts = Vec::new();
                for path in [path(Simd::Auto), path(Simd::Avx512)] {
                    let mut fast = vec![0f32; m * n];
                    gemm_bf16(path, m, n, k, opa, opb, &mut fast);
                    // The native kernel is the portable one bit for bit;
                    // AMX's and the fp32 kernel on rounded inputs (no
                    // AVX-512-BF16) are held to the same bound from the
                    // exact sum below.
                    if path == Bf16Path::Native {
                        for (i, (x, y)) in fast.iter().zip(&reference).enumerate() {
                            assert_eq!(x.to_bits(), y.to_bits(), "{m}x{n}x{k} t=({at},{bt}) [{i}]: {x} vs {y}");
                        }
                    }
                    // Bias and ReLU in the store: the product's values,
                    // passed through the same epilogue afterwards.
                    let bias = random(n, 7 + n as u64, 2.0);
                    let epilogue = Epilogue { bias: Some(&bias), relu: true };
                    let mut fused = vec![f32::NAN; m * n];
                    gemm_bf16_then(path, m, n, k, opa, opb, &mut fused, epilogue);
                    let mut then = fast.clone();
                    then.chunks_mut(n.max(1)).for_each(|row| epilogue.row(0, row));
                    for (i, (x, y)) in fused.iter().zip(&then).enumerate() {
                        assert_eq!(x.to_bits(), y.to_bits(), "epilogue {path:?} {m}x{n}x{k} t=({at},{bt}) [{i}]");
                    }
                    fasts.push(fast);
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
                        for got in [reference[i * n + j], fasts[0][i * n + j], fasts[1][i * n + j]] {
                            let got = f64::from(got);
                            let bound = 1e-5 * (1.0 + exact.abs()) * k as f64;
                            assert!((got - exact).abs() <= bound, "{got} vs {exact}");
                        }
                    }
                }
            }
        }
    }
}
