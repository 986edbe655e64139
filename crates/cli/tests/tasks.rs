//! Several tasks and behaviour sequences end to end (issue 41): generated
//! behaviour data with click, conversion and a class label, a history
//! column sharing the item table; `train` reports every task's figures,
//! `eval` and `predict` agree with it, `launch` trains the same model bit
//! for bit; bad labels are bad rows named by file and line; one task named
//! through `labels` is today's job bit for bit.

mod common;

use common::{last_json, sparrow, train_json};
use serde_json::{Value, json};
use std::path::Path;

/// `gen --tasks --sequence --classes 3` into `dir/data`.
fn behaviour_data(dir: &Path, train_rows: &str) -> Value {
    let out = sparrow()
        .args(["gen", "--out", &dir.join("data").display().to_string(), "--train-rows", train_rows])
        .args(["--test-rows", "4000", "--tasks", "--sequence", "--classes", "3"])
        .output()
        .expect("gen");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// A three-task MLP on the behaviour data; `extra` ends the file (in `[eval]`).
fn job(dir: &Path, extra: &str) -> String {
    let d = dir.join("data").display().to_string();
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[data]
format = "csv"
train = "{d}/train.csv"
test = "{d}/test.csv"
[data.schema]
labels = ["click", "conversion", "ad_type"]
sparse = ["user_id", "item_id", "item_category", "site"]
dense = ["price"]
dense_transform = "log1p"
multi_hot_separator = "|"
sequence = [{{ field = "hist_items", table = "item_id", max_len = 10 }}]
[model]
kind = "mlp"
embedding_dim = 8
hidden = [32, 16]
pooling = "sum"
[[model.tasks]]
name = "click"
[[model.tasks]]
name = "conversion"
weight = 2.0
[[model.tasks]]
name = "ad_type"
kind = "multiclass"
classes = 3
weight = 0.5
[train]
batch_size = 256
epochs = 2
[embedding]
optimizer = "adagrad"
learning_rate = 0.05
[checkpoint]
dir = "{ck}"
[eval]
group_by = "user_id"
{extra}
"#,
            ck = dir.join("ck").display()
        ),
    )
    .expect("write");
    path.display().to_string()
}

/// `dir/<kind>`, holding a link to `dir/data` and [`job`]'s config with
/// `model.kind = kind`: the directory and the config's path.
fn kind_job(dir: &Path, kind: &str) -> (std::path::PathBuf, String) {
    let own = dir.join(kind);
    std::fs::create_dir_all(&own).expect("dir");
    std::os::unix::fs::symlink(dir.join("data"), own.join("data")).expect("data");
    let config = job(&own, "");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("kind = \"mlp\"", &format!("kind = \"{kind}\""))).expect("write");
    (own, config)
}

