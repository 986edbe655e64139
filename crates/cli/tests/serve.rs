//! `sparrow serve` answers the Open Inference Protocol (KServe v2 REST) with
//! `sparrow predict`'s figures, refuses bad requests with a 4xx and a message
//! while it keeps serving, and refuses a damaged export at start.

mod common;

use common::{generate, sparrow, write_config};
use serde_json::{Value, json};

/// One HTTP/1.1 request on a new connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    common::http_request(addr, method, path, body, None)
}

/// The KServe inputs for the Criteo rows `lines` (raw cells as in the file).
fn inputs(lines: &[&str]) -> Value {
    let rows: Vec<Vec<&str>> = lines.iter().map(|l| l.split('\t').collect()).collect();
    let mut inputs = Vec::new();
    for i in 0..13 {
        let data: Vec<Value> = rows
            .iter()
            .map(|r| {
                r.get(1 + i).filter(|c| !c.is_empty()).map_or(Value::Null, |c| json!(c.parse::<f64>().expect("count")))
            })
            .collect();
        inputs.push(json!({"name": format!("I{}", i + 1), "datatype": "FP32", "shape": [rows.len()], "data": data}));
    }
    for i in 0..26 {
        let data: Vec<&str> = rows.iter().map(|r| r.get(14 + i).copied().unwrap_or_default()).collect();
        inputs.push(json!({"name": format!("C{}", i + 1), "datatype": "BYTES", "shape": [rows.len()], "data": data}));
    }
    json!({ "id": "req-1", "inputs": inputs })
}

use common::start_serve as start;

