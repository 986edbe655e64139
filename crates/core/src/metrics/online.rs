//! Progressive validation (online evaluation): every batch is scored before
//! it is trained on, and the scores are measured over a sliding window of
//! the last N samples and over the whole run. The metrics are the ones
//! practitioners of online CTR training read: AUC, log-loss, normalized
//! entropy (log-loss over the entropy of the base rate) and calibration
//! (the sum of predictions over the sum of labels).
//!
//! The window keeps its samples, so its AUC is exact. The whole run may be
//! endless, so it keeps counts only: its AUC comes from histograms of the
//! predicted probability in [`RUN_AUC_BUCKETS`] equal buckets (samples in
//! one bucket count as tied), which bounds its error by the share of
//! positive–negative pairs that fall in one bucket.
//!
//! Several evaluators (a cluster's workers, each scoring its own batches)
//! add up through [`OnlineCounts`]: sums and sparse histograms, whose
//! merged AUC is bucketed like the run's.

use super::{auc, logistic_loss, sigmoid};

/// Buckets of the whole run's AUC histograms (of the predicted probability).
pub const RUN_AUC_BUCKETS: usize = 1 << 14;

/// The metrics of a set of scored samples. NaN where undefined: AUC with one
/// class absent, normalized entropy when the base rate is 0 or 1,
/// calibration without a positive, everything without a sample.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct OnlineMetrics {
    pub samples: u64,
    pub auc: f64,
    pub log_loss: f64,
    pub normalized_entropy: f64,
    pub calibration: f64,
}

/// Entropy (nats) of a 0/1 label with base rate `p`.
pub(crate) fn entropy(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        return 0.0;
    }
    -(p * p.ln() + (1.0 - p) * (1.0 - p).ln())
}

/// The metrics of `n` samples with `positives` positive labels, summed
/// log-loss `loss` and summed predicted probability `predicted`.
fn summarize(n: u64, positives: f64, loss: f64, predicted: f64, auc: f64) -> OnlineMetrics {
    if n == 0 {
        return OnlineMetrics {
            samples: 0,
            auc: f64::NAN,
            log_loss: f64::NAN,
            normalized_entropy: f64::NAN,
            calibration: f64::NAN,
        };
    }
    let log_loss = loss / n as f64;
    let h = entropy(positives / n as f64);
    OnlineMetrics {
        samples: n,
        auc,
        log_loss,
        normalized_entropy: if h > 0.0 { log_loss / h } else { f64::NAN },
        calibration: if positives > 0.0 { predicted / positives } else { f64::NAN },
    }
}

/// The bucket of predicted probability `p` (NaN, a diverged model, ranks
/// lowest, as `auc` ranks it).
fn bucket(p: f64) -> usize {
    if p.is_nan() { 0 } else { ((p * RUN_AUC_BUCKETS as f64) as usize).min(RUN_AUC_BUCKETS - 1) }
}

/// AUC from (positives, negatives) per bucket, lowest bucket first: a
/// positive beats every negative in a lower bucket and ties those in its own.
fn bucketed_auc(buckets: impl Iterator<Item = (u64, u64)>) -> f64 {
    let (mut negatives_below, mut positives, mut pairs) = (0u64, 0u64, 0f64);
    for (pos, neg) in buckets {
        pairs += pos as f64 * (negatives_below as f64 + neg as f64 / 2.0);
        negatives_below += neg;
        positives += pos;
    }
    if positives == 0 || negatives_below == 0 { f64::NAN } else { pairs / (positives as f64 * negatives_below as f64) }
}

/// What an evaluator counted over its window or its run, in a form that
/// adds up across evaluators.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OnlineCounts {
    pub samples: u64,
    pub positives: f64,
    /// Summed log-loss and predicted probability.
    pub loss: f64,
    pub predicted: f64,
    /// (bucket, positives, negatives) of each bucket holding a sample, in
    /// bucket order.
    pub buckets: Vec<(u32, u64, u64)>,
}

