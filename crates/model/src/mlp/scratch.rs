//! The buffers of an MLP's step, kept from step to step.

use super::amx_kept;

/// Buffers of one MLP step, kept between steps: a step reuses them instead of
/// allocating and zero-filling ~5 MB (at batch 1024) every time.
#[derive(Default)]
pub struct MlpScratch {
    /// Outputs of the hidden layers (after ReLU).
    pub(super) hidden: Vec<Vec<f32>>,
    /// Output of the last layer.
    pub output: Vec<f32>,
    /// Gradient at the current layer while going backward; d input at the end.
    pub grad_input: Vec<f32>,
    pub(super) grad_next: Vec<f32>,
    /// A used parameter gradient handed back (`DenseModel::recycle`) for
    /// the next backward pass to fill instead of allocating.
    pub spare_grad: Vec<f32>,
    pub(super) rows: usize,
    /// What the forward pass's dropout scaled kept values by (1: none).
    pub(super) dropout_scale: f32,
    /// `model.norm`: each layer's x̂ and 1/σ̂ (per row for `layer`, per column for `batch`).
    pub(super) normed: Vec<Vec<f32>>,
    pub(super) inv_std: Vec<Vec<f32>>,
    /// A training pass's batch statistics, laid out as the running ones.
    pub(super) batch_stats: Vec<f32>,
    /// Whether the last forward pass was a training one.
    pub(super) trained: bool,
    /// Its dropout draw (an activation other than ReLU reapplies the masks
    /// to the gradient), and where its rows start in the batch (the masks
    /// are drawn by a value's place in the whole batch).
    pub(super) draw: Option<u64>,
    pub(super) first_row: usize,
    /// What each layer's activation other than ReLU kept.
    pub(super) acts: Vec<crate::activation::ActScratch>,
    /// bf16 on a CPU without a bf16 dot product: the pass's rounded operands.
    pub(super) rounded: crate::bf16_rounded::RoundedOperands,
    /// A half's pass of a batch run in halves: the weights it read (`met.rs`).
    pub(super) weights: Vec<f32>,
    /// bf16 on AMX: the pass's outputs kept as tiles.
    pub(super) tiles: amx_kept::KeptTiles,
}

impl MlpScratch {
    /// Whether the last backward pass checked `grad_input` and found every
    /// value finite (false: not checked there, or not finite).
    pub(crate) fn grad_input_finite(&self) -> bool {
        self.tiles.input_grad_finite()
    }
}
