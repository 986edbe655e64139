//! The products' operands as bf16 pairs along k: the left one row by row
//! (or pair by pair when transposed), the right one in panels of columns.
//!
//! Each conversion loop runs as one call over a task's rows or pairs. A
//! call a row (64 floats, two vectors) spent most of its time outside its
//! vectors: packing an expert's 1024×64 gradient as a left operand took
//! 9.9 µs on two Zen 5 threads, its 1024×81 input transposed 9.8, and
//! PLE's step spent 20% of its time in these loops.

use rayon::prelude::*;

use super::{Operand, pair};

/// Which code converts f32 to bf16 pairs: the same bits either way.
#[derive(Clone, Copy)]
pub(super) enum Convert {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Simd,
}

/// Pairs a task of a conversion takes, about.
const PAIRS_PER_TASK: usize = 1 << 12;

impl Convert {
    /// `out[p]` = the pair `(src[2p], src[2p+1])`, 0 past the end of `src`.
    pub(super) fn row_pairs(self, src: &[f32], out: &mut [u32]) {
        assert_eq!(out.len(), src.len().div_ceil(2), "row_pairs: sizes");
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd` is only chosen after `simd::available()`.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            Convert::Simd => unsafe { x86::row_pairs(src, out) },
            Convert::Portable => {
                let mut two = src.chunks_exact(2);
                for (o, c) in out.iter_mut().zip(&mut two) {
                    *o = pair(c[0], c[1]);
                }
                if let [last] = two.remainder() {
                    out[src.len() / 2] = pair(*last, 0.0);
                }
            }
        }
    }

    /// [`row_pairs`](Self::row_pairs) of each row of `k` floats of `src`
    /// into each row of `⌈k/2⌉` pairs of `out`.
    fn rows_pairs(self, src: &[f32], k: usize, out: &mut [u32]) {
        let pairs = k.div_ceil(2);
        assert!(k > 0 && src.len() / k == out.len() / pairs, "rows_pairs: sizes");
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd` is only chosen after `simd::available()`.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            Convert::Simd => unsafe { x86::rows_pairs(src, k, out) },
            Convert::Portable => {
                for (row, out) in src.chunks_exact(k).zip(out.chunks_exact_mut(pairs)) {
                    self.row_pairs(row, out);
                }
            }
        }
    }

    /// `out[j]` = the pair `(even[j], odd[j])`; `odd` None: 0.
    pub(super) fn interleave(self, even: &[f32], odd: Option<&[f32]>, out: &mut [u32]) {
        assert!(even.len() >= out.len() && odd.is_none_or(|o| o.len() >= out.len()), "interleave: sizes");
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd` is only chosen after `simd::available()`.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            Convert::Simd => unsafe { x86::interleave(even, odd, out) },
            Convert::Portable => match odd {
                Some(odd) => out.iter_mut().zip(even.iter().zip(odd)).for_each(|(o, (&lo, &hi))| *o = pair(lo, hi)),
                None => out.iter_mut().zip(even).for_each(|(o, &lo)| *o = pair(lo, 0.0)),
            },
        }
    }

    /// For each pair `p` of `pairs` (`out` holding `pairs.len()` rows
    /// `out_stride` apart): [`interleave`](Self::interleave) of `len`
    /// floats from column `at` of `src`'s rows `2p` and `2p + 1` (rows
    /// `stride` apart; the second where `2p + 1 < k`) into its row's first
    /// `len` dwords.
    fn interleave_rows(
        self,
        src: &[f32],
        (k, stride, at, len): (usize, usize, usize, usize),
        pairs: std::ops::Range<usize>,
        (out, out_stride): (&mut [u32], usize),
    ) {
        assert!(len <= out_stride && out.len() >= pairs.len() * out_stride, "interleave_rows: sizes");
        assert!(pairs.end <= k.div_ceil(2) && (k == 0 || src.len() >= (k - 1) * stride + at + len));
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd` is only chosen after `simd::available()`.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            Convert::Simd => unsafe { x86::interleave_rows(src, (k, stride, at, len), pairs, (out, out_stride)) },
            Convert::Portable => {
                for (p, out) in pairs.zip(out.chunks_mut(out_stride)) {
                    let even = &src[2 * p * stride + at..][..len];
                    let odd = (2 * p + 1 < k).then(|| &src[(2 * p + 1) * stride + at..][..len]);
                    self.interleave(even, odd, &mut out[..len]);
                }
            }
        }
    }
}

/// The left operand as bf16 pairs along k: pair p of row i at
/// `i·row_stride + p·pair_stride`.
pub(super) struct PackedRows {
    pub(super) data: Vec<u32>,
    pub(super) row_stride: usize,
    pub(super) pair_stride: usize,
}

