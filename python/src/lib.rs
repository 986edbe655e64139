//! `sparrow._native`: the Rust side of the `sparrow` Python package. The
//! Python side (`python/sparrow/`) shapes arguments and results; this module
//! runs the same library calls as the `sparrow` command (train, gen,
//! evaluate, predict), with the GIL released while they work.
//!
//! Errors become the exception classes of `sparrow._errors`, carrying the
//! CLI's message; Ctrl-C during training stops it after the current step,
//! writes the checkpoint, and raises `KeyboardInterrupt`.

use sparrow_core::Overrides;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::RecvTimeoutError;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use sparrow_core::Config;
use sparrow_core::config::{DataConfig, DataFormat};
use sparrow_core::metrics::sigmoid;
use sparrow_trainer::progress::ProgressUpdate;
use sparrow_trainer::{TrainError, Trainer};

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
    Overrides::parse(overrides).and_then(|o| Config::from_toml(&text, &source, &o)).map_err(|e| config_error(py, e))
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
            let overrides = Overrides::parse(&overrides)?;
            sparrow_trainer::evaluate_checkpoint(&checkpoint, &data, &overrides, None)
        })
        .map_err(|e| train_error(py, e))?;
    serde_json::to_string(&summary).map_err(|e| exception(py, "SparrowError", e.to_string()))
}

/// One column of rows handed to `Model.predict_columns`.
enum Column {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Uint(Vec<u64>),
    Text(Vec<String>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::Float(v) => v.len(),
            Column::Int(v) => v.len(),
            Column::Uint(v) => v.len(),
            Column::Text(v) => v.len(),
        }
    }

    /// Row `i` as the data file's text would hold it (NaN: an empty cell).
    fn cell(&self, i: usize, out: &mut String) {
        use std::fmt::Write as _;
        match self {
            Column::Float(v) if v[i].is_nan() => {}
            Column::Float(v) => {
                let _ = write!(out, "{}", v[i]);
            }
            Column::Int(v) => {
                let _ = write!(out, "{}", v[i]);
            }
            Column::Uint(v) => {
                let _ = write!(out, "{}", v[i]);
            }
            Column::Text(v) => out.push_str(&v[i]),
        }
    }

    /// [`Column::cell`] on a CSV line: a value holding the delimiter or a
    /// quote is quoted ("" for a quote), as the CSV reader reads it.
    fn csv_cell(&self, i: usize, delimiter: char, out: &mut String) {
        match self {
            Column::Text(v) if v[i].contains(delimiter) || v[i].contains('"') => {
                out.push('"');
                out.push_str(&v[i].replace('"', "\"\""));
                out.push('"');
            }
            _ => self.cell(i, out),
        }
    }
}

/// The columns a model reads, in the order its data file holds them.
struct InputSchema {
    label: String,
    /// (column name, place in the line) of every input, dense then sparse.
    inputs: Vec<(String, usize)>,
    /// CSV: the header line to write (None: Criteo, or a CSV without header).
    header: Option<String>,
    /// The line's width and its separator.
    width: usize,
    delimiter: char,
    /// Where the label goes, and columns that must hold a value (a CSV
    /// timestamp column: written as 0 unless given).
    label_at: usize,
    fixed: Vec<(String, usize, String)>,
}

impl InputSchema {
    fn of(data: &DataConfig) -> Result<InputSchema, String> {
        match data.format {
            DataFormat::Criteo => {
                let dense = (1..=13).map(|i| format!("I{i}"));
                let sparse = (1..=26).map(|i| format!("C{i}"));
                let inputs: Vec<(String, usize)> = dense.chain(sparse).enumerate().map(|(i, n)| (n, i + 1)).collect();
                Ok(InputSchema {
                    label: "label".into(),
                    width: inputs.len() + 1,
                    inputs,
                    header: None,
                    delimiter: '\t',
                    label_at: 0,
                    fixed: Vec::new(),
                })
            }
            DataFormat::Csv => {
                let schema = data.schema.clone().unwrap_or_default();
                let delimiter = schema.delimiter.chars().next().unwrap_or(',');
                let mut names: Vec<String> = vec![schema.label.clone()];
                names.extend(schema.dense.iter().cloned());
                names.extend(schema.sparse.iter().cloned());
                if let Some(ts) = &schema.timestamp {
                    names.push(ts.clone());
                }
                // Without a header, the schema names columns by number.
                let places: Vec<usize> = if schema.header {
                    (0..names.len()).collect()
                } else {
                    names
                        .iter()
                        .map(|n| n.parse::<usize>().map_err(|_| format!("schema column `{n}` is not a column number")))
                        .collect::<Result<_, _>>()?
                };
                let width = places.iter().max().map_or(0, |m| m + 1);
                let inputs_end = 1 + schema.dense.len() + schema.sparse.len();
                let inputs = (1..inputs_end).map(|i| (names[i].clone(), places[i])).collect();
                let fixed =
                    schema.timestamp.iter().map(|ts| (ts.clone(), places[inputs_end], "0".to_string())).collect();
                Ok(InputSchema {
                    label: schema.label.clone(),
                    inputs,
                    header: schema.header.then(|| names.join(&delimiter.to_string())),
                    width,
                    delimiter,
                    label_at: places[0],
                    fixed,
                })
            }
            other => Err(format!(
                "the model reads data.format = {other:?}: pass its rows as a file path (columns are read for criteo \
                 and csv models)"
            )),
        }
    }
}

