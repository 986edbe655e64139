//! Fused candle ops: DLRM's pairwise-dot interaction and its adjoint (the
//! MLP layers' bias + ReLU are fused inside `mlp.rs`'s op). CPU only for now;
//! a CUDA kernel goes in `cuda_fwd` without touching callers.

mod first_order_fm;

pub use first_order_fm::*;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;
pub use sparrow_core::simd::Simd;

pub(crate) fn contiguous_f32<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<f32>()?[start..end]),
        None => Err(candle_core::Error::Msg(format!("{op}: input must be contiguous"))),
    }
}

/// DLRM's interaction: for `t: [rows, n, d]`, the dot product of every pair
/// `i < j` of the n vectors of a row, `[rows, n(n-1)/2]`, pairs in row-major
/// upper-triangle order. As candle ops (a batched n×d·d×n matmul, then an
/// index_select of the upper triangle) a step spent more in a thousand tiny
/// matmuls and in index_add than in the whole top MLP.
pub struct PairwiseDots(pub Simd);

fn rows_n_d(op: &str, l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match l.dims() {
        [rows, n, d] => Ok((*rows, *n, *d)),
        dims => Err(candle_core::Error::Msg(format!("{op}: expected [rows, n, d], got {dims:?}"))),
    }
}

/// Lanes of the interaction's blocks: one 512-bit register of f32.
const LANES: usize = 16;
/// Vectors of a row taken together: four independent accumulator chains.
const BLOCK: usize = 4;

/// The interaction's two kernels. The portable ones and the AVX-512 ones
/// give the same bits (the test runs both); the row functions are generic
/// over them, so with AVX-512 each row function is compiled whole for it and
/// the kernels inline.
trait Kernels {
    /// A block of sums `acc[b][l] = Σ_t a[b·a_row + t] · rows[t·row_stride + l]`
    /// (`b < 4`, `l < 16`, `t < count`), each summed in order of `t`, a
    /// product rounded and then added (no fused multiply-add): the same
    /// bits however it is computed.
    fn block(&self, a: &[f32], a_row: usize, rows: &[f32], row_stride: usize, count: usize) -> [[f32; LANES]; BLOCK];

    /// Transposes 16 rows of 16 floats (`src`, row-major) into `dst`: row
    /// `k` of the result, at `dst[k·dst_stride..][..16]`, holds column `k`
    /// of `src`.
    fn transpose(&self, src: &[f32], dst: &mut [f32], dst_stride: usize);
}

struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn block(&self, a: &[f32], a_row: usize, rows: &[f32], row_stride: usize, count: usize) -> [[f32; LANES]; BLOCK] {
        let mut acc = [[0.0f32; LANES]; BLOCK];
        for t in 0..count {
            let row = &rows[t * row_stride..][..LANES];
            for (b, acc) in acc.iter_mut().enumerate() {
                let a = a[b * a_row + t];
                acc.iter_mut().zip(row).for_each(|(acc, r)| *acc += a * r);
            }
        }
        acc
    }

    #[inline(always)]
    fn transpose(&self, src: &[f32], dst: &mut [f32], dst_stride: usize) {
        for (j, row) in src.chunks_exact(LANES).take(LANES).enumerate() {
            for (k, &x) in row.iter().enumerate() {
                dst[k * dst_stride + j] = x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use super::{BLOCK, Kernels, LANES, RowBuf, Vectors};

    /// The AVX-512 kernels; a value exists only where the CPU has AVX-512F.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(());

    impl Avx512 {
        pub(super) fn detected(simd: sparrow_core::simd::Simd) -> Option<Self> {
            (simd.allows_avx512() && std::arch::is_x86_feature_detected!("avx512f")).then_some(Avx512(()))
        }
    }

    impl Kernels for Avx512 {
        #[inline(always)]
        fn block(
            &self,
            a: &[f32],
            a_row: usize,
            rows: &[f32],
            row_stride: usize,
            count: usize,
        ) -> [[f32; LANES]; BLOCK] {
            // SAFETY: an `Avx512` exists only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                block(a, a_row, rows, row_stride, count)
            }
        }

        #[inline(always)]
        fn transpose(&self, src: &[f32], dst: &mut [f32], dst_stride: usize) {
            // SAFETY: an `Avx512` exists only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                transpose(src, dst, dst_stride)
            }
        }
    }

    /// [`super::pairwise_dots_row`] compiled for AVX-512F, its kernels inline.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dots_row(k: Avx512, v: Vectors<'_>, out: &mut [f32], buf: &mut RowBuf) {
        super::dots_row_by_width(&k, v, out, buf);
    }

    /// [`super::pairwise_dots_grad_row`] compiled for AVX-512F, its kernels inline.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dots_grad_row(
        k: Avx512,
        v: Vectors<'_>,
        g: &[f32],
        grad: (&mut [f32], &mut [f32]),
        buf: &mut RowBuf,
    ) {
        super::dots_grad_row_by_width(&k, v, g, grad, buf);
    }

    /// [`Kernels::block`] with 512-bit multiplies and adds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn block(a: &[f32], a_row: usize, rows: &[f32], row_stride: usize, count: usize) -> [[f32; LANES]; BLOCK] {
        assert!(
            count == 0 || (a.len() >= (BLOCK - 1) * a_row + count && rows.len() >= (count - 1) * row_stride + LANES)
        );
        let mut acc = [_mm512_setzero_ps(); BLOCK];
        for t in 0..count {
            // SAFETY: the assert above keeps `t·row_stride + 16 ≤ rows.len()`.
            #[expect(unsafe_code, reason = "an unaligned 16-lane load within the slice")]
            let row = unsafe { _mm512_loadu_ps(rows.as_ptr().add(t * row_stride)) };
            for (b, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_set1_ps(a[b * a_row + t]), row));
            }
        }
        let mut out = [[0.0f32; LANES]; BLOCK];
        for (out, acc) in out.iter_mut().zip(acc) {
            // SAFETY: `out` is 16 f32s.
            #[expect(unsafe_code, reason = "an unaligned 16-lane store into an array of 16")]
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr(), acc)
            };
        }
        out
    }

    /// [`Kernels::transpose`] in registers: 32-bit, then 64-bit
    /// interleaves within 128-bit lanes, then two rounds of 128-bit lane
    /// shuffles (64 shuffles for 256 floats, against 256 scalar stores).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn transpose(src: &[f32], dst: &mut [f32], dst_stride: usize) {
        assert!(src.len() >= LANES * LANES && dst.len() >= (LANES - 1) * dst_stride + LANES);
        // SAFETY: the assert above keeps every load within `src`'s 256
        // floats and every store within `dst` (row k at k·dst_stride, 16 wide).
        #[expect(unsafe_code, reason = "unaligned 16-lane loads and stores within the slices")]
        unsafe {
            let r: [__m512; LANES] = std::array::from_fn(|j| _mm512_loadu_ps(src.as_ptr().add(j * LANES)));
            // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved, per 128-bit lane.
            let t: [__m512; LANES] = std::array::from_fn(|x| {
                let (a, b) = (r[x & !1], r[x | 1]);
                if x % 2 == 0 { _mm512_unpacklo_ps(a, b) } else { _mm512_unpackhi_ps(a, b) }
            });
            // u[4i + c], lane L: column 4L + c of rows 4i..4i + 4.
            let u: [__m512; LANES] = std::array::from_fn(|x| {
                let (i, c) = (x / 4, x % 4);
                let (a, b) = (_mm512_castps_pd(t[4 * i + c / 2]), _mm512_castps_pd(t[4 * i + 2 + c / 2]));
                _mm512_castpd_ps(if c % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
            });
            for c in 0..4 {
                // Lanes (0, 2) and (1, 3) of u[c], u[4 + c], then of u[8 + c], u[12 + c].
                let v0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
                let v1 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
                let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
                let v3 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
                // Column 4L + c is lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
                let columns = [
                    (c, _mm512_shuffle_f32x4::<0x88>(v0, v2)),
                    (4 + c, _mm512_shuffle_f32x4::<0x88>(v1, v3)),
                    (8 + c, _mm512_shuffle_f32x4::<0xdd>(v0, v2)),
                    (12 + c, _mm512_shuffle_f32x4::<0xdd>(v1, v3)),
                ];
                for (k, column) in columns {
                    _mm512_storeu_ps(dst.as_mut_ptr().add(k * dst_stride), column);
                }
            }
        }
    }
}

/// The interaction's per-row scratch, reused across the rows of a batch.
/// The row functions write the same positions of it for every row of one
/// shape and leave the padding (and `G`'s diagonal) alone, so the zeros
/// written when it takes a new shape stay zeros: no zero fill per row.
#[derive(Default)]
pub(crate) struct RowBuf {
    data: Vec<f32>,
    /// (adjoint?, n, d) of the layout `data` holds.
    shape: Option<(bool, usize, usize)>,
}

impl RowBuf {
    fn zeros_once(&mut self, shape: (bool, usize, usize), len: usize) -> &mut [f32] {
        if self.shape != Some(shape) || self.data.len() != len {
            self.data.clear();
            self.data.resize(len, 0.0);
            self.shape = Some(shape);
        }
        &mut self.data
    }
}

/// Index of pair `(i, j)`, `i < j`, among a row's n(n-1)/2 dots.
fn pair_index(n: usize, i: usize, j: usize) -> usize {
    i * n - i * (i + 1) / 2 + (j - i - 1)
}