impl OnlineCounts {
    /// Several evaluators' counts as one.
    pub fn merged<'a>(parts: impl IntoIterator<Item = &'a OnlineCounts>) -> OnlineCounts {
        let mut total = OnlineCounts::default();
        let mut buckets = std::collections::BTreeMap::<u32, (u64, u64)>::new();
        for p in parts {
            total.samples += p.samples;
            total.positives += p.positives;
            total.loss += p.loss;
            total.predicted += p.predicted;
            for &(b, pos, neg) in &p.buckets {
                let e = buckets.entry(b).or_default();
                (e.0, e.1) = (e.0 + pos, e.1 + neg);
            }
        }
        total.buckets = buckets.into_iter().map(|(b, (pos, neg))| (b, pos, neg)).collect();
        total
    }

    /// Their metrics (the AUC bucketed).
    pub fn metrics(&self) -> OnlineMetrics {
        let auc = bucketed_auc(self.buckets.iter().map(|&(_, pos, neg)| (pos, neg)));
        summarize(self.samples, self.positives, self.loss, self.predicted, auc)
    }

    fn from_histogram(samples: u64, sums: (f64, f64, f64), positive: &[u64], negative: &[u64]) -> OnlineCounts {
        let buckets = (0..positive.len())
            .filter(|&b| positive[b] + negative[b] > 0)
            .map(|b| (b as u32, positive[b], negative[b]))
            .collect();
        OnlineCounts { samples, positives: sums.0, loss: sums.1, predicted: sums.2, buckets }
    }
}

/// Scores before training, over a window and over the run.
#[derive(Clone, Debug)]
pub struct ProgressiveEval {
    /// The last `capacity` samples (logit, label), oldest at `next` once full.
    logits: Vec<f32>,
    labels: Vec<f32>,
    capacity: usize,
    next: usize,
    run: RunTotals,
}

/// The whole run's counts.
#[derive(Clone, Debug)]
struct RunTotals {
    samples: u64,
    positives: f64,
    loss: f64,
    predicted: f64,
    /// Samples by bucket of predicted probability, by label.
    positive_buckets: Vec<u64>,
    negative_buckets: Vec<u64>,
}

impl ProgressiveEval {
    /// A window of the last `window` samples (at least one).
    pub fn new(window: usize) -> Self {
        let capacity = window.max(1);
        ProgressiveEval {
            logits: Vec::with_capacity(capacity.min(1 << 20)),
            labels: Vec::with_capacity(capacity.min(1 << 20)),
            capacity,
            next: 0,
            run: RunTotals {
                samples: 0,
                positives: 0.0,
                loss: 0.0,
                predicted: 0.0,
                positive_buckets: vec![0; RUN_AUC_BUCKETS],
                negative_buckets: vec![0; RUN_AUC_BUCKETS],
            },
        }
    }

    /// A batch's logits, scored before it was trained on, and its 0/1 labels.
    pub fn add(&mut self, logits: &[f32], labels: &[f32]) {
        assert_eq!(logits.len(), labels.len(), "logits and labels differ in length");
        for (&x, &y) in logits.iter().zip(labels) {
            let (x64, y64) = (f64::from(x), f64::from(y));
            let p = sigmoid(x64);
            let run = &mut self.run;
            run.samples += 1;
            run.positives += y64;
            run.loss += logistic_loss(x64, y64);
            run.predicted += p;
            if y > 0.5 {
                run.positive_buckets[bucket(p)] += 1;
            } else {
                run.negative_buckets[bucket(p)] += 1;
            }
            if self.logits.len() < self.capacity {
                self.logits.push(x);
                self.labels.push(y);
            } else {
                self.logits[self.next] = x;
                self.labels[self.next] = y;
                self.next = (self.next + 1) % self.capacity;
            }
        }
    }

