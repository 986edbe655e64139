//! Real processes on loopback (ephemeral ports): `sparrow launch` trains the
//! same model as `sparrow train`, keeps data-parallel replicas identical, and
//! leaves no process behind — after success, after a shard is killed, and
//! when a message exceeds its cap. Roles refuse unauthenticated requests and
//! report an unreachable coordinator after retrying.

mod common;

use common::{collect_lines, generate, last_json, signal, sparrow, train_json, wait_with_timeout, write_config};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The child pids `launch` reported on stderr.
fn child_pids(stderr: &str) -> Vec<u32> {
    stderr.lines().filter_map(|l| l.strip_prefix("launch: ")?.rsplit_once(" is pid ")?.1.trim().parse().ok()).collect()
}

fn assert_all_gone(pids: &[u32]) {
    assert!(!pids.is_empty(), "launch reported no children");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive: Vec<_> = pids.iter().filter(|p| Path::new(&format!("/proc/{p}")).exists()).collect();
        if alive.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "processes left behind: {alive:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn launch_trains_the_same_model_as_train_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    // Three malformed rows: both paths skip and count them.
    let train = tmp.path().join("data/train.tsv");
    let mut text = std::fs::read_to_string(&train).expect("read");
    text.push_str("not a row\n1\tx\n\n");
    std::fs::write(&train, text).expect("write");
    let config = write_config(tmp.path(), "");
    let single = train_json(&config);

    // One shard, one worker: the same arithmetic in the same order as `train`.
    let one =
        sparrow().args(["launch", "--config", &config, "--shards", "1", "--workers", "1"]).output().expect("launch");
    let stderr = String::from_utf8_lossy(&one.stderr);
    assert!(one.status.success(), "{stderr}");
    assert_all_gone(&child_pids(&stderr));
    let one = last_json(&one);
    assert_eq!(one["test_auc"], single["test_auc"], "1 shard + 1 worker vs train");
    assert_eq!(one["train_rows"], 20000);
    assert_eq!(one["embedding_rows"], single["embedding_rows"]);
    assert_eq!(one["bad_rows"], single["bad_rows"]);
    assert!(single["bad_rows"].as_u64().is_some_and(|n| n >= 2), "{}", single["bad_rows"]);
    // launch's JSON is train's plus cluster fields; the same batches give the same dedup.
    for key in single.as_object().expect("object").keys() {
        assert!(one.get(key).is_some(), "launch's JSON lacks `{key}`");
    }
    assert_eq!(one["dedup_ratio"], single["dedup_ratio"]);
    assert_eq!(one["shuffle_bytes_per_sample"], single["shuffle_bytes_per_sample"]);
    assert_eq!(one["cache_hit_rate"], serde_json::Value::Null, "no SSD tier");

    // Pulled one batch ahead (train.pipeline_depth = 1): still train's model at that depth.
    let depth_1 = ["--set", "train.pipeline_depth=1"];
    let single_1 = sparrow().args(["train", "--config", &config, "--quiet"]).args(depth_1).output().expect("train");
    assert!(single_1.status.success(), "{}", String::from_utf8_lossy(&single_1.stderr));
    let one_1 = sparrow()
        .args(["launch", "--config", &config, "--shards", "1", "--workers", "1", "--quiet"])
        .args(depth_1)
        .output()
        .expect("launch");
    assert!(one_1.status.success(), "{}", String::from_utf8_lossy(&one_1.stderr));
    let (single_1, one_1) = (last_json(&single_1), last_json(&one_1));
    assert_eq!(one_1["test_auc"], single_1["test_auc"], "depth 1: launch vs train");
    assert_ne!(one_1["test_auc"], one["test_auc"], "depth 1 trained on stale rows");

    let ckpt = tmp.path().join("ckpt");
    let ckpt_set = format!("checkpoint.dir={:?}", ckpt.display().to_string());
    let two = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet", "--set", &ckpt_set])
        .output()
        .expect("launch");
    let stderr = String::from_utf8_lossy(&two.stderr);
    assert!(two.status.success(), "{stderr}");
    assert_all_gone(&child_pids(&stderr));
    let two = last_json(&two);
    assert_eq!(two["shards"], 2);
    assert_eq!(two["workers"], 2);
    assert_eq!(two["mode"], "s0");
    assert_eq!(two["train_rows"], 20000, "every sample trained once");
    assert_eq!(two["replicas_identical"], true, "{}", two["dense_checksums"]);
    assert_eq!(two["embedding_rows"], single["embedding_rows"], "every key lives on exactly one shard");
    let auc = two["test_auc"].as_f64().expect("auc");
    assert!(auc > 0.6, "two workers learned: {auc}");
    // Workers receive dense + labels + key positions from the loader and rows from the shards.
    let bytes = &two["worker_in_bytes_per_sample"];
    assert!(bytes["loader"].as_f64().expect("loader bytes") > 0.0);
    assert!(bytes["shards"].as_f64().expect("shard bytes") > 0.0);

    // The cluster's model is saved in train's format: eval reads it and finds
    // the AUC the job reported.
    let saved = two["checkpoint"].as_str().expect("checkpoint path");
    let test = tmp.path().join("data/test.tsv").display().to_string();
    let eval = sparrow().args(["eval", "--checkpoint", saved, "--data", &test]).output().expect("eval");
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    let eval = last_json(&eval);
    assert_eq!(eval["auc"], two["test_auc"], "the checkpoint holds the evaluated model");
}

