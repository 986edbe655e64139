//! The model kinds. Each is a type in its own file (`kinds/<name>.rs`)
//! that implements [`Kind`]: its checks of the config, its network (built
//! on a [`ParamStore`], with candle's graph step and, where it has one, the
//! direct CPU step), its exported structure (the ONNX export lowers it),
//! its flops and its size. [`KINDS`] is the registry: `model.kind` names
//! one of its entries. Adding a kind is a new file here and a line in
//! [`KINDS`] (docs/book/src/models.md says how).
//!
//! Shared pieces (first-order terms, the experts of the multi-task kinds)
//! are parts in their own files, not kinds.

use candle_core::{Device, Tensor, Var};
use sparrow_core::config::{ModelConfig, ModelKind, Norm, NormSetting};
use sparrow_core::{Config, ConfigError};

use crate::ModelError;
use crate::bf16::Arith;
use crate::fused::Simd;
use crate::heads::Heads;
use crate::meet::Side;
use crate::mlp::{Mlp, MlpScratch, StackStyle};
use crate::params::ParamStore;
use crate::spec::NetSpec;
use crate::step::{ModelShape, Scratch};

mod beside;
mod dcn;
mod deepfm;
mod din;
mod dlrm;
mod esmm;
pub(crate) mod first_order;
mod fm;
mod lr;
mod mlp;
mod mmoe;
mod multitask;
mod nfm;
pub(crate) mod parts;
mod ple;
mod wide_deep;

/// Every kind `model.kind` can name, in the book's order (one-task kinds
/// first). A new kind adds its line here.
pub const KINDS: &[&dyn Kind] = &[
    &lr::Lr,
    &fm::Fm,
    &mlp::MlpKind,
    &wide_deep::WideDeep,
    &deepfm::DeepFm,
    &dlrm::Dlrm,
    &dcn::Dcn,
    &nfm::Nfm,
    &esmm::Esmm,
    &mmoe::Mmoe,
    &ple::Ple,
    &din::Din,
];

/// What a kind is built for: the book groups kinds by it, and `sparrow
/// bench` times the one-task kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// One or more tasks on a shared body.
    OneTask,
    /// Built for several tasks (experts, towers).
    MultiTask,
    /// Attends over behaviour sequences.
    Sequence,
}

/// A model kind: everything the rest of Sparrow asks of it.
pub trait Kind: Sync {
    /// Its `model.kind` name.
    fn name(&self) -> &'static str;

    /// One line for the config reference and `sparrow kinds`.
    fn about(&self) -> &'static str;

    fn family(&self) -> Family {
        Family::OneTask
    }

    /// Floats per embedding row it reads (a first-order weight, then the vector).
    fn embedding_width(&self, embedding_dim: usize) -> usize {
        embedding_dim
    }

    /// Whether it has matrix products (a deep part): without them it has one
    /// output, and `model.precision = "bf16"` changes nothing.
    fn has_products(&self) -> bool {
        true
    }

    /// Whether it reads the batch's behaviour sequences unpooled.
    fn attends(&self) -> bool {
        false
    }

    /// Its MLP stacks' norm when `model.norm` is `auto` (the default). A
    /// checkpoint stores `auto`, so this is part of its models' format.
    fn default_norm(&self) -> Norm {
        Norm::None
    }

    /// Its own refusals of a config, each naming the key.
    fn check(&self, _config: &Config) -> Result<(), ConfigError> {
        Ok(())
    }

    /// Its network, its parameters registered on `at.ps` (their order is the
    /// checkpoint's).
    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError>;

    /// The dense step's arithmetic floor, flops per sample (see
    /// `DenseModel::step_flops_per_sample`).
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64;

    /// What each history item of a sample adds to that floor (a kind that
    /// attends runs its attention once an item); 0 for the others.
    fn step_flops_per_history_item(&self, _config: &ModelConfig, _shape: ModelShape) -> f64 {
        0.0
    }

    /// Its dense parameters (weights and biases; a bound where the exact
    /// count needs the tasks' outputs).
    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128;

