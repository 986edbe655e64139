//! A trained network as plain data: its structure and weights, for an
//! exporter (ONNX) that rebuilds its forward pass outside Sparrow.
//! `DenseModel::spec` fills it; the forward it describes is `forward_with`'s.

/// `y = x·W + b`, then (`norm`) a layer or batch norm, then the
/// `activation` if any; `weight` is `[fan_in, fan_out]` row-major.
#[derive(Clone, Debug)]
pub struct DenseLayer {
    pub fan_in: usize,
    pub fan_out: usize,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub activation: Option<ActivationSpec>,
    /// `model.norm`: the pre-activation normalized (before the activation).
    pub norm: Option<NormSpec>,
}

/// `model.activation` on z (see `sparrow_core::config::Activation`).
#[derive(Clone, Debug)]
pub enum ActivationSpec {
    Relu,
    /// z where z > 0, else `slope`·z.
    Prelu {
        slope: f32,
    },
    /// z·Φ(z), exact (ONNX's `Gelu`).
    Gelu,
    /// z·σ(z).
    Silu,
    /// z·(α + (1 − α)·σ(ẑ)), ẑ = (z − mean)/√(var + eps) per column.
    Dice {
        alpha: Vec<f32>,
        mean: Vec<f32>,
        var: Vec<f32>,
        eps: f32,
    },
}

/// `running: None` (`model.norm = "layer"`): y = (z − μ) / √(σ² + eps) ·
/// gamma + beta over a row's `fan_out` values (ONNX's
/// `LayerNormalization`, axis −1). `running` (`"batch"`, outside
/// training): the same with each column's running mean and variance
/// (in ONNX a subtraction and a product per column).
#[derive(Clone, Debug)]
pub struct NormSpec {
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    pub eps: f32,
    pub running: Option<RunningStats>,
}

/// A batch norm's running statistics, one value per column.
#[derive(Clone, Debug)]
pub struct RunningStats {
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
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
    /// `mmoe` / `ple`: level by level, each task's input (and the shared
    /// input) goes through the experts and is mixed by a softmax gate; each
    /// task's last mix goes through its tower (a task's outputs side by
    /// side). `esmm` (`esmm`, no levels): two towers on x, a CTR logit `a`
    /// and a CVR logit `b`; the outputs are `a` and logit(σ(a)·σ(b)) =
    /// −log(e^{−a} + e^{−b} + e^{−a−b}).
    MultiTask { esmm: bool, levels: Vec<LevelSpec>, towers: Vec<Vec<DenseLayer>> },
    /// `din`: for each `(slot, query)` pair, the sequence's slot becomes
    /// Σ_k unit([q, k, q − k, q ⊙ k])·k over its history items k (unpooled,
    /// the newest `max_len`), q being field `query`'s vector; then the MLP
    /// on x.
    Din { pairs: Vec<(usize, usize)>, units: Vec<Vec<DenseLayer>>, mlp: Vec<DenseLayer> },
    /// A kind written as generic operations ([`Op`]), in order: each
    /// op's value is a `[N, k]` matrix, the last op's is the logits. A new
    /// kind lowers itself to these (its `Net::spec`) and the exporter needs
    /// nothing new.
    Ops(Vec<Op>),
}

/// One operation of [`NetSpec::Ops`]; `usize` operands are earlier ops'
/// indices. "The fields" are the pooled vectors `[N, width]`, one a field.
#[derive(Clone, Debug)]
pub enum Op {
    /// Columns `start..end` of every field's vector, summed over the fields.
    SumFields {
        start: usize,
        end: usize,
    },
    /// The same columns squared, summed over the fields.
    SumFieldSquares {
        start: usize,
        end: usize,
    },
    /// Columns `start..end` of every field side by side, field after field.
    Fields {
        start: usize,
        end: usize,
    },
    /// The dense values `[N, num_dense]`.
    DenseValues,
    /// Element-wise, `[N, k]` each (a `[N, 1]` operand broadcasts).
    Add(usize, usize),
    Sub(usize, usize),
    Mul(usize, usize),
    /// Times a constant.
    Scale(usize, f32),
    /// Plus a constant.
    Offset(usize, f32),
    /// Side by side, in order.
    Concat(Vec<usize>),
    /// Through dense layers in order (`DenseLayer::relu` after each that sets it).
    Layers(usize, Vec<DenseLayer>),
}

/// One level of experts (each an MLP, ReLU after its last layer too) and
/// their gates (a linear layer over the level's input, then a softmax).
#[derive(Clone, Debug)]
pub struct LevelSpec {
    /// The shared experts, on the shared input.
    pub shared: Vec<Vec<DenseLayer>>,
    /// Each task's own experts (PLE), on that task's input.
    pub own: Vec<Vec<Vec<DenseLayer>>>,
    /// Task t's gate reads task t's input and mixes its own experts then
    /// the shared ones (MMoE: the shared ones only).
    pub gates: Vec<DenseLayer>,
    /// PLE below the top: the shared gate, over the shared input, mixing
    /// the shared experts then every task's own, task by task; its mix is
    /// the next level's shared input.
    pub shared_gate: Option<DenseLayer>,
}
