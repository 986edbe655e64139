//! Where `sparrow train` reads its batches: the training file for
//! `train.epochs` passes, or (`[data.stream]`) a Kafka topic from the
//! offsets the model has consumed, until the stream is stopped.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sparrow_core::Config;
use sparrow_core::batch::StreamMark;
use sparrow_data::input::Codec;
use sparrow_data::{BadRows, BatchStream, DataError};

use crate::TrainError;
use crate::pipeline::PlannedBatches;
use crate::trainer::Trainer;

pub struct TrainingInput {
    pub batches: PlannedBatches,
    /// What the input is called in messages: the file, or the topic.
    pub origin: PathBuf,
    /// Bytes of all passes over a plain text file (progress has a total).
    pub bytes_total: Option<u64>,
    /// A plain text file's size: a position's epoch and offset in bytes.
    pub file_bytes: Option<u64>,
}

impl TrainingInput {
    /// Opens the input at `trainer`'s position (its checkpoint's offsets).
    pub fn open(config: &Config, trainer: &Trainer, bad: &BadRows) -> Result<TrainingInput, TrainError> {
        let batch_size = config.train.batch_size;
        let (stream, origin, file_bytes) = match &config.data.stream {
            Some(s) => {
                if config.data.train.is_some() {
                    tracing::info!("[data.stream] is set: data.train is not read");
                }
                let stream = sparrow_stream::spawn(config, batch_size, trainer.stream.as_deref(), bad.clone())?;
                (stream, PathBuf::from(format!("kafka topic {}", s.topic)), None)
            }
            None => {
                let path = config
                    .data
                    .train
                    .as_deref()
                    .map(Path::new)
                    .ok_or(DataError::MissingPath { key: "train", what: "the training data file" })?;
                let stream =
                    BatchStream::spawn(path, config, batch_size, trainer.position, config.train.epochs, bad.clone())?;
                // Positions are offsets in the text: a compressed file's size
                // says nothing about them, so its progress has no total.
                let plain = Codec::sniff(path).is_ok_and(|c| c == Codec::Plain);
                let bytes = std::fs::metadata(path).ok().filter(|_| plain).map(|m| m.len());
                (stream, path.to_path_buf(), bytes)
            }
        };
        let batches = PlannedBatches::spawn(stream, trainer.table.partitioner(), config.data.prefetch_batches)
            .map_err(|e| TrainError::io(&origin, e))?;
        let bytes_total = file_bytes.map(|b| b * config.train.epochs);
        Ok(TrainingInput { batches, origin, bytes_total, file_bytes })
    }
}

/// Why a stream trained nothing.
pub const NO_RECORD: &str = "the stream gave no record from where it started (data.stream.start, or the checkpoint's \
                             offsets) before data.stream.stop_when_idle_secs passed without one";

/// The stream's figures in the final JSON (null without `[data.stream]`).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct StreamReport {
    /// Partition → the next offset to read (what the last checkpoint holds).
    #[serde(default, deserialize_with = "from_json_value")]
    pub stream_offsets: Option<std::collections::BTreeMap<i32, i64>>,
    /// Records consumed (good and malformed) and, of them, malformed.
    pub stream_records: Option<u64>,
    pub stream_bad_records: Option<u64>,
    /// Of those, stamped more than `data.stream.max_future_secs` ahead of
    /// the reader's clock: their time moved no clock.
    pub future_records: Option<u64>,
    /// Records the broker held past the offsets when the last batch was cut.
    pub stream_lag_records: Option<u64>,
    /// Offsets the broker skipped inside partitions (`data.stream.on_gap`).
    #[serde(default)]
    pub stream_gap_records: Option<u64>,
    /// Logs found gone backwards and moved past (`data.stream.on_offset_reset`).
    #[serde(default)]
    pub stream_offset_resets: Option<u64>,
}

/// Reads a field through a JSON value: inside a flattened struct serde
/// buffers the field, and a map's integer keys (JSON strings) no longer
/// read as integers then; a JSON value reads them.
pub fn from_json_value<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let value = <serde_json::Value as serde::Deserialize>::deserialize(d)?;
    serde_json::from_value(value).map_err(serde::de::Error::custom)
}

impl StreamReport {
    pub fn of(mark: Option<&StreamMark>) -> StreamReport {
        match mark {
            None => StreamReport::default(),
            Some(m) => StreamReport {
                stream_offsets: Some(m.offsets.clone()),
                stream_records: Some(m.records),
                stream_bad_records: Some(m.bad_records),
                future_records: Some(m.future_records),
                stream_lag_records: Some(m.lag_records),
                stream_gap_records: Some(m.gap_records),
                stream_offset_resets: Some(m.offset_resets),
            },
        }
    }
}

/// Seconds from the newest trained record's append to now.
pub fn lag_secs(mark: &StreamMark) -> Option<f64> {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as i64;
    mark.newest_record_ms.map(|ms| (now_ms - ms).max(0) as f64 / 1e3)
}

/// The lag, for the progress line: records behind the partitions' ends,
/// and seconds behind the newest trained record.
pub fn describe_lag(mark: &StreamMark) -> String {
    match lag_secs(mark) {
        Some(secs) => format!(" lag {} records {secs:.1} s", mark.lag_records),
        None => format!(" lag {} records", mark.lag_records),
    }
}
