//! Sample weighting by age (S4.4, `[data.weighting]`).
//!
//! The reader reads a merge buffer of `max(merge_buffer_rows, batch_size)`
//! rows at a time. Within it, identical samples (same label, dense values
//! and keys) whose times fall in the same `merge_window_secs` window
//! (windows aligned to the Unix epoch) merge into one sample with a count,
//! placed where the first of them was and dated by the newest. Its weight is
//! decay_base^(−age) × count, age = (reference − newest) / age_unit_secs
//! (never below 0); a sample weighing less than `drop_below` is dropped. The
//! buffer's kept samples go out in batches of `batch_size` (its last batch
//! may be shorter). The trainers multiply each sample's loss by its weight
//! (the batch loss is the mean over its rows of weight × loss).
//!
//! A batch from inside a buffer ends at the buffer's start with
//! [`DataPosition::skip`] = the merged samples taken so far: a resumed reader
//! re-reads the buffer, merges it again (the same way) and skips them, so a
//! resumed run trains exactly the samples an uninterrupted one would.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sparrow_core::Batch;
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::config::WeightingConfig;
use std::sync::Mutex;

/// A sample's time checked: not after `now` (Unix seconds), else why not.
pub fn check_time(ts: i64, now: i64, column: &str) -> Result<i64, String> {
    if ts > now {
        return Err(format!("column {column}: {ts} is in the future (now is {now})"));
    }
    Ok(ts)
}

/// Now, in Unix seconds (rows dated later are malformed).
pub fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(i64::MAX, |d| d.as_secs() as i64)
}

/// The next batch of at most `batch_size` rows from `read` (which reads up
/// to the number of rows it is given), through `weigher` when there is one.
/// A buffer whose every sample was dropped is skipped (the reader reads on).
pub fn next_weighted(
    weigher: Option<&mut Weigher>,
    batch_size: usize,
    mut read: impl FnMut(usize) -> Result<Option<Batch>, crate::DataError>,
) -> Result<Option<Batch>, crate::DataError> {
    let Some(w) = weigher else { return read(batch_size) };
    let batch_size = batch_size.max(1);
    loop {
        if let Some(batch) = w.take(batch_size) {
            return Ok(Some(batch));
        }
        let Some(rows) = read(w.buffer_rows(batch_size))? else { return Ok(None) };
        w.fill(rows);
    }
}

/// What weighting did to the training data (the final JSON's fields).
#[derive(Debug, Default)]
pub struct WeightCounters {
    /// Samples folded into an identical one (read rows − merged samples).
    pub merged: AtomicU64,
    /// Merged samples dropped for weighing less than `drop_below`.
    pub dropped: AtomicU64,
    /// The kept samples' weights, summed.
    pub weight_sum: Mutex<f64>,
}

