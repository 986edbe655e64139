//! The driver of the direct CPU step: every kind with one
//! (`Net::direct`, `kinds/`) takes it on CPU, outside candle's graph,
//! the same math as its graph step and autograd (tested). Around the fused
//! MLPs, candle's graph (narrow, concatenations, broadcast adds, the
//! adjoint of each, and a tensor allocated for each) cost Wide&Deep, DeepFM
//! and DLRM a third of their dense step; here the buffers are kept between
//! steps and each value is written once.
//!
//! The step reads input rows `[pooled embeddings | dense values]` (the
//! engine pools straight into them) and leaves d loss / d input in the same
//! layout, the dense values' part included, for the engine to unpool from.

use super::DenseModel;
use crate::ModelError;
use crate::kinds::{Direct, Grads, WholeStep};
use crate::optimizer::DenseGrads;
use crate::step::Scratch;

/// What [`DenseModel::whole_step`] computed.
pub(super) struct FirstOrderStep {
    pub(super) loss: f64,
    pub(super) logits: Vec<f32>,
    pub(super) grads: DenseGrads,
    /// Whether every value of the input gradient (`Scratch::grad_x`) is finite.
    pub(super) finite: bool,
}

impl DenseModel {
    /// Its direct step, where it takes it: on CPU, a kind that has one, for
    /// one binary output or (where the kind takes them) several tasks'.
    pub(super) fn direct(&self) -> Option<&dyn Direct> {
        let direct = self.net.direct().filter(|_| self.params.device().is_cpu())?;
        (self.heads.is_one_binary() || direct.several_outputs()).then_some(direct)
    }

    pub(super) fn is_direct(&self) -> bool {
        self.direct().is_some()
    }

    /// Floats of an input row: `[pooled embeddings (fields × width) | dense values]`.
    pub(super) fn row_len(&self) -> usize {
        self.at.row_len()
    }

    /// The kind's forward, loss and backward in one pass, where it has one
    /// (LR and FM: see `first_order.rs`); `None` for the other kinds.
    pub(super) fn whole_step(
        &self,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        s: &mut Scratch,
    ) -> Result<Option<FirstOrderStep>, ModelError> {
        let direct = self.direct().ok_or(ModelError::NotPacked { kind: self.kind.name() })?;
        let Some(WholeStep { loss, logits, grads, finite }) = direct.whole_step(&self.at, x, labels, weights, s)?
        else {
            return Ok(None);
        };
        Ok(Some(FirstOrderStep { loss, logits, grads: self.in_param_order(grads, labels.len()), finite }))
    }

    /// Logits of a batch of input rows `x` (see [`row_len`](Self::row_len)),
    /// dropout drawn by `draw` (a training step's); what the backward pass
    /// needs stays in `s`.
    pub(super) fn forward_direct(
        &self,
        x: &[f32],
        rows: usize,
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_direct_at(x, (rows, 0), draw, s)
    }