/// A row's interacting vectors of `d` floats: those of `head`, then those
/// of `tail` (DLRM: the bottom MLP's output, then the fields' embeddings,
/// each read where it lies).
#[derive(Clone, Copy)]
pub(crate) struct Vectors<'a> {
    pub head: &'a [f32],
    pub tail: &'a [f32],
    pub d: usize,
}

impl<'a> Vectors<'a> {
    /// `v`'s vectors, all in one slice.
    pub(crate) fn of(v: &'a [f32], d: usize) -> Self {
        Vectors { head: &[], tail: v, d }
    }

    fn count(&self) -> usize {
        (self.head.len() + self.tail.len()) / self.d.max(1)
    }

    fn iter(&self) -> impl Iterator<Item = &'a [f32]> {
        let d = self.d.max(1);
        self.head.chunks_exact(d).chain(self.tail.chunks_exact(d))
    }
}

/// One row of [`PairwiseDots`]: `out` gets the n(n-1)/2 dot products of the
/// pairs `i < j` of the row's n vectors; `buf` is scratch. Each dot is
/// summed over `k` in order.
pub(crate) fn pairwise_dots_row(simd: Simd, v: Vectors<'_>, out: &mut [f32], buf: &mut RowBuf) {
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = wide::Avx512::detected(simd) {
        // SAFETY: `k` exists, so AVX-512F was detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            wide::dots_row(k, v, out, buf)
        };
        return;
    }
    dots_row_by_width(&Portable, v, out, buf);
}

#[inline(always)]
fn dots_row_by_width(k: &impl Kernels, v: Vectors<'_>, out: &mut [f32], buf: &mut RowBuf) {
    match v.d {
        // Compiled apart with d known: a vector's copies become a few moves
        // instead of a libc call each (DLRM's 27 vectors of 16, one thread:
        // the adjoint 1.2× as fast, the dots alike).
        LANES => pairwise_dots_row_with(k, Vectors { d: LANES, ..v }, out, buf),
        _ => pairwise_dots_row_with(k, v, out, buf),
    }
}

/// Four vectors `i` at a time against 16 vectors `j` at a time, from the
/// row transposed (`k`-major, `j` padded to 16 with zeros): a broadcast
/// multiply-add per `k`, no horizontal sums.
#[inline(always)]
fn pairwise_dots_row_with(kernels: &impl Kernels, v: Vectors<'_>, out: &mut [f32], buf: &mut RowBuf) {
    let (n, d) = (v.count(), v.d);
    let n_pad = n.next_multiple_of(LANES);
    // [v transposed (d × n_pad) | v, its rows padded with zeros to n_pad (n_pad × d)]
    let buf = buf.zeros_once((false, n, d), 2 * d * n_pad);
    let (vt, vp) = buf.split_at_mut(d * n_pad);
    for (j, vj) in v.iter().enumerate() {
        vp[j * d..(j + 1) * d].copy_from_slice(vj);
    }
    if d == LANES {
        // 16 vectors of 16 at a time, the padding rows' zeros included.
        for j0 in (0..n_pad).step_by(LANES) {
            kernels.transpose(&vp[j0 * LANES..], &mut vt[j0..], n_pad);
        }
    } else {
        for (j, vj) in vp.chunks_exact(d).take(n).enumerate() {
            for (k, &x) in vj.iter().enumerate() {
                vt[k * n_pad + j] = x;
            }
        }
    }
    for i0 in (0..n).step_by(BLOCK) {
        // Only the chunks holding some j > i0.
        for jc in ((i0 + 1) / LANES * LANES..n_pad).step_by(LANES) {
            let acc = kernels.block(&vp[i0 * d..], d, &vt[jc..], n_pad, d);
            // Row i's dots with j in this chunk, j > i: one contiguous run of `out`.
            for (b, acc) in acc.iter().enumerate().take(n - i0) {
                let i = i0 + b;
                let (first, end) = ((i + 1).max(jc), n.min(jc + LANES));
                if first < end {
                    out[pair_index(n, i, first)..][..end - first].copy_from_slice(&acc[first - jc..end - jc]);
                }
            }
        }
    }
}

/// One row of [`PairwiseDots`]' adjoint: `grad_i = Σ_j G_ij · v_j`, `G`
/// the symmetric matrix of `g` (zero diagonal), into `grad` (`head`'s
/// vectors' first, then `tail`'s, as `v` splits them); every value is
/// written. `buf` is scratch.
pub(crate) fn pairwise_dots_grad_row(
    simd: Simd,
    v: Vectors<'_>,
    g: &[f32],
    grad: (&mut [f32], &mut [f32]),
    buf: &mut RowBuf,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = wide::Avx512::detected(simd) {
        // SAFETY: `k` exists, so AVX-512F was detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            wide::dots_grad_row(k, v, g, grad, buf)
        };
        return;
    }
    dots_grad_row_by_width(&Portable, v, g, grad, buf);
}

