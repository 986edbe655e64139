//! `exp` of `f32` in plain arithmetic, so a loop over a vector of values
//! compiles to vector instructions (`f32::exp` is a call into libm a value:
//! the multi-task gates' softmax spent 2–3% of MMoE's and PLE's step in
//! it). Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (ln 2 split
//! in two so `n·C1` is exact), a degree-7 polynomial in `r`, scaled by
//! `2^n` in two exact steps so a subnormal result is rounded once. No
//! fused multiply-add: the same bits on every build and CPU. Within two
//! units in the last place of the exact value (tested), where libm is
//! within one; a gate's weights move in their last bits. The graph takes
//! the same exponentials ([`Exp`]), so it stays the direct step's reference
//! to its last bits but for the order of sums.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// `e^x`: 1 at 0, 0 below −104 (and at −∞), ∞ above 88.73, NaN at NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2; C1 has nine significant bits.
    const C1: f32 = 0.693_359_4; // 355/512 in f32
    const C2: f32 = -2.121_944_4e-4;
    // Beyond these, e^x is 0 or ∞ in f32; `clamp` keeps a NaN.
    let x = x.clamp(-104.0, 88.73);
    // Rounded to the nearest integer, ties to even, by adding and taking
    // away 1.5·2^23 (`round_ties_even` is a libm call without SSE4.1).
    const ROUND: f32 = 12_582_912.0;
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * C1) - n * C2;
    let p = ((((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
        * r
        + 0.5)
        * (r * r)
        + r)
        + 1.0;
    // 2^n as two normal powers (n in [−150, 128]). n as an integer is
    // `t`'s last bits (t = 1.5·2^23 + n, one exponent for every such n):
    // `n as i32`, a saturating cast, took each lane out of its vector to
    // convert it. A NaN's n is garbage, and its result NaN all the same.
    let n = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let half = n >> 1;
    let scale = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * scale(half) * scale(n - half)
}

/// [`exp_f32`] of every value of a tensor, as a graph op: its gradient is
/// the incoming one times the output.
pub(crate) struct Exp;

impl CustomOp1 for Exp {
    fn name(&self) -> &'static str {
        "exp-f32"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = crate::fused::contiguous_f32(self.name(), s, l)?;
        Ok((CpuStorage::F32(x.iter().map(|&v| exp_f32(v)).collect()), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.mul(res)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `got` and `want` (both finite).
    fn ulps(got: f32, want: f32) -> u32 {
        let key = |v: f32| {
            let b = v.to_bits() as i32;
            if b < 0 { i32::MIN - b } else { b }
        };
        key(got).abs_diff(key(want))
    }

    #[test]
    fn within_two_units_in_the_last_place_over_the_whole_range() {
        let (lo, hi) = (-104.0f64, 88.72f64);
        let steps = 2_000_000;
        let mut worst = (0, 0.0f32);
        for i in 0..=steps {
            let x = (lo + (hi - lo) * i as f64 / steps as f64) as f32;
            let want = f64::from(x).exp() as f32;
            let got = exp_f32(x);
            let u = ulps(got, want);
            if u > worst.0 {
                worst = (u, x);
            }
        }
        assert!(worst.0 <= 2, "{} units in the last place at x = {}", worst.0, worst.1);
    }

    #[test]
    fn the_graph_op_takes_the_same_values_and_its_gradient() {
        use candle_core::{Device, Var};
        let xs = [-3.0f32, -0.5, 0.0, 0.25, -20.0, 2.0];
        let x = Var::new(&xs[..], &Device::Cpu).expect("var");
        let y = x.as_tensor().contiguous().expect("contiguous").apply_op1(Exp).expect("exp");
        let values = y.to_vec1::<f32>().expect("values");
        assert_eq!(values, xs.map(exp_f32).to_vec(), "the op's values are exp_f32's");
        let weights = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0][..], &Device::Cpu).expect("weights");
        let grads = (y * weights).expect("mul").sum_all().expect("sum").backward().expect("backward");
        let d = grads.get(x.as_tensor()).expect("a gradient").to_vec1::<f32>().expect("d");
        let want: Vec<f32> = xs.iter().zip(1..).map(|(&v, w)| w as f32 * exp_f32(v)).collect();
        assert_eq!(d, want, "d e^x / dx = e^x");
    }

    #[test]
    fn near_zero_and_at_the_edges() {
        assert_eq!(exp_f32(0.0), 1.0, "exactly 1 at 0 (a softmax's largest logit)");
        assert_eq!(exp_f32(-0.0), 1.0);
        for x in [1e-8f32, -1e-8, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, -87.0, -100.0, 88.0] {
            let want = f64::from(x).exp() as f32;
            assert!(ulps(exp_f32(x), want) <= 2, "x = {x}: {} against {want}", exp_f32(x));
        }
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan(), "a NaN stays a NaN");
        assert!(exp_f32(-103.0) > 0.0, "a subnormal result is kept");
    }
}
