//! First dedup (S3.2) and partition of the unique keys by owning shard (S3.1,
//! S3.3): the plan keeps the inverse index that restores the batch order.

use hashbrown::HashMap;

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

impl KeyPlan {
    /// `shard_of` must return a value below `shards`.
    pub fn new(keys: &[u64], shards: usize, shard_of: impl Fn(u64) -> usize) -> KeyPlan {
        // First dedup: order of first sight, inverse index into it.
        let mut first_index: HashMap<u64, u32> = HashMap::with_capacity(keys.len());
        let mut seen: Vec<u64> = Vec::with_capacity(keys.len());
        let mut inverse: Vec<u32> = Vec::with_capacity(keys.len());
        for &k in keys {
            let next = seen.len() as u32;
            let idx = *first_index.entry(k).or_insert_with(|| {
                seen.push(k);
                next
            });
            inverse.push(idx);
        }
        // Partition by shard with a counting sort: counts first, so every
        // shard's range is sized exactly (never n × shards).
        let owners: Vec<usize> = seen.iter().map(|&k| shard_of(k)).collect();
        let mut shard_offsets = vec![0usize; shards + 1];
        for &s in &owners {
            shard_offsets[s + 1] += 1;
        }
        for s in 0..shards {
            shard_offsets[s + 1] += shard_offsets[s];
        }
        let mut cursor = shard_offsets.clone();
        let mut unique = vec![0u64; seen.len()];
        let mut moved_to = vec![0u32; seen.len()];
        for (i, (&k, &s)) in seen.iter().zip(&owners).enumerate() {
            let dst = cursor[s];
            cursor[s] += 1;
            unique[dst] = k;
            moved_to[i] = dst as u32;
        }
        for idx in &mut inverse {
            *idx = moved_to[*idx as usize];
        }
        KeyPlan {
            unique,
            shard_offsets,
            inverse,
        }
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