impl WeightCounters {
    pub fn weight_sum(&self) -> f64 {
        *self.weight_sum.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One merged sample of the buffer: its first row, count, newest time and
/// weight (`None`: dropped).
#[derive(Clone, Copy, Debug)]
struct Group {
    row: usize,
    count: u32,
    newest: i64,
    weight: Option<f64>,
}

/// The merge buffer being handed out.
struct Buffer {
    rows: Batch,
    groups: Vec<Group>,
    /// Groups handed out (kept or dropped).
    next: usize,
    /// Where the buffer's first row was (its batches' `end` until the last).
    start: DataPosition,
}

/// Merges, weighs and drops the samples of each merge buffer.
pub struct Weigher {
    cfg: WeightingConfig,
    reference: i64,
    counters: Arc<WeightCounters>,
    buffer: Option<Buffer>,
    /// Where the next buffer starts, and groups of it to skip (a resume).
    next_start: DataPosition,
}

impl Weigher {
    pub fn new(cfg: WeightingConfig, reference: i64, counters: Arc<WeightCounters>) -> Self {
        Weigher { cfg, reference, counters, buffer: None, next_start: DataPosition::default() }
    }

    /// The weight of a merged sample of `count` rows whose newest is `newest`.
    pub fn weight(&self, newest: i64, count: u32) -> f64 {
        let age = ((self.reference - newest) as f64 / self.cfg.age_unit_secs).max(0.0);
        self.cfg.decay_base.powf(-age) * f64::from(count)
    }

    /// One batch as cut from a stream, merged and weighed with ages counted
    /// from `reference` (the stream's event clock, Unix seconds): each row
    /// must carry its time. `None`: every sample weighed less than
    /// `drop_below`. The batch's stream mark goes with it.
    pub fn weigh_batch(&mut self, batch: Batch, reference: i64) -> Option<Batch> {
        self.reference = reference;
        let (rows, stream) = (batch.rows(), batch.stream.clone());
        self.next_start = DataPosition::default();
        self.fill(batch);
        let mut weighed = self.take(rows.max(1));
        self.buffer = None;
        if let Some(b) = weighed.as_mut() {
            b.stream = stream;
        }
        weighed
    }

    /// The reader moved to `pos` (an epoch's start or a resume): the next
    /// buffer starts there, and its first `pos.skip` merged samples were taken.
    pub fn seek(&mut self, pos: DataPosition) {
        self.buffer = None;
        self.next_start = pos;
    }

    /// Rows one merge buffer holds.
    fn buffer_rows(&self, batch_size: usize) -> usize {
        self.cfg.merge_buffer_rows.max(batch_size)
    }

    /// A buffer's rows as read: merged and weighed, ready to hand out.
    fn fill(&mut self, rows: Batch) {
        let start = self.next_start;
        self.next_start = DataPosition { skip: 0, ..rows.end };
        let groups = self.merge(&rows);
        // A resumed buffer: the first `skip` samples were trained before
        // (and counted then).
        let next = (start.skip as usize).min(groups.len());
        self.buffer = Some(Buffer { rows, groups, next, start: DataPosition { skip: 0, ..start } });
    }

    /// The buffer's next batch of up to `batch_size` kept samples; `None`
    /// when the buffer is spent.
    fn take(&mut self, batch_size: usize) -> Option<Batch> {
        let buf = self.buffer.as_mut()?;
        let rows = &buf.rows;
        let capacity = batch_size.min(buf.groups.len() - buf.next);
        let mut out = BatchBuilder::new(rows.num_fields, rows.num_dense, rows.key_weights.is_some(), capacity)
            .with_tasks(rows.tasks());
        let (mut weights, mut newest) = (Vec::with_capacity(capacity), Vec::with_capacity(capacity));
        let (mut merged, mut dropped, mut sum) = (0u64, 0u64, 0f64);
        while out.rows() < batch_size && buf.next < buf.groups.len() {
            let g = buf.groups[buf.next];
            buf.next += 1;
            merged += u64::from(g.count - 1);
            let Some(w) = g.weight else {
                dropped += 1;
                continue;
            };
            out.begin_row();
            for &v in &rows.dense[g.row * rows.num_dense..(g.row + 1) * rows.num_dense] {
                out.push_dense(v);
            }
            for field in 0..rows.num_fields {
                for k in rows.bag(g.row, field) {
                    out.push_key(field, rows.keys[k], rows.key_weights.as_ref().map_or(1.0, |w| w[k]));
                }
            }
            let t = rows.tasks();
            let labels = &rows.labels[g.row * t..(g.row + 1) * t];
            labels[1..].iter().for_each(|&l| out.push_label(l));
            out.end_row(labels[0]);
            weights.push(w as f32);
            newest.push(g.newest);
            sum += w;
        }
        // Dropped samples at the buffer's tail belong to its last batch.
        while buf.next < buf.groups.len() && buf.groups[buf.next].weight.is_none() {
            merged += u64::from(buf.groups[buf.next].count - 1);
            dropped += 1;
            buf.next += 1;
        }
        let c = &self.counters;
        c.merged.fetch_add(merged, Ordering::Relaxed);
        c.dropped.fetch_add(dropped, Ordering::Relaxed);
        *c.weight_sum.lock().unwrap_or_else(|e| e.into_inner()) += sum;
        let end = if buf.next == buf.groups.len() {
            buf.rows.end
        } else {
            DataPosition { skip: buf.next as u64, ..buf.start }
        };
        let timed = buf.rows.timestamps.is_some();
        if buf.next == buf.groups.len() {
            self.buffer = None;
        }
        if out.rows() == 0 {
            return None;
        }
        let mut batch = out.finish(end);
        if timed {
            batch.timestamps = Some(newest);
            batch.sample_weights = Some(weights);
        }
        Some(batch)
    }

    /// The buffer's distinct samples in order of their first row (rows
    /// without times are each their own sample, weight 1).
    fn merge(&self, batch: &Batch) -> Vec<Group> {
        let Some(times) = batch.timestamps.as_ref() else {
            return (0..batch.rows()).map(|row| Group { row, count: 1, newest: 0, weight: Some(1.0) }).collect();
        };
        let window = self.cfg.merge_window_secs.max(1) as i64;
        let mut groups: Vec<Group> = Vec::new();
        let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
        let mut identity = Vec::new();
        for (row, &ts) in times.iter().enumerate() {
            identity.clear();
            identity.extend_from_slice(&ts.div_euclid(window).to_le_bytes());
            let t = batch.tasks();
            for l in &batch.labels[row * t..(row + 1) * t] {
                identity.extend_from_slice(&l.to_bits().to_le_bytes());
            }
            for v in &batch.dense[row * batch.num_dense..(row + 1) * batch.num_dense] {
                identity.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            for field in 0..batch.num_fields {
                let bag = batch.bag(row, field);
                identity.extend_from_slice(&(bag.len() as u32).to_le_bytes());
                for k in bag.clone() {
                    identity.extend_from_slice(&batch.keys[k].to_le_bytes());
                    if let Some(w) = &batch.key_weights {
                        identity.extend_from_slice(&w[k].to_bits().to_le_bytes());
                    }
                }
            }
            match index.get(&identity) {
                Some(&g) => {
                    groups[g].count += 1;
                    groups[g].newest = groups[g].newest.max(ts);
                }
                None => {
                    index.insert(identity.clone(), groups.len());
                    groups.push(Group { row, count: 1, newest: ts, weight: None });
                }
            }
        }
        for g in &mut groups {
            let w = self.weight(g.newest, g.count);
            g.weight = (w >= self.cfg.drop_below).then_some(w);
        }
        groups
    }

    /// One buffer merged, weighed and handed out whole (tests).
    #[cfg(test)]
    fn apply(&mut self, batch: Batch) -> Batch {
        self.fill(batch);
        self.take(usize::MAX).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: &[(f32, u64, i64)]) -> Batch {
        let mut b = BatchBuilder::new(1, 0, false, rows.len());
        for &(label, key, ts) in rows {
            b.begin_row();
            b.set_timestamp(ts);
            b.push_key(0, key, 1.0);
            assert!(b.end_row(label));
        }
        b.finish(Default::default())
    }

    #[test]
    fn identical_samples_in_a_window_merge_and_old_ones_drop() {
        let day = 86_400;
        let now = 100 * day;
        let counters = Arc::new(WeightCounters::default());
        let mut w = Weigher::new(WeightingConfig::default(), now, counters.clone());
        // The seed's example: one purchase at 10:00 and one at 15:00 the same day → one sample, count 2.
        let today = now - 20 * 3600;
        let rows = [
            (1.0, 7, today),
            (1.0, 7, today + 5 * 3600),
            (0.0, 7, today),             // another label: another sample
            (1.0, 7, now - 6 * day - 1), // 6 days old: kept
            (1.0, 8, now - 7 * day - 1), // 7 days old: e^-7 < 0.001, dropped
        ];
        let out = w.apply(batch(&rows));
        assert_eq!(out.labels, vec![1.0, 0.0, 1.0]);
        let weights = out.sample_weights.expect("weights");
        // Newest member 15:00, 15 h before the reference: 2·e^(−15/24).
        assert!((f64::from(weights[0]) - 2.0 * (-15.0f64 / 24.0).exp()).abs() < 1e-6, "{weights:?}");
        assert_eq!(counters.merged.load(Ordering::Relaxed), 1);
        assert_eq!(counters.dropped.load(Ordering::Relaxed), 1);
        assert!(f64::from(weights[2]) > 0.001 && f64::from(weights[2]) < 0.0025, "{weights:?}");
        // The same samples a window apart stay two.
        let apart = w.apply(batch(&[(1.0, 7, today), (1.0, 7, today - day)]));
        assert_eq!(apart.rows(), 2);
    }

    #[test]
    fn a_stream_batch_is_weighed_against_the_clock_it_is_given() {
        let day = 86_400;
        let mut w = Weigher::new(WeightingConfig::default(), 0, Arc::new(WeightCounters::default()));
        let mut b = batch(&[(1.0, 7, 10 * day), (0.0, 8, 10 * day - day / 2), (1.0, 7, 10 * day)]);
        let mark = Arc::new(sparrow_core::batch::StreamMark { records: 3, ..Default::default() });
        b.stream = Some(mark.clone());
        let out = w.weigh_batch(b.clone(), 10 * day).expect("kept");
        assert_eq!(out.labels, vec![1.0, 0.0]);
        let weights = out.sample_weights.clone().expect("weights");
        assert!((f64::from(weights[0]) - 2.0).abs() < 1e-6, "{weights:?}");
        assert!((f64::from(weights[1]) - (-0.5f64).exp()).abs() < 1e-6, "{weights:?}");
        assert_eq!(out.stream, Some(mark));
        // A clock ten days on: every sample weighs e^-10 < drop_below.
        assert!(w.weigh_batch(b, 20 * day).is_none());
    }
}
