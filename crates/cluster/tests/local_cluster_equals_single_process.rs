//! The split data path (S0) over the in-process transport: loader, 3 shards
//! and one worker end with exactly the model `sparrow train` produces, and the
//! shards refuse batches they do not hold.

use std::sync::Arc;

use sparrow_cluster::{ClusterError, Mode, ShardServer, ShardService, train_local};
use sparrow_core::Config;
use sparrow_core::config::InitConfig;
use sparrow_embedding::{EmbeddingTable, Initializer, SparseOptimizer};

fn config(dir: &std::path::Path, kind: &str) -> Config {
    let d = dir.display();
    let text = format!(
        r#"
        [data]
        train = "{d}/train.tsv"
        test = "{d}/test.tsv"
        [model]
        kind = "{kind}"
        embedding_dim = 4
        hidden = [16, 8]
        bottom_hidden = [8]
        [train]
        batch_size = 128
        seed = 3
        "#
    );
    Config::from_toml_with_overrides(&text, "test", &[]).expect("config")
}

#[test]
fn three_shards_one_worker_equals_train() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    for kind in ["dlrm", "mlp"] {
        let c = config(tmp.path(), kind);
        let single = sparrow_trainer::train(&c, true).expect("train");
        let cluster = train_local(&c, 3).expect("cluster");
        assert_eq!(cluster.train_rows, single.train_rows);
        assert_eq!(cluster.embedding_rows, single.embedding_rows, "{kind}: rows across shards");
        assert_eq!(
            cluster.test_auc.map(f64::to_bits),
            single.test_auc.map(f64::to_bits),
            "{kind}: {:?} vs {:?}",
            cluster.test_auc,
            single.test_auc
        );
        // The worker's inbound traffic: dense + labels + bag structure from
        // the loader, embedding rows from the shards — no raw IDs.
        assert!(cluster.worker_in_bytes_per_sample_loader > 0.0);
        assert!(cluster.worker_in_bytes_per_sample_shards > 0.0);
    }
}

#[test]
fn shards_refuse_batches_they_do_not_hold() {
    let table = EmbeddingTable::new(4, SparseOptimizer::Sgd { lr: 0.1 }, Initializer::new(InitConfig::default(), 1), 4);
    let shard = Arc::new(ShardServer::new(2, table));
    let err = shard.pull(7).expect_err("never queued");
    assert!(matches!(err, ClusterError::UnknownBatch { shard: 2, batch_id: 7 }), "{err}");
    shard.enqueue(7, vec![1, 2, 3], Mode::Train).expect("enqueue");
    let err = shard.push(7, vec![0.0; 12]).expect_err("push before pull");
    assert!(err.to_string().contains("shard 2"), "{err}");
    let rows = shard.pull(7).expect("pull");
    assert_eq!(rows.len(), 12);
    let err = shard.push(7, vec![0.0; 5]).expect_err("wrong size");
    assert!(matches!(err, ClusterError::WrongSize { shard: 2, .. }), "{err}");
    shard.push(7, vec![0.5; 12]).expect("push");
    assert!(shard.push(7, vec![0.5; 12]).is_err(), "a batch is applied once");
    // An evaluation batch reads without inserting.
    shard.enqueue(8, vec![1, 99], Mode::Eval).expect("enqueue");
    assert_eq!(shard.pull(8).expect("pull").len(), 8);
    assert_eq!(shard.table().len(), 3);
}
