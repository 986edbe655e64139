//! `sparrow._native`: the Rust side of the `sparrow` Python package. The
//! Python side (`python/sparrow/`) shapes arguments and results; this module
//! runs the same library calls as the `sparrow` command (train, gen,
//! evaluate, predict), with the GIL released while they work.
//!
//! Errors become the exception classes of `sparrow._errors`, carrying the
//! CLI's message; Ctrl-C during training stops it after the current step,
//! writes the checkpoint, and raises `KeyboardInterrupt`.

use sparrow_core::Overrides;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::RecvTimeoutError;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use sparrow_core::Config;
use sparrow_data::columns::{ColumnValues, InputColumn, ModelInputs};
use sparrow_trainer::TrainError;
use sparrow_trainer::progress::ProgressUpdate;

// As in the `sparrow` binary: training allocates tensor-sized buffers every
// step; mimalloc (keeping freed pages) avoids glibc's page churn.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often a waiting call looks at Python's signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The exception of `sparrow._errors` named `class`, holding `message`.
fn exception(py: Python<'_>, class: &str, message: String) -> PyErr {
    let made = py.import("sparrow._errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1((message.clone(),)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

/// The class a library error maps to, and the CLI's message for it (the
/// whole chain of causes, as `sparrow` prints after "error: ").
fn train_error(py: Python<'_>, e: TrainError) -> PyErr {
    let class = match &e {
        TrainError::Config(_) => "ConfigError",
        TrainError::Data(_) | TrainError::DataShape { .. } => "DataError",
        TrainError::Checkpoint { .. } => "CheckpointError",
        TrainError::Io { .. } => "FileError",
        TrainError::NonFinite { .. } => "DivergedError",
        TrainError::Argument { .. } => "ArgumentError",
        _ => "SparrowError",
    };
    exception(py, class, format!("{:#}", anyhow::Error::from(e)))
}

fn config_error(py: Python<'_>, e: sparrow_core::ConfigError) -> PyErr {
    train_error(py, TrainError::Config(e))
}

/// A config from a TOML file (`path`) or from a JSON object (the Python
/// dict, `json`), with `KEY=VALUE` overrides applied.
fn load_config(py: Python<'_>, path: Option<PathBuf>, json: Option<&str>, overrides: &[String]) -> PyResult<Config> {
    let (text, source) = match (path, json) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| exception(py, "FileError", format!("reading config {}: {e}", path.display())))?;
            (text, path.display().to_string())
        }
        (None, Some(json)) => {
            let value: serde_json::Value = serde_json::from_str(json)
                .map_err(|e| exception(py, "ConfigError", format!("the config dict: {e}")))?;
            let text = toml::to_string(&value)
                .map_err(|e| exception(py, "ConfigError", format!("the config dict cannot be written as TOML: {e}")))?;
            (text, "the config dict".to_string())
        }
        (None, None) => return Err(exception(py, "ArgumentError", "train needs a config".into())),
    };
    edge_overrides(overrides)
        .and_then(|o| Config::from_toml(&text, &source, &o))
        .and_then(|mut c| c.resolve_secrets(|v| std::env::var_os(v)).map(|()| c))
        .map_err(|e| config_error(py, e))
}

fn progress_dict<'py>(py: Python<'py>, u: &ProgressUpdate) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", u.step)?;
    d.set_item("epoch", u.epoch)?;
    d.set_item("samples", u.samples)?;
    d.set_item("bytes_done", u.bytes_done)?;
    d.set_item("bytes_total", u.bytes_total)?;
    d.set_item("train_logloss", u.train_logloss)?;
    d.set_item("samples_per_sec", u.samples_per_sec)?;
    // [data.stream]: the lag; progressive validation: the window's figures
    // (None where off or undefined).
    d.set_item("stream_lag_records", u.stream_lag_records)?;
    d.set_item("stream_lag_secs", u.stream_lag_secs)?;
    let finite = |x: f64| x.is_finite().then_some(x);
    let window = u.online.map(|o| o.window);
    d.set_item("online_window_auc", window.and_then(|w| finite(w.auc)))?;
    d.set_item("online_window_logloss", window.and_then(|w| finite(w.log_loss)))?;
    d.set_item("online_window_normalized_entropy", window.and_then(|w| finite(w.normalized_entropy)))?;
    d.set_item("online_window_calibration", window.and_then(|w| finite(w.calibration)))?;
    d.set_item("online_auc", u.online.and_then(|o| finite(o.run.auc)))?;
    Ok(d)
}

