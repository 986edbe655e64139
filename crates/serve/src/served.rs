//! The model a server answers with: the export's model, the names of its
//! inputs, and how a request's rows are scored (in chunks of bounded
//! memory, under one read of the model so a reply comes from one version).

use sparrow_core::Overrides;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::borrow::Cow;

use sparrow_data::columns::{ColumnValues, InputColumn, ModelInputs};
use sparrow_trainer::Model;
use sparrow_trainer::export::{ExportData, ExportManifest};

use crate::metrics::Metrics;
use crate::outputs::Output;
use crate::request::{Cell, Cells, MAX_LIST_ITEMS, Request};
use crate::{ApiError, ServeError, bad};
use sparrow_core::config::ServedOutput;

/// Rows scored in one pass through the model: the pass's memory (pooled
/// embeddings, activations, about 9 KB a row for the reference model) stays
/// this size whatever a request holds.
pub const SCORE_CHUNK_ROWS: usize = 1024;

/// One loaded model: the export's rows and dense weights, and the
/// names of its inputs.
pub struct Served {
    name: String,
    /// The step of the model answering now (the export's).
    step: AtomicU64,
    inputs: ModelInputs,
    /// Its outputs, one a task (`outputs.rs`), and the logits a row.
    outputs: (Vec<ServedOutput>, usize),
    layout: sparrow_data::DataLayout,
    /// Requests predict side by side under the read lock; a `--watch`
    /// update takes the write lock (requests wait, none fails).
    model: parking_lot::RwLock<Model>,
    /// The export served now: its directory and manifest (`--watch` moves on from it).
    current: parking_lot::Mutex<(PathBuf, ExportManifest)>,
    /// What `--model` named (an export, or a directory whose LATEST names one).
    source: PathBuf,
    /// Applied to each export's stored config.
    overrides: Overrides,
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

/// The answer to one request: the model's step and its outputs (each a
/// probability, or a multiclass task's probabilities, a row).
pub struct Scores {
    pub version: u64,
    pub rows: usize,
    pub outputs: Vec<Output>,
}

impl Served {
    /// Loads an export (checksums verified first: a damaged one is refused
    /// naming its file), served as `name`.
    pub fn load(model: &Path, name: String, overrides: Overrides) -> Result<Served, ServeError> {
        let (loaded, manifest) = sparrow_trainer::export::load_export(model, &overrides)?;
        let dir = sparrow_trainer::export::resolve_export(model)?;
        let inputs =
            ModelInputs::of(&loaded.config.data).map_err(|e| ServeError::Setup(format!("{}: {e}", model.display())))?;
        let outputs = crate::outputs::specs(&loaded.config);
        let metrics = Metrics::new();
        metrics.model_step.set(i64::try_from(manifest.step).unwrap_or(i64::MAX));
        Ok(Served {
            name,
            step: AtomicU64::new(manifest.step),
            inputs,
            outputs,
            layout: loaded.layout.clone(),
            model: parking_lot::RwLock::new(loaded),
            current: parking_lot::Mutex::new((dir, manifest)),
            source: model.to_path_buf(),
            overrides,
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
                let model = self.model.write();
                let start = Instant::now();
                for update in &updates {
                    update.apply(&model)?;
                }
                self.step.store(manifest.step, Ordering::SeqCst);
                (start.elapsed(), updates.len(), rows)
            }
            None => {
                let (fresh, _) = sparrow_trainer::export::load_export(&newest, &self.overrides)?;
                let rows = fresh.table.len();
                let mut model = self.model.write();
                let start = Instant::now();
                *model = fresh;
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
            // A row's history: a list of IDs (or one string of them between separators).
            .chain(
                self.inputs.sequences.iter().map(|q| json!({"name": q.name, "datatype": "BYTES", "shape": [-1, -1]})),
            )
            .collect();
        let outputs: Vec<serde_json::Value> = self
            .outputs
            .0
            .iter()
            .map(|o| match o.per_row {
                1 => json!({"name": o.name, "datatype": "FP32", "shape": [-1]}),
                k => json!({"name": o.name, "datatype": "FP32", "shape": [-1, k]}),
            })
            .collect();
        json!({
            "name": self.name,
            "versions": [self.step().to_string()],
            "platform": "sparrow",
            "inputs": inputs,
            "outputs": outputs,
        })
    }

    /// The inputs a request may name: the model's columns.
    pub fn input_columns(&self) -> usize {
        self.inputs.dense.len() + self.inputs.sparse.len() + self.inputs.sequences.len()
    }

    /// Scores one decoded request: its columns go value by value through
    /// the data format's reading rules ([`ModelInputs::batch`], so the
    /// figures are `sparrow predict`'s), into batches of [`SCORE_CHUNK_ROWS`]
    /// before the model's lock; then every batch is scored under one read
    /// of the model. Its IDs (lists, joined sequences, multi-hot cells)
    /// are counted first: more than `max_ids` is a 413.
    pub fn infer(&self, request: &Request, max_ids: usize) -> Result<Scores, ApiError> {
        let mut rows: Option<usize> = None;
        let picked = crate::outputs::select(&self.outputs.0, &request.outputs).map_err(bad)?;
        let mut columns = RequestColumns {
            inputs: &self.inputs,
            dense: vec![None; self.inputs.dense.len()],
            sparse: vec![None; self.inputs.sparse.len()],
            sequences: vec![None; self.inputs.sequences.len()],
        };
        for input in &request.inputs {
            let name = input.name.as_str();
            let no_such =
                || bad(format!("input `{name}`: the model has no such input (see GET /v2/models/{})", self.name));
            let (slot, want) = match self.inputs.column(name).ok_or_else(no_such)? {
                InputColumn::Dense(i) => (&mut columns.dense[i], "FP32"),
                InputColumn::Sparse(i) => (&mut columns.sparse[i], "BYTES"),
                InputColumn::Sequence(j) => {
                    if input.datatype != "BYTES" {
                        return Err(bad(format!("input `{name}`: datatype `{}`, expected BYTES", input.datatype)));
                    }
                    let (n, width) = sequence_rows(name, input)?;
                    if rows.is_some_and(|other| other != n) {
                        return Err(bad(format!("input `{name}` has {n} rows, another input {}", rows.unwrap_or(0))));
                    }
                    rows = Some(n);
                    if columns.sequences[j].replace((&input.cells, name, width)).is_some() {
                        return Err(bad(format!("input `{name}` is given twice")));
                    }
                    continue;
                }
                InputColumn::Unused => return Err(no_such()),
            };
            if slot.is_some() {
                return Err(bad(format!("input `{name}` is given twice")));
            }
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
            *slot = Some((&input.cells, name));
        }
        let n = rows.unwrap_or(0);
        columns.count_ids(n, request.list_ids, max_ids)?;
        let batches = (0..n)
            .step_by(SCORE_CHUNK_ROWS)
            .map(|start| self.inputs.batch(&self.layout, &columns, start..(start + SCORE_CHUNK_ROWS).min(n)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outputs: Vec<Output> = picked
            .iter()
            .map(|o| Output { name: o.name.clone(), per_row: o.per_row, values: Vec::with_capacity(n * o.per_row) })
            .collect();
        let model = self.model.read();
        // Read under the lock: the step of the model that answers.
        let version = self.step();
        for batch in &batches {
            let logits = model.predict_batch(batch).map_err(|e| ApiError::internal(e.to_string()))?;
            for (spec, out) in picked.iter().zip(&mut outputs) {
                spec.extend_from(&logits, self.outputs.1, &mut out.values);
            }
        }
        drop(model);
        self.metrics.rows.inc_by(n as u64);
        Ok(Scores { version, rows: n, outputs })
    }
}

/// A request's inputs by column, as the batch builder reads them.
struct RequestColumns<'r> {
    inputs: &'r ModelInputs,
    dense: Vec<Option<(&'r Cells<'r>, &'r str)>>,
    sparse: Vec<Option<(&'r Cells<'r>, &'r str)>>,
    /// With the width of a rectangular [N, L] input given flat (`None`:
    /// one cell a row, a list or a string of IDs).
    sequences: Vec<Option<(&'r Cells<'r>, &'r str, Option<usize>)>>,
}

/// A sequence input's rows, and its width when it is given as a flat
/// [N, L] tensor (L IDs a row, empty strings padding, as numpy clients send
/// a rectangular history): [N] holds a list (or a string of IDs) a row.
fn sequence_rows(name: &str, input: &crate::request::Input) -> Result<(usize, Option<usize>), ApiError> {
    let n = input.cells.len();
    let dims: Vec<Option<usize>> = input.shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let flat = input.cells.values.iter().all(|c| !matches!(c, Cell::List { .. }));
    match dims[..] {
        [Some(rows)] if rows == n => Ok((n, None)),
        // Nested lists a row: [N, L] or [N, -1] (ragged) name the rows.
        [Some(rows), _] if rows == n && !flat => Ok((n, None)),
        [Some(rows), Some(width)] if flat && width > 0 && rows.checked_mul(width) == Some(n) => Ok((rows, Some(width))),
        [Some(0), Some(0)] if n == 0 => Ok((0, None)),
        _ => Err(bad(format!(
            "input `{name}`: shape {:?} for {n} values; expected [N] with a list of IDs a row, or [N, L] with N×L IDs",
            input.shape
        ))),
    }
}

impl ColumnValues for RequestColumns<'_> {
    type Error = ApiError;

    fn dense(&self, column: usize, row: usize) -> Result<Option<f64>, ApiError> {
        match self.dense[column] {
            Some((cells, name)) => dense_cell(name, cells, row, self.inputs.dense_are_counts()),
            None => Ok(None),
        }
    }

    fn sparse(&self, column: usize, row: usize) -> Result<Option<Cow<'_, [u8]>>, ApiError> {
        match self.sparse[column] {
            Some((cells, name)) => sparse_cell(self.inputs, name, cells, row).map(|v| v.map(Cow::Borrowed)),
            None => Ok(None),
        }
    }

    fn refused(&self, _column: Option<InputColumn>, row: usize, message: String) -> ApiError {
        bad(format!("row {row}: {message}"))
    }

    /// A list of IDs, or one string of them between the data's separator
    /// (as the file's cell holds them); null is an empty history.
    fn sequence(&self, column: usize, row: usize) -> Result<Vec<Cow<'_, [u8]>>, ApiError> {
        let Some((cells, name, width)) = self.sequences[column] else { return Ok(Vec::new()) };
        if let Some(width) = width {
            let mut ids = Vec::with_capacity(width);
            for cell in &cells.values[row * width..(row + 1) * width] {
                match *cell {
                    Cell::Null => {}
                    Cell::Text { start, len } => {
                        let id = cells.text(start, len);
                        self.inputs.check_text(id).map_err(|e| bad(format!("input `{name}`: row {row}: {e}")))?;
                        ids.push(Cow::Borrowed(id.as_bytes()));
                    }
                    _ => return Err(bad(format!("input `{name}`: row {row}: an ID is not a string (BYTES)"))),
                }
            }
            return Ok(ids);
        }
        let check = |id: &str| self.inputs.check_text(id).map_err(|e| bad(format!("input `{name}`: row {row}: {e}")));
        // The newest `max_len` IDs, and one more to count the history as
        // truncated: the rest are never split out or kept.
        let keep = self.inputs.sequences[column].max_len.saturating_add(1);
        let mut ids: Vec<&str> = match cells.values[row] {
            Cell::Null => Vec::new(),
            Cell::List { first, count } => {
                cells.list(first, count).try_for_each(check)?;
                cells.list(first, count).rev().filter(|id| !id.is_empty()).take(keep).collect()
            }
            Cell::Text { start, len } => {
                let text = cells.text(start, len);
                check(text)?;
                text.rsplit(self.sequence_separator()).filter(|id| !id.is_empty()).take(keep).collect()
            }
            Cell::Number(v) => {
                return Err(bad(format!("input `{name}`: row {row}: {v} is not a list of IDs (BYTES)")));
            }
        };
        ids.reverse();
        Ok(ids.into_iter().map(|id| Cow::Borrowed(id.as_bytes())).collect())
    }
}

impl RequestColumns<'_> {
    /// What separates a joined sequence's IDs (and a multi-hot cell's).
    fn sequence_separator(&self) -> &str {
        self.inputs.rules.separator().unwrap_or("|")
    }

    /// The IDs `rows` rows hand the model: `list_ids` from lists (counted
    /// while decoding), those each multi-hot cell and joined sequence
    /// splits into (a sequence's newest `max_len`, and one). A cell of more
    /// than [`MAX_LIST_ITEMS`] is refused, as a list of more is; past
    /// `max_ids` in all, the request is (413).
    fn count_ids(&self, rows: usize, list_ids: usize, max_ids: usize) -> Result<(), ApiError> {
        let mut ids = list_ids;
        let over = |ids: usize| {
            ApiError(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request's behaviour sequences and multi-hot cells hold more than {max_ids} IDs, this \
                     server's --max-request-ids: send fewer rows a request ({ids} so far)"
                ),
            )
        };
        if let Some(sep) = self.inputs.rules.separator() {
            for &(cells, name) in self.sparse.iter().flatten() {
                for (row, cell) in cells.values.iter().enumerate() {
                    let Cell::Text { start, len } = *cell else { continue };
                    let n =
                        cells.text(start, len).split(sep).filter(|id| !id.is_empty()).take(MAX_LIST_ITEMS + 1).count();
                    if n > MAX_LIST_ITEMS {
                        return Err(bad(format!("input `{name}`: row {row} holds more than {MAX_LIST_ITEMS} IDs")));
                    }
                    ids += n;
                    if ids > max_ids {
                        return Err(over(ids));
                    }
                }
            }
        }
        for (j, q) in self.inputs.sequences.iter().enumerate() {
            let Some((cells, _, None)) = self.sequences[j] else { continue };
            for cell in &cells.values[..rows.min(cells.len())] {
                let Cell::Text { start, len } = *cell else { continue };
                let text = cells.text(start, len);
                ids += text.rsplit(self.sequence_separator()).filter(|id| !id.is_empty()).take(q.max_len + 1).count();
                if ids > max_ids {
                    return Err(over(ids));
                }
            }
        }
        Ok(())
    }
}

/// Row `row`'s value of a dense input (`None`: null, an empty cell).
/// (`counts`: Criteo's integer counts).
fn dense_cell(name: &str, cells: &Cells, row: usize, counts: bool) -> Result<Option<f64>, ApiError> {
    match (counts, cells.values[row]) {
        (_, Cell::Null) => Ok(None),
        (true, Cell::Number(v)) => {
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
        (_, Cell::List { .. }) => Err(bad(format!("input `{name}`: row {row} is a list, not a number (FP32)"))),
    }
}

/// Row `row`'s value of a sparse input (`None`: null, an empty cell).
/// Values a line of the data file could not hold are refused, so serving
/// answers only what `sparrow predict` could be asked.
fn sparse_cell<'c>(
    inputs: &ModelInputs,
    name: &str,
    cells: &'c Cells,
    row: usize,
) -> Result<Option<&'c [u8]>, ApiError> {
    match cells.values[row] {
        Cell::Null => Ok(None),
        Cell::Text { start, len } => {
            let s = cells.text(start, len);
            inputs.check_text(s).map_err(|e| bad(format!("input `{name}`: {e}")))?;
            Ok(Some(s.as_bytes()))
        }
        Cell::Number(v) => Err(bad(format!("input `{name}`: {v} is not a string (BYTES)"))),
        Cell::List { .. } => {
            Err(bad(format!("input `{name}`: row {row} is a list; this input takes one string a row")))
        }
    }
}
