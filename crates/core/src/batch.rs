//! A batch of samples in columnar form: labels, dense values, and for every
//! (row, field) a "bag" of zero or more weighted keys (multi-hot fields).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where a data stream stands, so that a resumed run reads exactly the rows an
/// uninterrupted run would have read next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: u64,
    /// Byte offset (text formats) or row index (Parquet) of the next unread row.
    pub offset: u64,
    /// 1-based number of the next line (text) or row (Parquet), for error messages.
    pub line: u64,
    /// Merged samples already taken from the age-weighting merge buffer
    /// that starts at `offset` (`data.weighting.merge_buffer_rows` above one
    /// batch): a resumed reader merges that buffer again and skips them.
    #[serde(default)]
    pub skip: u64,
}

impl DataPosition {
    /// Where a batch starts, as a key (the line number only names rows in errors).
    pub fn key(self) -> (u64, u64, u64) {
        (self.epoch, self.offset, self.skip)
    }

    /// The further of two positions (workers see batches in any order).
    pub fn later(self, other: DataPosition) -> DataPosition {
        if (other.epoch, other.offset, other.skip) > (self.epoch, self.offset, self.skip) { other } else { self }
    }
}

/// Where a stream stands after a batch (`[data.stream]`): what a resumed
/// reader needs to cut exactly the batches an uninterrupted one would have
/// cut next, and what the run reports about the stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamMark {
    /// Partition → the next offset to read.
    pub offsets: BTreeMap<i32, i64>,
    /// The partition the next batch starts reading at (each batch starts at
    /// the next partition in turn, so none waits behind another's backlog).
    pub next_partition: i32,
    /// Records consumed, good and malformed (across resumes).
    pub records: u64,
    /// Of those, malformed (skipped, their offsets consumed).
    pub bad_records: u64,
    /// Of those, stamped more than `data.stream.max_future_secs` ahead of
    /// the reader's clock when read: trained, but their time moved no
    /// clock (one far-future record would otherwise stop `ttl_secs` for good).
    #[serde(default)]
    pub future_records: u64,
    /// Offsets the broker skipped inside partitions (across resumes).
    #[serde(default)]
    pub gap_records: u64,
    /// Times a partition's log was found to have gone backwards and
    /// `data.stream.on_offset_reset` moved the reader (across resumes).
    #[serde(default)]
    pub offset_resets: u64,
    /// Partition → a fingerprint of the record just before `offsets[p]`
    /// (the last one trained): a resumed reader checks the log still holds
    /// that record there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tails: BTreeMap<i32, u64>,
    /// Records past these offsets that the broker held when the batch was
    /// cut (the partitions' last known ends minus `offsets`).
    #[serde(default)]
    pub lag_records: u64,
    /// Append time (Unix ms) of the newest record in the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_record_ms: Option<i64>,
    /// The stream's event clock (Unix ms): the newest sample time read so
    /// far, across resumes (`[data.weighting]` ages samples from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_ms: Option<i64>,
    /// Partition → where this batch started reading it (the partitions it
    /// read): the batch's records are `from[p]..offsets[p]`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub from: BTreeMap<i32, i64>,
    /// Partition → offset ranges past `offsets` that were trained already
    /// (a cluster's worker ran ahead of another's batch): a resumed reader
    /// drops them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skip: BTreeMap<i32, Vec<(i64, i64)>>,
}

impl StreamMark {
    /// `ahead`'s records (batches trained past this mark) added to `skip`,
    /// and ranges this mark's offsets passed dropped.
    pub fn with_skipped<'a>(mut self, ahead: impl IntoIterator<Item = &'a StreamMark>) -> StreamMark {
        for b in ahead {
            for (&p, &from) in &b.from {
                let to = b.offsets.get(&p).copied().unwrap_or(from);
                if to > from {
                    self.skip.entry(p).or_default().push((from, to));
                }
            }
        }
        for (p, ranges) in self.skip.iter_mut() {
            let next = self.offsets.get(p).copied().unwrap_or(i64::MIN);
            ranges.retain(|&(_, to)| to > next);
            ranges.sort_unstable();
        }
        self.skip.retain(|_, ranges| !ranges.is_empty());
        self
    }
}

