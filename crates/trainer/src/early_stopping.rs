//! `[train.early_stopping]`'s judgement of each validation evaluation: the
//! best figure so far and where, and how many evaluations since; kept in
//! every checkpoint, so a resumed run stops where the uninterrupted one
//! would have.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sparrow_core::Config;
use sparrow_core::config::{EarlyStoppingConfig, StopMetric};
use sparrow_core::metrics::tasks::TaskFigures;

use crate::evaluation::Figures;

/// The best validation evaluation so far.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// The watched figure (`train.early_stopping.metric` of its task).
    #[serde(with = "exact_f64")]
    pub metric: f64,
    /// The job's step and epoch (from 0, as in the metrics lines) it was taken at.
    pub step: u64,
    pub epoch: u64,
}

/// The last validation's figures, as the final JSON reports them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastValidation {
    /// NaN where undefined (a multiclass first task's AUC).
    #[serde(with = "exact_f64")]
    pub auc: f64,
    #[serde(with = "exact_f64")]
    pub logloss: f64,
    pub rows: u64,
    /// Every task's figures by name (empty in a manifest older than them).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty", with = "exact_tasks")]
    pub tasks: BTreeMap<String, TaskFigures>,
}

impl LastValidation {
    pub fn of(figures: &Figures) -> LastValidation {
        LastValidation { auc: figures.auc, logloss: figures.logloss, rows: figures.rows, tasks: figures.tasks.clone() }
    }
}

/// A figure in a checkpoint's manifest, bit for bit: written as Rust's
/// shortest round-trip text (`"0.5628"`, `"NaN"`), which parses back to the
/// same bits (JSON numbers, as `serde_json` parses them by default, may come
/// back a unit in the last place off, and JSON has no NaN). A number or
/// null (NaN), as older manifests wrote it, reads too.
mod exact_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Text(String),
        Number(f64),
        Null(()),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Written::deserialize(d)? {
            Written::Text(t) => t.parse().map_err(|e| serde::de::Error::custom(format!("figure {t:?}: {e}"))),
            Written::Number(v) => Ok(v),
            Written::Null(()) => Ok(f64::NAN),
        }
    }
}

/// Every task's figures, each as [`exact_f64`] writes a figure.
mod exact_tasks {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use sparrow_core::metrics::tasks::TaskFigures;

    /// A figure as `exact_f64` writes it.
    #[derive(Clone, Copy, Serialize, Deserialize)]
    #[serde(transparent)]
    struct Exact(#[serde(with = "super::exact_f64")] f64);

    /// [`TaskFigures`], its figures exact (a multiclass task has no `auc`,
    /// which is how an untagged read tells the two apart).
    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Kept {
        Binary {
            auc: Exact,
            logloss: Exact,
            ne: Exact,
            calibration: Exact,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            gauc: Option<Exact>,
            rows: u64,
        },
        Multiclass {
            accuracy: Exact,
            top_k_accuracy: Exact,
            macro_auc: Exact,
            logloss: Exact,
            rows: u64,
        },
    }

    fn kept(f: &TaskFigures) -> Kept {
        match *f {
            TaskFigures::Binary { auc, logloss, ne, calibration, gauc, rows } => Kept::Binary {
                auc: Exact(auc),
                logloss: Exact(logloss),
                ne: Exact(ne),
                calibration: Exact(calibration),
                gauc: gauc.map(Exact),
                rows,
            },
            TaskFigures::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, rows } => Kept::Multiclass {
                accuracy: Exact(accuracy),
                top_k_accuracy: Exact(top_k_accuracy),
                macro_auc: Exact(macro_auc),
                logloss: Exact(logloss),
                rows,
            },
        }
    }

    fn figures(k: Kept) -> TaskFigures {
        match k {
            Kept::Binary { auc, logloss, ne, calibration, gauc, rows } => TaskFigures::Binary {
                auc: auc.0,
                logloss: logloss.0,
                ne: ne.0,
                calibration: calibration.0,
                gauc: gauc.map(|g| g.0),
                rows,
            },
            Kept::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, rows } => TaskFigures::Multiclass {
                accuracy: accuracy.0,
                top_k_accuracy: top_k_accuracy.0,
                macro_auc: macro_auc.0,
                logloss: logloss.0,
                rows,
            },
        }
    }

    pub fn serialize<S: Serializer>(tasks: &BTreeMap<String, TaskFigures>, s: S) -> Result<S::Ok, S::Error> {
        tasks.iter().map(|(name, f)| (name, kept(f))).collect::<BTreeMap<_, _>>().serialize(s)
    }

    /// A task whose figures read as neither kind is named (an untagged
    /// enum's own error says only that no variant matched).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, TaskFigures>, D::Error> {
        let written = BTreeMap::<String, serde_json::Value>::deserialize(d)?;
        written
            .into_iter()
            .map(|(name, value)| match serde_json::from_value::<Kept>(value) {
                Ok(k) => Ok((name, figures(k))),
                Err(_) => Err(serde::de::Error::custom(format!(
                    "the last validation's figures of task {name:?}: neither a binary task's (auc, logloss, ne, \
                     calibration, rows) nor a multiclass task's (accuracy, top_k_accuracy, macro_auc, logloss, \
                     rows), each figure a number written as text"
                ))),
            })
            .collect()
    }
}

