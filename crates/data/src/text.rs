//! Line-oriented formats: Criteo TSV, CSV (with a schema), libsvm, libffm.
//! Each parser turns one line into one row of a [`BatchBuilder`] or explains
//! why it cannot; the caller counts the bad row and rolls it back.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use sparrow_core::Config;
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::config::{DataFormat, DenseScale, Schema};

use crate::labels::{LabelRules, parse_label};
use sparrow_core::{Batch, feature_key};

use crate::error::{BadRows, DataError};
use crate::input::TextInput;
use crate::layout::{CRITEO_DENSE, CRITEO_SPARSE, DataLayout};
use crate::source::BatchSource;

pub trait LineParser: Send {
    /// Parses `line` (no trailing newline) into the builder's current row.
    fn parse(&mut self, line: &[u8], out: &mut BatchBuilder) -> Result<f32, String>;

    /// Whether a last line that ends without a newline is whole rather than
    /// cut off by a truncated file (then it counts as malformed): Criteo, when
    /// it parses; CSV, when every column of the header is there; never for
    /// libsvm/libffm, whose rows have no fixed length (a cut one looks whole).
    fn whole_without_newline(&self, _line: &[u8]) -> bool {
        false
    }

    /// A row dated after `now` (Unix seconds) is malformed: a stream that
    /// runs for days moves its parser's clock along.
    fn set_now(&mut self, _now: i64) {}
}

fn ascii(raw: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(raw).map_err(|_| "not valid UTF-8".to_string())
}

/// Criteo's integer transform: log(1 + max(x, 0)).
#[inline]
pub fn criteo_dense(x: f64) -> f32 {
    (x.max(0.0)).ln_1p() as f32
}

/// log(1 + x) for the small integers that make up most Criteo values, so the
/// reader does not call `log1p` 13 times per row.
struct Log1pTable([f32; 1024]);

impl Log1pTable {
    fn new() -> Self {
        Log1pTable(std::array::from_fn(|i| criteo_dense(i as f64)))
    }

    #[inline]
    fn get(&self, x: i64) -> f32 {
        match usize::try_from(x) {
            Ok(i) if i < self.0.len() => self.0[i],
            _ => criteo_dense(x as f64),
        }
    }
}

/// A decimal integer (optional sign, ASCII digits only); `None` otherwise.
#[inline]
pub(crate) fn parse_int(raw: &[u8]) -> Option<i64> {
    let (neg, digits) = match raw.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, raw),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v * 10 + i64::from(d - b'0');
    }
    Some(if neg { -v } else { v })
}

/// Criteo TSV: label, 13 integer columns, 26 categorical columns. Short rows
/// are padded with empty (missing) values; an empty categorical value is the
/// field's "missing" key, an empty integer is 0.
pub struct CriteoParser {
    log1p: Log1pTable,
}

impl Default for CriteoParser {
    fn default() -> Self {
        CriteoParser { log1p: Log1pTable::new() }
    }
}

impl LineParser for CriteoParser {
    fn parse(&mut self, line: &[u8], out: &mut BatchBuilder) -> Result<f32, String> {
        let mut cols = line.split(|&b| b == b'\t');
        let label = parse_label(cols.next().unwrap_or_default())?;
        for i in 0..CRITEO_DENSE {
            let raw = cols.next().unwrap_or_default();
            let v = if raw.is_empty() {
                0
            } else {
                parse_int(raw)
                    .ok_or_else(|| format!("column I{}: `{}` is not an integer", i + 1, String::from_utf8_lossy(raw)))?
            };
            out.push_dense(self.log1p.get(v));
        }
        let keys: [u64; CRITEO_SPARSE] =
            std::array::from_fn(|f| feature_key(f as u32, cols.next().unwrap_or_default()));
        if cols.next().is_some() {
            return Err(format!("more than {} columns", 1 + CRITEO_DENSE + CRITEO_SPARSE));
        }
        if !out.push_key_per_field(&keys) {
            return Err(format!("a batch of {} fields for Criteo's {CRITEO_SPARSE}", out.num_fields()));
        }
        Ok(label)
    }

    /// Criteo's own files end without a newline and cut trailing empty
    /// columns (the Kaggle sample in `testdata/` does both), so a last line
    /// is whole when it parses: a file cut exactly at a tab cannot be told
    /// from such a row.
    fn whole_without_newline(&self, _line: &[u8]) -> bool {
        true
    }
}

