//! The multi-task gates' passes over rows, and the sums of a level's input
//! gradients. At the sizes these kinds run, the step's working set (a
//! level's expert outputs, their gradients, each input's gradients) is
//! larger than a core's L2, and wider arithmetic does little for the
//! backward passes (the gates' adjoint built for AVX-512 took 1–2% off
//! PLE's step, no more; its own kernel, `gates/x86.rs`, which overlaps a
//! row's dots and writes each expert's row once, took 13–20% off the
//! adjoint). So each reads what it needs once:
//! - forward, every gate of a level in one pass over the rows: each row's
//!   expert outputs are read once for all the gates that pool them (MMoE's
//!   three gates each read all four experts before). Its softmax runs
//!   sixteen rows at a time, a row a lane, and a row's mix is summed in
//!   registers: a row at a time, the few logits' max, sum and divisions
//!   were chains of dependent scalar operations, and the mix was read and
//!   written once an expert;
//! - backward, every gate's softmax adjoint and every expert's output
//!   gradient in one pass, each expert's taken through its last ReLU as
//!   it is written (the expert's backward pass then skips its own pass
//!   over it);
//! - an input's gradient is its contributions summed in one pass (they
//!   were added one buffer at a time), and at the bottom the sum of the
//!   inputs' sums in one pass.
//!
//! Each pass has an AVX-512 build of the same code, taken where
//! `train.simd` allows and the CPU has AVX-512F; the forward pass and the
//! adjoint also an AVX2 build, taken where it has AVX2 but not AVX-512F
//! (a Zen 3), whose mixes and adjoint run `x86.rs`'s kernels on eight
//! floats ([`Build`]). Every value is computed by the same operations in
//! the same order as when the passes were separate, so the step's bits
//! are unchanged, on every build (tested).

use rayon::prelude::*;

use sparrow_core::simd::Simd;

use crate::columns::avx512f;
use crate::exp::exp_f32;
use crate::matrix::dot;
use crate::mlp::through_relu;

#[cfg(target_arch = "x86_64")]
mod x86;

/// Rows a task of a pass over rows takes.
const ROWS_PER_TASK: usize = 64;

/// Floats a task of a sum takes.
const FLOATS_PER_TASK: usize = 1 << 13;

/// One gate of a level, forward: its logits `[rows, k]` (bias not yet
/// added; its softmax weights once the pass is done), the experts it
/// pools (indices into the level's outputs) and its mix `[rows, width]`.
pub(super) struct GateForward<'a> {
    pub logits: &'a mut [f32],
    pub bias: &'a [f32],
    pub pool: &'a [usize],
    pub mix: &'a mut [f32],
}

/// One gate of a level, backward: its softmax weights, the gradient of
/// its mix, the experts it pools, and where its logits' gradient goes.
pub(super) struct GateBackward<'a> {
    pub weights: &'a [f32],
    pub d_mix: &'a [f32],
    pub pool: &'a [usize],
    pub d_logits: &'a mut [f32],
}

/// The build a pass over rows runs: the portable code, or the same code
/// compiled for AVX2 or AVX-512F with `x86.rs`'s kernels on its vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Build {
    Portable,
    Avx2,
    Avx512,
}

impl Build {
    /// The widest build `simd` allows and the CPU has.
    pub(super) fn of(simd: Simd) -> Build {
        if avx512f(simd) {
            return Build::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
            return Build::Avx2;
        }
        Build::Portable
    }
}

/// Every row, every gate in order: `logits += bias`, their softmax (in
/// place), then `mix = Σ_k weight_k · outs[pool_k]`. Every pool holds the
/// level's shared experts (`model.experts` is refused below 1), so no
/// pool is empty; the guard below only keeps a chunk size from being 0.
/// Where `simd` allows and the CPU has AVX-512F or AVX2, each task runs the
/// same code compiled for it: the same operations, the same bits (tested).
pub(super) fn softmax_mix(simd: Simd, outs: &[&[f32]], width: usize, gates: Vec<GateForward<'_>>) {
    softmax_mix_on(Build::of(simd), outs, width, gates);
}

