//! `embedding.dtype`: how a row's vector is stored. A row is a run of 4-byte
//! words (the key's two, then the vector's, then the optimizer state's); in
//! f16 or bf16 two coordinates share a word (coordinate 2i in its low half,
//! 2i + 1 in its high half, so the bytes read as little-endian u16s), which
//! halves the vector part of the row in memory, on the SSD tier, in
//! checkpoints and in pull replies. The optimizer state stays f32.
//!
//! Everything outside the table sees a row *logically*: `dim` f32 weights,
//! then the state. A stored half converts to f32 exactly, so decoding and
//! encoding again is the identity; the only rounding is
//! [`RowFormat::encode_vector`]'s, once per update or restore (round to
//! nearest, ties to even; beyond f16's range a value becomes ±inf, which the
//! trainer's non-finite check reports).

use crate::optimizer::SparseOptimizer;
use half::f16;
pub use sparrow_core::config::EmbeddingDtype;
use sparrow_core::key::mix64;
pub use sparrow_core::simd::Simd;

/// The stored shape of a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowFormat {
    pub dtype: EmbeddingDtype,
    pub dim: usize,
    /// f32 words of optimizer state after the vector.
    pub state_len: usize,
    /// Whether its conversions and steps may take their SIMD kernels
    /// (`train.simd`; the same bits either way).
    pub simd: Simd,
}

impl RowFormat {
    /// Words the vector takes.
    #[inline]
    pub fn vector_words(&self) -> usize {
        match self.dtype {
            EmbeddingDtype::F32 => self.dim,
            EmbeddingDtype::F16 | EmbeddingDtype::Bf16 => self.dim.div_ceil(2),
        }
    }

    /// Words of a stored row without its key: vector, then state.
    #[inline]
    pub fn stored_len(&self) -> usize {
        self.vector_words() + self.state_len
    }

    /// Floats of a logical row: `dim` weights, then state.
    #[inline]
    pub fn logical_len(&self) -> usize {
        self.dim + self.state_len
    }

    /// Bytes of a stored row's vector and state (what `embedding.dtype` halves).
    pub fn stored_bytes(&self) -> usize {
        self.stored_len() * 4
    }

    /// The vector's `dim` coordinates as f32 (exact).
    #[inline]
    pub fn decode_vector(&self, words: &[f32], out: &mut [f32]) {
        match self.dtype {
            EmbeddingDtype::F32 => out.copy_from_slice(&words[..self.dim]),
            EmbeddingDtype::F16 => simd::decode_f16(self.simd, words, out),
            EmbeddingDtype::Bf16 => unpack(words, out, widen_bf16),
        }
    }

    /// [`decode_vector`](Self::decode_vector) for each `(stored, out)` pair;
    /// for f16 with F16C, the whole loop in one call compiled for it.
    pub fn decode_vectors<'a>(&self, rows: impl Iterator<Item = (&'a [f32], &'a mut [f32])>) {
        #[cfg(target_arch = "x86_64")]
        if self.dtype == EmbeddingDtype::F16 && simd::x86::available(self.simd) {
            // SAFETY: F16C and AVX were detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                simd::x86::decode_all(rows)
            };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.dtype == EmbeddingDtype::Bf16 && simd::x86::bf16_available(self.simd) {
            // SAFETY: AVX2 was detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                simd::x86::decode_all_bf16(rows)
            };
            return;
        }
        rows.for_each(|(words, out)| self.decode_vector(words, out));
    }

    /// Stores `w` (`dim` coordinates), each rounded to nearest even.
    #[inline]
    pub fn encode_vector(&self, w: &[f32], words: &mut [f32]) {
        match self.dtype {
            EmbeddingDtype::F32 => words[..self.dim].copy_from_slice(w),
            EmbeddingDtype::F16 => {
                let done = simd::narrow_f16(self.simd, w, words);
                pack(&w[done..], &mut words[done / 2..], |x| f16::from_f32(x).to_bits());
            }
            EmbeddingDtype::Bf16 => {
                let done = simd::narrow_bf16(self.simd, w, words);
                pack(&w[done..], &mut words[done / 2..], bf16_bits);
            }
        }
    }

    /// One optimizer step on a stored vector: `state` is the row's
    /// optimizer state, `grad` its gradient. The step runs in f32 and the
    /// result is rounded once as it is stored. For f16 rows with F16C, an
    /// optimizer with a [`CoordinateRule`](crate::optimizer::CoordinateRule) runs it eight coordinates at a
    /// time in registers (widen, step, narrow: the same bits); otherwise the
    /// vector is decoded into `scratch` (`dim` floats), stepped and encoded.
    #[inline]
    pub fn update_vector(
        &self,
        opt: &SparseOptimizer,
        words: &mut [f32],
        state: &mut [f32],
        grad: &[f32],
        scratch: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.dtype == EmbeddingDtype::F16 && simd::x86::available(self.simd) {
            // SAFETY: F16C and AVX were detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                simd::x86::update(opt, words, state, grad, scratch)
            };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.dtype == EmbeddingDtype::Bf16 && simd::x86::bf16_available(self.simd) {
            // SAFETY: AVX2 was detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            unsafe {
                simd::x86::update_bf16(opt, words, state, grad, scratch)
            };
            return;
        }
        self.decode_vector(words, scratch);
        opt.apply(scratch, state, grad);
        self.encode_vector(scratch, words);
    }

    /// Rounds `w` in place to what [`encode_vector`](Self::encode_vector)
    /// would store: a vector the caller keeps equals the stored one.
    pub fn round(&self, w: &mut [f32]) {
        match self.dtype {
            EmbeddingDtype::F32 => {}
            EmbeddingDtype::F16 => w.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
            EmbeddingDtype::Bf16 => w.iter_mut().for_each(|x| *x = f32::from_bits(u32::from(bf16_bits(*x)) << 16)),
        }
    }

    /// Rounds `w` in place, stochastically (`embedding.rounding =
    /// "stochastic"`), to values the stored type holds: each coordinate
    /// goes to one of its two neighbours, away from zero with probability
    /// (distance to the lower one) / (gap), so the stored value is right on
    /// average. The uniform draw is a hash of `seed`, `key`, `count` (the
    /// row's update count, kept in the row; advanced here, wrapping at 2²⁴)
    /// and the coordinate: the same job rounds the same way wherever the row
    /// is updated (a table, a cluster shard, S1's second level). An f16
    /// value within a gap of 65504 may round to ±inf, which the trainer's
    /// non-finite check reports. f32 rows are left as they are.
    pub fn round_stochastic(&self, w: &mut [f32], seed: u64, key: u64, count: &mut f32) {
        let (mantissa, min_exp) = match self.dtype {
            EmbeddingDtype::F32 => return,
            EmbeddingDtype::F16 => (10, -14),
            EmbeddingDtype::Bf16 => (7, -126),
        };
        let n = *count as u32;
        let row = mix64(seed ^ key ^ 0x5851_f42d_4c95_7f2d);
        // Coordinate i's draw: the top 24 bits of mix64(row + (n << 32 | i)).
        simd::round_stochastic(self.simd, w, row.wrapping_add(u64::from(n) << 32), mantissa, min_exp);
        *count = if n + 1 >= 1 << 24 { 0.0 } else { (n + 1) as f32 };
    }

    /// One optimizer step on a logical vector `w` with its row's `state`,
    /// then `w` rounded as the row stores it: to nearest, or with
    /// `stochastic` (the seed and the row's key) stochastically, `state`'s
    /// last word being the row's update count. Every update site (the
    /// table, S1's second level) goes through it, so they round alike.
    pub fn step_and_round(
        &self,
        opt: &SparseOptimizer,
        w: &mut [f32],
        state: &mut [f32],
        g: &[f32],
        stochastic: Option<(u64, u64)>,
    ) {
        match (stochastic, state.split_last_mut()) {
            (Some((seed, key)), Some((count, state))) => {
                opt.apply(w, state, g);
                self.round_stochastic(w, seed, key, count);
            }
            _ => {
                opt.apply(w, state, g);
                self.round(w);
            }
        }
    }

    /// A stored row (without its key) as a logical one.
    pub fn decode(&self, stored: &[f32], logical: &mut [f32]) {
        let words = self.vector_words();
        self.decode_vector(&stored[..words], &mut logical[..self.dim]);
        logical[self.dim..].copy_from_slice(&stored[words..]);
    }

    /// A logical row stored (its vector rounded).
    pub fn encode(&self, logical: &[f32], stored: &mut [f32]) {
        let words = self.vector_words();
        self.encode_vector(&logical[..self.dim], &mut stored[..words]);
        stored[words..].copy_from_slice(&logical[self.dim..]);
    }
}

