//! `model.norm`: what normalizes the MLP stacks' activated layers, as
//! written (`NormSetting`, `auto` by default) and as a kind resolves it
//! (`Norm`; the model crate's `kinds::stack_style` asks the kind).

use serde::{Deserialize, Serialize};

/// `model.norm`: what normalizes the MLP stacks' activated layers.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// Nothing.
    #[default]
    None,
    /// Layer norm of each row's pre-activation (PyTorch's LayerNorm, ε 1e-5,
    /// learned γ and β), before the ReLU.
    Layer,
    /// Batch norm of each column of the pre-activation (PyTorch's
    /// BatchNorm1d, ε 1e-5, learned γ and β), before the ReLU: a training
    /// step normalizes by its batch's statistics and moves running ones;
    /// evaluation and serving normalize by the running ones.
    Batch,
}

/// `model.norm` as written: a norm for every kind, or each kind's own.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NormSetting {
    /// The kind's own: `batch` for `din` (its MLP; the DIN paper's and
    /// torch-rechub's DIN normalize by the batch, and on a real behaviour
    /// log it was worth 0.010 of validation AUC to DIN and 0.001 to sum
    /// pooling: docs/benchmarks.md, "On real logs"), `none` for every other
    /// kind (batch norm cost the shared-bottom model 0.014 of validation AUC
    /// on a real tabular log).
    #[default]
    Auto,
    /// Nothing.
    None,
    /// Layer norm of each row's pre-activation (PyTorch's LayerNorm, ε 1e-5,
    /// learned γ and β), before the ReLU.
    Layer,
    /// Batch norm of each column of the pre-activation (PyTorch's
    /// BatchNorm1d, ε 1e-5, learned γ and β), before the ReLU: a training
    /// step normalizes by its batch's statistics and moves running ones;
    /// evaluation and serving normalize by the running ones.
    Batch,
}

impl From<Norm> for NormSetting {
    /// That norm, whatever the kind.
    fn from(norm: Norm) -> NormSetting {
        match norm {
            Norm::None => NormSetting::None,
            Norm::Layer => NormSetting::Layer,
            Norm::Batch => NormSetting::Batch,
        }
    }
}