#[test]
fn several_tasks_and_a_sequence_train_evaluate_predict_and_launch_alike() {
    let tmp = tempfile::tempdir().expect("tmp");
    let truth = behaviour_data(tmp.path(), "40000");
    assert_eq!(truth["header"][9], "hist_items");
    let config = job(tmp.path(), "");
    let trained = train_json(&config);
    let tasks = &trained["tasks"];
    for task in ["click", "conversion"] {
        let auc = tasks[task]["auc"].as_f64().expect("auc");
        let bayes = truth["tasks"][task]["bayes_auc"].as_f64().expect("bayes");
        // Learned (chance is 0.5 ± 0.01 on 4000 rows), and no better than the truth.
        assert!(auc > 0.58 && auc < bayes, "{task}: {auc} (Bayes {bayes})");
        for key in ["logloss", "ne", "calibration", "gauc"] {
            assert!(tasks[task][key].as_f64().is_some_and(f64::is_finite), "{task}.{key}: {tasks}");
        }
    }
    let accuracy = tasks["ad_type"]["accuracy"].as_f64().expect("accuracy");
    let rate = truth["tasks"]["ad_type"]["rate"].as_f64().expect("rate");
    assert!(accuracy > rate, "ad_type accuracy {accuracy}, the commonest class's share {rate}");
    assert!(tasks["ad_type"]["macro_auc"].as_f64().is_some_and(|a| a > 0.55), "{tasks}");
    // The first task's figures keep their keys.
    assert_eq!(trained["test_auc"], tasks["click"]["auc"]);
    assert_eq!(trained["test_logloss"], tasks["click"]["logloss"]);
    assert!(trained["truncated_sequences"].as_u64().is_some_and(|n| n > 0), "{trained}");

    // `eval` of the final checkpoint gives the same figures.
    let ck = tmp.path().join("ck").display().to_string();
    let test = tmp.path().join("data/test.csv").display().to_string();
    let eval = sparrow().args(["eval", "--checkpoint", &ck, "--data", &test]).output().expect("eval");
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    assert_eq!(last_json(&eval)["tasks"], trained["tasks"]);

    // `predict`: a line per row, each task's probabilities (1 + 1 + 3).
    let pred = tmp.path().join("pred.tsv");
    let out = sparrow()
        .args(["predict", "--checkpoint", &ck, "--data", &test, "--out", &pred.display().to_string()])
        .output()
        .expect("predict");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Vec<f64>> = std::fs::read_to_string(&pred)
        .expect("pred")
        .lines()
        .map(|l| l.split('\t').map(|v| v.parse().expect("a probability")).collect())
        .collect();
    assert_eq!(lines.len(), 4000);
    for p in &lines {
        assert_eq!(p.len(), 5);
        assert!(p.iter().all(|v| (0.0..=1.0).contains(v)));
        assert!((p[2..].iter().sum::<f64>() - 1.0).abs() < 1e-5, "{p:?}");
    }

    // A cluster of one shard and one worker trains the same model, and two
    // shards do too; its GAUC too (the loader gives each row a group number,
    // never an ID's key, and the worker scores by them).
    for shards in ["1", "2"] {
        let out = sparrow()
            .args(["launch", "--config", &config, "--shards", shards, "--workers", "1", "--quiet"])
            .args([
                "--set",
                &format!("checkpoint.dir={:?}", tmp.path().join(format!("ck{shards}")).display().to_string()),
            ])
            .output()
            .expect("launch");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let launched = last_json(&out);
        assert_eq!(launched["test_auc"], trained["test_auc"], "{shards} shards");
        assert_eq!(launched["truncated_sequences"], trained["truncated_sequences"]);
        assert_eq!(launched["tasks"], trained["tasks"], "{shards} shards");
    }
}

/// A label that is neither 0, 1 nor empty, and a class id at or past the
/// task's classes, are bad rows: counted, reported with file and line.
#[test]
fn bad_labels_are_bad_rows_named_by_file_and_line() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "2000");
    let train = tmp.path().join("data/train.csv");
    let mut text = std::fs::read_to_string(&train).expect("read");
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    lines[3] = lines[3].replacen(&lines[3][..1], "yes", 1);
    let fields: Vec<&str> = lines[7].split(',').collect();
    lines[7] = [&fields[..4], &["3"], &fields[5..]].concat().join(",");
    text = lines.join("\n") + "\n";
    std::fs::write(&train, text).expect("write");
    let config = job(tmp.path(), "");
    let out = sparrow().args(["train", "--config", &config, "--set", "train.epochs=1"]).output().expect("train");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(last_json(&out)["bad_rows"], 2, "{stderr}");
    assert!(stderr.contains("train.csv:4") && stderr.contains("task `click`"), "{stderr}");
    assert!(stderr.contains("train.csv:8") && stderr.contains("not a class id in 0..3"), "{stderr}");
    // A table that names no field is a config error naming the key.
    let out = sparrow()
        .args(["train", "--config", &config])
        .args(["--set", r#"data.schema.sequence=[{field="hist_items",table="item",max_len=5}]"#])
        .output()
        .expect("train");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("data.schema.sequence[0].table"), "{stderr}");
}

