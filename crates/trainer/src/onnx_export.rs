//! `sparrow export --format onnx`: a checkpoint as an ONNX graph
//! (`sparrow-onnx` builds it). Sparrow keeps no vocabulary (a key is a hash
//! of the raw ID), so the raw IDs the graph maps to rows are read from data
//! files: by default the job's `data.train` and `data.test`. Each ID found
//! gets the row `sparrow predict` would read for it (its trained row, or the
//! initial vector of a key the table lacks); an ID the files lack reads as
//! zeros in the graph. A behaviour sequence's IDs are its `table` field's.

use std::collections::BTreeSet;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sparrow_core::config::{Config, DataFormat};
use sparrow_core::key::feature_key;
use sparrow_data::columns::ModelInputs;
use sparrow_data::input::TextInput;
use sparrow_data::text::{MAX_LINE_BYTES, split_bytes, split_csv};

use crate::error::TrainError;
use crate::trainer::Trainer;

/// The file the graph is written to, in the export's directory.
pub const MODEL_FILE: &str = sparrow_onnx::MODEL_FILE;
/// Past this many bytes the graph's tables go beside it (protobuf's limit).
pub const MAX_INLINE_BYTES: u64 = sparrow_onnx::MAX_INLINE_BYTES;
/// Where the rows go when the graph takes pooled vectors.
pub const ROWS_DIR: &str = "rows";

/// What `sparrow export --format onnx` prints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OnnxSummary {
    pub export: String,
    pub format: String,
    pub model: String,
    pub checkpoint_step: u64,
    /// `true`: IDs map to rows inside the graph; `false`: its inputs are
    /// the pooled vectors, the rows are in `rows/` (a serving export).
    pub embedded: bool,
    /// Raw IDs the graph maps to rows (0 when not embedded).
    pub ids: u64,
    /// `model.onnx`'s bytes.
    pub bytes: u64,
    /// Past `--max-inline-bytes` (protobuf's 2 GiB by default): the file
    /// beside `model.onnx` holding its tables (ONNX external data), and its
    /// bytes; `null` and 0 when the model is one file.
    pub external_data: Option<String>,
    pub external_bytes: u64,
}

fn argument(flag: &'static str, value: impl std::fmt::Display, message: impl Into<String>) -> TrainError {
    TrainError::Argument { flag, value: value.to_string(), message: message.into() }
}