/// `x` rounded to one of its two neighbours among the values with
/// `mantissa` stored bits and smallest normal exponent `min_exp` (below it,
/// the subnormals' fixed spacing): away from zero when `u` (uniform over
/// [0, 2²⁴)) is below the fraction of the gap `x` lies above the lower
/// neighbour, times 2²⁴. Zeros, infinities and NaN stay as they are.
#[inline]
fn round_stochastic_one(x: f32, mantissa: i32, min_exp: i32, u: u32) -> f32 {
    let abs = x.to_bits() & 0x7fff_ffff;
    let exp_field = (abs >> 23) as i32;
    if exp_field == 0xff || abs == 0 {
        return x;
    }
    let exp = exp_field - 127;
    if exp >= min_exp {
        // The common case, on the bits: the stored type keeps the top
        // `mantissa` of f32's 23, the fraction is the bits dropped, and a
        // carry out of them moves into the next binade on its own.
        let drop = 23 - mantissa as u32;
        let dropped = abs & ((1 << drop) - 1);
        let up = u < dropped << (24 - drop);
        let rounded = (abs - dropped) + (u32::from(up) << drop);
        return f32::from_bits(rounded | (x.to_bits() & 0x8000_0000));
    }
    // Below the stored type's normals: a fixed spacing, in f64 (exact: a
    // power-of-two scaling of a 24-bit significand).
    let spacing = 2f64.powi(min_exp - mantissa);
    let scaled = f64::from(x.abs()) / spacing;
    let lower = scaled.floor();
    let up = f64::from(u) < (scaled - lower) * f64::from(1u32 << 24);
    (((lower + f64::from(u8::from(up))) * spacing) as f32).copysign(x)
}

/// [`round_stochastic_one`] on every coordinate of `w`, coordinate i with the
/// draw `mix64(base + i) >> 40`, written so that it vectorises: every lane
/// takes the bit path, lanes outside it (zeros, infinities, NaN, values
/// below the type's normals) keep their value, and only if one lies below
/// the normals does a second pass round those (with the same draws) the
/// slow way. The same bits as one coordinate at a time (tested).
#[inline(always)]
fn round_stochastic_lanes(w: &mut [f32], base: u64, mantissa: i32, min_exp: i32) {
    let drop = 23 - mantissa as u32;
    let min_field = (min_exp + 127) as u32;
    let mut below_normals = false;
    for (i, x) in w.iter_mut().enumerate() {
        let u = (mix64(base.wrapping_add(i as u64)) >> 40) as u32;
        let bits = x.to_bits();
        let abs = bits & 0x7fff_ffff;
        let field = abs >> 23;
        let dropped = abs & ((1 << drop) - 1);
        let up = u32::from(u < dropped << (24 - drop));
        let rounded = (abs - dropped + (up << drop)) | (bits & 0x8000_0000);
        below_normals |= field < min_field && abs != 0;
        *x = f32::from_bits(if field >= min_field && field != 0xff { rounded } else { bits });
    }
    if below_normals {
        // A rounded normal stays at or above the smallest normal, so what is
        // below it now was left alone above.
        for (i, x) in w.iter_mut().enumerate() {
            let abs = x.to_bits() & 0x7fff_ffff;
            if abs != 0 && abs >> 23 < min_field {
                *x = round_stochastic_one(*x, mantissa, min_exp, (mix64(base.wrapping_add(i as u64)) >> 40) as u32);
            }
        }
    }
}

/// bf16 bits → f32 (exact: the f32 with those top bits).
#[inline]
fn widen_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 → bf16 bits, to nearest even (a NaN stays a quiet NaN): `half`'s
/// rule, written branch-free for the non-NaN case so the loop vectorises.
#[inline]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() { ((b >> 16) | 0x40) as u16 } else { ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16 }
}

#[inline]
fn unpack(words: &[f32], out: &mut [f32], widen: impl Fn(u16) -> f32) {
    let half = out.len() / 2;
    let mut pairs = out.chunks_exact_mut(2);
    for (pair, word) in (&mut pairs).zip(words) {
        let bits = word.to_bits();
        pair[0] = widen(bits as u16);
        pair[1] = widen((bits >> 16) as u16);
    }
    if let ([last], Some(word)) = (pairs.into_remainder(), words.get(half)) {
        *last = widen(word.to_bits() as u16);
    }
}