    /// Floats a batch row needs in the step beyond the pooled rows and the
    /// widest layer (DCN-v2's cross inputs; the multi-task kinds' experts,
    /// mixes and towers; DIN's attention over each history item), for the
    /// memory estimate: floats a unit and row at or below what the step was
    /// measured to hold (peak memory), so a refusal is of a job that could
    /// not fit.
    fn step_floats_per_row(&self, _config: &Config, _shape: ModelShape) -> u128 {
        0
    }
}

/// What a kind's [`Kind::build`] builds on.
pub struct Build<'a> {
    pub ps: &'a mut ParamStore,
    pub config: &'a ModelConfig,
    pub shape: ModelShape,
    pub heads: &'a Heads,
    /// Each sequence's slot among the fields and its candidate's.
    pub pairs: &'a [(usize, usize)],
    pub arith: Arith,
    pub simd: Simd,
    pub device: &'a Device,
}

impl Build<'_> {
    /// Logits a row: the tasks' outputs side by side.
    pub fn outputs(&self) -> usize {
        self.heads.outputs()
    }

    /// Whether the MLP stacks' activated layers are normalized (`model.norm`).
    pub fn normed(&self) -> crate::mlp::StackStyle {
        stack_style(self.config)
    }

    /// The fields' vectors (without a first-order column) and the dense
    /// values, flattened: an MLP's input.
    pub fn flat_len(&self) -> usize {
        self.shape.num_fields * self.shape.embedding_dim + self.shape.num_dense
    }
}

/// The layout a built network's steps read.
#[derive(Clone, Copy, Debug)]
pub struct At {
    pub shape: ModelShape,
    /// Floats per field (the kind's embedding width).
    pub width: usize,
    pub simd: Simd,
    /// A training step's dropout draw (`model.dropout`; see `dropout.rs`):
    /// `None` outside training, where nothing is dropped.
    pub dropout: Option<u64>,
    /// The batch's row the step's input starts at: 0, or where the second
    /// half starts for a batch run in halves (`models/halves.rs`), so that
    /// dropout draws each value by its place in the whole batch.
    pub first_row: usize,
}

impl At {
    /// The same layout for a step whose dropout draw is `draw`.
    pub fn drawn(self, draw: Option<u64>) -> At {
        At { dropout: draw, ..self }
    }

    /// The same layout for rows that start at the batch's row `first_row`.
    pub fn from_row(self, first_row: usize) -> At {
        At { first_row, ..self }
    }

    /// Floats of a packed input row: `[pooled embeddings | dense values]`.
    pub fn row_len(&self) -> usize {
        self.shape.num_fields * self.width + self.shape.num_dense
    }
}

/// The gradients of the dense parameters, in any order, keyed by parameter.
pub type Grads<'a> = Vec<(&'a Var, Vec<f32>)>;

/// A half's pass of a batch run in halves, which may wait to meet the
/// other half (`meet.rs`).
pub type Met<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, ModelError>> + Send + 'a>>;

/// A built network.
pub trait Net: Send + Sync {
    /// Logits `[batch, outputs]` (candle's graph: every device, autograd)
    /// from pooled embeddings `[batch, fields, width]`, dense values
    /// `[batch, num_dense]` and each sequence's items and rows.
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, items: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError>;

    /// Its structure and weights, for an exporter.
    fn spec(&self) -> Result<NetSpec, ModelError>;

    /// Each sequence's slot and its candidate's (a kind that attends).
    fn attention(&self) -> &[(usize, usize)] {
        &[]
    }

    /// Its step on CPU outside candle's graph, if it has one.
    fn direct(&self) -> Option<&dyn Direct> {
        None
    }
}

/// What one pass of a whole step ([`Direct::whole_step`]) computed.
pub struct WholeStep<'a> {
    pub loss: f64,
    pub logits: Vec<f32>,
    pub grads: Grads<'a>,
    /// Whether every value of the input gradient (`Scratch::grad_x`) is finite.
    pub finite: bool,
}

