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
    /// Applied to every dense value: `none`, or `log1p` = log(1 + max(x, 0))
    /// as the Criteo reader does (for raw counts).
    pub dense_transform: DenseTransform,
    /// The column holding each sample's time (Unix seconds; in Parquet also
    /// a timestamp type), for `[data.weighting]`.
    pub timestamp: Option<String>,
    /// Columns holding a list of IDs each (behaviour sequences, newest last).
    pub sequence: Vec<SequenceField>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DenseTransform {
    #[default]
    None,
    Log1p,
}

impl DenseTransform {
    #[inline]
    pub fn apply(self, x: f64) -> f64 {
        match self {
            DenseTransform::None => x,
            DenseTransform::Log1p => x.max(0.0).ln_1p(),
        }
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
            timestamp: None,
            labels: Vec::new(),
            sequence: Vec::new(),
        }
    }
}
