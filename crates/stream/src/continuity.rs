//! Whether a partition's log is still the one the reader was reading, and
//! what the keys say to do when it is not:
//!
//! - **retention** deleted records before they were read (the next offset is
//!   below the log's start): `on_retention_gap`;
//! - the log **went backwards** (its end is before the next offset, or the
//!   record last read is no longer the one at its offset: a broker restarted
//!   empty, a topic deleted and created again, a checkpoint of another
//!   log): `on_offset_reset`;
//! - offsets were **skipped inside** the log (a fetch answered from past the
//!   offset asked, records missing between two read): `on_gap`.
//!
//! Offsets alone cannot tell a refilled log from the old one, so the reader
//! keeps a fingerprint of the record before its next offset and now and then
//! asks for that record again (`Cutter::fetch`); a checkpoint keeps it too.

use rskafka::client::partition::OffsetAt;
use rskafka::record::RecordAndOffset;
use sparrow_core::config::{GapPolicy, OffsetReset, RetentionGap, StreamConfig, StreamStart};
use sparrow_data::DataError;

use crate::broker::Broker;

/// A 64-bit fingerprint of a record: its time, key and value. Not a
/// defence against a forger, a check that the log holds the same record.
pub fn fingerprint(r: &RecordAndOffset) -> u64 {
    let mut h = Mix(0x243f_6a88_85a3_08d3);
    h.add(r.record.timestamp.timestamp_millis() as u64);
    for part in [&r.record.key, &r.record.value] {
        match part {
            None => h.add(u64::MAX),
            Some(bytes) => h.add_bytes(bytes),
        }
    }
    h.0
}

struct Mix(u64);

