//! Small pieces several kinds build from: layer sizes, their flops and
//! parameter counts, and the MLP's input on candle's graph.

use candle_core::Tensor;

use super::At;
use crate::ModelError;
use crate::params::{Linear, ParamStore};

/// `hidden` then an output layer of `outputs`.
pub(crate) fn head(hidden: &[usize], outputs: usize) -> Vec<usize> {
    hidden.iter().copied().chain(std::iter::once(outputs)).collect()
}

/// The first-order weights of the dense values (none without them).
pub(crate) fn with_dense(ps: &mut ParamStore, num_dense: usize) -> Result<Option<Linear>, ModelError> {
    if num_dense == 0 { Ok(None) } else { Linear::new(ps, "dense_linear", num_dense, 1).map(Some) }
}

/// Flops a sample of a stack of layers `input → sizes…`, forward and
/// backward: `6·in·out` a layer (forward, weight gradient, input gradient).
pub(crate) fn stack_flops(input: f64, sizes: &[usize]) -> f64 {
    let mut fan_in = input;
    let mut total = 0.0;
    for &out in sizes {
        total += 6.0 * fan_in * out as f64;
        fan_in = out as f64;
    }
    total
}

/// Units of a stack's layers, all together.
pub(crate) fn units(sizes: &[usize]) -> u128 {
    sizes.iter().map(|&s| s as u128).sum()
}

/// Weights and biases of an MLP `input → sizes… → 1`.
pub(crate) fn mlp_params(input: u128, sizes: &[usize]) -> u128 {
    let mut fan_in = input;
    let mut n = 0u128;
    for &s in sizes.iter().chain(std::iter::once(&1)) {
        n += (fan_in + 1) * s as u128;
        fan_in = s as u128;
    }
    n
}

/// `v` `[B, F, d]` flattened, then the dense values: an MLP's input.
pub(crate) fn flat_with_dense(at: &At, v: &Tensor, dense: &Tensor) -> Result<Tensor, ModelError> {
    let (b, f, d) = v.dims3()?;
    let flat = v.reshape((b, f * d))?;
    Ok(if at.shape.num_dense > 0 { Tensor::cat(&[&flat, dense], 1)? } else { flat })
}

/// The fields' vectors without their first-order column: `emb[:, :, 1..]`.
pub(crate) fn vectors(at: &At, emb: &Tensor) -> Result<Tensor, ModelError> {
    Ok(emb.narrow(2, 1, at.shape.embedding_dim)?.contiguous()?)
}