#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub num_fields: usize,
    pub num_dense: usize,
    /// Labels a row holds, one per task (0 is read as 1: a default batch).
    pub num_tasks: usize,
    /// `rows × num_tasks`, row-major: a binary task's 0.0 or 1.0, a
    /// multiclass task's class id; NaN masks the task for the row.
    pub labels: Vec<f32>,
    /// `rows × num_dense`, row-major.
    pub dense: Vec<f32>,
    /// All keys of all bags, bag after bag.
    pub keys: Vec<u64>,
    /// Per-key weight (the value of a libsvm/libffm feature); `None` means all 1.
    pub key_weights: Option<Vec<f32>>,
    /// `rows × num_fields + 1` offsets into `keys`: bag (r, f) is
    /// `keys[bag_offsets[r*F+f] .. bag_offsets[r*F+f+1]]`.
    pub bag_offsets: Vec<u32>,
    /// Position of the first row after this batch.
    pub end: DataPosition,
    /// Each row's time (Unix seconds) when the schema names a timestamp column.
    pub timestamps: Option<Vec<i64>>,
    /// Each row's weight in the loss (`[data.weighting]`); `None` means all 1.
    pub sample_weights: Option<Vec<f32>>,
    /// A stream's batch: where the stream stands after it.
    pub stream: Option<std::sync::Arc<StreamMark>>,
    /// Its rows' behaviour sequences longer than their `max_len` (each
    /// kept its newest IDs).
    pub truncated_sequences: u64,
}

impl Batch {
    pub fn rows(&self) -> usize {
        self.labels.len() / self.tasks()
    }

    /// Labels a row holds (one per task).
    #[inline]
    pub fn tasks(&self) -> usize {
        self.num_tasks.max(1)
    }

    /// Task `task`'s label of each row (NaN where masked).
    pub fn task_labels(&self, task: usize) -> impl Iterator<Item = f32> + '_ {
        self.labels.iter().skip(task).step_by(self.tasks()).copied()
    }

    #[inline]
    pub fn bag(&self, row: usize, field: usize) -> std::ops::Range<usize> {
        let i = row * self.num_fields + field;
        self.bag_offsets[i] as usize..self.bag_offsets[i + 1] as usize
    }
}

/// Builds a [`Batch`] row by row; a row that turns out malformed halfway is
/// rolled back so the batch never holds part of a row.
#[derive(Debug)]
pub struct BatchBuilder {
    batch: Batch,
    row_start: (usize, usize, usize, usize),
    current_field: usize,
    /// The current row's timestamp, kept until the row ends.
    pending_timestamp: Option<i64>,
    /// The current row's labels after the first, kept until the row ends.
    pending_labels: Vec<f32>,
    /// The current row's truncated sequences, counted when the row ends.
    pending_truncated: u64,
}

impl BatchBuilder {
    pub fn new(num_fields: usize, num_dense: usize, weighted: bool, capacity_rows: usize) -> Self {
        let mut bag_offsets = Vec::with_capacity(capacity_rows * num_fields + 1);
        bag_offsets.push(0);
        BatchBuilder {
            batch: Batch {
                num_fields,
                num_dense,
                num_tasks: 1,
                labels: Vec::with_capacity(capacity_rows),
                dense: Vec::with_capacity(capacity_rows * num_dense),
                keys: Vec::with_capacity(capacity_rows * num_fields),
                key_weights: weighted.then(|| Vec::with_capacity(capacity_rows * num_fields)),
                bag_offsets,
                end: DataPosition::default(),
                timestamps: None,
                sample_weights: None,
                stream: None,
                truncated_sequences: 0,
            },
            row_start: (0, 0, 0, 1),
            current_field: 0,
            pending_timestamp: None,
            pending_labels: Vec::new(),
            pending_truncated: 0,
        }
    }

    /// Rows hold `tasks` labels each: the first is given to
    /// [`end_row`](Self::end_row), the others to
    /// [`push_label`](Self::push_label) before it.
    pub fn with_tasks(mut self, tasks: usize) -> Self {
        self.batch.num_tasks = tasks.max(1);
        self
    }

    pub fn num_tasks(&self) -> usize {
        self.batch.num_tasks
    }

    /// The current row has a behaviour sequence longer than its `max_len`.
    pub fn count_truncated_sequence(&mut self) {
        self.pending_truncated += 1;
    }

