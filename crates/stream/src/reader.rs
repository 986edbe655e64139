//! Records of a Kafka topic cut into batches, deterministically: a batch
//! starts at the next partition in turn and takes records in offset order,
//! moving to the following partition only when one has no more records (a
//! fetch from its next offset returned none; not the end the broker last
//! reported, which brokers compute differently and which lags). Over records
//! already in the log the cut depends on nothing but the log, so a run
//! resumed from a checkpoint's offsets cuts exactly the batches an
//! uninterrupted run cut; only a batch short of `train.batch_size` (every
//! partition read to its end) waits, `data.stream.linger_ms`, for more.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rskafka::record::RecordAndOffset;
use sparrow_core::Batch;
use sparrow_core::Config;
use sparrow_core::batch::{BatchBuilder, DataPosition, StreamMark};
use sparrow_core::config::{Partitions, StreamConfig};
use sparrow_data::text::{LineParser, MAX_LINE_BYTES, row_parser};
use sparrow_data::weighting::Weigher;
use sparrow_data::{BadRows, BatchStream, DataError, DataLayout};

use crate::access::Access;
use crate::broker::{Broker, FetchError, Fetched};
use crate::continuity::{self, fingerprint};

/// How long one wait for new records lasts before the reader looks at its
/// stop flag and idle clock again.
const POLL_MS: u64 = 500;

/// A fetch answered later than its wait by more than this went through a
/// broker outage (stopped, unreachable, restarting); the excess is not
/// idle time.
const OUTAGE_GRACE: Duration = Duration::from_secs(1);

/// An outage this long is a warning; a shorter one, at debug.
const OUTAGE_WARNING: Duration = Duration::from_secs(3);

