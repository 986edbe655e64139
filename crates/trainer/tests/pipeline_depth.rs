//! `train.pipeline_depth`: at 0 a batch's lookup sees the previous batch's
//! update (the exact, unpipelined model); at d ≥ 1 the batch d ahead is looked
//! up beside the current dense step, so it sees rows from before that update.

mod common;

use std::path::Path;

use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_trainer::{Trainer, train};

fn first_batches(config: &sparrow_core::Config, n: usize) -> Vec<sparrow_core::Batch> {
    let path = config.data.train.clone().expect("train path");
    let stream =
        BatchStream::spawn(Path::new(&path), config, 128, Default::default(), 1, BadRows::new(0, 0)).expect("stream");
    stream.take(n).map(|b| b.expect("batch")).collect()
}

/// Trains `batches` one step each at `depth`, then applies the update left waiting.
fn trained(config: &sparrow_core::Config, depth: usize, batches: &[sparrow_core::Batch]) -> Trainer {
    let mut config = config.clone();
    config.train.pipeline_depth = depth;
    let mut trainer = Trainer::new(&config, DataLayout::from_config(&config.data)).expect("trainer");
    let partitioner = trainer.table.partitioner();
    let mut queue = batches.iter();
    let mut next = |_: usize| queue.next().map(|b| Ok((b.clone(), partitioner.plan(&b.keys))));
    while let Some(report) = trainer.step(&mut next).expect("step") {
        assert!(report.deferred.is_none());
    }
    assert_eq!(trainer.has_pending_update(), depth > 0, "the last update waits at depth {depth}");
    trainer.flush_update().expect("update");
    trainer
}

#[test]
fn depth_0_sees_the_previous_update_and_depth_1_does_not() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 1000, 100);
    let config = common::small_config(&data, "dlrm");
    let batches = first_batches(&config, 2);
    let (b1, b2) = (&batches[0], &batches[1]);
    let exact = trained(&config, 0, &batches);
    let piped = trained(&config, 1, &batches);
    assert_eq!(exact.step, 2);
    assert_eq!(piped.step, 2);
    // At depth 1 batch 2 was looked up beside batch 1's dense step, before
    // its update: a key of both got batch 2's gradient at other weights. A
    // key of batch 1 alone got batch 1's update only, the same either way.
    let b2_keys: std::collections::HashSet<u64> = b2.keys.iter().copied().collect();
    let (mut shared, mut own) = (0, 0);
    for key in b1.keys.iter().collect::<std::collections::HashSet<_>>() {
        let (a, b) = (exact.table.get_row(*key), piped.table.get_row(*key));
        if b2_keys.contains(key) {
            assert_ne!(a, b, "key {key:x}: depth 0 saw batch 1's update, depth 1 did not");
            shared += 1;
        } else {
            assert_eq!(a, b, "key {key:x} is in batch 1 only: the same row either way");
            own += 1;
        }
    }
    assert!(shared > 0 && own > 0, "the batches share {shared} keys and have {own} of their own");
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
