//! The in-memory embedding table: `shards` independently locked hash maps from
//! key to slot, and per-shard chunked arenas of rows `[weights | optimizer state]`.
//!
//! Invariant: a row never moves once allocated (chunks are never reallocated),
//! and rows are only added, so a slot stays valid for the table's lifetime.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashMap;
use parking_lot::RwLock;
use rayon::prelude::*;
use sparrow_core::config::{InitConfig, InitKind};
use sparrow_core::key::mix64;
use sparrow_core::rng::Rng;

use crate::optimizer::SparseOptimizer;
use crate::plan::KeyPlan;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    #[error("embedding row for key {key:#018x} has {found} floats, the table expects {expected}")]
    RowWidth { key: u64, expected: usize, found: usize },
    #[error("the table holds more than {max} rows in one shard")]
    ShardFull { max: u64 },
}

/// Keys are already hashes; the mixer only decorrelates bucket bits from the
/// shard bits (both come from the same mixed value, at different positions).
#[derive(Clone, Copy, Default)]
struct MixHasherBuilder;

#[derive(Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = mix64(key);
    }
}

impl BuildHasher for MixHasherBuilder {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

/// Deterministic per-key initialisation: the same key gets the same initial
/// vector whatever the insertion order or thread, so runs are reproducible.
#[derive(Clone, Copy, Debug)]
pub struct Initializer {
    pub kind: InitKind,
    pub scale: f32,
    pub seed: u64,
}

impl Initializer {
    pub fn new(config: InitConfig, seed: u64) -> Self {
        Initializer { kind: config.kind, scale: config.scale, seed }
    }

    pub fn fill(&self, key: u64, w: &mut [f32]) {
        let mut rng = Rng::new(self.seed ^ mix64(key));
        match self.kind {
            InitKind::Zeros => w.fill(0.0),
            InitKind::Uniform => {
                for x in w {
                    *x = ((rng.next_f64() * 2.0 - 1.0) as f32) * self.scale;
                }
            }
            InitKind::Normal => {
                for x in w {
                    *x = rng.normal() as f32 * self.scale;
                }
            }
        }
    }
}

struct TableShard {
    index: HashMap<u64, u32, MixHasherBuilder>,
    chunks: Vec<Box<[f32]>>,
    rows: usize,
}

/// Which rows of a shard's arena live in which chunk.
#[derive(Clone, Copy)]
struct Layout {
    row_len: usize,
    dim: usize,
    chunk_rows: usize,
}

impl TableShard {
    #[inline]
    fn row_mut(&mut self, layout: Layout, slot: u32) -> &mut [f32] {
        let slot = slot as usize;
        let chunk = &mut self.chunks[slot / layout.chunk_rows];
        let start = (slot % layout.chunk_rows) * layout.row_len;
        &mut chunk[start..start + layout.row_len]
    }

    #[inline]
    fn row(&self, layout: Layout, slot: u32) -> &[f32] {
        let slot = slot as usize;
        let chunk = &self.chunks[slot / layout.chunk_rows];
        let start = (slot % layout.chunk_rows) * layout.row_len;
        &chunk[start..start + layout.row_len]
    }

    fn allocate(&mut self, layout: Layout) -> Result<u32, TableError> {
        let slot = self.rows;
        if slot >= u32::MAX as usize {
            return Err(TableError::ShardFull { max: u64::from(u32::MAX) });
        }
        if slot / layout.chunk_rows == self.chunks.len() {
            self.chunks.push(vec![0.0f32; layout.chunk_rows * layout.row_len].into_boxed_slice());
        }
        self.rows += 1;
        Ok(slot as u32)
    }