/// Where early stopping stands (and the validation set with it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoppingState {
    pub best: Option<Best>,
    /// Evaluations since the best one that did not improve on it.
    pub since_best: u32,
    /// The job step of the last validation: a run resumed from a
    /// checkpoint of an epoch's last step does not score (and count) it twice.
    #[serde(default)]
    pub validated_step: Option<u64>,
    /// The last validation's figures: what a run resumed (or a cluster's
    /// next generation) reports when it ends before validating again.
    #[serde(default)]
    pub last: Option<LastValidation>,
}

/// What an evaluation means for the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A new best: keep this model as `best`.
    Improved,
    /// Not better; training goes on.
    NotBetter,
    /// Not better `patience` times in a row: training stops.
    Stop,
}

impl StoppingState {
    /// Counts an evaluation whose watched figure is `metric`. A NaN figure
    /// (a diverged model) is never an improvement.
    pub fn judge(&mut self, rule: &EarlyStoppingConfig, metric: f64, step: u64, epoch: u64) -> Verdict {
        let better = !metric.is_nan() && self.best.is_none_or(|b| rule.improves(metric, b.metric));
        if better {
            self.best = Some(Best { metric, step, epoch });
            self.since_best = 0;
            return Verdict::Improved;
        }
        self.since_best += 1;
        if self.since_best >= rule.patience { Verdict::Stop } else { Verdict::NotBetter }
    }
}

