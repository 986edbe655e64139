//! `data.validation` and `[train.early_stopping]` in a cluster job
//! (`crates/cluster/src/epochs.rs`): `launch` validates at each epoch's end
//! (and every `train.eval_every_steps`) with the model `sparrow train`
//! validates, judges as it does, keeps the same `best`, stops at the same
//! step and scores `data.test` with the same model; a worker that dies
//! around a validation point's checkpoint changes none of it, nor does a
//! stop right at an epoch's end; several workers in every sync mode (and
//! collocated nodes) validate too; and what a cluster cannot do is refused
//! naming the keys.

mod common;

use common::{Log, generate, last_json, signal, sparrow, write_config};
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// Six epochs at a rate that overfits, a quarter of the rows held out,
/// patience 1: the validation AUC peaks early and the job stops.
const VALIDATING: &str = "[train.early_stopping]\npatience = 1";

fn job(dir: &Path) -> String {
    generate(dir, "6000");
    let config = write_config(dir, VALIDATING);
    let text = std::fs::read_to_string(&config).expect("config");
    let text = text
        .replace("[train]\n", "[train]\nepochs = 6\n")
        .replace("learning_rate = 0.05", "learning_rate = 0.3")
        .replace("[model]", "validation = 0.25\n[model]");
    std::fs::write(&config, text).expect("write config");
    config
}

fn run(command: &str, config: &str, dir: &Path, name: &str, args: &[&str], failpoints: &str) -> Value {
    let mut cmd = sparrow();
    cmd.args([command, "--config", config, "--quiet"]).args(args);
    let ckpt = format!("checkpoint.dir={:?}", dir.join(name).display().to_string());
    let metrics = format!("train.metrics_path={:?}", dir.join(format!("{name}.jsonl")).display().to_string());
    cmd.args(["--set", &ckpt, "--set", &metrics]);
    if !failpoints.is_empty() {
        cmd.env("FAILPOINTS", failpoints);
    }
    let out = cmd.output().expect("run");
    assert!(out.status.success(), "{command} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// `(epoch, step, validation_auc)` of each `validation` line.
fn validations(dir: &Path, name: &str) -> Vec<(u64, u64, f64)> {
    let text = std::fs::read_to_string(dir.join(format!("{name}.jsonl"))).expect("metrics");
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a json line"))
        .filter(|v| v["event"] == "validation")
        .map(|v| {
            (
                v["epoch"].as_u64().unwrap_or(99),
                v["step"].as_u64().unwrap_or(0),
                v["validation_auc"].as_f64().unwrap_or(0.0),
            )
        })
        .collect()
}

/// `(step, test_auc)` of each `eval` line: `data.test` is scored once, at
/// the job's end, not at each validation point.
fn evaluations(dir: &Path, name: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join(format!("{name}.jsonl"))).expect("metrics");
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a json line"))
        .filter(|v| v["event"] == "eval")
        .map(|v| (v["step"].as_u64().unwrap_or(0), v["test_auc"].as_f64().unwrap_or(0.0)))
        .collect()
}

const REPORTED: [&str; 10] = [
    "test_auc",
    "validation_auc",
    "validation_tasks",
    "validation_rows",
    "best_step",
    "best_epoch",
    "best_validation",
    "stopped_early",
    "test_model",
    "train_rows",
];

#[test]
fn launch_validates_judges_and_stops_as_train_does_through_a_death() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = job(tmp.path());
    let train = run("train", &config, tmp.path(), "train", &[], "");
    let cluster = ["--shards", "2", "--workers", "1"];
    let launch = run("launch", &config, tmp.path(), "launch", &cluster, "");
    assert_eq!(train["stopped_early"], true, "the job was meant to stop early: {train}");
    assert!(train["best_epoch"].as_u64().is_some_and(|e| e + 1 < 6), "{train}");
    assert_eq!(train["test_model"], "best");
    let tasks = train["validation_tasks"].as_object().expect("validation_tasks");
    assert_eq!(tasks.values().map(|t| &t["auc"]).collect::<Vec<_>>(), [&train["validation_auc"]], "{train}");
    for key in REPORTED {
        assert_eq!(launch[key], train[key], "`{key}`: launch vs train");
    }
    // A periodic checkpoint at an epoch's last step (18 steps an epoch)
    // comes before its judgement: the epoch's own checkpoint still follows.
    let every = ["--shards", "1", "--workers", "1", "--set", "checkpoint.every_steps=6"];
    let periodic = run("launch", &config, tmp.path(), "periodic", &every, "");
    for key in REPORTED {
        assert_eq!(periodic[key], train[key], "`{key}`: with periodic checkpoints vs train");
    }
    // And when the worker dies between the two (its fourth checkpoint
    // call, the first epoch's own): restored at that epoch's end, not yet
    // judged, the job validates it before the next epoch.
    let after_periodic = run("launch", &config, tmp.path(), "after", &every, "worker.checkpoint=3*off->return");
    assert_eq!(after_periodic["restarts"]["worker"], 1, "{after_periodic}");
    for key in REPORTED {
        assert_eq!(after_periodic[key], train[key], "`{key}`: a death after a periodic checkpoint vs train");
    }
    let each = validations(tmp.path(), "train");
    assert!(each.len() >= 2, "{each:?}");
    assert_eq!(validations(tmp.path(), "launch"), each, "the same validation at each epoch's end");
    let scored = evaluations(tmp.path(), "train");
    assert_eq!(scored.len(), 1, "{scored:?}");
    assert_eq!(evaluations(tmp.path(), "launch"), scored, "the test set scored once, at the end");
    let mut after = validations(tmp.path(), "after");
    after.dedup_by_key(|l| l.1);
    assert_eq!(after, each, "each epoch validated, the first again after the restore, alike");
    // The best model is kept, in train's format: it scores the test AUC reported.
    let best = launch["best_checkpoint"].as_str().expect("best");
    assert_eq!(Path::new(best), tmp.path().join("launch/best"));
    let test = tmp.path().join("data/test.tsv").display().to_string();
    let eval = sparrow().args(["eval", "--checkpoint", best, "--data", &test]).output().expect("eval");
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    assert_eq!(last_json(&eval)["auc"], launch["test_auc"]);

    // The worker dies at its second checkpoint (the second epoch's, its
    // judgement made and not yet committed): restarted from the first
    // epoch's, it trains and judges the second again, once.
    let died = run("launch", &config, tmp.path(), "died", &cluster, "worker.checkpoint=1*off->return");
    assert_eq!(died["restarts"]["worker"], 1, "{died}");
    for key in REPORTED {
        assert_eq!(died[key], train[key], "`{key}`: after a death vs train");
    }
    let lines = validations(tmp.path(), "died");
    let mut once = lines.clone();
    once.dedup_by_key(|l| l.1);
    assert_eq!(once, each, "each epoch's validation, the replayed one scored alike: {lines:?}");

    // Cut by train.max_steps past the first epoch's end (18 steps): the last
    // generation validates nothing, and the report is still the last
    // validation's, as train's (it was the model at the cut, scored anew).
    let cut = "train.max_steps=23";
    let train_cut = run("train", &config, tmp.path(), "train-cut", &["--set", cut], "");
    let launch_cut =
        run("launch", &config, tmp.path(), "launch-cut", &["--shards", "1", "--workers", "1", "--set", cut], "");
    assert_eq!(validations(tmp.path(), "train-cut").len(), 1, "{train_cut}");
    for key in REPORTED {
        assert_eq!(launch_cut[key], train_cut[key], "`{key}`: cut by train.max_steps, launch vs train");
    }
}

