//! What the matrix products take (a row-major operand, used as stored or
//! transposed), and the fp32 product itself ([`sgemm`], on the `gemm`
//! crate), which `mlp` runs in fp32 and `bf16` runs on bf16-rounded
//! operands where the CPU has no bf16 dot product; and [`dot`], a short
//! dot product in lanes (the multi-task gates' and DIN's adjoints). A
//! product with a narrow right-hand side runs on a kernel of its own where
//! the CPU has AVX-512F or AVX2 with FMA ([`narrow`]), and one with one
//! output column and many rows where it has AVX-512F ([`column`]), with
//! `gemm`'s bits.

mod column;
mod narrow;

use sparrow_core::simd::Simd;

/// A row-major matrix operand, used as stored or transposed.
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub transposed: bool,
}

impl<'a> Operand<'a> {
    pub fn plain(data: &'a [f32]) -> Self {
        Operand { data, transposed: false }
    }
    pub fn t(data: &'a [f32]) -> Self {
        Operand { data, transposed: true }
    }
}

/// What a product does to each output as it stores it: add a bias per
/// column, then ReLU. An MLP layer's forward pass in one sweep.
#[derive(Clone, Copy, Default)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub relu: bool,
}

impl Epilogue<'_> {
    /// The columns `j0..` of one output row: `v + bias[j]`, then `v > 0 ? v
    /// : 0` (NaN and −0 become +0), as the SIMD store computes it; each a
    /// pass the compiler vectorises.
    pub(crate) fn row(&self, j0: usize, row: &mut [f32]) {
        if let Some(bias) = self.bias {
            row.iter_mut().zip(&bias[j0..]).for_each(|(v, b)| *v += b);
        }
        if self.relu {
            row.iter_mut().for_each(|v| *v = if *v > 0.0 { *v } else { 0.0 });
        }
    }
}

/// `dst (m×n) = op(a)·op(b)`, all row-major. `a` is `m×k` (stored `k×m` when
/// transposed), `b` is `k×n` (stored `n×k` when transposed). Runs on the
/// current rayon pool; `simd` only keeps the narrow kernel to its AVX2
/// build where it says `avx2` (the same bits either way).
pub fn sgemm(simd: Simd, m: usize, n: usize, k: usize, a: Operand<'_>, b: Operand<'_>, dst: &mut [f32]) {
    sgemm_threads(simd, m, n, k, a, b, dst, rayon::current_num_threads());
}

/// [`sgemm`] on at most `threads` threads of the current pool.
#[expect(clippy::too_many_arguments, reason = "a matrix product's kernels, shape, operands and threads")]
pub fn sgemm_threads(
    simd: Simd,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
    threads: usize,
) {
    assert_eq!(a.data.len(), m * k, "sgemm: lhs size");
    assert_eq!(b.data.len(), k * n, "sgemm: rhs size");
    assert_eq!(dst.len(), m * n, "sgemm: dst size");
    if m == 0 || n == 0 {
        return;
    }
    if a.transposed && !b.transposed && takes_transposed(simd, m, n, k) {
        return transposed_product(simd, (m, n, k), a.data, b.data, dst, threads);
    }
    direct_product(simd, (m, n, k), a, b, dst, threads);
}

/// `dst = a·b` with each output row's `bias` added and (where `relu`) its
/// ReLU taken, `max(v, +0)`, where the narrow kernel takes the product:
/// as it stores each output, in place of a pass over them after it (the
/// bits of [`sgemm`] then `v = (v + b).max(0.0)`, tested). False, and
/// nothing written, where it does not (`a` and `b` as stored).
pub(crate) fn sgemm_with_bias(
    simd: Simd,
    (m, n, k): (usize, usize, usize),
    (a, b): (&[f32], &[f32]),
    dst: &mut [f32],
    (bias, relu): (&[f32], bool),
) -> bool {
    assert_eq!(a.len(), m * k, "sgemm: lhs size");
    assert_eq!(b.len(), k * n, "sgemm: rhs size");
    assert_eq!(dst.len(), m * n, "sgemm: dst size");
    // `direct_product`'s way to the narrow kernel: no column kernel (it
    // takes one column), no outer product (`k` = 1) before it.
    if bias.len() != n || column::fits(m, n, k, false) || is_outer(m, n, k) {
        return false;
    }
    let then = Epilogue { bias: Some(bias), relu };
    narrow::product_on(narrow::kernel(simd), (m, n, k), (a, false), b, (dst, then), rayon::current_num_threads())
}

