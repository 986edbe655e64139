//! An MLP whose first layer's product its caller computes from the
//! input's parts, the input itself never laid out: DIN's local activation
//! unit reads `[q, k, q − k, q ⊙ k]`, whose product with `W` is
//! `q·(W_q + W_d) + [k, q ⊙ k]·[W_k − W_d; W_p]`, the first term once a
//! row, not once a history item (`kinds/din/product.rs`).

use super::{Mlp, MlpScratch, MlpShape, cpu};
use crate::ModelError;
use crate::bf16::{Arith, PackedLeft};
use sparrow_core::config::Activation;

/// The first layer's product from the input's parts (fp32). Its bias and
/// a ReLU right after it (no norm between) are applied in the same pass
/// over its output as the parts' sum, forward and backward: on DIN's
/// thousands of history items by `[36]`, each pass of its own cost as
/// much as the product's arithmetic.
pub(crate) trait FirstProduct: Send {
    /// `out = input·W + b` (`[rows, fan_out]`), through a ReLU where
    /// `relu`.
    fn forward(&mut self, w: &[f32], rows: usize, fan_out: usize, bias_and_relu: (&[f32], bool), out: &mut [f32]);
    /// From `g = d loss / d out`: first through the ReLU where `relu` is
    /// given (its output and dropout's scale, as `relu_mask`; `g` is
    /// written where [`FirstGrad`] says), then `db += Σ_rows g` in the
    /// rows' order, `dW = inputᵀ·g` (every element written, or left to
    /// the product's owner to write once the call returns: the towers side
    /// by side of `one_input_towers.rs`), and d input as the caller keeps
    /// it.
    fn backward(
        &mut self,
        w: &[f32],
        rows_and_fan_out: (usize, usize),
        g_and_relu: (FirstGrad<'_>, Option<(&[f32], f32)>),
        dw_and_db: (&mut [f32], &mut [f32]),
    );
    /// Whether [`backward`](Self::backward) sums the next layer's weights'
    /// gradient ([`FirstGrad::Outer`]'s `next_dw`) for a first layer of
    /// `fan_out` outputs, with the one-column product's bits and in as
    /// little time: where its kernels run (else the product does it).
    fn sums_next_dw(&self, fan_out: usize) -> bool {
        let _ = fan_out;
        false
    }
}

/// The gradient at the first layer's output.
pub(crate) enum FirstGrad<'a> {
    /// Laid out `[rows, fan_out]`, rewritten in place.
    Laid(&'a mut [f32]),
    /// Not laid out: the next layer has one output and no activation, so
    /// `g[r][c] = seed[r]·w[c]` (its output's gradient times its weights,
    /// one rounded product each, as `matrix::is_outer` says the product
    /// would be). Computed where the ReLU pass reads it and written to
    /// `into` (`[rows, fan_out]`): one pass over DIN's `[items, 36]`, not
    /// two. `next_dw`, where given, is the next layer's input (this
    /// layer's output, `[rows, fan_out]`) and its weights' gradient
    /// `xᵀ·seed` to write, summed in the same pass as the product sums
    /// it (`matrix::column`: the first row's product, then each next one
    /// fused in, in order): that pass read all of DIN's `[items, 36]`
    /// again, 6% of its step.
    Outer { seed: &'a [f32], w: &'a [f32], into: &'a mut [f32], next_dw: Option<(&'a [f32], &'a mut [f32])> },
}

/// An MLP pass's input: laid out, or computed into the first layer.
pub(crate) enum First<'a> {
    Input(&'a [f32]),
    /// Laid out, and packed as bf16 pairs for the first layer's product
    /// of this pass (forward `x·W` or backward `xᵀ·g`) by a caller that
    /// runs several stacks on it (`bf16/lent.rs`).
    Packed(&'a [f32], &'a PackedLeft),
    Product(&'a mut dyn FirstProduct),
}

impl<'a> First<'a> {
    /// The first layer's operand packed by the caller, if any.
    pub(super) fn packed(&self) -> Option<&'a PackedLeft> {
        match self {
            First::Packed(_, packed) => Some(packed),
            _ => None,
        }
    }

    /// The laid-out input (none for a product).
    pub(super) fn laid(&self) -> &'a [f32] {
        match self {
            First::Input(x) | First::Packed(x, _) => x,
            First::Product(_) => &[],
        }
    }
}

impl Mlp {
    /// [`forward_cpu`](Self::forward_cpu) with the first layer's product
    /// computed by `first` (fp32 stacks: [`is_f32`](Self::is_f32)).
    pub(crate) fn forward_cpu_from(
        &self,
        first: &mut dyn FirstProduct,
        rows: usize,
        draw: Option<u64>,
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        self.forward_cpu_from_at(first, (rows, 0), draw, scratch)
    }

