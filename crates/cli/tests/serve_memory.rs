//! A request at `sparrow serve`'s limits, in each form an input may take,
//! against a model with every kind of input (numbers, strings, a multi-hot
//! cell, a behaviour sequence): the server's peak memory stays under the
//! bound the book gives (the serving chapter), and the request is answered
//! or refused with a status, never an abort.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use common::sparrow;
use serde_json::{Value, json};

/// The book's bound on the server's peak resident memory through one
/// request at the default limits (64 MiB body, 16 384 rows, 2^20 IDs).
const PEAK_BOUND_KB: u64 = 200_000;
/// A body just under the default `--max-body-bytes` (64 MiB).
const BODY: usize = 62 << 20;
const MIB: usize = 1 << 20;
const ROWS: usize = 16_384;

struct Server {
    child: common::ServeChild,
    addr: String,
}

impl Server {
    fn start(export: &Path) -> Server {
        let (child, addr) = common::start_serve(&export.display().to_string(), &["--name", "m"]);
        Server { child, addr }
    }

    fn peak_kb(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.0.id())).expect("status");
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("kB")
    }

    /// POSTs `body` (`json_len`: KServe's binary extension); the status.
    fn infer(&self, body: &[u8], json_len: Option<usize>) -> (u16, String) {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        let binary = json_len.map(|n| format!("Inference-Header-Content-Length: {n}\r\n")).unwrap_or_default();
        let head = format!(
            "POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n{binary}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("head");
        stream.write_all(body).expect("body");
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).expect("reply");
        let reply = String::from_utf8_lossy(&reply).to_string();
        let status = reply.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let start = reply.find("\r\n\r\n").map_or(0, |i| i + 4);
        (status, reply[start..].chars().take(300).collect())
    }
}

