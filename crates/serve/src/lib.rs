//! `sparrow serve`: a serving export behind the Open Inference Protocol
//! (KServe v2 REST: `GET /v2/health/live|ready`, `GET /v2/models/{name}`,
//! `GET /v2/models/{name}/ready`, `POST /v2/models/{name}/infer`), so KServe,
//! Triton and Seldon clients work unchanged, plus `/metrics` for Prometheus.
//! Built on axum (hyper underneath).
//!
//! Inputs are the data file's columns by the schema's names (Criteo: `I1`…`I13`
//! as `FP32`, `C1`…`C26` as `BYTES`; CSV: the schema's dense and sparse
//! columns), shape `[N]`; a missing input is an empty cell. Each request row goes through the same line parser as `sparrow
//! predict`, so the output `probability` equals its figures.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_core::config::DataFormat;
use sparrow_core::metrics::sigmoid;
use sparrow_data::layout::{CRITEO_DENSE, CRITEO_SPARSE};
use sparrow_data::text::{CriteoParser, LineParser};
use sparrow_trainer::export::{ExportData, ExportManifest};
use sparrow_trainer::trainer::Trainer;

/// How `sparrow serve` runs.
pub struct ServeOptions {
    pub model: PathBuf,
    pub listen: SocketAddr,
    /// The model's name (default: the export directory's name).
    pub name: Option<String>,
    /// Requests with a larger body are refused (413).
    pub max_body_bytes: usize,
    /// `--watch`: how often `model/LATEST` is read; a new export named
    /// there is applied while serving (None: the model never changes).
    pub watch: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Model(#[from] sparrow_trainer::TrainError),
    #[error("{0}")]
    Setup(String),
    #[error("listening on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

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
    metrics: Metrics,
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

struct Metrics {
    registry: prometheus::Registry,
    requests: prometheus::IntCounterVec,
    rows: prometheus::IntCounter,
    seconds: prometheus::Histogram,
    model_step: prometheus::IntGauge,
    swaps: prometheus::IntCounterVec,
    swap_locked: prometheus::Gauge,
    staleness: prometheus::Gauge,
}

impl Metrics {
    fn new() -> Metrics {
        let registry = prometheus::Registry::new();
        let requests = prometheus::IntCounterVec::new(
            prometheus::Opts::new("sparrow_serve_requests_total", "inference requests by HTTP status"),
            &["code"],
        )
        .expect("valid metric");
        let rows = prometheus::IntCounter::new("sparrow_serve_rows_total", "rows scored").expect("valid metric");
        let seconds = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
            "sparrow_serve_infer_seconds",
            "time to answer an inference request",
        ))
        .expect("valid metric");
        let model_step = prometheus::IntGauge::new("sparrow_serve_model_step", "training step of the model served")
            .expect("valid metric");
        let swaps = prometheus::IntCounterVec::new(
            prometheus::Opts::new("sparrow_serve_swaps_total", "--watch: exports applied, by kind (delta, full)"),
            &["kind"],
        )
        .expect("valid metric");
        let swap_locked = prometheus::Gauge::new(
            "sparrow_serve_swap_lock_seconds",
            "--watch: how long the last swap held the model (requests waited, none failed)",
        )
        .expect("valid metric");
        let staleness = prometheus::Gauge::new(
            "sparrow_serve_staleness_seconds",
            "--watch: at the last swap, the longest a row's update had waited to be served",
        )
        .expect("valid metric");
        for metric in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(rows.clone()),
            Box::new(seconds.clone()),
            Box::new(model_step.clone()),
            Box::new(swaps.clone()),
            Box::new(swap_locked.clone()),
            Box::new(staleness.clone()),
        ] {
            registry.register(metric).expect("registered once");
        }
        Metrics { registry, requests, rows, seconds, model_step, swaps, swap_locked, staleness }
    }
}

/// A request the server refuses: its status and message (KServe's `{"error": …}`).
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, axum::Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message.into())
}

/// A model's inputs (dense then sparse, named as its data schema names
/// them) and how a request row becomes the line its data file would hold.
#[derive(Clone)]
struct Inputs {
    dense: Vec<String>,
    sparse: Vec<String>,
    /// CSV: the schema read against a header of our own (label, dense,
    /// sparse, in that order), with its delimiter. None: Criteo TSV.
    csv: Option<(sparrow_core::config::Schema, String, char)>,
}

