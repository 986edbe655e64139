//! `data.validation` and `[train.early_stopping]`: the held-out rows are
//! never trained and are the validation set; every epoch's end is scored;
//! training stops after `patience` evaluations without a new best, the
//! best model kept in `checkpoint.dir/best` and scored on `data.test`; and
//! a run stopped and resumed (mid-epoch, or right at an epoch's end) makes
//! the same evaluations, the same decisions and the same model.

mod common;

use std::path::Path;

use serde_json::Value;
use sparrow_core::config::{EarlyStoppingConfig, ValidationSet, held_out};
use sparrow_core::{Config, Overrides};
use sparrow_trainer::checkpoint::load_trainer;
use sparrow_trainer::{evaluate_checkpoint, train};

fn validation_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json line"))
        .filter(|v| v["event"] == "validation")
        .collect()
}

/// 4000 rows of small data, a quarter of them held out by `config`: the
/// folder they are in (under the temporary directory) and how many are held
/// out (the TSV's lines are numbered from 1, no header).
fn quarter_held_out() -> (tempfile::TempDir, std::path::PathBuf, u64) {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 4000, 500);
    let held = (1..=4000).filter(|&line| held_out(line, 0.25)).count() as u64;
    (tmp, data, held)
}

fn config(data: &Path, dir: &Path, epochs: u64, patience: Option<u32>) -> Config {
    let mut c = common::small_config(data, "mlp");
    c.data.validation = Some(ValidationSet::Fraction(0.25));
    c.train.epochs = epochs;
    c.checkpoint.dir = Some(dir.join("ckpt").display().to_string());
    c.train.metrics_path = Some(dir.join("metrics.jsonl").display().to_string());
    // A rate that overfits 4000 rows within a few epochs.
    c.embedding.learning_rate = 0.3;
    c.train.early_stopping = patience.map(|patience| EarlyStoppingConfig { patience, ..Default::default() });
    c
}

#[test]
fn a_held_out_fraction_is_never_trained_and_is_what_each_epoch_end_scores() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 4000, 500);
    let c = config(&data, tmp.path(), 2, None);
    let summary = train(&c, true).expect("train");
    // The TSV's lines are numbered from 1, no header.
    let held = (1..=4000).filter(|&line| held_out(line, 0.25)).count() as u64;
    assert!((800..1200).contains(&held), "{held}");
    assert_eq!(summary.train_rows, 2 * (4000 - held), "two passes over the rows not held out");
    assert_eq!(summary.validation.validation_rows, Some(held));
    let lines = validation_lines(&tmp.path().join("metrics.jsonl"));
    let per_epoch = (4000 - held).div_ceil(128);
    let at: Vec<(u64, u64)> =
        lines.iter().map(|l| (l["epoch"].as_u64().expect("a number"), l["step"].as_u64().expect("a number"))).collect();
    assert_eq!(at, vec![(0, per_epoch), (1, 2 * per_epoch)], "one validation at each epoch's end");
    assert_eq!(lines[1]["validation_auc"].as_f64(), summary.validation.validation_auc);
    assert_eq!(summary.validation.test_model.as_deref(), Some("last"));
    assert!(!summary.validation.stopped_early && summary.validation.best_step.is_none());
    // The same model as training on a file without those rows: the split is
    // by line, so the rows trained are exactly the others, in order.
    let kept: String = std::fs::read_to_string(data.join("train.tsv"))
        .expect("train")
        .lines()
        .enumerate()
        .filter(|(i, _)| !held_out(*i as u64 + 1, 0.25))
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    std::fs::write(tmp.path().join("kept.tsv"), kept).expect("write");
    let mut plain = common::small_config(&data, "mlp");
    plain.data.train = Some(tmp.path().join("kept.tsv").display().to_string());
    plain.train.epochs = 2;
    plain.embedding.learning_rate = 0.3;
    let split = common::trained_model(&Config { checkpoint: Default::default(), ..c.clone() }, &tmp.path().join("a"));
    let file = common::trained_model(&plain, &tmp.path().join("b"));
    assert!(split == file, "training with a held-out fraction is training on the other rows");
}

