//! The passes over the attention unit's first layer, a `[h]`-wide row a
//! history item (DIN's default `[36]`, a few thousand items a batch), on
//! AVX-512F kernels where `h` ≤ 48. Forward: each item's product plus its
//! batch row's `q·(W_q + W_d)` and the bias, through the ReLU. Backward:
//! each item's gradient through the ReLU, summed into the bias's gradient
//! and into its batch row's; for a unit of one layer (`[36] → 1`) that
//! gradient is the score's times the last layer's weights, computed here
//! rather than laid out by a product first and read back. Built for the
//! x86-64 baseline these loops ran four lanes at a time with scalar tails
//! and kept every sum in memory; the kernels hold the bias, the row's term
//! and the sums in registers (a row's items are consecutive) and take 16
//! lanes a step. The same operations in the same order as the portable
//! loops: the same bits (tested).

use sparrow_core::simd::Simd;

use crate::mlp::first_product::FirstGrad;

/// The widest row the kernels take (three 16-lane vectors).
const MAX_H: usize = 48;

/// `out[p] = out[p] + row_terms[at_rows[p]] + bias` (`[h]` each), then
/// `max(·, 0)` where `relu`, for each position `p` of `out`.
pub(super) fn add_row_terms(
    simd: Simd,
    out: &mut [f32],
    at_rows: &[u32],
    row_terms: &[f32],
    (bias, relu): (&[f32], bool),
) {
    let h = bias.len();
    assert_eq!(out.len(), at_rows.len() * h, "unit pass: {} positions of {h}", at_rows.len());
    let rows = row_terms.len() / h.max(1);
    rows_within(at_rows, rows);
    if h == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernels(simd, h) {
        // SAFETY: AVX-512F was detected (`kernels`); `out` holds
        // `at_rows.len()` rows of `h`, each row index is below `rows`, so
        // `row_terms` holds its `h` values, and `bias` is `h` long
        // (asserted above); `NV` is `h`'s count of 16-lane vectors.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let (o, t, b) = (out.as_mut_ptr(), row_terms.as_ptr(), bias.as_ptr());
            match h.div_ceil(16) {
                1 => x86::add_row_terms::<1>(h, o, at_rows, t, b, relu),
                2 => x86::add_row_terms::<2>(h, o, at_rows, t, b, relu),
                _ => x86::add_row_terms::<3>(h, o, at_rows, t, b, relu),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::columns::avx2_fma(simd) {
        #[target_feature(enable = "avx2,fma")]
        fn terms_avx2(out: &mut [f32], at_rows: &[u32], row_terms: &[f32], (bias, relu): (&[f32], bool)) {
            add_row_terms_loop(out, at_rows, row_terms, (bias, relu));
        }
        // SAFETY: `avx2_fma` is true only where AVX2 and FMA were detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { terms_avx2(out, at_rows, row_terms, (bias, relu)) };
    }
    add_row_terms_loop(out, at_rows, row_terms, (bias, relu));
}

/// [`add_row_terms`]' values, a position at a time (`for` loops, so that
/// the AVX2 build compiles them for its vectors: a `for_each`'s `fold`
/// may be compiled apart from it).
#[inline(always)]
fn add_row_terms_loop(out: &mut [f32], at_rows: &[u32], row_terms: &[f32], (bias, relu): (&[f32], bool)) {
    let h = bias.len();
    for (o, &r) in out.chunks_exact_mut(h).zip(at_rows) {
        let r = r as usize;
        let terms = o.iter_mut().zip(&row_terms[r * h..(r + 1) * h]).zip(bias);
        if relu {
            for ((o, a), b) in terms {
                *o = (*o + a + b).max(0.0);
            }
        } else {
            for ((o, a), b) in terms {
                *o = *o + a + b;
            }
        }
    }
}

/// Each position's gradient `g[p]` (`[h]`) through a ReLU whose output
/// was `relu.0` (kept values times dropout's scale `relu.1`, as
/// `mlp::relu::relu_mask`), where given; then, in the positions' order,
/// added to `db` and to its batch row's sum `g_rows[at_rows[p]]` (which
/// the caller zeroes). `g` is laid out and rewritten, or each `seed[p]·w`
/// computed here and written to `into`, with the next layer's weights'
/// gradient `Σ_p x[p]·seed[p]` where given ([`FirstGrad`]).
pub(super) fn mask_and_sum(
    simd: Simd,
    (g, relu): (FirstGrad<'_>, Option<(&[f32], f32)>),
    at_rows: &[u32],
    (db, g_rows): (&mut [f32], &mut [f32]),
) {
    let h = db.len();
    let (g, outer, next_dw) = match g {
        FirstGrad::Laid(g) => (g, None, None),
        FirstGrad::Outer { seed, w, into, next_dw } => {
            assert_eq!((seed.len(), w.len()), (at_rows.len(), h), "unit pass: the outer product's sides");
            if let Some((x, dw)) = &next_dw {
                assert_eq!((x.len(), dw.len()), (at_rows.len() * h, h), "unit pass: the next layer's input");
            }
            (into, Some((seed, w)), next_dw)
        }
    };
    assert_eq!(g.len(), at_rows.len() * h, "unit pass: {} positions of {h}", at_rows.len());
    assert!(relu.is_none_or(|(out, _)| out.len() == g.len()), "unit pass: the ReLU's output");
    let rows = g_rows.len() / h.max(1);
    rows_within(at_rows, rows);
    if h == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernels(simd, h) {
        // SAFETY: AVX-512F was detected (`kernels`); `g` (and the ReLU's
        // output, of its length) holds `at_rows.len()` rows of `h`, as
        // the outer product's `seed` holds one value a position and its
        // `w` `h` values; each row index is below `rows`, so `g_rows`
        // holds its `h` values, and `db` is `h` long (asserted above);
        // `NV` is `h`'s count of 16-lane vectors.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let relu = relu.map(|(out, scale)| (out.as_ptr(), scale));
            let outer = outer.map(|(seed, w)| (seed.as_ptr(), w.as_ptr()));
            let next_dw = next_dw.map(|(x, dw)| (x.as_ptr(), dw.as_mut_ptr()));
            let (g, db, sums) = (g.as_mut_ptr(), db.as_mut_ptr(), g_rows.as_mut_ptr());
            match h.div_ceil(16) {
                1 => x86::mask_and_sum::<1>(h, (g, outer, relu), next_dw, at_rows, (db, sums)),
                2 => x86::mask_and_sum::<2>(h, (g, outer, relu), next_dw, at_rows, (db, sums)),
                _ => x86::mask_and_sum::<3>(h, (g, outer, relu), next_dw, at_rows, (db, sums)),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::columns::avx2_fma(simd) {
        #[target_feature(enable = "avx2,fma")]
        fn mask_avx2(
            (g, outer, relu): (&mut [f32], Option<Seeded<'_>>, Option<Relu<'_>>),
            next_dw: Option<(&[f32], &mut [f32])>,
            at_rows: &[u32],
            (db, g_rows): (&mut [f32], &mut [f32]),
        ) {
            mask_and_sum_loop((g, outer, relu), next_dw, at_rows, (db, g_rows));
        }
        // SAFETY: `avx2_fma` is true only where AVX2 and FMA were detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { mask_avx2((g, outer, relu), next_dw, at_rows, (db, g_rows)) };
    }
    mask_and_sum_loop((g, outer, relu), next_dw, at_rows, (db, g_rows));
}

/// An outer product's sides: each position's seed and the weights.
type Seeded<'a> = (&'a [f32], &'a [f32]);
/// A ReLU's output and its dropout scale.
type Relu<'a> = (&'a [f32], f32);

/// [`mask_and_sum`]'s values, a position at a time (`for` loops, so that
/// the AVX2 build compiles them for its vectors, its `mul_add` one fused
/// multiply-add).
#[inline(always)]
fn mask_and_sum_loop(
    (g, outer, relu): (&mut [f32], Option<Seeded<'_>>, Option<Relu<'_>>),
    next_dw: Option<(&[f32], &mut [f32])>,
    at_rows: &[u32],
    (db, g_rows): (&mut [f32], &mut [f32]),
) {
    let h = db.len();
    if let (Some((x, dw)), Some((seed, _))) = (next_dw, outer) {
        // The one-column product's sum (`matrix::column`).
        dw.fill(0.0);
        for (p, (x, &s)) in x.chunks_exact(h).zip(seed).enumerate() {
            for (d, &x) in dw.iter_mut().zip(x) {
                *d = if p == 0 { x * s } else { x.mul_add(s, *d) };
            }
        }
    }
    for (p, &r) in at_rows.iter().enumerate() {
        let (r, gp) = (r as usize, &mut g[p * h..(p + 1) * h]);
        if let Some((seed, w)) = outer {
            for (g, &w) in gp.iter_mut().zip(w) {
                *g = seed[p] * w;
            }
        }
        if let Some((out, scale)) = relu {
            let out = &out[p * h..(p + 1) * h];
            if scale == 1.0 {
                for (g, &a) in gp.iter_mut().zip(out) {
                    *g = if a > 0.0 { *g } else { 0.0 };
                }
            } else {
                for (g, &a) in gp.iter_mut().zip(out) {
                    *g = if a > 0.0 { *g * scale } else { 0.0 };
                }
            }
        }
        let sums = g_rows[r * h..(r + 1) * h].iter_mut().zip(db.iter_mut());
        for ((s, d), g) in sums.zip(gp.iter()) {
            *s += g;
            *d += g;
        }
    }
}

/// From each position's `e[p] = [l, m]` (`2·d`: the unit's gradient
/// through the item's linear part and through `q ⊙ k`): the item's
/// gradient `dk[p] += l + m ⊙ q` (its row's query `q`) and the position's
/// share of the query's `dq[p] = m ⊙ k` (the item `k = keys[p]`).
pub(super) fn item_and_query(
    simd: Simd,
    d: usize,
    ((e, keys), q_rows): ((&[f32], &[f32]), &[f32]),
    at_rows: &[u32],
    (dk, dq): (&mut [f32], &mut [f32]),
) {
    let n = at_rows.len();
    assert!(e.len() == 2 * n * d && keys.len() == n * d, "unit pass: {n} positions of {d}");
    assert!(dk.len() == n * d && dq.len() == n * d, "unit pass: {n} positions' gradients of {d}");
    let rows = q_rows.len() / d.max(1);
    rows_within(at_rows, rows);
    #[cfg(target_arch = "x86_64")]
    if avx_rows(simd, d) {
        // SAFETY: AVX was detected (`avx_rows`); `e` holds `n` rows of
        // `2·d`, `keys`, `dk` and `dq` `n` rows of `d`, and each row index
        // is below `rows`, so `q_rows` holds its `d` values (asserted
        // above); `d` is a multiple of 8, as the kernel requires.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            x86::item_and_query(
                d,
                (e.as_ptr(), keys.as_ptr(), q_rows.as_ptr()),
                at_rows,
                (dk.as_mut_ptr(), dq.as_mut_ptr()),
            );
        }
        return;
    }
    let items = e.chunks_exact(2 * d).zip(keys.chunks_exact(d)).zip(at_rows);
    for ((dq, dk), ((e, k), &r)) in dq.chunks_exact_mut(d).zip(dk.chunks_exact_mut(d)).zip(items) {
        let (lin, prod) = e.split_at(d);
        let q = &q_rows[r as usize * d..(r as usize + 1) * d];
        for ((((dk, dq), lin), prod), (q, k)) in dk.iter_mut().zip(dq).zip(lin).zip(prod).zip(q.iter().zip(k)) {
            *dk += lin + prod * q;
            *dq = prod * k;
        }
    }
}

/// A slot of `d` values in each batch row of a matrix, `stride` values a
/// row, starting at `offset`.
pub(super) struct Slots<'a> {
    pub(super) values: &'a mut [f32],
    pub(super) stride: usize,
    pub(super) offset: usize,
}

/// Each position's `d` values `rows[p]` added to its batch row's slot,
/// times `scale[p]` where given (`slot += s·v`, a product then a sum), in
/// the positions' order: the attention's weighted sum forward, the
/// queries' shares of their gradients backward.
pub(super) fn add_to_slots(
    simd: Simd,
    d: usize,
    (rows, scale): (&[f32], Option<&[f32]>),
    at_rows: &[u32],
    slots: Slots<'_>,
) {
    let n = at_rows.len();
    assert!(rows.len() == n * d && scale.is_none_or(|s| s.len() == n), "unit pass: {n} positions of {d}");
    let batch = slots.values.len() / slots.stride.max(1);
    assert!(slots.offset + d <= slots.stride, "unit pass: a slot past its row");
    rows_within(at_rows, batch);
    #[cfg(target_arch = "x86_64")]
    if avx_rows(simd, d) {
        // SAFETY: AVX was detected (`avx_rows`); `rows` holds `n` rows of
        // `d` (and `scale` `n` values); each slot, `d` values from
        // `r·stride + offset` with `offset + d ≤ stride` and `r` below the
        // batch's rows, is inside `slots.values` (asserted above); `d` is
        // a multiple of 8.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let out = (slots.values.as_mut_ptr(), slots.stride, slots.offset);
            x86::add_to_slots(d, (rows.as_ptr(), scale.map(<[f32]>::as_ptr)), at_rows, out);
        }
        return;
    }
    for (p, &r) in at_rows.iter().enumerate() {
        let at = r as usize * slots.stride + slots.offset;
        let slot = slots.values[at..at + d].iter_mut().zip(&rows[p * d..(p + 1) * d]);
        match scale {
            Some(s) => slot.for_each(|(o, v)| *o += s[p] * v),
            None => slot.for_each(|(o, v)| *o += v),
        }
    }
}

