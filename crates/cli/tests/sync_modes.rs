//! `cluster.sync`: the round queue with local updates (S2) beside the
//! every-step sum (S0.6), as real processes on loopback.

mod common;

use common::{generate, last_json, sparrow, train_json, write_config};

fn launch(config: &str, workers: &str, sets: &[&str], failpoints: Option<&str>) -> serde_json::Value {
    let mut command = sparrow();
    command.args(["launch", "--config", config, "--shards", "2", "--workers", workers, "--quiet"]);
    for set in sets {
        command.args(["--set", set]);
    }
    if let Some(f) = failpoints {
        command.env("FAILPOINTS", f);
    }
    let out = command.output().expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

#[test]
fn a_round_of_one_worker_is_sequential_training_and_workers_of_unequal_speed_share_rounds_by_speed() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    let single = train_json(&config);

    // One worker: its replica is the round's merge, bit for bit `train`, by either rule.
    for rule in ["mean", "sum"] {
        let merge = format!("cluster.round_merge={rule:?}");
        let one = launch(&config, "1", &["cluster.sync=\"round\"", &merge], None);
        assert_eq!(one["sync"], "round");
        assert_eq!(one["test_auc"], single["test_auc"], "one worker in rounds ({rule}) vs train");
        assert_eq!(one["train_rows"], 12000);
        // 12000 rows in batches of 256: 47 items, 4 per round.
        assert_eq!(one["rounds"], 12, "{one}");
    }

    // Two workers, the second slowed by a failpoint (200 ms after each step,
    // several of a debug build's steps even on a loaded machine: at 20 ms,
    // 2 runs of 6 beside two busy loops had the slow one take more): the
    // fast one takes more of every round, each takes at least one, the
    // replicas end identical and every sample is trained once.
    let two = launch(&config, "2", &["cluster.sync=\"round\""], Some("worker.1.step=sleep(200)"));
    assert_eq!(two["replicas_identical"], true, "{}", two["dense_checksums"]);
    assert_eq!(two["train_rows"], 12000);
    let items: Vec<f64> = two["items_per_round"].as_array().expect("items").iter().filter_map(|v| v.as_f64()).collect();
    let rounds = two["rounds"].as_f64().expect("rounds");
    assert_eq!(items.len(), 2);
    assert!(items[1] >= 1.0 && items[0] > items[1], "items per round by worker: {items:?}");
    assert!((items.iter().sum::<f64>() * rounds - 47.0).abs() < 1e-9, "every item once: {items:?} × {rounds}");
    assert!(two["test_auc"].as_f64().expect("auc") > 0.55, "learned: {}", two["test_auc"]);
    // One update and one merge per worker per round, against a sum every step.
    let step = launch(&config, "2", &[], None);
    let (round_bytes, step_bytes) = (
        two["dense_sync_bytes_per_sample"].as_f64().expect("bytes"),
        step["dense_sync_bytes_per_sample"].as_f64().expect("bytes"),
    );
    assert!(round_bytes > 0.0 && round_bytes < step_bytes / 2.0, "round {round_bytes} vs step {step_bytes}");
}

#[test]
fn bad_sync_settings_are_refused_naming_the_key() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "1000");
    for (set, key) in [
        ("cluster.sync=\"rounds\"", "sync"),
        ("cluster.round_iterations=0", "cluster.round_iterations"),
        ("cluster.round_merge=\"median\"", "round_merge"),
        ("cluster.lazy.send=\"all\"", "send"),
        ("cluster.lazy.combine=\"xor\"", "combine"),
        ("cluster.lazy.max_net_utilisation=0", "cluster.lazy.max_net_utilisation"),
    ] {
        let config = write_config(tmp.path(), "");
        let out = sparrow()
            .args(["launch", "--config", &config, "--shards", "1", "--workers", "1", "--set", set])
            .output()
            .expect("launch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} was accepted");
        assert!(stderr.contains(key), "{set}: the error names `{key}`: {stderr}");
    }
}

