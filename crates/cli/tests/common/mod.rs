#![allow(dead_code)]
//! Helpers the process tests share: the binary, its JSON line, generated
//! data, the small cluster job's config, waiting for and signalling children,
//! collecting a child's output while it runs.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn sparrow() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sparrow"))
}

pub fn last_json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| {
        panic!("last stdout line is not JSON ({e}): {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr))
    })
}

/// `sparrow train --config CONFIG --quiet`: its JSON summary (it must succeed).
pub fn train_json(config: &str) -> serde_json::Value {
    let out = sparrow().args(["train", "--config", config, "--quiet"]).output().expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// The `[data.schema]` keys of `gen --format csv --days` rows: the 13 dense
/// and 26 sparse columns, dense values log1p-transformed.
pub fn days_schema() -> String {
    let dense: Vec<String> = (1..=13).map(|i| format!("\"I{i}\"")).collect();
    let sparse: Vec<String> = (1..=26).map(|i| format!("\"C{i}\"")).collect();
    format!("dense = [{}]\nsparse = [{}]\ndense_transform = \"log1p\"\n", dense.join(","), sparse.join(","))
}

/// The small cluster job (DLRM, dim 8, batch 256, heartbeats every 100 ms,
/// a 2 s timeout) on `dir/data`; `extra` goes into `[cluster]`, the last table.
pub fn write_config(dir: &Path, extra: &str) -> String {
    let d = dir.display();
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[data]
train = "{d}/data/train.tsv"
test = "{d}/data/test.tsv"
[model]
kind = "dlrm"
embedding_dim = 8
hidden = [32, 16]
bottom_hidden = [16]
[train]
batch_size = 256
[embedding]
optimizer = "adagrad"
learning_rate = 0.05
[cluster]
heartbeat_interval_ms = 100
heartbeat_timeout_ms = 2000
{extra}
"#
        ),
    )
    .expect("write config");
    path.display().to_string()
}

/// `train_rows` generated training rows and 3 000 test rows in `dir/data`.
pub fn generate(dir: &Path, train_rows: &str) {
    let out = sparrow()
        .args([
            "gen",
            "--out",
            &dir.join("data").display().to_string(),
            "--train-rows",
            train_rows,
            "--test-rows",
            "3000",
        ])
        .output()
        .expect("gen");
    assert!(out.status.success());
}

pub fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill").success());
}

/// With no restart budget (`cluster.max_restarts = 0`) a dead role stops the
/// job as it did before recovery existed (see `recovery.rs` for the rest).
pub fn wait_with_timeout(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("launch did not stop within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Appends each line `stream` yields to `log` until it closes.
pub fn collect_lines(
    stream: impl std::io::Read + Send + 'static,
    log: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            let mut log = log.lock().expect("log");
            log.push_str(&line);
            log.push('\n');
        }
    })
}

/// 20 000 generated training rows, 3 000 test rows.
pub fn data(dir: &Path) {
    generate(dir, "20000");
}

/// The recovery tests' job: four epochs of 79 batches (316 steps), a
/// checkpoint every 50 steps, depth 0 (so a recovered job is exact).
pub fn config(dir: &Path, extra: &str) -> String {
    let path = write_config(dir, extra);
    let text = std::fs::read_to_string(&path)
        .expect("read")
        .replace("batch_size = 256", "batch_size = 256\nepochs = 4\npipeline_depth = 0");
    let checkpoint = format!("\n[checkpoint]\ndir = {:?}\nevery_steps = 50\n", dir.join("ckpt").display().to_string());
    std::fs::write(&path, text + &checkpoint).expect("write config");
    path
}

