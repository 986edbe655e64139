//! First dedup (S3.2) and partition of the unique keys by owning shard (S3.1,
//! S3.3): the plan keeps the inverse index that restores the batch order.

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

/// An open-addressing set of a batch's keys, kept between batches (a
/// thread's own): each bucket holds a key, its index among the batch's
/// unique keys and the batch's generation, so a new batch starts from an
/// empty set without clearing it.
#[derive(Default)]
struct DedupScratch {
    buckets: Vec<Bucket>,
    generation: u32,
}

/// Keys ahead of the one being placed whose bucket is prefetched.
const PREFETCH_AHEAD: usize = 16;

#[derive(Clone, Copy, Default)]
struct Bucket {
    key: u64,
    index: u32,
    /// The batch that wrote it; any other batch reads the bucket as empty.
    generation: u32,
}

impl DedupScratch {
    /// The unique keys of `keys` in order of first sight; `inverse[i]`
    /// receives key i's index among them.
    fn dedup(&mut self, keys: &[u64], inverse: &mut [u32]) -> Vec<u64> {
        // At most half full (every key distinct): short probe runs.
        let buckets = (keys.len() * 2).next_power_of_two().max(16);
        // Grown for a larger batch; not kept far larger than the batches
        // that follow need (one huge batch would otherwise pin its set).
        if self.buckets.len() < buckets || self.buckets.len() > 8 * buckets.max(1 << 16) {
            self.buckets = vec![Bucket::default(); buckets];
        }
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            // Generation 0 is what a fresh bucket holds: wrapped around, start over.
            self.buckets.fill(Bucket::default());
            self.generation = 1;
        }
        let (generation, mask) = (self.generation, buckets - 1);
        let table = &mut self.buckets[..buckets];
        let mut unique = Vec::with_capacity(keys.len());
        // Low bits of mix64: independent of the lock-shard bits (32..).
        let home = |k: u64| mix64(k) as usize & mask;
        for (i, (&k, out)) in keys.iter().zip(inverse.iter_mut()).enumerate() {
            // The set outgrows the core's first caches at a batch's size:
            // the bucket of a key some way ahead is requested now.
            if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
                crate::hint::prefetch(&table[home(ahead)]);
            }
            let mut b = home(k);
            *out = loop {
                let bucket = &mut table[b];
                if bucket.generation != generation {
                    *bucket = Bucket { key: k, index: unique.len() as u32, generation };
                    unique.push(k);
                    break bucket.index;
                }
                if bucket.key == k {
                    break bucket.index;
                }
                b = (b + 1) & mask;
            };
        }
        unique
    }
}

thread_local! {
    /// Each thread's dedup set (the planner's, a compute thread's).
    static DEDUP: std::cell::RefCell<DedupScratch> = std::cell::RefCell::default();
}

impl KeyPlan {
    /// `shard_of` must return a value below `shards`. The batch's keys are
    /// de-duplicated first (in order of first sight), then the unique keys
    /// are grouped by owner with a stable counting sort, so within a shard
    /// they keep the order of first sight. Grouping first and de-duplicating
    /// each shard's keys on its own gave the same plan but handled every
    /// key of the batch (2.5 per unique key here) three more times.
    /// Runs on the calling thread: it takes no threads from a pool (the
    /// pipeline's planner relies on that).
    pub fn new(keys: &[u64], shards: usize, shard_of: impl Fn(u64) -> usize) -> KeyPlan {
        let mut inverse = vec![0u32; keys.len()];
        let first_seen = DEDUP.with_borrow_mut(|scratch| scratch.dedup(keys, &mut inverse));
        let owners: Vec<u32> = first_seen.iter().map(|&k| shard_of(k) as u32).collect();
        let mut shard_offsets = vec![0usize; shards + 1];
        for &s in &owners {
            shard_offsets[s as usize + 1] += 1;
        }
        for s in 0..shards {
            shard_offsets[s + 1] += shard_offsets[s];
        }
        // Stable: each shard's keys in order of first sight.
        let mut cursor = shard_offsets.clone();
        let mut unique = vec![0u64; first_seen.len()];
        let mut position = vec![0u32; first_seen.len()];
        for ((&k, &s), position) in first_seen.iter().zip(&owners).zip(position.iter_mut()) {
            let at = &mut cursor[s as usize];
            unique[*at] = k;
            *position = *at as u32;
            *at += 1;
        }
        for i in inverse.iter_mut() {
            *i = position[*i as usize];
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
            // unique really is unique and covers every input key
            let mut sorted = plan.unique.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), plan.unique.len());
            for (i, &k) in keys.iter().enumerate() {
                prop_assert_eq!(plan.unique[plan.inverse[i] as usize], k);
            }
            // every key sits in its owner's range, in order of first sight
            for s in 0..shards {
                let mut first_sight: Vec<u64> = Vec::new();
                for &k in keys.iter().filter(|&&k| (k % shards as u64) as usize == s) {
                    if !first_sight.contains(&k) {
                        first_sight.push(k);
                    }
                }
                prop_assert_eq!(plan.shard_keys(s), &first_sight[..]);
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