/// One task named through `data.schema.labels` (and `[[model.tasks]]`) is
/// the one-label job of before, bit for bit: the same model and figures.
#[test]
fn one_task_through_labels_is_the_one_label_job() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "6000");
    let config = job(tmp.path(), "");
    let text = std::fs::read_to_string(&config).expect("config");
    let head = text.split("[[model.tasks]]").next().expect("head").to_string();
    let tail = &text[text.find("[train]").expect("train")..];
    let one_label =
        format!("{head}{tail}").replace(r#"labels = ["click", "conversion", "ad_type"]"#, r#"label = "click""#);
    let through_labels = format!("{head}[[model.tasks]]\nname = \"click\"\n{tail}")
        .replace(r#"labels = ["click", "conversion", "ad_type"]"#, r#"labels = ["click"]"#);
    let run = |name: &str, text: &str| {
        let ck = tmp.path().join(format!("ck-{name}"));
        let text = text.replace(&tmp.path().join("ck").display().to_string(), &ck.display().to_string());
        let path = tmp.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).expect("write");
        let json = train_json(&path.display().to_string());
        let latest = std::fs::read_to_string(ck.join("LATEST")).expect("latest");
        (json, std::fs::read(ck.join(latest.trim()).join("dense.safetensors")).expect("dense"))
    };
    let (a, dense_a) = run("one-label", &one_label);
    let (b, dense_b) = run("through-labels", &through_labels);
    assert_eq!(a["test_auc"], b["test_auc"]);
    assert_eq!(a["embedding_rows"], b["embedding_rows"]);
    assert!(dense_a == dense_b, "the dense weights differ");
}

/// The book's example (models chapter) (`configs/behaviour-tasks.toml` on `gen --tasks
/// --sequence --classes 4`) trains, exports and is served: each task's
/// output (`probability_<task>`, `probabilities_<task>` [N, 4], and the
/// first task as `probability`) equals `sparrow predict`'s figures for the
/// same rows, whether the history comes as a list of IDs a row or as the
/// file's string of them; bad requests are refused naming what.
#[test]
fn the_readme_example_trains_and_serves_an_output_per_task() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data/behaviour");
    let out = sparrow()
        .args(["gen", "--out", &data.display().to_string(), "--train-rows", "5000", "--test-rows", "1000"])
        .args(["--tasks", "--sequence", "--classes", "4"])
        .output()
        .expect("gen");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for kind in ["mlp", "din"] {
        served_like_predict(tmp.path(), &data, kind);
    }
}

