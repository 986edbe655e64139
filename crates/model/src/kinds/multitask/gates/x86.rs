//! The gates' mix and adjoint on x86 vectors, with the portable code's bits
//! (`mix_row_of`, `block_adjoint`): AVX-512F's sixteen floats or, on a CPU
//! without it (a Zen 3), AVX2's eight ([`Vector`]). The AVX2 build of the
//! portable code alone, without these kernels, was no faster than the
//! baseline's (1% of MMoE's and PLE's step). The adjoint runs in three
//! passes over a task's rows:
//! - each gate's dots, up to eight of its experts at a time, each still
//!   multiplied then added in eight lanes and its lanes summed in `dot`'s
//!   order: the gate's row of `d_mix` read once for them, and their lanes
//!   transposed so that each step of their sum is one vector add (a dot's
//!   lanes summed through memory, one at a time, were half the dots' time;
//!   four at a time, PLE's gates of five and seven took two groups each,
//!   the second of one or three dots, and the adjoint 3–4% longer);
//! - each row's softmax adjoint, a row's short scalar chains independent of
//!   the next row's (after each row's own dots, they waited on them);
//! - each expert's row, summed over the gates that pool it in registers, in
//!   their order, masked by its ReLU and stored once, every expert's row
//!   while the row's `d_mix` is in L1.
//!
//! Timed alone on one thread (MMoE's three gates of four experts, width
//! 64, 512 rows, best of 15), these passes take 102–109 ns a row where the
//! adjoint a row at a time took 120–130; PLE's bf16 step took 3–5% less.

use std::arch::x86_64::*;

use super::{Block, softmax_adjoint};

/// A vector of floats the kernels below are written on, and the few
/// operations they take: each one instruction of its ISA, so a kernel's
/// operations, lane by lane, are the portable code's in its order.
///
/// # Safety
/// Each method needs its ISA (AVX-512F for `__m512`, AVX for `__m256`):
/// they are inlined into functions built for it and called where the CPU
/// has it.
#[expect(unsafe_code, reason = "each method needs its ISA")]
pub(super) trait Vector: Copy {
    /// Floats in the vector.
    const LANES: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(v: f32) -> Self;
    /// `LANES` floats from `p`.
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(p: *mut f32, v: Self);
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `v`'s lanes where `o`'s are above 0 (ordered: not NaN), else +0.
    unsafe fn where_positive(o: Self, v: Self) -> Self;
}

#[expect(unsafe_code, reason = "AVX-512F intrinsics, inlined into the AVX-512F build")]
impl Vector for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the trait's: the ISA, and `LANES` floats readable at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self) {
        // SAFETY: the trait's: the ISA, and `LANES` floats writable at `p`.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn where_positive(o: Self, v: Self) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(o, _mm512_setzero_ps()), v) }
    }
}

#[expect(unsafe_code, reason = "AVX intrinsics, inlined into the AVX2 build")]
impl Vector for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the trait's: the ISA, and `LANES` floats readable at `p`.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self) {
        // SAFETY: the trait's: the ISA, and `LANES` floats writable at `p`.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn where_positive(o: Self, v: Self) -> Self {
        // All ones where above 0, so `and` keeps `v`'s bits there; +0 elsewhere.
        // SAFETY: the trait's: the caller has the ISA.
        unsafe { _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(o, _mm256_setzero_ps()), v) }
    }
}

/// [`mix_row`] where a kernel takes the row's width: a whole number of
/// `V`'s vectors, at most 64 floats; false (nothing written) elsewhere.
///
/// # Safety
/// `V`'s ISA (inlined into a build for it); `mix` and each pooled row at
/// `at` hold `mix.len()` floats.
#[inline(always)]
#[expect(unsafe_code, reason = "calling the kernels of the caller's ISA")]
pub(super) unsafe fn mix_row_if_whole<V: Vector>(
    mix: &mut [f32],
    weights: &[f32],
    pool: &[usize],
    outs: &[&[f32]],
    at: usize,
) -> bool {
    let width = mix.len();
    if !width.is_multiple_of(V::LANES) || width > 64 {
        return false;
    }
    // SAFETY: the caller's.
    unsafe {
        match width / V::LANES {
            1 => mix_row::<V, 1>(mix, weights, pool, outs, at),
            2 => mix_row::<V, 2>(mix, weights, pool, outs, at),
            3 => mix_row::<V, 3>(mix, weights, pool, outs, at),
            4 => mix_row::<V, 4>(mix, weights, pool, outs, at),
            5 => mix_row::<V, 5>(mix, weights, pool, outs, at),
            6 => mix_row::<V, 6>(mix, weights, pool, outs, at),
            7 => mix_row::<V, 7>(mix, weights, pool, outs, at),
            8 => mix_row::<V, 8>(mix, weights, pool, outs, at),
            _ => return false,
        }
    }
    true
}

