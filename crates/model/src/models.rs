//! The model zoo. Embedding width per key is `embedding_dim`, plus one leading
//! column for models with a first-order ("wide"/linear) term; LR uses width 1.

use candle_core::{D, Device, Tensor, Var};
use rayon::prelude::*;
use sparrow_core::config::{ModelConfig, ModelKind, Precision};
use sparrow_core::metrics::logistic_loss_and_sigmoid;

use crate::ModelError;
use crate::bf16::Arith;
use crate::fused::{FirstOrderFm, PairwiseDots, Simd};
use crate::heads::Heads;
use crate::mlp::Mlp;

mod described;
mod din;
mod direct;
mod multitask;
use crate::optimizer::{DenseGrads, DenseOptimizer};
use crate::params::{Linear, ParamStore};
pub use din::Sequences;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub num_fields: usize,
    pub num_dense: usize,
    pub embedding_dim: usize,
}

enum Net {
    /// First-order terms only.
    Lr {
        dense: Option<Linear>,
    },
    Fm {
        dense: Option<Linear>,
    },
    Mlp {
        mlp: Mlp,
    },
    WideDeep {
        dense: Option<Linear>,
        deep: Mlp,
    },
    DeepFm {
        dense: Option<Linear>,
        deep: Mlp,
    },
    Dlrm {
        bottom: Option<Mlp>,
        top: Mlp,
        pairs: Tensor,
        n: usize,
    },
    Dcn {
        cross: Vec<Linear>,
        deep: Mlp,
        arith: Arith,
    },
    /// `esmm`, `mmoe`, `ple` (`models/multitask.rs`).
    MultiTask(multitask::MultiTask),
    /// `din` (`models/din.rs`).
    Din(din::Din),
}

pub struct DenseModel {
    pub kind: ModelKind,
    pub shape: ModelShape,
    pub params: ParamStore,
    net: Net,
    /// Scalar bias shared by the first-order models.
    bias: Option<Var>,
    /// Buffers of the direct step, reused across steps.
    scratch: std::sync::Mutex<direct::Scratch>,
    /// `train.simd`: whether its kernels may take their SIMD versions.
    simd: Simd,
    /// Its outputs, a group per task, and their loss.
    heads: Heads,
}

pub struct StepOutput {
    pub logits: Vec<f32>,
    /// Mean logistic loss of the batch.
    pub loss: f64,
    /// d(mean loss)/d(pooled embeddings), `[batch, fields, width]` row-major.
    pub emb_grad: Vec<f32>,
    /// d(mean loss)/d(each history item), per sequence, as [`Sequences::items`]
    /// (empty for a model that does not attend).
    pub item_grads: Vec<Vec<f32>>,
}

fn with_dense(ps: &mut ParamStore, num_dense: usize) -> Result<Option<Linear>, ModelError> {
    if num_dense == 0 { Ok(None) } else { Linear::new(ps, "dense_linear", num_dense, 1).map(Some) }
}

fn head(hidden: &[usize], outputs: usize) -> Vec<usize> {
    hidden.iter().copied().chain(std::iter::once(outputs)).collect()
}

impl DenseModel {
    /// The network `config` describes, its weights drawn from `seed`; its
    /// kernels take their SIMD versions as `simd` allows (`train.simd`).
    pub fn new(
        config: &ModelConfig,
        shape: ModelShape,
        seed: u64,
        device: Device,
        simd: Simd,
    ) -> Result<DenseModel, ModelError> {
        Self::with_heads(config, shape, Heads::one_binary(), seed, device, simd)
    }

    /// [`new`](Self::new) with an output group per task (`heads`): the
    /// shared body ends in one layer of `heads.outputs()` logits.
    pub fn with_heads(
        config: &ModelConfig,
        shape: ModelShape,
        heads: Heads,
        seed: u64,
        device: Device,
        simd: Simd,
    ) -> Result<DenseModel, ModelError> {
        Self::with_attention(config, shape, heads, &[], seed, device, simd)
    }

