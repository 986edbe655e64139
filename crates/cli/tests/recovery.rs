//! A `launch` job survives the death of any role and ends with exactly the
//! model it would have had (issue 13): at `train.pipeline_depth = 0` with one
//! worker the test AUC and row counts equal those of the same job never
//! interrupted (`sparrow train`, which `launch` 1×1 equals bit for bit).
//!
//! Deaths are injected by name (`FAILPOINTS`, the `fail` crate; see
//! `crates/cluster/src/faults.rs`) so that they land at a known step, not at
//! a time racing the job; one test kills a shard with a real SIGKILL.

mod common;

use common::{Scenario, collect_lines, config, data, last_json, scenario, signal, sparrow, wait_with_timeout};
use std::path::Path;
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn as_is(text: String, _: &Path) -> String {
    text
}

/// `sparrow launch` (2 shards, 1 worker) with `FAILPOINTS` set.
fn launch(config: &str, failpoints: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = sparrow();
    command.args(["launch", "--config", config, "--shards", "2", "--workers", "1"]).args(args);
    if !failpoints.is_empty() {
        command.env("FAILPOINTS", failpoints);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("launch")
}

/// The job recovered: exit 0, the uninterrupted job's model, `role` restarted.
fn assert_recovered_exactly(out: &Output, whole: &serde_json::Value, role: &str, restarts: u64) -> serde_json::Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json = last_json(out);
    assert_eq!(json["test_auc"], whole["test_auc"], "bit for bit the uninterrupted job's AUC\n{stderr}");
    assert_eq!(json["embedding_rows"], whole["embedding_rows"]);
    assert_eq!(json["train_rows"], whole["train_rows"]);
    assert_eq!(json["steps"], whole["steps"]);
    assert_eq!(json["restarts"][role], restarts, "{}", json["restarts"]);
    assert!(json["checkpoints_committed"].as_u64().is_some_and(|n| n >= 6), "{}", json["checkpoints_committed"]);
    assert!(json["recovery_secs"].as_f64().is_some_and(|s| s > 0.0), "{}", json["recovery_secs"]);
    json
}

#[test]
fn a_shard_that_dies_mid_training_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    // Both shards die at their 171st push (step 171): back to step 150.
    let out = launch(&config, "shard.push=170*off->return", &[], &[]);
    let json = assert_recovered_exactly(&out, &whole, "shard", 2);
    assert_eq!(json["steps_replayed"], 20, "steps 151..=170 were trained twice");
}

#[test]
fn a_worker_that_dies_mid_training_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    let out = launch(&config, "worker.step=120*off->return", &[], &[]);
    let json = assert_recovered_exactly(&out, &whole, "worker", 1);
    // It died after step 121; the coordinator counts what its heartbeats
    // (every 100 ms) last said: up to 21 steps past the checkpoint at 100.
    let replayed = json["steps_replayed"].as_u64().expect("replayed");
    assert!(replayed <= 21, "{replayed}");
}

#[test]
fn the_loader_dying_mid_training_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    let out = launch(&config, "loader.next_batch=230*off->return", &[], &[]);
    assert_recovered_exactly(&out, &whole, "loader", 1);
}

#[test]
fn the_coordinator_dying_mid_checkpoint_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    // The third checkpoint (step 150): every part written and verified, the
    // manifest not yet renamed into place. The version is never read.
    let out = launch(&config, "coordinator.commit=2*off->return", &[], &[]);
    assert_recovered_exactly(&out, &whole, "coordinator", 1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("goes back to") && stderr.contains("ckpt-000000000100"), "{stderr}");
}

#[test]
fn a_shard_dying_while_writing_its_part_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    // The shards' parts of the second checkpoint are on disk, not reported.
    let out = launch(&config, "shard.part_written=1*off->return", &[], &[]);
    assert_recovered_exactly(&out, &whole, "shard", 2);
}

#[test]
fn a_second_death_during_recovery_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(as_is);
    // The worker dies; restoring the checkpoint, both shards die too.
    let out = launch(&config, "worker.step=120*off->return;shard.restore=return", &[], &[]);
    let json = assert_recovered_exactly(&out, &whole, "worker", 1);
    assert_eq!(json["restarts"]["shard"], 2, "{}", json["restarts"]);
}