#[inline]
fn pack(w: &[f32], words: &mut [f32], narrow: impl Fn(f32) -> u16) {
    let pairs = w.chunks_exact(2);
    let last = pairs.remainder().first().copied();
    for (pair, word) in pairs.zip(words.iter_mut()) {
        *word = f32::from_bits(u32::from(narrow(pair[0])) | (u32::from(narrow(pair[1])) << 16));
    }
    if let (Some(x), Some(word)) = (last, words.get_mut(w.len() / 2)) {
        *word = f32::from_bits(u32::from(narrow(x)));
    }
}

/// Kernels chosen at run time: f16 ⇄ f32 eight coordinates at a time with
/// F16C (`vcvtph2ps`, `vcvtps2ph` rounding to nearest even), bf16 ⇄ f32 with
/// AVX2 integer lanes, the optimizer step on a stored half vector in
/// registers, and stochastic rounding built for AVX-512; the scalar code
/// does the rest and everything where the CPU lacks the features (or
/// `train.simd = "portable"`). Both give the same bits (tested).
mod simd {
    use super::Simd;

    /// [`round_stochastic_lanes`](super::round_stochastic_lanes), compiled
    /// for AVX-512 (64-bit multiplies in vector lanes: the draws' hash) where
    /// the CPU has it.
    #[inline]
    pub(super) fn round_stochastic(simd: Simd, w: &mut [f32], base: u64, mantissa: i32, min_exp: i32) {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx512(simd) {
            // SAFETY: AVX-512 F, DQ and VL were detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { x86::round_stochastic(w, base, mantissa, min_exp) };
        }
        super::round_stochastic_lanes(w, base, mantissa, min_exp);
    }

    /// Decodes an f16 vector: `out.len()` coordinates from `words`.
    #[inline]
    pub(super) fn decode_f16(simd: Simd, words: &[f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if x86::available(simd) {
            // SAFETY: F16C and AVX were detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { x86::decode(words, out) };
        }
        super::unpack(words, out, |h| half::f16::from_bits(h).to_f32());
    }

    /// [`narrow_f16`] for bf16, with AVX2.
    #[inline]
    pub(super) fn narrow_bf16(simd: Simd, w: &[f32], words: &mut [f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if w.len() >= 8 && x86::bf16_available(simd) {
            // SAFETY: AVX2 was detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { x86::narrow_bf16(w, words) };
        }
        let _ = (w, words);
        0
    }

    /// Narrows the first multiple of 8 coordinates of `w` into `words`;
    /// returns how many it did.
    #[inline]
    pub(super) fn narrow_f16(simd: Simd, w: &[f32], words: &mut [f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if w.len() >= 8 && x86::available(simd) {
            // SAFETY: F16C and AVX were detected just above.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { x86::narrow(w, words) };
        }
        let _ = (w, words);
        0
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) mod x86 {
        use super::Simd;
        use crate::optimizer::{CoordinateRule, SparseOptimizer};
        use std::arch::x86_64::{
            __m256, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_add_epi32,
            _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8, _mm256_castps_si256, _mm256_castsi256_ps,
            _mm256_castsi256_si128, _mm256_cmp_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_cvtps_ph,
            _mm256_div_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32,
            _mm256_permute4x64_epi64, _mm256_set1_epi32, _mm256_set1_ps, _mm256_slli_epi32, _mm256_sqrt_ps,
            _mm256_srli_epi32, _mm256_storeu_ps, _mm256_sub_ps,
        };

        #[inline]
        pub(crate) fn available(simd: Simd) -> bool {
            simd.allows() && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx")
        }

        #[inline]
        pub(crate) fn has_avx512(simd: Simd) -> bool {
            simd.allows_avx512()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl")
        }

        /// [`round_stochastic_lanes`](super::super::round_stochastic_lanes)
        /// compiled for AVX-512: integer operations only (and, on the rare
        /// values below the normals, the same f64 arithmetic), so the same bits.
        #[target_feature(enable = "avx512f,avx512dq,avx512vl")]
        pub(crate) fn round_stochastic(w: &mut [f32], base: u64, mantissa: i32, min_exp: i32) {
            super::super::round_stochastic_lanes(w, base, mantissa, min_exp);
        }

        #[target_feature(enable = "f16c,avx")]
        pub(crate) fn widen(words: &[f32], out: &mut [f32]) -> usize {
            let n = out.len() / 8 * 8;
            for (o, w) in out[..n].chunks_exact_mut(8).zip(words.chunks_exact(4)) {
                // SAFETY: `w` is 4 words (16 bytes, eight halves) and `o` 8
                // floats (32 bytes); both accesses are unaligned-tolerant.
                #[expect(unsafe_code, reason = "SIMD load and store behind run-time feature detection")]
                unsafe {
                    _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().cast())));
                }
            }
            n
        }

        /// [`decode_f16`](super::decode_f16) with F16C: eight coordinates
        /// at a time, the rest one by one.
        #[target_feature(enable = "f16c,avx")]
        pub(crate) fn decode(words: &[f32], out: &mut [f32]) {
            let done = widen(words, out);
            if done < out.len() {
                super::super::unpack(&words[done / 2..], &mut out[done..], |h| half::f16::from_bits(h).to_f32());
            }
        }

        /// [`decode`] over many vectors, inlined into one loop.
        #[target_feature(enable = "f16c,avx")]
        pub(crate) fn decode_all<'a>(rows: impl Iterator<Item = (&'a [f32], &'a mut [f32])>) {
            for (words, out) in rows {
                decode(words, out);
            }
        }

        /// [`RowFormat::update_vector`](super::super::RowFormat::update_vector)
        /// for f16, compiled for F16C so the optimizer's arithmetic and the
        /// conversions inline together.
        #[target_feature(enable = "f16c,avx")]
        pub(crate) fn update(opt: &SparseOptimizer, words: &mut [f32], state: &mut [f32], g: &[f32], w: &mut [f32]) {
            if g.len().is_multiple_of(8)
                && let Some(rule) = opt.coordinate_rule(state, g)
            {
                return step_in_registers(rule, words, state, g);
            }
            let done = widen(words, w);
            super::super::unpack(&words[done / 2..], &mut w[done..], |h| half::f16::from_bits(h).to_f32());
            opt.apply(w, state, g);
            let done = narrow(w, words);
            super::super::pack(&w[done..], &mut words[done / 2..], |x| half::f16::from_f32(x).to_bits());
        }