/// A gate's mix of one row, `mix = 0 + w_0·e_0 + w_1·e_1 + …` (`e_j` the
/// row of `outs[pool_j]` at `at`), `C` vectors wide: the portable
/// `mix_row_of`'s operations in its order (a product, then a sum from
/// zero, an expert at a time), its sums held in registers.
///
/// # Safety
/// `V`'s ISA (inlined into a build for it).
#[inline(always)]
#[expect(unsafe_code, reason = "vector loads and stores of whole vectors inside checked slices")]
unsafe fn mix_row<V: Vector, const C: usize>(
    mix: &mut [f32],
    weights: &[f32],
    pool: &[usize],
    outs: &[&[f32]],
    at: usize,
) {
    // SAFETY: `V`'s ISA, the caller's.
    let mut acc = [unsafe { V::zero() }; C];
    for (&wk, &e) in weights.iter().zip(pool) {
        let row = &outs[e][at..at + C * V::LANES];
        // SAFETY: `V`'s ISA, the caller's.
        let w = unsafe { V::splat(wk) };
        for (c, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `row` holds `C` vectors (sliced above).
            unsafe { *acc = V::add(*acc, V::mul(w, V::load(row.as_ptr().add(c * V::LANES)))) };
        }
    }
    let mix = &mut mix[..C * V::LANES];
    for (c, acc) in acc.iter().enumerate() {
        // SAFETY: `mix` holds `C` vectors (sliced above).
        unsafe { V::store(mix.as_mut_ptr().add(c * V::LANES), *acc) };
    }
}

/// [`super::block_adjoint`]'s rows: every row's dots, then every row's
/// softmax adjoints, then every row's experts (see the module's doc).
///
/// # Safety
/// `V`'s ISA (inlined into a build for it); `block.width` is a multiple
/// of `V::LANES`.
#[inline(always)]
#[expect(unsafe_code, reason = "vector kernels on slices of whole vectors")]
pub(super) unsafe fn block_adjoint<V: Vector>(
    block: &Block<'_>,
    dls: &mut [&mut [f32]],
    des: &mut [&mut [f32]],
    rows: usize,
) {
    let Block { first, gates, outs, masks, width, .. } = *block;
    let end = first + rows;
    // The pointers below read within these bounds.
    for (w, d_mix, pool) in gates {
        assert!(w.len() >= end * pool.len() && d_mix.len() >= end * width, "a gate's rows");
        assert!(pool.iter().all(|&e| outs[e].len() >= end * width), "a pooled expert's rows");
    }
    for r in 0..rows {
        let row = first + r;
        for ((_, d_mix, pool), dl) in gates.iter().zip(dls.iter_mut()) {
            let k = pool.len();
            let dl = &mut dl[r * k..(r + 1) * k];
            // SAFETY: row < end (asserted above).
            let a = unsafe { d_mix.as_ptr().add(row * width) };
            // A gate's experts eight at a time, `d_mix`'s row read once for
            // them; a group of fewer multiplies only its own.
            for (group, dl) in pool.chunks(8).zip(dl.chunks_mut(8)) {
                // SAFETY: row < end; each pooled expert's output holds `end` rows.
                let b = |i: usize| unsafe { outs[group[i]].as_ptr().add(row * width) };
                // SAFETY: each pointer starts `width` floats (asserted above).
                let dots = unsafe {
                    match group.len() {
                        8 => dots8(a, [b(0), b(1), b(2), b(3), b(4), b(5), b(6), b(7)], width),
                        7 => dots8(a, [b(0), b(1), b(2), b(3), b(4), b(5), b(6)], width),
                        6 => dots8(a, [b(0), b(1), b(2), b(3), b(4), b(5)], width),
                        5 => dots8(a, [b(0), b(1), b(2), b(3), b(4)], width),
                        4 => dots8(a, [b(0), b(1), b(2), b(3)], width),
                        3 => dots8(a, [b(0), b(1), b(2)], width),
                        2 => dots8(a, [b(0), b(1)], width),
                        _ => dots8(a, [b(0)], width),
                    }
                };
                super::copy_few(dl, &dots[..dl.len()]);
            }
        }
    }
    // Then every row's softmax adjoint: short chains of scalar operations,
    // a row's independent of the next (after each row's dots, they waited
    // on them).
    for ((w, _, pool), dl) in gates.iter().zip(dls.iter_mut()) {
        let k = pool.len();
        for (dl, w) in dl[..rows * k].chunks_exact_mut(k).zip(w[first * k..end * k].chunks_exact(k)) {
            softmax_adjoint(dl, w);
        }
    }
    // Each expert's terms: the gates that pool it, in order, its column of
    // a gate's softmax weights, the gate's `k` and its `d_mix`.
    let terms: Vec<Vec<(*const f32, usize, *const f32)>> = (0..des.len())
        .map(|e| {
            (gates.iter())
                .flat_map(|(w, d_mix, pool)| {
                    let places = pool.iter().enumerate().filter(move |&(_, &p)| p == e);
                    places.map(move |(j, _)| (w[j..].as_ptr(), pool.len(), d_mix.as_ptr()))
                })
                .collect()
        })
        .collect();
    for (terms, (de, out)) in terms.iter().zip(des.iter().zip(outs)) {
        let fits = de.len() == rows * width && out.len() >= end * width;
        assert!(terms.is_empty() || de.is_empty() || fits, "an expert's rows");
    }
    // Row by row, every expert's row while the row's `d_mix` is in L1.
    for r in 0..rows {
        for ((terms, de), (out, mask)) in terms.iter().zip(des.iter_mut()).zip(outs.iter().zip(masks)) {
            if terms.is_empty() || de.is_empty() {
                continue;
            }
            // SAFETY: the rows lie within every buffer (asserted above);
            // `width` is a multiple of `V::LANES`.
            unsafe { expert_row::<V>(&mut de[r * width..(r + 1) * width], (terms, first + r), out, *mask) };
        }
    }
}

