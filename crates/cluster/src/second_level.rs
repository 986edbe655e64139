//! S1's second level on a shard (`cluster.mode = "collocated"`).
//!
//! The shard's table is the first level (memory, or the SSD tier behind its
//! cache). Before a pass the loader stages it (S1.1): the shard copies the
//! rows of the pass's IDs it owns from level 1 into this second level, a map
//! of whole rows (vector and optimizer state) in the shard's process; an ID
//! level 1 does not have is initialised here, once, as level 1 would have
//! (the same per-key initialiser and optimizer state). During the pass every
//! pull and push of a training batch reads and updates rows here only (S1.2,
//! S1.4): a key outside the staged set is an error, never a level-1 read.
//! When the last batch of a pass is pushed, the rows no later staged pass
//! holds are written back into level 1 and freed (S1.4); rows the next pass
//! also needs stay (staging pass p+1 while pass p trains shares them, so both
//! passes see one copy). Checkpoints and evaluation first write every row
//! here back into level 1 (kept here).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};
use sparrow_embedding::{EmbeddingTable, Initializer, RowFormat, SparseOptimizer};

pub use crate::messages::SecondLevelStats;
use crate::transport::ClusterError;

#[derive(Default)]
struct Pass {
    /// The pass's unique keys on this shard.
    keys: HashSet<u64>,
    /// Its batches (with keys on this shard) not yet pushed.
    outstanding: usize,
}

#[derive(Default)]
struct State {
    rows: HashMap<u64, Box<[f32]>>,
    /// Staged passes not yet flushed that hold each key.
    holders: HashMap<u64, u32>,
    passes: BTreeMap<u64, Pass>,
    /// Training batch id → its pass.
    batch_pass: HashMap<u64, u64>,
    stats: SecondLevelStats,
    /// Stages waiting for room (exposed for tests to order by).
    waiting: usize,
    /// A flush or a write-through is writing level 1 (one at a time, so a
    /// row's writes reach level 1 in the order they were made). No lock
    /// is held while it writes.
    l1_writer: bool,
    /// Rows a flush took out of the map and is writing into level 1: a
    /// stage copies a row from here rather than read level 1 before the
    /// write lands.
    writing_back: HashMap<u64, std::sync::Arc<[f32]>>,
}

/// Rows written into level 1 a chunk at a time (a write-through copies no
/// more than this out of the map at once).
const WRITE_THROUGH_CHUNK: usize = 4096;

pub struct SecondLevel {
    shard: usize,
    dim: usize,
    row_len: usize,
    /// Level 1's `embedding.dtype`: rows here are f32, their vectors rounded
    /// after every update as level 1 would store them, so a pass trains
    /// exactly as level 1 would.
    format: RowFormat,
    optimizer: SparseOptimizer,
    init: Initializer,
    /// Level 1's stochastic rounding (its seed): rounded here the same way,
    /// the row's last word counting its updates.
    stochastic_seed: Option<u64>,
    /// `cluster.l2_capacity_rows` (0: no limit).
    capacity: u64,
    state: Mutex<State>,
    /// A pass was flushed (a stage waiting for room goes on), or a
    /// level-1 write ended (the next writer goes on).
    flushed: parking_lot::Condvar,
    /// The shard's generation is over: a stage waiting for room gives up.
    closed: std::sync::atomic::AtomicBool,
}

impl SecondLevel {
    /// The second level of shard `shard` over level 1 `l1` (same row shape,
    /// optimizer and initialiser).
    pub fn over(shard: usize, l1: &EmbeddingTable, capacity: u64) -> Self {
        SecondLevel {
            shard,
            dim: l1.dim(),
            row_len: l1.row_len(),
            format: l1.row_format(),
            optimizer: *l1.optimizer(),
            init: *l1.initializer(),
            stochastic_seed: l1.stochastic_seed(),
            capacity,
            state: Mutex::new(State::default()),
            flushed: parking_lot::Condvar::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn error(&self, message: String) -> ClusterError {
        ClusterError::Setup(format!("shard {}: {message}", self.shard))
    }

    /// Waits until at most one pass is held, so that a new one may be
    /// staged beside it (the loader stages pass p+1 while pass p trains).
    /// Gives up once [`close`](Self::close)d: an abandoned generation's pass
    /// never ends, and its loader must not wait for it.
    pub fn wait_for_room(&self, pass: u64) -> Result<(), ClusterError> {
        let mut state = self.state.lock();
        let mut counted = false;
        let room = loop {
            if state.passes.contains_key(&pass) || state.passes.len() < 2 {
                break Ok(());
            }
            if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
                break Err(ClusterError::Rpc {
                    peer: format!("shard {}", self.shard),
                    method: "stage",
                    message: "this shard's generation is over (a role died)".into(),
                });
            }
            if !counted {
                state.waiting += 1;
                counted = true;
                self.flushed.notify_all();
            }
            self.flushed.wait_for(&mut state, std::time::Duration::from_millis(100));
        };
        if counted {
            state.waiting -= 1;
        }
        room
    }

    /// Blocks until `n` stages wait for room (tests order by it, not by time).
    pub fn wait_for_waiting_stages(&self, n: usize) {
        let mut state = self.state.lock();
        while state.waiting < n {
            self.flushed.wait(&mut state);
        }
    }

    /// The shard's generation is over: stages waiting for room give up.
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.flushed.notify_all();
    }

