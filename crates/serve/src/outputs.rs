//! What a served model answers: one output per task, from the logits the
//! model gives each row (its tasks' outputs side by side, in task order).
//!
//! - One binary task: `probability` ([N]), as always.
//! - Several tasks: `probability_<task>` ([N]) for a binary task and
//!   `probabilities_<task>` ([N, K], a softmax) for a multiclass one. The
//!   first task, when binary, is also `probability`, as `test_auc` is the
//!   first task's; a model with exactly one multiclass task also answers
//!   it as `probabilities`.
//!
//! A request's `outputs` picks some by name; by default every one comes.

use sparrow_core::Config;
use sparrow_core::config::ServedOutput;

/// An output's values for a request's rows, `per_row` a row.
pub struct Output {
    pub name: String,
    pub per_row: usize,
    pub values: Vec<f32>,
}

/// The outputs a model of `config` answers with, and its logits a row
/// (`Config::served_outputs`: the ONNX export and Python name them alike).
pub fn specs(config: &Config) -> (Vec<ServedOutput>, usize) {
    config.served_outputs()
}

/// The outputs `requested` names (empty: all), or the name the model lacks.
pub fn select<'s>(specs: &'s [ServedOutput], requested: &[String]) -> Result<Vec<&'s ServedOutput>, String> {
    if requested.is_empty() {
        return Ok(specs.iter().collect());
    }
    requested
        .iter()
        .map(|name| {
            specs.iter().find(|s| s.name == *name).ok_or_else(|| {
                let known: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
                format!("output `{name}`: the model's outputs are {known:?}")
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::metrics::sigmoid;

    #[test]
    fn each_task_has_its_output_and_the_first_binary_one_is_also_probability() {
        let mut config = Config::default();
        config.data.format = sparrow_core::config::DataFormat::Csv;
        let labels = vec!["click".into(), "ad_type".into()];
        config.data.schema = Some(sparrow_core::config::Schema { labels, ..Default::default() });
        config.model.tasks = vec![sparrow_core::config::TaskConfig {
            name: "ad_type".into(),
            kind: sparrow_core::config::TaskKind::Multiclass,
            classes: Some(3),
            weight: 1.0,
        }];
        let (specs, per_row) = specs(&config);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["probability_click", "probabilities_ad_type", "probability", "probabilities"]);
        assert_eq!(per_row, 4);
        let logits = [0.0f32, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0, f32::ln(2.0)];
        let mut click = Vec::new();
        specs[0].extend_from(&logits, per_row, &mut click);
        assert_eq!(click, [0.5, sigmoid(2.0) as f32]);
        let mut classes = Vec::new();
        specs[1].extend_from(&logits, per_row, &mut classes);
        let want = [1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 0.25, 0.25, 0.5];
        assert!(classes.iter().zip(want).all(|(a, b)| (f64::from(*a) - b).abs() < 1e-6), "{classes:?}");
        let picked = select(&specs, &["probabilities".into()]).expect("known");
        assert_eq!(picked[0].per_row, 3);
        let e = select(&specs, &["logit".into()]).map(|_| ()).expect_err("unknown");
        assert!(e.contains("output `logit`") && e.contains("probability_click"), "{e}");
    }
}
