//! A serving export (dense weights, vectors without optimizer state, the
//! config) predicts exactly what the checkpoint it came from predicts, and a
//! damaged export is refused naming the file.

mod common;

use common::{small_config, small_data};
use sparrow_core::Overrides;
use sparrow_core::config::EmbeddingDtype;
use sparrow_trainer::checkpoint::load_trainer;
use sparrow_trainer::export::{load_export, write_export};

#[test]
fn an_export_predicts_what_its_checkpoint_predicts() {
    let tmp = tempfile::tempdir().expect("tmp");
    small_data(tmp.path(), 3000, 500);
    for kind in ["dlrm", "mlp"] {
        let mut config = small_config(tmp.path(), kind);
        let ckpt = tmp.path().join(format!("ckpt-{kind}"));
        config.checkpoint.dir = Some(ckpt.display().to_string());
        sparrow_trainer::train(&config, true).expect("train");
        let (trainer, manifest, _) = load_trainer(&ckpt, &Overrides::none()).expect("checkpoint");
        let export = tmp.path().join(format!("export-{kind}"));
        let dim = trainer.table.dim();
        let mut cursor = Some((0usize, 0usize));
        let pages = || {
            let Some(at) = cursor else { return Ok(None) };
            let (mut keys, mut vectors) = (Vec::new(), Vec::new());
            cursor = trainer
                .table
                .rows_from(at, 1000, |key, _, row| {
                    keys.push(key);
                    vectors.extend_from_slice(&row[..dim]);
                })
                .expect("rows");
            Ok(Some((keys, vectors)))
        };
        let written = write_export(&export, &trainer.config, &trainer.layout, manifest.step, &trainer.model, pages)
            .expect("export");
        assert_eq!(written.rows, trainer.table.len() as u64);

        let test = tmp.path().join("test.tsv");
        let from_checkpoint = tmp.path().join(format!("from-checkpoint-{kind}.txt"));
        let from_export = tmp.path().join(format!("from-export-{kind}.txt"));
        let a =
            sparrow_trainer::predict_checkpoint(&ckpt, &test, &from_checkpoint, &Overrides::none()).expect("predict");
        let b =
            sparrow_trainer::run::predict_export(&export, &test, &from_export, &Overrides::none()).expect("predict");
        assert_eq!(a.auc.to_bits(), b.auc.to_bits(), "{kind}");
        assert_eq!(
            std::fs::read_to_string(&from_checkpoint).expect("read"),
            std::fs::read_to_string(&from_export).expect("read"),
            "{kind}: every prediction"
        );

        // One flipped byte in the rows: refused, naming the file.
        let rows = export.join("embeddings.bin");
        let mut bytes = std::fs::read(&rows).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&rows, bytes).expect("write");
        let err = load_export(&export, &Overrides::none()).err().expect("refused").to_string();
        assert!(err.contains("embeddings.bin") && err.contains("checksum"), "{err}");
    }
}

/// `checkpoint.export_every_steps`: exports while training goes on, most of
/// them holding only the rows updated since the one before; the chain that
/// `exports/LATEST` names rebuilds the final model exactly, and exports older
/// than the full one before the newest full one are removed. Half rows
/// (`embedding.dtype`) are exported in their own type, exactly too.
#[test]
fn incremental_exports_rebuild_the_trained_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    small_data(tmp.path(), 6000, 500);
    for dtype in [EmbeddingDtype::F32, EmbeddingDtype::Bf16] {
        let mut config = small_config(tmp.path(), "mlp");
        config.embedding.dtype = dtype;
        let ckpt = tmp.path().join(format!("ckpt-{}", dtype.name()));
        config.checkpoint.dir = Some(ckpt.display().to_string());
        config.checkpoint.export_every_steps = Some(3);
        config.checkpoint.full_every = 4;
        let summary = sparrow_trainer::train(&config, true).expect("train");
        assert_eq!(summary.steps, 47, "6000 rows in batches of 128");

        let root = ckpt.join("exports");
        assert_eq!(std::fs::read_to_string(root.join("LATEST")).expect("LATEST").trim(), "000000000047");
        let mut names: Vec<String> = std::fs::read_dir(&root)
            .expect("exports")
            .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
            .filter(|n| n.parse::<u64>().is_ok())
            .collect();
        names.sort();
        // Steps 3..45 every 3, then 47 (the end); full at 3, 15, 27, 39; each
        // full export removes those older than the full one before it.
        let steps: Vec<u64> = names.iter().map(|n| n.parse().expect("number")).collect();
        assert_eq!(steps, [27, 30, 33, 36, 39, 42, 45, 47]);
        let chain = sparrow_trainer::export::export_chain(&root.join("000000000047")).expect("chain");
        let chain_steps: Vec<u64> = chain.iter().map(|(_, m)| m.step).collect();
        assert_eq!(chain_steps, [39, 42, 45, 47]);
        assert!(chain[0].1.base.is_none() && chain[1].1.base.as_deref() == Some("000000000039"));
        let (full_rows, delta_rows) = (chain[0].1.rows, chain[1].1.rows);
        assert!(
            delta_rows > 0 && delta_rows < full_rows,
            "a delta holds only updated rows: {delta_rows} of {full_rows}"
        );
        assert!(chain.iter().all(|(_, m)| m.dtype == dtype.name()), "{:?}", chain[0].1.dtype);

        let test = tmp.path().join("test.tsv");
        let (a, b) = (tmp.path().join("a.txt"), tmp.path().join("b.txt"));
        sparrow_trainer::predict_checkpoint(&ckpt, &test, &a, &Overrides::none()).expect("predict");
        sparrow_trainer::run::predict_export(&root, &test, &b, &Overrides::none()).expect("predict");
        assert_eq!(std::fs::read_to_string(&a).expect("a"), std::fs::read_to_string(&b).expect("b"), "{dtype:?}");

        // A delta whose base is gone is refused, naming both.
        std::fs::remove_dir_all(root.join("000000000042")).expect("remove");
        let err = load_export(&root, &Overrides::none()).err().expect("refused").to_string();
        assert!(err.contains("000000000045") && err.contains("`000000000042`, which is gone"), "{err}");
    }
}

