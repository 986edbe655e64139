//! Cluster checkpoints in parts (issue 13): each shard streams its rows into
//! its own part; an incremental version holds only the rows used since the
//! version it builds on, and reading the chain gives back the live tables
//! exactly (rows, optimizer state, last uses, filter clock), whether a shard
//! reads its own part or a reader takes every part.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use sparrow_core::Config;
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, owner};
use sparrow_trainer::Trainer;
use sparrow_trainer::checkpoint::{
    FORMAT_VERSION, Manifest, commit, hash_file, load_into, load_shard_into, resolve, stored_config, write_part,
};

const SHARDS: usize = 2;

fn config(tmp: &Path, incremental: bool, ttl_steps: u64) -> Config {
    let mut c = common::small_config(&tmp.join("data"), "dlrm");
    c.checkpoint.incremental = incremental;
    c.embedding.ttl_steps = ttl_steps;
    c.embedding.optimizer = sparrow_core::config::SparseOptimizerKind::Adagrad;
    c
}

fn layout() -> DataLayout {
    DataLayout { num_fields: 26, num_dense: 13, weighted: false, num_tasks: 1 }
}

/// Trains `batches` batches of keys on the shard tables: keys `from..from+span`
/// (a hot set) with a gradient that depends on the row.
fn train(tables: &[EmbeddingTable], batches: std::ops::Range<u64>, span: u64) {
    for b in batches {
        let keys: Vec<u64> = (0..64).map(|i| sparrow_core::key::mix64((b * 64 + i * 7) % span)).collect();
        for (s, table) in tables.iter().enumerate() {
            let mine: Vec<u64> = keys.iter().copied().filter(|&k| owner(k, SHARDS) == s).collect();
            let plan = table.plan(&mine);
            let mut rows = vec![0.0f32; plan.num_unique() * table.dim()];
            let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
            let grads: Vec<f32> = rows.iter().enumerate().map(|(i, w)| 0.3 * w - 0.01 * (i % 3) as f32).collect();
            table.apply_gradients_at(&plan, &slots, &grads).expect("update");
        }
    }
}

/// Writes one version from the shard tables, incremental on `base` when given.
fn checkpoint(root: &Path, c: &Config, tables: &[EmbeddingTable], step: u64, base: Option<&Path>) -> (u64, Manifest) {
    let staging = root.join(format!(".tmp-ckpt-{step:012}-test"));
    std::fs::create_dir_all(&staging).expect("staging");
    let trainer = Trainer::new(c, layout()).expect("trainer");
    let mut files = BTreeMap::new();
    files.insert(
        "dense.safetensors".to_string(),
        sparrow_trainer::checkpoint::write_dense(&trainer.model, &trainer.dense_optimizer, &staging).expect("dense"),
    );
    let base_manifest = base.map(|b| sparrow_trainer::checkpoint::read_manifest(b).expect("base"));
    let mut parts = Vec::new();
    let mut bytes = 0;
    for (i, table) in tables.iter().enumerate() {
        let since = base_manifest.as_ref().map(|m| m.parts[i].clock);
        let written = write_part(table, &staging, i, since, c).expect("part");
        for (name, size) in &written.files {
            let entry = hash_file(&staging.join(name)).expect("hash");
            assert_eq!(entry.bytes, *size);
            bytes += size;
            files.insert(name.clone(), entry);
        }
        parts.push(written.part);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        model_kind: c.model.kind.name().to_string(),
        num_fields: 26,
        num_dense: 13,
        embedding_dim: c.model.embedding_dim,
        embedding_width: tables[0].dim(),
        embedding_dtype: tables[0].row_format().dtype,
        embedding_rounding: tables[0].rounding(),
        row_len: tables[0].row_len(),
        sparse_optimizer: tables[0].optimizer().name().to_string(),
        step,
        samples_trained: step * 64,
        dense_optimizer_step: step,
        position: Default::default(),
        embedding_rows: tables.iter().map(|t| t.len() as u64).sum(),
        files,
        config: stored_config(c),
        created_unix_secs: 0,
        parts,
        base: base.map(|b| b.file_name().expect("name").to_string_lossy().to_string()),
        skip: Vec::new(),
        stream: None,
        event_clock: Vec::new(),
        early_stopping: None,
    };
    commit(root, &staging, &manifest, 2).expect("commit");
    (bytes, manifest)
}