/// `N` (1 to 8) [`dot`](crate::matrix::dot)s of `width` floats, `a`'s
/// with each `b[i]`'s, each with its bits: eight lanes multiplied then
/// added, the lanes summed in order (`((l0 + l1) + l2) + … + l7`, what
/// `Iterator::sum`'s start from −0 gives; `dot`'s tail is empty), in the
/// first `N` of the eight floats returned. `a` is read once for them, and
/// their lanes are transposed (with zeros past `N`) so that each step of
/// the lanes' sum is one add for all of them.
///
/// # Safety
/// AVX; each pointer starts `width` readable floats, a multiple of 8
/// (the caller's rows are whole vectors).
#[inline]
#[target_feature(enable = "avx")]
#[expect(unsafe_code, reason = "AVX loads through raw pointers")]
unsafe fn dots8<const N: usize>(a: *const f32, b: [*const f32; N], width: usize) -> [f32; 8] {
    const { assert!(N >= 1 && N <= 8, "dots8: one to eight dots") };
    debug_assert!(width.is_multiple_of(8), "dots8: whole lanes");
    let mut l = [_mm256_setzero_ps(); 8];
    let mut c = 0;
    while c < width {
        // SAFETY: `c + 8 <= width`.
        let x = unsafe { _mm256_loadu_ps(a.add(c)) };
        for (l, b) in l.iter_mut().zip(b) {
            // SAFETY: `c + 8 <= width`.
            *l = _mm256_add_ps(*l, _mm256_mul_ps(x, unsafe { _mm256_loadu_ps(b.add(c)) }));
        }
        c += 8;
    }
    // `t`: pairs of dots' lanes interleaved. `q[j]` (j < 4): lane j of
    // dots 0–3 in its low half, lane j + 4 in its high; `q[j + 4]` the
    // same for dots 4–7.
    let t = [0, 2, 4, 6].map(|i| (_mm256_unpacklo_ps(l[i], l[i + 1]), _mm256_unpackhi_ps(l[i], l[i + 1])));
    let q = [
        _mm256_shuffle_ps::<0x44>(t[0].0, t[1].0),
        _mm256_shuffle_ps::<0xEE>(t[0].0, t[1].0),
        _mm256_shuffle_ps::<0x44>(t[0].1, t[1].1),
        _mm256_shuffle_ps::<0xEE>(t[0].1, t[1].1),
        _mm256_shuffle_ps::<0x44>(t[2].0, t[3].0),
        _mm256_shuffle_ps::<0xEE>(t[2].0, t[3].0),
        _mm256_shuffle_ps::<0x44>(t[2].1, t[3].1),
        _mm256_shuffle_ps::<0xEE>(t[2].1, t[3].1),
    ];
    // `lane[j]`: lane j of every dot.
    let low = |j: usize| _mm256_permute2f128_ps::<0x20>(q[j], q[j + 4]);
    let high = |j: usize| _mm256_permute2f128_ps::<0x31>(q[j], q[j + 4]);
    let lane = [low(0), low(1), low(2), low(3), high(0), high(1), high(2), high(3)];
    // −0 + l0 is l0, bit for bit: the sum may start from lane 0.
    let sum = lane[1..].iter().fold(lane[0], |s, &v| _mm256_add_ps(s, v));
    let mut out = [0.0f32; 8];
    // SAFETY: `out` holds eight floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
    out
}

