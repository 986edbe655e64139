//! The memory cache in front of a lock shard's SSD store (S3.8): which
//! cached rows are used when, which are dirty, and which one to evict
//! (Redis-style sampled LRU/LFU, staged one miss ahead).

use sparrow_core::config::CachePolicy;

use super::TableError;
use super::arena::prefetch;
use super::filters::FilterStats;
use crate::disk::{DiskStore, StorePos};

/// Where a lock shard's rows live besides its arena: nowhere (the arena is
/// the table), or an SSD store with the arena as its cache. A lookup calls
/// the same hooks either way; a memory table's do nothing.
#[expect(
    clippy::large_enum_variant,
    reason = "one per lock shard; the tier inline saves a pointer chase on every lookup"
)]
pub(super) enum Backing {
    Memory,
    Ssd(Tier),
}

/// A new row's contents as [`Backing::fill`] left them.
pub(super) struct Fill {
    /// Read back from the store (otherwise the caller initialises it).
    pub(super) loaded: bool,
    /// Its clock: the lookup's tick, or (staged by a prefetch) the stored
    /// row's own last use, since a prefetch is not a use.
    pub(super) last_use: u64,
}

impl Backing {
    pub(super) fn tier(&self) -> Option<&Tier> {
        match self {
            Backing::Memory => None,
            Backing::Ssd(t) => Some(t),
        }
    }

    pub(super) fn tier_mut(&mut self) -> Option<&mut Tier> {
        match self {
            Backing::Memory => None,
            Backing::Ssd(t) => Some(t),
        }
    }

    /// A cached row found by a lookup.
    pub(super) fn count_hit(&mut self) {
        if let Backing::Ssd(t) = self {
            t.stats.hits += 1;
        }
    }

    /// A cached row found by a prefetch: kept for the lookup it is staged for.
    pub(super) fn stage(&mut self, slot: u32, tick: u64) {
        if let Backing::Ssd(t) = self {
            let m = &mut t.meta[slot as usize];
            m.staged_at = m.staged_at.max(tick);
        }
    }

    /// A cached row that aged out starts afresh in its slot.
    pub(super) fn restarted(&mut self, slot: u32) {
        if let Backing::Ssd(t) = self {
            let m = &mut t.meta[slot as usize];
            (m.uses, m.dirty) = (0, true);
        }
    }

    /// A lookup used the row in `slot` (a new one, or found).
    pub(super) fn touch(&mut self, slot: u32, tick: u64) {
        if let Backing::Ssd(t) = self {
            t.touch(slot, tick);
        }
    }

    /// Fills a new slot for `key`: from the store if it holds a live row
    /// (one past `ttl_steps` is gone: it starts afresh, its record
    /// overwritten at the next write-back), else nothing to read.
    pub(super) fn fill(
        &mut self,
        slot: u32,
        key: u64,
        row: &mut [f32],
        tick: u64,
        prefetching: bool,
        filter_stats: &mut FilterStats,
    ) -> Result<Fill, TableError> {
        let Backing::Ssd(t) = self else { return Ok(Fill { loaded: false, last_use: tick }) };
        let stored = t.store.get_pos(key, row)?;
        let live = stored.filter(|s| !t.expired(s.how.last_use, tick));
        let loaded = live.is_some();
        // Staged, not used: a row read back keeps its age until its lookup.
        let last_use = match (live, prefetching) {
            (Some(s), true) => s.how.last_use,
            _ => tick,
        };
        t.pos[slot as usize] = stored.map(|s| s.pos);
        let m = &mut t.meta[slot as usize];
        // A row read back resumes the use count it was evicted with.
        m.uses = live.map_or(0, |s| s.how.uses);
        (m.vacant, m.dirty) = (false, !loaded);
        if prefetching {
            // Kept for its lookup, which counts the use.
            m.staged_at = tick;
        }
        if stored.is_some() {
            t.stored_only -= 1;
            if !loaded {
                filter_stats.expired += 1;
            }
        }
        match (prefetching, loaded) {
            (false, true) => t.stats.loads += 1,
            (false, false) => t.stats.inits += 1,
            (true, true) => t.stats.prefetch_loads += 1,
            (true, false) => t.stats.prefetch_inits += 1,
        }
        Ok(Fill { loaded, last_use })
    }
}