    /// The last `window` samples' metrics (fewer before that many were seen).
    pub fn window(&self) -> OnlineMetrics {
        let (mut positives, mut loss, mut predicted) = (0.0, 0.0, 0.0);
        for (&x, &y) in self.logits.iter().zip(&self.labels) {
            let (x, y) = (f64::from(x), f64::from(y));
            positives += y;
            loss += logistic_loss(x, y);
            predicted += sigmoid(x);
        }
        let auc = if self.logits.is_empty() { f64::NAN } else { auc(&self.logits, &self.labels) };
        summarize(self.logits.len() as u64, positives, loss, predicted, auc)
    }

    /// The whole run's metrics (AUC from the histograms).
    pub fn run(&self) -> OnlineMetrics {
        let run = &self.run;
        let auc = bucketed_auc(run.positive_buckets.iter().copied().zip(run.negative_buckets.iter().copied()));
        summarize(run.samples, run.positives, run.loss, run.predicted, auc)
    }

    /// The whole run's counts, to add to other evaluators'.
    pub fn run_counts(&self) -> OnlineCounts {
        let r = &self.run;
        OnlineCounts::from_histogram(
            r.samples,
            (r.positives, r.loss, r.predicted),
            &r.positive_buckets,
            &r.negative_buckets,
        )
    }

    /// The window's counts (its AUC bucketed like the run's once merged).
    pub fn window_counts(&self) -> OnlineCounts {
        let (mut positive, mut negative) = (vec![0u64; RUN_AUC_BUCKETS], vec![0u64; RUN_AUC_BUCKETS]);
        let (mut positives, mut loss, mut predicted) = (0.0, 0.0, 0.0);
        for (&x, &y) in self.logits.iter().zip(&self.labels) {
            let (x, y64) = (f64::from(x), f64::from(y));
            let p = sigmoid(x);
            positives += y64;
            loss += logistic_loss(x, y64);
            predicted += p;
            if y > 0.5 {
                positive[bucket(p)] += 1;
            } else {
                negative[bucket(p)] += 1;
            }
        }
        OnlineCounts::from_histogram(self.logits.len() as u64, (positives, loss, predicted), &positive, &negative)
    }