/// The training tools of issue 58 over gRPC: a warmup and cosine decay of
/// both rates (each push carries its step's factor to the shards),
/// `embedding.l2`, AdamW, dropout, batch norm and Dice (running statistics
/// through the workers' dense sync); `launch` trains `train`'s model bit
/// for bit, and without the schedule's factor on the wire it would not.
#[test]
fn a_schedule_and_the_regularizers_train_the_same_model_in_launch() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "6000");
    let config = write_config(tmp.path(), "");
    let sets = [
        "train.schedule.kind=\"cosine\"",
        "train.schedule.warmup_steps=3",
        "train.schedule.decay_steps=4",
        "train.schedule.final_factor=0.25",
        "embedding.l2=0.001",
        "dense_optimizer.kind=\"adamw\"",
        "dense_optimizer.weight_decay=0.01",
        "model.dropout=0.1",
        "model.norm=\"batch\"",
        "model.activation=\"dice\"",
    ];
    let run = |command: &str, schedule: bool| {
        let mut cmd = sparrow();
        cmd.args([command, "--config", &config, "--quiet"]);
        for set in sets.iter().filter(|s| schedule || !s.starts_with("train.schedule")) {
            cmd.args(["--set", set]);
        }
        if command == "launch" {
            cmd.args(["--shards", "2", "--workers", "1"]);
        }
        let out = cmd.output().expect("run");
        assert!(out.status.success(), "{command}: {}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let (train, launch) = (run("train", true), run("launch", true));
    assert_eq!(launch["test_auc"], train["test_auc"], "launch vs train");
    assert_ne!(run("train", false)["test_auc"], train["test_auc"], "the schedule changed nothing");
}

/// `embedding.dtype = "f16"`: shards store half rows and send half vectors
/// over gRPC; `launch` still trains `train`'s model bit for bit, its workers
/// receive fewer bytes from the shards, and its checkpoint is smaller.
#[test]
fn half_rows_train_the_same_model_in_launch_with_fewer_bytes_on_the_wire() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "6000");
    let config = write_config(tmp.path(), "");
    let run = |command: &str, dtype: &str, ckpt: &str| {
        let ckpt = format!("checkpoint.dir={:?}", tmp.path().join(ckpt).display().to_string());
        let dtype = format!("embedding.dtype=\"{dtype}\"");
        let mut cmd = sparrow();
        cmd.args([command, "--config", &config, "--quiet", "--set", &dtype, "--set", &ckpt]);
        if command == "launch" {
            cmd.args(["--shards", "2", "--workers", "1"]);
        }
        let out = cmd.output().expect("run");
        assert!(out.status.success(), "{command} {dtype}: {}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let half_train = run("train", "f16", "train-f16");
    let half_launch = run("launch", "f16", "launch-f16");
    let full_launch = run("launch", "f32", "launch-f32");
    assert_eq!(half_launch["test_auc"], half_train["test_auc"], "launch vs train in f16");
    assert_ne!(half_launch["test_auc"], full_launch["test_auc"], "f16 rows round");
    let from_shards = |j: &serde_json::Value| j["worker_in_bytes_per_sample"]["shards"].as_f64().expect("bytes");
    let ratio = from_shards(&half_launch) / from_shards(&full_launch);
    // Vectors of 8 coordinates: 16 bytes instead of 32 per pulled row.
    assert!((0.45..0.55).contains(&ratio), "pull bytes f16/f32 = {ratio}");
    let rows_bytes = |dir: &str| {
        let version = std::fs::read_to_string(tmp.path().join(dir).join("LATEST")).expect("LATEST");
        let version = tmp.path().join(dir).join(version.trim());
        std::fs::read_dir(&version)
            .expect("version")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains("embeddings"))
            .map(|e| e.metadata().expect("meta").len())
            .sum::<u64>()
    };
    // key 8 + vector 16 + Adagrad state 32 against 8 + 32 + 32 bytes a row: 0.78.
    let ratio = rows_bytes("launch-f16") as f64 / rows_bytes("launch-f32") as f64;
    assert!((0.76..0.80).contains(&ratio), "checkpoint rows f16/f32 = {ratio}");
    // The f16 checkpoint evaluates to the AUC the job reported.
    let test = tmp.path().join("data/test.tsv").display().to_string();
    let saved = half_launch["checkpoint"].as_str().expect("checkpoint");
    let eval = sparrow().args(["eval", "--checkpoint", saved, "--data", &test]).output().expect("eval");
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    assert_eq!(last_json(&eval)["auc"], half_launch["test_auc"]);
}