impl Inputs {
    fn of(model: &Path, data: &sparrow_core::config::DataConfig) -> Result<Inputs, ServeError> {
        match data.format {
            DataFormat::Criteo => Ok(Inputs {
                dense: (1..=CRITEO_DENSE).map(|i| format!("I{i}")).collect(),
                sparse: (1..=CRITEO_SPARSE).map(|i| format!("C{i}")).collect(),
                csv: None,
            }),
            DataFormat::Csv => {
                let mut schema = data.schema.clone().unwrap_or_default();
                let delimiter = schema.delimiter.chars().next().unwrap_or(',');
                // Our lines carry no time: serving does not weight samples.
                schema.timestamp = None;
                schema.header = true;
                let names: Vec<&str> = std::iter::once(schema.label.as_str())
                    .chain(schema.dense.iter().map(String::as_str))
                    .chain(schema.sparse.iter().map(String::as_str))
                    .collect();
                let header = names.join(&delimiter.to_string());
                Ok(Inputs {
                    dense: schema.dense.clone(),
                    sparse: schema.sparse.clone(),
                    csv: Some((schema, header, delimiter)),
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

    fn separator(&self) -> char {
        self.csv.as_ref().map_or('\t', |(_, _, d)| *d)
    }

    fn parser(&self) -> Result<Box<dyn LineParser>, ApiError> {
        match &self.csv {
            None => Ok(Box::new(CriteoParser::default())),
            Some((schema, header, _)) => {
                sparrow_data::text::CsvParser::new(Path::new("request"), schema, Some(header.as_bytes()))
                    .map(|p| Box::new(p) as Box<dyn LineParser>)
                    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
            }
        }
    }
}

impl Served {
    /// Loads an export (checksums verified first: a damaged one is refused naming its file).
    pub fn load(model: &Path, name: Option<String>) -> Result<Served, ServeError> {
        let (trainer, manifest) = sparrow_trainer::export::load_export(model, &[])?;
        let dir = sparrow_trainer::export::resolve_export(model)?;
        let inputs = Inputs::of(model, &trainer.config.data)?;
        let name = name.unwrap_or_else(|| {
            let dir = sparrow_trainer::export::resolve_export(model).unwrap_or_else(|_| model.to_path_buf());
            dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "model".into())
        });
        let metrics = Metrics::new();
        metrics.model_step.set(manifest.step as i64);
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

    /// `--watch`: if `LATEST` names another export than the one served,
    /// serve that one. The exports that follow the served one in its chain
    /// are read and verified first, then applied under the model's write lock
    /// (requests wait for it, none fails, none sees half an update); an
    /// export of another chain (a full one) is loaded beside the served
    /// model and swapped in. On an error the served model stays.
    pub fn refresh(&self) -> Result<Option<Swap>, sparrow_trainer::TrainError> {
        let newest = sparrow_trainer::export::resolve_export(&self.source)?;
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
                let (fresh, _) = sparrow_trainer::export::load_export(&newest, &[])?;
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
        self.metrics.model_step.set(swap.step as i64);
        self.metrics.swaps.with_label_values(&[if deltas > 0 { "delta" } else { "full" }]).inc();
        self.metrics.swap_locked.set(locked.as_secs_f64());
        if let Some(s) = swap.staleness_max {
            self.metrics.staleness.set(s.as_secs_f64());
        }
        Ok(Some(swap))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn metadata(&self) -> Value {
        let inputs: Vec<Value> = self
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

    /// Answers one `infer` request body.
    pub fn infer(&self, body: &Value) -> Result<Value, ApiError> {
        let inputs =
            body.get("inputs").and_then(Value::as_array).ok_or_else(|| bad("the request has no `inputs` array"))?;
        let n_dense = self.inputs.dense.len();
        let mut rows: Option<usize> = None;
        let mut columns: Vec<Option<Vec<String>>> = vec![None; n_dense + self.inputs.sparse.len()];
        for input in inputs {
            let name = input.get("name").and_then(Value::as_str).ok_or_else(|| bad("an input has no `name`"))?;
            let column = self.inputs.names().position(|n| n == name).ok_or_else(|| {
                bad(format!("input `{name}`: the model has no such input (see GET /v2/models/{})", self.name))
            })?;
            let want = if column < n_dense { "FP32" } else { "BYTES" };
            let datatype = input.get("datatype").and_then(Value::as_str).unwrap_or_default();
            if datatype != want {
                return Err(bad(format!("input `{name}`: datatype `{datatype}`, expected {want}")));
            }
            let data = input
                .get("data")
                .and_then(Value::as_array)
                .ok_or_else(|| bad(format!("input `{name}`: no `data` array")))?;
            let shape: Vec<u64> = input
                .get("shape")
                .and_then(Value::as_array)
                .map(|s| s.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            if shape.len() != 1 || shape[0] as usize != data.len() {
                return Err(bad(format!(
                    "input `{name}`: shape {shape:?} for {} values; expected [N] with N values",
                    data.len()
                )));
            }
            if let Some(n) = rows
                && n != data.len()
            {
                return Err(bad(format!("input `{name}` has {} rows, another input {n}", data.len())));
            }
            rows = Some(data.len());
            let kind = match (column < n_dense, self.inputs.csv.is_some()) {
                (true, false) => Cell::Count,
                (true, true) => Cell::Number,
                (false, _) => Cell::Text(self.inputs.separator()),
            };
            let cells = data.iter().map(|v| cell(name, v, kind)).collect::<Result<Vec<_>, _>>()?;
            columns[column] = Some(cells);
        }
        let n = rows.unwrap_or(0);
        let mut parser = self.inputs.parser()?;
        let separator = self.inputs.separator();
        // Parsed before the model's lock: only the lookup and the forward pass hold it.
        let mut builder = BatchBuilder::new(self.layout.num_fields, self.layout.num_dense, false, n.max(1));
        let mut line = String::new();
        for row in 0..n {
            line.clear();
            line.push('0');
            for column in &columns {
                line.push(separator);
                if let Some(cells) = column {
                    line.push_str(&cells[row]);
                }
            }
            builder.begin_row();
            let parsed = parser.parse(line.as_bytes(), &mut builder);
            if let Err(e) = parsed.and_then(|label| {
                builder.end_row(label).then_some(()).ok_or_else(|| "wrong number of dense values".into())
            }) {
                return Err(bad(format!("row {row}: {e}")));
            }
        }
        let mut version = self.step();
        let probability: Vec<f32> = if n == 0 {
            Vec::new()
        } else {
            let batch = builder.finish(DataPosition::default());
            let trainer = self.trainer.read();
            // Read under the lock: the step of the model that answers.
            version = self.step();
            let logits = trainer
                .predict_batch(&batch)
                .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
            logits.iter().map(|&x| sigmoid(f64::from(x)) as f32).collect()
        };
        self.metrics.rows.inc_by(n as u64);
        let mut reply = json!({
            "model_name": self.name,
            "model_version": version.to_string(),
            "outputs": [{"name": "probability", "datatype": "FP32", "shape": [n], "data": probability}],
        });
        if let Some(id) = body.get("id") {
            reply["id"] = id.clone();
        }
        Ok(reply)
    }
}

/// What an input's cells are: a Criteo dense count (an integer), a CSV
/// dense number, or a categorical value (on a CSV line: quoted where it
/// holds the delimiter or a quote).
#[derive(Clone, Copy)]
enum Cell {
    Count,
    Number,
    Text(char),
}

/// One cell of the line `sparrow predict` would read.
fn cell(name: &str, value: &Value, kind: Cell) -> Result<String, ApiError> {
    match (kind, value) {
        (_, Value::Null) => Ok(String::new()),
        (Cell::Count, Value::Number(x)) => {
            let v = x.as_f64().unwrap_or(f64::NAN);
            if v.fract() != 0.0 || !v.is_finite() || v.abs() > 9.0e15 {
                return Err(bad(format!("input `{name}`: {x} is not an integer (Criteo's dense columns are counts)")));
            }
            Ok(format!("{}", v as i64))
        }
        (Cell::Number, Value::Number(x)) => Ok(x.to_string()),
        (Cell::Text(separator), Value::String(s)) => {
            if s.contains(['\n', '\r']) || (separator == '\t' && s.contains('\t')) {
                return Err(bad(format!(
                    "input `{name}`: a value holds a line break{}",
                    if separator == '\t' { " or a tab" } else { "" }
                )));
            }
            if separator != '\t' && (s.contains(separator) || s.contains('"')) {
                return Ok(format!("\"{}\"", s.replace('"', "\"\"")));
            }
            Ok(s.clone())
        }
        (Cell::Count | Cell::Number, other) => Err(bad(format!("input `{name}`: {other} is not a number (FP32)"))),
        (Cell::Text(_), other) => Err(bad(format!("input `{name}`: {other} is not a string (BYTES)"))),
    }
}

fn model<'a>(served: &'a Served, name: &str) -> Result<&'a Served, ApiError> {
    if name == served.name {
        Ok(served)
    } else {
        Err(ApiError(StatusCode::NOT_FOUND, format!("no model named `{name}` (this server serves `{}`)", served.name)))
    }
}

/// The header of KServe's binary tensor extension: the JSON part's length.
const BINARY_HEADER: &str = "inference-header-content-length";

/// A request body as JSON with every input's `data` inline: a plain JSON
/// body (any content type: Triton's client sends none), or KServe's binary
/// tensor extension (a JSON header of `Inference-Header-Content-Length`
/// bytes, then each input with `parameters.binary_data_size` as raw
/// little-endian values; `BYTES` elements each a 4-byte length and the bytes).
/// Also whether the reply's output is to be binary.
fn decode_request(headers: &axum::http::HeaderMap, body: &[u8]) -> Result<(Value, bool), ApiError> {
    let json_len = match headers.get(BINARY_HEADER) {
        None => body.len(),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n <= body.len())
            .ok_or_else(|| bad(format!("{BINARY_HEADER}: not a length within the body ({} bytes)", body.len())))?,
    };
    let mut request: Value = serde_json::from_slice(&nan_as_null(&body[..json_len]))
        .map_err(|e| bad(format!("the body is not a JSON request: {e}")))?;
    let mut binary = &body[json_len..];
    if let Some(inputs) = request.get_mut("inputs").and_then(Value::as_array_mut) {
        for input in inputs {
            let Some(size) = input.pointer("/parameters/binary_data_size").and_then(Value::as_u64) else { continue };
            let name = input.get("name").and_then(Value::as_str).unwrap_or("?").to_string();
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            if size > binary.len() {
                return Err(bad(format!(
                    "input `{name}`: binary_data_size {size}, but {} bytes of binary data are left",
                    binary.len()
                )));
            }
            let (raw, rest) = binary.split_at(size);
            binary = rest;
            let data = match input.get("datatype").and_then(Value::as_str) {
                Some("FP32") if size % 4 == 0 => raw
                    .chunks_exact(4)
                    .map(|b| {
                        let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        // NaN: a missing value, as `null` is in JSON.
                        if x.is_nan() { Value::Null } else { json!(x) }
                    })
                    .collect(),
                Some("BYTES") => {
                    let (mut values, mut at) = (Vec::new(), raw);
                    while !at.is_empty() {
                        let len = at.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
                        let Some(value) = len.and_then(|n| at.get(4..4 + n)) else {
                            return Err(bad(format!("input `{name}`: a BYTES element runs past its binary data")));
                        };
                        let text = std::str::from_utf8(value)
                            .map_err(|_| bad(format!("input `{name}`: a BYTES element is not UTF-8")))?;
                        values.push(Value::String(text.to_string()));
                        at = &at[4 + value.len()..];
                    }
                    values
                }
                other => {
                    return Err(bad(format!(
                        "input `{name}`: binary data of {size} bytes for datatype {}",
                        other.unwrap_or("(none)")
                    )));
                }
            };
            input["data"] = Value::Array(data);
        }
    }
    if !binary.is_empty() {
        return Err(bad(format!("{} bytes of binary data belong to no input", binary.len())));
    }
    let mut binary_out = request.pointer("/parameters/binary_data_output").and_then(Value::as_bool) == Some(true);
    if let Some(outputs) = request.get("outputs").and_then(Value::as_array) {
        for output in outputs {
            let name = output.get("name").and_then(Value::as_str).unwrap_or_default();
            if name != "probability" {
                return Err(bad(format!("output `{name}`: the model's only output is `probability`")));
            }
            if let Some(b) = output.pointer("/parameters/binary_data").and_then(Value::as_bool) {
                binary_out = b;
            }
        }
    }
    Ok((request, binary_out))
}

/// `NaN` outside strings read as `null` (a missing value): numpy-based
/// clients (Triton's) write a float column's NaN so, though JSON has no NaN.
fn nan_as_null(json: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !json.windows(3).any(|w| w == b"NaN") {
        return std::borrow::Cow::Borrowed(json);
    }
    let (mut out, mut in_string, mut escaped, mut i) = (Vec::with_capacity(json.len() + 16), false, false, 0);
    while i < json.len() {
        let b = json[i];
        if in_string {
            (escaped, in_string) = (!escaped && b == b'\\', in_string && (escaped || b != b'"'));
        } else if b == b'"' {
            in_string = true;
        } else if json[i..].starts_with(b"NaN") {
            out.extend_from_slice(b"null");
            i += 3;
            continue;
        }
        out.push(b);
        i += 1;
    }
    std::borrow::Cow::Owned(out)
}

/// The reply with its output as binary data (KServe's binary extension).
fn binary_reply(mut reply: Value) -> Response {
    let values: Vec<f32> = reply["outputs"][0]["data"]
        .as_array()
        .map(|d| d.iter().map(|v| v.as_f64().unwrap_or(f64::NAN) as f32).collect())
        .unwrap_or_default();
    let output = &mut reply["outputs"][0];
    if let Some(o) = output.as_object_mut() {
        o.remove("data");
    }
    output["parameters"] = json!({ "binary_data_size": values.len() * 4 });
    let mut body = serde_json::to_vec(&reply).unwrap_or_default();
    let json_len = body.len();
    for v in values {
        body.extend_from_slice(&v.to_le_bytes());
    }
    (
        StatusCode::OK,
        [
            (axum::http::header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (axum::http::HeaderName::from_static(BINARY_HEADER), json_len.to_string()),
        ],
        body,
    )
        .into_response()
}

async fn infer(
    State(served): State<Arc<Served>>,
    UrlPath(name): UrlPath<String>,
    headers: axum::http::HeaderMap,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let start = Instant::now();
    let answer = match (model(&served, &name), body) {
        (Err(e), _) => Err(e),
        (Ok(_), Err(rejection)) => {
            Err(ApiError(rejection.status(), format!("the body cannot be read: {}", rejection.body_text())))
        }
        (Ok(_), Ok(body)) => {
            let s = served.clone();
            tokio::task::spawn_blocking(move || {
                let (request, binary_out) = decode_request(&headers, &body)?;
                s.infer(&request).map(|reply| (reply, binary_out))
            })
            .await
            .unwrap_or_else(|e| Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())))
        }
    };
    let response = match answer {
        Ok((reply, true)) => binary_reply(reply),
        Ok((reply, false)) => (StatusCode::OK, axum::Json(reply)).into_response(),
        Err(e) => e.into_response(),
    };
    served.metrics.requests.with_label_values(&[response.status().as_str()]).inc();
    served.metrics.seconds.observe(start.elapsed().as_secs_f64());
    response
}

/// The server's routes over one model.
pub fn router(served: Arc<Served>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route(
            "/v2",
            get(|| async {
                axum::Json(json!({"name": "sparrow", "version": env!("CARGO_PKG_VERSION"), "extensions": []}))
            }),
        )
        .route(
            "/v2/models/{name}",
            get(|State(s): State<Arc<Served>>, UrlPath(name): UrlPath<String>| async move {
                model(&s, &name).map(|m| axum::Json(m.metadata()))
            }),
        )
        .route(
            "/v2/models/{name}/ready",
            get(|State(s): State<Arc<Served>>, UrlPath(name): UrlPath<String>| async move {
                model(&s, &name).map(|_| StatusCode::OK)
            }),
        )
        .route("/v2/models/{name}/infer", post(infer))
        .route(
            "/metrics",
            get(|State(s): State<Arc<Served>>| async move {
                let mut out = String::new();
                let encoder = prometheus::TextEncoder::new();
                let _ = encoder.encode_utf8(&s.metrics.registry.gather(), &mut out);
                out
            }),
        )
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(served)
}

/// Runs the server until `stop` resolves. `on_listening` gets the bound address.
pub fn serve(
    options: &ServeOptions,
    on_listening: impl FnOnce(SocketAddr, &str),
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let served = Arc::new(Served::load(&options.model, options.name.clone())?);
    let watching = Arc::new(AtomicBool::new(true));
    if let Some(every) = options.watch {
        if !options.model.join("LATEST").is_file() {
            return Err(ServeError::Setup(format!(
                "--watch: {} has no LATEST naming the newest export (watch checkpoint.dir/exports, which \
                 checkpoint.export_every_steps writes)",
                options.model.display()
            )));
        }
        let (served, watching) = (served.clone(), watching.clone());
        std::thread::Builder::new()
            .name("sparrow-watch".into())
            .spawn(move || watch(&served, every, &watching))
            .map_err(|e| ServeError::Setup(format!("starting the --watch thread: {e}")))?;
    }
    let _stop_watching = StopOnDrop(watching);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| ServeError::Listen { addr: options.listen, source })?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|source| ServeError::Listen { addr: options.listen, source })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Listen { addr: options.listen, source })?;
        on_listening(addr, served.name());
        axum::serve(listener, router(served, options.max_body_bytes))
            .with_graceful_shutdown(stop)
            .await
            .map_err(|source| ServeError::Listen { addr, source })
    })
}

