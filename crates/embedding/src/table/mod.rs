//! The in-memory embedding table: `shards` independently locked shards, each a
//! chunked arena of rows `[key | weights | optimizer state]` and a
//! [`SlotIndex`] from key to slot.
//!
//! The full key lives in its row; an index entry is the slot plus a 32-bit
//! fingerprint of the key (8 bytes, no control bytes). A batch lookup is a
//! software pipeline: it prefetches the index bucket of key i + 2D, probes key
//! i + D and prefetches its row, and finishes key i (full key checked in the
//! row, or the row inserted). At dim 16 with Adagrad a row is 136 bytes,
//! exactly key + vector + state.
//!
//! Invariant: a row never moves once allocated (chunks are never reallocated).
//! A slot changes hands only by eviction (SSD tier) or expiry (`ttl_steps`),
//! never while a lookup that used its row is in flight (`in_flight.rs`), so
//! the slots a lookup returns stay valid until the update that follows it;
//! the update checks each row's key all the same and refuses a stale slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use rayon::prelude::*;
use sparrow_core::config::{CachePolicy, Rounding};
use sparrow_core::simd::Simd;

mod arena;
mod cache;
mod filters;
mod init;
mod shard;
mod walk;

use arena::{KEY_FLOATS, Layout, PREFETCH_DISTANCE, key_of, prefetch, prefetch_lines, set_key, stored_in};
pub use cache::TierStats;
use cache::{Backing, SlotMeta, Tier, VICTIM_SAMPLES};
use filters::{AdmitSketch, Expiry, fold_sketches};
pub use filters::{Deletion, FeatureFilters, FilterState, FilterStats};
pub use init::Initializer;
use shard::{Access, NOT_ADMITTED, TableShard};
pub use walk::STORE_CURSOR;

use crate::disk::{DiskStore, Use};
use crate::dtype::{EmbeddingDtype, RowFormat};
use crate::in_flight::{InFlight, Lease};
use crate::index::{Probe, SlotIndex};
use crate::optimizer::SparseOptimizer;
use crate::partition::Partitioner;
use crate::plan::KeyPlan;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    #[error("embedding row for key {key:#018x} has {found} floats, the table expects {expected}")]
    RowWidth { key: u64, expected: usize, found: usize },
    #[error("the table holds more than {max} rows in one shard")]
    ShardFull { max: u64 },
    /// An update's slot no longer holds the key it was looked up for: the
    /// lookup's slots went stale (a bug; the update is refused, not misapplied).
    #[error(
        "lock shard {shard}: the row looked up for key {key:#018x} now holds key {found:#018x}; its update is refused"
    )]
    SlotReused { shard: usize, key: u64, found: u64 },
    /// The message already names the file; not a `source`, so an error
    /// chain does not print it twice.
    #[error("SSD tier: {0}")]
    Ssd(std::io::Error),
    /// A config the table cannot be laid out from (an unknown `model.kind`).
    #[error("config: {key}: {message}")]
    Config { key: &'static str, message: String },
}

impl From<std::io::Error> for TableError {
    fn from(e: std::io::Error) -> Self {
        TableError::Ssd(e)
    }
}

/// Runs `f` on a scratch vector of `dim` floats (on the stack up to 64).
#[inline]
fn with_vector<R>(dim: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    if dim <= 64 {
        let mut buf = [0.0f32; 64];
        f(&mut buf[..dim])
    } else {
        f(&mut vec![0.0f32; dim])
    }
}

/// Fills a new packed row: `key`'s initial vector, rounded to the stored
/// dtype before the optimizer's state is derived from it (FTRL's `z`
/// reproduces the stored vector), and that state.
#[inline]
fn init_row(layout: Layout, init: &Initializer, opt: &SparseOptimizer, key: u64, packed: &mut [f32]) {
    let (words, state) = packed.split_at_mut(layout.vector_words());
    if layout.format.dtype == EmbeddingDtype::F32 {
        init.fill(key, words);
        opt.init_state(words, state);
        return;
    }
    with_vector(layout.dim, |w| {
        init.fill(key, w);
        layout.format.round(w);
        opt.init_state(w, state);
        layout.format.encode_vector(w, words);
    });
}

