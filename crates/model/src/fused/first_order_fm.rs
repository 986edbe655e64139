//! The first-order and FM models' sparse part as one fused op
//! ([`FirstOrderFm`]) and its adjoint, with the row kernels the direct step
//! calls (`first_order_fm_rows`, `first_order_fm_grad_rows`).

use super::*;

/// The sparse part of the first-order and FM models, from `emb: [rows, f,
/// 1 + d]` (each field's leading column is its first-order weight, the rest
/// its factor vector `v`): `Σ_f emb[f][0]`, plus with `second_order`
/// FM's `½ Σ_k [(Σ_f v_fk)² − Σ_f v_fk²]`, as `[rows, 1]`. As candle ops
/// (narrow, sums, squares and their adjoints) FM's dense step took 7 ms a
/// batch of 1024 for 2k flops a sample.
pub struct FirstOrderFm {
    pub second_order: bool,
}

/// One row of [`FirstOrderFm`]: `e` is the row's `f` fields of width `w`,
/// `sum` a buffer of `w - 1` that receives the row's Σ_f v_f.
///
/// The second order is `½ Σ_k (s_k² − q_k)` with `s_k = Σ_f v_fk` and
/// `q_k = Σ_f v_fk²`, each coordinate k summed over the fields in field
/// order (as the candle ops it replaces sum them): the k are independent
/// lanes, so the pass over the fields is vector adds, and the only chain
/// across k is the last sum.
#[inline(always)]
pub(crate) fn first_order_fm_row(e: &[f32], w: usize, second_order: bool, sum: &mut [f32]) -> f32 {
    let first = e.chunks_exact(w).fold(0.0f32, |first, field| first + field[0]);
    if !second_order {
        return first + 0.0;
    }
    let d = w - 1;
    let mut total = 0.0f32;
    let mut k = 0;
    while k < d {
        // A register's worth of lanes at a time: a constant count keeps the
        // running sums in registers; a last, shorter chunk goes lane by lane.
        let lanes = (d - k).min(LANES);
        total = if lanes == LANES {
            second_order_lanes::<LANES>(e, w, k, &mut sum[k..k + LANES], total)
        } else {
            second_order_partial(e, w, k, &mut sum[k..d], total)
        };
        k += lanes;
    }
    first + 0.5 * total
}

/// Lanes `k..k + N` of [`first_order_fm_row`]'s second order: their Σ_f v
/// into `sum`, `total + Σ_k (s_k² − q_k)` returned (k in order).
#[inline(always)]
fn second_order_lanes<const N: usize>(e: &[f32], w: usize, k: usize, sum: &mut [f32], mut total: f32) -> f32 {
    let (mut s, mut q) = ([0.0f32; N], [0.0f32; N]);
    for field in e.chunks_exact(w) {
        let v: &[f32; N] = field[1 + k..1 + k + N].try_into().expect("N lanes");
        for j in 0..N {
            s[j] += v[j];
            q[j] += v[j] * v[j];
        }
    }
    for j in 0..N {
        total += s[j] * s[j] - q[j];
    }
    sum.copy_from_slice(&s);
    total
}

/// [`second_order_lanes`] for fewer than [`LANES`] lanes (`sum.len()` of them).
#[inline(always)]
fn second_order_partial(e: &[f32], w: usize, k: usize, sum: &mut [f32], mut total: f32) -> f32 {
    let n = sum.len();
    let (mut s, mut q) = ([0.0f32; LANES], [0.0f32; LANES]);
    for field in e.chunks_exact(w) {
        for (j, &v) in field[1 + k..1 + k + n].iter().enumerate() {
            s[j] += v;
            q[j] += v * v;
        }
    }
    for j in 0..n {
        total += s[j] * s[j] - q[j];
    }
    sum.copy_from_slice(&s[..n]);
    total
}

/// Rows [`first_order_fm_rows`] takes side by side without a second order (LR).
pub(crate) const FM_ROWS_AT_ONCE: usize = 8;

/// [`first_order_fm_row`] for each of `out.len()` rows: row `r`'s fields
/// are the first `f·w` floats of `x[r·stride..]`, its result goes to
/// `out[r]` and (FM) its Σ_f v_f to `sums[r·(w − 1)..]` (`sums` holds
/// `out.len()·(w − 1)`), for the backward pass. Compiled for AVX2 where the
/// CPU has it (the same operations, so the same bits: no contraction into
/// fused multiply-adds). Blocks of [`FM_ROWS_AT_ONCE`] rows run side by
/// side, each row's additions in [`first_order_fm_row`]'s order (the same
/// bits, tested): each row's chains of dependent adds (LR's over the
/// fields; FM's over the fields, then over k), one row after the other,
/// left the adder waiting on its own latency.
pub(crate) fn first_order_fm_rows(
    simd: Simd,
    x: &[f32],
    stride: usize,
    (f, w): (usize, usize),
    second_order: bool,
    sums: &mut [f32],
    out: &mut [f32],
) {
    let n = out.len();
    assert!(n == 0 || x.len() >= (n - 1) * stride + f * w, "rows of the block");
    let d = w.saturating_sub(1);
    let sums = &mut sums[..n * d];
    #[cfg(target_arch = "x86_64")]
    if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            first_order_fm_rows_avx2(x, stride, (f, w), second_order, sums, out);
        }
        return;
    }
    first_order_fm_rows_portable(x, stride, (f, w), second_order, sums, out);
}