    /// S1.1: stages `keys` (this shard's IDs of pass `pass`, or of one of
    /// its batches) for the training batches `batches`. Call it for every
    /// list of the pass before the pass's batches are pulled.
    pub fn stage(&self, l1: &EmbeddingTable, pass: u64, keys: &[u64], batches: &[u64]) -> Result<(), ClusterError> {
        let start = Instant::now();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if !state.passes.contains_key(&pass) {
            state.stats.passes_staged += 1;
        }
        let entry = state.passes.entry(pass).or_default();
        for &b in batches {
            if state.batch_pass.insert(b, pass).is_none() {
                entry.outstanding += 1;
            }
        }
        let mut fetch = Vec::new();
        let mut rows: Vec<(u64, Box<[f32]>)> = Vec::new();
        for &key in keys {
            // A key listed twice for the pass (one list per batch) is held once.
            if !entry.keys.insert(key) {
                continue;
            }
            let held = state.holders.entry(key).or_insert(0);
            *held += 1;
            if *held == 1 && !state.rows.contains_key(&key) {
                // A row a flush is still writing into level 1: its newest copy is here.
                match state.writing_back.get(&key) {
                    Some(row) => rows.push((key, row.to_vec().into_boxed_slice())),
                    None => fetch.push(key),
                }
            }
        }
        let mut from_l1 = rows.len() as u64;
        // Level 1 is read without the state lock, so the pass training beside
        // this one is not held up. No write of these keys is under way: a
        // writer writes only rows of the map or `writing_back`.
        drop(guard);
        let mut initialised = 0;
        rows.extend(fetch.into_iter().map(|key| match l1.get_row(key) {
            Some(row) => {
                from_l1 += 1;
                (key, row.into_boxed_slice())
            }
            None => {
                let mut row = vec![0.0f32; self.row_len].into_boxed_slice();
                let (w, opt_state) = row.split_at_mut(self.dim);
                self.init.fill(key, w);
                self.format.round(w);
                self.optimizer.init_state(w, opt_state);
                initialised += 1;
                (key, row)
            }
        }));
        let mut state = self.state.lock();
        state.rows.extend(rows);
        state.stats.rows_from_l1 += from_l1;
        state.stats.rows_initialised += initialised;
        let held = state.rows.len() as u64;
        state.stats.peak_rows = state.stats.peak_rows.max(held);
        state.stats.staging_secs += start.elapsed().as_secs_f64();
        if self.capacity > 0 && held > self.capacity {
            return Err(self.error(format!(
                "the second level holds {held} rows, over cluster.l2_capacity_rows = {} (the loader ends a pass at \
                 half of it: lower cluster.pass_batches or train.batch_size, or raise the capacity)",
                self.capacity
            )));
        }
        Ok(())
    }

    /// Copies the vectors of `keys` (a training batch's unique keys) into
    /// `out`; a key not staged is an error.
    pub fn lookup(&self, keys: &[u64], out: &mut [f32]) -> Result<(), ClusterError> {
        let state = self.state.lock();
        for (key, dst) in keys.iter().zip(out.chunks_exact_mut(self.dim)) {
            let row = state.rows.get(key).ok_or_else(|| self.not_staged(*key))?;
            dst.copy_from_slice(&row[..self.dim]);
        }
        Ok(())
    }

    fn not_staged(&self, key: u64) -> ClusterError {
        self.error(format!(
            "key {key} is not in the staged pass's set: a second-level lookup outside the pass (never read from level 1)"
        ))
    }

    /// Applies `grads` (summed per unique key of the batch) to the rows of
    /// `keys`, then counts the batch pushed: the last batch of a pass frees
    /// its rows no later pass holds, writing them back into level 1.
    pub fn apply(&self, l1: &EmbeddingTable, batch_id: u64, keys: &[u64], grads: &[f32]) -> Result<(), ClusterError> {
        self.apply_or_release(l1, batch_id, keys, Some((grads, 1.0)))
    }