/// Without `checkpoint.dir` the exports have nowhere to go: refused, naming both keys.
#[test]
fn exports_need_a_checkpoint_dir() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut config = small_config(tmp.path(), "mlp");
    config.checkpoint.export_every_steps = Some(5);
    let err = config.validate().expect_err("refused").to_string();
    assert!(err.contains("checkpoint.export_every_steps") && err.contains("checkpoint.dir"), "{err}");
}

/// Exports told by content (a cluster's, from successive checkpoints): a
/// delta holds the rows whose vector changed and the new ones; a row gone
/// since the last export makes the export full, so no reader keeps it.
#[test]
fn exports_by_content_hold_the_changed_rows_and_go_full_when_a_row_is_gone() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut config = small_config(tmp.path(), "mlp");
    config.checkpoint.dir = Some(tmp.path().join("ck").display().to_string());
    config.checkpoint.export_every_steps = Some(1);
    let layout = sparrow_data::DataLayout { num_fields: 26, num_dense: 13, weighted: false, num_tasks: 1 };
    let mut exports = sparrow_trainer::export::IncrementalExports::new(&config).expect("exports").by_content();
    let trainer = |rows: &[(u64, f32)], step: u64| {
        let mut t = sparrow_trainer::Trainer::new(&config, layout.clone()).expect("trainer");
        let mut row = vec![0f32; t.table.row_len()];
        for &(key, value) in rows {
            row[0] = value;
            t.table.put_row(key, &row).expect("row");
        }
        t.step = step;
        t
    };
    let manifest =
        |dir: &std::path::Path| sparrow_trainer::export::export_chain(dir).expect("chain").pop().expect("newest").1;
    let first = exports.write(&trainer(&[(1, 1.0), (2, 2.0), (3, 3.0)], 1)).expect("first");
    assert_eq!((manifest(&first).rows, manifest(&first).base.clone()), (3, None));
    // Key 2 changed, key 4 is new, keys 1 and 3 are as they were.
    let second = exports.write(&trainer(&[(1, 1.0), (2, 2.5), (3, 3.0), (4, 4.0)], 2)).expect("second");
    assert_eq!((manifest(&second).rows, manifest(&second).base.as_deref()), (2, Some("000000000001")));
    // Key 3 is gone: the export is full.
    let third = exports.write(&trainer(&[(1, 1.0), (2, 2.5), (4, 4.0)], 3)).expect("third");
    assert_eq!((manifest(&third).rows, manifest(&third).base.clone()), (3, None));
    let (served, _) = load_export(&tmp.path().join("ck/exports"), &Overrides::none()).expect("load");
    assert_eq!(served.table.len(), 3);
}

/// Every model kind exports and its export predicts what its checkpoint
/// predicts: a row is as wide as the kind's table makes it (LR 1, FM and
/// the wide kinds 1 + dim), not always `embedding_dim` (exports of LR, FM,
/// Wide&Deep and DeepFM were refused as "N keys with N values").
#[test]
fn every_model_kind_exports() {
    let tmp = tempfile::tempdir().expect("tmp");
    small_data(tmp.path(), 2000, 300);
    for kind in ["lr", "fm", "wide_deep", "deepfm", "mlp", "dlrm", "dcn"] {
        let mut config = small_config(tmp.path(), kind);
        let ckpt = tmp.path().join(format!("ckpt-{kind}"));
        config.checkpoint.dir = Some(ckpt.display().to_string());
        sparrow_trainer::train(&config, true).expect("train");
        let export = tmp.path().join(format!("export-{kind}"));
        let written = sparrow_trainer::run::export_checkpoint(&ckpt, &export, sparrow_trainer::export::VectorType::F32)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert!(written.rows > 0, "{kind}");
        let test = tmp.path().join("test.tsv");
        let (a, b) = (tmp.path().join(format!("a-{kind}")), tmp.path().join(format!("b-{kind}")));
        sparrow_trainer::predict_checkpoint(&ckpt, &test, &a, &Overrides::none()).expect("predict");
        sparrow_trainer::run::predict_export(&export, &test, &b, &Overrides::none()).expect("predict export");
        assert_eq!(std::fs::read_to_string(&a).expect("a"), std::fs::read_to_string(&b).expect("b"), "{kind}");
    }
}