/// [`softmax_mix`] on `build` (one the CPU has).
fn softmax_mix_on(build: Build, outs: &[&[f32]], width: usize, gates: Vec<GateForward<'_>>) {
    let Some(rows) = gates.first().map(|g| g.logits.len() / g.pool.len().max(1)) else { return };
    if rows == 0 || width == 0 || gates.iter().any(|g| g.pool.is_empty()) {
        return;
    }
    // Each task's rows of every gate's logits and mix.
    let mut blocks: Vec<Vec<GateForward<'_>>> = (0..rows.div_ceil(ROWS_PER_TASK)).map(|_| Vec::new()).collect();
    for g in gates {
        let k = g.pool.len();
        let parts = g.logits.chunks_mut(k * ROWS_PER_TASK).zip(g.mix.chunks_mut(width * ROWS_PER_TASK));
        for (block, (logits, mix)) in blocks.iter_mut().zip(parts) {
            block.push(GateForward { logits, bias: g.bias, pool: g.pool, mix });
        }
    }
    blocks.par_iter_mut().enumerate().for_each_init(Vec::new, |lanes, (b, gates)| {
        let first = b * ROWS_PER_TASK * width;
        #[cfg(target_arch = "x86_64")]
        match build {
            Build::Avx512 => {
                #[target_feature(enable = "avx512f")]
                fn block_avx512(
                    gates: &mut [GateForward<'_>],
                    outs: &[&[f32]],
                    at: usize,
                    lanes: &mut Vec<[f32; LANES]>,
                ) {
                    block_forward::<16>(gates, outs, at, lanes);
                }
                // SAFETY: `Build::Avx512` only where AVX-512F was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { block_avx512(gates, outs, first, lanes) };
            }
            Build::Avx2 => {
                #[target_feature(enable = "avx2")]
                fn block_avx2(
                    gates: &mut [GateForward<'_>],
                    outs: &[&[f32]],
                    at: usize,
                    lanes: &mut Vec<[f32; LANES]>,
                ) {
                    block_forward::<8>(gates, outs, at, lanes);
                }
                // SAFETY: `Build::Avx2` only where AVX2 was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { block_avx2(gates, outs, first, lanes) };
            }
            Build::Portable => {}
        }
        block_forward::<0>(gates, outs, first, lanes);
    });
}

/// A task's rows (`gates`' parts; its first row's outputs at `at` in
/// `outs`), sixteen rows at a time: every gate's softmax, then each row's
/// mixes (the rows' expert outputs stay in L1 for all the gates).
/// `VECTOR`: the floats in a vector of the build (16 for AVX-512F, 8 for
/// AVX2, 0 for the portable one); the x86 builds keep a mix's sums in
/// registers.
#[inline(always)]
fn block_forward<const VECTOR: usize>(
    gates: &mut [GateForward<'_>],
    outs: &[&[f32]],
    at: usize,
    lanes: &mut Vec<[f32; LANES]>,
) {
    let rows = gates[0].logits.len() / gates[0].pool.len();
    let width = gates[0].mix.len() / rows;
    for first in (0..rows).step_by(LANES) {
        let group = first..rows.min(first + LANES);
        for gate in gates.iter_mut() {
            let k = gate.pool.len();
            softmax_rows(&mut gate.logits[group.start * k..group.end * k], gate.bias, lanes);
        }
        for r in group {
            for gate in gates.iter_mut() {
                let k = gate.pool.len();
                let mix = &mut gate.mix[r * width..(r + 1) * width];
                mix_row::<VECTOR>(mix, &gate.logits[r * k..(r + 1) * k], gate.pool, outs, at + r * width);
            }
        }
    }
}

/// Each row of `logits` (`[rows, k]`, `k` the bias's length; at most
/// [`LANES`] rows) in place: `+ bias`, less the row's max, exp, over the
/// row's sum, as the graph. A row a lane: each step is one operation on
/// every row (a row at a time, its few logits' max, sum and divisions were
/// chains of dependent scalar operations). The same operations in the
/// same order as a row at a time: the same bits.
#[inline(always)]
fn softmax_rows(logits: &mut [f32], bias: &[f32], lanes: &mut Vec<[f32; LANES]>) {
    let k = bias.len();
    let n = logits.len() / k;
    lanes.resize(k, [0.0; LANES]);
    for (j, (lane, &b)) in lanes.iter_mut().zip(bias).enumerate() {
        for (i, v) in lane.iter_mut().enumerate().take(n) {
            *v = logits[i * k + j] + b;
        }
    }
    let mut max = [f32::NEG_INFINITY; LANES];
    for lane in lanes.iter() {
        max.iter_mut().zip(lane).for_each(|(m, &v)| *m = m.max(v));
    }
    // Every lane (those past `n` hold what they held, and go unread): a
    // vector of sixteen exponentials.
    for lane in lanes.iter_mut() {
        lane.iter_mut().zip(&max).for_each(|(v, m)| *v = exp_f32(*v - m));
    }
    // `Iterator::sum`'s bits: it starts from −0.
    let mut sum = [-0.0f32; LANES];
    for lane in lanes.iter() {
        sum.iter_mut().zip(lane).for_each(|(s, &v)| *s += v);
    }
    for (j, lane) in lanes.iter().enumerate() {
        for (i, (&v, s)) in lane.iter().zip(&sum).enumerate().take(n) {
            logits[i * k + j] = v / s;
        }
    }
}

/// `mix = 0 + w_0·e_0 + w_1·e_1 + …` (`e_j` the row of `outs[pool_j]` at
/// `at`), added in that order: the bits of a sum that starts from zero.
/// Sixteen columns at a time in registers, the mix written once (a pass
/// over the mix an expert read and wrote it `k` times); widths of up to
/// four such columns are unrolled, every expert's row one read.
/// In the x86 builds (`VECTOR`) the sums are held in registers
/// (`x86::mix_row`: the arrays below went through the stack between
/// experts, a third of the forward pass on a Zen 4), with the same
/// operations in the same order.
#[inline(always)]
fn mix_row<const VECTOR: usize>(mix: &mut [f32], weights: &[f32], pool: &[usize], outs: &[&[f32]], at: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m256, __m512};
        // SAFETY: `VECTOR` is 16 only in the AVX-512F build and 8 only in
        // the AVX2 one, each called where the CPU has it (`softmax_mix`).
        #[expect(unsafe_code, reason = "calling the kernels of the build made for them")]
        let done = unsafe {
            match VECTOR {
                16 => x86::mix_row_if_whole::<__m512>(mix, weights, pool, outs, at),
                8 => x86::mix_row_if_whole::<__m256>(mix, weights, pool, outs, at),
                _ => false,
            }
        };
        if done {
            return;
        }
    }
    match mix.len() {
        16 => mix_row_of::<1>(mix, weights, pool, outs, at),
        32 => mix_row_of::<2>(mix, weights, pool, outs, at),
        48 => mix_row_of::<3>(mix, weights, pool, outs, at),
        64 => mix_row_of::<4>(mix, weights, pool, outs, at),
        _ => mix_row_any(mix, weights, pool, outs, at),
    }
}

/// [`mix_row`] for a width of `C` times [`LANES`].
#[inline(always)]
fn mix_row_of<const C: usize>(mix: &mut [f32], weights: &[f32], pool: &[usize], outs: &[&[f32]], at: usize) {
    let mut acc = [[0.0f32; LANES]; C];
    for (&wk, &e) in weights.iter().zip(pool) {
        let (e, _) = outs[e][at..at + C * LANES].as_chunks::<LANES>();
        for (a, e) in acc.iter_mut().zip(e) {
            a.iter_mut().zip(e).for_each(|(a, e)| *a += wk * e);
        }
    }
    for (m, a) in mix.as_chunks_mut::<LANES>().0.iter_mut().zip(&acc) {
        *m = *a;
    }
}

/// [`mix_row`] for any width: a chunk of [`LANES`] columns at a time, then the rest.
#[inline(always)]
fn mix_row_any(mix: &mut [f32], weights: &[f32], pool: &[usize], outs: &[&[f32]], at: usize) {
    let width = mix.len();
    let (chunks, rest) = mix.as_chunks_mut::<LANES>();
    for (c, m) in chunks.iter_mut().enumerate() {
        let mut acc = [0.0f32; LANES];
        for (&wk, &e) in weights.iter().zip(pool) {
            let e = &outs[e][at + c * LANES..at + (c + 1) * LANES];
            acc.iter_mut().zip(e).for_each(|(a, e)| *a += wk * e);
        }
        *m = acc;
    }
    let done = width - rest.len();
    for (i, m) in rest.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (&wk, &e) in weights.iter().zip(pool) {
            acc += wk * outs[e][at + done + i];
        }
        *m = acc;
    }
}

