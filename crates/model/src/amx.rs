//! bf16 matrix products on AMX, the CPU's tile unit (`amx_bf16`: Intel
//! Sapphire Rapids and later). Where a CPU has it, `model.precision =
//! "bf16"` runs its products here (`Bf16Path::Amx`); `train.simd =
//! "avx512"` keeps AVX-512-BF16's `vdpbf16ps` instead, for comparison.
//!
//! Both operands are rounded to bf16 as `vdpbf16ps`'s path rounds them,
//! and packed into tiles of 16 rows × 16 bf16 pairs (1 KB each, k padded
//! with zeros to a multiple of 32, rows and columns to a multiple of 32).
//! A block of 2×2 tiles (32×32 outputs) then runs `tdpbf16ps` over all of k
//! in one pass, its sums in the tile registers. Each output is one chain of
//! `tdpbf16ps`, over k's 32-value chunks in order. Its value depends only on
//! its row of `op(a)` and its column of `op(b)`, so neither the blocking,
//! the threads nor the product's other rows change it. The instruction sums
//! a chunk's 32 products in an order of its own, not a chain of pairs (measured
//! here: 129 of 256 outputs equal the correctly rounded sum, fewer each
//! pairwise chain). So this path's bits are AMX's, not those of
//! `vdpbf16ps` or the portable kernel. The accuracy is the same: fp32 sums
//! of exact products of bf16 values.
//!
//! The CPU must say so (CPUID: AMX-TILE, AMX-BF16, the 16×64-byte palette),
//! and Linux must grant the process the tiles' state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), asked once. Where it refuses (a
//! kernel before 5.16, a sandbox), bf16 stays on AVX-512-BF16, and the
//! refusal is named ([`refusal`]). The tile instructions are written with
//! stable inline assembly: no C++ library, and the arithmetic is the
//! instruction's alone (oneDNN would pick its own blocking and
//! k-splitting by shape and threads).

use std::sync::atomic::AtomicBool;

use sparrow_core::simd::Simd;

use crate::matrix::{Epilogue, Operand};

/// Whether bf16 products may run on AMX here under `simd`: the CPU has
/// it and Linux granted the tiles (asked once a process).
pub fn available(simd: Simd) -> bool {
    simd.allows_amx() && grant().is_ok()
}

/// Why a CPU that has AMX cannot use it here (the kernel refused the
/// tiles' state); None where it can, or where the CPU has no AMX.
pub fn refusal() -> Option<String> {
    match grant() {
        Err(Refused::ByKernel(why)) => Some(why),
        _ => None,
    }
}

/// The smallest product AMX takes: smaller ones (a layer of one output,
/// an outer product) stay on `vdpbf16ps`, chosen by shape alone so that a
/// product always takes the same path.
pub(crate) fn takes(m: usize, n: usize, k: usize) -> bool {
    m >= 16 && n >= 16 && k >= 16
}

#[derive(Clone)]
enum Refused {
    /// No AMX-BF16 on this CPU (or not the tile palette written for).
    NoCpu,
    ByKernel(String),
}

thread_local! {
    /// This thread's answer from [`grant`]: asked once a thread (the
    /// kernel's grant is the process's, and asking again is granted again).
    static GRANT: std::cell::OnceCell<Result<(), Refused>> = const { std::cell::OnceCell::new() };
}