/// One optimizer step on a packed row: in f32 on the decoded vector (in
/// `scratch`, `dim` floats), which is rounded once as it is stored again:
/// to nearest, or with `stochastic` (the seed and the row's key)
/// stochastically, the row's last word counting its updates.
#[inline]
fn update_row(
    layout: Layout,
    opt: &SparseOptimizer,
    packed: &mut [f32],
    grad: &[f32],
    scratch: &mut [f32],
    stochastic: Option<(u64, u64)>,
) {
    let (words, state) = packed.split_at_mut(layout.vector_words());
    if stochastic.is_some() {
        layout.format.decode_vector(words, scratch);
        layout.format.step_and_round(opt, scratch, state, grad, stochastic);
        layout.format.encode_vector(scratch, words);
        return;
    }
    if layout.format.dtype == EmbeddingDtype::F32 {
        opt.apply(words, state, grad);
        return;
    }
    layout.format.update_vector(opt, words, state, grad, scratch);
}

pub struct EmbeddingTable {
    layout: Layout,
    optimizer: SparseOptimizer,
    init: Initializer,
    shards: Box<[RwLock<TableShard>]>,
    shard_mask: u64,
    /// Counts training lookups: a cached row's age for eviction.
    tick: AtomicU64,
    /// The lookups (and prefetches) whose rows are still in flight.
    in_flight: Arc<InFlight>,
    /// `ttl_steps`: lookups between sweeps for expired rows, ⌈ttl/8⌉ (a row
    /// goes between ttl and 9/8 ttl lookups after its last use); 0: never.
    sweep_every: u64,
    /// `embedding.rounding = "stochastic"`: the seed of its draws; each row
    /// then ends with its update count (see [`RowFormat::round_stochastic`]).
    stochastic_seed: Option<u64>,
}

/// The SSD tier of a table (S3.8): where its files go and the cache in front.
#[derive(Clone, Debug)]
pub struct SsdOptions {
    pub dir: std::path::PathBuf,
    /// Rows the memory cache holds (split evenly across the lock shards).
    pub cache_capacity_rows: usize,
    pub policy: CachePolicy,
}

impl std::fmt::Debug for EmbeddingTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingTable")
            .field("dim", &self.layout.dim)
            .field("optimizer", &self.optimizer)
            .field("rows", &self.len())
            .finish()
    }
}

/// The slots of a lookup's unique keys, so the update that follows does not
/// probe the hash index again. Valid for the table that produced it: while it
/// lives, its lookup is in flight and none of its rows is evicted or expired.
/// Drop it once its update is applied (or abandoned).
#[derive(Debug, Default)]
pub struct RowSlots {
    table_id: usize,
    slots: Vec<u32>,
    _lease: Option<Lease>,
}

/// Rows a [`EmbeddingTable::prefetch`] staged into the cache stay there
/// while this lives: keep it until the lookup they were staged for.
#[derive(Debug, Default)]
#[must_use = "staged rows may be evicted again once this is dropped"]
pub struct Staged {
    _lease: Option<Lease>,
}

impl EmbeddingTable {
    /// A table of f32 vectors in memory; `shards` must be a power of two.
    pub fn new(dim: usize, optimizer: SparseOptimizer, init: Initializer, shards: usize) -> Self {
        Self::typed(dim, EmbeddingDtype::F32, optimizer, init, shards)
    }

    /// A table in memory whose vectors are stored in `dtype`.
    pub fn typed(
        dim: usize,
        dtype: EmbeddingDtype,
        optimizer: SparseOptimizer,
        init: Initializer,
        shards: usize,
    ) -> Self {
        assert!(shards.is_power_of_two(), "table shards must be a power of two");
        let layout = Layout::new(RowFormat { dtype, dim, state_len: optimizer.state_len(dim), simd: Simd::Auto });
        let shard_mask = shards as u64 - 1;
        let shards = (0..shards)
            .map(|_| {
                RwLock::new(TableShard {
                    index: SlotIndex::default(),
                    chunks: Vec::new(),
                    rows: 0,
                    backing: Backing::Memory,
                    admit: None,
                    expiry: None,
                    filter_stats: FilterStats::default(),
                })
            })
            .collect();
        EmbeddingTable {
            layout,
            optimizer,
            init,
            shards,
            shard_mask,
            tick: AtomicU64::new(1),
            in_flight: Arc::default(),
            sweep_every: 0,
            stochastic_seed: None,
        }
    }

    /// `train.simd`: whether the rows' conversions and steps may take their
    /// SIMD kernels (the same bits either way).
    pub fn with_simd(mut self, simd: Simd) -> Self {
        self.layout.format.simd = simd;
        self
    }