        /// `rule` on a stored half vector (`words`, `dim` a multiple of 8),
        /// eight coordinates at a time without leaving registers: widen,
        /// the operations of [`SparseOptimizer::apply`](crate::SparseOptimizer::apply)
        /// in its order (no fused multiply-add), narrow to nearest even — so
        /// the same bits as decode, `apply`, encode (tested). One function
        /// per half type, stamped from this text with the type's widening
        /// and narrowing. For f16, widening into a scratch vector, stepping
        /// it there and narrowing it back took 22 ns a row against 12 this
        /// way (dim 16, row-wise Adagrad, rows in cache, one thread; f32
        /// rows take 10).
        macro_rules! step_in_registers {
            ($name:ident, $features:literal, $widen:ident, $narrow:ident) => {
                #[target_feature(enable = $features)]
                fn $name(rule: CoordinateRule, words: &mut [f32], state: &mut [f32], g: &[f32]) {
                    let eights = words.chunks_exact_mut(4).zip(g.chunks_exact(8));
                    match rule {
                        CoordinateRule::Scaled { step } => {
                            let step = _mm256_set1_ps(step);
                            for (halves, g) in eights {
                                // SAFETY: `g` is 8 floats (32 bytes); unaligned-tolerant.
                                #[expect(unsafe_code, reason = "SIMD load behind run-time feature detection")]
                                let g = unsafe { _mm256_loadu_ps(g.as_ptr()) };
                                $narrow(scaled_step($widen(halves), g, step), halves);
                            }
                        }
                        CoordinateRule::Adagrad { lr, eps } => {
                            let (lr, eps) = (_mm256_set1_ps(lr), _mm256_set1_ps(eps));
                            for ((halves, g), acc) in eights.zip(state.chunks_exact_mut(8)) {
                                // SAFETY: `g` and `acc` are 8 floats each (the
                                // state's accumulators at the same
                                // coordinates); unaligned-tolerant.
                                #[expect(unsafe_code, reason = "SIMD loads and stores, features detected")]
                                unsafe {
                                    let g = _mm256_loadu_ps(g.as_ptr());
                                    let (w, sum) =
                                        adagrad_step($widen(halves), g, _mm256_loadu_ps(acc.as_ptr()), lr, eps);
                                    _mm256_storeu_ps(acc.as_mut_ptr(), sum);
                                    $narrow(w, halves);
                                }
                            }
                        }
                    }
                }
            };
        }
        step_in_registers!(step_in_registers, "f16c,avx", widen_f16_lanes, narrow_f16_lanes);
        step_in_registers!(step_bf16_in_registers, "avx2", widen_bf16_lanes, narrow_bf16_lanes);

