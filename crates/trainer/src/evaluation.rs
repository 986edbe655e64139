//! Scoring a file with a model, and the figures of what was scored: the
//! first task's `auc`/`logloss` (the keys a one-task job always had) and
//! every task's figures (`tasks`, with GAUC under `eval.group_by`).

use std::collections::BTreeMap;
use std::path::Path;

use sparrow_core::Config;
use sparrow_core::config::{DataConfig, TaskKind};
use sparrow_core::metrics::tasks::{TaskFigures, task_columns, task_figures};
use sparrow_core::metrics::{auc, count_nan, log_loss_from_logits};
use sparrow_data::{BadRows, BatchStream};

use crate::TrainError;
use crate::inference::Scoring;

/// What scoring a file gave: rows × outputs logits, rows × tasks labels,
/// and with `eval.group_by` each row's group key.
#[derive(Clone, Debug, Default)]
pub struct Scores {
    pub logits: Vec<f32>,
    pub labels: Vec<f32>,
    pub groups: Option<Vec<u64>>,
}

/// The field index whose first key groups rows (`eval.group_by`).
pub fn group_field(config: &Config) -> Option<usize> {
    let group = config.eval.group_by.as_ref()?;
    config.data.schema.as_ref()?.sparse.iter().position(|s| s == group)
}

/// The group number of each row of `batch`: a mix of its first ID's key in
/// `field` (0 if none). Not the key itself: a cluster's loader hands these
/// to a worker, which never sees a key a shard holds (S0.1); `train` and
/// `launch` use the same numbers, so GAUC sums its groups in the same order.
pub fn group_keys(batch: &sparrow_core::Batch, field: usize) -> impl Iterator<Item = u64> + '_ {
    (0..batch.rows()).map(move |r| {
        let key = batch.bag(r, field).next().map_or(0, |k| batch.keys[k]);
        let mut state = key ^ 0x6a09_e667_f3bc_c909;
        sparrow_core::rng::splitmix64(&mut state)
    })
}

/// Logits and labels of every good row of `path`, read as they are:
/// `[data.weighting]` shapes what training consumes, never what is scored
/// (nor its counters, even when `path` is the training file).
pub fn predict_file(model: Scoring<'_>, path: &Path, data: &DataConfig, bad: &BadRows) -> Result<Scores, TrainError> {
    let job = &Config { data: data.for_scoring(), ..model.config.clone() };
    let stream =
        BatchStream::spawn(path, job, model.config.train.batch_size.max(1024), Default::default(), 1, bad.clone())?;
    if stream.layout.num_fields != model.layout.num_fields || stream.layout.num_dense != model.layout.num_dense {
        return Err(TrainError::checkpoint(
            path,
            format!(
                "data has {} fields and {} dense values, the model was trained on {} and {}",
                stream.layout.num_fields, stream.layout.num_dense, model.layout.num_fields, model.layout.num_dense
            ),
        ));
    }
    let field = group_field(model.config);
    let mut s = Scores { groups: field.map(|_| Vec::new()), ..Scores::default() };
    for batch in stream {
        let batch = batch?;
        s.logits.extend(model.predict_batch(&batch)?);
        s.labels.extend_from_slice(&batch.labels);
        if let (Some(f), Some(groups)) = (field, s.groups.as_mut()) {
            groups.extend(group_keys(&batch, f));
        }
    }
    Ok(s)
}

/// The figures of scored rows.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// The first task's AUC and log-loss (NaN: a multiclass first task's AUC).
    pub auc: f64,
    pub logloss: f64,
    pub rows: u64,
    pub nan_predictions: u64,
    /// Every task's figures.
    pub tasks: BTreeMap<String, TaskFigures>,
}

impl Figures {
    pub fn of(config: &Config, s: &Scores) -> Figures {
        let tasks = config.tasks();
        let rows = (s.labels.len() / tasks.len().max(1)) as u64;
        let nan_predictions = count_nan(&s.logits);
        let by_task = task_figures(&tasks, &s.logits, &s.labels, s.groups.as_deref(), config.eval.top_k);
        let (auc, logloss) = if config.single_binary_task() && !s.labels.iter().any(|l| l.is_nan()) {
            // Exactly the figures of a job before tasks.
            (auc(&s.logits, &s.labels), log_loss_from_logits(&s.logits, &s.labels))
        } else {
            let first = task_columns(&tasks, &s.logits, &s.labels, None).swap_remove(0);
            match tasks[0].kind {
                TaskKind::Binary => {
                    (auc(&first.logits, &first.labels), log_loss_from_logits(&first.logits, &first.labels))
                }
                TaskKind::Multiclass => match by_task.get(&tasks[0].name) {
                    Some(TaskFigures::Multiclass { logloss, .. }) => (f64::NAN, *logloss),
                    _ => (f64::NAN, f64::NAN),
                },
            }
        };
        Figures { auc, logloss, rows, nan_predictions, tasks: by_task }
    }
}

/// A row's probabilities as `sparrow predict` writes them: a binary task's
/// click probability, a multiclass task's one per class, tab-separated in
/// task order.
pub fn probabilities(tasks: &[sparrow_core::config::Task], row: &[f32], out: &mut String) {
    use std::fmt::Write;
    let mut values = Vec::with_capacity(row.len());
    sparrow_core::metrics::tasks::row_probabilities(tasks, row, &mut values);
    for (i, p) in values.iter().enumerate() {
        let _ = write!(out, "{}{p}", if i == 0 { "" } else { "\t" });
    }
}

/// Every task's figures as TensorBoard tags (`<set>/<task>/<figure>`, the
/// set `test` or `validation`).
pub fn tagged(set: &str, tasks: &BTreeMap<String, TaskFigures>) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for (name, f) in tasks {
        let figures: Vec<(&str, f64)> = match f {
            TaskFigures::Binary { auc, logloss, ne, calibration, gauc, .. } => {
                let mut v = vec![("auc", *auc), ("logloss", *logloss), ("ne", *ne), ("calibration", *calibration)];
                v.extend(gauc.map(|g| ("gauc", g)));
                v
            }
            TaskFigures::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, .. } => vec![
                ("accuracy", *accuracy),
                ("top_k_accuracy", *top_k_accuracy),
                ("macro_auc", *macro_auc),
                ("logloss", *logloss),
            ],
        };
        out.extend(figures.into_iter().map(|(k, v)| (format!("{set}/{name}/{k}"), v)));
    }
    out
}
