//! Sample weighting by age (S4.4, `[data.weighting]`).
//!
//! Within a batch as read, identical samples (same label, dense values and
//! keys) whose times fall in the same `merge_window_secs` window (windows
//! aligned to the Unix epoch) merge into one sample with a count, placed
//! where the first of them was and dated by the newest. Its weight is
//! decay_base^(−age) × count, age = (reference − newest) / age_unit_secs
//! (never below 0); a sample weighing less than `drop_below` is dropped. The
//! trainers multiply each sample's loss by its weight (the batch loss is the
//! mean over its rows of weight × loss).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sparrow_core::Batch;
use sparrow_core::batch::BatchBuilder;
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

/// The next batch from `read`, through `weigher` when there is one: a batch
/// whose every sample was dropped is skipped (the reader reads on).
pub fn next_weighted(
    weigher: Option<&Weigher>,
    mut read: impl FnMut() -> Result<Option<Batch>, crate::DataError>,
) -> Result<Option<Batch>, crate::DataError> {
    loop {
        let Some(batch) = read()? else { return Ok(None) };
        let Some(w) = weigher else { return Ok(Some(batch)) };
        let weighed = w.apply(batch);
        if weighed.rows() > 0 {
            return Ok(Some(weighed));
        }
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

/// Merges, weighs and drops the samples of each batch.
pub struct Weigher {
    cfg: WeightingConfig,
    reference: i64,
    counters: Arc<WeightCounters>,
}

impl Weigher {
    pub fn new(cfg: WeightingConfig, reference: i64, counters: Arc<WeightCounters>) -> Self {
        Weigher { cfg, reference, counters }
    }

    /// The weight of a merged sample of `count` rows whose newest is `newest`.
    pub fn weight(&self, newest: i64, count: u32) -> f64 {
        let age = ((self.reference - newest) as f64 / self.cfg.age_unit_secs).max(0.0);
        self.cfg.decay_base.powf(-age) * f64::from(count)
    }

    /// The batch with duplicates merged, weights set and light samples
    /// dropped (possibly no rows left). A batch without timestamps is returned as is.
    pub fn apply(&self, batch: Batch) -> Batch {
        let Some(times) = batch.timestamps.as_ref() else { return batch };
        let window = self.cfg.merge_window_secs.max(1) as i64;
        // Per distinct sample: its first row, count and newest time.
        let mut groups: Vec<(usize, u32, i64)> = Vec::new();
        let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
        let mut identity = Vec::new();
        for (row, &ts) in times.iter().enumerate() {
            identity.clear();
            identity.extend_from_slice(&ts.div_euclid(window).to_le_bytes());
            identity.extend_from_slice(&batch.labels[row].to_bits().to_le_bytes());
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
                    groups[g].1 += 1;
                    groups[g].2 = groups[g].2.max(ts);
                }
                None => {
                    index.insert(identity.clone(), groups.len());
                    groups.push((row, 1, ts));
                }
            }
        }
        let mut out = BatchBuilder::new(batch.num_fields, batch.num_dense, batch.key_weights.is_some(), groups.len());
        let (mut weights, mut newest) = (Vec::with_capacity(groups.len()), Vec::with_capacity(groups.len()));
        let (mut dropped, mut sum) = (0u64, 0f64);
        for &(row, count, ts) in &groups {
            let w = self.weight(ts, count);
            if w < self.cfg.drop_below {
                dropped += 1;
                continue;
            }
            out.begin_row();
            for &v in &batch.dense[row * batch.num_dense..(row + 1) * batch.num_dense] {
                out.push_dense(v);
            }
            for field in 0..batch.num_fields {
                for k in batch.bag(row, field) {
                    out.push_key(field, batch.keys[k], batch.key_weights.as_ref().map_or(1.0, |w| w[k]));
                }
            }
            out.end_row(batch.labels[row]);
            weights.push(w as f32);
            newest.push(ts);
            sum += w;
        }
        let c = &self.counters;
        c.merged.fetch_add((times.len() - groups.len()) as u64, Ordering::Relaxed);
        c.dropped.fetch_add(dropped, Ordering::Relaxed);
        *c.weight_sum.lock().unwrap_or_else(|e| e.into_inner()) += sum;
        let mut merged = out.finish(batch.end);
        merged.timestamps = Some(newest);
        merged.sample_weights = Some(weights);
        merged
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
        let w = Weigher::new(WeightingConfig::default(), now, counters.clone());
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
}