/// Whether `aᵀ·b` (a layer's weights' gradient `xᵀ·g`: `m` inputs, `n`
/// outputs, summed over `k` rows) is computed as `(bᵀ·a)ᵀ`, with `n` and
/// `m` swapped: where `n` is narrow, `m` a whole number of 16-lane vectors
/// wider than it, and `k` deep, on a CPU with AVX-512F (`simd` not
/// `avx2`). Each output is the same fused multiply-adds in the same order
/// either way, so the bits are the same: one chain over `k` from zero, cut
/// into blocks by `k` and by
/// whether both `m` and `n` are at most 64, which the swap keeps; `gemm`'s
/// paths that sum otherwise take `k` ≤ 2, one row or one column, or a
/// left-hand side read along its rows with a right-hand side read down its
/// columns, and neither form has those here. One thread, batch halves of 512 rows, the same Xeon: `[64, 512]·
/// [512, 5]` (a PLE gate's) took 10.0 µs and its transpose's 1.9;
/// `[64, 512]·[512, 32]` (a tower's first layer) 19.2 and 12.9; `[432,
/// 512]·[512, 8]` 74 and 23. Wider outputs (`[128, 64]`, 0.95×), inputs
/// of no whole vectors (`[81, 32]`, 0.86×) and short sums (`k` = 20,
/// 0.8×) stay as they are.
fn takes_transposed(simd: Simd, m: usize, n: usize, k: usize) -> bool {
    let avx512 = narrow::kernel(simd) == Some(narrow::Kernel::Avx512);
    (2..=48).contains(&n) && n < m && m.is_multiple_of(16) && k >= 128 && avx512
}

thread_local! {
    /// [`transposed_product`]'s `[n, m]` result before it is laid out;
    /// taken while in use, so a product nested in it (a rayon task run
    /// while it waits) gets a buffer of its own.
    static TRANSPOSED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    /// A narrow product's transposed right-hand side laid out
    /// ([`narrow::laid_out`]), kept between products; taken while in use.
    static LAID: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `dst (m×n) = aᵀ·b` (`a` stored `k×m`, `b` `k×n`) as `(bᵀ·a)ᵀ`.
fn transposed_product(
    simd: Simd,
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    dst: &mut [f32],
    threads: usize,
) {
    let mut t = TRANSPOSED.take();
    t.resize(m * n, 0.0);
    let t_out = &mut t[..m * n];
    direct_product(simd, (n, m, k), Operand::t(b), Operand::plain(a), t_out, threads);
    for (j, column) in t_out.chunks_exact(m).enumerate() {
        for (row, &v) in dst.chunks_exact_mut(n).zip(column) {
            row[j] = v;
        }
    }
    TRANSPOSED.set(t);
}

/// [`sgemm_threads`] as asked (sizes checked by the caller).
fn direct_product(
    simd: Simd,
    (m, n, k): (usize, usize, usize),
    a: Operand<'_>,
    b: Operand<'_>,
    dst: &mut [f32],
    threads: usize,
) {
    let (a_t, b_t) = (a.transposed, b.transposed);
    let (a, b) = (a.data, b.data);
    // A narrow product's transposed right-hand side is laid out on every
    // CPU, so that its bits do not depend on which kernel runs it.
    if b_t && narrow::fits(m, n, k, a_t) {
        let mut laid = LAID.take();
        narrow::laid_out(simd, b, n, k, &mut laid);
        direct_product(simd, (m, n, k), Operand { data: a, transposed: a_t }, Operand::plain(&laid), dst, threads);
        LAID.set(laid);
        return;
    }
    // One column is the same `k` values stored either way.
    if column::product(simd, (m, n, k), (a, a_t), b, dst, threads) {
        return;
    }
    if is_outer(m, n, k) {
        return outer(a, b, dst);
    }
    if !b_t && narrow::product(simd, (m, n, k), (a, a_t), b, dst, threads) {
        return;
    }
    gemm_product((m, n, k), (a, a_t), (b, b_t), dst, threads);
}

/// Whether [`sgemm`] takes this product on the narrow kernel, which sums
/// each output column on its own, whatever `n` (the bits of `gemm`'s
/// block, [`narrow`]).
pub(crate) fn narrow_takes(simd: Simd, m: usize, n: usize, k: usize, a_transposed: bool) -> bool {
    narrow::fits(m, n, k, a_transposed) && narrow::kernel(simd).is_some()
}

/// The `gemm` crate's kernels on this CPU, as `sparrow bench` names them:
/// `avx512f` (its AVX-512 build, the workspace's `x86-v4` feature),
/// `avx2_fma` or `baseline`. `train.simd` does not reach them.
pub fn gemm_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if narrow::avx512f() {
            return "avx512f";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return "avx2_fma";
        }
    }
    "baseline"
}