/// `[k, q ⊙ k]` a position (`2·d`): its item `k = keys[p]` and the
/// product with its row's query `q = q_rows[at_rows[p]]`.
pub(super) fn items_and_products(
    simd: Simd,
    d: usize,
    (keys, q_rows): (&[f32], &[f32]),
    at_rows: &[u32],
    kq: &mut [f32],
) {
    let n = at_rows.len();
    assert!(keys.len() == n * d && kq.len() == 2 * n * d, "unit pass: {n} positions of {d}");
    let rows = q_rows.len() / d.max(1);
    rows_within(at_rows, rows);
    #[cfg(target_arch = "x86_64")]
    if avx_rows(simd, d) {
        // SAFETY: AVX was detected (`avx_rows`); `keys` holds `n` rows of
        // `d` and `kq` of `2·d`, each row index is below `rows` (asserted
        // above); `d` is a multiple of 8.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            x86::items_and_products(d, (keys.as_ptr(), q_rows.as_ptr()), at_rows, kq.as_mut_ptr());
        }
        return;
    }
    for ((f, k), &r) in kq.chunks_exact_mut(2 * d).zip(keys.chunks_exact(d)).zip(at_rows) {
        let q = &q_rows[r as usize * d..(r as usize + 1) * d];
        let (fk, fprod) = f.split_at_mut(d);
        fk.copy_from_slice(k);
        fprod.iter_mut().zip(q.iter().zip(k)).for_each(|(o, (q, k))| *o = q * k);
    }
}