        /// Eight stored f16 values (`halves`: 4 words) as f32 lanes.
        #[target_feature(enable = "f16c,avx")]
        #[inline]
        fn widen_f16_lanes(halves: &[f32]) -> __m256 {
            assert!(halves.len() >= 4);
            // SAFETY: `halves` holds at least 4 words (16 bytes, eight
            // halves); the load is unaligned-tolerant.
            #[expect(unsafe_code, reason = "SIMD load behind run-time feature detection")]
            unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(halves.as_ptr().cast()))
            }
        }

        /// Eight f32 lanes stored as f16, to nearest even, into `halves` (4 words).
        #[target_feature(enable = "f16c,avx")]
        #[inline]
        fn narrow_f16_lanes(w: __m256, halves: &mut [f32]) {
            assert!(halves.len() >= 4);
            // SAFETY: `halves` holds at least 4 words (16 bytes); the store
            // is unaligned-tolerant.
            #[expect(unsafe_code, reason = "SIMD store behind run-time feature detection")]
            unsafe {
                _mm_storeu_si128(halves.as_mut_ptr().cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(w));
            }
        }

        /// Eight stored bf16 values (`halves`: 4 words) as f32 lanes: each
        /// the top half of its f32 (exact).
        #[target_feature(enable = "avx2")]
        #[inline]
        fn widen_bf16_lanes(halves: &[f32]) -> __m256 {
            assert!(halves.len() >= 4);
            // SAFETY: `halves` holds at least 4 words (16 bytes, eight
            // halves); the load is unaligned-tolerant.
            #[expect(unsafe_code, reason = "SIMD load behind run-time feature detection")]
            let halves = unsafe { _mm_loadu_si128(halves.as_ptr().cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }

        /// Eight f32 lanes stored as bf16 into `halves` (4 words), as
        /// [`bf16_bits`](super::super::bf16_bits) rounds one: to nearest
        /// even, a NaN kept quiet.
        #[target_feature(enable = "avx2")]
        #[inline]
        fn narrow_bf16_lanes(w: __m256, halves: &mut [f32]) {
            assert!(halves.len() >= 4);
            let b = _mm256_castps_si256(w);
            let high = _mm256_srli_epi32::<16>(b);
            let odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
            let rounded =
                _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd));
            let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(w, w));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // Every lane is below 2^16: packing saturates nothing. It packs
            // within 128-bit halves, so the two 64-bit results are gathered.
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
            // SAFETY: `halves` holds at least 4 words (16 bytes); the store
            // is unaligned-tolerant.
            #[expect(unsafe_code, reason = "SIMD store behind run-time feature detection")]
            unsafe {
                _mm_storeu_si128(halves.as_mut_ptr().cast(), _mm256_castsi256_si128(packed));
            }
        }

        #[inline]
        pub(crate) fn bf16_available(simd: Simd) -> bool {
            simd.allows() && is_x86_feature_detected!("avx2")
        }

        /// [`RowFormat::update_vector`](super::super::RowFormat::update_vector)
        /// for bf16 with AVX2: the register step where the optimizer has a
        /// coordinate rule, otherwise decode, `apply`, encode.
        #[target_feature(enable = "avx2")]
        pub(crate) fn update_bf16(
            opt: &SparseOptimizer,
            words: &mut [f32],
            state: &mut [f32],
            g: &[f32],
            w: &mut [f32],
        ) {
            if g.len().is_multiple_of(8)
                && let Some(rule) = opt.coordinate_rule(state, g)
            {
                return step_bf16_in_registers(rule, words, state, g);
            }
            super::super::unpack(words, w, super::super::widen_bf16);
            opt.apply(w, state, g);
            super::super::pack(w, words, super::super::bf16_bits);
        }

        /// Narrows the first multiple of 8 coordinates of `w` to bf16 into
        /// `words`; returns how many it did.
        #[target_feature(enable = "avx2")]
        pub(crate) fn narrow_bf16(w: &[f32], words: &mut [f32]) -> usize {
            let n = w.len() / 8 * 8;
            for (x, halves) in w[..n].chunks_exact(8).zip(words.chunks_exact_mut(4)) {
                // SAFETY: `x` is 8 floats (32 bytes); unaligned-tolerant.
                #[expect(unsafe_code, reason = "SIMD load behind run-time feature detection")]
                let x = unsafe { _mm256_loadu_ps(x.as_ptr()) };
                narrow_bf16_lanes(x, halves);
            }
            n
        }

        /// Widens every `(stored, out)` bf16 pair, eight coordinates at a
        /// time (the rest one by one).
        #[target_feature(enable = "avx2")]
        pub(crate) fn decode_all_bf16<'a>(rows: impl Iterator<Item = (&'a [f32], &'a mut [f32])>) {
            for (words, out) in rows {
                let n = out.len() / 8 * 8;
                for (o, halves) in out[..n].chunks_exact_mut(8).zip(words.chunks_exact(4)) {
                    // SAFETY: `o` is 8 floats (32 bytes); unaligned-tolerant.
                    #[expect(unsafe_code, reason = "SIMD store behind run-time feature detection")]
                    unsafe {
                        _mm256_storeu_ps(o.as_mut_ptr(), widen_bf16_lanes(halves))
                    };
                }
                super::super::unpack(&words[n / 2..], &mut out[n..], super::super::widen_bf16);
            }
        }

        /// [`CoordinateRule::Scaled`] on eight f32 lanes: `w - step·g`.
        #[target_feature(enable = "avx")]
        #[inline]
        pub(crate) fn scaled_step(w: __m256, g: __m256, step: __m256) -> __m256 {
            _mm256_sub_ps(w, _mm256_mul_ps(step, g))
        }

        /// [`CoordinateRule::Adagrad`] on eight f32 lanes: the new weights
        /// and accumulators, `acc + g·g` and `w - (lr·g) / (√acc' + eps)`.
        #[target_feature(enable = "avx")]
        #[inline]
        pub(crate) fn adagrad_step(w: __m256, g: __m256, acc: __m256, lr: __m256, eps: __m256) -> (__m256, __m256) {
            let sum = _mm256_add_ps(acc, _mm256_mul_ps(g, g));
            let denom = _mm256_add_ps(_mm256_sqrt_ps(sum), eps);
            (_mm256_sub_ps(w, _mm256_div_ps(_mm256_mul_ps(lr, g), denom)), sum)
        }

        #[target_feature(enable = "f16c,avx")]
        pub(crate) fn narrow(w: &[f32], words: &mut [f32]) -> usize {
            let n = w.len() / 8 * 8;
            for (x, o) in w[..n].chunks_exact(8).zip(words.chunks_exact_mut(4)) {
                // SAFETY: `x` is 8 floats (32 bytes) and `o` 4 words (16
                // bytes, eight halves); both accesses are unaligned-tolerant.
                #[expect(unsafe_code, reason = "SIMD load and store behind run-time feature detection")]
                unsafe {
                    let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr()));
                    _mm_storeu_si128(o.as_mut_ptr().cast(), halves);
                }
            }
            n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(dtype: EmbeddingDtype, dim: usize) -> RowFormat {
        RowFormat { dtype, dim, state_len: 3, simd: Simd::Auto }
    }

    /// A half type's run-time kernels against its portable conversions:
    /// every 16-bit pattern widened, and `inputs` (a multiple of 8)
    /// narrowed, bit for bit.
    #[cfg(target_arch = "x86_64")]
    fn assert_kernels_convert_as_portable(
        widen_simd: impl Fn(&[f32], &mut [f32]),
        widen: fn(u16) -> f32,
        narrow_simd: impl Fn(&[f32], &mut [f32]) -> usize,
        narrow: fn(f32) -> u16,
        inputs: &[f32],
    ) {
        let halves: Vec<u16> = (0..=u16::MAX).collect();
        let words: Vec<f32> =
            halves.chunks(2).map(|p| f32::from_bits(u32::from(p[0]) | (u32::from(p[1]) << 16))).collect();
        let (mut simd_out, mut portable) = (vec![0.0f32; halves.len()], vec![0.0f32; halves.len()]);
        widen_simd(&words, &mut simd_out);
        unpack(&words, &mut portable, widen);
        assert_eq!(bits(&simd_out), bits(&portable), "widening");
        let (mut simd_words, mut portable_words) = (vec![0.0f32; inputs.len() / 2], vec![0.0f32; inputs.len() / 2]);
        assert_eq!(narrow_simd(inputs, &mut simd_words), inputs.len());
        pack(inputs, &mut portable_words, narrow);
        assert_eq!(bits(&simd_words), bits(&portable_words), "narrowing");
    }

    /// `n` values of a xorshift sequence through `value`.
    fn xorshift_values(n: usize, value: impl Fn(u64) -> f32) -> Vec<f32> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                value(x)
            })
            .collect()
    }

    /// The F16C path and the scalar one give the same bits: every f16 bit
    /// pattern widened, and f32s of every kind narrowed (ties, subnormals,
    /// overflow, infinities, NaNs).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_and_portable_conversions_agree_bit_for_bit() {
        if !simd::x86::available(Simd::Auto) {
            return; // no F16C on this CPU: nothing to compare
        }
        let mut inputs = xorshift_values(200_000, |x| {
            // Exponents around f16's range, and raw bit patterns.
            if x.is_multiple_of(3) {
                f32::from_bits(x as u32)
            } else {
                ((x >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 2f32.powi((x % 48) as i32 - 28)
            }
        });
        // Exact ties between two halves, both parities, and the edges.
        inputs.extend([
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            65504.0,
            65520.0,
            65519.99,
            2f32.powi(-25),
            2f32.powi(-24) * 1.5,
            f32::INFINITY,
            f32::NAN,
            -0.0,
        ]);
        inputs.truncate(inputs.len() / 8 * 8);
        let widen_simd = |words: &[f32], out: &mut [f32]| {
            #[expect(unsafe_code, reason = "the test checks F16C against the portable code")]
            // SAFETY: F16C and AVX were detected above.
            let done = unsafe { simd::x86::widen(words, out) };
            assert_eq!(done, out.len());
        };
        let narrow_simd = |w: &[f32], words: &mut [f32]| {
            #[expect(unsafe_code, reason = "the test checks F16C against the portable code")]
            // SAFETY: F16C and AVX were detected above.
            unsafe {
                simd::x86::narrow(w, words)
            }
        };
        let (widen, narrow) = (|h| f16::from_bits(h).to_f32(), |x| f16::from_f32(x).to_bits());
        assert_kernels_convert_as_portable(widen_simd, widen, narrow_simd, narrow, &inputs);
    }

    /// The AVX2 bf16 conversions are the portable ones: every bf16 widened,
    /// and 200k f32s narrowed — raw bit patterns (NaNs with every payload:
    /// the portable rule keeps the top half and sets the quiet bit, where
    /// rounding the bits would carry into the sign), values below f32's
    /// normals, exact ties of both parities.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_portable_bf16_conversions_agree_bit_for_bit() {
        if !simd::x86::bf16_available(Simd::Auto) {
            return; // no AVX2 on this CPU: nothing to compare
        }
        let mut inputs = xorshift_values(200_000, |x| match x % 4 {
            0 | 1 => f32::from_bits(x as u32),
            2 => f32::from_bits((x as u32 & 0x807f_ffff) | 0x7f80_0000), // ±inf and NaNs
            _ => f32::from_bits(x as u32 & 0x80ff_ffff),                 // the lowest binades
        });
        for high in [0x3f80u32, 0x3f81, 0x0001, 0x7f7f, 0xff7f] {
            inputs.extend([f32::from_bits((high << 16) | 0x8000), f32::from_bits((high << 16) | 0x7fff)]);
        }
        inputs.truncate(inputs.len() / 8 * 8);
        let widen_simd = |words: &[f32], out: &mut [f32]| {
            #[expect(unsafe_code, reason = "the test checks AVX2 against the portable code")]
            // SAFETY: AVX2 was detected above.
            unsafe {
                simd::x86::decode_all_bf16(std::iter::once((words, out)))
            }
        };
        let narrow_simd = |w: &[f32], words: &mut [f32]| {
            #[expect(unsafe_code, reason = "the test checks AVX2 against the portable code")]
            // SAFETY: AVX2 was detected above.
            unsafe {
                simd::x86::narrow_bf16(w, words)
            }
        };
        assert_kernels_convert_as_portable(widen_simd, widen_bf16, narrow_simd, bf16_bits, &inputs);
    }

    /// [`round_stochastic_one`] by its definition, in f64 for every value:
    /// the spacing of the stored type at `x`, the fraction of it `x` lies
    /// above the lower neighbour, away from zero when `u / 2²⁴` is below it.
    fn stochastic_reference(x: f32, mantissa: i32, min_exp: i32, u: u32) -> f32 {
        if !x.is_finite() || x == 0.0 {
            return x;
        }
        let exp = (f64::from(x.abs()).log2().floor() as i32).max(min_exp);
        let spacing = 2f64.powi(exp - mantissa);
        let scaled = f64::from(x.abs()) / spacing;
        let fraction = scaled - scaled.floor();
        let up = f64::from(u) / f64::from(1u32 << 24) < fraction;
        (((scaled.floor() + f64::from(u8::from(up))) * spacing) as f32).copysign(x)
    }

    /// The bit-level stochastic rounding equals its f64 definition, for
    /// f16's and bf16's shapes, normal and subnormal values, binade edges,
    /// and the extreme draws; its results are values the type holds, one of
    /// the input's two neighbours.
    #[test]
    fn stochastic_rounding_follows_its_definition() {
        let mut value = signed_values(17);
        let mut draws = 0x2545_f491_4f6c_dd1du64;
        for (dtype, mantissa, min_exp, exponents) in
            [(EmbeddingDtype::F16, 10, -14, -30..18), (EmbeddingDtype::Bf16, 7, -126, -140..40)]
        {
            let f = format(dtype, 1);
            let mut inputs: Vec<f32> = (0..100_000).map(|_| value(exponents.clone())).collect();
            inputs.extend([1.0, -1.0, 1.0 + 2f32.powi(-20), 2.0 - 2f32.powi(-20), 65504.0, 65519.0, 1e-30, 1e-40]);
            for x in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0] {
                let got = round_stochastic_one(x, mantissa, min_exp, 12345);
                assert_eq!(got.to_bits(), x.to_bits(), "{dtype:?}: {x} passes through");
            }
            for x in inputs {
                draws = mix64(draws);
                for u in [0, (1 << 24) - 1, (draws >> 40) as u32] {
                    let got = round_stochastic_one(x, mantissa, min_exp, u);
                    let want = stochastic_reference(x, mantissa, min_exp, u);
                    assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} x = {x:e}, u = {u}");
                    let mut stored = [got];
                    f.round(&mut stored);
                    if dtype == EmbeddingDtype::F16 && got.abs() > 65504.0 {
                        // Up from f16's largest finite value: ±inf, as documented.
                        assert!(stored[0].is_infinite() && x.abs() > 65504.0, "{x:e} → {got:e}");
                        continue;
                    }
                    assert_eq!(stored[0].to_bits(), got.to_bits(), "{dtype:?}: {x:e} → {got:e} is not stored as is");
                    // The two neighbours are a spacing apart: the result is
                    // within a spacing of x.
                    let spacing = 2f64.powi((f64::from(x.abs()).log2().floor() as i32).max(min_exp) - mantissa);
                    assert!(f64::from((got - x).abs()) <= spacing, "{dtype:?}: {x:e} → {got:e}");
                }
                assert!(round_stochastic_one(x, mantissa, min_exp, 0).abs() >= x.abs(), "u = 0 rounds away from zero");
            }
        }
    }

    /// A vector rounded stochastically — the AVX-512 build where the CPU has
    /// it, and the portable one — is each coordinate rounded on its own with
    /// its draw, bit for bit: vectors of every length up to 40, values
    /// normal, below the normals, zeros, infinities and NaN, mixed.
    #[test]
    fn stochastic_rounding_of_vectors_is_one_coordinate_at_a_time() {
        let mut value = signed_values(31);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, -3e-39, 65519.0];
        for (mantissa, min_exp, exponents) in [(10, -14, -30..18), (7, -126, -140..40)] {
            for len in 0..=40 {
                for case in 0..40 {
                    rng = mix64(rng);
                    let w: Vec<f32> = (0..len)
                        .map(|i| match (case % 4, i % 7) {
                            (0, _) | (1, 1..) => value(exponents.clone()),
                            _ => specials[(rng as usize + i) % specials.len()],
                        })
                        .collect();
                    let base = rng;
                    let want: Vec<u32> = w
                        .iter()
                        .enumerate()
                        .map(|(i, &x)| {
                            let u = (mix64(base.wrapping_add(i as u64)) >> 40) as u32;
                            round_stochastic_one(x, mantissa, min_exp, u).to_bits()
                        })
                        .collect();
                    let (mut dispatched, mut portable) = (w.clone(), w.clone());
                    simd::round_stochastic(Simd::Auto, &mut dispatched, base, mantissa, min_exp);
                    round_stochastic_lanes(&mut portable, base, mantissa, min_exp);
                    assert_eq!(bits(&portable), want, "portable, len {len}, {w:?}");
                    assert_eq!(bits(&dispatched), want, "this CPU's build, len {len}, {w:?}");
                }
            }
        }
    }

    /// Over many draws (keys, update counts) a stochastically rounded value
    /// is right on average, where rounding to nearest loses the update; the
    /// count advances by one a call and wraps at 2²⁴; the draws depend on
    /// the seed.
    #[test]
    fn stochastic_rounding_is_unbiased_and_counts_updates() {
        for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
            let f = format(dtype, 4);
            // A tenth of the gap above 1.0 (f16: 2^-10, bf16: 2^-7).
            let gap = if dtype == EmbeddingDtype::F16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
            let x = [1.0 + gap / 10.0, -(1.0 + gap / 10.0), 1.0 + gap * 0.75, 3.0];
            let n = 200_000u64;
            let mut sums = [0f64; 4];
            let mut count = 0.0f32;
            for key in 0..n {
                let mut w = x;
                f.round_stochastic(&mut w, 42, key, &mut count);
                sums.iter_mut().zip(w).for_each(|(s, w)| *s += f64::from(w));
            }
            assert_eq!(count, n as f32, "one count a call");
            for (i, (&sum, &x)) in sums.iter().zip(&x).enumerate() {
                let mean = sum / n as f64;
                // The binomial's standard deviation of the mean is at most gap / (2·√n).
                let tolerance = 6.0 * f64::from(gap) / (2.0 * (n as f64).sqrt());
                assert!((mean - f64::from(x)).abs() < tolerance, "{dtype:?} coordinate {i}: mean {mean} vs {x}");
            }
            let mut nearest = x;
            f.round(&mut nearest);
            assert_eq!(nearest[0], 1.0, "to nearest, a tenth of a gap is lost");

            let (mut a, mut b, mut c) = (x, x, x);
            let (mut ca, mut cb, mut cc) = (7.0f32, 7.0f32, 7.0f32);
            f.round_stochastic(&mut a, 1, 5, &mut ca);
            f.round_stochastic(&mut b, 1, 5, &mut cb);
            assert_eq!(bits(&a), bits(&b), "the same seed, key and count: the same draws");
            let differs = (2..50u64).any(|seed| {
                c = x;
                cc = 7.0;
                f.round_stochastic(&mut c, seed, 5, &mut cc);
                bits(&c) != bits(&a)
            });
            assert!(differs, "another seed draws otherwise");
            let mut last = 16_777_215.0f32;
            f.round_stochastic(&mut c, 1, 5, &mut last);
            assert_eq!(last, 0.0, "the count wraps at 2^24");
        }
    }

    /// Pseudo-random values from `seed`: each call uniform in ±2^(e - 1)
    /// for an exponent e drawn from the range it is given.
    fn signed_values(seed: u64) -> impl FnMut(std::ops::Range<i32>) -> f32 {
        let mut x = seed;
        move |exponents| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let e = exponents.start + (x % exponents.len() as u64) as i32;
            ((x >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 2f32.powi(e)
        }
    }

    /// `update_vector` (on x86 with F16C: the step in registers for SGD,
    /// Adagrad and row-wise Adagrad at dims that are multiples of 8) stores
    /// the same bits as decoding with the portable code, `apply` and
    /// encoding with the portable code, for every optimizer and for dims
    /// with and without a tail.
    #[test]
    fn a_half_update_stores_what_decode_step_encode_would() {
        let optimizers = [
            SparseOptimizer::Sgd { lr: 0.3 },
            SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 },
            SparseOptimizer::RowwiseAdagrad { lr: 0.05, eps: 1e-8 },
            SparseOptimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
            SparseOptimizer::Ftrl { alpha: 0.05, beta: 1.0, l1: 1e-3, l2: 1e-3 },
        ];
        let mut next = signed_values(0x2545_f491_4f6c_dd1d);
        // bf16 rows also meet NaN, infinities and values below f32's normals.
        let specials = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -2e-39, 0.0, -0.0];
        let (f16_to, f16_from) = (|x: f32| f16::from_f32(x).to_bits(), |h| f16::from_bits(h).to_f32());
        for (dtype, to, from, exponents) in [
            (EmbeddingDtype::F16, &f16_to as &dyn Fn(f32) -> u16, &f16_from as &dyn Fn(u16) -> f32, -4..18),
            (EmbeddingDtype::Bf16, &bf16_bits, &widen_bf16, -130..40),
        ] {
            for opt in optimizers {
                for dim in [8usize, 16, 24, 64, 5, 17] {
                    let f = RowFormat { dtype, dim, state_len: opt.state_len(dim), simd: Simd::Auto };
                    for case in 0..200 {
                        // Steps as large as the weights' last bits and larger,
                        // and now and then a weight past f16's range.
                        let mut w: Vec<f32> = (0..dim).map(|_| next(exponents.clone())).collect();
                        if dtype == EmbeddingDtype::Bf16 && case % 5 == 0 {
                            w[case % dim] = specials[case % specials.len()];
                        }
                        f.round(&mut w);
                        let mut words = vec![0.0f32; f.vector_words()];
                        pack(&w, &mut words, to);
                        let mut state: Vec<f32> = (0..f.state_len).map(|_| next(-12..2).abs()).collect();
                        let g: Vec<f32> = (0..dim).map(|_| next(-12..2)).collect();

                        let (mut fast_words, mut fast_state) = (words.clone(), state.clone());
                        f.update_vector(&opt, &mut fast_words, &mut fast_state, &g, &mut vec![0.0; dim]);

                        let mut v = vec![0.0f32; dim];
                        unpack(&words, &mut v, from);
                        opt.apply(&mut v, &mut state, &g);
                        pack(&v, &mut words, to);
                        let what = format!("{dtype:?} {} dim {dim}", opt.name());
                        assert_eq!(bits(&fast_words), bits(&words), "{what}: stored vector");
                        assert_eq!(bits(&fast_state), bits(&state), "{what}: state");

                        // Decoding many rows at once is decoding each.
                        let (mut many, mut one) = (vec![0.0f32; dim], vec![0.0f32; dim]);
                        f.decode_vectors(std::iter::once((&words[..], &mut many[..])));
                        unpack(&words, &mut one, from);
                        assert_eq!(bits(&many), bits(&one), "{what}: decode");
                    }
                }
            }
        }
    }

    /// The eight-lane steps of the f16 kernel give `apply`'s f32 bits before
    /// any rounding to f16 (which would hide most differences in the last
    /// bits): same inputs through `coordinate_rule` and the lanes, and
    /// through `apply`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_register_steps_give_applys_f32_bits() {
        use crate::optimizer::CoordinateRule;
        use std::arch::x86_64::{_mm256_loadu_ps, _mm256_set1_ps, _mm256_storeu_ps};
        if !simd::x86::available(Simd::Auto) {
            return; // no AVX on this CPU: nothing to compare
        }
        let mut next = signed_values(0x9e37_79b9_7f4a_7c15);
        let optimizers = [
            SparseOptimizer::Sgd { lr: 0.3 },
            SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 },
            SparseOptimizer::RowwiseAdagrad { lr: 0.05, eps: 1e-8 },
        ];
        for opt in optimizers {
            for _ in 0..20_000 {
                let w: Vec<f32> = (0..8).map(|_| next(-6..4)).collect();
                let g: Vec<f32> = (0..8).map(|_| next(-12..2)).collect();
                let state: Vec<f32> = (0..opt.state_len(8)).map(|_| next(-14..2).abs()).collect();
                let (mut want_w, mut want_state) = (w.clone(), state.clone());
                opt.apply(&mut want_w, &mut want_state, &g);

                let (mut got_w, mut got_state) = (vec![0.0f32; 8], state.clone());
                let rule = opt.coordinate_rule(&mut got_state, &g).expect("a rule");
                #[expect(unsafe_code, reason = "the test checks the AVX lanes against the portable step")]
                // SAFETY: AVX was detected above; every load and store is of 8 floats.
                unsafe {
                    let (wv, gv) = (_mm256_loadu_ps(w.as_ptr()), _mm256_loadu_ps(g.as_ptr()));
                    match rule {
                        CoordinateRule::Scaled { step } => {
                            _mm256_storeu_ps(got_w.as_mut_ptr(), simd::x86::scaled_step(wv, gv, _mm256_set1_ps(step)));
                        }
                        CoordinateRule::Adagrad { lr, eps } => {
                            let acc = _mm256_loadu_ps(got_state.as_ptr());
                            let (new_w, new_acc) =
                                simd::x86::adagrad_step(wv, gv, acc, _mm256_set1_ps(lr), _mm256_set1_ps(eps));
                            _mm256_storeu_ps(got_w.as_mut_ptr(), new_w);
                            _mm256_storeu_ps(got_state.as_mut_ptr(), new_acc);
                        }
                    }
                }
                assert_eq!(bits(&got_w), bits(&want_w), "{}: weights", opt.name());
                assert_eq!(bits(&got_state), bits(&want_state), "{}: state", opt.name());
            }
        }
    }

    #[test]
    fn bf16_rounding_is_halfs() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = f32::from_bits(x as u32);
            assert_eq!(bf16_bits(v), half::bf16::from_f32(v).to_bits(), "{:#x}", x as u32);
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn half_rows_take_half_the_vector_words() {
        assert_eq!(format(EmbeddingDtype::F32, 16).stored_len(), 19);
        assert_eq!(format(EmbeddingDtype::F16, 16).stored_len(), 11);
        assert_eq!(format(EmbeddingDtype::Bf16, 5).stored_len(), 6, "an odd dim pads its last word");
    }

    #[test]
    fn encoding_rounds_to_nearest_even_once_and_decoding_is_exact() {
        let w = [1.0f32, 1.0 + 1.5 / 1024.0, -3.3e-3, 70000.0, 1e-8, f32::from_bits(0x3f80_8000), 0.1];
        for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
            let f = format(dtype, w.len());
            let logical: Vec<f32> = w.iter().copied().chain([7.0, 8.0, 9.0]).collect();
            let mut stored = vec![0.0; f.stored_len()];
            f.encode(&logical, &mut stored);
            let mut back = vec![0.0; f.logical_len()];
            f.decode(&stored, &mut back);
            let mut rounded = w;
            f.round(&mut rounded);
            assert_eq!(back[..w.len()], rounded, "{dtype:?}");
            assert_eq!(back[w.len()..], [7.0, 8.0, 9.0], "the state is f32");
            // Decoded values encode to the same words (no second rounding).
            let mut again = vec![0.0; f.stored_len()];
            f.encode(&back, &mut again);
            assert_eq!(
                again.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                stored.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        let f16s = format(EmbeddingDtype::F16, 7);
        let mut v = w;
        f16s.round(&mut v);
        // Ties to even: 1 + 1.5 ulp(2^-10) rounds up to 1 + 2 ulp.
        assert_eq!(v[1], 1.0 + 2.0 / 1024.0);
        assert_eq!(v[3], f32::INFINITY, "past f16's range");
        assert_eq!(v[4], 0.0, "below f16's smallest subnormal");
        let bf = format(EmbeddingDtype::Bf16, 7);
        let mut v = w;
        bf.round(&mut v);
        // 0x3f808000 is the tie between 0x3f80 and 0x3f81: to even.
        assert_eq!(v[5].to_bits(), 0x3f80_0000);
        assert_eq!(v[3], 70144.0, "bf16 keeps f32's range");
    }
}
