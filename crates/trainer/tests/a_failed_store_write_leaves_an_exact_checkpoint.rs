//! A full disk under the SSD tier (issue 11, item 2): the checkpoint written
//! after the error used to claim step N while holding step N+1's dense
//! weights. Now it is exactly one step's state — a run resumed from it ends
//! with the uninterrupted run's model, bit for bit — or, where the failed
//! lookup had already moved the feature filters, it is not written at all.
//! The disk is filled with a failpoint (`fail` crate) on the store's writes.

mod common;

use sparrow_core::Config;
use sparrow_core::config::Storage;
use sparrow_trainer::checkpoint::{read_manifest, resolve};
use sparrow_trainer::train;

fn ssd_config(tmp: &std::path::Path, name: &str, ttl_steps: u64) -> Config {
    let data = tmp.join("data");
    let mut c = common::small_config(&data, "dlrm");
    c.train.batch_size = 32;
    c.embedding.table_shards = 4;
    c.embedding.ttl_steps = ttl_steps;
    c.embedding.storage = Storage::Ssd;
    c.embedding.path = Some(tmp.join(format!("{name}-ssd")).display().to_string());
    c.embedding.cache_capacity_rows = 600;
    c.checkpoint.dir = Some(tmp.join(format!("{name}-ckpt")).display().to_string());
    c
}

fn checkpoint_step(dir: &str) -> Option<u64> {
    let version = resolve(std::path::Path::new(dir)).ok()?;
    Some(read_manifest(&version).expect("manifest").step)
}

/// Trains `failing` with every store write after the first `writes` failing,
/// then resumes from whatever checkpoint is there onto a fresh SSD directory.
fn fail_then_resume(
    failing: &Config,
    writes: u32,
    tmp: &std::path::Path,
    name: &str,
) -> (Option<u64>, Option<f64>, String) {
    fail::cfg("disk_store::write", &format!("{writes}*off->return")).expect("failpoint");
    let err = train(failing, true).expect_err("the disk filled up");
    fail::remove("disk_store::write");
    let dir = failing.checkpoint.dir.clone().expect("dir");
    let saved = checkpoint_step(&dir);
    let mut resumed = failing.clone();
    resumed.checkpoint.resume_from = saved.map(|_| dir.clone());
    resumed.embedding.path = Some(tmp.join(format!("{name}-ssd-resumed")).display().to_string());
    let auc = train(&resumed, true).expect("resumed").test_auc;
    (saved, auc, err.to_string())
}

#[test]
fn a_full_disk_under_the_ssd_tier_leaves_a_checkpoint_of_exactly_one_step() {
    let scenario = fail::FailScenario::setup();
    let tmp = tempfile::tempdir().expect("tmp");
    common::small_data(&tmp.path().join("data"), 3000, 500);

    // No filters: the failing step is completed, then saved.
    let uninterrupted = train(&ssd_config(tmp.path(), "whole", 0), true).expect("uninterrupted");
    let steps = uninterrupted.steps;
    let (saved, auc, err) = fail_then_resume(&ssd_config(tmp.path(), "full", 0), 300, tmp.path(), "full");
    assert!(err.contains("no space left on device"), "{err}");
    let saved = saved.expect("a checkpoint was written after the error");
    assert!(saved > 0 && saved < steps, "saved at step {saved} of {steps}");
    assert_eq!(auc.map(f64::to_bits), uninterrupted.test_auc.map(f64::to_bits), "resumed from step {saved}");

    // ttl_steps: the failed prefetch had aged rows, so nothing is written
    // after the error; the periodic checkpoint before it resumes exactly.
    let mut periodic = ssd_config(tmp.path(), "ttl-whole", 20);
    periodic.checkpoint.every_steps = Some(10);
    let uninterrupted = train(&periodic, true).expect("uninterrupted");
    let mut failing = ssd_config(tmp.path(), "ttl", 20);
    failing.checkpoint.every_steps = Some(10);
    let (saved, auc, _) = fail_then_resume(&failing, 4000, tmp.path(), "ttl");
    let saved = saved.expect("a periodic checkpoint");
    assert!(saved > 0 && saved % 10 == 0, "only periodic checkpoints: {saved}");
    assert_eq!(auc.map(f64::to_bits), uninterrupted.test_auc.map(f64::to_bits), "resumed from step {saved}");
    scenario.teardown();
}