/// [`the_readme_example_trains_and_serves_an_output_per_task`] for one `model.kind`.
fn served_like_predict(dir: &Path, data: &Path, kind: &str) {
    let tmp = dir.join(kind);
    std::fs::create_dir_all(&tmp).expect("dir");
    std::os::unix::fs::symlink(dir.join("data"), tmp.join("data")).expect("data");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/behaviour-tasks.toml");
    let out = sparrow()
        .current_dir(&tmp)
        .args(["train", "--config", config, "--quiet", "--set", "train.epochs=1"])
        .args(["--set", &format!("model.kind={kind:?}")])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json = last_json(&out);
    for task in ["click", "conversion", "ad_type"] {
        assert!(json["tasks"][task]["rows"] == 1000, "{task}: {json}");
    }
    let export = tmp.join("export");
    let out = sparrow()
        .current_dir(&tmp)
        .args(["export", "--checkpoint", "ck/behaviour", "--out", &export.display().to_string()])
        .output()
        .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pred = tmp.join("pred.tsv");
    let test = data.join("test.csv");
    let out = sparrow()
        .args(["predict", "--model", &export.display().to_string(), "--data", &test.display().to_string()])
        .args(["--out", &pred.display().to_string()])
        .output()
        .expect("predict");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let predicted: Vec<Vec<f64>> = std::fs::read_to_string(&pred)
        .expect("pred")
        .lines()
        .take(40)
        .map(|l| l.split('\t').map(|v| v.parse().expect("number")).collect())
        .collect();
    let text = std::fs::read_to_string(&test).expect("test");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let rows: Vec<Vec<&str>> = lines.take(40).map(|l| l.split(',').collect()).collect();
    let column = |name: &str| header.iter().position(|h| *h == name).expect("column");
    // The history as a list of IDs a row, as the file's string of them, or
    // flat [N, L] (padded with empty strings, as a numpy client sends it).
    let longest = rows.iter().map(|r| r[column("hist_items")].split('|').count()).max().expect("rows");
    let request = |form: usize| {
        let mut inputs = vec![serde_json::json!({"name": "price", "datatype": "FP32", "shape": [rows.len()],
            "data": rows.iter().map(|r| r[column("price")].parse::<f64>().expect("price")).collect::<Vec<_>>()})];
        for name in ["user_id", "item_id", "item_category", "site"] {
            let data: Vec<&str> = rows.iter().map(|r| r[column(name)]).collect();
            inputs.push(serde_json::json!({"name": name, "datatype": "BYTES", "shape": [rows.len()], "data": data}));
        }
        let cells = rows.iter().map(|r| r[column("hist_items")]);
        let text = |v: &str| json!(v);
        let (history, shape): (Vec<Value>, Value) = match form {
            0 => (cells.map(|c| serde_json::json!(c.split('|').collect::<Vec<_>>())).collect(), json!([rows.len()])),
            1 => (cells.map(text).collect(), json!([rows.len()])),
            _ => (
                cells
                    .flat_map(|c| {
                        let ids: Vec<&str> = c.split('|').collect();
                        (0..longest).map(move |i| serde_json::json!(ids.get(i).copied().unwrap_or("")))
                    })
                    .collect(),
                json!([rows.len(), longest]),
            ),
        };
        inputs.push(json!({"name": "hist_items", "datatype": "BYTES", "shape": shape, "data": history}));
        serde_json::json!({ "inputs": inputs })
    };
    let mut serve = sparrow()
        .args(["serve", "--model", &export.display().to_string(), "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("serve");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(serve.stdout.take().expect("stdout")), &mut line)
        .expect("first line");
    let addr = serde_json::from_str::<Value>(&line).expect("started")["listening"].as_str().expect("addr").to_string();
    let infer = |body: &Value| {
        let path = "/v2/models/export/infer";
        let (status, reply) = common::http_request(&addr, "POST", path, body.to_string().as_bytes(), None);
        (status, reply)
    };
    let (status, meta) = common::http_request(&addr, "GET", "/v2/models/export", b"", None);
    assert_eq!(status, 200, "{meta}");
    assert!(meta.contains("probability_conversion") && meta.contains("probabilities_ad_type"), "{meta}");
    for form in 0..3 {
        let (status, reply) = infer(&request(form));
        assert_eq!(status, 200, "{reply}");
        let reply: Value = serde_json::from_str(&reply).expect("json");
        let output = |name: &str| -> Vec<f64> {
            let o = reply["outputs"].as_array().expect("outputs").iter().find(|o| o["name"] == name);
            let o = o.unwrap_or_else(|| panic!("no output {name}: {reply}"));
            o["data"].as_array().expect("data").iter().map(|v| v.as_f64().expect("number")).collect()
        };
        let (click, conversion, ad_type) =
            (output("probability_click"), output("probability_conversion"), output("probabilities_ad_type"));
        assert_eq!(output("probability"), click, "the first task is also `probability`");
        for (r, want) in predicted.iter().enumerate() {
            let got =
                [click[r], conversion[r], ad_type[4 * r], ad_type[4 * r + 1], ad_type[4 * r + 2], ad_type[4 * r + 3]];
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "row {r} (history form {form}): served {got:?}, predict {want:?}");
            }
        }
    }
    let mut wrong = request(0);
    wrong["outputs"] = serde_json::json!([{"name": "logit"}]);
    let (status, reply) = infer(&wrong);
    assert!(status == 400 && reply.contains("output `logit`") && reply.contains("probability_click"), "{reply}");
    let mut wrong = request(0);
    wrong["inputs"][5]["data"][0] = serde_json::json!(["i1", 7]);
    let (status, reply) = infer(&wrong);
    // (JSON objects here put `data` before `name`: the input is named by its place.)
    assert!(status == 400 && reply.contains("input `#5`: data[0] is a list holding a number"), "{reply}");
    let _ = serve.kill();
    let _ = serve.wait();
}