impl PackedRows {
    pub(super) fn at(&self, i: usize, p: usize) -> u32 {
        self.data[i * self.row_stride + p * self.pair_stride]
    }
}

/// `a` (m×k) as bf16 pairs along k, `rows_to` rows (those past m are 0);
/// an odd k is padded with 0. A plain operand is packed row by row (pairs
/// of a row adjacent; rows of an even k are one run of pairs); a
/// transposed one (stored k×m) pair by pair, each from two stored rows side
/// by side (the rows of a pair adjacent).
pub(super) fn pack_rows(
    m: usize,
    k: usize,
    a: &Operand<'_>,
    rows_to: usize,
    convert: Convert,
    buf: Vec<u32>,
) -> PackedRows {
    let pairs = k.div_ceil(2);
    let mut data = sized(buf, rows_to * pairs);
    let len = rows_to * pairs;
    let src = a.data;
    if a.transposed {
        if rows_to == 0 {
            return PackedRows { data, row_stride: 1, pair_stride: 0 };
        }
        let per_task = PAIRS_PER_TASK.div_ceil(rows_to);
        data[..len].par_chunks_mut(per_task * rows_to).enumerate().for_each(|(t, out)| {
            let first = t * per_task;
            let here = first..first + out.len() / rows_to;
            convert.interleave_rows(src, (k, m, 0, m), here, (out, rows_to));
            out.chunks_exact_mut(rows_to).for_each(|pair| pair[m..].fill(0));
        });
        PackedRows { data, row_stride: 1, pair_stride: rows_to }
    } else {
        if pairs > 0 {
            let (src, out) = (&src[..m * k], &mut data[..m * pairs]);
            if k.is_multiple_of(2) {
                // Rows of whole pairs lie end to end: one run of pairs.
                out.par_chunks_mut(PAIRS_PER_TASK)
                    .zip(src.par_chunks(2 * PAIRS_PER_TASK))
                    .for_each(|(out, src)| convert.row_pairs(src, out));
            } else {
                let per_task = PAIRS_PER_TASK.div_ceil(pairs).max(1);
                out.par_chunks_mut(per_task * pairs)
                    .zip(src.par_chunks(per_task * k))
                    .for_each(|(out, src)| convert.rows_pairs(src, k, out));
            }
        }
        data[m * pairs..len].fill(0);
        PackedRows { data, row_stride: pairs, pair_stride: 1 }
    }
}

/// `buf` holding at least `len` dwords, of which the packing then writes
/// the first `len`, every one. A longer buffer keeps its length: the
/// products of a step take turns with a thread's buffers, and one cut to a
/// smaller product's size was zeroed again as it grew back.
fn sized(mut buf: Vec<u32>, len: usize) -> Vec<u32> {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    buf
}

