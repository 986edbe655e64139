//! Several labels and behaviour sequences: `data.schema.labels`,
//! `data.schema.sequence` and `[[model.tasks]]`, and the checks that tie
//! them together (a task per label column, a sequence's table a sparse
//! field). A job that names none of them has one binary task on its one
//! label, exactly as before.

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, DataFormat};

/// The longest `max_len` a sequence may keep (IDs per sample).
pub const MAX_SEQUENCE_LEN: usize = 10_000;

/// The most classes a multiclass task may have.
pub const MAX_CLASSES: usize = 4096;

/// `data.schema.sequence` entry: a column holding a list of IDs (newest
/// last), looked up in the table of the sparse field `table`.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SequenceField {
    /// The column.
    pub field: String,
    /// The sparse field whose embedding table the IDs share.
    pub table: String,
    /// IDs kept per sample: the newest `max_len` (longer lists are
    /// truncated and counted).
    pub max_len: usize,
}

/// `kind` of a `[[model.tasks]]` entry.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// A 0/1 label, logistic loss.
    #[default]
    Binary,
    /// A class id in `0..classes`, softmax cross-entropy.
    Multiclass,
}

impl TaskKind {
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Binary => "binary",
            TaskKind::Multiclass => "multiclass",
        }
    }
}

/// A `[[model.tasks]]` entry.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TaskConfig {
    /// Its label column (one of `data.schema.labels`).
    pub name: String,
    /// `binary` (a 0/1 label) or `multiclass` (a class id, with `classes`).
    #[serde(default)]
    pub kind: TaskKind,
    /// Multiclass only: the number of classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<usize>,
    /// Its weight in the summed loss.
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// `[eval]`: how offline figures are computed.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// A sparse field: binary tasks also get GAUC, the AUC of each of its
    /// values' rows weighted by their count (the first ID of a multi-hot cell).
    pub group_by: Option<String>,
    /// The k of a multiclass task's top-k accuracy.
    pub top_k: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig { group_by: None, top_k: 5 }
    }
}

/// A task as training runs it, resolved from the config.
#[derive(Clone, Debug, PartialEq)]
pub struct Task {
    pub name: String,
    pub kind: TaskKind,
    /// Logits it takes: 1 for a binary task, `classes` for a multiclass one.
    pub outputs: usize,
    pub weight: f64,
}

impl Task {
    pub fn is_binary(&self) -> bool {
        self.kind == TaskKind::Binary
    }
}

/// An output a served model answers: the one type `sparrow serve`, the
/// ONNX export and Python's `Model.outputs` use. Its name, its task's first
/// logit among a row's, its values a row (1, or a multiclass task's
/// classes), and whether it is a softmax.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedOutput {
    pub name: String,
    pub offset: usize,
    pub per_row: usize,
    pub multiclass: bool,
}

impl Config {
    /// What a served model answers, and its logits a row.
    /// - One binary task: `probability` ([N]).
    /// - Several tasks: `probability_<task>` ([N]) for a binary task and
    ///   `probabilities_<task>` ([N, K], a softmax) for a multiclass one. The
    ///   first task, when binary, is also `probability`, as `test_auc` is the
    ///   first task's; a model with exactly one multiclass task also answers
    ///   it as `probabilities`.
    pub fn served_outputs(&self) -> (Vec<ServedOutput>, usize) {
        let tasks = self.tasks();
        let logits_per_row = tasks.iter().map(|t| t.outputs).sum();
        if tasks.len() == 1 && tasks[0].is_binary() {
            let only = ServedOutput { name: "probability".into(), offset: 0, per_row: 1, multiclass: false };
            return (vec![only], logits_per_row);
        }
        let (mut outputs, mut offset) = (Vec::new(), 0);
        for t in &tasks {
            let multiclass = !t.is_binary();
            let name = if multiclass { format!("probabilities_{}", t.name) } else { format!("probability_{}", t.name) };
            outputs.push(ServedOutput { name, offset, per_row: t.outputs, multiclass });
            offset += t.outputs;
        }
        if let Some(first) = outputs.first().filter(|s| !s.multiclass) {
            outputs.push(ServedOutput { name: "probability".into(), ..first.clone() });
        }
        let multiclass: Vec<&ServedOutput> = outputs.iter().filter(|s| s.multiclass).collect();
        if let [only] = multiclass[..] {
            outputs.push(ServedOutput { name: "probabilities".into(), ..only.clone() });
        }
        (outputs, logits_per_row)
    }

