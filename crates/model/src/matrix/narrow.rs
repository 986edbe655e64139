//! The fp32 product for a narrow right-hand side: `n` ≤ 64 columns and
//! `k` from 3 to 512. DIN's attention unit (a few thousand history items
//! by `[2·d] → [36]`), the multi-task gates (`→ [experts]`), the experts
//! and the small stacks' layers, and their weights' gradients (`xᵀ·g` over
//! a batch's rows) have these shapes, where the `gemm` crate spends as
//! long packing and dispatching as it does multiplying (its kernel ran DIN's
//! `[3379, 16]·[16, 36]` at 70 GFLOP/s on an AVX-512 Xeon; this one at 120).
//!
//! Each output row is `R` rows' worth of accumulators held in AVX-512
//! registers, one per 16 columns (`NV` of them), summed over `k` in order,
//! one fused multiply-add a step from zero: the operations `gemm`'s kernel
//! does for a `k` within one of its blocks (it never cuts `k` below 512),
//! so the product has its bits (tested against it). A transposed left-hand
//! side is read with its strides; a transposed right-hand side is laid out
//! first, on every CPU (`gemm` would sum some such shapes as dot products
//! in lanes: laid out, the bits are the same with this kernel or without),
//! 16×16 tiles at a time: laid out and multiplied here, `[128, 64]·[64,
//! 64]ᵀ` took 9.9 µs on a Zen 4, 10.8 in `gemm` reading it transposed.
//! A `k` below 3 and a single row, where `gemm`'s bits differ (it takes
//! other paths), stay with it. A CPU with AVX2 and FMA but not AVX-512F
//! (a Zen 3) runs the same sums on 8-lane vectors (`narrow/avx2.rs`);
//! one with neither leaves every product to `gemm`.

use rayon::prelude::*;

use sparrow_core::simd::Simd;

use super::Epilogue;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// The widest right-hand side taken here (four 16-lane accumulators a
/// row). At 64 columns this kernel is still faster than `gemm`'s (a Zen
/// 4, one thread: `[128, 64]·[64, 64]` 9.2 µs against 9.8, `[64, 128]ᵀ·
/// [128, 64]` 9.1 against 10.0, `[81, 512]ᵀ·[512, 64]` 46.5 against 48.6).
const MAX_N: usize = 64;

/// The most rows of a transposed left-hand side (a layer's inputs, for its
/// weights' gradient): past it `gemm`, reading `b` once for many rows, is
/// faster (221 rows by 32 columns: 23 µs against 28).
const MAX_M_TRANSPOSED: usize = 128;
/// The deepest: `gemm` sums a `k` up to here in one block on every CPU.
const MAX_K: usize = 512;
/// The most of `b` a pass over the rows reads (a slice of `k`, the rest
/// read by the next pass): a weights' gradient's `[512, 64]` is 128 KiB,
/// read from the second-level cache once a row block, and the sum over
/// `k` is cut in slices that fit the first (`[81, 512]ᵀ·[512, 64]`, one
/// thread, an AVX-512 Xeon with AMX, alternated: 47 µs whole, 37.5 in
/// slices of 24 KiB; 16 and 32 KiB no better).
const SLICE_BYTES: usize = 24 << 10;
/// A `b` up to this size is read whole: `[128, 64]` (32 KiB) in two slices
/// ran up to 6% slower than whole (the slice's sums stored and taken up
/// again for little gain where `b` fits the first-level cache anyway).
const WHOLE_BYTES: usize = 40 << 10;
/// Rows a parallel task takes are a multiple of every kernel's row block.
const ROW_BLOCK: usize = 24;

/// Whether a product of this shape is this module's to compute.
pub(super) fn fits(m: usize, n: usize, k: usize, a_transposed: bool) -> bool {
    let rows = if a_transposed { 2..=MAX_M_TRANSPOSED } else { 2..=usize::MAX };
    rows.contains(&m) && (2..=MAX_N).contains(&n) && (3..=MAX_K).contains(&k)
}

/// `b` (`n×k` row-major, a transposed operand) laid out as `k×n` in
/// `laid` (resized to that; every value is written, so a buffer kept
/// between products needs no clearing). Where the CPU has AVX-512F, 16×16
/// tiles transposed in registers (`[41, 64]` took 1.55 µs an element at a
/// time in a new buffer, a sixth of the product it feeds); where it has
/// AVX2, 8×8 tiles (`avx2::transpose`); elsewhere a column of `b` at a
/// time written across the rows. Only values move: the same result on
/// every CPU.
pub(super) fn laid_out(simd: Simd, b: &[f32], n: usize, k: usize, laid: &mut Vec<f32>) {
    laid_out_on(kernel(simd), b, n, k, laid);
}