    /// `embedding.rounding`: with `Stochastic` on a half table, updated
    /// vectors are rounded stochastically, drawing from the initializer's
    /// seed, and every row gets one more word (its update count) after the
    /// optimizer state. Set on an empty table, before its SSD tier.
    pub fn with_rounding(mut self, rounding: Rounding) -> Self {
        if rounding == Rounding::Nearest || self.layout.format.dtype == EmbeddingDtype::F32 {
            return self;
        }
        assert!(
            self.shards.iter().all(|s| s.read().rows == 0 && matches!(s.read().backing, Backing::Memory)),
            "the rounding is set on an empty in-memory table"
        );
        let format = self.layout.format;
        self.layout = Layout::new(RowFormat { state_len: self.optimizer.state_len(format.dim) + 1, ..format });
        self.stochastic_seed = Some(self.init.seed);
        self
    }

    /// The seed of stochastic rounding's draws; `None`: to nearest.
    pub fn stochastic_seed(&self) -> Option<u64> {
        self.stochastic_seed
    }

    /// How updated vectors are rounded (f32 tables: to nearest, i.e. not at all).
    pub fn rounding(&self) -> Rounding {
        if self.stochastic_seed.is_some() { Rounding::Stochastic } else { Rounding::Nearest }
    }

    /// A table whose rows live in files under `ssd.dir` (one per lock shard),
    /// with at most `ssd.cache_capacity_rows` of them in memory.
    pub fn with_ssd(
        dim: usize,
        optimizer: SparseOptimizer,
        init: Initializer,
        shards: usize,
        ssd: &SsdOptions,
    ) -> Result<Self, TableError> {
        Self::new(dim, optimizer, init, shards).with_ssd_tier(ssd)
    }

