//! The `sparrow` binary as a user runs it: gen → train → eval → predict, and
//! bad input that must end with a clear error and a non-zero exit code.

use std::path::Path;
use std::process::{Command, Output};

fn sparrow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sparrow")).args(args).output().expect("run sparrow")
}

fn last_json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last stdout line is not JSON ({e}): {stdout}"))
}

fn ok(out: &Output) {
    assert!(out.status.success(), "exit {:?}\nstderr: {}", out.status, String::from_utf8_lossy(&out.stderr));
}

fn fails_with(out: &Output, needles: &[&str]) {
    assert!(!out.status.success(), "expected failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    let err = String::from_utf8_lossy(&out.stderr);
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`: {err}");
    }
}

fn write_config(dir: &Path, name: &str, extra: &str) -> String {
    let d = dir.display();
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            r#"
[data]
format = "criteo"
train = "{d}/data/train.tsv"
test = "{d}/data/test.tsv"
[model]
kind = "dlrm"
embedding_dim = 8
hidden = [32, 16]
[train]
batch_size = 256
log_interval_steps = 4
metrics_path = "{d}/metrics.jsonl"
[embedding]
optimizer = "adagrad"
learning_rate = 0.05
init = {{ kind = "uniform", scale = 0.01 }}
[dense_optimizer]
kind = "adam"
learning_rate = 0.001
[checkpoint]
dir = "{d}/ck"
{extra}
"#
        ),
    )
    .expect("write config");
    path.display().to_string()
}

#[test]
fn gen_train_eval_predict() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let out = sparrow(&[
        "gen",
        "--out",
        &data.display().to_string(),
        "--train-rows",
        "20000",
        "--test-rows",
        "4000",
        "--seed",
        "2",
    ]);
    ok(&out);
    let truth: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("truth.json")).expect("truth")).expect("json");
    let bayes = truth["bayes_auc"].as_f64().expect("bayes_auc");
    assert!(bayes > 0.75 && bayes < 0.95, "bayes_auc {bayes}");
    assert!(truth["bayes_logloss"].as_f64().is_some());
    let first = std::fs::read_to_string(data.join("train.tsv")).expect("train.tsv");
    let cols: Vec<&str> = first.lines().next().expect("a row").split('\t').collect();
    assert_eq!(cols.len(), 40);

    let config = write_config(tmp.path(), "job.toml", "");
    let out = sparrow(&[
        "train",
        "--config",
        &config,
        "--set",
        "embedding.learning_rate=0.1",
        "--set",
        "embedding.optimizer=adagrad",
    ]);
    ok(&out);
    let summary = last_json(&out);
    for key in [
        "test_auc",
        "test_logloss",
        "train_rows",
        "samples_per_sec",
        "wall_secs",
        "peak_rss_bytes",
        "embedding_rows",
        "bad_rows",
    ] {
        assert!(summary.get(key).is_some_and(|v| !v.is_null()), "summary lacks {key}: {summary}");
    }
    assert_eq!(summary["train_rows"], 20000);
    assert_eq!(summary["bad_rows"], 0);
    let auc = summary["test_auc"].as_f64().expect("auc");
    assert!(auc > 0.6 && auc <= bayes + 0.01, "test_auc {auc} vs bayes {bayes}");
    let metrics = std::fs::read_to_string(tmp.path().join("metrics.jsonl")).expect("metrics");
    assert!(metrics.lines().count() >= 10, "per-interval metrics: {metrics}");
    for line in metrics.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("JSON line");
    }

    let ck = tmp.path().join("ck").display().to_string();
    let test = data.join("test.tsv").display().to_string();
    let out = sparrow(&["eval", "--checkpoint", &ck, "--data", &test]);
    ok(&out);
    let eval = last_json(&out);
    assert_eq!(eval["rows"], 4000);
    assert!((eval["auc"].as_f64().expect("auc") - auc).abs() < 1e-9, "eval reproduces the training run's test AUC");
    assert!(eval["logloss"].as_f64().is_some());

    let pred = tmp.path().join("pred.txt");
    let out = sparrow(&["predict", "--checkpoint", &ck, "--data", &test, "--out", &pred.display().to_string()]);
    ok(&out);
    let probs: Vec<f64> =
        std::fs::read_to_string(&pred).expect("pred").lines().map(|l| l.parse().expect("number")).collect();
    assert_eq!(probs.len(), 4000);
    assert!(probs.iter().all(|p| *p > 0.0 && *p < 1.0));

    // `sparrow export`: the serving export predicts exactly what its checkpoint does.
    let export = tmp.path().join("export").display().to_string();
    let out = sparrow(&["export", "--checkpoint", &ck, "--out", &export]);
    ok(&out);
    let written = last_json(&out);
    assert_eq!(written["rows"], summary["embedding_rows"], "{written}");
    assert_eq!(written["dtype"], "f32");
    let from_export = tmp.path().join("pred-export.txt");
    ok(&sparrow(&["predict", "--model", &export, "--data", &test, "--out", &from_export.display().to_string()]));
    assert_eq!(std::fs::read_to_string(&from_export).expect("pred"), std::fs::read_to_string(&pred).expect("pred"));
    fails_with(&sparrow(&["export", "--checkpoint", &ck, "--out", &export]), &["export", "exists already"]);
    // `--dtype f16`: vectors in half the bytes, predictions within f16's rounding.
    let half = tmp.path().join("export-f16").display().to_string();
    let out = sparrow(&["export", "--checkpoint", &ck, "--out", &half, "--dtype", "f16"]);
    ok(&out);
    assert_eq!(last_json(&out)["dtype"], "f16");
    let size = |dir: &str| std::fs::metadata(Path::new(dir).join("embeddings.bin")).expect("rows").len();
    let rows = written["rows"].as_u64().expect("rows");
    assert_eq!(size(&export) - size(&half), rows * 8 * 2, "dim 8: 16 bytes fewer per row");
    let from_half = tmp.path().join("pred-f16.txt");
    ok(&sparrow(&["predict", "--model", &half, "--data", &test, "--out", &from_half.display().to_string()]));
    let half_probs: Vec<f64> =
        std::fs::read_to_string(&from_half).expect("pred").lines().map(|l| l.parse().expect("number")).collect();
    let worst = probs.iter().zip(&half_probs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst > 0.0 && worst < 1e-2, "f16 vectors move predictions a little: {worst}");
    fails_with(
        &sparrow(&["export", "--checkpoint", &ck, "--out", "/tmp/x", "--dtype", "f8"]),
        &["'f8'", "--dtype", "f32, f16, bf16"],
    );
}

#[test]
fn bad_config_and_inputs_fail_clearly() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    ok(&sparrow(&["gen", "--out", &data.display().to_string(), "--train-rows", "600", "--test-rows", "100"]));

    let config = write_config(tmp.path(), "job.toml", "");
    fails_with(&sparrow(&["train", "--config", &config, "--set", "train.bach_size=3"]), &["bach_size"]);
    fails_with(&sparrow(&["train", "--config", &config, "--set", "train.batch_size=\"big\""]), &["batch_size"]);
    fails_with(&sparrow(&["train", "--config", &config, "--set", "model.kind=transformer"]), &["transformer"]);
    let unknown_key = write_config(tmp.path(), "unknown.toml", "[extra]\nfoo = 1\n");
    fails_with(&sparrow(&["train", "--config", &unknown_key]), &["extra"]);
    // Benches with nothing to time, or an unknown optimizer, say so before measuring.
    fails_with(&sparrow(&["bench", "--batches", "0"]), &["--batches"]);
    fails_with(&sparrow(&["bench", "--table-rows", "0"]), &["--table-rows"]);
    fails_with(&sparrow(&["bench", "--dims", "16,0"]), &["--dims", "0"]);
    fails_with(&sparrow(&["bench", "--dims", "5000"]), &["--dims", "5000"]);
    fails_with(&sparrow(&["bench", "--threads", "1,0"]), &["--threads"]);
    // Tables no machine holds: refused before any is filled, not an OOM kill.
    fails_with(&sparrow(&["bench", "--table-rows", "10000000000"]), &["--dims", "GB", "--table-rows"]);
    fails_with(&sparrow(&["bench", "--optimizers", "adagrad,lion"]), &["--optimizers", "'lion'", "rowwise_adagrad"]);
    fails_with(&sparrow(&["bench", "--roundings", "nearest,up"]), &["--roundings", "'up'", "stochastic"]);
    fails_with(&sparrow(&["bench", "--kinds", "mlp,dnn"]), &["--kinds", "'dnn'", "wide_deep"]);
    fails_with(&sparrow(&["gen", "--format", "tsv", "--out", "/tmp/never"]), &["--format", "'tsv'", "criteo, csv"]);
    fails_with(&sparrow(&["train", "--config", "/nonexistent/job.toml"]), &["/nonexistent/job.toml"]);
    fails_with(
        &sparrow(&["train", "--config", &config, "--set", "data.train=\"/nonexistent/train.tsv\""]),
        &["/nonexistent/train.tsv"],
    );

    // Malformed rows: counted within budget, a clear error past it.
    let bad = tmp.path().join("bad.tsv");
    let mut text = std::fs::read_to_string(data.join("train.tsv")).expect("train");
    text.push_str("1\tnot-a-number\n2\t3\n");
    std::fs::write(&bad, text).expect("write");
    let bad_s = format!("data.train={:?}", bad.display().to_string());
    let out = sparrow(&["train", "--config", &config, "--set", &bad_s, "--set", "data.max_bad_rows=5"]);
    ok(&out);
    assert_eq!(last_json(&out)["bad_rows"], 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.tsv:601") && stderr.contains("bad.tsv:602"), "{stderr}");
    let out = sparrow(&["train", "--config", &config, "--set", &bad_s, "--set", "data.max_bad_rows=1"]);
    fails_with(&out, &["bad.tsv", "max_bad_rows", "saved"]);
    // What was trained before the error is kept, and evaluates.
    let ck = tmp.path().join("ck").display().to_string();
    ok(&sparrow(&["eval", "--checkpoint", &ck, "--data", &data.join("test.tsv").display().to_string()]));
    fails_with(&sparrow(&["eval", "--checkpoint", "/nonexistent/ck", "--data", "x"]), &["/nonexistent/ck"]);
}

#[test]
fn ctrl_c_checkpoints_and_the_run_resumes() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    ok(&sparrow(&["gen", "--out", &data.display().to_string(), "--train-rows", "4000", "--test-rows", "500"]));
    // Many epochs: the run is still training when the interrupt arrives.
    let config = write_config(tmp.path(), "job.toml", "");
    let child = Command::new(env!("CARGO_BIN_EXE_sparrow"))
        .args(["train", "--config", &config, "--set", "train.epochs=100000", "--set", "train.log_interval_steps=1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let metrics = tmp.path().join("metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.lines().count() < 3) {
        assert!(started.elapsed().as_secs() < 60, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let killed = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(130), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("saved in") && stderr.contains("--resume"), "{stderr}");
    let ck = tmp.path().join("ck");
    let out = sparrow(&[
        "eval",
        "--checkpoint",
        &ck.display().to_string(),
        "--data",
        &data.join("test.tsv").display().to_string(),
    ]);
    ok(&out);
    assert!(last_json(&out)["checkpoint_step"].as_u64().expect("step") >= 3);
    // A run resumes from the interrupted one's checkpoint.
    let out =
        sparrow(&["train", "--config", &config, "--resume", &ck.display().to_string(), "--set", "train.max_steps=100"]);
    ok(&out);
    assert!(last_json(&out)["resumed_from_step"].as_u64().is_some());
}

/// An SSD-tier run killed (SIGKILL) while writing a checkpoint: the version
/// being written is ignored, `LATEST` still names the previous complete one,
/// and a run resumed from it ends with the uninterrupted run's model.
#[test]
fn a_kill_during_a_checkpoint_of_an_ssd_table_keeps_the_previous_one() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    ok(&sparrow(&["gen", "--out", &data.display().to_string(), "--train-rows", "30000", "--test-rows", "500"]));
    let config = write_config(tmp.path(), "job.toml", "every_steps = 20");
    let ssd = |name: &str| {
        let path = tmp.path().join(name).display().to_string();
        vec![
            "--set".to_string(),
            "embedding.storage=\"ssd\"".to_string(),
            "--set".to_string(),
            format!("embedding.path=\"{path}\""),
            "--set".to_string(),
            "embedding.cache_capacity_rows=4096".to_string(),
            "--set".to_string(),
            "train.batch_size=64".to_string(),
        ]
    };
    let ck = tmp.path().join("ck");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sparrow"))
        .args(["train", "--config", &config])
        .args(ssd("ssd-killed"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    // Wait for a complete checkpoint, then kill the process as soon as the
    // next one is being written (its temporary directory exists).
    let started = std::time::Instant::now();
    let writing = |dir: &Path| {
        std::fs::read_dir(dir)
            .map(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with(".tmp-ckpt")))
            .unwrap_or(false)
    };
    while !ck.join("LATEST").exists() {
        assert!(started.elapsed().as_secs() < 120, "no checkpoint was written");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // Freeze the process while a checkpoint is being written; if the write
    // finished before the freeze took hold, let it run to the next one.
    let signal = |sig: &str| {
        assert!(Command::new("kill").args([sig, &child.id().to_string()]).status().expect("kill").success());
    };
    loop {
        while !writing(&ck) {
            assert!(started.elapsed().as_secs() < 120, "no second checkpoint started");
            std::thread::yield_now();
        }
        signal("-STOP");
        std::thread::sleep(std::time::Duration::from_millis(20));
        if writing(&ck) {
            break;
        }
        signal("-CONT");
    }
    signal("-KILL");
    child.wait().expect("reap");
    assert!(writing(&ck), "the incomplete version is left behind, unnamed");
    let latest = std::fs::read_to_string(ck.join("LATEST")).expect("LATEST");
    let step: u64 = latest.trim().trim_start_matches("ckpt-").parse().expect("step in the name");
    assert!(step >= 20 && step.is_multiple_of(20), "LATEST names {latest}");

    // The previous version loads and verifies (sizes and hashes).
    let test = data.join("test.tsv").display().to_string();
    let out = sparrow(&["eval", "--checkpoint", &ck.display().to_string(), "--data", &test]);
    ok(&out);
    assert_eq!(last_json(&out)["checkpoint_step"].as_u64(), Some(step));

    // Resumed (onto a fresh SSD tier) = never interrupted.
    let stop = format!("train.max_steps={}", step + 30);
    let resumed = sparrow(
        &[
            &["train", "--config", &config, "--resume", &ck.display().to_string(), "--set", &stop][..],
            &ssd("ssd-resumed").iter().map(String::as_str).collect::<Vec<_>>(),
        ]
        .concat(),
    );
    ok(&resumed);
    let full_ck = format!("checkpoint.dir=\"{}\"", tmp.path().join("ck-full").display());
    let full = sparrow(
        &[
            &["train", "--config", &config, "--set", &stop, "--set", &full_ck][..],
            &ssd("ssd-full").iter().map(String::as_str).collect::<Vec<_>>(),
        ]
        .concat(),
    );
    ok(&full);
    let (r, f) = (last_json(&resumed), last_json(&full));
    assert_eq!(r["resumed_from_step"].as_u64(), Some(step));
    assert_eq!(r["steps"], f["steps"]);
    assert_eq!(r["test_auc"], f["test_auc"], "resumed {r}\nuninterrupted {f}");
    assert_eq!(r["embedding_rows"], f["embedding_rows"]);
}

/// `configs/dlrm.toml` on fresh data: `train.metrics_path` in a folder that
/// does not exist yet is made, as `checkpoint.dir` is.
#[test]
fn a_metrics_path_in_a_new_folder_is_created() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().display().to_string();
    ok(&sparrow(&["gen", "--out", &format!("{d}/data"), "--train-rows", "1500", "--test-rows", "300"]));
    let config = write_config(tmp.path(), "m.toml", "");
    let metrics = format!("{d}/runs/today/metrics.jsonl");
    let out = sparrow(&["train", "--config", &config, "--quiet", "--set", &format!("train.metrics_path={metrics:?}")]);
    ok(&out);
    let lines = std::fs::read_to_string(&metrics).expect("metrics written");
    assert!(lines.lines().count() > 1, "{lines}");
}

/// Progressive validation scores each batch with its own step's forward
/// pass, before the update: over the whole run its log-loss is the
/// row-weighted mean of the per-step training losses (logged every step).
/// A window of 512 samples holds the last two batches. Off by default for
/// a file.
#[test]
fn online_metrics_score_each_batch_before_its_update() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().display().to_string();
    ok(&sparrow(&["gen", "--out", &format!("{d}/data"), "--train-rows", "3000", "--test-rows", "300"]));
    let config = write_config(tmp.path(), "o.toml", "");
    let plain = last_json(&sparrow(&["train", "--config", &config, "--quiet"]));
    assert!(plain["online_auc"].is_null() && plain["online_samples"].is_null(), "{plain}");
    let out = sparrow(&[
        "train",
        "--config",
        &config,
        "--quiet",
        "--set",
        "train.online_window_samples=512",
        "--set",
        "train.log_interval_steps=1",
    ]);
    ok(&out);
    let json = last_json(&out);
    assert_eq!(json["online_samples"], 3000);
    assert_eq!(json["test_auc"], plain["test_auc"], "scoring changes nothing in the model");
    let lines = std::fs::read_to_string(tmp.path().join("metrics.jsonl")).expect("metrics");
    let steps: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .filter(|v: &serde_json::Value| v["event"].is_null())
        .collect();
    let (mut loss, mut rows, mut samples) = (0.0, 0.0, 0.0);
    for v in &steps {
        let now = v["samples"].as_f64().expect("samples");
        loss += v["train_logloss"].as_f64().expect("loss") * (now - samples);
        rows += now - samples;
        samples = now;
    }
    let online = json["online_logloss"].as_f64().expect("online log-loss");
    assert!((online - loss / rows).abs() < 1e-5, "online {online} vs the steps' mean training loss {}", loss / rows);
    let last = steps.last().expect("a line");
    assert_eq!(last["online_window"]["samples"], 512, "{last}");
    assert!(json["online_window_auc"].as_f64().is_some_and(|a| a > 0.0 && a < 1.0), "{json}");
}

/// `sparrow demo` ends with one line a person reads (test AUC beside the
/// best possible, speed, where the checkpoint is), then the JSON.
#[test]
fn the_demo_ends_with_a_line_for_people_before_its_json() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("demo");
    let out = sparrow(&["demo", "--dir", &dir.display().to_string(), "--train-rows", "3000", "--test-rows", "600"]);
    ok(&out);
    let json = last_json(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr.lines().last().expect("a last line");
    let auc = json["test_auc"].as_f64().expect("auc");
    let bayes = json["bayes_auc"].as_f64().expect("bayes");
    let checkpoint = json["checkpoint"].as_str().expect("checkpoint");
    assert!(line.starts_with("demo: test AUC "), "{line}");
    assert!(line.contains(&format!("{auc:.4}")) && line.contains(&format!("{bayes:.4}")), "{line}");
    assert!(line.contains("samples/s") && line.contains(checkpoint), "{line}");
}

/// A table trained with half rows (`embedding.dtype` f16 or bf16) and
/// exported in its own type loses nothing: the export predicts exactly what
/// its checkpoint does, at half the vector bytes of an f32 export. bf16
/// rows exported as f16 round (bf16 keeps 8 bits where f16 keeps 11, but a
/// wider range, so neither holds the other).
#[test]
fn half_rows_export_in_their_own_type_without_loss() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data").display().to_string();
    ok(&sparrow(&["gen", "--out", &data, "--train-rows", "8000", "--test-rows", "1000", "--seed", "5"]));
    let test = tmp.path().join("data/test.tsv").display().to_string();
    let config = write_config(tmp.path(), "job.toml", "");
    let path = |name: &str| tmp.path().join(name).display().to_string();
    let predict = |flag: &str, dir: &str| {
        let out = path(&format!("pred-{}.txt", dir.rsplit('/').next().unwrap_or_default()));
        ok(&sparrow(&["predict", flag, dir, "--data", &test, "--out", &out]));
        std::fs::read_to_string(out).expect("predictions")
    };
    let vector_bytes = |dir: &str| std::fs::metadata(Path::new(dir).join("embeddings.bin")).expect("rows").len();
    for dtype in ["f16", "bf16"] {
        let ck = path(&format!("ck-{dtype}"));
        let dtype_set = format!("embedding.dtype=\"{dtype}\"");
        let ck_set = format!("checkpoint.dir=\"{ck}\"");
        ok(&sparrow(&["train", "--config", &config, "--quiet", "--set", &dtype_set, "--set", &ck_set]));
        let from_checkpoint = predict("--checkpoint", &ck);
        let own = path(&format!("export-{dtype}-as-{dtype}"));
        let out = sparrow(&["export", "--checkpoint", &ck, "--out", &own, "--dtype", dtype]);
        ok(&out);
        assert_eq!(last_json(&out)["dtype"], dtype);
        assert_eq!(predict("--model", &own), from_checkpoint, "{dtype} rows exported as {dtype}");
        let full = path(&format!("export-{dtype}-as-f32"));
        let out = sparrow(&["export", "--checkpoint", &ck, "--out", &full]);
        ok(&out);
        let rows = last_json(&out)["rows"].as_u64().expect("rows");
        assert_eq!(predict("--model", &full), from_checkpoint, "{dtype} rows exported as f32");
        assert_eq!(vector_bytes(&full) - vector_bytes(&own), rows * 8 * 2, "dim 8: 16 bytes fewer per row");
    }
    // bf16 rows as f16: f16 holds every bf16 value of its range, but
    // rounds the small ones to its subnormals' spacing (2^-24). Compared
    // value by value: whether that rounding moves a printed prediction
    // depends on the trained bits (it did not on one CPU's gemm kernels).
    let crossed = path("export-bf16-as-f16");
    ok(&sparrow(&["export", "--checkpoint", &path("ck-bf16"), "--out", &crossed, "--dtype", "f16"]));
    let vectors = |dir: &str| {
        let bytes = std::fs::read(Path::new(dir).join("embeddings.bin")).expect("rows");
        sparrow_trainer::export::parse_embeddings(&bytes, 8).expect("an embeddings file")
    };
    let ((keys, own), (crossed_keys, as_f16)) = (vectors(&path("export-bf16-as-bf16")), vectors(&crossed));
    assert_eq!(keys, crossed_keys);
    let moved: Vec<(f32, f32)> = own.iter().zip(&as_f16).filter(|(a, b)| a != b).map(|(&a, &b)| (a, b)).collect();
    assert!(!moved.is_empty(), "bf16 rows as f16 round: none of {} values moved", own.len());
    let half_spacing = 2f32.powi(-25);
    assert!(moved.iter().all(|(a, b)| (a - b).abs() <= half_spacing && a.abs() < 2f32.powi(-14)), "{moved:?}");
}

/// The kernels chosen at run time (bf16 products, DLRM's interaction at
/// d = 16, f16 and bf16 row conversions and steps, stochastic rounding,
/// the first-order and FM terms, batch norm and Dice) and their portable versions train the
/// same model: with `SPARROW_SIMD=portable` the checkpoint is the same
/// bytes, on this machine as on a CPU without the features (bf16 products
/// are the same bytes where the CPU has AVX-512-BF16; without it they run
/// the fp32 kernels on rounded inputs, to the same accuracy). The SIMD side
/// runs `SPARROW_SIMD=avx512`: every SIMD kernel but AMX's tiles (on a CPU
/// without AMX the same as `auto`). With AMX, bf16 products are AMX's own
/// sums, other bits by design: `auto` trains them to the same accuracy. A
/// value other than `auto`, `avx512`, `avx2` or `portable` is refused naming the
/// variable.
#[test]
fn portable_kernels_train_the_same_model_bit_for_bit() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data").display().to_string();
    ok(&sparrow(&["gen", "--out", &data, "--train-rows", "12000", "--test-rows", "2000", "--seed", "4"]));
    let config = write_config(tmp.path(), "job.toml", "");
    let train = |simd: &str, ck: &str, sets: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sparrow"));
        cmd.env("SPARROW_SIMD", simd).args(["train", "--config", &config]);
        for set in sets {
            cmd.args(["--set", set]);
        }
        let out = cmd.args(["--set", &format!("checkpoint.dir=\"{ck}\"")]).output().expect("run sparrow");
        ok(&out);
        let summary = last_json(&out);
        let ckpt = Path::new(summary["checkpoint"].as_str().expect("checkpoint")).to_path_buf();
        (summary, ckpt)
    };
    let ck = |name: &str| tmp.path().join(name).display().to_string();
    let modes: [&[&str]; 4] = [
        &["model.embedding_dim=16", "model.precision=\"bf16\"", "embedding.dtype=\"f16\""],
        &["model.embedding_dim=16", "model.kind=\"fm\"", "embedding.dtype=\"bf16\""],
        &[
            "model.embedding_dim=16",
            "model.kind=\"deepfm\"",
            "embedding.dtype=\"bf16\"",
            "embedding.rounding=\"stochastic\"",
        ],
        // Batch norm's passes and the bias gradients' column sums (a tile of
        // 32 and an edge of 8 columns), Dice's batch statistics.
        &["model.embedding_dim=16", "model.norm=\"batch\"", "model.activation=\"dice\"", "model.hidden=[40]"],
    ];
    // Without AVX-512-BF16, `model.precision = "bf16"` runs the fp32 kernels
    // on bf16-rounded inputs: the same accuracy, other bits (by design).
    let native_bf16 =
        std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|f| f == "avx512_bf16"));
    let mut portable_cks = Vec::new();
    let amx = sparrow_model::amx::available(sparrow_core::simd::Simd::Auto);
    for (m, sets) in modes.iter().enumerate() {
        let (simd, simd_ck) = train("avx512", &ck(&format!("ck-simd-{m}")), sets);
        if amx && sets.contains(&"model.precision=\"bf16\"") {
            let (on_amx, _) = train("auto", &ck(&format!("ck-amx-{m}")), sets);
            let auc = |j: &serde_json::Value| j["test_auc"].as_f64().expect("auc");
            assert!((auc(&simd) - auc(&on_amx)).abs() < 0.01, "{sets:?}: {simd} against AMX's {on_amx}");
        }
        let (portable, portable_ck) = train("portable", &ck(&format!("ck-portable-{m}")), sets);
        portable_cks.push(portable_ck.clone());
        if sets.contains(&"model.precision=\"bf16\"") && !native_bf16 {
            let auc = |j: &serde_json::Value| j["test_auc"].as_f64().expect("auc");
            assert!((auc(&simd) - auc(&portable)).abs() < 0.01, "{sets:?}: {simd} against {portable}");
            continue;
        }
        for key in ["test_auc", "test_logloss", "train_logloss"] {
            assert_eq!(simd[key].as_f64(), portable[key].as_f64(), "{sets:?}: {key}");
        }
        for file in ["embeddings.bin", "dense.safetensors"] {
            let (a, b) = (std::fs::read(simd_ck.join(file)), std::fs::read(portable_ck.join(file)));
            assert!(
                a.expect(file) == b.expect(file),
                "{sets:?}: {file} differs between the SIMD and the portable kernels"
            );
        }
    }
    // The config key is the same switch: `train.simd = "portable"` with the
    // environment saying `auto` trains the portable run's model.
    let portable_key = [modes[1], &["train.simd=\"portable\""]].concat();
    let (_, by_key_ck) = train("auto", &ck("ck-portable-by-key"), &portable_key);
    for file in ["embeddings.bin", "dense.safetensors"] {
        let (a, b) = (std::fs::read(by_key_ck.join(file)), std::fs::read(portable_cks[1].join(file)));
        assert!(a.expect(file) == b.expect(file), "{file}: train.simd = \"portable\" is not SPARROW_SIMD=portable");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_sparrow"))
        .env("SPARROW_SIMD", "avx9000")
        .args(["train", "--config", &config])
        .output()
        .expect("run sparrow");
    fails_with(&out, &["SPARROW_SIMD=avx9000", "portable"]);
}

/// `model.precision = "bf16"` on LR or FM (no matrix products) trains in f32
/// as it must, and says so instead of passing silently.
#[test]
fn bf16_on_a_kind_without_matrix_products_is_named() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data").display().to_string();
    ok(&sparrow(&["gen", "--out", &data, "--train-rows", "3000", "--test-rows", "500", "--seed", "5"]));
    let config = write_config(tmp.path(), "job.toml", "");
    for kind in ["lr", "fm"] {
        let kind_set = format!("model.kind=\"{kind}\"");
        let out = sparrow(&["train", "--config", &config, "--set", &kind_set, "--set", "model.precision=\"bf16\""]);
        ok(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("no effect on model.kind = \"{kind}\"")), "{kind}: {err}");
        let f32_run = sparrow(&["train", "--config", &config, "--set", &kind_set]);
        ok(&f32_run);
        assert_eq!(last_json(&out)["test_auc"], last_json(&f32_run)["test_auc"], "{kind}: the same model as f32");
    }
}

/// The kinds table states each kind's dense step against both floors: the
/// flops (beside the fp32 ceiling) and the bytes it must move — the input
/// row read and its gradient written, 8 bytes a float (LR: 26 fields of
/// width 1 and 13 dense values; FM: width 17) — beside a copy of a batch's
/// size measured in the same run.
#[test]
fn the_kinds_table_reports_the_bytes_floor_beside_the_flops() {
    let report = kinds_table("lr,fm");
    let kinds = report["kinds"].as_array().expect("kinds");
    let bytes: Vec<(&str, f64)> = kinds
        .iter()
        .map(|k| (k["kind"].as_str().expect("kind"), k["bytes_per_sample"].as_f64().expect("bytes")))
        .collect();
    assert_eq!(bytes, [("lr", 8.0 * 39.0), ("fm", 8.0 * (26.0 * 17.0 + 13.0))]);
    for k in kinds {
        let field = |name: &str| k[name].as_f64().unwrap_or_else(|| panic!("{name} in {k}"));
        let copy = field("copy_gbytes_per_sec");
        assert!(copy.is_finite() && copy > 0.0, "{k}");
        let share = field("dense_gbytes_per_sec") / copy;
        assert!((field("share_of_copy_bandwidth") - share).abs() <= 1e-9 * share.max(1.0), "{k}");
        assert!(field("best_round_share_of_copy_bandwidth") >= field("share_of_copy_bandwidth") * 0.999, "{k}");
        // The roofline: the flops the bytes allow at copy speed, over the ceiling.
        let ceiling = field("dense_gflops") / field("share_of_ceiling");
        let allowed = (field("flops_per_sample") * copy / field("bytes_per_sample") / ceiling).min(1.0);
        let got = field("share_of_ceiling_bytes_allow");
        assert!((got - allowed).abs() <= 1e-9 * allowed.max(1e-3), "{k}: {got} vs {allowed}");
        // At most the ceiling; below it where the copy bandwidth cannot
        // feed the flops (LR and FM on most CPUs, though not always on an
        // AVX2-only one, whose ceiling is low beside its cache bandwidth).
        assert!(got <= 1.0, "{k}: {got}");
    }
}

/// `sparrow bench`'s kinds table alone for `kinds`, five steps each, on a
/// small embedding table: the report.
fn kinds_table(kinds: &str) -> serde_json::Value {
    let out = sparrow(&[
        "bench",
        "--dims",
        "8",
        "--table-rows",
        "1000",
        "--batches",
        "1",
        "--optimizers",
        "sgd",
        "--dtypes",
        "f32",
        "--train-steps",
        "0",
        "--memory-rows",
        "0",
        "--kind-steps",
        "5",
        "--kinds",
        kinds,
    ]);
    ok(&out);
    last_json(&out)
}

/// A bf16 row of the kinds table also reads against the AVX-512-BF16
/// ceiling where the run measured it (on an AMX CPU `share_of_ceiling`
/// divides by AMX's), and an f32 row has no such share.
#[test]
fn a_bf16_kind_reads_against_the_bf16_dot_ceiling_too() {
    let report = kinds_table("esmm");
    let dot = report["arithmetic"]["peaks"]["bf16_dot"]["gflops"].as_f64();
    let kinds = report["kinds"].as_array().expect("kinds");
    let precisions: Vec<&str> = kinds.iter().map(|k| k["precision"].as_str().expect("precision")).collect();
    assert_eq!(precisions, ["f32", "bf16"], "{report}");
    for k in kinds {
        let share = &k["share_of_bf16_dot_ceiling"];
        match (k["precision"].as_str(), dot) {
            (Some("bf16"), Some(dot)) => {
                let want = k["dense_gflops"].as_f64().expect("dense_gflops") / dot;
                let got = share.as_f64().unwrap_or_else(|| panic!("share_of_bf16_dot_ceiling in {k}"));
                assert!((got - want).abs() <= 1e-9 * want, "{k}: {got} vs {want}");
            }
            _ => assert!(share.is_null(), "{k}"),
        }
    }
}

/// `sparrow config --defaults` prints every key with its default, as TOML a
/// job reads back unchanged; `--config F --set k=v` prints F as the job
/// reads it; a wrong key is refused naming it, and neither flag is an error.
#[test]
fn config_prints_the_defaults_and_a_config_as_a_job_reads_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let run = |args: &[&str]| sparrow(&[&["config"], args].concat());
    let defaults = run(&["--defaults"]);
    assert!(defaults.status.success(), "{}", String::from_utf8_lossy(&defaults.stderr));
    let text = String::from_utf8(defaults.stdout).expect("utf-8");
    assert!(text.contains("[model]\nkind = \"dlrm\"") && text.contains("attention_hidden = [36]"), "{text}");
    let path = tmp.path().join("defaults.toml");
    std::fs::write(&path, &text).expect("write");
    let again = run(&["--config", &path.display().to_string()]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    let body = |t: &str| t.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n");
    assert_eq!(body(&String::from_utf8_lossy(&again.stdout)), body(&text), "the defaults read back unchanged");
    let behaviour = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/behaviour-tasks.toml");
    let shown = run(&["--config", behaviour, "--set", "train.epochs=3"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("epochs = 3") && shown.contains("name = \"ad_type\"") && shown.contains("seed ="),
        "{shown}"
    );
    std::fs::write(&path, "[model]\nkinds = \"mlp\"\n").expect("write");
    let wrong = run(&["--config", &path.display().to_string()]);
    assert!(!wrong.status.success() && String::from_utf8_lossy(&wrong.stderr).contains("kinds"));
    assert!(!run(&[]).status.success(), "neither --defaults nor --config");
}
