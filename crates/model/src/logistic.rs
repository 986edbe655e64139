//! The binary heads' stable logistic loss and sigmoid, `max(x, 0) − x·y +
//! ln(1 + e^−|x|)` and `σ(x)`, in f64 plain arithmetic over a block of
//! rows at a time, so the loop compiles to vector instructions. Each row
//! took a call into libm for `exp` and one for `log1p`: in ESMM's dense
//! step (two binary heads, a small network) they were a tenth of it, and
//! LR's and FM's one-pass step (`kinds/first_order.rs`), which takes its
//! rows eight at a time, ran 8–12% faster without them.
//!
//! `e^−a` is Cephes' `exp` (`−a = n·ln 2 + r`, ln 2 split in two so
//! `n·C1` is exact, a rational function of `r`, scaled by `2^n` in two
//! exact steps); `ln(1 + e)` for `e` in [0, 1] is `2·atanh(e / (2 + e))`,
//! a series in odd powers, taking `ln 2 + ln(1 + (e − 1)/2)` above ½ so the
//! series' argument stays below 1/5. No fused multiply-add: the same bits
//! on every build and CPU. Within two units in the last place of libm's
//! `exp` and three of its `log1p` (tested); the sigmoid, which the
//! gradients read, goes to f32 after. A row's seed is `((σ − y)·task
//! weight)·(w / rows)` for a model without tasks too (it was `((σ − y)·w)
//! / rows`: with sample weights its last bit may differ from before).

use sparrow_core::simd::Simd;

/// `e^−a` for `a ≥ 0`: 1 at 0, 0 past 746 (and at ∞), NaN at NaN.
#[inline(always)]
fn exp_neg(a: f64) -> f64 {
    const LOG2_E: f64 = std::f64::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with few enough bits that n·C1 is exact.
    const C1: f64 = 6.931_457_519_531_25e-1;
    const C2: f64 = 1.428_606_820_309_417_3e-6;
    // Below this e^x is 0 in f64; `clamp` keeps a NaN.
    let x = (-a).clamp(-746.0, 0.0);
    // Rounded to the nearest integer, ties to even, by adding and taking
    // away 1.5·2^52 (`round_ties_even` is a libm call without SSE4.1).
    const ROUND: f64 = 6_755_399_441_055_744.0;
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * C1) - n * C2;
    let rr = r * r;
    let px = r * ((1.261_771_930_748_105_8e-4 * rr + 3.029_944_077_074_419_5e-2) * rr + 1.0);
    let q = ((3.001_985_051_386_644_6e-6 * rr + 2.524_483_403_496_841e-3) * rr + 2.272_655_482_081_550_3e-1) * rr + 2.0;
    let e = 1.0 + 2.0 * (px / (q - px));
    // 2^n as two normal powers (n in [−1076, 0]); n as an integer is `t`'s
    // last bits (t = 1.5·2^52 + n, one exponent for every such n). A NaN's
    // n is garbage, and its result NaN all the same.
    let n = t.to_bits() as i64 - ROUND.to_bits() as i64;
    let half = n >> 1;
    let scale = |k: i64| f64::from_bits(((k + 1023) as u64) << 52);
    e * scale(half) * scale(n - half)
}

/// `ln(1 + e)` for `e` in [0, 1] (NaN at NaN).
#[inline(always)]
fn ln_1p_unit(e: f64) -> f64 {
    // Above ½: 1 + e = 2·(1 + u) with u = (e − 1)/2 in (−¼, 0], exact.
    let high = e > 0.5;
    let u = if high { (e - 1.0) * 0.5 } else { e };
    // ln(1 + u) = 2·atanh(s), s = u/(2 + u), |s| ≤ 1/5: Σ 2·s^(2k+1)/(2k+1),
    // its terms past s^25 below 1e-18 of the sum.
    let s = u / (2.0 + u);
    let z = s * s;
    let mut sum = 2.0 / 25.0;
    for k in (0..12).rev() {
        sum = sum * z + 2.0 / (2 * k + 1) as f64;
    }
    let ln = s * sum;
    if high { ln + std::f64::consts::LN_2 } else { ln }
}

