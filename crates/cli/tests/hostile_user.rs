//! What a hostile but honest user found (issue 11), one test per scenario:
//! every command must end — with a clear error naming the key, file or step
//! where the input is bad — and never lose what was trained.

mod common;

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
    Output { status, stdout: out_thread.join().unwrap_or_default(), stderr: err_thread.join().unwrap_or_default() }
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

    /// `sparrow train --config job.toml --set S… --quiet`.
    fn train(&self, sets: &[&str]) -> Output {
        self.run(&with_sets(&["train", "--config", "job.toml"], sets))
    }

    /// `sparrow launch --config job.toml --shards S --workers W --set S… --quiet`.
    fn launch(&self, shards: &str, workers: &str, sets: &[&str]) -> Output {
        self.run(&with_sets(&["launch", "--config", "job.toml", "--shards", shards, "--workers", workers], sets))
    }
}

/// `command` with `--set S` for each of `sets`, then `--quiet`.
fn with_sets<'a>(command: &[&'a str], sets: &[&'a str]) -> Vec<&'a str> {
    let mut args = command.to_vec();
    for set in sets {
        args.extend(["--set", set]);
    }
    args.push("--quiet");
    args
}

// ---- 1. A NaN output hangs nothing --------------------------------------

/// `train` with a learning rate that makes the model diverge stops with an
/// error naming the step and the parameter, saves the model it had before
/// that step, and `eval`/`predict` of a diverged model end too.
#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_the_last_finite_model() {
    let job = Job::new(8000);
    let out = job.train(&["dense_optimizer.learning_rate=1e10"]);
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
    let out = job.train(&["dense_optimizer.learning_rate=1e10", "train.on_non_finite=skip_batch"]);
    ok(&out);
    let json = last_json(&out);
    let steps = json["steps"].as_u64().expect("steps");
    let skipped = json["skipped_batches"].as_u64().expect("skipped_batches");
    assert_eq!(steps, 8000_u64.div_ceil(256), "every batch consumed");
    assert_eq!(skipped, steps - 1, "every batch after the first diverged: {json}");
    assert_eq!(json["train_rows"], 256, "only the first batch trained: {json}");
    assert!(stderr(&out).contains("skipping the batch of step 2"), "{}", stderr(&out));
}

/// `skip_batch` in a cluster job: with one worker it skips the batches
/// `train` skips and ends with `train`'s model; with two, a worker that
/// skips meets the dense sum with nothing, so no one waits, and every
/// skipped batch is counted.
#[test]
fn skip_batch_in_a_cluster_job_skips_what_train_skips_and_keeps_the_workers_in_step() {
    let job = Job::new(8000);
    let sets = |dir: &'static str| ["dense_optimizer.learning_rate=1e10", "train.on_non_finite=skip_batch", dir];
    let single = job.train(&sets("checkpoint.dir=\"ck-train\""));
    ok(&single);
    let single = last_json(&single);
    let out = job.launch("2", "1", &sets("checkpoint.dir=\"ck-launch\""));
    ok(&out);
    let cluster = last_json(&out);
    for key in ["skipped_batches", "train_rows", "test_auc", "test_logloss"] {
        assert_eq!(cluster[key], single[key], "{key}: launch {cluster}, train {single}");
    }
    // The dense weights of both final checkpoints, byte for byte (the
    // diverged model scores NaN: its AUC alone would prove little).
    let dense = |dir: &str| {
        let latest = std::fs::read_to_string(job.path(&format!("{dir}/LATEST"))).expect("LATEST");
        std::fs::read(job.path(&format!("{dir}/{}/dense.safetensors", latest.trim()))).expect("dense weights")
    };
    assert!(dense("ck-train") == dense("ck-launch"), "launch's dense weights differ from train's");
    let out = job.launch("2", "2", &sets("checkpoint.dir=\"ck-pair\""));
    ok(&out);
    let pair = last_json(&out);
    // The first step trains each worker's batch (a worker the other kept
    // waiting may train another at the same weights); every later batch
    // diverges and is skipped, and none is lost: trained + skipped = all.
    let trained = pair["train_rows"].as_u64().expect("train_rows") / 256;
    assert!(trained >= 2, "{pair}");
    assert_eq!(pair["steps"], 1, "{pair}");
    assert_eq!(pair["skipped_batches"].as_u64(), Some(8000_u64.div_ceil(256) - trained), "{pair}");
    assert_eq!(pair["replicas_identical"], true, "{pair}");
}