/// A job stopped after 30 steps on one shard resumes on three shards and
/// ends with exactly the model of an uninterrupted single-process run.
#[test]
fn a_checkpoint_resumes_in_a_cluster_with_another_shard_count() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let config = write_config(tmp.path(), "");
    let whole = sparrow().args(["train", "--config", &config, "--quiet"]).output().expect("train");
    assert!(whole.status.success(), "{}", String::from_utf8_lossy(&whole.stderr));
    let whole = last_json(&whole);

    let ckpt = format!("checkpoint.dir={:?}", tmp.path().join("ckpt").display().to_string());
    let first = sparrow()
        .args(["launch", "--config", &config, "--shards", "1", "--workers", "1", "--quiet"])
        .args(["--set", &ckpt, "--set", "train.max_steps=30"])
        .output()
        .expect("first part");
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let first = last_json(&first);
    assert_eq!(first["train_rows"], 30 * 256);

    let resume = format!("checkpoint.resume_from={:?}", tmp.path().join("ckpt").display().to_string());
    let second = sparrow()
        .args(["launch", "--config", &config, "--shards", "3", "--workers", "1", "--quiet", "--set", &resume])
        .output()
        .expect("second part");
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let second = last_json(&second);
    assert_eq!(second["train_rows"], 20000 - 30 * 256);
    assert_eq!(second["test_auc"], whole["test_auc"], "resumed on 3 shards vs uninterrupted train");
    assert_eq!(second["embedding_rows"], whole["embedding_rows"]);
}