    /// The label columns, in the order their values sit in each sample:
    /// `data.schema.labels`, else the one `data.schema.label` (the formats
    /// without a schema have one label, "label").
    pub fn label_columns(&self) -> Vec<String> {
        match &self.data.schema {
            Some(s) if !s.labels.is_empty() => s.labels.clone(),
            Some(s) => vec![s.label.clone()],
            None => vec!["label".to_string()],
        }
    }

    /// The tasks, one per label column and in its order: `[[model.tasks]]`
    /// where given, else a binary task of weight 1 for each label.
    pub fn tasks(&self) -> Vec<Task> {
        self.label_columns()
            .into_iter()
            .map(|name| match self.model.tasks.iter().find(|t| t.name == name) {
                Some(t) => Task {
                    name,
                    kind: t.kind,
                    outputs: if t.kind == TaskKind::Multiclass { t.classes.unwrap_or(2) } else { 1 },
                    weight: t.weight,
                },
                None => Task { name, kind: TaskKind::Binary, outputs: 1, weight: 1.0 },
            })
            .collect()
    }

    /// Logits a sample gets: one per binary task, `classes` per multiclass one.
    pub fn model_outputs(&self) -> usize {
        self.tasks().iter().map(|t| t.outputs).sum()
    }

    /// Whether the job is today's one binary task of weight 1 (trained
    /// exactly as before tasks existed).
    pub fn single_binary_task(&self) -> bool {
        let tasks = self.tasks();
        tasks.len() == 1 && tasks[0].is_binary() && tasks[0].weight == 1.0
    }

    /// `data.schema.sequence`: their bags follow the sparse fields' in
    /// each sample, in this order.
    pub fn sequence_fields(&self) -> &[SequenceField] {
        self.data.schema.as_ref().map_or(&[], |s| &s.sequence)
    }

    /// For each sequence field, its slot among the sample's fields and the
    /// slot of the field whose table it shares (the candidate it is weighed
    /// against under `model.kind = "din"`).
    pub fn attention_pairs(&self) -> Vec<(usize, usize)> {
        let Some(s) = &self.data.schema else { return Vec::new() };
        s.sequence
            .iter()
            .enumerate()
            .filter_map(|(j, q)| Some((s.sparse.len() + j, s.sparse.iter().position(|f| *f == q.table)?)))
            .collect()
    }

    /// The task whose label groups training batches under
    /// `data.group_by_label` (S0.7): `data.group_task`, else the first
    /// multiclass task, else the first task. Its index among the tasks.
    pub fn group_task(&self) -> Option<usize> {
        let tasks = self.tasks();
        match &self.data.group_task {
            Some(name) => tasks.iter().position(|t| t.name == *name),
            None => tasks.iter().position(|t| !t.is_binary()).or(Some(0)),
        }
    }

    /// `data.group_by_label` and its keys.
    fn validate_grouping(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        let invalid = |key: &str, message: String| Err(ConfigError::Invalid { key: key.to_string(), message });
        if !d.group_by_label {
            return match &d.group_task {
                Some(_) => invalid("data.group_task", "takes effect with data.group_by_label = true".into()),
                None => Ok(()),
            };
        }
        if let Some(name) = &d.group_task
            && self.group_task().is_none()
        {
            return invalid("data.group_task", format!("`{name}` is not a label column {:?}", self.label_columns()));
        }
        if d.weighting.is_some() {
            return invalid(
                "data.group_by_label",
                "cannot be combined with [data.weighting] (both regroup the rows they read)".into(),
            );
        }
        if d.stream.is_some() {
            return invalid(
                "data.group_by_label",
                "reads files: a stream ([data.stream]) is trained in its records' order".into(),
            );
        }
        Ok(())
    }

    /// `data.shuffle`: files, and one reshaping of the training rows at a time.
    fn validate_shuffle(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        let refuse = |why: &str| Err(ConfigError::Invalid { key: "data.shuffle".into(), message: why.into() });
        if !d.shuffle {
            return Ok(());
        }
        if d.group_by_label {
            return refuse("cannot be combined with data.group_by_label, which draws the batches' order itself");
        }
        if d.weighting.is_some() {
            return refuse("cannot be combined with [data.weighting] (both regroup the rows they read)");
        }
        if d.stream.is_some() {
            return refuse("reads files: a stream ([data.stream]) is trained in its records' order");
        }
        Ok(())
    }