/// `mmoe`, `ple`, `esmm` and `din` train on the behaviour data (ESMM on
/// its two binary tasks), learn every task, and a two-shard cluster trains
/// each to the same model bit for bit (DIN's workers read the history
/// items unpooled, their gradients scattered back to the shards' rows).
#[test]
fn the_multi_task_kinds_train_and_launch_alike() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "40000");
    let three = std::fs::read_to_string(job(tmp.path(), "")).expect("config");
    let two = two_binary_tasks(&three);
    for (kind, text) in [("mmoe", &three), ("ple", &three), ("esmm", &two), ("din", &three)] {
        // The default experts (4 of [64]): MMoE and PLE run their batches
        // of 256 in halves (`models/halves.rs`), on `train` and `launch` alike.
        let text = text.replace("kind = \"mlp\"", &format!("kind = \"{kind}\"\ntower_hidden = [8]"));
        let path = tmp.path().join(format!("{kind}.toml"));
        std::fs::write(&path, text).expect("write");
        let config = path.display().to_string();
        let trained = train_json(&config);
        for (task, figures) in trained["tasks"].as_object().expect("tasks") {
            let learned = figures["auc"].as_f64().or(figures["macro_auc"].as_f64()).expect("an AUC");
            assert!(learned > 0.55, "{kind}: {task}: {figures}");
        }
        let ck = format!("checkpoint.dir={:?}", tmp.path().join(format!("ck-{kind}")).display().to_string());
        let out = sparrow()
            .args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet", "--set", &ck])
            .output()
            .expect("launch");
        assert!(out.status.success(), "{kind}: {}", String::from_utf8_lossy(&out.stderr));
        let launched = last_json(&out);
        assert_eq!(launched["test_auc"], trained["test_auc"], "{kind}");
        assert_eq!(launched["tasks"]["conversion"]["auc"], trained["tasks"]["conversion"]["auc"], "{kind}");
    }
}

