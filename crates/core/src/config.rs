//! The typed job config (TOML). Every section rejects unknown keys, every key
//! has an explicit default, and units live in the names.

mod bounds;
mod buckets;
mod cluster;
mod kinds;
mod norm;
mod overrides;
mod reference;
mod schedule;
mod schema;
mod stored;
mod stream;
mod stream_auth;
mod tasks;
mod validate;
mod validation;

pub use buckets::{BucketField, bucket_id};
pub use cluster::{
    ClusterConfig, ClusterMode, Combine, LazyConfig, LazySend, PassRequest, ProbeRoles, RoundMergeRule, SyncMode,
    Utilisation,
};
pub use kinds::ModelKind;
pub use norm::{Norm, NormSetting};
pub use overrides::Overrides;
pub use reference::json_schema;
pub use schedule::{ScheduleConfig, ScheduleKind};
pub use schema::{DenseScale, DenseTransform, Schema};
pub use stream::{
    GapPolicy, MAX_FETCH_BYTES, OffsetReset, Partitions, RetentionGap, StreamConfig, StreamKind, StreamStart,
};
pub use stream_auth::{SaslMechanism, Secret, StreamSasl, StreamTls};
pub use tasks::{EvalConfig, MAX_CLASSES, MAX_SEQUENCE_LEN, SequenceField, ServedOutput, Task, TaskConfig, TaskKind};
pub use validation::{EarlyStoppingConfig, RowSplit, StopMetric, ValidationSet, held_out, no_row_left};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("config {source_name}: {message}")]
    Parse { source_name: String, message: String },
    #[error("--set {assignment:?}: expected KEY=VALUE, e.g. embedding.learning_rate=0.1")]
    BadAssignment { assignment: String },
    #[error("--set {key}: `{segment}` is a value, not a table")]
    NotATable { key: String, segment: String },
    #[error("config: {key}: {message}")]
    Invalid { key: String, message: String },
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[data]`: the files (or the stream) trained and tested on, and how they read.
    pub data: DataConfig,
    /// `[model]`: the dense network and its tasks.
    pub model: ModelConfig,
    /// `[train]`: batches, epochs, threads, the seed, and what is logged.
    pub train: TrainConfig,
    /// `[embedding]`: the embedding tables: their optimizer, storage tier, filters and bounds.
    pub embedding: EmbeddingConfig,
    /// `[dense_optimizer]`: the optimizer of the dense network's weights.
    pub dense_optimizer: DenseOptimizerConfig,
    /// `[checkpoint]`: where the model is saved, how often, and what a run resumes from.
    pub checkpoint: CheckpointConfig,
    /// `[cluster]`: `sparrow launch` and the separate roles: the data path, sync, failure handling.
    pub cluster: ClusterConfig,
    /// `[eval]`: how the offline figures are computed.
    pub eval: EvalConfig,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// Criteo's TSV: a label, 13 integer counts (read as log(1 + x)), 26
    /// hashed categories.
    #[default]
    Criteo,
    /// Delimited text, its columns named by `[data.schema]`.
    Csv,
    /// Apache Parquet, its columns named by `[data.schema]`.
    Parquet,
    /// `label index:value ...`: one multi-hot field, each value its ID's weight.
    Libsvm,
    /// `label field:index:value ...` (`num_fields` fields).
    Libffm,
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// The files' format: `criteo` (the Criteo TSV: label, 13 counts, 26
    /// hashed categories), `csv` or `parquet` (columns named by
    /// `[data.schema]`), `libsvm` or `libffm`.
    pub format: DataFormat,
    /// The training file (a path; gzip and zstd files are read through
    /// their codec, recognised by their first bytes).
    /// Required unless `[data.stream]` is set.
    pub train: Option<String>,
    /// The test file: evaluated at the end (and every `train.eval_every_steps`).
    pub test: Option<String>,
    /// `[data.schema]`: which CSV or Parquet columns are labels, dense values,
    /// sparse IDs, sequences and the timestamp.
    pub schema: Option<Schema>,
    /// Malformed rows skipped (and counted) before the job stops with an error.
    pub max_bad_rows: u64,
    /// Also stop when more than this fraction of a pass's rows were malformed
    /// (checked at the end of each pass over the file). Default: no limit.
    pub max_bad_fraction: Option<f64>,
    /// How many malformed rows are reported one by one (file, line, reason).
    pub report_bad_rows: u64,
    /// libffm: number of fields (field indices must be below it).
    pub num_fields: Option<usize>,
    /// Batches parsed ahead of the training step (bounded memory).
    pub prefetch_batches: usize,
    /// Sample weighting by age (S4.4); needs `schema.timestamp`.
    pub weighting: Option<WeightingConfig>,
    /// Train from a Kafka topic instead of `train` (which is then not read).
    pub stream: Option<StreamConfig>,
    /// S0.7: every training batch holds samples of one label only (of
    /// `group_task`); batches of different labels interleave in an order
    /// drawn from `train.seed`.
    pub group_by_label: bool,
    /// The task whose label groups the batches (a label column); default:
    /// the first multiclass task, else the first task.
    pub group_task: Option<String>,
    /// Rows read at once and split by label (at least `train.batch_size`):
    /// a label's rows within it go out in batches, the batches of all
    /// labels in a seeded order. Larger windows mix labels over a longer
    /// stretch of the file and hold more rows in memory.
    pub group_window_rows: usize,
    /// Reads the training file's rows in a seeded order, drawn anew each
    /// epoch from `train.seed`: windows of `shuffle_window_rows` rows, each
    /// permuted in memory, in the file's order (a window at least as large
    /// as the file is a full shuffle). A resume reads its window again and
    /// skips what was trained: the same model as an uninterrupted run.
    /// Files only; not with `group_by_label` (which draws its own order) or
    /// `[data.weighting]`.
    pub shuffle: bool,
    /// `shuffle`: rows read at once and permuted (held in memory).
    pub shuffle_window_rows: usize,
    /// The validation set: a file (`"valid.csv"`), or a fraction of
    /// `data.train`'s rows (`0.1`) held out of training, the same rows for
    /// every seed. Scored at the end of every epoch and every
    /// `train.eval_every_steps` (a `validation` line in the metrics); what
    /// `[train.early_stopping]` watches. `data.test` is then scored once, at
    /// the end. A cluster job validates at each epoch's end and every
    /// `train.eval_every_steps` (each stretch a generation from the last
    /// one's checkpoint: it needs `checkpoint.dir`).
    pub validation: Option<ValidationSet>,
    /// Which of the training file's rows a reader hands out (the trainer's
    /// to set: training, validation or scoring).
    #[serde(skip)]
    #[schemars(skip)]
    pub split: RowSplit,
}

impl DataConfig {
    /// The data settings for scoring a file: as read, without what shapes
    /// training's batches (weighting, label groups, the shuffle), even
    /// when the file scored is the training file.
    pub fn for_scoring(&self) -> DataConfig {
        // The validation set's reading stays the held-out rows.
        let split = if self.split == RowSplit::HeldOut { RowSplit::HeldOut } else { RowSplit::All };
        DataConfig { weighting: None, group_by_label: false, shuffle: false, split, ..self.clone() }
    }

    /// The data settings for scoring the validation set: the held-out rows
    /// of the training file, or the validation file as read; `None`
    /// without `validation`.
    pub fn for_validation(&self) -> Option<(String, DataConfig)> {
        let scoring = self.for_scoring();
        match self.validation.as_ref()? {
            ValidationSet::File(path) => Some((path.clone(), scoring)),
            ValidationSet::Fraction(_) => {
                Some((self.train.clone()?, DataConfig { split: RowSplit::HeldOut, ..scoring }))
            }
        }
    }
}

/// `[data.weighting]`: identical samples in the same window merge into one
/// with a count; weight = decay_base^(−age) × count, age in `age_unit_secs`
/// from `reference_time` to the merged sample's newest member; samples
/// below `drop_below` are dropped. Applies to the training file.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WeightingConfig {
    /// The base b of the age decay: a sample `age` units old weighs b^(−age).
    pub decay_base: f64,
    /// The unit of age, in seconds (default: a day).
    pub age_unit_secs: f64,
    /// Unix seconds; default: the newest timestamp in the training file.
    pub reference_time: Option<i64>,
    /// Samples whose weight falls below this are dropped.
    pub drop_below: f64,
    /// Identical samples whose timestamps fall in the same window of this
    /// many seconds merge into one with a count.
    pub merge_window_secs: u64,
    /// Rows a merge sees at once: 0 (default) or anything up to
    /// `train.batch_size` is one batch as read; more reads that many rows,
    /// merges them and hands the merged samples out in batches.
    pub merge_buffer_rows: usize,
}

/// The largest merge buffer: 16 Mi rows (a few GiB of Criteo rows).
pub const MAX_MERGE_BUFFER_ROWS: usize = 1 << 24;

impl Default for WeightingConfig {
    fn default() -> Self {
        WeightingConfig {
            decay_base: std::f64::consts::E,
            age_unit_secs: 86_400.0,
            reference_time: None,
            drop_below: 0.001,
            merge_window_secs: 86_400,
            merge_buffer_rows: 0,
        }
    }
}

impl Config {
    /// The default job reading data as `data` says (tests and tools that
    /// only read files).
    pub fn with_data(data: DataConfig) -> Config {
        Config { data, ..Config::default() }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            format: DataFormat::Criteo,
            train: None,
            test: None,
            schema: None,
            max_bad_rows: 1000,
            max_bad_fraction: None,
            report_bad_rows: 5,
            num_fields: None,
            prefetch_batches: 8,
            weighting: None,
            stream: None,
            group_by_label: false,
            group_task: None,
            group_window_rows: 16384,
            shuffle: false,
            shuffle_window_rows: 100_000,
            validation: None,
            split: RowSplit::Training,
        }
    }
}

/// `model.precision`: the arithmetic of the dense model's matrix products.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    /// The products' inputs rounded to bf16 (nearest even), accumulated in
    /// fp32; weights, gradients' sums and optimizer state stay fp32.
    Bf16,
}

/// `model.activation`, `model.attention_activation`: what an MLP stack's
/// activated layers apply after their norm.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// max(z, 0).
    #[default]
    Relu,
    /// z where z > 0, else a·z, one learned slope a a layer (PyTorch's
    /// PReLU(), a starting at 0.25).
    Prelu,
    /// The DIN paper's data-adaptive activation: p = σ(ẑ), y = z·(α + (1 −
    /// α)·p), ẑ each output batch-normalized without scale or shift
    /// (running statistics outside training, as batch norm's), α learned
    /// per output from 0 (DeepCTR-Torch's Dice).
    Dice,
    /// z·Φ(z), Φ the standard normal's distribution function (PyTorch's
    /// GELU(), exact).
    Gelu,
    /// z·σ(z) (PyTorch's SiLU).
    Silu,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The IDs' vectors added.
    #[default]
    Sum,
    /// Their mean.
    Mean,
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The dense network: one of the kinds listed below (`sparrow kinds`
    /// prints them), each one file of the model crate's registry.
    pub kind: ModelKind,
    /// Length of every embedding vector (all fields share it).
    pub embedding_dim: usize,
    /// Hidden layers of the MLP (mlp, wide_deep, deepfm, dcn) or of DLRM's top MLP.
    pub hidden: Vec<usize>,
    /// DLRM's bottom MLP on the dense values (its output layer is `embedding_dim`).
    pub bottom_hidden: Vec<usize>,
    /// DCN-v2 cross layers.
    pub cross_layers: usize,
    /// How the IDs of one multi-hot field are combined.
    pub pooling: Pooling,
    /// `f32`, or `bf16`: the MLP stacks' (experts and towers among them)
    /// and DCN-v2's cross layers' matrix products (forward and both
    /// gradients) take bf16-rounded inputs (nearest even, denormals to
    /// zero) and accumulate in fp32; weights and optimizer state stay f32.
    /// DIN's attention units, the multi-task gates and a stack's head (a
    /// layer after its first of at most 4 outputs: a task's logit or
    /// classes) stay fp32: their products are narrow (one a history item;
    /// one column an expert a gate mixes; a column an output), and in bf16
    /// they ran slower than in fp32. AVX-512-BF16 runs it where the CPU has it;
    /// elsewhere a portable product gives the same bits 12-20× slower than
    /// f32's with AVX2 (`bf16_portable_gflops` in `sparrow bench`): on a CPU
    /// without AVX-512-BF16 keep f32 (a warning says so). LR and FM have no
    /// matrix products: bf16 changes nothing there.
    pub precision: Precision,
    /// `mmoe`/`ple`: shared experts (per level), each an MLP of these layers.
    pub experts: usize,
    /// `mmoe`/`ple`: hidden layers of each expert (its last layer is the expert's output).
    pub expert_hidden: Vec<usize>,
    /// `ple`: each task's own experts per level.
    pub task_experts: usize,
    /// `ple`: extraction levels (each mixes shared and task experts).
    pub levels: usize,
    /// `esmm`/`mmoe`/`ple`: each task's tower (its last layer, the task's outputs, added).
    pub tower_hidden: Vec<usize>,
    /// `din`: hidden layers of the local activation unit, which scores each
    /// history item against the candidate (its output layer, one score, added).
    pub attention_hidden: Vec<usize>,
    /// `[[model.tasks]]`: one per label column (none: a binary task per label).
    pub tasks: Vec<TaskConfig>,
    /// Inverted dropout in [0, 1): each activated layer's outputs in every
    /// MLP stack (the deep MLP, DLRM's bottom and top, the experts and
    /// towers; not DIN's attention unit) are zeroed at this rate while
    /// training and the kept ones scaled by 1/(1 − rate); evaluation,
    /// serving and ONNX use the weights as they are. The draws are a hash
    /// of the seed, the dense step, the worker, the stack, the layer and
    /// the element: the same model every run, after a resume and in
    /// `launch`. 0: off.
    pub dropout: f32,
    /// `auto`, `none`, `layer` or `batch`: each activated layer of the same
    /// MLP stacks as `dropout`'s normalizes its pre-activation, then takes
    /// the ReLU (learned scale and shift). `auto` (the default) is `batch`
    /// for `din` and `none` for every other kind. `layer`: over the layer's outputs,
    /// row by row; in training, evaluation, serving and ONNX alike
    /// (`LayerNormalization`). `batch`: each output over the batch's rows
    /// while training (in a cluster, each worker over its own batch), by
    /// running statistics elsewhere (in ONNX a subtraction and a product). The running
    /// mean and (unbiased) variance are kept with the dense weights: in
    /// checkpoints, exports, and a cluster's dense sync, where they move by
    /// the workers' batches together. Batch norm (and Dice) needs
    /// `train.batch_size` of 2 or more: one row has no variance.
    pub norm: NormSetting,
    /// `norm = "batch"`: how far a training step moves the running
    /// statistics towards its batch's, in (0, 1] (PyTorch's `momentum`):
    /// running ← (1 − m)·running + m·batch.
    pub batch_norm_momentum: f32,
    /// `relu`, `prelu`, `dice`, `gelu` or `silu`: what each activated layer
    /// of the MLP stacks (those `norm` normalizes) applies after its norm.
    /// `dice` keeps running statistics as batch norm does (the same
    /// momentum); `prelu` and `dice` learn their slopes. ONNX lowers each
    /// (`PRelu`, `Gelu`, a sigmoid's product for `silu` and `dice`).
    pub activation: Activation,
    /// `din`: what the hidden layers of the local activation unit apply
    /// (the same choices; the DIN paper uses `prelu` or `dice` there).
    pub attention_activation: Activation,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            kind: ModelKind::default(),
            embedding_dim: 16,
            hidden: vec![256, 128],
            bottom_hidden: vec![64],
            cross_layers: 2,
            pooling: Pooling::Sum,
            precision: Precision::F32,
            experts: 4,
            expert_hidden: vec![64],
            task_experts: 1,
            levels: 2,
            tower_hidden: vec![32],
            attention_hidden: vec![36],
            tasks: Vec::new(),
            dropout: 0.0,
            norm: NormSetting::Auto,
            batch_norm_momentum: 0.1,
            activation: Activation::Relu,
            attention_activation: Activation::Relu,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Samples per training step (in a cluster: per worker and step).
    pub batch_size: usize,
    /// Passes over the training file.
    pub epochs: u64,
    /// Threads of the training step and the embedding lookups (a process's
    /// compute threads; parsing runs beside them). The model does not
    /// depend on it. On a machine of few cores, a small step can train
    /// faster with fewer: on 2 cores at batch 256, the three-task MLP ran
    /// 20–35% faster with 1 (the reader then has a core of its own), MMoE,
    /// PLE and DIN faster with 2 (`docs/benchmarks.md`, Issue 56). MMoE,
    /// PLE, ESMM and DIN run each half of a large enough batch on a thread
    /// of their own, batch norm's and Dice's statistics meeting across the
    /// halves; the halves are cut by the batch's rows, so one
    /// thread runs them in turn and trains the same model.
    pub threads: usize,
    /// The seed of every random draw (initial weights and rows, shuffles):
    /// the same config and seed give the same model.
    pub seed: u64,
    /// Stop after this many steps (the run can be resumed from its checkpoint).
    pub max_steps: Option<u64>,
    /// Steps between metric lines (JSONL and plain progress).
    pub log_interval_steps: u64,
    /// Per-interval metrics file (JSON lines). Default: none. In a cluster
    /// job every worker appends its lines to it, each tagged with its `worker`.
    pub metrics_path: Option<String>,
    /// Also evaluate every this many steps: on `data.validation` when it is
    /// set (a `validation` line, what early stopping judges), else on
    /// `data.test` (an `eval` line in the metrics, a point on the report's
    /// and TensorBoard's AUC curve). The model trained is the same with or
    /// without it. In a cluster job worker 0 evaluates `data.test` as the
    /// job's step passes each multiple; with `data.validation` each
    /// stretch of this many steps is a generation of the job, validated at
    /// its end (under `cluster.sync = "step"` with several workers a step
    /// takes a batch from each, more from a faster one: about every this
    /// many steps).
    pub eval_every_steps: Option<u64>,
    /// Write TensorBoard scalars (an `events.out.tfevents.*` file) into this
    /// directory at every logging interval and evaluation (a cluster job:
    /// each worker's into `worker-<i>/`).
    pub tensorboard_dir: Option<String>,
    /// Progressive validation: every batch is scored before it is trained
    /// on, and AUC, log-loss, normalized entropy and calibration are kept
    /// over the last this many samples and over the whole run. Default:
    /// 100 000 with `[data.stream]`, off for files; 0 turns it off. At most
    /// 10 million (the window is held in memory).
    pub online_window_samples: Option<u64>,
    /// How many batches ahead the embedding lookup runs (S3.10). 0: each
    /// batch's lookup sees every earlier batch's update (the exact,
    /// unpipelined model). d ≥ 1: batch t+d's rows are looked up while batch
    /// t's dense step runs, so they miss the updates of batches t..t+d-1
    /// (the same model every run). In `launch` each worker pulls d batches
    /// ahead the same way.
    pub pipeline_depth: usize,
    /// What a non-finite loss, gradient or weight does: stop the run with an
    /// error naming the step and the parameter (the model saved is the one
    /// before that batch), or skip the batch (no update) and go on.
    pub on_non_finite: OnNonFinite,
    /// `auto`: kernels chosen by CPU feature take their SIMD versions where
    /// the CPU has them, bf16 products AMX's tiles where it has AMX-BF16;
    /// `avx512`: the same but for AMX (bf16 products on AVX-512-BF16, whose
    /// bits the portable kernels give; for comparison); `avx2`: what a CPU
    /// with AVX2 and FMA but no AVX-512 takes (an AMD Zen 3), the narrow fp32
    /// product's AVX2 build too, bf16 products on the fp32 kernels, to time
    /// that path on any machine (in fp32 the same model as `auto`, bit for
    /// bit); `portable`: their portable versions (the same bits, slower).
    /// `SPARROW_SIMD` in the environment sets it for every command (a
    /// `--set` of it wins). The fp32 matrix product otherwise picks its
    /// kernels by CPU (the `gemm` crate's, and for a narrow product or one
    /// output column Sparrow's AVX-512 ones, with gemm's bits); `gemm`'s own
    /// keep the CPU's widest under `avx2` too.
    pub simd: crate::simd::Simd,
    /// `[train.schedule]`: the learning rates' warmup and decay by dense step.
    pub schedule: ScheduleConfig,
    /// `[train.early_stopping]`: stop once the validation figure has not
    /// improved for `patience` evaluations, keeping the best model in
    /// `checkpoint.dir/best`. Default: off.
    pub early_stopping: Option<EarlyStoppingConfig>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnNonFinite {
    /// Stop with an error naming the step and the parameter.
    #[default]
    Stop,
    /// Skip the batch (no update) and go on.
    SkipBatch,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 1024,
            epochs: 1,
            threads: 2,
            seed: 1,
            max_steps: None,
            log_interval_steps: 200,
            metrics_path: None,
            eval_every_steps: None,
            tensorboard_dir: None,
            online_window_samples: None,
            pipeline_depth: 0,
            on_non_finite: OnNonFinite::Stop,
            simd: crate::simd::Simd::Auto,
            schedule: ScheduleConfig::default(),
            early_stopping: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SparseOptimizerKind {
    Sgd,
    #[default]
    Adagrad,
    /// One Adagrad accumulator per row (the mean of the squared gradient's
    /// coordinates), as FBGEMM's `EXACT_ROWWISE_ADAGRAD`, TorchRec's usual
    /// choice: 4 bytes of state a row instead of 4 per coordinate.
    #[serde(rename = "rowwise_adagrad")]
    RowwiseAdagrad,
    Adam,
    Ftrl,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum InitKind {
    #[default]
    Uniform,
    Normal,
    Zeros,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InitConfig {
    /// The distribution a new row's coordinates are drawn from.
    pub kind: InitKind,
    /// Half-width (uniform) or standard deviation (normal).
    pub scale: f32,
}

impl Default for InitConfig {
    fn default() -> Self {
        InitConfig { kind: InitKind::Uniform, scale: 0.01 }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddingConfig {
    /// The sparse optimizer applied to each looked-up row.
    pub optimizer: SparseOptimizerKind,
    /// The rows' learning rate (FTRL's alpha).
    pub learning_rate: f32,
    /// `[embedding.init]`: how a new row's vector is drawn.
    pub init: InitConfig,
    /// Adagrad / Adam epsilon.
    pub eps: f32,
    /// Adam: decay of the first moment.
    pub beta1: f32,
    /// Adam: decay of the second moment.
    pub beta2: f32,
    /// FTRL beta (alpha is `learning_rate`).
    pub ftrl_beta: f32,
    /// FTRL L1 strength (drives small coordinates to exactly zero).
    pub ftrl_l1: f32,
    /// FTRL L2 strength.
    pub ftrl_l2: f32,
    /// L2 on the rows a batch touches, as the PyTorch libraries put it in
    /// the loss: each distinct row a batch looks up gets `l2 · w` added to
    /// its gradient (the gradient of `l2/2 · Σ ‖w‖²` over those rows, taken
    /// at the values the batch read), once per batch, before the optimizer
    /// step. Rows not looked up are left alone. DeepCTR-Torch's
    /// `l2_reg_embedding = c` is `l2 = 2c` on the rows it touches. 0: off.
    pub l2: f32,
    /// Lock shards of the in-memory table (a power of two).
    pub table_shards: usize,
    /// Where rows live: all in memory, or on SSD behind a memory cache (S3.8).
    pub storage: Storage,
    /// The SSD tier's directory (`storage = "ssd"`); its files are working
    /// storage, rebuilt at every start (checkpoints hold the durable copy).
    pub path: Option<String>,
    /// Rows the memory cache in front of the SSD tier holds.
    pub cache_capacity_rows: usize,
    /// Which cached row the SSD tier's memory cache evicts first (sampled,
    /// as Redis approximates LRU; LFU counts are stored with evicted rows
    /// and resume when read back).
    pub cache_policy: CachePolicy,
    /// Feature filter (Monolith-style): a new ID gets a row only once it was
    /// seen in this many training batches; until then it reads as its initial
    /// vector and its gradients are dropped. 0 or 1: every ID is admitted.
    pub admit_min_count: u32,
    /// Counters of the admission sketch (one byte each, split across the lock
    /// shards): bounds the memory spent on IDs not admitted yet.
    pub admit_sketch_counters: usize,
    /// Rows not looked up for this many training batches are deleted (their
    /// ID starts afresh if it comes back). 0: rows never expire.
    pub ttl_steps: u64,
    /// `[data.stream]`: rows whose last training use was on records appended
    /// more than this many seconds before the newest record trained (event
    /// time, not wall time) are deleted. 0: off.
    pub ttl_secs: u64,
    /// At most this many rows in the table (in a cluster, split evenly over
    /// the shards): past it, rows are evicted by `eviction` down to 90% of
    /// it. 0: no bound.
    pub max_rows: u64,
    /// Which rows `max_rows` evicts first.
    pub eviction: Eviction,
    /// How a row's vector is stored (in memory, on the SSD tier, on the wire
    /// and in checkpoints; f16 and bf16 halve its bytes); gradients, the
    /// optimizer's arithmetic and its state stay f32. An f16 value past
    /// ±65504 becomes ±inf (`train.on_non_finite` reports it). Resuming with
    /// another dtype converts the checkpoint's rows.
    pub dtype: EmbeddingDtype,
    /// How an updated f16 or bf16 vector is rounded as it is stored.
    pub rounding: Rounding,
}

/// `embedding.rounding`: how an updated half vector is rounded when it is
/// written back.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Rounding {
    /// To nearest, ties to even: an update smaller than half the gap to the
    /// next half value is lost.
    #[default]
    Nearest,
    /// Up or down at random, with the probability that makes the stored
    /// value right on average (an update of a tenth of the gap moves the row
    /// one time in ten). The random numbers are a hash of the job's seed,
    /// the key, the row's update count (one more f32 word a row) and the
    /// coordinate: the same job gives the same model.
    Stochastic,
}

impl Rounding {
    pub fn name(self) -> &'static str {
        match self {
            Rounding::Nearest => "nearest",
            Rounding::Stochastic => "stochastic",
        }
    }
}

/// `embedding.dtype`: the stored vector's number format. Gradients and the
/// optimizer's arithmetic stay f32; an updated vector is rounded once, to
/// nearest even, when it is written back to its row.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EmbeddingDtype {
    #[default]
    F32,
    /// IEEE half precision: 10-bit mantissa, range ±65504.
    F16,
    /// bfloat16: f32's range with an 8-bit mantissa.
    Bf16,
}

impl EmbeddingDtype {
    pub fn name(self) -> &'static str {
        match self {
            EmbeddingDtype::F32 => "f32",
            EmbeddingDtype::F16 => "f16",
            EmbeddingDtype::Bf16 => "bf16",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    /// Every row in memory.
    #[default]
    Memory,
    /// Rows on SSD behind a memory cache of `cache_capacity_rows` (S3.8).
    Ssd,
}

/// Which cached row the SSD tier's cache evicts: the least recently or the
/// least frequently used (approximated by sampling).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CachePolicy {
    #[default]
    Lru,
    Lfu,
}

/// Which rows `embedding.max_rows` evicts first: the least recently used
/// (by training lookup). Least frequently used is not offered yet (rows
/// keep no use count in memory).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    #[default]
    Lru,
}

impl EmbeddingConfig {
    /// Rows may be deleted while training (`ttl_steps`, `ttl_secs`,
    /// `max_rows`): each row's last use is kept, checkpointed, and serving
    /// exports are full (a delta cannot delete a row).
    pub fn deletes_rows(&self) -> bool {
        self.ttl_steps > 0 || self.ttl_secs > 0 || self.max_rows > 0
    }
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        EmbeddingConfig {
            optimizer: SparseOptimizerKind::Adagrad,
            learning_rate: 0.05,
            init: InitConfig::default(),
            eps: 1e-8,
            beta1: 0.9,
            beta2: 0.999,
            ftrl_beta: 1.0,
            ftrl_l1: 0.0,
            ftrl_l2: 0.0,
            l2: 0.0,
            table_shards: 64,
            storage: Storage::Memory,
            path: None,
            cache_capacity_rows: 1_000_000,
            admit_min_count: 0,
            admit_sketch_counters: 1 << 22,
            ttl_steps: 0,
            ttl_secs: 0,
            max_rows: 0,
            eviction: Eviction::Lru,
            cache_policy: CachePolicy::Lru,
            dtype: EmbeddingDtype::F32,
            rounding: Rounding::Nearest,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DenseOptimizerKind {
    #[default]
    Adam,
    Sgd,
    /// Adam with decoupled weight decay (Loshchilov & Hutter; PyTorch's
    /// `AdamW`): each step first scales every weight by `1 − lr ·
    /// weight_decay`, then takes Adam's step on the gradient alone.
    #[serde(rename = "adamw")]
    AdamW,
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DenseOptimizerConfig {
    /// `adam`, `adamw` or `sgd`.
    pub kind: DenseOptimizerKind,
    /// The dense weights' learning rate.
    pub learning_rate: f64,
    /// Adam: decay of the first moment.
    pub beta1: f64,
    /// Adam: decay of the second moment.
    pub beta2: f64,
    /// Adam epsilon. A moment that decays below the smallest normal f32
    /// (a weight whose gradient stays 0, as a ReLU unit's that no longer
    /// fires) is stored as 0, since arithmetic on subnormals runs ~10×
    /// slower on x86: always for the first moment (its share of a step is
    /// ~10⁻³² of a weight); for the second where eps hides it in the
    /// step's denominator (eps ≥ 1.1e-10 does from the first step at
    /// beta2 = 0.999; never eps = 0). The weights take the same steps to
    /// the bit, except a weight itself smaller than ~1e-24 (at the defaults).
    pub eps: f64,
    /// `adam` and `sgd`: an L2 penalty, `weight_decay · w` added to each
    /// weight's gradient (PyTorch's `Adam(weight_decay=…)`). `adamw`: the
    /// decoupled decay, each weight scaled by `1 − lr · weight_decay` every
    /// step (PyTorch's `AdamW(weight_decay=…)`). 0: none.
    pub weight_decay: f64,
}

