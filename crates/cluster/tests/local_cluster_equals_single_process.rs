//! The split data path (S0) over the in-process transport: loader, 3 shards
//! and one worker end with exactly the model `sparrow train` produces (in S0
//! and in worker_lookup mode); data-parallel workers keep identical dense
//! weights; the shards refuse batches they do not hold.

use std::sync::Arc;

use sparrow_cluster::{ClusterError, Mode, ShardServer, ShardService, train_local};
use sparrow_core::Config;
use sparrow_core::config::InitConfig;
use sparrow_embedding::{EmbeddingTable, Initializer, SparseOptimizer};

fn config(dir: &std::path::Path, kind: &str) -> Config {
    config_with(dir, kind, &[])
}

fn config_with(dir: &std::path::Path, kind: &str, overrides: &[&str]) -> Config {
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
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::from_toml_with_overrides(&text, "test", &overrides).expect("config")
}

#[test]
fn three_shards_one_worker_equals_train() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    for kind in ["dlrm", "mlp"] {
        let c = config(tmp.path(), kind);
        let single = sparrow_trainer::train(&c, true).expect("train");
        let cluster = train_local(&c, 3, 1).expect("cluster");
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
        let w = &cluster.workers[0];
        assert!(w.bytes_from_loader > 0 && w.bytes_from_shards > 0);
        // Per sample from the loader: label + 13 dense + 26 key positions, 4
        // bytes each (one-hot bags need no offsets).
        let per_sample = w.bytes_from_loader as f64 / w.rows as f64;
        assert!((4.0 * 40.0..4.0 * 41.0).contains(&per_sample), "{per_sample} bytes per sample");
    }
}

#[test]
fn worker_lookup_mode_trains_the_same_model_with_raw_ids_sent_to_the_worker() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 2000, 400, 5).expect("generate");
    let s0 = train_local(&config(tmp.path(), "dlrm"), 2, 1).expect("s0");
    let baseline =
        train_local(&config_with(tmp.path(), "dlrm", &["cluster.mode=\"worker_lookup\""]), 2, 1).expect("baseline");
    assert_eq!(s0.test_auc.map(f64::to_bits), baseline.test_auc.map(f64::to_bits));
    let (a, b) = (&s0.workers[0], &baseline.workers[0]);
    assert_eq!(a.bytes_from_shards, b.bytes_from_shards, "the same rows come back");
    // The baseline's loader message carries 8-byte IDs instead of 4-byte
    // positions and no per-shard counts (2 per batch).
    assert_eq!(b.bytes_from_loader - a.bytes_from_loader, 4 * a.keys - 4 * 2 * a.batches);
}

#[test]
fn data_parallel_workers_hold_identical_dense_weights() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 4000, 800, 11).expect("generate");
    for kind in ["dlrm", "mlp"] {
        let c = config(tmp.path(), kind);
        let single = train_local(&c, 2, 1).expect("one worker");
        let pair = train_local(&c, 2, 3).expect("three workers");
        let sums = &pair.dense_checksums;
        assert!(sums.iter().all(|&s| s == sums[0]), "{kind}: replicas diverged: {sums:x?}");
        assert_ne!(sums[0], single.dense_checksums[0], "{kind}: three workers trained a different schedule");
        assert_eq!(pair.train_rows, 4000, "{kind}: every sample trained once");
        assert!(pair.workers.iter().all(|w| w.batches > 0), "{kind}: every worker took batches");
        // Every worker stepped in every round, with or without a batch.
        assert!(pair.workers.iter().all(|w| w.steps == pair.workers[0].steps), "{kind}");
        assert!(pair.test_auc.is_some_and(|a| a.is_finite()), "{kind}: worker 0 evaluated");
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