    /// [`with_heads`](Self::with_heads) for a model that attends over
    /// behaviour sequences (`din`): `pairs` holds each sequence's slot among
    /// the fields and its candidate's (`Config::attention_pairs`).
    pub fn with_attention(
        config: &ModelConfig,
        shape: ModelShape,
        heads: Heads,
        pairs: &[(usize, usize)],
        seed: u64,
        device: Device,
        simd: Simd,
    ) -> Result<DenseModel, ModelError> {
        let outputs = heads.outputs();
        if outputs != 1 && matches!(config.kind, ModelKind::Lr | ModelKind::Fm) {
            return Err(ModelError::Heads { kind: config.kind.name(), outputs });
        }
        let arith = Arith::new(config.precision, simd);
        if config.precision == Precision::Bf16 && matches!(config.kind, ModelKind::Lr | ModelKind::Fm) {
            // Valid (a sweep may set it for every kind), but it changes nothing: say so.
            tracing::warn!(
                "model.precision = \"bf16\" has no effect on model.kind = \"{}\": it has no matrix products \
                 and trains in f32",
                config.kind.name()
            );
        }
        let mut ps = ParamStore::new(seed, device.clone());
        let (f, nd, d) = (shape.num_fields, shape.num_dense, shape.embedding_dim);
        let mut bias = None;
        let net = match config.kind {
            ModelKind::Lr => {
                bias = Some(ps.zeros("bias".into(), &[1])?);
                Net::Lr { dense: with_dense(&mut ps, nd)? }
            }
            ModelKind::Fm => {
                bias = Some(ps.zeros("bias".into(), &[1])?);
                Net::Fm { dense: with_dense(&mut ps, nd)? }
            }
            ModelKind::Mlp => {
                Net::Mlp { mlp: Mlp::new(&mut ps, "mlp", f * d + nd, &head(&config.hidden, outputs), false, arith)? }
            }
            ModelKind::WideDeep => {
                bias = Some(ps.zeros("bias".into(), &[1])?);
                Net::WideDeep {
                    dense: with_dense(&mut ps, nd)?,
                    deep: Mlp::new(&mut ps, "deep", f * d + nd, &head(&config.hidden, outputs), false, arith)?,
                }
            }
            ModelKind::Deepfm => {
                bias = Some(ps.zeros("bias".into(), &[1])?);
                Net::DeepFm {
                    dense: with_dense(&mut ps, nd)?,
                    deep: Mlp::new(&mut ps, "deep", f * d + nd, &head(&config.hidden, outputs), false, arith)?,
                }
            }
            ModelKind::Dlrm => {
                let bottom = if nd == 0 {
                    None
                } else {
                    let sizes: Vec<usize> = config.bottom_hidden.iter().copied().chain(std::iter::once(d)).collect();
                    Some(Mlp::new(&mut ps, "bottom", nd, &sizes, true, arith)?)
                };
                let n = f + usize::from(nd > 0);
                // Upper triangle (i < j) of the n×n dot-product matrix, flattened.
                let pairs: Vec<u32> = (0..n).flat_map(|i| ((i + 1)..n).map(move |j| (i * n + j) as u32)).collect();
                let num_pairs = pairs.len();
                let pairs = Tensor::from_vec(pairs, num_pairs, &device)?;
                let top_in = num_pairs + if nd > 0 { d } else { 0 };
                Net::Dlrm {
                    bottom,
                    top: Mlp::new(&mut ps, "top", top_in, &head(&config.hidden, outputs), false, arith)?,
                    pairs,
                    n,
                }
            }
            ModelKind::Dcn => {
                let x_dim = f * d + nd;
                let cross = (0..config.cross_layers)
                    .map(|l| Linear::new(&mut ps, &format!("cross.{l}"), x_dim, x_dim))
                    .collect::<Result<Vec<_>, _>>()?;
                Net::Dcn {
                    cross,
                    deep: Mlp::new(&mut ps, "deep", x_dim, &head(&config.hidden, outputs), false, arith)?,
                    arith,
                }
            }
            ModelKind::Esmm | ModelKind::Mmoe | ModelKind::Ple => {
                Net::MultiTask(multitask::MultiTask::new(&mut ps, config, f * d + nd, &heads, arith)?)
            }
            ModelKind::Din => {
                if pairs.is_empty() || pairs.iter().any(|&(s, q)| s >= f || q >= f) {
                    return Err(ModelError::Sequences { expected: pairs.len().max(1), found: 0 });
                }
                Net::Din(din::Din::new(&mut ps, config, pairs, f * d + nd, outputs, arith)?)
            }
        };
        Ok(DenseModel { kind: config.kind, shape, params: ps, net, bias, scratch: Default::default(), simd, heads })
    }