/// Trains in a thread of its own while this (the caller's) thread, with the
/// GIL released between polls, hands progress to `progress` and watches
/// for Ctrl-C. Returns `sparrow train`'s JSON summary.
#[pyfunction]
#[pyo3(signature = (path, json, overrides, progress=None, quiet=true))]
fn train(
    py: Python<'_>,
    path: Option<PathBuf>,
    json: Option<&str>,
    overrides: Vec<String>,
    progress: Option<Py<PyAny>>,
    quiet: bool,
) -> PyResult<String> {
    let config = load_config(py, path, json, &overrides)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = crossbeam_channel::unbounded::<ProgressUpdate>();
    let trainer_stop = stop.clone();
    let checkpoint_dir = config.checkpoint.dir.clone();
    let handle = std::thread::Builder::new()
        .name("sparrow-train".into())
        .spawn(move || {
            let observer = move |u: &ProgressUpdate| {
                let _ = tx.send(u.clone());
            };
            sparrow_trainer::run::train_observed(&config, quiet, &trainer_stop, &observer)
        })
        .map_err(|e| exception(py, "SparrowError", format!("starting the training thread: {e}")))?;
    // Why training was stopped early from here: Ctrl-C or a progress
    // callback that raised; raised once training has stopped.
    let mut raised: Option<PyErr> = None;
    loop {
        match py.detach(|| rx.recv_timeout(SIGNAL_POLL)) {
            Ok(update) => {
                if let (Some(callback), None) = (&progress, &raised)
                    && let Err(e) = progress_dict(py, &update).and_then(|d| callback.call1(py, (d,)))
                {
                    stop.store(true, Ordering::SeqCst);
                    raised = Some(e);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if raised.is_none()
            && let Err(e) = py.check_signals()
        {
            stop.store(true, Ordering::SeqCst);
            raised = Some(e);
        }
    }
    let outcome = py
        .detach(|| handle.join())
        .map_err(|_| exception(py, "SparrowError", "the training thread panicked".into()))?;
    match (outcome, raised) {
        (Ok(summary), None) => {
            serde_json::to_string(&summary).map_err(|e| exception(py, "SparrowError", format!("the summary: {e}")))
        }
        (Err(TrainError::Interrupted { step }), Some(e)) if e.is_instance_of::<PyKeyboardInterrupt>(py) => {
            let saved = match checkpoint_dir {
                Some(dir) => format!("the model so far is saved in {dir} (resume with checkpoint.resume_from)"),
                None => "no checkpoint.dir is set, so nothing was saved".to_string(),
            };
            Err(PyKeyboardInterrupt::new_err(format!("training stopped after step {step}; {saved}")))
        }
        (Err(TrainError::Interrupted { .. }), Some(e)) => Err(e),
        // Finished (or failed) before the stop was seen: the training's own
        // outcome stands, then the pending Python error.
        (Ok(_), Some(e)) => Err(e),
        (Err(e), _) => Err(train_error(py, e)),
    }
}

/// `sparrow gen`: generated data whose true click probabilities are known;
/// returns `truth.json`'s content.
#[pyfunction]
#[pyo3(signature = (out, train_rows, test_rows, seed, format, days=None, shuffled=false))]
#[expect(clippy::too_many_arguments, reason = "the Python function's keyword arguments")]
fn generate(
    py: Python<'_>,
    out: PathBuf,
    train_rows: u64,
    test_rows: u64,
    seed: u64,
    format: &str,
    days: Option<u32>,
    shuffled: bool,
) -> PyResult<String> {
    let truth = match (format, days) {
        ("criteo", None) if shuffled => {
            return Err(exception(py, "ArgumentError", "shuffled=True goes with format='csv' and days".into()));
        }
        ("criteo", Some(_)) => {
            return Err(exception(py, "ArgumentError", "days writes CSV with a ts column: pass format='csv'".into()));
        }
        ("criteo", None) => py.detach(|| sparrow_data::synth::generate(&out, train_rows, test_rows, seed)),
        ("csv", days) => py.detach(|| {
            sparrow_data::synth::generate_days(&out, train_rows, test_rows, days.unwrap_or(1), shuffled, seed)
        }),
        (other, _) => {
            return Err(exception(py, "ArgumentError", format!("format={other:?}: expected 'criteo' or 'csv'")));
        }
    };
    let truth = truth.map_err(|e| train_error(py, e.into()))?;
    serde_json::to_string(&truth).map_err(|e| exception(py, "SparrowError", e.to_string()))
}

/// `sparrow eval`: AUC and log-loss of a checkpoint on a data file.
#[pyfunction]
fn evaluate(py: Python<'_>, checkpoint: PathBuf, data: PathBuf, overrides: Vec<String>) -> PyResult<String> {
    let summary = py
        .detach(|| {
            let overrides = edge_overrides(&overrides)?;
            sparrow_trainer::evaluate_checkpoint(&checkpoint, &data, &overrides, None)
        })
        .map_err(|e| train_error(py, e))?;
    serde_json::to_string(&summary).map_err(|e| exception(py, "SparrowError", e.to_string()))
}

/// `SPARROW_SIMD`, read here at the edge, as the `sparrow` binary reads it.
fn simd_from_env() -> Result<Option<sparrow_core::simd::Simd>, String> {
    use sparrow_core::simd::{Simd, VARIABLE};
    match std::env::var(VARIABLE) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => Simd::parse(&v).map(Some),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(format!("{VARIABLE}={v:?}: expected `auto`, `avx512`, `avx2` or `portable`"))
        }
    }
}

/// The caller's overrides after what the environment sets (`SPARROW_SIMD`
/// as `train.simd`; the caller's own setting of that key wins).
fn edge_overrides(assignments: &[String]) -> Result<Overrides, sparrow_core::config::ConfigError> {
    // Checked at import: a bad value cannot reach here.
    let simd = simd_from_env().ok().flatten();
    let mut all: Vec<String> = simd.map(|s| format!("train.simd={:?}", s.name())).into_iter().collect();
    all.extend(assignments.iter().cloned());
    Overrides::parse(&all)
}

/// One column of rows handed to `Model.predict_columns`.
enum Column {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Uint(Vec<u64>),
    Text(Vec<String>),
    /// A behaviour sequence: each row's IDs, oldest first.
    Lists(Vec<Vec<String>>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::Float(v) => v.len(),
            Column::Int(v) => v.len(),
            Column::Uint(v) => v.len(),
            Column::Text(v) => v.len(),
            Column::Lists(v) => v.len(),
        }
    }
}