/// A shard's cache bookkeeping when its table has an SSD tier (S3.8).
pub(super) struct Tier {
    pub(super) store: DiskStore,
    /// Rows this shard's cache holds before it starts evicting.
    pub(super) capacity: usize,
    pub(super) policy: CachePolicy,
    /// Per cached slot, in one cache line: eviction reads them together.
    pub(super) meta: Vec<SlotMeta>,
    /// Where a cached row read from the store sits there: its write-back
    /// skips the probe.
    pub(super) pos: Vec<Option<StorePos>>,
    /// Keys in the store and not in the cache.
    pub(super) stored_only: usize,
    pub(super) rng: u64,
    /// Eviction runs one miss ahead, so that its random reads are in flight
    /// while the store is read: slots sampled (use records prefetched) at the
    /// previous miss, and the victim chosen then (row prefetched).
    pub(super) sampled: [u32; VICTIM_SAMPLES],
    pub(super) next_victim: Option<u32>,
    /// `ttl_steps` (0: off; at least the floor): stored rows unused for longer read as absent
    /// and are deleted by a sweep of the store, a quarter per expiry pass.
    pub(super) ttl: u64,
    pub(super) sweep_cursor: u64,
    pub(super) stats: TierStats,
}

/// Slots an eviction compares (Redis's approximated LRU/LFU).
pub(super) const VICTIM_SAMPLES: usize = 8;

/// A cached row's use record (24 bytes).
#[derive(Clone, Copy)]
pub(super) struct SlotMeta {
    /// The training lookup (tick) that last used the row: its recency for
    /// eviction and, with `ttl_steps`, its age. The slot's one clock.
    pub(super) last_use: u64,
    /// The latest prefetch that staged the row for a lookup still to come
    /// (a prefetch is not a use): kept while that prefetch's `Staged` lease
    /// holds its tick in flight. 0: never staged.
    pub(super) staged_at: u64,
    pub(super) uses: u32,
    /// Changed since it was read from the store (or never stored).
    pub(super) dirty: bool,
    /// Its row expired (`ttl_steps`); the slot waits to be reused.
    pub(super) vacant: bool,
}

impl SlotMeta {
    /// A slot about to receive a new row (the caller sets its use).
    pub(super) const FRESH: SlotMeta = SlotMeta { last_use: 0, staged_at: 0, uses: 0, dirty: true, vacant: false };
}

/// Lookups of a table with an SSD tier, by outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierStats {
    /// Found in the memory cache.
    pub hits: u64,
    /// Read from the SSD store into the cache.
    pub loads: u64,
    /// Keys seen for the first time (initialised, nothing to read).
    pub inits: u64,
    /// Rows written back to the store on eviction.
    pub writebacks: u64,
    /// Rows read from the store (or initialised) ahead of their lookup by
    /// [`EmbeddingTable::prefetch`] (S3.5).
    pub prefetch_loads: u64,
    pub prefetch_inits: u64,
}

impl std::ops::AddAssign for TierStats {
    fn add_assign(&mut self, o: TierStats) {
        self.hits += o.hits;
        self.loads += o.loads;
        self.inits += o.inits;
        self.writebacks += o.writebacks;
        self.prefetch_loads += o.prefetch_loads;
        self.prefetch_inits += o.prefetch_inits;
    }
}

impl TierStats {
    /// Lookups of known keys served from memory without reading the store
    /// on their behalf: prefetched rows are hits at lookup but count as misses here.
    pub fn cache_hit_rate(&self) -> f64 {
        let known = (self.hits + self.loads).saturating_sub(self.prefetch_inits);
        let served = self.hits.saturating_sub(self.prefetch_loads + self.prefetch_inits);
        served as f64 / known.max(1) as f64
    }
}

