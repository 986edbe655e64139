//! `sparrow serve` against a client that means harm: a request declaring
//! a million rows, connections that send nothing or a byte at a time,
//! requests without the token, and exports crafted to crash or to read
//! outside themselves. The server refuses each with a status or an error,
//! keeps serving, and its memory stays bounded.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{generate, sparrow, write_config};
use serde_json::{Value, json};

struct Server {
    child: Child,
    addr: String,
    stderr: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// A line of /proc/PID/status, in kB (VmRSS, VmHWM).
    fn status_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("status");
        let line = status.lines().find(|l| l.starts_with(field)).expect("field");
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("kB")
    }

    fn metric(&self, name: &str, token: Option<&str>) -> f64 {
        let (status, text) = request(&self.addr, "GET", "/metrics", b"", token);
        assert_eq!(status, 200, "{text}");
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }
}

/// Starts `sparrow serve` with `args`; `env`: extra environment.
fn start(tmp: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    let stderr = tmp.join(format!("serve-{}.err", std::process::id() ^ rand_suffix()));
    let mut child = sparrow()
        .arg("serve")
        .args(args)
        .env_remove("SPARROW_AUTH_TOKEN")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
    let started: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{e}: `{line}`: {}", std::fs::read_to_string(&stderr).unwrap_or_default()));
    let addr = started["listening"].as_str().expect("address").to_string();
    Server { child, addr, stderr }
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
}

fn request(addr: &str, method: &str, path: &str, body: &[u8], token: Option<&str>) -> (u16, String) {
    common::http_request(addr, method, path, body, token)
}

/// The start of a reply, for a failure's message (a reply may hold a million figures).
fn short(reply: &str) -> &str {
    reply.char_indices().nth(400).map_or(reply, |(i, _)| &reply[..i])
}

/// A trained model's export (the small DLRM of the cluster tests).
fn exported_model(tmp: &Path) -> String {
    generate(tmp, "4000");
    let ck = tmp.join("ck").display().to_string();
    let config = write_config(tmp, "");
    let out = sparrow()
        .args(["train", "--config", &config, "--quiet", "--set", &format!("checkpoint.dir={ck:?}")])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let export = tmp.join("ctr").display().to_string();
    let out = sparrow().args(["export", "--checkpoint", &ck, "--out", &export]).output().expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    export
}

/// A request of `rows` rows with every input of the Criteo model.
fn full_request(rows: usize) -> Vec<u8> {
    let mut inputs = Vec::new();
    for i in 1..=13 {
        inputs.push(json!({"name": format!("I{i}"), "datatype": "FP32", "shape": [rows], "data": vec![i; rows]}));
    }
    for i in 1..=26 {
        let data: Vec<String> = (0..rows).map(|r| format!("{:08x}", (r * 7919 + i) % 100_003)).collect();
        inputs.push(json!({"name": format!("C{i}"), "datatype": "BYTES", "shape": [rows], "data": data}));
    }
    serde_json::to_vec(&json!({ "inputs": inputs })).expect("json")
}

/// Polls `check` until it holds (an event the server exposes) or `limit` passes.
fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// Item 1: a body declaring 10⁶ rows is refused at once (413 naming
/// --max-batch-rows) instead of scored in one 9 GB batch; a request at the
/// limit (16 384 rows, every input) is answered with a peak resident
/// memory under 400 MB, and the memory is given back afterwards.
#[test]
fn a_request_at_the_row_limit_stays_under_a_memory_bound() {
    let tmp = tempfile::tempdir().expect("tmp");
    let export = exported_model(tmp.path());
    let server = start(tmp.path(), &["--model", &export, "--listen", "127.0.0.1:0"], &[]);
    let (rss_start, hwm_start) = (server.status_kb("VmRSS:"), server.status_kb("VmHWM:"));

    let million =
        json!({"inputs": [{"name": "I1", "datatype": "FP32", "shape": [1_000_000], "data": vec![1; 1_000_000]}]});
    let (status, reply) = request(&server.addr, "POST", "/v2/models/ctr/infer", million.to_string().as_bytes(), None);
    assert_eq!(status, 413, "{}", short(&reply));
    assert!(reply.contains("--max-batch-rows") && reply.contains("16384"), "{reply}");
    let (status, reply) = request(&server.addr, "POST", "/v2/models/ctr/infer", &full_request(16_385), None);
    assert_eq!(status, 413, "one row over: {}", short(&reply));

    let (status, reply) = request(&server.addr, "POST", "/v2/models/ctr/infer", &full_request(16_384), None);
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).expect("reply");
    assert_eq!(reply["outputs"][0]["data"].as_array().map(Vec::len), Some(16_384));
    let peak = server.status_kb("VmHWM:");
    eprintln!(
        "serve: RSS {rss_start} kB at start (peak {hwm_start} kB); peak {peak} kB through a request at the limit"
    );
    assert!(peak < 400_000, "peak RSS {peak} kB serving a request at the row limit");
    // Given back: resident memory returns near where it started.
    let back = eventually(Duration::from_secs(20), || server.status_kb("VmRSS:") < rss_start + 40_000);
    assert!(back, "RSS {} kB after the request, {rss_start} kB before", server.status_kb("VmRSS:"));
    assert_eq!(server.metric("sparrow_serve_rows_total", None), 16_384.0);
}