/// The stable logistic loss of `logit` against `label` and `σ(logit)`,
/// as `sparrow_core::metrics::logistic_loss_and_sigmoid` gives them
/// (within a few units in the last place).
#[inline(always)]
fn loss_and_sigmoid(logit: f64, label: f64) -> (f64, f64) {
    let e = exp_neg(logit.abs());
    let loss = logit.max(0.0) - logit * label + ln_1p_unit(e);
    let p = if logit >= 0.0 { 1.0 / (1.0 + e) } else { e / (1.0 + e) };
    (loss, p)
}

/// Rows of one binary task: `loss[r] += task_weight · w_r · l_r` and
/// `seed[r]` = d loss / d x_r for each row whose label is not masked (NaN:
/// the row's loss and seed are left as they are). `x` and `seed` are read
/// `strides.0` apart, `y` `strides.1` apart (a task's column of a row's
/// outputs and labels).
pub(crate) struct Column<'a> {
    pub x: &'a [f32],
    pub y: &'a [f32],
    pub seed: &'a mut [f32],
    pub strides: (usize, usize),
}

/// How a row's loss and seed are scaled: by the task's weight, the row's
/// sample weight (1 without `weights`) and one over the batch's rows.
#[derive(Clone, Copy)]
pub(crate) struct Scale<'a> {
    pub task_weight: f64,
    pub weights: Option<&'a [f32]>,
    pub inv_b: f64,
}

/// [`Column`]'s rows, their losses added to `losses` (one a row).
pub(crate) fn add_column(simd: Simd, column: Column<'_>, scale: Scale<'_>, losses: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if crate::columns::avx512f(simd) {
        #[target_feature(enable = "avx512f")]
        fn wide(column: Column<'_>, scale: Scale<'_>, losses: &mut [f64]) {
            rows(column, scale, losses);
        }
        // SAFETY: `avx512f` is true only where AVX-512F was detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { wide(column, scale, losses) };
    }
    let _ = simd;
    rows(column, scale, losses);
}

