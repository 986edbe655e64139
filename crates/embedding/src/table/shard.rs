//! One independently locked shard of the table: its slot index, its arena
//! of rows, its SSD tier backing and its admission and expiry filters.

use super::*;

pub(super) struct TableShard {
    /// Slots of the rows (with key fingerprints), by key.
    pub(super) index: SlotIndex,
    pub(super) chunks: Vec<Box<[f32]>>,
    /// Slots allocated so far (some may be vacant after expiry).
    pub(super) rows: usize,
    /// With an SSD tier, the rows above are a cache in front of it.
    pub(super) backing: Backing,
    /// `admit_min_count`: sightings of keys without a row.
    pub(super) admit: Option<AdmitSketch>,
    /// `ttl_steps`: when each row was last used; vacant slots.
    pub(super) expiry: Option<Expiry>,
    pub(super) filter_stats: FilterStats,
}

/// The slot a lookup reports for a key the admission filter turned away:
/// its update is skipped. Never a real slot (a shard holds < u32::MAX rows).
pub(super) const NOT_ADMITTED: u32 = u32::MAX;

/// How a missing row is made (initialiser, optimizer state) and for which
/// access (the lookup's tick; a prefetch stages rows without counting a use).
#[derive(Clone, Copy)]
pub(super) struct Access<'a> {
    pub(super) init: &'a Initializer,
    pub(super) opt: &'a SparseOptimizer,
    pub(super) tick: u64,
    /// Rows used at or after this tick may be in flight: never evicted.
    pub(super) oldest_in_flight: u64,
    pub(super) prefetching: bool,
}

impl TableShard {
    #[inline]
    pub(super) fn key_at(&self, layout: Layout, slot: u32) -> u64 {
        key_of(stored_in(&self.chunks, layout, slot))
    }

    #[inline]
    pub(super) fn find(&self, layout: Layout, key: u64) -> Option<u32> {
        self.index.find(key, |s| self.key_at(layout, s))
    }

    /// Prefetches a slot's row and its use record (the SSD tier's, or the
    /// clock `ttl_steps` and incremental checkpoints keep).
    #[inline]
    pub(super) fn prefetch_row(&self, layout: Layout, slot: u32) {
        prefetch_lines(stored_in(&self.chunks, layout, slot));
        if let Some(meta) = self.backing.tier().and_then(|t| t.meta.get(slot as usize)) {
            prefetch(meta);
        } else if let Some(last_use) = self.expiry.as_ref().and_then(|e| e.last_use.get(slot as usize)) {
            prefetch(last_use);
        }
    }

    /// [`confirm_or_insert`](Self::confirm_or_insert) for every key in order,
    /// calling `done(shard, j, slot)` after key j, as a software pipeline
    /// (D = [`PREFETCH_DISTANCE`]): prefetch the index bucket of key i + 2D,
    /// probe key i + D and prefetch its row, and finish key i, whose row has
    /// been in flight for D keys.
    pub(super) fn resolve_all(
        &mut self,
        layout: Layout,
        keys: &[u64],
        how: &Access<'_>,
        mut done: impl FnMut(&Self, usize, Option<u32>),
    ) -> Result<(), TableError> {
        const D: usize = PREFETCH_DISTANCE;
        let mut probes = vec![Probe::Vacant; keys.len()];
        for i in 0..keys.len() + 2 * D {
            if let Some(bucket) = keys.get(i).and_then(|&k| self.index.home(k)) {
                prefetch(bucket);
            }
            if let Some(j) = i.checked_sub(D).filter(|&j| j < keys.len()) {
                probes[j] = self.index.probe(keys[j]);
                if let Probe::Candidate { slot, .. } = probes[j] {
                    self.prefetch_row(layout, slot);
                }
            }
            if let Some(j) = i.checked_sub(2 * D) {
                let slot = self.confirm_or_insert(layout, keys[j], probes[j], how)?;
                done(self, j, slot);
            }
        }
        Ok(())
    }

    /// The packed row of a slot: vector (in `embedding.dtype`) and optimizer
    /// state; the key is not part of it.
    #[inline]
    pub(super) fn packed(&self, layout: Layout, slot: u32) -> &[f32] {
        &stored_in(&self.chunks, layout, slot)[KEY_FLOATS..]
    }

    #[inline]
    pub(super) fn packed_mut(&mut self, layout: Layout, slot: u32) -> &mut [f32] {
        let (chunk, start) = layout.locate(slot);
        &mut self.chunks[chunk][start + KEY_FLOATS..start + layout.stored_len]
    }