/// Sets the flag when dropped: the `--watch` thread ends with the server.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// `--watch`: applies each new export `LATEST` names, every `every`, while
/// `running`. An export that cannot be applied is reported (once per
/// distinct error) and retried; the served model stays.
fn watch(served: &Served, every: Duration, running: &AtomicBool) {
    let mut last_error = String::new();
    while running.load(Ordering::SeqCst) {
        std::thread::sleep(every);
        match served.refresh() {
            Ok(Some(swap)) => {
                last_error.clear();
                let secs =
                    |d: Option<Duration>| d.map_or_else(|| "?".to_string(), |d| format!("{:.3}", d.as_secs_f64()));
                let what = match swap.deltas {
                    0 => format!("full export, {} rows", swap.rows),
                    n => format!("{n} incremental export(s), {} rows", swap.rows),
                };
                tracing::info!(
                    "serving step {} from {} ({what}); requests waited {:.3} ms; updates {}–{} s old",
                    swap.step,
                    swap.export.display(),
                    swap.locked.as_secs_f64() * 1e3,
                    secs(swap.staleness_min),
                    secs(swap.staleness_max),
                );
            }
            Ok(None) => {}
            Err(e) => {
                let message = e.to_string();
                if message != last_error {
                    tracing::warn!("--watch: still serving step {}: {message}", served.step());
                    last_error = message;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binary_body(header: &Value, tail: &[u8]) -> (axum::http::HeaderMap, Vec<u8>) {
        let mut body = serde_json::to_vec(header).expect("json");
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(BINARY_HEADER, body.len().to_string().parse().expect("header"));
        body.extend_from_slice(tail);
        (headers, body)
    }

    #[test]
    fn binary_tensors_become_the_json_data_they_stand_for() {
        let mut tail = Vec::new();
        for x in [3.0f32, f32::NAN] {
            tail.extend_from_slice(&x.to_le_bytes());
        }
        for s in ["ab", ""] {
            tail.extend_from_slice(&(s.len() as u32).to_le_bytes());
            tail.extend_from_slice(s.as_bytes());
        }
        let header = json!({
            "inputs": [
                {"name": "I1", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
                {"name": "C1", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 10}},
            ],
            "outputs": [{"name": "probability", "parameters": {"binary_data": true}}],
        });
        let (headers, body) = binary_body(&header, &tail);
        let (request, binary_out) = decode_request(&headers, &body).expect("decoded");
        assert!(binary_out);
        assert_eq!(request["inputs"][0]["data"], json!([3.0, null]));
        assert_eq!(request["inputs"][1]["data"], json!(["ab", ""]));

        // Sizes past the data, data left over, a wrong output: 400s naming them.
        let (headers, body) = binary_body(&header, &tail[..12]);
        assert!(decode_request(&headers, &body).expect_err("short").1.contains("binary_data_size 10"));
        let (headers, body) = binary_body(&header, &[&tail[..], b"xx"].concat());
        assert!(decode_request(&headers, &body).expect_err("long").1.contains("2 bytes of binary data belong"));
        let wrong = json!({"inputs": [], "outputs": [{"name": "logit"}]});
        assert!(
            decode_request(&axum::http::HeaderMap::new(), &serde_json::to_vec(&wrong).expect("json"))
                .expect_err("output")
                .1
                .contains("only output is `probability`")
        );
    }

    #[test]
    fn nan_outside_strings_reads_as_null() {
        let body = br#"{"inputs": [{"name": "C1", "data": ["NaN", "a\"NaN"]}, {"data": [NaN, 1.5]}]}"#;
        let (request, _) = decode_request(&axum::http::HeaderMap::new(), body).expect("decoded");
        assert_eq!(request["inputs"][0]["data"], json!(["NaN", "a\"NaN"]));
        assert_eq!(request["inputs"][1]["data"], json!([null, 1.5]));
    }
}
