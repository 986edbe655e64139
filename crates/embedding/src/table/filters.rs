//! Feature filters (Monolith-style): admission by count (a count-min
//! sketch of sightings) and expiry by age (`ttl_steps`), with the state a
//! checkpoint keeps beside the rows.

use sparrow_core::key::mix64;

/// Feature filters of a table (Monolith-style); both off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeatureFilters {
    /// A key gets a row once seen in this many training lookups (0, 1: always).
    pub admit_min_count: u32,
    /// Byte counters of the admission sketch, over all lock shards.
    pub admit_sketch_counters: usize,
    /// Rows not used by this many training lookups are deleted (0: never).
    pub ttl_steps: u64,
    /// A `ttl_steps` below this counts as this: the lookups a run may have
    /// in flight, so that a pipelined run's model does not depend on
    /// expiries inside its window. (A row in flight never expires anyway.)
    pub ttl_floor: u64,
}

/// What the feature filters did, summed over lock shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FilterStats {
    /// Training lookups of keys not admitted yet (answered with the initial
    /// vector; their gradients dropped).
    pub not_admitted: u64,
    /// Keys given a row once they reached `admit_min_count`.
    pub admitted: u64,
    /// Rows deleted by `ttl_steps` or `ttl_secs`.
    pub expired: u64,
    /// Rows deleted to keep the table within `max_rows` (least recently used first).
    #[serde(default)]
    pub evicted: u64,
}

/// Why rows are deleted (which counter they go to).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// Past their age: `ttl_steps`, `ttl_secs`.
    Expired,
    /// Over the capacity: `max_rows`.
    Evicted,
}

impl FilterStats {
    pub(super) fn count(&mut self, why: Deletion, n: u64) {
        match why {
            Deletion::Expired => self.expired += n,
            Deletion::Evicted => self.evicted += n,
        }
    }
}

impl std::ops::AddAssign for FilterStats {
    fn add_assign(&mut self, o: FilterStats) {
        self.not_admitted += o.not_admitted;
        self.admitted += o.admitted;
        self.expired += o.expired;
        self.evicted += o.evicted;
    }
}

/// The feature filters' state that is not in the rows (checkpointed beside
/// them): the table's lookup clock and each lock shard's admission sketch.
/// A row's last use travels with the row (walks report it,
/// [`EmbeddingTable::put_row_used`] restores it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FilterState {
    /// Training lookups so far: the clock `ttl_steps` and last uses count in.
    pub tick: u64,
    /// Each lock shard's admission counters (none without `admit_min_count`).
    pub sketches: Vec<Vec<u8>>,
}

/// One sketch of `len` counters (a power of two) that estimates at least
/// what any of `sketches` did for every key: a counter of a smaller target
/// takes the maximum of the cells that share its low bits, a larger target
/// repeats the cells (a key's cells are its hash's low bits).
pub(super) fn fold_sketches<'a>(sketches: impl Iterator<Item = &'a Vec<u8>>, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for s in sketches.filter(|s| !s.is_empty()) {
        let n = s.len();
        if n >= len {
            for (i, &c) in s.iter().enumerate() {
                out[i & (len - 1)] = out[i & (len - 1)].max(c);
            }
        } else {
            for (j, o) in out.iter_mut().enumerate() {
                *o = (*o).max(s[j & (n - 1)]);
            }
        }
    }
    out
}

/// Counts sightings of keys that have no row, in bounded memory: a count-min
/// sketch of saturating byte counters with two hashes and conservative update
/// (only the smallest counters grow). It can over-count (a key admitted a
/// little early when counters collide), never under-count.
pub(super) struct AdmitSketch {
    pub(super) min_count: u8,
    pub(super) counters: Vec<u8>,
    pub(super) mask: u64,
}

impl AdmitSketch {
    pub(super) fn new(min_count: u32, counters: usize) -> AdmitSketch {
        let n = counters.next_power_of_two().max(64);
        AdmitSketch { min_count: min_count.min(255) as u8, counters: vec![0; n], mask: n as u64 - 1 }
    }

    pub(super) fn cells(&self, key: u64) -> [usize; 2] {
        // Bits unrelated to the shard and index bucket bits (another mix).
        let h = mix64(key ^ 0x5bd1_e995_ad5f_3c6b);
        [(h & self.mask) as usize, ((h >> 32) & self.mask) as usize]
    }

    pub(super) fn estimate(&self, key: u64) -> u8 {
        let [a, b] = self.cells(key);
        self.counters[a].min(self.counters[b])
    }

    /// Whether `key` has already been seen `min_count` times.
    pub(super) fn admitted(&self, key: u64) -> bool {
        self.estimate(key) >= self.min_count
    }

    /// Whether the next sighting of `key` admits it.
    pub(super) fn admits_next(&self, key: u64) -> bool {
        self.estimate(key).saturating_add(1) >= self.min_count
    }

    /// Counts a sighting of `key`; whether it is admitted now.
    pub(super) fn count(&mut self, key: u64) -> bool {
        let cells = self.cells(key);
        let low = self.estimate(key);
        for c in cells {
            if self.counters[c] == low {
                self.counters[c] = low.saturating_add(1);
            }
        }
        low.saturating_add(1) >= self.min_count
    }
}

/// Row expiry (`ttl_steps`); slots freed by expiry are reused before the
/// arena grows.
pub(super) struct Expiry {
    /// `ttl_steps`, at least the floor.
    pub(super) ttl: u64,
    /// Each row's last training lookup, when the table has no SSD tier (the
    /// tier's use record keeps that clock otherwise; see `TableShard::last_use`).
    pub(super) last_use: Vec<u64>,
    pub(super) vacant: Vec<bool>,
    pub(super) free: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The admission sketch may admit a key early when counters collide
        /// (64 counters for up to 200 keys here), never late: a key is
        /// admitted by its `min_count`-th sighting at the latest.
        #[test]
        fn the_admission_sketch_never_admits_late(
            sightings in proptest::collection::vec(0u64..200, 0..2000),
            min_count in 2u32..6,
        ) {
            let mut sketch = AdmitSketch::new(min_count, 64);
            let mut seen = std::collections::HashMap::<u64, u32>::new();
            let mut admitted = std::collections::HashSet::new();
            for key in sightings {
                let key = mix64(key);
                let n = seen.entry(key).or_insert(0);
                *n += 1;
                if admitted.contains(&key) {
                    proptest::prop_assert!(sketch.admitted(key));
                    continue;
                }
                let predicted = sketch.admits_next(key);
                let now = sketch.count(key);
                proptest::prop_assert_eq!(predicted, now, "a prefetch predicts the lookup");
                if now {
                    admitted.insert(key);
                } else {
                    proptest::prop_assert!(*n < min_count, "key seen {} times, not admitted", n);
                }
            }
        }
    }
}
