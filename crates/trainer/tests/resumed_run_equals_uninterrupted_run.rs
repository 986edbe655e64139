//! A run that stops and resumes from its checkpoint ends with exactly (bit for
//! bit) the model of an uninterrupted run with the same seed.

mod common;

use sparrow_core::Overrides;
use std::path::Path;

use sparrow_core::Config;
use sparrow_trainer::checkpoint::load_trainer;
use sparrow_trainer::train;

fn with_checkpoint(mut c: Config, dir: &Path) -> Config {
    c.checkpoint.dir = Some(dir.display().to_string());
    c
}

fn dense_values(t: &sparrow_trainer::Trainer) -> Vec<(String, Vec<f32>)> {
    t.model
        .params
        .vars()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values")))
        .collect()
}

fn rows(t: &sparrow_trainer::Trainer) -> Vec<(u64, Vec<u32>)> {
    let mut out = Vec::new();
    t.table
        .for_each_row(|k, _, r| {
            out.push((k, r.iter().map(|x| x.to_bits()).collect()));
            Ok(())
        })
        .expect("rows");
    out
}

#[test]
fn stop_and_resume_gives_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 4000, 500);
    // `mlp-bf16`, `dcn-bf16` (its cross layers' products in bf16 too) and
    // `dlrm-bf16` (bottom and top MLPs, the interaction in f32):
    // model.precision = "bf16" resumes bit for bit too; so do
    // half rows (`embedding.dtype`), with FTRL for `dlrm-f16rows` and
    // row-wise Adagrad for `mlp-bf16rows`, and stochastic rounding
    // (`embedding.rounding`: its draws count each row's updates, a count
    // the checkpoint keeps) for `dlrm-srf16rows` with Adagrad; and
    // `embedding.l2`, AdamW, dropout and layer norm (`mlp-regularized`); a warmup and
    // cosine decay of both rates (`dlrm-scheduled`).
    let kinds = [
        "dlrm",
        "deepfm",
        "mlp",
        "mlp-bf16",
        "dcn-bf16",
        "dlrm-bf16",
        "dlrm-f16rows",
        "mlp-bf16rows",
        "dlrm-srf16rows",
        "mlp-regularized",
        "dlrm-scheduled",
        "dlrm-batchnorm",
        "mlp-activations",
    ];
    for kind in kinds {
        let mut base = common::small_config(&data, kind.split('-').next().expect("kind"));
        if kind.ends_with("-bf16") {
            base.model.precision = sparrow_core::config::Precision::Bf16;
        }
        if kind.ends_with("-f16rows") {
            base.embedding.dtype = sparrow_core::config::EmbeddingDtype::F16;
            base.embedding.optimizer = sparrow_core::config::SparseOptimizerKind::Ftrl;
        }
        if kind.ends_with("-srf16rows") {
            base.embedding.dtype = sparrow_core::config::EmbeddingDtype::F16;
            base.embedding.rounding = sparrow_core::config::Rounding::Stochastic;
        }
        if kind.ends_with("-bf16rows") {
            base.embedding.dtype = sparrow_core::config::EmbeddingDtype::Bf16;
            base.embedding.optimizer = sparrow_core::config::SparseOptimizerKind::RowwiseAdagrad;
        }
        if kind.ends_with("-regularized") {
            // `embedding.l2` and AdamW's decoupled decay.
            base.embedding.l2 = 1e-3;
            base.dense_optimizer.kind = sparrow_core::config::DenseOptimizerKind::AdamW;
            base.dense_optimizer.weight_decay = 0.01;
            base.model.dropout = 0.2;
            base.model.norm = sparrow_core::config::NormSetting::Layer;
        }
        if kind.ends_with("-batchnorm") {
            // The running statistics are in the checkpoint with the weights.
            base.model.norm = sparrow_core::config::NormSetting::Batch;
            base.model.dropout = 0.1;
        }
        if kind.ends_with("-activations") {
            // Dice: its slopes and running statistics, after a layer norm.
            base.model.activation = sparrow_core::config::Activation::Dice;
            base.model.norm = sparrow_core::config::NormSetting::Layer;
        }
        if kind.ends_with("-scheduled") {
            // `[train.schedule]`: warmup, then cosine decay, both rates.
            base.train.schedule = sparrow_core::config::ScheduleConfig {
                kind: sparrow_core::config::ScheduleKind::Cosine,
                warmup_steps: 5,
                decay_steps: 30,
                final_factor: 0.1,
                ..Default::default()
            };
        }
        base.train.epochs = 2; // the stop falls in the first epoch, the end in the second

        let full_dir = tmp.path().join(format!("{kind}-full"));
        let full = train(&with_checkpoint(base.clone(), &full_dir), true).expect("full run");

        let part_dir = tmp.path().join(format!("{kind}-part"));
        let mut first = with_checkpoint(base.clone(), &part_dir);
        first.train.max_steps = Some(13);
        let stopped = train(&first, true).expect("first half");
        assert_eq!(stopped.steps, 13);

        let mut second = with_checkpoint(base.clone(), &part_dir);
        second.checkpoint.resume_from = Some(part_dir.display().to_string());
        let resumed = train(&second, true).expect("second half");
        assert_eq!(resumed.resumed_from_step, Some(13));
        assert_eq!(resumed.steps, full.steps);
        assert_eq!(stopped.train_rows + resumed.train_rows, full.train_rows);

        let (a, ma, _) = load_trainer(&full_dir, &Overrides::none()).expect("load full");
        let (b, mb, _) = load_trainer(&part_dir, &Overrides::none()).expect("load resumed");
        assert_eq!(ma.step, mb.step);
        assert_eq!(ma.position, mb.position);
        assert_eq!(dense_values(&a), dense_values(&b), "{kind}: dense weights differ");
        assert_eq!(rows(&a), rows(&b), "{kind}: embedding rows differ");
        assert_eq!(full.test_auc.map(f64::to_bits), resumed.test_auc.map(f64::to_bits));
        // Dense optimizer state too: one more identical step must keep them equal.
        let tensors_a = a.dense_optimizer.state_tensors(&a.model.params).expect("state");
        let tensors_b = b.dense_optimizer.state_tensors(&b.model.params).expect("state");
        assert_eq!(tensors_a.len(), tensors_b.len());
        for (k, t) in &tensors_a {
            let u = &tensors_b[k];
            let (x, y) =
                (t.flatten_all().and_then(|t| t.to_vec1::<f32>()), u.flatten_all().and_then(|t| t.to_vec1::<f32>()));
            assert_eq!(x.expect("a"), y.expect("b"), "{kind}: optimizer state {k}");
        }
    }
}

