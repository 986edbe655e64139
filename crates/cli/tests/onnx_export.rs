//! `sparrow export --format onnx` from the command line: the graph's inputs
//! are `sparrow serve`'s; past `--max-table-bytes` the graph takes pooled
//! vectors and the rows go beside it as a serving export; bad arguments are
//! refused by name. (ONNX Runtime's figures against `sparrow predict`'s, for
//! every kind, are python/tests/test_onnx.py's.)

mod common;

use common::{generate, last_json, sparrow, write_config};
use prost::Message;
use sparrow_onnx::proto::{ModelProto, ValueInfoProto, tensor_shape_proto::dimension::Value};

fn trained(dir: &std::path::Path) -> String {
    generate(dir, "4000");
    let config = write_config(dir, "");
    let ck = dir.join("ck").display().to_string();
    let out = sparrow()
        .args(["train", "--config", &config, "--set", &format!("checkpoint.dir={ck}"), "--quiet"])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    ck
}

fn graph(path: &std::path::Path) -> ModelProto {
    ModelProto::decode(std::fs::read(path).expect("model.onnx").as_slice()).expect("an ONNX model")
}

/// An input's name, element type and dimensions (`None`: the rows).
fn describe(v: &ValueInfoProto) -> (String, i32, Vec<Option<i64>>) {
    let Some(sparrow_onnx::proto::type_proto::Value::TensorType(t)) = v.r#type.as_ref().and_then(|t| t.value.clone())
    else {
        panic!("{:?} is not a tensor", v.name)
    };
    let dims = t
        .shape
        .unwrap_or_default()
        .dim
        .iter()
        .map(|d| match &d.value {
            Some(Value::DimValue(n)) => Some(*n),
            _ => None,
        })
        .collect();
    (v.name.clone().unwrap_or_default(), t.elem_type.unwrap_or_default(), dims)
}

#[test]
fn the_graph_takes_serves_inputs_or_pooled_vectors_beside_the_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ck = trained(dir.path());
    let embedded = dir.path().join("embedded");
    let out = sparrow()
        .args(["export", "--checkpoint", &ck, "--out", &embedded.display().to_string(), "--format", "onnx"])
        .output()
        .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = last_json(&out);
    assert_eq!(summary["embedded"], true, "{summary}");
    let model = graph(&embedded.join("model.onnx"));
    let g = model.graph.expect("a graph");
    let inputs: Vec<_> = g.input.iter().map(describe).collect();
    let mut expected: Vec<_> = (1..=13).map(|i| (format!("I{i}"), 1, vec![None])).collect();
    expected.extend((1..=26).map(|i| (format!("C{i}"), 8, vec![None])));
    assert_eq!(inputs, expected, "float [N] per dense column, string [N] per sparse one");
    assert_eq!(g.output.iter().map(describe).collect::<Vec<_>>(), vec![("probability".to_string(), 1, vec![None])]);
    assert!(g.node.iter().any(|n| n.op_type.as_deref() == Some("LabelEncoder")), "IDs map to rows in the graph");

    let pooled = dir.path().join("pooled");
    let out = sparrow()
        .args(["export", "--checkpoint", &ck, "--out", &pooled.display().to_string(), "--format", "onnx"])
        .args(["--max-table-bytes", "0"])
        .output()
        .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(last_json(&out)["embedded"], false);
    let g = graph(&pooled.join("model.onnx")).graph.expect("a graph");
    let inputs: Vec<_> = g.input.iter().map(describe).collect();
    assert_eq!(inputs[0], ("I1".to_string(), 1, vec![None]));
    assert_eq!(inputs[13], ("C1_embedding".to_string(), 1, vec![None, Some(8)]), "pooled vectors of width 8");
    assert!(!g.node.iter().any(|n| n.op_type.as_deref() == Some("LabelEncoder")));
    // The rows beside it are a serving export that scores as the checkpoint.
    let test = dir.path().join("data/test.tsv").display().to_string();
    let score = |source: &[&str], out: &str| {
        let o = sparrow().arg("predict").args(source).args(["--data", &test, "--out", out]).output().expect("predict");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(out).expect("predictions")
    };
    let rows = pooled.join("rows").display().to_string();
    let a = score(&["--checkpoint", &ck], &dir.path().join("a.txt").display().to_string());
    let b = score(&["--model", &rows], &dir.path().join("b.txt").display().to_string());
    assert_eq!(a, b);
}

#[test]
fn bad_exports_are_refused_by_name_and_leave_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ck = trained(dir.path());
    let out_dir = dir.path().join("onnx").display().to_string();
    let missing = dir.path().join("nope.tsv").display().to_string();
    let out = sparrow()
        .args(["export", "--checkpoint", &ck, "--out", &out_dir, "--format", "onnx", "--vocabulary", &missing])
        .output()
        .expect("export");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("nope.tsv"), "{stderr}");
    assert!(!std::path::Path::new(&out_dir).exists());
    // A vocabulary with no ID of a column would map every ID to zeros.
    let empty = dir.path().join("empty.tsv");
    std::fs::write(&empty, "").expect("write");
    let out = sparrow()
        .args(["export", "--checkpoint", &ck, "--out", &out_dir, "--format", "onnx", "--vocabulary"])
        .arg(&empty)
        .output()
        .expect("export");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no ID of column `C1`") && stderr.contains("empty.tsv"), "{stderr}");
    assert!(!std::path::Path::new(&out_dir).exists());
    // An existing directory is not written into.
    std::fs::create_dir(&out_dir).expect("mkdir");
    let out = sparrow()
        .args(["export", "--checkpoint", &ck, "--out", &out_dir, "--format", "onnx"])
        .output()
        .expect("export");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"));
}
