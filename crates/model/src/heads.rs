//! A model's outputs, one group per task (`[[model.tasks]]`), and the
//! summed, masked loss over them: a binary task's logit takes the stable
//! logistic loss, a multiclass task's `classes` logits the softmax
//! cross-entropy, each times the task's weight. A masked label (NaN) adds
//! nothing to its task's loss or gradients. Each row's loss is also
//! multiplied by its sample weight, and the sum divided by the batch's
//! rows, as for one task.

use rayon::prelude::*;
use sparrow_core::config::{Task, TaskKind};
use sparrow_core::simd::Simd;

use crate::logistic::{self, Column, Scale};

/// One task's slice of a row's logits.
#[derive(Clone, Debug, PartialEq)]
pub struct Head {
    pub name: String,
    /// Its first logit in the row's outputs.
    pub offset: usize,
    /// 1 (binary) or the number of classes.
    pub outputs: usize,
    pub multiclass: bool,
    pub weight: f64,
}

/// The tasks' heads, in label order.
#[derive(Clone, Debug, PartialEq)]
pub struct Heads {
    heads: Vec<Head>,
}

impl Heads {
    /// One binary task of weight 1: the model as it was before tasks.
    pub fn one_binary() -> Heads {
        Heads { heads: vec![Head { name: "label".into(), offset: 0, outputs: 1, multiclass: false, weight: 1.0 }] }
    }

    pub fn of(tasks: &[Task]) -> Heads {
        let mut offset = 0;
        let heads = tasks
            .iter()
            .map(|t| {
                let h = Head {
                    name: t.name.clone(),
                    offset,
                    outputs: t.outputs,
                    multiclass: t.kind == TaskKind::Multiclass,
                    weight: t.weight,
                };
                offset += t.outputs;
                h
            })
            .collect();
        Heads { heads }
    }

    /// Logits a row has.
    pub fn outputs(&self) -> usize {
        self.heads.iter().map(|h| h.outputs).sum()
    }

