//! S0.7, label-grouped batches (`data.group_by_label`): every training
//! batch holds samples of one label of one task (`Config::group_task`): a
//! class of a multiclass task, 0 or 1 of a binary one; samples whose label
//! is masked form a group of their own.
//!
//! A policy of `regroup.rs`: each window of
//! `max(data.group_window_rows, batch_size)` rows is split by label
//! (ascending; each label's rows keep the file's order) into batches of
//! `batch_size` (a label's last batch may be shorter), handed out in an
//! order shuffled by a generator seeded from `train.seed`, the epoch and
//! where the window starts; a resume skips what was handed out.

use sparrow_core::Batch;
use sparrow_core::batch::DataPosition;

use crate::regroup::{Regrouped, Regrouping, shuffle, window_rng};
use crate::source::BatchSource;

/// Splits a window by task `task`'s label.
pub struct ByLabel {
    task: usize,
    seed: u64,
}

/// Any reader's training rows, regrouped into batches of one label each.
pub type LabelGroups = Regrouped<ByLabel>;

impl Regrouped<ByLabel> {
    /// Groups `inner`'s rows by task `task`'s label, windows of
    /// `window_rows`, the order drawn from `seed`.
    pub fn new(inner: Box<dyn BatchSource>, task: usize, window_rows: usize, seed: u64) -> LabelGroups {
        Regrouped::with_policy(inner, ByLabel { task, seed }, window_rows)
    }
}

impl Regrouping for ByLabel {
    fn split(&self, rows: &Batch, batch_size: usize, start: DataPosition) -> Vec<Vec<usize>> {
        let t = rows.tasks();
        // Masked (NaN) labels sort after every class as a group of their own.
        let key = |r: usize| {
            let l = rows.labels[r * t + self.task.min(t - 1)];
            if l.is_nan() { u32::MAX } else { l.to_bits() }
        };
        let mut order: Vec<usize> = (0..rows.rows()).collect();
        // Labels are 0, 1 or a class id (non-negative): their bits sort as their values.
        order.sort_by_key(|&r| key(r));
        let mut batches: Vec<Vec<usize>> = Vec::new();
        for r in order {
            match batches.last_mut() {
                Some(b) if b.len() < batch_size && key(b[0]) == key(r) => b.push(r),
                _ => batches.push(vec![r]),
            }
        }
        shuffle(&mut batches, &mut window_rng(self.seed, start));
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regroup::tests::{Rows, assert_complete_and_resumable};

    fn groups(seed: u64) -> Box<dyn BatchSource> {
        Box::new(LabelGroups::new(Rows::boxed(100), 0, 40, seed))
    }

    #[test]
    fn batches_hold_one_label_each_in_a_seeded_repeatable_order_and_resume_exactly() {
        let whole = assert_complete_and_resumable(&|| groups(5), 100, 0);
        for (_, labels, _) in &whole {
            assert!(labels.iter().all(|&l| l == labels[0]), "one label a batch: {labels:?}");
        }
        let again = assert_complete_and_resumable(&|| groups(5), 100, 0);
        assert_eq!(again, whole, "the same seed, the same batches");
        let other = assert_complete_and_resumable(&|| groups(6), 100, 0);
        assert_ne!(other.iter().map(|b| &b.0).collect::<Vec<_>>(), whole.iter().map(|b| &b.0).collect::<Vec<_>>());
        // Labels interleave within a window (not all of one label first).
        let first_window: Vec<u32> = whole.iter().take_while(|b| b.2.offset == 0).map(|b| b.1[0]).collect();
        assert!(first_window.windows(2).any(|w| w[0] != w[1]) && first_window.len() > 3, "{first_window:?}");
    }
}