/// An expert's row of its output gradient at `row`: `Σ w · d_mix` over the
/// gates that pool it (`terms`: the start of its column of a gate's
/// softmax weights, the gate's `k`, and its `d_mix`; the first product,
/// then each added, in their order), through its last ReLU where it has a
/// mask (`scale` where the output is above 0, else 0), stored once.
///
/// # Safety
/// `V`'s ISA; `terms` is not empty; `row` lies within every term's weights
/// and `d_mix` and within `out`, each row `de.len()` floats, a multiple of
/// `V::LANES`.
#[inline(always)]
#[expect(unsafe_code, reason = "vector loads and stores through checked pointers")]
unsafe fn expert_row<V: Vector>(
    de: &mut [f32],
    (terms, row): (&[(*const f32, usize, *const f32)], usize),
    out: &[f32],
    mask: Option<f32>,
) {
    let vectors = de.len() / V::LANES;
    let mut v = 0;
    while v + 4 <= vectors {
        // SAFETY: vectors v..v + 4 lie within each row (the caller's bounds).
        unsafe { expert_vectors::<V, 4>(de, (terms, row), out, mask, v * V::LANES) };
        v += 4;
    }
    while v < vectors {
        // SAFETY: vector v lies within each row.
        unsafe { expert_vectors::<V, 1>(de, (terms, row), out, mask, v * V::LANES) };
        v += 1;
    }
}

