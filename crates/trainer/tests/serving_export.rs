//! A serving export (dense weights, vectors without optimizer state, the
//! config) predicts exactly what the checkpoint it came from predicts, and a
//! damaged export is refused naming the file.

mod common;

use common::{small_config, small_data};
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
        let (trainer, manifest, _) = load_trainer(&ckpt, &[]).expect("checkpoint");
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
        let a = sparrow_trainer::predict_checkpoint(&ckpt, &test, &from_checkpoint, &[]).expect("predict");
        let b = sparrow_trainer::run::predict_export(&export, &test, &from_export, &[]).expect("predict");
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
        let err = load_export(&export, &[]).err().expect("refused").to_string();
        assert!(err.contains("embeddings.bin") && err.contains("checksum"), "{err}");
    }
}
