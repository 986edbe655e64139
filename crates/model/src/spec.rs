//! A trained network as plain data: its structure and weights, for an
//! exporter (ONNX) that rebuilds its forward pass outside Sparrow.
//! `DenseModel::spec` fills it; the forward it describes is `forward_with`'s.

/// `y = x·W + b`, then ReLU if `relu`; `weight` is `[fan_in, fan_out]`
/// row-major.
#[derive(Clone, Debug)]
pub struct DenseLayer {
    pub fan_in: usize,
    pub fan_out: usize,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub relu: bool,
}

/// The network between the pooled embeddings `[N, fields, width]` plus the
/// dense values `[N, num_dense]`, and the logits `[N, outputs]`. "x" below
/// is the fields' vectors flattened, then the dense values.
#[derive(Clone, Debug)]
pub enum NetSpec {
    /// `lr` (width 1) and `fm` (`second_order`: width 1 + d): Σ_f column 0,
    /// plus ½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²] over columns 1.., plus
    /// `dense` on the dense values, plus `bias`.
    FirstOrder { second_order: bool, dense: Option<DenseLayer>, bias: f32 },
    /// `mlp`: the MLP on x.
    Mlp { layers: Vec<DenseLayer> },
    /// `wide_deep` / `deepfm` (`second_order`): the first-order part as
    /// above over column 0 (FM's second order over columns 1..), plus the
    /// MLP on x built from columns 1...
    WideDeep { second_order: bool, dense: Option<DenseLayer>, bias: f32, deep: Vec<DenseLayer> },
    /// `dlrm`: b = bottom(dense values) `[N, d]` (none without dense
    /// values); t = [b, v_1 … v_F] `[N, n, d]`; the dot products of every
    /// pair i < j of t's rows, row-major; the top MLP on [b, dots].
    Dlrm { bottom: Option<Vec<DenseLayer>>, top: Vec<DenseLayer> },
    /// `dcn`: x_{l+1} = x₀ ⊙ (x_l·W_l + b_l) + x_l for each cross layer
    /// (`relu` unset), then the MLP on the last x.
    Dcn { cross: Vec<DenseLayer>, deep: Vec<DenseLayer> },
}