#[test]
fn a_role_that_keeps_dying_spends_the_budget_and_the_last_checkpoint_stays_intact() {
    let tmp = tempfile::tempdir().expect("tmp");
    data(tmp.path());
    let config = config(tmp.path(), "max_restarts = 2");
    // Every shard process dies at its 61st push, restarted ones too: at
    // steps 61, 111 (back to 50, then 100), then 161 is one death too many.
    let out = launch(&config, "shard.push=60*off->return", &[], &[("SPARROW_FAILPOINTS_ON_RESTART", "1")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let last = &stderr[stderr.rfind("error: the job failed").expect("the job's error")..];
    assert!(last.contains("shard") && last.contains("died 3 time(s): cluster.max_restarts = 2 is spent"), "{stderr}");
    // The last committed checkpoint (step 150) is intact: it evaluates.
    let ckpt = tmp.path().join("ckpt");
    let latest = std::fs::read_to_string(ckpt.join("LATEST")).expect("LATEST");
    assert_eq!(latest.trim(), "ckpt-000000000150");
    let eval = sparrow()
        .args(["eval", "--checkpoint", &ckpt.display().to_string()])
        .args(["--data", &tmp.path().join("data/test.tsv").display().to_string()])
        .output()
        .expect("eval");
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    let eval = last_json(&eval);
    assert_eq!(eval["checkpoint_step"], 150);
    assert!(eval["auc"].as_f64().is_some_and(|a| a > 0.5), "{eval}");
}

#[test]
fn a_shard_on_the_ssd_tier_restarts_from_the_checkpoint() {
    let Scenario { config, whole, tmp } = scenario(|text, dir| {
        let path = dir.join("ssd").display().to_string();
        let tier = format!("storage = \"ssd\"\npath = {path:?}\ncache_capacity_rows = 4000");
        text.replace("learning_rate = 0.05", &format!("learning_rate = 0.05\n{tier}"))
    });
    // The baseline's tier went to the same path: start the job's afresh.
    std::fs::remove_dir_all(tmp.path().join("ssd")).expect("remove");
    let out = launch(&config, "shard.push=170*off->return", &[], &[]);
    let json = assert_recovered_exactly(&out, &whole, "shard", 2);
    assert!(json["ssd_writebacks"].as_u64().is_some_and(|n| n > 0), "{json}");
    // The dead processes' working files are gone; the last generation's are there.
    let mut dirs: Vec<String> = std::fs::read_dir(tmp.path().join("ssd"))
        .expect("ssd dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .collect();
    dirs.sort();
    // Two deaths, two new generations (each shard's own notice).
    assert_eq!(dirs, ["shard-0-g3", "shard-1-g3"]);
}

#[test]
fn incremental_checkpoints_recover_exactly_and_write_less() {
    let Scenario { config, whole, tmp } =
        scenario(|text, _| text.replace("every_steps = 50", "every_steps = 50\nincremental = true\nfull_every = 4"));
    let out = launch(&config, "shard.push=270*off->return", &["--set", "checkpoint.keep=1"], &[]);
    assert_recovered_exactly(&out, &whole, "shard", 2);
    // Its generation 2 went back to an incremental version (step 250: full at
    // 200, deltas at 250) and the chain it needs survived keep = 1.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("incremental"), "{stderr}");
    let latest = std::fs::read_to_string(tmp.path().join("ckpt/LATEST")).expect("LATEST");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(tmp.path().join("ckpt").join(latest.trim()).join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    assert!(manifest["base"].is_string(), "the last version is incremental: {manifest}");
}

/// Two workers cannot replay bit for bit (which worker takes which batch,
/// and how many per round, varies from run to run), so what is exact here is
/// the data: every training row is trained (`train_rows`), the replicas end
/// identical, and only steps past the checkpoint are replayed. The AUC is a
/// sanity bound, not a comparison: uninterrupted runs of this job alone
/// spread over 0.620–0.651 (ten runs, half of them beside two busy cores, on
/// the 2-core machine of issue 40's first session), so two of them can be
/// 0.03 apart with nothing wrong. Within 0.05 of an uninterrupted run and
/// above 0.58 (an untrained model scores 0.5, one epoch of this job 0.618).
#[test]
fn two_workers_recover_within_the_spread_of_uninterrupted_runs() {
    let tmp = tempfile::tempdir().expect("tmp");
    data(tmp.path());
    let config = config(tmp.path(), "");
    let plain =
        sparrow().args(["launch", "--config", &config, "--shards", "2", "--workers", "2"]).output().expect("launch");
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let plain = last_json(&plain);
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "2"])
        .env("FAILPOINTS", "worker.step=100*off->return")
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json = last_json(&out);
    assert_eq!(json["restarts"]["worker"], 2, "both workers died at their step 101: {}", json["restarts"]);
    assert_eq!(json["replicas_identical"], true);
    assert_eq!(json["train_rows"], plain["train_rows"], "every row trained");
    assert_eq!(json["train_rows"], 80_000, "four epochs of 20 000 rows");
    // Each died after its 101st step; the checkpoint before is the job's
    // step 50 or 100, so at most 101 of each worker's steps come again.
    let replayed = json["steps_replayed"].as_u64().expect("replayed");
    assert!((1..=2 * 101).contains(&replayed), "{replayed}");
    let (a, b) = (json["test_auc"].as_f64().expect("auc"), plain["test_auc"].as_f64().expect("auc"));
    assert!(a > 0.58 && (a - b).abs() < 0.05, "{a} vs {b}");
}

/// A launch whose stderr is collected while it runs.
struct Running {
    child: std::process::Child,
    log: Arc<Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

impl Running {
    fn start(config: &str) -> Running {
        let mut child = sparrow()
            .args(["launch", "--config", config, "--shards", "2", "--workers", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("launch");
        let log = Arc::new(Mutex::new(String::new()));
        let reader = collect_lines(child.stderr.take().expect("stderr"), log.clone());
        Running { child, log, reader }
    }

    /// Shard 1's pid once the checkpoint at step 100 is committed.
    fn shard_after_checkpoint(&self) -> u32 {
        let start = Instant::now();
        loop {
            let text = self.log.lock().expect("log").clone();
            let pid = text.lines().find_map(|l| l.strip_prefix("launch: shard 1 is pid ")?.trim().parse::<u32>().ok());
            if let Some(pid) = pid
                && text.contains("checkpoint at step 100 committed")
            {
                return pid;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint: {text}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The final JSON and the log, once launch exited (successfully).
    fn finish(mut self) -> (serde_json::Value, String) {
        let stdout = {
            use std::io::Read;
            let mut s = String::new();
            self.child.stdout.take().expect("stdout").read_to_string(&mut s).expect("read");
            s
        };
        let status = self.child.wait().expect("wait");
        self.reader.join().expect("reader");
        let text = self.log.lock().expect("log").clone();
        assert!(status.success(), "{text}");
        (serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("json"), text)
    }
}

/// The one real signal: a shard killed with SIGKILL once a checkpoint is
/// committed, wherever the job is then. Its replacement listens on another
/// port; the others find it through the coordinator.
#[test]
fn a_shard_killed_with_sigkill_after_a_checkpoint_leaves_the_model_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(|text, _| text.replace("epochs = 4", "epochs = 10"));
    let job = Running::start(&config);
    signal(job.shard_after_checkpoint(), "-9");
    let (json, text) = job.finish();
    assert_eq!(json["test_auc"], whole["test_auc"], "{text}");
    assert_eq!(json["embedding_rows"], whole["embedding_rows"]);
    assert_eq!(json["train_rows"], whole["train_rows"]);
    assert_eq!(json["restarts"]["shard"], 1);
    assert!(text.contains("shard 1 died (signal: 9 (SIGKILL)); restarting it"), "{text}");
    let addresses: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("[shard 1] ")?.split("shard 1: listening on ").nth(1)).collect();
    assert_eq!(addresses.len(), 2, "{text}");
    assert_ne!(addresses[0], addresses[1], "the replacement listens elsewhere");
}

/// A shard that hangs (SIGSTOP) stops answering heartbeats: the coordinator
/// reports it, launch kills and restarts it, the model is exact.
#[test]
fn a_hung_shard_is_restarted_and_the_model_stays_exact() {
    let Scenario { config, whole, tmp: _tmp } = scenario(|text, _| text.replace("epochs = 4", "epochs = 10"));
    let job = Running::start(&config);
    signal(job.shard_after_checkpoint(), "-STOP");
    let (json, text) = job.finish();
    assert_eq!(json["test_auc"], whole["test_auc"], "{text}");
    assert_eq!(json["train_rows"], whole["train_rows"]);
    assert_eq!(json["restarts"]["shard"], 1);
    assert!(text.contains("shard 1 stopped answering; killing it"), "{text}");
}

/// A multi-host job (every role started by hand, no `launch`): a shard is
/// killed and started again from outside with the same command line, as
/// Kubernetes would. It registers again under its index, the job goes back
/// to the last checkpoint and ends with the uninterrupted model.
#[test]
fn a_shard_restarted_from_outside_rejoins_a_job_without_launch() {
    let Scenario { config, whole, tmp: _tmp } = scenario(|text, _| text.replace("epochs = 4", "epochs = 10"));
    let role = |args: &[&str]| {
        sparrow().args(args).env_remove("SPARROW_AUTH_TOKEN").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()
    };
    let mut coordinator =
        role(&["coordinator", "--config", &config, "--shards", "2", "--workers", "1", "--listen", "127.0.0.1:0"])
            .expect("coordinator");
    let log = Arc::new(Mutex::new(String::new()));
    let coordinator_out = Arc::new(Mutex::new(String::new()));
    collect_lines(coordinator.stdout.take().expect("stdout"), coordinator_out.clone());
    collect_lines(coordinator.stderr.take().expect("stderr"), log.clone());
    let start = Instant::now();
    let address = loop {
        let out = coordinator_out.lock().expect("out").clone();
        if let Some(a) = out.lines().find_map(|l| l.strip_prefix("listening on ")) {
            break a.to_string();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no coordinator");
        std::thread::sleep(Duration::from_millis(10));
    };
    let shard_args = |i: &'static str| {
        vec!["shard".to_string(), "--coordinator".into(), address.clone(), "--index".into(), i.into()]
    };
    let start_role = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = role(&args).expect("role");
        collect_lines(child.stderr.take().expect("stderr"), log.clone());
        child
    };
    let mut shard0 = start_role(shard_args("0"));
    let mut shard1 = start_role(shard_args("1"));
    let mut loader = start_role(vec!["loader".into(), "--coordinator".into(), address.clone()]);
    let mut worker = role(&["worker", "--coordinator", &address, "--index", "0"]).expect("worker");
    collect_lines(worker.stderr.take().expect("stderr"), log.clone());
    let worker_out = Arc::new(Mutex::new(String::new()));
    let reader = collect_lines(worker.stdout.take().expect("stdout"), worker_out.clone());
    while !log.lock().expect("log").contains("checkpoint at step 100 committed") {
        assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint: {}", log.lock().expect("log"));
        std::thread::sleep(Duration::from_millis(5));
    }
    shard1.kill().expect("kill shard 1");
    let _ = shard1.wait();
    let mut shard1 = start_role(shard_args("1"));
    let status = wait_with_timeout(&mut worker, Duration::from_secs(120));
    reader.join().expect("reader");
    let text = log.lock().expect("log").clone();
    assert!(status.success(), "{text}");
    let summary: serde_json::Value =
        serde_json::from_str(worker_out.lock().expect("out").lines().last().unwrap_or_default()).expect("json");
    assert_eq!(summary["test_auc"], whole["test_auc"], "{text}");
    assert_eq!(summary["train_rows"], whole["train_rows"]);
    assert_eq!(summary["embedding_rows"], whole["embedding_rows"]);
    assert!(text.contains("every role goes back to"), "{text}");
    for child in [&mut coordinator, &mut shard0, &mut shard1, &mut loader] {
        assert!(wait_with_timeout(child, Duration::from_secs(20)).success(), "{text}");
    }
}

/// A malformed `FAILPOINTS` value is an error naming the entry (it used to panic).
#[test]
fn a_malformed_failpoints_value_is_an_error_naming_it() {
    for (value, says) in [("shard.push=garbage", "unrecognized command"), ("nonsense", "is not NAME=ACTIONS")] {
        let out = sparrow().args(["gen", "--help"]).env("FAILPOINTS", value).output().expect("sparrow");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(&format!("FAILPOINTS: `{value}`")) && stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// Half rows (`embedding.dtype = "f16"`: shards store, checkpoint and send
/// 16-bit vectors), rounded stochastically (each row's update count, which
/// the draws hash, restored from the checkpoint), and bf16 products
/// (`model.precision = "bf16"`) recover exactly too: a shard and then the
/// worker die, and the job ends with the uninterrupted half-precision model.
#[test]
fn half_rows_and_bf16_products_recover_exactly() {
    let Scenario { config, whole, tmp } = scenario(|text, _| {
        text.replace("learning_rate = 0.05", "learning_rate = 0.05\ndtype = \"f16\"\nrounding = \"stochastic\"")
            .replace("kind = \"dlrm\"", "kind = \"dlrm\"\nprecision = \"bf16\"")
    });
    let out = launch(&config, "shard.push=170*off->return;worker.step=240*off->return", &[], &[]);
    let json = assert_recovered_exactly(&out, &whole, "shard", 2);
    assert_eq!(json["restarts"]["worker"], 1, "{}", json["restarts"]);
    // The checkpoints hold half rows: the job ran in the mode it names.
    let ckpt = tmp.path().join("ckpt");
    let latest = std::fs::read_to_string(ckpt.join("LATEST")).expect("LATEST");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join(latest.trim()).join("manifest.json")).expect("manifest"))
            .expect("json");
    assert_eq!(manifest["embedding_dtype"], "f16", "{manifest}");
}
