//! Exact AUC (ties share their average rank) and log-loss; progressive
//! validation over a window and a run in [`online`].

pub mod online;
pub mod tasks;

/// Area under the ROC curve of `scores` against 0/1 `labels`. Tied scores
/// count half, as the Mann–Whitney statistic with average ranks does. NaN when
/// one class is absent. Total on any input: NaN scores (a diverged model) rank
/// below every number and tie with each other, whatever their bit patterns;
/// [`count_nan`] says how many there were.
pub fn auc(scores: &[f32], labels: &[f32]) -> f64 {
    assert_eq!(scores.len(), labels.len(), "scores and labels differ in length");
    let rank_key = |i: u32| {
        let s = scores[i as usize];
        (!s.is_nan(), if s.is_nan() { 0.0 } else { s })
    };
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| {
        let (ka, kb) = (rank_key(a), rank_key(b));
        ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
    });
    let (mut pos, mut rank_sum) = (0f64, 0f64);
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        let group = rank_key(order[i]);
        let mut pos_in_group = 0f64;
        // `==` on the canonical key: every NaN is one group, and each step
        // of this loop advances `j`, so the walk ends.
        while j < order.len() && rank_key(order[j]) == group {
            pos_in_group += f64::from(labels[order[j] as usize]);
            j += 1;
        }
        // Ranks i+1 ..= j share their mean.
        let mean_rank = (i + 1 + j) as f64 / 2.0;
        rank_sum += pos_in_group * mean_rank;
        pos += pos_in_group;
        i = j;
    }
    let neg = scores.len() as f64 - pos;
    if pos == 0.0 || neg == 0.0 {
        return f64::NAN;
    }
    (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

/// How many scores are NaN (reported beside an AUC that ranked them last).
pub fn count_nan(scores: &[f32]) -> u64 {
    scores.iter().filter(|s| s.is_nan()).count() as u64
}

/// Stable logistic loss of one logit: max(x,0) − x·y + log(1+exp(−|x|)).
#[inline]
pub fn logistic_loss(logit: f64, label: f64) -> f64 {
    logit.max(0.0) - logit * label + (-logit.abs()).exp().ln_1p()
}

/// [`logistic_loss`] and [`sigmoid`] of one logit at once: both take
/// `exp(−|x|)` (the sigmoid's `exp(−x)` for x ≥ 0, `exp(x)` below), so it is
/// computed once; the same bits as the two calls (tested).
#[inline]
pub fn logistic_loss_and_sigmoid(logit: f64, label: f64) -> (f64, f64) {
    let e = (-logit.abs()).exp();
    let loss = logit.max(0.0) - logit * label + e.ln_1p();
    let p = if logit >= 0.0 { 1.0 / (1.0 + e) } else { e / (1.0 + e) };
    (loss, p)
}

/// Mean log-loss from logits (exact even where the sigmoid saturates).
pub fn log_loss_from_logits(logits: &[f32], labels: &[f32]) -> f64 {
    if logits.is_empty() {
        return f64::NAN;
    }
    let s: f64 = logits.iter().zip(labels).map(|(&x, &y)| logistic_loss(f64::from(x), f64::from(y))).sum();
    s / logits.len() as f64
}

/// Mean log-loss from probabilities, clamped away from 0 and 1.
pub fn log_loss_from_probs(probs: &[f64], labels: &[f32]) -> f64 {
    if probs.is_empty() {
        return f64::NAN;
    }
    let eps = 1e-15;
    let s: f64 = probs
        .iter()
        .zip(labels)
        .map(|(&p, &y)| {
            let p = p.clamp(eps, 1.0 - eps);
            -(f64::from(y) * p.ln() + (1.0 - f64::from(y)) * (1.0 - p).ln())
        })
        .sum();
    s / probs.len() as f64
}

#[inline]
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// O(P·N) definition: P(score_pos > score_neg) + ½ P(tie).
    fn naive_auc(scores: &[f32], labels: &[f32]) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for (i, &li) in labels.iter().enumerate() {
            for (j, &lj) in labels.iter().enumerate() {
                if li == 1.0 && lj == 0.0 {
                    den += 1.0;
                    if scores[i] > scores[j] {
                        num += 1.0;
                    } else if scores[i] == scores[j] {
                        num += 0.5;
                    }
                }
            }
        }
        num / den
    }

    #[test]
    fn loss_and_sigmoid_together_are_the_two_calls_bit_for_bit() {
        let mut rng = crate::rng::Rng::new(17);
        let mut logits =
            vec![0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::MIN_POSITIVE / 4.0, -1e-300, 745.0, -745.0];
        logits.extend((0..100_000).map(|i| {
            let scale = [1e-6, 0.5, 8.0, 60.0, 800.0][i % 5];
            rng.uniform(-scale, scale)
        }));
        for &x in &logits {
            for y in [0.0, 1.0, 0.3] {
                let (loss, p) = logistic_loss_and_sigmoid(x, y);
                assert_eq!(loss.to_bits(), logistic_loss(x, y).to_bits(), "loss at {x:e}, {y}");
                assert_eq!(p.to_bits(), sigmoid(x).to_bits(), "sigmoid at {x:e}");
            }
        }
        let (loss, p) = logistic_loss_and_sigmoid(f64::NAN, 1.0);
        assert!(loss.is_nan() && p.is_nan());
    }

    #[test]
    fn auc_matches_pairwise_definition_with_ties() {
        let mut rng = crate::rng::Rng::new(5);
        for _ in 0..50 {
            let n = 2 + rng.below(60) as usize;
            let scores: Vec<f32> = (0..n).map(|_| rng.below(6) as f32).collect();
            let mut labels: Vec<f32> = (0..n).map(|_| rng.below(2) as f32).collect();
            labels[0] = 0.0;
            labels[1] = 1.0;
            assert!((auc(&scores, &labels) - naive_auc(&scores, &labels)).abs() < 1e-12);
        }
        assert_eq!(auc(&[0.1, 0.9], &[0.0, 1.0]), 1.0);
        assert_eq!(auc(&[0.5, 0.5], &[0.0, 1.0]), 0.5);
        assert!(auc(&[0.5], &[1.0]).is_nan());
    }

    #[test]
    fn auc_is_total_on_nan_scores() {
        // A diverged model: NaN scores (two bit patterns) rank below every
        // number and tie with each other. This used to loop forever.
        let other_nan = f32::from_bits(f32::NAN.to_bits() ^ 1);
        assert!(other_nan.is_nan());
        let scores = [f32::NAN, 0.2, other_nan, 0.9, f32::NAN, -0.0, 0.0];
        let labels = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let as_lowest: Vec<f32> = scores.iter().map(|&s| if s.is_nan() { -1e30 } else { s }).collect();
        assert_eq!(auc(&scores, &labels), naive_auc(&as_lowest, &labels));
        assert_eq!(count_nan(&scores), 3);
        assert_eq!(auc(&[f32::NAN, f32::NAN], &[0.0, 1.0]), 0.5);
    }

    #[test]
    fn logistic_loss_is_stable_and_correct() {
        assert!((logistic_loss(0.0, 1.0) - 2f64.ln()).abs() < 1e-12);
        assert!(logistic_loss(1000.0, 0.0).is_finite());
        assert!((logistic_loss(1000.0, 0.0) - 1000.0).abs() < 1e-9);
        assert!(logistic_loss(-1000.0, 0.0) < 1e-12);
        let x: f64 = 0.7;
        let p = sigmoid(x);
        assert!((logistic_loss(x, 1.0) + p.ln()).abs() < 1e-12);
        assert!((log_loss_from_probs(&[p], &[0.0]) - logistic_loss(x, 0.0)).abs() < 1e-12);
    }
}