#[test]
fn a_served_export_answers_kserve_requests_with_predicts_figures() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let ck = tmp.path().join("ck").display().to_string();
    let config = write_config(tmp.path(), "");
    let out = sparrow()
        .args(["train", "--config", &config, "--quiet", "--set", &format!("checkpoint.dir={ck:?}")])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let export = tmp.path().join("ctr-model").display().to_string();
    let out = sparrow().args(["export", "--checkpoint", &ck, "--out", &export]).output().expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let test = tmp.path().join("data/test.tsv");
    let pred = tmp.path().join("pred.txt");
    let out = sparrow()
        .args([
            "predict",
            "--model",
            &export,
            "--data",
            &test.display().to_string(),
            "--out",
            &pred.display().to_string(),
        ])
        .output()
        .expect("predict");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let expected: Vec<f64> =
        std::fs::read_to_string(&pred).expect("pred").lines().map(|l| l.parse().expect("p")).collect();
    let text = std::fs::read_to_string(&test).expect("test");
    let lines: Vec<&str> = text.lines().take(300).collect();

    let (_server, addr) = start(&export, &["--max-body-bytes", "400000"]);
    assert_eq!(http(&addr, "GET", "/v2/health/ready", b"").0, 200);
    let (status, meta) = http(&addr, "GET", "/v2/models/ctr-model", b"");
    assert_eq!(status, 200, "{meta}");
    let meta: Value = serde_json::from_str(&meta).expect("metadata");
    assert_eq!(meta["name"], "ctr-model", "named after the export's directory");
    assert_eq!(meta["inputs"].as_array().map(Vec::len), Some(39));
    assert_eq!(meta["outputs"][0]["name"], "probability");

    // Batches of 1 and of 256 rows: `predict`'s figures to 1e-6.
    for (from, n) in [(0, 1), (1, 256), (257, 43)] {
        let body = inputs(&lines[from..from + n]).to_string();
        let (status, reply) = http(&addr, "POST", "/v2/models/ctr-model/infer", body.as_bytes());
        assert_eq!(status, 200, "{reply}");
        let reply: Value = serde_json::from_str(&reply).expect("reply");
        assert_eq!(reply["id"], "req-1");
        let output = &reply["outputs"][0];
        assert_eq!((output["name"].as_str(), output["datatype"].as_str()), (Some("probability"), Some("FP32")));
        assert_eq!(output["shape"], json!([n]));
        let got: Vec<f64> = output["data"].as_array().expect("data").iter().map(|v| v.as_f64().expect("p")).collect();
        for (i, (g, e)) in got.iter().zip(&expected[from..from + n]).enumerate() {
            assert!((g - e).abs() <= 1e-6, "row {}: served {g}, predict {e}", from + i);
        }
    }
    // A missing input reads as an empty cell, as a missing column does in a file.
    let mut partial = inputs(&lines[..2]);
    partial["inputs"].as_array_mut().expect("inputs").retain(|i| i["name"] != "C3");
    assert_eq!(http(&addr, "POST", "/v2/models/ctr-model/infer", partial.to_string().as_bytes()).0, 200);

    // Bad requests: a 4xx with a message each, and the server keeps serving.
    let good = inputs(&lines[..2]).to_string();
    let mut wrong_type = inputs(&lines[..2]);
    wrong_type["inputs"][0]["datatype"] = json!("INT64");
    let mut wrong_shape = inputs(&lines[..2]);
    wrong_shape["inputs"][5]["shape"] = json!([3]);
    let mut not_a_count = inputs(&lines[..2]);
    not_a_count["inputs"][0]["data"] = json!([1.5, 2]);
    let huge = format!("{{\"inputs\": [], \"pad\": \"{}\"}}", "x".repeat(500_000));
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v2/models/ctr-model/infer", "{not json".into(), 400, "not a JSON request"),
        ("/v2/models/ctr-model/infer", wrong_type.to_string(), 400, "datatype `INT64`, expected FP32"),
        ("/v2/models/ctr-model/infer", wrong_shape.to_string(), 400, "input `I6`: shape [3]"),
        ("/v2/models/ctr-model/infer", not_a_count.to_string(), 400, "1.5 is not an integer"),
        (
            "/v2/models/ctr-model/infer",
            json!({"inputs": [{"name": "C99", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}).to_string(),
            400,
            "no such input",
        ),
        ("/v2/models/other/infer", good.clone(), 404, "no model named `other`"),
        ("/v2/models/ctr-model/infer", huge, 413, ""),
    ];
    for (path, body, want, message) in cases {
        let (status, reply) = http(&addr, "POST", path, body.as_bytes());
        assert_eq!(status, want, "{path}: {reply}");
        assert!(reply.contains(message), "{path}: `{reply}` lacks `{message}`");
        assert_eq!(http(&addr, "POST", "/v2/models/ctr-model/infer", good.as_bytes()).0, 200, "still serving");
    }
    let (status, metrics) = http(&addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    assert!(metrics.contains("sparrow_serve_requests_total{code=\"200\"}"), "{metrics}");
    assert!(metrics.contains("sparrow_serve_requests_total{code=\"400\"}"), "{metrics}");

    // A damaged export is refused at start, naming the file.
    let rows = std::path::Path::new(&export).join("embeddings.bin");
    let mut bytes = std::fs::read(&rows).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&rows, bytes).expect("write");
    let out = sparrow().args(["serve", "--model", &export, "--listen", "127.0.0.1:0"]).output().expect("serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("embeddings.bin") && stderr.contains("checksum"), "{stderr}");
}

/// `sparrow serve --watch` over `checkpoint.dir/exports` while training
/// writes incremental exports (`checkpoint.export_every_steps`): every
/// request is answered (200) through full and incremental swaps (one of
/// each brought about by events: LATEST moved along a chain, and a resumed
/// run's new chain, not by the watcher keeping pace with training), the
/// versions answering only move forward, and once training ends the server
/// answers with the final checkpoint's predictions.
#[test]
fn a_watching_server_follows_training_without_failing_a_request() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let ck = tmp.path().join("ck").display().to_string();
    let config = write_config(tmp.path(), "");
    let train = |extra: &[&str]| {
        let out = sparrow()
            .args(["train", "--config", &config, "--quiet", "--set", &format!("checkpoint.dir={ck:?}")])
            .args(["--set", "checkpoint.export_every_steps=4"])
            .args(extra)
            .output()
            .expect("train");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    // The first 8 steps: exports at 4 and 8, the server starts on step 8.
    train(&["--set", "train.max_steps=8"]);
    let exports = format!("{ck}/exports");
    let refused = sparrow()
        .args(["serve", "--model", &format!("{exports}/000000000008"), "--listen", "127.0.0.1:0", "--watch"])
        .output()
        .expect("serve");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("--watch") && stderr.contains("LATEST"), "{stderr}");

    // The server starts on the chain's first export (step 4) and is then
    // pointed at step 8, a delta of it: one incremental swap, whatever the
    // watcher's timing (a watcher starved past a chain while training runs
    // loads the newer chain whole).
    let point = |name: &str| {
        let tmp = format!("{exports}/.LATEST.test");
        std::fs::write(&tmp, format!("{name}\n")).expect("LATEST");
        std::fs::rename(&tmp, format!("{exports}/LATEST")).expect("LATEST");
    };
    point("000000000004");
    let (_server, addr, log) =
        common::start_serve_logged(&exports, &["--watch", "--watch-interval-ms", "20", "--name", "ctr"]);
    // The server logs each swap as it makes it ("serving step N from …"):
    // the test waits on those lines, not on time (the bound only turns a
    // swap that never comes into a failure).
    let swapped_to = |step: u64| -> String {
        let prefix = format!("serving step {step} from");
        loop {
            match log.recv_timeout(std::time::Duration::from_secs(120)) {
                Ok(line) if line.starts_with(&prefix) => return line,
                Ok(_) => {}
                Err(e) => panic!("no swap to step {step}: {e}"),
            }
        }
    };
    let (_, meta) = http(&addr, "GET", "/v2/models/ctr", b"");
    let meta: Value = serde_json::from_str(&meta).expect("metadata");
    assert_eq!(meta["versions"][0].as_str(), Some("4"), "{meta}");
    point("000000000008");
    let line = swapped_to(8);
    assert!(line.contains("1 incremental export(s)"), "{line}");
    let (_, metrics) = http(&addr, "GET", "/metrics", b"");
    assert!(metrics.contains("sparrow_serve_swaps_total{kind=\"delta\"} 1"), "{metrics}");
    let test = tmp.path().join("data/test.tsv");
    let text = std::fs::read_to_string(&test).expect("test");
    let lines: Vec<&str> = text.lines().take(200).collect();
    let one = inputs(&lines[..1]).to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Each answer's version, as the requester gets it: the test stops it
    // once an answer came from the final model (an event, not a time).
    let (answered, versions_seen) = std::sync::mpsc::channel::<u64>();
    let requester = {
        let (stop, addr, one) = (stop.clone(), addr.clone(), one.clone());
        std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let (status, reply) = http(&addr, "POST", "/v2/models/ctr/infer", one.as_bytes());
                let version = serde_json::from_str::<Value>(&reply)
                    .ok()
                    .and_then(|r| r["model_version"].as_str().and_then(|v| v.parse::<u64>().ok()));
                let _ = answered.send(version.unwrap_or(0));
                answers.push((status, version, reply));
            }
            answers
        })
    };
    // The rest of the run (resumed: its first export is full, a chain that
    // does not hold step 8, so the first swap from here is a full one).
    train(&["--resume", &ck]);
    let final_step = 79; // 20000 rows in batches of 256
    swapped_to(final_step);
    loop {
        match versions_seen.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(version) if version == final_step => break,
            Ok(_) => {}
            Err(e) => panic!("no answer from step {final_step}: {e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let answers = requester.join().expect("requester");
    assert!(answers.len() > 20, "{} requests", answers.len());
    for (status, _, reply) in &answers {
        assert_eq!(*status, 200, "{reply}");
    }
    let versions: Vec<u64> = answers.iter().map(|(_, v, _)| v.expect("a version")).collect();
    assert!(versions.windows(2).all(|w| w[0] <= w[1]), "versions only move forward");
    assert_eq!(versions.first(), Some(&8));
    assert_eq!(versions.last(), Some(&final_step));

    let (_, metrics) = http(&addr, "GET", "/metrics", b"");
    assert!(metrics.contains("sparrow_serve_swaps_total{kind=\"delta\"}"), "{metrics}");
    assert!(metrics.contains("sparrow_serve_swaps_total{kind=\"full\"}"), "{metrics}");
    assert!(metrics.contains(&format!("sparrow_serve_model_step {final_step}")), "{metrics}");

    // The served model is the final one: the checkpoint's predictions.
    let pred = tmp.path().join("pred.txt");
    let out = sparrow()
        .args(["predict", "--checkpoint", &ck, "--data", &test.display().to_string()])
        .args(["--out", &pred.display().to_string()])
        .output()
        .expect("predict");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let expected: Vec<f64> =
        std::fs::read_to_string(&pred).expect("pred").lines().map(|l| l.parse().expect("p")).collect();
    let (status, reply) = http(&addr, "POST", "/v2/models/ctr/infer", inputs(&lines).to_string().as_bytes());
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).expect("reply");
    let got = reply["outputs"][0]["data"].as_array().expect("data");
    assert_eq!(got.len(), lines.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let g = g.as_f64().expect("p");
        assert!((g - e).abs() <= 1e-6, "row {i}: served {g}, checkpoint {e}");
    }
}

