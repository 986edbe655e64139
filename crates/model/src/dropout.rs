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

/// Draws are 16-bit: the rate is kept to the nearest 1/65536.
const LEVELS: u32 = 1 << 16;

/// A stack's dropout: its rate and what tells its draws from other stacks'.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Dropout {
    /// Draws below this (of 65536) drop the value.
    threshold: u32,
    /// From the stack's name.
    salt: u64,
}

impl Dropout {
    /// `rate` in [0, 1) for the stack named `name`.
    pub(crate) fn new(rate: f32, name: &str) -> Dropout {
        let threshold = (f64::from(rate.clamp(0.0, 1.0)) * f64::from(LEVELS)).round() as u32;
        let salt = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Dropout { threshold: threshold.min(LEVELS - 1), salt }
    }

    pub(crate) fn is_on(&self) -> bool {
        self.threshold > 0
    }

    /// What a kept value is multiplied by: 1 / (the share kept).
    pub(crate) fn scale(&self) -> f32 {
        (f64::from(LEVELS) / f64::from(LEVELS - self.threshold)) as f32
    }

    /// The same stack's dropout at another rate.
    pub(crate) fn with_rate(self, rate: f32) -> Dropout {
        Dropout { salt: self.salt, ..Dropout::new(rate, "") }
    }

    /// Drops values of layer `layer`'s output `out` for the step drawn
    /// `draw`, scaling the kept ones; returns the scale (1: it did nothing).
    pub(crate) fn apply(&self, draw: Option<u64>, layer: usize, out: &mut [f32]) -> f32 {
        let Some(draw) = draw.filter(|_| self.is_on()) else { return 1.0 };
        let base = mix64(draw ^ self.salt ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let (threshold, scale) = (self.threshold, self.scale());
        // Four draws a hash: blocks of whole groups of four (and rows) per task.
        const BLOCK: usize = 4 * 1024;
        out.par_chunks_mut(BLOCK).enumerate().for_each(|(b, block)| {
            for (g, group) in block.chunks_mut(4).enumerate() {
                let bits = mix64(base.wrapping_add(((b * BLOCK) / 4 + g) as u64));
                for (k, v) in group.iter_mut().enumerate() {
                    let u = ((bits >> (16 * k)) & 0xffff) as u32;
                    *v = if u < threshold { 0.0 } else { *v * scale };
                }
            }
        });
        scale
    }
}

#[cfg(test)]
mod tests {
    use super::Dropout;

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
            let scale = d.apply(Some(7), 0, &mut a);
            assert!((scale - 1.0 / (1.0 - rate)).abs() < 1e-4, "{scale}");
            let dropped = a.iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
            assert!((dropped - f64::from(rate)).abs() < 0.01, "rate {rate}: {dropped} dropped");
            assert!(a.iter().all(|v| *v == 0.0 || *v == scale));
            let mean = a.iter().map(|v| f64::from(*v)).sum::<f64>() / n as f64;
            assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
            let mut again = ones.clone();
            d.apply(Some(7), 0, &mut again);
            assert_eq!(a, again);
            for (draw, layer, name) in [(8, 0, "mlp"), (7, 1, "mlp"), (7, 0, "tower.0")] {
                let mut other = ones.clone();
                Dropout::new(rate, name).apply(Some(draw), layer, &mut other);
                assert_ne!(a, other, "{draw} {layer} {name}");
            }
        }
        let mut same = ones.clone();
        assert_eq!(Dropout::new(0.5, "mlp").apply(None, 0, &mut same), 1.0);
        assert_eq!(Dropout::new(0.0, "mlp").apply(Some(7), 0, &mut same), 1.0);
        assert_eq!(same, ones);
    }
}
