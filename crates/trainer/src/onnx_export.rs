//! `sparrow export --format onnx`: a checkpoint as an ONNX graph
//! (`sparrow-onnx` builds it). Sparrow keeps no vocabulary (a key is a hash
//! of the raw ID), so the raw IDs the graph maps to rows are read from data
//! files: by default the job's `data.train` and `data.test`. Each ID found
//! gets the row `sparrow predict` would read for it (its trained row, or the
//! initial vector of a key the table lacks); an ID the files lack reads as
//! zeros in the graph.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sparrow_core::config::{Config, DataFormat};
use sparrow_core::key::feature_key;
use sparrow_data::columns::ModelInputs;
use sparrow_data::input::TextInput;
use sparrow_data::text::split_csv;

use crate::error::TrainError;
use crate::trainer::Trainer;

/// The file the graph is written to, in the export's directory.
pub const MODEL_FILE: &str = "model.onnx";
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
    pub bytes: u64,
}

fn argument(flag: &'static str, value: impl std::fmt::Display, message: impl Into<String>) -> TrainError {
    TrainError::Argument { flag, value: value.to_string(), message: message.into() }
}

/// The checkpoint at `checkpoint` as `out/model.onnx`. `vocabulary`: the
/// data files whose sparse columns hold the raw IDs (empty: `data.train`
/// and `data.test`); past `max_table_bytes` of rows the graph takes pooled
/// vectors instead.
pub fn export_onnx(
    checkpoint: &Path,
    out: &Path,
    vocabulary: &[PathBuf],
    max_table_bytes: u64,
) -> Result<OnnxSummary, TrainError> {
    if out.exists() {
        return Err(TrainError::io(
            out,
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, "the export's directory exists already"),
        ));
    }
    let (trainer, manifest, _) = crate::checkpoint::load_trainer(checkpoint, &sparrow_core::Overrides::none())?;
    let spec = trainer.model.spec("ONNX")?;
    let config = &trainer.config;
    let inputs = ModelInputs::of(&config.data).map_err(|m| argument("--format", "onnx", m))?;
    let schema = config.data.schema.clone().unwrap_or_default();
    if config.data.format == DataFormat::Csv && schema.multi_hot_separator.is_some() {
        return Err(argument(
            "--format",
            "onnx",
            "multi-hot fields (data.schema.multi_hot_separator) are not exported yet",
        ));
    }
    if !inputs.sequences.is_empty() {
        return Err(argument("--format", "onnx", "behaviour sequences (data.schema.sequence) are not exported yet"));
    }
    let width = trainer.table.dim();
    let files = vocabulary_files(config, vocabulary)?;
    let ids = read_ids(config, &inputs, &files)?;
    let total: u64 = ids.iter().map(|f| f.len() as u64).sum();
    let embedded = total.saturating_mul(width as u64 * 4) <= max_table_bytes;
    let mut sparse = Vec::with_capacity(inputs.sparse.len());
    for (field, (name, ids)) in inputs.sparse.iter().zip(ids).enumerate() {
        let rows = if embedded { Some((ids.clone(), rows_of(&trainer, field, &ids)?)) } else { None };
        sparse.push(sparrow_onnx::SparseInput { name: name.clone(), rows, unknown: vec![0.0; width] });
    }
    let log1p = match config.data.format {
        DataFormat::Criteo => true,
        _ => schema.dense_transform == sparrow_core::config::DenseTransform::Log1p,
    };
    let bytes = sparrow_onnx::export(&sparrow_onnx::Export {
        spec: &spec,
        dense: inputs.dense.clone(),
        log1p,
        sparse,
        width,
        name: format!("sparrow_{}", config.model.kind.name()),
        doc: format!(
            "Sparrow {} model.kind = {}, trained {} steps; inputs as `sparrow serve`'s, output `probability`.",
            env!("CARGO_PKG_VERSION"),
            config.model.kind.name(),
            manifest.step
        ),
    })
    .map_err(|e| argument("--format", "onnx", e.to_string()))?;
    // Written beside `out` and renamed into place: a stopped export leaves
    // no half a directory behind under the name.
    let staging = out.with_extension("onnx-staging");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| TrainError::io(&staging, e))?;
    if !embedded {
        let pages = crate::export::row_pages(&trainer.table, |_, _, _| true);
        crate::export::write_export_as(
            &staging.join(ROWS_DIR),
            config,
            &trainer.layout,
            manifest.step,
            &trainer.model,
            crate::export::VectorType::F32,
            pages,
        )?;
    }
    std::fs::write(staging.join(MODEL_FILE), &bytes).map_err(|e| TrainError::io(&staging.join(MODEL_FILE), e))?;
    std::fs::rename(&staging, out).map_err(|e| TrainError::io(out, e))?;
    let model = out.join(MODEL_FILE);
    Ok(OnnxSummary {
        export: out.display().to_string(),
        format: "onnx".into(),
        model: model.display().to_string(),
        checkpoint_step: manifest.step,
        embedded,
        ids: if embedded { total } else { 0 },
        bytes: bytes.len() as u64,
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
    for path in files {
        let mut input = TextInput::open(path)?;
        let mut line = Vec::new();
        let mut columns: Option<Vec<usize>> = match config.data.format {
            // label, 13 counts, then the 26 categories.
            DataFormat::Criteo => Some((0..inputs.sparse.len()).map(|f| 14 + f).collect()),
            _ if !schema.header => Some(
                inputs
                    .sparse
                    .iter()
                    .map(|name| {
                        name.parse::<usize>().map_err(|_| argument("--vocabulary", name, "not a column number"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            _ => None,
        };
        let delimiter = inputs.separator as u8;
        loop {
            line.clear();
            if input.read_until(b'\n', &mut line).map_err(|e| TrainError::io(path, e))? == 0 {
                break;
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
                let found = inputs
                    .sparse
                    .iter()
                    .map(|name| {
                        header.iter().position(|h| h == name).ok_or_else(|| {
                            argument("--vocabulary", path.display(), format!("no column `{name}` in the header"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                columns = Some(found);
                continue;
            };
            for (field, &col) in cols.iter().enumerate() {
                let raw = cells.get(col).map_or(&b""[..], |c| c.as_ref());
                if let Ok(id) = std::str::from_utf8(raw)
                    && !ids[field].contains(id)
                {
                    ids[field].insert(id.to_string());
                }
            }
        }
    }
    Ok(ids.into_iter().map(|s| s.into_iter().collect()).collect())
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
