//! The model a server answers with: the export's trainer, the names of its
//! inputs, and how a request's rows are scored (in chunks of bounded
//! memory, under one read of the model so a reply comes from one version).

use sparrow_core::Overrides;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sparrow_core::batch::{Batch, BatchBuilder, DataPosition};
use sparrow_core::config::DataFormat;
use sparrow_core::metrics::sigmoid;
use sparrow_data::columns::ColumnRules;
use sparrow_data::layout::{CRITEO_DENSE, CRITEO_SPARSE};
use sparrow_trainer::export::{ExportData, ExportManifest};
use sparrow_trainer::trainer::Trainer;

use crate::metrics::Metrics;
use crate::request::{Cell, Cells, Request};
use crate::{ApiError, ServeError, bad};

/// Rows scored in one pass through the model: the pass's memory (pooled
/// embeddings, activations, about 9 KB a row for the reference model) stays
/// this size whatever a request holds.
pub const SCORE_CHUNK_ROWS: usize = 1024;

/// One loaded model: the export's trainer (vectors, dense weights) and the
/// names of its inputs.
pub struct Served {
    name: String,
    /// The step of the model answering now (the export's).
    step: AtomicU64,
    inputs: Inputs,
    layout: sparrow_data::DataLayout,
    /// Requests predict side by side under the read lock; a `--watch`
    /// update takes the write lock (requests wait, none fails).
    trainer: parking_lot::RwLock<Trainer>,
    /// The export served now: its directory and manifest (`--watch` moves on from it).
    current: parking_lot::Mutex<(PathBuf, ExportManifest)>,
    /// What `--model` named (an export, or a directory whose LATEST names one).
    source: PathBuf,
    pub(crate) metrics: Metrics,
}

/// What one `--watch` update did.
#[derive(Clone, Debug)]
pub struct Swap {
    pub export: PathBuf,
    pub step: u64,
    /// Incremental exports applied to the served model (0: a full reload).
    pub deltas: usize,
    pub rows: usize,
    /// How long requests waited: the time the model's lock was held.
    pub locked: Duration,
    /// From when the previously served export was taken (the oldest update
    /// this swap brings in waited that long) and from when the new one was
    /// taken, to now.
    pub staleness_max: Option<Duration>,
    pub staleness_min: Option<Duration>,
}

/// The answer to one request: the model's step and a probability a row.
pub struct Scores {
    pub version: u64,
    pub probability: Vec<f32>,
}

/// A model's inputs (dense then sparse, named as its data schema names
/// them) and the rules its data file's reader applies to their values.
#[derive(Clone)]
struct Inputs {
    dense: Vec<String>,
    sparse: Vec<String>,
    rules: ColumnRules,
    /// The data file's delimiter (values that could not sit in one of its
    /// lines are refused, as `sparrow predict` could not read them).
    separator: char,
}

impl Inputs {
    fn of(model: &Path, data: &sparrow_core::config::DataConfig) -> Result<Inputs, ServeError> {
        match data.format {
            DataFormat::Criteo => Ok(Inputs {
                dense: (1..=CRITEO_DENSE).map(|i| format!("I{i}")).collect(),
                sparse: (1..=CRITEO_SPARSE).map(|i| format!("C{i}")).collect(),
                rules: ColumnRules::Criteo,
                separator: '\t',
            }),
            DataFormat::Csv => {
                let schema = data.schema.clone().unwrap_or_default();
                Ok(Inputs {
                    dense: schema.dense.clone(),
                    sparse: schema.sparse.clone(),
                    rules: ColumnRules::csv(&schema),
                    separator: schema.delimiter.chars().next().unwrap_or(','),
                })
            }
            other => Err(ServeError::Setup(format!(
                "{}: the model was trained on data.format = {other:?}; serving reads the named columns of Criteo \
                 and CSV data",
                model.display()
            ))),
        }
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.dense.iter().chain(&self.sparse)
    }

    fn is_csv(&self) -> bool {
        matches!(self.rules, ColumnRules::Csv { .. })
    }
}

impl Served {
    /// Loads an export (checksums verified first: a damaged one is refused
    /// naming its file), served as `name`.
    pub fn load(model: &Path, name: String) -> Result<Served, ServeError> {
        let (trainer, manifest) = sparrow_trainer::export::load_export(model, &Overrides::none())?;
        let dir = sparrow_trainer::export::resolve_export(model)?;
        let inputs = Inputs::of(model, &trainer.config.data)?;
        let metrics = Metrics::new();
        metrics.model_step.set(i64::try_from(manifest.step).unwrap_or(i64::MAX));
        Ok(Served {
            name,
            step: AtomicU64::new(manifest.step),
            inputs,
            layout: trainer.layout.clone(),
            trainer: parking_lot::RwLock::new(trainer),
            current: parking_lot::Mutex::new((dir, manifest)),
            source: model.to_path_buf(),
            metrics,
        })
    }

