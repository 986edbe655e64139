//! `[train.early_stopping]`'s judgement of each validation evaluation: the
//! best figure so far and where, and how many evaluations since; kept in
//! every checkpoint, so a resumed run stops where the uninterrupted one
//! would have.

use serde::{Deserialize, Serialize};
use sparrow_core::Config;
use sparrow_core::config::{EarlyStoppingConfig, StopMetric};
use sparrow_core::metrics::tasks::TaskFigures;

use crate::evaluation::Figures;

/// The best validation evaluation so far.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// The watched figure (`train.early_stopping.metric` of its task).
    pub metric: f64,
    /// The job's step and epoch (from 0, as in the metrics lines) it was taken at.
    pub step: u64,
    pub epoch: u64,
}

/// The last validation's figures, as the final JSON reports them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastValidation {
    pub auc: f64,
    pub logloss: f64,
    pub rows: u64,
}

impl LastValidation {
    pub fn of(figures: &Figures) -> LastValidation {
        LastValidation { auc: figures.auc, logloss: figures.logloss, rows: figures.rows }
    }
}

/// Where early stopping stands (and the validation set with it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
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