/// The largest count a Criteo file's integer cell holds (18 digits).
const CRITEO_MAX_COUNT: u64 = 999_999_999_999_999_999;

/// Integers up to this are exact in f64 (above it, the file's decimal is read).
const F64_EXACT: u64 = 1 << 53;

/// The given columns by input, as the batch builder reads them: each value
/// read as the data file's reader reads the cell holding it.
struct GivenColumns<'a> {
    inputs: &'a ModelInputs,
    dense: Vec<Option<(&'a str, &'a Column)>>,
    sparse: Vec<Option<(&'a str, &'a Column)>>,
    sequences: Vec<Option<(&'a str, &'a Column)>>,
}

impl GivenColumns<'_> {
    /// An integer count or number, as its decimal reads in a cell.
    fn integer(&self, negative: bool, magnitude: u64) -> Result<Option<f64>, String> {
        let signed = |v: f64| if negative { -v } else { v };
        if self.inputs.dense_are_counts() {
            if magnitude > CRITEO_MAX_COUNT {
                return Err(format!("`{}{magnitude}` is not an integer", if negative { "-" } else { "" }));
            }
            // Criteo's reader takes log(1 + x) of the integer as f64, as here.
            return Ok(Some(signed(magnitude as f64)));
        }
        if magnitude <= F64_EXACT {
            return Ok(Some(signed(magnitude as f64)));
        }
        // Past 2^53 the f64 would round once and f32 again: read the decimal.
        let text = format!("{}{magnitude}", if negative { "-" } else { "" });
        self.inputs.rules.dense_text(&text)
    }
}

