//! What a hostile but honest user found (issue 11), one test per scenario:
//! every command must end — with a clear error naming the key, file or step
//! where the input is bad — and never lose what was trained.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary under test; `SPARROW_TEST_BIN` points these scenarios at
/// another build (to show that they fail on an older one).
fn sparrow_bin() -> String {
    std::env::var("SPARROW_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_sparrow").to_string())
}

/// Runs `sparrow args…` in `dir`, killing it (and failing the test) if it
/// has not ended within `limit`: a hang is a failure, never a stuck suite.
fn run_in(dir: &Path, args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(sparrow_bin())
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sparrow");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_thread = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stdout.read_to_end(&mut b);
        b
    });
    let err_thread = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stderr.read_to_end(&mut b);
        b
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let err = err_thread.join().unwrap_or_default();
            panic!("sparrow {args:?} did not end within {limit:?}; stderr:\n{}", String::from_utf8_lossy(&err));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_thread.join().unwrap_or_default(),
        stderr: err_thread.join().unwrap_or_default(),
    }
}

const MINUTE: Duration = Duration::from_secs(60);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn last_json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last stdout line is not JSON ({e}): {stdout}\nstderr: {}", stderr(out)))
}

fn ok(out: &Output) {
    assert!(out.status.success(), "exit {:?}\nstderr: {}", out.status, stderr(out));
}

/// The command failed (non-zero exit, no panic) and its stderr holds every needle.
fn fails_with(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected failure; stderr: {err}");
    assert!(!err.contains("panicked"), "a panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`: {err}");
    }
}

/// A scratch directory with generated data (`data/train.tsv`, `data/test.tsv`)
/// and a small DLRM config `job.toml` whose checkpoints go to `ck/`.
struct Job {
    tmp: tempfile::TempDir,
}

impl Job {
    fn new(train_rows: u32) -> Job {
        let tmp = tempfile::tempdir().expect("tmp");
        let rows = train_rows.to_string();
        let out = run_in(
            tmp.path(),
            &["gen", "--out", "data", "--train-rows", &rows, "--test-rows", "2000", "--seed", "3"],
            MINUTE,
        );
        ok(&out);
        let job = Job { tmp };
        job.write_config("job.toml", "");
        job
    }

    fn dir(&self) -> &Path {
        self.tmp.path()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir().join(name)
    }

    fn write_config(&self, name: &str, extra: &str) -> String {
        std::fs::write(
            self.path(name),
            format!(
                r#"
[data]
train = "data/train.tsv"
test = "data/test.tsv"
[model]
kind = "dlrm"
embedding_dim = 8
hidden = [32, 16]
bottom_hidden = [16]
[train]
batch_size = 256
log_interval_steps = 4
[checkpoint]
dir = "ck"
[cluster]
heartbeat_interval_ms = 100
heartbeat_timeout_ms = 2000
{extra}
"#
            ),
        )
        .expect("write config");
        name.to_string()
    }

    fn run(&self, args: &[&str]) -> Output {
        run_in(self.dir(), args, 2 * MINUTE)
    }
}

// ---- 1. A NaN output hangs nothing --------------------------------------

/// `train` with a learning rate that makes the model diverge stops with an
/// error naming the step and the parameter, saves the model it had before
/// that step, and `eval`/`predict` of a diverged model end too.
#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_the_last_finite_model() {
    let job = Job::new(8000);
    let out = job.run(&["train", "--config", "job.toml", "--set", "dense_optimizer.learning_rate=1e10", "--quiet"]);
    fails_with(&out, &["non-finite", "at step 2", "top.params", "train.on_non_finite"]);
    // The model saved is step 1's: finite, so evaluation is meaningful.
    let latest = std::fs::read_to_string(job.path("ck/LATEST")).expect("a checkpoint was written");
    assert!(latest.trim().ends_with("000001"), "{latest}");
    let eval = job.run(&["eval", "--checkpoint", "ck", "--data", "data/test.tsv"]);
    ok(&eval);
    let predict = job.run(&["predict", "--checkpoint", "ck", "--data", "data/test.tsv", "--out", "p.txt"]);
    ok(&predict);
    assert_eq!(std::fs::read_to_string(job.path("p.txt")).expect("predictions").lines().count(), 2000);
}

#[test]
fn skip_batch_goes_on_past_non_finite_batches_and_counts_them() {
    let job = Job::new(8000);
    let out = job.run(&[
        "train",
        "--config",
        "job.toml",
        "--set",
        "dense_optimizer.learning_rate=1e10",
        "--set",
        "train.on_non_finite=skip_batch",
        "--quiet",
    ]);
    ok(&out);
    let json = last_json(&out);
    let steps = json["steps"].as_u64().expect("steps");
    let skipped = json["skipped_batches"].as_u64().expect("skipped_batches");
    assert_eq!(steps, 8000_u64.div_ceil(256), "every batch consumed");
    assert_eq!(skipped, steps - 1, "every batch after the first diverged: {json}");
    assert_eq!(json["train_rows"], 256, "only the first batch trained: {json}");
    assert!(stderr(&out).contains("skipping the batch of step 2"), "{}", stderr(&out));
}

/// The cluster hung forever here: worker 0 spun in AUC while its heartbeats
/// kept the coordinator content. Now the worker stops naming the step, and
/// the whole job ends.
#[test]
fn a_diverging_cluster_job_ends_with_the_workers_error() {
    let job = Job::new(8000);
    let out = job.run(&[
        "launch",
        "--config",
        "job.toml",
        "--shards",
        "1",
        "--workers",
        "2",
        "--set",
        "dense_optimizer.learning_rate=1e10",
        "--quiet",
    ]);
    fails_with(&out, &["the job failed", "non-finite", "at step"]);
}
