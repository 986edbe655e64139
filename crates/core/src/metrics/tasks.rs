//! Offline figures per task, as practitioners read them: for a binary task
//! AUC, log-loss, normalized entropy (log-loss over the entropy of the base
//! rate), calibration (predictions over labels) and, grouped by a field,
//! GAUC; for a multiclass task accuracy, top-k accuracy, macro one-vs-rest
//! AUC and log-loss. Rows whose label masks the task are left out of it.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use super::online::entropy;
use super::{auc, logistic_loss, sigmoid};
use crate::config::{Task, TaskKind};

/// One task's figures (NaN, written as null, where undefined).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TaskFigures {
    Binary {
        #[serde(deserialize_with = "nan_if_null")]
        auc: f64,
        #[serde(deserialize_with = "nan_if_null")]
        logloss: f64,
        #[serde(deserialize_with = "nan_if_null")]
        ne: f64,
        #[serde(deserialize_with = "nan_if_null")]
        calibration: f64,
        /// With `eval.group_by`: impression-weighted AUC over the groups
        /// that hold both classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gauc: Option<f64>,
        rows: u64,
    },
    Multiclass {
        #[serde(deserialize_with = "nan_if_null")]
        accuracy: f64,
        #[serde(deserialize_with = "nan_if_null")]
        top_k_accuracy: f64,
        #[serde(deserialize_with = "nan_if_null")]
        macro_auc: f64,
        #[serde(deserialize_with = "nan_if_null")]
        logloss: f64,
        rows: u64,
    },
}

/// A figure written as null (NaN) reads back as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Each task's scores and labels over the rows it is not masked in.
pub struct TaskColumns {
    /// A binary task: one logit a row; multiclass: `outputs` logits a row.
    pub logits: Vec<f32>,
    pub labels: Vec<f32>,
    /// The rows' group keys (`eval.group_by`), where given.
    pub groups: Vec<u64>,
}

/// Splits rows × outputs `logits` and rows × tasks `labels` by task,
/// leaving out each task's masked rows.
/// A row's probabilities from its logits (`logits`: every task's outputs,
/// in task order), appended to `out`: a binary task's σ(logit), a
/// multiclass task's softmax over its classes. What `sparrow predict`
/// writes, `serve` answers and Python's `Model.predict` returns.
pub fn row_probabilities(tasks: &[Task], logits: &[f32], out: &mut Vec<f32>) {
    let mut at = 0;
    for task in tasks {
        let x = &logits[at..at + task.outputs];
        at += task.outputs;
        match task.kind {
            TaskKind::Binary => out.push(sigmoid(f64::from(x[0])) as f32),
            TaskKind::Multiclass => {
                let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
                out.extend(x.iter().map(|&v| (f64::from(v - max).exp() / sum) as f32));
            }
        }
    }
}

pub fn task_columns(tasks: &[Task], logits: &[f32], labels: &[f32], groups: Option<&[u64]>) -> Vec<TaskColumns> {
    let outputs: usize = tasks.iter().map(|t| t.outputs).sum();
    let rows = labels.len() / tasks.len().max(1);
    let mut offset = 0;
    tasks
        .iter()
        .enumerate()
        .map(|(t, task)| {
            let mut c = TaskColumns { logits: Vec::new(), labels: Vec::new(), groups: Vec::new() };
            for r in 0..rows {
                let y = labels[r * tasks.len() + t];
                if y.is_nan() {
                    continue;
                }
                let at = r * outputs + offset;
                c.logits.extend_from_slice(&logits[at..at + task.outputs]);
                c.labels.push(y);
                if let Some(g) = groups {
                    c.groups.push(g[r]);
                }
            }
            offset += task.outputs;
            c
        })
        .collect()
}