impl ColumnValues for GivenColumns<'_> {
    type Error = String;

    fn dense(&self, column: usize, row: usize) -> Result<Option<f64>, String> {
        let Some((name, values)) = self.dense[column] else { return Ok(None) };
        let read = match values {
            Column::Float(v) if v[row].is_nan() => Ok(None),
            Column::Float(v) => {
                let x = v[row];
                // Criteo's cell holds the decimal `x` prints: an integer of at most 18 digits.
                let whole = x.fract() == 0.0 && x.abs() < 1e18;
                if self.inputs.dense_are_counts() && !whole {
                    Err(format!("`{x}` is not an integer"))
                } else {
                    Ok(Some(x))
                }
            }
            Column::Int(v) => self.integer(v[row] < 0, v[row].unsigned_abs()),
            Column::Uint(v) => self.integer(false, v[row]),
            Column::Text(v) => self.inputs.rules.dense_text(&v[row]),
            Column::Lists(_) => Err("a list is not a number".into()),
        };
        read.map_err(|e| format!("column `{name}`, row {row}: {e}"))
    }

    fn sparse(&self, column: usize, row: usize) -> Result<Option<Cow<'_, [u8]>>, String> {
        let Some((_, values)) = self.sparse[column] else { return Ok(None) };
        // An ID is its cell's text: a number's is the decimal it prints.
        Ok(match values {
            Column::Float(v) if v[row].is_nan() => None,
            Column::Float(v) => Some(Cow::Owned(v[row].to_string().into_bytes())),
            Column::Int(v) => Some(Cow::Owned(v[row].to_string().into_bytes())),
            Column::Uint(v) => Some(Cow::Owned(v[row].to_string().into_bytes())),
            Column::Text(v) => Some(Cow::Borrowed(v[row].as_bytes())),
            Column::Lists(_) => None,
        })
    }

    /// A list of IDs a row, or a string of them between the data's separator.
    fn sequence(&self, column: usize, row: usize) -> Result<Vec<Cow<'_, [u8]>>, String> {
        let Some((_, values)) = self.sequences[column] else { return Ok(Vec::new()) };
        Ok(match values {
            Column::Lists(v) => v[row].iter().map(|id| Cow::Borrowed(id.as_bytes())).collect(),
            Column::Text(v) => {
                let sep = self.inputs.rules.separator().unwrap_or("|");
                v[row].split(sep).map(|id| Cow::Borrowed(id.as_bytes())).collect()
            }
            _ => Vec::new(),
        })
    }

    fn refused(&self, column: Option<InputColumn>, row: usize, message: String) -> String {
        let name = match column {
            Some(InputColumn::Dense(i)) => self.inputs.dense.get(i),
            Some(InputColumn::Sparse(i)) => self.inputs.sparse.get(i),
            _ => None,
        };
        match name {
            Some(name) => format!("column `{name}`, row {row}: {message}"),
            None => format!("row {row}: {message}"),
        }
    }
}

/// A model loaded for prediction (from a checkpoint or a serving export).
#[pyclass(module = "sparrow._native", name = "Model", frozen)]
struct Model {
    model: sparrow_trainer::Model,
    inputs: Result<ModelInputs, String>,
    pool: rayon::ThreadPool,
    step: u64,
    path: PathBuf,
}

impl Model {
    /// Probabilities of every good row of `data` (as `sparrow predict`
    /// writes them); with `strict`, a malformed row is an error instead.
    fn predict_path(&self, data: &Path) -> Result<Vec<f32>, TrainError> {
        let read = &self.model.config.data;
        let (logits, _) = self.pool.install(|| sparrow_trainer::run::score_file(&self.model, data, read))?;
        Ok(self.probabilities(&logits))
    }

    /// Each row's probabilities, task by task (a multiclass task's one a class).
    fn probabilities(&self, logits: &[f32]) -> Vec<f32> {
        let tasks = self.model.config.tasks();
        let per_row: usize = tasks.iter().map(|t| t.outputs).sum();
        let mut out = Vec::with_capacity(logits.len());
        for row in logits.chunks_exact(per_row.max(1)) {
            sparrow_core::metrics::tasks::row_probabilities(&tasks, row, &mut out);
        }
        out
    }

    /// What each row's probabilities are: (task, values a row), in order.
    fn layout(&self) -> Vec<(String, usize)> {
        self.model.config.tasks().into_iter().map(|t| (t.name, t.outputs)).collect()
    }
}

fn f32_bytes<'py>(py: Python<'py>, values: &[f32]) -> Bound<'py, PyBytes> {
    let mut bytes = Vec::with_capacity(values.len() * 4);
    for v in values {
        bytes.extend_from_slice(&v.to_ne_bytes());
    }
    PyBytes::new(py, &bytes)
}