    /// [`apply`](Self::apply) at the rows' learning rate times the factor
    /// beside the gradients (a step of `[train.schedule]`).
    pub fn apply_scaled(
        &self,
        l1: &EmbeddingTable,
        batch_id: u64,
        keys: &[u64],
        grads: (&[f32], f32),
    ) -> Result<(), ClusterError> {
        self.apply_or_release(l1, batch_id, keys, Some(grads))
    }

    /// [`apply`](Self::apply), or (`None`) the batch counted pushed with no
    /// row updated: its worker skipped it.
    pub fn apply_or_release(
        &self,
        l1: &EmbeddingTable,
        batch_id: u64,
        keys: &[u64],
        grads: Option<(&[f32], f32)>,
    ) -> Result<(), ClusterError> {
        let (grads, lr_scale) = grads.map_or((None, 1.0), |(g, s)| (Some(g), s));
        let optimizer = self.optimizer.scaled(lr_scale);
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if let Some(key) = keys.iter().find(|k| !state.rows.contains_key(k)) {
            return Err(self.not_staged(*key));
        }
        for (key, g) in keys.iter().zip(grads.unwrap_or_default().chunks_exact(self.dim)) {
            if let Some(row) = state.rows.get_mut(key) {
                let (w, opt_state) = row.split_at_mut(self.dim);
                let stochastic = self.stochastic_seed.map(|seed| (seed, *key));
                self.format.step_and_round(&optimizer, w, opt_state, g, stochastic);
            }
        }
        let Some(pass) = state.batch_pass.remove(&batch_id) else { return Ok(()) };
        let done = match state.passes.get_mut(&pass) {
            Some(p) => {
                p.outstanding = p.outstanding.saturating_sub(1);
                p.outstanding == 0
            }
            None => false,
        };
        if done {
            self.flush_pass(l1, guard, pass)?;
        }
        Ok(())
    }

    /// S1.4's write-back of a finished pass. Its rows leave the map under the
    /// state lock; level 1 is written without it, the rows kept in `writing_back` until written.
    fn flush_pass(&self, l1: &EmbeddingTable, mut guard: MutexGuard<State>, pass: u64) -> Result<(), ClusterError> {
        let start = Instant::now();
        // One level-1 writer at a time: a write-through may be under way.
        while guard.l1_writer {
            self.flushed.wait(&mut guard);
        }
        let state = &mut *guard;
        let Some(p) = state.passes.remove(&pass) else { return Ok(()) };
        let mut out = Vec::new();
        for key in p.keys {
            let Some(held) = state.holders.get_mut(&key) else { continue };
            *held -= 1;
            if *held > 0 {
                continue;
            }
            state.holders.remove(&key);
            if let Some(row) = state.rows.remove(&key) {
                let row: std::sync::Arc<[f32]> = row.into();
                state.writing_back.insert(key, row.clone());
                out.push((key, row));
            }
        }
        state.l1_writer = true;
        drop(guard);
        self.flushed.notify_all();
        let written = out.iter().try_for_each(|(key, row)| l1.put_row(*key, row));
        let mut state = self.state.lock();
        for (key, _) in &out {
            state.writing_back.remove(key);
        }
        state.l1_writer = false;
        state.stats.rows_flushed += out.len() as u64;
        state.stats.passes_flushed += 1;
        state.stats.flush_secs += start.elapsed().as_secs_f64();
        drop(state);
        self.flushed.notify_all();
        written.map_err(|source| ClusterError::Table { shard: self.shard, source })
    }

    /// Writes every row held here into level 1, keeping it here (before a
    /// checkpoint part or an evaluation reads level 1). The rows are copied
    /// out a chunk at a time and written without the lock; being the one
    /// level-1 writer, no flush overtakes it.
    pub fn write_through(&self, l1: &EmbeddingTable) -> Result<(), ClusterError> {
        let mut state = self.state.lock();
        while state.l1_writer {
            self.flushed.wait(&mut state);
        }
        state.l1_writer = true;
        let keys: Vec<u64> = state.rows.keys().copied().collect();
        drop(state);
        let mut written = Ok(());
        for chunk in keys.chunks(WRITE_THROUGH_CHUNK) {
            let rows: Vec<(u64, Box<[f32]>)> = {
                let state = self.state.lock();
                chunk.iter().filter_map(|k| state.rows.get(k).map(|row| (*k, row.clone()))).collect()
            };
            written = rows.iter().try_for_each(|(key, row)| l1.put_row(*key, row));
            if written.is_err() {
                break;
            }
        }
        self.state.lock().l1_writer = false;
        self.flushed.notify_all();
        written.map_err(|source| ClusterError::Table { shard: self.shard, source })
    }

