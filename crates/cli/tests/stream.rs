//! Training from a Kafka topic (`[data.stream]`, issue 40) against a real
//! Kafka-protocol broker: tansu, installed by `scripts/ensure-tansu` (the
//! test command runs it and sets SPARROW_TANSU), started on 127.0.0.1 with
//! its in-memory storage, one broker per test.
//!
//! Records are produced before training starts, so the batches a run cuts
//! depend on the log only, and runs can be compared bit for bit.

mod common;

use common::{Log, last_json, signal, sparrow};
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::Duration;

/// A tansu broker on a free loopback port, stopped when dropped.
struct Broker {
    child: Child,
    addr: String,
}

impl Broker {
    fn start() -> Broker {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
        let addr = format!("127.0.0.1:{port}");
        Broker { child: Broker::spawn(&addr), addr }
    }

    /// tansu on `addr`, with its in-memory storage.
    fn spawn(addr: &str) -> Child {
        common::kafka::spawn_tansu(addr, addr, "memory://tansu/", &[])
    }

    /// Kills the broker and starts an empty one on the same address (its
    /// storage is memory: every topic and record is gone).
    fn restart_empty(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Broker::spawn(&self.addr);
    }

    /// `sparrow produce --from FILE` into `topic` (created with `partitions`).
    fn produce(&self, topic: &str, partitions: u32, file: &Path) -> serde_json::Value {
        let out = sparrow()
            .args(["produce", "--brokers", &self.addr, "--topic", topic])
            .args(["--partitions", &partitions.to_string(), "--from", &file.display().to_string()])
            .output()
            .expect("produce");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The small job (`common::write_config`, at depth 0) on `dir/data`,
/// reading `topic` with `stream` lines added to `[data.stream]`; `None`:
/// the file instead. Its checkpoints go to `dir/ckpt-TOPIC`.
fn job(dir: &Path, broker: &Broker, topic: Option<&str>, stream: &str) -> String {
    let name = topic.unwrap_or("file");
    let base = std::fs::read_to_string(common::write_config(dir, "")).expect("config");
    let section = match topic {
        Some(t) => format!(
            "[data.stream]\nbrokers = [\"{}\"]\ntopic = \"{t}\"\nstop_when_idle_secs = 1\n{stream}\n",
            broker.addr
        ),
        None => String::new(),
    };
    let text = base.replace("batch_size = 256", "batch_size = 256\npipeline_depth = 0")
        + &format!("{section}\n[checkpoint]\ndir = {:?}\n", dir.join(format!("ckpt-{name}")).display().to_string());
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("config");
    path.display().to_string()
}

fn train(config: &str, args: &[&str]) -> Output {
    sparrow().args(["train", "--config", config, "--quiet"]).args(args).output().expect("train")
}

fn ok_json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(out)
}

fn setup(rows: &str) -> (tempfile::TempDir, Broker) {
    let tmp = tempfile::tempdir().expect("tmp");
    common::generate(tmp.path(), rows);
    (tmp, Broker::start())
}

#[test]
fn a_topic_of_one_partition_trains_the_model_its_file_trains() {
    let (tmp, broker) = setup("6000");
    let produced = broker.produce("rows", 1, &tmp.path().join("data/train.tsv"));
    assert_eq!(produced["end_offsets"]["0"], 6000, "{produced}");
    let file = ok_json(&train(&job(tmp.path(), &broker, None, ""), &[]));
    let stream = ok_json(&train(&job(tmp.path(), &broker, Some("rows"), ""), &[]));
    // The same batches in the same order: bit for bit the file's model.
    assert_eq!(stream["test_auc"], file["test_auc"]);
    assert_eq!(stream["test_logloss"], file["test_logloss"]);
    assert_eq!(stream["embedding_rows"], file["embedding_rows"]);
    assert_eq!(stream["steps"], file["steps"]);
    assert_eq!(stream["stream_offsets"], serde_json::json!({"0": 6000}));
    assert_eq!(stream["stream_records"], 6000);
    assert_eq!((&stream["stream_bad_records"], &stream["stream_lag_records"]), (&0.into(), &0.into()));
    assert!(file["stream_offsets"].is_null(), "{file}");
    // Progressive validation is on for a stream by default, off for a file.
    assert_eq!(stream["online_samples"], 6000);
    assert!(stream["online_window_auc"].as_f64().is_some_and(|a| a > 0.0 && a < 1.0), "{stream}");
    assert!(file["online_samples"].is_null(), "{file}");
    // The checkpoint holds the offsets.
    let ckpt = stream["checkpoint"].as_str().expect("checkpoint");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(ckpt).join("manifest.json")).expect("manifest")).expect("json");
    assert_eq!(manifest["stream"]["offsets"], serde_json::json!({"0": 6000}), "{manifest}");
}

#[test]
fn stop_and_resume_on_a_topic_of_three_partitions_gives_the_uninterrupted_model() {
    let (tmp, broker) = setup("8000");
    broker.produce("three", 3, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("three"), "");
    let whole = ok_json(&train(&config, &["--set", &format!("checkpoint.dir={:?}", tmp.path().join("whole"))]));
    assert_eq!(whole["stream_records"], 8000);
    let offsets = &whole["stream_offsets"];
    // Row i went to partition i mod 3.
    assert_eq!(*offsets, serde_json::json!({"0": 2667, "1": 2667, "2": 2666}));
    // 13 steps, then a second run resumes from the checkpoint's offsets.
    let first = ok_json(&train(&config, &["--set", "train.max_steps=13"]));
    assert_eq!(first["steps"], 13);
    assert_eq!(first["stream_records"], 13 * 256);
    let resumed = ok_json(&train(&config, &["--resume", first["checkpoint"].as_str().expect("ckpt")]));
    assert_eq!(resumed["resumed_from_step"], 13);
    assert_eq!(resumed["test_auc"], whole["test_auc"], "nothing skipped, nothing trained twice");
    assert_eq!(resumed["steps"], whole["steps"]);
    assert_eq!(resumed["embedding_rows"], whole["embedding_rows"]);
    assert_eq!(resumed["stream_offsets"], *offsets);
    assert_eq!(resumed["stream_records"], 8000);
    assert_eq!(resumed["train_rows"].as_u64().expect("rows") + 13 * 256, 8000);
}

