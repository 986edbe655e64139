//! Sample weighting by age (`[data.weighting]`, S4.4) on `sparrow gen
//! --format csv --days` data: the fields it adds to the JSON, the same
//! weighted model from `train` and from a one-worker `launch`, a merge
//! buffer larger than a batch (merging further, resuming exactly), bad
//! timestamps counted as bad rows, and settings refused naming the key.

mod common;

use common::{last_json, sparrow};
use std::path::Path;

fn gen_days(dir: &Path, extra: &[&str]) {
    let out = sparrow()
        .args(["gen", "--format", "csv", "--days", "4", "--train-rows", "8000", "--test-rows", "1000", "--out"])
        .arg(dir.join("data"))
        .args(extra)
        .output()
        .expect("gen");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn config(dir: &Path, weighting: &str) -> String {
    let d = dir.display();
    let schema = common::days_schema();
    let text = format!(
        r#"
[data]
format = "csv"
train = "{d}/data/train.csv"
test = "{d}/data/test.csv"
[data.schema]
{schema}timestamp = "ts"
{weighting}
[model]
kind = "dlrm"
embedding_dim = 8
hidden = [16]
bottom_hidden = [8]
[train]
batch_size = 256
[cluster]
heartbeat_interval_ms = 100
heartbeat_timeout_ms = 2000
"#,
    );
    let path = dir.join(format!("job{}.toml", weighting.len()));
    std::fs::write(&path, text).expect("config");
    path.display().to_string()
}

#[test]
fn weighted_training_reports_its_weights_and_a_cluster_trains_the_same_weighted_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    gen_days(tmp.path(), &[]);
    let header = std::fs::read_to_string(tmp.path().join("data/train.csv")).expect("csv");
    assert!(header.lines().next().is_some_and(|h| h.ends_with(",ts")), "a ts column");

    let plain = config(tmp.path(), "");
    let out = sparrow().args(["train", "--config", &plain, "--quiet"]).output().expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plain = last_json(&out);
    assert_eq!((plain["merged_samples"].as_u64(), plain["dropped_samples"].as_u64()), (Some(0), Some(0)));
    assert_eq!(plain["sample_weight_sum"].as_f64(), Some(8000.0), "unweighted: every sample weighs 1");

    // Four days, e-fold decay per day: the oldest day weighs e^-3 and more.
    let weighted = config(tmp.path(), "[data.weighting]\ndrop_below = 0.06");
    let out = sparrow().args(["train", "--config", &weighted, "--quiet"]).output().expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let single = last_json(&out);
    let (rows, sum) =
        (single["train_rows"].as_u64().expect("rows"), single["sample_weight_sum"].as_f64().expect("sum"));
    let dropped = single["dropped_samples"].as_u64().expect("dropped");
    // Part of the oldest day is older than ln(1/0.06) = 2.8 days: dropped.
    assert!(dropped > 0 && rows + dropped == 8000, "{rows} trained + {dropped} dropped");
    assert!(sum > 0.06 * rows as f64 && sum < rows as f64 * 0.6, "weights sum to {sum} over {rows} rows");
    assert_ne!(single["test_auc"], plain["test_auc"], "the weights changed the model");

    // The weights travel with the batches to a worker: one shard and one
    // worker train train's weighted model bit for bit.
    let out = sparrow()
        .args(["launch", "--config", &weighted, "--shards", "1", "--workers", "1", "--quiet"])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let one = last_json(&out);
    assert_eq!(one["test_auc"], single["test_auc"]);
    assert_eq!(one["dropped_samples"], single["dropped_samples"]);
    assert!((one["sample_weight_sum"].as_f64().expect("sum") - sum).abs() < 1e-6 * sum);
}

