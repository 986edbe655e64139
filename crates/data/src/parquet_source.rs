//! Parquet input (arrow-rs `parquet` crate, record API): the same schema
//! mapping as CSV; list columns are multi-hot fields. Rows are streamed row
//! group by row group, so memory stays bounded by one row group.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use sparrow_core::Config;
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::config::DenseScale;
use sparrow_core::{Batch, feature_key};

use crate::error::{BadRows, DataError};
use crate::labels::LabelRules;
use crate::layout::DataLayout;
use crate::source::BatchSource;

pub struct ParquetSource {
    path: PathBuf,
    rows: RowIter<'static>,
    layout: DataLayout,
    /// The label columns, one per task, and how their cells read.
    labels: Vec<usize>,
    rules: LabelRules,
    /// `data.schema.sequence`: column, the sparse field whose keys its IDs
    /// take, `max_len`.
    sequences: Vec<(usize, u32, usize)>,
    /// What separates a sequence's IDs in a string cell.
    separator: String,
    dense: Vec<(usize, String)>,
    sparse: Vec<usize>,
    scale: DenseScale,
    /// `[[data.schema.buckets]]`: each sparse field's boundaries, if bucketized.
    buckets: Vec<Option<Vec<f64>>>,
    /// Index of the next row (0-based).
    next_row: u64,
    bad: BadRows,
    /// `schema.timestamp`'s column and name; rows dated after `now` are malformed.
    timestamp: Option<(usize, String)>,
    now: i64,
    /// `[data.weighting]`, on the training file.
    weigher: Option<crate::weighting::Weigher>,
    /// `data.validation = <fraction>`: the rows this reader leaves out.
    holdout: Option<crate::holdout::Holdout>,
}

/// A label or dense column must hold one number (or a string of one) per
/// row: any other type is refused once, for the schema, instead of once per row.
fn check_scalar_column(
    path: &Path,
    names: &[String],
    types: &[ColumnType],
    col: usize,
    role: &str,
) -> Result<(), DataError> {
    use parquet::basic::{Repetition, Type as Physical};
    let t = &types[col];
    let problem = if !t.is_primitive() {
        Some("a group or list".to_string())
    } else if t.get_basic_info().repetition() == Repetition::REPEATED {
        Some("a repeated column".to_string())
    } else {
        match t.get_physical_type() {
            Physical::BOOLEAN | Physical::INT32 | Physical::INT64 | Physical::FLOAT | Physical::DOUBLE => None,
            Physical::BYTE_ARRAY => None,
            other => Some(format!("of type {other}")),
        }
    };
    match problem {
        None => Ok(()),
        Some(p) => Err(DataError::Schema {
            path: path.to_path_buf(),
            message: format!("column `{}` ({role}) is {p}; it must hold a number or a string per row", names[col]),
        }),
    }
}

type ColumnType = std::sync::Arc<parquet::schema::types::Type>;

fn open_rows(path: &Path) -> Result<(RowIter<'static>, Vec<String>), DataError> {
    let (rows, names, _) = open_rows_typed(path)?;
    Ok((rows, names))
}

thread_local! {
    static GUARDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside a call into the parquet library whose panic
/// becomes an error: a binary's panic hook may stay silent for it (the error
/// that follows says what happened).
pub fn panic_is_handled() -> bool {
    GUARDING.get()
}

/// Runs a call into the parquet library, turning a panic into an error: the
/// library panics on some malformed files (fuzzing found a footer whose
/// schema length overflows an allocation), and a bad file must be an error
/// naming it, never a crash. Its state is dropped with the failed call.
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T, DataError>) -> Result<T, DataError> {
    GUARDING.set(true);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDING.set(false);
    outcome.unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(DataError::Parquet {
            path: path.to_path_buf(),
            message: format!("malformed file (the parquet reader failed: {why})"),
        })
    })
}

fn open_rows_typed(path: &Path) -> Result<(RowIter<'static>, Vec<String>, Vec<ColumnType>), DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let reader = guarded(path, || {
        SerializedFileReader::new(file)
            .map_err(|e| DataError::Parquet { path: path.to_path_buf(), message: e.to_string() })
    })?;
    let types: Vec<ColumnType> = reader.metadata().file_metadata().schema_descr().root_schema().get_fields().to_vec();
    let names = types.iter().map(|f| f.name().to_string()).collect();
    Ok((reader.into_iter(), names, types))
}