/// A direct CPU step on packed input rows (see [`At::row_len`]): the same
/// math as [`Net::forward`] and its autograd (tested for each kind). A
/// kind that attends reads the batch's sequences from `Scratch::sequences`
/// (the driver moves them in, checked) and leaves their items' gradients
/// in `Scratch::item_grads`.
///
/// A kind implements [`forward`](Direct::forward) and
/// [`backward`](Direct::backward), or, where its step in halves meets at
/// batch statistics, [`forward_met`](Direct::forward_met) and
/// [`backward_met`](Direct::backward_met): each pair's defaults run the
/// other's.
pub trait Direct: Sync {
    /// Logits of `rows` input rows `x`; what the backward pass needs stays in `s`.
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        crate::meet::unmet(self.forward_met(at, (x, rows), s, None))
    }

    /// The backward pass of the last [`forward`](Self::forward) on the same
    /// input and scratch from `seed = d loss / d logits`: the dense
    /// gradients into `grads`, d loss / d input (the input's layout) into
    /// `s.grad_x`.
    fn backward<'a>(
        &'a self,
        at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        grads.extend(crate::meet::unmet(self.backward_met(at, (x, seed), s, None))?);
        Ok(())
    }

    /// [`forward`](Self::forward), on a half of a batch run in halves
    /// (`meet`), its batch statistics met with the other half's where the
    /// kind [`meets_statistics`](Self::meets_statistics).
    fn forward_met<'a>(
        &'a self,
        at: &'a At,
        (x, rows): (&'a [f32], usize),
        s: &'a mut Scratch,
        _meet: Option<Side<'a>>,
    ) -> Met<'a, Vec<f32>> {
        Box::pin(async move { self.forward(at, x, rows, s) })
    }

    /// [`backward`](Self::backward) after a [`forward_met`](Self::forward_met):
    /// the dense gradients.
    fn backward_met<'a: 'b, 'b>(
        &'a self,
        at: &'b At,
        (x, seed): (&'b [f32], &'b [f32]),
        s: &'b mut Scratch,
        _meet: Option<Side<'b>>,
    ) -> Met<'b, Grads<'a>> {
        Box::pin(async move {
            let mut grads = Vec::new();
            self.backward(at, x, seed, s, &mut grads)?;
            Ok(grads)
        })
    }

    /// Whether its step in halves meets the other half at its batch
    /// statistics ([`forward_met`](Self::forward_met)): where it does not,
    /// a model whose layers keep batch statistics runs its batches whole.
    fn meets_statistics(&self) -> bool {
        false
    }

    /// Forward, loss and backward in one pass over the batch, where the
    /// kind has such a pass (the first-order kinds); `None` otherwise.
    fn whole_step<'a>(
        &'a self,
        _at: &At,
        _x: &[f32],
        _labels: &[f32],
        _weights: Option<&[f32]>,
        _s: &mut Scratch,
    ) -> Result<Option<WholeStep<'a>>, ModelError> {
        Ok(None)
    }

    /// Its MLPs and their buffers (a spent gradient buffer goes back to one).
    fn mlps<'s>(&'s self, _s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        Vec::new()
    }

    /// Whether it takes several tasks' outputs (its logits `[rows,
    /// outputs]`, each task's seed in its columns); a kind built around one
    /// logit (a first-order term added to it) says no, and several tasks
    /// take its graph step.
    fn several_outputs(&self) -> bool {
        false
    }

    /// The fewest rows a half of a batch takes where its step may run a
    /// batch as two halves, one a thread (`models/halves.rs`); `None`
    /// where it may not. A kind says so where no pass reads the batch as
    /// a whole, its MLPs' dropout is drawn from [`At::first_row`], and its
    /// passes are too small to split across threads one by one. The
    /// driver also checks that no layer keeps batch statistics, unless the
    /// kind [`meets_statistics`](Self::meets_statistics).
    fn half_rows(&self) -> Option<usize> {
        None
    }
}

/// The least work of a half of a batch run as two halves, one a thread
/// (`Direct::half_rows`, `models/halves.rs`): on the 2-core VMs measured (session 50) waking
/// the other thread took 20–30 µs, and a step wakes it twice (forward,
/// then backward after the loss); 8 Mflop is some 80 µs of one core.
/// ESMM's towers of 32 on 41 inputs (16k flops a row) split a batch of
/// 1024 and not one of 256, whose halves measured slower in the median.
const HALF_FLOPS: usize = 8_000_000;