/// Item 2: with the cap's worth of idle connections open (and timeouts far
/// away, 60 s), a normal request is still answered (the idlest connection
/// makes room); a head sent a byte at a time is cut at the header timeout,
/// an idle keep-alive connection at the idle timeout, and with every
/// connection busy a new one gets 503. `/metrics` counts each.
#[test]
fn idle_connections_cannot_starve_the_server() {
    let tmp = tempfile::tempdir().expect("tmp");
    let export = exported_model(tmp.path());
    let one = full_request(1);
    let server = start(tmp.path(), &["--model", &export, "--listen", "127.0.0.1:0", "--max-connections", "16"], &[]);
    // Accepted in the order they connect: these 16 take every slot first.
    let idle: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(&server.addr).expect("connect")).collect();
    let started = Instant::now();
    let mut stream = TcpStream::connect(&server.addr).expect("connect");
    // An order of magnitude under the 60 s timeouts that would otherwise free a slot.
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let head = format!(
        "POST /v2/models/ctr/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        one.len()
    );
    stream.write_all(head.as_bytes()).expect("write");
    stream.write_all(&one).expect("body");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let answered = started.elapsed();
    assert!(response.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&response));
    eprintln!(
        "answered in {:.1} ms with 16 idle connections open at --max-connections 16",
        answered.as_secs_f64() * 1e3
    );
    assert!(server.metric("sparrow_serve_connections_evicted_total", None) >= 1.0);
    drop(idle);
    drop(server);

    // Timeouts: a slow head, then an idle keep-alive connection.
    let server = start(
        tmp.path(),
        &[
            "--model",
            &export,
            "--listen",
            "127.0.0.1:0",
            "--header-read-timeout-ms",
            "300",
            "--idle-timeout-ms",
            "300",
            "--max-connections",
            "2",
            "--request-timeout-ms",
            "3000",
        ],
        &[],
    );
    let mut slow = TcpStream::connect(&server.addr).expect("connect");
    slow.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut write_failed = false;
    for byte in
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    {
        if slow.write_all(&[*byte]).is_err() {
            write_failed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Closed by the server: a write failed, or the read ends (EOF or reset)
    // with no reply; a read that times out means the connection stayed.
    let mut rest = Vec::new();
    let read = slow.read_to_end(&mut rest);
    let cut = write_failed
        || matches!(read, Ok(0))
        || matches!(read, Err(ref e) if e.kind() == std::io::ErrorKind::ConnectionReset);
    assert!(cut && rest.is_empty(), "a head sent a byte at a time is cut: {read:?} {}", String::from_utf8_lossy(&rest));
    assert!(server.metric("sparrow_serve_connections_timed_out_total{phase=\"header\"}", None) >= 1.0);

    let mut kept = TcpStream::connect(&server.addr).expect("connect");
    kept.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
    let mut reply = Vec::new();
    kept.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let _ = kept.read_to_end(&mut reply);
    assert!(reply.starts_with(b"HTTP/1.1 200"), "answered, then closed when idle");
    assert!(server.metric("sparrow_serve_connections_timed_out_total{phase=\"idle\"}", None) >= 1.0);

    // Two connections busy (heads sent, bodies never; the server's `100
    // Continue` says it is reading the body): a third is refused with 503,
    // and each busy one gets 408 at the request timeout.
    let head = "POST /v2/models/ctr/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n";
    let mut busy: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&server.addr).expect("connect")).collect();
    for b in &mut busy {
        b.write_all(head.as_bytes()).expect("write");
        b.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut cont = [0u8; 25];
        b.read_exact(&mut cont).expect("100 Continue");
        assert!(cont.starts_with(b"HTTP/1.1 100 Continue"), "{}", String::from_utf8_lossy(&cont));
    }
    let refused = eventually(Duration::from_secs(10), || {
        let mut third = TcpStream::connect(&server.addr).expect("connect");
        third.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut reply = Vec::new();
        let _ = third.read_to_end(&mut reply);
        reply.starts_with(b"HTTP/1.1 503")
    });
    assert!(refused, "with every connection busy, a new one is refused");
    for mut b in busy {
        b.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut reply = Vec::new();
        let _ = b.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.starts_with("HTTP/1.1 408") && reply.contains("--request-timeout-ms"), "{reply}");
    }
    assert!(server.metric("sparrow_serve_connections_refused_total", None) >= 1.0);
}