    /// A new row for `key` (which must not be present), indexed; its weights
    /// and state are zero until the caller fills them.
    pub(super) fn add(&mut self, layout: Layout, key: u64) -> Result<u32, TableError> {
        let slot = match self.expiry.as_mut().and_then(|e| e.free.pop().map(|slot| (e, slot))) {
            Some((e, slot)) => {
                e.vacant[slot as usize] = false;
                if let Some(t) = self.backing.tier_mut() {
                    t.meta[slot as usize] = SlotMeta::FRESH;
                }
                slot
            }
            None => self.allocate(layout)?,
        };
        let (chunk, start) = layout.locate(slot);
        set_key(&mut self.chunks[chunk][start..start + KEY_FLOATS], key);
        self.index.insert(key, slot);
        Ok(slot)
    }

    /// A new slot at the end of the arena.
    pub(super) fn allocate(&mut self, layout: Layout) -> Result<u32, TableError> {
        let slot = self.rows;
        if slot >= NOT_ADMITTED as usize {
            return Err(TableError::ShardFull { max: u64::from(NOT_ADMITTED) });
        }
        let slot = slot as u32;
        let (chunk, _) = layout.locate(slot);
        if chunk == self.chunks.len() {
            self.chunks.push(vec![0.0f32; layout.chunk_rows() * layout.stored_len].into_boxed_slice());
        }
        self.rows += 1;
        if let Some(t) = self.backing.tier_mut() {
            t.meta.push(SlotMeta::FRESH);
            t.pos.push(None);
        }
        if let Some(e) = &mut self.expiry {
            if self.backing.tier().is_none() {
                e.last_use.push(0);
            }
            e.vacant.push(false);
        }
        Ok(slot)
    }

    pub(super) fn is_vacant(&self, slot: usize) -> bool {
        self.expiry.as_ref().is_some_and(|e| e.vacant[slot])
    }

    /// The training lookup that last used a cached row, for `ttl_steps`
    /// (`now` without expiry, where nothing ages). One clock per slot: the
    /// SSD tier's use record when there is one, else the expiry state's.
    pub(super) fn last_use(&self, slot: usize, now: u64) -> u64 {
        match (&self.expiry, self.backing.tier()) {
            (None, _) => now,
            (Some(_), Some(t)) => t.meta[slot].last_use,
            (Some(e), None) => e.last_use[slot],
        }
    }

    /// A training lookup at `tick` used the row in `slot` (kept if later).
    pub(super) fn note_use(&mut self, slot: usize, tick: u64) {
        match (&mut self.expiry, self.backing.tier_mut()) {
            (_, Some(t)) => t.touch(slot as u32, tick),
            (Some(e), None) => e.last_use[slot] = e.last_use[slot].max(tick),
            (None, None) => {}
        }
    }

    /// Sets the clock of a slot that just received a row.
    pub(super) fn set_last_use(&mut self, slot: usize, last_use: u64) {
        match (&mut self.expiry, self.backing.tier_mut()) {
            (_, Some(t)) => t.meta[slot].last_use = last_use,
            (Some(e), None) => e.last_use[slot] = last_use,
            (None, None) => {}
        }
    }

    /// Admission filter: whether a key with no cached row gets one now. A
    /// key on the SSD tier was admitted before (or restored from a checkpoint).
    pub(super) fn admits(&mut self, key: u64, prefetching: bool, tick: u64) -> Result<bool, TableError> {
        let Some(sketch) = &mut self.admit else { return Ok(true) };
        if sketch.admitted(key) {
            return Ok(true);
        }
        if let Some(t) = self.backing.tier()
            && t.store.last_use(key)?.is_some_and(|last| !t.expired(last, tick))
        {
            return Ok(true);
        }
        if prefetching && !sketch.admits_next(key) {
            // Its lookup counts the sighting (and turns it away).
            return Ok(false);
        }
        // A prefetch that stages the row counts the sighting for the lookup
        // that follows (it finds the row cached): the sketch is the same with
        // or without the prefetch.
        let now = sketch.count(key);
        if now {
            self.filter_stats.admitted += 1;
        } else {
            self.filter_stats.not_admitted += 1;
        }
        Ok(now)
    }

    /// `ttl_steps`: whether the cached row in `slot` outlived its age as of
    /// lookup `tick` (it then reads as absent until the sweep deletes it).
    pub(super) fn aged_out(&self, slot: usize, tick: u64) -> bool {
        // Nothing is older than `ttl` before tick `ttl` (and a clock kept for
        // incremental checkpoints has an infinite one): no load then.
        self.expiry.as_ref().is_some_and(|e| tick > e.ttl && self.last_use(slot, tick) < tick - e.ttl)
    }