impl Default for DenseOptimizerConfig {
    fn default() -> Self {
        DenseOptimizerConfig {
            kind: DenseOptimizerKind::Adam,
            learning_rate: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Where checkpoints are written; none are written without it.
    pub dir: Option<String>,
    /// Also write one every this many steps (besides the one at the end).
    pub every_steps: Option<u64>,
    /// Versions kept in `dir` (older ones are removed after a new one lands;
    /// an incremental version keeps the versions it builds on).
    pub keep: usize,
    /// Resume from this checkpoint (a checkpoint root or one version directory).
    pub resume_from: Option<String>,
    /// `sparrow launch`: a checkpoint holds only the rows updated (or
    /// expired) since the previous one; restoring applies base + deltas.
    pub incremental: bool,
    /// With `incremental`: every this many checkpoints one is full (1: all).
    /// Also for `export_every_steps`: every this many exports one is full.
    pub full_every: u64,
    /// Write a serving export into `dir/exports/` every this many steps (and
    /// at the end), each holding only the rows updated since the previous
    /// one (every `full_every`-th is full); `exports/LATEST` names the
    /// newest, which `sparrow serve --watch` applies while it serves.
    pub export_every_steps: Option<u64>,
    /// Also write a checkpoint when this many seconds passed since the last
    /// one (a stream has no end to wait for).
    pub every_secs: Option<u64>,
    /// Also write a serving export when this many seconds passed since the
    /// last one (`serve --watch` follows them). In `sparrow launch`, set
    /// below `every_secs`, the workers meet this often and write an export
    /// alone between checkpoints (each shard its changed rows); without
    /// `every_secs` or a step cadence, it times the checkpoints too.
    pub export_every_secs: Option<u64>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: None,
            every_steps: None,
            keep: 2,
            resume_from: None,
            incremental: false,
            full_every: 8,
            export_every_steps: None,
            every_secs: None,
            export_every_secs: None,
        }
    }
}

/// Longest embedding vector accepted (a row of a CTR table is tens to
/// hundreds of floats; 4096 leaves room, and keeps a row within a chunk).
pub const MAX_EMBEDDING_DIM: usize = 4096;

impl Config {
    /// Parses TOML text, applies `overrides`, and validates.
    pub fn from_toml(text: &str, source_name: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let table: toml::Table = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { source_name: source_name.to_string(), message: e.to_string() })?;
        Config::from_table(table, source_name, overrides)
    }

    /// A parsed table, `overrides` applied, validated.
    fn from_table(mut table: toml::Table, source_name: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        overrides.apply(&mut table)?;
        let config: Config = toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| ConfigError::Parse {
            source_name: source_name.to_string(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# config not serializable: {e}"))
    }

    /// The progressive-validation window in samples (`None`: off): the key's
    /// value, or 100 000 when a stream is read.
    pub fn online_window(&self) -> Option<usize> {
        let default = self.data.stream.as_ref().map(|_| 100_000);
        self.train.online_window_samples.or(default).filter(|&n| n > 0).map(|n| n as usize)
    }
}

#[cfg(test)]
mod tests;