impl Tier {
    pub(super) fn draw(&mut self, rows: usize) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % rows as u64) as usize
    }

    /// Not used by a lookup in flight, not staged for one, not vacant.
    pub(super) fn evictable(&self, slot: usize, oldest_in_flight: u64) -> bool {
        let m = &self.meta[slot];
        !m.vacant && m.last_use < oldest_in_flight && m.staged_at < oldest_in_flight
    }

    /// As of `tick`, rows last used before this have outlived `ttl_steps`
    /// (`None`: no expiry).
    pub(super) fn expiry_cutoff(&self, tick: u64) -> Option<u64> {
        (self.ttl > 0).then(|| tick.saturating_sub(self.ttl))
    }

    pub(super) fn expired(&self, last_use: u64, tick: u64) -> bool {
        self.expiry_cutoff(tick).is_some_and(|cutoff| last_use < cutoff)
    }

    /// The policy's order: lower goes first.
    pub(super) fn eviction_rank(&self, slot: usize) -> u64 {
        let m = self.meta[slot];
        match self.policy {
            CachePolicy::Lru => m.last_use,
            CachePolicy::Lfu => (u64::from(m.uses) << 32) | (m.last_use & 0xffff_ffff),
        }
    }

    /// The lowest-ranked evictable slot of `slots`.
    pub(super) fn best_of(&self, slots: impl Iterator<Item = usize>, oldest_in_flight: u64) -> Option<u32> {
        slots.filter(|&s| self.evictable(s, oldest_in_flight)).min_by_key(|&s| self.eviction_rank(s)).map(|s| s as u32)
    }

    /// A slot to evict: the least recently (or frequently) used of a few
    /// sampled unprotected slots, as Redis approximates LRU; `None` if every
    /// sample was protected (the cache then grows past its capacity).
    ///
    /// Normally the victim chosen at the previous miss; then the samples of
    /// the previous miss are compared (their use records have arrived) and
    /// new ones drawn, so no miss waits on these random reads.
    /// The caller prefetches the row of the staged [`next_victim`](Self::next_victim).
    pub(super) fn pick_victim(&mut self, rows: usize, oldest_in_flight: u64) -> Option<u32> {
        let ready =
            self.next_victim.take().filter(|&v| (v as usize) < rows && self.evictable(v as usize, oldest_in_flight));
        let victim = match ready {
            Some(v) => Some(v),
            None => self.pick_now(rows, oldest_in_flight),
        };
        // Stage the next eviction: compare the samples drawn last time…
        // (Before the first miss they are all slot 0, which exists by then.)
        let sampled = self.sampled;
        self.next_victim =
            self.best_of(sampled.iter().map(|&s| s as usize), oldest_in_flight).filter(|&s| Some(s) != victim);
        // …and draw the samples for the one after.
        for i in 0..VICTIM_SAMPLES {
            let slot = self.draw(rows);
            prefetch(&self.meta[slot]);
            self.sampled[i] = slot as u32;
        }
        victim
    }

    /// [`pick_victim`](Self::pick_victim) without the staged one: draws
    /// rounds of samples until enough of them are unprotected.
    pub(super) fn pick_now(&mut self, rows: usize, oldest_in_flight: u64) -> Option<u32> {
        let mut best: Option<u32> = None;
        let mut candidates = 0;
        for _round in 0..8 {
            let mut slots = [0usize; VICTIM_SAMPLES];
            for slot in &mut slots {
                *slot = self.draw(rows);
                prefetch(&self.meta[*slot]);
            }
            candidates += slots.iter().filter(|&&s| self.evictable(s, oldest_in_flight)).count();
            best = self.best_of(slots.into_iter().chain(best.map(|b| b as usize)), oldest_in_flight);
            if candidates >= VICTIM_SAMPLES {
                break;
            }
        }
        best
    }

    /// A use by lookup `tick`. Lookups of one shard may finish out of tick
    /// order (concurrent pulls): a row keeps its latest use, so it stays
    /// protected while the newest lookup that used it is in flight.
    pub(super) fn touch(&mut self, slot: u32, tick: u64) {
        let s = slot as usize;
        let m = &mut self.meta[s];
        m.last_use = m.last_use.max(tick);
        m.uses = m.uses.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use sparrow_core::config::{CachePolicy, InitConfig};

    use crate::optimizer::SparseOptimizer;
    use crate::table::{EmbeddingTable, Initializer, SsdOptions};

    /// LFU: a row evicted to the store and read back resumes its use count,
    /// so a warm row does not restart as cold as a key never seen before.
    #[test]
    fn an_lfu_row_read_back_from_the_store_keeps_its_use_count() {
        let dir = tempfile::tempdir().expect("tmp");
        let ssd = SsdOptions { dir: dir.path().to_path_buf(), cache_capacity_rows: 1, policy: CachePolicy::Lfu };
        let opt = SparseOptimizer::Sgd { lr: 0.1 };
        let t = EmbeddingTable::with_ssd(4, opt, Initializer::new(InitConfig::default(), 9), 1, &ssd).expect("ssd");
        let look = |key: u64| {
            let plan = t.plan(&[key]);
            let mut rows = vec![0.0; t.row_len()];
            let slots = t.lookup_or_insert(&plan, &mut rows).expect("lookup");
            t.apply_gradients_at(&plan, &slots, &[0.5; 4]).expect("update");
        };
        let uses_of = |key: u64| {
            let shard = t.shards[0].read();
            let slot = shard.find(t.layout, key).expect("cached");
            shard.backing.tier().map(|tier| tier.meta[slot as usize].uses)
        };
        for _ in 0..3 {
            look(7);
        }
        assert_eq!(uses_of(7), Some(3));
        // One cached row: 8 evicts 7 (written back with its count), 7 evicts 8.
        look(8);
        assert_eq!(uses_of(8), Some(1));
        look(7);
        assert_eq!(uses_of(7), Some(4), "3 uses before the eviction, 1 after");
        assert_eq!(t.tier_stats().map(|s| s.writebacks), Some(2));
    }
}