/// A long `launch` (2 shards, 1 worker, many epochs) whose stderr is collected.
struct LoggedLaunch {
    child: Child,
    log: Arc<Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

impl LoggedLaunch {
    /// Checkpoints every 10 steps: the first commit is the event that says
    /// the job is training (the tests act then, not after a sleep).
    fn start(config: &str) -> LoggedLaunch {
        let ck = Path::new(config).with_file_name("ck").display().to_string();
        let mut child = sparrow()
            .args(["launch", "--config", config, "--shards", "2", "--workers", "1", "--set", "train.epochs=200"])
            .args(["--set", &format!("checkpoint.dir={ck:?}"), "--set", "checkpoint.every_steps=10"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("launch");
        let log = Arc::new(Mutex::new(String::new()));
        let reader = collect_lines(child.stderr.take().expect("stderr"), log.clone());
        LoggedLaunch { child, log, reader }
    }

    fn text(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Waits until the job trained its first 10 steps (their checkpoint is
    /// committed); returns shard 1's pid.
    fn wait_training(&self) -> u32 {
        let started = Instant::now();
        loop {
            let text = self.text();
            let pid = text.lines().find_map(|l| l.strip_prefix("launch: shard 1 is pid ")?.trim().parse::<u32>().ok());
            if let Some(pid) = pid
                && text.contains("checkpoint at step 10 committed")
            {
                return pid;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "never started: {text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for launch to exit (30 s at most) and for every child's stderr to close.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = wait_with_timeout(&mut self.child, Duration::from_secs(30));
        let text = {
            self.reader.join().expect("reader");
            self.log.lock().expect("log").clone()
        };
        (status, text)
    }
}

#[test]
fn a_killed_shard_without_a_restart_budget_stops_the_job_naming_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let launch = LoggedLaunch::start(&write_config(tmp.path(), "max_restarts = 0"));
    let shard_pid = launch.wait_training();
    signal(shard_pid, "-9");
    let (status, text) = launch.finish();
    assert!(!status.success(), "the job must fail: {text}");
    let last = text.lines().rev().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(last.contains("shard 1"), "the error names the dead shard: {last}\n{text}");
    assert_all_gone(&child_pids(&text));
}

#[test]
fn every_role_exits_when_the_launcher_is_killed() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let mut launch = LoggedLaunch::start(&write_config(tmp.path(), ""));
    launch.wait_training();
    launch.child.kill().expect("kill -9 the launcher");
    // finish() returns once the children's stderr pipes closed: all gone.
    let (_, text) = launch.finish();
    let pids = child_pids(&text);
    assert_eq!(pids.len(), 5, "coordinator, 2 shards, loader, worker");
    assert_all_gone(&pids);
}

/// A shard that hangs (SIGSTOP) rather than dies: its heartbeats stop, the
/// coordinator (no restart budget) fails the job within the timeout naming
/// it, nothing is left.
#[test]
fn a_hung_shard_is_reported_within_the_heartbeat_timeout() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let launch = LoggedLaunch::start(&write_config(tmp.path(), "max_restarts = 0"));
    let shard_pid = launch.wait_training();
    signal(shard_pid, "-STOP");
    let stopped = Instant::now();
    let (status, text) = launch.finish();
    let took = stopped.elapsed();
    assert!(!status.success(), "{text}");
    assert!(text.contains("shard 1 at") && text.contains("stopped answering"), "{text}");
    // heartbeat_timeout_ms = 2000, plus the coordinator's grace and launch's reaping.
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_all_gone(&child_pids(&text));
}

#[test]
fn an_oversized_message_is_refused_naming_the_cap() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "3000");
    let config = write_config(tmp.path(), "max_message_bytes = 4096");
    let out =
        sparrow().args(["launch", "--config", &config, "--shards", "1", "--workers", "1"]).output().expect("launch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let last = stderr.lines().rev().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(last.contains("too large") && last.contains("cluster.max_message_bytes"), "{last}\n{stderr}");
    assert_all_gone(&child_pids(&stderr));
}

/// Starts a coordinator and returns it with its address.
fn coordinator(config: &str, token: Option<&str>) -> (Child, String) {
    let mut cmd = sparrow();
    cmd.args(["coordinator", "--config", config, "--shards", "1", "--workers", "1", "--listen", "127.0.0.1:0"]);
    cmd.env_remove("SPARROW_AUTH_TOKEN");
    if let Some(t) = token {
        cmd.env("SPARROW_AUTH_TOKEN", t);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("coordinator");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    let addr = line.trim().strip_prefix("listening on ").expect("address line").to_string();
    (child, addr)
}

#[test]
fn roles_require_the_token_off_loopback_and_on_every_rpc_when_set() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = write_config(tmp.path(), "");
    let open = sparrow()
        .args(["coordinator", "--config", &config, "--shards", "1", "--workers", "1", "--listen", "0.0.0.0:0"])
        .env_remove("SPARROW_AUTH_TOKEN")
        .output()
        .expect("coordinator");
    assert!(!open.status.success());
    assert!(String::from_utf8_lossy(&open.stderr).contains("refusing to listen on 0.0.0.0"));

    let (mut coord, addr) = coordinator(&config, Some("s3cret"));
    let shard = |token: Option<&str>| {
        let mut cmd = sparrow();
        cmd.args(["shard", "--coordinator", &addr, "--connect-timeout-ms", "2000"]).env_remove("SPARROW_AUTH_TOKEN");
        if let Some(t) = token {
            cmd.env("SPARROW_AUTH_TOKEN", t);
        }
        cmd.output().expect("shard")
    };
    for token in [None, Some("wrong")] {
        let out = shard(token);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Unauthenticated") && err.contains("coordinator at"), "{token:?}: {err}");
    }
    let _ = coord.kill();
    let _ = coord.wait();
}

#[test]
fn an_unreachable_coordinator_is_retried_then_reported() {
    // A port nothing listens on: bind one and drop it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    let out =
        sparrow().args(["worker", "--coordinator", &addr, "--connect-timeout-ms", "1500"]).output().expect("worker");
    let waited = start.elapsed();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("coordinator at {addr}")) && err.contains("unreachable after"), "{err}");
    assert!(waited >= Duration::from_millis(1000), "gave up after {waited:?} without retrying");
}

/// A role whose coordinator is gone for good (killed, nobody restarts it)
/// stops once the heartbeat timeout and `cluster.connect_timeout_ms` (the
/// time it keeps trying to rejoin) have passed, naming it, with exit code 75
/// (a restart registers again). (Its heartbeat thread used to lock the
/// state it was reporting from, and the role hung instead.)
#[test]
fn a_role_whose_coordinator_is_gone_stops_after_trying_to_rejoin() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = write_config(tmp.path(), "connect_timeout_ms = 1000");
    let (mut coord, addr) = coordinator(&config, None);
    let mut shard = sparrow()
        .args(["shard", "--coordinator", &addr, "--listen", "127.0.0.1:0"])
        .env_remove("SPARROW_AUTH_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("shard");
    let stderr = shard.stderr.take().expect("stderr");
    let log = Arc::new(Mutex::new(String::new()));
    let reader = collect_lines(stderr, log.clone());
    let start = Instant::now();
    while !log.lock().expect("log").contains("listening on") {
        assert!(start.elapsed() < Duration::from_secs(20), "the shard never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    coord.kill().expect("kill the coordinator");
    let _ = coord.wait();
    // heartbeat_timeout_ms = 2000 and connect_timeout_ms = 1000 in this
    // config: it stops after about 3 s (a hang is caught here).
    let status = wait_with_timeout(&mut shard, Duration::from_secs(30));
    reader.join().expect("reader");
    let text = log.lock().expect("log").clone();
    assert_eq!(status.code(), Some(75), "{text}");
    assert!(text.contains(&format!("coordinator at {addr}")) && text.contains("no answer for"), "{text}");
    assert!(text.contains("trying to rejoin") && text.contains("giving up"), "{text}");
}

/// `sparrow predict FLAG MODEL` on `dir/data/test.tsv` into `out`: the predictions.
fn predict_with(dir: &Path, flag: &str, model: &str, out: &str) -> String {
    let test = dir.join("data/test.tsv").display().to_string();
    let o = sparrow().args(["predict", flag, model, "--data", &test, "--out", out]).output().expect("predict");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out).expect("predictions")
}

/// `checkpoint.export_every_secs` below `every_secs` in `launch`: between
/// checkpoints the workers meet for an export alone. Each shard writes the
/// rows used since the export before into a file of its own, the
/// coordinator the dense weights and the manifest, and no checkpoint is
/// committed (only step 1's and the end's). The meetings change nothing:
/// the newest export and the final checkpoint predict what a run without
/// them predicts, and that checkpoint continues where that run's does.
#[test]
fn launch_exports_between_checkpoints_from_each_shards_changed_rows() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let config = write_config(tmp.path(), "");
    let run = |name: &str, export: bool| {
        let ckpt = tmp.path().join(name).display().to_string();
        let mut command = sparrow();
        command.args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet"]);
        command.args(["--set", &format!("checkpoint.dir={ckpt:?}"), "--set", "checkpoint.every_secs=3600"]);
        command.args(["--set", "train.pipeline_depth=0"]);
        if export {
            // Steps of 60 ms or more: the 79 steps outlast a few timed meetings.
            command.args(["--set", "checkpoint.export_every_secs=1"]).env("FAILPOINTS", "worker.step=sleep(60)");
        }
        let out = command.output().expect("launch");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (ckpt, last_json(&out))
    };
    let (plain, plain_summary) = run("plain", false);
    let (ckpt, summary) = run("exported", true);
    assert_eq!(summary["steps"], 79);
    assert_eq!(summary["checkpoints_committed"], 2, "step 1 and the end: {summary}");
    assert_eq!(summary["test_auc"], plain_summary["test_auc"], "meetings change nothing");
    let exports = format!("{ckpt}/exports");
    let mut steps: Vec<u64> = std::fs::read_dir(&exports)
        .expect("exports")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    steps.sort();
    assert!(steps.len() >= 3 && steps.first() == Some(&1) && steps.last() == Some(&79), "{steps:?}");
    let manifest = |step: u64| -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{exports}/{step:012}/manifest.json")).expect("manifest");
        serde_json::from_str(&text).expect("json")
    };
    assert!(manifest(1)["base"].is_null(), "the first export is full");
    let mut deltas = 0;
    for pair in steps.windows(2) {
        // Each a delta on the one before, but every full_every-th (8th) full.
        let m = manifest(pair[1]);
        if !m["base"].is_null() {
            assert_eq!(m["base"], format!("{:012}", pair[0]), "{m}");
            deltas += 1;
        }
        let files: Vec<&String> = m["files"].as_object().expect("files").keys().collect();
        assert_eq!(files, ["dense.safetensors", "embeddings-0000.bin", "embeddings-0001.bin"], "one file a shard");
    }
    assert!(deltas >= 1, "{steps:?}");
    let predict = |flag: &str, model: &str, out: &str| predict_with(tmp.path(), flag, model, out);
    let expected = predict("--checkpoint", &plain, &tmp.path().join("plain.txt").display().to_string());
    assert_eq!(predict("--checkpoint", &ckpt, &tmp.path().join("a.txt").display().to_string()), expected);
    assert_eq!(predict("--model", &exports, &tmp.path().join("b.txt").display().to_string()), expected);
    let position = |root: &str| -> serde_json::Value {
        let latest = std::fs::read_to_string(format!("{root}/LATEST")).expect("LATEST");
        let text = std::fs::read_to_string(format!("{root}/{}/manifest.json", latest.trim())).expect("manifest");
        let m: serde_json::Value = serde_json::from_str(&text).expect("json");
        serde_json::json!([m["position"], m["samples_trained"], m["skip"]])
    };
    assert_eq!(position(&ckpt), position(&plain));
}