#[inline(always)]
fn dots_grad_row_by_width(
    k: &impl Kernels,
    v: Vectors<'_>,
    g: &[f32],
    grad: (&mut [f32], &mut [f32]),
    buf: &mut RowBuf,
) {
    match v.d {
        // As in `dots_row_by_width`.
        LANES => pairwise_dots_grad_row_with(k, Vectors { d: LANES, ..v }, g, grad, buf),
        _ => pairwise_dots_grad_row_with(k, v, g, grad, buf),
    }
}

/// Four vectors `i` at a time, 16 lanes of `k` at a time (`d` padded with zeros).
#[inline(always)]
fn pairwise_dots_grad_row_with(
    kernels: &impl Kernels,
    v: Vectors<'_>,
    g: &[f32],
    (grad_head, grad_tail): (&mut [f32], &mut [f32]),
    buf: &mut RowBuf,
) {
    let (n, d) = (v.count(), v.d);
    let d_pad = d.next_multiple_of(LANES);
    let n_blocks = n.next_multiple_of(BLOCK);
    let n_head = v.head.len() / d.max(1);
    // [G (n_blocks × n) | v in one piece, padded (n × d_pad), unless it is one already]
    let in_place = d == d_pad && n_head == 0;
    let padded = if in_place { 0 } else { n * d_pad };
    let buf = buf.zeros_once((true, n, d), n_blocks * n + padded);
    let (gm, vp) = buf.split_at_mut(n_blocks * n);
    // Row i of G: its pairs (i, j > i) are one run of `g`; left of the
    // diagonal it mirrors the rows above (column i, read down), where
    // writing each pair to both places stored down a column.
    let mut run_start = 0;
    for i in 0..n {
        let (above, row) = gm.split_at_mut(i * n);
        let row = &mut row[..n];
        let run = n - 1 - i;
        row[i + 1..].copy_from_slice(&g[run_start..run_start + run]);
        run_start += run;
        for (x, above_j) in row[..i].iter_mut().zip(above.chunks_exact(n)) {
            *x = above_j[i];
        }
    }
    let rows: &[f32] = if in_place {
        v.tail
    } else {
        for (dst, src) in vp.chunks_exact_mut(d_pad).zip(v.iter()) {
            dst[..d].copy_from_slice(src);
        }
        vp
    };
    for i0 in (0..n).step_by(BLOCK) {
        for kc in (0..d_pad).step_by(LANES) {
            let acc = kernels.block(&gm[i0 * n..], n, &rows[kc..], d_pad, n);
            let lanes = (d - kc).min(LANES);
            for (b, acc) in acc.iter().enumerate().take(n - i0) {
                let i = i0 + b;
                let out = if i < n_head { &mut grad_head[i * d..] } else { &mut grad_tail[(i - n_head) * d..] };
                out[kc..][..lanes].copy_from_slice(&acc[..lanes]);
            }
        }
    }
}

impl CustomOp1 for PairwiseDots {
    fn name(&self) -> &'static str {
        "pairwise-dots"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = contiguous_f32(self.name(), s, l)?;
        let (rows, n, d) = rows_n_d(self.name(), l)?;
        let pairs = n * n.saturating_sub(1) / 2;
        let mut out = vec![0.0f32; rows * pairs];
        if pairs > 0 {
            let rows_in = out.par_chunks_mut(pairs).zip(t.par_chunks(n * d));
            rows_in
                .for_each_init(RowBuf::default, |buf, (out, v)| pairwise_dots_row(self.0, Vectors::of(v, d), out, buf));
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, pairs))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(grad_res, &PairwiseDotsGrad(self.0))?))
    }
}

/// d loss / d t of [`PairwiseDots`]: `grad[i] += g_ij · t[j]`, `grad[j] += g_ij · t[i]`.
struct PairwiseDotsGrad(Simd);

impl CustomOp2 for PairwiseDotsGrad {
    fn name(&self) -> &'static str {
        "pairwise-dots-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = contiguous_f32(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let (rows, n, d) = rows_n_d(self.name(), l1)?;
        let pairs = n * n.saturating_sub(1) / 2;
        if g.len() != rows * pairs {
            return Err(candle_core::Error::Msg(format!("pairwise-dots-grad: gradient {:?}", l2.dims())));
        }
        let mut grad = vec![0.0f32; rows * n * d];
        if pairs > 0 {
            let rows_in = grad.par_chunks_mut(n * d).zip(t.par_chunks(n * d)).zip(g.par_chunks(pairs));
            rows_in.for_each_init(RowBuf::default, |buf, ((grad, v), g)| {
                pairwise_dots_grad_row(self.0, Vectors::of(v, d), g, (&mut [], grad), buf)
            });
        }
        Ok((CpuStorage::F32(grad), l1.shape().clone()))
    }
}