/// [`first_order_fm_rows_portable`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn first_order_fm_rows_avx2(
    x: &[f32],
    stride: usize,
    shape: (usize, usize),
    second_order: bool,
    sums: &mut [f32],
    out: &mut [f32],
) {
    first_order_fm_rows_portable(x, stride, shape, second_order, sums, out);
}

#[inline(always)]
pub(super) fn first_order_fm_rows_portable(
    x: &[f32],
    stride: usize,
    (f, w): (usize, usize),
    second_order: bool,
    sums: &mut [f32],
    out: &mut [f32],
) {
    let d = w.saturating_sub(1);
    let mut start = 0;
    for block in out.chunks_exact_mut(FM_ROWS_AT_ONCE) {
        let x = &x[start * stride..];
        if second_order {
            let sums = &mut sums[start * d..(start + FM_ROWS_AT_ONCE) * d];
            let (first, total) = fm_block::<FM_ROWS_AT_ONCE>(x, stride, (f, w), sums);
            block.iter_mut().zip(first.iter().zip(total)).for_each(|(o, (first, total))| *o = first + 0.5 * total);
        } else {
            let first = first_order_block::<FM_ROWS_AT_ONCE>(x, stride, (f, w));
            block.iter_mut().zip(first).for_each(|(o, first)| *o = first + 0.0);
        }
        start += FM_ROWS_AT_ONCE;
    }
    for r in start..out.len() {
        let sum = &mut sums[r * d..(r + 1) * d];
        out[r] = first_order_fm_row(&x[r * stride..r * stride + f * w], w, second_order, sum);
    }
}

/// `N` rows' first order side by side (`N` a constant: the running sums are
/// registers), each `Σ_f e_f[0]` as [`first_order_fm_row`] adds it.
#[inline(always)]
fn first_order_block<const N: usize>(x: &[f32], stride: usize, (f, w): (usize, usize)) -> [f32; N] {
    let rows: [&[f32]; N] = std::array::from_fn(|r| &x[r * stride..r * stride + f * w]);
    let mut first = [0.0f32; N];
    for field in 0..f {
        for r in 0..N {
            first[r] += rows[r][field * w];
        }
    }
    first
}

/// `N` rows' first order `Σ_f e_f[0]` and second order `Σ_k (s_k² − q_k)`
/// (before the ½), each row's Σ_f v_f into `sums` (`N·(w − 1)` floats), with
/// [`first_order_fm_row`]'s operations in its order, row by row. One row at
/// a time, each row's sums were chains of dependent adds; here two rows
/// share the pass over the fields (their first order scalar beside the
/// factors' lanes: across 8 rows the compiler built it from lane inserts)
/// and the N rows' sums over k run side by side.
#[inline(always)]
fn fm_block<const N: usize>(
    x: &[f32],
    stride: usize,
    (f, w): (usize, usize),
    sums: &mut [f32],
) -> ([f32; N], [f32; N]) {
    const { assert!(N.is_multiple_of(2), "rows go in pairs") };
    let d = w - 1;
    if d == 0 {
        return (first_order_block(x, stride, (f, w)), [0.0; N]);
    }
    let (mut first, mut total) = ([0.0f32; N], [0.0f32; N]);
    let mut k = 0;
    while k < d {
        let lanes = (d - k).min(LANES);
        // s_k² − q_k of each row's lanes k..k + lanes.
        let mut terms = [[0.0f32; LANES]; N];
        for r in (0..N).step_by(2) {
            let rows = [&x[r * stride..r * stride + f * w], &x[(r + 1) * stride..(r + 1) * stride + f * w]];
            let (pair_first, s, q) = if lanes == LANES {
                sums_and_squares_lanes(rows, w, k)
            } else {
                sums_and_squares_partial(rows, w, k, lanes)
            };
            for i in 0..2 {
                if k == 0 {
                    first[r + i] = pair_first[i];
                }
                sums[(r + i) * d + k..(r + i) * d + k + lanes].copy_from_slice(&s[i][..lanes]);
                for j in 0..lanes {
                    terms[r + i][j] = s[i][j] * s[i][j] - q[i][j];
                }
            }
        }
        for j in 0..lanes {
            total.iter_mut().zip(&terms).for_each(|(total, terms)| *total += terms[j]);
        }
        k += lanes;
    }
    (first, total)
}