/// A build's transpose: `b` (`n×k`) laid out `k×n` at the pointer given.
#[cfg(target_arch = "x86_64")]
type Transpose = unsafe fn(*const f32, (usize, usize), *mut f32);

/// [`laid_out`] on `kernel` (one the CPU has), or a value at a time.
fn laid_out_on(kernel: Option<Kernel>, b: &[f32], n: usize, k: usize, laid: &mut Vec<f32>) {
    assert_eq!(b.len(), n * k, "laid_out: b is not n×k");
    laid.resize(k * n, 0.0);
    let laid = &mut laid[..k * n];
    #[cfg(target_arch = "x86_64")]
    {
        // Each build's tiles, where the CPU has it.
        let tiles: Option<Transpose> = match kernel {
            Some(Kernel::Avx512) if avx512f() => Some(x86::transpose),
            Some(Kernel::Avx2) if avx2_fma() => Some(avx2::transpose),
            Some(kernel) => panic!("a transpose on {kernel:?}, which the CPU does not have"),
            None => None,
        };
        if let Some(tiles) = tiles {
            // SAFETY: the kernel's features were detected just above; `b`
            // is `n×k` (asserted) and `laid` `k×n`, as each requires.
            #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
            unsafe {
                tiles(b.as_ptr(), (n, k), laid.as_mut_ptr())
            };
            return;
        }
    }
    // Elsewhere no kernel is ever detected.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    // Dividing each index by `n` made this copy 2% of a multi-task step.
    for (j, column) in b.chunks_exact(k.max(1)).take(n).enumerate() {
        for (at, &v) in laid[j..].iter_mut().step_by(n).zip(column) {
            *at = v;
        }
    }
}

/// `dst (m×n) = op(a)·b` (`a` `m×k`, stored `k×m` when transposed; `b`
/// `k×n` as stored) where [`fits`] and the CPU has a [`Kernel`], on up to
/// `threads` threads above the size `gemm` would split; false (nothing
/// written) elsewhere.
pub(super) fn product(
    simd: Simd,
    (m, n, k): (usize, usize, usize),
    (a, a_transposed): (&[f32], bool),
    b: &[f32],
    dst: &mut [f32],
    threads: usize,
) -> bool {
    product_on(kernel(simd), (m, n, k), (a, a_transposed), b, (dst, Epilogue::default()), threads)
}

/// [`product`] on `kernel` (one the CPU has; none: false), each output
/// through `then` as it is stored (`relu`: `max(v, +0)`, which is
/// `Epilogue::row`'s `v > 0 ? v : 0` and `f32::max`'s bits, NaN and −0
/// becoming +0).
pub(super) fn product_on(
    kernel: Option<Kernel>,
    (m, n, k): (usize, usize, usize),
    (a, a_transposed): (&[f32], bool),
    b: &[f32],
    (dst, then): (&mut [f32], Epilogue<'_>),
    threads: usize,
) -> bool {
    let Some(kernel) = kernel else { return false };
    if !fits(m, n, k, a_transposed) {
        return false;
    }
    assert!(then.bias.is_none_or(|bias| bias.len() == n), "narrow product: a bias of {n} columns");
    // Element (i, p) of op(a) sits at i·rs + p·cs.
    let lhs = if a_transposed { Lhs { data: a, rs: 1, cs: m } } else { Lhs { data: a, rs: k, cs: 1 } };
    if threads > 1 && m * n * k >= 1 << 20 {
        let rows = m.div_ceil(threads).next_multiple_of(ROW_BLOCK);
        let parts = dst.par_chunks_mut(rows * n).enumerate();
        parts.for_each(|(t, d)| rows_for_cpu(kernel, n, k, lhs, t * rows, b, (d, then)));
    } else {
        rows_for_cpu(kernel, n, k, lhs, 0, b, (dst, then));
    }
    true
}

/// A left-hand side and its strides.
#[derive(Clone, Copy)]
struct Lhs<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// Whether the CPU has AVX-512F.
pub(super) fn avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// The build of the kernel a CPU runs: AVX-512F's 16-lane vectors, or
/// AVX2's 8 with FMA. Each sums every output the same way: the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    Avx512,
    Avx2,
}

