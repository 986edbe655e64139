//! `model.activation` other than ReLU (which the MLP's passes fuse): what
//! an activated layer applies to its (normalized) pre-activation z, on the
//! fused CPU step and from candle's ops (the same values, tested). The
//! backward pass reads the z the forward pass kept. Sums over rows (the
//! slopes' gradients) are taken in blocks of fixed rows, added in order:
//! the same bits on any number of threads.

use candle_core::Tensor;
use rayon::prelude::*;
use sparrow_core::config::Activation;
use sparrow_core::simd::Simd;

use crate::ModelError;
use crate::meet::Side;

mod dice;

/// Rows an elementwise pass gives each task.
const ROWS_PER_TASK: usize = 128;

/// The learned values of an activated layer of `fan_out` outputs, as they
/// start: PReLU's slope (0.25, PyTorch's), Dice's α per output (0).
pub(crate) fn learned(activation: Activation, fan_out: usize) -> Vec<f32> {
    match activation {
        Activation::Prelu => vec![0.25],
        Activation::Dice => vec![0.0; fan_out],
        Activation::Relu | Activation::Gelu | Activation::Silu => Vec::new(),
    }
}

/// What one layer's activation keeps for the backward pass.
#[derive(Default)]
pub(crate) struct ActScratch {
    /// z.
    pre: Vec<f32>,
    /// Dice: ẑ, the columns' 1/σ̂, and p = σ(ẑ).
    xhat: Vec<f32>,
    inv: Vec<f32>,
    p: Vec<f32>,
    /// Dice's backward: the gradient through p.
    through_p: Vec<f32>,
    /// Whether Dice normalized by the batch (training).
    by_batch: bool,
}