    /// `ttl_steps`: deletes the rows that no lookup used in the last `ttl`
    /// lookups, except rows in flight (they read as absent, and go at a later
    /// sweep); with an SSD tier, also the stored rows of the next quarter of
    /// the store (of all of it if `whole`).
    pub(super) fn expire(
        &mut self,
        layout: Layout,
        tick: u64,
        oldest_in_flight: u64,
        whole: bool,
    ) -> Result<(), TableError> {
        let Some(ttl) = self.expiry.as_ref().map(|e| e.ttl) else { return Ok(()) };
        let used_since = tick.saturating_sub(ttl).min(oldest_in_flight);
        self.delete_cached_before(layout, used_since, tick, Deletion::Expired);
        let cutoff = self.backing.tier().and_then(|t| t.expiry_cutoff(tick));
        self.sweep_store(layout, cutoff, whole, Deletion::Expired)
    }

    /// Deletes every row last used before `used_since` (the caller keeps
    /// rows in flight out of it), cached or stored: `embedding.ttl_secs` and
    /// `max_rows`, whose clocks the trainer computes.
    pub(super) fn delete_before(
        &mut self,
        layout: Layout,
        used_since: u64,
        tick: u64,
        why: Deletion,
    ) -> Result<(), TableError> {
        self.delete_cached_before(layout, used_since, tick, why);
        self.sweep_store(layout, Some(used_since), true, why)
    }

    /// The last use of every row (cached or only stored), for an LRU cutoff.
    pub(super) fn last_uses(&mut self, layout: Layout, tick: u64, out: &mut Vec<u64>) -> Result<(), TableError> {
        out.extend((0..self.rows).filter(|&s| !self.is_vacant(s)).map(|s| self.last_use(s, tick)));
        let TableShard { index, chunks, backing, .. } = self;
        let Some(t) = backing.tier_mut() else { return Ok(()) };
        let cached = |key: u64| index.find(key, |s| key_of(stored_in(chunks, layout, s))).is_some();
        let buckets = t.store.buckets();
        t.store.sweep(0, buckets, |key, last| {
            if !cached(key) {
                out.push(last);
            }
            false
        })?;
        Ok(())
    }

    /// The cached rows of [`delete_before`](Self::delete_before).
    fn delete_cached_before(&mut self, layout: Layout, used_since: u64, tick: u64, why: Deletion) {
        let old: Vec<usize> =
            (0..self.rows).filter(|&s| !self.is_vacant(s) && self.last_use(s, tick) < used_since).collect();
        let TableShard { index, chunks, expiry, filter_stats, backing, .. } = self;
        let Some(e) = expiry else { return };
        for slot in old {
            let key = key_of(stored_in(chunks, layout, slot as u32));
            index.remove(key, slot as u32);
            e.vacant[slot] = true;
            e.free.push(slot as u32);
            match backing.tier_mut() {
                Some(t) => {
                    t.meta[slot] = SlotMeta { vacant: true, dirty: false, ..SlotMeta::FRESH };
                    if t.pos[slot].take().is_some() {
                        // Its stored copy is older still: the sweep deletes and counts it.
                        t.stored_only += 1;
                    } else {
                        filter_stats.count(why, 1);
                    }
                }
                None => filter_stats.count(why, 1),
            }
        }
    }

    /// Deletes the expired rows of the next quarter of the SSD store (of all
    /// of it if `whole`), except the keys cached (their cached row decides).
    pub(super) fn sweep_store(
        &mut self,
        layout: Layout,
        cutoff: Option<u64>,
        whole: bool,
        why: Deletion,
    ) -> Result<(), TableError> {
        let TableShard { index, chunks, filter_stats, backing, .. } = self;
        let Some(t) = backing.tier_mut() else { return Ok(()) };
        let Some(cutoff) = cutoff else { return Ok(()) };
        let (from, count) =
            if whole { (0, t.store.buckets()) } else { (t.sweep_cursor, t.store.buckets().div_ceil(4)) };
        let cached = |key: u64| index.find(key, |s| key_of(stored_in(chunks, layout, s))).is_some();
        let (next, deleted) = t.store.sweep(from, count, |key, last| last < cutoff && !cached(key))?;
        if !whole {
            t.sweep_cursor = next;
        }
        t.stored_only -= deleted as usize;
        filter_stats.count(why, deleted);
        Ok(())
    }

