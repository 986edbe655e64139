//! Multi-layer perceptrons: `relu(x·W₁ + b₁) → … → x·W_L + b_L`.
//!
//! On CPU the whole stack is one candle op ([`FusedMlp`]): the forward pass
//! calls gemm directly and adds bias + ReLU in the same pass; the backward pass
//! is written out by hand (two gemms, a ReLU mask and a column sum per layer).
//! Built from candle's own ops, the same stack spent more time allocating,
//! zero-filling and accumulating intermediate gradients than in its matmuls.
//! Other devices use the layer-by-layer candle path ([`Mlp::forward_ops`]),
//! which gives the same values (tested), so callers never branch on the device.

mod amx_kept;
pub(crate) mod first_product;
mod linear;
mod met;
mod precision;
mod relu;
mod scratch;

pub(crate) use first_product::First;
use first_product::{FirstGrad, next_dw_in_pass, outer_to_first};
use linear::weight_grads;
pub(crate) use linear::{linear_grads, matmul};
pub use precision::matmul_in;
pub(crate) use relu::through_relu;
use relu::{add_bias, relu_mask, relu_mask_from};
pub use scratch::MlpScratch;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor, Var};
use rayon::prelude::*;

use sparrow_core::config::{Activation, ModelConfig, Norm};

use crate::bf16::Arith;
use crate::dropout::Dropout;

use crate::ModelError;
pub use crate::matrix::{Operand, sgemm, sgemm_threads};
use crate::meet::Side;
use crate::params::{BatchValue, ParamStore};

/// Where each layer's weights live in the flat parameter vector.
#[derive(Clone, Debug)]
struct LayerSlot {
    fan_in: usize,
    fan_out: usize,
    /// `W` is `[fan_in, fan_out]` row-major at `w`, `b` is `[fan_out]` at `b`.
    w: usize,
    b: usize,
    relu: bool,
    /// `model.norm`: γ at this offset, β after it (`fan_out` each).
    norm: Option<usize>,
    /// `model.norm = "batch"`: the running mean at this offset of the
    /// stack's running statistics, the running variance after it.
    running: Option<usize>,
    /// The activation's learned values (PReLU's slope, Dice's α) at this offset.
    act: Option<usize>,
    /// Dice: its running mean and variance at this offset of the running statistics.
    dice_running: Option<usize>,
    /// How its products run: the stack's, but fp32 for a layer of at most
    /// [`NARROW_OUTPUTS`] outputs after the first (a task's head).
    arith: Arith,
}

/// A layer after a stack's first with at most this many outputs (a task's
/// head: one logit, or a few classes') takes its products in fp32 whatever
/// `model.precision` says, as the gates do (`kinds/multitask.rs`): at that
/// width a bf16 product packs both operands to pairs for a handful of
/// dots, and ran slower than fp32's (ESMM's heads, `[512, 32]·[32, 1]`,
/// its dW and d x: 13.9% of a half's time in bf16, docs/benchmarks.md).
/// A stack's first layer keeps the stack's: a kind's own first products
/// (`first_product.rs`) read the input in its precision.
const NARROW_OUTPUTS: usize = 4;

#[derive(Debug)]
struct MlpShape {
    layers: Vec<LayerSlot>,
    num_params: usize,
    arith: Arith,
    /// `model.dropout` after each activated layer (off: rate 0).
    dropout: Dropout,
    /// What normalizes the layers with a `norm` (`layer` or `batch`).
    norm: Norm,
    /// What every activated layer applies after its norm.
    activation: Activation,
    /// The kernels `train.simd` allows the elementwise passes (dropout's
    /// masks, batch norm, bias gradients).
    simd: sparrow_core::simd::Simd,
}

impl MlpShape {
    /// Whether the last layer ends in a ReLU, which the backward pass
    /// applies to d loss / d output as it takes it in.
    fn masks_output(&self) -> bool {
        self.layers.last().is_some_and(|l| l.relu && self.activation == Activation::Relu)
    }
}

/// How an MLP stack's activated layers are built: their norm
/// (`model.norm`) and activation (`model.activation`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StackStyle {
    pub norm: Norm,
    /// Running statistics' momentum (`model.batch_norm_momentum`; batch norm and Dice).
    pub momentum: f32,
    pub activation: Activation,
}

impl StackStyle {
    /// No norm, ReLU.
    pub const PLAIN: StackStyle = StackStyle { norm: Norm::None, momentum: 0.1, activation: Activation::Relu };

    /// The model's MLP stacks' with `norm`, `model.norm` as the kind
    /// resolves it (`kinds::stack_style`).
    pub fn with(config: &ModelConfig, norm: Norm) -> StackStyle {
        StackStyle { norm, momentum: config.batch_norm_momentum, activation: config.activation }
    }

    /// DIN's local activation unit's: no norm, `model.attention_activation`.
    pub fn attention(config: &ModelConfig) -> StackStyle {
        StackStyle { activation: config.attention_activation, ..StackStyle::with(config, Norm::None) }
    }
}