#[test]
fn lazy_aggregation_ends_with_one_model_on_every_worker_with_one_or_two_aggregators() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    for (aggregators, send) in [("1", "delta"), ("2", "delta"), ("1", "round_gradient")] {
        let send = format!("cluster.lazy.send={send:?}");
        let mut command = sparrow();
        command.args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet"]);
        command.args(["--aggregators", aggregators, "--set", "cluster.sync=\"lazy\"", "--set", &send]);
        let out = command.output().expect("launch");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lazy = last_json(&out);
        assert_eq!(lazy["sync"], "lazy");
        assert_eq!(lazy["aggregators"].as_u64(), aggregators.parse().ok());
        assert_eq!(lazy["replicas_identical"], true, "{}", lazy["dense_checksums"]);
        assert_eq!(lazy["train_rows"], 12000, "every sample once");
        // Every local iteration was aggregated, at most max_local_iterations (3) per worker each time.
        assert_eq!(lazy["local_iterations"], 47, "{lazy}");
        let aggregations = lazy["aggregations"].as_u64().expect("aggregations");
        assert!((47u64.div_ceil(6)..=47).contains(&aggregations), "{aggregations} aggregations");
        assert!(lazy["dense_sync_bytes_per_sample"].as_f64().expect("bytes") > 0.0);
    }
}

#[test]
fn an_aggregator_mapping_must_name_every_worker_and_only_aggregators_that_exist() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "1000");
    let config = write_config(tmp.path(), "");
    for (mapping, aggregators, says) in
        [("[0]", "1", "names 1 workers, the job has 2"), ("[0, 2]", "2", "worker 1 goes to aggregator 2")]
    {
        let set = format!("cluster.lazy.aggregator_of={mapping}");
        let out = sparrow()
            .args(["launch", "--config", &config, "--shards", "1", "--workers", "2", "--quiet"])
            .args(["--aggregators", aggregators, "--set", "cluster.sync=\"lazy\"", "--set", &set])
            .output()
            .expect("launch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mapping} was accepted");
        assert!(stderr.contains("cluster.lazy.aggregator_of") && stderr.contains(says), "{mapping}: {stderr}");
    }
}

#[test]
fn lazy_aggregation_backs_up_changed_weights_as_serving_exports() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    let ckpt = tmp.path().join("ckpt");
    let dir = format!("checkpoint.dir={:?}", ckpt.display().to_string());
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet"])
        .args(["--set", "cluster.sync=\"lazy\"", "--set", &dir])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lazy = last_json(&out);
    let backups = lazy["backups"].as_u64().expect("backups");
    let exports = ckpt.join("exports");
    let written =
        std::fs::read_dir(&exports).expect("exports").filter(|e| e.as_ref().is_ok_and(|e| e.path().is_dir())).count();
    // The first aggregation is always backed up; later ones when the weights moved 5%.
    // (On failure: the job's report and log, to tell a restarted job from a lost backup.)
    assert!(
        backups >= 1 && written as u64 == backups,
        "{backups} backups, {written} export directories\nreport: {lazy}\nlog:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let latest = std::fs::read_to_string(exports.join("LATEST")).expect("LATEST");
    assert!(exports.join(latest.trim()).join("manifest.json").is_file());

    let test = tmp.path().join("data/test.tsv");
    let predictions = tmp.path().join("p.txt");
    let served = sparrow()
        .args(["predict", "--model"])
        .arg(&exports)
        .arg("--data")
        .arg(&test)
        .arg("--out")
        .arg(&predictions)
        .output()
        .expect("predict");
    assert!(served.status.success(), "{}", String::from_utf8_lossy(&served.stderr));
    let served = last_json(&served);
    assert_eq!(served["rows"], 3000);
    assert_eq!(std::fs::read_to_string(&predictions).expect("read").lines().count(), 3000);
}

/// Rounds take part in the recovery of issue 13: checkpoints at round ends
/// (`every_steps` counts the job's batches), a shard killed mid-way, and the
/// job ends with the model of the uninterrupted run.
#[test]
fn a_round_job_whose_shard_dies_ends_with_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    let run = |name: &str, failpoints: Option<&str>| {
        let dir = format!("checkpoint.dir={:?}", tmp.path().join(name).display().to_string());
        let sets = ["cluster.sync=\"round\"", "checkpoint.every_steps=10", &dir];
        let mut command = sparrow();
        command.args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet"]);
        for set in sets {
            command.args(["--set", set]);
        }
        if let Some(f) = failpoints {
            command.env("FAILPOINTS", f);
        }
        let out = command.output().expect("launch");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let whole = run("whole", None);
    let broken = run("broken", Some("shard.push=30*off->return"));
    assert!(broken["restarts"]["shard"].as_u64().is_some_and(|n| n >= 1), "{}", broken["restarts"]);
    assert!(broken["checkpoints_committed"].as_u64().is_some_and(|n| n >= 3), "{broken}");
    assert_eq!(broken["test_auc"], whole["test_auc"], "the recovered round job");
}