    /// Labels a row has (one per task).
    pub fn tasks(&self) -> usize {
        self.heads.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Head> {
        self.heads.iter()
    }

    /// Whether this is one binary task of weight 1 (the model's own
    /// single-output paths apply, exactly as before tasks).
    pub fn is_one_binary(&self) -> bool {
        self.heads.len() == 1 && !self.heads[0].multiclass && self.heads[0].weight == 1.0
    }

    /// Calls `f` with the first task's logit and label of each row it is
    /// not masked in, when that task is binary (what figures of one task,
    /// such as progressive validation, read); `None` otherwise.
    pub fn with_first_binary<R>(
        &self,
        logits: &[f32],
        labels: &[f32],
        f: impl FnOnce(&[f32], &[f32]) -> R,
    ) -> Option<R> {
        if self.is_one_binary() && !labels.iter().any(|l| l.is_nan()) {
            return Some(f(logits, labels));
        }
        if self.heads[0].multiclass {
            return None;
        }
        let (o, t) = (self.outputs(), self.tasks());
        let (x, y): (Vec<f32>, Vec<f32>) = logits
            .chunks_exact(o)
            .zip(labels.chunks_exact(t))
            .filter(|(_, y)| !y[0].is_nan())
            .map(|(x, y)| (x[0], y[0]))
            .unzip();
        Some(f(&x, &y))
    }

    /// Refuses a label its task cannot take: a multiclass task's must be a
    /// class id below its outputs (or NaN, masked), a binary task's finite
    /// or NaN. The readers only make such labels; a batch from the wire is
    /// checked here, before any index is taken from it.
    pub fn check_labels(&self, labels: &[f32]) -> Result<(), crate::ModelError> {
        let t = self.tasks().max(1);
        // Binary and regression heads take any label but an infinity: one
        // pass over the bits first (the row-by-row loop below, which names
        // the task, was 2% of ESMM's dense step).
        if self.heads.iter().all(|h| !h.multiclass) {
            // No early exit: the fold vectorizes, `all` did not.
            let infinite = |y: &f32| y.to_bits() & !(1 << 31) == f32::INFINITY.to_bits();
            if !labels.iter().fold(false, |any, y| any | infinite(y)) {
                return Ok(());
            }
        }
        // Row by row, a task's head beside its label (no `i % t` a label:
        // a division each, 3% of ESMM's dense step).
        let rows = labels.chunks_exact(t);
        let tail = rows.remainder();
        for (y, h) in rows.flat_map(|row| row.iter().zip(&self.heads)).chain(tail.iter().zip(&self.heads)) {
            let y = *y;
            let fits = y.is_nan()
                || if h.multiclass { y >= 0.0 && y.fract() == 0.0 && (y as usize) < h.outputs } else { y.is_finite() };
            if !fits {
                return Err(crate::ModelError::BadLabel { task: h.name.clone(), label: y, outputs: h.outputs });
            }
        }
        Ok(())
    }

    /// The summed loss of a batch (over its rows) and d loss / d logits:
    /// `logits` is rows × outputs, `labels` rows × tasks, `weights` one
    /// per row.
    pub fn loss_and_seed(&self, logits: &[f32], labels: &[f32], weights: Option<&[f32]>) -> (f64, Vec<f32>) {
        self.loss_and_seed_in(Simd::Auto, logits, labels, weights)
    }

    /// [`loss_and_seed`](Self::loss_and_seed) with the instructions
    /// `train.simd` allows (the same bits with any).
    pub(crate) fn loss_and_seed_in(
        &self,
        simd: Simd,
        logits: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
    ) -> (f64, Vec<f32>) {
        let rows = labels.len() / self.tasks().max(1);
        let inv_b = 1.0 / rows.max(1) as f64;
        let (losses, seed) = self.rows_loss_and_seed(simd, logits, labels, weights, inv_b);
        (sum_in_order(&losses) * inv_b, seed)
    }

    /// [`loss_and_seed`](Self::loss_and_seed) of some of a batch's rows
    /// (`inv_b`: one over the whole batch's rows): each row's weighted
    /// loss, not yet summed, and the rows' seed.
    pub(crate) fn rows_loss_and_seed(
        &self,
        simd: Simd,
        logits: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        inv_b: f64,
    ) -> (Vec<f64>, Vec<f32>) {
        const ROWS: usize = 64;
        let (o, t) = (self.outputs(), self.tasks());
        let rows = labels.len() / t.max(1);
        let mut seed = vec![0.0f32; logits.len()];
        let mut losses = vec![0.0f64; rows];
        // A task at a time over a block of rows, so each row's loss adds
        // its tasks' in task order, as a row at a time did.
        (losses.par_chunks_mut(ROWS).zip(seed.par_chunks_mut(ROWS * o)))
            .zip(logits.par_chunks(ROWS * o).zip(labels.par_chunks(ROWS * t)))
            .enumerate()
            .for_each_init(Vec::new, |exps, (b, ((losses, seed), (x, y)))| {
                let weights = weights.map(|w| &w[b * ROWS..][..losses.len()]);
                for (task, h) in self.heads.iter().enumerate() {
                    if h.multiclass {
                        self.multiclass_rows(h, (x, &y[task..]), (weights, inv_b), seed, exps, losses);
                        continue;
                    }
                    let column =
                        Column { x: &x[h.offset..], y: &y[task..], seed: &mut seed[h.offset..], strides: (o, t) };
                    let scale = Scale { task_weight: h.weight, weights, inv_b };
                    logistic::add_column(simd, column, scale, losses);
                }
            });
        (losses, seed)
    }

    /// A multiclass task's rows (`y` its labels, a row's `tasks` apart):
    /// each one's weighted softmax cross-entropy added to its loss, its
    /// logits' gradients into `seed`; `exps` holds a row's exponentials.
    fn multiclass_rows(
        &self,
        h: &Head,
        (x, y): (&[f32], &[f32]),
        (weights, inv_b): (Option<&[f32]>, f64),
        seed: &mut [f32],
        exps: &mut Vec<f64>,
        losses: &mut [f64],
    ) {
        let (o, t) = (self.outputs(), self.tasks());
        for (r, loss) in losses.iter_mut().enumerate() {
            let label = y[r * t];
            if label.is_nan() {
                continue;
            }
            let weight = weights.map_or(1.0, |w| f64::from(w[r]));
            let scale = weight * inv_b;
            let (x, seed) = (&x[r * o + h.offset..][..h.outputs], &mut seed[r * o + h.offset..][..h.outputs]);
            let class = label as usize;
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            exps.clear();
            exps.extend(x.iter().map(|&v| f64::from(v - max).exp()));
            let sum: f64 = exps.iter().sum();
            *loss += h.weight * weight * (sum.ln() - f64::from(x[class] - max));
            for (k, (s, e)) in seed.iter_mut().zip(exps.iter()).enumerate() {
                let target = if k == class { 1.0 } else { 0.0 };
                *s = ((e / sum - target) * h.weight * scale) as f32;
            }
        }
    }
}

/// Rows' losses summed in row order (the sum of a batch run in halves is
/// the first half's losses, then the second's: the whole batch's bits).
pub(crate) fn sum_in_order(losses: &[f64]) -> f64 {
    losses.iter().fold(0.0, |sum, l| sum + l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads() -> Heads {
        Heads::of(&[
            Task { name: "click".into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 },
            Task { name: "kind".into(), kind: TaskKind::Multiclass, outputs: 3, weight: 0.5 },
        ])
    }

    /// The seed is the loss's gradient: central differences of the loss
    /// agree with it, for a binary and a multiclass head, weighted rows.
    #[test]
    fn the_seed_is_the_gradient_of_the_loss() {
        let h = heads();
        let logits = vec![0.3f32, 1.0, -0.5, 0.25, -1.2, 0.0, 2.0, -0.7];
        let labels = vec![1.0f32, 2.0, 0.0, 0.0];
        let weights = [1.0f32, 0.5];
        let (_, seed) = h.loss_and_seed(&logits, &labels, Some(&weights));
        for i in 0..logits.len() {
            let at = |d: f32| {
                let mut x = logits.clone();
                x[i] += d;
                h.loss_and_seed(&x, &labels, Some(&weights)).0
            };
            let numeric = (at(1e-3) - at(-1e-3)) / 2e-3;
            assert!((numeric - f64::from(seed[i])).abs() < 1e-4, "logit {i}: {numeric} vs {}", seed[i]);
        }
    }

    /// A masked label adds nothing: the row's loss and its task's
    /// gradients are as if the task were not there.
    #[test]
    fn a_masked_label_adds_nothing() {
        let h = heads();
        let logits = vec![0.3f32, 1.0, -0.5, 0.25];
        let (loss, seed) = h.loss_and_seed(&logits, &[f32::NAN, 1.0], None);
        assert_eq!(seed[0], 0.0);
        let (alone, _) =
            Heads::of(&[Task { name: "kind".into(), kind: TaskKind::Multiclass, outputs: 3, weight: 0.5 }])
                .loss_and_seed(&logits[1..], &[1.0], None);
        assert_eq!(loss.to_bits(), alone.to_bits());
        let (none, seed) = h.loss_and_seed(&logits, &[f32::NAN, f32::NAN], None);
        assert_eq!(none, 0.0);
        assert!(seed.iter().all(|&s| s == 0.0));
    }

    /// A class id at or past a task's classes, a fraction or a negative id,
    /// and an infinite binary label are refused naming the task (a batch
    /// from the wire could carry one; the loss would index past the row).
    #[test]
    fn labels_no_task_can_take_are_refused() {
        let h = heads();
        assert!(h.check_labels(&[1.0, 2.0, f32::NAN, f32::NAN, 0.0, 0.0]).is_ok());
        for bad in [[1.0, 3.0], [1.0, 1.5], [1.0, -1.0], [f32::INFINITY, 0.0]] {
            let err = h.check_labels(&bad).expect_err("refused").to_string();
            assert!(err.contains(if bad[0].is_finite() { "`kind`" } else { "`click`" }), "{bad:?}: {err}");
        }
        // In a later row, each label still read against its own task's head.
        let err = h.check_labels(&[1.0, 0.0, 0.0, 1.0, 1.0, 3.0]).expect_err("refused").to_string();
        assert!(err.contains("`kind`"), "{err}");
        // Labels short of a whole row: the last ones still read, each
        // against its own task's head.
        let err = h.check_labels(&[1.0, 0.0, f32::INFINITY]).expect_err("refused").to_string();
        assert!(err.contains("`click`"), "{err}");
        // Binary tasks alone (the pass over the bits first): NaN and any
        // finite label pass, either infinity in a later row is refused
        // naming its task.
        let binary = |name: &str| Task { name: name.into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 };
        let two = Heads::of(&[binary("click"), binary("buy")]);
        let mut labels: Vec<f32> = (0..40).map(|i| [0.0, 1.0, f32::NAN, -0.0, 2.5, f32::MAX][i % 6]).collect();
        assert!(two.check_labels(&labels).is_ok());
        for infinity in [f32::INFINITY, f32::NEG_INFINITY] {
            labels[33] = infinity;
            let err = two.check_labels(&labels).expect_err("refused").to_string();
            assert!(err.contains("`buy`"), "{err}");
        }
    }
}