#[test]
fn sigterm_keeps_the_offsets_and_a_resumed_run_ends_with_the_uninterrupted_model() {
    let (tmp, broker) = setup("8000");
    broker.produce("live", 2, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("live"), "");
    let whole = ok_json(&train(&config, &["--set", &format!("checkpoint.dir={:?}", tmp.path().join("whole"))]));
    // Without stop_when_idle_secs the run reads on until it is stopped.
    let mut child = sparrow()
        .args(["train", "--config", &config, "--set", "data.stream.stop_when_idle_secs=0"])
        .args(["--set", "train.log_interval_steps=1", "--set", "checkpoint.export_every_secs=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("train");
    let log = Log::default();
    let reader = log.collect(child.stderr.take().expect("stderr"));
    // Every record trained (the lag line says 0 records behind at 8000 samples).
    log.wait_for_line(&["samples 8000 ", "lag 0 records"], Duration::from_secs(120));
    signal(child.id(), "-TERM");
    // Not a timing: an idle stream once kept a stopped run waiting forever.
    let status = common::wait_with_timeout(&mut child, Duration::from_secs(60));
    reader.join().expect("reader");
    assert_eq!(status.code(), Some(143), "{}", log.text());
    // Timed exports: at least the last, its manifest holding the offsets.
    let latest = std::fs::read_to_string(tmp.path().join("ckpt-live/exports/LATEST")).expect("an export");
    let export = tmp.path().join("ckpt-live/exports").join(latest.trim()).join("manifest.json");
    let export: serde_json::Value = serde_json::from_slice(&std::fs::read(export).expect("manifest")).expect("json");
    assert_eq!(export["stream"]["offsets"], whole["stream_offsets"], "{export}");
    let latest = std::fs::read_to_string(tmp.path().join("ckpt-live/LATEST")).expect("LATEST");
    let resumed = ok_json(&train(
        &config,
        &["--resume", &tmp.path().join("ckpt-live").join(latest.trim()).display().to_string()],
    ));
    // The stopped run had trained every record: the resumed one finds none
    // (it trains nothing, and says so: a resumed run may find its data used up).
    assert_eq!(resumed["train_rows"], 0);
    assert_eq!(resumed["test_auc"], whole["test_auc"]);
    assert_eq!(resumed["stream_offsets"], whole["stream_offsets"]);
}

#[test]
fn malformed_records_are_counted_named_and_skipped_and_their_offsets_consumed() {
    let (tmp, broker) = setup("1000");
    let rows = std::fs::read_to_string(tmp.path().join("data/train.tsv")).expect("rows");
    let mut lines: Vec<&str> = rows.lines().collect();
    lines.insert(10, "not a row");
    lines.insert(500, "1\tone\ttoo few");
    let bad = tmp.path().join("bad.tsv");
    std::fs::write(&bad, lines.join("\n") + "\n").expect("write");
    broker.produce("bad", 1, &bad);
    let out = train(&job(tmp.path(), &broker, Some("bad"), ""), &[]);
    let json = ok_json(&out);
    assert_eq!(json["stream_bad_records"], 2);
    assert_eq!(json["bad_rows"], 2);
    assert_eq!(json["stream_records"], 1002);
    assert_eq!(json["train_rows"], 1000);
    assert_eq!(json["stream_offsets"], serde_json::json!({"0": 1002}));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("kafka topic bad partition 0 offset 10"), "{stderr}");
    assert!(stderr.contains("kafka topic bad partition 0 offset 500"), "{stderr}");
    // max_bad_rows still applies.
    let out = train(&job(tmp.path(), &broker, Some("bad"), ""), &["--set", "data.max_bad_rows=1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("more than data.max_bad_rows = 1"), "{stderr}");
}

#[test]
fn a_missing_topic_or_partition_and_an_unreachable_broker_are_named() {
    let (tmp, broker) = setup("300");
    broker.produce("there", 2, &tmp.path().join("data/train.tsv"));
    let err = |out: Output| {
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = err(train(&job(tmp.path(), &broker, Some("absent"), ""), &[]));
    assert!(e.contains("topic \"absent\" does not exist"), "{e}");
    let e = err(train(&job(tmp.path(), &broker, Some("there"), "partitions = [0, 5]"), &[]));
    assert!(e.contains("has no partition 5") && e.contains("partitions 0, 1"), "{e}");
    // A row whose time column is not a time: named by line, nothing sent.
    let out = sparrow()
        .args(["produce", "--brokers", &broker.addr, "--topic", "stamped", "--timestamp-column", "99"])
        .args(["--from", &tmp.path().join("data/train.tsv").display().to_string()])
        .output()
        .expect("produce");
    let e = err(out);
    assert!(e.contains("line 1: column 99 is not a time in Unix seconds"), "{e}");
    // A lazy cluster job cannot keep offsets yet: refused, not ignored.
    let e = err(sparrow()
        .args(["launch", "--config", &job(tmp.path(), &broker, Some("there"), "")])
        .args(["--set", "cluster.sync=\"lazy\""])
        .output()
        .expect("launch"));
    assert!(e.contains("[data.stream] with cluster.sync = \"lazy\""), "{e}");
    // No broker at all: retried, then refused after max_unavailable_secs.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
    let gone = job(tmp.path(), &broker, Some("there"), "max_unavailable_secs = 1").to_string();
    let text = std::fs::read_to_string(&gone).expect("config").replace(&broker.addr, &format!("127.0.0.1:{port}"));
    std::fs::write(&gone, text).expect("config");
    let e = err(train(&gone, &[]));
    assert!(e.contains(&format!("127.0.0.1:{port}")) && e.contains("cannot connect"), "{e}");
}

/// `sparrow launch` (2 shards, 1 worker, a checkpoint every 10 steps) on
/// `config`, with `FAILPOINTS` set when given.
fn launch(config: &str, failpoints: &str) -> Output {
    launch_with(config, failpoints, &[])
}

fn launch_with(config: &str, failpoints: &str, args: &[&str]) -> Output {
    let mut command = sparrow();
    command.args(["launch", "--config", config, "--shards", "2", "--workers", "1", "--quiet"]);
    command.args(["--set", "checkpoint.every_steps=10"]).args(args);
    if !failpoints.is_empty() {
        command.env("FAILPOINTS", failpoints);
    }
    command.output().expect("launch")
}

/// A cluster job reading a topic: 1×1 it trains `train`'s model, and when a
/// shard dies (both shards, at their 25th push), or in another run the
/// loader (at its 27th batch), the job goes back to the checkpoint at step
/// 20, reads on from its offsets, and ends with the uninterrupted model.
/// The deaths are failpoints that end the process on the spot, as SIGKILL
/// does (`crates/cluster/src/faults.rs`).
#[test]
fn a_cluster_job_on_a_topic_recovers_exactly_from_a_shard_or_loader_death() {
    let (tmp, broker) = setup("8000");
    broker.produce("cluster", 3, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("cluster"), "");
    let whole = ok_json(&train(&config, &["--set", &format!("checkpoint.dir={:?}", tmp.path().join("whole"))]));
    assert_eq!(whole["steps"], 32, "8000 records in batches of 256");
    let plain = ok_json(&launch(&config, ""));
    assert_eq!(plain["test_auc"], whole["test_auc"], "bit for bit train's model");
    assert_eq!(plain["embedding_rows"], whole["embedding_rows"]);
    assert_eq!(plain["stream_offsets"], whole["stream_offsets"]);
    assert_eq!(plain["stream_records"], 8000);
    assert_eq!(plain["online_logloss"], whole["online_logloss"], "the worker scores as train does");
    for (role, failpoint) in [("shard", "shard.push=24*off->return"), ("loader", "loader.next_batch=26*off->return")] {
        let out = launch(&config, failpoint);
        let json = ok_json(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(json["restarts"][role].as_u64().is_some_and(|n| n >= 1), "{role}: {}\n{stderr}", json["restarts"]);
        assert_eq!(json["test_auc"], whole["test_auc"], "{role}: nothing skipped, nothing trained twice");
        assert_eq!(json["embedding_rows"], whole["embedding_rows"], "{role}");
        assert_eq!(json["train_rows"], whole["train_rows"], "{role}");
        assert_eq!(json["stream_offsets"], whole["stream_offsets"], "{role}");
        assert_eq!(json["stream_records"], 8000, "{role}");
        assert!(json["steps_replayed"].as_u64().is_some_and(|n| n >= 1), "{role}: {}", json["steps_replayed"]);
    }
}

/// `embedding.max_rows` in a cluster: each of the two shards keeps within
/// half the bound (evicting its least recently used rows after a push), and
/// when both shards die the job goes back to a checkpoint (each row's last
/// use is in it) and ends with the model of the run without a death.
#[test]
fn a_cluster_job_on_a_topic_keeps_within_max_rows_and_recovers_exactly() {
    let (tmp, broker) = setup("8000");
    broker.produce("bounded", 3, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("bounded"), "");
    // The workers' metrics lines say where the stream stands, as train's do.
    let metrics = tmp.path().join("metrics.jsonl");
    let sets = [format!("train.metrics_path={:?}", metrics.display().to_string()), "train.log_interval_steps=2".into()];
    let free = ok_json(&launch_with(&config, "", &["--set", &sets[0], "--set", &sets[1]]));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|l: &serde_json::Value| l["event"].is_null())
        .collect();
    let records: Vec<u64> = lines.iter().map(|l| l["stream_records"].as_u64().expect("stream_records")).collect();
    assert!(records.len() >= 2 && records.windows(2).all(|w| w[0] < w[1]) && records[records.len() - 1] <= 8000);
    assert!(lines.iter().all(|l| l["stream_lag_records"].as_u64().is_some() && l["worker"] == 0), "{lines:?}");
    let bound = free["embedding_rows"].as_u64().expect("rows") / 3;
    let max_rows = format!("embedding.max_rows={bound}");
    let capped = ok_json(&launch_with(&config, "", &["--set", &max_rows]));
    assert!(capped["evicted_rows"].as_u64().is_some_and(|n| n > 0), "{capped}");
    assert!(capped["embedding_rows"].as_u64().is_some_and(|n| n <= bound), "{capped}");
    assert_ne!(capped["test_auc"], free["test_auc"], "evictions changed the model");
    let out = launch_with(&config, "shard.push=24*off->return", &["--set", &max_rows]);
    let json = ok_json(&out);
    assert!(json["restarts"]["shard"].as_u64().is_some_and(|n| n >= 1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json["test_auc"], capped["test_auc"], "the same evictions after the recovery");
    assert_eq!(json["embedding_rows"], capped["embedding_rows"]);
    assert_eq!(json["stream_records"], 8000);
}

/// Timed checkpoints and exports in a cluster (`checkpoint.every_secs`,
/// `export_every_secs`): the workers meet at the steps each commit names
/// (the first right after the start), the coordinator exports committed
/// versions, and when both shards die at their 25th push the job goes back
/// to the last timed checkpoint, wherever it fell, and ends with `train`'s
/// model.
#[test]
fn timed_checkpoints_in_a_cluster_recover_exactly() {
    let (tmp, broker) = setup("8000");
    broker.produce("timed", 3, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("timed"), "");
    let whole = ok_json(&train(&config, &["--set", &format!("checkpoint.dir={:?}", tmp.path().join("whole"))]));
    let timed = |failpoints: &str| {
        let mut command = sparrow();
        command.args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet"]);
        command.args(["--set", "checkpoint.every_secs=1", "--set", "checkpoint.export_every_secs=1"]);
        command.env("FAILPOINTS", failpoints).output().expect("launch")
    };
    let plain = ok_json(&timed(""));
    assert_eq!(plain["test_auc"], whole["test_auc"], "checkpoints change nothing");
    assert!(plain["checkpoints_committed"].as_u64().is_some_and(|n| n >= 2), "step 1 and the end: {plain}");
    assert!(tmp.path().join("ckpt-timed/exports/LATEST").is_file(), "a serving export");
    let out = timed("shard.push=24*off->return");
    let json = ok_json(&out);
    assert!(json["restarts"]["shard"].as_u64().is_some_and(|n| n >= 1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json["test_auc"], whole["test_auc"], "nothing skipped, nothing trained twice");
    assert_eq!(json["stream_records"], 8000);
}

/// Two workers that prefetch (depth 1) train batches out of order, so a
/// checkpoint may hold batches trained past its offsets (as skip ranges in
/// its mark). Both workers die after their step 9: the job goes back to a
/// checkpoint and ends with every record trained once. (Without a death,
/// the online figures are both workers' together.)
#[test]
fn two_workers_on_a_topic_recover_with_every_record_trained_once() {
    let (tmp, broker) = setup("8000");
    broker.produce("two", 3, &tmp.path().join("data/train.tsv"));
    let config = job(tmp.path(), &broker, Some("two"), "");
    // Without a death: the online figures add up both workers' batches.
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet"])
        .args(["--set", "train.pipeline_depth=1"])
        .output()
        .expect("launch");
    let json = ok_json(&out);
    assert_eq!(json["online_samples"], 8000, "{json}");
    assert!(json["online_window_auc"].as_f64().is_some_and(|a| a > 0.0 && a < 1.0), "{json}");
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2", "--quiet"])
        .args(["--set", "checkpoint.every_steps=4", "--set", "train.pipeline_depth=1"])
        .env("FAILPOINTS", "worker.step=8*off->return")
        .output()
        .expect("launch");
    let json = ok_json(&out);
    assert_eq!(json["restarts"]["worker"], 2, "{}", json["restarts"]);
    assert_eq!(json["train_rows"], 8000, "nothing skipped, nothing trained twice");
    assert_eq!(json["stream_records"], 8000);
    assert_eq!(json["stream_offsets"], serde_json::json!({"0": 2667, "1": 2667, "2": 2666}));
    // No figure for steps_replayed: the coordinator counts the steps its
    // heartbeats reported, and a worker killed between two heartbeats took
    // its last step with it (0 or 1 here, by timing).
}

/// A job on generated CSV rows spread over four days (`gen --days`), each
/// record stamped with its row's time (`produce --timestamp-column`):
/// `bounds` go in `[embedding]`, `tables` at the end. Its metrics and
/// checkpoints go to `metrics-NAME.jsonl` and `ckpt-NAME`.
fn days_job(dir: &Path, broker: &Broker, name: &str, bounds: &str, tables: &str) -> String {
    let d = dir.display();
    let header = std::fs::read_to_string(dir.join("data/train.csv")).expect("csv");
    let header = header.lines().next().expect("header");
    let schema = common::days_schema();
    let text = format!(
        r#"
[data]
format = "csv"
test = "{d}/data/test.csv"
[data.schema]
{schema}[data.stream]
brokers = ["{}"]
topic = "days"
header = "{header}"
stop_when_idle_secs = 1
[model]
kind = "dlrm"
embedding_dim = 8
hidden = [16]
bottom_hidden = [8]
[train]
batch_size = 256
log_interval_steps = 1
metrics_path = "{d}/metrics-{name}.jsonl"
[embedding]
{bounds}
[checkpoint]
dir = "{d}/ckpt-{name}"
{tables}
"#,
        broker.addr,
    );
    let path = dir.join(format!("days-{name}.toml"));
    std::fs::write(&path, text).expect("config");
    path.display().to_string()
}

/// `gen --days 4` rows (8,000, in `dir/data`) on topic `days` of a fresh
/// broker (two partitions), each record stamped with its row's time.
fn days_on_a_topic(dir: &Path) -> Broker {
    let generated = sparrow()
        .args(["gen", "--format", "csv", "--days", "4", "--train-rows", "8000", "--test-rows", "1000", "--out"])
        .arg(dir.join("data"))
        .output()
        .expect("gen");
    assert!(generated.status.success(), "{}", String::from_utf8_lossy(&generated.stderr));
    let broker = Broker::start();
    let out = sparrow()
        .args(["produce", "--brokers", &broker.addr, "--topic", "days", "--partitions", "2"])
        .args(["--from", &dir.join("data/train.csv").display().to_string()])
        .args(["--skip-header", "--timestamp-column", "40"])
        .output()
        .expect("produce");
    assert_eq!(last_json(&out)["records"], 8000, "{}", String::from_utf8_lossy(&out.stderr));
    broker
}

/// Bounded tables on a stream: `max_rows` keeps the table within its bound
/// at every step, `ttl_secs` deletes rows by the records' time, and a run
/// stopped and resumed with both ends with the uninterrupted model (the
/// event clock and each row's last use are in the checkpoint).
#[test]
fn bounded_tables_stay_within_max_rows_and_expire_by_record_time_exactly() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = days_on_a_topic(tmp.path());
    let free = ok_json(&train(&days_job(tmp.path(), &broker, "free", "", ""), &[]));
    let all_rows = free["embedding_rows"].as_u64().expect("rows");
    assert_eq!((&free["expired_rows"], &free["evicted_rows"]), (&0.into(), &0.into()), "{free}");

    let bound = all_rows / 4;
    let capped = days_job(tmp.path(), &broker, "capped", &format!("max_rows = {bound}"), "");
    let json = ok_json(&train(&capped, &[]));
    assert!(json["evicted_rows"].as_u64().is_some_and(|n| n > 0), "{json}");
    let metrics = std::fs::read_to_string(tmp.path().join("metrics-capped.jsonl")).expect("metrics");
    for line in metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")) {
        if let Some(rows) = line["embedding_rows"].as_u64() {
            assert!(rows <= bound, "{rows} rows past max_rows = {bound}: {line}");
        }
    }

    let ttl = days_job(tmp.path(), &broker, "ttl", "ttl_secs = 43200", "");
    let json = ok_json(&train(&ttl, &[]));
    let expired = json["expired_rows"].as_u64().expect("expired");
    assert!(expired > 0 && json["embedding_rows"].as_u64().expect("rows") < all_rows, "{json}");

    // Stopped after 13 steps (on the second day) and resumed: the
    // uninterrupted model, with ttl_secs alone and with both bounds. The
    // rows' times are random within their day, so event time moves a day at
    // a time; a TTL of a day and a half deletes the first day's rows when
    // the third begins, which only the checkpointed event clock knows.
    for (name, bounds) in
        [("ttl", "ttl_secs = 129600".to_string()), ("both", format!("ttl_secs = 129600\nmax_rows = {bound}"))]
    {
        let job = days_job(tmp.path(), &broker, &format!("resume-{name}"), &bounds, "");
        let whole = ok_json(&train(&job, &["--set", &format!("checkpoint.dir={:?}", tmp.path().join(name))]));
        let first = ok_json(&train(&job, &["--set", "train.max_steps=13"]));
        let resumed = ok_json(&train(&job, &["--resume", first["checkpoint"].as_str().expect("ckpt")]));
        assert_eq!(resumed["test_auc"], whole["test_auc"], "{name}: deletions at the same steps");
        assert_eq!(resumed["embedding_rows"], whole["embedding_rows"], "{name}");
        assert_eq!(resumed["stream_records"], 8000, "{name}");
    }
}

/// Age weighting on a stream (`[data.weighting]`): each sample is dated by
/// its record and weighed by its age on the stream's event clock, which
/// checkpoints keep, so a resumed run weighs its first batches as the
/// uninterrupted run did. And online training with `ttl_secs` and age
/// weighting tracks the drifting stream: its AUC over the newest day (each
/// sample scored before it was trained on) is no more than 0.01 below that
/// of a model trained offline on the newest day's rows.
#[test]
fn age_weighting_on_a_stream_resumes_exactly_and_tracks_the_drift() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = days_on_a_topic(tmp.path());

    // The newest day's rows, as a file.
    let csv = std::fs::read_to_string(tmp.path().join("data/train.csv")).expect("csv");
    let mut lines = csv.lines();
    let header = lines.next().expect("header");
    let time = |line: &str| line.rsplit(',').next().and_then(|t| t.parse::<i64>().ok()).expect("ts");
    let rows: Vec<&str> = lines.collect();
    let newest_day = rows.iter().map(|l| time(l)).max().expect("rows") / 86_400 * 86_400;
    let newest: Vec<&str> = rows.iter().copied().filter(|l| time(l) >= newest_day).collect();
    let day_file = tmp.path().join("data/newest-day.csv");
    std::fs::write(&day_file, format!("{header}\n{}\n", newest.join("\n"))).expect("day file");

    let job = days_job(tmp.path(), &broker, "weighted", "ttl_secs = 86400", "[data.weighting]\ndrop_below = 0.01");
    let window = format!("train.online_window_samples={}", newest.len());
    let whole = ok_json(&train(&job, &["--set", &window]));
    let (rows, weights) =
        (whole["train_rows"].as_f64().expect("rows"), whole["sample_weight_sum"].as_f64().expect("sum"));
    // Times are random within their day, so a sample is up to a day older
    // than the newest record read before it: weights between e^-1 and 1.
    assert!(weights < 0.9 * rows && weights > 0.3 * rows, "weights sum to {weights} over {rows} samples");
    assert_eq!(whole["stream_records"], 8000, "{whole}");

    let first = ok_json(&train(&job, &["--set", &window, "--set", "train.max_steps=13"]));
    let resumed = ok_json(&train(&job, &["--set", &window, "--resume", first["checkpoint"].as_str().expect("ckpt")]));
    assert_eq!(resumed["test_auc"], whole["test_auc"], "the resumed run weighs as the uninterrupted one");
    assert_eq!(resumed["stream_records"], 8000);

    // A cluster weighs the same way, and its checkpoints keep the clock: at
    // depth 0 with one worker, a loader that dies at its 27th batch goes
    // back to step 20 and the job ends with `train`'s model.
    let cluster = days_job(tmp.path(), &broker, "weighted-cluster", "", "[data.weighting]\ndrop_below = 0.01");
    let text = std::fs::read_to_string(&cluster)
        .expect("job")
        .replace("batch_size = 256", "batch_size = 256\npipeline_depth = 0");
    std::fs::write(&cluster, text).expect("job");
    let single = ok_json(&train(&cluster, &[]));
    let out = launch(&cluster, "loader.next_batch=26*off->return");
    let json = ok_json(&out);
    assert!(json["restarts"]["loader"].as_u64().is_some_and(|n| n >= 1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json["test_auc"], single["test_auc"], "the recovered loader weighs as before its death");
    assert_eq!(json["sample_weight_sum"].as_f64().map(|w| w < 0.9 * 8000.0), Some(true), "{json}");

    // A record without a time (Kafka's -1, here -5 s) has no age to weigh
    // by: counted as malformed, named, its offset consumed.
    let undated = tmp.path().join("undated.csv");
    let mut row: Vec<&str> = newest[0].split(',').collect();
    *row.last_mut().expect("ts") = "-5";
    std::fs::write(&undated, format!("{}\n{}\n{}\n", newest[0], row.join(","), newest[1])).expect("undated");
    let out = sparrow()
        .args(["produce", "--brokers", &broker.addr, "--topic", "undated", "--timestamp-column", "40"])
        .args(["--from", &undated.display().to_string()])
        .output()
        .expect("produce");
    assert_eq!(last_json(&out)["records"], 3, "{}", String::from_utf8_lossy(&out.stderr));
    let undated_dir = format!("checkpoint.dir={:?}", tmp.path().join("undated").display().to_string());
    let out = train(&job, &["--set", "data.stream.topic=\"undated\"", "--set", &undated_dir]);
    let json = ok_json(&out);
    assert_eq!((&json["stream_bad_records"], &json["train_rows"]), (&1.into(), &2.into()), "{json}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("partition 0 offset 1") && stderr.contains("no record timestamp"), "{stderr}");

    // The same model offline, on the newest day's file, unweighted.
    let text = std::fs::read_to_string(&job).expect("job");
    let (stream_at, model_at) = (text.find("[data.stream]").expect("stream"), text.find("[model]").expect("model"));
    let text = format!("{}{}", &text[..stream_at], &text[model_at..])
        .replacen("[data]\n", &format!("[data]\ntrain = {:?}\n", day_file.display().to_string()), 1)
        .replace("[data.weighting]\ndrop_below = 0.01", "")
        .replace("ttl_secs = 86400", "")
        .replace("-weighted", "-offline");
    let offline = tmp.path().join("offline.toml");
    std::fs::write(&offline, text).expect("offline job");
    let offline = ok_json(&train(&offline.display().to_string(), &[]));
    let (online, offline) =
        (whole["online_window_auc"].as_f64().expect("online"), offline["test_auc"].as_f64().expect("offline"));
    assert!(online >= offline - 0.01, "online AUC on the newest day {online}, the offline model's {offline}");
}

/// `embedding.ttl_secs` in a cluster: each shard keeps its lookup clock
/// against the records' time (the loader sends each batch's newest record
/// time with its keys), deletes rows past the TTL after a push, and keeps
/// that clock in its checkpoint part. Both shards die at their 25th push;
/// from the checkpoint at step 20 the job deletes the second day's rows
/// when the fourth begins (near step 24), which only the restored clock
/// knows, and ends with the model of the run without a death, which is
/// `train`'s model.
#[test]
fn a_cluster_job_expires_rows_by_record_time_and_recovers_exactly() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = days_on_a_topic(tmp.path());
    let job = days_job(tmp.path(), &broker, "cluster-ttl", "ttl_secs = 129600", "");
    let text =
        std::fs::read_to_string(&job).expect("job").replace("batch_size = 256", "batch_size = 256\npipeline_depth = 0");
    std::fs::write(&job, text).expect("job");
    let plain = ok_json(&launch(&job, ""));
    assert!(plain["expired_rows"].as_u64().is_some_and(|n| n > 0), "{plain}");
    let out = launch(&job, "shard.push=24*off->return");
    let json = ok_json(&out);
    assert!(json["restarts"]["shard"].as_u64().is_some_and(|n| n >= 1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json["test_auc"], plain["test_auc"], "the same deletions after the recovery");
    assert_eq!(json["embedding_rows"], plain["embedding_rows"]);
    assert_eq!(json["stream_records"], 8000);
    let single = ok_json(&train(&job, &[]));
    assert_eq!(single["test_auc"], plain["test_auc"], "two shards expire the rows train's table does");
    assert_eq!(single["embedding_rows"], plain["embedding_rows"]);
}

/// Issue 53 item 4: one record stamped a century ahead moved the event
/// clock there for good (checkpointed), and `ttl_secs` expired nothing
/// after it: 2,344 rows against 20,047. Now a record stamped more than
/// `data.stream.max_future_secs` ahead of the reader's clock is trained but
/// moves no clock, and is counted (`future_records`, in the final JSON of
/// `train` and `launch` and in the metrics lines), so expiry goes on.
#[test]
fn a_record_stamped_far_ahead_does_not_stop_expiry() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = days_on_a_topic(tmp.path());
    let plain = ok_json(&train(&days_job(tmp.path(), &broker, "plain", "ttl_secs = 43200", ""), &[]));
    let expired = plain["expired_rows"].as_u64().expect("expired");
    assert!(expired > 0 && plain["future_records"] == 0, "{plain}");

    // The same rows, the 200th stamped 100 years ahead.
    let csv = std::fs::read_to_string(tmp.path().join("data/train.csv")).expect("csv");
    let century = 4_102_444_800i64 + 100 * 365 * 86_400;
    let lines: Vec<String> = csv
        .lines()
        .enumerate()
        .map(|(i, l)| if i == 200 { format!("{},{century}", l.rsplit_once(',').expect("ts").0) } else { l.into() })
        .collect();
    let future_csv = tmp.path().join("future.csv");
    std::fs::write(&future_csv, lines.join("\n") + "\n").expect("write");
    let ahead = Broker::start();
    let out = sparrow()
        .args(["produce", "--brokers", &ahead.addr, "--topic", "days", "--partitions", "2"])
        .args(["--from", &future_csv.display().to_string(), "--skip-header", "--timestamp-column", "40"])
        .output()
        .expect("produce");
    assert_eq!(last_json(&out)["records"], 8000, "{}", String::from_utf8_lossy(&out.stderr));
    let job = days_job(tmp.path(), &ahead, "future", "ttl_secs = 43200", "");
    let out = train(&job, &[]);
    let json = ok_json(&out);
    assert_eq!(json["future_records"], 1, "{json}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max_future_secs") && stderr.contains("ahead"), "{stderr}");
    let with_future = json["expired_rows"].as_u64().expect("expired");
    assert!(with_future * 10 >= expired * 9, "expiry went on: {with_future} rows expired, {expired} without");
    let metrics = std::fs::read_to_string(tmp.path().join("metrics-future.jsonl")).expect("metrics");
    let mut lines = metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"));
    let last = lines.rfind(|l| !l["future_records"].is_null()).expect("a training line");
    assert_eq!(last["future_records"], 1, "{last}");
    // A cluster counts it too (the mark crosses the RPCs), and expires alike.
    let launched = ok_json(&launch(&job, ""));
    assert_eq!(launched["future_records"], 1, "{launched}");
    assert_eq!(launched["expired_rows"], json["expired_rows"]);
}

/// Issue 53 items 6 and 11: `start = { timestamp }` an hour ahead trained
/// every record from offset 0 (the broker answered a time past its newest
/// record with offset 0); `{ timestamp = -1 }` passed validation and failed
/// later with `Connection is poisoned`; a start at the end with no new
/// record said "the file holds no row". Now a time after now starts at the
/// end, a negative one is refused naming the key, and a stream that gave
/// nothing says so, in `train` and in `launch`.
#[test]
fn a_start_after_now_begins_at_the_end_and_bad_starts_are_named() {
    let (tmp, broker) = setup("300");
    broker.produce("rows", 1, &tmp.path().join("data/train.tsv"));
    let hour_ahead = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now").as_secs() + 3600;
    for start in [format!("start = {{ timestamp = {hour_ahead} }}"), "start = \"latest\"".to_string()] {
        let config = job(tmp.path(), &broker, Some("rows"), &start);
        for out in [train(&config, &[]), launch(&config, "")] {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{start}: {stderr}");
            assert!(stderr.contains("the stream gave no record") && !stderr.contains("file"), "{start}: {stderr}");
        }
    }
    for secs in ["-1", "253402300800"] {
        let config = job(tmp.path(), &broker, Some("rows"), &format!("start = {{ timestamp = {secs} }}"));
        let out = train(&config, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{secs}: {stderr}");
        assert!(stderr.contains("data.stream.start") && stderr.contains(secs), "{secs}: {stderr}");
    }
}

/// A cluster job on a topic that goes quiet for over three times a call's
/// deadline (`2 × heartbeat_timeout_ms`) and past the coordinator's
/// `progress_timeout_ms` keeps running: a worker's wait for its next batch
/// is the loader answering that it is alive and waiting, and each answer is
/// progress. The records that come after are trained, and the job stops on
/// `stop_when_idle_secs` (exit 0) with every record trained once.
#[test]
fn a_cluster_job_waits_out_an_idle_topic_and_trains_what_comes_after() {
    waits_out_an_idle_topic("step");
}

/// The same with `sync = "round"` (S2): a worker waiting for its round's
/// items on an idle stream gets `waiting` answers from the round queue.
/// (Before, the round queue's read blocked past the call's deadline.)
#[test]
fn a_round_sync_job_waits_out_an_idle_topic_and_trains_what_comes_after() {
    waits_out_an_idle_topic("round");
}

fn waits_out_an_idle_topic(sync: &str) {
    let (tmp, broker) = setup("8000");
    let text = std::fs::read_to_string(tmp.path().join("data/train.tsv")).expect("train.tsv");
    let lines: Vec<&str> = text.lines().collect();
    let (first, second) = (tmp.path().join("first.tsv"), tmp.path().join("second.tsv"));
    std::fs::write(&first, lines[..4000].join("\n") + "\n").expect("first half");
    std::fs::write(&second, lines[4000..].join("\n") + "\n").expect("second half");
    broker.produce("quiet", 2, &first);
    let config = job(tmp.path(), &broker, Some("quiet"), "");
    let idle_stop = std::fs::read_to_string(&config)
        .expect("config")
        .replace("stop_when_idle_secs = 1", "stop_when_idle_secs = 25");
    std::fs::write(&config, idle_stop).expect("config");
    // Not --quiet: the loader's log says when the workers wait, and how long.
    let launch = spawn_logged(
        sparrow()
            .args(["launch", "--config", &config, "--shards", "2", "--workers", "2"])
            .args(["--set", "cluster.heartbeat_timeout_ms=1500", "--set", "cluster.progress_timeout_ms=4000"])
            .args(["--set", &format!("cluster.sync={sync:?}")])
            .env("RUST_LOG", "warn,sparrow_cluster::loader=debug"),
    );
    // Ordered by the loader's wait states: the first half is handed out and
    // the topic is quiet; then the loader answered `waiting` 12 times in a
    // row, each after half a call's deadline (3 s): with two workers, over
    // three deadlines of quiet and past the progress timeout (4 s).
    launch.log.wait_for_line(&["the training data is quiet"], Duration::from_secs(120));
    launch.log.wait_for_line(&["(12 since the last batch)"], Duration::from_secs(120));
    broker.produce("quiet", 2, &second);
    let (out, stderr) = launch.finish();
    assert!(out.status.success(), "{stderr}");
    let json = last_json(&out);
    assert_eq!((&json["stream_records"], &json["train_rows"]), (&8000.into(), &8000.into()), "{json} {stderr}");
    assert_eq!(json["restarts"]["worker"], 0, "{stderr}");
}

/// A broker that stops answering (SIGSTOP) for longer than
/// `stop_when_idle_secs` is an outage, not a quiet topic: the job waits it
/// out and trains what is produced after it. (Before, the stall counted as
/// idle time and the job ended at SIGCONT with half the records.) In a
/// cluster, so that the stall is measured by events: the loader answers the
/// two workers `waiting` every half call deadline (0.75 s) all through it.
#[test]
fn a_stalled_broker_is_not_an_idle_topic() {
    let (tmp, broker) = setup("2000");
    broker.produce("stall", 2, &rows(tmp.path(), 0, 1000));
    let config = job(tmp.path(), &broker, Some("stall"), "");
    let launch = spawn_logged(
        sparrow()
            .args(["launch", "--config", &config, "--shards", "1", "--workers", "2"])
            .args(["--set", "data.stream.stop_when_idle_secs=4", "--set", "cluster.heartbeat_timeout_ms=1500"])
            .env("RUST_LOG", "warn,sparrow_cluster::loader=debug"),
    );
    // The first half is trained and the workers wait: stall the broker until
    // 16 `waiting` answers (about 6 s, past stop_when_idle_secs) went by.
    launch.log.wait_for_line(&["the training data is quiet"], Duration::from_secs(120));
    signal(broker.child.id(), "-STOP");
    launch.log.wait_for_line(&["(16 since the last batch)"], Duration::from_secs(120));
    signal(broker.child.id(), "-CONT");
    broker.produce("stall", 2, &rows(tmp.path(), 1000, 2000));
    let (out, stderr) = launch.finish();
    assert!(out.status.success(), "{stderr}");
    let json = last_json(&out);
    assert_eq!((&json["stream_records"], &json["train_rows"]), (&2000.into(), &2000.into()), "{json} {stderr}");
    assert!(stderr.contains("an outage, not counted as idle time"), "{stderr}");
}

/// A child whose stderr a reader thread gathers into `log`.
struct Logged {
    child: Child,
    log: Log,
    reader: std::thread::JoinHandle<()>,
}

impl Logged {
    /// Waits for the child to exit and for its stderr to close: its output,
    /// and its log with every line read. (Read at once after the exit, the
    /// log could still lack the last lines: the "job checkpointed" line
    /// went missing that way.)
    fn finish(self) -> (Output, String) {
        let out = self.child.wait_with_output().expect("sparrow");
        self.reader.join().expect("log reader");
        (out, self.log.text())
    }
}

/// `command` started with its stdout piped and its stderr collected.
fn spawn_logged(command: &mut std::process::Command) -> Logged {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start sparrow");
    let log = Log::default();
    let reader = log.collect(child.stderr.take().expect("stderr"));
    Logged { child, log, reader }
}

/// `train` on `config` with `stop_when_idle_secs = idle_secs`, its log
/// collected, once its reader has read every partition to `offsets` (as
/// the reader's debug line lists them) and waits for more.
fn train_waiting_at_the_end(config: &str, idle_secs: u64, offsets: &str) -> Logged {
    let text = std::fs::read_to_string(config).expect("config");
    let idle = format!("stop_when_idle_secs = {idle_secs}");
    std::fs::write(config, text.replace("stop_when_idle_secs = 1", &idle)).expect("config");
    let logged =
        spawn_logged(sparrow().args(["train", "--config", config]).env("RUST_LOG", "warn,sparrow_stream=debug"));
    logged.log.wait_for_line(&["every partition read to its end", offsets], Duration::from_secs(120));
    logged
}

/// Rows `from..to` of `dir/data/train.tsv` as a file of their own.
fn rows(dir: &Path, from: usize, to: usize) -> PathBuf {
    let text = std::fs::read_to_string(dir.join("data/train.tsv")).expect("train.tsv");
    let path = dir.join(format!("rows-{from}-{to}.tsv"));
    std::fs::write(&path, text.lines().skip(from).take(to - from).collect::<Vec<_>>().join("\n") + "\n").expect("rows");
    path
}

/// A log that went backwards is an error naming the partition and both
/// offsets, never a silent skip; `on_offset_reset` goes on from the new
/// log's start (counted). Both ways a broker can hide it are caught on
/// resume: its log ends before the checkpoint's offsets, or it was refilled
/// past them with other records (the checkpoint's fingerprint of the last
/// record trained does not match).
#[test]
fn a_log_that_went_backwards_stops_the_job_unless_on_offset_reset_says_otherwise() {
    let (tmp, mut broker) = setup("3000");
    broker.produce("reset", 2, &rows(tmp.path(), 0, 1000));
    let config = job(tmp.path(), &broker, Some("reset"), "");
    let first = ok_json(&train(&config, &[]));
    assert_eq!(first["stream_offsets"], serde_json::json!({"0": 500, "1": 500}));
    assert_eq!((&first["stream_gap_records"], &first["stream_offset_resets"]), (&0.into(), &0.into()));
    let checkpoint = first["checkpoint"].as_str().expect("checkpoint").to_string();
    // Each resume saves elsewhere: the first checkpoint stays as it is.
    let runs = std::cell::Cell::new(0);
    let resume = |extra: &[&str]| {
        runs.set(runs.get() + 1);
        let dir = format!("checkpoint.dir={:?}", tmp.path().join(format!("resumed-{}", runs.get())));
        train(&config, &[&["--resume", checkpoint.as_str(), "--set", &dir], extra].concat())
    };

    // Restarted empty, then 300 records: the log ends before the offsets.
    broker.restart_empty();
    broker.produce("reset", 2, &rows(tmp.path(), 1000, 1300));
    let out = resume(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for needle in ["topic \"reset\" partition 0", "the log ends at offset 150, before the checkpoint's offset 500"] {
        assert!(stderr.contains(needle), "{needle:?} in {stderr}");
    }
    assert!(stderr.contains("data.stream.on_offset_reset"), "{stderr}");
    let earliest = ok_json(&resume(&["--set", "data.stream.on_offset_reset=\"earliest\""]));
    assert_eq!(earliest["stream_offsets"], serde_json::json!({"0": 150, "1": 150}));
    assert_eq!((&earliest["stream_records"], &earliest["train_rows"]), (&1300.into(), &300.into()));
    assert_eq!(earliest["stream_offset_resets"], 2);

    // Restarted empty, then 1200 records: past the offsets, other records.
    broker.restart_empty();
    broker.produce("reset", 2, &rows(tmp.path(), 1000, 2200));
    let out = resume(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("the record at offset 499 is not the one read there before"), "{stderr}");
    let earliest = ok_json(&resume(&["--set", "data.stream.on_offset_reset=\"earliest\""]));
    assert_eq!(earliest["stream_offsets"], serde_json::json!({"0": 600, "1": 600}));
    assert_eq!((&earliest["train_rows"], &earliest["stream_offset_resets"]), (&1200.into(), &2.into()));
}

/// A broker restarted empty while a run reads (then refilled past the
/// reader's offsets) is found at once: with `on_offset_reset = "earliest"`
/// every record of the new log is trained, and the resets are counted.
/// (Before, the reader went on at its old offsets: 1,000 of the new log's
/// 1,500 records were skipped without a word.)
#[test]
fn a_broker_restarted_empty_during_a_run_is_found_and_every_new_record_trained() {
    let (tmp, mut broker) = setup("2500");
    broker.produce("restart", 2, &rows(tmp.path(), 0, 1000));
    let config = job(tmp.path(), &broker, Some("restart"), "on_offset_reset = \"earliest\"");
    let train = train_waiting_at_the_end(&config, 4, "0: 500, 1: 500");
    broker.restart_empty();
    broker.produce("restart", 2, &rows(tmp.path(), 1000, 2500));
    let (out, stderr) = train.finish();
    assert!(out.status.success(), "{stderr}");
    let json = last_json(&out);
    assert_eq!(json["stream_offsets"], serde_json::json!({"0": 750, "1": 750}), "{stderr}");
    assert_eq!((&json["train_rows"], &json["stream_offset_resets"]), (&2500.into(), &2.into()), "{json} {stderr}");
    assert!(stderr.contains("the log went backwards") && stderr.contains("on_offset_reset"), "{stderr}");
}

/// Offsets a broker skips are counted and, on a topic that is not
/// compacted, stop the job by default. tansu 0.6.0 answers a fetch that
/// starts inside a record batch from the next batch on: a run resumed at
/// offset 256 of batches of 100 gets 300 on, and 44 records are lost.
/// (Before, that was one warning, exit 0 and the full offsets reported.)
/// On a topic whose cleanup.policy is `compact` the gap is counted only.
#[test]
fn offsets_the_broker_skips_are_counted_and_stop_the_job_unless_on_gap_is_skip() {
    let (tmp, broker) = setup("1000");
    // A compacted topic: its cleanup.policy, as the broker's DescribeConfigs
    // gives it, makes the same gap compaction's work.
    let url = format!("tcp://{}", broker.addr);
    let create = std::process::Command::new(common::kafka::tansu())
        .args(["topic", "create", "compacted", "--broker", &url, "--partitions", "1"])
        .args(["--config", "cleanup.policy=compact"])
        .output()
        .expect("tansu topic create");
    assert!(create.status.success(), "{}", String::from_utf8_lossy(&create.stderr));
    // Resumed at offset 256 of a topic of batches of 100 records.
    let resumed_inside_a_batch = |topic: &str, extra: &[&str]| {
        let out = sparrow()
            .args(["produce", "--brokers", &broker.addr, "--topic", topic, "--batch-records", "100"])
            .args(["--from", &tmp.path().join("data/train.tsv").display().to_string()])
            .output()
            .expect("produce");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let config = job(tmp.path(), &broker, Some(topic), "");
        let first = ok_json(&train(&config, &["--set", "train.max_steps=1"]));
        assert_eq!(first["stream_offsets"], serde_json::json!({"0": 256}));
        let checkpoint = first["checkpoint"].as_str().expect("checkpoint").to_string();
        let dir = format!("checkpoint.dir={:?}", tmp.path().join(format!("resumed-{topic}")));
        train(&config, &[&["--resume", checkpoint.as_str(), "--set", &dir], extra].concat())
    };
    let compacted = ok_json(&resumed_inside_a_batch("compacted", &[]));
    assert_eq!((&compacted["train_rows"], &compacted["stream_gap_records"]), (&700.into(), &44.into()));
    let resume = |dir: &str, extra: &[&str]| resumed_inside_a_batch(dir, extra);
    let out = resume("batched", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for needle in ["topic \"batched\" partition 0", "offsets 256..300 (44 records) were skipped", "on_gap"] {
        assert!(stderr.contains(needle), "{needle:?} in {stderr}");
    }
    let skipped = ok_json(&resume("skipped", &["--set", "data.stream.on_gap=\"skip\""]));
    assert_eq!(skipped["stream_offsets"], serde_json::json!({"0": 1000}));
    assert_eq!((&skipped["train_rows"], &skipped["stream_gap_records"]), (&700.into(), &44.into()), "{skipped}");
    assert_eq!(skipped["stream_records"], 956);
}

/// SIGTERM to `launch` while the topic is quiet ends the data where it is:
/// the job checkpoints the offsets it trained to and exits 143, and a run
/// resumed from that checkpoint trains only what came after.
#[test]
fn sigterm_to_a_cluster_job_on_a_quiet_topic_checkpoints_its_offsets() {
    let (tmp, broker) = setup("2000");
    broker.produce("stopped", 2, &rows(tmp.path(), 0, 1000));
    let config = job(tmp.path(), &broker, Some("stopped"), "");
    let launch = spawn_logged(
        sparrow()
            .args(["launch", "--config", &config, "--shards", "1", "--workers", "2"])
            .args(["--set", "data.stream.stop_when_idle_secs=0"])
            .env("RUST_LOG", "warn,sparrow_cluster::loader=info"),
    );
    launch.log.wait_for_line(&["the training data is quiet"], Duration::from_secs(120));
    signal(launch.child.id(), "-TERM");
    let (out, stderr) = launch.finish();
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("the job checkpointed (") && stderr.contains("continue with --resume"), "{stderr}");
    let json = last_json(&out);
    assert_eq!(json["stream_offsets"], serde_json::json!({"0": 500, "1": 500}), "{json}");
    let checkpoint = json["checkpoint"].as_str().expect("a checkpoint").to_string();
    broker.produce("stopped", 2, &rows(tmp.path(), 1000, 2000));
    let resumed = ok_json(&train(&config, &["--resume", &checkpoint]));
    assert_eq!((&resumed["train_rows"], &resumed["stream_records"]), (&1000.into(), &2000.into()), "{resumed}");
}
