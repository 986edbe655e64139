//! How a sample's label cells read: one per task (`[[model.tasks]]`), a
//! binary task's 0/1 (or −1/+1), a multiclass task's class id below its
//! `classes`. With several label columns (`data.schema.labels`) an empty
//! cell masks the task for the sample (NaN in the batch); the one label of
//! a job without them must be there, as before.

use sparrow_core::Config;
use sparrow_core::config::TaskKind;

/// `0`/`1` or `-1`/`+1`; anything else is a malformed row.
pub fn parse_label(raw: &[u8]) -> Result<f32, String> {
    match raw {
        b"1" | b"+1" | b"1.0" => Ok(1.0),
        b"0" | b"-1" | b"0.0" | b"-1.0" => Ok(0.0),
        _ => Err(format!("label `{}` is not 0/1 or -1/+1", String::from_utf8_lossy(raw))),
    }
}

/// The label columns' reading rules, in the order the batch holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct LabelRules {
    tasks: Vec<(String, Option<usize>)>,
    /// An empty cell masks its task (several label columns were named).
    masking: bool,
}

impl LabelRules {
    /// The rules of `job`'s tasks.
    pub fn of(job: &Config) -> LabelRules {
        let tasks = job
            .tasks()
            .into_iter()
            .map(|t| {
                let classes = (t.kind == TaskKind::Multiclass).then_some(t.outputs);
                (t.name, classes)
            })
            .collect();
        let masking = job.data.schema.as_ref().is_some_and(|s| !s.labels.is_empty());
        LabelRules { tasks, masking }
    }

    /// A schema's label columns read as binary tasks (the rules before a
    /// job's tasks are known; [`of`](Self::of) for a job).
    pub fn binary_of(schema: &sparrow_core::config::Schema) -> LabelRules {
        if schema.labels.is_empty() {
            return LabelRules::one_binary(&schema.label);
        }
        LabelRules { tasks: schema.labels.iter().map(|l| (l.clone(), None)).collect(), masking: true }
    }

    /// One binary label, always present (Criteo, libsvm, a one-label CSV).
    pub fn one_binary(name: &str) -> LabelRules {
        LabelRules { tasks: vec![(name.to_string(), None)], masking: false }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// The label columns' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tasks.iter().map(|(n, _)| n.as_str())
    }

    /// Task `task`'s value from its cell's text (NaN: masked).
    pub fn read(&self, task: usize, raw: &[u8]) -> Result<f32, String> {
        let (name, classes) = &self.tasks[task];
        if !self.masking && classes.is_none() {
            // The one label of a job without `labels`: read as it always was.
            return parse_label(raw);
        }
        let text = std::str::from_utf8(raw).map(str::trim).unwrap_or("\u{fffd}");
        if self.masking && text.is_empty() {
            return Ok(f32::NAN);
        }
        match classes {
            None => {
                parse_label(text.as_bytes()).map_err(|e| format!("task `{name}`: {e} (an empty cell masks the task)"))
            }
            Some(k) => match text.parse::<u32>() {
                Ok(c) if (c as usize) < *k => Ok(c as f32),
                _ => Err(format!(
                    "task `{name}`: label `{}` is not a class id in 0..{k}",
                    String::from_utf8_lossy(raw).escape_debug()
                )),
            },
        }
    }

    /// A label's numeric value (a Parquet cell that holds a number): NaN
    /// masks it where masking applies.
    pub fn read_number(&self, task: usize, value: f64) -> Result<f32, String> {
        let (name, classes) = &self.tasks[task];
        match classes {
            None if value == 0.0 || value == -1.0 => Ok(0.0),
            None if value == 1.0 => Ok(1.0),
            None => Err(format!("task `{name}`: label `{value}` is not 0/1 or -1/+1")),
            Some(k) if value.fract() == 0.0 && value >= 0.0 && value < *k as f64 => Ok(value as f32),
            Some(k) => Err(format!("task `{name}`: label `{value}` is not a class id in 0..{k}")),
        }
    }

    /// Whether a missing cell masks the task (rather than being an error).
    pub fn masking(&self) -> bool {
        self.masking
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_tasks() -> Config {
        let text = r#"
            [data]
            format = "csv"
            [data.schema]
            labels = ["click", "kind"]
            sparse = ["u"]
            [model]
            kind = "mlp"
            [[model.tasks]]
            name = "click"
            [[model.tasks]]
            name = "kind"
            kind = "multiclass"
            classes = 3
        "#;
        Config::from_toml(text, "t.toml", &sparrow_core::Overrides::none()).expect("config")
    }

    /// Binary cells read 0/1 (and −1/+1), class ids below `classes`, an
    /// empty cell masks; anything else is an error naming the task.
    #[test]
    fn cells_read_by_their_tasks_kind() {
        let rules = LabelRules::of(&two_tasks());
        assert_eq!(rules.names().collect::<Vec<_>>(), ["click", "kind"]);
        assert_eq!(rules.read(0, b"1"), Ok(1.0));
        assert_eq!(rules.read(0, b"-1"), Ok(0.0));
        assert!(rules.read(0, b"").expect("masked").is_nan());
        assert!(rules.read(1, b" ").expect("masked").is_nan());
        assert_eq!(rules.read(1, b"2"), Ok(2.0));
        for (task, bad) in [(0, "2"), (0, "yes"), (1, "3"), (1, "-1"), (1, "1.5")] {
            let err = rules.read(task, bad.as_bytes()).expect_err(bad);
            assert!(err.contains(["`click`", "`kind`"][task]), "{err}");
        }
        // One label without masking: an empty cell is an error, as before.
        assert!(LabelRules::one_binary("label").read(0, b"").is_err());
        assert_eq!(rules.read_number(1, 2.0), Ok(2.0));
        assert!(rules.read_number(1, 3.0).is_err());
        assert!(rules.read_number(0, 0.5).is_err());
    }
}