/// Rows a half takes at least, whatever its work.
const MIN_HALF_ROWS: usize = 64;

/// The fewest rows a half takes for a kind whose step does `flops_per_row`
/// a row ([`HALF_FLOPS`], [`MIN_HALF_ROWS`]).
pub(crate) fn half_rows_for(flops_per_row: usize) -> usize {
    HALF_FLOPS.div_ceil(flops_per_row.max(1)).max(MIN_HALF_ROWS)
}

/// The kind `model.kind` names.
pub fn find(kind: &ModelKind) -> Result<&'static dyn Kind, ModelError> {
    KINDS
        .iter()
        .copied()
        .find(|k| kind.is(k.name()))
        .ok_or_else(|| ModelError::UnknownKind { kind: kind.name().to_string(), known: names().join(", ") })
}

/// The model's MLP stacks' style: `model.norm` as written, or its kind's
/// own for `auto` (an unknown kind builds nothing; it is refused by name
/// where the model is built).
pub fn stack_style(config: &ModelConfig) -> StackStyle {
    let norm = match config.norm {
        NormSetting::Auto => find(&config.kind).map_or(Norm::None, |k| k.default_norm()),
        NormSetting::None => Norm::None,
        NormSetting::Layer => Norm::Layer,
        NormSetting::Batch => Norm::Batch,
    };
    StackStyle::with(config, norm)
}

/// The kind `config` names, or a config error naming `model.kind` and the kinds there are.
pub fn configured(config: &Config) -> Result<&'static dyn Kind, ConfigError> {
    find(&config.model.kind).map_err(|_| ConfigError::Invalid {
        key: "model.kind".into(),
        message: format!("\"{}\" is not a kind; the kinds are {}", config.model.kind, names().join(", ")),
    })
}

/// The registry's names, in its order.
pub fn names() -> Vec<&'static str> {
    KINDS.iter().map(|k| k.name()).collect()
}

/// The kinds of a family, in the registry's order.
pub fn of_family(family: Family) -> impl Iterator<Item = &'static dyn Kind> {
    KINDS.iter().copied().filter(move |k| k.family() == family)
}

/// `model.kind` is a kind of the registry, and the config suits it: the
/// checks that need the kinds (the rest of the config is checked as it is
/// parsed).
pub fn check(config: &Config) -> Result<(), ConfigError> {
    let kind = configured(config)?;
    let tasks = config.tasks();
    if !kind.has_products() && (tasks.len() > 1 || !tasks[0].is_binary()) {
        return Err(ConfigError::Invalid {
            key: "model.tasks".into(),
            message: format!(
                "model.kind = \"{}\" has one output (no hidden layer to share): several tasks or a multiclass \
                 task need a kind with a deep part",
                kind.name()
            ),
        });
    }
    check_batch_statistics(kind, config)?;
    kind.check(config)
}

/// A layer normalized by its batch (batch norm, `model.norm`'s `batch`, as
/// DIN's `auto` is; Dice's own normalization) needs batches of two rows or
/// more: one row's variance is 0, so the layer's output is its shift
/// whatever the input, nothing below it learns, and the running variance
/// each step moves towards 0 leaves evaluation dividing by √ε (a log-loss
/// in the hundreds, trained without a word). PyTorch refuses such a batch
/// too.
fn check_batch_statistics(kind: &dyn Kind, config: &Config) -> Result<(), ConfigError> {
    use sparrow_core::config::Activation;
    let m = &config.model;
    let (norm, dice) = ("model.norm = \"none\" or \"layer\"", "another activation");
    let by_batch = if stack_style(m).norm == Norm::Batch {
        let what = match m.norm {
            NormSetting::Auto => format!("model.norm = \"auto\" (batch norm for {})", kind.name()),
            _ => "model.norm = \"batch\"".to_string(),
        };
        Some((what, norm))
    } else if m.activation == Activation::Dice {
        Some(("model.activation = \"dice\"".to_string(), dice))
    } else if kind.attends() && m.attention_activation == Activation::Dice {
        Some(("model.attention_activation = \"dice\"".to_string(), dice))
    } else {
        None
    };
    match by_batch {
        Some((what, instead)) if kind.has_products() && config.train.batch_size < 2 => Err(ConfigError::Invalid {
            key: "train.batch_size".into(),
            message: format!(
                "{what} normalizes each column over a batch's rows: a batch of {} row has no variance to \
                 normalize by (use 2 or more, or {instead})",
                config.train.batch_size
            ),
        }),
        _ => Ok(()),
    }
}