/// Backward through the weighted sum: each position's `d_scores[p] =
/// ⟨g_r, k_p⟩` (`crate::matrix::dot`'s sum: its bits) and its item's
/// gradient `dk[p] = scores[p]·g_r`, with `g_r` its batch row's slot of
/// the gradient.
pub(super) fn score_grads(
    simd: Simd,
    d: usize,
    (keys, scores): (&[f32], &[f32]),
    at_rows: &[u32],
    g: (&[f32], usize, usize),
    (d_scores, dk): (&mut [f32], &mut [f32]),
) {
    let (n, (g, stride, offset)) = (at_rows.len(), g);
    assert!(keys.len() == n * d && scores.len() == n, "unit pass: {n} positions of {d}");
    assert!(d_scores.len() == n && dk.len() == n * d, "unit pass: {n} positions' gradients of {d}");
    let batch = g.len() / stride.max(1);
    assert!(offset + d <= stride, "unit pass: a slot past its row");
    rows_within(at_rows, batch);
    #[cfg(target_arch = "x86_64")]
    if avx_rows(simd, d) {
        // SAFETY: AVX was detected (`avx_rows`); `keys` and `dk` hold `n`
        // rows of `d`, `scores` and `d_scores` `n` values; each slot, `d`
        // values from `r·stride + offset` with `offset + d ≤ stride` and
        // `r` below the batch's rows, is inside `g` (asserted above); `d`
        // is a multiple of 8.
        #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
        unsafe {
            let slots = (g.as_ptr(), stride, offset);
            x86::score_grads(d, (keys.as_ptr(), scores), at_rows, slots, (d_scores, dk.as_mut_ptr()));
        }
        return;
    }
    for (p, &r) in at_rows.iter().enumerate() {
        let at = r as usize * stride + offset;
        let (g, k) = (&g[at..at + d], &keys[p * d..(p + 1) * d]);
        d_scores[p] = crate::matrix::dot(g, k);
        dk[p * d..(p + 1) * d].iter_mut().zip(g).for_each(|(o, g)| *o = scores[p] * g);
    }
}