#[test]
fn bad_timestamps_are_bad_rows_and_bad_settings_name_their_key() {
    let tmp = tempfile::tempdir().expect("tmp");
    gen_days(tmp.path(), &[]);
    let train = tmp.path().join("data/train.csv");
    let mut text = std::fs::read_to_string(&train).expect("csv");
    let good = text.lines().nth(1).expect("a row").to_string();
    let (row, _) = good.rsplit_once(',').expect("ts");
    text.push_str(&format!("{row},yesterday\n{row},99999999999\n"));
    std::fs::write(&train, text).expect("write");
    let weighted = config(tmp.path(), "[data.weighting]");
    let out = sparrow().args(["train", "--config", &weighted, "--quiet"]).output().expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(last_json(&out)["bad_rows"], 2, "{stderr}");
    assert!(stderr.contains("train.csv:8002") && stderr.contains("`yesterday` is not a time"), "{stderr}");
    assert!(stderr.contains("train.csv:8003") && stderr.contains("in the future"), "{stderr}");

    let no_column = std::fs::read_to_string(&weighted).expect("config").replace("timestamp = \"ts\"\n", "");
    let path = tmp.path().join("no_ts.toml");
    std::fs::write(&path, no_column).expect("config");
    for (path, set, key) in [
        (path.display().to_string(), None, "data.weighting"),
        (weighted.clone(), Some("data.weighting.decay_base=1.0"), "data.weighting.decay_base"),
        (weighted.clone(), Some("data.weighting.merge_buffer_rows=100000000"), "data.weighting.merge_buffer_rows"),
    ] {
        let mut command = sparrow();
        command.args(["train", "--config", &path, "--quiet"]);
        if let Some(set) = set {
            command.args(["--set", set]);
        }
        let out = command.output().expect("train");
        assert!(!out.status.success(), "{key}: accepted");
        assert!(String::from_utf8_lossy(&out.stderr).contains(key), "{key}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

fn train(config: &str, sets: &[String]) -> serde_json::Value {
    let mut command = sparrow();
    command.args(["train", "--config", config, "--quiet"]);
    for set in sets {
        command.args(["--set", set]);
    }
    let out = command.output().expect("train");
    assert!(out.status.success(), "{sets:?}: {}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// Each of 4000 rows comes again 4000 rows later (more than a batch): only
/// a merge buffer holding both copies merges them, and a run stopped inside
/// a buffer resumes to the uninterrupted run's model.
#[test]
fn a_merge_buffer_larger_than_a_batch_merges_further_and_resumes_exactly() {
    let tmp = tempfile::tempdir().expect("tmp");
    gen_days(tmp.path(), &[]);
    let train_csv = tmp.path().join("data/train.csv");
    let text = std::fs::read_to_string(&train_csv).expect("csv");
    let mut lines = text.lines();
    let header = lines.next().expect("header");
    let rows: Vec<&str> = lines.take(4000).collect();
    std::fs::write(&train_csv, format!("{header}\n{}\n{}\n", rows.join("\n"), rows.join("\n"))).expect("write");
    let weighted = config(tmp.path(), "[data.weighting]");

    let within_batches = train(&weighted, &[]);
    let buffer = "data.weighting.merge_buffer_rows=8000".to_string();
    let whole = train(&weighted, std::slice::from_ref(&buffer));
    let merged = |j: &serde_json::Value| j["merged_samples"].as_u64().expect("merged");
    assert!(merged(&within_batches) < 100, "copies 4000 rows apart merge only in a larger buffer");
    assert!(merged(&whole) >= 4000, "every copy merges with its twin: {}", merged(&whole));
    assert_eq!(whole["train_rows"].as_u64().map(|r| r + merged(&whole)), Some(8000));
    // A twin adds its weight to the merged sample's count: the sum is unchanged.
    let sum = |j: &serde_json::Value| j["sample_weight_sum"].as_f64().expect("sum");
    assert!((sum(&whole) - sum(&within_batches)).abs() < 1e-6 * sum(&whole));

    // Stopped after 3 batches, inside the first 2048-row buffer, and resumed.
    let ck = tmp.path().join("ck").display().to_string();
    let buffer = "data.weighting.merge_buffer_rows=2048".to_string();
    let dir = format!("checkpoint.dir=\"{ck}\"");
    let uninterrupted = train(&weighted, std::slice::from_ref(&buffer));
    let stopped = train(&weighted, &[buffer.clone(), dir.clone(), "train.max_steps=3".into()]);
    assert_eq!(stopped["steps"].as_u64(), Some(3), "{stopped}");
    let mut command = sparrow();
    command.args(["train", "--config", &weighted, "--quiet", "--resume", &ck, "--set", &buffer]);
    let out = command.output().expect("resume");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let resumed = last_json(&out);
    assert_eq!(resumed["resumed_from_step"].as_u64(), Some(3));
    assert_eq!(resumed["test_auc"], uninterrupted["test_auc"], "resumed inside a merge buffer");
    assert_eq!(resumed["test_logloss"], uninterrupted["test_logloss"]);

    // The loader hands the same batches to a worker.
    let out = sparrow()
        .args(["launch", "--config", &weighted, "--shards", "1", "--workers", "1", "--quiet", "--set", &buffer])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(last_json(&out)["test_auc"], uninterrupted["test_auc"], "launch with a merge buffer");
}

/// With `data.test` the training file itself, the weighting figures are
/// what training consumed, counted once (they were twice that: the test
/// read was weighted too), in `train` and in a one-worker `launch`.
#[test]
fn weighting_counts_what_training_consumed_once_when_the_test_file_is_the_training_file() {
    let tmp = tempfile::tempdir().expect("tmp");
    gen_days(tmp.path(), &[]);
    let weighted = config(tmp.path(), "[data.weighting]\ndrop_below = 0.06");
    let train_csv = tmp.path().join("data/train.csv").display().to_string();
    let same_file = format!("data.test={train_csv:?}");
    let figures = |j: &serde_json::Value| {
        (
            j["merged_samples"].as_u64(),
            j["dropped_samples"].as_u64(),
            j["sample_weight_sum"].as_f64(),
            j["train_rows"].as_u64(),
        )
    };
    let apart = train(&weighted, &[]);
    let same = train(&weighted, std::slice::from_ref(&same_file));
    assert!(apart["dropped_samples"].as_u64() > Some(0), "{apart}");
    assert_eq!(figures(&same), figures(&apart), "train: the test read adds nothing");
    // The test read is the file as it is: every row scored.
    assert_eq!(same["test_rows"].as_u64(), Some(8000), "{same}");

    let out = sparrow()
        .args(["launch", "--config", &weighted, "--shards", "1", "--workers", "1", "--quiet", "--set", &same_file])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let launched = last_json(&out);
    let (merged, dropped, sum, rows) = figures(&launched);
    assert_eq!((merged, dropped, rows), (figures(&apart).0, figures(&apart).1, figures(&apart).3), "{launched}");
    let (sum, expected) = (sum.expect("sum"), figures(&apart).2.expect("sum"));
    assert!((sum - expected).abs() <= 1e-6 * expected, "launch: {sum} against {expected}");
}
