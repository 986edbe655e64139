//! `model.dropout`: inverted dropout after each activated layer of an MLP
//! stack, drawn from a counter-based hash so a run stays exact.
//!
//! Each element's draw is a function of the step's draw (the job's seed,
//! the dense step, the worker), the stack (its name), the layer and the
//! element's place in the batch: the same on any thread split, on the
//! direct step and candle's graph, and after a resume. A kept value is
//! scaled by 1/keep, so evaluation and serving (no draw) use the weights
//! as they are and ONNX has nothing to lower.

use rayon::prelude::*;
use sparrow_core::key::mix64;
use sparrow_core::simd::Simd;

/// Draws are 16-bit: the rate is kept to the nearest 1/65536.
const LEVELS: u32 = 1 << 16;

/// A stack's dropout: its rate and what tells its draws from other stacks'.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Dropout {
    /// Draws below this (of 65536) drop the value.
    threshold: u32,
    /// From the stack's name.
    salt: u64,
    /// `train.simd`: whether the masks may be drawn by the AVX2 build (the same bits).
    simd: Simd,
}

impl Dropout {
    /// `rate` in [0, 1) for the stack named `name`.
    pub(crate) fn new(rate: f32, name: &str) -> Dropout {
        let threshold = (f64::from(rate.clamp(0.0, 1.0)) * f64::from(LEVELS)).round() as u32;
        let salt = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Dropout { threshold: threshold.min(LEVELS - 1), salt, simd: Simd::Auto }
    }

    pub(crate) fn is_on(&self) -> bool {
        self.threshold > 0
    }

    /// What a kept value is multiplied by: 1 / (the share kept).
    pub(crate) fn scale(&self) -> f32 {
        (f64::from(LEVELS) / f64::from(LEVELS - self.threshold)) as f32
    }

    /// The same stack's dropout at another rate, its kernels as `simd` allows.
    pub(crate) fn with_rate(self, rate: f32, simd: Simd) -> Dropout {
        Dropout { salt: self.salt, simd, ..Dropout::new(rate, "") }
    }

    /// Drops values of layer `layer`'s output `out` for the step drawn
    /// `draw`, scaling the kept ones; returns the scale (1: it did nothing).
    /// `out[0]` is value `first` of the layer's output over the whole batch
    /// (not 0 for the second half of a batch run in halves).
    pub(crate) fn apply(&self, draw: Option<u64>, layer: usize, first: usize, out: &mut [f32]) -> f32 {
        let Some(draw) = draw.filter(|_| self.is_on()) else { return 1.0 };
        let base = mix64(draw ^ self.salt ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let (lo, hi) = (base as u32, (base >> 32) as u32);
        let (threshold, scale, simd) = (self.threshold, self.scale(), self.simd);
        const BLOCK: usize = 16 * 1024;
        out.par_chunks_mut(BLOCK).enumerate().for_each(|(b, block)| {
            let first = (first + b * BLOCK) as u32;
            drop_block(simd, block, first, (lo, hi), threshold, scale);
        });
        scale
    }
}

/// Element `first + i` of `block` dropped where its draw is below
/// `threshold`, else scaled: compiled for AVX2 where the CPU has it (the
/// 32-bit multiplies vectorise there, not in the x86-64 baseline, where
/// the masks took a fifth of an MLP step), the portable build elsewhere;
/// the same bits either way (integer draws, one multiply a value).
fn drop_block(simd: Simd, block: &mut [f32], first: u32, seed: (u32, u32), threshold: u32, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn drop_avx2(block: &mut [f32], first: u32, seed: (u32, u32), threshold: u32, scale: f32) {
            drop_portable(block, first, seed, threshold, scale);
        }
        // SAFETY: AVX2 was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            drop_avx2(block, first, seed, threshold, scale)
        };
        return;
    }
    drop_portable(block, first, seed, threshold, scale);
}