/// An MLP whose weights are one flat variable (one gradient, one optimizer pass).
pub struct Mlp {
    shape: Arc<MlpShape>,
    params: Var,
    /// `model.norm = "batch"`: the running statistics (`[mean | var]` of
    /// each normalized layer) and where a training pass leaves its batch's.
    running: Option<(Var, BatchValue)>,
}

impl Mlp {
    /// Layers `input → sizes[0] → … → sizes[n-1]`, ReLU between them and, if
    /// `relu_last`, after the last. Weights and biases are drawn from
    /// U(±1/√fan_in), PyTorch's default for `Linear`.
    pub fn new(
        ps: &mut ParamStore,
        name: &str,
        input: usize,
        sizes: &[usize],
        relu_last: bool,
        arith: Arith,
    ) -> Result<Mlp, ModelError> {
        Mlp::new_normed(ps, name, input, sizes, relu_last, arith, StackStyle::PLAIN)
    }

    /// [`new`](Self::new), each activated layer's pre-activation normalized
    /// as `style.norm` says (`layer_norm.rs`, `batch_norm.rs`): γ = 1 and β = 0
    /// after the layer's bias (no draw: the other weights stay as they
    /// are); with batch norm, the running statistics (mean 0, variance 1)
    /// in a variable of their own, `<name>.running`, after the parameters;
    /// each activated layer applies `style.activation` (its learned values
    /// after γ and β, Dice's running statistics after batch norm's).
    pub fn new_normed(
        ps: &mut ParamStore,
        name: &str,
        input: usize,
        sizes: &[usize],
        relu_last: bool,
        arith: Arith,
        style: StackStyle,
    ) -> Result<Mlp, ModelError> {
        let mut layers = Vec::with_capacity(sizes.len());
        let mut data = Vec::new();
        let mut running = Vec::new();
        let mut fan_in = input;
        for (i, &fan_out) in sizes.iter().enumerate() {
            let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
            let w = data.len();
            data.extend(ps.draw_uniform(fan_in * fan_out, bound));
            let b = data.len();
            data.extend(ps.draw_uniform(fan_out, bound));
            // The backward pass splits [W | b] of a layer as one slice.
            debug_assert_eq!(b, w + fan_in * fan_out);
            let relu = i + 1 < sizes.len() || relu_last;
            let gamma_beta = || std::iter::repeat_n(1.0f32, fan_out).chain(std::iter::repeat_n(0.0, fan_out));
            let normed = style.norm != Norm::None && relu;
            let norm_at = normed.then(|| {
                let at = data.len();
                data.extend(gamma_beta());
                at
            });
            // A running mean of 0 and variance of 1: γ and β's pattern.
            let mut keep_running = |keep: bool| {
                keep.then(|| {
                    let at = running.len();
                    running.extend(std::iter::repeat_n(0.0f32, fan_out).chain(std::iter::repeat_n(1.0, fan_out)));
                    at
                })
            };
            let running_at = keep_running(normed && style.norm == Norm::Batch);
            let dice_running = keep_running(relu && style.activation == Activation::Dice);
            let learned = crate::activation::learned(style.activation, fan_out);
            let act = (relu && !learned.is_empty()).then(|| {
                let at = data.len();
                data.extend(learned);
                at
            });
            let norm = norm_at;
            let arith = if i > 0 && fan_out <= NARROW_OUTPUTS { arith.in_f32() } else { arith };
            layers.push(LayerSlot { fan_in, fan_out, w, b, relu, norm, running: running_at, act, dice_running, arith });
            fan_in = fan_out;
        }
        let num_params = data.len();
        let params = ps.push(format!("{name}.params"), data, &[num_params])?;
        let running = if running.is_empty() {
            None
        } else {
            Some(ps.statistic(format!("{name}.running"), running, style.momentum)?)
        };
        let dropout = Dropout::new(0.0, name);
        let (norm, activation) = (style.norm, style.activation);
        let simd = sparrow_core::simd::Simd::Auto;
        let shape = MlpShape { layers, num_params, arith, dropout, norm, activation, simd };
        Ok(Mlp { shape: Arc::new(shape), params, running })
    }

    /// With inverted dropout at `rate` after each activated layer, where a
    /// step draws it (training; see `dropout.rs`), its masks drawn (and the
    /// stack's other elementwise passes run) by the kernels `simd` allows.
    pub fn with_dropout(self, rate: f32, simd: sparrow_core::simd::Simd) -> Mlp {
        let s = &self.shape;
        let dropout = s.dropout.with_rate(rate, simd);
        let (layers, num_params) = (s.layers.clone(), s.num_params);
        let (arith, norm, activation) = (s.arith, s.norm, s.activation);
        let shape = MlpShape { layers, num_params, arith, dropout, norm, activation, simd };
        Mlp { shape: Arc::new(shape), params: self.params, running: self.running }
    }