/// Rows a block at a time: the values gathered into arrays (a column of a
/// row's outputs is strided), the arithmetic run on the arrays, the
/// results written back.
#[inline(always)]
fn rows(column: Column<'_>, scale: Scale<'_>, losses: &mut [f64]) {
    // Four vectors of eight rows: each row is a long chain of dependent
    // operations, and one vector at a time left the core waiting on them
    // (ESMM's dense step 3–5% shorter than with blocks of 8).
    const BLOCK: usize = 32;
    let Column { x, y, seed, strides: (xs, ys) } = column;
    let Scale { task_weight, weights, inv_b } = scale;
    for (b, losses) in losses.chunks_mut(BLOCK).enumerate() {
        let first = b * BLOCK;
        let (mut lx, mut ly, mut lw) = ([0.0f64; BLOCK], [0.0f64; BLOCK], [1.0f64; BLOCK]);
        for i in 0..losses.len() {
            lx[i] = f64::from(x[(first + i) * xs]);
            ly[i] = f64::from(y[(first + i) * ys]);
            lw[i] = weights.map_or(1.0, |w| f64::from(w[first + i]));
        }
        let (mut l, mut s) = ([0.0f64; BLOCK], [0.0f32; BLOCK]);
        for i in 0..BLOCK {
            let (loss, p) = loss_and_sigmoid(lx[i], ly[i]);
            l[i] = task_weight * lw[i] * loss;
            let d = p - ly[i];
            s[i] = (d * task_weight * (lw[i] * inv_b)) as f32;
        }
        for (i, loss) in losses.iter_mut().enumerate() {
            if !ly[i].is_nan() {
                *loss += l[i];
                seed[(first + i) * xs] = s[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `got` and `want` (both finite, ≥ 0).
    fn ulps(got: f64, want: f64) -> u64 {
        got.to_bits().abs_diff(want.to_bits())
    }

    #[test]
    fn the_exponential_and_logarithm_are_within_three_units_in_the_last_place_of_libm() {
        let mut worst = (0u64, 0u64);
        for i in 0..=2_000_000u32 {
            // a over [0, 745], denser near 0; v over [0, 1].
            let a = 745.0 * (f64::from(i) / 2e6).powi(2);
            let e = exp_neg(a);
            worst.0 = worst.0.max(ulps(e, (-a).exp()));
            let v = f64::from(i) / 2e6;
            worst.1 = worst.1.max(ulps(ln_1p_unit(v), v.ln_1p()));
        }
        assert!(worst.0 <= 2 && worst.1 <= 3, "exp within {} ulps, ln_1p within {}", worst.0, worst.1);
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(746.0), 0.0);
        assert_eq!(exp_neg(f64::INFINITY), 0.0);
        assert!(exp_neg(f64::NAN).is_nan() && ln_1p_unit(f64::NAN).is_nan());
        assert_eq!(ln_1p_unit(0.0), 0.0);
        assert_eq!(ln_1p_unit(1.0), std::f64::consts::LN_2);
    }

    /// Against `metrics::logistic_loss_and_sigmoid` (libm) over logits from
    /// −800 to 800 and both labels: the loss and σ within a few units in the
    /// last place, σ the same f32.
    #[test]
    fn the_loss_and_sigmoid_are_libms_within_a_few_units_in_the_last_place() {
        for i in -80_000..=80_000 {
            let x = f64::from(i) / 100.0;
            for y in [0.0, 1.0, 0.3] {
                let (loss, p) = loss_and_sigmoid(x, y);
                let (want_loss, want_p) = sparrow_core::metrics::logistic_loss_and_sigmoid(x, y);
                let close = |a: f64, b: f64| a == b || (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1e-300);
                assert!(close(loss, want_loss), "loss at {x}, {y}: {loss} against {want_loss}");
                assert!(close(p, want_p), "σ at {x}: {p} against {want_p}");
            }
        }
        let (loss, p) = loss_and_sigmoid(f64::NAN, 1.0);
        assert!(loss.is_nan() && p.is_nan());
    }

    /// The block and its AVX-512 build give every row's loss and seed as
    /// the row-at-a-time arithmetic does, a masked row untouched, in a
    /// strided column with a ragged last block.
    #[test]
    fn a_column_gives_each_rows_arithmetic_and_leaves_masked_rows() {
        let rows = 37;
        let x: Vec<f32> = (0..rows * 3).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        let y: Vec<f32> = (0..rows * 2).map(|i| if i % 7 == 3 { f32::NAN } else { (i % 2) as f32 }).collect();
        let w: Vec<f32> = (0..rows).map(|i| 0.5 + i as f32 / 10.0).collect();
        for simd in [Simd::Auto, Simd::Portable] {
            let mut seed = vec![9.0f32; rows * 3];
            let mut losses = vec![1.0f64; rows];
            let column = Column { x: &x[1..], y: &y[1..], seed: &mut seed[1..], strides: (3, 2) };
            let scale = Scale { task_weight: 2.0, weights: Some(&w), inv_b: 1.0 / 64.0 };
            add_column(simd, column, scale, &mut losses);
            for r in 0..rows {
                let (xr, yr) = (f64::from(x[1 + 3 * r]), f64::from(y[1 + 2 * r]));
                if yr.is_nan() {
                    assert_eq!((losses[r], seed[1 + 3 * r]), (1.0, 9.0), "row {r} is masked");
                    continue;
                }
                let (l, p) = loss_and_sigmoid(xr, yr);
                let wr = f64::from(w[r]);
                assert_eq!(losses[r], 1.0 + 2.0 * wr * l, "row {r}'s loss");
                assert_eq!(seed[1 + 3 * r], ((p - yr) * 2.0 * (wr / 64.0)) as f32, "row {r}'s seed");
            }
        }
    }
}
