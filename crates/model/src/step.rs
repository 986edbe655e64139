//! What the kinds (`kinds/`) and the model that drives them
//! (`models.rs`) share, below both: the input's shape, the direct step's
//! buffers, one row's loss, a linear layer as exported data.

use sparrow_core::metrics::logistic_loss_and_sigmoid;

use crate::ModelError;
use crate::mlp::MlpScratch;
use crate::params::Linear;
use crate::spec::DenseLayer;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub num_fields: usize,
    pub num_dense: usize,
    pub embedding_dim: usize,
}

/// Buffers of the direct step, kept between steps (each kind uses those it needs).
#[derive(Default)]
pub struct Scratch {
    /// The deep (DLRM: top) MLP's.
    pub(crate) deep: MlpScratch,
    /// DLRM's bottom MLP's.
    pub(crate) bottom: MlpScratch,
    /// The deep MLP's input rows where they are not the input's (Wide&Deep
    /// and DeepFM: without the first-order columns; DLRM: the top MLP's).
    pub(crate) x: Vec<f32>,
    /// DLRM: the dense values alone (the bottom MLP's input).
    pub(crate) dense: Vec<f32>,
    /// DCN-v2: each cross layer's output and gate.
    pub(crate) cross_out: Vec<Vec<f32>>,
    pub(crate) gates: Vec<Vec<f32>>,
    /// FM and DeepFM: each row's Σ_f v_f from the forward pass, for the backward.
    pub(crate) fm_sums: Vec<f32>,
    /// d loss / d input, in the input's layout: what the step hands back.
    pub(crate) grad_x: Vec<f32>,
    /// Backward buffers: DCN-v2's gradients at a layer's input and at its
    /// gate; DLRM's at the bottom MLP's output.
    pub(crate) grad_in: Vec<f32>,
    pub(crate) grad_gate: Vec<f32>,
    pub(crate) grad_t: Vec<f32>,
}

/// One row of `DenseModel::loss_and_seed`: its loss times
/// `weight`, and d (mean loss) / d logit (`inv_b`: one over the rows).
#[inline]
pub(crate) fn loss_and_seed_row(logit: f32, label: f32, weight: f64, inv_b: f64) -> (f64, f32) {
    // A masked label (`data.schema.labels`, an empty cell) adds nothing.
    if label.is_nan() {
        return (0.0, 0.0);
    }
    let (loss, p) = logistic_loss_and_sigmoid(f64::from(logit), f64::from(label));
    (weight * loss, ((p - f64::from(label)) * weight * inv_b) as f32)
}

/// A linear layer's weights as exported data.
pub(crate) fn linear_spec(l: &Linear) -> Result<DenseLayer, ModelError> {
    let (w, b) = (l.weight().as_tensor(), l.bias().as_tensor());
    let (fan_in, fan_out) = w.dims2()?;
    Ok(DenseLayer { fan_in, fan_out, weight: w.flatten_all()?.to_vec1()?, bias: b.to_vec1()?, relu: false })
}
