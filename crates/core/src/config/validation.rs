//! `data.validation` and `[train.early_stopping]`: a validation set (a file,
//! or a seeded fraction of the training file's rows held out of training),
//! scored at the end of every epoch and every `train.eval_every_steps`; and
//! stopping once its figure has not improved for `patience` evaluations,
//! the best model kept as `best`.

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};

/// `data.validation`: a path, or a number in (0, 1).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(untagged)]
pub enum ValidationSet {
    /// That fraction of `data.train`'s rows, drawn by each row's line (a
    /// Parquet file: its row number), never trained on.
    Fraction(f64),
    /// A file of the training file's format and schema.
    File(String),
}

/// Why a training file gave no row where none was malformed: it holds
/// none, or none outside the fraction `data.validation` holds out (a
/// fraction near 1 leaves nothing to train; the file itself is not empty).
pub fn no_row_left(data: &super::DataConfig) -> String {
    match data.validation {
        Some(ValidationSet::Fraction(f)) => {
            format!("the file holds no row outside the fraction data.validation = {f} holds out")
        }
        _ => "the file holds no row".to_string(),
    }
}

/// Which of the training file's rows a reader hands out: training leaves
/// a held-out fraction out, validation reads only those, scoring all.
/// Set by the trainer, never by a config file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowSplit {
    #[default]
    Training,
    All,
    HeldOut,
}

/// Tells the hold-out's draw from every other use of the row number.
const HOLDOUT_SALT: u64 = 0x7661_6c69_6461_7465;

/// Whether row `row` (a line number, or a Parquet row number) is among the
/// `fraction` held out. The same rows for every seed, so runs of several
/// seeds are compared on one validation set.
pub fn held_out(row: u64, fraction: f64) -> bool {
    let mut state = row ^ HOLDOUT_SALT;
    let draw = (crate::rng::splitmix64(&mut state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    draw < fraction
}

/// The figure early stopping watches.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StopMetric {
    /// The task's AUC: higher is better.
    #[default]
    Auc,
    /// The task's log-loss: lower is better.
    Logloss,
}

/// `[train.early_stopping]`: needs `data.validation` and `checkpoint.dir`.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EarlyStoppingConfig {
    /// `auc` or `logloss`, on the validation set.
    pub metric: StopMetric,
    /// The task whose figure is watched (a `[[model.tasks]]` name). Default:
    /// the first task.
    pub task: Option<String>,
    /// Evaluations in a row without an improvement before training stops.
    pub patience: u32,
    /// What counts as an improvement: better than the best by more than this.
    pub min_delta: f64,
    /// Score `data.test` (the summary's `test_*` figures) with the best
    /// model, as kept in `checkpoint.dir/best`, rather than the last one.
    /// The last one is the run's checkpoint either way (a resume continues it).
    pub restore_best: bool,
}

impl Default for EarlyStoppingConfig {
    fn default() -> Self {
        EarlyStoppingConfig { metric: StopMetric::Auc, task: None, patience: 2, min_delta: 0.0, restore_best: true }
    }
}

impl EarlyStoppingConfig {
    /// Whether `now` beats `best` by more than `min_delta`.
    pub fn improves(&self, now: f64, best: f64) -> bool {
        match self.metric {
            StopMetric::Auc => now > best + self.min_delta,
            StopMetric::Logloss => now < best - self.min_delta,
        }
    }
}