/// The widest [`Kernel`] the CPU has, if any; at most AVX2's where `simd`
/// says `avx2` (as a CPU without AVX-512F runs it: the same bits).
pub(super) fn kernel(simd: Simd) -> Option<Kernel> {
    if avx512f() && !simd.products_at_most_avx2() {
        return Some(Kernel::Avx512);
    }
    avx2_fma().then_some(Kernel::Avx2)
}

/// Whether the CPU has AVX2 and FMA (the products take the widest kernel
/// whatever `train.simd` says: each has `gemm`'s bits).
fn avx2_fma() -> bool {
    crate::columns::avx2_fma(sparrow_core::simd::Simd::Auto)
}

/// Rows `first..` of `a` (as many as `out` holds) times `b` (`k×n`), on `kernel`.
fn rows_for_cpu(
    kernel: Kernel,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    first: usize,
    b: &[f32],
    (out, then): (&mut [f32], Epilogue<'_>),
) {
    assert!((1..=MAX_N).contains(&n) && k > 0, "narrow product: n {n}, k {k}");
    assert_eq!(b.len(), k * n, "narrow product: rhs size");
    assert_eq!(out.len() % n, 0, "narrow product: dst size");
    let rows = out.len() / n;
    if rows == 0 {
        return;
    }
    let last = (first + rows - 1) * a.rs + (k - 1) * a.cs;
    assert!(last < a.data.len(), "narrow product: lhs size");
    #[cfg(target_arch = "x86_64")]
    {
        if kernel == Kernel::Avx2 {
            assert!(avx2_fma(), "narrow product without AVX2 and FMA");
            // SAFETY: AVX2 and FMA were detected just above; `a`, `b`, the
            // bias and `out` are read and written as for AVX-512 below.
            #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
            unsafe {
                let a = (a.data.as_ptr().add(first * a.rs), a.rs, a.cs);
                let out = (out.as_mut_ptr(), then.bias.map(<[f32]>::as_ptr), then.relu);
                avx2::rows((rows, n, k), a, b.as_ptr(), out);
            }
            return;
        }
        assert!(avx512f(), "narrow product without AVX-512F");
        // SAFETY: AVX-512F was detected just above. The kernels read `a` at
        // `(first + r)·rs + p·cs` for `r < rows`, `p < k`, whose largest is
        // `last`, asserted inside `a`; `b` at `p·n + c` for `c < n` (`b` is
        // `k×n`, asserted); and write `out` at `r·n + c` (`out` is `rows×n`).
        // `NV` is `n`'s count of 16-lane vectors, as each kernel requires;
        // a bias holds `n` values (asserted by `product_on`).
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let a = (a.data.as_ptr().add(first * a.rs), a.rs, a.cs);
            let out = (out.as_mut_ptr(), then.bias.map(<[f32]>::as_ptr), then.relu);
            // As many rows a block as the 32 registers hold: `R·NV`
            // accumulators, `NV` of `b` and a broadcast (a remainder block
            // takes at most 11 rows). One thread, an AVX-512 Xeon with AMX,
            // alternated:
            // - two to four vectors a row: 16 and 18 accumulators (four and
            //   six rows) ran 5–14% slower than 24 (`[128, 64]·[64, 64]`
            //   6.6–7.0 µs against 6.1–6.2; `[128, 41]·[41, 48]` 3.3 against
            //   2.9–3.0; `[64, 512]ᵀ·[512, 64]` 27.5–27.8 against 24–26); an
            //   earlier CPU ran four rows of four vectors no slower than six;
            // - one vector a row: 12 rows ran 3–12% faster than 8 (`[128,
            //   41]·[41, 5]` 1.43 µs against 1.28–1.33, `[128, 64]·[64, 16]`
            //   2.19–2.26 against 2.00–2.08).
            match n.div_ceil(16) {
                1 => x86::rows::<1, 12>((rows, n, k), a, b.as_ptr(), out),
                2 => x86::rows::<2, 8>((rows, n, k), a, b.as_ptr(), out),
                3 => x86::rows::<3, 8>((rows, n, k), a, b.as_ptr(), out),
                _ => x86::rows::<4, 6>((rows, n, k), a, b.as_ptr(), out),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("narrow product without a kernel: {kernel:?}");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `laid[p·n + j] = b[j·k + p]` for `j < n`, `p < k`: 16×16 tiles, each
    /// 16 rows of `b` loaded (masked past `n` and `k`), transposed in
    /// registers (`pairs::transpose`, the bf16 packing's) and stored as 16
    /// rows of `laid` (masked likewise).
    ///
    /// # Safety
    /// AVX-512F; `b` readable for `n·k` values, `laid` writable for `k·n`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn transpose(b: *const f32, (n, k): (usize, usize), laid: *mut f32) {
        for j0 in (0..n).step_by(16) {
            let columns = crate::pairs::lanes(n - j0);
            for p0 in (0..k).step_by(16) {
                let along = crate::pairs::lanes(k - p0);
                // Floats moved as the dwords they are (the casts are free).
                let mut r = [_mm512_setzero_si512(); 16];
                for (i, r) in r.iter_mut().enumerate().take((n - j0).min(16)) {
                    // SAFETY: row `j0 + i` < n, lanes masked to `p0 + l` < k.
                    *r = _mm512_castps_si512(unsafe { _mm512_maskz_loadu_ps(along, b.add((j0 + i) * k + p0)) });
                }
                crate::pairs::transpose(&mut r);
                for (l, t) in r.iter().enumerate().take((k - p0).min(16)) {
                    // SAFETY: row `p0 + l` < k of `laid`, lanes masked to `j0 + i` < n.
                    unsafe { _mm512_mask_storeu_ps(laid.add((p0 + l) * n + j0), columns, _mm512_castsi512_ps(*t)) };
                }
            }
        }
    }

    /// `out[r] = a[r]·b` for each of `m` rows: `R` rows at a time, each
    /// row's `n` outputs in `NV` registers (the last masked to `n`'s tail),
    /// then the rows left (fewer than `R`, at most 11) as one block of their
    /// own. Row by row, each step would wait on the one before: DIN's
    /// items' gradient, 16 rows by 36 columns, spent a third of its time on
    /// its last 4 that way.
    ///
    /// `out.1`, where given, is a bias added to each output row, and
    /// `out.2` a ReLU after it (`max(v, +0)`), before each store.
    ///
    /// # Safety
    /// AVX-512F; `NV = ⌈n/16⌉`; `a.0` readable at `r·a.1 + p·a.2` for
    /// `r < m`, `p < k`; `b` at `p·n + c`, a bias at `c`, and `out`
    /// writable at `r·n + c` for `c < n`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn rows<const NV: usize, const R: usize>(
        (m, n, k): (usize, usize, usize),
        (a, rs, cs): (*const f32, usize, usize),
        b: *const f32,
        (out, bias, relu): (*mut f32, Option<*const f32>, bool),
    ) {
        let tail = n - (NV - 1) * 16;
        let mut masks = [u16::MAX; NV];
        masks[NV - 1] = if tail == 16 { u16::MAX } else { (1u16 << tail) - 1 };
        // The bias in registers, masked past `n` (zeros there go unstored).
        let mut add = None;
        if let Some(bias) = bias {
            // SAFETY: the bias holds `n` values, lanes masked to them.
            add = Some(std::array::from_fn(|v| unsafe { _mm512_maskz_loadu_ps(masks[v], bias.add(v * 16)) }));
        }
        const { assert!(R <= 12, "a remainder past 11 rows has no block below") };
        let full = m / R * R;
        // `b` a slice of `k` at a time that stays in the core's first-level
        // cache while every row block reads it: each block stores its sums
        // after a slice and takes them up again for the next, the same
        // chain of fused multiply-adds (a float stored and loaded is the
        // same float), the bias and ReLU after the last slice only.
        let slice = if 4 * n * k <= super::WHOLE_BYTES { k } else { (super::SLICE_BYTES / (4 * n)).max(1) };
        let mut p0 = 0;
        while p0 < k {
            let along = slice.min(k - p0);
            let last = p0 + along == k;
            let then = Store { masks, add: add.filter(|_| last), relu: relu && last, resume: p0 > 0 };
            // SAFETY: every block's rows are below `m` and its `p` below
            // `k`, as the caller guarantees for `a`, `b` and `out`.
            unsafe {
                let (a, b) = (a.add(p0 * cs), b.add(p0 * n));
                for r0 in (0..full).step_by(R) {
                    block::<NV, R>((n, along), (a.add(r0 * rs), rs, cs), b, out.add(r0 * n), then);
                }
                let (a, out) = (a.add(full * rs), out.add(full * n));
                match m - full {
                    0 => {}
                    1 => block::<NV, 1>((n, along), (a, rs, cs), b, out, then),
                    2 => block::<NV, 2>((n, along), (a, rs, cs), b, out, then),
                    3 => block::<NV, 3>((n, along), (a, rs, cs), b, out, then),
                    4 => block::<NV, 4>((n, along), (a, rs, cs), b, out, then),
                    5 => block::<NV, 5>((n, along), (a, rs, cs), b, out, then),
                    6 => block::<NV, 6>((n, along), (a, rs, cs), b, out, then),
                    7 => block::<NV, 7>((n, along), (a, rs, cs), b, out, then),
                    8 => block::<NV, 8>((n, along), (a, rs, cs), b, out, then),
                    9 => block::<NV, 9>((n, along), (a, rs, cs), b, out, then),
                    10 => block::<NV, 10>((n, along), (a, rs, cs), b, out, then),
                    // Fewer than `R` ≤ 12 rows are left (asserted above).
                    _ => block::<NV, 11>((n, along), (a, rs, cs), b, out, then),
                }
            }
            p0 += along;
        }
    }

    /// How a block stores its rows: the vectors' lanes below `n`, then
    /// (where given) a bias to add and a ReLU.
    #[derive(Clone, Copy)]
    struct Store<const NV: usize> {
        masks: [u16; NV],
        add: Option<[__m512; NV]>,
        relu: bool,
        /// Whether the sums start from the outputs stored (a slice of `k`
        /// after the first), not from zero.
        resume: bool,
    }

    /// `out[r] = a[r]·b` for `R` rows, summed over `k` in order, one fused
    /// multiply-add a step from zero, then through `then` as stored.
    ///
    /// # Safety
    /// As [`rows`], for `m` = `R`; `then.masks` are the vectors' lanes below `n`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    #[expect(clippy::needless_range_loop, reason = "row and vector indices pick registers in step")]
    unsafe fn block<const NV: usize, const R: usize>(
        (n, k): (usize, usize),
        (a, rs, cs): (*const f32, usize, usize),
        b: *const f32,
        out: *mut f32,
        then: Store<NV>,
    ) {
        let masks = then.masks;
        // SAFETY: the rows read and written are below `R` and `p < k`,
        // within what the caller guarantees; `b`'s and `out`'s lanes at or
        // past `n` are masked off (not accessed).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            if then.resume {
                for r in 0..R {
                    for v in 0..NV {
                        acc[r][v] = _mm512_maskz_loadu_ps(masks[v], out.add(r * n + v * 16));
                    }
                }
            }
            for p in 0..k {
                let mut bv = [_mm512_setzero_ps(); NV];
                for v in 0..NV {
                    bv[v] = _mm512_maskz_loadu_ps(masks[v], b.add(p * n + v * 16));
                }
                for r in 0..R {
                    let x = _mm512_set1_ps(*a.add(r * rs + p * cs));
                    for v in 0..NV {
                        acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
                    }
                }
            }
            for r in 0..R {
                for v in 0..NV {
                    let mut sum = acc[r][v];
                    if let Some(add) = then.add {
                        sum = _mm512_add_ps(sum, add[v]);
                    }
                    if then.relu {
                        // +0 where `sum` is NaN or either zero: `vmaxps`
                        // returns its second operand there, as `f32::max`.
                        sum = _mm512_max_ps(sum, _mm512_setzero_ps());
                    }
                    _mm512_mask_storeu_ps(out.add(r * n + v * 16), masks[v], sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::tests::{same_bits, values};
    use crate::matrix::{Operand, sgemm_threads};

    fn by_gemm(m: usize, n: usize, k: usize, (a, a_t): (&[f32], bool), b: &[f32]) -> Vec<f32> {
        let mut dst = vec![f32::NAN; m * n];
        super::super::gemm_product((m, n, k), (a, a_t), (b, false), &mut dst, 1);
        dst
    }

    /// Every build of the kernel this CPU has: an AVX-512 machine runs the
    /// AVX2 build's tests too.
    fn kernels() -> Vec<Kernel> {
        let mut all = Vec::new();
        if avx512f() {
            all.push(Kernel::Avx512);
        }
        if avx2_fma() {
            all.push(Kernel::Avx2);
        }
        all
    }

    #[test]
    fn the_widest_kernel_the_cpu_has_is_taken() {
        assert_eq!(kernel(Simd::Auto), kernels().first().copied());
        assert_eq!(kernel(Simd::Avx2), avx2_fma().then_some(Kernel::Avx2), "avx2: at most AVX2's build");
        let named = match kernels().first() {
            Some(Kernel::Avx512) => "avx512",
            Some(Kernel::Avx2) => "avx2",
            None => "gemm",
        };
        assert_eq!(crate::matrix::narrow_kernel(Simd::Auto), named);
        let (m, n, k) = (9, 20, 16);
        let mut dst = vec![f32::NAN; m * n];
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        assert_eq!(product(Simd::Auto, (m, n, k), (&a, false), &b, &mut dst, 1), kernel(Simd::Auto).is_some());
    }

    #[test]
    fn a_narrow_product_has_the_bits_of_gemm() {
        let mut products = 0;
        for m in [2, 3, 7, 9, 10, 11, 14, 23, 25, 64, 128, 257] {
            for n in 2..=MAX_N + 2 {
                for k in [3, 4, 16, 17, 41, 64, 97, 256, MAX_K] {
                    let (a, b) = (values(m * k, 1), values(k * n, 2));
                    for a_t in [false, true] {
                        let expected = by_gemm(m, n, k, (&a, a_t), &b);
                        for kernel in kernels() {
                            let mut dst = vec![f32::NAN; m * n];
                            let taken =
                                product_on(Some(kernel), (m, n, k), (&a, a_t), &b, (&mut dst, Epilogue::default()), 1);
                            let what = format!("{kernel:?}, m {m} n {n} k {k} transposed a {a_t}");
                            assert_eq!(taken, fits(m, n, k, a_t), "{what}");
                            if !taken {
                                continue;
                            }
                            products += 1;
                            assert!(same_bits(&expected, &dst), "{what}: not gemm's bits");
                        }
                    }
                }
            }
        }
        assert_eq!(products > 0, kernel(Simd::Auto).is_some(), "products taken: {products}");
    }

    /// Each build's bias and ReLU, stored with the last slice of `k` (a
    /// `b` past `WHOLE_BYTES`, summed in slices, too), against `gemm`'s
    /// product and then the pass after it: −0 sums and biases, a NaN row,
    /// columns past the last whole vector of either build.
    #[test]
    fn each_build_stores_through_the_bias_and_relu_as_the_pass_after_gemm() {
        let mut products = 0;
        for (m, n, k) in [(7, 5, 41), (128, 64, 41), (30, 41, 64), (25, 17, 3), (13, 36, 512), (40, 64, 256)] {
            let (mut a, b) = (values(m * k, 3), values(k * n, 4));
            let mut bias = values(n, 5);
            bias[1] = -0.0;
            a[..k].iter_mut().for_each(|v| *v = -0.0);
            a[k] = f32::NAN;
            for relu in [false, true] {
                let mut want = by_gemm(m, n, k, (&a, false), &b);
                let then = Epilogue { bias: Some(&bias), relu };
                want.chunks_exact_mut(n).for_each(|row| then.row(0, row));
                for kernel in kernels() {
                    let mut got = vec![f32::NAN; m * n];
                    assert!(product_on(Some(kernel), (m, n, k), (&a, false), &b, (&mut got, then), 1));
                    products += 1;
                    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                        let same = x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
                        assert!(same, "{kernel:?}, m {m} n {n} k {k} relu {relu}, output {i}: {x} against {y}");
                    }
                }
            }
        }
        assert_eq!(products > 0, kernel(Simd::Auto).is_some(), "products taken: {products}");
    }

    #[test]
    fn a_transposed_right_hand_side_gives_the_bits_of_it_laid_out() {
        // gemm alone sums some of these (few rows, few columns) in lanes.
        for (m, n, k) in [
            (2, 3, 16),
            (7, 2, 41),
            (25, 9, 64),
            (64, 4, 128),
            (300, 41, 64),
            (2, 60, 16),
            (7, 50, 41),
            (3, 64, 3),
            (128, 64, 64),
        ] {
            let (a, b_t) = (values(m * k, 5), values(n * k, 6));
            let mut via_t = vec![f32::NAN; m * n];
            sgemm_threads(Simd::Auto, m, n, k, Operand::plain(&a), Operand::t(&b_t), &mut via_t, 1);
            // Laid out here by hand: element (p, j) of b is b_t[j][p].
            let mut laid = vec![f32::NAN; k * n];
            for p in 0..k {
                for j in 0..n {
                    laid[p * n + j] = b_t[j * k + p];
                }
            }
            assert!(same_bits(&via_t, &by_gemm(m, n, k, (&a, false), &laid)), "m {m} n {n} k {k}");
        }
    }

    #[test]
    fn laid_out_moves_every_value_to_its_place() {
        // Whole tiles, tails of every size along both sides, and fewer
        // than 8 or 16 of either; on every build the CPU has, and a value
        // at a time.
        let shapes =
            [(16, 16), (41, 64), (64, 64), (5, 64), (41, 5), (1, 3), (17, 33), (48, 512), (3, 1), (8, 8), (9, 15)];
        for kernel in kernels().into_iter().map(Some).chain([None]) {
            for (n, k) in shapes {
                let b = values(n * k, 9);
                let mut laid = vec![f32::NAN; 3];
                laid_out_on(kernel, &b, n, k, &mut laid);
                assert_eq!(laid.len(), n * k);
                for j in 0..n {
                    for p in 0..k {
                        let what = format!("{kernel:?}, n {n} k {k}: ({p}, {j})");
                        assert_eq!(laid[p * n + j].to_bits(), b[j * k + p].to_bits(), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_nan_or_an_infinity_reaches_the_outputs_it_reaches_in_gemm() {
        // A non-finite input is the gradient check's to report: the product
        // passes it on where gemm's does, and leaves every other output as
        // gemm's.
        let (m, n, k) = (9, 20, 16);
        let mut a = values(m * k, 7);
        let b = values(k * n, 8);
        a[3 * k + 5] = f32::NAN;
        a[6 * k + 2] = f32::INFINITY;
        let expected = by_gemm(m, n, k, (&a, false), &b);
        for kernel in kernels() {
            let mut dst = vec![0.0; m * n];
            assert!(product_on(Some(kernel), (m, n, k), (&a, false), &b, (&mut dst, Epilogue::default()), 1));
            for (i, (x, y)) in expected.iter().zip(&dst).enumerate() {
                assert_eq!(x.is_nan(), y.is_nan(), "{kernel:?}, output {i}: {x} against gemm's {y}");
                assert!(x.is_nan() || x.to_bits() == y.to_bits(), "{kernel:?}, output {i}: {x} against gemm's {y}");
            }
            assert!(dst[3 * n..4 * n].iter().all(|v| v.is_nan()) && dst[6 * n..7 * n].iter().all(|v| !v.is_finite()));
        }
    }

    #[test]
    fn split_over_threads_it_has_the_same_bits() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool of 3 threads");
        for ((m, n, k), a_t) in [((3379, 36, 16), false), ((MAX_M_TRANSPOSED, 36, MAX_K), true)] {
            let (a, b) = (values(m * k, 3), values(k * n, 4));
            let expected = by_gemm(m, n, k, (&a, a_t), &b);
            for kernel in kernels() {
                let mut dst = vec![f32::NAN; m * n];
                let then = (&mut dst[..], Epilogue::default());
                assert!(pool.install(|| product_on(Some(kernel), (m, n, k), (&a, a_t), &b, then, 3)));
                assert!(same_bits(&expected, &dst), "{kernel:?}, m {m} n {n} k {k}");
            }
        }
    }

    #[test]
    fn shapes_gemm_sums_otherwise_stay_with_it() {
        assert!(!fits(1, 16, 16, false), "one row: gemm's vector path");
        assert!(!fits(64, 16, 2, false) && !fits(64, 16, 1, false), "k below 3: gemm's bits differ");
        assert!(!fits(64, 16, MAX_K + 1, false), "gemm cuts k past 512");
        assert!(!fits(64, MAX_N + 1, 16, false) && !fits(MAX_M_TRANSPOSED + 1, 16, 16, true), "gemm is as fast");
        assert!(fits(2, 2, 3, false) && fits(5000, MAX_N, MAX_K, false) && fits(MAX_M_TRANSPOSED, 2, 3, true));
    }
}
