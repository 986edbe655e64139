//! What a run reports while it trains: `eval_every_steps` puts test points
//! in the metrics without changing the model, and `tensorboard_dir` writes
//! the scalars TensorBoard reads.

mod common;

use common::{small_config, small_data};
use sparrow_trainer::tensorboard::read_events;

#[test]
fn periodic_evaluation_and_tensorboard_leave_the_model_unchanged() {
    let tmp = tempfile::tempdir().expect("tmp");
    small_data(tmp.path(), 4000, 500);
    let plain = sparrow_trainer::train(&small_config(tmp.path(), "mlp"), true).expect("train");

    let mut config = small_config(tmp.path(), "mlp");
    let (metrics, board) = (tmp.path().join("m/metrics.jsonl"), tmp.path().join("tb"));
    config.train.metrics_path = Some(metrics.display().to_string());
    config.train.eval_every_steps = Some(10);
    config.train.tensorboard_dir = Some(board.display().to_string());
    let reported = sparrow_trainer::train(&config, true).expect("train");
    assert_eq!(plain.test_auc.map(f64::to_bits), reported.test_auc.map(f64::to_bits), "the same model");
    assert_eq!(plain.steps, 32);

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let evals: Vec<&serde_json::Value> = lines.iter().filter(|l| l["event"] == "eval").collect();
    let eval_steps: Vec<u64> = evals.iter().map(|l| l["step"].as_u64().expect("step")).collect();
    assert_eq!(eval_steps, [10, 20, 30, 32]);
    assert_eq!(evals[3]["test_auc"].as_f64(), reported.test_auc);
    assert!(evals.iter().all(|l| l["samples"].as_u64().is_some()));
    let interval = lines.iter().find(|l| l["event"].is_null()).expect("an interval line");
    assert!(interval["dedup_ratio"].as_f64().is_some_and(|d| d >= 1.0), "{interval}");
    assert!(interval["phase_secs"]["dense"].as_f64().is_some_and(|d| d > 0.0), "{interval}");
    // The wait for the reader's batches is a phase of its own (zero or more).
    assert!(interval["phase_secs"]["next_batch"].as_f64().is_some_and(|w| w >= 0.0), "{interval}");

    let files: Vec<_> = std::fs::read_dir(&board).expect("tb").map(|e| e.expect("entry").path()).collect();
    assert_eq!(files.len(), 1);
    assert!(files[0].file_name().expect("name").to_string_lossy().starts_with("events.out.tfevents."));
    let events = read_events(&files[0]).expect("events");
    let scalars: Vec<(i64, String)> = events
        .iter()
        .flat_map(|e| e.summary.iter().flat_map(move |s| s.value.iter().map(move |v| (e.step, v.tag.clone()))))
        .collect();
    let tags = [
        "train/logloss",
        "train/samples_per_sec",
        "train/dedup_ratio",
        "step_ms/dense",
        "step_ms/next_batch",
        "test/auc",
    ];
    for tag in tags {
        assert!(scalars.iter().any(|(_, t)| t == tag), "{tag} missing");
    }
    let auc_steps: Vec<i64> = scalars.iter().filter(|(_, t)| t == "test/auc").map(|(s, _)| *s).collect();
    assert_eq!(auc_steps, [10, 20, 30, 32]);
}

/// Periodic evaluation without a test file would evaluate nothing, silently:
/// refused, naming both keys.
#[test]
fn periodic_evaluation_needs_a_test_file() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut config = small_config(tmp.path(), "mlp");
    config.data.test = None;
    config.train.eval_every_steps = Some(10);
    let err = config.validate().expect_err("refused").to_string();
    assert!(err.contains("train.eval_every_steps") && err.contains("data.test"), "{err}");
}