/// The checkpoint at `checkpoint` as `out/model.onnx`. `vocabulary`: the
/// data files whose sparse columns hold the raw IDs (empty: `data.train`
/// and `data.test`); past `max_table_bytes` of rows the graph takes pooled
/// vectors instead; past `max_inline_bytes` the tables go beside the
/// graph as ONNX external data.
pub fn export_onnx(
    checkpoint: &Path,
    out: &Path,
    vocabulary: &[PathBuf],
    max_table_bytes: u64,
    max_inline_bytes: u64,
) -> Result<OnnxSummary, TrainError> {
    // Refused before the checkpoint is loaded: a wrong --out fails at once.
    let new = crate::new_dir::NewDir::create(out, "--out")?;
    let (trainer, manifest, _) = crate::checkpoint::load_trainer(checkpoint, &sparrow_core::Overrides::none())?;
    let spec = trainer.model.spec()?;
    if trainer.config.model.precision == sparrow_core::config::Precision::Bf16 {
        tracing::warn!(
            "model.precision = \"bf16\": the ONNX graph computes in f32, so its figures differ from `sparrow \
             predict`'s by the bf16 rounding of the products' inputs"
        );
    }
    let config = &trainer.config;
    let inputs = ModelInputs::of(&config.data).map_err(|m| argument("--format", "onnx", m))?;
    let schema = config.data.schema.clone().unwrap_or_default();
    let width = trainer.table.dim();
    let files = vocabulary_files(config, vocabulary)?;
    let ids = read_ids(config, &inputs, &files)?;
    let total: u64 = ids.iter().map(|f| f.len() as u64).sum();
    let embedded = total.saturating_mul(width as u64 * 4) <= max_table_bytes;
    let multi_hot = schema.multi_hot_separator.clone().filter(|_| config.data.format == DataFormat::Csv);
    let mut sparse = Vec::with_capacity(inputs.sparse.len() + inputs.sequences.len());
    let buckets = schema.bucket_boundaries();
    for (field, (name, ids)) in inputs.sparse.iter().zip(ids).enumerate() {
        // A bucketized field's IDs are its buckets' numbers (and the
        // missing one), whatever the files' cells.
        let bucketized = buckets.get(field).cloned().flatten().filter(|_| config.data.format != DataFormat::Criteo);
        let ids = match &bucketized {
            Some(b) => std::iter::once(String::new()).chain((0..=b.len()).map(|i| i.to_string())).collect(),
            None => ids,
        };
        let rows = if embedded { Some((ids.clone(), rows_of(&trainer, field, &ids)?)) } else { None };
        sparse.push(sparrow_onnx::SparseInput {
            name: name.clone(),
            separator: multi_hot.clone(),
            max_len: None,
            table: field,
            rows,
            unknown: vec![0.0; width],
            buckets: bucketized,
        });
    }
    for q in &inputs.sequences {
        sparse.push(sparrow_onnx::SparseInput {
            name: q.name.clone(),
            separator: Some(sequence_separator(config)),
            max_len: Some(q.max_len),
            table: q.table as usize,
            rows: None,
            unknown: vec![0.0; width],
            buckets: None,
        });
    }
    let log1p = match config.data.format {
        DataFormat::Criteo => true,
        _ => schema.dense_transform == sparrow_core::config::DenseTransform::Log1p,
    };
    let graph = sparrow_onnx::export(&sparrow_onnx::Export {
        spec: &spec,
        dense: inputs.dense.clone(),
        log1p,
        standardize: schema
            .dense_scale()
            .standardized()
            .map(|stats| stats.iter().map(|&(mean, inverse)| (mean as f32, inverse as f32)).collect()),
        sparse,
        mean: config.model.pooling == sparrow_core::config::Pooling::Mean,
        width,
        outputs: config.served_outputs().0,
        name: format!("sparrow_{}", config.model.kind.name()),
        doc: format!(
            "Sparrow {} model.kind = {}, trained {} steps; inputs as `sparrow serve`'s, output `probability`.",
            env!("CARGO_PKG_VERSION"),
            config.model.kind.name(),
            manifest.step
        ),
    })
    .map_err(|e| argument("--format", "onnx", e.to_string()))?;
    // Written under a staging name and renamed into place: a stopped or
    // failed export leaves nothing behind.
    let staging = new.staging();
    if !embedded {
        let pages = crate::export::row_pages(&trainer.table, |_, _, _| true);
        let rows = staging.join(ROWS_DIR);
        std::fs::create_dir(&rows).map_err(|e| TrainError::io(&rows, e))?;
        let meta = crate::export::ExportMeta { dtype: Some(crate::export::VectorType::F32), ..Default::default() };
        crate::export::write_export_files(&rows, config, &trainer.layout, manifest.step, &trainer.model, &meta, pages)?;
    }
    let written = sparrow_onnx::write(graph, staging, max_inline_bytes).map_err(|e| match e {
        sparrow_onnx::OnnxError::Io { path, source } => TrainError::io(&path, source),
        other => argument("--max-table-bytes", max_table_bytes, other.to_string()),
    })?;
    if let Some((_, bytes)) = &written.external {
        tracing::info!(
            "model.onnx would take more than {max_inline_bytes} bytes (--max-inline-bytes): its tables ({bytes} \
             bytes) are in {} beside it, as ONNX external data; keep the two files together",
            sparrow_onnx::EXTERNAL_DATA_FILE
        );
    }
    new.commit()?;
    let model = out.join(MODEL_FILE);
    Ok(OnnxSummary {
        export: out.display().to_string(),
        format: "onnx".into(),
        model: model.display().to_string(),
        checkpoint_step: manifest.step,
        embedded,
        ids: if embedded { total } else { 0 },
        bytes: written.model_bytes,
        external_data: written
            .external
            .as_ref()
            .map(|_| out.join(sparrow_onnx::EXTERNAL_DATA_FILE).display().to_string()),
        external_bytes: written.external.map_or(0, |(_, b)| b),
    })
}

fn vocabulary_files(config: &Config, given: &[PathBuf]) -> Result<Vec<PathBuf>, TrainError> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    let files: Vec<PathBuf> = config.data.train.iter().chain(&config.data.test).map(PathBuf::from).collect();
    if files.is_empty() {
        return Err(argument(
            "--vocabulary",
            "(none)",
            "the job names no data.train or data.test: name the data files whose IDs the graph maps",
        ));
    }
    Ok(files)
}