    /// The dense step's arithmetic floor, flops per sample: what the model
    /// must compute forward and backward (the embedding gradients included),
    /// at 2 flops a multiply-add. A matrix product `in → out` costs
    /// `6·in·out` (forward, weight gradient, input gradient); FM's second
    /// order `5·f·d`; DLRM's pairwise dots `6·d` per pair; a DCN-v2 cross
    /// layer `6·x² + 6·x` (its product and the gating); first-order terms
    /// `2·f + 6·num_dense`. Element-wise activations and the loss are left
    /// out: this is a floor, the time it takes at the machine's ceiling is
    /// the least a step can take.
    pub fn step_flops_per_sample(config: &ModelConfig, shape: ModelShape) -> f64 {
        let (f, nd, d) = (shape.num_fields as f64, shape.num_dense as f64, shape.embedding_dim as f64);
        let stack = |input: f64, sizes: &[usize]| {
            let mut fan_in = input;
            let mut total = 0.0;
            for &out in sizes {
                total += 6.0 * fan_in * out as f64;
                fan_in = out as f64;
            }
            total
        };
        let first_order = 2.0 * f + 6.0 * nd;
        let fm = 5.0 * f * d;
        let deep = || stack(f * d + nd, &head(&config.hidden, 1));
        match config.kind {
            ModelKind::Lr => first_order,
            ModelKind::Fm => first_order + fm,
            ModelKind::Mlp => deep(),
            ModelKind::WideDeep => first_order + deep(),
            ModelKind::Deepfm => first_order + fm + deep(),
            ModelKind::Dlrm => {
                let bottom = if nd > 0.0 {
                    let sizes: Vec<usize> = config.bottom_hidden.iter().copied().chain([shape.embedding_dim]).collect();
                    stack(nd, &sizes)
                } else {
                    0.0
                };
                let n = f + if nd > 0.0 { 1.0 } else { 0.0 };
                let pairs = n * (n - 1.0) / 2.0;
                let top_in = pairs + if nd > 0.0 { d } else { 0.0 };
                bottom + 6.0 * d * pairs + stack(top_in, &head(&config.hidden, 1))
            }
            ModelKind::Dcn => {
                let x = f * d + nd;
                config.cross_layers as f64 * (6.0 * x * x + 6.0 * x) + deep()
            }
            // The MLP; the attention units' work grows with the history's length.
            ModelKind::Din => deep(),
            // Experts and towers (one output a tower), gates left out.
            ModelKind::Esmm => 2.0 * stack(f * d + nd, &head(&config.tower_hidden, 1)),
            ModelKind::Mmoe | ModelKind::Ple => {
                let expert_out = config.expert_hidden.last().copied().unwrap_or(1) as f64;
                let experts = if config.kind == ModelKind::Mmoe {
                    config.experts as f64 * stack(f * d + nd, &config.expert_hidden)
                } else {
                    let per_level = (config.experts + config.task_experts) as f64;
                    per_level * stack(f * d + nd, &config.expert_hidden)
                        + per_level
                            * (config.levels.saturating_sub(1)) as f64
                            * stack(expert_out, &config.expert_hidden)
                };
                experts + stack(expert_out, &head(&config.tower_hidden, 1))
            }
        }
    }

    /// Floats per embedding row this model reads.
    pub fn embedding_width(kind: ModelKind, embedding_dim: usize) -> usize {
        match kind {
            ModelKind::Lr => 1,
            ModelKind::Fm | ModelKind::WideDeep | ModelKind::Deepfm => 1 + embedding_dim,
            ModelKind::Mlp | ModelKind::Dlrm | ModelKind::Dcn => embedding_dim,
            ModelKind::Esmm | ModelKind::Mmoe | ModelKind::Ple | ModelKind::Din => embedding_dim,
        }
    }

    pub fn width(&self) -> usize {
        Self::embedding_width(self.kind, self.shape.embedding_dim)
    }

    /// Each sequence's slot among the fields and its candidate's slot, for
    /// a model that attends over them (`din`); empty otherwise.
    pub fn attention(&self) -> &[(usize, usize)] {
        match &self.net {
            Net::Din(net) => net.pairs(),
            _ => &[],
        }
    }

    /// Logits `[batch]` from pooled embeddings `[batch, fields, width]` and dense `[batch, num_dense]`.
    pub fn forward(&self, emb: &Tensor, dense: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_with(emb, dense, &[])
    }