/// The registry's kinds in a JSON Schema's `oneOf` (name and line), for
/// `definitions.ModelKind`: the config's schema lists the allowed names.
pub fn annotate_schema(schema: &mut serde_json::Value) {
    let one_of: Vec<serde_json::Value> = KINDS
        .iter()
        .map(|k| serde_json::json!({ "const": k.name(), "description": k.about(), "type": "string" }))
        .collect();
    if let Some(kind) = schema.pointer_mut("/definitions/ModelKind").and_then(|v| v.as_object_mut()) {
        kind.remove("type");
        kind.insert("oneOf".into(), one_of.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sets: &[&str]) -> Result<Config, ConfigError> {
        sparrow_core::Overrides::parse(sets).and_then(|o| Config::from_toml("", "test", &o))
    }

    /// Two binary tasks and a multiclass one, no sequence.
    const TASKS: &str = r#"
        [data]
        format = "csv"
        [data.schema]
        labels = ["click", "conversion", "kind"]
        sparse = ["user", "item"]
        [[model.tasks]]
        name = "click"
        [[model.tasks]]
        name = "conversion"
        [[model.tasks]]
        name = "kind"
        kind = "multiclass"
        classes = 4
    "#;

    #[test]
    fn every_name_is_found_once_and_an_unknown_one_lists_the_kinds() {
        let names = names();
        for name in &names {
            assert_eq!(names.iter().filter(|n| *n == name).count(), 1, "{name} twice");
            assert_eq!(find(&ModelKind::named(name)).expect("found").name(), *name);
        }
        let err = check(&config(&["model.kind=\"transformer\""]).expect("parses")).expect_err("unknown");
        let text = err.to_string();
        assert!(text.contains("model.kind") && text.contains("transformer") && text.contains("dlrm"), "{text}");
    }

    #[test]
    fn each_kinds_refusal_names_its_key() {
        let with_tasks = |kind: &str| {
            let sets = sparrow_core::Overrides::parse(&[format!("model.kind=\"{kind}\"")]).expect("set");
            Config::from_toml(TASKS, "tasks.toml", &sets).expect("parses")
        };
        for (kind, key) in [("lr", "model.tasks"), ("fm", "model.tasks"), ("esmm", "model.kind")] {
            let err = check(&with_tasks(kind)).expect_err("refused").to_string();
            assert!(err.contains(key), "{kind}: {err}");
        }
        check(&with_tasks("mmoe")).expect("mmoe takes three tasks");
        let cases: [(&[&str], &str); 3] = [
            (&["model.kind=\"esmm\""], "model.kind"),
            (&["model.kind=\"din\""], "model.kind"),
            (&["model.kind=\"mmoe\"", "model.expert_hidden=[]"], "model.expert_hidden"),
        ];
        for (sets, key) in cases {
            let parsed = config(sets).expect("parses");
            let err = check(&parsed).expect_err("refused").to_string();
            assert!(err.contains(key), "{sets:?}: {err}");
        }
        check(&config(&["model.kind=\"mlp\""]).expect("parses")).expect("mlp takes the default config");
    }

    #[test]
    fn the_schema_lists_every_kind() {
        let mut schema = sparrow_core::config::json_schema();
        annotate_schema(&mut schema);
        let listed = schema["definitions"]["ModelKind"]["oneOf"].as_array().expect("oneOf").len();
        assert_eq!(listed, KINDS.len());
    }
}