/// A model loaded for prediction (from a checkpoint or a serving export).
#[pyclass(module = "sparrow._native", name = "Model", frozen)]
struct Model {
    trainer: parking_lot::Mutex<Trainer>,
    pool: rayon::ThreadPool,
    step: u64,
    path: PathBuf,
}

impl Model {
    /// Probabilities of every good row of `data` (as `sparrow predict`
    /// writes them); with `strict`, a malformed row is an error instead.
    fn predict_path(&self, data: &Path, strict: bool) -> Result<Vec<f32>, TrainError> {
        let trainer = self.trainer.lock();
        let mut read = trainer.config.data.clone();
        if strict {
            read.max_bad_rows = 0;
        }
        let (logits, _) = self.pool.install(|| sparrow_trainer::run::score_file(&trainer, data, &read))?;
        Ok(logits.iter().map(|&x| sigmoid(f64::from(x)) as f32).collect())
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
            let (trainer, step) = sparrow_trainer::run::load_model(&path, &Overrides::parse(&overrides)?)?;
            let pool = sparrow_trainer::run::compute_pool(trainer.config.train.threads)?;
            Ok(Model { trainer: parking_lot::Mutex::new(trainer), pool, step, path: path.clone() })
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

    /// The model kind (`mlp`, `dcn_v2`, …), the data format it reads, the
    /// label's column name, and the input columns' names.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let trainer = self.trainer.lock();
        let d = PyDict::new(py);
        d.set_item("model", trainer.config.model.kind.name())?;
        d.set_item("format", format!("{:?}", trainer.config.data.format).to_lowercase())?;
        if let Ok(schema) = InputSchema::of(&trainer.config.data) {
            d.set_item("label", schema.label)?;
            d.set_item("inputs", schema.inputs.into_iter().map(|(n, _)| n).collect::<Vec<_>>())?;
        }
        Ok(d)
    }

    /// Probabilities (float32, native-endian bytes) of every good row of a data file.
    fn predict_file<'py>(&self, py: Python<'py>, data: PathBuf) -> PyResult<Bound<'py, PyBytes>> {
        let probabilities = py.detach(|| self.predict_path(&data, false)).map_err(|e| train_error(py, e))?;
        Ok(f32_bytes(py, &probabilities))
    }

    /// Probabilities of rows given as columns: `(name, kind, values)` with
    /// kind `f` (float64 bytes), `i` (int64 bytes), `u` (uint64 bytes) or
    /// `s` (a list of str). The rows are written in the model's data format
    /// and read back as `sparrow predict` reads a file, so the numbers are
    /// the CLI's; any malformed row is an error naming it.
    fn predict_columns<'py>(
        &self,
        py: Python<'py>,
        columns: Vec<(String, String, Bound<'py, PyAny>)>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data_config = self.trainer.lock().config.data.clone();
        let schema = InputSchema::of(&data_config).map_err(|m| exception(py, "DataError", m))?;
        let mut given: Vec<(String, Column)> = Vec::with_capacity(columns.len());
        for (name, kind, values) in columns {
            let column = match kind.as_str() {
                "f" => Column::Float(words(values.cast::<PyBytes>()?.as_bytes(), f64::from_ne_bytes)),
                "i" => Column::Int(words(values.cast::<PyBytes>()?.as_bytes(), i64::from_ne_bytes)),
                "u" => Column::Uint(words(values.cast::<PyBytes>()?.as_bytes(), u64::from_ne_bytes)),
                _ => Column::Text(values.cast::<PyList>()?.extract()?),
            };
            given.push((name, column));
        }
        // Chunks of rows, with Python's signals checked between them: Ctrl-C
        // on a million rows stops within a chunk, not at the end.
        let slots = self.place_columns(&schema, &given).map_err(|f| failure(py, f))?;
        let rows = given.first().map_or(0, |(_, c)| c.len());
        let dir = private_dir().map_err(|e| train_error(py, e))?;
        let mut probabilities = Vec::with_capacity(rows);
        for start in (0..rows).step_by(PREDICT_CHUNK_ROWS) {
            let end = (start + PREDICT_CHUNK_ROWS).min(rows);
            let chunk = py.detach(|| self.score_rows(&schema, &slots, start..end, dir.path()));
            probabilities.extend(chunk.map_err(|f| failure(py, f))?);
            py.check_signals()?;
        }
        Ok(f32_bytes(py, &probabilities))
    }
}

/// Rows scored between two checks for signals (Ctrl-C).
const PREDICT_CHUNK_ROWS: usize = 65_536;