    /// [`forward`](Self::forward) with each sequence's history items
    /// `[positions, width]` and the rows `[positions]` (u32) they belong to.
    pub fn forward_with(&self, emb: &Tensor, dense: &Tensor, items: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let b = emb.dim(0)?;
        let (f, d) = (self.shape.num_fields, self.shape.embedding_dim);
        let fm_second = |v: &Tensor| -> Result<Tensor, ModelError> {
            // ½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²]
            let s = v.sum(1)?.sqr()?;
            let q = v.sqr()?.sum(1)?;
            Ok(((s - q)?.sum_keepdim(1)? * 0.5)?)
        };
        // Σ_f w_f (the leading column), FM's second order if `fm`, + dense·w + bias.
        let first_order = |dense_lin: &Option<Linear>, fm: bool| -> Result<Tensor, ModelError> {
            let mut t = if emb.device().is_cpu() {
                emb.contiguous()?.apply_op1(FirstOrderFm { second_order: fm })? // [B, 1]
            } else {
                let t = emb.narrow(2, 0, 1)?.sum(1)?;
                if fm { (t + fm_second(&emb.narrow(2, 1, d)?)?)? } else { t }
            };
            if let Some(lin) = dense_lin {
                t = (t + lin.forward(dense)?)?;
            }
            if let Some(bias) = &self.bias {
                t = t.broadcast_add(bias.as_tensor())?;
            }
            Ok(t)
        };
        let flat_with_dense = |v: &Tensor| -> Result<Tensor, ModelError> {
            let flat = v.reshape((b, f * d))?;
            Ok(if self.shape.num_dense > 0 { Tensor::cat(&[&flat, dense], 1)? } else { flat })
        };
        let out = match &self.net {
            Net::Lr { dense: lin } => first_order(lin, false)?,
            Net::Fm { dense: lin } => first_order(lin, true)?,
            Net::Mlp { mlp } => mlp.forward(&flat_with_dense(emb)?)?,
            Net::WideDeep { dense: lin, deep } => {
                let v = emb.narrow(2, 1, d)?.contiguous()?;
                first_order(lin, false)?.broadcast_add(&deep.forward(&flat_with_dense(&v)?)?)?
            }
            Net::DeepFm { dense: lin, deep } => {
                let v = emb.narrow(2, 1, d)?.contiguous()?;
                first_order(lin, true)?.broadcast_add(&deep.forward(&flat_with_dense(&v)?)?)?
            }
            Net::Dlrm { bottom, top, pairs, n } => {
                let (t, bottom_out) = match bottom {
                    Some(mlp) => {
                        let x = mlp.forward(dense)?; // [B, d]
                        (Tensor::cat(&[&x.unsqueeze(1)?, emb], 1)?, Some(x))
                    }
                    None => (emb.clone(), None),
                };
                let inter = if t.device().is_cpu() {
                    t.contiguous()?.apply_op1(PairwiseDots(self.simd))?
                } else {
                    // [B, n, n] dot products, then their upper triangle.
                    t.matmul(&t.t()?)?.reshape((b, n * n))?.index_select(pairs, 1)?
                };
                let top_in = match bottom_out {
                    Some(x) => Tensor::cat(&[&x, &inter], 1)?,
                    None => inter,
                };
                top.forward(&top_in)?
            }
            Net::MultiTask(net) => net.forward(&flat_with_dense(emb)?)?,
            Net::Din(net) => net.forward(emb, dense, items)?,
            Net::Dcn { cross, deep, arith } => {
                let x0 = flat_with_dense(emb)?;
                let mut x = x0.clone();
                for layer in cross {
                    x = crate::mlp::cross(*arith, &x0, &x, layer.weight().as_tensor(), layer.bias().as_tensor())?;
                }
                deep.forward(&x)?
            }
        };
        Ok(if self.heads.outputs() == 1 { out.squeeze(D::Minus1)? } else { out })
    }

    /// Its outputs, a group per task.
    pub fn heads(&self) -> &Heads {
        &self.heads
    }

    fn inputs(&self, emb: Vec<f32>, dense: Vec<f32>, rows: usize) -> Result<(Tensor, Tensor), ModelError> {
        let dev = self.params.device();
        let emb = Tensor::from_vec(emb, (rows, self.shape.num_fields, self.width()), dev)?;
        let dense = Tensor::from_vec(dense, (rows, self.shape.num_dense), dev)?;
        Ok((emb, dense))
    }