/// Rows (forward) and columns (a mix) a pass holds in registers at a time.
const LANES: usize = 16;

/// `dst.copy_from_slice(src)` for the few floats of a row of a gate's
/// logits or a task's outputs. A copy of a length known only at run time
/// is a call to `memcpy`, which costs more than copying a handful of
/// floats: such calls, a row at a time, were about 1% of PLE's step in
/// `perf`. Up to eight floats are copied inline.
#[inline(always)]
pub(super) fn copy_few(dst: &mut [f32], src: &[f32]) {
    /// The copy of `N` floats, its length a constant.
    #[inline(always)]
    fn of<const N: usize>(dst: &mut [f32], src: &[f32]) {
        let (Ok(dst), Ok(src)) = (<&mut [f32; N]>::try_from(dst), <&[f32; N]>::try_from(src)) else {
            unreachable!("copy_few: lengths checked by the caller")
        };
        *dst = *src;
    }
    assert_eq!(dst.len(), src.len(), "copy_few: lengths differ");
    match dst.len() {
        0 => {}
        1 => of::<1>(dst, src),
        2 => of::<2>(dst, src),
        3 => of::<3>(dst, src),
        4 => of::<4>(dst, src),
        5 => of::<5>(dst, src),
        6 => of::<6>(dst, src),
        7 => of::<7>(dst, src),
        8 => of::<8>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

/// Every row, every gate in order: `d_logits = w ⊙ (d w − Σ_j w_j d w_j)`
/// with `d w_k = ⟨d mix, outs[pool_k]⟩`, and `d_experts[pool_k] += w_k · d
/// mix` (the first gate that pools an expert writes its gradient, the
/// later ones add); a pooled expert with a mask (`Mlp::output_mask`: its
/// last ReLU's dropout scale) has its summed gradient taken through that
/// ReLU, for its backward pass to skip (`Mlp::backward_cpu_masked`).
/// Returns which experts some gate pools.
pub(super) fn adjoint(
    simd: Simd,
    (outs, masks): (&[&[f32]], &[Option<f32>]),
    width: usize,
    gates: Vec<GateBackward<'_>>,
    d_experts: &mut [Vec<f32>],
) -> Vec<bool> {
    adjoint_on(Build::of(simd), (outs, masks), width, gates, d_experts)
}

/// [`adjoint`] on `build` (one the CPU has).
fn adjoint_on(
    build: Build,
    (outs, masks): (&[&[f32]], &[Option<f32>]),
    width: usize,
    gates: Vec<GateBackward<'_>>,
    d_experts: &mut [Vec<f32>],
) -> Vec<bool> {
    let mut pooled = vec![false; d_experts.len()];
    // Whether each (gate, pooled expert) adds to what an earlier gate wrote.
    let adds: Vec<Vec<bool>> =
        gates.iter().map(|g| g.pool.iter().map(|&e| std::mem::replace(&mut pooled[e], true)).collect()).collect();
    let rows = gates.first().map_or(0, |g| g.weights.len() / g.pool.len().max(1));
    // Every pooled expert's gradient is `[rows, width]`, of no rows too
    // (a longer buffer left from a larger batch would be read as its).
    for (d, _) in d_experts.iter_mut().zip(&pooled).filter(|(_, p)| **p) {
        d.resize(rows * width, 0.0);
    }
    if rows == 0 || width == 0 || gates.iter().any(|g| g.pool.is_empty()) {
        return pooled;
    }
    // Each task's rows of every gate's logits' gradient and every expert's output gradient.
    let n = rows.div_ceil(ROWS_PER_TASK);
    let mut logit_blocks: Vec<Vec<&mut [f32]>> = (0..n).map(|_| Vec::new()).collect();
    let mut read = Vec::with_capacity(gates.len());
    for g in gates {
        let k = g.pool.len();
        for (block, part) in logit_blocks.iter_mut().zip(g.d_logits.chunks_mut(k * ROWS_PER_TASK)) {
            block.push(part);
        }
        read.push((g.weights, g.d_mix, g.pool));
    }
    let gates = read;
    let mut expert_blocks: Vec<Vec<&mut [f32]>> = (0..n).map(|_| Vec::new()).collect();
    for d in d_experts.iter_mut() {
        let mut parts = d.chunks_mut(width * ROWS_PER_TASK);
        for block in expert_blocks.iter_mut() {
            block.push(parts.next().unwrap_or(&mut []));
        }
    }
    // Only a pooled expert's gradient is its to mask (another's is zeros).
    let masks: Vec<Option<f32>> = masks.iter().zip(&pooled).map(|(m, &p)| m.filter(|_| p)).collect();
    let masks = &masks[..];
    logit_blocks.par_iter_mut().zip(expert_blocks.par_iter_mut()).enumerate().for_each(|(b, (dls, des))| {
        let block = Block { first: b * ROWS_PER_TASK, gates: &gates, adds: &adds, outs, masks, width };
        #[cfg(target_arch = "x86_64")]
        match build {
            Build::Avx512 => {
                #[target_feature(enable = "avx512f")]
                fn block_avx512(block: &Block<'_>, dls: &mut [&mut [f32]], des: &mut [&mut [f32]]) {
                    block_adjoint::<16>(block, dls, des);
                }
                // SAFETY: `Build::Avx512` only where AVX-512F was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { block_avx512(&block, dls, des) };
            }
            Build::Avx2 => {
                #[target_feature(enable = "avx2")]
                fn block_avx2(block: &Block<'_>, dls: &mut [&mut [f32]], des: &mut [&mut [f32]]) {
                    block_adjoint::<8>(block, dls, des);
                }
                // SAFETY: `Build::Avx2` only where AVX2 was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { block_avx2(&block, dls, des) };
            }
            Build::Portable => {}
        }
        block_adjoint::<0>(&block, dls, des);
    });
    pooled
}

/// What a task of [`adjoint`] reads: its first row, each gate's softmax
/// weights, mix gradient and pool, whether each (gate, pooled expert) adds
/// to what an earlier gate wrote, and the experts' outputs.
struct Block<'a> {
    first: usize,
    gates: &'a [(&'a [f32], &'a [f32], &'a [usize])],
    adds: &'a [Vec<bool>],
    outs: &'a [&'a [f32]],
    masks: &'a [Option<f32>],
    width: usize,
}