    /// The running statistics' values (empty without batch norm).
    fn running_values(&self) -> Result<Vec<f32>, ModelError> {
        match &self.running {
            Some((var, _)) => Ok(var.as_tensor().to_vec1::<f32>()?),
            None => Ok(Vec::new()),
        }
    }

    /// Hands a training pass's batch statistics on (see
    /// `ParamStore::statistic`); a batch of no rows has none.
    fn hand_on(&self, draw: Option<u64>, rows: usize, batch: &[f32]) -> Result<(), ModelError> {
        if let (Some((_, slot)), Some(_), true) = (&self.running, draw, rows > 0) {
            *slot.lock().map_err(|_| ModelError::Poisoned)? = Some(batch.to_vec());
        }
        Ok(())
    }

    /// Its layers' weights, in order, for an exporter.
    pub fn layers(&self) -> Result<Vec<crate::spec::DenseLayer>, ModelError> {
        let p = self.params.as_tensor().to_vec1::<f32>()?;
        let running = self.running_values()?;
        Ok(self
            .shape
            .layers
            .iter()
            .map(|l| crate::spec::DenseLayer {
                fan_in: l.fan_in,
                fan_out: l.fan_out,
                weight: p[l.w..l.w + l.fan_in * l.fan_out].to_vec(),
                bias: p[l.b..l.b + l.fan_out].to_vec(),
                activation: l.relu.then(|| self.activation_spec(l, &p, &running)),
                norm: l.norm.map(|n| crate::spec::NormSpec {
                    gamma: p[n..n + l.fan_out].to_vec(),
                    beta: p[n + l.fan_out..n + 2 * l.fan_out].to_vec(),
                    eps: crate::layer_norm::EPS,
                    running: l.running.map(|r| crate::spec::RunningStats {
                        mean: running[r..r + l.fan_out].to_vec(),
                        var: running[r + l.fan_out..r + 2 * l.fan_out].to_vec(),
                    }),
                }),
            })
            .collect())
    }

    fn activation_spec(&self, l: &LayerSlot, p: &[f32], running: &[f32]) -> crate::spec::ActivationSpec {
        use crate::spec::ActivationSpec;
        let fo = l.fan_out;
        match (self.shape.activation, l.act, l.dice_running) {
            (Activation::Prelu, Some(a), _) => ActivationSpec::Prelu { slope: p[a] },
            (Activation::Dice, Some(a), Some(r)) => ActivationSpec::Dice {
                alpha: p[a..a + fo].to_vec(),
                mean: running[r..r + fo].to_vec(),
                var: running[r + fo..r + 2 * fo].to_vec(),
                eps: crate::batch_norm::EPS,
            },
            (Activation::Gelu, ..) => ActivationSpec::Gelu,
            (Activation::Silu, ..) => ActivationSpec::Silu,
            _ => ActivationSpec::Relu,
        }
    }

    /// Its output on `x: [rows, in]`; `draw`: a training step's dropout
    /// draw (`None`: outside training, so no dropout, and batch norm by the
    /// running statistics).
    pub fn forward(&self, x: &Tensor, draw: Option<u64>) -> Result<Tensor, ModelError> {
        if x.device().is_cpu() && x.dtype() == DType::F32 {
            let op = FusedMlp {
                shape: self.shape.clone(),
                draw,
                scratch: Mutex::new(MlpScratch::default()),
                running: if draw.is_some() { Vec::new() } else { self.running_values()? },
                batch: self.running.as_ref().filter(|_| draw.is_some()).map(|(_, slot)| slot.clone()),
            };
            Ok(x.contiguous()?.apply_op2(self.params.as_tensor(), op)?)
        } else {
            self.forward_ops(x, draw)
        }
    }