    /// The current row's label of the next task after the first (NaN: masked).
    pub fn push_label(&mut self, label: f32) {
        self.pending_labels.push(label);
    }

    pub fn rows(&self) -> usize {
        self.batch.rows()
    }

    pub fn num_fields(&self) -> usize {
        self.batch.num_fields
    }

    pub fn num_dense(&self) -> usize {
        self.batch.num_dense
    }

    /// Starts a row. Keys are then pushed field by field in increasing field
    /// order via [`push_key`](Self::push_key) (fields may be skipped: empty bags).
    pub fn begin_row(&mut self) {
        let b = &self.batch;
        self.row_start = (b.labels.len(), b.dense.len(), b.keys.len(), b.bag_offsets.len());
        self.current_field = 0;
        self.pending_labels.clear();
        self.pending_truncated = 0;
    }

    /// The current row's time (Unix seconds).
    pub fn set_timestamp(&mut self, ts: i64) {
        self.pending_timestamp = Some(ts);
    }

    pub fn push_dense(&mut self, v: f32) {
        self.batch.dense.push(v);
    }

    /// Adds a key to the bag of `field`. Returns false if `field` is out of
    /// range or goes backwards (the caller reports the row as malformed).
    pub fn push_key(&mut self, field: usize, key: u64, weight: f32) -> bool {
        if field >= self.batch.num_fields || field < self.current_field {
            return false;
        }
        self.close_bags_until(field);
        self.batch.keys.push(key);
        if let Some(w) = self.batch.key_weights.as_mut() {
            w.push(weight);
        }
        true
    }

    /// Adds one key to every field's bag, in field order, for a row that
    /// has none yet (a row whose every field holds one value, as Criteo's):
    /// what [`push_key`](Self::push_key) field by field gives (weight 1), in
    /// one pass. Returns false, adding nothing, if the row already has keys
    /// or `keys` is not one a field.
    pub fn push_key_per_field(&mut self, keys: &[u64]) -> bool {
        if self.current_field != 0 || self.batch.keys.len() != self.row_start.2 || keys.len() != self.batch.num_fields {
            return false;
        }
        let n = self.batch.keys.len() as u32;
        self.batch.keys.extend_from_slice(keys);
        if let Some(w) = self.batch.key_weights.as_mut() {
            w.extend(std::iter::repeat_n(1.0, keys.len()));
        }
        // Bag f ends after key f; the last bag's end is pushed by `end_row`,
        // as after `push_key`.
        self.batch.bag_offsets.extend((1..keys.len() as u32).map(|i| n + i));
        self.current_field = keys.len().saturating_sub(1);
        true
    }

    fn close_bags_until(&mut self, field: usize) {
        let n = self.batch.keys.len() as u32;
        while self.current_field < field {
            self.batch.bag_offsets.push(n);
            self.current_field += 1;
        }
    }

    /// Finishes the row, `label` its first task's. Fails (and rolls back)
    /// if the dense count or the number of labels is wrong.
    pub fn end_row(&mut self, label: f32) -> bool {
        let dense_pushed = self.batch.dense.len() - self.row_start.1;
        if dense_pushed != self.batch.num_dense || self.pending_labels.len() + 1 != self.batch.tasks() {
            self.rollback_row();
            return false;
        }
        let f = self.batch.num_fields;
        self.close_bags_until(f);
        self.batch.labels.push(label);
        self.batch.labels.append(&mut self.pending_labels);
        self.batch.truncated_sequences += std::mem::take(&mut self.pending_truncated);
        if let Some(ts) = self.pending_timestamp.take() {
            self.batch.timestamps.get_or_insert_with(Vec::new).push(ts);
        }
        true
    }

    pub fn rollback_row(&mut self) {
        let (l, d, k, o) = self.row_start;
        self.batch.labels.truncate(l);
        self.batch.dense.truncate(d);
        self.batch.keys.truncate(k);
        if let Some(w) = self.batch.key_weights.as_mut() {
            w.truncate(k);
        }
        self.batch.bag_offsets.truncate(o);
        self.current_field = 0;
        self.pending_timestamp = None;
        self.pending_labels.clear();
        self.pending_truncated = 0;
    }

