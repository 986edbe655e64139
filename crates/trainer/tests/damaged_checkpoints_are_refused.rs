//! Truncated, corrupted or mismatched checkpoints give a clear error, never a
//! silently wrong model.

mod common;

use sparrow_core::Overrides;
use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sparrow_trainer::checkpoint::{load_trainer, resolve};
use sparrow_trainer::{evaluate_checkpoint, train};

fn trained_checkpoint(tmp: &Path) -> (PathBuf, PathBuf) {
    let data = tmp.join("data");
    common::small_data(&data, 1500, 300);
    let mut c = common::small_config(&data, "dlrm");
    let ck = tmp.join("ck");
    c.checkpoint.dir = Some(ck.display().to_string());
    train(&c, true).expect("train");
    (data, ck)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

fn load_err(dir: &Path) -> String {
    match load_trainer(dir, &Overrides::none()) {
        Ok(_) => panic!("{} loaded although damaged", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damage_and_mismatch_are_reported() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (data, ck) = trained_checkpoint(tmp.path());
    let version = resolve(&ck).expect("resolve");
    assert!(load_trainer(&ck, &Overrides::none()).is_ok());
    let eval = evaluate_checkpoint(&ck, &data.join("test.tsv"), &Overrides::none(), Some(1)).expect("eval");
    assert_eq!(eval.rows, 300);
    assert!(eval.auc > 0.5);

    // Truncated embeddings file.
    let cut = tmp.path().join("cut");
    copy_dir(&version, &cut);
    let f = OpenOptions::new().write(true).open(cut.join("embeddings.bin")).expect("open");
    let len = f.metadata().expect("meta").len();
    f.set_len(len - 7).expect("truncate");
    let msg = load_err(&cut);
    assert!(msg.contains("embeddings.bin") && msg.contains("truncated"), "{msg}");

    // One flipped byte in the dense weights.
    let flipped = tmp.path().join("flipped");
    copy_dir(&version, &flipped);
    let mut f = OpenOptions::new().read(true).write(true).open(flipped.join("dense.safetensors")).expect("open");
    let at = f.metadata().expect("meta").len() - 5;
    f.seek(SeekFrom::Start(at)).expect("seek");
    f.write_all(&[0x5a]).expect("write");
    drop(f);
    let msg = load_err(&flipped);
    assert!(msg.contains("dense.safetensors") && msg.contains("checksum"), "{msg}");

    // One flipped byte in an embedding row.
    let flipped_rows = tmp.path().join("flipped-rows");
    copy_dir(&version, &flipped_rows);
    let mut f = OpenOptions::new().read(true).write(true).open(flipped_rows.join("embeddings.bin")).expect("open");
    f.seek(SeekFrom::Start(100)).expect("seek");
    f.write_all(&[0xff, 0x00]).expect("write");
    drop(f);
    let msg = load_err(&flipped_rows);
    assert!(msg.contains("checksum"), "{msg}");

    // Truncated manifest.
    let half = tmp.path().join("half-manifest");
    copy_dir(&version, &half);
    let text = std::fs::read(half.join("manifest.json")).expect("read");
    std::fs::write(half.join("manifest.json"), &text[..text.len() / 2]).expect("write");
    let msg = load_err(&half);
    assert!(msg.contains("manifest") && msg.contains("corrupt or truncated"), "{msg}");

    // Not a checkpoint at all.
    let msg = load_err(&data);
    assert!(msg.contains("not a checkpoint"), "{msg}");

    // A checkpoint of another model kind cannot be resumed by this config.
    let mut other = common::small_config(&data, "mlp");
    other.checkpoint.resume_from = Some(ck.display().to_string());
    let err = train(&other, true).expect_err("kind mismatch");
    let msg = err.to_string();
    assert!(msg.contains("`dlrm`") && msg.contains("`mlp`"), "{msg}");
}

/// Rows whose state another optimizer or another rounding would misread
/// are refused naming the key, even where the row lengths agree: SGD's rows
/// with stochastic rounding's count word are as long as row-wise Adagrad's.
#[test]
fn rows_of_another_optimizer_or_rounding_are_refused() {
    use sparrow_core::config::{EmbeddingDtype, Rounding, SparseOptimizerKind};
    let tmp = tempfile::tempdir().expect("tmp");
    let (c, ck) = mlp_checkpoint(tmp.path(), &|c| {
        c.embedding.dtype = EmbeddingDtype::F16;
        c.embedding.optimizer = SparseOptimizerKind::Sgd;
        c.embedding.rounding = Rounding::Stochastic;
    });
    let resume = |edit: &dyn Fn(&mut sparrow_core::Config)| {
        train(&resuming(&c, &ck, edit), true).map(|_| ()).expect_err("refused").to_string()
    };
    let msg = resume(&|c| {
        c.embedding.optimizer = SparseOptimizerKind::RowwiseAdagrad;
        c.embedding.rounding = Rounding::Nearest;
    });
    assert!(msg.contains("embedding.optimizer") && msg.contains("sgd"), "{msg}");
    let msg = resume(&|c| c.embedding.rounding = Rounding::Nearest);
    assert!(msg.contains("embedding.rounding") && msg.contains("stochastic"), "{msg}");
    // The same settings resume.
    train(&resuming(&c, &ck, &|_| {}), true).expect("the same settings resume");
}

/// An `mlp` of `edit`'s settings trained into `tmp/ck`: its config and that directory.
fn mlp_checkpoint(tmp: &Path, edit: &dyn Fn(&mut sparrow_core::Config)) -> (sparrow_core::Config, PathBuf) {
    let data = tmp.join("data");
    common::small_data(&data, 1500, 300);
    let mut c = common::small_config(&data, "mlp");
    edit(&mut c);
    let ck = tmp.join("ck");
    c.checkpoint.dir = Some(ck.display().to_string());
    train(&c, true).expect("train");
    (c, ck)
}

/// `c` resuming from `ck`, `edit` applied.
fn resuming(c: &sparrow_core::Config, ck: &Path, edit: &dyn Fn(&mut sparrow_core::Config)) -> sparrow_core::Config {
    let mut again = c.clone();
    again.checkpoint.resume_from = Some(ck.display().to_string());
    edit(&mut again);
    again
}

/// A model of another `model.norm` is refused naming the key and the value
/// that resumes it (an `mlp` trained with `none` resumed asking for
/// `batch`), not by its parameters' sizes; `auto` resumes it (none for an
/// `mlp`). A stored config older than the key reads as `none`
/// (`config/stored.rs`).
#[test]
fn a_model_of_another_norm_is_refused_naming_the_key() {
    use sparrow_core::config::NormSetting;
    let tmp = tempfile::tempdir().expect("tmp");
    let (c, ck) = mlp_checkpoint(tmp.path(), &|c| c.model.norm = NormSetting::None);
    let batch = resuming(&c, &ck, &|c| c.model.norm = NormSetting::Batch);
    let msg = train(&batch, true).map(|_| ()).expect_err("refused").to_string();
    assert!(msg.contains("model.norm = \"none\"") && msg.contains("\"batch\""), "{msg}");
    // `auto` resolves as the checkpoint's `none` for an mlp: it resumes.
    train(&resuming(&c, &ck, &|c| c.model.norm = NormSetting::Auto), true).expect("auto is none for an mlp");
}

#[test]
fn keeps_the_newest_versions_and_latest_points_at_a_complete_one() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 1500, 100);
    let mut c = common::small_config(&data, "fm");
    let ck = tmp.path().join("ck");
    c.checkpoint.dir = Some(ck.display().to_string());
    c.checkpoint.every_steps = Some(3);
    c.checkpoint.keep = 2;
    let s = train(&c, true).expect("train");
    let mut versions: Vec<String> = std::fs::read_dir(&ck)
        .expect("read")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("ckpt-"))
        .collect();
    versions.sort();
    assert_eq!(versions.len(), 2, "{versions:?}");
    let latest = std::fs::read_to_string(ck.join("LATEST")).expect("LATEST");
    assert_eq!(latest.trim(), format!("ckpt-{:012}", s.steps));
    assert_eq!(versions.last().map(String::as_str), Some(latest.trim()));

    // Resuming a finished run into the same directory checkpoints the same
    // step again: a new version, never the one LATEST names replaced in place.
    c.checkpoint.resume_from = Some(ck.display().to_string());
    let again = train(&c, true).expect("resume");
    assert_eq!(again.steps, s.steps);
    let latest = std::fs::read_to_string(ck.join("LATEST")).expect("LATEST");
    assert_eq!(latest.trim(), format!("ckpt-{:012}-1", s.steps));
    assert!(sparrow_trainer::checkpoint::load_trainer(&ck, &Overrides::none()).is_ok());
}