impl ParquetSource {
    pub fn open(path: &Path, job: &Config, bad: BadRows) -> Result<ParquetSource, DataError> {
        let config = &job.data;
        let schema = config.schema.clone().unwrap_or_default();
        let (rows, names, types) = open_rows_typed(path)?;
        let find = |name: &str| {
            names.iter().position(|n| n == name).ok_or_else(|| DataError::Schema {
                path: path.to_path_buf(),
                message: format!("column `{name}` is not in the file ({})", names.join(",")),
            })
        };
        let rules = LabelRules::of(job);
        let labels: Vec<usize> = rules.names().map(find).collect::<Result<_, DataError>>()?;
        let dense: Vec<(usize, String)> =
            schema.dense.iter().map(|n| Ok((find(n)?, n.clone()))).collect::<Result<_, DataError>>()?;
        let sparse = schema.sparse.iter().map(|n| find(n)).collect::<Result<_, DataError>>()?;
        for &label in &labels {
            check_scalar_column(path, &names, &types, label, "a label")?;
        }
        let sequences = schema
            .sequence
            .iter()
            .map(|q| {
                let table = schema.sparse.iter().position(|s| *s == q.table).unwrap_or_default();
                Ok((find(&q.field)?, table as u32, q.max_len))
            })
            .collect::<Result<_, DataError>>()?;
        for (col, _) in &dense {
            check_scalar_column(path, &names, &types, *col, "a dense value")?;
        }
        let timestamp = schema.timestamp.as_ref().map(|n| Ok::<_, DataError>((find(n)?, n.clone()))).transpose()?;
        let mut source = ParquetSource {
            path: path.to_path_buf(),
            rows,
            layout: DataLayout::from_config(config),
            labels,
            rules,
            sequences,
            separator: schema.multi_hot_separator.clone().unwrap_or_else(|| "|".into()),
            dense,
            sparse,
            scale: schema.dense_scale(),
            buckets: schema.bucket_boundaries(),
            next_row: 0,
            bad,
            timestamp,
            now: crate::weighting::now_secs(),
            weigher: None,
            holdout: crate::holdout::Holdout::of(job, path),
        };
        let is_train = config.train.as_deref().is_some_and(|t| Path::new(t) == path);
        if let (Some(cfg), true) = (&config.weighting, is_train) {
            let reference = match cfg.reference_time {
                Some(t) => t,
                None => source.newest_timestamp()?,
            };
            let counters = source.bad.weighting.clone();
            source.weigher = Some(crate::weighting::Weigher::new(cfg.clone(), reference, counters));
        }
        Ok(source)
    }

    /// The row's time from the timestamp column: Unix seconds as a number, a
    /// string of one, or a Parquet timestamp (millis, micros); not in the future.
    fn timestamp_of(&self, cols: &[&Field]) -> Result<Option<i64>, String> {
        let Some((col, name)) = &self.timestamp else { return Ok(None) };
        let f = cols.get(*col).ok_or("row is shorter than the schema")?;
        let ts = match f {
            Field::TimestampMillis(ms) => ms.div_euclid(1000),
            Field::TimestampMicros(us) => us.div_euclid(1_000_000),
            Field::Str(s) => match s.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v.abs() < 9e15 => v.floor() as i64,
                _ => return Err(format!("column {name}: `{s}` is not a time in Unix seconds")),
            },
            other => match number(other) {
                Some(v) if v.is_finite() && v.abs() < 9e15 => v.floor() as i64,
                _ => return Err(format!("column {name}: `{other}` is not a time in Unix seconds")),
            },
        };
        crate::weighting::check_time(ts, self.now, name).map(Some)
    }

    /// The newest valid timestamp in the file (the weighting's default
    /// reference time): one pass over the rows, invalid ones skipped.
    fn newest_timestamp(&self) -> Result<i64, DataError> {
        let (mut rows, _) = open_rows(&self.path)?;
        let mut newest: Option<i64> = None;
        while let Some(row) = guarded(&self.path, || Ok(rows.next()))? {
            let Ok(row) = row else { break };
            let cols: Vec<&Field> = row.get_column_iter().map(|(_, f)| f).collect();
            if let Ok(Some(ts)) = self.timestamp_of(&cols) {
                newest = Some(newest.map_or(ts, |m| m.max(ts)));
            }
        }
        newest.ok_or_else(|| DataError::Schema {
            path: self.path.clone(),
            message: "[data.weighting]: no row has a valid timestamp (set data.weighting.reference_time?)".into(),
        })
    }

    fn parse_row(&self, row: &Row, out: &mut BatchBuilder) -> Result<f32, String> {
        let cols: Vec<&Field> = row.get_column_iter().map(|(_, f)| f).collect();
        let mut label = 0.0;
        for (task, &col) in self.labels.iter().enumerate() {
            let value = match cols.get(col).ok_or("row is shorter than the schema")? {
                Field::Str(s) => self.rules.read(task, s.as_bytes())?,
                Field::Null if self.rules.masking() => f32::NAN,
                other => match number(other) {
                    Some(v) => self.rules.read_number(task, v)?,
                    None if task == 0 && !self.rules.masking() => {
                        return Err(format!("label `{other}` is not 0/1 or -1/+1"));
                    }
                    None => return Err(format!("label `{other}` of task {task} is not a number")),
                },
            };
            if task == 0 {
                label = value;
            } else {
                out.push_label(value);
            }
        }
        if let Some(ts) = self.timestamp_of(&cols)? {
            out.set_timestamp(ts);
        }
        for (i, (col, name)) in self.dense.iter().enumerate() {
            let f = cols.get(*col).ok_or("row is shorter than the schema")?;
            let v = match f {
                Field::Null => 0.0,
                Field::Str(s) => {
                    s.trim().parse::<f64>().map_err(|_| format!("column {name}: `{s}` is not a number"))?
                }
                other => number(other).ok_or_else(|| format!("column {name}: `{other}` is not a number"))?,
            };
            if !v.is_finite() {
                return Err(format!("column {name}: value is not finite"));
            }
            out.push_dense(self.scale.apply(i, v) as f32);
        }
        for (fi, &col) in self.sparse.iter().enumerate() {
            let f = cols.get(col).ok_or("row is shorter than the schema")?;
            if let Some(boundaries) = &self.buckets[fi] {
                let raw = if matches!(f, Field::Null) { Vec::new() } else { id_bytes(f) };
                let id = sparrow_core::config::bucket_id(boundaries, &raw).map_err(|e| format!("column {col}: {e}"))?;
                out.push_key(fi, feature_key(fi as u32, id.as_bytes()), 1.0);
                continue;
            }
            match f {
                Field::ListInternal(list) => {
                    for e in list.elements() {
                        if !matches!(e, Field::Null) {
                            out.push_key(fi, feature_key(fi as u32, &id_bytes(e)), 1.0);
                        }
                    }
                }
                other => {
                    out.push_key(fi, feature_key(fi as u32, &id_bytes(other)), 1.0);
                }
            }
        }
        let first = self.sparse.len();
        for (j, &(col, table, max_len)) in self.sequences.iter().enumerate() {
            // A list column, or a string of IDs between separators; newest last.
            let ids: Vec<Vec<u8>> = match cols.get(col).ok_or("row is shorter than the schema")? {
                Field::ListInternal(list) => {
                    list.elements().iter().filter(|e| !matches!(e, Field::Null)).map(id_bytes).collect()
                }
                Field::Null => Vec::new(),
                Field::Str(s) => s
                    .split(self.separator.as_str())
                    .filter(|id| !id.is_empty())
                    .map(|id| id.as_bytes().to_vec())
                    .collect(),
                other => vec![id_bytes(other)],
            };
            let ids: Vec<&[u8]> = ids.iter().map(Vec::as_slice).collect();
            crate::text::push_sequence(out, first + j, table, max_len, &ids);
        }
        Ok(label)
    }
}