/// Dice's normalization: by the batch while training (its mean and
/// unbiased variance written to the first, `[mean | var]`), else by the
/// running statistics in the second.
pub(crate) enum DiceStats<'a> {
    Batch(&'a mut [f32]),
    Running(&'a [f32]),
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Φ(z), the standard normal's distribution function.
fn normal_cdf(z: f32) -> f32 {
    0.5 * (1.0 + candle_core::cpu::erf::erf_f32(z * std::f32::consts::FRAC_1_SQRT_2))
}

/// φ(z), its density.
fn normal_pdf(z: f32) -> f32 {
    (-0.5 * z * z).exp() * 0.398_942_3
}

/// `f` over blocks of rows of `a` and `b` side by side.
fn blocks<'a>(
    a: &'a mut [f32],
    b: &'a [f32],
    width: usize,
) -> impl IndexedParallelIterator<Item = (&'a mut [f32], &'a [f32])> {
    let block = width.max(1) * ROWS_PER_TASK;
    a.par_chunks_mut(block).zip(b.par_chunks(block))
}

/// y from z = `out` (rows × `width`) in place; z (and Dice's ẑ and p) kept
/// in `s`. `learned`: the layer's slopes; `stats`: Dice's normalization,
/// whose batch statistics on a half of a batch (`meet`) meet the other
/// half's, as batch norm's do.
pub(crate) async fn forward(
    (activation, simd): (Activation, Simd),
    out: &mut [f32],
    width: usize,
    learned: &[f32],
    (stats, meet): (Option<DiceStats<'_>>, Option<Side<'_>>),
    s: &mut ActScratch,
) -> Result<(), ModelError> {
    s.pre.clear();
    s.pre.extend_from_slice(out);
    match activation {
        Activation::Relu => out.par_iter_mut().for_each(|v| *v = v.max(0.0)),
        Activation::Prelu => {
            let a = learned[0];
            out.par_iter_mut().for_each(|v| *v = if *v > 0.0 { *v } else { a * *v });
        }
        Activation::Gelu => out.par_iter_mut().for_each(|v| *v *= normal_cdf(*v)),
        Activation::Silu => out.par_iter_mut().for_each(|v| *v *= sigmoid(*v)),
        Activation::Dice => dice_forward(simd, out, width, learned, (stats, meet), s).await?,
    }
    Ok(())
}

async fn dice_forward(
    simd: Simd,
    out: &mut [f32],
    width: usize,
    alpha: &[f32],
    (stats, meet): (Option<DiceStats<'_>>, Option<Side<'_>>),
    s: &mut ActScratch,
) -> Result<(), ModelError> {
    let (ones, zeros) = (vec![1.0f32; width], vec![0.0f32; width]);
    s.p.clear();
    s.p.extend_from_slice(out);
    let kept = (&mut s.xhat, &mut s.inv);
    s.by_batch = matches!(stats, Some(DiceStats::Batch(_)));
    match stats {
        Some(DiceStats::Batch(batch)) => {
            let normed = (&mut s.p[..], width, false);
            crate::batch_norm::forward_train_met(simd, normed, (&ones, &zeros), kept, (batch, meet)).await?;
        }
        Some(DiceStats::Running(r)) => {
            let running = (&r[..width], &r[width..]);
            crate::batch_norm::forward_running(simd, (&mut s.p, width, false), (&ones, &zeros), kept, running);
        }
        None => {}
    }
    dice::gate(simd, out, &mut s.p, width, alpha);
    Ok(())
}

/// From `g` = d loss / d y (replaced by d loss / d z): adds the slopes'
/// gradients into `dlearned`; Dice's sums over the batch meet the other
/// half's on a half of a batch (`meet`).
pub(crate) async fn backward(
    (activation, simd): (Activation, Simd),
    g: &mut [f32],
    width: usize,
    learned: &[f32],
    (s, meet): (&mut ActScratch, Option<Side<'_>>),
    dlearned: &mut [f32],
) -> Result<(), ModelError> {
    match activation {
        Activation::Relu => blocks(g, &s.pre, width).for_each(|(g, z)| {
            g.iter_mut().zip(z).for_each(|(g, &z)| *g = if z > 0.0 { *g } else { 0.0 });
        }),
        Activation::Prelu => {
            let a = learned[0];
            let partial: Vec<f32> = blocks(g, &s.pre, width)
                .map(|(g, z)| {
                    let mut da = 0.0f32;
                    for (g, &z) in g.iter_mut().zip(z) {
                        if z <= 0.0 {
                            da += *g * z;
                            *g *= a;
                        }
                    }
                    da
                })
                .collect();
            dlearned[0] += partial.iter().sum::<f32>();
        }
        Activation::Gelu => blocks(g, &s.pre, width).for_each(|(g, z)| {
            g.iter_mut().zip(z).for_each(|(g, &z)| *g *= normal_cdf(z) + z * normal_pdf(z));
        }),
        Activation::Silu => blocks(g, &s.pre, width).for_each(|(g, z)| {
            g.iter_mut().zip(z).for_each(|(g, &z)| {
                let p = sigmoid(z);
                *g *= p * (1.0 + z * (1.0 - p));
            });
        }),
        Activation::Dice => dice_backward(simd, (g, width), learned, (s, meet), dlearned).await?,
    }
    Ok(())
}

/// y = z·(α + (1 − α)·p), p = σ(ẑ): d z = g·(α + (1 − α)·p) plus, through
/// ẑ's normalization, the adjoint of h = g·z·(1 − α)·p·(1 − p); d α = Σ g·z·(1 − p).
async fn dice_backward(
    simd: Simd,
    (g, width): (&mut [f32], usize),
    alpha: &[f32],
    (s, meet): (&mut ActScratch, Option<Side<'_>>),
    dalpha: &mut [f32],
) -> Result<(), ModelError> {
    let rows = g.len() / width.max(1);
    s.through_p.resize(g.len(), 0.0);
    dice::through_gate(simd, (g, &mut s.through_p), (&s.pre, &s.p), width, (alpha, dalpha));
    let (ones, mut unused) = (vec![1.0f32; width], vec![0.0f32; 2 * width]);
    let (dg, db) = unused.split_at_mut(width);
    let (normed, by_batch) = ((&s.xhat[..], &s.inv[..]), s.by_batch);
    crate::batch_norm::backward_met(simd, (&mut s.through_p, width), &ones, normed, (dg, db), (by_batch, meet)).await?;
    debug_assert_eq!(s.through_p.len(), rows * width);
    dice::add(g, &s.through_p, width);
    Ok(())
}

/// The same function from candle's ops: `learned` the layer's slopes (a
/// slice of the flat parameters), `xhat` Dice's normalized z.
pub(crate) fn ops(
    activation: Activation,
    z: &Tensor,
    learned: Option<&Tensor>,
    xhat: Option<&Tensor>,
) -> Result<Tensor, ModelError> {
    let missing = |what: &str| ModelError::Candle(candle_core::Error::Msg(format!("{activation:?}: no {what}")));
    let learned = || learned.ok_or_else(|| missing("learned values"));
    Ok(match activation {
        Activation::Relu => z.relu()?,
        Activation::Prelu => {
            let positive = z.relu()?;
            (&positive + (z - &positive)?.broadcast_mul(learned()?)?)?
        }
        Activation::Gelu => z.gelu_erf()?,
        Activation::Silu => {
            let p = (z.neg()?.exp()? + 1.0)?.recip()?;
            (z * p)?
        }
        Activation::Dice => {
            let xhat = xhat.ok_or_else(|| missing("ẑ"))?;
            // The direct pass's exponential (`dice.rs`), so both give one sigmoid.
            let p = (xhat.neg()?.contiguous()?.apply_op1(crate::exp::Exp)? + 1.0)?.recip()?;
            // α + (1 − α)·p = p + α·(1 − p)
            let gate = (&p + (p.ones_like()? - &p)?.broadcast_mul(learned()?)?)?;
            (z * gate)?
        }
    })
}
