//! `[data.schema]`: where a CSV or Parquet file's columns are, and how
//! their cells read.

use serde::{Deserialize, Serialize};

use super::SequenceField;

/// Column mapping for CSV and Parquet.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Schema {
    /// The label column of a one-task job.
    pub label: String,
    /// Several label columns, one per task (`[[model.tasks]]`); an empty
    /// cell masks that task for the sample.
    pub labels: Vec<String>,
    /// Columns of dense (numeric) values, each one input of the dense network.
    pub dense: Vec<String>,
    /// Columns of categorical IDs (strings or integers), each a field with
    /// its own embedding table.
    pub sparse: Vec<String>,
    /// CSV only: one character.
    pub delimiter: String,
    /// CSV only: whether the first line names the columns. Without a header
    /// the schema's names must be column numbers ("0", "1", …).
    pub header: bool,
    /// CSV only: splits one cell into several IDs of the same field (multi-hot).
    pub multi_hot_separator: Option<String>,
    /// Applied to every dense value: `none`; `log1p` = log(1 + max(x, 0))
    /// as the Criteo reader does (for raw counts); or `standardize` =
    /// (x − mean) / std, each column's mean and (population) standard
    /// deviation from a first pass over the training rows (a missing cell
    /// counts as 0, as it reads), kept in `standardize_stats`.
    pub dense_transform: DenseTransform,
    /// `standardize`: one `[mean, std]` per dense column, in order. Filled
    /// by the first pass and kept in the checkpoint's and the export's
    /// config, so evaluation, prediction, serving and ONNX read values as
    /// training did; give it to skip the pass. A std of 0 divides by 1.
    pub standardize_stats: Option<Vec<[f64; 2]>>,
    /// The column holding each sample's time (Unix seconds; in Parquet also
    /// a timestamp type), for `[data.weighting]`.
    pub timestamp: Option<String>,
    /// Columns holding a list of IDs each (behaviour sequences, newest last).
    pub sequence: Vec<SequenceField>,
    /// `[[data.schema.buckets]]`: sparse columns of numbers read as the
    /// bucket each value falls in (`column`, `boundaries`), e.g. an age as
    /// an age band with an embedding of its own.
    pub buckets: Vec<super::BucketField>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DenseTransform {
    #[default]
    None,
    Log1p,
    Standardize,
}

/// How a reader turns a dense cell into the model's value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DenseScale {
    transform: DenseTransform,
    /// `standardize`: per column, the mean and 1 / std.
    stats: Vec<(f64, f64)>,
}

impl DenseScale {
    /// Column `col`'s value of cell value `x`.
    #[inline]
    pub fn apply(&self, col: usize, x: f64) -> f64 {
        match self.transform {
            DenseTransform::None => x,
            DenseTransform::Log1p => x.max(0.0).ln_1p(),
            DenseTransform::Standardize => {
                let (mean, inverse) = self.stats.get(col).copied().unwrap_or((0.0, 1.0));
                (x - mean) * inverse
            }
        }
    }

    /// `standardize`'s per-column mean and 1 / std (a std of 0 or less: 1).
    pub fn standardized(&self) -> Option<&[(f64, f64)]> {
        (self.transform == DenseTransform::Standardize).then_some(&self.stats)
    }
}

impl Schema {
    /// How this schema's dense cells read. `standardize` without its
    /// statistics yet (the first pass reads raw values through it) is the
    /// identity.
    pub fn dense_scale(&self) -> DenseScale {
        let stats = self.standardize_stats.as_deref().unwrap_or_default();
        let stats = stats.iter().map(|&[m, s]| (m, if s > 0.0 { 1.0 / s } else { 1.0 })).collect();
        DenseScale { transform: self.dense_transform, stats }
    }
}

impl Default for Schema {
    fn default() -> Self {
        Schema {
            label: "label".into(),
            dense: Vec::new(),
            sparse: Vec::new(),
            delimiter: ",".into(),
            header: true,
            multi_hot_separator: None,
            dense_transform: DenseTransform::None,
            standardize_stats: None,
            timestamp: None,
            labels: Vec::new(),
            sequence: Vec::new(),
            buckets: Vec::new(),
        }
    }
}