    /// A pass is staged and not yet flushed.
    pub fn in_pass(&self) -> bool {
        !self.state.lock().passes.is_empty()
    }

    /// Counts a level-1 read made while a pass was staged (outside staging).
    pub fn note_l1_read(&self) {
        let mut state = self.state.lock();
        if !state.passes.is_empty() {
            state.stats.l1_reads_during_pass += 1;
        }
    }

    pub fn stats(&self) -> SecondLevelStats {
        self.state.lock().stats
    }

    pub fn rows(&self) -> usize {
        self.state.lock().rows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::config::{InitConfig, InitKind};
    use std::sync::Arc;

    fn level1() -> EmbeddingTable {
        let init = Initializer::new(InitConfig { kind: InitKind::Uniform, scale: 0.1 }, 7);
        EmbeddingTable::new(2, SparseOptimizer::Adagrad { lr: 0.5, eps: 1e-8 }, init, 2)
    }

    #[test]
    fn a_pass_reads_and_updates_its_staged_rows_only_and_writes_them_back_at_its_end() {
        let l1 = level1();
        l1.put_row(1, &[1.0, 2.0, 0.0, 0.0]).expect("row 1");
        let l2 = SecondLevel::over(0, &l1, 0);
        l2.stage(&l1, 0, &[1, 2], &[10, 11]).expect("stage");
        let mut out = vec![0.0; 4];
        l2.lookup(&[1, 2], &mut out).expect("staged");
        assert_eq!(&out[..2], &[1.0, 2.0], "row 1 from level 1");
        let mut fresh = vec![0.0; 2];
        l1.initializer().fill(2, &mut fresh);
        assert_eq!(&out[2..], &fresh[..], "key 2 initialised as level 1 would");
        // Outside the pass: an error, and level 1 is not read.
        let err = l2.lookup(&[3], &mut [0.0; 2]).expect_err("not staged");
        assert!(err.to_string().contains("key 3 is not in the staged pass"), "{err}");
        assert!(l2.apply(&l1, 10, &[3], &[1.0, 1.0]).is_err());
        // Updates stay in the second level until the pass's last batch.
        l2.apply(&l1, 10, &[1], &[1.0, 1.0]).expect("push");
        assert_eq!(l1.get_row(1).expect("row")[..2], [1.0, 2.0], "level 1 untouched during the pass");
        assert_eq!(l1.get_row(2), None);
        l2.apply(&l1, 11, &[2], &[0.0, 0.0]).expect("last push");
        let row = l1.get_row(1).expect("flushed");
        assert!((row[0] - 0.5).abs() < 1e-6 && (row[2] - 1.0).abs() < 1e-6, "Adagrad step and state: {row:?}");
        assert!(l1.get_row(2).is_some(), "the new row is in level 1 now");
        assert_eq!(l2.rows(), 0, "freed");
        let stats = l2.stats();
        assert_eq!((stats.rows_from_l1, stats.rows_initialised, stats.rows_flushed), (1, 1, 2));
    }

    #[test]
    fn a_row_of_the_next_pass_stays_and_a_third_pass_waits_for_room() {
        let l1 = level1();
        let l2 = Arc::new(SecondLevel::over(0, &l1, 0));
        l2.stage(&l1, 0, &[1], &[10]).expect("pass 0");
        l2.stage(&l1, 1, &[1, 2], &[11]).expect("pass 1 beside it");
        l2.apply(&l1, 10, &[1], &[1.0, 0.0]).expect("pass 0 ends");
        assert_eq!(l2.rows(), 2, "key 1 is still pass 1's");
        let mut out = vec![0.0; 2];
        l2.lookup(&[1], &mut out).expect("still staged");
        // A third pass waits until pass 1 is flushed.
        l2.stage(&l1, 2, &[3], &[12]).expect("pass 2");
        let waiter = {
            let l2 = l2.clone();
            std::thread::spawn(move || l2.wait_for_room(3))
        };
        l2.wait_for_waiting_stages(1);
        assert!(!waiter.is_finished(), "two passes are held");
        l2.apply(&l1, 11, &[1, 2], &[0.0; 4]).expect("pass 1 ends");
        waiter.join().expect("thread").expect("room");
        // A closed level (its generation is over) lets a waiting stage go with an error.
        l2.stage(&l1, 3, &[4], &[13]).expect("pass 3");
        let waiter = {
            let l2 = l2.clone();
            std::thread::spawn(move || l2.wait_for_room(4))
        };
        l2.wait_for_waiting_stages(1);
        l2.close();
        let err = waiter.join().expect("thread").expect_err("closed");
        assert!(err.may_be_a_death() && err.to_string().contains("generation is over"), "{err}");
    }
}