/// The uninterrupted job's figures (`sparrow train` on the same config).
pub fn uninterrupted(config: &str) -> serde_json::Value {
    // Its checkpoints go elsewhere (they change nothing in the model).
    let out = sparrow()
        .args(["train", "--config", config, "--quiet"])
        .args(["--set", &format!("checkpoint.dir={:?}", format!("{config}.train-ckpt"))])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// A job's directory (data, config) and the uninterrupted job's figures.
pub struct Scenario {
    pub tmp: tempfile::TempDir,
    pub config: String,
    pub whole: serde_json::Value,
}

/// The job of this file, `edit` applied to its config text (given the job's directory).
pub fn scenario(edit: impl Fn(String, &Path) -> String) -> Scenario {
    let tmp = tempfile::tempdir().expect("tmp");
    data(tmp.path());
    let config = config(tmp.path(), "");
    let text = edit(std::fs::read_to_string(&config).expect("read"), tmp.path());
    std::fs::write(&config, text).expect("write");
    let whole = uninterrupted(&config);
    Scenario { tmp, config, whole }
}

/// One HTTP/1.1 request on a new connection (`token`: a bearer token to
/// send): (status, body); status 0 when no reply came.
pub fn http_request(addr: &str, method: &str, path: &str, body: &[u8], token: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write");
    // A refused body may be answered before it is all sent.
    let _ = stream.write_all(body);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).to_string();
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// Lines of child processes' output, gathered by reader threads; a waiter
/// wakes on each new line (an event), not on a timer.
#[derive(Clone, Default)]
pub struct Log(Arc<(Mutex<String>, std::sync::Condvar)>);

impl Log {
    /// Appends each line `stream` yields, until it closes.
    pub fn collect(&self, stream: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<()> {
        let log = self.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let (text, added) = &*log.0;
                let mut text = text.lock().expect("log");
                text.push_str(&line);
                text.push('\n');
                added.notify_all();
            }
        })
    }

    pub fn text(&self) -> String {
        self.0.0.lock().expect("log").clone()
    }

    /// Waits for a line for which `found` gives a value, woken by each new
    /// line; panics, showing the log, past `limit` (a hang, not a timing).
    pub fn wait_for<T>(&self, what: &str, limit: Duration, found: impl Fn(&str) -> Option<T>) -> T {
        let (text, added) = &*self.0;
        let deadline = Instant::now() + limit;
        let mut guard = text.lock().expect("log");
        loop {
            if let Some(value) = guard.lines().find_map(&found) {
                return value;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {what} within {limit:?}:\n{}", *guard);
            guard = added.wait_timeout(guard, left).expect("log").0;
        }
    }

    /// Waits for a line holding every one of `needles`.
    pub fn wait_for_line(&self, needles: &[&str], limit: Duration) {
        self.wait_for(&format!("line with {needles:?}"), limit, |l| needles.iter().all(|n| l.contains(n)).then_some(()))
    }
}

/// A `sparrow serve` child, killed when dropped.
pub struct ServeChild(pub Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `sparrow serve --model MODEL` on a free loopback port (no token),
/// with `extra` flags: the server and its address.
pub fn start_serve(model: &str, extra: &[&str]) -> (ServeChild, String) {
    let mut child = sparrow()
        .args(["serve", "--model", model, "--listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("SPARROW_AUTH_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
    let started: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: `{line}`"));
    (ServeChild(child), started["listening"].as_str().expect("address").to_string())
}

/// [`start_serve`] with its log (stderr) read as it is written: each line
/// sent on the channel, by a thread that drains it until the server ends.
pub fn start_serve_logged(model: &str, extra: &[&str]) -> (ServeChild, String, std::sync::mpsc::Receiver<String>) {
    let mut child = sparrow()
        .args(["serve", "--model", model, "--listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("SPARROW_AUTH_TOKEN")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // The test may have stopped listening: the pipe is drained anyway.
            let _ = tx.send(line);
        }
    });
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
    let started: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: `{line}`"));
    (ServeChild(child), started["listening"].as_str().expect("address").to_string(), rx)
}

/// Runs `command` (stdout discarded) until it ends, failing the test if
/// that takes past `limit` (a hang): its exit status and stderr.
pub fn ends_within(command: &mut Command, limit: Duration) -> (std::process::ExitStatus, String) {
    let mut child =
        command.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().expect("spawn");
    let log = Arc::new(Mutex::new(String::new()));
    let reader = collect_lines(child.stderr.take().expect("stderr"), log.clone());
    let status = wait_with_timeout(&mut child, limit);
    let _ = reader.join();
    let stderr = log.lock().expect("log").clone();
    (status, stderr)
}

pub mod kafka;