/// A numeric column's values from its native-endian bytes.
fn words<T>(bytes: &[u8], from: fn([u8; 8]) -> T) -> Vec<T> {
    bytes.chunks_exact(8).map(|c| from(c.try_into().unwrap_or_default())).collect()
}

#[pymethods]
impl Model {
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf, overrides: Vec<String>) -> PyResult<Model> {
        let loaded = py.detach(|| -> Result<Model, TrainError> {
            let (model, step) = sparrow_trainer::run::load_model(&path, &edge_overrides(&overrides)?)?;
            let pool = sparrow_trainer::run::compute_pool(model.config.train.threads)?;
            let inputs = ModelInputs::of(&model.config.data);
            Ok(Model { model, inputs, pool, step, path: path.clone() })
        });
        loaded.map_err(|e| train_error(py, e))
    }

    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// What `sparrow serve` and the ONNX export answer for this model, in
    /// their order: (name, values a row), from the one `ServedOutput` list.
    fn outputs(&self) -> Vec<(String, usize)> {
        self.model.config.served_outputs().0.into_iter().map(|o| (o.name, o.per_row)).collect()
    }

    /// The model kind (`mlp`, `dcn_v2`, …), the data format it reads, the
    /// label's column name, and the input columns' names.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let config = &self.model.config;
        let d = PyDict::new(py);
        d.set_item("model", config.model.kind.name())?;
        d.set_item("format", format!("{:?}", config.data.format).to_lowercase())?;
        if let Ok(inputs) = &self.inputs {
            d.set_item("label", inputs.label())?;
            d.set_item("labels", &inputs.labels)?;
            d.set_item("sequences", inputs.sequences.iter().map(|q| &q.name).collect::<Vec<_>>())?;
            d.set_item("inputs", inputs.names().collect::<Vec<_>>())?;
        }
        Ok(d)
    }

    /// Probabilities (float32, native-endian bytes) of every good row of a
    /// data file, each row's task by task, and what they are ([`layout`](Self::layout)).
    fn predict_file<'py>(&self, py: Python<'py>, data: PathBuf) -> PyResult<Scored<'py>> {
        let probabilities = py.detach(|| self.predict_path(&data)).map_err(|e| train_error(py, e))?;
        Ok((f32_bytes(py, &probabilities), self.layout()))
    }

    /// Probabilities of rows given as columns: `(name, kind, values)` with
    /// kind `f` (float64 bytes), `i` (int64 bytes), `u` (uint64 bytes) or
    /// `s` (a list of str), or `l` (a list of lists of str: a behaviour
    /// sequence's IDs a row). Each value goes into the batch through the data
    /// format's reading rules, as `sparrow predict` reads the cell holding
    /// it (no text line, no file), so the numbers are the CLI's; a value the
    /// format refuses is an error naming its column and row.
    fn predict_columns<'py>(
        &self,
        py: Python<'py>,
        columns: Vec<(String, String, Bound<'py, PyAny>)>,
    ) -> PyResult<Scored<'py>> {
        let inputs = self.inputs.as_ref().map_err(|m| exception(py, "DataError", m.clone()))?;
        let mut given: Vec<(String, Column)> = Vec::with_capacity(columns.len());
        for (name, kind, values) in columns {
            let column = match kind.as_str() {
                "f" => Column::Float(words(values.cast::<PyBytes>()?.as_bytes(), f64::from_ne_bytes)),
                "i" => Column::Int(words(values.cast::<PyBytes>()?.as_bytes(), i64::from_ne_bytes)),
                "u" => Column::Uint(words(values.cast::<PyBytes>()?.as_bytes(), u64::from_ne_bytes)),
                "l" => Column::Lists(values.cast::<PyList>()?.extract()?),
                _ => Column::Text(values.cast::<PyList>()?.extract()?),
            };
            given.push((name, column));
        }
        let columns = place_columns(inputs, &given).map_err(|m| exception(py, "DataError", m))?;
        let rows = given.first().map_or(0, |(_, c)| c.len());
        let mut probabilities = Vec::with_capacity(rows);
        // Chunks of rows, with Python's signals checked between them: Ctrl-C
        // on a million rows stops within a chunk, not at the end.
        for start in (0..rows).step_by(PREDICT_CHUNK_ROWS) {
            let end = (start + PREDICT_CHUNK_ROWS).min(rows);
            let scored = py.detach(|| {
                let batch = inputs.batch(&self.model.layout, &columns, start..end).map_err(Failure::Input)?;
                self.pool.install(|| self.model.predict_batch(&batch)).map_err(Failure::Train)
            });
            probabilities.extend(self.probabilities(&scored.map_err(|f| failure(py, f))?));
            tracing::debug!(target: "sparrow.predict", "scored rows {start}..{end} of {rows}");
            // A Python handler of that record may raise (KeyboardInterrupt
            // when Ctrl-C lands during it): pyo3-log leaves it set, not returned.
            if let Some(e) = PyErr::take(py) {
                return Err(e);
            }
            py.check_signals()?;
        }
        Ok((f32_bytes(py, &probabilities), self.layout()))
    }
}

