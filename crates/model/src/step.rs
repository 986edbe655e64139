//! What the kinds (`kinds/`) and the model that drives them
//! (`models.rs`) share, below both: the input's shape, the direct step's
//! buffers, one row's loss, a linear layer as exported data.

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

/// A batch's behaviour sequences, unpooled, for a model that attends over
/// them: one entry per sequence field, in `DenseModel::attention`'s order.
#[derive(Clone, Debug, Default)]
pub struct Sequences {
    /// Per field: the row each history position belongs to (ascending).
    pub rows: Vec<Vec<u32>>,
    /// Per field: each position's embedding row, `[positions × width]`.
    pub items: Vec<Vec<f32>>,
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
    /// Whether the backward pass found every value of `grad_x` finite as it
    /// wrote it (false: not checked there; the step checks it after).
    pub(crate) grad_x_finite: bool,
    /// Backward buffers: DCN-v2's gradients at a layer's input and at its
    /// gate; DLRM's at the bottom MLP's output.
    pub(crate) grad_in: Vec<f32>,
    pub(crate) grad_gate: Vec<f32>,
    pub(crate) grad_t: Vec<f32>,
    /// A kind that attends: the batch's sequences (moved in for the step,
    /// checked against the batch) and, after the backward pass, d loss / d
    /// each history item, as [`Sequences::items`].
    pub(crate) sequences: Sequences,
    pub(crate) item_grads: Vec<Vec<f32>>,
    /// Buffers of a kind whose step needs its own (the multi-task kinds', DIN's).
    pub(crate) kind: Option<Box<dyn std::any::Any + Send>>,
    /// A step run as two halves (`models/halves.rs`): the second half's
    /// buffers (these are the first's).
    pub(crate) second_half: Option<Box<Scratch>>,
}

impl Scratch {
    /// The kind's own buffers, made on first use (and again if another
    /// kind's were left here).
    pub(crate) fn of_kind<T: Default + Send + 'static>(&mut self) -> &mut T {
        if !self.kind.as_ref().is_some_and(|k| k.is::<T>()) {
            self.kind = Some(Box::new(T::default()));
        }
        self.kind.as_mut().and_then(|k| k.downcast_mut::<T>()).expect("made above")
    }
}

/// A linear layer's weights as exported data.
pub(crate) fn linear_spec(l: &Linear) -> Result<DenseLayer, ModelError> {
    let (w, b) = (l.weight().as_tensor(), l.bias().as_tensor());
    let (fan_in, fan_out) = w.dims2()?;
    Ok(DenseLayer {
        fan_in,
        fan_out,
        weight: w.flatten_all()?.to_vec1()?,
        bias: b.to_vec1()?,
        activation: None,
        norm: None,
    })
}