/// Whether the CPU has AMX and Linux granted the process its tiles.
fn grant() -> Result<(), Refused> {
    GRANT.with(|grant| {
        grant
            .get_or_init(|| {
                #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                {
                    if !x86::cpu_has_amx() {
                        return Err(Refused::NoCpu);
                    }
                    x86::request_tiles().map_err(Refused::ByKernel)
                }
                #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
                Err(Refused::NoCpu)
            })
            .clone()
    })
}

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` on AMX, through `epilogue`, on
/// the current rayon pool, or on this thread alone where `threads` is 1
/// (a caller running two products side by side); false (nothing written)
/// where AMX is not granted or the product is too small for it ([`takes`]).
#[expect(clippy::too_many_arguments, reason = "a matrix product's shape, operands, epilogue and threads")]
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: &Operand<'_>,
    b: &Operand<'_>,
    dst: &mut [f32],
    epilogue: Epilogue<'_>,
    threads: Option<usize>,
) -> bool {
    if !takes(m, n, k) || grant().is_err() {
        return false;
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        x86::gemm((m, n, k), Left::Values(*a, None), Right::Values(*b), Out::Values(dst, epilogue), min_len(threads));
        true
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = (a, b, dst, epilogue, threads);
        false
    }
}

/// The shortest run rayon may split off: all of it, on one thread, where
/// `threads` is 1.
fn min_len(threads: Option<usize>) -> usize {
    if threads == Some(1) { usize::MAX } else { 1 }
}

/// bf16 tiles a product keeps for later products (see [`Out::Packed`]),
/// their buffers reused from step to step.
#[derive(Default)]
pub(crate) struct Packed {
    lines: Vec<Line>,
    /// Dwords written by the last product that kept them.
    len: usize,
}

impl Packed {
    #[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux")), expect(dead_code))]
    fn resized(&mut self, len: usize) -> &mut [u32] {
        self.len = len;
        dwords(&mut self.lines, len)
    }

    /// The first `len` dwords, which a product must have kept.
    #[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux")), expect(dead_code))]
    fn tiles(&self, len: usize) -> &[u32] {
        assert!(len <= self.len, "{len} dwords of tiles read where a product kept {}", self.len);
        // SAFETY: as in `dwords`; `len` dwords lie within the lines (asserted).
        #[expect(unsafe_code, reason = "viewing aligned lines of dwords as dwords")]
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr().cast::<u32>(), len)
        }
    }
}

/// A product's left operand.
pub(crate) enum Left<'a> {
    /// fp32 values, packed by the product; a plain one's blocks also kept
    /// as its transpose's tiles where given (a layer's input `x`, for its
    /// weight gradient `xᵀ·g`).
    Values(Operand<'a>, Option<&'a mut Packed>),
    /// Tiles an earlier product kept: its [`Kept::rows`], or its
    /// [`Kept::across`] made `transposed`.
    Packed(&'a Packed),
}

/// A product's right operand.
pub(crate) enum Right<'a> {
    Values(Operand<'a>),
    /// An earlier product's [`Kept::across`], not `transposed`.
    Packed(&'a Packed),
}

/// Where a product's outputs go.
pub(crate) enum Out<'a> {
    /// fp32 values through the epilogue.
    Values(&'a mut [f32], Epilogue<'a>),
    /// bf16 tiles only, through a ReLU: a hidden layer's output, or the
    /// gradient at one, kept for the products that read it next.
    Packed(Kept<'a>),
    /// fp32 values with no epilogue, each task then checking that the rows
    /// it wrote are all finite while they are in its core's cache (a pass
    /// of its own after the product read them back from memory, or from
    /// the other core's): `finite` is cleared where one is not.
    Checked(&'a mut [f32], &'a AtomicBool),
}

/// The tiles of a product's outputs `y` (`m×n`): `rows`, `y` as a plain
/// left operand (the next layer's input; the gradient that multiplies
/// the weights); `across`, pairs across its rows, as the left operand
/// `yᵀ` (`transposed`: the next layer's weight gradient `yᵀ·g`) or as a
/// right one (a weight gradient's `g`).
pub(crate) struct Kept<'a> {
    pub rows: &'a mut Packed,
    pub across: &'a mut Packed,
    pub transposed: bool,
    pub relu: Relu<'a>,
}

/// The ReLU between a layer's product and the next.
pub(crate) enum Relu<'a> {
    /// Forward: `y = max(v + bias, 0)`; which outputs passed (`v + bias >
    /// 0`) recorded, a bit each, for the backward pass.
    Apply { bias: &'a [f32], passed: &'a mut Vec<u32> },
    /// Backward: the gradient zeroed where the forward ReLU did not pass,
    /// and summed by column into `sums` (the layer's bias gradient, each
    /// column row after row: the product runs on one thread).
    Mask { passed: &'a [u32], sums: &'a mut [f32] },
}

/// `out = op(a)·op(b)` (`m×n`, over `k`) on AMX, on the current rayon pool
/// or on this thread alone (`threads` 1; required by [`Relu::Mask`]'s
/// sums). The caller checked [`available`] and [`takes`].
#[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux")), expect(unused_variables))]
pub(crate) fn product(
    (m, n, k): (usize, usize, usize),
    a: Left<'_>,
    b: Right<'_>,
    out: Out<'_>,
    threads: Option<usize>,
) {
    assert!(takes(m, n, k) && grant().is_ok(), "AMX cannot take a {m}×{n}×{k} product here");
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    x86::gemm((m, n, k), a, b, out, min_len(threads));
}