/// `checkpoint.export_every_steps` in `launch`: the coordinator exports its
/// committed checkpoints (checkpoints are taken at the export cadence when
/// `every_steps` is unset), incrementally; the newest export's chain predicts
/// what the final checkpoint predicts. A cadence off the checkpoints' is
/// refused.
#[test]
fn launch_writes_serving_exports_of_its_checkpoints() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let config = write_config(tmp.path(), "");
    let ckpt = tmp.path().join("ckpt").display().to_string();
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet"])
        .args(["--set", &format!("checkpoint.dir={ckpt:?}"), "--set", "checkpoint.export_every_steps=20"])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = last_json(&out);
    assert_eq!(summary["steps"], 79);
    let exports = format!("{ckpt}/exports");
    assert_eq!(std::fs::read_to_string(format!("{exports}/LATEST")).expect("LATEST").trim(), "000000000079");
    let predict = |flag: &str, model: &str, out: &str| predict_with(tmp.path(), flag, model, out);
    let a = predict("--checkpoint", &ckpt, &tmp.path().join("a.txt").display().to_string());
    let b = predict("--model", &exports, &tmp.path().join("b.txt").display().to_string());
    assert_eq!(a, b);
    // Exports at 20 (full), 40, 60 and 79 (the end): the later ones hold only
    // the rows that changed, each naming the one before as its base.
    let manifest = |step: u64| -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{exports}/{step:012}/manifest.json")).expect("manifest");
        serde_json::from_str(&text).expect("json")
    };
    assert!(manifest(20)["base"].is_null());
    for (step, base) in [(40, 20), (60, 40), (79, 60)] {
        assert_eq!(manifest(step)["base"], format!("{base:012}"));
    }
    let (last, rows) =
        (manifest(79)["rows"].as_u64().expect("rows"), summary["embedding_rows"].as_u64().expect("rows"));
    assert!(last > 0 && last < rows / 2, "the last delta holds {last} of the {rows} rows");

    let refused = sparrow()
        .args(["launch", "--config", &config, "--shards", "1", "--workers", "1", "--quiet"])
        .args(["--set", &format!("checkpoint.dir={ckpt:?}"), "--set", "checkpoint.export_every_steps=30"])
        .args(["--set", "checkpoint.every_steps=20"])
        .output()
        .expect("launch");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("multiple of checkpoint.every_steps = 20"), "{stderr}");
}