/// Splits a CSV line on `delim`, honouring double quotes ("" is a quote).
pub fn split_csv<'a>(line: &'a [u8], delim: u8, cells: &mut Vec<std::borrow::Cow<'a, [u8]>>) -> Result<(), String> {
    use std::borrow::Cow;
    cells.clear();
    let mut i = 0;
    loop {
        if i < line.len() && line[i] == b'"' {
            let mut cell = Vec::new();
            i += 1;
            loop {
                match line.get(i) {
                    None => return Err("unterminated quoted cell".into()),
                    Some(b'"') if line.get(i + 1) == Some(&b'"') => {
                        cell.push(b'"');
                        i += 2;
                    }
                    Some(b'"') => {
                        i += 1;
                        break;
                    }
                    Some(&b) => {
                        cell.push(b);
                        i += 1;
                    }
                }
            }
            cells.push(Cow::Owned(cell));
            match line.get(i) {
                None => return Ok(()),
                Some(&b) if b == delim => i += 1,
                Some(_) => return Err("text after a closing quote".into()),
            }
        } else {
            let end = line[i..].iter().position(|&b| b == delim).map(|p| i + p);
            match end {
                Some(e) => {
                    cells.push(Cow::Borrowed(&line[i..e]));
                    i = e + 1;
                }
                None => {
                    cells.push(Cow::Borrowed(&line[i..]));
                    return Ok(());
                }
            }
        }
    }
}

/// A behaviour sequence's column in a CSV row.
#[derive(Clone, Copy, Debug)]
struct SequenceColumn {
    col: usize,
    /// The sparse field whose keys its IDs take.
    table: u32,
    max_len: usize,
}

/// Where each schema column sits in a CSV row.
pub struct CsvParser {
    delim: u8,
    /// The label columns, one per task, and how their cells read.
    labels: Vec<usize>,
    rules: LabelRules,
    /// `data.schema.sequence`: each one's column, the sparse field whose
    /// table its IDs share (their keys are that field's) and `max_len`.
    sequences: Vec<SequenceColumn>,
    dense: Vec<(usize, String)>,
    sparse: Vec<usize>,
    multi_hot: Option<Vec<u8>>,
    scale: DenseScale,
    /// `[[data.schema.buckets]]`: each sparse field's boundaries, if
    /// bucketized, and the fields' names (an error names the column).
    buckets: Vec<Option<Vec<f64>>>,
    sparse_names: Vec<String>,
    width: usize,
    /// Columns a whole row has: the header's, else the schema's widest.
    columns: usize,
    /// The timestamp column (`schema.timestamp`) and its name.
    timestamp: Option<(usize, String)>,
    /// Rows dated after this (the time the file was opened) are malformed.
    now: i64,
}

impl CsvParser {
    /// `header` is the first line when the schema says there is one.
    pub fn new(path: &Path, schema: &Schema, header: Option<&[u8]>) -> Result<CsvParser, DataError> {
        let delim = schema.delimiter.as_bytes()[0];
        let schema_err = |message: String| DataError::Schema { path: path.to_path_buf(), message };
        let names: Vec<String> = match header {
            Some(h) => {
                let mut cells = Vec::new();
                split_csv(h, delim, &mut cells).map_err(|e| schema_err(format!("header: {e}")))?;
                cells.iter().map(|c| String::from_utf8_lossy(c).trim().to_string()).collect()
            }
            None => Vec::new(),
        };
        let find = |name: &str| -> Result<usize, DataError> {
            if header.is_some() {
                names
                    .iter()
                    .position(|n| n == name)
                    .ok_or_else(|| schema_err(format!("column `{name}` is not in the header ({})", names.join(","))))
            } else {
                name.parse::<usize>()
                    .map_err(|_| schema_err(format!("without a header, column `{name}` must be a column number")))
            }
        };
        let rules = LabelRules::binary_of(schema);
        let labels = rules.names().map(find).collect::<Result<Vec<_>, DataError>>()?;
        let dense = schema.dense.iter().map(|n| Ok((find(n)?, n.clone()))).collect::<Result<Vec<_>, DataError>>()?;
        let sparse = schema.sparse.iter().map(|n| find(n)).collect::<Result<Vec<_>, DataError>>()?;
        let timestamp = schema.timestamp.as_ref().map(|n| Ok::<_, DataError>((find(n)?, n.clone()))).transpose()?;
        let sequences = schema
            .sequence
            .iter()
            .map(|q| {
                let table = schema.sparse.iter().position(|s| *s == q.table).ok_or_else(|| {
                    schema_err(format!("sequence `{}`: table `{}` is not a sparse field", q.field, q.table))
                })?;
                Ok(SequenceColumn { col: find(&q.field)?, table: table as u32, max_len: q.max_len })
            })
            .collect::<Result<Vec<_>, DataError>>()?;
        let width = labels
            .iter()
            .copied()
            .chain(dense.iter().map(|d| d.0))
            .chain(sparse.iter().copied())
            .chain(sequences.iter().map(|q| q.col))
            .chain(timestamp.iter().map(|t| t.0))
            .max()
            .unwrap_or(0)
            + 1;
        let columns = if header.is_some() { names.len().max(width) } else { width };
        Ok(CsvParser {
            columns,
            delim,
            labels,
            rules,
            sequences,
            dense,
            sparse,
            multi_hot: schema.multi_hot_separator.as_ref().map(|s| s.as_bytes().to_vec()),
            scale: schema.dense_scale(),
            buckets: schema.bucket_boundaries(),
            sparse_names: schema.sparse.clone(),
            width,
            timestamp,
            now: crate::weighting::now_secs(),
        })
    }