/// Item 3: off loopback the server needs SPARROW_AUTH_TOKEN or --no-auth
/// (which it says on start); with a token every endpoint but the health
/// probes wants `Authorization: Bearer`.
#[test]
fn off_loopback_the_server_wants_a_token() {
    let tmp = tempfile::tempdir().expect("tmp");
    let export = exported_model(tmp.path());
    let out = sparrow()
        .args(["serve", "--model", &export, "--listen", "0.0.0.0:0"])
        .env_remove("SPARROW_AUTH_TOKEN")
        .output()
        .expect("serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("SPARROW_AUTH_TOKEN") && stderr.contains("--no-auth"), "{stderr}");

    let server = start(tmp.path(), &["--model", &export, "--listen", "0.0.0.0:0", "--no-auth"], &[]);
    let said = std::fs::read_to_string(&server.stderr).expect("stderr");
    assert!(said.contains("--no-auth") && said.contains("not authenticated"), "{said}");
    drop(server);

    let token = "s3cret-token";
    let server = start(tmp.path(), &["--model", &export, "--listen", "127.0.0.1:0"], &[("SPARROW_AUTH_TOKEN", token)]);
    let body = full_request(2);
    for path in ["/v2/health/live", "/v2/health/ready"] {
        assert_eq!(request(&server.addr, "GET", path, b"", None).0, 200, "{path} stays open for probes");
    }
    for (method, path, body) in [
        ("POST", "/v2/models/ctr/infer", &body[..]),
        ("GET", "/v2/models/ctr", &b""[..]),
        ("GET", "/metrics", &b""[..]),
        ("GET", "/v2", &b""[..]),
    ] {
        let (status, reply) = request(&server.addr, method, path, body, None);
        assert_eq!(status, 401, "{path} without a token: {reply}");
        assert!(reply.contains("Authorization: Bearer"), "{reply}");
        assert_eq!(request(&server.addr, method, path, body, Some("s3cret-tokeN")).0, 401, "{path}: a wrong token");
        assert_eq!(request(&server.addr, method, path, body, Some(token)).0, 200, "{path} with the token");
    }
    assert_eq!(server.metric("sparrow_serve_unauthorized_total", Some(token)), 8.0);
}

/// Item 10: duplicate inputs, a negative shape, binary infinities, a count
/// out of range, and flags that cannot be right are refused, each naming
/// what; under --watch the model's name is `model` whatever LATEST names.
#[test]
fn requests_and_flags_that_cannot_be_right_are_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let export = exported_model(tmp.path());
    for (flags, want) in [
        (vec!["--name", ""], "--name"),
        (vec!["--name", "a/b"], "--name"),
        (vec!["--max-body-bytes", "0"], "--max-body-bytes 0"),
        (vec!["--max-batch-rows", "0"], "--max-batch-rows 0"),
        (vec!["--watch-interval-ms", "0", "--watch"], "--watch-interval-ms 0"),
        (vec!["--idle-timeout-ms", "0"], "--idle-timeout-ms 0"),
        (vec!["--request-timeout-ms", "18446744073709551615"], "at most 86400000"),
    ] {
        let out = sparrow()
            .args(["serve", "--model", &export, "--listen", "127.0.0.1:0"])
            .args(&flags)
            .output()
            .expect("serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(want), "{flags:?}: {stderr}");
    }

    let server = start(tmp.path(), &["--model", &export, "--listen", "127.0.0.1:0"], &[]);
    let infer = |body: &Value| request(&server.addr, "POST", "/v2/models/ctr/infer", body.to_string().as_bytes(), None);
    let i1 = |data: Value, shape: Value| json!({"name": "I1", "datatype": "FP32", "shape": shape, "data": data});
    let cases = [
        (json!({"inputs": [i1(json!([1]), json!([1])), i1(json!([2]), json!([1]))]}), "input `I1` is given twice"),
        (json!({"inputs": [i1(json!([1]), json!([-1]))]}), "shape [-1]"),
        (json!({"inputs": [i1(json!([3e38]), json!([1]))]}), "out of range"),
        (json!({"inputs": [i1(json!([1.5]), json!([1]))]}), "1.5 is not an integer"),
    ];
    for (body, want) in cases {
        let (status, reply) = infer(&body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(reply.contains(want), "{body}: `{reply}` lacks `{want}`");
    }
    // Binary ±inf: refused as JSON's 1e999 is.
    let header =
        json!({"inputs": [{"name": "I1", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]});
    let mut body = serde_json::to_vec(&header).expect("json");
    let json_len = body.len();
    body.extend_from_slice(&f32::INFINITY.to_le_bytes());
    let mut stream = TcpStream::connect(&server.addr).expect("connect");
    let head = format!(
        "POST /v2/models/ctr/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: {json_len}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("head");
    stream.write_all(&body).expect("body");
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 400") && reply.contains("not a finite number"), "{reply}");
    let (status, reply) = request(
        &server.addr,
        "POST",
        "/v2/models/ctr/infer",
        b"{\"inputs\": [{\"name\": \"I1\", \"datatype\": \"FP32\", \"shape\": [1], \"data\": [1e999]}]}",
        None,
    );
    assert_eq!(status, 400, "{reply}");
}

/// A copy of export `from` as `to`, its `embeddings.bin` claiming 2⁶¹ more
/// rows than it holds (the count that wraps an unchecked size to the true
/// one), the manifest's checksum corrected.
fn crafted_export(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
    let mut bytes = std::fs::read(to.join("embeddings.bin")).expect("rows");
    let dim = u64::from(u32::from_le_bytes(bytes[8..12].try_into().expect("4")));
    let rows = u64::from_le_bytes(bytes[12..20].try_into().expect("8"));
    let record = 8 + dim * if &bytes[..8] == b"SPRWEMB1" { 4 } else { 2 };
    let huge = rows.wrapping_add(1u64 << (64 - record.trailing_zeros()));
    bytes[12..20].copy_from_slice(&huge.to_le_bytes());
    std::fs::write(to.join("embeddings.bin"), &bytes).expect("write");
    let mut manifest: Value =
        serde_json::from_slice(&std::fs::read(to.join("manifest.json")).expect("manifest")).expect("json");
    manifest["files"]["embeddings.bin"]["xxh3"] = json!(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
    std::fs::write(to.join("manifest.json"), serde_json::to_vec(&manifest).expect("json")).expect("manifest");
}

/// Items 4 and 5: a crafted export (a row count that wraps the size
/// check, a manifest naming /dev/zero, LATEST a symlink to /dev/zero) is an
/// error for `predict` and `serve` (exit 2, naming the file), and under
/// `--watch` the server keeps serving the model it has, counts the errors,
/// turns unready after --watch-unready-after-ms, and ready again once
/// LATEST names a good export.
#[test]
fn a_crafted_export_never_takes_the_server_down() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "4000");
    let ck = tmp.path().join("ck");
    let config = write_config(tmp.path(), "");
    let out = sparrow()
        .args(["train", "--config", &config, "--quiet", "--set", &format!("checkpoint.dir={:?}", ck.display())])
        .args(["--set", "checkpoint.export_every_steps=5"])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let exports = ck.join("exports");
    let latest = std::fs::read_to_string(exports.join("LATEST")).expect("LATEST").trim().to_string();
    let crafted = exports.join("999999999999");
    crafted_export(&exports.join(&latest), &crafted);
    let test = tmp.path().join("data/test.tsv").display().to_string();

    let predict = |model: &Path| {
        sparrow()
            .args(["predict", "--model", &model.display().to_string(), "--data", &test])
            .args(["--out", &tmp.path().join("p.txt").display().to_string()])
            .output()
            .expect("predict")
    };
    let out = predict(&crafted);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "an error, not a panic: {stderr}");
    assert!(stderr.contains("embeddings.bin") && stderr.contains("rows"), "{stderr}");
    let out = sparrow()
        .args(["serve", "--model", &crafted.display().to_string(), "--listen", "127.0.0.1:0"])
        .output()
        .expect("serve");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));

    let zero = exports.join("999999999998");
    crafted_export(&exports.join(&latest), &zero);
    let mut manifest: Value =
        serde_json::from_slice(&std::fs::read(zero.join("manifest.json")).expect("m")).expect("j");
    manifest["files"]["/dev/zero"] = json!({"bytes": 1_000_000_000_000u64, "xxh3": "0"});
    std::fs::write(zero.join("manifest.json"), serde_json::to_vec(&manifest).expect("json")).expect("write");
    let out = predict(&zero);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("/dev/zero") && stderr.contains("plain file name"), "{stderr}");

    let server = start(
        tmp.path(),
        &[
            "--model",
            &exports.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--watch",
            "--watch-interval-ms",
            "20",
            "--watch-unready-after-ms",
            "300",
        ],
        &[],
    );
    let (status, meta) = request(&server.addr, "GET", "/v2/models/model", b"", None);
    assert_eq!(status, 200, "under --watch the model is `model`: {meta}");
    let served: Value = serde_json::from_str(&meta).expect("meta");
    let step = served["versions"][0].as_str().expect("version").to_string();
    let set_latest = |name: &str| {
        let tmp_latest = exports.join(".LATEST.test");
        let _ = std::fs::remove_file(&tmp_latest);
        std::fs::write(&tmp_latest, format!("{name}\n")).expect("write");
        std::fs::rename(&tmp_latest, exports.join("LATEST")).expect("rename");
    };
    let infer = || request(&server.addr, "POST", "/v2/models/model/infer", &full_request(3), None);
    for bad in ["999999999999", "999999999998", "/dev/zero"] {
        let errors = server.metric("sparrow_serve_watch_errors_total", None);
        if bad == "/dev/zero" {
            let _ = std::fs::remove_file(exports.join("LATEST"));
            std::os::unix::fs::symlink("/dev/zero", exports.join("LATEST")).expect("symlink");
        } else {
            set_latest(bad);
        }
        assert!(
            eventually(Duration::from_secs(20), || server.metric("sparrow_serve_watch_errors_total", None) > errors),
            "{bad}: the watch reports it"
        );
        let (status, reply) = infer();
        assert_eq!(status, 200, "{bad}: still serving: {reply}");
        let reply: Value = serde_json::from_str(&reply).expect("reply");
        assert_eq!(reply["model_version"].as_str(), Some(step.as_str()), "{bad}: the model it had");
        assert!(
            eventually(Duration::from_secs(20), || request(&server.addr, "GET", "/v2/health/ready", b"", None).0
                == 503),
            "{bad}: unready once it failed past --watch-unready-after-ms"
        );
        let (_, why) = request(&server.addr, "GET", "/v2/health/ready", b"", None);
        assert!(why.contains("--watch"), "{why}");
        assert_eq!(server.metric("sparrow_serve_watch_failing", None), 1.0);
        let _ = std::fs::remove_file(exports.join("LATEST"));
        set_latest(&latest);
        assert!(
            eventually(Duration::from_secs(20), || request(&server.addr, "GET", "/v2/health/ready", b"", None).0
                == 200),
            "{bad}: ready again on a good export"
        );
    }
    // Reading /dev/zero through LATEST never grew the server.
    assert!(server.status_kb("VmHWM:") < 400_000, "peak {} kB", server.status_kb("VmHWM:"));
}