/// Every position's batch row is below `rows` (a batch the kernels'
/// reads and writes stay inside).
fn rows_within(at_rows: &[u32], rows: usize) {
    assert!(at_rows.iter().all(|&r| (r as usize) < rows), "unit pass: a position's row past {rows}");
}

/// Whether the 8-lane kernels take rows of `d`.
fn avx_rows(simd: Simd, d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd.allows() && d > 0 && d.is_multiple_of(8) && std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Whether [`mask_and_sum`] is the place to sum the next layer's weights'
/// gradient (`FirstGrad::Outer`'s `next_dw`): on its AVX-512 kernel (its
/// portable loop, the reference, would call a software `mul_add` a
/// value), for two inputs or more (one is `gemm`'s horizontal kernel,
/// other sums).
pub(super) fn sums_next_dw(simd: Simd, h: usize) -> bool {
    h >= 2 && kernels(simd, h)
}

/// Whether the kernels take rows of `h`.
fn kernels(simd: Simd, h: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd.allows_avx512() && h <= MAX_H && std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The lanes of each of `NV` vectors below `h`.
    fn masks<const NV: usize>(h: usize) -> [u16; NV] {
        let mut masks = [u16::MAX; NV];
        let tail = h - (NV - 1) * 16;
        masks[NV - 1] = if tail == 16 { u16::MAX } else { (1u16 << tail) - 1 };
        masks
    }

    /// [`super::add_row_terms`]; a row's term is loaded once for its
    /// positions in a run.
    ///
    /// # Safety
    /// AVX-512F; `NV = ⌈h/16⌉`; `out` holds `at_rows.len()·h` values,
    /// `row_terms` `h` from each `at_rows[p]·h`, `bias` `h`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn add_row_terms<const NV: usize>(
        h: usize,
        out: *mut f32,
        at_rows: &[u32],
        row_terms: *const f32,
        bias: *const f32,
        relu: bool,
    ) {
        let masks = masks::<NV>(h);
        // SAFETY: every access is of `h` values (the last vector masked)
        // at a position's `p·h` in `out`, a row's `r·h` in `row_terms`, or
        // `bias`, within what the caller guarantees.
        unsafe {
            let mut b = [_mm512_setzero_ps(); NV];
            for v in 0..NV {
                b[v] = _mm512_maskz_loadu_ps(masks[v], bias.add(v * 16));
            }
            let load = |p: usize| {
                let mut o = [_mm512_setzero_ps(); NV];
                for v in 0..NV {
                    o[v] = _mm512_maskz_loadu_ps(masks[v], out.add(p * h + v * 16));
                }
                o
            };
            let (mut row, mut terms) = (u32::MAX, [_mm512_setzero_ps(); NV]);
            let mut next = if at_rows.is_empty() { [_mm512_setzero_ps(); NV] } else { load(0) };
            for (p, &r) in at_rows.iter().enumerate() {
                if r != row {
                    row = r;
                    for v in 0..NV {
                        terms[v] = _mm512_maskz_loadu_ps(masks[v], row_terms.add(r as usize * h + v * 16));
                    }
                }
                // The next position's values are read before this one's
                // are stored: a load overlapping a pending masked store
                // (the tail of a row, a vector past it) waits for it.
                let o = next;
                if p + 1 < at_rows.len() {
                    next = load(p + 1);
                }
                for v in 0..NV {
                    let o = _mm512_add_ps(_mm512_add_ps(o[v], terms[v]), b[v]);
                    // `max(o, 0)` gives 0 for a NaN `o`, as `f32::max` does.
                    let o = if relu { _mm512_max_ps(o, _mm512_setzero_ps()) } else { o };
                    _mm512_mask_storeu_ps(out.add(p * h + v * 16), masks[v], o);
                }
            }
        }
    }

    /// [`super::item_and_query`], 8 lanes at a time (`d = 8` is one
    /// vector a part: a 16-lane one would be half empty).
    ///
    /// # Safety
    /// AVX; `d` a multiple of 8; `e` holds `2·d` values a position,
    /// `keys`, `dk` and `dq` `d`, `q_rows` `d` from each `at_rows[p]·d`.
    #[target_feature(enable = "avx")]
    #[expect(unsafe_code, reason = "AVX loads and stores through raw pointers")]
    pub(super) unsafe fn item_and_query(
        d: usize,
        (e, keys, q_rows): (*const f32, *const f32, *const f32),
        at_rows: &[u32],
        (dk, dq): (*mut f32, *mut f32),
    ) {
        // SAFETY: every access is of 8 values at `c < d` from a
        // position's `p·d` (`p·2·d` and `p·2·d + d` in `e`) or a row's
        // `r·d`, within what the caller guarantees.
        unsafe {
            for (p, &r) in at_rows.iter().enumerate() {
                for c in (0..d).step_by(8) {
                    let lin = _mm256_loadu_ps(e.add(p * 2 * d + c));
                    let prod = _mm256_loadu_ps(e.add(p * 2 * d + d + c));
                    let q = _mm256_loadu_ps(q_rows.add(r as usize * d + c));
                    let k = _mm256_loadu_ps(keys.add(p * d + c));
                    let at = dk.add(p * d + c);
                    // dk + (l + m·q), and m·k: no product fused into a sum.
                    let grad = _mm256_add_ps(_mm256_loadu_ps(at), _mm256_add_ps(lin, _mm256_mul_ps(prod, q)));
                    _mm256_storeu_ps(at, grad);
                    _mm256_storeu_ps(dq.add(p * d + c), _mm256_mul_ps(prod, k));
                }
            }
        }
    }

    /// [`super::add_to_slots`], 8 lanes at a time.
    ///
    /// # Safety
    /// AVX; `d` a multiple of 8; `rows` holds `d` values a position (and
    /// `scale` one); `out` `d` from each `at_rows[p]·stride + offset`.
    #[target_feature(enable = "avx")]
    #[expect(unsafe_code, reason = "AVX loads and stores through raw pointers")]
    pub(super) unsafe fn add_to_slots(
        d: usize,
        (rows, scale): (*const f32, Option<*const f32>),
        at_rows: &[u32],
        (out, stride, offset): (*mut f32, usize, usize),
    ) {
        // SAFETY: every access is of 8 values at `c < d` from a
        // position's `p·d`, a row's slot, or `scale[p]`, within what the
        // caller guarantees.
        unsafe {
            for (p, &r) in at_rows.iter().enumerate() {
                let slot = out.add(r as usize * stride + offset);
                for c in (0..d).step_by(8) {
                    let mut v = _mm256_loadu_ps(rows.add(p * d + c));
                    if let Some(scale) = scale {
                        v = _mm256_mul_ps(_mm256_set1_ps(*scale.add(p)), v);
                    }
                    _mm256_storeu_ps(slot.add(c), _mm256_add_ps(_mm256_loadu_ps(slot.add(c)), v));
                }
            }
        }
    }

    /// [`super::score_grads`], 8 lanes at a time: the dot product's lanes
    /// as `crate::matrix::dot` sums them (a product, then a sum, from 0),
    /// then added across in its order.
    ///
    /// # Safety
    /// AVX; `d` a multiple of 8; `keys` and `dk` hold `d` values a
    /// position, `scores` and `d_scores` one; `g` `d` from each
    /// `at_rows[p]·stride + offset`.
    #[target_feature(enable = "avx")]
    #[expect(unsafe_code, reason = "AVX loads and stores through raw pointers")]
    pub(super) unsafe fn score_grads(
        d: usize,
        (keys, scores): (*const f32, &[f32]),
        at_rows: &[u32],
        (g, stride, offset): (*const f32, usize, usize),
        (d_scores, dk): (&mut [f32], *mut f32),
    ) {
        // `dot`'s sum of the values past its last 8 (none here).
        let tail: f32 = std::iter::empty::<f32>().sum();
        // SAFETY: every access is of 8 values at `c < d` from a
        // position's `p·d` or a row's slot, within what the caller
        // guarantees; `scores` and `d_scores` are indexed below `n`.
        unsafe {
            for (p, &r) in at_rows.iter().enumerate() {
                let slot = g.add(r as usize * stride + offset);
                let score = _mm256_set1_ps(scores[p]);
                let mut lanes = _mm256_setzero_ps();
                for c in (0..d).step_by(8) {
                    let gv = _mm256_loadu_ps(slot.add(c));
                    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(gv, _mm256_loadu_ps(keys.add(p * d + c))));
                    _mm256_storeu_ps(dk.add(p * d + c), _mm256_mul_ps(score, gv));
                }
                let mut sum = [0.0f32; 8];
                _mm256_storeu_ps(sum.as_mut_ptr(), lanes);
                d_scores[p] = sum.iter().sum::<f32>() + tail;
            }
        }
    }

    /// [`super::items_and_products`], 8 lanes at a time.
    ///
    /// # Safety
    /// AVX; `d` a multiple of 8; `keys` holds `d` values a position and
    /// `kq` `2·d`; `q_rows` `d` from each `at_rows[p]·d`.
    #[target_feature(enable = "avx")]
    #[expect(unsafe_code, reason = "AVX loads and stores through raw pointers")]
    pub(super) unsafe fn items_and_products(
        d: usize,
        (keys, q_rows): (*const f32, *const f32),
        at_rows: &[u32],
        kq: *mut f32,
    ) {
        // SAFETY: every access is of 8 values at `c < d` from a
        // position's `p·d` (`p·2·d` and `p·2·d + d` in `kq`) or a row's
        // `r·d`, within what the caller guarantees.
        unsafe {
            for (p, &r) in at_rows.iter().enumerate() {
                for c in (0..d).step_by(8) {
                    let k = _mm256_loadu_ps(keys.add(p * d + c));
                    let q = _mm256_loadu_ps(q_rows.add(r as usize * d + c));
                    _mm256_storeu_ps(kq.add(p * 2 * d + c), k);
                    _mm256_storeu_ps(kq.add(p * 2 * d + d + c), _mm256_mul_ps(q, k));
                }
            }
        }
    }

    /// An outer product's sides: `seed` (a value a position) and `w`.
    type Outer = (*const f32, *const f32);

    /// [`super::mask_and_sum`]: the bias's sums and the current row's
    /// held in registers, a row's sum added to `g_rows` when its run of
    /// positions ends.
    ///
    /// # Safety
    /// AVX-512F; `NV = ⌈h/16⌉`; `g` (and the ReLU's output) hold
    /// `at_rows.len()·h` values, `g_rows` `h` from each `at_rows[p]·h`,
    /// `db` `h`; the outer product's `seed` `at_rows.len()`, its `w` `h`;
    /// with an outer product only, the next layer's input `next_dw.0`
    /// `at_rows.len()·h` and its weights' gradient `next_dw.1` `h`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn mask_and_sum<const NV: usize>(
        h: usize,
        (g, outer, relu): (*mut f32, Option<Outer>, Option<(*const f32, f32)>),
        next_dw: Option<(*const f32, *mut f32)>,
        at_rows: &[u32],
        (db, g_rows): (*mut f32, *mut f32),
    ) {
        let masks = masks::<NV>(h);
        // SAFETY: every access is of `h` values (the last vector masked)
        // at a position's `p·h` in `g`, the ReLU's output and the next
        // layer's input, a row's `r·h` in `g_rows`, `db`, `w` or the next
        // layer's dW, or of `seed[p]`, within what the caller guarantees.
        unsafe {
            let zero = _mm512_setzero_ps();
            let mut db_sum = [zero; NV];
            let mut w = [zero; NV];
            for v in 0..NV {
                db_sum[v] = _mm512_maskz_loadu_ps(masks[v], db.add(v * 16));
                if let Some((_, wp)) = outer {
                    w[v] = _mm512_maskz_loadu_ps(masks[v], wp.add(v * 16));
                }
            }
            // A row's sum: 0 + g₁ + g₂ + …, as its zeroed slot summed in
            // memory (0 + x is x, a −0 included: both give +0).
            let flush = |row: u32, sum: &[__m512; NV]| {
                for v in 0..NV {
                    let at = g_rows.add(row as usize * h + v * 16);
                    _mm512_mask_storeu_ps(at, masks[v], _mm512_add_ps(_mm512_maskz_loadu_ps(masks[v], at), sum[v]));
                }
            };
            // A position's gradient: read, or its one product seed·w.
            let load = |p: usize| {
                let mut x = [zero; NV];
                for v in 0..NV {
                    x[v] = match outer {
                        Some((seed, _)) => _mm512_mul_ps(_mm512_set1_ps(*seed.add(p)), w[v]),
                        None => _mm512_maskz_loadu_ps(masks[v], g.add(p * h + v * 16)),
                    };
                }
                x
            };
            let written = relu.is_some() || outer.is_some();
            // The next layer's weights' gradient: one chain of fused
            // multiply-adds a column from the first position's product.
            let next_dw = next_dw.zip(outer.map(|(seed, _)| seed));
            let mut dw = [zero; NV];
            let (mut row, mut row_sum) = (at_rows.first().copied().unwrap_or(0), [zero; NV]);
            let mut next = if at_rows.is_empty() { [zero; NV] } else { load(0) };
            for (p, &r) in at_rows.iter().enumerate() {
                if r != row {
                    flush(row, &row_sum);
                    (row, row_sum) = (r, [zero; NV]);
                }
                // Read ahead of this position's stores, as forward.
                let mut x = next;
                if p + 1 < at_rows.len() {
                    next = load(p + 1);
                }
                for v in 0..NV {
                    if let Some((out, scale)) = relu {
                        let kept = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(
                            _mm512_maskz_loadu_ps(masks[v], out.add(p * h + v * 16)),
                            zero,
                        );
                        if scale != 1.0 {
                            x[v] = _mm512_mul_ps(x[v], _mm512_set1_ps(scale));
                        }
                        x[v] = _mm512_maskz_mov_ps(kept, x[v]);
                    }
                    if written {
                        _mm512_mask_storeu_ps(g.add(p * h + v * 16), masks[v], x[v]);
                    }
                    row_sum[v] = _mm512_add_ps(row_sum[v], x[v]);
                    db_sum[v] = _mm512_add_ps(db_sum[v], x[v]);
                }
                if let Some(((input, _), seed)) = next_dw {
                    let s = _mm512_set1_ps(*seed.add(p));
                    for v in 0..NV {
                        let x = _mm512_maskz_loadu_ps(masks[v], input.add(p * h + v * 16));
                        dw[v] = if p == 0 { _mm512_mul_ps(x, s) } else { _mm512_fmadd_ps(x, s, dw[v]) };
                    }
                }
            }
            if !at_rows.is_empty() {
                flush(row, &row_sum);
            }
            if let Some(((_, out), _)) = next_dw {
                for v in 0..NV {
                    _mm512_mask_storeu_ps(out.add(v * 16), masks[v], dw[v]);
                }
            }
            for v in 0..NV {
                _mm512_mask_storeu_ps(db.add(v * 16), masks[v], db_sum[v]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::Operand;
    use crate::matrix::tests::{same_bits, values};

    /// Rows of 0 to 4 positions (some none), ascending, and one run split
    /// in two (a row seen again later).
    fn layout(rows: usize, split: bool) -> Vec<u32> {
        let mut at: Vec<u32> =
            (0..rows as u32).flat_map(|r| std::iter::repeat_n(r, (r as usize * 7 + 3) % 5)).collect();
        if split && !at.is_empty() {
            at.push(0);
        }
        at
    }

    #[test]
    fn the_kernels_have_the_portable_bits() {
        for h in [1, 5, 16, 17, 32, 36, 48, 49] {
            for (rows, split) in [(0, false), (1, false), (9, false), (40, false), (9, true)] {
                let at = layout(rows, split);
                let n = at.len() * h;
                let (terms, bias) = (values(rows.max(1) * h, 1), values(h, 2));
                for relu in [false, true] {
                    let mut outs = [values(n, 3), values(n, 3)];
                    for (out, simd) in outs.iter_mut().zip([Simd::Auto, Simd::Portable]) {
                        add_row_terms(simd, out, &at, &terms, (&bias, relu));
                    }
                    assert!(same_bits(&outs[0], &outs[1]), "forward h {h} rows {rows} split {split} relu {relu}");
                }
                let out = values(n, 4);
                for relu in [None, Some((&out[..], 1.0)), Some((&out[..], 1.25))] {
                    let mut g = [values(n, 5), values(n, 5)];
                    let mut sums =
                        [(values(h, 6), vec![0.0; rows.max(1) * h]), (values(h, 6), vec![0.0; rows.max(1) * h])];
                    for ((g, (db, g_rows)), simd) in g.iter_mut().zip(sums.iter_mut()).zip([Simd::Auto, Simd::Portable])
                    {
                        mask_and_sum(simd, (FirstGrad::Laid(g), relu), &at, (db, g_rows));
                    }
                    let what = format!("backward h {h} rows {rows} split {split} relu {:?}", relu.map(|r| r.1));
                    assert!(same_bits(&g[0], &g[1]), "{what}: the gradients");
                    assert!(same_bits(&sums[0].0, &sums[1].0), "{what}: the bias's");
                    assert!(same_bits(&sums[0].1, &sums[1].1), "{what}: the rows'");
                    // The gradient as an outer product, computed in the pass:
                    // what the pass gives on the product laid out.
                    let (seed, w) = (values(at.len(), 7), values(h, 8));
                    let mut laid = vec![0.0; n];
                    for (g, s) in laid.chunks_exact_mut(h).zip(&seed) {
                        g.iter_mut().zip(&w).for_each(|(g, w)| *g = s * w);
                    }
                    if crate::matrix::is_outer(at.len(), h, 1) {
                        let mut by_sgemm = vec![0.0; n];
                        crate::matrix::sgemm(
                            Simd::Auto,
                            at.len(),
                            h,
                            1,
                            Operand::plain(&seed),
                            Operand::t(&w),
                            &mut by_sgemm,
                        );
                        assert!(same_bits(&laid, &by_sgemm), "{what}: sgemm's outer product");
                    }
                    let (db, g_rows) = (values(h, 6), vec![0.0; rows.max(1) * h]);
                    let mut expected = (laid, db.clone(), g_rows.clone());
                    mask_and_sum(
                        Simd::Portable,
                        (FirstGrad::Laid(&mut expected.0), relu),
                        &at,
                        (&mut expected.1, &mut expected.2),
                    );
                    // The next layer's weights' gradient, summed in the
                    // pass: the bits of its product (`xᵀ·seed`).
                    let next_x = values(n, 10);
                    let mut by_product = vec![0.0; h];
                    if at.len() >= 3 {
                        let (x, s) = (Operand::t(&next_x), Operand::plain(&seed));
                        crate::matrix::sgemm_threads(Simd::Auto, h, 1, at.len(), x, s, &mut by_product, 1);
                    }
                    for simd in [Simd::Auto, Simd::Portable] {
                        for summed in [false, true] {
                            let (mut into, mut db, mut g_rows) = (values(n, 9), db.clone(), g_rows.clone());
                            let mut dw = values(h, 11);
                            let next_dw = summed.then_some((&next_x[..], &mut dw[..]));
                            let outer = FirstGrad::Outer { seed: &seed, w: &w, into: &mut into, next_dw };
                            mask_and_sum(simd, (outer, relu), &at, (&mut db, &mut g_rows));
                            let what = format!("{what}, outer, {simd:?}, next layer's dW {summed}");
                            assert!(same_bits(&into, &expected.0), "{what}: the gradients");
                            assert!(same_bits(&db, &expected.1), "{what}: the bias's");
                            assert!(same_bits(&g_rows, &expected.2), "{what}: the rows'");
                            // One input (`h` 1) or a `k` below 3 is
                            // `gemm`'s other path: the caller asks for
                            // neither (`is_outer`, `sums_next_dw`).
                            if summed && at.len() >= 3 && h >= 2 {
                                assert!(same_bits(&dw, &by_product), "{what}: the next layer's dW");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_item_pass_has_the_portable_bits() {
        for d in [1, 4, 8, 12, 16, 24] {
            for rows in [0, 1, 9, 40] {
                let at = layout(rows, false);
                let n = at.len();
                let (e, keys, q_rows) = (values(2 * n * d, 1), values(n * d, 2), values(rows.max(1) * d, 3));
                let mut grads = [(values(n * d, 4), vec![0.0; n * d]), (values(n * d, 4), vec![0.0; n * d])];
                for ((dk, dq), simd) in grads.iter_mut().zip([Simd::Auto, Simd::Portable]) {
                    item_and_query(simd, d, ((&e, &keys), &q_rows), &at, (dk, dq));
                }
                assert!(same_bits(&grads[0].0, &grads[1].0), "items' gradients, d {d} rows {rows}");
                assert!(same_bits(&grads[0].1, &grads[1].1), "queries' shares, d {d} rows {rows}");
            }
        }
        // One position by hand: dk = 1 + (2 + 3·5), dq = 3·7.
        let e: Vec<f32> = [[2.0; 8], [3.0; 8]].concat();
        for simd in [Simd::Auto, Simd::Portable] {
            let (mut dk, mut dq) = ([1.0; 8], [0.0; 8]);
            item_and_query(simd, 8, ((&e, &[7.0; 8]), &[5.0; 8]), &[0], (&mut dk, &mut dq));
            assert_eq!((dk, dq), ([18.0; 8], [21.0; 8]), "{simd:?}");
        }
    }

    #[test]
    fn the_slot_and_layout_passes_have_the_portable_bits() {
        for d in [1, 4, 8, 12, 16, 24] {
            for (rows, split) in [(0, false), (1, false), (9, false), (40, false), (9, true)] {
                let at = layout(rows, split);
                let n = at.len();
                let (stride, offset) = (3 * d + 2, d + 1);
                let (items, scores) = (values(n * d, 1), values(n, 2));
                for scale in [None, Some(&scores[..])] {
                    let mut outs = [values(rows.max(1) * stride, 3), values(rows.max(1) * stride, 3)];
                    for (out, simd) in outs.iter_mut().zip([Simd::Auto, Simd::Portable]) {
                        add_to_slots(simd, d, (&items, scale), &at, Slots { values: out, stride, offset });
                    }
                    assert!(same_bits(&outs[0], &outs[1]), "slots, d {d} rows {rows} scaled {}", scale.is_some());
                }
                let g = values(rows.max(1) * stride, 5);
                let mut grads = [(vec![0.0; n], vec![0.0; n * d]), (vec![0.0; n], vec![0.0; n * d])];
                for ((d_scores, dk), simd) in grads.iter_mut().zip([Simd::Auto, Simd::Portable]) {
                    score_grads(simd, d, (&items, &scores), &at, (&g, stride, offset), (d_scores, dk));
                }
                assert!(same_bits(&grads[0].0, &grads[1].0), "d scores, d {d} rows {rows}");
                assert!(same_bits(&grads[0].1, &grads[1].1), "d items, d {d} rows {rows}");
                let q_rows = values(rows.max(1) * d, 4);
                let mut kq = [vec![0.0; 2 * n * d], vec![0.0; 2 * n * d]];
                for (kq, simd) in kq.iter_mut().zip([Simd::Auto, Simd::Portable]) {
                    items_and_products(simd, d, (&items, &q_rows), &at, kq);
                }
                assert!(same_bits(&kq[0], &kq[1]), "[k, q ⊙ k], d {d} rows {rows}");
            }
        }
        // By hand, d = 8: two positions of row 1, the second scaled by 3.
        for simd in [Simd::Auto, Simd::Portable] {
            let (mut d_scores, mut dk) = (vec![0.0; 1], vec![0.0; 8]);
            let g: Vec<f32> = (0..10).map(|i| i as f32).collect();
            score_grads(simd, 8, (&[2.0; 8], &[0.5]), &[0], (&g, 10, 1), (&mut d_scores, &mut dk));
            assert_eq!(d_scores, [72.0], "{simd:?}: 2·(1 + … + 8)");
            assert_eq!(dk, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0], "{simd:?}");
        }
        for simd in [Simd::Auto, Simd::Portable] {
            let mut out = vec![1.0; 2 * 10];
            let items: Vec<f32> = [[1.0; 8], [2.0; 8]].concat();
            add_to_slots(
                simd,
                8,
                (&items, Some(&[1.0, 3.0])),
                &[1, 1],
                Slots { values: &mut out, stride: 10, offset: 1 },
            );
            assert_eq!(out[10..], [1.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 1.0], "{simd:?}");
            assert_eq!(out[..10], [1.0; 10], "{simd:?}: row 0 untouched");
            let mut kq = vec![0.0; 16];
            items_and_products(
                simd,
                8,
                (&[2.0; 8], &[0.0; 8].iter().chain(&[5.0; 8]).copied().collect::<Vec<_>>()),
                &[1],
                &mut kq,
            );
            assert_eq!(kq, [[2.0; 8], [10.0; 8]].concat(), "{simd:?}");
        }
    }

    #[test]
    fn the_passes_compute_what_they_say() {
        // Two rows, the second with two positions; h = 2.
        let at = [0u32, 1, 1];
        let mut out = vec![1.0, -5.0, 2.0, 0.0, -1.0, f32::NAN];
        let terms = [10.0, 20.0, 100.0, 200.0];
        for simd in [Simd::Auto, Simd::Portable] {
            let mut o = out.clone();
            add_row_terms(simd, &mut o, &at, &terms, (&[0.5, -100.0], true));
            // A NaN through the ReLU is 0, as `f32::max` gives.
            assert_eq!(o, [11.5, 0.0, 102.5, 100.0, 99.5, 0.0], "{simd:?}");
        }
        out = vec![1.0, 0.0, 0.0, 2.0, 3.0, 0.0];
        for simd in [Simd::Auto, Simd::Portable] {
            let (mut g, mut db, mut rows) = (vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![0.5, 0.0], vec![0.0; 4]);
            mask_and_sum(simd, (FirstGrad::Laid(&mut g), Some((&out, 2.0))), &at, (&mut db, &mut rows));
            assert_eq!(g, [2.0, 0.0, 0.0, 8.0, 10.0, 0.0], "{simd:?}");
            assert_eq!(db, [12.5, 8.0], "{simd:?}");
            assert_eq!(rows, [2.0, 0.0, 10.0, 8.0], "{simd:?}");
        }
    }

    #[test]
    #[should_panic(expected = "a position's row past")]
    fn a_row_past_the_batch_is_refused() {
        add_row_terms(Simd::Auto, &mut [0.0; 2], &[3], &[0.0; 4], (&[0.0, 0.0], false));
    }
}