    /// [`forward_cpu_from`](Self::forward_cpu_from) on rows that start at
    /// row `first_row` of the batch (as [`forward_cpu_at`](Self::forward_cpu_at)).
    pub(crate) fn forward_cpu_from_at(
        &self,
        first: &mut dyn FirstProduct,
        (rows, first_row): (usize, usize),
        draw: Option<u64>,
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        let running = if draw.is_some() { Vec::new() } else { self.running_values()? };
        {
            let (ps, pl) = self.params.storage_and_layout();
            let (p, input) = ((cpu(&ps, pl)?, &running[..]), First::Product(first));
            crate::meet::unmet(super::forward_into(&self.shape, p, input, (rows, first_row), (draw, None), scratch))?;
        }
        self.hand_on(draw, rows, &scratch.batch_stats)
    }

    /// Backward pass of the last [`forward_cpu_from`](Self::forward_cpu_from):
    /// d params; d input is `first`'s to keep.
    pub(crate) fn backward_cpu_from(
        &self,
        first: &mut dyn FirstProduct,
        grad_out: &[f32],
        scratch: &mut MlpScratch,
    ) -> Result<Vec<f32>, ModelError> {
        let (ps, pl) = self.params.storage_and_layout();
        let input = (First::Product(first), (grad_out, false));
        crate::meet::unmet(super::backward_into(&self.shape, cpu(&ps, pl)?, input.0, input.1, (scratch, None)))
    }

    /// Where its first layer's weights `W` (`[fan_in, fan_out]`, row-major)
    /// sit in its parameters: `(offset, fan_in, fan_out)`.
    pub(crate) fn first_weights(&self) -> Option<(usize, usize, usize)> {
        self.shape.layers.first().map(|l| (l.w, l.fan_in, l.fan_out))
    }

    /// How its products run.
    pub(crate) fn arith(&self) -> Arith {
        self.shape.arith
    }
}

/// Whether the last layer's d input goes to the first layer's product as
/// [`FirstGrad::Outer`], not laid out: two layers, the first a product
/// with at most a ReLU (which the product applies), the last of one output
/// with no activation or norm (DIN's unit, `[36] → 1`; ESMM's towers,
/// `[32] → 1`), in fp32 where `sgemm` takes d input as an outer product
/// (a head is fp32 in a bf16 stack too, `NARROW_OUTPUTS`: the same bits).
pub(super) fn outer_to_first(shape: &MlpShape, x: &First<'_>, rows: usize) -> bool {
    let [first, last] = &shape.layers[..] else { return false };
    let first_plain = first.norm.is_none() && (!first.relu || shape.activation == Activation::Relu);
    let last_plain = last.fan_out == 1 && !last.relu && last.norm.is_none();
    let outer = last.arith.is_f32() && crate::matrix::is_outer(rows, last.fan_in, 1);
    matches!(x, First::Product(_)) && first_plain && last_plain && outer
}

/// Whether, with the last layer's d input given to the first layer's
/// product ([`outer_to_first`]), that product's pass sums the last layer's
/// dW too (`FirstGrad::Outer`'s `next_dw`), where its kernels do
/// ([`FirstProduct::sums_next_dw`]).
pub(super) fn next_dw_in_pass(shape: &MlpShape, x: &First<'_>, outer_to_first: bool) -> bool {
    match (x, shape.layers.first()) {
        (First::Product(first), Some(l)) => outer_to_first && first.sums_next_dw(l.fan_out),
        _ => false,
    }
}