/// [`expert_row`]'s `N` vectors from float `at` of the row.
///
/// # Safety
/// [`expert_row`]'s, and `at + N·V::LANES <= de.len()`.
#[inline(always)]
#[expect(unsafe_code, reason = "vector loads and stores through checked pointers")]
unsafe fn expert_vectors<V: Vector, const N: usize>(
    de: &mut [f32],
    (terms, row): (&[(*const f32, usize, *const f32)], usize),
    out: &[f32],
    mask: Option<f32>,
    at: usize,
) {
    let width = de.len();
    // A term's weight, broadcast, and where its `N` vectors start.
    let term = |&(w, k, d_mix): &(*const f32, usize, *const f32)| {
        // SAFETY: `row` lies within the term's weights and `d_mix` (the caller's bounds).
        unsafe { (V::splat(*w.add(row * k)), d_mix.add(row * width + at)) }
    };
    // `N` vectors from `d` (within the row: the caller's bounds).
    let load = |d: *const f32, i: usize| {
        // SAFETY: `at + N·V::LANES <= width`, `i < N`.
        unsafe { V::load(d.add(i * V::LANES)) }
    };
    let (w, d) = term(&terms[0]);
    // SAFETY: `V`'s ISA, the caller's.
    let mut sum: [V; N] = std::array::from_fn(|i| unsafe { V::mul(w, load(d, i)) });
    for t in &terms[1..] {
        let (w, d) = term(t);
        for (i, sum) in sum.iter_mut().enumerate() {
            // SAFETY: `V`'s ISA, the caller's.
            *sum = unsafe { V::add(*sum, V::mul(w, load(d, i))) };
        }
    }
    for (i, mut sum) in sum.into_iter().enumerate() {
        let at = at + i * V::LANES;
        if let Some(scale) = mask {
            // SAFETY: `out` holds the row (the caller's bounds).
            let o = unsafe { V::load(out.as_ptr().add(row * width + at)) };
            if scale != 1.0 {
                // SAFETY: `V`'s ISA, the caller's.
                sum = unsafe { V::mul(sum, V::splat(scale)) };
            }
            // SAFETY: `V`'s ISA, the caller's.
            sum = unsafe { V::where_positive(o, sum) };
        }
        // SAFETY: `at + V::LANES <= de.len()`.
        unsafe { V::store(de.as_mut_ptr().add(at), sum) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::rng::Rng;

    /// `where_positive` on both vectors keeps `v` exactly where the
    /// portable ReLU mask (`through_relu`) does: not at ±0, a NaN or
    /// below 0, yes at the smallest subnormal and at infinity; elsewhere +0.
    #[test]
    fn where_positive_masks_as_the_portable_relu_on_both_vectors() {
        let o: [f32; 16] = [
            f32::NAN,
            -0.0,
            0.0,
            -1.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(1),
            -f32::from_bits(1),
            2.5,
            -2.5,
            f32::MIN_POSITIVE,
            f32::MAX,
            -f32::NAN,
            3.0,
            -3.0,
        ];
        let v: [f32; 16] = std::array::from_fn(|i| if i == 9 { f32::NAN } else { -(i as f32) - 0.5 });
        let mut expected = v;
        crate::mlp::through_relu(&mut expected, &o, 1.0);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut got = [7.0f32; 16];
        if std::arch::is_x86_feature_detected!("avx") {
            for half in 0..2 {
                let at = half * 8;
                // SAFETY: the CPU has AVX (checked above); each array holds 16 floats.
                #[expect(unsafe_code, reason = "calling the kernel under test")]
                unsafe {
                    let kept = <__m256 as Vector>::where_positive(
                        <__m256 as Vector>::load(o.as_ptr().add(at)),
                        <__m256 as Vector>::load(v.as_ptr().add(at)),
                    );
                    <__m256 as Vector>::store(got.as_mut_ptr().add(at), kept);
                }
            }
            assert_eq!(bits(&got), bits(&expected), "__m256");
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above); each array holds 16 floats.
            #[expect(unsafe_code, reason = "calling the kernel under test")]
            unsafe {
                let kept = <__m512 as Vector>::where_positive(
                    <__m512 as Vector>::load(o.as_ptr()),
                    <__m512 as Vector>::load(v.as_ptr()),
                );
                <__m512 as Vector>::store(got.as_mut_ptr(), kept);
            }
            assert_eq!(bits(&got), bits(&expected), "__m512");
        }
    }

    /// One to eight dots at once, at widths of one to eight lane groups:
    /// each the bits of `dot` on the same rows (where the CPU has AVX;
    /// elsewhere the kernel cannot run and the portable build is the one).
    #[test]
    fn up_to_eight_dots_at_once_have_the_bits_of_dot() {
        // Without AVX the kernel cannot run (the gates' tests still check
        // the portable build).
        if !std::arch::is_x86_feature_detected!("avx") {
            return;
        }
        let mut rng = Rng::new(5);
        for width in (8..=64).step_by(8) {
            let a: Vec<f32> = (0..width).map(|_| rng.uniform(-3.0, 3.0) as f32).collect();
            let b: Vec<Vec<f32>> =
                (0..8).map(|_| (0..width).map(|_| rng.uniform(-3.0, 3.0) as f32).collect()).collect();
            let p: Vec<*const f32> = b.iter().map(|b| b.as_ptr()).collect();
            // SAFETY: the CPU has AVX (checked above); every row holds `width` floats, a multiple of 8.
            #[expect(unsafe_code, reason = "calling the kernel under test")]
            let got: Vec<[f32; 8]> = unsafe {
                vec![
                    dots8(a.as_ptr(), [p[0]], width),
                    dots8(a.as_ptr(), [p[0], p[1]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2], p[3]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2], p[3], p[4]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2], p[3], p[4], p[5]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2], p[3], p[4], p[5], p[6]], width),
                    dots8(a.as_ptr(), [p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]], width),
                ]
            };
            for (n, got) in got.iter().enumerate() {
                for (i, b) in b.iter().enumerate().take(n + 1) {
                    let expected = crate::matrix::dot(&a, b);
                    assert_eq!(got[i].to_bits(), expected.to_bits(), "dot {i} of {}, width {width}", n + 1);
                }
            }
        }
    }
}