    /// The step of the model answering now.
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::SeqCst)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The export LATEST names now (or the one served, without a LATEST).
    pub fn newest(&self) -> Result<PathBuf, sparrow_trainer::TrainError> {
        sparrow_trainer::export::resolve_export(&self.source)
    }

    /// `--watch`: if `LATEST` names another export than the one served,
    /// serve that one. The exports that follow the served one in its chain
    /// are read and verified first, then applied under the model's write lock
    /// (requests wait for it, none fails, none sees half an update); an
    /// export of another chain (a full one) is loaded beside the served
    /// model and swapped in. On an error the served model stays.
    pub fn refresh(&self) -> Result<Option<Swap>, sparrow_trainer::TrainError> {
        let newest = self.newest()?;
        let (served_dir, served) = self.current.lock().clone();
        if newest == served_dir {
            return Ok(None);
        }
        let chain = sparrow_trainer::export::export_chain(&newest)?;
        let (_, manifest) = chain[chain.len() - 1].clone();
        if manifest.num_fields != self.layout.num_fields || manifest.num_dense != self.layout.num_dense {
            return Err(sparrow_trainer::TrainError::checkpoint(
                &newest,
                "holds a model of other inputs than the one served: restart the server to serve it",
            ));
        }
        let after = chain.iter().position(|(dir, _)| *dir == served_dir);
        let (locked, deltas, rows) = match after {
            Some(i) => {
                let updates =
                    chain[i + 1..].iter().map(|(dir, _)| ExportData::read(dir)).collect::<Result<Vec<_>, _>>()?;
                let rows = updates.iter().map(ExportData::rows).sum();
                let trainer = self.trainer.write();
                let start = Instant::now();
                for update in &updates {
                    update.apply(&trainer)?;
                }
                self.step.store(manifest.step, Ordering::SeqCst);
                (start.elapsed(), updates.len(), rows)
            }
            None => {
                let (fresh, _) = sparrow_trainer::export::load_export(&newest, &Overrides::none())?;
                let rows = fresh.table.len();
                let mut trainer = self.trainer.write();
                let start = Instant::now();
                *trainer = fresh;
                self.step.store(manifest.step, Ordering::SeqCst);
                (start.elapsed(), 0, rows)
            }
        };
        let now_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let since = |taken: Option<u64>| taken.map(|t| Duration::from_millis(now_ms.saturating_sub(t)));
        let swap = Swap {
            export: newest.clone(),
            step: manifest.step,
            deltas,
            rows,
            locked,
            staleness_max: since(served.taken_unix_ms),
            staleness_min: since(manifest.taken_unix_ms),
        };
        *self.current.lock() = (newest, manifest);
        self.metrics.model_step.set(i64::try_from(swap.step).unwrap_or(i64::MAX));
        self.metrics.swaps.with_label_values(&[if deltas > 0 { "delta" } else { "full" }]).inc();
        self.metrics.swap_locked.set(locked.as_secs_f64());
        if let Some(s) = swap.staleness_max {
            self.metrics.staleness.set(s.as_secs_f64());
        }
        Ok(Some(swap))
    }

    pub(crate) fn metadata(&self) -> serde_json::Value {
        use serde_json::json;
        let inputs: Vec<serde_json::Value> = self
            .inputs
            .dense
            .iter()
            .map(|n| json!({"name": n, "datatype": "FP32", "shape": [-1]}))
            .chain(self.inputs.sparse.iter().map(|n| json!({"name": n, "datatype": "BYTES", "shape": [-1]})))
            .collect();
        json!({
            "name": self.name,
            "versions": [self.step().to_string()],
            "platform": "sparrow",
            "inputs": inputs,
            "outputs": [{"name": "probability", "datatype": "FP32", "shape": [-1]}],
        })
    }

    /// Scores one decoded request: each row goes through the data file's
    /// line parser (so the figures are `sparrow predict`'s), into batches of
    /// [`SCORE_CHUNK_ROWS`] before the model's lock; then every batch is
    /// scored under one read of the model.
    pub fn infer(&self, request: &Request) -> Result<Scores, ApiError> {
        let n_dense = self.inputs.dense.len();
        let mut rows: Option<usize> = None;
        let mut columns: Vec<Option<(&Cells, Kind, &str)>> = vec![None; n_dense + self.inputs.sparse.len()];
        for input in &request.inputs {
            let name = input.name.as_str();
            let column = self.inputs.names().position(|n| n == name).ok_or_else(|| {
                bad(format!("input `{name}`: the model has no such input (see GET /v2/models/{})", self.name))
            })?;
            if columns[column].is_some() {
                return Err(bad(format!("input `{name}` is given twice")));
            }
            let want = if column < n_dense { "FP32" } else { "BYTES" };
            if input.datatype != want {
                return Err(bad(format!("input `{name}`: datatype `{}`, expected {want}", input.datatype)));
            }
            let n = input.cells.len();
            if input.shape.len() != 1 || usize::try_from(input.shape[0]).ok() != Some(n) {
                return Err(bad(format!(
                    "input `{name}`: shape {:?} for {n} values; expected [N] with N values",
                    input.shape
                )));
            }
            if let Some(other) = rows
                && other != n
            {
                return Err(bad(format!("input `{name}` has {n} rows, another input {other}")));
            }
            rows = Some(n);
            let kind = match (column < n_dense, self.inputs.is_csv()) {
                (true, false) => Kind::Count,
                (true, true) => Kind::Number,
                (false, _) => Kind::Text(self.inputs.separator),
            };
            columns[column] = Some((&input.cells, kind, name));
        }
        let n = rows.unwrap_or(0);
        let batches = self.batches(&columns, n)?;
        let mut probability = Vec::with_capacity(n);
        let trainer = self.trainer.read();
        // Read under the lock: the step of the model that answers.
        let version = self.step();
        for batch in &batches {
            let logits = trainer.predict_batch(batch).map_err(|e| ApiError::internal(e.to_string()))?;
            probability.extend(logits.iter().map(|&x| sigmoid(f64::from(x)) as f32));
        }
        drop(trainer);
        self.metrics.rows.inc_by(n as u64);
        Ok(Scores { version, probability })
    }

    /// The request's rows, value by value through the data format's rules
    /// (no text in between), in batches of at most [`SCORE_CHUNK_ROWS`] rows.
    fn batches(&self, columns: &[Option<(&Cells, Kind, &str)>], n: usize) -> Result<Vec<Batch>, ApiError> {
        let n_dense = self.inputs.dense.len();
        let (dense, sparse) = columns.split_at(n_dense);
        let mut batches = Vec::with_capacity(n.div_ceil(SCORE_CHUNK_ROWS));
        for start in (0..n).step_by(SCORE_CHUNK_ROWS) {
            let end = (start + SCORE_CHUNK_ROWS).min(n);
            let mut builder = BatchBuilder::new(self.layout.num_fields, self.layout.num_dense, false, end - start);
            for row in start..end {
                builder.begin_row();
                for column in dense {
                    let value = match column {
                        Some((cells, kind, name)) => dense_cell(name, cells, row, *kind)?,
                        None => None,
                    };
                    self.inputs.rules.push_dense(&mut builder, value).map_err(|e| bad(format!("row {row}: {e}")))?;
                }
                let texts = sparse
                    .iter()
                    .map(|column| match column {
                        Some((cells, kind, name)) => sparse_cell(name, cells, row, *kind),
                        None => Ok(None),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let pushed = self.inputs.rules.push_sparse(&mut builder, texts.into_iter());
                if let Err(e) = pushed.and_then(|()| {
                    builder.end_row(0.0).then_some(()).ok_or_else(|| "wrong number of dense values".into())
                }) {
                    return Err(bad(format!("row {row}: {e}")));
                }
            }
            batches.push(builder.finish(DataPosition::default()));
        }
        Ok(batches)
    }
}

/// What an input's cells are: a Criteo dense count (an integer), a CSV
/// dense number, or a categorical value (on a CSV line: quoted where it
/// holds the delimiter or a quote).
#[derive(Clone, Copy)]
enum Kind {
    Count,
    Number,
    Text(char),
}

/// Row `row`'s value of a dense input (`None`: null, an empty cell).
fn dense_cell(name: &str, cells: &Cells, row: usize, kind: Kind) -> Result<Option<f64>, ApiError> {
    match (kind, cells.values[row]) {
        (_, Cell::Null) => Ok(None),
        (Kind::Count, Cell::Number(v)) => {
            if !v.is_finite() || v.abs() > 9.0e15 {
                return Err(bad(format!(
                    "input `{name}`: {v:e} is out of range (Criteo's dense columns are integer counts within ±9e15)"
                )));
            }
            if v.fract() != 0.0 {
                return Err(bad(format!("input `{name}`: {v} is not an integer (Criteo's dense columns are counts)")));
            }
            Ok(Some(v))
        }
        (_, Cell::Number(v)) => Ok(Some(v)),
        (_, Cell::Text { start, len }) => {
            Err(bad(format!("input `{name}`: \"{}\" is not a number (FP32)", cells.text(start, len))))
        }
    }
}

/// Row `row`'s value of a sparse input (`None`: null, an empty cell).
/// Values a line of the data file could not hold are refused, so serving
/// answers only what `sparrow predict` could be asked.
fn sparse_cell<'c>(name: &str, cells: &'c Cells, row: usize, kind: Kind) -> Result<Option<&'c [u8]>, ApiError> {
    match (kind, cells.values[row]) {
        (_, Cell::Null) => Ok(None),
        (Kind::Text(separator), Cell::Text { start, len }) => {
            let s = cells.text(start, len);
            if s.contains(['\n', '\r']) || (separator == '\t' && s.contains('\t')) {
                return Err(bad(format!(
                    "input `{name}`: a value holds a line break{}",
                    if separator == '\t' { " or a tab" } else { "" }
                )));
            }
            Ok(Some(s.as_bytes()))
        }
        (_, Cell::Number(v)) => Err(bad(format!("input `{name}`: {v} is not a string (BYTES)"))),
        (_, Cell::Text { start, len }) => {
            Err(bad(format!("input `{name}`: \"{}\" is not a number (FP32)", cells.text(start, len))))
        }
    }
}