    /// Slot of `key`, inserting an initialised row on first sight (S3.9).
    #[inline]
    fn slot_or_insert(
        &mut self,
        layout: Layout,
        key: u64,
        init: &Initializer,
        opt: &SparseOptimizer,
    ) -> Result<u32, TableError> {
        if let Some(&slot) = self.index.get(&key) {
            return Ok(slot);
        }
        let slot = self.allocate(layout)?;
        self.index.insert(key, slot);
        let row = self.row_mut(layout, slot);
        let (w, state) = row.split_at_mut(layout.dim);
        init.fill(key, w);
        opt.init_state(w, state);
        Ok(slot)
    }
}

pub struct EmbeddingTable {
    layout: Layout,
    optimizer: SparseOptimizer,
    init: Initializer,
    shards: Box<[RwLock<TableShard>]>,
    shard_mask: u64,
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

/// Bytes of one arena chunk; small enough that a shard's tail waste stays low
/// (≤ shards × 64 KiB for the whole table).
const CHUNK_BYTES: usize = 64 * 1024;

/// The slots of a lookup's unique keys, so the update that follows does not
/// probe the hash index again. Valid for the table that produced it: rows never
/// move or disappear (see the module invariant).
#[derive(Debug, Default)]
pub struct RowSlots {
    table_id: usize,
    slots: Vec<u32>,
}

impl EmbeddingTable {
    /// `shards` must be a power of two.
    pub fn new(dim: usize, optimizer: SparseOptimizer, init: Initializer, shards: usize) -> Self {
        assert!(shards.is_power_of_two(), "table shards must be a power of two");
        let row_len = dim + optimizer.state_len(dim);
        let chunk_rows = (CHUNK_BYTES / (row_len * 4)).max(1);
        let shard_mask = shards as u64 - 1;
        let shards = (0..shards)
            .map(|_| {
                RwLock::new(TableShard { index: HashMap::with_hasher(MixHasherBuilder), chunks: Vec::new(), rows: 0 })
            })
            .collect();
        EmbeddingTable { layout: Layout { row_len, dim, chunk_rows }, optimizer, init, shards, shard_mask }
    }

    pub fn dim(&self) -> usize {
        self.layout.dim
    }

    /// Floats per stored row: weights then optimizer state.
    pub fn row_len(&self) -> usize {
        self.layout.row_len
    }

    pub fn optimizer(&self) -> &SparseOptimizer {
        &self.optimizer
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    #[inline]
    pub fn shard_of(&self, key: u64) -> usize {
        ((mix64(key) >> 32) & self.shard_mask) as usize
    }

    /// Dedup + partition a batch's keys for this table.
    pub fn plan(&self, keys: &[u64]) -> KeyPlan {
        KeyPlan::new(keys, self.shards.len(), |k| self.shard_of(k))
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().index.len()).sum()
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
        let out_parts = self.shard_slices(plan, out, dim);
        let slot_parts = self.shard_slices(plan, &mut slots, 1);
        out_parts.into_par_iter().zip(slot_parts).try_for_each(|((s, out), (_, slots))| {
            let mut shard = self.shards[s].write();
            for (i, &key) in plan.shard_keys(s).iter().enumerate() {
                let slot = shard.slot_or_insert(layout, key, &self.init, &self.optimizer)?;
                slots[i] = slot;
                out[i * dim..(i + 1) * dim].copy_from_slice(&shard.row(layout, slot)[..dim]);
            }
            Ok(())
        })?;
        Ok(RowSlots { table_id: self.id(), slots })
    }

    /// Identity of this table (its address), tying [`RowSlots`] to it.
    fn id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// Applies summed gradients (`num_unique × dim`, plan order) to the rows a
    /// preceding [`lookup_or_insert`](Self::lookup_or_insert) of the same plan
    /// found, without probing the index again.
    pub fn apply_gradients_at(&self, plan: &KeyPlan, slots: &RowSlots, grads: &[f32]) {
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(slots.table_id, self.id(), "slots come from another table");
        assert_eq!(slots.slots.len(), plan.num_unique(), "slots of another plan");
        assert_eq!(grads.len(), plan.num_unique() * dim, "gradient size");
        (0..self.shards.len()).into_par_iter().for_each(|s| {
            let (lo, hi) = (plan.shard_offsets[s], plan.shard_offsets[s + 1]);
            if lo == hi {
                return;
            }
            let mut shard = self.shards[s].write();
            for u in lo..hi {
                let (w, state) = shard.row_mut(layout, slots.slots[u]).split_at_mut(dim);
                self.optimizer.apply(w, state, &grads[u * dim..(u + 1) * dim]);
            }
        });
    }