    /// Moves an empty table's rows to files under `ssd.dir`, behind a cache.
    pub fn with_ssd_tier(self, ssd: &SsdOptions) -> Result<Self, TableError> {
        let table = self;
        let shards = table.shards.len();
        assert_eq!(table.len(), 0, "the SSD tier is set on an empty table");
        std::fs::create_dir_all(&ssd.dir)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", ssd.dir.display())))?;
        let capacity = ssd.cache_capacity_rows.div_ceil(shards).max(1);
        for (i, shard) in table.shards.iter().enumerate() {
            let store = DiskStore::create(&ssd.dir.join(format!("shard-{i:03}.bin")), table.layout.packed_len)?;
            shard.write().backing = Backing::Ssd(Tier {
                store,
                capacity,
                policy: ssd.policy,
                meta: Vec::new(),
                pos: Vec::new(),
                stored_only: 0,
                rng: 0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1),
                sampled: [0; VICTIM_SAMPLES],
                next_victim: None,
                ttl: 0,
                sweep_cursor: 0,
                stats: TierStats::default(),
            });
        }
        Ok(table)
    }

    /// The table `embedding.*` describes: in memory, or with its SSD tier in
    /// `embedding.path` (joined with `subdir`, so several tables of one
    /// machine do not share files). `ttl_floor`: see [`FeatureFilters`].
    pub fn from_config(
        dim: usize,
        config: &sparrow_core::config::EmbeddingConfig,
        init: Initializer,
        subdir: Option<&str>,
        ttl_floor: u64,
        simd: Simd,
    ) -> Result<Self, TableError> {
        let optimizer = SparseOptimizer::from_config(config);
        let filters = FeatureFilters {
            admit_min_count: config.admit_min_count,
            admit_sketch_counters: config.admit_sketch_counters,
            ttl_steps: config.ttl_steps,
            ttl_floor,
        };
        let table = Self::typed(dim, config.dtype, optimizer, init, config.table_shards)
            .with_simd(simd)
            .with_rounding(config.rounding);
        let table = match (config.storage, &config.path) {
            (sparrow_core::config::Storage::Ssd, Some(path)) => {
                let mut dir = std::path::PathBuf::from(path);
                if let Some(sub) = subdir {
                    dir.push(sub);
                }
                let ssd =
                    SsdOptions { dir, cache_capacity_rows: config.cache_capacity_rows, policy: config.cache_policy };
                table.with_ssd_tier(&ssd)?
            }
            _ => table,
        };
        table.with_filters(filters)
    }

    /// Turns on the feature filters (admission by count, expiry by age).
    pub fn with_filters(mut self, filters: FeatureFilters) -> Result<Self, TableError> {
        let shards = self.shards.len();
        for shard in self.shards.iter() {
            let mut shard = shard.write();
            assert_eq!(shard.rows, 0, "filters are set on an empty table");
            if filters.admit_min_count > 1 {
                shard.admit = Some(AdmitSketch::new(filters.admit_min_count, filters.admit_sketch_counters / shards));
            }
            if filters.ttl_steps > 0 {
                let ttl = filters.ttl_steps.max(filters.ttl_floor);
                if let Some(t) = shard.backing.tier_mut() {
                    t.ttl = ttl;
                }
                shard.expiry = Some(Expiry { ttl, last_use: Vec::new(), vacant: Vec::new(), free: Vec::new() });
            }
        }
        self.sweep_every = filters.ttl_steps.div_ceil(8);
        Ok(self)
    }

    /// Keeps each row's last training lookup even without `ttl_steps` (a
    /// table in memory has no clock otherwise; the SSD tier always keeps
    /// one): incremental checkpoints write only the rows used since the
    /// previous one. Rows never age (an infinite `ttl`).
    pub fn track_last_use(self) -> Self {
        self.with_ages(false)
    }

    /// Keeps each row's last training lookup and lets rows be deleted by
    /// the trainer's policies (`ttl_secs`, `max_rows`:
    /// [`delete_used_before`](Self::delete_used_before)), on the SSD tier too.
    pub fn with_deletable_rows(self) -> Self {
        self.with_ages(true)
    }

    fn with_ages(self, with_tier: bool) -> Self {
        for shard in self.shards.iter() {
            let mut shard = shard.write();
            assert_eq!(shard.rows, 0, "the clock is set on an empty table");
            if shard.expiry.is_none() && (with_tier || shard.backing.tier().is_none()) {
                shard.expiry =
                    Some(Expiry { ttl: u64::MAX, last_use: Vec::new(), vacant: Vec::new(), free: Vec::new() });
            }
        }
        self
    }

    /// A clock reading below every use still to come: rows used (looked up
    /// for training) after this call have a last use above it, including
    /// the rows of lookups in flight now, whose updates are still to land.
    /// An incremental checkpoint taken later writes the rows above it.
    pub fn settled_clock(&self) -> u64 {
        let now = self.tick.load(Ordering::Relaxed);
        now.min(self.in_flight.oldest(&self.tick).saturating_sub(1))
    }

    /// `ttl_steps`: deletes every row past its age now, cached or stored
    /// (lookups already read them as absent), so that `len()` counts exactly
    /// the rows a walk visits. Training calls it at the end, checkpoints first.
    pub fn sweep_expired(&self) -> Result<(), TableError> {
        if self.sweep_every == 0 {
            return Ok(());
        }
        let (layout, tick) = (self.layout, self.tick.load(Ordering::Relaxed));
        let oldest = self.in_flight.oldest(&self.tick);
        self.shards.par_iter().try_for_each(|shard| shard.write().expire(layout, tick, oldest, true))
    }

    /// The lookup clock now: rows used by the lookups so far have a last use
    /// at or below it.
    pub fn clock(&self) -> u64 {
        self.tick.load(Ordering::Relaxed)
    }

    /// Deletes every row, cached or stored, that no training lookup used
    /// since `cutoff` (on the lookup clock), except rows in flight:
    /// `embedding.ttl_secs` and `max_rows`, whose policies in the trainer
    /// pick the cutoff. Needs the rows' last uses ([`track_last_use`](Self::track_last_use)
    /// or `ttl_steps`); returns the rows deleted.
    pub fn delete_used_before(&self, cutoff: u64, why: Deletion) -> Result<u64, TableError> {
        let before = self.len();
        let (layout, tick) = (self.layout, self.tick.load(Ordering::Relaxed));
        let used_since = cutoff.min(self.in_flight.oldest(&self.tick));
        self.shards.par_iter().try_for_each(|shard| shard.write().delete_before(layout, used_since, tick, why))?;
        Ok(before.saturating_sub(self.len()) as u64)
    }

    /// The lookup-clock cutoff that deletes the least recently used rows
    /// down to at most `keep` (rows tied with the last one to go go too),
    /// or `None` when the table holds no more than `keep`. Reads every
    /// row's last use (stored ones too): call it when over the bound, not
    /// every step.
    pub fn lru_cutoff(&self, keep: usize) -> Result<Option<u64>, TableError> {
        let (layout, tick) = (self.layout, self.tick.load(Ordering::Relaxed));
        let mut uses = Vec::with_capacity(self.len());
        for shard in self.shards.iter() {
            shard.write().last_uses(layout, tick, &mut uses)?;
        }
        if uses.len() <= keep {
            return Ok(None);
        }
        let going = uses.len() - keep;
        let (_, last_to_go, _) = uses.select_nth_unstable(going - 1);
        Ok(Some(last_to_go.saturating_add(1)))
    }

    /// The filters' state a checkpoint keeps beside the rows.
    pub fn filter_state(&self) -> FilterState {
        let sketches = self.shards.iter().filter_map(|shard| shard.read().admit.as_ref().map(|a| a.counters.clone()));
        FilterState { tick: self.tick.load(Ordering::Relaxed), sketches: sketches.collect() }
    }

    /// Restores a checkpoint's filter state into this table before its rows
    /// are put back: the clock moves on to `state.tick` (so restored last uses
    /// keep their age), and the admission counters are copied lock shard by
    /// lock shard when the layout is the same, or else folded into one sketch
    /// that every lock shard takes (it can only over-count). Counters are
    /// merged by maximum, so restoring several tables' states (a cluster's
    /// shards) leaves no key needing more sightings than on its own shard.
    /// Restored into another layout, the sketch keeps every key's sightings
    /// but not the old layout's collisions: a key may then be admitted a
    /// sighting later than in an uninterrupted run whose counters it shared.
    /// Without an admission filter here, the counters are dropped.
    pub fn restore_filter_state(&self, state: &FilterState) {
        self.tick.fetch_max(state.tick, Ordering::Relaxed);
        if state.sketches.is_empty() {
            return;
        }
        let same_layout = state.sketches.len() == self.shards.len();
        for (i, shard) in self.shards.iter().enumerate() {
            let mut shard = shard.write();
            let Some(admit) = &mut shard.admit else { continue };
            let len = admit.counters.len();
            let saved = match state.sketches.get(i) {
                Some(s) if same_layout && s.len() == len => s.clone(),
                _ => fold_sketches(state.sketches.iter(), len),
            };
            admit.counters.iter_mut().zip(&saved).for_each(|(a, &b)| *a = (*a).max(b));
        }
    }

    /// What the feature filters did, summed over lock shards.
    pub fn filter_stats(&self) -> FilterStats {
        let mut total = FilterStats::default();
        for shard in self.shards.iter() {
            total += shard.read().filter_stats;
        }
        total
    }

    /// Lookup outcomes of the SSD tier, summed over shards (`None` in memory).
    pub fn tier_stats(&self) -> Option<TierStats> {
        let mut total: Option<TierStats> = None;
        for shard in self.shards.iter() {
            if let Some(t) = shard.read().backing.tier() {
                *total.get_or_insert_with(TierStats::default) += t.stats;
            }
        }
        total
    }

    /// Rows held in memory (all of them without an SSD tier).
    pub fn cached_rows(&self) -> usize {
        self.shards.iter().map(|s| s.read().index.len()).sum()
    }

    pub fn dim(&self) -> usize {
        self.layout.dim
    }

    /// Floats per row as [`get_row`](Self::get_row) and
    /// [`put_row`](Self::put_row) see it: `dim` f32 weights, then optimizer state.
    pub fn row_len(&self) -> usize {
        self.layout.row_len
    }

    /// How rows are stored (`embedding.dtype`): what checkpoints and pull
    /// replies encode rows and vectors with.
    pub fn row_format(&self) -> RowFormat {
        self.layout.format
    }

    /// The vector a key without a row reads as: its initial vector, rounded
    /// as a new row's would be.
    pub fn initial_vector(&self, key: u64, out: &mut [f32]) {
        self.init.fill(key, out);
        self.layout.format.round(out);
    }

    /// How a new row's vector is drawn (the same for every copy of the table).
    pub fn initializer(&self) -> &Initializer {
        &self.init
    }

    pub fn optimizer(&self) -> &SparseOptimizer {
        &self.optimizer
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    #[inline]
    pub fn shard_of(&self, key: u64) -> usize {
        self.partitioner().shard_of(key)
    }

    /// The key → shard map, as a value another thread can hold.
    pub fn partitioner(&self) -> Partitioner {
        Partitioner { mask: self.shard_mask }
    }

    /// Dedup + partition a batch's keys for this table.
    pub fn plan(&self, keys: &[u64]) -> KeyPlan {
        self.partitioner().plan(keys)
    }

    /// Distinct keys held, in memory and on SSD.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.read();
                s.index.len() + s.backing.tier().map_or(0, |t| t.stored_only)
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits `out` (one `dim`-wide row per unique key) into per-shard slices.
    fn shard_slices<'a, T>(&self, plan: &KeyPlan, out: &'a mut [T], width: usize) -> Vec<(usize, &'a mut [T])> {
        let mut slices = Vec::with_capacity(self.shards.len());
        let mut rest = out;
        for s in 0..self.shards.len() {
            let n = (plan.shard_offsets[s + 1] - plan.shard_offsets[s]) * width;
            let (head, tail) = rest.split_at_mut(n);
            rest = tail;
            if n > 0 {
                slices.push((s, head));
            }
        }
        slices
    }

    /// Training lookup: copies the weights of every unique key of `plan` into
    /// `out` (`num_unique × dim`), inserting unseen keys.
    pub fn lookup_or_insert(&self, plan: &KeyPlan, out: &mut [f32]) -> Result<RowSlots, TableError> {
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(out.len(), plan.num_unique() * dim, "output size");
        let mut slots = vec![0u32; plan.num_unique()];
        let lease = self.in_flight.begin_lookup(&self.tick);
        let tick = lease.tick();
        let oldest_in_flight = self.in_flight.oldest(&self.tick);
        if self.sweep_every > 0 && tick.is_multiple_of(self.sweep_every) {
            self.shards.par_iter().try_for_each(|shard| shard.write().expire(layout, tick, oldest_in_flight, false))?;
        }
        let access = Access { init: &self.init, opt: &self.optimizer, tick, oldest_in_flight, prefetching: false };
        let out_parts = self.shard_slices(plan, out, dim);
        let slot_parts = self.shard_slices(plan, &mut slots, 1);
        // Half rows are widened after the walk, all in one call (a call per
        // row into the F16C code cost more than the conversion); f32 rows
        // are copied as they are found.
        let widen_after = layout.format.dtype != EmbeddingDtype::F32;
        out_parts.into_par_iter().zip(slot_parts).try_for_each(|((s, out), (_, slots))| {
            let keys = plan.shard_keys(s);
            let mut shard = self.shards[s].write();
            shard.resolve_all(layout, keys, &access, |shard, j, slot| {
                let dst = &mut out[j * dim..(j + 1) * dim];
                match slot {
                    Some(slot) => {
                        slots[j] = slot;
                        if !widen_after {
                            layout.format.decode_vector(shard.packed(layout, slot), dst);
                        }
                    }
                    None => {
                        slots[j] = NOT_ADMITTED;
                        self.initial_vector(keys[j], dst);
                    }
                }
            })?;
            if widen_after {
                let found = slots.iter().zip(out.chunks_exact_mut(dim)).filter(|(slot, _)| **slot != NOT_ADMITTED);
                layout.format.decode_vectors(found.map(|(&slot, dst)| (shard.packed(layout, slot), dst)));
            }
            Ok::<_, TableError>(())
        })?;
        Ok(RowSlots { table_id: self.id(), slots, _lease: Some(lease) })
    }

    /// S3.5: brings the rows of `plan`'s keys that are not cached into the
    /// cache (read from the store, or initialised on first sight) without
    /// copying them out, so the lookup that follows finds them in memory. Run
    /// beside the previous batch's dense step: it touches only rows that batch
    /// does not use (those are cached and protected), so the model is the
    /// same as without it. The staged rows stay cached while the returned
    /// [`Staged`] lives. A no-op without an SSD tier.
    pub fn prefetch(&self, plan: &KeyPlan) -> Result<Staged, TableError> {
        if self.shards[0].read().backing.tier().is_none() {
            return Ok(Staged::default());
        }
        let layout = self.layout;
        let lease = self.in_flight.begin_prefetch(&self.tick);
        let tick = lease.tick();
        let oldest_in_flight = self.in_flight.oldest(&self.tick);
        let access = Access { init: &self.init, opt: &self.optimizer, tick, oldest_in_flight, prefetching: true };
        (0..self.shards.len()).into_par_iter().try_for_each(|s| {
            let keys = plan.shard_keys(s);
            if keys.is_empty() {
                return Ok(());
            }
            // A key the filter will not admit stays out (the lookup says so).
            self.shards[s].write().resolve_all(layout, keys, &access, |_, _, _| {})
        })?;
        Ok(Staged { _lease: Some(lease) })
    }

    /// Whether rows live on SSD behind a cache (so [`prefetch`](Self::prefetch) pays).
    pub fn is_tiered(&self) -> bool {
        self.shards[0].read().backing.tier().is_some()
    }

    /// Identity of this table (its address), tying [`RowSlots`] to it.
    fn id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// Applies summed gradients (`num_unique × dim`, plan order) to the rows a
    /// preceding [`lookup_or_insert`](Self::lookup_or_insert) of the same plan
    /// found, without probing the index again. Each row's key is checked
    /// before its update (it shares the row's first cache line): a slot that
    /// no longer holds its key stops the update with
    /// [`TableError::SlotReused`] (rows before it in its lock shard were
    /// updated: the table is then not any step's state).
    pub fn apply_gradients_at(&self, plan: &KeyPlan, slots: &RowSlots, grads: &[f32]) -> Result<(), TableError> {
        self.apply_gradients_scaled(plan, slots, grads, 1.0)
    }

    /// [`apply_gradients_at`](Self::apply_gradients_at) at the optimizer's
    /// learning rate times `lr_scale` (a step of `[train.schedule]`).
    pub fn apply_gradients_scaled(
        &self,
        plan: &KeyPlan,
        slots: &RowSlots,
        grads: &[f32],
        lr_scale: f32,
    ) -> Result<(), TableError> {
        let optimizer = self.optimizer.scaled(lr_scale);
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(slots.table_id, self.id(), "slots come from another table");
        assert_eq!(slots.slots.len(), plan.num_unique(), "slots of another plan");
        assert_eq!(grads.len(), plan.num_unique() * dim, "gradient size");
        (0..self.shards.len()).into_par_iter().try_for_each(|s| {
            let (lo, hi) = (plan.shard_offsets[s], plan.shard_offsets[s + 1]);
            if lo == hi {
                return Ok(());
            }
            let mut shard = self.shards[s].write();
            let keys = plan.shard_keys(s);
            // Half rows decode into it; f32 rows update in place (no allocation).
            let mut scratch = if layout.format.dtype == EmbeddingDtype::F32 { Vec::new() } else { vec![0.0f32; dim] };
            for u in lo..hi {
                if let Some(&ahead) =
                    slots.slots.get(u + PREFETCH_DISTANCE).filter(|&&a| u + PREFETCH_DISTANCE < hi && a != NOT_ADMITTED)
                {
                    shard.prefetch_row(layout, ahead);
                }
                let slot = slots.slots[u];
                if slot == NOT_ADMITTED {
                    continue;
                }
                let (key, found) = (keys[u - lo], shard.key_at(layout, slot));
                if found != key {
                    return Err(TableError::SlotReused { shard: s, key, found });
                }
                let grad = &grads[u * dim..(u + 1) * dim];
                let stochastic = self.stochastic_seed.map(|seed| (seed, key));
                update_row(layout, &optimizer, shard.packed_mut(layout, slot), grad, &mut scratch, stochastic);
                shard.mark_dirty(slot);
            }
            Ok(())
        })
    }

    /// Read-only lookup (evaluation): an unseen key reads as its initial
    /// vector and is not inserted (nor moved into the cache).
    pub fn lookup(&self, plan: &KeyPlan, out: &mut [f32]) -> Result<(), TableError> {
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(out.len(), plan.num_unique() * dim, "output size");
        let tick = self.tick.load(Ordering::Relaxed);
        self.shard_slices(plan, out, dim).into_par_iter().try_for_each(|(s, out)| {
            let shard = self.shards[s].read();
            let mut full = vec![0.0f32; layout.row_len];
            for (i, &key) in plan.shard_keys(s).iter().enumerate() {
                let dst = &mut out[i * dim..(i + 1) * dim];
                match shard.find(layout, key) {
                    Some(slot) if !shard.aged_out(slot as usize, tick) => {
                        layout.format.decode_vector(shard.packed(layout, slot), dst)
                    }
                    Some(_) => self.initial_vector(key, dst),
                    None if shard.read_row(layout, key, &mut full, tick)? => dst.copy_from_slice(&full[..dim]),
                    None => self.initial_vector(key, dst),
                }
            }
            Ok(())
        })
    }

    /// Full row (weights and optimizer state) of `key`, if present.
    pub fn get_row(&self, key: u64) -> Option<Vec<f32>> {
        let shard = self.shards[self.shard_of(key)].read();
        let mut row = vec![0.0f32; self.layout.row_len];
        // A store read error reads as absent here; training paths report it.
        let tick = self.tick.load(Ordering::Relaxed);
        shard.read_row(self.layout, key, &mut row, tick).ok()?.then_some(row)
    }

    /// Inserts or overwrites a full row, as just used.
    pub fn put_row(&self, key: u64, row: &[f32]) -> Result<(), TableError> {
        self.put(key, row, None)
    }

    /// Inserts or overwrites a full row last used at lookup `last_use`
    /// (checkpoint restore, after [`restore_filter_state`](Self::restore_filter_state)
    /// set the clock): `ttl_steps` expires it when it would have.
    pub fn put_row_used(&self, key: u64, row: &[f32], last_use: u64) -> Result<(), TableError> {
        self.put(key, row, Some(last_use))
    }

    fn put(&self, key: u64, row: &[f32], last_use: Option<u64>) -> Result<(), TableError> {
        if row.len() != self.layout.row_len {
            return Err(TableError::RowWidth { key, expected: self.layout.row_len, found: row.len() });
        }
        let mut shard = self.shards[self.shard_of(key)].write();
        let slot = match shard.find(self.layout, key) {
            None => {
                let mut scratch = vec![0.0f32; self.layout.packed_len];
                let stored = match shard.backing.tier_mut() {
                    Some(t) => t.store.get(key, &mut scratch)?,
                    None => None,
                };
                let oldest_in_flight = self.in_flight.oldest(&self.tick);
                let slot = shard.free_slot(self.layout, key, oldest_in_flight)?;
                if let Some(t) = shard.backing.tier_mut() {
                    if stored.is_some() {
                        t.stored_only -= 1;
                    }
                    // Its record (if any) is overwritten at the write-back.
                    t.pos[slot as usize] = stored.map(|s| s.pos);
                    // A row of unknown use is evictable at once (never
                    // counted as in flight); a restored last use is kept, as
                    // its record's age when it is written back.
                    let last_use = last_use.unwrap_or(oldest_in_flight.saturating_sub(1));
                    t.meta[slot as usize] = SlotMeta { last_use, ..SlotMeta::FRESH };
                } else {
                    shard.set_last_use(slot as usize, last_use.unwrap_or(self.tick.load(Ordering::Relaxed)));
                }
                slot
            }
            Some(slot) => {
                if shard.expiry.is_some() {
                    shard.set_last_use(slot as usize, last_use.unwrap_or(self.tick.load(Ordering::Relaxed)));
                }
                slot
            }
        };
        self.layout.format.encode(row, shard.packed_mut(self.layout, slot));
        shard.mark_dirty(slot);
        Ok(())
    }

    /// Bytes held by the table: arenas plus hash index (capacity, not length).
    pub fn allocated_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.read();
                let arena: usize = s.chunks.iter().map(|c| c.len() * 4).sum();
                let index = s.index.allocated_bytes();
                arena + index
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::config::InitConfig;

    fn table(opt: SparseOptimizer) -> EmbeddingTable {
        EmbeddingTable::new(4, opt, Initializer::new(InitConfig::default(), 9), 4)
    }

    #[test]
    fn lookup_inserts_deterministically_and_readonly_does_not() {
        let t = table(SparseOptimizer::Sgd { lr: 0.1 });
        let plan = t.plan(&[5, 7, 5, 9]);
        let mut ro = vec![0.0; plan.num_unique() * 4];
        t.lookup(&plan, &mut ro).expect("lookup");
        assert!(t.is_empty());
        let mut out = vec![0.0; plan.num_unique() * 4];
        t.lookup_or_insert(&plan, &mut out).expect("lookup");
        assert_eq!(t.len(), 3);
        assert_eq!(ro, out, "read-only lookup of an unseen key equals its initial value");
        assert!(out.iter().all(|x| x.abs() <= 0.01) && out.iter().any(|&x| x != 0.0));
    }

    /// The update checks each row's key: slots that hold other keys (here a
    /// lookup's slots given with another batch's plan) are refused, naming
    /// the lock shard and both keys, instead of training the wrong rows.
    #[test]
    fn an_update_through_slots_that_hold_other_keys_is_refused() {
        let t = EmbeddingTable::new(4, SparseOptimizer::Sgd { lr: 0.1 }, Initializer::new(InitConfig::default(), 9), 1);
        let (a, b) = (t.plan(&[11, 12]), t.plan(&[21, 22]));
        let mut rows = vec![0.0; 8];
        let slots_a = t.lookup_or_insert(&a, &mut rows).expect("lookup a");
        let _slots_b = t.lookup_or_insert(&b, &mut rows).expect("lookup b");
        let before = t.get_row(11);
        let err = t.apply_gradients_at(&b, &slots_a, &[1.0; 8]).expect_err("stale slots");
        assert!(matches!(err, TableError::SlotReused { shard: 0, key: 21 | 22, found: 11 | 12 }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("lock shard 0") && msg.contains("refused"), "{msg}");
        assert_eq!(t.get_row(11), before, "the other key's row is untouched");
        t.apply_gradients_at(&a, &slots_a, &[1.0; 8]).expect("its own plan");
        assert_ne!(t.get_row(11), before);
    }

    #[test]
    fn put_row_rejects_wrong_width() {
        let t = table(SparseOptimizer::Adagrad { lr: 0.1, eps: 1e-8 });
        assert!(t.put_row(1, &[0.0; 8]).is_ok());
        assert!(matches!(t.put_row(1, &[0.0; 3]), Err(TableError::RowWidth { .. })));
    }
}