/// A behaviour job's config with its two binary tasks alone (ESMM's).
fn two_binary_tasks(three: &str) -> String {
    let head = three.split("[[model.tasks]]").next().expect("head");
    let tail = &three[three.find("[train]").expect("train")..];
    format!("{head}{tail}").replace(r#"["click", "conversion", "ad_type"]"#, r#"["click", "conversion"]"#)
}

/// Exactness holds for several tasks and a sequence, pooled by sum (MLP)
/// or by attention (DIN), and for the multi-task kinds (ESMM on its two
/// tasks), MMoE also batch-normed and DIN also with Dice in its MLP and its
/// attention unit (their batches of 256 run in halves whose statistics
/// meet): the SSD tier trains the in-memory model, a run stopped
/// at step 40 and resumed ends with the uninterrupted one's figures, and
/// one or three step threads (`train.threads`; 2 by default) train the same
/// model, bit for bit.
#[test]
fn several_tasks_are_exact_on_the_ssd_tier_and_across_a_resume() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "12000");
    for kind in ["mlp", "din", "mmoe", "ple", "esmm", "mmoe-batch", "din-dice"] {
        let (dir, config) = kind_job(tmp.path(), kind);
        let text = std::fs::read_to_string(&config).expect("config");
        match kind {
            "esmm" => std::fs::write(&config, two_binary_tasks(&text)).expect("write"),
            "mmoe-batch" => {
                let text = text.replace(r#"kind = "mmoe-batch""#, "kind = \"mmoe\"\nnorm = \"batch\"");
                std::fs::write(&config, text).expect("write");
            }
            "din-dice" => {
                let dice = "kind = \"din\"\nactivation = \"dice\"\nattention_activation = \"dice\"";
                std::fs::write(&config, text.replace(r#"kind = "din-dice""#, dice)).expect("write");
            }
            _ => {}
        }
        exact_on_the_ssd_tier_and_across_a_resume(&dir, &config);
    }
}

fn exact_on_the_ssd_tier_and_across_a_resume(dir: &Path, config: &str) {
    let whole = train_json(config);
    let run = |args: &[&str]| {
        let out = sparrow().args(["train", "--config", config, "--quiet"]).args(args).output().expect("train");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let ssd = dir.join("ssd").display().to_string();
    let on_ssd = run(&[
        "--set",
        "embedding.storage=\"ssd\"",
        "--set",
        &format!("embedding.path={ssd:?}"),
        "--set",
        "embedding.cache_capacity_rows=3000",
        "--set",
        &format!("checkpoint.dir={:?}", dir.join("ck-ssd").display().to_string()),
    ]);
    assert!(on_ssd["cache_hit_rate"].as_f64().is_some_and(|r| r < 1.0), "the tier was used: {on_ssd}");
    assert_eq!(on_ssd["tasks"], whole["tasks"]);
    let ck = format!("checkpoint.dir={:?}", dir.join("ck-resumed").display().to_string());
    run(&["--set", &ck, "--set", "train.max_steps=40"]);
    let resumed = run(&["--set", &ck, "--resume", &dir.join("ck-resumed").display().to_string()]);
    assert_eq!(resumed["resumed_from_step"], 40);
    assert_eq!(resumed["tasks"], whole["tasks"]);
    for threads in [1, 3] {
        let ck = format!("checkpoint.dir={:?}", dir.join(format!("ck-threads-{threads}")).display().to_string());
        let other = run(&["--set", &ck, "--set", &format!("train.threads={threads}")]);
        assert_eq!(other["tasks"], whole["tasks"], "train.threads = {threads}");
    }
}

/// Every sync policy takes several tasks, pooled by sum (MLP) or by
/// attention (DIN): with one worker, `sync = "round"` trains `train`'s model
/// bit for bit, and `sync = "lazy"` a model within its aggregation's
/// rounding of it; one collocated node (S1) trains `train`'s model bit for
/// bit; the bf16 path trains them too (other bits, close figures).
#[test]
fn several_tasks_run_under_every_sync_policy_and_in_bf16() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "30000");
    for kind in ["mlp", "din"] {
        let (dir, config) = kind_job(tmp.path(), kind);
        under_every_sync_policy_and_in_bf16(&dir, &config, kind);
    }
}

fn under_every_sync_policy_and_in_bf16(dir: &Path, config: &str, kind: &str) {
    let whole = train_json(config);
    let ck = |name: &str| format!("checkpoint.dir={:?}", dir.join(name).display().to_string());
    let modes: [(&str, &[&str]); 3] = [
        ("round", &["--shards", "2", "--workers", "1", "--set", "cluster.sync=\"round\""]),
        ("lazy", &["--shards", "2", "--workers", "1", "--set", "cluster.sync=\"lazy\""]),
        ("collocated", &["--nodes", "1", "--set", "cluster.mode=\"collocated\"", "--set", "cluster.pass_batches=8"]),
    ];
    for (mode, args) in modes {
        let out = sparrow()
            .args(["launch", "--config", config, "--quiet", "--set", &ck(&format!("ck-{mode}"))])
            .args(args)
            .output()
            .expect("launch");
        assert!(out.status.success(), "{kind} {mode}: {}", String::from_utf8_lossy(&out.stderr));
        let launched = last_json(&out);
        if mode != "lazy" {
            assert_eq!(launched["tasks"], whole["tasks"], "{kind} {mode}");
        }
        for task in ["click", "conversion"] {
            let auc = |j: &Value| j["tasks"][task]["auc"].as_f64().expect("auc");
            assert!((auc(&launched) - auc(&whole)).abs() < 0.01, "{kind} {mode}: {task}: {launched}");
        }
    }
    let out = sparrow()
        .args(["train", "--config", config, "--quiet", "--set", "model.precision=\"bf16\"", "--set", &ck("ck-bf16")])
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bf16 = last_json(&out);
    // Close figures at the test set's resolution: 4,000 rows, about 680
    // clicks and 200 conversions, an AUC's standard error about 0.01 and
    // 0.02. DIN's bf16 and fp32 conversion AUCs differed by up to 0.040
    // over seeds 0–5 (clicks: 0.018); chance is 0.5 ± 0.01.
    for (task, within) in [("click", 0.03), ("conversion", 0.06)] {
        let (a, b) =
            (bf16["tasks"][task]["auc"].as_f64().expect("auc"), whole["tasks"][task]["auc"].as_f64().expect("auc"));
        assert!((a - b).abs() < within, "{kind}: {task}: bf16 {a}, f32 {b}");
    }
    let clicks = bf16["tasks"]["click"]["auc"].as_f64().expect("auc");
    assert!(clicks > 0.55, "{kind}: bf16 learned clicks: {clicks}");
}

/// S0.7: `data.group_by_label` batches the training rows by the class of
/// `ad_type` (the first multiclass task). Two runs give the same model; a
/// run stopped at step 13 (inside a window of rows) and resumed gives the
/// uninterrupted one's; a two-shard cluster trains it bit for bit; it is
/// another model than ordinary batches give. Bad keys are named.
#[test]
fn label_grouped_batches_are_repeatable_resumable_and_launch_alike() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "12000");
    let config = job(tmp.path(), "");
    let ordinary = train_json(&config);
    let text = std::fs::read_to_string(&config).expect("config");
    let grouped_text = text.replace("[data.schema]", "group_by_label = true\ngroup_window_rows = 5000\n[data.schema]");
    std::fs::write(&config, &grouped_text).expect("write");
    let run = |args: &[&str]| {
        let out = sparrow().args(["train", "--config", &config, "--quiet"]).args(args).output().expect("train");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let ck = |name: &str| format!("checkpoint.dir={:?}", tmp.path().join(name).display().to_string());
    let grouped = run(&["--set", &ck("ck-a")]);
    assert_ne!(grouped["tasks"], ordinary["tasks"], "grouping changes the batches");
    // Every window's labels end in a shorter batch: more steps than rows / batch.
    assert!(grouped["steps"].as_u64() > ordinary["steps"].as_u64(), "{grouped}");
    assert_eq!(run(&["--set", &ck("ck-b")])["tasks"], grouped["tasks"], "repeatable");
    run(&["--set", &ck("ck-r"), "--set", "train.max_steps=13"]);
    let resumed = run(&["--set", &ck("ck-r"), "--resume", &tmp.path().join("ck-r").display().to_string()]);
    assert_eq!(resumed["resumed_from_step"], 13);
    assert_eq!(resumed["tasks"], grouped["tasks"], "resumed inside a window");
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet", "--set", &ck("ck-l")])
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(last_json(&out)["tasks"], grouped["tasks"], "launch");
    for (set, key) in [
        ("data.group_task=\"price\"", "data.group_task"),
        ("data.weighting.decay_base=2.0", "data.group_by_label"),
        ("data.group_window_rows=0", "data.group_window_rows"),
    ] {
        let out = sparrow().args(["train", "--config", &config, "--quiet", "--set", set]).output().expect("train");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(key), "{set}: {stderr}");
    }
}