/// A stop (SIGTERM to `launch`) as the next epoch's generation starts:
/// the job ends with 143 and its checkpoint; resumed, it judges and stops
/// as `train` does. (By hand, before the coordinator's rule that only a
/// generation that committed starts the next epoch, such a stop restarted
/// that epoch again and again, each generation told to end at once; this
/// test does not always land in that window.)
#[test]
fn a_stop_at_an_epochs_end_ends_the_job_and_a_resume_judges_as_train() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = job(tmp.path());
    let train = run("train", &config, tmp.path(), "train", &[], "");
    let ckpt = tmp.path().join("stopped").display().to_string();
    let mut child = sparrow()
        .args(["launch", "--config", &config, "--shards", "1", "--workers", "1"])
        .args(["--set", &format!("checkpoint.dir={ckpt:?}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("launch");
    let log = Log::default();
    let reader = log.collect(child.stderr.take().expect("stderr"));
    log.wait_for_line(&["epoch 0 validated; epoch 1 starts"], Duration::from_secs(60));
    signal(child.id(), "-TERM");
    // A hang is the bug: its error line never comes.
    log.wait_for_line(&["stopped by a signal"], Duration::from_secs(60));
    let status = child.wait().expect("wait");
    reader.join().expect("stderr reader");
    assert_eq!(status.code(), Some(143), "{}", log.text());
    let resume = format!("checkpoint.resume_from={ckpt:?}");
    let resumed =
        run("launch", &config, tmp.path(), "stopped", &["--shards", "1", "--workers", "1", "--set", &resume], "");
    for key in REPORTED.iter().filter(|k| **k != "train_rows") {
        assert_eq!(resumed[*key], train[*key], "`{key}`: stopped and resumed vs train");
    }
}

/// `train.eval_every_steps` beside `data.validation`: each stretch of that
/// many steps is a generation, validated at its end as `train` validates
/// inside an epoch (18 steps an epoch here, validated at 5, 10, 15, 18,
/// 20, ...); one worker judges, stops and keeps the best as `train` does,
/// also when it dies at a stretch's checkpoint; two workers validate at
/// the same points.
#[test]
fn eval_every_steps_validates_inside_epochs_as_train_does() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = job(tmp.path());
    let text = std::fs::read_to_string(&config).expect("config").replace("patience = 1", "patience = 3");
    std::fs::write(&config, text.replace("[train]\n", "[train]\neval_every_steps = 5\n")).expect("write config");
    let train = run("train", &config, tmp.path(), "train", &[], "");
    let each = validations(tmp.path(), "train");
    let steps: Vec<u64> = each.iter().map(|v| v.1).collect();
    assert!(steps.starts_with(&[5, 10, 15, 18, 20]), "train validates every 5 steps and at epochs' ends: {steps:?}");
    assert_eq!(train["stopped_early"], true, "{train}");
    let cluster = ["--shards", "2", "--workers", "1"];
    let launch = run("launch", &config, tmp.path(), "launch", &cluster, "");
    for key in REPORTED {
        assert_eq!(launch[key], train[key], "`{key}`: launch vs train");
    }
    // The stretches' generations were planned: no role died, nothing recovered.
    assert_eq!(launch["recovery_secs"], 0.0, "{launch}");
    assert_eq!(validations(tmp.path(), "launch"), each, "the same validations at the same steps");
    let scored = evaluations(tmp.path(), "train");
    assert_eq!(scored.len(), 1, "{scored:?}");
    assert_eq!(evaluations(tmp.path(), "launch"), scored, "the test set scored once, at the end");
    // Dead at its third checkpoint (step 15's, judged, not committed):
    // restored at step 10, it trains and judges 11..15 again, alike.
    let died = run("launch", &config, tmp.path(), "died", &cluster, "worker.checkpoint=2*off->return");
    assert_eq!(died["restarts"]["worker"], 1, "{died}");
    assert!(died["recovery_secs"].as_f64().is_some_and(|s| s > 0.0), "{died}");
    for key in REPORTED {
        assert_eq!(died[key], train[key], "`{key}`: after a death vs train");
    }
    let mut once = validations(tmp.path(), "died");
    once.dedup_by_key(|l| l.1);
    assert_eq!(once, each, "each point validated, the replayed one alike");
    // Two workers under lazy sync, where a job step is a batch: the same
    // points, a multiple of 5 or an epoch's end. (Under step sync a step
    // takes a batch from each worker, more from a faster one: the points
    // come about every 5 steps.)
    let two = ["--shards", "2", "--workers", "2", "--set", "cluster.sync=\"lazy\""];
    let two = run("launch", &config, tmp.path(), "two", &two, "");
    let at: Vec<u64> = validations(tmp.path(), "two").iter().map(|v| v.1).collect();
    assert!(at.starts_with(&[5, 10, 15, 18, 20]) && at.iter().all(|s| s % 5 == 0 || s % 18 == 0), "{at:?}");
    assert!(tmp.path().join("two/best/LATEST").exists() && two["best_step"].is_u64(), "{two}");
}

#[test]
fn several_workers_validate_in_every_sync_mode() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = job(tmp.path());
    let held = 6000 - run("train", &config, tmp.path(), "train", &[], "")["validation_rows"].as_u64().expect("rows");
    let collocated = ["--nodes", "2", "--set", "cluster.mode=\"collocated\""];
    for sync in ["step", "round", "lazy", "collocated"] {
        let set = format!("cluster.sync={sync:?}");
        let workers = ["--shards", "2", "--workers", "2", "--set", &set];
        let args: &[&str] = if sync == "collocated" { &collocated } else { &workers };
        let out = run("launch", &config, tmp.path(), sync, args, "");
        let epochs = validations(tmp.path(), sync);
        assert!(!epochs.is_empty(), "{sync}: no validation");
        let at: Vec<u64> = epochs.iter().map(|e| e.0).collect();
        assert_eq!(at, (0..at.len() as u64).collect::<Vec<_>>(), "{sync}: one validation an epoch: {epochs:?}");
        assert_eq!(out["train_rows"], held * epochs.len() as u64, "{sync}: whole epochs, none past the stop");
        assert_eq!(out["validation_auc"].as_f64(), epochs.last().map(|e| e.2), "{sync}");
        let stopped = out["stopped_early"] == true;
        assert!(stopped || epochs.len() == 6, "{sync}: {out}");
        assert!(tmp.path().join(sync).join("best/LATEST").exists(), "{sync}: no best kept");
    }
}

#[test]
fn what_a_cluster_cannot_validate_is_refused_naming_the_keys() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Validation alone (early stopping also needs checkpoint.dir, in any run).
    let config = job(tmp.path());
    let text = std::fs::read_to_string(&config).expect("config").replace(VALIDATING, "");
    std::fs::write(&config, text).expect("write config");
    let refused = |sets: &[&str]| {
        let mut cmd = sparrow();
        cmd.args(["launch", "--config", &config, "--shards", "1", "--workers", "1"]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().expect("launch");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let no_dir = refused(&[]);
    assert!(no_dir.contains("data.validation") && no_dir.contains("checkpoint.dir"), "{no_dir}");
    let ckpt = format!("checkpoint.dir={:?}", tmp.path().join("c").display().to_string());
    // A validation file that is not there: named before any training.
    let missing = tmp.path().join("no-such.tsv").display().to_string();
    let file = refused(&[&ckpt, &format!("data.validation={missing:?}")]);
    assert!(file.contains("data.validation") && file.contains(&missing), "{file}");
}