    /// Reads its label columns as `rules` says (a job's tasks: the
    /// multiclass ones' class ids); `rules` names the schema's label columns.
    pub fn with_rules(mut self, rules: LabelRules) -> Self {
        debug_assert!(rules.names().eq(self.rules.names()), "the schema's label columns");
        self.rules = rules;
        self
    }

    /// The row's time from the timestamp column: Unix seconds (an integer, or
    /// a decimal whose fraction is dropped), not after the file was opened.
    fn timestamp_of(&self, cells: &[std::borrow::Cow<'_, [u8]>]) -> Result<Option<i64>, String> {
        let Some((col, name)) = &self.timestamp else { return Ok(None) };
        let raw = cells.get(*col).map(|c| c.as_ref()).unwrap_or_default();
        let text = ascii(raw)?.trim();
        let ts = match parse_int(text.as_bytes()) {
            Some(v) => v,
            None => match text.parse::<f64>() {
                Ok(v) if v.is_finite() && v.abs() < 9e15 => v.floor() as i64,
                _ => return Err(format!("column {name}: `{text}` is not a time in Unix seconds")),
            },
        };
        crate::weighting::check_time(ts, self.now, name).map(Some)
    }

    /// The newest valid timestamp of a CSV line (the weighting's default reference time).
    pub fn line_timestamp(&self, line: &[u8]) -> Option<i64> {
        let mut cells = Vec::with_capacity(self.width);
        split_csv(line, self.delim, &mut cells).ok()?;
        self.timestamp_of(&cells).ok().flatten()
    }
}

impl LineParser for CsvParser {
    fn set_now(&mut self, now: i64) {
        self.now = now;
    }

    fn parse(&mut self, line: &[u8], out: &mut BatchBuilder) -> Result<f32, String> {
        let mut cells = Vec::with_capacity(self.width);
        split_csv(line, self.delim, &mut cells)?;
        if cells.len() < self.width {
            return Err(format!("{} columns, the schema needs at least {}", cells.len(), self.width));
        }
        let label = self.rules.read(0, cells[self.labels[0]].as_ref())?;
        for (task, &col) in self.labels.iter().enumerate().skip(1) {
            out.push_label(self.rules.read(task, cells[col].as_ref())?);
        }
        if let Some(ts) = self.timestamp_of(&cells)? {
            out.set_timestamp(ts);
        }
        for (i, (col, name)) in self.dense.iter().enumerate() {
            let raw = cells[*col].as_ref();
            let v = if raw.is_empty() {
                0.0
            } else {
                ascii(raw)?
                    .trim()
                    .parse::<f32>()
                    .map_err(|_| format!("column {name}: `{}` is not a number", String::from_utf8_lossy(raw)))?
            };
            if !v.is_finite() {
                return Err(format!("column {name}: value is not finite"));
            }
            out.push_dense(self.scale.apply(i, f64::from(v)) as f32);
        }
        for (f, &col) in self.sparse.iter().enumerate() {
            let raw = cells[col].as_ref();
            if let Some(boundaries) = &self.buckets[f] {
                let id = sparrow_core::config::bucket_id(boundaries, raw)
                    .map_err(|e| format!("column {}: {e}", self.sparse_names[f]))?;
                out.push_key(f, feature_key(f as u32, id.as_bytes()), 1.0);
                continue;
            }
            match &self.multi_hot {
                Some(sep) => {
                    for id in split_bytes(raw, sep).filter(|s| !s.is_empty()) {
                        out.push_key(f, feature_key(f as u32, id), 1.0);
                    }
                }
                None => {
                    out.push_key(f, feature_key(f as u32, raw), 1.0);
                }
            }
        }
        let first = self.sparse.len();
        for (j, q) in self.sequences.iter().enumerate() {
            // A sequence is a list however the sparse fields are read.
            let sep = self.multi_hot.as_deref().unwrap_or(b"|");
            let ids: Vec<&[u8]> = split_bytes(cells[q.col].as_ref(), sep).filter(|s| !s.is_empty()).collect();
            push_sequence(out, first + j, q.table, q.max_len, &ids);
        }
        Ok(label)
    }