/// Rows' probabilities (float32, native-endian bytes, each row's tasks
/// side by side) and what they are: (task, values a row), in order.
type Scored<'py> = (Bound<'py, PyBytes>, Vec<(String, usize)>);

/// Rows scored between two checks for signals (Ctrl-C).
const PREDICT_CHUNK_ROWS: usize = 65_536;

fn failure(py: Python<'_>, f: Failure) -> PyErr {
    match f {
        Failure::Input(m) => exception(py, "DataError", m),
        Failure::Train(e) => train_error(py, e),
    }
}

enum Failure {
    Input(String),
    Train(TrainError),
}

/// The given columns placed by input, checked: equal lengths, names the
/// model reads (the label and a CSV timestamp are accepted, not read), and
/// no text a line of the data file could not hold.
fn place_columns<'a>(inputs: &'a ModelInputs, given: &'a [(String, Column)]) -> Result<GivenColumns<'a>, String> {
    let rows = given.first().map_or(0, |(_, c)| c.len());
    let mut placed = GivenColumns {
        inputs,
        dense: vec![None; inputs.dense.len()],
        sparse: vec![None; inputs.sparse.len()],
        sequences: vec![None; inputs.sequences.len()],
    };
    for (name, column) in given {
        if column.len() != rows {
            return Err(format!("column `{name}` has {} rows, column `{}` {rows}", column.len(), given[0].0));
        }
        let slot = match inputs.column(name) {
            Some(InputColumn::Dense(i)) => &mut placed.dense[i],
            Some(InputColumn::Sparse(i)) => &mut placed.sparse[i],
            Some(InputColumn::Sequence(j)) => &mut placed.sequences[j],
            Some(InputColumn::Unused) => continue,
            None => {
                let names: Vec<&str> = inputs.names().map(String::as_str).collect();
                return Err(format!("column `{name}`: the model has no such input (its inputs: {})", names.join(", ")));
            }
        };
        if let Column::Text(values) = column {
            for (row, value) in values.iter().enumerate() {
                inputs.check_text(value).map_err(|e| format!("column `{name}`, row {row}: {e}"))?;
            }
        }
        let is_sequence = matches!(inputs.column(name), Some(InputColumn::Sequence(_)));
        match column {
            Column::Lists(lists) if is_sequence => {
                for (row, ids) in lists.iter().enumerate() {
                    for id in ids {
                        inputs.check_text(id).map_err(|e| format!("column `{name}`, row {row}: {e}"))?;
                    }
                }
            }
            Column::Lists(_) => return Err(format!("column `{name}` holds lists: it takes one value a row")),
            Column::Text(_) if is_sequence => {}
            _ if is_sequence => {
                return Err(format!("column `{name}` is a behaviour sequence: give a list of IDs (str) a row"));
            }
            _ => {}
        }
        *slot = Some((name.as_str(), column));
    }
    Ok(placed)
}

/// mimalloc's purge delay option (see the `sparrow` binary's main.rs).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Steps reuse the same sizes: keep freed pages rather than fault them back.
    #[expect(unsafe_code, reason = "FFI call into mimalloc")]
    // SAFETY: mi_option_set takes any option id and value and only stores
    // the value (options are plain integers read at each purge).
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
    }
    // Library logs go to Python's `logging` (a second import keeps the first logger).
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)?.install();
    // As the `sparrow` binary: a SPARROW_SIMD value other than auto/avx512/avx2/portable fails the import.
    simd_from_env().map_err(pyo3::exceptions::PyValueError::new_err)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_class::<Model>()?;
    Ok(())
}
