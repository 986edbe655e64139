//! Windows of a reader's rows handed out as batches in another order: the
//! machinery behind S0.7's label-grouped batches (`label_groups.rs`) and
//! `data.shuffle` (`shuffle.rs`), each a [`Regrouping`] policy.
//!
//! The reader reads a window of `max(window_rows, batch_size)` rows; the
//! policy splits it into batches of at most `batch_size` rows, in the
//! order it hands them out (seeded from `train.seed`, the epoch and where
//! the window starts). The same config and data give the same batches in
//! the same order.
//!
//! A batch from inside a window ends at the window's start with
//! [`DataPosition::skip`] = the batches handed out so far, as the weighting
//! buffer's do (`weighting.rs`): a resumed reader reads the window again,
//! splits it the same way and skips them.

use sparrow_core::Batch;
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::rng::Rng;

use crate::error::DataError;
use crate::layout::DataLayout;
use crate::source::BatchSource;

/// How a window's rows become batches.
pub trait Regrouping: Send {
    /// The window `rows` (starting at `start`) as batches of at most
    /// `batch_size` rows each: every row once, in hand-out order.
    fn split(&self, rows: &Batch, batch_size: usize, start: DataPosition) -> Vec<Vec<usize>>;
}

/// A generator for the window starting at `start`, from `seed`: the same
/// window of the same epoch draws the same numbers, resumed or not.
pub(crate) fn window_rng(seed: u64, start: DataPosition) -> Rng {
    Rng::new(seed ^ start.epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ start.offset.rotate_left(17))
}

/// `items` in an order drawn from `rng` (Fisher–Yates).
pub(crate) fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// A window read and split, being handed out.
struct Window {
    rows: Batch,
    /// Each batch's rows, in hand-out order.
    batches: Vec<Vec<usize>>,
    next: usize,
    start: DataPosition,
}

/// Any reader's rows, regrouped window by window by the policy `P`.
pub struct Regrouped<P> {
    inner: Box<dyn BatchSource>,
    policy: P,
    window_rows: usize,
    window: Option<Window>,
    /// Where the next window starts, and its batches to skip (a resume).
    next_start: DataPosition,
}

impl<P: Regrouping> Regrouped<P> {
    /// `inner`'s rows in windows of `window_rows`, split by `policy`.
    pub fn with_policy(inner: Box<dyn BatchSource>, policy: P, window_rows: usize) -> Regrouped<P> {
        Regrouped { inner, policy, window_rows, window: None, next_start: DataPosition::default() }
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

impl<P: Regrouping> BatchSource for Regrouped<P> {
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
            let batches = self.policy.split(&rows, batch_size, start);
            // A resumed window: its first `skip` batches were trained before.
            let next = skip.min(batches.len());
            self.window = Some(Window { rows, batches, next, start });
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Rows 0..n of one field, key = row, label = row's class (row % 3,
    /// every seventh masked), read `batch_size` rows at a time from `pos`.
    pub(crate) struct Rows {
        pub(crate) n: u64,
        pub(crate) at: u64,
        pub(crate) layout: DataLayout,
    }

    impl Rows {
        pub(crate) fn boxed(n: u64) -> Box<dyn BatchSource> {
            let layout = DataLayout { num_fields: 1, num_dense: 0, num_tasks: 1, weighted: false };
            Box::new(Rows { n, at: 0, layout })
        }
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

    /// (keys, labels' bits, end) of each batch from `pos` to the end of epoch `epoch`.
    pub(crate) fn drain(
        g: &mut dyn BatchSource,
        pos: DataPosition,
        epoch: u64,
    ) -> Vec<(Vec<u64>, Vec<u32>, DataPosition)> {
        g.seek(pos).expect("seek");
        let mut out = Vec::new();
        while let Some(b) = g.next_batch(6, epoch).expect("batch") {
            out.push((b.keys.clone(), b.labels.iter().map(|l| l.to_bits()).collect(), b.end));
        }
        out
    }

    /// Every row exactly once, and from each batch's end the rest of the
    /// run exactly as the whole run handed it out.
    pub(crate) fn assert_complete_and_resumable(
        make: &dyn Fn() -> Box<dyn BatchSource>,
        n: u64,
        epoch: u64,
    ) -> Vec<(Vec<u64>, Vec<u32>, DataPosition)> {
        let start = DataPosition { epoch, ..DataPosition::default() };
        let whole = drain(make().as_mut(), start, epoch);
        let mut keys: Vec<u64> = whole.iter().flat_map(|b| b.0.clone()).collect();
        keys.sort_unstable();
        assert_eq!(keys, (0..n).collect::<Vec<_>>(), "every row once");
        assert!(whole.iter().all(|b| b.0.len() <= 6));
        for (i, (_, _, end)) in whole.iter().enumerate() {
            assert_eq!(drain(make().as_mut(), *end, epoch), whole[i + 1..], "resumed after batch {i} at {end:?}");
        }
        whole
    }
}