/// The feature-filter state is checked like the rows: a truncated or
/// altered filters.bin is refused naming it.
#[test]
fn damaged_filter_state_is_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 1500, 300);
    let mut c = common::small_config(&data, "dlrm");
    c.embedding.admit_min_count = 2;
    c.embedding.ttl_steps = 5;
    let ck = tmp.path().join("ck");
    c.checkpoint.dir = Some(ck.display().to_string());
    train(&c, true).expect("train");
    let version = resolve(&ck).expect("resolve");
    assert!(version.join("filters.bin").is_file());
    assert!(load_trainer(&ck, &Overrides::none()).is_ok());

    let cut = tmp.path().join("cut");
    copy_dir(&version, &cut);
    let f = OpenOptions::new().write(true).open(cut.join("filters.bin")).expect("open");
    f.set_len(f.metadata().expect("meta").len() - 8).expect("truncate");
    let msg = load_err(&cut);
    assert!(msg.contains("filters.bin") && msg.contains("truncated"), "{msg}");

    let flipped = tmp.path().join("flipped");
    copy_dir(&version, &flipped);
    let mut f = OpenOptions::new().read(true).write(true).open(flipped.join("filters.bin")).expect("open");
    f.seek(SeekFrom::Start(30)).expect("seek");
    f.write_all(&[0x7f]).expect("write");
    drop(f);
    let msg = load_err(&flipped);
    assert!(msg.contains("filters.bin") && msg.contains("checksum"), "{msg}");
}

/// Data of another layout than the checkpoint's is a data error naming
/// both layouts, not a damaged checkpoint.
#[test]
fn data_of_another_layout_is_named_as_such() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (data, ck) = trained_checkpoint(tmp.path());
    let dir = resolve(&ck).expect("latest");
    let c = common::small_config(&data, "dlrm");
    let layout = sparrow_data::DataLayout { num_fields: 20, num_dense: 13, weighted: false, num_tasks: 1 };
    let mut trainer = sparrow_trainer::Trainer::new(&c, layout).expect("trainer");
    let err = sparrow_trainer::checkpoint::load_into(&mut trainer, &dir).expect_err("another layout");
    assert!(matches!(err, sparrow_trainer::TrainError::DataShape { saved: (26, 13), data: (20, 13), .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("20 fields") && msg.contains("26 and 13"), "{msg}");
}