/// `data.shuffle`: the training rows in a seeded order, windows of 5000
/// rows. Two runs give the same model; a run stopped at step 13 (inside a
/// window) and resumed gives the uninterrupted one's; a two-shard cluster
/// trains it bit for bit; it is another model than the file's order
/// gives (two epochs each; `shuffle.rs` shows each epoch draws another
/// order). Bad keys are named.
#[test]
fn shuffled_rows_are_repeatable_resumable_and_launch_alike() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "12000");
    let config = job(tmp.path(), "");
    let run = |args: &[&str]| {
        let out = sparrow().args(["train", "--config", &config, "--quiet"]).args(args).output().expect("train");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let two = ["--set", "train.epochs=2"];
    let ordinary = run(&two);
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("[data.schema]", "shuffle = true\nshuffle_window_rows = 5000\n[data.schema]"))
        .expect("write");
    let ck = |name: &str| format!("checkpoint.dir={:?}", tmp.path().join(name).display().to_string());
    let shuffled = run(&[&two[..], &["--set", &ck("ck-a")]].concat());
    assert_ne!(shuffled["tasks"], ordinary["tasks"], "the shuffle changes the batches");
    assert_eq!(run(&[&two[..], &["--set", &ck("ck-b")]].concat())["tasks"], shuffled["tasks"], "repeatable");
    run(&[&two[..], &["--set", &ck("ck-r"), "--set", "train.max_steps=13"]].concat());
    let resume = tmp.path().join("ck-r").display().to_string();
    let resumed = run(&[&two[..], &["--set", &ck("ck-r"), "--resume", &resume]].concat());
    assert_eq!(resumed["resumed_from_step"], 13);
    assert_eq!(resumed["tasks"], shuffled["tasks"], "resumed inside a window");
    let out = sparrow()
        .args(["launch", "--config", &config, "--shards", "2", "--workers", "1", "--quiet", "--set", &ck("ck-l")])
        .args(two)
        .output()
        .expect("launch");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(last_json(&out)["tasks"], shuffled["tasks"], "launch");
    for (set, key) in [
        ("data.group_by_label=true", "data.shuffle"),
        ("data.weighting.decay_base=2.0", "data.shuffle"),
        ("data.shuffle_window_rows=0", "data.shuffle_window_rows"),
    ] {
        let out = sparrow().args(["train", "--config", &config, "--quiet", "--set", set]).output().expect("train");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(key), "{set}: {stderr}");
    }
}