    /// Read-only lookup (evaluation): an unseen key reads as its initial
    /// vector and is not inserted.
    pub fn lookup(&self, plan: &KeyPlan, out: &mut [f32]) {
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(out.len(), plan.num_unique() * dim, "output size");
        self.shard_slices(plan, out, dim).into_par_iter().for_each(|(s, out)| {
            let shard = self.shards[s].read();
            for (i, &key) in plan.shard_keys(s).iter().enumerate() {
                let dst = &mut out[i * dim..(i + 1) * dim];
                match shard.index.get(&key) {
                    Some(&slot) => dst.copy_from_slice(&shard.row(layout, slot)[..dim]),
                    None => self.init.fill(key, dst),
                }
            }
        });
    }

    /// Applies summed gradients (`num_unique × dim`, in plan order) once per
    /// unique key (S3.7). A key not in the table is inserted first.
    pub fn apply_gradients(&self, plan: &KeyPlan, grads: &[f32]) -> Result<(), TableError> {
        let layout = self.layout;
        let dim = layout.dim;
        assert_eq!(grads.len(), plan.num_unique() * dim, "gradient size");
        (0..self.shards.len()).into_par_iter().try_for_each(|s| {
            let keys = plan.shard_keys(s);
            if keys.is_empty() {
                return Ok(());
            }
            let base = plan.shard_offsets[s];
            let mut shard = self.shards[s].write();
            for (i, &key) in keys.iter().enumerate() {
                let slot = shard.slot_or_insert(layout, key, &self.init, &self.optimizer)?;
                let g = &grads[(base + i) * dim..(base + i + 1) * dim];
                let (w, state) = shard.row_mut(layout, slot).split_at_mut(dim);
                self.optimizer.apply(w, state, g);
            }
            Ok(())
        })
    }

    /// Full row (weights and optimizer state) of `key`, if present.
    pub fn get_row(&self, key: u64) -> Option<Vec<f32>> {
        let shard = self.shards[self.shard_of(key)].read();
        shard.index.get(&key).map(|&slot| shard.row(self.layout, slot).to_vec())
    }

    /// Inserts or overwrites a full row (checkpoint restore).
    pub fn put_row(&self, key: u64, row: &[f32]) -> Result<(), TableError> {
        if row.len() != self.layout.row_len {
            return Err(TableError::RowWidth { key, expected: self.layout.row_len, found: row.len() });
        }
        let mut shard = self.shards[self.shard_of(key)].write();
        let slot = match shard.index.get(&key) {
            Some(&slot) => slot,
            None => {
                let slot = shard.allocate(self.layout)?;
                shard.index.insert(key, slot);
                slot
            }
        };
        shard.row_mut(self.layout, slot).copy_from_slice(row);
        Ok(())
    }

    /// Visits every row, shard by shard, in a deterministic order (sorted by key
    /// within a shard) so that checkpoints of equal tables are byte-identical.
    pub fn for_each_row(&self, mut f: impl FnMut(u64, &[f32]) -> std::io::Result<()>) -> std::io::Result<()> {
        for shard in self.shards.iter() {
            let shard = shard.read();
            let mut entries: Vec<(u64, u32)> = shard.index.iter().map(|(&k, &s)| (k, s)).collect();
            entries.sort_unstable_by_key(|e| e.0);
            for (key, slot) in entries {
                f(key, shard.row(self.layout, slot))?;
            }
        }
        Ok(())
    }

    /// Bytes held by the table: arenas plus hash index (capacity, not length).
    pub fn allocated_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.read();
                let arena: usize = s.chunks.iter().map(|c| c.len() * 4).sum();
                // hashbrown: one (key, slot) pair plus one control byte per bucket.
                let index = s.index.capacity() * (std::mem::size_of::<(u64, u32)>() + 1) * 8 / 7;
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
        t.lookup(&plan, &mut ro);
        assert!(t.is_empty());
        let mut out = vec![0.0; plan.num_unique() * 4];
        t.lookup_or_insert(&plan, &mut out).expect("lookup");
        assert_eq!(t.len(), 3);
        assert_eq!(ro, out, "read-only lookup of an unseen key equals its initial value");
        assert!(out.iter().all(|x| x.abs() <= 0.01) && out.iter().any(|&x| x != 0.0));
    }

    #[test]
    fn put_row_rejects_wrong_width() {
        let t = table(SparseOptimizer::Adagrad { lr: 0.1, eps: 1e-8 });
        assert!(t.put_row(1, &[0.0; 8]).is_ok());
        assert!(matches!(t.put_row(1, &[0.0; 3]), Err(TableError::RowWidth { .. })));
    }
}