    /// Samples the window holds.
    pub fn window_len(&self) -> usize {
        self.logits.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::log_loss_from_logits;
    use crate::rng::Rng;

    /// Samples whose logit predicts the label somewhat (a model's scores).
    fn samples(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        let labels: Vec<f32> = (0..n).map(|_| if rng.uniform(0.0, 1.0) < 0.3 { 1.0 } else { 0.0 }).collect();
        let logits = labels.iter().map(|&y| (rng.uniform(-2.0, 1.0) + 1.5 * f64::from(y)) as f32).collect();
        (logits, labels)
    }

    #[test]
    fn the_window_measures_exactly_the_last_samples() {
        let (logits, labels) = samples(2500, 1);
        let mut eval = ProgressiveEval::new(1000);
        for (x, y) in logits.chunks(300).zip(labels.chunks(300)) {
            eval.add(x, y);
        }
        assert_eq!(eval.window_len(), 1000);
        let (tail_x, tail_y) = (&logits[1500..], &labels[1500..]);
        let w = eval.window();
        assert_eq!(w.samples, 1000);
        assert_eq!(w.auc, auc(tail_x, tail_y), "the same samples, in another order: the same exact AUC");
        assert!((w.log_loss - log_loss_from_logits(tail_x, tail_y)).abs() < 1e-12, "{w:?}");
        let r = eval.run();
        assert_eq!(r.samples, 2500);
        assert!((r.log_loss - log_loss_from_logits(&logits, &labels)).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn the_runs_bucketed_auc_is_the_exact_auc_within_its_resolution() {
        let (logits, labels) = samples(20_000, 2);
        let mut eval = ProgressiveEval::new(10);
        eval.add(&logits, &labels);
        let (bucketed, exact) = (eval.run().auc, auc(&logits, &labels));
        assert!(exact > 0.7, "a predictive model: {exact}");
        assert!((bucketed - exact).abs() < 1e-3, "bucketed {bucketed}, exact {exact}");
        // Equal scores tie in both: one half.
        let mut tied = ProgressiveEval::new(4);
        tied.add(&[0.3; 4], &[1.0, 0.0, 1.0, 0.0]);
        assert_eq!((tied.run().auc, tied.window().auc), (0.5, 0.5));
    }

    /// Two evaluators' counts merged: the run's sums of all their samples,
    /// and an AUC that is one evaluator's of them all within the buckets'
    /// resolution; one evaluator's counts give its own run figures.
    #[test]
    fn counts_of_several_evaluators_add_up_to_one_evaluators() {
        let (logits, labels) = samples(20_000, 3);
        let (mut all, mut a, mut b) =
            (ProgressiveEval::new(20_000), ProgressiveEval::new(6000), ProgressiveEval::new(6000));
        for (i, (x, y)) in logits.chunks(500).zip(labels.chunks(500)).enumerate() {
            all.add(x, y);
            if i % 2 == 0 { a.add(x, y) } else { b.add(x, y) }
        }
        let run = OnlineCounts::merged([&a.run_counts(), &b.run_counts()]).metrics();
        let whole = all.run();
        assert_eq!(run.samples, 20_000);
        assert!((run.log_loss - whole.log_loss).abs() < 1e-12 && (run.calibration - whole.calibration).abs() < 1e-12);
        assert!((run.auc - whole.auc).abs() < 1e-12, "the same histograms: {run:?} {whole:?}");
        assert_eq!(a.run_counts().metrics(), a.run());
        // The windows: each evaluator's last 6000, 12 000 samples in all.
        let window = OnlineCounts::merged([&a.window_counts(), &b.window_counts()]).metrics();
        let tail = 20_000 - 12_000;
        let (tx, ty) = (&logits[tail..], &labels[tail..]);
        assert_eq!(window.samples, 12_000);
        assert!((window.log_loss - log_loss_from_logits(tx, ty)).abs() < 1e-9, "{window:?}");
        assert!((window.auc - auc(tx, ty)).abs() < 1e-3, "{} {}", window.auc, auc(tx, ty));
    }

    #[test]
    fn a_predictor_of_the_base_rate_has_normalized_entropy_and_calibration_one() {
        // 1 in 4 positive, every prediction 0.25: log-loss is the base rate's entropy.
        let labels: Vec<f32> = (0..4000).map(|i| if i % 4 == 0 { 1.0 } else { 0.0 }).collect();
        let logit = (0.25f64 / 0.75).ln() as f32;
        let mut eval = ProgressiveEval::new(4000);
        eval.add(&vec![logit; labels.len()], &labels);
        for m in [eval.window(), eval.run()] {
            assert!((m.normalized_entropy - 1.0).abs() < 1e-6, "{m:?}");
            assert!((m.calibration - 1.0).abs() < 1e-6, "{m:?}");
        }
        // Predicting twice the base rate: calibration 2, and worse than the base rate.
        let mut over = ProgressiveEval::new(4000);
        over.add(&vec![(0.5f64 / 0.5).ln() as f32; labels.len()], &labels);
        let m = over.window();
        assert!((m.calibration - 2.0).abs() < 1e-6 && m.normalized_entropy > 1.0, "{m:?}");
    }

    #[test]
    fn undefined_metrics_are_nan_not_a_panic() {
        let eval = ProgressiveEval::new(0);
        let m = eval.window();
        assert_eq!(m.samples, 0);
        assert!(m.auc.is_nan() && m.log_loss.is_nan() && m.normalized_entropy.is_nan() && m.calibration.is_nan());
        let mut negatives = ProgressiveEval::new(3);
        negatives.add(&[0.1, f32::NAN, -0.4], &[0.0, 0.0, 0.0]);
        let m = negatives.run();
        assert!(m.auc.is_nan() && m.normalized_entropy.is_nan() && m.calibration.is_nan(), "{m:?}");
        assert_eq!(negatives.window_len(), 3);
    }
}
