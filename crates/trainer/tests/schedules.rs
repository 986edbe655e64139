//! `[train.schedule]` scales both learning rates step by step: a step
//! under the schedule is the step at the scaled rates, for the dense
//! weights and (unless `embedding = false`) the rows. Resume and train ≡
//! launch under a schedule: `resumed_run_equals_uninterrupted_run.rs`,
//! `local_cluster_equals_single_process.rs`.

mod common;

use std::path::Path;

use sparrow_core::Config;
use sparrow_core::config::{ScheduleConfig, ScheduleKind};

/// The dense weights and every row's bits after the run of `c` in `dir`.
fn model(c: &Config, dir: &Path) -> (Vec<u32>, Vec<(u64, Vec<u32>)>) {
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (dense, rows) = common::trained_model(c, dir);
    (bits(&dense), rows.into_iter().map(|(k, r)| (k, bits(&r))).collect())
}

/// The first step of a 4-step warmup takes a quarter of each rate: the
/// model is, bit for bit, the one a run at a quarter of both rates trains
/// in its first step (powers of two: the products are exact). With
/// `embedding = false` only the dense rate is scaled. Without a schedule,
/// or after the warmup, nothing is.
#[test]
fn a_warmup_step_is_the_step_at_the_scaled_rates() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 1000, 100);
    let mut base = common::small_config(&data, "dlrm");
    base.train.max_steps = Some(1);
    base.embedding.learning_rate = 0.0625;
    base.dense_optimizer.learning_rate = 0.0078125;
    let mut warm = base.clone();
    warm.train.schedule = ScheduleConfig { warmup_steps: 4, ..Default::default() };
    let mut quarter = base.clone();
    quarter.embedding.learning_rate /= 4.0;
    quarter.dense_optimizer.learning_rate /= 4.0;
    let mut dense_only = warm.clone();
    dense_only.train.schedule.embedding = false;
    let m = |c: &Config, name: &str| model(c, &tmp.path().join(name));
    let (plain, warmed, scaled, dense_scaled) =
        (m(&base, "base"), m(&warm, "warm"), m(&quarter, "quarter"), m(&dense_only, "dense"));
    assert_eq!(warmed, scaled, "the warmup's first step is the step at a quarter of both rates");
    assert_ne!(warmed, plain);
    assert_eq!(dense_scaled.0, scaled.0, "embedding = false: the dense rate is scaled");
    assert_eq!(dense_scaled.1, plain.1, "embedding = false: the rows' rate is not");
    // After the warmup (a cosine that has not begun): the configured rates.
    let mut late = base.clone();
    late.train.schedule = ScheduleConfig { kind: ScheduleKind::Step, step_every: 100, ..Default::default() };
    assert_eq!(m(&late, "late"), plain);
}