#[inline(always)]
fn drop_portable(block: &mut [f32], first: u32, (lo, hi): (u32, u32), threshold: u32, scale: f32) {
    for (i, v) in block.iter_mut().enumerate() {
        let u = fmix32(fmix32(first.wrapping_add(i as u32) ^ lo) ^ hi) >> 16;
        *v = if u < threshold { 0.0 } else { *v * scale };
    }
}

/// MurmurHash3's finalizer: every input bit moves every output bit.
#[inline(always)]
fn fmix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^ (x >> 16)
}

#[cfg(test)]
mod tests {
    use super::Dropout;
    use sparrow_core::simd::Simd;

    /// About `rate` of the values go, the rest are scaled by 1/(1 − rate)
    /// (so the mean is kept); the same draw drops the same values, another
    /// draw, layer or stack other ones; no draw or rate 0 changes nothing.
    #[test]
    fn dropout_keeps_the_mean_and_repeats_its_draws() {
        let n = 200_000;
        let ones = vec![1.0f32; n];
        for rate in [0.1f32, 0.5] {
            let d = Dropout::new(rate, "mlp");
            let mut a = ones.clone();
            let scale = d.apply(Some(7), 0, 0, &mut a);
            assert!((scale - 1.0 / (1.0 - rate)).abs() < 1e-4, "{scale}");
            let dropped = a.iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
            assert!((dropped - f64::from(rate)).abs() < 0.01, "rate {rate}: {dropped} dropped");
            assert!(a.iter().all(|v| *v == 0.0 || *v == scale));
            let mean = a.iter().map(|v| f64::from(*v)).sum::<f64>() / n as f64;
            assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
            let mut again = ones.clone();
            d.apply(Some(7), 0, 0, &mut again);
            assert_eq!(a, again);
            for (draw, layer, name) in [(8, 0, "mlp"), (7, 1, "mlp"), (7, 0, "tower.0")] {
                let mut other = ones.clone();
                Dropout::new(rate, name).apply(Some(draw), layer, 0, &mut other);
                assert_ne!(a, other, "{draw} {layer} {name}");
            }
        }
        // The portable build draws the same masks.
        for rate in [0.1f32, 0.5] {
            let (mut auto, mut portable) = (ones.clone(), ones.clone());
            Dropout::new(0.0, "mlp").with_rate(rate, Simd::Auto).apply(Some(3), 1, 0, &mut auto);
            Dropout::new(0.0, "mlp").with_rate(rate, Simd::Portable).apply(Some(3), 1, 0, &mut portable);
            assert_eq!(auto, portable);
        }
        let mut same = ones.clone();
        assert_eq!(Dropout::new(0.5, "mlp").apply(None, 0, 0, &mut same), 1.0);
        assert_eq!(Dropout::new(0.0, "mlp").apply(Some(7), 0, 0, &mut same), 1.0);
        assert_eq!(same, ones);
    }

    /// A batch's output in two parts, each drawn from its place in the
    /// whole (`first`), drops what the whole does, across a block's end.
    #[test]
    fn a_part_drops_what_the_whole_drops_at_its_place() {
        let n = 40_000;
        let ones = vec![1.0f32; n];
        let d = Dropout::new(0.3, "expert.0");
        let mut whole = ones.clone();
        d.apply(Some(11), 2, 0, &mut whole);
        for cut in [1, 16 * 1024 + 3, 23_457] {
            let (mut head, mut tail) = (ones[..cut].to_vec(), ones[cut..].to_vec());
            d.apply(Some(11), 2, 0, &mut head);
            d.apply(Some(11), 2, cut, &mut tail);
            head.extend_from_slice(&tail);
            assert_eq!(head, whole, "cut at {cut}");
            // Drawn from the part's own start instead, they differ.
            let mut unplaced = ones[cut..].to_vec();
            d.apply(Some(11), 2, 0, &mut unplaced);
            assert_ne!(unplaced, whole[cut..], "cut at {cut}");
        }
    }
}
