//! `train.pipeline_depth`: at 0 a batch's lookup sees the previous batch's
//! update (the exact, unpipelined model); at d ≥ 1 the batch d ahead is looked
//! up beside the current dense step, so it sees rows from before that update.

mod common;

use std::path::Path;

use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_trainer::{Trainer, train};

fn first_batches(config: &sparrow_core::Config, n: usize) -> Vec<sparrow_core::Batch> {
    let path = config.data.train.clone().expect("train path");
    let stream = BatchStream::spawn(Path::new(&path), &config.data, 128, Default::default(), 1, BadRows::new(0, 0))
        .expect("stream");
    stream.take(n).map(|b| b.expect("batch")).collect()
}

#[test]
fn depth_0_sees_the_previous_update_and_depth_1_does_not() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 1000, 100);
    let config = common::small_config(&data, "dlrm");
    let layout = DataLayout::from_config(&config.data);
    let batches = first_batches(&config, 2);
    let (b1, b2) = (&batches[0], &batches[1]);

    // Depth 0: train batch 1, then look batch 2 up.
    let mut exact = Trainer::new(&config, layout.clone()).expect("trainer");
    let (p1, p2) = (exact.table.plan(&b1.keys), exact.table.plan(&b2.keys));
    exact.train_planned(b1, &p1).expect("step");
    let after = exact.look_up(&p2).expect("lookup");

    // Depth 1: batch 2 is looked up beside batch 1's dense step.
    let mut piped = Trainer::new(&config, layout).expect("trainer");
    let first = piped.look_up(&p1).expect("lookup");
    let (_, next) = piped.train_overlapped(b1, p1.clone(), first, Some(&p2)).expect("step");
    let before = next.expect("batch 2 looked up");
    assert!(piped.has_pending_update(), "batch 1's update waits for the next dense step");
    piped.flush_update().expect("update");

    let dim = exact.table.dim();
    let b1_keys: std::collections::HashSet<u64> = b1.keys.iter().copied().collect();
    let (mut shared, mut fresh) = (0, 0);
    for (u, key) in p2.unique.iter().enumerate() {
        let (a, b) = (&after.unique_rows[u * dim..(u + 1) * dim], &before.unique_rows[u * dim..(u + 1) * dim]);
        if b1_keys.contains(key) {
            assert_ne!(a, b, "key {key:x}: depth 0 must see batch 1's update, depth 1 must not");
            shared += 1;
        } else {
            assert_eq!(a, b, "key {key:x} is not in batch 1: same row either way");
            fresh += 1;
        }
    }
    assert!(shared > 0 && fresh > 0, "the batches share {shared} keys and have {fresh} of their own");
    // Both end with batch 1's update applied to the same rows.
    for key in &b1_keys {
        assert_eq!(exact.table.get_row(*key), piped.table.get_row(*key));
    }
}

#[test]
fn deeper_pipelines_train_every_row_to_a_close_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 30000, 3000);
    let base = common::small_config(&data, "dlrm");
    let exact = train(&base, true).expect("depth 0");
    let mut piped = base.clone();
    piped.train.pipeline_depth = 1;
    let piped = train(&piped, true).expect("depth 1");
    assert_eq!(piped.train_rows, exact.train_rows);
    assert_eq!(piped.steps, exact.steps);
    assert_eq!(piped.embedding_rows, exact.embedding_rows, "the same keys were inserted");
    let (a, b) = (exact.test_auc.expect("auc"), piped.test_auc.expect("auc"));
    assert_ne!(a.to_bits(), b.to_bits(), "stale-by-one lookups change the model");
    assert!((a - b).abs() < 0.01, "depth 0 {a}, depth 1 {b}");

    let mut deeper = base.clone();
    deeper.train.pipeline_depth = 3;
    let deeper = train(&deeper, true).expect("depth 3");
    assert_eq!((deeper.train_rows, deeper.steps), (exact.train_rows, exact.steps));
    assert_eq!(deeper.embedding_rows, exact.embedding_rows);
    let c = deeper.test_auc.expect("auc");
    assert_ne!(c.to_bits(), b.to_bits(), "stale by three is another model than stale by one");
    assert!((a - c).abs() < 0.01, "depth 0 {a}, depth 3 {c}");

    let mut seven = base.clone();
    seven.train.max_steps = Some(7);
    let e = train(&seven, true).expect("max_steps");
    for depth in [1, 3] {
        let mut stopped = base.clone();
        stopped.train.pipeline_depth = depth;
        stopped.train.max_steps = Some(7);
        let s = train(&stopped, true).expect("max_steps");
        assert_eq!(s.steps, 7);
        assert_eq!(s.embedding_rows, e.embedding_rows, "depth {depth}: no lookahead past the last step");
    }
}