#[test]
fn eval_every_steps_validates_at_each_multiple_without_a_test_set() {
    let (tmp, data, held) = quarter_held_out();
    let mut c = config(&data, tmp.path(), 2, None);
    // The validation set is what `train.eval_every_steps` scores: no
    // `data.test` is needed (it was, and without one the key did nothing).
    c.data.test = None;
    c.train.eval_every_steps = Some(10);
    let summary = train(&c, true).expect("train");
    let per_epoch = (4000 - held).div_ceil(128);
    let mut want: Vec<u64> = (1..=2 * per_epoch).filter(|s| s % 10 == 0 || s % per_epoch == 0).collect();
    want.dedup();
    let lines = validation_lines(&tmp.path().join("metrics.jsonl"));
    let at: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().expect("a number")).collect();
    assert_eq!(at, want, "every 10 steps and at each epoch's end, once a step");
    assert_eq!(lines.last().and_then(|l| l["validation_auc"].as_f64()), summary.validation.validation_auc);
    assert_eq!(summary.test_auc, None);
}

#[test]
fn early_stopping_keeps_the_best_model_and_stops_once_patience_is_spent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 4000, 500);
    let c = config(&data, tmp.path(), 12, Some(2));
    let s = train(&c, true).expect("train");
    let lines = validation_lines(&tmp.path().join("metrics.jsonl"));
    // What the rule says of these lines, worked out here.
    let (mut best, mut since, mut stop_at) = (None::<(f64, u64)>, 0, None);
    for l in &lines {
        let (auc, step) = (l["validation_auc"].as_f64().expect("a number"), l["step"].as_u64().expect("a number"));
        if best.is_none_or(|(b, _)| auc > b) {
            (best, since) = (Some((auc, step)), 0);
        } else {
            since += 1;
            if since == 2 {
                stop_at = Some(step);
                break;
            }
        }
    }
    let (best_auc, best_step) = best.expect("a best");
    let stop_at = stop_at.expect("these rows overfit within 12 epochs: the rule stops the run");
    assert_eq!(lines.last().expect("lines")["step"].as_u64(), Some(stop_at), "no evaluation after the stop");
    assert_eq!((s.steps, s.validation.stopped_early), (stop_at, true));
    assert_eq!((s.validation.best_step, s.validation.best_validation), (Some(best_step), Some(best_auc)));
    // The best model is kept, and `test_*` are its figures.
    let best_dir = tmp.path().join("ckpt/best");
    assert_eq!(s.validation.best_checkpoint.as_deref(), Some(best_dir.to_str().expect("path")));
    let (_, manifest, _) = load_trainer(&best_dir, &Overrides::none()).expect("best");
    assert_eq!(manifest.step, best_step);
    assert_eq!(s.validation.test_model.as_deref(), Some("best"));
    let scored = evaluate_checkpoint(&best_dir, &data.join("test.tsv"), &Overrides::none(), None).expect("eval");
    assert_eq!(s.test_auc, Some(scored.auc));
    // The run's own checkpoint is the last model (a resume continues it).
    let (_, last, _) = load_trainer(&tmp.path().join("ckpt"), &Overrides::none()).expect("last");
    assert_eq!(last.step, stop_at);
}