/// The narrow product's kernel on this CPU under `simd`, as `sparrow bench`
/// names it: `avx512`, `avx2` (AVX2 and FMA without AVX-512F, a Zen 3, or
/// `simd` saying `avx2`), or `gemm` (no kernel of its own: every product on
/// the `gemm` crate).
pub fn narrow_kernel(simd: Simd) -> &'static str {
    match narrow::kernel(simd) {
        Some(narrow::Kernel::Avx512) => "avx512",
        Some(narrow::Kernel::Avx2) => "avx2",
        None => "gemm",
    }
}

/// `gemm`'s horizontal kernel takes `m·n` up to this (for `k` = 1 too).
const GEMM_HORIZONTAL_MAX: usize = 256;

/// Whether [`sgemm`] takes an `m×1 · 1×n` product as [`outer`]'s, each
/// output the one rounded product `a_i·b_j`: a caller may then compute
/// those values where it reads them, with the same bits.
pub(crate) fn is_outer(m: usize, n: usize, k: usize) -> bool {
    k == 1 && m * n > GEMM_HORIZONTAL_MAX
}

/// `dst (m×n) = a·b` for `k` = 1 (`a` `m` values, `b` `n`, stored either
/// way), row by row: each output is one product, as in `gemm`'s outer
/// product (`gevv`), which writes it column by column, a cache line a value
/// (DIN's unit's `[3270, 1]·[1, 36]`: 27 µs there).
fn outer(a: &[f32], b: &[f32], dst: &mut [f32]) {
    for (row, &x) in dst.chunks_exact_mut(b.len()).zip(a) {
        row.iter_mut().zip(b).for_each(|(d, &y)| *d = x * y);
    }
}