/// `b` (k×n) as bf16 pairs along k, in panels of `width` columns: pair p
/// of column j at `((j / width)·pairs + p)·width + j % width` (columns past
/// n are 0), so a kernel reads one panel's rows in order. Panels in
/// parallel; a plain operand interleaves rows 2p and 2p+1, a transposed one
/// (stored n×k, each column's values adjacent) is read column by column.
pub(super) fn pack_cols(
    k: usize,
    n: usize,
    b: &Operand<'_>,
    width: usize,
    convert: Convert,
    buf: Vec<u32>,
) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let width = width.max(1);
    let len = n.div_ceil(width) * pairs * width;
    let mut out = sized(buf, len);
    if n == 0 || pairs == 0 {
        return out;
    }
    let data = b.data;
    out[..len].par_chunks_mut(pairs * width).enumerate().for_each(|(t, panel)| {
        let (j0, cols) = (t * width, width.min(n - t * width));
        if cols < width {
            panel.chunks_exact_mut(width).for_each(|row| row[cols..].fill(0));
        }
        if b.transposed {
            let mut strip = vec![0u32; pairs];
            for c in 0..cols {
                convert.row_pairs(&data[(j0 + c) * k..][..k], &mut strip);
                for (p, &v) in strip.iter().enumerate() {
                    panel[p * width + c] = v;
                }
            }
        } else {
            convert.interleave_rows(data, (k, n, j0, cols), 0..pairs, (panel, width));
        }
    });
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Lanes `0..n` of a 16-lane mask.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
    }

    /// `v`'s first `out.len()` (< 16) dwords into `out`: a masked store,
    /// which is slow on AMD's cores, but once a row (whole vectors go
    /// unmasked: packing rows of 64 masked took twice as long). Through the
    /// stack instead, the copy waited on the store (rows of 81 took 40%
    /// longer).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store_first(v: __m512i, out: &mut [u32]) {
        // SAFETY: writes the first out.len() < 16 dwords of `out` (the mask).
        #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
        unsafe {
            _mm512_mask_storeu_epi32(out.as_mut_ptr().cast(), lanes(out.len()), v)
        };
    }

    /// [`Convert::row_pairs`](super::Convert::row_pairs) with
    /// `vcvtne2ps2bf16`: 32 floats in order are 16 pairs in order.
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    pub(super) fn row_pairs(src: &[f32], out: &mut [u32]) {
        assert_eq!(out.len(), src.len().div_ceil(2), "row_pairs: sizes");
        let (whole, rest) = src.as_chunks::<32>();
        let (whole_out, rest_out) = out.split_at_mut(whole.len() * 16);
        for (src, out) in whole.iter().zip(whole_out.as_chunks_mut::<16>().0) {
            // SAFETY: 32 floats in, 16 dwords out.
            #[expect(unsafe_code, reason = "SIMD loads and stores behind run-time feature detection")]
            unsafe {
                let low = _mm512_loadu_ps(src.as_ptr());
                let high = _mm512_loadu_ps(src.as_ptr().add(16));
                let packed = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low));
                _mm512_storeu_si512(out.as_mut_ptr().cast(), packed);
            }
        }
        if !rest.is_empty() {
            let (lo, hi) = (rest.len().min(16), rest.len().saturating_sub(16));
            // SAFETY: the masked loads read lanes 0..lo of `rest` and
            // lo..lo+hi (< 32 in all, within it); masked-off lanes are not
            // accessed.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let packed = unsafe {
                let low = _mm512_maskz_loadu_ps(lanes(lo), rest.as_ptr());
                let high = _mm512_maskz_loadu_ps(lanes(hi), rest.as_ptr().add(lo));
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low))
            };
            store_first(packed, rest_out);
        }
    }

    /// [`row_pairs`] of each row of `k` floats (the caller checked the sizes).
    #[target_feature(enable = "avx512bf16,avx512f")]
    pub(super) fn rows_pairs(src: &[f32], k: usize, out: &mut [u32]) {
        for (row, out) in src.chunks_exact(k).zip(out.chunks_exact_mut(k.div_ceil(2))) {
            row_pairs(row, out);
        }
    }

    /// `vpermw`'s order from `vcvtne2ps2bf16(odd, even)`'s halves
    /// (`even` in words 0–15, `odd` in 16–31) to pairs `(even_j, odd_j)`.
    const PAIR_ORDER: [u16; 32] = {
        let mut order = [0u16; 32];
        let mut j = 0;
        while j < 16 {
            order[2 * j] = j as u16;
            order[2 * j + 1] = 16 + j as u16;
            j += 1;
        }
        order
    };

    /// [`PAIR_ORDER`] in a register.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn pair_order() -> __m512i {
        // SAFETY: PAIR_ORDER is 32 words, one 64-byte load.
        #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
        unsafe {
            _mm512_loadu_si512(PAIR_ORDER.as_ptr().cast())
        }
    }

    /// [`Convert::interleave`](super::Convert::interleave): both rows'
    /// 16 floats converted by one `vcvtne2ps2bf16` (the rounding of
    /// `vcvtneps2bf16`, lane for lane), then put in pairs by one `vpermw`.
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw")]
    pub(super) fn interleave(even: &[f32], odd: Option<&[f32]>, out: &mut [u32]) {
        assert!(even.len() >= out.len() && odd.is_none_or(|o| o.len() >= out.len()), "interleave: sizes");
        interleave_in(pair_order(), even, odd, out);
    }

    /// [`interleave`] with `order` = [`pair_order`] (`out` no longer than either source).
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw")]
    fn interleave_in(order: __m512i, even: &[f32], odd: Option<&[f32]>, out: &mut [u32]) {
        let pairs_of = |e: __m512, o: __m512| {
            // SAFETY: a bf16 vector reinterpreted as 16-bit integers.
            #[expect(unsafe_code, reason = "SIMD reinterpretation behind run-time feature detection")]
            let halves = unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(o, e)) };
            _mm512_permutexvar_epi16(order, halves)
        };
        let (even, full) = (&even[..out.len()], out.len() / 16 * 16);
        let odd = odd.map(|odd| &odd[..out.len()]);
        for j in (0..full).step_by(16) {
            // SAFETY: j + 16 ≤ out.len(), the length of both sources.
            #[expect(unsafe_code, reason = "SIMD loads and stores behind run-time feature detection")]
            unsafe {
                let e = _mm512_loadu_ps(even.as_ptr().add(j));
                let o = odd.map_or(_mm512_setzero_ps(), |odd| _mm512_loadu_ps(odd.as_ptr().add(j)));
                _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), pairs_of(e, o));
            }
        }
        if full < out.len() {
            let mask = lanes(out.len() - full);
            // SAFETY: the masked loads read lanes full..out.len() of
            // sources that long; the others are not accessed.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let (e, o) = unsafe {
                let e = _mm512_maskz_loadu_ps(mask, even.as_ptr().add(full));
                (e, odd.map_or(_mm512_setzero_ps(), |odd| _mm512_maskz_loadu_ps(mask, odd.as_ptr().add(full))))
            };
            store_first(pairs_of(e, o), &mut out[full..]);
        }
    }

    /// [`Convert::interleave_rows`](super::Convert::interleave_rows) (the
    /// caller checked the sizes).
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw")]
    pub(super) fn interleave_rows(
        src: &[f32],
        (k, stride, at, len): (usize, usize, usize, usize),
        pairs: std::ops::Range<usize>,
        (out, out_stride): (&mut [u32], usize),
    ) {
        let order = pair_order();
        // The pairs with both rows, their vectors in a loop of their own (a
        // call a pair, two vectors each, spent most of its time outside
        // them). A tail of a row of 16 or more is the row's last 16 again,
        // overlapping what is written with the same values (a masked store
        // a pair was a third of packing rows of 81). Rows shorter than a
        // vector, and a last pair of one row, after.
        let both = pairs.start..pairs.end.min(k / 2).max(pairs.start);
        let (full, overlap) = (len / 16 * 16, len >= 16 && !len.is_multiple_of(16));
        for (i, p) in both.clone().enumerate() {
            let first = 2 * p * stride + at;
            // SAFETY: rows 2p and 2p + 1 < k of `src` hold `at + len`
            // floats from their starts (the caller checked `src`'s length),
            // and row i of `out` `len ≤ out_stride` dwords (checked too);
            // the overlapping vector starts at len − 16 ≥ 0.
            #[expect(unsafe_code, reason = "SIMD loads and stores within checked bounds")]
            unsafe {
                let (e, o, to) = (src.as_ptr().add(first), src.as_ptr().add(first + stride), out.as_mut_ptr());
                let to = to.add(i * out_stride);
                let starts = (0..full).step_by(16).chain(overlap.then(|| len - 16));
                for j in starts {
                    let (e, o) = (_mm512_loadu_ps(e.add(j)), _mm512_loadu_ps(o.add(j)));
                    let halves = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(o, e));
                    _mm512_storeu_si512(to.add(j).cast(), _mm512_permutexvar_epi16(order, halves));
                }
            }
        }
        let done_with_both = if len >= 16 { len } else { 0 };
        for (i, p) in pairs.clone().enumerate() {
            let done = if both.contains(&p) { done_with_both } else { 0 };
            if done == len {
                continue;
            }
            let even = &src[2 * p * stride + at..][..len];
            let odd = (2 * p + 1 < k).then(|| &src[(2 * p + 1) * stride + at..][..len]);
            interleave_in(order, even, odd, &mut out[i * out_stride..][..len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::simd::Simd;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32).map(|i| f32::from_bits(i.wrapping_add(seed).wrapping_mul(0x9e37_79b9))).collect()
    }

    /// The SIMD packing (where the CPU has it) writes the portable bits
    /// (values of every kind: NaNs, infinities, denormals, both signs)
    /// into every dword of a buffer left dirty by a larger product: both
    /// layouts of each operand, odd and even k, a run of pairs longer than
    /// a task, rows padded past m, panels narrower than their width.
    #[test]
    fn simd_and_portable_packing_agree_in_every_layout() {
        if !super::super::simd::available(Simd::Auto) {
            return;
        }
        for (m, k) in [(1, 1), (3, 2), (17, 81), (81, 17), (1024, 64), (512, 81), (81, 1024), (40, 9000), (5, 0)] {
            let a = values(m * k, (m * 7 + k) as u32);
            for transposed in [false, true] {
                let op = Operand { data: &a, transposed };
                let rows_to = m.div_ceil(8) * 8;
                let dirty = vec![0xdead_beef_u32; 2 * rows_to * k.div_ceil(2) + 5];
                let fast = pack_rows(m, k, &op, rows_to, Convert::Simd, dirty.clone());
                let slow = pack_rows(m, k, &op, rows_to, Convert::Portable, Vec::new());
                assert_eq!((fast.row_stride, fast.pair_stride), (slow.row_stride, slow.pair_stride));
                // A longer buffer keeps its tail.
                let (packed, tail) = fast.data.split_at(slow.data.len());
                assert!(packed == slow.data, "pack_rows {m}x{k}, transposed: {transposed}");
                assert!(tail.iter().all(|&d| d == 0xdead_beef), "pack_rows {m}x{k}: past the packed pairs");
                // As the right operand: k×n with n = m.
                let fast = pack_cols(k, m, &op, 32, Convert::Simd, dirty.clone());
                let slow = pack_cols(k, m, &op, 32, Convert::Portable, Vec::new());
                assert!(fast[..slow.len()] == slow, "pack_cols {k}x{m}, transposed: {transposed}");
            }
        }
    }
}
