//! S0.7, label-grouped batches (`data.group_by_label`): every training
//! batch holds samples of one label of one task (`Config::group_task`): a
//! class of a multiclass task, 0 or 1 of a binary one; samples whose label
//! is masked form a group of their own.
//!
//! The reader reads a window of `max(data.group_window_rows, batch_size)`
//! rows, splits it by label (ascending; each label's rows keep the file's
//! order) into batches of `batch_size` (a label's last batch may be
//! shorter), and hands the window's batches out in an order shuffled by a
//! generator seeded from `train.seed`, the epoch and where the window
//! starts. The same config and data give the same batches in the same
//! order.
//!
//! A batch from inside a window ends at the window's start with
//! [`DataPosition::skip`] = the batches handed out so far, as the weighting
//! buffer's do (`weighting.rs`): a resumed reader reads the window again,
//! splits and shuffles it the same way and skips them.

use sparrow_core::Batch;
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::rng::Rng;

use crate::error::DataError;
use crate::layout::DataLayout;
use crate::source::BatchSource;

/// A window read and split, being handed out.
struct Window {
    rows: Batch,
    /// Each batch's rows, in hand-out order.
    batches: Vec<Vec<usize>>,
    next: usize,
    start: DataPosition,
}

/// Any reader's training rows, regrouped into batches of one label each.
pub struct LabelGroups {
    inner: Box<dyn BatchSource>,
    task: usize,
    window_rows: usize,
    seed: u64,
    window: Option<Window>,
    /// Where the next window starts, and its batches to skip (a resume).
    next_start: DataPosition,
}

impl LabelGroups {
    /// Groups `inner`'s rows by task `task`'s label, windows of
    /// `window_rows`, the order drawn from `seed`.
    pub fn new(inner: Box<dyn BatchSource>, task: usize, window_rows: usize, seed: u64) -> LabelGroups {
        LabelGroups { inner, task, window_rows, seed, window: None, next_start: DataPosition::default() }
    }

    /// Splits a window's rows by label into batches of `batch_size`, in
    /// an order drawn from the seed, the epoch and the window's start.
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
        let mut rng =
            Rng::new(self.seed ^ start.epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ start.offset.rotate_left(17));
        for i in (1..batches.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            batches.swap(i, j);
        }
        batches
    }

    /// The window's next batch; `None` when it is spent.
    fn take(&mut self) -> Option<Batch> {
        let w = self.window.as_mut()?;
        let picked = w.batches.get(w.next)?;
        w.next += 1;
        let rows = &w.rows;
        let mut out = BatchBuilder::new(rows.num_fields, rows.num_dense, rows.key_weights.is_some(), picked.len())
            .with_tasks(rows.tasks());
        let t = rows.tasks();
        for &r in picked {
            out.begin_row();
            if let Some(ts) = &rows.timestamps {
                out.set_timestamp(ts[r]);
            }
            for &v in &rows.dense[r * rows.num_dense..(r + 1) * rows.num_dense] {
                out.push_dense(v);
            }
            for field in 0..rows.num_fields {
                for k in rows.bag(r, field) {
                    out.push_key(field, rows.keys[k], rows.key_weights.as_ref().map_or(1.0, |w| w[k]));
                }
            }
            let labels = &rows.labels[r * t..(r + 1) * t];
            labels[1..].iter().for_each(|&l| out.push_label(l));
            out.end_row(labels[0]);
        }
        let last = w.next == w.batches.len();
        let end = if last { w.rows.end } else { DataPosition { skip: w.next as u64, ..w.start } };
        let mut batch = out.finish(end);
        // The window's truncations count with its last batch (a resumed
        // run hands that one out again, never the ones before it).
        if last {
            batch.truncated_sequences = w.rows.truncated_sequences;
            self.window = None;
        }
        Some(batch)
    }
}

impl BatchSource for LabelGroups {
    fn layout(&self) -> &DataLayout {
        self.inner.layout()
    }

    fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
        self.window = None;
        self.next_start = pos;
        self.inner.seek(DataPosition { skip: 0, ..pos })
    }

    fn next_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError> {
        let batch_size = batch_size.max(1);
        loop {
            if let Some(batch) = self.take() {
                return Ok(Some(batch));
            }
            let Some(rows) = self.inner.next_batch(self.window_rows.max(batch_size), epoch)? else { return Ok(None) };
            let start = DataPosition { skip: 0, ..self.next_start };
            let skip = self.next_start.skip as usize;
            self.next_start = DataPosition { skip: 0, ..rows.end };
            let batches = self.split(&rows, batch_size, start);
            // A resumed window: its first `skip` batches were trained before.
            let next = skip.min(batches.len());
            self.window = Some(Window { rows, batches, next, start });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows 0..n of one field, key = row, label = row's class (row % 3,
    /// every seventh masked), read `batch_size` rows at a time from `pos`.
    struct Rows {
        n: u64,
        at: u64,
        layout: DataLayout,
    }

    impl BatchSource for Rows {
        fn layout(&self) -> &DataLayout {
            &self.layout
        }
        fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
            assert_eq!(pos.skip, 0, "the inner reader sees window starts only");
            self.at = pos.offset;
            Ok(())
        }
        fn next_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError> {
            if self.at == self.n {
                return Ok(None);
            }
            let mut b = BatchBuilder::new(1, 0, false, batch_size);
            while b.rows() < batch_size && self.at < self.n {
                b.begin_row();
                b.push_key(0, self.at, 1.0);
                b.end_row(if self.at % 7 == 6 { f32::NAN } else { (self.at % 3) as f32 });
                self.at += 1;
            }
            Ok(Some(b.finish(DataPosition { epoch, offset: self.at, line: self.at + 1, skip: 0 })))
        }
    }

    fn groups(seed: u64) -> LabelGroups {
        let layout = DataLayout { num_fields: 1, num_dense: 0, num_tasks: 1, weighted: false };
        LabelGroups::new(Box::new(Rows { n: 100, at: 0, layout }), 0, 40, seed)
    }

    /// (first key, label, rows, end) of each batch from `pos` to the end.
    fn drain(g: &mut LabelGroups, pos: DataPosition) -> Vec<(Vec<u64>, u32, DataPosition)> {
        g.seek(pos).expect("seek");
        let mut out = Vec::new();
        while let Some(b) = g.next_batch(6, 0).expect("batch") {
            let labels: Vec<u32> = b.labels.iter().map(|l| l.to_bits()).collect();
            assert!(labels.iter().all(|&l| l == labels[0]), "one label a batch: {:?}", b.labels);
            out.push((b.keys.clone(), labels[0], b.end));
        }
        out
    }

    #[test]
    fn batches_hold_one_label_each_in_a_seeded_repeatable_order_and_resume_exactly() {
        let whole = drain(&mut groups(5), DataPosition::default());
        let mut keys: Vec<u64> = whole.iter().flat_map(|(k, _, _)| k.clone()).collect();
        keys.sort_unstable();
        assert_eq!(keys, (0..100).collect::<Vec<_>>(), "every row once");
        assert!(whole.iter().all(|(k, _, _)| k.len() <= 6));
        assert_eq!(drain(&mut groups(5), DataPosition::default()), whole, "the same seed, the same batches");
        let other = drain(&mut groups(6), DataPosition::default());
        assert_ne!(other.iter().map(|b| &b.0).collect::<Vec<_>>(), whole.iter().map(|b| &b.0).collect::<Vec<_>>());
        // Labels interleave within a window (not all of one label first).
        let first_window: Vec<u32> = whole.iter().take_while(|b| b.2.offset == 0).map(|b| b.1).collect();
        assert!(first_window.windows(2).any(|w| w[0] != w[1]) && first_window.len() > 3, "{first_window:?}");
        // From each batch's end, the rest is what the whole run handed out after it.
        for (i, (_, _, end)) in whole.iter().enumerate() {
            assert_eq!(drain(&mut groups(5), *end), whole[i + 1..], "resumed after batch {i} at {end:?}");
        }
    }
}