/// Cut mid-epoch, right at an epoch's end (its checkpoint written before
/// that epoch's validation) and after a whole run of one epoch (its
/// checkpoint written after it): the resumed run scores what the
/// uninterrupted one scored, once each, and stops at the same step with
/// the same best and the same model.
#[test]
fn a_resumed_run_stops_where_the_uninterrupted_one_does_with_the_same_model() {
    let (tmp, data, held) = quarter_held_out();
    let per_epoch = (4000 - held).div_ceil(128);
    let full_dir = tmp.path().join("full");
    let full = train(&config(&data, &full_dir, 12, Some(2)), true).expect("full");
    let full_lines = validation_lines(&full_dir.join("metrics.jsonl"));
    // Cut by train.max_steps mid-epoch and at an epoch's end (checkpoint
    // before that epoch's validation), and by the data's end after one
    // epoch (checkpoint after it: the resumed run must not score it again).
    for (cut, epochs) in [(Some(per_epoch + 7), 12), (Some(2 * per_epoch), 12), (None, 1)] {
        let dir = tmp.path().join(format!("cut-{cut:?}-{epochs}"));
        let mut first = config(&data, &dir, epochs, Some(2));
        first.train.max_steps = cut;
        first.checkpoint.every_steps = cut;
        train(&first, true).expect("first part");
        let mut second = config(&data, &dir, 12, Some(2));
        second.checkpoint.resume_from = Some(dir.join("ckpt").display().to_string());
        let resumed = train(&second, true).expect("resumed");
        assert_eq!(resumed.steps, full.steps, "cut at {cut:?}, {epochs} epochs");
        assert_eq!(
            resumed.validation,
            full.validation.clone().with_dir(&full_dir, &dir),
            "cut at {cut:?}, {epochs} epochs"
        );
        assert_eq!(resumed.test_auc.map(f64::to_bits), full.test_auc.map(f64::to_bits));
        let lines = validation_lines(&dir.join("metrics.jsonl"));
        assert_eq!(lines, full_lines, "cut at {cut:?}, {epochs} epochs: the same validations, once each");
        for (a, b) in [(full_dir.join("ckpt"), dir.join("ckpt")), (full_dir.join("ckpt/best"), dir.join("ckpt/best"))] {
            let (ta, ma, _) = load_trainer(&a, &Overrides::none()).expect("a");
            let (tb, mb, _) = load_trainer(&b, &Overrides::none()).expect("b");
            assert_eq!(
                (ma.step, ma.early_stopping),
                (mb.step, mb.early_stopping),
                "cut at {cut:?}, {epochs} epochs: {}",
                b.display()
            );
            assert!(ta.model.params.flat_values().expect("a") == tb.model.params.flat_values().expect("b"));
        }
    }
}

/// A run that ends (`train.max_steps`) past its last validation reports that
/// validation's figures; resumed from a checkpoint after it, it reports the
/// same ones, with early stopping and without (the checkpoint keeps them:
/// before, the resumed run reported none).
#[test]
fn the_last_validation_is_reported_after_a_resume_that_validates_no_more() {
    let (tmp, data, held) = quarter_held_out();
    let per_epoch = (4000 - held).div_ceil(128);
    for patience in [Some(2), None] {
        let full_dir = tmp.path().join(format!("full-{patience:?}"));
        let mut full = config(&data, &full_dir, 3, patience);
        full.train.max_steps = Some(per_epoch + 7);
        let full = train(&full, true).expect("full");
        let lines = validation_lines(&full_dir.join("metrics.jsonl"));
        assert_eq!(lines.len(), 1, "one epoch's end validated");
        assert_eq!(full.validation.validation_auc, lines[0]["validation_auc"].as_f64());
        assert_eq!(full.validation.validation_rows, lines[0]["validation_rows"].as_u64());
        let dir = tmp.path().join(format!("cut-{patience:?}"));
        let mut first = config(&data, &dir, 3, patience);
        first.train.max_steps = Some(per_epoch + 3);
        train(&first, true).expect("first part");
        let mut second = config(&data, &dir, 3, patience);
        second.train.max_steps = Some(per_epoch + 7);
        second.checkpoint.resume_from = Some(dir.join("ckpt").display().to_string());
        let resumed = train(&second, true).expect("resumed");
        assert_eq!(resumed.validation, full.validation.with_dir(&full_dir, &dir), "patience {patience:?}");
    }
}

trait WithDir {
    fn with_dir(self, from: &Path, to: &Path) -> Self;
}

impl WithDir for sparrow_trainer::validation::ValidationReport {
    /// The report as a run in `to` would name its best checkpoint.
    fn with_dir(mut self, from: &Path, to: &Path) -> Self {
        self.best_checkpoint =
            self.best_checkpoint.map(|d| d.replace(from.to_str().expect("path"), to.to_str().expect("path")));
        self
    }
}