/// S4.6 after a failure: each backup is committed as a checkpoint while the
/// aggregation's workers wait (a cut), so a lazy job whose worker dies goes
/// back to its latest backup, not to its start: it replays fewer steps than
/// the same job without backups.
#[test]
fn a_lazy_job_whose_worker_dies_resumes_from_its_latest_backup() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let config = write_config(tmp.path(), "");
    let run = |checkpoints: bool| {
        let mut command = sparrow();
        command.args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet"]);
        command.args(["--set", "cluster.sync=\"lazy\""]).env("FAILPOINTS", "worker.1.step=25*off->return");
        if checkpoints {
            command.args(["--set", &format!("checkpoint.dir={:?}", tmp.path().join("ckpt").display().to_string())]);
        }
        let out = command.output().expect("launch");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json = last_json(&out);
        assert_eq!(json["restarts"]["worker"], 1, "{}", json["restarts"]);
        assert_eq!(json["replicas_identical"], true);
        json
    };
    let from_start = run(false);
    let from_backup = run(true);
    let steps: Vec<u64> =
        from_backup["checkpoints"].as_array().expect("checkpoints").iter().filter_map(|c| c["step"].as_u64()).collect();
    assert!(steps.len() >= 2 && steps.last() == Some(&79), "backups, then the end: {steps:?}");
    let (without, with) = (from_start["steps_replayed"].as_u64(), from_backup["steps_replayed"].as_u64());
    assert!(without.is_some_and(|w| w >= 25), "without backups the job replays from its start: {without:?}");
    assert!(with < without, "replayed {with:?} from the latest backup vs {without:?} from the start ({steps:?})");
}

/// Aggregators are processes of their own: both die while summing their
/// workers' contributions (a failpoint before the partial sum goes out);
/// launch restarts them, the job goes back to its latest backup and ends
/// with every sample trained and one model on every worker.
#[test]
fn lazy_aggregator_processes_that_die_mid_aggregation_are_restarted_and_the_job_ends() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    let dir = format!("checkpoint.dir={:?}", tmp.path().join("ckpt").display().to_string());
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--aggregators", "2"])
        .args(["--set", "cluster.sync=\"lazy\"", "--set", &dir])
        .env("FAILPOINTS", "aggregator.partial=2*off->return")
        .output()
        .expect("launch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("aggregator 0 registered") && stderr.contains("aggregator 1 registered"), "{stderr}");
    assert!(stderr.contains("failpoint aggregator.partial"), "an aggregator process died: {stderr}");
    let json = last_json(&out);
    let restarts = json["restarts"]["aggregator"].as_u64().expect("aggregator restarts");
    assert!(restarts >= 1, "{}", json["restarts"]);
    assert_eq!(json["aggregators"], 2);
    assert_eq!(json["replicas_identical"], true, "{}", json["dense_checksums"]);
    assert_eq!(json["train_rows"], 12000, "every sample trained");
    let backups = json["backups"].as_u64().expect("backups");
    assert!(backups >= 1, "{json}");
    // The restart went back to a backup, not to the job's start.
    let replayed = json["steps_replayed"].as_u64().expect("replayed");
    assert!(replayed < 47, "replayed {replayed} of 47 steps");
}

