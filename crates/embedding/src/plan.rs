//! First dedup (S3.2) and partition of the unique keys by owning shard (S3.1,
//! S3.3): the plan keeps the inverse index that restores the batch order.

use rayon::prelude::*;
use sparrow_core::key::mix64;

/// The unique keys of a batch grouped by shard, and the map back.
#[derive(Clone, Debug, Default)]
pub struct KeyPlan {
    /// Unique keys, grouped so that shard `s` owns `unique[shard_offsets[s]..shard_offsets[s+1]]`.
    pub unique: Vec<u64>,
    /// `shards + 1` offsets into `unique`.
    pub shard_offsets: Vec<usize>,
    /// For each input key, its index in `unique`.
    pub inverse: Vec<u32>,
}

/// A small open-addressing set reused from shard to shard (and batch to
/// batch on one worker): a fresh hash map per shard per batch cost more in
/// allocation and setup than the dedup itself.
#[derive(Default)]
struct DedupScratch {
    keys: Vec<u64>,
    /// Index into the shard's unique keys; `u32::MAX` = empty bucket.
    slots: Vec<u32>,
}

impl DedupScratch {
    /// Unique keys of `positions` (indices into `keys`) in order of first
    /// sight; `local[i]` receives position i's index into them.
    fn dedup(&mut self, keys: &[u64], positions: &[u32], local: &mut [u32]) -> Vec<u64> {
        let buckets = (positions.len() * 2).next_power_of_two().max(16);
        self.keys.resize(buckets, 0);
        self.slots.clear();
        self.slots.resize(buckets, u32::MAX);
        let mask = buckets - 1;
        let mut unique = Vec::with_capacity(positions.len());
        for (&p, out) in positions.iter().zip(local.iter_mut()) {
            let k = keys[p as usize];
            // Low bits of mix64: independent of the shard bits (32..).
            let mut b = mix64(k) as usize & mask;
            *out = loop {
                let slot = self.slots[b];
                if slot == u32::MAX {
                    let idx = unique.len() as u32;
                    unique.push(k);
                    self.keys[b] = k;
                    self.slots[b] = idx;
                    break idx;
                }
                if self.keys[b] == k {
                    break slot;
                }
                b = (b + 1) & mask;
            };
        }
        unique
    }
}

impl KeyPlan {
    /// `shard_of` must return a value below `shards`. Keys are first
    /// partitioned by owner (a counting sort: counts first, so every shard's
    /// range is sized exactly, never n × shards), then each shard's keys are
    /// de-duplicated independently, in parallel on the current rayon pool.
    /// Within a shard, unique keys keep the order of first sight.
    pub fn new(keys: &[u64], shards: usize, shard_of: impl Fn(u64) -> usize + Sync) -> KeyPlan {
        Self::build(keys, shards, shard_of, true)
    }

    /// The same plan, computed on the calling thread only (for a pipeline
    /// stage that must not take threads from the compute pool).
    pub fn new_sequential(keys: &[u64], shards: usize, shard_of: impl Fn(u64) -> usize + Sync) -> KeyPlan {
        Self::build(keys, shards, shard_of, false)
    }

    fn build(keys: &[u64], shards: usize, shard_of: impl Fn(u64) -> usize + Sync, parallel: bool) -> KeyPlan {
        let owners: Vec<u32> = keys.iter().map(|&k| shard_of(k) as u32).collect();
        let mut starts = vec![0usize; shards + 1];
        for &s in &owners {
            starts[s as usize + 1] += 1;
        }
        for s in 0..shards {
            starts[s + 1] += starts[s];
        }
        // by_owner[starts[s]..starts[s+1]] = positions (in `keys`) of shard s's keys, in order.
        let mut cursor = starts.clone();
        let mut by_owner = vec![0u32; keys.len()];
        for (i, &s) in owners.iter().enumerate() {
            by_owner[cursor[s as usize]] = i as u32;
            cursor[s as usize] += 1;
        }
        // Each shard's local indices land in `local` at its own range of `by_owner`.
        let mut local = vec![0u32; keys.len()];
        let mut parts: Vec<(usize, &mut [u32])> = Vec::with_capacity(shards);
        let mut rest: &mut [u32] = &mut local;
        for s in 0..shards {
            let (head, tail) = rest.split_at_mut(starts[s + 1] - starts[s]);
            parts.push((s, head));
            rest = tail;
        }
        let dedup = |scratch: &mut DedupScratch, (s, local): (usize, &mut [u32])| {
            scratch.dedup(keys, &by_owner[starts[s]..starts[s + 1]], local)
        };
        let per_shard: Vec<Vec<u64>> = if parallel {
            parts.into_par_iter().map_init(DedupScratch::default, dedup).collect()
        } else {
            let mut scratch = DedupScratch::default();
            parts.into_iter().map(|part| dedup(&mut scratch, part)).collect()
        };
        let mut shard_offsets = Vec::with_capacity(shards + 1);
        shard_offsets.push(0);
        for u in &per_shard {
            shard_offsets.push(shard_offsets.last().copied().unwrap_or(0) + u.len());
        }
        let mut unique = Vec::with_capacity(shard_offsets[shards]);
        let mut inverse = vec![0u32; keys.len()];
        for (s, u) in per_shard.into_iter().enumerate() {
            unique.extend_from_slice(&u);
            for (&p, &l) in by_owner[starts[s]..starts[s + 1]].iter().zip(&local[starts[s]..starts[s + 1]]) {
                inverse[p as usize] = (shard_offsets[s] + l as usize) as u32;
            }
        }
        KeyPlan { unique, shard_offsets, inverse }
    }

    pub fn num_unique(&self) -> usize {
        self.unique.len()
    }

    pub fn shard_keys(&self, shard: usize) -> &[u64] {
        &self.unique[self.shard_offsets[shard]..self.shard_offsets[shard + 1]]
    }

    /// Restores the per-key rows of the batch from the unique rows (width `dim`).
    pub fn restore(&self, unique_rows: &[f32], dim: usize, out: &mut Vec<f32>) {
        out.clear();
        out.reserve(self.inverse.len() * dim);
        for &i in &self.inverse {
            let i = i as usize;
            out.extend_from_slice(&unique_rows[i * dim..(i + 1) * dim]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn plan_restores_every_key(keys in proptest::collection::vec(0u64..50, 0..300), shards in 1usize..9) {
            let plan = KeyPlan::new(&keys, shards, |k| (k % shards as u64) as usize);
            let seq = KeyPlan::new_sequential(&keys, shards, |k| (k % shards as u64) as usize);
            prop_assert_eq!(&plan.unique, &seq.unique);
            prop_assert_eq!(&plan.inverse, &seq.inverse);
            // unique really is unique and covers every input key
            let mut sorted = plan.unique.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), plan.unique.len());
            for (i, &k) in keys.iter().enumerate() {
                prop_assert_eq!(plan.unique[plan.inverse[i] as usize], k);
            }
            // every key sits in its owner's range
            for s in 0..shards {
                for &k in plan.shard_keys(s) {
                    prop_assert_eq!((k % shards as u64) as usize, s);
                }
            }
            // restore of one-float "rows" equal to the key gives back the keys
            let rows: Vec<f32> = plan.unique.iter().map(|&k| k as f32).collect();
            let mut out = Vec::new();
            plan.restore(&rows, 1, &mut out);
            let expect: Vec<f32> = keys.iter().map(|&k| k as f32).collect();
            prop_assert_eq!(out, expect);
        }
    }
}