/// A task's rows of [`adjoint`]: `dls` its rows of each gate's logits'
/// gradient, `des` of each expert's output gradient.
#[inline(always)]
fn block_adjoint<const VECTOR: usize>(block: &Block<'_>, dls: &mut [&mut [f32]], des: &mut [&mut [f32]]) {
    let Block { first, gates, adds, outs, masks, width } = *block;
    let rows = dls[0].len() / gates[0].2.len();
    #[cfg(target_arch = "x86_64")]
    if VECTOR > 0 && width.is_multiple_of(VECTOR) {
        use std::arch::x86_64::{__m256, __m512};
        // SAFETY: `VECTOR` is 16 only in the build for AVX-512F and 8 only
        // in the one for AVX2, each taken where the CPU has it, and `width`
        // is a whole number of its vectors.
        #[expect(unsafe_code, reason = "vector kernels in the build made for them")]
        unsafe {
            match VECTOR {
                16 => return x86::block_adjoint::<__m512>(block, dls, des, rows),
                8 => return x86::block_adjoint::<__m256>(block, dls, des, rows),
                _ => {}
            }
        }
    }
    for r in 0..rows {
        let (row, at) = (first + r, r * width..(r + 1) * width);
        for (((w, d_mix, pool), dl), adds) in gates.iter().zip(dls.iter_mut()).zip(adds) {
            let k = pool.len();
            let dy = &d_mix[row * width..(row + 1) * width];
            let (dl, wr) = (&mut dl[r * k..(r + 1) * k], &w[row * k..(row + 1) * k]);
            for (d, &e) in dl.iter_mut().zip(pool.iter()) {
                *d = dot(dy, &outs[e][row * width..(row + 1) * width]);
            }
            softmax_adjoint(dl, wr);
            for ((&e, &wk), &add) in pool.iter().zip(wr).zip(adds) {
                let de = &mut des[e][at.clone()];
                if add {
                    de.iter_mut().zip(dy).for_each(|(d, g)| *d += wk * g);
                } else {
                    de.iter_mut().zip(dy).for_each(|(d, g)| *d = wk * g);
                }
            }
        }
        // Each summed row through its expert's last ReLU, while in L1.
        for ((de, out), mask) in des.iter_mut().zip(outs).zip(masks) {
            if let (Some(scale), false) = (mask, de.is_empty()) {
                through_relu(&mut de[at.clone()], &out[row * width..(row + 1) * width], *scale);
            }
        }
    }
}