/// [`sgemm_threads`] on the `gemm` crate (sizes checked by the caller).
fn gemm_product(
    (m, n, k): (usize, usize, usize),
    (a, a_t): (&[f32], bool),
    (b, b_t): (&[f32], bool),
    dst: &mut [f32],
    threads: usize,
) {
    // Element (i, p) of op(a) sits at i·rs + p·cs.
    let (a_rs, a_cs) = if a_t { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if b_t { (1, k as isize) } else { (n as isize, 1) };
    let parallelism =
        if threads > 1 && m * n * k >= 1 << 20 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    #[expect(unsafe_code, reason = "gemm's raw-pointer API; bounds are asserted above")]
    // SAFETY: `sgemm_threads` asserts that `a` is m·k, `b` k·n and `dst`
    // m·n, so every (row, column) the strides address lies inside them;
    // `dst` is a unique borrow, so it aliases neither input. read_dst =
    // false: dst is only written, with beta = 1 (dst := a·b).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `Σ a_i·b_i` in eight lanes (a plain fold is one: the compiler keeps its
/// order). Always inlined: in a caller's AVX-512 build it is built for it too.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, a_rest) = a.as_chunks::<8>();
    let (b8, b_rest) = b.as_chunks::<8>();
    let mut lanes = [0.0f32; 8];
    for (a, b) in a8.iter().zip(b8) {
        for j in 0..8 {
            lanes[j] += a[j] * b[j];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(a, b)| a * b).sum();
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A product with its bias added and ReLU taken as the narrow kernel
    /// stores it has the bits of the product and then `v + b` and
    /// `(v + b).max(0.0)` (`add_bias`'s), NaN and a sum of −0 included,
    /// on one thread and two; a product the kernel does not take (one
    /// column, `k` = 1, too wide, no kernel for the CPU) is left to the caller.
    #[test]
    fn a_product_with_its_bias_has_the_bits_of_the_pass_after_it() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let mut taken = 0;
        for (m, n, k) in [(7, 5, 41), (128, 64, 41), (300, 41, 64), (25, 17, 3), (2, 2, 16), (130, 33, 512)] {
            let (mut a, b) = (values(m * k, 3), values(k * n, 4));
            let mut bias = values(n, 5);
            // A sum of −0 at (0, 1) (a product rounding to −0 from +0,
            // then −0s added) and a bias of −0 there; NaN through row 1.
            a[..k].iter_mut().for_each(|v| *v = -0.0);
            a[0] = -1e-30;
            let b = b.iter().enumerate().map(|(i, &v)| if i % n == 1 { 1e-30 } else { v }).collect::<Vec<_>>();
            bias[1] = -0.0;
            a[k] = f32::NAN;
            for relu in [false, true] {
                let mut want = vec![0.0f32; m * n];
                sgemm_threads(Simd::Auto, m, n, k, Operand::plain(&a), Operand::plain(&b), &mut want, 1);
                assert_eq!(want[1].to_bits(), (-0.0f32).to_bits(), "the case of a sum of −0");
                for row in want.chunks_exact_mut(n) {
                    for (v, b) in row.iter_mut().zip(&bias) {
                        *v = if relu { (*v + b).max(0.0) } else { *v + b };
                    }
                }
                for threads in [1, 2] {
                    let mut got = vec![f32::NAN; m * n];
                    let mut run = || sgemm_with_bias(Simd::Auto, (m, n, k), (&a, &b), &mut got, (&bias, relu));
                    let took = if threads == 1 { run() } else { pool.install(run) };
                    assert_eq!(took, narrow_takes(Simd::Auto, m, n, k, false), "m {m} n {n} k {k}");
                    if !took {
                        continue;
                    }
                    taken += 1;
                    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                        let same = x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
                        assert!(same, "m {m} n {n} k {k} relu {relu}, output {i}: {x} against {y}");
                    }
                }
            }
        }
        assert_eq!(taken > 0, narrow::kernel(Simd::Auto).is_some(), "products taken: {taken}");
        let mut dst = vec![0.0f32; 400];
        for (m, n, k) in [(400, 1, 16), (20, 20, 1), (4, 100, 4)] {
            let (a, b, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let dst = &mut dst[..m * n];
            let taken = sgemm_with_bias(Simd::Auto, (m, n, k), (&a, &b), dst, (&bias, true));
            assert!(!taken, "m {m} n {n} k {k}: not the kernel's");
        }
    }

    /// Values with many bits set (and signed zeros), so that a reordered
    /// sum shows: the kernels' tests against `gemm`.
    pub(crate) fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| match (i * 31 + seed) % 17 {
                0 => 0.0,
                1 => -0.0,
                _ => ((i * 7919 + seed * 104_729) % 1013) as f32 / 997.0 - 0.507,
            })
            .collect()
    }

    pub(crate) fn same_bits(x: &[f32], y: &[f32]) -> bool {
        x.len() == y.len() && x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// A weights' gradient taken as its transpose's transpose has the bits
    /// of the product taken as asked: narrow gradients, deep sums (past
    /// `gemm`'s 512-row block too), on one thread and on two.
    #[test]
    fn a_gradient_taken_transposed_has_the_bits_of_the_product_as_asked() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        for (m, n, k) in [(64, 5, 512), (64, 32, 512), (32, 4, 1024), (128, 48, 300), (16, 2, 128), (432, 8, 2048)] {
            assert_eq!(takes_transposed(Simd::Auto, m, n, k), narrow::avx512f(), "[{m}, {n}] over {k}");
            assert!(!takes_transposed(Simd::Avx2, m, n, k), "[{m}, {n}] over {k}: an AVX-512F rule under avx2");
            let (x, g) = (values(k * m, 3), values(k * n, 4));
            for threads in [1, 2] {
                let mut asked = vec![f32::NAN; m * n];
                let mut taken = vec![f32::NAN; m * n];
                pool.install(|| {
                    direct_product(Simd::Auto, (m, n, k), Operand::t(&x), Operand::plain(&g), &mut asked, threads);
                    sgemm_threads(Simd::Auto, m, n, k, Operand::t(&x), Operand::plain(&g), &mut taken, threads);
                });
                assert!(same_bits(&asked, &taken), "[{m}, {n}] over {k} on {threads} threads");
            }
        }
    }

    /// An outer product (`k` = 1) has `gemm`'s bits, whichever way its
    /// operands are stored (one column or one row is the same values).
    #[test]
    fn an_outer_product_has_the_bits_of_gemm() {
        // Past 256 outputs: at fewer `gemm` takes its horizontal kernel,
        // whose bits for a signed zero depend on the operands' storage.
        for (m, n) in [(3270, 36), (1024, 32), (257, 1), (300, 2), (2, 200), (16, 17)] {
            let (a, b) = (values(m, 1), values(n, 2));
            let mut expected = vec![f32::NAN; m * n];
            gemm_product((m, n, 1), (&a, false), (&b, false), &mut expected, 1);
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut dst = vec![f32::NAN; m * n];
                let op = |data, t| if t { Operand::t(data) } else { Operand::plain(data) };
                sgemm_threads(Simd::Auto, m, n, 1, op(&a, a_t), op(&b, b_t), &mut dst, 1);
                assert!(same_bits(&dst, &expected), "m {m} n {n} transposed a {a_t} b {b_t}");
            }
        }
    }
}