    /// `data.schema.labels`, `data.schema.sequence` and `model.tasks`.
    pub(super) fn validate_tasks(&self) -> Result<(), ConfigError> {
        self.validate_grouping()?;
        self.validate_shuffle()?;
        let invalid = |key: &str, message: String| Err(ConfigError::Invalid { key: key.to_string(), message });
        let schema_format = matches!(self.data.format, DataFormat::Csv | DataFormat::Parquet);
        if let Some(s) = &self.data.schema {
            if !s.labels.is_empty() && s.label != super::Schema::default().label {
                return invalid(
                    "data.schema.labels",
                    format!("set either data.schema.label ({:?}) or data.schema.labels, not both", s.label),
                );
            }
            if (!s.labels.is_empty() || !s.sequence.is_empty()) && !schema_format {
                let key = if s.labels.is_empty() { "data.schema.sequence" } else { "data.schema.labels" };
                return invalid(
                    key,
                    format!("needs data.format = \"csv\" or \"parquet\" (this job's is {:?})", self.data.format),
                );
            }
            let mut seen = std::collections::BTreeSet::new();
            for l in &s.labels {
                if l.is_empty() || !seen.insert(l.as_str()) {
                    return invalid("data.schema.labels", format!("`{l}` is empty or named twice"));
                }
                if s.dense.contains(l) || s.sparse.contains(l) {
                    return invalid("data.schema.labels", format!("`{l}` is also a dense or sparse column"));
                }
            }
            let mut names = std::collections::BTreeSet::new();
            for (i, q) in s.sequence.iter().enumerate() {
                let key = |k: &str| format!("data.schema.sequence[{i}].{k}");
                if q.field.is_empty() || !names.insert(q.field.as_str()) {
                    return invalid(&key("field"), format!("`{}` is empty or named twice", q.field));
                }
                if s.dense.contains(&q.field) || s.sparse.contains(&q.field) || self.label_columns().contains(&q.field)
                {
                    return invalid(&key("field"), format!("`{}` is also a label, dense or sparse column", q.field));
                }
                if !s.sparse.contains(&q.table) {
                    return invalid(
                        &key("table"),
                        format!(
                            "`{}` names no sparse field (its IDs share that field's table; the sparse fields are {:?})",
                            q.table, s.sparse
                        ),
                    );
                }
            }
        }
        let labels = self.label_columns();
        let mut named = std::collections::BTreeSet::new();
        for (i, t) in self.model.tasks.iter().enumerate() {
            let key = |k: &str| format!("model.tasks[{i}].{k}");
            if !labels.contains(&t.name) {
                return invalid(
                    &key("name"),
                    format!("`{}` is not a label column (the labels are {labels:?})", t.name),
                );
            }
            if !named.insert(t.name.as_str()) {
                return invalid(&key("name"), format!("`{}` has two tasks", t.name));
            }
            match (t.kind, t.classes) {
                (TaskKind::Binary, Some(_)) => {
                    return invalid(&key("classes"), "is for kind = \"multiclass\" only".into());
                }
                (TaskKind::Multiclass, None) => {
                    return invalid(&key("classes"), "is needed by a multiclass task".into());
                }
                _ => {}
            }
            if !t.weight.is_finite() || t.weight < 0.0 {
                return invalid(&key("weight"), format!("must be a finite number ≥ 0, not {}", t.weight));
            }
        }
        if !self.model.tasks.is_empty() && named.len() != labels.len() {
            let missing: Vec<&String> = labels.iter().filter(|l| !named.contains(l.as_str())).collect();
            return invalid(
                "model.tasks",
                format!("has no task for the label columns {missing:?}: one task per label"),
            );
        }
        if let Some(g) = &self.eval.group_by {
            let sparse = self.data.schema.as_ref().map(|s| s.sparse.as_slice()).unwrap_or_default();
            if !schema_format || !sparse.contains(g) {
                return invalid(
                    "eval.group_by",
                    format!("`{g}` is not a sparse field of data.schema (the sparse fields are {sparse:?})"),
                );
            }
        }
        if let Some(s) = &self.data.schema
            && !s.sequence.is_empty()
            && self.data.format == DataFormat::Csv
            && s.multi_hot_separator.as_deref().is_none_or(str::is_empty)
        {
            return invalid(
                "data.schema.sequence",
                "needs data.schema.multi_hot_separator (what separates a sequence cell's IDs)".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Overrides;

    const JOB: &str = r#"
        [data]
        format = "csv"
        [data.schema]
        labels = ["click", "conversion", "kind"]
        sparse = ["user", "item"]
        multi_hot_separator = "|"
        sequence = [{ field = "hist", table = "item", max_len = 50 }]
        [model]
        kind = "mlp"
        [[model.tasks]]
        name = "click"
        [[model.tasks]]
        name = "conversion"
        weight = 2.0
        [[model.tasks]]
        name = "kind"
        kind = "multiclass"
        classes = 4
        [eval]
        group_by = "user"
    "#;

    fn parse(text: &str, sets: &[&str]) -> Result<Config, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Overrides::parse(&sets).and_then(|o| Config::from_toml(text, "job.toml", &o))
    }

    fn refused(text: &str, sets: &[&str]) -> String {
        parse(text, sets).expect_err("refused").to_string()
    }

    /// The issue's keys parse into tasks in label order with their outputs
    /// and weights; a job without them is one binary task.
    #[test]
    fn tasks_follow_the_label_columns() {
        let c = parse(JOB, &[]).expect("parses");
        let tasks = c.tasks();
        let names: Vec<&str> = tasks.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["click", "conversion", "kind"]);
        assert_eq!(tasks.iter().map(|t| t.outputs).collect::<Vec<_>>(), [1, 1, 4]);
        assert_eq!(tasks[1].weight, 2.0);
        assert_eq!(c.model_outputs(), 6);
        assert!(!c.single_binary_task());
        assert_eq!(c.sequence_fields()[0].table, "item");
        let plain = Config::default();
        assert!(plain.single_binary_task());
        assert_eq!(plain.label_columns(), ["label"]);
        // Without [[model.tasks]], each label is a binary task.
        let c = parse(JOB, &["model.tasks=[]"]).expect("parses");
        assert!(c.tasks().iter().all(|t| t.is_binary() && t.weight == 1.0));
        // The config survives the TOML a role receives.
        let again =
            Config::from_toml(&toml::to_string(&parse(JOB, &[]).expect("p")).expect("toml"), "t", &Overrides::none());
        assert_eq!(again.expect("round trip"), parse(JOB, &[]).expect("p"));
    }

    /// Each refusal names its key.
    #[test]
    fn bad_tasks_and_sequences_name_their_key() {
        let cases: [(&[&str], &str); 11] = [
            (&[r#"data.schema.sequence=[{field="hist",table="nowhere",max_len=5}]"#], "data.schema.sequence[0].table"),
            (&[r#"data.schema.sequence=[{field="hist",table="item",max_len=0}]"#], "data.schema.sequence[0].max_len"),
            (&[r#"data.schema.sequence=[{field="user",table="item",max_len=5}]"#], "data.schema.sequence[0].field"),
            (&[r#"model.tasks=[{name="click"}]"#], "model.tasks"),
            (&[r#"model.tasks=[{name="clicks"},{name="conversion"},{name="kind"}]"#], "model.tasks[0].name"),
            (
                &[r#"model.tasks=[{name="click",kind="multiclass"},{name="conversion"},{name="kind"}]"#],
                "model.tasks[0].classes",
            ),
            (
                &[r#"model.tasks=[{name="click",classes=3},{name="conversion"},{name="kind"}]"#],
                "model.tasks[0].classes",
            ),
            (
                &[r#"model.tasks=[{name="click",weight=-1.0},{name="conversion"},{name="kind"}]"#],
                "model.tasks[0].weight",
            ),
            (&[r#"data.schema.labels=["click","click"]"#, "model.tasks=[]"], "data.schema.labels"),
            (&["eval.group_by=\"hist\""], "eval.group_by"),
            (&["data.schema.multi_hot_separator=\"\""], "data.schema.sequence"),
        ];
        for (sets, key) in cases {
            let err = refused(JOB, sets);
            assert!(err.contains(key), "{sets:?}: {err}");
        }
        let no_separator = JOB.replace("multi_hot_separator = \"|\"", "");
        assert!(refused(&no_separator, &[]).contains("data.schema.sequence"));
        let criteo = "[data]\nformat = \"criteo\"\n[data.schema]\nlabels = [\"a\", \"b\"]\n";
        assert!(refused(criteo, &[]).contains("data.schema.labels"));
    }
}