/// The batches of `data.stream`'s topic from `resume`'s offsets (or from
/// `data.stream.start`), on a reader thread. Connecting, finding the
/// partitions and the start offsets happen here, so a missing topic, a
/// partition that is not there, or a retention gap fail before training.
pub fn spawn(
    job: &Config,
    batch_size: usize,
    resume: Option<&StreamMark>,
    bad: BadRows,
) -> Result<BatchStream, DataError> {
    let data = &job.data;
    let stream = data.stream.clone().ok_or(DataError::MissingPath { key: "stream", what: "the topic to read" })?;
    let cutter = Cutter::open(&stream, job, batch_size, resume, bad)?;
    let layout = cutter.layout.clone();
    BatchStream::from_thread(layout, data.prefetch_batches, "sparrow-kafka", move |tx, stop| {
        let mut cutter = cutter;
        loop {
            match cutter.next_batch(stop) {
                Ok(Some(b)) => {
                    if tx.send(Ok(b)).is_err() {
                        return;
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        }
    })
    .map_err(|e| DataError::Stream(format!("kafka: cannot start the reader thread: {e}")))
}

struct PartitionState {
    id: i32,
    /// The next offset to train on.
    next: i64,
    /// Fetched, not yet cut into a batch.
    fetched: VecDeque<RecordAndOffset>,
    /// The next offset to fetch.
    fetch_at: i64,
    /// The partition's end as the broker last reported it (for the lag).
    end: Option<i64>,
    /// A fetch from `fetch_at` found no record, in this batch's turn.
    at_end: bool,
    /// The fingerprint of the record at `fetch_at - 1` (the last fetched),
    /// to check that the log still holds it.
    tail: Option<u64>,
    /// The fingerprint of the record at `next - 1` (the last taken into a
    /// batch): the checkpoint's `tails`.
    trained_tail: Option<u64>,
}

impl PartitionState {
    fn read_to_end(&self) -> bool {
        self.fetched.is_empty() && self.at_end
    }
}

struct Cutter {
    broker: Broker,
    config: StreamConfig,
    parts: Vec<PartitionState>,
    /// Offsets of a checkpoint's partitions this run does not read: kept.
    carried: BTreeMap<i32, i64>,
    /// The index in `parts` of the partition the next batch starts at.
    cursor: usize,
    records: u64,
    bad_records: u64,
    /// Records stamped past `max_future_secs` ahead (their time moved no clock).
    future_records: u64,
    /// Offsets the broker skipped inside partitions.
    gap_records: u64,
    /// Logs found gone backwards and moved past (`on_offset_reset`).
    offset_resets: u64,
    /// The topic's `cleanup.policy` is `compact` (as the broker says): gaps
    /// are compaction's.
    compacted: bool,
    /// Unix ms past which a record is stamped in the future (set as each
    /// batch is cut, from the wall clock and `max_future_secs`).
    future_after_ms: i64,
    parser: Box<dyn LineParser>,
    layout: DataLayout,
    bad: BadRows,
    batch_size: usize,
    /// When `records` was last seen to have grown (the idle clock).
    last_record: Instant,
    records_when_seen: u64,
    /// Every partition was read to its end since the last batch was cut
    /// (said once in the log, at debug).
    quiet: bool,
    /// Ranges a cluster trained ahead of the checkpoint (its mark's
    /// `skip`): dropped as they come, and still listed until passed.
    skip: BTreeMap<i32, Vec<(i64, i64)>>,
    /// Where the batch being cut started on each partition it read.
    from: BTreeMap<i32, i64>,
    /// `[data.weighting]`: each batch merged and weighed as it is cut.
    weigher: Option<Weigher>,
    /// The newest sample time read so far, in Unix ms (the mark's
    /// `clock_ms`): the weighting's reference.
    clock_ms: Option<i64>,
}

impl Cutter {
    fn open(
        config: &StreamConfig,
        job: &Config,
        batch_size: usize,
        resume: Option<&StreamMark>,
        bad: BadRows,
    ) -> Result<Cutter, DataError> {
        let data = &job.data;
        let unavailable = Duration::from_secs(config.max_unavailable_secs);
        let access = Access::of(config)?;
        let mut broker = Broker::connect(&access, &config.topic, unavailable)?;
        let exists = broker.partitions()?;
        let ids = match &config.partitions {
            Partitions::All => exists.clone(),
            Partitions::Some(list) => {
                let mut list = list.clone();
                list.sort_unstable();
                if let Some(p) = list.iter().find(|p| !exists.contains(p)) {
                    return Err(DataError::Stream(format!(
                        "kafka {}: topic {:?} has no partition {p} (it has {}): see data.stream.partitions",
                        config.brokers.join(","),
                        config.topic,
                        describe(&exists)
                    )));
                }
                list
            }
        };
        broker.open(&ids)?;
        let mut parts = Vec::with_capacity(ids.len());
        let mut offset_resets = resume.map_or(0, |m| m.offset_resets);
        for &id in &ids {
            let checkpointed = resume.and_then(|m| m.offsets.get(&id).copied());
            let (next, reset) = continuity::start_offset(&broker, config, id, checkpointed)?;
            offset_resets += u64::from(reset);
            // The checkpoint's fingerprint holds only for its own offset.
            let tail = resume.and_then(|m| m.tails.get(&id).copied()).filter(|_| checkpointed == Some(next));
            parts.push(PartitionState {
                id,
                next,
                fetched: VecDeque::new(),
                fetch_at: next,
                end: None,
                at_end: false,
                tail,
                trained_tail: tail,
            });
        }
        let compacted = compacted(&access, config, unavailable);
        let carried = resume
            .map(|m| m.offsets.iter().filter(|(p, _)| !ids.contains(p)).map(|(&p, &o)| (p, o)).collect())
            .unwrap_or_default();
        let cursor = resume.and_then(|m| ids.iter().position(|&p| p >= m.next_partition)).unwrap_or(0);
        let origin = format!("kafka topic {}", config.topic);
        let format = config.value_format(data.format);
        let parser = row_parser(format, job, config.header.as_deref(), Path::new(&origin))?;
        Ok(Cutter {
            broker,
            config: config.clone(),
            parts,
            carried,
            cursor,
            records: resume.map_or(0, |m| m.records),
            bad_records: resume.map_or(0, |m| m.bad_records),
            future_records: resume.map_or(0, |m| m.future_records),
            gap_records: resume.map_or(0, |m| m.gap_records),
            offset_resets,
            compacted,
            future_after_ms: i64::MAX,
            parser,
            layout: DataLayout::from_config(data),
            batch_size,
            last_record: Instant::now(),
            records_when_seen: resume.map_or(0, |m| m.records),
            quiet: false,
            skip: resume.map(|m| m.skip.clone()).unwrap_or_default(),
            from: BTreeMap::new(),
            weigher: data.weighting.clone().map(|cfg| Weigher::new(cfg, 0, bad.weighting.clone())),
            clock_ms: resume.and_then(|m| m.clock_ms),
            bad,
        })
    }

    /// The next batch; `None` once stopped, or idle for
    /// `stop_when_idle_secs`. With `[data.weighting]`, its samples are
    /// weighed by their age on the event clock; a batch whose every sample
    /// is dropped is passed over (the next one's mark covers its records).
    fn next_batch(&mut self, stop: &AtomicBool) -> Result<Option<Batch>, DataError> {
        loop {
            let Some(batch) = self.cut_batch(stop)? else { return Ok(None) };
            let Some(weigher) = self.weigher.as_mut() else { return Ok(Some(batch)) };
            let reference = self.clock_ms.unwrap_or(0).div_euclid(1000);
            if let Some(weighed) = weigher.weigh_batch(batch, reference) {
                return Ok(Some(weighed));
            }
        }
    }

    /// The next batch of records as read.
    fn cut_batch(&mut self, stop: &AtomicBool) -> Result<Option<Batch>, DataError> {
        let n = self.parts.len();
        let start = self.cursor;
        let mut b = self.layout.builder(self.batch_size);
        self.parser.set_now(sparrow_data::weighting::now_secs());
        let ahead_ms = i64::try_from(self.config.max_future_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        self.future_after_ms = continuity::now_ms().saturating_add(ahead_ms);
        let mut newest_ms = None;
        let mut linger_until = None;
        let mut i = start;
        // Each batch asks every partition again whether it has more.
        for p in &mut self.parts {
            p.at_end = false;
        }
        self.from.clear();
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            self.take_from(i, &mut b, &mut newest_ms)?;
            if b.rows() >= self.batch_size {
                break;
            }
            i = (i + 1) % n;
            if i != start {
                continue;
            }
            // A whole turn: every partition is read to its end.
            let now = Instant::now();
            if b.rows() > 0 {
                let until = *linger_until.get_or_insert(now + Duration::from_millis(self.config.linger_ms));
                if now >= until {
                    break;
                }
                self.wait_for_records(until - now)?;
            } else {
                // Idle since the last record taken (a malformed one counts).
                if self.records != self.records_when_seen {
                    (self.records_when_seen, self.last_record) = (self.records, now);
                }
                if !self.quiet {
                    self.quiet = true;
                    let at: Vec<String> = self.parts.iter().map(|p| format!("{}: {}", p.id, p.next)).collect();
                    tracing::debug!(
                        "kafka topic {}: every partition read to its end ({}): waiting for records",
                        self.config.topic,
                        at.join(", ")
                    );
                }
                let idle = Duration::from_secs(self.config.stop_when_idle_secs);
                if !idle.is_zero() && self.last_record.elapsed() >= idle {
                    tracing::info!(
                        "kafka topic {}: no record for {} s (data.stream.stop_when_idle_secs): the stream ends here",
                        self.config.topic,
                        idle.as_secs()
                    );
                    return Ok(None);
                }
                self.wait_for_records(Duration::from_millis(POLL_MS))?;
            }
        }
        self.cursor = (start + 1) % n;
        self.quiet = false;
        self.bad.record_good(b.rows() as u64);
        let end = DataPosition { epoch: 0, offset: self.records, line: self.records + 1, skip: 0 };
        let mut batch = b.finish(end);
        // A timestamp column may date samples past their records' times
        // (but not into the future, as a record's own time may not).
        let in_time = |ms: &i64| *ms <= self.future_after_ms;
        let newest =
            batch.timestamps.as_ref().and_then(|t| t.iter().map(|s| s.saturating_mul(1000)).filter(in_time).max());
        if let Some(newest) = newest {
            self.clock_ms = Some(self.clock_ms.map_or(newest, |c| c.max(newest)));
        }
        batch.stream = Some(Arc::new(self.mark(newest_ms)));
        Ok(Some(batch))
    }

    fn mark(&self, newest_record_ms: Option<i64>) -> StreamMark {
        let mut offsets = self.carried.clone();
        offsets.extend(self.parts.iter().map(|p| (p.id, p.next)));
        let lag_records = self.parts.iter().map(|p| p.end.map_or(0, |end| (end - p.next).max(0) as u64)).sum();
        StreamMark {
            offsets,
            next_partition: self.parts[self.cursor].id,
            records: self.records,
            bad_records: self.bad_records,
            future_records: self.future_records,
            gap_records: self.gap_records,
            offset_resets: self.offset_resets,
            tails: self.parts.iter().filter_map(|p| Some((p.id, p.trained_tail?))).collect(),
            lag_records,
            newest_record_ms,
            clock_ms: self.clock_ms,
            from: self.from.clone(),
            skip: self.skip.clone(),
        }
    }

    /// Records of partition `i` into `b` until it is full or the partition
    /// is read to its end.
    fn take_from(&mut self, i: usize, b: &mut BatchBuilder, newest_ms: &mut Option<i64>) -> Result<(), DataError> {
        // The last record taken: its fingerprint is the partition's
        // `trained_tail`, computed once per call rather than per record.
        let mut last = None;
        while b.rows() < self.batch_size {
            let Some(record) = self.parts[i].fetched.pop_front() else {
                if self.parts[i].read_to_end() {
                    break;
                }
                // Before a fetch, which may find the log reset.
                if let Some(r) = last.take() {
                    self.parts[i].trained_tail = Some(fingerprint(&r));
                }
                self.fetch(&[i], 0)?;
                continue;
            };
            self.take_record(i, &record, b, newest_ms)?;
            last = Some(record);
        }
        if let Some(r) = last {
            self.parts[i].trained_tail = Some(fingerprint(&r));
        }
        Ok(())
    }

    /// One record of partition `i` into `b` (or counted as malformed).
    fn take_record(
        &mut self,
        i: usize,
        record: &RecordAndOffset,
        b: &mut BatchBuilder,
        newest_ms: &mut Option<i64>,
    ) -> Result<(), DataError> {
        let p = &mut self.parts[i];
        self.from.entry(p.id).or_insert(p.next);
        p.next = record.offset + 1;
        self.records += 1;
        let ms = record.record.timestamp.timestamp_millis();
        let future = ms > self.future_after_ms;
        if future {
            self.future_records += 1;
            if self.future_records == 1 {
                tracing::warn!(
                    "kafka topic {} partition {} offset {}: stamped {} s ahead of this machine's clock, more than \
                     data.stream.max_future_secs ({}): trained, but its time moves no clock (counted in \
                     future_records; this warning is not repeated)",
                    self.config.topic,
                    p.id,
                    record.offset,
                    (ms - continuity::now_ms()) / 1000,
                    self.config.max_future_secs
                );
            }
        }
        // Every record read moves the clock, as it did when it was first read.
        if ms >= 0 && !future {
            self.clock_ms = Some(self.clock_ms.map_or(ms, |c| c.max(ms)));
        }
        if trained_already(&mut self.skip, p.id, record.offset) {
            return Ok(());
        }
        if !future {
            *newest_ms = Some(newest_ms.map_or(ms, |m: i64| m.max(ms)));
        }
        // Kafka's "no timestamp" is -1: such a record has no age to weigh by.
        let parsed = match (self.weigher.is_some(), ms >= 0) {
            (false, _) => parse_value(self.parser.as_mut(), record.record.value.as_deref(), None, b),
            (true, true) => {
                parse_value(self.parser.as_mut(), record.record.value.as_deref(), Some(ms.div_euclid(1000)), b)
            }
            (true, false) => Err(format!("no record timestamp ({ms} ms), which [data.weighting] needs")),
        };
        if let Err(reason) = parsed {
            self.bad_records += 1;
            let place = format!("kafka topic {} partition {} offset {}", self.config.topic, p.id, record.offset);
            self.bad.record_at(&place, reason)?;
        }
        Ok(())
    }

    fn fetch_bytes(&self) -> i32 {
        self.config.fetch_max_bytes.min(i32::MAX as u32) as i32
    }

    /// Fetches partitions `which` (indices in `parts`), waiting up to
    /// `wait_ms` for a record, and adds what came. A fetch that does not
    /// wait asks from the record before the next offset, to check the log
    /// still holds it (the broker answers at once then, so a waiting fetch
    /// cannot): records are taken only from such a fetch, a waiting one
    /// only says that some came. The time a broker took past the wait is an
    /// outage: it does not count toward `stop_when_idle_secs` (a stalled
    /// broker is not a quiet topic).
    fn fetch(&mut self, which: &[usize], wait_ms: i32) -> Result<(), DataError> {
        let began = Instant::now();
        let asks: Vec<(i32, i64)> = which
            .iter()
            .map(|&i| {
                let p = &self.parts[i];
                let back = wait_ms == 0 && p.tail.is_some() && p.fetch_at > 0;
                (p.id, p.fetch_at - i64::from(back))
            })
            .collect();
        let results = self.broker.fetch(&asks, self.fetch_bytes(), wait_ms);
        let took = began.elapsed();
        let outage = took.saturating_sub(Duration::from_millis(wait_ms.max(0) as u64) + OUTAGE_GRACE);
        if !outage.is_zero() {
            self.last_record += outage;
            // tansu holds a fetch past its wait while records trickle in:
            // a warning for a real outage only.
            let topic = &self.config.topic;
            let secs = took.as_secs_f64();
            let said = "an outage, not counted as idle time (data.stream.stop_when_idle_secs)";
            if outage >= OUTAGE_WARNING {
                tracing::warn!("kafka topic {topic}: the broker answered a fetch after {secs:.1} s: {said}");
            } else {
                tracing::debug!("kafka topic {topic}: the broker answered a fetch after {secs:.1} s: {said}");
            }
        }
        for ((&i, fetched), &(_, asked)) in which.iter().zip(results).zip(&asks) {
            self.apply(i, asked, wait_ms > 0, fetched)?;
        }
        Ok(())
    }

    /// Waits up to `wait` for a record on any partition.
    fn wait_for_records(&mut self, wait: Duration) -> Result<(), DataError> {
        let all: Vec<usize> = (0..self.parts.len()).collect();
        let wait_ms = wait.as_millis().clamp(1, POLL_MS as u128) as i32;
        self.fetch(&all, wait_ms)
    }

    /// Adds the records of a fetch of partition `i` from offset `asked` to
    /// its own, after checking the log: still the one read (the record
    /// before `fetch_at`, when asked for, is the one read there), not ended
    /// before `fetch_at`, no offsets skipped. A `waited` fetch that could
    /// not check leaves its records for the next.
    fn apply(
        &mut self,
        i: usize,
        asked: i64,
        waited: bool,
        fetched: Result<Fetched, FetchError>,
    ) -> Result<(), DataError> {
        let f = match fetched {
            Ok(f) => f,
            // The record before the next offset is gone (retention): not
            // checked this time; the next fetch asks from the next offset.
            Err(FetchError::OutOfRange) if asked < self.parts[i].fetch_at => {
                self.parts[i].tail = None;
                return Ok(());
            }
            Err(FetchError::OutOfRange) => return self.out_of_range(i),
            Err(FetchError::Failed(e)) => return Err(e),
        };
        let p = &mut self.parts[i];
        if asked < p.fetch_at
            && let Some(r) = f.records.iter().find(|r| r.offset == asked)
            && Some(fingerprint(r)) != p.tail
        {
            let why = format!("the record at offset {asked} is not the one read there before");
            return self.reset(i, &why);
        }
        if f.high_watermark >= 0 && f.high_watermark < p.fetch_at {
            let why = format!("the log ends at offset {}, before the next offset to read", f.high_watermark);
            return self.reset(i, &why);
        }
        p.end = Some(f.high_watermark);
        if waited && p.tail.is_some() && f.records.iter().any(|r| r.offset >= p.fetch_at) {
            p.at_end = false;
            return Ok(());
        }
        let before = p.fetched.len();
        let mut gaps = Vec::new();
        for r in f.records {
            if r.offset < p.fetch_at {
                continue;
            }
            if r.offset > p.fetch_at {
                gaps.push((p.fetch_at, r.offset));
            }
            p.fetch_at = r.offset + 1;
            p.fetched.push_back(r);
        }
        p.at_end = p.fetched.len() == before;
        if !p.at_end {
            p.tail = p.fetched.back().map(fingerprint);
        }
        let id = p.id;
        for (from, to) in gaps {
            self.gap_records += (to - from) as u64;
            continuity::gap(&self.config, id, from, to, self.compacted)?;
        }
        Ok(())
    }

    /// Partition `i`'s log went backwards (`why`): stop, or go on where
    /// `on_offset_reset` says, counted. Records fetched from the old log
    /// before are still trained.
    fn reset(&mut self, i: usize, why: &str) -> Result<(), DataError> {
        let p = &self.parts[i];
        let offset = continuity::reset(&self.broker, &self.config, p.id, p.fetch_at, why)?;
        self.offset_resets += 1;
        let p = &mut self.parts[i];
        (p.fetch_at, p.tail, p.end, p.at_end) = (offset, None, None, false);
        if p.fetched.is_empty() {
            (p.next, p.trained_tail) = (offset, None);
        }
        Ok(())
    }

    /// The broker refused partition `i`'s next offset as out of range:
    /// below the log's start (retention), or past its end (gone backwards).
    fn out_of_range(&mut self, i: usize) -> Result<(), DataError> {
        let (id, from) = (self.parts[i].id, self.parts[i].fetch_at);
        let earliest = self.broker.offset(id, rskafka::client::partition::OffsetAt::Earliest)?;
        if from >= earliest {
            return self.reset(i, &format!("the broker answers that offset {from} is out of range"));
        }
        let next = continuity::retention(&self.broker, &self.config, id, from)?;
        let p = &mut self.parts[i];
        (p.next, p.fetch_at, p.end, p.at_end, p.tail, p.trained_tail) = (next, next, None, false, None, None);
        p.fetched.clear();
        Ok(())
    }
}

/// Whether the topic's `cleanup.policy` includes `compact`, as the broker
/// says (DescribeConfigs); a broker that does not say leaves it "no".
fn compacted(access: &Access, config: &StreamConfig, unavailable: Duration) -> bool {
    let topic = &config.topic;
    match crate::describe::cleanup_policy(access, topic, unavailable.min(Duration::from_secs(10))) {
        Ok(Some(policy)) => {
            let compact = policy.split(',').any(|p| p.trim() == "compact");
            tracing::debug!("kafka topic {topic}: cleanup.policy = {policy:?}");
            compact
        }
        Ok(None) => {
            tracing::debug!("kafka topic {topic}: the broker lists no cleanup.policy: taken as \"delete\"");
            false
        }
        Err(e) => {
            tracing::info!(
                "kafka topic {topic}: the broker did not say its cleanup.policy ({e}): taken as not compacted, so \
                 offsets skipped inside a partition stop the job unless data.stream.on_gap = \"skip\""
            );
            false
        }
    }
}

/// Whether `offset` of `partition` is in a range a cluster trained ahead
/// of its checkpoint; ranges it passed are forgotten.
fn trained_already(skip: &mut BTreeMap<i32, Vec<(i64, i64)>>, partition: i32, offset: i64) -> bool {
    let Some(ranges) = skip.get_mut(&partition) else { return false };
    let inside = ranges.iter().any(|&(from, to)| from <= offset && offset < to);
    ranges.retain(|&(_, to)| to > offset + 1);
    if ranges.is_empty() {
        skip.remove(&partition);
    }
    inside
}

/// One record's value as a row of `b`, dated `time` (Unix seconds; a
/// timestamp column overrides it), or why it is malformed (the row is
/// rolled back).
fn parse_value(
    parser: &mut dyn LineParser,
    value: Option<&[u8]>,
    time: Option<i64>,
    b: &mut BatchBuilder,
) -> Result<(), String> {
    let Some(value) = value else { return Err("the record has no value".into()) };
    let mut line = value;
    while let Some((&last, rest)) = line.split_last() {
        if last != b'\n' && last != b'\r' {
            break;
        }
        line = rest;
    }
    if line.len() as u64 > MAX_LINE_BYTES {
        return Err(format!("a value of {} bytes, more than the {MAX_LINE_BYTES}-byte limit", line.len()));
    }
    if line.contains(&b'\n') {
        return Err("the value holds more than one line (one record is one row)".into());
    }
    b.begin_row();
    if let Some(ts) = time {
        b.set_timestamp(ts);
    }
    let parsed = parser
        .parse(line, b)
        .and_then(|label| b.end_row(label).then_some(()).ok_or_else(|| "wrong number of dense values".to_string()));
    if parsed.is_err() {
        b.rollback_row();
    }
    parsed
}

fn describe(partitions: &[i32]) -> String {
    match partitions {
        [] => "none".into(),
        [one] => format!("partition {one}"),
        many => format!("partitions {}", many.iter().map(i32::to_string).collect::<Vec<_>>().join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets inside a skip range are dropped, the others trained; a range
    /// is forgotten once its last offset is passed.
    #[test]
    fn records_a_cluster_trained_ahead_are_dropped_once() {
        let mut skip: BTreeMap<i32, Vec<(i64, i64)>> = [(0, vec![(3, 5), (8, 9)])].into();
        let dropped: Vec<i64> = (0..10).filter(|&o| trained_already(&mut skip, 0, o)).collect();
        assert_eq!(dropped, vec![3, 4, 8]);
        assert!(skip.is_empty());
        assert!(!trained_already(&mut skip, 1, 3), "another partition's offsets");
    }
}