/// With both feature filters on, the checkpoint keeps their state (the
/// lookup clock, the admission sketch, each row's last use): the resumed run
/// admits and expires exactly the keys the uninterrupted one does — in memory
/// and on the SSD tier, whose cache holds other rows after the restore.
#[test]
fn feature_filters_resume_where_they_stopped() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 4000, 500);
    for storage in ["memory", "ssd"] {
        let mut base = common::small_config(&data, "dlrm");
        base.train.epochs = 2;
        base.embedding.admit_min_count = 3;
        base.embedding.ttl_steps = 12;
        if storage == "ssd" {
            base.embedding.storage = sparrow_core::config::Storage::Ssd;
            base.embedding.cache_capacity_rows = 512;
        }
        filters_resume(&tmp.path().join(storage), base);
    }
}

fn filters_resume(tmp: &Path, mut base: Config) {
    let storage = format!("{:?}", base.embedding.storage);
    if base.embedding.storage == sparrow_core::config::Storage::Ssd {
        base.embedding.path = Some(tmp.join("store-full").display().to_string());
    }

    let full_dir = tmp.join("full");
    let full = train(&with_checkpoint(base.clone(), &full_dir), true).expect("full run");
    let part_dir = tmp.join("part");
    if base.embedding.storage == sparrow_core::config::Storage::Ssd {
        base.embedding.path = Some(tmp.join("store-part").display().to_string());
    }
    let mut first = with_checkpoint(base.clone(), &part_dir);
    first.train.max_steps = Some(20);
    let stopped = train(&first, true).expect("first half");
    assert!(stopped.table.expired_rows > 0 && stopped.table.not_admitted_lookups > 0, "{:?}", stopped.table);
    let mut second = with_checkpoint(base.clone(), &part_dir);
    second.checkpoint.resume_from = Some(part_dir.display().to_string());
    let resumed = train(&second, true).expect("second half");
    assert_eq!(resumed.steps, full.steps);

    let (a, _, _) = load_trainer(&full_dir, &Overrides::none()).expect("load full");
    let (b, _, _) = load_trainer(&part_dir, &Overrides::none()).expect("load resumed");
    let (rows_a, rows_b) = (rows(&a), rows(&b));
    let differ = rows_a.iter().zip(&rows_b).filter(|(x, y)| x != y).count();
    assert!(
        rows_a.len() == rows_b.len() && differ == 0,
        "{storage}: {} vs {} rows, {differ} differ: the same keys must be admitted and expired, with the same rows",
        rows_a.len(),
        rows_b.len()
    );
    let (fa, fb) = (a.table.filter_state(), b.table.filter_state());
    assert_eq!(fa.tick, fb.tick, "{storage}: the lookup clock");
    let counters = |f: &sparrow_embedding::FilterState| f.sketches.concat();
    let (ca, cb) = (counters(&fa), counters(&fb));
    let differ: Vec<(u8, u8)> = ca.iter().zip(&cb).filter(|(x, y)| x != y).map(|(x, y)| (*x, *y)).collect();
    assert!(ca.len() == cb.len() && differ.is_empty(), "{storage}: admission counters differ: {differ:?}");
    assert_eq!(dense_values(&a), dense_values(&b));
    assert_eq!(full.test_auc.map(f64::to_bits), resumed.test_auc.map(f64::to_bits));
}
