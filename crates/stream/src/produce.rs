//! `sparrow produce`: rows (one per record) appended to a topic at a given
//! rate, for demos and tests. Row `i` goes to the topic's partition
//! `i mod partitions`, so each partition holds its rows in their order.

use std::io::BufRead;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rskafka::record::Record;
use serde::Serialize;
use sparrow_data::DataError;

use crate::access::Access;
use crate::broker::Broker;

pub struct ProduceOptions {
    /// The brokers, with TLS and SASL as `[data.stream]` says.
    pub access: Access,
    pub topic: String,
    /// Partitions of the topic when it has to be created.
    pub partitions: i32,
    /// Records per second; 0: as fast as the broker takes them.
    pub rate: f64,
    /// Records per produce request (one record batch) and partition, at most.
    pub batch_records: usize,
    /// Each record's timestamp is the row's time: this column (0-based,
    /// Unix seconds, split at `delimiter`); `None`: the time it is sent.
    pub timestamp_column: Option<usize>,
    pub delimiter: u8,
    /// Lines skipped first (a CSV header).
    pub skip_lines: usize,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Produced {
    pub topic: String,
    pub partitions: usize,
    pub records: u64,
    pub secs: f64,
    pub records_per_sec: f64,
    /// Partition → the next offset after the records written.
    pub end_offsets: std::collections::BTreeMap<i32, i64>,
}

/// Appends each line of `lines` (empty ones skipped) as one record.
pub fn produce(options: &ProduceOptions, lines: impl BufRead) -> Result<Produced, DataError> {
    let mut broker = Broker::connect(&options.access, &options.topic, Duration::from_secs(30))?;
    let partitions = match broker.partitions() {
        Ok(p) => p,
        Err(_) => {
            broker.create_topic(options.partitions)?;
            wait_for_partitions(&broker)?
        }
    };
    broker.open(&partitions)?;
    let start = Instant::now();
    let mut pending: Vec<Vec<Record>> = vec![Vec::new(); partitions.len()];
    let mut produced = Produced { topic: options.topic.clone(), partitions: partitions.len(), ..Default::default() };
    for (number, line) in lines.split(b'\n').enumerate().skip(options.skip_lines) {
        let mut line = line.map_err(|e| DataError::Stream(format!("produce: reading the rows: {e}")))?;
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.is_empty() {
            continue;
        }
        let ms = match options.timestamp_column {
            None => now_ms(),
            Some(column) => row_time_ms(&line, column, options.delimiter).ok_or_else(|| {
                DataError::Stream(format!(
                    "produce: line {}: column {column} is not a time in Unix seconds (--timestamp-column)",
                    number + 1
                ))
            })?,
        };
        let slot = (produced.records % partitions.len() as u64) as usize;
        pending[slot].push(Record {
            key: None,
            value: Some(line),
            headers: Default::default(),
            timestamp: chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default(),
        });
        produced.records += 1;
        // At a rate, what is due leaves together, then the producer waits
        // for the next record's time; unlimited, in chunks.
        let due = (options.rate > 0.0).then(|| Duration::from_secs_f64(produced.records as f64 / options.rate));
        let ahead = due.and_then(|d| d.checked_sub(start.elapsed()));
        if ahead.is_some() || pending[slot].len() >= options.batch_records.max(1) {
            send(&broker, &partitions, &mut pending, &mut produced)?;
        }
        if let Some(wait) = ahead {
            std::thread::sleep(wait);
        }
    }
    send(&broker, &partitions, &mut pending, &mut produced)?;
    produced.secs = start.elapsed().as_secs_f64();
    produced.records_per_sec = produced.records as f64 / produced.secs.max(1e-9);
    Ok(produced)
}

fn send(
    broker: &Broker,
    partitions: &[i32],
    pending: &mut [Vec<Record>],
    produced: &mut Produced,
) -> Result<(), DataError> {
    for (slot, records) in pending.iter_mut().enumerate() {
        if records.is_empty() {
            continue;
        }
        let offsets = broker.produce(partitions[slot], std::mem::take(records))?;
        if let Some(last) = offsets.last() {
            produced.end_offsets.insert(partitions[slot], last + 1);
        }
    }
    Ok(())
}

/// A topic just created shows its partitions once its metadata spread.
fn wait_for_partitions(broker: &Broker) -> Result<Vec<i32>, DataError> {
    let start = Instant::now();
    loop {
        match broker.partitions() {
            Ok(p) if !p.is_empty() => return Ok(p),
            Err(e) if start.elapsed() > Duration::from_secs(30) => return Err(e),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Field `column` of `line`, a time in Unix seconds, in milliseconds.
fn row_time_ms(line: &[u8], column: usize, delimiter: u8) -> Option<i64> {
    let field = line.split(|&b| b == delimiter).nth(column)?;
    let secs: i64 = std::str::from_utf8(field).ok()?.trim().parse().ok()?;
    secs.checked_mul(1000)
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