/// Two rows' Σ_f e_f[0], Σ_f v_fk and Σ_f v_fk² for the [`LANES`] lanes from `k`.
#[inline(always)]
fn sums_and_squares_lanes(rows: [&[f32]; 2], w: usize, k: usize) -> ([f32; 2], [[f32; LANES]; 2], [[f32; LANES]; 2]) {
    let (mut first, mut s, mut q) = ([0.0f32; 2], [[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
    for (a, b) in rows[0].chunks_exact(w).zip(rows[1].chunks_exact(w)) {
        first[0] += a[0];
        first[1] += b[0];
        let v: [&[f32; LANES]; 2] =
            [a[1 + k..1 + k + LANES].try_into().expect("lanes"), b[1 + k..1 + k + LANES].try_into().expect("lanes")];
        for i in 0..2 {
            for j in 0..LANES {
                s[i][j] += v[i][j];
                q[i][j] += v[i][j] * v[i][j];
            }
        }
    }
    (first, s, q)
}

/// [`sums_and_squares_lanes`] for the `n` (< [`LANES`]) lanes from `k`.
#[inline(always)]
fn sums_and_squares_partial(
    rows: [&[f32]; 2],
    w: usize,
    k: usize,
    n: usize,
) -> ([f32; 2], [[f32; LANES]; 2], [[f32; LANES]; 2]) {
    let (mut first, mut s, mut q) = ([0.0f32; 2], [[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
    for i in 0..2 {
        for field in rows[i].chunks_exact(w) {
            first[i] += field[0];
            for (j, &v) in field[1 + k..1 + k + n].iter().enumerate() {
                s[i][j] += v;
                q[i][j] += v * v;
            }
        }
    }
    (first, s, q)
}

/// One row of [`FirstOrderFm`]'s adjoint for the row's output gradient `g`:
/// writes `g` on each leading column and (with `second_order`)
/// `g · (Σ_f v_fk − v_fk)` on the factors; without it the factors are left
/// as they are (`grad` may hold what else flows into them).
pub(crate) fn first_order_fm_grad_row(
    e: &[f32],
    w: usize,
    g: f32,
    second_order: bool,
    sum: &mut [f32],
    grad: &mut [f32],
) {
    sum.fill(0.0);
    if second_order {
        for field in e.chunks_exact(w) {
            sum.iter_mut().zip(&field[1..]).for_each(|(s, x)| *s += x);
        }
    }
    first_order_fm_grad_row_from_sum(e, w, g, second_order, sum, grad, &mut WrittenSum::default());
}

/// [`first_order_fm_grad_row`] with the row's `sum` (Σ_f v_f) given, as the
/// forward pass ([`first_order_fm_rows`]) left it. Returns a [`WrittenSum`]
/// of what it wrote.
#[inline(always)]
pub(crate) fn first_order_fm_grad_row_from_sum(
    e: &[f32],
    w: usize,
    g: f32,
    second_order: bool,
    sum: &[f32],
    grad: &mut [f32],
    written: &mut WrittenSum,
) {
    // Every leading column holds `g`: once stands for all of them.
    written.rest += g;
    for (gf, field) in grad.chunks_exact_mut(w).zip(e.chunks_exact(w)) {
        gf[0] = g;
        if !second_order {
            continue;
        }
        // The usual width as arrays: straight-line vector code, no loop
        // set-up per field.
        if let (Ok(o), Ok(s), Ok(v)) = (
            <&mut [f32; LANES]>::try_from(&mut gf[1..]),
            <&[f32; LANES]>::try_from(sum),
            <&[f32; LANES]>::try_from(&field[1..]),
        ) {
            for j in 0..LANES {
                o[j] = g * (s[j] - v[j]);
                written.lanes[j] += o[j];
            }
            continue;
        }
        for ((o, s), v) in gf[1..].iter_mut().zip(sum.iter()).zip(&field[1..]) {
            *o = g * (s - v);
            written.rest += *o;
        }
    }
}

/// A sum of every value a gradient pass wrote (in no particular order): a
/// NaN or an infinity among them makes it NaN or infinite (they absorb every
/// addition), so a finite sum proves them all finite; finite values whose
/// sum overflows make it infinite too, so a non-finite sum means "look at
/// the values" ([`all_finite`](crate::optimizer::all_finite)), not "one is
/// non-finite". Checking the gradient this way costs an add beside each
/// store instead of a second pass over it. Kept as lanes (a vector add a
/// register of values, no chain across them), summed when asked.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WrittenSum {
    lanes: [f32; LANES],
    rest: f32,
}

impl WrittenSum {
    /// Adds values written outside the passes above, lane by lane.
    pub(crate) fn add(&mut self, values: &[f32]) {
        for chunk in values.chunks(LANES) {
            self.lanes.iter_mut().zip(chunk).for_each(|(sum, v)| *sum += v);
        }
    }

    /// The sum.
    pub(crate) fn total(&self) -> f32 {
        self.lanes.iter().fold(self.rest, |sum, v| sum + v)
    }

    /// Whether the sum proves every value finite.
    pub(crate) fn proves_finite(&self) -> bool {
        self.total().is_finite()
    }
}

/// The rows [`first_order_fm_grad_rows`] takes: row `r`'s `f` fields of
/// width `w` at `x[r·stride..]`, its output gradient `seeds[r]`, its Σ_f
/// v_f at `sums[r·(w − 1)..]` (FM: `second_order`).
#[derive(Clone, Copy)]
pub(crate) struct GradRows<'a> {
    pub x: &'a [f32],
    pub stride: usize,
    pub shape: (usize, usize),
    pub seeds: &'a [f32],
    pub second_order: bool,
    pub sums: &'a [f32],
}

/// [`first_order_fm_grad_row_from_sum`] for each row of `rows`, its
/// gradient written to the first `f·w` floats of `grad[r·stride..]`, and a
/// [`WrittenSum`] of them. Compiled for AVX2 where the CPU has it (the same
/// operations: the same bits).
pub(crate) fn first_order_fm_grad_rows(simd: Simd, rows: GradRows<'_>, grad: &mut [f32]) -> WrittenSum {
    let (n, (f, w)) = (rows.seeds.len(), rows.shape);
    let d = w.saturating_sub(1);
    assert!(n == 0 || rows.x.len().min(grad.len()) >= (n - 1) * rows.stride + f * w, "rows of the block");
    assert!(!rows.second_order || rows.sums.len() >= n * d, "Σ v of every row");
    #[cfg(target_arch = "x86_64")]
    if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { first_order_fm_grad_rows_avx2(rows, grad) };
    }
    first_order_fm_grad_rows_portable(rows, grad)
}

/// [`first_order_fm_grad_rows_portable`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn first_order_fm_grad_rows_avx2(rows: GradRows<'_>, grad: &mut [f32]) -> WrittenSum {
    first_order_fm_grad_rows_portable(rows, grad)
}

#[inline(always)]
pub(super) fn first_order_fm_grad_rows_portable(rows: GradRows<'_>, grad: &mut [f32]) -> WrittenSum {
    let GradRows { x, stride, shape: (f, w), seeds, second_order, sums } = rows;
    let d = w.saturating_sub(1);
    let mut written = WrittenSum::default();
    for (r, &g) in seeds.iter().enumerate() {
        let sum = if second_order { &sums[r * d..(r + 1) * d] } else { &[][..] };
        let at = r * stride;
        let row = &mut grad[at..at + f * w];
        first_order_fm_grad_row_from_sum(&x[at..at + f * w], w, g, second_order, sum, row, &mut written);
    }
    written
}

impl CustomOp1 for FirstOrderFm {
    fn name(&self) -> &'static str {
        "first-order-fm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let e = contiguous_f32(self.name(), s, l)?;
        let (rows, f, w) = rows_n_d(self.name(), l)?;
        let mut out = vec![0.0f32; rows];
        let d = w.saturating_sub(1);
        if f * w > 0 {
            let rows_in = out.par_iter_mut().zip(e.par_chunks(f * w));
            rows_in.for_each_init(
                || vec![0.0f32; d],
                |sum, (out, e)| *out = first_order_fm_row(e, w, self.second_order, sum),
            );
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, 1))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = FirstOrderFmGrad { second_order: self.second_order };
        Ok(Some(arg.apply_op2_no_bwd(grad_res, &grad)?))
    }
}

/// d loss / d emb of [`FirstOrderFm`]: `g` on each leading column, and
/// `g · (Σ_f v_fk − v_fk)` on the factors.
struct FirstOrderFmGrad {
    second_order: bool,
}

impl CustomOp2 for FirstOrderFmGrad {
    fn name(&self) -> &'static str {
        "first-order-fm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let e = contiguous_f32(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let (rows, f, w) = rows_n_d(self.name(), l1)?;
        if g.len() != rows {
            return Err(candle_core::Error::Msg(format!("first-order-fm-grad: gradient {:?}", l2.dims())));
        }
        let mut grad = vec![0.0f32; rows * f * w];
        if f * w > 0 {
            let d = w - 1;
            let rows_in = grad.par_chunks_mut(f * w).zip(e.par_chunks(f * w)).zip(g.par_iter());
            rows_in.for_each_init(
                || vec![0.0f32; d],
                |sum, ((grad, e), &g)| first_order_fm_grad_row(e, w, g, self.second_order, sum, grad),
            );
        }
        Ok((CpuStorage::F32(grad), l1.shape().clone()))
    }
}