/// A model trained on CSV data is served by its schema's column names
/// (dense `FP32`, sparse `BYTES`), with `predict`'s figures; a value holding
/// the delimiter is quoted on the line, as the CSV reader reads it.
#[test]
fn a_csv_model_is_served_by_its_schemas_names() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("days");
    let out = sparrow()
        .args(["gen", "--format", "csv", "--days", "2", "--out", &data.display().to_string()])
        .args(["--train-rows", "5000", "--test-rows", "500"])
        .output()
        .expect("gen");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config = tmp.path().join("csv.toml");
    let sparse: Vec<String> = (1..=26).map(|i| format!("\"C{i}\"")).collect();
    std::fs::write(
        &config,
        format!(
            r#"
[data]
format = "csv"
train = "{d}/train.csv"
test = "{d}/test.csv"
[data.schema]
label = "label"
dense = ["I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13"]
sparse = [{sparse}]
dense_transform = "log1p"
timestamp = "ts"
[model]
kind = "mlp"
embedding_dim = 8
hidden = [16]
[train]
batch_size = 256
[checkpoint]
dir = "{ck}"
"#,
            d = data.display(),
            sparse = sparse.join(", "),
            ck = tmp.path().join("ck").display()
        ),
    )
    .expect("config");
    let run = |args: &[&str]| {
        let out = sparrow().args(args).output().expect("sparrow");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ck = tmp.path().join("ck").display().to_string();
    let export = tmp.path().join("csv-model").display().to_string();
    let test = data.join("test.csv").display().to_string();
    let pred = tmp.path().join("pred.txt").display().to_string();
    run(&["train", "--config", &config.display().to_string(), "--quiet"]);
    run(&["export", "--checkpoint", &ck, "--out", &export]);
    run(&["predict", "--model", &export, "--data", &test, "--out", &pred]);
    let expected: Vec<f64> =
        std::fs::read_to_string(&pred).expect("pred").lines().map(|l| l.parse().expect("p")).collect();

    let text = std::fs::read_to_string(&test).expect("test");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let rows: Vec<Vec<&str>> = lines.take(100).map(|l| l.split(',').collect()).collect();
    let column = |name: &str| header.iter().position(|h| *h == name).expect("column");
    let mut inputs = Vec::new();
    for i in 1..=13 {
        let c = column(&format!("I{i}"));
        let data: Vec<Value> = rows.iter().map(|r| r[c].parse::<f64>().map_or(Value::Null, |v| json!(v))).collect();
        inputs.push(json!({"name": format!("I{i}"), "datatype": "FP32", "shape": [rows.len()], "data": data}));
    }
    for i in 1..=26 {
        let c = column(&format!("C{i}"));
        let data: Vec<&str> = rows.iter().map(|r| r[c]).collect();
        inputs.push(json!({"name": format!("C{i}"), "datatype": "BYTES", "shape": [rows.len()], "data": data}));
    }
    let (_server, addr) = start(&export, &[]);
    let (status, meta) = http(&addr, "GET", "/v2/models/csv-model", b"");
    assert_eq!(status, 200, "{meta}");
    assert!(meta.contains("\"I13\"") && meta.contains("\"C26\""), "{meta}");
    let body = json!({ "inputs": inputs });
    let (status, reply) = http(&addr, "POST", "/v2/models/csv-model/infer", body.to_string().as_bytes());
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).expect("reply");
    let got = reply["outputs"][0]["data"].as_array().expect("data");
    assert_eq!(got.len(), rows.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let g = g.as_f64().expect("p");
        assert!((g - e).abs() <= 1e-6, "row {i}: served {g}, predict {e}");
    }
    let mut odd = body.clone();
    odd["inputs"][13]["data"][0] = json!("a,\"b\"");
    let (status, reply) = http(&addr, "POST", "/v2/models/csv-model/infer", odd.to_string().as_bytes());
    assert_eq!(status, 200, "a quoted value: {reply}");
}
