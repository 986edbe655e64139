//! `model.kind`: the dense network a job trains.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Logistic regression: one weight per ID and per dense value.
    Lr,
    /// Factorization machine: first-order terms plus pairwise dot products.
    Fm,
    /// The fields' pooled vectors and the dense values, concatenated, into an MLP.
    Mlp,
    /// Wide & Deep: a linear part (one weight per ID) beside an MLP.
    WideDeep,
    /// DeepFM: an FM beside an MLP over the same vectors.
    Deepfm,
    /// DLRM: a bottom MLP on the dense values, pairwise dot products of
    /// every vector, a top MLP.
    #[default]
    Dlrm,
    /// DCN-v2: `cross_layers` cross layers beside an MLP.
    Dcn,
    /// Several tasks: ESMM's CTR and CTCVR towers.
    Esmm,
    /// Several tasks: shared experts, a gate and a tower per task.
    Mmoe,
    /// Several tasks: shared and task experts, progressive extraction.
    Ple,
    /// A behaviour sequence pooled by attention: each history item weighed
    /// against the candidate item (DIN).
    Din,
}

impl ModelKind {
    /// The one-task kinds, in the book's order (docs/book/src/models.md).
    pub const ALL: [ModelKind; 7] = [
        ModelKind::Lr,
        ModelKind::Fm,
        ModelKind::Mlp,
        ModelKind::WideDeep,
        ModelKind::Deepfm,
        ModelKind::Dlrm,
        ModelKind::Dcn,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Lr => "lr",
            ModelKind::Fm => "fm",
            ModelKind::Mlp => "mlp",
            ModelKind::WideDeep => "wide_deep",
            ModelKind::Deepfm => "deepfm",
            ModelKind::Dlrm => "dlrm",
            ModelKind::Dcn => "dcn",
            ModelKind::Esmm => "esmm",
            ModelKind::Mmoe => "mmoe",
            ModelKind::Ple => "ple",
            ModelKind::Din => "din",
        }
    }

    /// The kinds built for several tasks (experts, towers).
    pub const MULTI_TASK: [ModelKind; 3] = [ModelKind::Esmm, ModelKind::Mmoe, ModelKind::Ple];

    pub fn is_multi_task(self) -> bool {
        Self::MULTI_TASK.contains(&self)
    }
}