/// A row of a gate's softmax: `d_w` (d loss / d each weight `w`) becomes
/// d loss / d each logit, `w ⊙ (d_w − Σ_j w_j d_w_j)`.
#[inline(always)]
fn softmax_adjoint(d_w: &mut [f32], w: &[f32]) {
    let s: f32 = w.iter().zip(d_w.iter()).map(|(w, d)| w * d).sum();
    d_w.iter_mut().zip(w).for_each(|(d, w)| *d = w * (*d - s));
}

/// `dst = parts[0] + parts[1] + …`, added in that order (zeros if none).
pub(super) fn sum_into(simd: Simd, dst: &mut Vec<f32>, len: usize, parts: &[&[f32]]) {
    dst.resize(len, 0.0);
    sums_into(simd, dst, &[parts.to_vec()], false);
}

/// `dst = 0 + Σ_i (groups[i][0] + groups[i][1] + …)`, each group summed in
/// its order, then the groups' sums in theirs (an empty group adds 0).
pub(super) fn sum_of_sums_into(simd: Simd, dst: &mut Vec<f32>, len: usize, groups: &[Vec<&[f32]>]) {
    dst.resize(len, 0.0);
    sums_into(simd, dst, groups, true);
}

/// One pass: each element of `dst` is its groups' sums added to zero
/// (`from_zero`), or the one group's sum. Compiled for AVX-512F or AVX2
/// where `simd` allows and the CPU has it: the same adds in the same
/// order, the same bits (tested).
fn sums_into(simd: Simd, dst: &mut [f32], groups: &[Vec<&[f32]>], from_zero: bool) {
    let build = Build::of(simd);
    dst.par_chunks_mut(FLOATS_PER_TASK).enumerate().for_each(|(c, d)| {
        let start = c * FLOATS_PER_TASK;
        #[cfg(target_arch = "x86_64")]
        match build {
            Build::Avx512 => {
                #[target_feature(enable = "avx512f")]
                fn sums_avx512(d: &mut [f32], start: usize, groups: &[Vec<&[f32]>], from_zero: bool) {
                    sums_at(d, start, groups, from_zero);
                }
                // SAFETY: `Build::Avx512` only where AVX-512F was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { sums_avx512(d, start, groups, from_zero) };
            }
            Build::Avx2 => {
                #[target_feature(enable = "avx2")]
                fn sums_avx2(d: &mut [f32], start: usize, groups: &[Vec<&[f32]>], from_zero: bool) {
                    sums_at(d, start, groups, from_zero);
                }
                // SAFETY: `Build::Avx2` only where AVX2 was detected.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                return unsafe { sums_avx2(d, start, groups, from_zero) };
            }
            Build::Portable => {}
        }
        sums_at(d, start, groups, from_zero);
    });
}

