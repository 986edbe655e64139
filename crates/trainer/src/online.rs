//! Progressive validation's figures (`train.online_window_samples`) where a
//! run reports them: the metrics JSONL, TensorBoard, the progress line and
//! callback, and the final JSON. Each batch is scored by the forward pass of
//! its own step, before its update (`sparrow_core::metrics::online`).

use serde::{Deserialize, Serialize};
use sparrow_core::metrics::online::{OnlineCounts, OnlineMetrics, ProgressiveEval};

/// The window's and the whole run's metrics at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OnlineFigures {
    /// The last `train.online_window_samples` samples (fewer early on).
    pub window: OnlineMetrics,
    /// Every sample this run scored (AUC from histograms: see `ProgressiveEval`).
    pub run: OnlineMetrics,
}

impl OnlineFigures {
    pub fn of(eval: &ProgressiveEval) -> OnlineFigures {
        OnlineFigures { window: eval.window(), run: eval.run() }
    }

    /// TensorBoard scalars.
    pub fn scalars(&self) -> [(&'static str, f64); 8] {
        let (w, r) = (&self.window, &self.run);
        [
            ("online/window_auc", w.auc),
            ("online/window_logloss", w.log_loss),
            ("online/window_normalized_entropy", w.normalized_entropy),
            ("online/window_calibration", w.calibration),
            ("online/run_auc", r.auc),
            ("online/run_logloss", r.log_loss),
            ("online/run_normalized_entropy", r.normalized_entropy),
            ("online/run_calibration", r.calibration),
        ]
    }

    /// For the progress line.
    pub fn describe(&self) -> String {
        let w = &self.window;
        format!(" online_auc {:.4} ne {:.4} calibration {:.3}", w.auc, w.normalized_entropy, w.calibration)
    }
}

/// The final JSON's progressive-validation fields (null when it is off).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct OnlineReport {
    /// Samples scored before training, over the whole run.
    pub online_samples: Option<u64>,
    pub online_auc: Option<f64>,
    pub online_logloss: Option<f64>,
    pub online_normalized_entropy: Option<f64>,
    pub online_calibration: Option<f64>,
    /// The same over the last `train.online_window_samples` samples.
    pub online_window_auc: Option<f64>,
    pub online_window_logloss: Option<f64>,
    pub online_window_normalized_entropy: Option<f64>,
    pub online_window_calibration: Option<f64>,
}

/// A cluster worker's counts, which `launch` adds up across workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OnlineTally {
    pub window: OnlineCounts,
    pub run: OnlineCounts,
}

impl OnlineTally {
    pub fn of(eval: &ProgressiveEval) -> OnlineTally {
        OnlineTally { window: eval.window_counts(), run: eval.run_counts() }
    }
}

impl OnlineReport {
    pub fn of(eval: Option<&ProgressiveEval>) -> OnlineReport {
        eval.map_or_else(OnlineReport::default, |e| OnlineReport::from_figures(OnlineFigures::of(e)))
    }

    /// Several workers' figures as one: the run's over every worker's
    /// samples, the window's over each worker's last
    /// `train.online_window_samples` together (both AUCs bucketed). None
    /// given: every field null.
    pub fn merged(tallies: &[&OnlineTally]) -> OnlineReport {
        if tallies.is_empty() {
            return OnlineReport::default();
        }
        let window = OnlineCounts::merged(tallies.iter().map(|t| &t.window)).metrics();
        let run = OnlineCounts::merged(tallies.iter().map(|t| &t.run)).metrics();
        OnlineReport::from_figures(OnlineFigures { window, run })
    }

    fn from_figures(figures: OnlineFigures) -> OnlineReport {
        let OnlineFigures { window: w, run: r } = figures;
        // JSON has no NaN: an undefined figure (one class only) is null.
        let finite = |x: f64| x.is_finite().then_some(x);
        OnlineReport {
            online_samples: Some(r.samples),
            online_auc: finite(r.auc),
            online_logloss: finite(r.log_loss),
            online_normalized_entropy: finite(r.normalized_entropy),
            online_calibration: finite(r.calibration),
            online_window_auc: finite(w.auc),
            online_window_logloss: finite(w.log_loss),
            online_window_normalized_entropy: finite(w.normalized_entropy),
            online_window_calibration: finite(w.calibration),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off: every field null; on: the window's and the run's figures, and
    /// an undefined one (no positive yet) is null, not NaN.
    #[test]
    fn the_report_holds_the_evaluator_figures_and_null_for_undefined_ones() {
        assert!(OnlineReport::of(None).online_auc.is_none());
        let mut eval = ProgressiveEval::new(2);
        eval.add(&[-1.0, -2.0], &[0.0, 0.0]);
        let r = OnlineReport::of(Some(&eval));
        assert_eq!(r.online_samples, Some(2));
        assert!(r.online_logloss.is_some_and(|l| l > 0.0));
        assert_eq!((r.online_auc, r.online_calibration), (None, None), "one class only");
        eval.add(&[3.0, -3.0], &[1.0, 0.0]);
        let r = OnlineReport::of(Some(&eval));
        assert_eq!(r.online_window_auc, Some(1.0), "the window is the last two: ranked right");
        assert_eq!(r.online_samples, Some(4));
        let f = OnlineFigures::of(&eval);
        assert_eq!(f.scalars()[0], ("online/window_auc", 1.0));
        assert!(f.describe().contains("online_auc 1.0000"), "{}", f.describe());
    }
}