fn failure(py: Python<'_>, f: Failure) -> PyErr {
    match f {
        Failure::Input(m) => exception(py, "DataError", m),
        Failure::Train(e) => train_error(py, e),
    }
}

/// A directory of our own (mode 0700, a random name) for the rows' files:
/// no other user can plant a file or a symlink where one is written.
fn private_dir() -> Result<tempfile::TempDir, TrainError> {
    tempfile::Builder::new().prefix("sparrow-predict-").tempdir().map_err(|e| TrainError::io(&std::env::temp_dir(), e))
}

enum Failure {
    Input(String),
    Train(TrainError),
}

impl Model {
    /// Each line slot's column, the given columns checked (lengths, names,
    /// values a line cannot hold).
    fn place_columns<'a>(
        &self,
        schema: &InputSchema,
        given: &'a [(String, Column)],
    ) -> Result<Vec<Option<&'a Column>>, Failure> {
        let rows = given.first().map_or(0, |(_, c)| c.len());
        // Each line slot: the given column for it, if any.
        let mut slots: Vec<Option<&Column>> = vec![None; schema.width];
        for (name, column) in given {
            if column.len() != rows {
                return Err(Failure::Input(format!(
                    "column `{name}` has {} rows, column `{}` {rows}",
                    column.len(),
                    given[0].0
                )));
            }
            if *name == schema.label {
                continue;
            }
            let place = schema
                .inputs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, p)| *p)
                .or_else(|| schema.fixed.iter().find(|(n, _, _)| n == name).map(|(_, p, _)| *p));
            let Some(place) = place else {
                let names: Vec<&str> = schema.inputs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(Failure::Input(format!(
                    "column `{name}`: the model has no such input (its inputs: {})",
                    names.join(", ")
                )));
            };
            // A CSV cell may hold the delimiter or a quote (it is quoted); a
            // Criteo cell may not hold a tab.
            let tsv = schema.delimiter == '\t';
            if let Column::Text(values) = column
                && let Some(row) = values.iter().position(|v| v.contains(['\n', '\r']) || (tsv && v.contains('\t')))
            {
                return Err(Failure::Input(format!(
                    "column `{name}`, row {row}: {:?} holds a line break{}",
                    values[row],
                    if tsv { " or a tab" } else { "" }
                )));
            }
            slots[place] = Some(column);
        }
        Ok(slots)
    }

    /// Probabilities of rows `range`: written in the model's data format to
    /// a new file in `dir` (created, never opened if there), read back as
    /// `sparrow predict` reads a file, and removed.
    fn score_rows(
        &self,
        schema: &InputSchema,
        slots: &[Option<&Column>],
        range: std::ops::Range<usize>,
        dir: &Path,
    ) -> Result<Vec<f32>, Failure> {
        let file = dir.join(format!("rows-{}.txt", range.start));
        let start = range.start;
        let written = write_rows(&file, schema, slots, range.clone());
        let result = match written {
            Ok(()) => self.predict_path(&file, true).map_err(Failure::Train),
            Err(e) => Err(Failure::Train(TrainError::io(&file, e))),
        };
        let _ = std::fs::remove_file(&file);
        let probabilities = result.map_err(|f| match f {
            Failure::Train(TrainError::Data(e)) => Failure::Input(format!(
                "the rows given, written in the model's data format to {e} (line {} is row {start})",
                if schema.header.is_some() { 2 } else { 1 }
            )),
            other => other,
        })?;
        // Strict reading: a malformed row was an error, so each row has its probability.
        debug_assert_eq!(probabilities.len(), range.len());
        Ok(probabilities)
    }
}

/// Rows `rows` as the data file's lines, into a file created new (never
/// one already there, nor through a symlink), readable by its owner only.
fn write_rows(
    path: &Path,
    schema: &InputSchema,
    slots: &[Option<&Column>],
    rows: std::ops::Range<usize>,
) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    let mut w = BufWriter::new(file);
    if let Some(header) = &schema.header {
        writeln!(w, "{header}")?;
    }
    let mut line = String::new();
    for row in rows {
        line.clear();
        for (place, slot) in slots.iter().enumerate() {
            if place > 0 {
                line.push(schema.delimiter);
            }
            match slot {
                Some(column) if schema.delimiter == '\t' => column.cell(row, &mut line),
                Some(column) => column.csv_cell(row, schema.delimiter, &mut line),
                None if place == schema.label_at => line.push('0'),
                None => {
                    if let Some((_, _, value)) = schema.fixed.iter().find(|(_, p, _)| *p == place) {
                        line.push_str(value);
                    }
                }
            }
        }
        line.push('\n');
        w.write_all(line.as_bytes())?;
    }
    w.flush()
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
    // As the `sparrow` binary: a SPARROW_SIMD value other than auto/portable fails the import.
    sparrow_core::simd::SimdChoice::from_env().map_err(pyo3::exceptions::PyValueError::new_err)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_class::<Model>()?;
    Ok(())
}