/// `gen --tasks --sequence` data, and the export of `kind` trained on it
/// (inputs: `price`; `user_id`, `item_id`, `item_category`, `site`, multi-hot
/// on `|`; `hist_items`, the newest 20 kept).
fn export(dir: &Path, kind: &str) -> PathBuf {
    let data = dir.join("data/behaviour");
    if !data.exists() {
        let out = sparrow()
            .args(["gen", "--out", &data.display().to_string(), "--train-rows", "2000", "--test-rows", "500"])
            .args(["--tasks", "--sequence", "--classes", "4"])
            .output()
            .expect("gen");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/behaviour-tasks.toml");
    let out = sparrow()
        .current_dir(dir)
        .args(["train", "--config", config, "--quiet", "--set", "train.epochs=1"])
        .args(["--set", &format!("model.kind={kind:?}"), "--set", &format!("checkpoint.dir=\"ck/{kind}\"")])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let export = dir.join(format!("export-{kind}"));
    let out = sparrow()
        .current_dir(dir)
        .args(["export", "--checkpoint", &format!("ck/{kind}"), "--out", &export.display().to_string()])
        .output()
        .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    export
}

fn input(name: &str, datatype: &str, shape: Value, data: Value) -> Value {
    json!({"name": name, "datatype": datatype, "shape": shape, "data": data})
}

/// Binary data: the JSON header of `inputs` (each `(name, datatype, shape,
/// raw bytes)`), then the bytes; and the header's length.
fn binary(inputs: &[(&str, &str, Value, Vec<u8>)]) -> (Vec<u8>, Option<usize>) {
    let header: Vec<Value> = inputs
        .iter()
        .map(|(name, datatype, shape, raw)| {
            json!({"name": name, "datatype": datatype, "shape": shape,
                   "parameters": {"binary_data_size": raw.len()}})
        })
        .collect();
    let mut body = serde_json::to_vec(&json!({ "inputs": header })).expect("json");
    let json_len = body.len();
    for (_, _, _, raw) in inputs {
        body.extend_from_slice(raw);
    }
    (body, Some(json_len))
}

fn bytes_elements(values: impl Iterator<Item = String>) -> Vec<u8> {
    let mut raw = Vec::new();
    for v in values {
        raw.extend_from_slice(&(v.len() as u32).to_le_bytes());
        raw.extend_from_slice(v.as_bytes());
    }
    raw
}

/// Each form an input may take, at the limit that binds it: (what, body,
/// binary header length).
fn forms() -> Vec<(&'static str, Vec<u8>, Option<usize>)> {
    let big = BODY / MIB - 1;
    let mut forms = Vec::new();
    let mut full = vec![input("price", "FP32", json!([ROWS]), json!(vec![1.5; ROWS]))];
    for name in ["user_id", "item_id", "item_category"] {
        let ids: Vec<String> = (0..ROWS).map(|r| format!("{name}{r}")).collect();
        full.push(input(name, "BYTES", json!([ROWS]), json!(ids)));
    }
    full.push(input("site", "BYTES", json!([ROWS]), json!(vec!["s1|s2|s3"; ROWS])));
    let history: Vec<String> =
        (0..ROWS).map(|r| (0..20).map(|i| format!("i{}", r + i)).collect::<Vec<_>>().join("|")).collect();
    full.push(input("hist_items", "BYTES", json!([ROWS]), json!(history)));
    forms.push(("every input at the row limit", json!({ "inputs": full }).to_string().into_bytes(), None));
    let nan = format!(
        r#"{{"inputs": [{{"name": "price", "datatype": "FP32", "shape": [{ROWS}], "data": [{}]}}]}}"#,
        vec!["NaN"; ROWS].join(",")
    );
    forms.push(("bare NaN at the row limit", nan.into_bytes(), None));
    let numbers: Vec<u8> = (0..ROWS).flat_map(|r| (r as f32).to_le_bytes()).collect();
    let ids = bytes_elements((0..ROWS).map(|r| format!("u{r}")));
    let (body, header) = binary(&[("price", "FP32", json!([ROWS]), numbers), ("user_id", "BYTES", json!([ROWS]), ids)]);
    forms.push(("binary tensors at the row limit", body, header));

    let long = "a".repeat(MIB);
    let strings = json!({"inputs": [input("user_id", "BYTES", json!([big]), json!(vec![&long; big]))]});
    forms.push(("strings at the body limit", strings.to_string().into_bytes(), None));
    // One escape a string: the unescaped copy is the whole string.
    let escaped = format!(
        r#"{{"inputs": [{{"name": "user_id", "datatype": "BYTES", "shape": [{big}], "data": [{}]}}]}}"#,
        vec![format!("\"\\/{}\"", "a".repeat(MIB - 1)); big].join(",")
    );
    forms.push(("escaped strings at the body limit", escaped.into_bytes(), None));
    let (body, header) =
        binary(&[("user_id", "BYTES", json!([big]), bytes_elements(std::iter::repeat_n(long.clone(), big)))]);
    forms.push(("binary strings at the body limit", body, header));
    let bars = "|".repeat(MIB);
    let joined = json!({"inputs": [input("hist_items", "BYTES", json!([big]), json!(vec![&bars; big]))]});
    forms.push(("joined histories of separators at the body limit", joined.to_string().into_bytes(), None));
    let joined_ids = "ab|".repeat(MIB / 3);
    let joined = json!({"inputs": [input("hist_items", "BYTES", json!([big]), json!(vec![&joined_ids; big]))]});
    forms.push(("joined histories of IDs at the body limit", joined.to_string().into_bytes(), None));
    let flat = json!({"inputs": [input("hist_items", "BYTES", json!([1, big]), json!(vec![&long; big]))]});
    forms.push(("a flat [N, L] history at the body limit", flat.to_string().into_bytes(), None));
    let item = "i".repeat(40);
    let lists: Vec<Vec<&str>> = vec![vec![item.as_str(); 64]; ROWS];
    let lists = json!({"inputs": [input("hist_items", "BYTES", json!([ROWS, -1]), json!(lists))]});
    forms.push(("lists at the ID limit", lists.to_string().into_bytes(), None));
    let multi = "abc|".repeat(64);
    let multi = json!({"inputs": [input("site", "BYTES", json!([ROWS]), json!(vec![&multi; ROWS]))]});
    forms.push(("multi-hot cells at the ID limit", multi.to_string().into_bytes(), None));
    // The hostile test's body: one history of 6·10⁷ separators (refused: no
    // data line holds a 60 MB cell).
    let one = json!({"inputs": [input("hist_items", "BYTES", json!([1]), json!(["|".repeat(60_000_000)]))]});
    forms.push(("one joined history of 6·10⁷ separators", one.to_string().into_bytes(), None));
    for (what, body, _) in &forms {
        assert!(body.len() < 64 << 20, "{what}: {} bytes", body.len());
    }
    forms
}

/// Item 1 of issue 53: a history sent as one joined string of 6·10⁷
/// separators took 2.5 GB. Every form at the limits now stays under the
/// book's bound, for an MLP and for DIN (attention over the history).
#[test]
fn every_input_form_at_the_limits_stays_under_the_books_bound() {
    let tmp = tempfile::tempdir().expect("tmp");
    let forms = forms();
    for kind in ["mlp", "din"] {
        let export = export(tmp.path(), kind);
        for (what, body, header) in &forms {
            let server = Server::start(&export);
            let (status, reply) = server.infer(body, *header);
            let peak = server.peak_kb();
            eprintln!("{kind}: {what} ({} MB): {status}, peak {} MB", body.len() >> 20, peak / 1000);
            assert!(matches!(status, 200 | 400 | 413), "{kind}: {what}: {status} {reply}");
            assert!(peak < PEAK_BOUND_KB, "{kind}: {what}: peak {peak} kB");
            // The server goes on.
            let (status, reply) = server.infer(br#"{"inputs": []}"#, None);
            assert_eq!(status, 200, "{kind}: after {what}: {reply}");
        }
    }
}
