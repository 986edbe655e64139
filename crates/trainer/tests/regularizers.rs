//! `embedding.l2`, `dense_optimizer.kind = "adamw"` and `model.dropout` do
//! what they say on a real run: L2 reaches each row a batch looks up once,
//! at the value it read; AdamW's decay and dropout change the model; all
//! resume bit for bit (`resumed_run_equals_uninterrupted_run.rs`) and train
//! ≡ launch (`local_cluster_equals_single_process.rs`).

mod common;

use std::collections::HashMap;
use std::path::Path;

use sparrow_core::Config;
use sparrow_core::Overrides;
use sparrow_core::config::{DenseOptimizerKind, SparseOptimizerKind};
use sparrow_embedding::Initializer;
use sparrow_trainer::train;

/// Every row's vector of the run's checkpoint in `dir`, by key, and the dense weights.
fn trained(c: &Config, dir: &Path) -> (HashMap<u64, Vec<f32>>, Vec<f32>) {
    let (dense, rows) = common::trained_model(c, dir);
    (rows.into_iter().map(|(k, r)| (k, r[..c.model.embedding_dim].to_vec())).collect(), dense)
}

/// One SGD step at learning rate η: w₁ = w₀ − η(g + l2·w₀). The step
/// without L2 and the one with it see the same g (the same initial rows and
/// weights), so for every row the first batch touched their difference is
/// η·l2·w₀ — once, though most rows sit in many of the batch's samples (a
/// per-sample L2 would move them by a multiple of it).
#[test]
fn embedding_l2_decays_each_row_a_batch_reads_once_at_the_value_it_read() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 2000, 200);
    let mut base = common::small_config(&data, "mlp");
    base.embedding.optimizer = SparseOptimizerKind::Sgd;
    base.embedding.learning_rate = 0.5;
    base.train.max_steps = Some(1);
    let (lr, l2) = (0.5f32, 0.2f32);
    let (off, dense_off) = trained(&base, &tmp.path().join("off"));
    let mut with_l2 = base.clone();
    with_l2.embedding.l2 = l2;
    let (on, dense_on) = trained(&with_l2, &tmp.path().join("on"));

    assert_eq!(dense_off, dense_on, "L2 on rows leaves the first step's dense update alone");
    assert_eq!(off.len(), on.len());
    assert!(off.len() > 100, "{} rows", off.len());
    let init = Initializer::new(base.embedding.init, sparrow_trainer::inference::seeds(base.train.seed).0);
    let mut w0 = vec![0.0f32; base.model.embedding_dim];
    let mut moved = 0;
    for (key, w_off) in &off {
        init.fill(*key, &mut w0);
        let w_on = &on[key];
        for ((&a, &b), &w) in w_off.iter().zip(w_on).zip(&w0) {
            let want = lr * l2 * w;
            assert!((a - b - want).abs() <= 1e-8 + 1e-5 * want.abs(), "key {key}: {a} − {b} is not {want}");
            moved += usize::from(a != b);
        }
    }
    assert!(moved > off.len(), "only {moved} coordinates moved");
}

/// AdamW's decoupled decay is a model of its own: not Adam's coupled L2
/// of the same strength, not Adam without decay; at weight decay 0 it is
/// Adam, bit for bit.
#[test]
fn adamw_trains_a_model_of_its_own_and_is_adam_without_decay() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 2000, 200);
    let mut base = common::small_config(&data, "mlp");
    base.train.max_steps = Some(6);
    let run = |kind: DenseOptimizerKind, weight_decay: f64, name: &str| {
        let mut c = base.clone();
        c.dense_optimizer.kind = kind;
        c.dense_optimizer.weight_decay = weight_decay;
        trained(&c, &tmp.path().join(name)).1
    };
    let adam = run(DenseOptimizerKind::Adam, 0.0, "adam");
    let adam_l2 = run(DenseOptimizerKind::Adam, 0.5, "adam-l2");
    let adamw = run(DenseOptimizerKind::AdamW, 0.5, "adamw");
    let adamw_zero = run(DenseOptimizerKind::AdamW, 0.0, "adamw-0");
    assert_eq!(adam, adamw_zero);
    assert_ne!(adamw, adam);
    assert_ne!(adamw, adam_l2);
    // The decay pulls the weights in: a smaller norm than Adam's.
    let norm = |w: &[f32]| w.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>();
    assert!(norm(&adamw) < norm(&adam), "{} vs {}", norm(&adamw), norm(&adam));
}

/// `model.dropout` changes what a step learns, not what a model predicts:
/// a run with it trains another model than one without; the test AUC the
/// run reports is what `evaluate` of its checkpoint computes (evaluation
/// drops nothing); the same config trains the same model again.
#[test]
fn dropout_trains_another_model_and_evaluation_drops_nothing() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 2000, 300);
    for kind in ["mlp", "dlrm"] {
        let mut base = common::small_config(&data, kind);
        base.train.max_steps = Some(8);
        let (_, plain) = trained(&base, &tmp.path().join(format!("{kind}-plain")));
        let mut dropped = base.clone();
        dropped.model.dropout = 0.3;
        let dir = tmp.path().join(format!("{kind}-dropout"));
        let (_, with_dropout) = trained(&dropped, &dir);
        let (_, again) = trained(&dropped, &tmp.path().join(format!("{kind}-again")));
        assert_ne!(plain, with_dropout, "{kind}: dropout changed nothing");
        assert_eq!(with_dropout, again, "{kind}: the same config, another model");
        let mut c = dropped.clone();
        c.checkpoint.dir = Some(dir.display().to_string());
        let run = train(
            &{
                let mut c = c.clone();
                c.checkpoint.dir = Some(tmp.path().join(format!("{kind}-rerun")).display().to_string());
                c
            },
            true,
        )
        .expect("train");
        let eval = sparrow_trainer::evaluate_checkpoint(&dir, &data.join("test.tsv"), &Overrides::none(), None)
            .expect("evaluate");
        assert_eq!(
            run.test_auc.map(f64::to_bits),
            Some(eval.auc.to_bits()),
            "{kind}: {:?} vs {}",
            run.test_auc,
            eval.auc
        );
    }
}