/// The figure `rule` watches in `figures`: its task's AUC or log-loss (the
/// first task's by default; a multiclass task's macro AUC).
pub fn watched(config: &Config, rule: &EarlyStoppingConfig, figures: &Figures) -> f64 {
    let first = config.tasks().first().map(|t| t.name.clone()).unwrap_or_default();
    let task = rule.task.clone().unwrap_or(first);
    match (figures.tasks.get(&task), rule.metric) {
        (Some(TaskFigures::Binary { auc, .. }), StopMetric::Auc) => *auc,
        (Some(TaskFigures::Binary { logloss, .. }), StopMetric::Logloss) => *logloss,
        (Some(TaskFigures::Multiclass { macro_auc, .. }), StopMetric::Auc) => *macro_auc,
        (Some(TaskFigures::Multiclass { logloss, .. }), StopMetric::Logloss) => *logloss,
        (None, StopMetric::Auc) => figures.auc,
        (None, StopMetric::Logloss) => figures.logloss,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NaN figure (a multiclass first task's AUC, a diverged model's
    /// log-loss) reads back as NaN: the checkpoint that keeps it stays
    /// readable (as a JSON number it was written as null, which did not read).
    #[test]
    fn a_nan_last_validation_survives_the_manifest() {
        let state = StoppingState {
            last: Some(LastValidation { auc: f64::NAN, logloss: f64::NAN, rows: 7, tasks: BTreeMap::new() }),
            ..Default::default()
        };
        let text = serde_json::to_string(&state).expect("write");
        let back: StoppingState = serde_json::from_str(&text).expect("read back");
        let last = back.last.expect("kept");
        assert!(last.auc.is_nan() && last.logloss.is_nan() && last.rows == 7, "{text}");
    }

    /// The figures come back bit for bit (this log-loss, written as a JSON
    /// number, read back one unit in the last place off), and a manifest
    /// that wrote them as numbers still reads.
    #[test]
    fn figures_survive_the_manifest_bit_for_bit() {
        let (auc, logloss) = (0.56279987205459, 1.3703492875578547);
        let state = StoppingState {
            best: Some(Best { metric: logloss, step: 3, epoch: 0 }),
            last: Some(LastValidation { auc, logloss, rows: 7, tasks: BTreeMap::new() }),
            ..Default::default()
        };
        let text = serde_json::to_string(&state).expect("write");
        let back: StoppingState = serde_json::from_str(&text).expect("read back");
        let last = back.last.expect("kept");
        assert_eq!((last.auc.to_bits(), last.logloss.to_bits()), (auc.to_bits(), logloss.to_bits()), "{text}");
        assert_eq!(back.best.map(|b| b.metric.to_bits()), Some(logloss.to_bits()), "{text}");
        let old = r#"{"best":{"metric":0.75,"step":3,"epoch":0},"since_best":1,"validated_step":3}"#;
        let old: StoppingState = serde_json::from_str(old).expect("an older manifest's state");
        assert_eq!(old.best.map(|b| b.metric), Some(0.75));
    }

    /// Every task's figures come back bit for bit too, a binary task's
    /// with GAUC and without, a multiclass one's, NaN as NaN; a manifest
    /// written before them reads with none.
    #[test]
    fn every_tasks_figures_survive_the_manifest_bit_for_bit() {
        let odd = 1.3703492875578547;
        let tasks = BTreeMap::from([
            (
                "click".to_string(),
                TaskFigures::Binary {
                    auc: 0.56279987205459,
                    logloss: odd,
                    ne: 0.9,
                    calibration: 1.1,
                    gauc: Some(odd),
                    rows: 7,
                },
            ),
            (
                "cvr".to_string(),
                TaskFigures::Binary {
                    auc: f64::NAN,
                    logloss: odd,
                    ne: f64::NAN,
                    calibration: 2.0,
                    gauc: None,
                    rows: 7,
                },
            ),
            (
                "kind".to_string(),
                TaskFigures::Multiclass {
                    accuracy: 0.25,
                    top_k_accuracy: 1.0,
                    macro_auc: odd,
                    logloss: f64::NAN,
                    rows: 7,
                },
            ),
        ]);
        let last = LastValidation { auc: 0.5, logloss: odd, rows: 7, tasks: tasks.clone() };
        let text = serde_json::to_string(&StoppingState { last: Some(last), ..Default::default() }).expect("write");
        let back = serde_json::from_str::<StoppingState>(&text).expect("read back").last.expect("kept").tasks;
        let bits = |t: &BTreeMap<String, TaskFigures>| -> Vec<(String, Vec<u64>, u64)> {
            t.iter()
                .map(|(name, f)| match *f {
                    TaskFigures::Binary { auc, logloss, ne, calibration, gauc, rows } => {
                        let gauc = gauc.map_or(vec![], |g| vec![g.to_bits()]);
                        let figures = [auc, logloss, ne, calibration].map(f64::to_bits);
                        (name.clone(), [&figures[..], &gauc].concat(), rows)
                    }
                    TaskFigures::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, rows } => {
                        (name.clone(), [accuracy, top_k_accuracy, macro_auc, logloss].map(f64::to_bits).to_vec(), rows)
                    }
                })
                .collect()
        };
        assert_eq!(bits(&back), bits(&tasks), "{text}");
        let old = r#"{"since_best":0,"last":{"auc":"0.5","logloss":"0.6","rows":7}}"#;
        let old: StoppingState = serde_json::from_str(old).expect("an older manifest's state");
        assert!(old.last.is_some_and(|l| l.tasks.is_empty()));
        let bad = r#"{"since_best":0,"last":{"auc":"0.5","logloss":"0.6","rows":7,"tasks":{"cvr":{"auc":"x"}}}}"#;
        let err = serde_json::from_str::<StoppingState>(bad).expect_err("a task's figures that read as neither kind");
        assert!(err.to_string().contains("task \"cvr\""), "{err}");
    }

    /// Patience counts evaluations without an improvement since the best;
    /// an improvement starts the count again; NaN never improves.
    #[test]
    fn patience_counts_evaluations_since_the_best() {
        let rule = EarlyStoppingConfig { patience: 2, ..Default::default() };
        let mut s = StoppingState::default();
        assert_eq!(s.judge(&rule, f64::NAN, 1, 0), Verdict::NotBetter);
        assert_eq!(s.judge(&rule, 0.70, 2, 0), Verdict::Improved);
        assert_eq!(s.judge(&rule, 0.69, 3, 1), Verdict::NotBetter);
        assert_eq!(s.judge(&rule, 0.71, 4, 1), Verdict::Improved);
        assert_eq!(s.judge(&rule, 0.71, 5, 2), Verdict::NotBetter, "equal is not better");
        assert_eq!(s.judge(&rule, f64::NAN, 6, 2), Verdict::Stop);
        assert_eq!(s.best, Some(Best { metric: 0.71, step: 4, epoch: 1 }));
        let loss = EarlyStoppingConfig { metric: StopMetric::Logloss, patience: 1, ..Default::default() };
        let mut l = StoppingState::default();
        assert_eq!(l.judge(&loss, 0.5, 1, 0), Verdict::Improved);
        assert_eq!(l.judge(&loss, 0.4, 2, 0), Verdict::Improved);
        assert_eq!(l.judge(&loss, 0.45, 3, 0), Verdict::Stop);
    }
}