impl Config {
    /// `data.validation`'s and `[train.early_stopping]`'s rules.
    pub(super) fn validate_validation(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| Err(ConfigError::Invalid { key: key.to_string(), message });
        match &self.data.validation {
            Some(ValidationSet::Fraction(f)) if !(*f > 0.0 && *f < 1.0) => {
                return invalid("data.validation", format!("a fraction of data.train must be in (0, 1), not {f}"));
            }
            Some(ValidationSet::Fraction(_)) if self.data.stream.is_some() => {
                return invalid(
                    "data.validation",
                    "a fraction holds rows out of data.train, which [data.stream] replaces: name a file".into(),
                );
            }
            Some(ValidationSet::File(path)) if path.trim().is_empty() => {
                return invalid("data.validation", "is empty: name a file, or give a fraction such as 0.1".into());
            }
            _ => {}
        }
        self.validate_standardize()?;
        let Some(stop) = &self.train.early_stopping else { return Ok(()) };
        if self.data.validation.is_none() {
            return invalid(
                "train.early_stopping",
                "needs data.validation (the set it watches): a file, or a fraction of data.train such as 0.1".into(),
            );
        }
        if self.checkpoint.dir.is_none() {
            return invalid(
                "train.early_stopping",
                "needs checkpoint.dir (the best model is kept in its best/)".into(),
            );
        }
        if stop.patience == 0 {
            return invalid("train.early_stopping.patience", "must be at least 1".into());
        }
        if !stop.min_delta.is_finite() || stop.min_delta < 0.0 {
            return invalid("train.early_stopping.min_delta", format!("must be >= 0, not {}", stop.min_delta));
        }
        if let Some(task) = &stop.task
            && !self.tasks().iter().any(|t| &t.name == task)
        {
            let names: Vec<String> = self.tasks().into_iter().map(|t| t.name).collect();
            return invalid("train.early_stopping.task", format!("no task is named `{task}` (tasks: {names:?})"));
        }
        Ok(())
    }
}

impl Config {
    /// `data.schema.dense_transform = "standardize"` and its statistics.
    fn validate_standardize(&self) -> Result<(), ConfigError> {
        let Some(schema) = &self.data.schema else { return Ok(()) };
        schema.check_buckets()?;
        let schema_format = matches!(self.data.format, super::DataFormat::Csv | super::DataFormat::Parquet);
        if !schema.buckets.is_empty() && !schema_format {
            return Err(ConfigError::Invalid {
                key: "data.schema.buckets".into(),
                message: "applies to csv and parquet files (the schema's sparse columns)".into(),
            });
        }
        let invalid = |key: &str, message: String| Err(ConfigError::Invalid { key: key.to_string(), message });
        if let Some(stats) = &schema.standardize_stats {
            if stats.len() != schema.dense.len() {
                return invalid(
                    "data.schema.standardize_stats",
                    format!("holds {} [mean, std] pairs for {} dense columns", stats.len(), schema.dense.len()),
                );
            }
            if let Some(bad) = stats.iter().find(|[m, s]| !m.is_finite() || !s.is_finite() || *s < 0.0) {
                return invalid(
                    "data.schema.standardize_stats",
                    format!("{bad:?}: a mean and a std must be finite, the std >= 0"),
                );
            }
        }
        if schema.dense_transform != super::DenseTransform::Standardize {
            return Ok(());
        }
        if !matches!(self.data.format, super::DataFormat::Csv | super::DataFormat::Parquet) {
            return invalid(
                "data.schema.dense_transform",
                "applies to csv and parquet files (the schema's dense columns); criteo's counts are read through                  log1p"
                    .into(),
            );
        }
        if self.data.stream.is_some() && schema.standardize_stats.is_none() {
            return invalid(
                "data.schema.dense_transform",
                "\"standardize\" on a stream has no first pass to take its statistics from: give                  data.schema.standardize_stats"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// About the fraction asked for, the same rows every time, and a
    /// larger fraction holds out a superset.
    #[test]
    fn the_held_out_rows_are_a_fixed_fraction() {
        let tenth = (0..100_000).filter(|&r| held_out(r, 0.1)).count();
        assert!((9_500..10_500).contains(&tenth), "{tenth}");
        let a: Vec<u64> = (0..1000).filter(|&r| held_out(r, 0.2)).collect();
        assert_eq!(a, (0..1000).filter(|&r| held_out(r, 0.2)).collect::<Vec<_>>());
        assert!((0..1000).filter(|&r| held_out(r, 0.1)).all(|r| a.contains(&r)));
    }

    #[test]
    fn improvement_is_by_the_metrics_direction_and_margin() {
        let auc = EarlyStoppingConfig { min_delta: 0.001, ..Default::default() };
        assert!(auc.improves(0.802, 0.8) && !auc.improves(0.8005, 0.8));
        let loss = EarlyStoppingConfig { metric: StopMetric::Logloss, ..Default::default() };
        assert!(loss.improves(0.44, 0.45) && !loss.improves(0.45, 0.45));
    }
}