    pub fn finish(self, end: DataPosition) -> Batch {
        let mut b = self.batch;
        b.end = end;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches trained past a mark become its skip ranges, merged with
    /// the ones it had; ranges its offsets passed are dropped.
    #[test]
    fn batches_trained_ahead_become_skip_ranges_until_passed() {
        let mark = |offsets: &[(i32, i64)], from: &[(i32, i64)]| StreamMark {
            offsets: offsets.iter().copied().collect(),
            from: from.iter().copied().collect(),
            ..Default::default()
        };
        let mut at = mark(&[(0, 10), (1, 5)], &[]);
        at.skip.insert(1, vec![(2, 4), (7, 9)]);
        let ahead = [mark(&[(0, 30), (1, 6)], &[(0, 20), (1, 6)]), mark(&[(0, 15)], &[(0, 12)])];
        let out = at.with_skipped(&ahead);
        // Partition 1's 6..6 is empty and its 2..4 is behind offset 5.
        assert_eq!(out.skip, [(0, vec![(12, 15), (20, 30)]), (1, vec![(7, 9)])].into());
    }

    /// A key per field in one call builds the batch that `push_key` field
    /// by field builds, weighted or not, rolled back or not; a row that
    /// already has keys, or a count that is not one a field, is refused.
    #[test]
    fn a_key_per_field_at_once_equals_one_field_at_a_time() {
        for weighted in [false, true] {
            let (mut a, mut b) = (BatchBuilder::new(3, 1, weighted, 4), BatchBuilder::new(3, 1, weighted, 4));
            for (row, keys) in [[1u64, 2, 3], [4, 5, 6], [7, 8, 9]].iter().enumerate() {
                a.begin_row();
                b.begin_row();
                a.push_dense(row as f32);
                b.push_dense(row as f32);
                for (f, &k) in keys.iter().enumerate() {
                    assert!(a.push_key(f, k, 1.0));
                }
                assert!(b.push_key_per_field(keys));
                assert!(!b.push_key_per_field(keys), "a row's keys are added once");
                if row == 1 {
                    a.rollback_row();
                    b.rollback_row();
                } else {
                    assert!(a.end_row(1.0));
                    assert!(b.end_row(1.0));
                }
            }
            b.begin_row();
            assert!(!b.push_key_per_field(&[1, 2]), "two keys for three fields");
            assert!(b.push_key(0, 1, 1.0));
            assert!(!b.push_key_per_field(&[1, 2, 3]), "the row has a key already");
            b.rollback_row();
            let (a, b) = (a.finish(DataPosition::default()), b.finish(DataPosition::default()));
            assert_eq!(
                (a.keys.clone(), a.bag_offsets.clone(), a.key_weights.clone()),
                (b.keys, b.bag_offsets, b.key_weights)
            );
            assert_eq!(a.bag(1, 2), 5..6);
        }
    }

    #[test]
    fn rows_with_skipped_fields_and_rollback() {
        let mut b = BatchBuilder::new(3, 1, false, 4);
        b.begin_row();
        b.push_dense(1.0);
        assert!(b.push_key(0, 10, 1.0));
        assert!(b.push_key(2, 12, 1.0));
        assert!(b.push_key(2, 13, 1.0));
        assert!(b.end_row(1.0));
        // malformed: field goes backwards
        b.begin_row();
        b.push_dense(2.0);
        assert!(b.push_key(1, 20, 1.0));
        assert!(!b.push_key(0, 21, 1.0));
        b.rollback_row();
        // malformed: missing dense value
        b.begin_row();
        assert!(!b.end_row(0.0));
        b.begin_row();
        b.push_dense(3.0);
        assert!(b.end_row(0.0));
        let batch = b.finish(DataPosition::default());
        assert_eq!(batch.rows(), 2);
        assert_eq!(batch.dense, vec![1.0, 3.0]);
        assert_eq!(batch.keys, vec![10, 12, 13]);
        assert_eq!(batch.bag(0, 0), 0..1);
        assert_eq!(batch.bag(0, 1), 1..1);
        assert_eq!(batch.bag(0, 2), 1..3);
        assert_eq!(batch.bag(1, 0), 3..3);
        assert_eq!(batch.bag(1, 2), 3..3);
    }
}