fn shard_tables(c: &Config) -> Vec<EmbeddingTable> {
    (0..SHARDS).map(|_| sparrow_trainer::trainer::model_table(c, None).expect("table")).collect()
}

fn rows_of(table: &EmbeddingTable) -> BTreeMap<u64, (u64, Vec<u32>)> {
    let mut out = BTreeMap::new();
    table
        .for_each_row(|key, last_use, row| {
            out.insert(key, (last_use, row.iter().map(|x| x.to_bits()).collect()));
            Ok(())
        })
        .expect("walk");
    out
}

fn check_chain(ttl_steps: u64) {
    let tmp = tempfile::tempdir().expect("tmp");
    let root = tmp.path().join("ckpt");
    let c = config(tmp.path(), true, ttl_steps);
    let tables = shard_tables(&c);
    // Most rows are cold: a wide first pass, then a small hot set.
    train(&tables, 0..40, 20_000);
    let (full_bytes, _) = checkpoint(&root, &c, &tables, 40, None);
    train(&tables, 40..60, 300);
    let first = resolve(&root).expect("latest");
    let (delta_bytes, delta) = checkpoint(&root, &c, &tables, 60, Some(&first));
    assert!(delta.parts.iter().all(|p| p.since.is_some()), "incremental parts");
    assert!(
        ttl_steps > 0 || delta_bytes * 4 < full_bytes,
        "a delta over a hot set is much smaller: {delta_bytes} vs {full_bytes} bytes"
    );
    train(&tables, 60..75, 300);
    let second = resolve(&root).expect("latest");
    checkpoint(&root, &c, &tables, 75, Some(&second));
    // keep = 2, but the chain's full version stays.
    assert!(first.join("manifest.json").is_file(), "the base of a kept delta is not pruned");
    let last = resolve(&root).expect("latest");

    // Each shard restores its own part; a reader of the whole model takes every part.
    for (s, table) in tables.iter().enumerate() {
        let mut restored = Trainer::new(&c, layout()).expect("trainer");
        load_shard_into(&mut restored, &last, s, SHARDS, |k| owner(k, SHARDS) == s).expect("load");
        assert_eq!(rows_of(&restored.table), rows_of(table), "shard {s}: rows, state and last uses");
        assert_eq!(restored.table.filter_state(), table.filter_state(), "shard {s}: clock and sketches");
    }
    let mut whole = Trainer::new(&c, layout()).expect("trainer");
    load_into(&mut whole, &last).expect("load all");
    let mut expected = BTreeMap::new();
    tables.iter().for_each(|t| expected.extend(rows_of(t)));
    let got: BTreeMap<u64, Vec<u32>> = rows_of(&whole.table).into_iter().map(|(k, (_, r))| (k, r)).collect();
    let expected: BTreeMap<u64, Vec<u32>> = expected.into_iter().map(|(k, (_, r))| (k, r)).collect();
    assert_eq!(got, expected);
}

#[test]
fn an_incremental_chain_restores_every_shard_exactly() {
    check_chain(0);
}

#[test]
fn an_incremental_chain_restores_exactly_when_rows_expire_between_versions() {
    // Cold rows of the first pass expire during the hot passes: the deltas do
    // not list them, the reader deletes them as the live tables did.
    check_chain(12);
}

#[test]
fn a_missing_base_is_refused_naming_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let root = tmp.path().join("ckpt");
    let c = config(tmp.path(), true, 0);
    let tables = shard_tables(&c);
    train(&tables, 0..5, 1000);
    checkpoint(&root, &c, &tables, 5, None);
    let first = resolve(&root).expect("latest");
    train(&tables, 5..8, 1000);
    checkpoint(&root, &c, &tables, 8, Some(&first));
    std::fs::remove_dir_all(&first).expect("remove the base");
    let mut t = Trainer::new(&c, layout()).expect("trainer");
    let err = load_into(&mut t, &resolve(&root).expect("latest")).expect_err("base missing").to_string();
    assert!(err.contains("ckpt-000000000005") && err.contains("missing"), "{err}");
}