/// A 2×2 job under step and round sync writes `train`'s kinds of lines
/// into `train.metrics_path` (one file, each line tagged with its worker;
/// `eval` lines every `train.eval_every_steps` and at the end, the last with
/// the final JSON's AUC) and each worker's scalars into
/// `train.tensorboard_dir/worker-<i>/`. The periodic evaluations leave the
/// model as it is (a 2×1 job, deterministic, with and without them).
#[test]
fn a_cluster_job_writes_metrics_lines_and_tensorboard_events_per_worker() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "12000");
    let config = write_config(tmp.path(), "");
    for sync in ["step", "round"] {
        let (metrics, board) =
            (tmp.path().join(format!("{sync}/metrics.jsonl")), tmp.path().join(format!("{sync}/tb")));
        // A line from before: a job that does not resume starts the file anew.
        std::fs::create_dir_all(metrics.parent().expect("dir")).expect("dir");
        std::fs::write(&metrics, "{\"stale\": true}\n").expect("stale");
        let sets = [
            format!("cluster.sync={sync:?}"),
            format!("train.metrics_path={:?}", metrics.display().to_string()),
            format!("train.tensorboard_dir={:?}", board.display().to_string()),
            "train.log_interval_steps=3".to_string(),
            "train.eval_every_steps=10".to_string(),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let out = launch(&config, "2", &sets, None);
        let text = std::fs::read_to_string(&metrics).expect("metrics");
        let lines: Vec<serde_json::Value> =
            text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{sync}: {l}: {e}"))).collect();
        assert!(lines.iter().all(|l| l["stale"].is_null()), "{sync}: the old line was kept");
        for worker in [0, 1] {
            let mine: Vec<&serde_json::Value> =
                lines.iter().filter(|l| l["worker"] == worker && l["event"].is_null()).collect();
            assert!(mine.len() >= 2, "{sync}: worker {worker}'s training lines: {text}");
            for l in &mine {
                assert!(l["train_logloss"].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{l}");
                assert!(l["samples_per_sec"].as_f64().is_some_and(|x| x > 0.0), "{l}");
                assert!(l["phase_secs"]["dense"].as_f64().is_some_and(|x| x > 0.0), "{l}");
                assert!(l["step"].as_u64().is_some() && l["samples"].as_u64().is_some(), "{l}");
            }
            let samples: Vec<u64> = mine.iter().map(|l| l["samples"].as_u64().expect("samples")).collect();
            assert!(samples.windows(2).all(|w| w[0] < w[1]), "{sync}: worker {worker}'s samples grow: {samples:?}");
        }
        let evals: Vec<&serde_json::Value> = lines.iter().filter(|l| l["event"] == "eval").collect();
        let steps: Vec<u64> = evals.iter().map(|l| l["step"].as_u64().expect("step")).collect();
        // An evaluation as the job's step passes each multiple of 10 (after a
        // trained step, an idle one or a round's merge), and the last.
        let last_step = *steps.last().expect("the last evaluation");
        let periodic = &steps[..steps.len() - 1];
        assert!(last_step >= 10 && periodic.len() as u64 == last_step / 10, "{sync}: {steps:?}");
        assert!(periodic.iter().enumerate().all(|(i, &s)| s / 10 == i as u64 + 1), "{sync}: {steps:?}");
        assert!(evals.iter().all(|l| l["worker"] == 0 && l["test_rows"] == out["test_rows"]), "{sync}: {text}");
        let last = evals.last().expect("the last evaluation");
        assert_eq!(last["test_auc"], out["test_auc"], "{sync}");
        // Each is the model of its step: figures, and not the last one's.
        let aucs: Vec<f64> = evals.iter().map(|l| l["test_auc"].as_f64().expect("auc")).collect();
        assert!(aucs.iter().all(|a| *a > 0.0 && *a < 1.0) && aucs[0] != aucs[aucs.len() - 1], "{sync}: {aucs:?}");

        for worker in [0, 1] {
            let dir = board.join(format!("worker-{worker}"));
            let files: Vec<_> = std::fs::read_dir(&dir).expect("tb").map(|e| e.expect("entry").path()).collect();
            assert_eq!(files.len(), 1, "{sync}: {}", dir.display());
            let events = sparrow_trainer::tensorboard::read_events(&files[0]).expect("events");
            let tags: Vec<String> = events
                .iter()
                .flat_map(|e| e.summary.iter().flat_map(|s| s.value.iter().map(|v| v.tag.clone())))
                .collect();
            for tag in ["train/logloss", "train/samples_per_sec", "step_ms/dense"] {
                assert!(tags.iter().any(|t| t == tag), "{sync}: worker {worker}: {tag} missing");
            }
            let auc = tags.iter().filter(|t| *t == "test/auc").count();
            assert_eq!(auc, if worker == 0 { steps.len() } else { 0 }, "{sync}: the evaluating worker's test/auc");
        }
    }
    let sets = ["train.eval_every_steps=7"];
    let (plain, evaluated) = (launch_2x1(&config, &[]), launch_2x1(&config, &sets));
    assert_eq!(plain["dense_checksums"], evaluated["dense_checksums"], "the model with and without evaluations");
    assert_eq!(plain["test_auc"], evaluated["test_auc"]);
}

fn launch_2x1(config: &str, sets: &[&str]) -> serde_json::Value {
    let mut command = sparrow();
    command.args(["launch", "--config", config, "--shards", "2", "--workers", "1", "--quiet"]);
    for set in sets {
        command.args(["--set", set]);
    }
    let out = command.output().expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}