/// The cluster hung forever here: worker 0 spun in AUC while its heartbeats
/// kept the coordinator content. Now the worker stops naming the step, and
/// the whole job ends.
#[test]
fn a_diverging_cluster_job_ends_with_the_workers_error() {
    let job = Job::new(8000);
    let out = job.launch("1", "2", &["dense_optimizer.learning_rate=1e10"]);
    fails_with(&out, &["the job failed", "non-finite", "at step"]);
}

// ---- 3. One run per checkpoint directory --------------------------------

/// Starts `sparrow args…` in `dir` in the background (stdout and stderr to files).
fn spawn_in(dir: &Path, args: &[&str]) -> std::process::Child {
    let log = |name: &str| std::fs::File::create(dir.join(name)).expect("log file");
    Command::new(sparrow_bin())
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log("bg.stdout"))
        .stderr(log("bg.stderr"))
        .spawn()
        .expect("spawn sparrow")
}

/// Waits until `path` has at least `lines` lines (a run's metrics).
fn wait_for_lines(path: &Path, lines: usize) {
    let start = Instant::now();
    while std::fs::read_to_string(path).map_or(true, |m| m.lines().count() < lines) {
        assert!(start.elapsed() < MINUTE, "{} never reached {lines} lines", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: u32, sig: &str) {
    let sent = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill");
    assert!(sent.success());
}

#[test]
fn a_second_run_on_a_checkpoint_directory_in_use_is_refused_naming_the_holder() {
    let job = Job::new(4000);
    let long = job.write_config("long.toml", "");
    let mut first = spawn_in(
        job.dir(),
        &[
            "train",
            "--config",
            &long,
            "--set",
            "train.epochs=100000",
            "--set",
            "train.metrics_path=\"m.jsonl\"",
            "--set",
            "checkpoint.every_steps=3",
        ],
    );
    wait_for_lines(&job.path("m.jsonl"), 2);
    let second = job.train(&[]);
    let pid = first.id().to_string();
    let launch = job.launch("1", "1", &[]);
    signal(first.id(), "-KILL");
    let _ = first.wait();
    fails_with(&second, &["checkpoint.dir", "in use by another run", &format!("pid {pid}")]);
    fails_with(&launch, &["checkpoint.dir", "in use by another run", &format!("pid {pid}")]);
    // The lock died with its holder: the directory is usable at once, and the
    // temporaries a killed run may have left are gone.
    ok(&job.train(&["train.max_steps=2"]));
    let leftovers: Vec<String> = std::fs::read_dir(job.path("ck"))
        .expect("ck")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

// ---- 4. predict never overwrites its input ------------------------------

#[test]
fn predict_refuses_an_out_that_is_the_input_or_a_directory() {
    let job = Job::new(3000);
    ok(&job.train(&[]));
    let before = std::fs::read(job.path("data/test.tsv")).expect("test data");
    let same = job.run(&["predict", "--checkpoint", "ck", "--data", "data/test.tsv", "--out", "data/test.tsv"]);
    fails_with(&same, &["--out data/test.tsv", "is the input file"]);
    // Another spelling of the same file.
    let same =
        job.run(&["predict", "--checkpoint", "ck", "--data", "data/test.tsv", "--out", "./data/../data/test.tsv"]);
    fails_with(&same, &["is the input file"]);
    assert_eq!(std::fs::read(job.path("data/test.tsv")).expect("test data"), before, "the input was changed");
    let dir = job.run(&["predict", "--checkpoint", "ck", "--data", "data/test.tsv", "--out", "data"]);
    fails_with(&dir, &["--out data", "is a directory"]);
    let names: Vec<String> = std::fs::read_dir(job.dir())
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert!(!names.iter().any(|n| n.contains("partial")), "{names:?}");
}

// ---- 5. SIGTERM and SIGHUP stop like Ctrl-C ------------------------------

#[test]
fn sigterm_and_sighup_checkpoint_and_exit_like_ctrl_c() {
    for (sig, code) in [("-TERM", 143), ("-HUP", 129)] {
        let job = Job::new(4000);
        let mut child = spawn_in(
            job.dir(),
            &[
                "train",
                "--config",
                "job.toml",
                "--set",
                "train.epochs=100000",
                "--set",
                "train.metrics_path=\"m.jsonl\"",
            ],
        );
        wait_for_lines(&job.path("m.jsonl"), 3);
        signal(child.id(), sig);
        let status = child.wait().expect("wait");
        let err = std::fs::read_to_string(job.path("bg.stderr")).expect("stderr");
        assert_eq!(status.code(), Some(code), "{sig}: {err}");
        assert!(err.contains("saved in") && err.contains("--resume"), "{sig}: {err}");
        let eval = job.run(&["eval", "--checkpoint", "ck", "--data", "data/test.tsv"]);
        ok(&eval);
        assert!(last_json(&eval)["checkpoint_step"].as_u64().expect("step") >= 12, "{sig}");
    }
}

// ---- 6. launch checks its checkpoint directory first ---------------------

#[test]
fn launch_refuses_an_unwritable_checkpoint_directory_before_training() {
    let job = Job::new(3000);
    // A regular file where the directory should be: no one (root included) can create it.
    std::fs::write(job.path("blocker"), "x").expect("file");
    let config = job.write_config("bad.toml", "");
    let started = Instant::now();
    let out = job.run(&[
        "launch",
        "--config",
        &config,
        "--shards",
        "1",
        "--workers",
        "1",
        "--set",
        "checkpoint.dir=\"blocker/ck\"",
        "--quiet",
    ]);
    fails_with(&out, &["checkpoint.dir", "blocker/ck"]);
    assert!(!stderr(&out).contains("is pid"), "children were started: {}", stderr(&out));
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A metrics file or TensorBoard folder that cannot be made fails `train`
/// and `launch` alike, naming the key and the path (one log, one message).
#[test]
fn an_unwritable_metrics_path_or_tensorboard_dir_is_named_by_its_key() {
    let job = Job::new(3000);
    std::fs::write(job.path("blocker"), "x").expect("file");
    for (set, key) in [
        ("train.metrics_path=\"blocker/m.jsonl\"", "train.metrics_path: blocker"),
        ("train.tensorboard_dir=\"blocker/tb\"", "train.tensorboard_dir: blocker/tb"),
    ] {
        fails_with(&job.train(&[set, "checkpoint.dir=\"ck-train\""]), &[key]);
        fails_with(&job.launch("1", "1", &[set, "checkpoint.dir=\"ck-launch\""]), &[key]);
    }
}

// ---- 7, 8, 10. Tokens: never stored, handed to children, made up if absent

#[test]
fn a_configured_token_reaches_launchs_children_and_never_a_checkpoint() {
    let job = Job::new(4000);
    let token = "s3cr3t-token-0123456789abcdef";
    let config = job.write_config("tok.toml", &format!("auth_token = \"{token}\""));
    let out = job.run(&["launch", "--config", &config, "--shards", "1", "--workers", "1", "--quiet"]);
    ok(&out);
    // The checkpoint worker 0 wrote, and one from `train`, hold no token.
    ok(&job.run(&["train", "--config", &config, "--set", "checkpoint.dir=\"ck2\"", "--quiet"]));
    for dir in ["ck", "ck2"] {
        let mut stack = vec![job.path(dir)];
        let mut files = 0;
        while let Some(p) = stack.pop() {
            if p.is_dir() {
                stack.extend(std::fs::read_dir(&p).expect("read").flatten().map(|e| e.path()));
            } else {
                files += 1;
                let bytes = std::fs::read(&p).expect("read");
                assert!(!bytes.windows(token.len()).any(|w| w == token.as_bytes()), "token in {}", p.display());
            }
        }
        assert!(files >= 3, "{dir}: {files} files");
    }
}

#[test]
fn launch_gives_its_children_a_random_token_in_their_environment_only() {
    let job = Job::new(200_000);
    let mut child = spawn_in(job.dir(), &["launch", "--config", "job.toml", "--shards", "1", "--workers", "1"]);
    let start = Instant::now();
    let pid = loop {
        let err = std::fs::read_to_string(job.path("bg.stderr")).unwrap_or_default();
        if let Some(pid) = err.lines().find_map(|l| l.strip_prefix("launch: coordinator is pid ")) {
            break pid.trim().to_string();
        }
        assert!(start.elapsed() < MINUTE, "no coordinator: {err}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    signal(child.id(), "-TERM");
    let _ = child.wait();
    let token = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"SPARROW_AUTH_TOKEN="))
        .map(|t| String::from_utf8_lossy(t).to_string())
        .expect("the coordinator has a token in its environment");
    assert_eq!(token.len(), 32, "{token}");
    assert!(token.chars().all(|c| c.is_ascii_hexdigit()), "{token}");
    assert!(!cmdline.windows(token.len()).any(|w| w == token.as_bytes()), "token on the command line");
}

// ---- 12. Data cannot drive the terminal ----------------------------------

#[test]
fn warnings_escape_control_bytes_from_the_data() {
    let job = Job::new(3000);
    let mut text = std::fs::read_to_string(job.path("data/train.tsv")).expect("train");
    // A label that sets an xterm's title, then rings the bell.
    text.insert_str(0, "\u{1b}]0;pwned\u{7}\t1\t2\n");
    std::fs::write(job.path("data/train.tsv"), text).expect("write");
    let out = job.train(&[]);
    ok(&out);
    let err = stderr(&out);
    assert!(err.contains("skipped malformed row") && err.contains("\\x1b]0;pwned\\x07"), "{err}");
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "raw control bytes on stderr: {err:?}");
}

// ---- 15. Nothing trained is not a success --------------------------------

#[test]
fn an_empty_or_all_bad_training_file_fails_instead_of_training_nothing() {
    let job = Job::new(3000);
    std::fs::write(job.path("empty.tsv"), "").expect("write");
    let bad_rows: String = (0..300).map(|i| format!("label{i}\tnot a row\n")).collect();
    std::fs::write(job.path("bad.tsv"), bad_rows).expect("write");
    let empty = job.train(&["data.train=\"empty.tsv\""]);
    fails_with(&empty, &["empty.tsv", "no training row", "holds no row"]);
    let all_bad = job.train(&["data.train=\"bad.tsv\"", "data.max_bad_rows=1000000"]);
    fails_with(&all_bad, &["bad.tsv", "no training row", "all 300 rows were malformed"]);
    let cluster = job.launch("1", "1", &["data.train=\"empty.tsv\"", "checkpoint.dir=\"ck-launch\""]);
    fails_with(&cluster, &["no training row", "empty.tsv"]);
    // A held-out fraction that leaves no row to train names itself (the
    // file is not empty: it said so).
    let held_out = job.train(&["data.validation=0.999999"]);
    fails_with(&held_out, &["no training row", "no row outside the fraction data.validation = 0.999999"]);
    // A fraction: 300 bad rows among 3000 good ones is 9%.
    let mut mixed = std::fs::read_to_string(job.path("data/train.tsv")).expect("train");
    mixed.push_str(&std::fs::read_to_string(job.path("bad.tsv")).expect("bad"));
    std::fs::write(job.path("mixed.tsv"), mixed).expect("write");
    let over = |fraction: &str| {
        job.train(&[
            "data.train=\"mixed.tsv\"",
            "data.max_bad_rows=1000000",
            &format!("data.max_bad_fraction={fraction}"),
            "checkpoint.dir=\"ck-fraction\"",
        ])
    };
    fails_with(&over("0.05"), &["mixed.tsv", "300 of 3300 rows malformed", "data.max_bad_fraction = 0.05"]);
    ok(&over("0.1"));
}

// ---- 16. Compressed input ------------------------------------------------

#[test]
fn gzip_and_zstd_files_train_the_same_model_as_the_plain_file_and_resume_inside_them() {
    use std::io::Write;
    let job = Job::new(6000);
    let plain = std::fs::read(job.path("data/train.tsv")).expect("train");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&plain).expect("gzip");
    // Named like the plain file: the magic bytes decide.
    std::fs::write(job.path("train-gz.tsv"), gz.finish().expect("gzip")).expect("write");
    let zst = ruzstd::encoding::compress_to_vec(&plain[..], ruzstd::encoding::CompressionLevel::Fastest);
    std::fs::write(job.path("train.tsv.zst"), zst).expect("write");
    let auc = |train: &str, extra: &[&str]| {
        let mut args = vec!["train", "--config", "job.toml", "--set", train, "--quiet"];
        args.extend_from_slice(extra);
        let out = job.run(&args);
        ok(&out);
        let json = last_json(&out);
        assert_eq!(json["bad_rows"], 0, "{train}: {json}");
        json["test_auc"].as_f64().expect("auc")
    };
    let reference = auc("data.train=\"data/train.tsv\"", &["--set", "checkpoint.dir=\"ck-plain\""]);
    let gz_auc = auc("data.train=\"train-gz.tsv\"", &["--set", "checkpoint.dir=\"ck-gz\""]);
    assert_eq!(gz_auc, reference, "gzip");
    assert_eq!(auc("data.train=\"train.tsv.zst\"", &["--set", "checkpoint.dir=\"ck-zst\""]), reference, "zstd");
    // Stopped inside the compressed file and resumed: the same model.
    ok(&job.train(&["data.train=\"train-gz.tsv\"", "checkpoint.dir=\"ck-split\"", "train.max_steps=9"]));
    let resumed = auc("data.train=\"train-gz.tsv\"", &["--set", "checkpoint.dir=\"ck-split\"", "--resume", "ck-split"]);
    assert_eq!(resumed, reference, "resumed inside the gzip stream");
}

// ---- 17. A byte-order mark, a truncated last line, stale temporaries ------

#[test]
fn a_byte_order_mark_is_no_bad_row_and_a_cut_off_last_line_is_one() {
    let job = Job::new(3000);
    let text = std::fs::read_to_string(job.path("data/train.tsv")).expect("train");
    std::fs::write(job.path("bom.tsv"), format!("\u{feff}{text}")).expect("write");
    let out = job.train(&["data.train=\"bom.tsv\""]);
    ok(&out);
    assert_eq!(last_json(&out)["bad_rows"], 0, "{}", stderr(&out));
    assert_eq!(last_json(&out)["train_rows"], 3000);
    // libsvm: a last line without its newline may be cut anywhere (`3:0.` of
    // `3:0.25`): counted as malformed, named by its line.
    let svm = "1 1:0.5 7:1\n0 2:1 9:0.25\n1 3:0.";
    std::fs::write(job.path("cut.svm"), svm).expect("write");
    let config = job.write_config("svm.toml", "");
    let out = job.run(&[
        "train",
        "--config",
        &config,
        "--set",
        "data.format=libsvm",
        "--set",
        "data.train=\"cut.svm\"",
        "--set",
        "data.test=\"cut.svm\"",
        "--set",
        "model.kind=lr",
        "--quiet",
    ]);
    ok(&out);
    assert_eq!(last_json(&out)["train_rows"], 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("cut.svm:3: the last line has no newline"), "{}", stderr(&out));
    // CSV: a last line without newline is whole when every column is there.
    let csv_config = job.write_config("csv.toml", "");
    let train_csv = |text: &str, checkpoint: &str| {
        std::fs::write(job.path("rows.csv"), text).expect("write");
        job.run(&[
            "train",
            "--config",
            &csv_config,
            "--set",
            "data.format=csv",
            "--set",
            "data.train=\"rows.csv\"",
            "--set",
            "data.test=\"rows.csv\"",
            "--set",
            "data.schema={sparse=[\"a\",\"b\"]}",
            "--set",
            "model.kind=lr",
            "--set",
            &format!("checkpoint.dir=\"{checkpoint}\""),
            "--quiet",
        ])
    };
    let out = train_csv("label,a,b\n1,x,y\n0,x,z\n1,w", "ck-csv1");
    ok(&out);
    assert_eq!(last_json(&out)["train_rows"], 2, "{}", stderr(&out));
    let out = train_csv("label,a,b\n1,x,y\n0,x,z\n1,w,q", "ck-csv2");
    ok(&out);
    assert_eq!(last_json(&out)["train_rows"], 3, "{}", stderr(&out));
}

/// A full disk leaves `.tmp-ckpt-*` behind; the next run on the directory removes them.
#[test]
fn temporaries_left_by_a_failed_checkpoint_are_removed_at_the_next_start() {
    let job = Job::new(3000);
    let stale = job.path("ck/.tmp-ckpt-000000000007-424242");
    std::fs::create_dir_all(&stale).expect("stale");
    std::fs::write(stale.join("embeddings.bin"), vec![0u8; 4096]).expect("partial file");
    std::fs::write(job.path("ck/.LATEST.tmp-424242"), "ckpt-000000000007\n").expect("partial LATEST");
    ok(&job.train(&["train.max_steps=2"]));
    assert!(!stale.exists() && !job.path("ck/.LATEST.tmp-424242").exists());
    assert!(job.path("ck/LATEST").exists());
}

// ---- 13. Sizes: validated, never a panic or an allocation abort ----------

#[test]
fn impossible_sizes_are_refused_naming_the_key() {
    let job = Job::new(1000);
    for (set, key) in [
        ("model.hidden=[0]", "model.hidden"),
        ("model.bottom_hidden=[0]", "model.bottom_hidden"),
        ("train.batch_size=1000000000", "train.batch_size"),
        ("data.prefetch_batches=1000000000", "data.prefetch_batches"),
        ("embedding.table_shards=1073741824", "embedding.table_shards"),
        ("model.embedding_dim=100000", "model.embedding_dim"),
        ("embedding.learning_rate=nan", "embedding.learning_rate"),
        ("train.epochs=0", "train.epochs"),
        ("checkpoint.keep=0", "checkpoint.keep"),
    ] {
        let out = job.run(&["train", "--config", "job.toml", "--set", set, "--quiet"]);
        fails_with(&out, &[key]);
        assert_eq!(out.status.code(), Some(2), "{set}: {}", stderr(&out));
    }
    // Past the config's bounds: refused at once, naming the bound.
    let out = job.train(&["model.kind=dcn", "model.cross_layers=100000"]);
    fails_with(&out, &["model.cross_layers", "past the largest accepted"]);
    let out = job.launch("1", "1", &["train.batch_size=1000000000"]);
    fails_with(&out, &["train.batch_size", "past the largest accepted"]);
    let out = job.launch("1", "1", &["cluster.loader_queue_batches=1000000000"]);
    fails_with(&out, &["cluster.loader_queue_batches", "past the largest accepted"]);
    let out = job.launch("1", "1", &["cluster.loader_queue_batches=9223372036854775807"]);
    fails_with(&out, &["cluster.loader_queue_batches"]);
    let out = job.launch("1", "1", &["cluster.sync=\"lazy\"", "cluster.lazy.probe_interval_ms=9223372036854775807"]);
    fails_with(&out, &["cluster.lazy.probe_interval_ms"]);
    // Within them, past this machine's memory: refused naming the key.
    let out = job.train(&["model.kind=dcn", "model.cross_layers=64", "model.embedding_dim=4096"]);
    fails_with(&out, &["too large"]);
}

/// SIGTERM to `launch` stops the job like Ctrl-C (exit 143, no child left)
/// after a checkpoint of what it trained; SIGTERM to one role ends it with
/// 143, and the job fails naming it.
#[test]
fn sigterm_stops_launch_and_its_roles_cleanly() {
    let job = Job::new(200_000);
    // launch's stderr as it comes, each line waking the waits below.
    let start = || {
        let mut child = Command::new(sparrow_bin())
            .args(["launch", "--config", "job.toml", "--shards", "1", "--workers", "1"])
            .current_dir(job.dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn launch");
        let log = common::Log::default();
        let reader = log.collect(child.stderr.take().expect("stderr"));
        (child, log, reader)
    };
    let pids_of = |text: &str| -> Vec<(String, u32)> {
        text.lines()
            .filter_map(|l| {
                let (name, pid) = l.strip_prefix("launch: ")?.rsplit_once(" is pid ")?;
                Some((name.to_string(), pid.trim().parse().ok()?))
            })
            .collect()
    };
    let gone = |pid: u32| !Path::new(&format!("/proc/{pid}")).exists();

    let (mut launch, log, reader) = start();
    log.wait_for_line(&["[worker 0]"], MINUTE);
    signal(launch.id(), "-TERM");
    let status = launch.wait().expect("wait");
    reader.join().expect("stderr reader");
    let err = log.text();
    assert_eq!(status.code(), Some(143), "{err}");
    // The data ended where it was and the job checkpointed what it trained.
    assert!(err.contains("the job checkpointed (") && err.contains("continue with --resume"), "{err}");
    let children = pids_of(&err);
    assert_eq!(children.len(), 4, "{children:?}");
    // launch reaps every child before it exits: none is left to wait for.
    assert!(children.iter().all(|(_, pid)| gone(*pid)), "children left behind: {children:?}");

    let (mut launch, log, reader) = start();
    log.wait_for_line(&["[worker 0]"], MINUTE);
    // A shard listens after it set its signal handlers: a SIGTERM before
    // that kills the process outright, a death `launch` recovers from (CI
    // saw it on a loaded machine).
    log.wait_for_line(&["shard 0: listening on"], MINUTE);
    let shard = pids_of(&log.text()).into_iter().find(|(name, _)| name == "shard 0").expect("shard 0").1;
    signal(shard, "-TERM");
    let status = launch.wait().expect("wait");
    reader.join().expect("stderr reader");
    let err = log.text();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("shard 0 exited (exit status: 143)") && err.contains("shard stopped by SIGTERM"), "{err}");
}

/// Parquet footers that made the parquet reader panic and ask for a 21 GB
/// allocation (found by fuzzing, parquet 57): errors naming the file, no
/// panic message, no abort.
#[test]
fn a_malformed_parquet_file_is_an_error_not_a_panic() {
    let job = Job::new(1000);
    for name in ["footer-capacity-overflow", "footer-21gb-schema-list"] {
        let bad = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/parquet_file").join(name);
        std::fs::copy(&bad, job.path("bad.parquet")).expect("copy");
        let out = job.train(&[
            "data.format=parquet",
            "data.train=\"bad.parquet\"",
            "data.schema={label=\"y\",sparse=[\"a\"]}",
        ]);
        fails_with(&out, &["bad.parquet: parquet:"]);
    }
}
