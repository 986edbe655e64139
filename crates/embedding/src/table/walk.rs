//! Walks over every row of a table: paged (a cluster shard's export) and
//! whole, in a deterministic order (checkpoints). Cached rows, then (SSD
//! tier) the stored rows that are not cached; rows past `ttl_steps` are gone.

use std::sync::atomic::Ordering;

use super::arena::{KEY_FLOATS, key_of, stored_in};
use super::{EmbeddingTable, TableError};

/// [`EmbeddingTable::rows_from`] positions at or past this walk a shard's SSD store.
pub const STORE_CURSOR: usize = 1 << 40;

impl EmbeddingTable {
    /// Up to `max` rows in storage order starting at `cursor` (lock shard,
    /// position), each with its key; returns the cursor after them, `None`
    /// once every row was visited. For a table that is not being trained, a
    /// walk from `(0, 0)` visits every row exactly once (export in pages):
    /// a shard's cached rows first, then (SSD tier) its stored rows that are
    /// not cached, at positions from [`STORE_CURSOR`] on.
    pub fn rows_from(
        &self,
        cursor: (usize, usize),
        max: usize,
        mut f: impl FnMut(u64, u64, &[f32]),
    ) -> Result<Option<(usize, usize)>, TableError> {
        let (mut shard_index, mut pos) = cursor;
        let mut visited = 0;
        let format = self.layout.format;
        let mut row = vec![0.0f32; self.layout.row_len];
        let tick = self.tick.load(Ordering::Relaxed);
        while shard_index < self.shards.len() {
            let shard = self.shards[shard_index].read();
            while pos < shard.rows && pos < STORE_CURSOR {
                if visited == max {
                    return Ok(Some((shard_index, pos)));
                }
                if !shard.is_vacant(pos) && !shard.aged_out(pos, tick) {
                    let stored = stored_in(&shard.chunks, self.layout, pos as u32);
                    format.decode(&stored[KEY_FLOATS..], &mut row);
                    f(key_of(stored), shard.last_use(pos, tick), &row);
                    visited += 1;
                }
                pos += 1;
            }
            if let Some(t) = shard.backing.tier() {
                let mut bucket = pos.saturating_sub(STORE_CURSOR) as u64;
                loop {
                    if visited == max {
                        return Ok(Some((shard_index, STORE_CURSOR + bucket as usize)));
                    }
                    let next = t.store.scan_from(bucket, max - visited, |key, how, packed| {
                        if shard.find(self.layout, key).is_none() && !t.expired(how.last_use, tick) {
                            format.decode(packed, &mut row);
                            f(key, how.last_use, &row);
                            return true;
                        }
                        false
                    })?;
                    match next {
                        Some((b, n)) => {
                            visited += n;
                            bucket = b;
                        }
                        None => break,
                    }
                }
            }
            shard_index += 1;
            pos = 0;
        }
        Ok(None)
    }

    /// Visits every (logical) row with its last use (the lookup tick; `ttl_steps` ages
    /// rows by it), shard by shard, in a deterministic order (sorted by key
    /// within a shard) so that checkpoints of equal tables are byte-identical.
    pub fn for_each_row(&self, mut f: impl FnMut(u64, u64, &[f32]) -> std::io::Result<()>) -> std::io::Result<()> {
        let tick = self.tick.load(Ordering::Relaxed);
        let format = self.layout.format;
        let mut row = vec![0.0f32; self.layout.row_len];
        for shard in self.shards.iter() {
            let shard = shard.read();
            let mut entries: Vec<(u64, u32)> = (0..shard.rows as u32)
                .filter(|&slot| !shard.is_vacant(slot as usize) && !shard.aged_out(slot as usize, tick))
                .map(|slot| (key_of(stored_in(&shard.chunks, self.layout, slot)), slot))
                .collect();
            // SSD tier: the stored rows that are not cached (the cache's copy is newer).
            let mut stored: Vec<(u64, u64, Vec<f32>)> = Vec::new();
            if let Some(t) = shard.backing.tier() {
                t.store.for_each(|key, how, row| {
                    if shard.find(self.layout, key).is_none() && !t.expired(how.last_use, tick) {
                        stored.push((key, how.last_use, row.to_vec()));
                    }
                })?;
            }
            let mut all: Vec<(u64, Result<u32, usize>)> = entries.drain(..).map(|(k, s)| (k, Ok(s))).collect();
            all.extend(stored.iter().enumerate().map(|(i, (k, _, _))| (*k, Err(i))));
            all.sort_unstable_by_key(|e| e.0);
            for (key, at) in all {
                match at {
                    Ok(slot) => {
                        format.decode(shard.packed(self.layout, slot), &mut row);
                        f(key, shard.last_use(slot as usize, tick), &row)?
                    }
                    Err(i) => {
                        format.decode(&stored[i].2, &mut row);
                        f(key, stored[i].1, &row)?
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use sparrow_core::config::InitConfig;

    use super::*;
    use crate::optimizer::SparseOptimizer;
    use crate::table::Initializer;

    fn mix(k: u64) -> u64 {
        sparrow_core::key::mix64(k)
    }

    fn table(opt: SparseOptimizer) -> EmbeddingTable {
        EmbeddingTable::new(4, opt, Initializer::new(InitConfig::default(), 9), 4)
    }

    #[test]
    fn a_paged_walk_visits_every_row_once() {
        let t = table(SparseOptimizer::Adagrad { lr: 0.1, eps: 1e-8 });
        for key in 0..1000u64 {
            let row: Vec<f32> = (0..t.row_len()).map(|i| (key * 10 + i as u64) as f32).collect();
            t.put_row(mix(key), &row).expect("put");
        }
        let (mut seen, mut cursor) = (Vec::new(), Some((0, 0)));
        while let Some(at) = cursor {
            cursor = t
                .rows_from(at, 37, |key, _, row| {
                    assert_eq!(Some(row.to_vec()), t.get_row(key));
                    seen.push(key);
                })
                .expect("walk");
        }
        seen.sort_unstable();
        let mut expected: Vec<u64> = (0..1000).map(mix).collect();
        expected.sort_unstable();
        assert_eq!(seen, expected);
    }
}
