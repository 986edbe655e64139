//! Tables that stay bounded on an endless stream: `embedding.ttl_secs`
//! deletes rows by the records' time (event time: a row's last training use
//! was on records appended more than ttl_secs before the newest record
//! trained), `embedding.max_rows` evicts the least recently used rows past
//! a capacity. Both pick a cutoff on the table's lookup clock, which every
//! row's last use is stamped in, and delete through
//! [`EmbeddingTable::delete_used_before`]; the rows of lookups in flight are
//! never deleted. Deletions happen at fixed steps from a fixed clock, so a
//! run is as repeatable with them as without (the clock of record times is
//! checkpointed).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

use sparrow_core::config::EmbeddingConfig;
use sparrow_embedding::{Deletion, EmbeddingTable, TableError};

/// How finely event time is kept: a TTL's window holds this many entries.
const ENTRIES_PER_TTL: u64 = 64;

pub struct TableBounds {
    ttl_secs: u64,
    max_rows: usize,
    /// (the lookup clock after a step, the newest record time trained by
    /// then, in seconds): one entry per `bucket_secs` of event time, oldest
    /// first, back to the oldest time rows may still have been used at.
    clock: VecDeque<(u64, i64)>,
    bucket_secs: i64,
    /// [`evict_over`] warned of a bound below one batch.
    small_bound_warned: AtomicBool,
}

impl TableBounds {
    /// The bounds `embedding` sets, if any.
    pub fn new(embedding: &EmbeddingConfig) -> Option<TableBounds> {
        (embedding.ttl_secs > 0 || embedding.max_rows > 0).then(|| TableBounds {
            ttl_secs: embedding.ttl_secs,
            max_rows: usize::try_from(embedding.max_rows).unwrap_or(usize::MAX),
            clock: VecDeque::new(),
            bucket_secs: embedding.ttl_secs.div_ceil(ENTRIES_PER_TTL).max(1) as i64,
            small_bound_warned: AtomicBool::new(false),
        })
    }

    /// The event clock a checkpoint keeps.
    pub fn saved(&self) -> Vec<(u64, i64)> {
        self.clock.iter().copied().collect()
    }

    /// The event clock of the checkpoint a run resumes from.
    pub fn restore(&mut self, saved: &[(u64, i64)]) {
        self.clock = saved.iter().copied().collect();
    }

    /// After a step: `newest_record_ms`, the newest record trained so far
    /// (the stream's mark). Returns the rows expired and evicted.
    pub fn after_step(
        &mut self,
        table: &EmbeddingTable,
        newest_record_ms: Option<i64>,
    ) -> Result<(u64, u64), TableError> {
        let mut expired = 0;
        if let Some(cutoff) = self.ttl_cutoff(table.clock(), newest_record_ms) {
            expired = table.delete_used_before(cutoff, Deletion::Expired)?;
        }
        Ok((expired, evict_over(table, self.max_rows, &self.small_bound_warned)?))
    }

    /// `embedding.ttl_secs`: the lookups up to `tick` trained records up to
    /// `newest_record_ms`; the lookup clock before which rows have expired,
    /// when it moved (the caller deletes them).
    pub fn ttl_cutoff(&mut self, tick: u64, newest_record_ms: Option<i64>) -> Option<u64> {
        match newest_record_ms {
            Some(ms) if self.ttl_secs > 0 => self.advance(tick, ms.div_euclid(1000)),
            _ => None,
        }
    }

    /// Notes that the lookups up to `tick` trained records up to `secs`;
    /// when event time entered a new bucket, the cutoff of the rows whose
    /// last use is older than `ttl_secs` (and those entries are dropped).
    fn advance(&mut self, tick: u64, secs: i64) -> Option<u64> {
        let newest = self.clock.back().map_or(secs, |&(_, s)| s.max(secs));
        match self.clock.back_mut() {
            Some(last) if last.1.div_euclid(self.bucket_secs) == newest.div_euclid(self.bucket_secs) => {
                *last = (tick, newest);
                return None;
            }
            _ => self.clock.push_back((tick, newest)),
        }
        // Entries before the first still within the TTL hold rows to delete.
        let horizon = newest - self.ttl_secs as i64;
        let within = self.clock.iter().position(|&(_, s)| s >= horizon).unwrap_or(self.clock.len());
        if within == 0 {
            return None;
        }
        let (last_gone, _) = self.clock[within - 1];
        self.clock.drain(..within);
        Some(last_gone + 1)
    }
}

/// `table` past `max_rows` rows (0: no bound): its least recently used
/// rows evicted down to 90% of the bound (so the next eviction is a tenth
/// of it away), but never the rows of the newest lookup: with a bound below
/// one batch's unique IDs, the rows the next step reads stay (the table
/// holds that batch, over the bound, with a warning the first time `warned`
/// is found unset) instead of every row going each step. Returns the rows
/// evicted.
pub fn evict_over(table: &EmbeddingTable, max_rows: usize, warned: &AtomicBool) -> Result<u64, TableError> {
    if max_rows == 0 || table.len() <= max_rows {
        return Ok(0);
    }
    let Some(cutoff) = table.lru_cutoff(max_rows - max_rows / 10)? else { return Ok(0) };
    let newest = table.clock();
    let evicted = table.delete_used_before(cutoff.min(newest), Deletion::Evicted)?;
    if cutoff > newest && !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "embedding.max_rows = {max_rows} is below the rows one batch looks up: the newest batch's rows are \
             kept ({} rows now), the others evicted every step; raise embedding.max_rows well past a batch's unique \
             IDs (train.batch_size × the fields)",
            table.len()
        );
    }
    Ok(evicted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(ttl_secs: u64) -> TableBounds {
        let config = EmbeddingConfig { ttl_secs, ..Default::default() };
        TableBounds::new(&config).expect("bounded")
    }

    /// Event time, not steps: rows used at lookups up to the last entry
    /// older than the TTL go once a record newer than the TTL is trained.
    #[test]
    fn the_cutoff_follows_record_time() {
        let mut b = bounds(64);
        assert_eq!(b.bucket_secs, 1);
        assert_eq!(b.advance(10, 1000), None);
        assert_eq!(b.advance(20, 1000), None, "the same second: the entry moves on");
        assert_eq!(b.advance(30, 1030), None);
        assert_eq!(b.advance(40, 1064), None, "1000 is exactly 64 s old: kept");
        assert_eq!(b.advance(50, 1065), Some(21), "lookups up to 20 trained records of 1000");
        assert_eq!(b.saved(), vec![(30, 1030), (40, 1064), (50, 1065)]);
        // An older record does not move event time back.
        assert_eq!(b.advance(60, 900), None);
        assert_eq!(b.saved().last(), Some(&(60, 1065)));
        assert_eq!(b.advance(70, 2000), Some(61), "everything before is older than 64 s");
    }

    #[test]
    fn neither_key_means_no_bounds() {
        assert!(TableBounds::new(&EmbeddingConfig::default()).is_none());
        assert_eq!(bounds(6400).bucket_secs, 100);
    }
}
