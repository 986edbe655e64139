//! Where `sparrow export` writes, and what it reads, as a careless or
//! hostile user would give it (issue 53): an `--out` that names a
//! directory already there (through `..`, a dangling link, an empty
//! directory) is refused and nothing outside the export is touched, nothing
//! is left behind on any failure; an unbounded `--vocabulary` is refused
//! by name; pruning checkpoint versions keeps what the checkpoint did not
//! write.

mod common;

use std::path::{Path, PathBuf};

use common::{generate, sparrow, write_config};

/// Past this a command is hung (the test fails, the command is killed).
const HANG: std::time::Duration = std::time::Duration::from_secs(120);

fn trained(dir: &Path, extra: &[&str]) -> String {
    generate(dir, "4000");
    let config = write_config(dir, "");
    let ck = dir.join("ck").display().to_string();
    let out = sparrow()
        .args(["train", "--config", &config, "--set", &format!("checkpoint.dir={ck:?}"), "--quiet"])
        .args(extra)
        .output()
        .expect("train");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    ck
}

/// Every entry under `dir`, recursively, relative to it.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            all.push(p.strip_prefix(dir).expect("under").to_path_buf());
            if e.file_type().expect("type").is_dir() {
                stack.push(p);
            }
        }
    }
    all.sort();
    all
}

fn export(args: &[&str]) -> (Option<i32>, String) {
    let out = sparrow().arg("export").args(args).output().expect("export");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
}

/// Item 2: `--out prod/v2/..` overwrote `prod/model.onnx`; `nonexist/..`
/// left a full serving export in `./.tmp-…`; a dangling link left staging
/// directories with full files. Each is refused before anything is written.
#[test]
fn an_out_naming_what_exists_is_refused_and_nothing_is_left() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ck = trained(tmp.path(), &[]);
    let work = tmp.path().join("work");
    let prod = work.join("prod");
    std::fs::create_dir_all(&prod).expect("prod");
    std::fs::write(prod.join("model.onnx"), "PRODUCTION\n").expect("write");
    std::fs::create_dir(work.join("empty")).expect("empty");
    std::os::unix::fs::symlink(work.join("nowhere"), work.join("dangling")).expect("symlink");
    let before = tree(&work);
    let path = |p: &str| work.join(p).display().to_string();
    for (out, want) in [
        ("prod/v2/..", "ends in `..`"),
        ("nonexist/..", "ends in `..`"),
        ("prod/.", "exists already"),
        ("prod/model.onnx", "exists already"),
        ("empty", "exists already"),
        ("dangling", "exists already"),
    ] {
        for format in ["onnx", "serving"] {
            let (code, stderr) = export(&["--checkpoint", &ck, "--out", &path(out), "--format", format]);
            assert_eq!(code, Some(2), "{out} ({format}): {stderr}");
            assert!(stderr.contains("--out") && stderr.contains(want), "{out} ({format}): {stderr}");
        }
    }
    assert_eq!(std::fs::read_to_string(prod.join("model.onnx")).expect("read"), "PRODUCTION\n");
    assert_eq!(tree(&work), before, "nothing written, nothing left behind");
    // A failure after the export began (a missing vocabulary) leaves nothing either.
    let (code, stderr) =
        export(&["--checkpoint", &ck, "--out", &path("new"), "--format", "onnx", "--vocabulary", &path("nope.tsv")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(tree(&work), before, "{stderr}");
    // A new name is written, in both formats, through a parent given with `..`.
    for (out, format) in [("prod/../v3", "onnx"), ("v4", "serving")] {
        let (code, stderr) = export(&["--checkpoint", &ck, "--out", &path(out), "--format", format]);
        assert_eq!(code, Some(0), "{out}: {stderr}");
    }
    assert!(work.join("v3/model.onnx").is_file() && work.join("v4/manifest.json").is_file());
    let stray: Vec<PathBuf> = tree(&work).into_iter().filter(|p| p.to_string_lossy().contains("staging")).collect();
    assert!(stray.is_empty(), "{stray:?}");
}

/// Item 5: `--vocabulary /dev/zero` read until 2.26 GB, a 200 MB one-ID line
/// went into the graph, `sparrow config --config /dev/zero` read until the
/// kernel killed it at 22 GB. A vocabulary line is capped as the training
/// reader caps rows (1 MiB), a config file at 1 MiB; each refused by name.
#[test]
fn unbounded_inputs_are_refused_by_name() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ck = trained(tmp.path(), &[]);
    let long = tmp.path().join("long.tsv");
    std::fs::write(&long, format!("1\t{}\t{}\n", vec!["0"; 13].join("\t"), "x".repeat(2 << 20))).expect("write");
    for vocabulary in [Path::new("/dev/zero"), long.as_path()] {
        let out = tmp.path().join("onnx").display().to_string();
        let mut export = sparrow();
        export.args(["export", "--checkpoint", &ck, "--out", &out, "--format", "onnx", "--vocabulary"]).arg(vocabulary);
        let (status, stderr) = common::ends_within(&mut export, HANG);
        assert_eq!(status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--vocabulary") && stderr.contains("line 1 is longer than 1048576"), "{stderr}");
        assert!(!Path::new(&out).exists());
    }
    let (status, stderr) = common::ends_within(sparrow().args(["config", "--config", "/dev/zero"]), HANG);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("config /dev/zero: more than 1048576 bytes"), "{stderr}");
}

/// Item 10: an ONNX export written into a checkpoint's version directory
/// was deleted when `checkpoint.keep` pruned that version. Pruning removes
/// the files the checkpoint wrote (its manifest's) and keeps the rest,
/// with the directory and a warning.
#[test]
fn pruning_keeps_what_the_checkpoint_did_not_write() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ck = trained(tmp.path(), &["--set", "train.max_steps=5", "--set", "checkpoint.keep=1"]);
    let version = Path::new(&ck).join("ckpt-000000000005");
    assert!(version.join("manifest.json").is_file());
    let onnx = version.join("onnx");
    let (code, stderr) = export(&["--checkpoint", &ck, "--out", &onnx.display().to_string(), "--format", "onnx"]);
    assert_eq!(code, Some(0), "{stderr}");
    std::fs::write(version.join("notes.txt"), "mine\n").expect("write");
    let config = tmp.path().join("job.toml").display().to_string();
    let out = sparrow()
        .args(["train", "--config", &config, "--quiet", "--resume", &ck])
        .args(["--set", &format!("checkpoint.dir={ck:?}"), "--set", "checkpoint.keep=1"])
        .output()
        .expect("resume");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("kept") && stderr.contains("notes.txt, onnx"), "{stderr}");
    let mut left: Vec<String> =
        std::fs::read_dir(&version).expect("kept").flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
    left.sort();
    assert_eq!(left, ["notes.txt", "onnx"], "the checkpoint's own files went, the rest stayed");
    assert!(onnx.join("model.onnx").is_file());
}