fn number(f: &Field) -> Option<f64> {
    Some(match *f {
        Field::Bool(b) => f64::from(u8::from(b)),
        Field::Byte(v) => f64::from(v),
        Field::Short(v) => f64::from(v),
        Field::Int(v) => f64::from(v),
        Field::Long(v) => v as f64,
        Field::UByte(v) => f64::from(v),
        Field::UShort(v) => f64::from(v),
        Field::UInt(v) => f64::from(v),
        Field::ULong(v) => v as f64,
        Field::Float(v) => f64::from(v),
        Field::Double(v) => v,
        _ => return None,
    })
}

/// The raw value that is hashed into a key: strings and bytes as they are,
/// everything else by its display form (so `7` in Int and Long is the same ID).
fn id_bytes(f: &Field) -> Vec<u8> {
    match f {
        Field::Null => Vec::new(),
        Field::Str(s) => s.as_bytes().to_vec(),
        Field::Bytes(b) => b.data().to_vec(),
        other => other.to_string().into_bytes(),
    }
}

impl BatchSource for ParquetSource {
    fn layout(&self) -> &DataLayout {
        &self.layout
    }

    fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
        let (rows, _) = open_rows(&self.path)?;
        self.rows = rows;
        self.next_row = 0;
        if let Some(w) = self.weigher.as_mut() {
            w.seek(pos);
        }
        while self.next_row < pos.offset {
            match guarded(&self.path, || Ok(self.rows.next()))? {
                None => break,
                Some(Err(e)) => {
                    return Err(DataError::Parquet { path: self.path.clone(), message: e.to_string() });
                }
                Some(Ok(_)) => self.next_row += 1,
            }
        }
        Ok(())
    }

    fn next_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError> {
        let mut weigher = self.weigher.take();
        let next = crate::weighting::next_weighted(weigher.as_mut(), batch_size, |n| self.read_batch(n, epoch));
        self.weigher = weigher;
        next
    }
}

impl ParquetSource {
    fn read_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError> {
        let mut b = self.layout.builder(batch_size);
        while b.rows() < batch_size {
            let row = match guarded(&self.path, || Ok(self.rows.next()))? {
                None => break,
                Some(Err(e)) => {
                    return Err(DataError::Parquet { path: self.path.clone(), message: e.to_string() });
                }
                Some(Ok(row)) => row,
            };
            self.next_row += 1;
            if self.holdout.is_some_and(|h| h.skips(self.next_row)) {
                continue;
            }
            b.begin_row();
            let ok = self
                .parse_row(&row, &mut b)
                .and_then(|label| b.end_row(label).then_some(()).ok_or_else(|| "wrong number of dense values".into()));
            if let Err(reason) = ok {
                b.rollback_row();
                self.bad.record(&self.path, self.next_row, format!("row {}: {reason}", self.next_row))?;
            }
        }
        if b.rows() == 0 {
            return Ok(None);
        }
        self.bad.record_good(b.rows() as u64);
        Ok(Some(b.finish(DataPosition { epoch, offset: self.next_row, line: self.next_row + 1, skip: 0 })))
    }
}