/// [`sums_into`]'s values from element `start` on, [`LANES`] at a time in
/// registers: each part read once and `d` written once (a group's sum was
/// a copy of its first part and a pass a part into a buffer, then added
/// to `d`, zeroed first: several times the bytes, for the same values).
#[inline(always)]
fn sums_at(d: &mut [f32], start: usize, groups: &[Vec<&[f32]>], from_zero: bool) {
    let len = d.len();
    let (chunks, tail) = d.as_chunks_mut::<LANES>();
    for (i, out) in chunks.iter_mut().enumerate() {
        let at = start + i * LANES;
        let mut acc = [0.0f32; LANES];
        for group in groups {
            let mut sum = [0.0f32; LANES];
            if let Some((first, rest)) = group.split_first() {
                sum.copy_from_slice(&first[at..at + LANES]);
                for p in rest {
                    sum.iter_mut().zip(&p[at..at + LANES]).for_each(|(s, p)| *s += p);
                }
            }
            if from_zero {
                acc.iter_mut().zip(&sum).for_each(|(a, s)| *a += s);
            } else {
                acc = sum;
            }
        }
        *out = acc;
    }
    let done = start + len - tail.len();
    for (i, out) in tail.iter_mut().enumerate() {
        let at = done + i;
        let mut acc = 0.0f32;
        for group in groups {
            let sum = group.split_first().map_or(0.0, |(first, rest)| rest.iter().fold(first[at], |s, p| s + p[at]));
            acc = if from_zero { acc + sum } else { sum };
        }
        *out = acc;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::rng::Rng;

    /// Every length, inline or not, copies each value to its place and
    /// nothing past it.
    #[test]
    fn a_few_floats_are_copied_whatever_their_number() {
        for n in 0..=12 {
            let src: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
            let mut dst = vec![-1.0f32; n + 1];
            copy_few(&mut dst[..n], &src);
            assert_eq!(&dst[..n], &src[..], "{n} floats");
            assert_eq!(dst[n], -1.0, "{n} floats: the value past them kept");
        }
    }

    /// Every build this CPU can run: the portable one, and AVX2's and
    /// AVX-512F's where it has them.
    fn builds() -> Vec<Build> {
        let mut builds = vec![Build::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                builds.push(Build::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                builds.push(Build::Avx512);
            }
        }
        builds
    }

    fn values(n: usize, rng: &mut Rng) -> Vec<f32> {
        (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect()
    }

    /// PLE's pools at one level: two tasks' gates (their own expert, then
    /// the two shared), the shared gate (all four), a gate of six (PLE's
    /// shared gate of seven: more than a group of four) and one of five
    /// (a group of four and one of one), and gates of two, seven (PLE's
    /// shared gate at the benchmarks' shape) and eight (a whole group of
    /// dots); 150 rows, not a multiple of a task's 64. One more expert no
    /// gate pools.
    const POOLS: [&[usize]; 8] = [
        &[2, 0, 1],
        &[3, 0, 1],
        &[0, 1, 2, 3],
        &[5, 4, 3, 2, 1, 0],
        &[1, 5, 0, 4, 2],
        &[6, 7],
        &[7, 6, 5, 4, 3, 2, 1],
        &[0, 1, 2, 3, 4, 5, 6, 7],
    ];
    const POOLED: usize = 8;
    const ROWS: usize = 150;
    const WIDTH: usize = 24;

    /// The gates' forward pass one gate at a time, a row at a time (the
    /// code `softmax_mix` replaces): their softmax weights and mixes.
    fn one_gate_at_a_time(
        outs: &[&[f32]],
        biases: &[Vec<f32>],
        raw: &[Vec<f32>],
        rows: usize,
        width: usize,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let mut weights = raw.to_vec();
        let mut mixes = vec![vec![0.0f32; rows * width]; POOLS.len()];
        for (g, pool) in POOLS.iter().enumerate() {
            let k = pool.len();
            for r in 0..rows {
                let w = &mut weights[g][r * k..(r + 1) * k];
                w.iter_mut().zip(&biases[g]).for_each(|(w, b)| *w += b);
                let max = w.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                w.iter_mut().for_each(|v| *v = exp_f32(*v - max));
                let sum: f32 = w.iter().sum();
                w.iter_mut().for_each(|v| *v /= sum);
                let m = &mut mixes[g][r * width..(r + 1) * width];
                m.fill(0.0);
                for (&wk, &e) in w.iter().zip(pool.iter()) {
                    m.iter_mut().zip(&outs[e][r * width..(r + 1) * width]).for_each(|(m, e)| *m += wk * e);
                }
            }
        }
        (weights, mixes)
    }

    /// The forward pass in lanes of rows, with the widths it unrolls and
    /// ones it does not, on every build the CPU has (AVX-512's vectors of
    /// 16 and AVX2's of 8 take a width of whole vectors up to 64): the
    /// bits of a gate at a time, a row at a time.
    /// Logits far apart (a weight that underflows to 0) and a batch whose
    /// last task ends in a part of a lane group.
    #[test]
    fn the_forward_in_lanes_gives_the_bits_of_a_row_at_a_time_on_every_build() {
        let mut rng = Rng::new(12);
        for width in [8, 16, 24, 32, 48, 56, 64, 80] {
            let outs: Vec<Vec<f32>> = (0..POOLED).map(|_| values(ROWS * width, &mut rng)).collect();
            let outs: Vec<&[f32]> = outs.iter().map(|o| &o[..]).collect();
            let biases: Vec<Vec<f32>> = POOLS.iter().map(|p| values(p.len(), &mut rng)).collect();
            let mut raw: Vec<Vec<f32>> = POOLS.iter().map(|p| values(ROWS * p.len(), &mut rng)).collect();
            raw[2][7] = -200.0;
            raw[0][3 * 3 + 1] = 150.0;
            let (weights_one, mixes_one) = one_gate_at_a_time(&outs, &biases, &raw, ROWS, width);
            assert_eq!(weights_one[2][7], 0.0, "a weight underflows");
            for build in builds() {
                let mut weights = raw.clone();
                let mut mixes = vec![vec![7.0f32; ROWS * width]; POOLS.len()];
                let forward = (weights.iter_mut().zip(mixes.iter_mut()).zip(&biases).zip(POOLS))
                    .map(|(((logits, mix), bias), pool)| GateForward { logits, bias, pool, mix })
                    .collect();
                softmax_mix_on(build, &outs, width, forward);
                // The first value whose bits differ, if any.
                let differs = |a: &[Vec<f32>], b: &[Vec<f32>]| {
                    a.iter().flatten().zip(b.iter().flatten()).position(|(x, y)| x.to_bits() != y.to_bits())
                };
                assert_eq!(differs(&weights, &weights_one), None, "softmax weights, width {width}, {build:?}");
                assert_eq!(differs(&mixes, &mixes_one), None, "mixes, width {width}, {build:?}");
            }
        }
    }

    /// The adjoint on every build, with and without masks, against one
    /// gate at a time: an expert's gradient written by the first gate that
    /// pools it, added to by the later ones, then through its ReLU.
    fn adjoint_matches_a_pass_a_gate(outs: &[&[f32]], weights: &[Vec<f32>], width: usize, rng: &mut Rng) {
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Backward, one gate at a time; an expert's gradient written by
        // the first gate that pools it, added to by the later ones.
        let d_mixes: Vec<Vec<f32>> = POOLS.iter().map(|_| values(ROWS * width, rng)).collect();
        let mut d_logits_one: Vec<Vec<f32>> = POOLS.iter().map(|p| vec![0.0; ROWS * p.len()]).collect();
        let mut d_experts_one = vec![vec![0.0f32; ROWS * width]; POOLED + 1];
        let mut filled = [false; POOLED + 1];
        for (g, pool) in POOLS.iter().enumerate() {
            let k = pool.len();
            for r in 0..ROWS {
                let dy = &d_mixes[g][r * width..(r + 1) * width];
                let dl = &mut d_logits_one[g][r * k..(r + 1) * k];
                for (d, &e) in dl.iter_mut().zip(pool.iter()) {
                    *d = dot(dy, &outs[e][r * width..(r + 1) * width]);
                }
                let wr = &weights[g][r * k..(r + 1) * k];
                let s: f32 = wr.iter().zip(dl.iter()).map(|(w, d)| w * d).sum();
                dl.iter_mut().zip(wr).for_each(|(d, w)| *d = w * (*d - s));
            }
            for (j, &e) in pool.iter().enumerate() {
                for r in 0..ROWS {
                    let wk = weights[g][r * k + j];
                    let d = &mut d_experts_one[e][r * width..(r + 1) * width];
                    let dy = d_mixes[g][r * width..(r + 1) * width].iter();
                    if filled[e] {
                        d.iter_mut().zip(dy).for_each(|(d, g)| *d += wk * g);
                    } else {
                        d.iter_mut().zip(dy).for_each(|(d, g)| *d = wk * g);
                    }
                }
                filled[e] = true;
            }
        }
        // Each expert's gradient through its last ReLU as the MLP's own
        // pass took it (`relu_mask_from`): zero where its output is not
        // positive, times dropout's scale where that is not 1.
        let relu = |d: &[f32], out: &[f32], scale: f32| -> Vec<f32> {
            let through = |(&g, &a): (&f32, &f32)| match (a > 0.0, scale == 1.0) {
                (false, _) => 0.0,
                (true, true) => g,
                (true, false) => g * scale,
            };
            d.iter().zip(out).map(through).collect()
        };
        // Without masks; with masks of scale 1 and 1.25 and an expert
        // without one; a mask for the last, unpooled, expert is ignored.
        let no_masks = [None; POOLED + 1];
        let some_masks = [Some(1.0), Some(1.25), None, Some(1.0), Some(1.5), Some(1.0), None, Some(1.25), Some(2.0)];
        // On every build the CPU has.
        for (build, masks) in builds().into_iter().flat_map(|b| [(b, no_masks), (b, some_masks)]) {
            let what = format!("width {width}, {build:?}, masks {masks:?}");
            let mut d_logits: Vec<Vec<f32>> = POOLS.iter().map(|p| vec![9.0; ROWS * p.len()]).collect();
            // Stale values in the experts' buffers, and an expert no gate pools.
            let mut d_experts = vec![vec![5.0f32; ROWS * width]; POOLED + 1];
            let backward = (d_logits.iter_mut().zip(weights).zip(&d_mixes).zip(POOLS))
                .map(|(((d_logits, weights), d_mix), pool)| GateBackward { weights, d_mix, pool, d_logits })
                .collect();
            let pooled = adjoint_on(build, (outs, &masks), width, backward, &mut d_experts);
            assert_eq!(pooled, [true, true, true, true, true, true, true, true, false]);
            assert_eq!(bits(&d_logits), bits(&d_logits_one), "the gates' logits' gradients, {what}");
            for e in 0..POOLED {
                let expected = match masks[e] {
                    Some(scale) => relu(&d_experts_one[e], outs[e], scale),
                    None => d_experts_one[e].clone(),
                };
                assert_eq!(bits(&d_experts[e..=e]), bits(&[expected]), "expert {e}'s output gradient, {what}");
            }
            assert!(d_experts[POOLED].iter().all(|&v| v == 5.0), "the unpooled expert's buffer is not the adjoint's");
        }
    }

    /// Every gate and sum, checked bit for bit against the passes they
    /// replace: one gate at a time, one contribution added at a time.
    #[test]
    fn one_pass_for_every_gate_gives_the_bits_of_a_pass_a_gate() {
        let mut rng = Rng::new(11);
        let outs: Vec<Vec<f32>> = (0..POOLED).map(|_| values(ROWS * WIDTH, &mut rng)).collect();
        let outs: Vec<&[f32]> = outs.iter().map(|o| &o[..]).collect();
        let biases: Vec<Vec<f32>> = POOLS.iter().map(|p| values(p.len(), &mut rng)).collect();
        let raw: Vec<Vec<f32>> = POOLS.iter().map(|p| values(ROWS * p.len(), &mut rng)).collect();

        // Forward, one gate at a time (the code this replaces).
        let (weights_one, mixes_one) = one_gate_at_a_time(&outs, &biases, &raw, ROWS, WIDTH);
        let mut weights = raw.clone();
        let mut mixes = vec![vec![7.0f32; ROWS * WIDTH]; POOLS.len()];
        let forward = (weights.iter_mut().zip(mixes.iter_mut()).zip(&biases).zip(POOLS))
            .map(|(((logits, mix), bias), pool)| GateForward { logits, bias, pool, mix })
            .collect();
        softmax_mix(Simd::Auto, &outs, WIDTH, forward);
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&weights), bits(&weights_one), "the gates' softmax weights");
        assert_eq!(bits(&mixes), bits(&mixes_one), "the gates' mixes");

        // Backward, at the test's width (three AVX2 vectors) and at widths
        // of whole AVX-512 vectors (one, four, five) and of one AVX2
        // vector: the x86 builds' own code.
        for width in [WIDTH, 8, 16, 64, 80] {
            let outs: Vec<Vec<f32>> = (0..POOLED).map(|_| values(ROWS * width, &mut rng)).collect();
            let outs: Vec<&[f32]> = outs.iter().map(|o| &o[..]).collect();
            adjoint_matches_a_pass_a_gate(&outs, &weights, width, &mut rng);
        }

        // An input's parts summed in one pass, and the bottom's sum of sums,
        // against adding one buffer at a time (an empty group adds zeros),
        // over three tasks' floats and a tail shorter than a lane group;
        // negative zeros in one element of a group's parts.
        let len = ROWS * WIDTH + 3 * FLOATS_PER_TASK + 5;
        let mut parts: Vec<Vec<f32>> = (0..4).map(|_| values(len, &mut rng)).collect();
        for p in &mut parts[..3] {
            p[7] = -0.0;
            p[len - 2] = -0.0;
        }
        let groups: Vec<Vec<&[f32]>> = vec![vec![&parts[0], &parts[1], &parts[2]], vec![], vec![&parts[3]]];
        let mut one_at_a_time: Vec<Vec<f32>> = Vec::new();
        for group in &groups {
            let mut d = group.first().map_or(vec![0.0; len], |p| p.to_vec());
            for p in group.iter().skip(1) {
                d.iter_mut().zip(p.iter()).for_each(|(d, p)| *d += p);
            }
            one_at_a_time.push(d);
        }
        assert!(one_at_a_time[0][7].is_sign_negative(), "a group's sum of negative zeros");
        let mut total_one = vec![0.0f32; len];
        for d in &one_at_a_time {
            total_one.iter_mut().zip(d).for_each(|(t, d)| *t += d);
        }
        // Every build: AVX-512F's (where the CPU has it), AVX2's, the baseline's.
        for simd in [Simd::Auto, Simd::Avx2, Simd::Portable] {
            for (group, expected) in groups.iter().zip(&one_at_a_time) {
                let mut d = vec![3.0f32; 10];
                sum_into(simd, &mut d, len, group);
                assert_eq!(bits(&[d]), bits(std::slice::from_ref(expected)), "an input's gradient, {simd:?}");
            }
            let mut total = vec![3.0f32; 2 * len];
            sum_of_sums_into(simd, &mut total, len, &groups);
            assert_eq!(bits(&[total]), bits(std::slice::from_ref(&total_one)), "the bottom's gradient, {simd:?}");
        }
    }

    /// Gates of seven, eight and eleven experts (a group of eight dots and
    /// one of three) at a width of whole vectors: each x86 build's bits
    /// are the portable build's (where the CPU has it).
    #[test]
    fn gates_of_more_than_a_group_of_dots_give_the_portable_bits() {
        let mut rng = Rng::new(13);
        let (rows, width) = (70, 32);
        let pools: [&[usize]; 3] =
            [&[6, 0, 1, 2, 3, 4, 5], &[7, 1, 0, 3, 2, 5, 4, 6], &[10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]];
        let outs: Vec<Vec<f32>> = (0..11).map(|_| values(rows * width, &mut rng)).collect();
        let outs: Vec<&[f32]> = outs.iter().map(|o| &o[..]).collect();
        let weights: Vec<Vec<f32>> = pools.iter().map(|p| values(rows * p.len(), &mut rng)).collect();
        let d_mixes: Vec<Vec<f32>> = pools.iter().map(|_| values(rows * width, &mut rng)).collect();
        let masks = [Some(1.0); 11];
        let run = |build: Build| {
            let mut d_logits: Vec<Vec<f32>> = pools.iter().map(|p| vec![0.0; rows * p.len()]).collect();
            let mut d_experts = vec![Vec::new(); 11];
            let backward = (d_logits.iter_mut().zip(&weights).zip(&d_mixes).zip(pools))
                .map(|(((d_logits, weights), d_mix), pool)| GateBackward { weights, d_mix, pool, d_logits })
                .collect();
            adjoint_on(build, (&outs, &masks), width, backward, &mut d_experts);
            let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&d_logits), bits(&d_experts))
        };
        let portable = run(Build::Portable);
        for build in builds() {
            let got = run(build);
            assert_eq!(got.0, portable.0, "the gates' logits' gradients, {build:?}");
            assert_eq!(got.1, portable.1, "the experts' output gradients, {build:?}");
        }
    }

    /// A batch of no rows leaves every pooled expert's gradient empty, not
    /// as long as a larger batch left it.
    #[test]
    fn no_rows_leave_every_pooled_gradient_empty() {
        let mut d_logits: Vec<Vec<f32>> = POOLS.iter().map(|_| Vec::new()).collect();
        let mut d_experts = vec![vec![5.0f32; ROWS * WIDTH]; POOLED + 1];
        let outs: Vec<&[f32]> = vec![&[]; POOLED];
        let backward = (d_logits.iter_mut().zip(POOLS))
            .map(|(d_logits, pool)| GateBackward { weights: &[], d_mix: &[], pool, d_logits })
            .collect();
        let pooled = adjoint(Simd::Auto, (&outs, &[None; POOLED + 1]), WIDTH, backward, &mut d_experts);
        assert_eq!(pooled, [true, true, true, true, true, true, true, true, false]);
        assert!(d_experts[..POOLED].iter().all(Vec::is_empty), "a pooled expert's gradient has no rows");
    }
}