/// Test helper: `a` and `b` (the same function built two ways) agree in
/// value, and in the gradients of `sum(out · weights)` w.r.t. `vars`.
#[cfg(test)]
pub(crate) fn assert_same_forward_and_backward(a: &Tensor, b: &Tensor, vars: &[&candle_core::Var]) {
    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    let close = |x: &[f32], y: &[f32], what: &str| {
        assert_eq!(x.len(), y.len(), "{what}: lengths");
        // fp32 rounding scales with the largest value summed into each
        // (a batch norm's gradients are sums over every row).
        let (scale, len) = (y.iter().fold(1f32, |m, v| m.max(v.abs())), y.len());
        for (i, (x, y)) in x.iter().zip(y).enumerate() {
            assert!((x - y).abs() < 1e-5 * scale, "{what}: {x} vs {y} at {i} of {len}, largest {scale}");
        }
    };
    close(&flat(a), &flat(b), "forward");
    let n = a.elem_count();
    let w = Tensor::from_vec((0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>(), a.shape(), a.device())
        .expect("weights");
    let ga = (a * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
    let gb = (b * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
    for v in vars {
        close(&flat(ga.get(v.as_tensor()).expect("grad")), &flat(gb.get(v.as_tensor()).expect("grad")), "gradient");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn pairwise_dots_equal_the_candle_ops_version() {
        let dev = Device::Cpu;
        let (rows, n, d) = (3, 5, 4);
        let data: Vec<f32> = (0..rows * n * d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect();
        let t = Var::from_tensor(&Tensor::from_vec(data, (rows, n, d), &dev).expect("t")).expect("var");
        let pairs: Vec<u32> = (0..n).flat_map(|i| ((i + 1)..n).map(move |j| (i * n + j) as u32)).collect();
        let idx = Tensor::from_vec(pairs.clone(), pairs.len(), &dev).expect("idx");
        let fused = t.as_tensor().apply_op1(PairwiseDots(Simd::Auto)).expect("fused");
        let plain = t
            .as_tensor()
            .matmul(&t.as_tensor().t().expect("t"))
            .and_then(|z| z.reshape((rows, n * n)))
            .and_then(|z| z.index_select(&idx, 1))
            .expect("plain");
        assert_same_forward_and_backward(&fused, &plain, &[&t]);
    }

    /// The AVX-512 build of the interaction (where the CPU has it) and the
    /// portable one give the same bits, forward and backward, for sizes
    /// that fill no block, part of one and several; both match f64.
    #[test]
    fn pairwise_dots_simd_and_portable_agree_bit_for_bit() {
        let mut rng = sparrow_core::rng::Rng::new(5);
        for (n, d) in [(1, 4), (2, 1), (3, 16), (5, 7), (17, 16), (27, 16), (30, 33)] {
            let v: Vec<f32> = (0..n * d).map(|_| rng.normal() as f32).collect();
            let pairs = n * (n - 1) / 2;
            let g: Vec<f32> = (0..pairs).map(|_| rng.normal() as f32).collect();
            // One buffer for everything, as rows of a batch share one: its
            // padding must stay zero across rows and layouts.
            let mut buf = RowBuf::default();
            let other: Vec<f32> = (0..n * d).map(|_| rng.normal() as f32).collect();
            let mut scrap = vec![0.0f32; pairs.max(n * d)];
            let vs = Vectors::of(&v, d);
            pairwise_dots_row(Simd::Auto, Vectors::of(&other, d), &mut scrap[..pairs], &mut buf);
            pairwise_dots_grad_row(Simd::Auto, Vectors::of(&other, d), &g, (&mut [], &mut scrap[..n * d]), &mut buf);
            pairwise_dots_row(Simd::Auto, Vectors::of(&other, d), &mut scrap[..pairs], &mut buf);
            let (mut fast, mut plain) = (vec![0.0f32; pairs], vec![0.0f32; pairs]);
            pairwise_dots_row(Simd::Auto, vs, &mut fast, &mut buf);
            pairwise_dots_row_with(&Portable, vs, &mut plain, &mut buf);
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&plain), "dots n={n} d={d}");
            let (mut fast_g, mut plain_g) = (vec![f32::NAN; n * d], vec![0.5f32; n * d]);
            pairwise_dots_grad_row(Simd::Auto, vs, &g, (&mut [], &mut fast_g), &mut buf);
            pairwise_dots_grad_row_with(&Portable, vs, &g, (&mut [], &mut plain_g), &mut buf);
            assert_eq!(bits(&fast_g), bits(&plain_g), "grad n={n} d={d}");
            // The first vector read from a slice of its own (DLRM's bottom
            // output beside the fields'): the same values.
            if n > 1 {
                let split = Vectors { head: &v[..d], tail: &v[d..], d };
                let mut split_dots = vec![0.0f32; pairs];
                pairwise_dots_row(Simd::Auto, split, &mut split_dots, &mut buf);
                assert_eq!(bits(&split_dots), bits(&fast), "split dots n={n} d={d}");
                let (mut head, mut tail) = (vec![f32::NAN; d], vec![f32::NAN; (n - 1) * d]);
                pairwise_dots_grad_row(Simd::Auto, split, &g, (&mut head, &mut tail), &mut buf);
                assert_eq!(bits(&head), bits(&fast_g[..d]), "split grad n={n} d={d}");
                assert_eq!(bits(&tail), bits(&fast_g[d..]), "split grad n={n} d={d}");
            }
            for i in 0..n {
                for j in i + 1..n {
                    let exact: f64 = (0..d).map(|k| f64::from(v[i * d + k]) * f64::from(v[j * d + k])).sum();
                    let got = f64::from(plain[pair_index(n, i, j)]);
                    assert!((got - exact).abs() < 1e-4 * (1.0 + exact.abs()), "dot ({i}, {j}): {got} vs {exact}");
                }
                for k in 0..d {
                    let exact: f64 = (0..n)
                        .filter(|&j| j != i)
                        .map(|j| f64::from(g[pair_index(n, i.min(j), i.max(j))]) * f64::from(v[j * d + k]))
                        .sum::<f64>();
                    let got = f64::from(plain_g[i * d + k]);
                    assert!((got - exact).abs() < 1e-4 * (1.0 + exact.abs()), "grad ({i}, {k}): {got} vs {exact}");
                }
            }
        }
    }

    /// The AVX-512 transpose (where the CPU has it) moves every float where
    /// the portable one does, and writes nothing else of `dst`.
    #[test]
    fn the_transposes_agree() {
        let src: Vec<f32> = (0..LANES * LANES).map(|i| i as f32 + 0.25).collect();
        for stride in [16usize, 32, 48] {
            let (mut fast, mut plain) = (vec![-1.0f32; 16 * stride], vec![-1.0f32; 16 * stride]);
            #[cfg(target_arch = "x86_64")]
            if let Some(k) = wide::Avx512::detected(Simd::Auto) {
                k.transpose(&src, &mut fast, stride);
            }
            Portable.transpose(&src, &mut plain, stride);
            #[cfg(target_arch = "x86_64")]
            if wide::Avx512::detected(Simd::Auto).is_some() {
                assert_eq!(fast, plain, "stride {stride}");
            }
            for k in 0..LANES {
                for j in 0..stride {
                    let want = if j < LANES { src[j * LANES + k] } else { -1.0 };
                    assert_eq!(plain[k * stride + j], want, "stride {stride}: ({k}, {j})");
                }
            }
        }
    }

    /// FM's sparse part (first order and second order) and LR's (first
    /// order, width 1) equal the candle ops they replace, values and gradients.
    #[test]
    fn first_order_fm_equals_the_candle_ops_version() {
        let dev = Device::Cpu;
        for (rows, f, w, second_order) in [(3, 5, 5, true), (4, 26, 17, true), (3, 5, 5, false), (2, 7, 1, false)] {
            let data: Vec<f32> = (0..rows * f * w).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.05).collect();
            let e = Var::from_tensor(&Tensor::from_vec(data, (rows, f, w), &dev).expect("e")).expect("var");
            let fused = e.as_tensor().apply_op1(FirstOrderFm { second_order }).expect("fused");
            let t = e.as_tensor();
            let mut plain = t.narrow(2, 0, 1).and_then(|x| x.sum(1)).expect("first");
            if second_order {
                let v = t.narrow(2, 1, w - 1).expect("v");
                let s = v.sum(1).and_then(|x| x.sqr()).expect("s");
                let q = v.sqr().and_then(|x| x.sum(1)).expect("q");
                let second = (s - q).and_then(|x| x.sum_keepdim(1)).and_then(|x| x * 0.5).expect("second");
                plain = (plain + second).expect("sum");
            }
            assert_same_forward_and_backward(&fused, &plain, &[&e]);
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// The adjoint from the forward's Σ v is the adjoint that sums them itself.
    #[test]
    fn first_order_adjoint_from_the_forwards_sums_is_the_same() {
        let mut rng = sparrow_core::rng::Rng::new(29);
        let (f, w) = (7, 5);
        for second_order in [false, true] {
            let e: Vec<f32> = (0..f * w).map(|_| rng.normal() as f32).collect();
            let mut sum = vec![0.0; w - 1];
            let (mut a, mut b) = (vec![0.0; f * w], vec![0.0; f * w]);
            first_order_fm_grad_row(&e, w, 0.37, second_order, &mut sum, &mut a);
            let mut out = [0.0];
            let mut forward_sum = vec![0.0; w - 1];
            first_order_fm_rows(Simd::Auto, &e, f * w, (f, w), second_order, &mut forward_sum, &mut out);
            first_order_fm_grad_row_from_sum(
                &e,
                w,
                0.37,
                second_order,
                &forward_sum,
                &mut b,
                &mut WrittenSum::default(),
            );
            assert_eq!(bits(&a), bits(&b));
        }
    }

    /// Rows side by side give each row's bits: LR's width 1 and FM's
    /// widths (fewer lanes than a register, exactly one, one and a part),
    /// with dense values after the fields (a stride beyond them), every
    /// count of rows up to two blocks and a part, values of every sign and
    /// scale.
    #[test]
    fn first_order_rows_side_by_side_equal_one_row_at_a_time() {
        let mut rng = sparrow_core::rng::Rng::new(23);
        for (f, w, dense) in [(1, 1, 0), (26, 1, 13), (3, 2, 0), (26, 17, 13), (5, 9, 2), (4, 21, 1), (3, 33, 1)] {
            let stride = f * w + dense;
            for second_order in [false, true] {
                for n in 0..=2 * FM_ROWS_AT_ONCE + 3 {
                    let x: Vec<f32> = (0..n * stride).map(|i| rng.normal() as f32 * [1e-3, 1.0, 40.0][i % 3]).collect();
                    let mut out = vec![f32::NAN; n];
                    let mut sums = vec![f32::NAN; n * (w - 1)];
                    first_order_fm_rows(Simd::Auto, &x, stride, (f, w), second_order, &mut sums, &mut out);
                    for (r, &got) in out.iter().enumerate() {
                        let mut sum = vec![0.0; w - 1];
                        let want = first_order_fm_row(&x[r * stride..r * stride + f * w], w, second_order, &mut sum);
                        let what = format!("f {f}, w {w}, fm {second_order}, row {r} of {n}");
                        assert_eq!(got.to_bits(), want.to_bits(), "{what}");
                        if second_order {
                            assert_eq!(bits(&sums[r * (w - 1)..(r + 1) * (w - 1)]), bits(&sum), "{what}: Σ v");
                        }
                    }
                }
            }
        }
    }

    /// The gradient pass's sum of what it wrote is that sum (within float
    /// error of f64), so finite exactly when it proves the gradient finite;
    /// a NaN or an infinity in a factor, in a row's Σ v or in a row's
    /// gradient makes it non-finite; finite values too large to sum make it
    /// infinite as well (the caller then looks at the values).
    #[test]
    fn the_gradient_pass_sums_what_it_wrote() {
        let mut rng = sparrow_core::rng::Rng::new(41);
        for (f, w, dense, n) in [(26, 1, 13, 19), (26, 17, 13, 21), (5, 9, 2, 9), (4, 21, 1, 3)] {
            let stride = f * w + dense;
            let d = w - 1;
            let x: Vec<f32> = (0..n * stride).map(|_| rng.normal() as f32).collect();
            let seeds: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            for second_order in [false, true] {
                let what = format!("f {f}, w {w}, fm {second_order}");
                let (mut out, mut sums) = (vec![0.0f32; n], vec![0.0f32; n * d]);
                first_order_fm_rows(Simd::Auto, &x, stride, (f, w), second_order, &mut sums, &mut out);
                let rows = GradRows { x: &x, stride, shape: (f, w), seeds: &seeds, second_order, sums: &sums };
                let mut grad = vec![0.0f32; n * stride];
                let written = first_order_fm_grad_rows(Simd::Auto, rows, &mut grad);
                // Each leading column counted once a row: it holds the row's seed.
                let mut want: f64 = seeds.iter().map(|&g| f64::from(g)).sum();
                if second_order {
                    for r in 0..n {
                        let row = &grad[r * stride..r * stride + f * w];
                        want += row.chunks_exact(w).flat_map(|field| &field[1..]).map(|&v| f64::from(v)).sum::<f64>();
                    }
                }
                assert!(written.proves_finite(), "{what}");
                let got = f64::from(written.total());
                assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "{what}: {got} vs {want}");
                // A non-finite factor, Σ v or seed in any row is never hidden.
                for (poison, r) in [(f32::NAN, 0), (f32::INFINITY, n - 1), (f32::NEG_INFINITY, n / 2)] {
                    let mut bad_x = x.clone();
                    bad_x[r * stride + f * w - 1] = poison;
                    let (mut out, mut bad_sums) = (vec![0.0f32; n], vec![0.0f32; n * d]);
                    first_order_fm_rows(Simd::Auto, &bad_x, stride, (f, w), second_order, &mut bad_sums, &mut out);
                    let mut bad_seeds = seeds.clone();
                    let rows =
                        GradRows { x: &bad_x, stride, shape: (f, w), seeds: &seeds, second_order, sums: &bad_sums };
                    let mut grad = vec![0.0f32; n * stride];
                    let written = first_order_fm_grad_rows(Simd::Auto, rows, &mut grad);
                    let finite = grad.iter().all(|v| v.is_finite());
                    assert!(finite || !written.proves_finite(), "{what}: {poison} in row {r} hidden");
                    bad_seeds[r] = poison;
                    let rows = GradRows { x: &x, stride, shape: (f, w), seeds: &bad_seeds, second_order, sums: &sums };
                    let written = first_order_fm_grad_rows(Simd::Auto, rows, &mut grad);
                    assert!(!written.proves_finite(), "{what}: a {poison} seed in row {r} hidden");
                }
                // Finite values past f32's range when summed: not a proof either way.
                let big: Vec<f32> = seeds.iter().map(|_| 3e38).collect();
                let rows = GradRows { x: &x, stride, shape: (f, w), seeds: &big, second_order, sums: &sums };
                let written = first_order_fm_grad_rows(Simd::Auto, rows, &mut grad);
                if n > 1 && !second_order {
                    assert!(grad.iter().all(|v| v.is_finite()) && !written.proves_finite(), "{what}: overflow");
                }
            }
        }
    }

    /// The AVX2 builds of the first-order and FM passes (where the CPU has
    /// AVX2) give the portable builds' bits, forward (values and Σ v) and
    /// backward, for LR's and FM's widths and partial register widths; the
    /// forward's second order matches f64 within float error.
    #[test]
    fn first_order_passes_for_this_cpu_equal_the_portable_ones() {
        let mut rng = sparrow_core::rng::Rng::new(31);
        for (f, w, dense, n) in [(26, 1, 13, 19), (26, 17, 13, 21), (3, 2, 0, 5), (5, 9, 2, 9), (4, 21, 1, 3)] {
            let stride = f * w + dense;
            let d = w - 1;
            let x: Vec<f32> = (0..n * stride).map(|i| rng.normal() as f32 * [1e-3, 1.0, 40.0][i % 3]).collect();
            let seeds: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            for second_order in [false, true] {
                let what = format!("f {f}, w {w}, fm {second_order}");
                let (mut out, mut sums) = (vec![f32::NAN; n], vec![f32::NAN; n * d]);
                let (mut plain_out, mut plain_sums) = (vec![0.0f32; n], vec![0.0f32; n * d]);
                first_order_fm_rows(Simd::Auto, &x, stride, (f, w), second_order, &mut sums, &mut out);
                first_order_fm_rows_portable(&x, stride, (f, w), second_order, &mut plain_sums, &mut plain_out);
                assert_eq!(bits(&out), bits(&plain_out), "{what}: values");
                if second_order {
                    assert_eq!(bits(&sums), bits(&plain_sums), "{what}: Σ v");
                }
                for (r, &got) in out.iter().enumerate() {
                    let row = &x[r * stride..r * stride + f * w];
                    let first: f64 = row.chunks_exact(w).map(|e| f64::from(e[0])).sum();
                    let second: f64 = if second_order {
                        (1..w)
                            .map(|k| {
                                let s: f64 = row.chunks_exact(w).map(|e| f64::from(e[k])).sum();
                                let q: f64 = row.chunks_exact(w).map(|e| f64::from(e[k]).powi(2)).sum();
                                0.5 * (s * s - q)
                            })
                            .sum()
                    } else {
                        0.0
                    };
                    let scale: f64 = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() + 1.0;
                    let exact = first + second;
                    assert!((f64::from(got) - exact).abs() < 1e-5 * scale, "{what}, row {r}: {got} vs {exact}");
                }
                let (mut grad, mut plain_grad) = (vec![f32::NAN; n * stride], vec![f32::NAN; n * stride]);
                let rows = GradRows { x: &x, stride, shape: (f, w), seeds: &seeds, second_order, sums: &sums };
                let written = first_order_fm_grad_rows(Simd::Auto, rows, &mut grad);
                let plain_written = first_order_fm_grad_rows_portable(rows, &mut plain_grad);
                assert_eq!(bits(&grad), bits(&plain_grad), "{what}: gradient");
                assert_eq!(written.total().to_bits(), plain_written.total().to_bits(), "{what}: sum of the gradient");
                for (r, &g) in seeds.iter().enumerate() {
                    let mut want = vec![f32::NAN; f * w];
                    let mut sum = vec![0.0; d];
                    first_order_fm_grad_row(
                        &x[r * stride..r * stride + f * w],
                        w,
                        g,
                        second_order,
                        &mut sum,
                        &mut want,
                    );
                    let got = &grad[r * stride..r * stride + f * w];
                    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                        // Without a second order the factors are not written.
                        if second_order || i % w == 0 {
                            assert_eq!(got.to_bits(), want.to_bits(), "{what}, row {r}: gradient {i}");
                        } else {
                            assert!(got.is_nan(), "{what}, row {r}: factor {i} written");
                        }
                    }
                    assert!(
                        grad[r * stride + f * w..(r + 1) * stride].iter().all(|v| v.is_nan()),
                        "{what}: dense columns untouched"
                    );
                }
            }
        }
    }
}