    fn whole_without_newline(&self, line: &[u8]) -> bool {
        let mut cells = Vec::new();
        split_csv(line, self.delim, &mut cells).is_ok() && cells.len() >= self.columns
    }
}

/// A behaviour sequence's IDs (oldest first, none empty) as the readers
/// push them: the newest `max_len`, keyed as sparse field `table`, into
/// bag `slot`; a longer list is counted as truncated.
pub fn push_sequence(out: &mut BatchBuilder, slot: usize, table: u32, max_len: usize, ids: &[&[u8]]) {
    let cut = ids.len().saturating_sub(max_len);
    if cut > 0 {
        out.count_truncated_sequence();
    }
    for id in &ids[cut..] {
        out.push_key(slot, feature_key(table, id), 1.0);
    }
}

/// `s` cut at every `sep` (all of `s` for an empty `sep`): a multi-hot
/// cell's or a history's IDs.
pub fn split_bytes<'a>(s: &'a [u8], sep: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut rest = Some(s);
    std::iter::from_fn(move || {
        let r = rest?;
        // A one-byte separator (the usual `|`) is found a byte at a time:
        // comparing every window as a slice was a `memcmp` call a byte,
        // a third of the reader's time on a file with histories.
        let found = match sep {
            [b] => r.iter().position(|c| c == b),
            _ => r.windows(sep.len().max(1)).position(|w| w == sep),
        };
        match found {
            Some(p) if !sep.is_empty() => {
                rest = Some(&r[p + sep.len()..]);
                Some(&r[..p])
            }
            _ => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// libsvm (`label idx:val …`, one multi-hot field) and libffm
/// (`label field:idx:val …`). Values become key weights.
pub struct SvmParser {
    /// `Some(n)` for libffm with n fields.
    ffm_fields: Option<usize>,
    scratch: Vec<(usize, u64, f32)>,
}

impl SvmParser {
    pub fn libsvm() -> Self {
        SvmParser { ffm_fields: None, scratch: Vec::new() }
    }
    pub fn libffm(num_fields: usize) -> Self {
        SvmParser { ffm_fields: Some(num_fields), scratch: Vec::new() }
    }
}

impl LineParser for SvmParser {
    fn parse(&mut self, line: &[u8], out: &mut BatchBuilder) -> Result<f32, String> {
        let text = ascii(line)?;
        let mut tokens = text.split_ascii_whitespace();
        let label = parse_label(tokens.next().unwrap_or_default().as_bytes())?;
        self.scratch.clear();
        for tok in tokens {
            let (feature, val) = tok.rsplit_once(':').ok_or_else(|| format!("token `{tok}` is not idx:val"))?;
            let w: f32 = val.parse().map_err(|_| format!("token `{tok}`: `{val}` is not a number"))?;
            if !w.is_finite() {
                return Err(format!("token `{tok}`: value is not finite"));
            }
            let (field, idx) = match self.ffm_fields {
                None => (0, feature),
                Some(n) => {
                    let (f, idx) =
                        feature.split_once(':').ok_or_else(|| format!("token `{tok}` is not field:idx:val"))?;
                    let f: usize = f.parse().map_err(|_| format!("token `{tok}`: field `{f}` is not a number"))?;
                    if f >= n {
                        return Err(format!("token `{tok}`: field {f} is not below data.num_fields = {n}"));
                    }
                    (f, idx)
                }
            };
            if idx.is_empty() {
                return Err(format!("token `{tok}` has an empty index"));
            }
            self.scratch.push((field, feature_key(field as u32, idx.as_bytes()), w));
        }
        // Fields may come in any order; the builder wants them ascending.
        self.scratch.sort_by_key(|e| e.0);
        for &(f, k, w) in &self.scratch {
            out.push_key(f, k, w);
        }
        Ok(label)
    }
}

/// Longest line accepted; a longer one is a malformed row (a file that is
/// not line-oriented at all must not be read into memory in one piece).
pub const MAX_LINE_BYTES: u64 = 1 << 20;
/// A line longer than [`MAX_LINE_BYTES`] is skipped as a bad row, but one
/// past this has no end in sight: the file is refused.
const MAX_SKIPPED_LINE_BYTES: u64 = 1 << 30;

const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// The parser of one row in `format` outside a file (a stream record's
/// value): CSV takes its column names from `header` when the schema reads
/// a header line. `origin` names the source in schema errors.
pub fn row_parser(
    format: DataFormat,
    job: &Config,
    header: Option<&str>,
    origin: &Path,
) -> Result<Box<dyn LineParser>, DataError> {
    let config = &job.data;
    let layout = DataLayout::from_config(config);
    Ok(match format {
        DataFormat::Criteo => Box::new(CriteoParser::default()),
        DataFormat::Libsvm => Box::new(SvmParser::libsvm()),
        DataFormat::Libffm => Box::new(SvmParser::libffm(layout.num_fields)),
        DataFormat::Csv => {
            let schema = config.schema.clone().unwrap_or_default();
            let header = header.filter(|_| schema.header).map(str::as_bytes);
            Box::new(CsvParser::new(origin, &schema, header)?.with_rules(LabelRules::of(job)))
        }
        DataFormat::Parquet => {
            return Err(DataError::Schema {
                path: origin.to_path_buf(),
                message: "parquet is not a text format".into(),
            });
        }
    })
}

/// A line-oriented file read sequentially, with its position tracked so a
/// resumed run can seek straight back to it.
pub struct TextSource {
    path: PathBuf,
    reader: TextInput,
    parser: Box<dyn LineParser>,
    layout: DataLayout,
    /// Offset of the first data line (after a CSV header).
    data_start: (u64, u64),
    offset: u64,
    line: u64,
    buf: Vec<u8>,
    bad: BadRows,
    /// `[data.weighting]`, on the training file.
    weigher: Option<crate::weighting::Weigher>,
    /// `data.validation = <fraction>`: the lines this reader leaves out.
    holdout: Option<crate::holdout::Holdout>,
}

impl TextSource {
    pub fn open(path: &Path, job: &Config, bad: BadRows) -> Result<TextSource, DataError> {
        let config = &job.data;
        let mut reader = TextInput::open(path)?;
        let layout = DataLayout::from_config(config);
        // A UTF-8 byte-order mark (Excel, Notepad) is not part of the first row.
        let head = reader.fill_buf().map_err(|e| DataError::io(path, e))?;
        let bom = if head.starts_with(UTF8_BOM) { UTF8_BOM.len() } else { 0 };
        reader.consume(bom);
        let mut data_start = (bom as u64, 1);
        let mut weigher = None;
        let parser: Box<dyn LineParser> = match config.format {
            DataFormat::Criteo => Box::new(CriteoParser::default()),
            DataFormat::Libsvm => Box::new(SvmParser::libsvm()),
            DataFormat::Libffm => Box::new(SvmParser::libffm(layout.num_fields)),
            DataFormat::Csv => {
                let schema = config.schema.clone().unwrap_or_default();
                let mut header = Vec::new();
                if schema.header {
                    let n = reader.read_until(b'\n', &mut header).map_err(|e| DataError::io(path, e))?;
                    if n == 0 {
                        return Err(DataError::Schema {
                            path: path.to_path_buf(),
                            message: "empty file, no header".into(),
                        });
                    }
                    data_start = (bom as u64 + n as u64, 2);
                }
                let h = trim_eol(&header);
                let parser = CsvParser::new(path, &schema, schema.header.then_some(h))?.with_rules(LabelRules::of(job));
                let is_train = config.train.as_deref().is_some_and(|t| Path::new(t) == path);
                if let (Some(cfg), true) = (&config.weighting, is_train) {
                    let reference = match cfg.reference_time {
                        Some(t) => t,
                        None => newest_timestamp(path, &parser)?,
                    };
                    weigher = Some(crate::weighting::Weigher::new(cfg.clone(), reference, bad.weighting.clone()));
                }
                Box::new(parser)
            }
            DataFormat::Parquet => {
                return Err(DataError::Schema {
                    path: path.to_path_buf(),
                    message: "parquet is not a text format".into(),
                });
            }
        };
        Ok(TextSource {
            path: path.to_path_buf(),
            reader,
            parser,
            layout,
            data_start,
            offset: data_start.0,
            line: data_start.1,
            buf: Vec::new(),
            bad,
            weigher,
            holdout: crate::holdout::Holdout::of(job, path),
        })
    }
}

/// The newest timestamp in a CSV file (one pass over its lines, malformed
/// ones skipped: the reading pass reports them).
fn newest_timestamp(path: &Path, parser: &CsvParser) -> Result<i64, DataError> {
    let mut input = TextInput::open(path)?;
    let mut line = Vec::new();
    let mut newest = None;
    loop {
        line.clear();
        let n = input.read_until(b'\n', &mut line).map_err(|e| DataError::io(path, e))?;
        if n == 0 {
            break;
        }
        if let Some(ts) = parser.line_timestamp(trim_eol(&line)) {
            newest = Some(newest.map_or(ts, |m: i64| m.max(ts)));
        }
    }
    newest.ok_or_else(|| DataError::Schema {
        path: path.to_path_buf(),
        message: "[data.weighting]: no row has a valid timestamp (set data.weighting.reference_time?)".into(),
    })
}

fn trim_eol(line: &[u8]) -> &[u8] {
    let mut l = line;
    while let Some((&last, rest)) = l.split_last() {
        if last == b'\n' || last == b'\r' {
            l = rest;
        } else {
            break;
        }
    }
    l
}

impl BatchSource for TextSource {
    fn layout(&self) -> &DataLayout {
        &self.layout
    }

    fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
        let (offset, line) = if pos.offset == 0 { self.data_start } else { (pos.offset, pos.line) };
        self.reader.seek(offset)?;
        self.offset = offset;
        self.line = line;
        if let Some(w) = self.weigher.as_mut() {
            w.seek(pos);
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

impl TextSource {
    fn read_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError> {
        let mut b = self.layout.builder(batch_size);
        while b.rows() < batch_size {
            self.buf.clear();
            let n = (&mut self.reader)
                .take(MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| DataError::io(&self.path, e))?;
            if n == 0 {
                break;
            }
            self.offset += n as u64;
            let line_no = self.line;
            self.line += 1;
            if n as u64 > MAX_LINE_BYTES && self.buf.last() != Some(&b'\n') {
                // Skip the rest of the line without holding it in memory,
                // up to a point: a gigabyte without a line break is no
                // line-oriented data (`/dev/zero` is endless).
                let mut skipped = n as u64;
                loop {
                    if skipped > MAX_SKIPPED_LINE_BYTES {
                        let why = format!(
                            "line {line_no}: more than {MAX_SKIPPED_LINE_BYTES} bytes without a line break: not a \
                             line-oriented data file"
                        );
                        return Err(DataError::io(
                            &self.path,
                            std::io::Error::new(std::io::ErrorKind::InvalidData, why),
                        ));
                    }
                    self.buf.clear();
                    let m = (&mut self.reader)
                        .take(1 << 20)
                        .read_until(b'\n', &mut self.buf)
                        .map_err(|e| DataError::io(&self.path, e))?;
                    self.offset += m as u64;
                    skipped += m as u64;
                    if m == 0 || self.buf.last() == Some(&b'\n') {
                        break;
                    }
                }
                let reason = format!("line of {skipped} bytes, more than the {MAX_LINE_BYTES}-byte limit");
                self.bad.record(&self.path, line_no, reason)?;
                continue;
            }
            let cut_short = self.buf.last() != Some(&b'\n');
            let line = trim_eol(&self.buf);
            if line.is_empty() || self.holdout.is_some_and(|h| h.skips(line_no)) {
                continue;
            }
            if cut_short && !self.parser.whole_without_newline(line) {
                let reason = "the last line has no newline and is not a whole row (a truncated file?)".to_string();
                self.bad.record(&self.path, line_no, reason)?;
                continue;
            }
            b.begin_row();
            let parsed = self.parser.parse(line, &mut b);
            let ok = match parsed {
                Ok(label) => b.end_row(label).then_some(()).ok_or_else(|| "wrong number of dense values".to_string()),
                Err(e) => Err(e),
            };
            if let Err(reason) = ok {
                b.rollback_row();
                self.bad.record(&self.path, line_no, reason)?;
            }
        }
        if b.rows() == 0 {
            return Ok(None);
        }
        self.bad.record_good(b.rows() as u64);
        Ok(Some(b.finish(DataPosition { epoch, offset: self.offset, line: self.line, skip: 0 })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-byte separator's search cuts every cell where the general
    /// one (every window compared) does: empty pieces, separators at
    /// either end, runs of them, and two-byte and empty separators.
    #[test]
    fn split_bytes_cuts_where_every_window_compared_does() {
        fn by_windows<'a>(s: &'a [u8], sep: &[u8]) -> Vec<&'a [u8]> {
            let (mut out, mut rest) = (Vec::new(), s);
            while let Some(p) = rest.windows(sep.len().max(1)).position(|w| w == sep).filter(|_| !sep.is_empty()) {
                out.push(&rest[..p]);
                rest = &rest[p + sep.len()..];
            }
            out.push(rest);
            out
        }
        let cells: [&[u8]; 9] = [b"", b"|", b"a", b"12|345|6", b"|12|", b"||", b"1||2", b"ab|:|cd|", b"x:|y"];
        for sep in [&b"|"[..], b":|", b""] {
            for cell in cells {
                let got: Vec<&[u8]> = split_bytes(cell, sep).collect();
                assert_eq!(got, by_windows(cell, sep), "{:?} by {:?}", String::from_utf8_lossy(cell), sep);
            }
        }
        assert_eq!(split_bytes(b"7|8|9", b"|").collect::<Vec<_>>(), [&b"7"[..], b"8", b"9"]);
    }

    fn one(
        parser: &mut dyn LineParser,
        fields: usize,
        dense: usize,
        weighted: bool,
        line: &str,
    ) -> Result<Batch, String> {
        let mut b = BatchBuilder::new(fields, dense, weighted, 1);
        b.begin_row();
        let label = parser.parse(line.as_bytes(), &mut b)?;
        if !b.end_row(label) {
            return Err("dense count".into());
        }
        Ok(b.finish(DataPosition::default()))
    }

    #[test]
    fn criteo_pads_short_rows_and_transforms_dense() {
        let b = one(&mut CriteoParser::default(), 26, 13, false, "1\t5\t\t-3\t\t\t\t\t\t\t\t\t\t\t68fd1e64\t80e26c9b")
            .expect("parses");
        assert_eq!(b.labels, vec![1.0]);
        assert!((b.dense[0] - 6f32.ln()).abs() < 1e-6);
        assert_eq!(b.dense[1], 0.0);
        assert_eq!(b.dense[2], 0.0, "negative clipped to 0");
        assert_eq!(b.keys.len(), 26);
        assert_eq!(b.keys[0], feature_key(0, b"68fd1e64"));
        assert_eq!(b.keys[25], feature_key(25, b""));
    }

    #[test]
    fn criteo_rejects_bad_rows_with_reasons() {
        let err = one(&mut CriteoParser::default(), 26, 13, false, "2\t1").expect_err("bad label");
        assert!(err.contains("label"), "{err}");
        let err = one(&mut CriteoParser::default(), 26, 13, false, "0\tx1").expect_err("bad int");
        assert!(err.contains("I1"), "{err}");
        let long = format!("0{}", "\t1".repeat(45));
        assert!(one(&mut CriteoParser::default(), 26, 13, false, &long).expect_err("too long").contains("columns"));
        // 40 columns parse; a 41st, even an empty one, is one too many.
        let whole = format!("0{}", "\t1".repeat(39));
        let b = one(&mut CriteoParser::default(), 26, 13, false, &whole).expect("40 columns");
        assert_eq!(b.keys[25], feature_key(25, b"1"));
        let err = one(&mut CriteoParser::default(), 26, 13, false, &format!("{whole}\t")).expect_err("41");
        assert!(err.contains("more than 40 columns"), "{err}");
    }

    #[test]
    fn integer_parser_and_log_table_match_std() {
        let table = Log1pTable::new();
        for raw in ["0", "7", "-3", "+12", "1023", "1024", "99999999", "000123"] {
            let v = parse_int(raw.as_bytes()).expect(raw);
            assert_eq!(v, raw.parse::<i64>().expect(raw));
            assert_eq!(table.get(v), criteo_dense(v as f64), "{raw}");
        }
        for bad in ["", "-", "1.5", "1e3", "x", "12a", "9999999999999999999"] {
            assert!(parse_int(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn csv_quotes_and_multi_hot() {
        let mut cells = Vec::new();
        split_csv(br#"a,"b,c","say ""hi""",,"#, b',', &mut cells).expect("splits");
        let got: Vec<&[u8]> = cells.iter().map(|c| c.as_ref()).collect();
        assert_eq!(got, vec![&b"a"[..], b"b,c", br#"say "hi""#, b"", b""]);
        let schema = Schema {
            label: "y".into(),
            dense: vec!["x".into()],
            sparse: vec!["tags".into(), "site".into()],
            multi_hot_separator: Some("|".into()),
            ..Schema::default()
        };
        let mut p = CsvParser::new(Path::new("t.csv"), &schema, Some(b"site,y,x,tags")).expect("schema");
        let b = one(&mut p, 2, 1, false, "s1,1,2.5,a|b|c").expect("parses");
        assert_eq!(b.dense, vec![2.5]);
        assert_eq!(b.bag(0, 0).len(), 3);
        assert_eq!(b.bag(0, 1).len(), 1);
        assert!(one(&mut p, 2, 1, false, "s1,1").is_err());
        assert!(CsvParser::new(Path::new("t.csv"), &schema, Some(b"site,y")).is_err());
    }

    #[test]
    fn libsvm_and_libffm() {
        let b = one(&mut SvmParser::libsvm(), 1, 0, true, "-1 3:0.5 7:1").expect("parses");
        assert_eq!(b.labels, vec![0.0]);
        assert_eq!(b.key_weights, Some(vec![0.5, 1.0]));
        let b = one(&mut SvmParser::libffm(3), 3, 0, true, "+1 2:9:1 0:4:0.25").expect("parses");
        assert_eq!(b.labels, vec![1.0]);
        assert_eq!(b.bag(0, 0).len(), 1);
        assert_eq!(b.bag(0, 1).len(), 0);
        assert_eq!(b.bag(0, 2).len(), 1);
        assert_eq!(b.key_weights, Some(vec![0.25, 1.0]));
        assert!(one(&mut SvmParser::libffm(3), 3, 0, true, "1 5:1:1").expect_err("field").contains("num_fields"));
        assert!(one(&mut SvmParser::libsvm(), 1, 0, true, "1 3").is_err());
    }

    /// Several labels and a behaviour sequence: each row holds a label per
    /// task (an empty cell masks it), the sequence's newest `max_len` IDs
    /// keyed as the field whose table it shares, truncations counted; a
    /// label that is not 0/1, a class id past the task's classes and an
    /// unparsable row are bad rows named by file and line.
    #[test]
    fn labels_per_task_and_a_sequence_sharing_a_table() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.csv");
        std::fs::write(
            &path,
            "click,cvr,kind,user,item,hist\n\
             1,,2,u1,i7,i3|i4|i5\n\
             0,0,0,u2,i3,\n\
             2,0,0,u3,i3,i1\n\
             1,1,4,u3,i3,i1\n\
             1,1,1,u4,i9,i7\n",
        )
        .expect("write");
        let text = format!(
            r#"
            [data]
            format = "csv"
            train = "{}"
            [data.schema]
            labels = ["click", "cvr", "kind"]
            sparse = ["user", "item"]
            multi_hot_separator = "|"
            sequence = [{{ field = "hist", table = "item", max_len = 2 }}]
            [model]
            kind = "mlp"
            [[model.tasks]]
            name = "click"
            [[model.tasks]]
            name = "cvr"
            [[model.tasks]]
            name = "kind"
            kind = "multiclass"
            classes = 3
            "#,
            path.display()
        );
        let job = Config::from_toml(&text, "t.toml", &sparrow_core::Overrides::none()).expect("config");
        let bad = BadRows::new(10, 0);
        let mut source = TextSource::open(&path, &job, bad.clone()).expect("open");
        let b = source.next_batch(16, 0).expect("read").expect("a batch");
        assert_eq!((b.rows(), b.tasks(), b.num_fields), (3, 3, 3));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&b.labels), bits(&[1.0, f32::NAN, 2.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]));
        // Row 0 keeps i4, i5 (the newest two), keyed as `item` (field 1) keys them.
        let seq: Vec<u64> = b.bag(0, 2).map(|k| b.keys[k]).collect();
        assert_eq!(seq, vec![feature_key(1, b"i4"), feature_key(1, b"i5")]);
        assert_eq!(b.bag(1, 2).len(), 0, "an empty history");
        assert_eq!(b.keys[b.bag(2, 2).start], b.keys[b.bag(0, 1).start], "i7 as history and as the item");
        assert_eq!(b.truncated_sequences, 1);
        assert_eq!(bad.total(), 2, "the label 2 and the class 4");
    }
}