/// Every task's figures by name (`top_k`: the multiclass top-k accuracy's k).
pub fn task_figures(
    tasks: &[Task],
    logits: &[f32],
    labels: &[f32],
    groups: Option<&[u64]>,
    top_k: usize,
) -> BTreeMap<String, TaskFigures> {
    tasks
        .iter()
        .zip(task_columns(tasks, logits, labels, groups))
        .map(|(task, c)| {
            let figures = match task.kind {
                TaskKind::Binary => binary(&c, groups.is_some()),
                TaskKind::Multiclass => multiclass(&c, task.outputs, top_k),
            };
            (task.name.clone(), figures)
        })
        .collect()
}

fn binary(c: &TaskColumns, grouped: bool) -> TaskFigures {
    let n = c.labels.len();
    let positives: f64 = c.labels.iter().map(|&y| f64::from(y)).sum();
    let loss: f64 = c.logits.iter().zip(&c.labels).map(|(&x, &y)| logistic_loss(f64::from(x), f64::from(y))).sum();
    let predicted: f64 = c.logits.iter().map(|&x| sigmoid(f64::from(x))).sum();
    let logloss = if n == 0 { f64::NAN } else { loss / n as f64 };
    let h = if n == 0 { 0.0 } else { entropy(positives / n as f64) };
    TaskFigures::Binary {
        auc: if n == 0 { f64::NAN } else { auc(&c.logits, &c.labels) },
        logloss,
        ne: if h > 0.0 { logloss / h } else { f64::NAN },
        calibration: if positives > 0.0 { predicted / positives } else { f64::NAN },
        gauc: grouped.then(|| gauc(&c.logits, &c.labels, &c.groups)),
        rows: n as u64,
    }
}

/// Impression-weighted mean of each group's AUC, over the groups holding
/// both classes (as in the DIN paper); NaN when none does.
pub fn gauc(scores: &[f32], labels: &[f32], groups: &[u64]) -> f64 {
    // Ordered by group: the sum is the same, bit for bit, run to run.
    let mut by_group: BTreeMap<u64, (Vec<f32>, Vec<f32>)> = BTreeMap::new();
    for ((&s, &y), &g) in scores.iter().zip(labels).zip(groups) {
        let e = by_group.entry(g).or_default();
        e.0.push(s);
        e.1.push(y);
    }
    let (mut sum, mut weight) = (0.0, 0.0);
    for (s, y) in by_group.values() {
        let positives = y.iter().filter(|&&y| y > 0.5).count();
        if positives == 0 || positives == y.len() {
            continue;
        }
        sum += y.len() as f64 * auc(s, y);
        weight += y.len() as f64;
    }
    if weight > 0.0 { sum / weight } else { f64::NAN }
}

fn multiclass(c: &TaskColumns, k: usize, top_k: usize) -> TaskFigures {
    let n = c.labels.len();
    let (mut correct, mut in_top, mut loss) = (0u64, 0u64, 0.0f64);
    let mut probs = vec![0.0f32; n * k];
    for (r, (x, &y)) in c.logits.chunks_exact(k).zip(&c.labels).enumerate() {
        let class = y as usize;
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
        loss += sum.ln() - f64::from(x[class] - max);
        for (p, &v) in probs[r * k..(r + 1) * k].iter_mut().zip(x) {
            *p = (f64::from(v - max).exp() / sum) as f32;
        }
        let above = x.iter().filter(|&&v| v > x[class]).count();
        correct += u64::from(above == 0 && x.iter().position(|&v| v == max) == Some(class));
        in_top += u64::from(above < top_k.max(1));
    }
    // One-vs-rest AUC of each class present and absent somewhere, averaged.
    let mut aucs = Vec::new();
    for class in 0..k {
        let scores: Vec<f32> = (0..n).map(|r| probs[r * k + class]).collect();
        let is: Vec<f32> = c.labels.iter().map(|&y| f32::from(y as usize == class)).collect();
        let positives = is.iter().filter(|&&v| v > 0.5).count();
        if positives > 0 && positives < n {
            aucs.push(auc(&scores, &is));
        }
    }
    let mean = |x: f64| if n == 0 { f64::NAN } else { x / n as f64 };
    TaskFigures::Multiclass {
        accuracy: mean(correct as f64),
        top_k_accuracy: mean(in_top as f64),
        macro_auc: if aucs.is_empty() { f64::NAN } else { aucs.iter().sum::<f64>() / aucs.len() as f64 },
        logloss: mean(loss),
        rows: n as u64,
    }
}

