//! [`DenseModel`]: a kind's network (`kinds/`) with what every kind's
//! step shares: the loss and its gradient, candle's autograd, the direct
//! step's driver and its buffers, the finiteness checks. Embedding width
//! per key is the kind's (`Kind::embedding_width`).

use candle_core::{D, Device, Tensor, Var};
use sparrow_core::config::{ModelConfig, Precision};

use crate::ModelError;
use crate::bf16::Arith;
use crate::fused::Simd;
use crate::heads::Heads;
use crate::input_grad::InputGrad;
use crate::kinds::{At, Build, Kind, Net};

mod described;
mod direct;
mod halves;
use crate::optimizer::{DenseGrads, DenseOptimizer};
use crate::params::ParamStore;
pub use crate::step::{ModelShape, Scratch, Sequences};

pub struct DenseModel {
    pub kind: &'static dyn Kind,
    pub shape: ModelShape,
    pub params: ParamStore,
    net: Box<dyn Net>,
    /// The layout its steps read.
    at: At,
    /// Buffers of the direct step, reused across steps.
    scratch: std::sync::Mutex<crate::step::Scratch>,
    /// Buffers of direct predictions, one taken a call and given back
    /// after (held only to take or give one): predictions may run beside
    /// a step and beside each other (a server's requests), and a batch's
    /// fresh buffers were faulted in page by page, most of an evaluation's
    /// time for DIN.
    predicting: std::sync::Mutex<Vec<crate::step::Scratch>>,
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

/// Sample weights, where given, are one a row (a loss indexes them by row).
fn check_sample_weights(weights: Option<&[f32]>, rows: usize) -> Result<(), ModelError> {
    match weights {
        Some(w) if w.len() != rows => {
            Err(ModelError::BadInput { what: "sample weights", len: w.len(), rows, per_row: 1 })
        }
        _ => Ok(()),
    }
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
        let kind = crate::kinds::find(&config.kind)?;
        let outputs = heads.outputs();
        if outputs != 1 && !kind.has_products() {
            return Err(ModelError::Heads { kind: kind.name(), outputs });
        }
        let arith = Arith::new(config.precision, simd);
        if config.precision == Precision::Bf16 && !kind.has_products() {
            // Valid (a sweep may set it for every kind), but it changes nothing: say so.
            tracing::warn!(
                "model.precision = \"bf16\" has no effect on model.kind = \"{}\": it has no matrix products \
                 and trains in f32",
                kind.name()
            );
        }
        let mut ps = ParamStore::new(seed, device.clone());
        let net =
            kind.build(&mut Build { ps: &mut ps, config, shape, heads: &heads, pairs, arith, simd, device: &device })?;
        let at = At { shape, width: kind.embedding_width(shape.embedding_dim), simd, dropout: None, first_row: 0 };
        let (scratch, predicting) = Default::default();
        Ok(DenseModel { kind, shape, params: ps, net, at, scratch, predicting, simd, heads })
    }

    /// The dense step's arithmetic floor, flops per sample: what the model
    /// must compute forward and backward (the embedding gradients included),
    /// at 2 flops a multiply-add. A matrix product `in → out` costs
    /// `6·in·out` (forward, weight gradient, input gradient); FM's second
    /// order `5·f·d`; DLRM's pairwise dots `6·d` per pair; a DCN-v2 cross
    /// layer `6·x² + 6·x` (its product and the gating); first-order terms
    /// `2·f + 6·num_dense`. Element-wise activations and the loss are left
    /// out: this is a floor, the time it takes at the machine's ceiling is
    /// the least a step can take. Each kind counts its own
    /// (`Kind::step_flops_per_sample`).
    pub fn step_flops_per_sample(config: &ModelConfig, shape: ModelShape) -> Result<f64, ModelError> {
        Ok(crate::kinds::find(&config.kind)?.step_flops_per_sample(config, shape))
    }

    pub fn width(&self) -> usize {
        self.at.width
    }

    /// Each sequence's slot among the fields and its candidate's slot, for
    /// a model that attends over them (`din`); empty otherwise.
    pub fn attention(&self) -> &[(usize, usize)] {
        self.net.attention()
    }