    /// Forward only: logits of a batch.
    pub fn predict(&self, emb: Vec<f32>, dense: Vec<f32>, rows: usize) -> Result<Vec<f32>, ModelError> {
        self.predict_with(emb, dense, rows, None)
    }

    /// [`predict`](Self::predict) with the batch's behaviour sequences,
    /// unpooled, for a model that attends over them.
    pub fn predict_with(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        rows: usize,
        sequences: Option<&Sequences>,
    ) -> Result<Vec<f32>, ModelError> {
        if self.is_direct() {
            let x = self.concat_rows(&emb, &dense, rows)?;
            // Its own buffers: predictions may run beside a training step.
            return self.forward_direct(&x, rows, &mut direct::Scratch::default());
        }
        let (emb, dense) = self.inputs(emb, dense, rows)?;
        let items = self.sequence_inputs(sequences, rows)?;
        Ok(self.forward_with(&emb, &dense, &items)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Each sequence's items (as variables: their gradients are read) and
    /// rows, checked against the batch.
    fn sequence_inputs(&self, sequences: Option<&Sequences>, rows: usize) -> Result<Vec<(Tensor, Tensor)>, ModelError> {
        let expected = self.attention().len();
        let Some(seq) = sequences.filter(|_| expected > 0) else {
            return if expected == 0 { Ok(Vec::new()) } else { Err(ModelError::Sequences { expected, found: 0 }) };
        };
        if seq.items.len() != expected || seq.rows.len() != expected {
            return Err(ModelError::Sequences { expected, found: seq.items.len().min(seq.rows.len()) });
        }
        let (dev, width) = (self.params.device(), self.width());
        seq.items
            .iter()
            .zip(&seq.rows)
            .map(|(items, at)| {
                if items.len() != at.len() * width || at.iter().any(|&r| r as usize >= rows) {
                    return Err(ModelError::BadInput {
                        what: "history items",
                        len: items.len(),
                        rows: at.len(),
                        per_row: width,
                    });
                }
                let keys = Var::from_vec(items.clone(), (at.len(), width), dev)?.as_tensor().clone();
                Ok((keys, Tensor::from_vec(at.clone(), at.len(), dev)?))
            })
            .collect()
    }

    /// Input rows `[pooled embeddings | dense values]` (see [`packed_row_len`](Self::packed_row_len)).
    fn concat_rows(&self, emb: &[f32], dense: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        let (fw, nd) = (self.shape.num_fields * self.width(), self.shape.num_dense);
        for (what, len, per_row) in [("pooled embeddings", emb.len(), fw), ("dense values", dense.len(), nd)] {
            if len != rows * per_row {
                return Err(ModelError::BadInput { what, len, rows, per_row });
            }
        }
        let mut x = Vec::with_capacity(rows * (fw + nd));
        for r in 0..rows {
            x.extend_from_slice(&emb[r * fw..(r + 1) * fw]);
            x.extend_from_slice(&dense[r * nd..(r + 1) * nd]);
        }
        Ok(x)
    }

    /// Mean stable logistic loss and its gradient w.r.t. the logits:
    /// d/dx [max(x,0) − x·y + log(1+e^{−|x|})] = σ(x) − y, over the batch size.
    /// With sample `weights` each row's loss (and gradient) is multiplied by
    /// its weight, still divided by the batch's row count.
    fn loss_and_seed(logits: &[f32], labels: &[f32], weights: Option<&[f32]>) -> (f64, Vec<f32>) {
        let inv_b = 1.0 / labels.len().max(1) as f64;
        // Each row's loss and gradient in parallel (an exponential and a
        // logarithm a row were a tenth of LR's dense step on one thread);
        // the losses are then summed in row order, as before.
        let (losses, seed): (Vec<f64>, Vec<f32>) = logits
            .par_iter()
            .zip(labels)
            .enumerate()
            .with_min_len(256)
            .map(|(i, (&x, &y))| Self::loss_and_seed_row(x, y, weights.map_or(1.0, |w| f64::from(w[i])), inv_b))
            .unzip();
        (losses.iter().fold(0.0, |sum, l| sum + l) * inv_b, seed)
    }

    /// One row of [`loss_and_seed`](Self::loss_and_seed): its loss times
    /// `weight`, and d (mean loss) / d logit (`inv_b`: one over the rows).
    #[inline]
    fn loss_and_seed_row(logit: f32, label: f32, weight: f64, inv_b: f64) -> (f64, f32) {
        // A masked label (`data.schema.labels`, an empty cell) adds nothing.
        if label.is_nan() {
            return (0.0, 0.0);
        }
        let (loss, p) = logistic_loss_and_sigmoid(f64::from(logit), f64::from(label));
        (weight * loss, ((p - f64::from(label)) * weight * inv_b) as f32)
    }

    /// A NaN or infinite loss stops the step before anything is updated.
    /// Names the dense parameter with the largest magnitude: where finite
    /// weights overflowed the forward pass, it is the one that blew up.
    fn check_loss(&self, loss: f64) -> Result<(), ModelError> {
        if loss.is_finite() {
            return Ok(());
        }
        let mut largest: Option<(&str, f32)> = None;
        for (name, var) in self.params.vars() {
            let w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            let m = w.iter().fold(0.0f32, |m, v| if v.is_nan() || v.abs() > m { v.abs() } else { m });
            if largest.is_none_or(|(_, l)| m > l || m.is_nan()) {
                largest = Some((name, m));
            }
        }
        let blame = largest.map_or_else(String::new, |(name, m)| {
            format!("; the largest dense parameter is `{name}`, with |w| up to {m:e}")
        });
        Err(ModelError::NonFinite { what: format!("training loss ({loss}: a logit is NaN or infinite{blame})") })
    }

    /// The first dense parameter or optimizer moment that is NaN or infinite, named.
    pub fn check_finite(&self, optimizer: &DenseOptimizer) -> Result<(), ModelError> {
        optimizer.check_finite(&self.params)
    }

    /// Forward and backward of one batch: its logits, mean stable logistic
    /// loss and d loss / d pooled embeddings, and the dense gradients for
    /// the optimizer (the step engine syncs and applies them). The loss and
    /// the embedding gradient are checked finite here.
    pub fn forward_backward(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        self.forward_backward_weighted(emb, dense, labels, None)
    }

    /// [`forward_backward`](Self::forward_backward) with each sample's loss
    /// multiplied by its weight (`None`: all 1).
    pub fn forward_backward_weighted(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        self.forward_backward_with(emb, dense, labels, weights, None)
    }

    /// [`forward_backward_weighted`](Self::forward_backward_weighted) with
    /// the batch's behaviour sequences, unpooled, for a model that attends
    /// over them; their items' gradients come back in `item_grads`.
    pub fn forward_backward_with(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        if self.is_direct() {
            self.forward_backward_direct(&emb, &dense, labels, weights)
        } else {
            self.autograd(emb, dense, labels, weights, sequences)
        }
    }

    /// [`forward_backward`](Self::forward_backward) through candle's
    /// autograd: every model, every device.
    pub fn forward_backward_autograd(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        self.autograd(emb, dense, labels, None, None)
    }

    fn autograd(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        let rows = labels.len() / self.heads.tasks();
        let (emb, dense) = self.inputs(emb, dense, rows)?;
        let emb = Var::from_tensor(&emb)?;
        let items = self.sequence_inputs(sequences, rows)?;
        let logits_t = self.forward_with(emb.as_tensor(), &dense, &items)?;
        let logits = logits_t.flatten_all()?.to_vec1::<f32>()?;
        // Seeding the backward pass with the loss gradient (as a constant)
        // gives the exact, stable gradient without building the loss in candle.
        let (loss, seed) = if self.heads.is_one_binary() {
            Self::loss_and_seed(&logits, labels, weights)
        } else {
            self.heads.check_labels(labels)?;
            self.heads.loss_and_seed(&logits, labels, weights)
        };
        self.check_loss(loss)?;
        let seed = Tensor::from_vec(seed, logits_t.shape(), self.params.device())?;
        let surrogate = (logits_t * seed)?.sum_all()?;
        let grads = surrogate.backward()?;
        let emb_grad = match grads.get(emb.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0.0; emb.elem_count()],
        };
        crate::optimizer::check_finite(self.simd, &emb_grad, || "gradient of the embedding inputs".into())?;
        let item_grads = items
            .iter()
            .map(|(keys, _)| match grads.get(keys) {
                Some(g) => {
                    let g = g.flatten_all()?.to_vec1::<f32>()?;
                    crate::optimizer::check_finite(self.simd, &g, || "gradient of the history items".into())?;
                    Ok(g)
                }
                None => Ok(vec![0.0; keys.elem_count()]),
            })
            .collect::<Result<_, ModelError>>()?;
        let dense_grads = self
            .params
            .vars()
            .iter()
            .map(|(_, var)| grads.get(var.as_tensor()).map(|g| g.flatten_all()?.to_vec1::<f32>()).transpose())
            .collect::<Result<_, _>>()?;
        Ok((StepOutput { logits, loss, emb_grad, item_grads }, DenseGrads { grads: dense_grads, rows: rows as u64 }))
    }

    /// Forward and backward on CPU, outside candle's graph (every kind):
    /// the same math as [`forward_backward_autograd`](Self::forward_backward_autograd) (tested).
    fn forward_backward_direct(
        &self,
        emb: &[f32],
        dense: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        let rows = labels.len();
        let x = self.concat_rows(emb, dense, rows)?;
        let (fw, stride) = (self.shape.num_fields * self.width(), self.row_len());
        let (loss, logits, emb_grad, grads) = self.forward_backward_packed_weighted(&x, labels, weights, |grad_x| {
            let mut emb_grad = Vec::with_capacity(rows * fw);
            for row in grad_x.chunks_exact(stride) {
                emb_grad.extend_from_slice(&row[..fw]);
            }
            emb_grad
        })?;
        Ok((StepOutput { logits, loss, emb_grad, item_grads: Vec::new() }, grads))
    }

    /// Floats per input row if this model takes its input packed, each row
    /// `[pooled embeddings | dense values]`, through
    /// [`forward_backward_packed`](Self::forward_backward_packed) (every
    /// kind on CPU); `None` otherwise.
    pub fn packed_row_len(&self) -> Option<usize> {
        self.is_direct().then(|| self.row_len())
    }

    /// Takes back gradient buffers the optimizer is done with
    /// (`DenseOptimizer::apply`'s result): the next step's backward pass
    /// fills one instead of allocating (and faulting in) a new one.
    pub fn recycle(&self, buffers: Vec<Vec<f32>>) {
        if let (true, Ok(mut scratch)) = (self.is_direct(), self.scratch.lock()) {
            self.recycle_direct(buffers, &mut scratch);
        }
    }

    /// Forward and backward on a packed input `x` (see
    /// [`packed_row_len`](Self::packed_row_len)): no concatenation, and
    /// d loss / d x (same layout) is handed to `on_input_grad` in place
    /// instead of being copied out. Returns the mean loss, the logits, what
    /// `on_input_grad` returned and the dense gradients.
    pub fn forward_backward_packed<R>(
        &self,
        x: &[f32],
        labels: &[f32],
        on_input_grad: impl FnOnce(&[f32]) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        self.forward_backward_packed_weighted(x, labels, None, on_input_grad)
    }

    /// [`forward_backward_packed`](Self::forward_backward_packed) with sample weights.
    pub fn forward_backward_packed_weighted<R>(
        &self,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        on_input_grad: impl FnOnce(&[f32]) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        if !self.is_direct() {
            return Err(ModelError::NotPacked { kind: self.kind.name() });
        }
        let mut scratch = self.scratch.lock().map_err(|_| ModelError::Poisoned)?;
        if let Some(direct::FirstOrderStep { loss, logits, grads, finite }) =
            self.first_order_step(x, labels, weights, &mut scratch)?
        {
            self.check_loss(loss)?;
            if !finite {
                crate::optimizer::check_finite(self.simd, &scratch.grad_x, || {
                    "gradient of the embedding inputs".into()
                })?;
            }
            let result = on_input_grad(&scratch.grad_x);
            return Ok((loss, logits, result, grads));
        }
        let logits = self.forward_direct(x, labels.len(), &mut scratch)?;
        let (loss, seed) = Self::loss_and_seed(&logits, labels, weights);
        self.check_loss(loss)?;
        let grads = self.backward_direct(x, &seed, &mut scratch)?;
        crate::optimizer::check_finite(self.simd, &scratch.grad_x, || "gradient of the embedding inputs".into())?;
        let result = on_input_grad(&scratch.grad_x);
        Ok((loss, logits, result, grads))
    }
}
