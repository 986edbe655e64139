//! `model.kind`: the dense network a job trains.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    Lr,
    Fm,
    Mlp,
    WideDeep,
    Deepfm,
    #[default]
    Dlrm,
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
    /// Every kind, in the README's order.
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