    /// The same function from candle's ops, layer by layer (any device).
    pub fn forward_ops(&self, x: &Tensor, draw: Option<u64>) -> Result<Tensor, ModelError> {
        let p = self.params.as_tensor();
        let mut h = x.clone();
        let mut batch_stats: Option<Vec<f32>> = None;
        for (i, l) in self.shape.layers.iter().enumerate() {
            let w = p.narrow(0, l.w, l.fan_in * l.fan_out)?.reshape((l.fan_in, l.fan_out))?;
            let b = p.narrow(0, l.b, l.fan_out)?;
            // The batch's mean takes b out again: a training batch norm
            // leaves it out, so b gets no gradient here either (see
            // `backward_into`), and adds it to the mean it hands on.
            let by_batch = l.running.is_some() && draw.is_some();
            h = h.matmul(&w)?;
            if !by_batch {
                h = h.broadcast_add(&b)?;
            }
            if let Some(n) = l.norm {
                let (gamma, beta) = (p.narrow(0, n, l.fan_out)?, p.narrow(0, n + l.fan_out, l.fan_out)?);
                let (centred, inv) = match l.running {
                    Some(r) => self.batch_normalized_ops(&h, (r, l.fan_out), draw, Some(&b), &mut batch_stats)?,
                    None => {
                        let centred = h.broadcast_sub(&h.mean_keepdim(1)?)?;
                        let eps = f64::from(crate::layer_norm::EPS);
                        let inv = (centred.sqr()?.mean_keepdim(1)? + eps)?.sqrt()?.recip()?;
                        (centred, inv)
                    }
                };
                h = centred.broadcast_mul(&inv)?.broadcast_mul(&gamma)?.broadcast_add(&beta)?;
            }
            if l.relu {
                let learned = match (self.shape.activation, l.act) {
                    (Activation::Prelu, Some(a)) => Some(p.narrow(0, a, 1)?),
                    (Activation::Dice, Some(a)) => Some(p.narrow(0, a, l.fan_out)?),
                    _ => None,
                };
                let xhat = match l.dice_running {
                    Some(r) => {
                        let (centred, inv) =
                            self.batch_normalized_ops(&h, (r, l.fan_out), draw, None, &mut batch_stats)?;
                        Some(centred.broadcast_mul(&inv)?)
                    }
                    None => None,
                };
                h = crate::activation::ops(self.shape.activation, &h, learned.as_ref(), xhat.as_ref())?;
                if draw.is_some() && self.shape.dropout.is_on() {
                    // The same draws as the fused step: its mask on ones.
                    let mut mask = vec![1.0f32; h.elem_count()];
                    self.shape.dropout.apply(draw, i, 0, &mut mask);
                    let mask = Tensor::from_vec(mask, h.shape(), h.device())?;
                    h = (h * mask)?;
                }
            }
        }
        if let Some(stats) = batch_stats {
            self.hand_on(draw, x.dims()[0], &stats)?;
        }
        Ok(h)
    }

    /// `h` (`[rows, fo]`) centred and each column's 1/√(var + ε): by the
    /// batch in training (its mean, plus `offset`, and unbiased variance go
    /// into `stats` at `r`, laid out as the running statistics), else by
    /// the running statistics at `r`.
    fn batch_normalized_ops(
        &self,
        h: &Tensor,
        (r, fo): (usize, usize),
        draw: Option<u64>,
        offset: Option<&Tensor>,
        stats: &mut Option<Vec<f32>>,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let eps = f64::from(crate::batch_norm::EPS);
        let Some((running, _)) = &self.running else {
            return Err(ModelError::Candle(err("batch statistics without running ones")));
        };
        if draw.is_none() {
            let running = running.as_tensor();
            let (mean, var) = (running.narrow(0, r, fo)?, running.narrow(0, r + fo, fo)?);
            return Ok((h.broadcast_sub(&mean)?, (var + eps)?.sqrt()?.recip()?));
        }
        let centred = h.broadcast_sub(&h.mean_keepdim(0)?)?;
        let var = centred.sqr()?.mean_keepdim(0)?;
        let rows = h.dims()[0];
        let unbiased = (&var * (rows as f64 / rows.saturating_sub(1).max(1) as f64))?;
        let values = stats.get_or_insert_with(|| vec![0.0; running.elem_count()]);
        let mean = match offset {
            Some(b) => (h.mean(0)? + b)?,
            None => h.mean(0)?,
        };
        values[r..r + fo].copy_from_slice(&mean.to_vec1::<f32>()?);
        values[r + fo..r + 2 * fo].copy_from_slice(&unbiased.flatten_all()?.to_vec1::<f32>()?);
        Ok((centred, (var + eps)?.sqrt()?.recip()?))
    }

    pub fn params(&self) -> &Var {
        &self.params
    }

    /// Values its output layer writes a row.
    pub fn outputs(&self) -> usize {
        self.shape.layers.last().map_or(0, |l| l.fan_out)
    }
}

/// The CPU op: inputs `x: [rows, in]` and the flat parameters.
struct FusedMlp {
    shape: Arc<MlpShape>,
    /// The step's dropout draw.
    draw: Option<u64>,
    /// The forward pass's buffers, kept for the backward pass.
    scratch: Mutex<MlpScratch>,
    /// Outside training: the running statistics (batch norm).
    running: Vec<f32>,
    /// Training with batch norm: where the batch's statistics go.
    batch: Option<BatchValue>,
}

pub(crate) fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("fused-mlp: {}", msg.into()))
}

pub(crate) fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| err("input must be contiguous"))?;
    Ok(&s.as_slice::<f32>()?[start..end])
}

pub(crate) fn cpu<'a>(s: &'a Storage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match s {
        Storage::Cpu(c) => contiguous(c, l),
        _ => Err(err("runs on CPU only")),
    }
}

/// Rows an elementwise pass gives each task: both cores take part (a pass
/// on one thread left the other waiting), in blocks large enough to
/// amortise the hand-off.
const ROWS_PER_TASK: usize = 128;