/// A timed block of `tdpbf16ps` on tiles in registers (returning its
/// flops), for the AMX ceiling (`peak::measure`); None where AMX is not
/// granted here.
pub(crate) fn ceiling_block() -> Option<fn() -> f64> {
    grant().ok()?;
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        Some(x86::peak_block)
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    None
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod x86;

/// A cache line of packed pairs. Tiles start on a line: a tile row that
/// straddles two lines costs `tileloadd` two (measured: 2.7× slower
/// products on rows 16 bytes off, as a `Vec<u32>` from the allocator lies).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u32; 16]);

thread_local! {
    /// Packing buffers reused by this thread's products (taken while in
    /// use: a product nested on the same thread allocates its own).
    static BUFFERS: std::cell::Cell<(Vec<Line>, Vec<Line>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

fn take_buffers() -> (Vec<Line>, Vec<Line>) {
    BUFFERS.take()
}

fn keep_buffers(a: Vec<Line>, b: Vec<Line>) {
    BUFFERS.set((a, b));
}

/// `lines` grown to hold `len` dwords (a multiple of 16), as dwords; the
/// packing writes every one.
fn dwords(lines: &mut Vec<Line>, len: usize) -> &mut [u32] {
    assert_eq!(len % 16, 0, "whole lines");
    lines.resize(len / 16, Line([0; 16]));
    // SAFETY: `Line` is 16 u32 with no padding (repr(C), 64 bytes, align
    // 64), so `len / 16` lines are `len` initialized, aligned u32, borrowed
    // mutably from `lines` for the slice's lifetime.
    #[expect(unsafe_code, reason = "viewing aligned lines of dwords as dwords")]
    unsafe {
        std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u32>(), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn here() -> bool {
        // Without AMX-BF16 (or the kernel's grant) there is nothing to test.
        available(Simd::Auto)
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = sparrow_core::rng::Rng::new(seed);
        // Mixed magnitudes, both signs, a few zeros.
        (0..len)
            .map(|i| if i % 37 == 5 { 0.0 } else { (rng.next_f64() as f32 - 0.5) * 2f32.powi((i % 9) as i32 - 4) })
            .collect()
    }

    /// `x` rounded to bf16 as the packing rounds it (to nearest even; the
    /// values here are finite), read back with a denormal as zero.
    fn widened(x: f32) -> f64 {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        if rounded & 0x7f80_0000 == 0 { 0.0 } else { f64::from(f32::from_bits(rounded)) }
    }

    /// op(x)[i][j] of a row-major operand `rows`×`cols` as used.
    fn at(x: &Operand<'_>, (rows, cols): (usize, usize), i: usize, j: usize) -> f32 {
        if x.transposed { x.data[j * rows + i] } else { x.data[i * cols + j] }
    }

    #[test]
    fn the_transpose_makes_rows_columns() {
        if !here() {
            return;
        }
        let rows: [[u32; 16]; 16] = std::array::from_fn(|r| std::array::from_fn(|c| (r * 100 + c) as u32));
        let t = x86::transpose_for_test(&rows);
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(t[c][r], rows[r][c], "({r}, {c})");
            }
        }
    }

    /// Every layout of the operands, edges in m, n and k, the epilogue:
    /// each output within fp32 rounding of the exact sum of its bf16
    /// products (an index or a pair out of place is off by far more).
    #[test]
    fn products_match_the_exact_sums_of_bf16_products_in_every_layout() {
        if !here() {
            return;
        }
        for &(m, n, k) in &[(16, 16, 16), (33, 47, 77), (100, 64, 429), (64, 129, 1024), (1024, 36, 64), (20, 300, 31)]
        {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (a, b) = (values(m * k, 1 + m as u64), values(k * n, 2 + n as u64));
                let bias = values(n, 3);
                let (a, b) = (Operand { data: &a, transposed: ta }, Operand { data: &b, transposed: tb });
                for relu in [false, true] {
                    let mut dst = vec![f32::NAN; m * n];
                    let epilogue = Epilogue { bias: Some(&bias), relu };
                    assert!(gemm(m, n, k, &a, &b, &mut dst, epilogue, None));
                    for i in 0..m {
                        for j in 0..n {
                            let terms = (0..k).map(|p| widened(at(&a, (m, k), i, p)) * widened(at(&b, (k, n), p, j)));
                            let (sum, size) = terms.fold((0.0, 0.0), |(s, z), t: f64| (s + t, z + t.abs()));
                            let got = f64::from(dst[i * n + j]) - f64::from(bias[j]);
                            let tolerance = size * (k.div_ceil(32) + 32) as f64 * f64::from(f32::EPSILON) + 1e-30;
                            let want =
                                if relu { (sum + f64::from(bias[j])).max(0.0) - f64::from(bias[j]) } else { sum };
                            assert!(
                                (got - want).abs() <= tolerance + f64::from(bias[j]).abs() * 1e-7,
                                "({m}, {n}, {k}) ta {ta} tb {tb} relu {relu}: [{i}][{j}] = {got}, exact {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// An output's bits depend on its row of op(a) and its column of
    /// op(b) alone: the same in a product of other rows and columns
    /// around it, and on one thread or two.
    #[test]
    fn an_outputs_bits_do_not_depend_on_the_rest_of_the_product_or_the_threads() {
        if !here() {
            return;
        }
        let (m, n, k) = (70, 90, 333);
        let (a, b) = (values(m * k, 7), values(k * n, 8));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let mut dst = vec![0f32; m * n];
            let threads = (threads == 1).then_some(1);
            pool.install(|| {
                gemm(m, n, k, &Operand::plain(&a), &Operand::plain(&b), &mut dst, Epilogue::default(), threads)
            });
            dst
        };
        let whole = run(2);
        assert!(whole.iter().zip(run(1)).all(|(x, y)| x.to_bits() == y.to_bits()), "one thread against two");
        // Rows 21..50 and columns 17..40 on their own (other offsets in
        // the tiles, another count of blocks).
        let (rows, cols) = (21..50, 17..40);
        let sub_a: Vec<f32> = rows.clone().flat_map(|i| a[i * k..(i + 1) * k].to_vec()).collect();
        let sub_b: Vec<f32> = (0..k).flat_map(|p| b[p * n + cols.start..p * n + cols.end].to_vec()).collect();
        let (sm, sn) = (rows.len(), cols.len());
        let mut sub = vec![0f32; sm * sn];
        let (sa, sb) = (Operand::plain(&sub_a), Operand::plain(&sub_b));
        assert!(gemm(sm, sn, k, &sa, &sb, &mut sub, Epilogue::default(), None));
        for (r, i) in rows.enumerate() {
            for (c, j) in cols.clone().enumerate() {
                assert_eq!(sub[r * sn + c].to_bits(), whole[i * n + j].to_bits(), "[{i}][{j}]");
            }
        }
    }

    /// A checked product's flag is cleared by any non-finite output, in
    /// whichever task's rows it lies (first, middle, last and partial row
    /// blocks; one thread or two), and left set where all are finite; the
    /// values are the unchecked product's.
    #[test]
    fn a_checked_product_finds_a_non_finite_output_in_any_row() {
        if !here() {
            return;
        }
        let (m, n, k) = (1000, 40, 64);
        let (mut a, b) = (values(m * k, 11), values(k * n, 12));
        let mut plain = vec![0f32; m * n];
        let product = |a: &[f32], out: Out<'_>| {
            product((m, n, k), Left::Values(Operand::plain(a), None), Right::Values(Operand::plain(&b)), out, None)
        };
        product(&a, Out::Values(&mut plain, Epilogue::default()));
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            for poisoned in [None, Some(0), Some(31), Some(500), Some(990), Some(m - 1)] {
                let at = poisoned.map(|row| row * k + 3);
                let clean = at.map(|i| std::mem::replace(&mut a[i], f32::INFINITY));
                let (mut dst, finite) = (vec![0f32; m * n], AtomicBool::new(true));
                pool.install(|| product(&a, Out::Checked(&mut dst, &finite)));
                assert_eq!(finite.into_inner(), poisoned.is_none(), "row {poisoned:?} poisoned, {threads} threads");
                if let (Some(i), Some(clean)) = (at, clean) {
                    a[i] = clean;
                } else {
                    assert!(dst.iter().zip(&plain).all(|(x, y)| x.to_bits() == y.to_bits()), "checked ≠ unchecked");
                }
            }
        }
    }

    #[test]
    fn small_products_are_left_to_the_other_kernels() {
        let mut dst = vec![0f32; 15 * 64];
        let (a, b) = (vec![1.0; 15 * 64], vec![1.0; 64 * 64]);
        assert!(!gemm(15, 64, 64, &Operand::plain(&a), &Operand::plain(&b), &mut dst, Epilogue::default(), None));
        assert!(!takes(64, 1, 64) && !takes(64, 64, 15) && takes(16, 16, 16));
    }
}