    /// [`forward_direct`](Self::forward_direct) on rows that start at the
    /// batch's row `first_row` (the second half of a batch run in halves).
    pub(super) fn forward_direct_at(
        &self,
        x: &[f32],
        (rows, first_row): (usize, usize),
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let row = self.row_len();
        if x.len() != rows * row {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: row });
        }
        let direct = self.direct().ok_or(ModelError::NotPacked { kind: self.kind.name() })?;
        direct.forward(&self.at.drawn(draw).from_row(first_row), x, rows, s)
    }

    /// The backward pass of the last [`forward_direct`](Self::forward_direct)
    /// on the same input and scratch, from `seed = d loss / d logits`: the
    /// dense gradients; d loss / d input (the input's layout) is left in
    /// `s.grad_x`.
    pub(super) fn backward_direct(&self, x: &[f32], seed: &[f32], s: &mut Scratch) -> Result<DenseGrads, ModelError> {
        let direct = self.direct().ok_or(ModelError::NotPacked { kind: self.kind.name() })?;
        let mut grads: Grads<'_> = Vec::new();
        direct.backward(&self.at, x, seed, s, &mut grads)?;
        Ok(self.in_param_order(grads, x.len() / self.row_len().max(1)))
    }

    /// The gradients in [`ParamStore`](crate::params::ParamStore) order,
    /// `None` where a parameter has none.
    pub(super) fn in_param_order(&self, mut grads: Grads<'_>, rows: usize) -> DenseGrads {
        let mut grads_in_order = Vec::with_capacity(self.params.vars().len());
        for (_, var) in self.params.vars() {
            let at = grads.iter().position(|(v, _)| v.as_tensor().id() == var.as_tensor().id());
            grads_in_order.push(at.map(|i| std::mem::take(&mut grads[i].1)));
        }
        DenseGrads::new(grads_in_order, rows as u64)
    }

    /// Each MLP's buffers with the gradient buffer of its size, if one came back.
    pub(super) fn recycle_direct(&self, mut buffers: Vec<Vec<f32>>, s: &mut Scratch) {
        let Some(direct) = self.direct() else { return };
        for (mlp, scratch) in direct.mlps(s) {
            let wanted = mlp.params().elem_count();
            if let Some(i) = buffers.iter().position(|b| b.len() == wanted) {
                scratch.spare_grad = buffers.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::{ModelConfig, ModelKind};
    use sparrow_core::rng::Rng;

    use super::{DenseModel, Scratch};
    use crate::ModelShape;

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// LR's and FM's one-pass step gives the bits of the three passes it
    /// replaces (forward, loss, backward): logits, loss, input gradient and
    /// every dense gradient, with and without dense values and sample
    /// weights, over several tasks and a partial one; its finiteness flag
    /// says whether the input gradient holds a NaN or an infinity.
    #[test]
    fn the_first_order_step_in_one_pass_is_the_three_passes() {
        let mut rng = Rng::new(41);
        for (kind, num_dense, weighted) in
            [("lr", 13, false), ("lr", 0, true), ("fm", 13, true), ("fm", 0, false), ("fm", 2, false)]
        {
            let shape = ModelShape { num_fields: 5, num_dense, embedding_dim: 16 };
            let config = ModelConfig { kind: ModelKind::named(kind), embedding_dim: 16, ..Default::default() };
            let model = DenseModel::new(&config, shape, 3, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
            let (rows, row) = (77, model.row_len());
            let labels: Vec<f32> = (0..rows).map(|i| (i % 3 == 0) as u8 as f32).collect();
            let weights: Vec<f32> = (0..rows).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
            let weights = weighted.then_some(&weights[..]);
            for poison in [None, Some(f32::NAN), Some(f32::INFINITY)] {
                let what = format!("{kind}, {num_dense} dense, weighted {weighted}, poison {poison:?}");
                let mut x: Vec<f32> = (0..rows * row).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
                if let Some(p) = poison {
                    x[40 * row + 3] = p;
                }
                let (mut one, mut three) = (Scratch::default(), Scratch::default());
                let step = model.whole_step(&x, &labels, weights, &mut one).expect("step").expect("LR or FM");
                let logits = model.forward_direct(&x, rows, None, &mut three).expect("forward");
                let (loss, seed) = model.heads().loss_and_seed(&logits, &labels, weights);
                let grads = model.backward_direct(&x, &seed, &mut three).expect("backward");
                assert_eq!(bits(&step.logits), bits(&logits), "{what}: logits");
                assert_eq!(step.loss.to_bits(), loss.to_bits(), "{what}: loss");
                assert_eq!(bits(&one.grad_x), bits(&three.grad_x), "{what}: input gradient");
                assert_eq!(step.grads.rows, grads.rows);
                for (a, b) in step.grads.grads.iter().zip(&grads.grads) {
                    assert_eq!(a.as_deref().map(bits), b.as_deref().map(bits), "{what}: dense gradient");
                }
                assert_eq!(step.finite, three.grad_x.iter().all(|v| v.is_finite()), "{what}: finite");
                // A NaN input reaches every gradient of its row; an infinite
                // one need not (LR's field weight: σ(∞) − y is finite).
                if poison.is_none() || poison.is_some_and(f32::is_nan) {
                    assert_eq!(step.finite, poison.is_none(), "{what}: the poison reaches the gradient");
                }
            }
        }
    }
}
