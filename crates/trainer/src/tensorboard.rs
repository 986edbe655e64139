//! `train.tensorboard_dir`: TensorBoard scalars, in the event file format
//! `tensorboard --logdir` reads: TFRecord records (length, masked CRC-32C of
//! the length, data, masked CRC-32C of the data), each an `Event` protobuf
//! (TensorFlow's `event.proto` / `summary.proto`, the fields used here
//! encoded with prost).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::TrainError;

/// `tensorflow.Event`: wall_time = 1, step = 2, file_version = 3, summary = 5.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`: value = 1 (repeated).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: tag = 1, simple_value = 2.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// TFRecord's CRC: CRC-32C, rotated and offset ("masked").
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One run's event file.
pub struct TensorBoard {
    path: PathBuf,
    out: BufWriter<File>,
}

fn now_secs() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoard {
    /// A new event file in `dir` (made if missing), named as TensorFlow
    /// names them (`events.out.tfevents.<secs>.<host>.<pid>`).
    pub fn create(dir: &Path) -> Result<TensorBoard, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!("events.out.tfevents.{}.{}.{}.sparrow", now_secs() as u64, host.trim(), std::process::id());
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| TrainError::io(&path, e))?;
        let mut board = TensorBoard { path, out: BufWriter::new(file) };
        board.write(&Event {
            wall_time: now_secs(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(board)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars (`tag`, value) at `step`, flushed so a running TensorBoard sees them.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), TrainError> {
        let value = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| SummaryValue { tag: (*tag).to_string(), simple_value: Some(*v as f32) })
            .collect();
        let event =
            Event { wall_time: now_secs(), step: step as i64, file_version: None, summary: Some(Summary { value }) };
        self.write(&event)
    }

    fn write(&mut self, event: &Event) -> Result<(), TrainError> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.out.write_all(&record).and_then(|()| self.out.flush()).map_err(|e| TrainError::io(&self.path, e))
    }
}

/// Reads an event file back: every event, each record's CRCs checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>, TrainError> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::io(path, e))?;
    let bad = |what: &str| TrainError::checkpoint(path, format!("not a TensorBoard event file: {what}"));
    let (mut events, mut at) = (Vec::new(), 0usize);
    while at < bytes.len() {
        let header = bytes.get(at..at + 12).ok_or_else(|| bad("a truncated record header"))?;
        let len_bytes: [u8; 8] = header[..8].try_into().map_err(|_| bad("header"))?;
        if u32::from_le_bytes(header[8..12].try_into().map_err(|_| bad("header"))?) != masked_crc(&len_bytes) {
            return Err(bad("a length's checksum does not match"));
        }
        let len = u64::from_le_bytes(len_bytes) as usize;
        let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| bad("a truncated record"))?;
        let crc = bytes.get(at + 12 + len..at + 16 + len).ok_or_else(|| bad("a truncated record"))?;
        if u32::from_le_bytes(crc.try_into().map_err(|_| bad("crc"))?) != masked_crc(data) {
            return Err(bad("a record's checksum does not match"));
        }
        events.push(Event::decode(data).map_err(|e| bad(&e.to_string()))?);
        at += 16 + len;
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's check value ("123456789" → 0xE3069283), masked as TFRecord masks it.
    #[test]
    fn the_record_checksum_is_tfrecords() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn scalars_read_back() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut board = TensorBoard::create(tmp.path()).expect("create");
        board.scalars(5, &[("train/logloss", 0.5), ("test/auc", 0.75), ("skipped", f64::NAN)]).expect("write");
        board.scalars(10, &[("train/logloss", 0.25)]).expect("write");
        let events = read_events(board.path()).expect("read");
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let first = events[1].summary.as_ref().expect("summary");
        assert_eq!(events[1].step, 5);
        let tags: Vec<(&str, Option<f32>)> = first.value.iter().map(|v| (v.tag.as_str(), v.simple_value)).collect();
        assert_eq!(tags, [("train/logloss", Some(0.5)), ("test/auc", Some(0.75))]);
        assert_eq!(events[2].step, 10);

        // A flipped byte is found.
        let mut bytes = std::fs::read(board.path()).expect("bytes");
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(board.path(), bytes).expect("write");
        assert!(read_events(board.path()).is_err());
    }
}
