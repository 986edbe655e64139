//! A shard's kind: where its training batches read and update rows. Level 1
//! directly ([`LevelOne`]: S0, with S3.5's staging of a queued batch's rows
//! when the table has an SSD tier), or a second level staged pass by pass
//! (`second_level::SecondLevel`, S1, `cluster.mode = "collocated"`). The
//! shard's queue, dedup, generation checks and checkpoint cut are the same
//! for both; what differs lives in the kind.

use sparrow_embedding::{EmbeddingTable, KeyPlan, RowSlots, Staged};

use crate::second_level::SecondLevel;
use crate::transport::ClusterError;

/// Where a shard's training rows live (see the module's doc).
pub trait TrainingRows: Send + Sync {
    /// A training batch of `keys` was queued: work done while it waits (the
    /// second dedup and the rows staged into the cache), kept for its pull.
    fn queued(&self, table: &EmbeddingTable, keys: &[u64]) -> Result<(Option<KeyPlan>, Staged), ClusterError> {
        let _ = (table, keys);
        Ok((None, Staged::default()))
    }

    /// A training pull: `plan`'s unique rows into `out` (unseen keys
    /// inserted); what its push needs beside the plan.
    fn pull(&self, table: &EmbeddingTable, plan: &KeyPlan, out: &mut [f32]) -> Result<Option<RowSlots>, ClusterError>;

    /// A pulled batch's gradients, summed per unique key of `plan`, and the
    /// factor on the rows' learning rate.
    fn push(
        &self,
        table: &EmbeddingTable,
        batch_id: u64,
        plan: &KeyPlan,
        slots: Option<RowSlots>,
        summed: (&[f32], f32),
    ) -> Result<(), ClusterError>;

    /// A pulled batch whose worker skipped it: no row is updated; what the
    /// pull set up for its push is let go.
    fn release(
        &self,
        table: &EmbeddingTable,
        batch_id: u64,
        plan: &KeyPlan,
        slots: Option<RowSlots>,
    ) -> Result<(), ClusterError> {
        let _ = (table, batch_id, plan, slots);
        Ok(())
    }

    /// Level 1 is about to be read as trained (an evaluation, an export, a
    /// checkpoint part, a report): rows trained elsewhere are written into
    /// it first. `counted`: a read that S1 counts when a pass is staged.
    fn before_level_one_read(&self, table: &EmbeddingTable, counted: bool) -> Result<(), ClusterError> {
        let _ = (table, counted);
        Ok(())
    }

    /// Its second level, if it is one (pass staging, its counters).
    fn second_level(&self) -> Option<&SecondLevel> {
        None
    }

    /// The shard's generation is over: nothing may keep a caller waiting.
    fn retire(&self) {}
}

/// Training reads and updates level 1 (S0); with an SSD tier a queued
/// batch's rows are staged into the cache while it waits (S3.5), so its pull
/// reads memory only.
pub struct LevelOne {
    pub shard: usize,
}

impl TrainingRows for LevelOne {
    fn queued(&self, table: &EmbeddingTable, keys: &[u64]) -> Result<(Option<KeyPlan>, Staged), ClusterError> {
        if !table.is_tiered() {
            return Ok((None, Staged::default()));
        }
        let plan = table.plan(keys);
        let staged = table.prefetch(&plan).map_err(|source| ClusterError::Table { shard: self.shard, source })?;
        Ok((Some(plan), staged))
    }

    fn pull(&self, table: &EmbeddingTable, plan: &KeyPlan, out: &mut [f32]) -> Result<Option<RowSlots>, ClusterError> {
        let slots =
            table.lookup_or_insert(plan, out).map_err(|source| ClusterError::Table { shard: self.shard, source })?;
        Ok(Some(slots))
    }

    fn push(
        &self,
        table: &EmbeddingTable,
        batch_id: u64,
        plan: &KeyPlan,
        slots: Option<RowSlots>,
        (summed, lr_scale): (&[f32], f32),
    ) -> Result<(), ClusterError> {
        let slots = slots.ok_or(ClusterError::UnknownBatch { shard: self.shard, batch_id })?;
        table
            .apply_gradients_scaled(plan, &slots, summed, lr_scale)
            .map_err(|source| ClusterError::Table { shard: self.shard, source })
    }
}

/// S1.2–S1.4: a training batch reads the second level only, and its update
/// goes there; level 1 takes the rows when a pass ends (or before it is read).
impl TrainingRows for SecondLevel {
    fn pull(&self, _: &EmbeddingTable, plan: &KeyPlan, out: &mut [f32]) -> Result<Option<RowSlots>, ClusterError> {
        self.lookup(&plan.unique, out)?;
        Ok(None)
    }

    fn push(
        &self,
        table: &EmbeddingTable,
        batch_id: u64,
        plan: &KeyPlan,
        _: Option<RowSlots>,
        summed: (&[f32], f32),
    ) -> Result<(), ClusterError> {
        self.apply_scaled(table, batch_id, &plan.unique, summed)
    }

    fn release(
        &self,
        table: &EmbeddingTable,
        batch_id: u64,
        plan: &KeyPlan,
        _: Option<RowSlots>,
    ) -> Result<(), ClusterError> {
        self.apply_or_release(table, batch_id, &plan.unique, None)
    }

    fn before_level_one_read(&self, table: &EmbeddingTable, counted: bool) -> Result<(), ClusterError> {
        if counted {
            self.note_l1_read();
        }
        // Empty: level 1 holds every row already (and a stage under way only reads it).
        if self.rows() > 0 { self.write_through(table) } else { Ok(()) }
    }

    fn second_level(&self) -> Option<&SecondLevel> {
        Some(self)
    }

    fn retire(&self) {
        self.close();
    }
}