    /// Slot of `key` (probed already), inserting an initialised row on first
    /// sight (S3.9); `None` if the admission filter turns the key away.
    /// With an SSD tier, a key missing from the cache is read from the store
    /// (or initialised on first sight) into a free or evicted slot.
    #[inline]
    pub(super) fn confirm_or_insert(
        &mut self,
        layout: Layout,
        key: u64,
        probe: Probe,
        how: &Access<'_>,
    ) -> Result<Option<u32>, TableError> {
        let Access { init, opt, tick, oldest_in_flight, prefetching } = *how;
        let found = self.index.confirm(key, probe, |s| self.key_at(layout, s));
        // ttl_steps: a cached row past its age is gone as a stored one is
        // when read, whether the sweep reached it yet or not, so which rows
        // were cached never changes the model.
        // A prefetch is not a use: the lookup it stages for decides.
        let aged_out = found.is_some_and(|slot| !prefetching && self.aged_out(slot as usize, tick));
        if let Some(slot) = found {
            if aged_out {
                init_row(layout, init, opt, key, self.packed_mut(layout, slot));
                self.filter_stats.expired += 1;
                self.backing.restarted(slot);
            }
            if prefetching {
                // Kept until the lookup it is staged for, which counts the use.
                self.backing.stage(slot, tick);
            } else {
                self.note_use(slot as usize, tick);
                self.backing.count_hit();
            }
            return Ok(Some(slot));
        }
        if !self.admits(key, prefetching, tick)? {
            return Ok(None);
        }
        let slot = self.free_slot(layout, key, oldest_in_flight)?;
        let (chunk, start) = layout.locate(slot);
        let row = &mut self.chunks[chunk][start + KEY_FLOATS..start + layout.stored_len];
        let filled = self.backing.fill(slot, key, row, tick, prefetching, &mut self.filter_stats)?;
        if !filled.loaded {
            init_row(layout, init, opt, key, row);
        }
        self.set_last_use(slot as usize, filled.last_use);
        if !prefetching {
            self.backing.touch(slot, tick);
        }
        Ok(Some(slot))
    }

    /// A slot for a new `key`, indexed: a fresh one while the cache is under
    /// capacity, else an evicted one (its row written back if dirty).
    pub(super) fn free_slot(&mut self, layout: Layout, key: u64, oldest_in_flight: u64) -> Result<u32, TableError> {
        let rows = self.rows;
        // Slots of expired rows are refilled before anything is evicted.
        let vacant = self.expiry.as_ref().is_some_and(|e| !e.free.is_empty());
        let victim = match self.backing.tier_mut() {
            Some(t) if rows >= t.capacity && !vacant => t.pick_victim(rows, oldest_in_flight),
            _ => None,
        };
        let Some(slot) = victim else { return self.add(layout, key) };
        let TableShard { index, chunks, backing, .. } = self;
        let Some(tier) = backing.tier_mut() else { return Err(TableError::ShardFull { max: 0 }) };
        if let Some(next) = tier.next_victim {
            prefetch_lines(stored_in(chunks, layout, next));
        }
        let old = key_of(stored_in(chunks, layout, slot));
        let meta = tier.meta[slot as usize];
        if meta.dirty {
            let row = &stored_in(chunks, layout, slot)[KEY_FLOATS..];
            let how = Use { uses: meta.uses, last_use: meta.last_use };
            tier.store.put_at(old, row, how, tier.pos[slot as usize])?;
            tier.stats.writebacks += 1;
        }
        tier.pos[slot as usize] = None;
        tier.stored_only += 1;
        index.remove(old, slot);
        let (chunk, start) = layout.locate(slot);
        set_key(&mut chunks[chunk][start..start + KEY_FLOATS], key);
        tier.meta[slot as usize] = SlotMeta::FRESH;
        index.insert(key, slot);
        Ok(slot)
    }

    /// `key`'s full (logical) row from the cache or the store, without
    /// inserting it; false if absent (or expired on the store, as of lookup `tick`).
    pub(super) fn read_row(&self, layout: Layout, key: u64, out: &mut [f32], tick: u64) -> Result<bool, TableError> {
        if let Some(slot) = self.find(layout, key) {
            layout.format.decode(self.packed(layout, slot), out);
            return Ok(!self.aged_out(slot as usize, tick));
        }
        let Some(t) = self.backing.tier() else { return Ok(false) };
        let mut packed = vec![0.0f32; layout.packed_len];
        let live = t.store.get(key, &mut packed)?.is_some_and(|s| !t.expired(s.how.last_use, tick));
        layout.format.decode(&packed, out);
        Ok(live)
    }

    pub(super) fn mark_dirty(&mut self, slot: u32) {
        if let Some(t) = self.backing.tier_mut() {
            t.meta[slot as usize].dirty = true;
        }
    }
}