/// Each sparse column's raw IDs in `files`, sorted (UTF-8 ones: ONNX
/// strings are text).
fn read_ids(config: &Config, inputs: &ModelInputs, files: &[PathBuf]) -> Result<Vec<Vec<String>>, TrainError> {
    let mut ids: Vec<BTreeSet<String>> = vec![BTreeSet::new(); inputs.sparse.len()];
    let schema = config.data.schema.clone().unwrap_or_default();
    let multi_hot = schema.multi_hot_separator.clone().filter(|_| config.data.format == DataFormat::Csv);
    let sequence_sep = sequence_separator(config);
    let mut not_text = 0u64;
    for path in files {
        let mut input = TextInput::open(path)?;
        let mut line = Vec::new();
        // The sparse fields' columns, then the sequences'.
        let names: Vec<&String> = inputs.sparse.iter().chain(inputs.sequences.iter().map(|q| &q.name)).collect();
        let mut columns: Option<Vec<usize>> = match config.data.format {
            // label, 13 counts, then the 26 categories.
            DataFormat::Criteo => Some((0..inputs.sparse.len()).map(|f| 14 + f).collect()),
            _ if !schema.header => Some(
                names
                    .iter()
                    .map(|name| {
                        name.parse::<usize>().map_err(|_| argument("--vocabulary", name, "not a column number"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            _ => None,
        };
        let delimiter = inputs.separator as u8;
        let mut number = 0u64;
        loop {
            line.clear();
            // A line is at most what the training reader takes (no file is read whole into one).
            let n = (&mut input)
                .take(MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut line)
                .map_err(|e| TrainError::io(path, e))?;
            if n == 0 {
                break;
            }
            number += 1;
            if n as u64 > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
                return Err(argument(
                    "--vocabulary",
                    path.display(),
                    format!(
                        "line {number} is longer than {MAX_LINE_BYTES} bytes, a data line's limit: not a data file"
                    ),
                ));
            }
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            let mut cells = Vec::new();
            if config.data.format == DataFormat::Criteo {
                cells.extend(text.split(|&b| b == b'\t').map(std::borrow::Cow::Borrowed));
            } else if split_csv(text, delimiter, &mut cells).is_err() {
                continue; // a malformed row: training skipped it too
            }
            let Some(cols) = &columns else {
                let header: Vec<String> = cells.iter().map(|c| String::from_utf8_lossy(c).trim().to_string()).collect();
                let found = names
                    .iter()
                    .map(|name| {
                        header.iter().position(|h| h == *name).ok_or_else(|| {
                            argument("--vocabulary", path.display(), format!("no column `{name}` in the header"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                columns = Some(found);
                continue;
            };
            for (input, &col) in cols.iter().enumerate() {
                let raw = cells.get(col).map_or(&b""[..], |c| c.as_ref());
                let (table, separator) = match input.checked_sub(inputs.sparse.len()) {
                    None => (input, multi_hot.as_deref()),
                    Some(q) => (inputs.sequences[q].table as usize, Some(sequence_sep.as_str())),
                };
                let mut add = |id: &[u8]| match std::str::from_utf8(id) {
                    Ok(id) if !ids[table].contains(id) => {
                        ids[table].insert(id.to_string());
                    }
                    Ok(_) => {}
                    Err(_) => not_text += 1,
                };
                match separator {
                    Some(sep) => split_bytes(raw, sep.as_bytes()).filter(|id| !id.is_empty()).for_each(&mut add),
                    None => add(raw),
                }
            }
        }
    }
    if not_text > 0 {
        tracing::warn!(
            "{not_text} IDs in the vocabulary files are not UTF-8 text (ONNX strings are): the graph reads them as \
             zero vectors"
        );
    }
    let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    if let Some(empty) = ids.iter().position(BTreeSet::is_empty) {
        return Err(argument(
            "--vocabulary",
            shown.join(" "),
            format!("no ID of column `{}` in these files: the graph would map every ID to zeros", inputs.sparse[empty]),
        ));
    }
    Ok(ids.into_iter().map(|s| s.into_iter().collect()).collect())
}

/// What splits a sequence's cell: the multi-hot separator, else `|` (as
/// the readers split it).
fn sequence_separator(config: &Config) -> String {
    config.data.schema.as_ref().and_then(|s| s.multi_hot_separator.clone()).unwrap_or_else(|| "|".into())
}

/// The rows `sparrow predict` reads for field `field`'s `ids`.
fn rows_of(trainer: &Trainer, field: usize, ids: &[String]) -> Result<Vec<f32>, TrainError> {
    let keys: Vec<u64> = ids.iter().map(|id| feature_key(field as u32, id.as_bytes())).collect();
    let width = trainer.table.dim();
    let plan = trainer.table.plan(&keys);
    let mut unique = vec![0.0f32; plan.num_unique() * width];
    trainer.table.lookup(&plan, &mut unique)?;
    let mut rows = Vec::with_capacity(keys.len() * width);
    plan.restore(&unique, width, &mut rows);
    Ok(rows)
}