/// `gen --click-shift X` moves every click logit: −2 takes the click rate
/// from about 17% to a few percent (what production ads see), the truth
/// follows it, and a value that is not a number is refused.
#[test]
fn gen_moves_the_click_rate_by_its_shift() {
    let tmp = tempfile::tempdir().expect("tmp");
    let rate = |shift: &str| {
        let out = sparrow()
            .args(["gen", "--out", &tmp.path().join(shift).display().to_string(), "--train-rows", "20000"])
            .args(["--test-rows", "20000", "--tasks", "--click-shift", shift])
            .output()
            .expect("gen");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)["tasks"]["click"]["rate"].as_f64().expect("rate")
    };
    let (base, shifted) = (rate("0"), rate("-2"));
    assert!(base > 0.12 && shifted < 0.05 && shifted > 0.005, "click rates {base} and {shifted}");
    let out = sparrow().args(["gen", "--out", "x", "--tasks", "--click-shift", "NaN"]).output().expect("gen");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--click-shift"));
}

/// `data.validation` with several tasks: the final JSON's
/// `validation_tasks` gives every task's figures of the last validation
/// (the `validation` line's `tasks`), `validation_auc` the first task's;
/// a run resumed past that validation, which validates no more, reports
/// the same figures from its checkpoint, and so does `launch`, whose
/// generation after the validation reads them from the manifest the
/// coordinator wrote (before, both reported no task's figures but the
/// first's).
#[test]
fn every_tasks_validation_figures_are_reported_and_kept_across_a_resume() {
    let tmp = tempfile::tempdir().expect("tmp");
    behaviour_data(tmp.path(), "12000");
    let config = job(tmp.path(), "");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replacen("[data]\n", "[data]\nvalidation = 0.25\n", 1)).expect("write");
    let set = |key: &str, name: &str| format!("{key}={:?}", tmp.path().join(name).display().to_string());
    let run = |command: &str, name: &str, args: &[&str]| {
        let out = sparrow()
            .args([command, "--config", &config, "--quiet", "--set", &set("checkpoint.dir", name)])
            .args(["--set", &set("train.metrics_path", &format!("{name}.jsonl"))])
            .args(args)
            .output()
            .expect("run");
        assert!(out.status.success(), "{command} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        last_json(&out)
    };
    let one = run("train", "one", &["--set", "train.epochs=1"]);
    let per_epoch = one["train_rows"].as_u64().expect("rows").div_ceil(256);
    // Past the first epoch's validation; the second epoch's end is not reached.
    let stop = format!("train.max_steps={}", per_epoch + 9);
    let whole = run("train", "whole", &["--set", &stop]);
    let text = std::fs::read_to_string(tmp.path().join("whole.jsonl")).expect("metrics");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a json line"))
        .filter(|v| v["event"] == "validation")
        .collect();
    assert_eq!(lines.len(), 1, "one validation, at the first epoch's end: {lines:?}");
    let tasks = &whole["validation_tasks"];
    assert_eq!(tasks, &lines[0]["tasks"], "the last validation's figures");
    assert_eq!(tasks.as_object().map(|t| t.len()), Some(3), "{whole}");
    assert_eq!(whole["validation_auc"], tasks["click"]["auc"]);
    for (task, key) in [("conversion", "auc"), ("conversion", "gauc"), ("ad_type", "macro_auc")] {
        assert!(tasks[task][key].as_f64().is_some_and(f64::is_finite), "{task}.{key}: {tasks}");
    }
    assert_eq!(tasks["click"]["rows"], whole["validation_rows"]);
    run("train", "cut", &["--set", &format!("train.max_steps={}", per_epoch + 4)]);
    let resume = tmp.path().join("cut").display().to_string();
    let resumed = run("train", "cut", &["--set", &stop, "--resume", &resume]);
    assert_eq!(resumed["resumed_from_step"], per_epoch + 4);
    assert_eq!(resumed["validation_tasks"], whole["validation_tasks"], "kept in the checkpoint");
    let launched = run("launch", "launched", &["--set", &stop, "--shards", "2", "--workers", "1"]);
    assert_eq!(launched["validation_tasks"], whole["validation_tasks"], "launch");
    assert_eq!(launched["tasks"], whole["tasks"], "launch");
}