impl Mix {
    fn add(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(23) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn add_bytes(&mut self, bytes: &[u8]) {
        self.add(bytes.len() as u64);
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let mut last = [0u8; 8];
        last[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        self.add(u64::from_le_bytes(last));
    }
}

/// "kafka BROKERS: topic "T" partition P", for messages.
pub fn place(config: &StreamConfig, id: i32) -> String {
    format!("kafka {}: topic {:?} partition {id}", config.brokers.join(","), config.topic)
}

/// Partition `id`'s log went backwards (`why`) while the reader's next
/// offset was `wanted`: an error naming both, or (`on_offset_reset`) the
/// offset to go on from, logged.
pub fn reset(broker: &Broker, config: &StreamConfig, id: i32, wanted: i64, why: &str) -> Result<i64, DataError> {
    let place = place(config, id);
    let (at, from) = match config.on_offset_reset {
        OffsetReset::Fail => {
            return Err(DataError::Stream(format!(
                "{place}: the log went backwards: {why} (the next offset to read is {wanted}). Likely the broker lost \
                 its log (restarted empty) or the topic was deleted and created again. Set \
                 data.stream.on_offset_reset = \"earliest\" (or \"latest\") to go on from the new log's start (or end)"
            )));
        }
        OffsetReset::Earliest => (OffsetAt::Earliest, "earliest"),
        OffsetReset::Latest => (OffsetAt::Latest, "latest"),
    };
    let offset = broker.offset(id, at)?;
    tracing::warn!(
        "{place}: the log went backwards: {why} (the next offset to read was {wanted}): going on from offset {offset} \
         (data.stream.on_offset_reset = \"{from}\"; counted in stream_offset_resets)"
    );
    Ok(offset)
}

/// Offsets `from..to` of partition `id` were skipped by the broker: an error
/// (`on_gap = "fail"` on a topic that is not compacted), else a warning.
pub fn gap(config: &StreamConfig, id: i32, from: i64, to: i64, compacted: bool) -> Result<(), DataError> {
    let place = place(config, id);
    let n = to - from;
    if config.on_gap == GapPolicy::Fail && !compacted {
        return Err(DataError::Stream(format!(
            "{place}: offsets {from}..{to} ({n} records) were skipped by the broker: asked for offset {from}, it \
             answered from offset {to} on. The topic's cleanup.policy is not \"compact\", so records were lost (a \
             broker that returns only whole record batches from the offset asked, as tansu 0.6.0 does, loses the \
             rest of a batch). Set data.stream.on_gap = \"skip\" to go on, counting them in stream_gap_records"
        )));
    }
    let why = if compacted { "compaction" } else { "data.stream.on_gap = \"skip\"" };
    tracing::warn!(
        "{place}: offsets {from}..{to} ({n} records) were skipped by the broker ({why}): counted in stream_gap_records"
    );
    Ok(())
}

/// Where partition `id` starts: the checkpoint's offset when it has one
/// (checked against what the broker still holds), else `start`'s; and
/// whether the log was found gone backwards (an offset reset).
pub fn start_offset(
    broker: &Broker,
    config: &StreamConfig,
    id: i32,
    checkpointed: Option<i64>,
) -> Result<(i64, bool), DataError> {
    if let Some(offset) = checkpointed {
        let end = broker.offset(id, OffsetAt::Latest)?;
        if offset > end {
            let why = format!("the log ends at offset {end}, before the checkpoint's offset {offset}");
            return Ok((reset(broker, config, id, offset, &why)?, true));
        }
        let earliest = broker.offset(id, OffsetAt::Earliest)?;
        return Ok((if offset < earliest { retention(broker, config, id, offset)? } else { offset }, false));
    }
    let offset = match config.start {
        StreamStart::Earliest => broker.offset(id, OffsetAt::Earliest)?,
        StreamStart::Latest => broker.offset(id, OffsetAt::Latest)?,
        // After now no record can be stamped yet: from the end (some
        // brokers answer a time past their newest record with offset 0).
        StreamStart::Timestamp(secs) if secs.saturating_mul(1000) > now_ms() => broker.offset(id, OffsetAt::Latest)?,
        StreamStart::Timestamp(secs) => {
            let at = chrono::DateTime::from_timestamp(secs, 0)
                .ok_or_else(|| DataError::Stream(format!("data.stream.start: timestamp {secs} is not a time")))?;
            match broker.offset(id, OffsetAt::Timestamp(at))? {
                // No record at or after it: from the end.
                o if o < 0 => broker.offset(id, OffsetAt::Latest)?,
                o => o,
            }
        }
        StreamStart::Checkpoint => {
            return Err(DataError::Stream(format!(
                "{}: data.stream.start = \"checkpoint\", but no checkpoint holds an offset for it (resume from one, or start at \"earliest\")",
                place(config, id)
            )));
        }
    };
    Ok((offset, false))
}

/// Offset `wanted` of partition `id` is below the log's start: retention
/// deleted it before it was read. An error naming both offsets, or
/// (`on_retention_gap = "skip"`) the oldest one kept.
pub fn retention(broker: &Broker, config: &StreamConfig, id: i32, wanted: i64) -> Result<i64, DataError> {
    let earliest = broker.offset(id, OffsetAt::Earliest)?;
    let place = place(config, id);
    match config.on_retention_gap {
        RetentionGap::Fail => Err(DataError::Stream(format!(
            "{place}: the next offset to read is {wanted}, but the broker keeps records from offset {earliest} on (retention deleted {} records); set data.stream.on_retention_gap = \"skip\" to go on from {earliest}",
            earliest - wanted
        ))),
        RetentionGap::Skip => {
            tracing::warn!(
                "{place}: offsets {wanted}..{earliest} were deleted by retention before they were read: {} records skipped (data.stream.on_retention_gap = \"skip\")",
                earliest - wanted
            );
            Ok(earliest)
        }
    }
}

/// The wall clock, in Unix ms.
pub(crate) fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rskafka::record::Record;

    fn record(offset: i64, ms: i64, value: &[u8]) -> RecordAndOffset {
        let timestamp = chrono::DateTime::from_timestamp_millis(ms).expect("time");
        RecordAndOffset {
            record: Record { key: None, value: Some(value.to_vec()), headers: Default::default(), timestamp },
            offset,
        }
    }

    /// The same record at any offset has one fingerprint; another time or
    /// value (even one byte, or a shorter one padded with zeros) another.
    #[test]
    fn a_fingerprint_tells_records_apart() {
        let a = fingerprint(&record(5, 1000, b"1\t2\t3"));
        assert_eq!(a, fingerprint(&record(9, 1000, b"1\t2\t3")));
        for other in [record(5, 1001, b"1\t2\t3"), record(5, 1000, b"1\t2\t4"), record(5, 1000, b"1\t2\t3\0")] {
            assert_ne!(a, fingerprint(&other));
        }
    }
}