/// Whether a bf16 MLP runs the fp32 kernels on operands it rounds itself
/// (once a step each, see `bf16_rounded`).
fn rounds_operands(arith: Arith) -> bool {
    matches!(arith, Arith::Bf16(crate::bf16::Bf16Path::Rounded(_)))
}

/// `buf` with exactly `n` elements; only newly grown elements are written.
pub(crate) fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    buf.resize(n, 0.0);
    buf
}

/// The first `n` elements of `buf`, grown (zero-filled) only if it is
/// shorter: a longer buffer keeps its length and its tail.
fn prefix(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// Forward pass into `scratch`, training where `draw` is a step's (with
/// dropout, and batch norm by the batch: its statistics in
/// `scratch.batch_stats`), else batch norm by `running`.
async fn forward_into(
    shape: &MlpShape,
    (p, running): (&[f32], &[f32]),
    mut x: First<'_>,
    (rows, first_row): (usize, usize),
    (draw, meet): (Option<u64>, Option<Side<'_>>),
    scratch: &mut MlpScratch,
) -> Result<(), ModelError> {
    let layers = &shape.layers;
    let running_len = layers.iter().map(|l| 2 * l.fan_out * (l.running.iter().count() + l.dice_running.iter().count()));
    scratch.batch_stats.resize(running_len.sum(), 0.0);
    scratch.trained = draw.is_some();
    scratch.draw = draw;
    scratch.first_row = first_row;
    scratch.acts.resize_with(layers.len(), Default::default);
    scratch.hidden.resize_with(layers.len().saturating_sub(1), Vec::new);
    scratch.rows = rows;
    scratch.dropout_scale = 1.0;
    scratch.normed.resize_with(layers.len(), Vec::new);
    scratch.inv_std.resize_with(layers.len(), Vec::new);
    scratch.tiles.plan(shape, &x, rows);
    let laid = x.laid();
    for (i, l) in layers.iter().enumerate() {
        let w = &p[l.w..l.w + l.fan_in * l.fan_out];
        let (done, rest) = scratch.hidden.split_at_mut(i.min(layers.len() - 1));
        let input: &[f32] = if i == 0 { laid } else { &done[i - 1] };
        // gemm overwrites every element of `out`, stale values included.
        let out = if i + 1 < layers.len() {
            sized(&mut rest[0], rows * l.fan_out)
        } else {
            sized(&mut scratch.output, rows * l.fan_out)
        };
        let bias = &p[l.b..l.b + l.fan_out];
        // A normalized layer's activation comes after its norm; a ReLU
        // without one is fused with the bias.
        let relu = l.relu && l.norm.is_none() && shape.activation == Activation::Relu;
        if let (0, First::Product(first)) = (i, &mut x) {
            first.forward(w, rows, l.fan_out, (bias, relu), out);
        } else if scratch.tiles.forward(i, (rows, l.fan_in, l.fan_out), input, w, (bias, relu), out) {
            // Its output is in `out`, or kept as tiles only.
        } else if rounds_operands(l.arith) {
            scratch.rounded.forward(l.arith.simd(), i, (rows, l.fan_in, l.fan_out), input, w, out);
            add_bias(shape.simd, out, bias, relu);
        } else {
            let (input, w) = (Operand::plain(input), Operand::plain(w));
            match l.arith {
                // Bias and ReLU as the product stores each tile.
                Arith::Bf16(path) => {
                    let epilogue = crate::bf16::Epilogue { bias: Some(bias), relu };
                    let packed = x.packed().filter(|_| i == 0);
                    crate::bf16::gemm_bf16_lent(path, (rows, l.fan_out, l.fan_in), (input, packed), w, out, epilogue);
                }
                Arith::F32(simd) => {
                    // The narrow kernel adds the bias as it stores.
                    let dims = (rows, l.fan_out, l.fan_in);
                    if !crate::matrix::sgemm_with_bias(simd, dims, (input.data, w.data), out, (bias, relu)) {
                        sgemm(simd, rows, l.fan_out, l.fan_in, input, w, out);
                        add_bias(shape.simd, out, bias, relu);
                    }
                }
            }
        }
        if let Some(n) = l.norm {
            let (fo, gb) = (l.fan_out, (&p[n..n + l.fan_out], &p[n + l.fan_out..n + 2 * l.fan_out]));
            let kept = (&mut scratch.normed[i], &mut scratch.inv_std[i]);
            // Batch norm takes the ReLU in its last pass.
            let relu = l.relu && shape.activation == Activation::Relu;
            let simd = shape.simd;
            match l.running {
                Some(r) if draw.is_some() => {
                    let stats = &mut scratch.batch_stats[r..r + 2 * fo];
                    crate::batch_norm::forward_train_met(simd, (out, fo, relu), gb, kept, (stats, meet)).await?;
                }
                Some(r) => {
                    let stats = (&running[r..r + fo], &running[r + fo..r + 2 * fo]);
                    crate::batch_norm::forward_running(simd, (out, fo, relu), gb, kept, stats);
                }
                None => {
                    crate::layer_norm::forward(out, fo, gb, kept.0, kept.1);
                    if relu {
                        out.par_chunks_mut(l.fan_out.max(1) * ROWS_PER_TASK)
                            .for_each(|o| o.iter_mut().for_each(|v| *v = if *v > 0.0 { *v } else { 0.0 }));
                    }
                }
            }
        }
        if l.relu && shape.activation != Activation::Relu {
            use crate::activation::DiceStats;
            let (fo, learned) = (l.fan_out, l.act.map_or(&[][..], |a| &p[a..]));
            let stats = l.dice_running.map(|r| match draw {
                Some(_) => DiceStats::Batch(&mut scratch.batch_stats[r..r + 2 * fo]),
                None => DiceStats::Running(&running[r..r + 2 * fo]),
            });
            let act = (shape.activation, shape.simd);
            crate::activation::forward(act, out, fo, learned, (stats, meet), &mut scratch.acts[i]).await?;
        }
        if l.relu {
            scratch.dropout_scale = shape.dropout.apply(draw, i, first_row * l.fan_out, out);
        }
    }
    Ok(())
}

/// Backward pass from `grad_out` (d loss / d output; `premasked`: already
/// through the last layer's ReLU, see [`Mlp::output_mask`]): d params is
/// returned, d x is left in `scratch.grad_input`.
async fn backward_into(
    shape: &MlpShape,
    p: &[f32],
    mut x: First<'_>,
    (grad_out, premasked): (&[f32], bool),
    (scratch, meet): (&mut MlpScratch, Option<Side<'_>>),
) -> Result<Vec<f32>, ModelError> {
    let layers = &shape.layers;
    let rows = scratch.rows;
    // `g[..g_len]` is the gradient at the current layer's output, first
    // through its ReLU. The two buffers take turns and keep their longest
    // length: cut to each layer's size, the one regrown to the next size
    // was zero-filled every step (2 MB at batch 1024, 2% of the f32 step).
    let mut g = std::mem::take(&mut scratch.grad_input);
    let mut g_len = grad_out.len();
    let scale = scratch.dropout_scale;
    // A ReLU on the last layer masks the gradient as it is copied in (one
    // pass over it, not two: an expert's output gradient is 256 KB at
    // batch 1024, read back from beyond L2).
    let masked_in = shape.masks_output();
    // A gradient the caller masked is only read by the top layer's
    // products (no norm changes it, and a first layer's product does not
    // take it as its own buffer): they read it where it is (copying an
    // expert's 256 KB was 2.6% of MMoE's step).
    let top = layers.len().saturating_sub(1);
    let read_in_place = masked_in
        && premasked
        && layers.last().is_some_and(|l| l.norm.is_none())
        && !(top == 0 && matches!(x, First::Product(_)));
    if masked_in && !premasked {
        let width = layers.last().map_or(1, |l| l.fan_out);
        relu_mask_from(shape.simd, prefix(&mut g, g_len), grad_out, &scratch.output, width, scale);
    } else if !read_in_place {
        prefix(&mut g, g_len).copy_from_slice(grad_out);
    }
    // db is summed into, so zeroed; dW is overwritten by its product, so a
    // reused buffer's stale values stay until then (zeroing all of it was a
    // memset of every weight each step). No rows: no product writes dW.
    let mut grad_p = std::mem::take(&mut scratch.spare_grad);
    if rows == 0 {
        grad_p.clear();
    }
    grad_p.resize(shape.num_params, 0.0);
    for l in layers {
        grad_p[l.b..l.b + l.fan_out].fill(0.0);
        if let Some(n) = l.norm {
            grad_p[n..n + 2 * l.fan_out].fill(0.0);
        }
        if let Some(a) = l.act {
            grad_p[a..a + crate::activation::learned(shape.activation, l.fan_out).len()].fill(0.0);
        }
    }
    let mut g_in = std::mem::take(&mut scratch.grad_next);
    let laid = x.laid();
    let outer_to_first = outer_to_first(shape, &x, rows);
    let next_dw_in_pass = next_dw_in_pass(shape, &x, outer_to_first);
    for (i, l) in layers.iter().enumerate().rev() {
        let input: &[f32] = if i == 0 { laid } else { &scratch.hidden[i - 1] };
        let (fi, fo) = (l.fan_in, l.fan_out);
        let out: &[f32] = if i + 1 == layers.len() { &scratch.output } else { &scratch.hidden[i] };
        let relu_here = l.relu && shape.activation == Activation::Relu && !(masked_in && i + 1 == layers.len());
        // A first layer's product masks by its ReLU as it sums its gradient.
        let relu_in_product = relu_here && i == 0 && l.norm.is_none() && matches!(x, First::Product(_));
        if l.relu {
            // d output → d (activation's input), through dropout's masks.
            if shape.activation == Activation::Relu {
                // A kept output's gradient was masked as it was stored.
                if relu_here && !relu_in_product && !scratch.tiles.kept(i) {
                    relu_mask(shape.simd, &mut g[..g_len], out, fo, scale);
                }
            } else {
                shape.dropout.apply(scratch.draw, i, scratch.first_row * fo, &mut g[..g_len]);
                let (learned, dlearned) = match l.act {
                    Some(a) => (&p[a..], &mut grad_p[a..]),
                    None => (&[][..], &mut [][..]),
                };
                crate::activation::backward(
                    (shape.activation, shape.simd),
                    &mut g[..g_len],
                    fo,
                    learned,
                    (&mut scratch.acts[i], meet),
                    dlearned,
                )
                .await?;
            }
        }
        if let Some(n) = l.norm {
            // d y → d z through the norm; d γ and d β beside.
            let (dgamma, dbeta) = grad_p[n..n + 2 * fo].split_at_mut(fo);
            let norm = (&scratch.normed[i][..], &scratch.inv_std[i][..]);
            if l.running.is_some() {
                let by_batch = scratch.trained;
                crate::batch_norm::backward_met(
                    shape.simd,
                    (&mut g[..g_len], fo),
                    &p[n..n + fo],
                    norm,
                    (dgamma, dbeta),
                    (by_batch, meet),
                )
                .await?;
            } else {
                crate::layer_norm::backward(&mut g[..g_len], fo, &p[n..n + fo], norm, (dgamma, dbeta));
            }
        }
        // W and b are adjacent in the parameter vector (see `Mlp::new`),
        // after the layers before.
        let (before, here) = grad_p.split_at_mut(l.w);
        let (here, after) = here.split_at_mut(l.b + fo - l.w);
        let (dw, db) = here.split_at_mut(fi * fo);
        let w = &p[l.w..l.w + fi * fo];
        let gs: &[f32] = if read_in_place && i == top { grad_out } else { &g[..g_len] };
        if i == 1 && outer_to_first {
            // d input (`g ⊗ w`) is the first layer's product's to compute,
            // and dW too where it sums it in its pass over this input.
            match next_dw_in_pass {
                true => crate::columns::add_column_sums(shape.simd, gs, fo, db),
                false => weight_grads((l.arith, shape.simd), (rows, fi, fo), (input, None), gs, (dw, db)),
            }
            continue;
        }
        let gi = prefix(&mut g_in, rows * fi);
        if let (0, First::Product(first)) = (i, &mut x) {
            let relu = relu_in_product.then_some((out, scale));
            let grad = match outer_to_first {
                true => {
                    let into = prefix(&mut g_in, rows * fo);
                    // The next layer's weights follow this one's (and
                    // any norm's or activation's) in the vector.
                    let next = &layers[1];
                    let next_dw = &mut after[next.w - l.b - fo..next.b - l.b - fo];
                    let next_dw = next_dw_in_pass.then_some((out, next_dw));
                    FirstGrad::Outer { seed: &g[..g_len], w: &p[next.w..next.b], into, next_dw }
                }
                false => FirstGrad::Laid(&mut g[..g_len]),
            };
            first.backward(w, (rows, fo), (grad, relu), (dw, db));
            if outer_to_first {
                // The gradient at the first layer's output is in `g_in`.
                std::mem::swap(&mut g, &mut g_in);
            }
        } else if scratch.tiles.backward(
            (i, shape.simd),
            (rows, fi, fo),
            (input, w, gs),
            (dw, db),
            i.checked_sub(1).map_or(&mut [][..], |b| &mut before[layers[b].b..layers[b].b + layers[b].fan_out]),
            gi,
        ) {
            // d x is in `gi`, or kept as tiles only.
        } else if rounds_operands(l.arith) {
            scratch.rounded.backward(l.arith.simd(), i, (rows, fi, fo), gs, (dw, db), gi);
        } else {
            let input = (input, x.packed().filter(|_| i == 0));
            linear_grads((l.arith, shape.simd), (rows, fi, fo), input, w, gs, (dw, db), gi);
        }
        // A batch norm subtracts the batch's mean, b included: b's gradient
        // is 0, not the rounding noise of Σ d z that Adam would turn into
        // a full step.
        if l.running.is_some() && scratch.trained {
            grad_p[l.b..l.b + fo].fill(0.0);
        }
        std::mem::swap(&mut g, &mut g_in);
        g_len = rows * fi;
    }
    g.truncate(g_len);
    scratch.grad_input = g;
    scratch.grad_next = g_in;
    Ok(grad_p)
}

impl Mlp {
    fn check_input(&self, x_len: usize, rows: usize) -> Result<(), ModelError> {
        let fan_in = self.shape.layers.first().map_or(0, |l| l.fan_in);
        if x_len != rows * fan_in {
            return Err(ModelError::Candle(err(format!("input of {x_len} values is not {rows} rows of {fan_in}"))));
        }
        Ok(())
    }

    /// Forward pass on a CPU slice `x: [rows, in]`, outside candle's graph;
    /// the output is `scratch.output`. `draw`: as for [`forward`](Self::forward).
    pub fn forward_cpu(
        &self,
        x: &[f32],
        rows: usize,
        draw: Option<u64>,
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        self.forward_cpu_at(x, (rows, 0), draw, scratch)
    }

    /// [`forward_cpu`](Self::forward_cpu) on rows that start at row
    /// `first_row` of the batch (a half of it, `models/halves.rs`): dropout
    /// draws each value by its place in the whole batch, so the halves drop
    /// what the whole batch would.
    pub fn forward_cpu_at(
        &self,
        x: &[f32],
        rows: (usize, usize),
        draw: Option<u64>,
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        self.forward_laid_at(First::Input(x), rows, draw, scratch)
    }

    /// [`forward_cpu_at`](Self::forward_cpu_at) on a laid-out input, its
    /// bf16 pairs perhaps packed by the caller ([`First::Packed`]).
    pub(crate) fn forward_laid_at(
        &self,
        x: First<'_>,
        rows: (usize, usize),
        draw: Option<u64>,
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        self.check_input(x.laid().len(), rows.0)?;
        let running = if draw.is_some() { Vec::new() } else { self.running_values()? };
        {
            let (ps, pl) = self.params.storage_and_layout();
            let p = (cpu(&ps, pl)?, &running[..]);
            crate::meet::unmet(forward_into(&self.shape, p, x, rows, (draw, None), scratch))?;
        }
        self.hand_on(draw, rows.0, &scratch.batch_stats)
    }

    /// Backward pass of the last [`forward_cpu`](Self::forward_cpu) on the
    /// same `x` and scratch: returns d params; d x is `scratch.grad_input`.
    pub fn backward_cpu(&self, x: &[f32], grad_out: &[f32], scratch: &mut MlpScratch) -> Result<Vec<f32>, ModelError> {
        self.backward_laid(First::Input(x), (grad_out, false), scratch)
    }

    /// [`backward_cpu`](Self::backward_cpu) on a laid-out input (perhaps
    /// packed, [`First::Packed`]); `premasked`: `grad_out` has been through
    /// the last ReLU ([`backward_cpu_masked`](Self::backward_cpu_masked)).
    pub(crate) fn backward_laid(
        &self,
        x: First<'_>,
        (grad_out, premasked): (&[f32], bool),
        scratch: &mut MlpScratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_input(x.laid().len(), scratch.rows)?;
        let (ps, pl) = self.params.storage_and_layout();
        crate::meet::unmet(backward_into(&self.shape, cpu(&ps, pl)?, x, (grad_out, premasked), (scratch, None)))
    }
}

impl CustomOp2 for FusedMlp {
    fn name(&self) -> &'static str {
        "fused-mlp"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(xs, xl)?;
        let p = contiguous(ps, pl)?;
        let layers = &self.shape.layers;
        let (Some(first), Some(last)) = (layers.first(), layers.last()) else { return Err(err("no layers")) };
        if p.len() != self.shape.num_params || xl.dims().len() != 2 || xl.dims()[1] != first.fan_in {
            return Err(err(format!("input {:?} / params {} do not fit the layers", xl.dims(), p.len())));
        }
        let rows = xl.dims()[0];
        let mut scratch = self.scratch.lock().map_err(|_| err("poisoned"))?;
        let input = (First::Input(x), (rows, 0), (self.draw, None));
        crate::meet::unmet(forward_into(&self.shape, (p, &self.running), input.0, input.1, input.2, &mut scratch))
            .map_err(|e| err(e.to_string()))?;
        if let Some(slot) = self.batch.as_ref().filter(|_| rows > 0) {
            *slot.lock().map_err(|_| err("poisoned"))? = Some(scratch.batch_stats.clone());
        }
        Ok((CpuStorage::F32(scratch.output.clone()), Shape::from((rows, last.fan_out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut scratch = self.scratch.lock().map_err(|_| err("poisoned"))?;
        if scratch.hidden.len() + 1 != self.shape.layers.len() || scratch.rows != x.dims().first().copied().unwrap_or(0)
        {
            return Err(err("backward without a matching forward"));
        }
        let (xs, xl) = x.storage_and_layout();
        let (ps, pl) = params.storage_and_layout();
        let (gs, gl) = grad_res.storage_and_layout();
        let (x_data, p, g) = (cpu(&xs, xl)?, cpu(&ps, pl)?, cpu(&gs, gl)?);
        let grad_p =
            crate::meet::unmet(backward_into(&self.shape, p, First::Input(x_data), (g, false), (&mut scratch, None)))
                .map_err(|e| err(e.to_string()))?;
        let grad_x = std::mem::take(&mut scratch.grad_input);
        let grad_x = Tensor::from_vec(grad_x, x.shape(), x.device())?;
        let grad_p = Tensor::from_vec(grad_p, params.shape(), params.device())?;
        Ok((Some(grad_x), Some(grad_p)))
    }
}

#[cfg(test)]
mod tests;