    /// Logits `[batch]` from pooled embeddings `[batch, fields, width]` and dense `[batch, num_dense]`.
    pub fn forward(&self, emb: &Tensor, dense: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_with(emb, dense, &[])
    }

    /// [`forward`](Self::forward) with each sequence's history items
    /// `[positions, width]` and the rows `[positions]` (u32) they belong to.
    pub fn forward_with(&self, emb: &Tensor, dense: &Tensor, items: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        self.forward_drawn(emb, dense, items, None)
    }

    /// [`forward_with`](Self::forward_with) for a training step whose
    /// dropout draw is `draw`.
    fn forward_drawn(
        &self,
        emb: &Tensor,
        dense: &Tensor,
        items: &[(Tensor, Tensor)],
        draw: Option<u64>,
    ) -> Result<Tensor, ModelError> {
        let out = self.net.forward(&self.at.drawn(draw), emb, dense, items)?;
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
            // Buffers of its own: predictions may run beside a training step.
            let taken = self.predicting.lock().ok().and_then(|mut free| free.pop());
            let mut scratch = taken.unwrap_or_default();
            // In halves where the step is (the step's logits, bit for bit).
            let logits = self.sequences_into(sequences.cloned(), rows, &mut scratch).and_then(|()| {
                if self.runs_in_halves(rows) {
                    self.forward_halves(&x, rows, None, &mut scratch)
                } else {
                    self.forward_direct(&x, rows, None, &mut scratch)
                }
            });
            // Given back whole only (a failed batch's buffers are dropped).
            if let (Ok(_), Ok(mut free)) = (&logits, self.predicting.lock()) {
                free.push(scratch);
            }
            return logits;
        }
        let (emb, dense) = self.inputs(emb, dense, rows)?;
        let items = self.sequence_inputs(sequences, rows)?;
        Ok(self.forward_with(&emb, &dense, &items)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The batch's sequences as the model needs them, checked against the
    /// batch: `None` for a model that does not attend (any given are not
    /// read), an error naming what is wrong for one that does.
    fn checked_sequences<'s>(
        &self,
        sequences: Option<&'s Sequences>,
        rows: usize,
    ) -> Result<Option<&'s Sequences>, ModelError> {
        let expected = self.attention().len();
        let Some(seq) = sequences.filter(|_| expected > 0) else {
            return if expected == 0 { Ok(None) } else { Err(ModelError::Sequences { expected, found: 0 }) };
        };
        if seq.items.len() != expected || seq.rows.len() != expected {
            return Err(ModelError::Sequences { expected, found: seq.items.len().min(seq.rows.len()) });
        }
        let width = self.width();
        for (items, at) in seq.items.iter().zip(&seq.rows) {
            if items.len() != at.len() * width || at.iter().any(|&r| r as usize >= rows) {
                return Err(ModelError::BadInput {
                    what: "history items",
                    len: items.len(),
                    rows: at.len(),
                    per_row: width,
                });
            }
        }
        Ok(Some(seq))
    }

    /// Each sequence's items (as variables: their gradients are read) and
    /// rows, checked against the batch.
    fn sequence_inputs(&self, sequences: Option<&Sequences>, rows: usize) -> Result<Vec<(Tensor, Tensor)>, ModelError> {
        let Some(seq) = self.checked_sequences(sequences, rows)? else { return Ok(Vec::new()) };
        let (dev, width) = (self.params.device(), self.width());
        seq.items
            .iter()
            .zip(&seq.rows)
            .map(|(items, at)| {
                let keys = Var::from_vec(items.clone(), (at.len(), width), dev)?.as_tensor().clone();
                Ok((keys, Tensor::from_vec(at.clone(), at.len(), dev)?))
            })
            .collect()
    }

    /// The batch's sequences, checked, moved into the direct step's
    /// buffers (empty for a model that does not attend).
    fn sequences_into(&self, sequences: Option<Sequences>, rows: usize, s: &mut Scratch) -> Result<(), ModelError> {
        self.checked_sequences(sequences.as_ref(), rows)?;
        s.sequences = if self.attention().is_empty() { Sequences::default() } else { sequences.unwrap_or_default() };
        Ok(())
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

    /// The batch's loss and its logits' seed: the one binary head's, or
    /// every head's (their labels checked first).
    fn batch_loss_and_seed(
        &self,
        logits: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
    ) -> Result<(f64, Vec<f32>), ModelError> {
        if !self.heads.is_one_binary() {
            self.heads.check_labels(labels)?;
        }
        Ok(self.heads.loss_and_seed_in(self.simd, logits, labels, weights))
    }

    /// [`batch_loss_and_seed`](Self::batch_loss_and_seed) of some of a
    /// batch's rows, their labels already checked (`inv_b`: one over the
    /// whole batch's rows): each row's loss, not yet summed, and the seed.
    fn rows_loss_and_seed_of(
        &self,
        logits: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        inv_b: f64,
    ) -> (Vec<f64>, Vec<f32>) {
        self.heads.rows_loss_and_seed(self.simd, logits, labels, weights, inv_b)
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
        self.forward_backward_with(emb, dense, labels, weights, None, None)
    }

    /// [`forward_backward_weighted`](Self::forward_backward_weighted) with
    /// the batch's behaviour sequences, unpooled, for a model that attends
    /// over them (their items' gradients come back in `item_grads`), and
    /// the step's dropout draw (`model.dropout`; `None`: nothing dropped).
    pub fn forward_backward_with(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
        dropout: Option<u64>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        if self.is_direct() {
            self.forward_backward_direct(&emb, &dense, labels, weights, sequences, dropout)
        } else {
            self.autograd(emb, dense, labels, weights, sequences, dropout)
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
        self.autograd(emb, dense, labels, None, None, None)
    }

    /// [`forward_backward_with`](Self::forward_backward_with) through
    /// candle's autograd (the reference the direct step is tested against).
    pub fn forward_backward_autograd_with(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
        dropout: Option<u64>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        self.autograd(emb, dense, labels, weights, sequences, dropout)
    }

    fn autograd(
        &self,
        emb: Vec<f32>,
        dense: Vec<f32>,
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
        dropout: Option<u64>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        let rows = labels.len() / self.heads.tasks();
        check_sample_weights(weights, rows)?;
        let (emb, dense) = self.inputs(emb, dense, rows)?;
        let emb = Var::from_tensor(&emb)?;
        let items = self.sequence_inputs(sequences, rows)?;
        let logits_t = self.forward_drawn(emb.as_tensor(), &dense, &items, self.training(dropout))?;
        let logits = logits_t.flatten_all()?.to_vec1::<f32>()?;
        // Seeding the backward pass with the loss gradient (as a constant)
        // gives the exact, stable gradient without building the loss in candle.
        let (loss, seed) = self.batch_loss_and_seed(&logits, labels, weights)?;
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
        let mut dense_grads = DenseGrads::new(dense_grads, rows as u64);
        self.params.take_batch_statistics(&mut dense_grads.grads)?;
        Ok((StepOutput { logits, loss, emb_grad, item_grads }, dense_grads))
    }

    /// A training pass's draw: with running statistics (batch norm) a step
    /// always draws, as `Some` is what tells the stacks it is training
    /// (with no dropout, the draw drops nothing).
    fn training(&self, dropout: Option<u64>) -> Option<u64> {
        if self.params.has_statistics() { dropout.or(Some(0)) } else { dropout }
    }

    /// Forward and backward on CPU, outside candle's graph (every kind):
    /// the same math as [`forward_backward_autograd`](Self::forward_backward_autograd) (tested).
    fn forward_backward_direct(
        &self,
        emb: &[f32],
        dense: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<&Sequences>,
        dropout: Option<u64>,
    ) -> Result<(StepOutput, DenseGrads), ModelError> {
        let rows = labels.len() / self.heads.tasks();
        let x = self.concat_rows(emb, dense, rows)?;
        let (fw, stride) = (self.shape.num_fields * self.width(), self.row_len());
        let sequences = sequences.filter(|_| !self.attention().is_empty()).cloned();
        let (loss, logits, (emb_grad, item_grads), grads) =
            self.forward_backward_packed_with(&x, labels, weights, sequences, dropout, |grad_x, item_grads| {
                let mut emb_grad = Vec::with_capacity(rows * fw);
                for row in grad_x.rows(stride) {
                    emb_grad.extend_from_slice(&row[..fw]);
                }
                (emb_grad, item_grads.to_vec())
            })?;
        Ok((StepOutput { logits, loss, emb_grad, item_grads }, grads))
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
    /// instead of being copied out (in two parts where the step ran in
    /// halves: [`InputGrad`]). Returns the mean loss, the logits, what
    /// `on_input_grad` returned and the dense gradients.
    pub fn forward_backward_packed<R>(
        &self,
        x: &[f32],
        labels: &[f32],
        on_input_grad: impl FnOnce(InputGrad<'_>) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        self.forward_backward_packed_weighted(x, labels, None, on_input_grad)
    }

    /// [`forward_backward_packed`](Self::forward_backward_packed) with sample weights.
    pub fn forward_backward_packed_weighted<R>(
        &self,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        on_input_grad: impl FnOnce(InputGrad<'_>) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        self.forward_backward_packed_with(x, labels, weights, None, None, |grad_x, _| on_input_grad(grad_x))
    }

    /// [`forward_backward_packed_weighted`](Self::forward_backward_packed_weighted)
    /// with the batch's behaviour sequences, unpooled, for a model that
    /// attends over them: `on_grads` gets d loss / d x ([`InputGrad`]) and d loss / d each
    /// history item (as [`Sequences::items`]; empty for a model that does
    /// not attend). `labels` are rows × tasks; `dropout` is the step's
    /// dropout draw (`None`: nothing dropped).
    pub fn forward_backward_packed_with<R>(
        &self,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        sequences: Option<Sequences>,
        dropout: Option<u64>,
        on_grads: impl FnOnce(InputGrad<'_>, &[Vec<f32>]) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        crate::awake::through(|| self.step_packed(x, (labels, weights), sequences, dropout, on_grads))
    }

    /// [`forward_backward_packed_with`](Self::forward_backward_packed_with)'s step.
    fn step_packed<R>(
        &self,
        x: &[f32],
        (labels, weights): (&[f32], Option<&[f32]>),
        sequences: Option<Sequences>,
        dropout: Option<u64>,
        on_grads: impl FnOnce(InputGrad<'_>, &[Vec<f32>]) -> R,
    ) -> Result<(f64, Vec<f32>, R, DenseGrads), ModelError> {
        if !self.is_direct() {
            return Err(ModelError::NotPacked { kind: self.kind.name() });
        }
        let rows = labels.len() / self.heads.tasks();
        check_sample_weights(weights, rows)?;
        let mut scratch = self.scratch.lock().map_err(|_| ModelError::Poisoned)?;
        self.sequences_into(sequences, rows, &mut scratch)?;
        if let Some(direct::FirstOrderStep { loss, logits, grads, finite }) =
            self.whole_step(x, labels, weights, &mut scratch)?
        {
            self.check_loss(loss)?;
            if !finite {
                crate::optimizer::check_finite(self.simd, &scratch.grad_x, || {
                    "gradient of the embedding inputs".into()
                })?;
            }
            let result = on_grads(InputGrad::whole(&scratch.grad_x), &[]);
            return Ok((loss, logits, result, grads));
        }
        let draw = self.training(dropout);
        scratch.grad_x_finite = false;
        let halves = self.runs_in_halves(rows);
        let (loss, logits, mut grads) = if halves {
            self.step_halves(x, (labels, weights), draw, &mut scratch)?
        } else {
            let logits = self.forward_direct(x, rows, draw, &mut scratch)?;
            let (loss, seed) = self.batch_loss_and_seed(&logits, labels, weights)?;
            self.check_loss(loss)?;
            (loss, logits, self.backward_direct(x, &seed, &mut scratch)?)
        };
        if self.params.has_statistics() {
            // The batch's statistics go where their gradients would: values
            // no pass has checked.
            self.params.take_batch_statistics(&mut grads.grads)?;
            grads.found_finite = false;
        }
        let input_grad = halves::checked_input_grad(&scratch, halves, self.simd)?;
        for g in &scratch.item_grads {
            crate::optimizer::check_finite(self.simd, g, || "gradient of the history items".into())?;
        }
        let result = on_grads(input_grad, &scratch.item_grads);
        Ok((loss, logits, result, grads))
    }
}