/// Written here, beside `row_probabilities`: the config module only
/// describes the outputs (metrics uses config, not the other way round).
impl crate::config::ServedOutput {
    /// This output's values from rows of `logits_per_row` logits, appended
    /// to `out` (`sparrow predict`'s arithmetic, so the figures are its own).
    pub fn extend_from(&self, logits: &[f32], logits_per_row: usize, out: &mut Vec<f32>) {
        for row in logits.chunks_exact(logits_per_row) {
            let own = &row[self.offset..self.offset + self.per_row];
            if !self.multiclass {
                out.push(super::sigmoid(f64::from(own[0])) as f32);
                continue;
            }
            let task = crate::config::Task {
                name: String::new(),
                kind: crate::config::TaskKind::Multiclass,
                outputs: self.per_row,
                weight: 1.0,
            };
            row_probabilities(std::slice::from_ref(&task), own, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(name: &str, kind: TaskKind, outputs: usize) -> Task {
        Task { name: name.into(), kind, outputs, weight: 1.0 }
    }

    /// Each task is figured over its own unmasked rows: the binary task's
    /// figures are those of its column alone; predicting the base rate
    /// gives NE and calibration 1.
    #[test]
    fn masked_rows_are_left_out_of_their_task() {
        let tasks = [task("click", TaskKind::Binary, 1), task("cvr", TaskKind::Binary, 1)];
        let base = (0.25f64 / 0.75).ln() as f32;
        let logits = vec![base, 2.0, base, -1.0, base, 0.5, base, 9.0];
        let labels = vec![1.0, 1.0, 0.0, f32::NAN, 0.0, 0.0, 0.0, f32::NAN];
        let figures = task_figures(&tasks, &logits, &labels, None, 1);
        let TaskFigures::Binary { ne, calibration, rows, gauc, .. } = &figures["click"] else { panic!() };
        assert_eq!(*rows, 4);
        assert!((ne - 1.0).abs() < 1e-6 && (calibration - 1.0).abs() < 1e-6, "{figures:?}");
        assert!(gauc.is_none());
        let TaskFigures::Binary { auc, rows, .. } = &figures["cvr"] else { panic!() };
        assert_eq!((*rows, *auc), (2, 1.0));
    }

    /// GAUC weighs each two-class group's AUC by its rows and skips
    /// one-class groups.
    #[test]
    fn gauc_weighs_groups_by_impressions() {
        let scores = [0.9f32, 0.1, 0.2, 0.8, 0.7, 0.3, 0.5];
        let labels = [1.0f32, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0];
        let groups = [1u64, 1, 2, 2, 2, 2, 3];
        // Group 1: AUC 1 (2 rows); group 2: positives 0.2, 0.3 below both
        // negatives: AUC 0 (4 rows); group 3 has one class.
        assert!((gauc(&scores, &labels, &groups) - 2.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn multiclass_accuracy_top_k_and_macro_auc() {
        let tasks = [task("kind", TaskKind::Multiclass, 3)];
        let logits = vec![3.0, 1.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 2.0, 0.0, 1.0, 2.0];
        let labels = vec![0.0, 1.0, 0.0, 1.0];
        let figures = task_figures(&tasks, &logits, &labels, None, 2);
        let TaskFigures::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, rows } = &figures["kind"] else {
            panic!()
        };
        assert_eq!(*rows, 4);
        assert_eq!(*accuracy, 0.5);
        assert_eq!(*top_k_accuracy, 1.0);
        assert!(macro_auc.is_finite() && logloss.is_finite() && *logloss > 0.0);
    }
}
