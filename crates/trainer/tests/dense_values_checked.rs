//! A batch whose dense values do not fill its rows (a loader on another
//! schema, a batch from the wire) is refused naming them, before any
//! weight moves: pooling writes each row's values beside its embeddings,
//! and a short or long slice would shift or drop them.

mod common;

use std::path::Path;

use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_trainer::Trainer;

#[test]
fn dense_values_short_or_long_of_the_rows_are_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 300, 10);
    let config = common::small_config(&data, "dlrm");
    let path = config.data.train.clone().expect("train path");
    let stream =
        BatchStream::spawn(Path::new(&path), &config, 64, Default::default(), 1, BadRows::new(0, 0)).expect("stream");
    let batch = stream.into_iter().next().expect("a batch").expect("batch");
    assert!(batch.num_dense > 0, "the small data has dense columns");
    let mut trainer = Trainer::new(&config, DataLayout::from_config(&config.data)).expect("trainer");
    let before = trainer.model.params.flat_values().expect("weights");
    for extra in [-1i64, 1] {
        let mut bad = batch.clone();
        match extra {
            -1 => _ = bad.dense.pop(),
            _ => bad.dense.push(0.5),
        }
        let Err(err) = trainer.train_batch(&bad) else {
            panic!("{extra:+}: a batch of the wrong dense values trained")
        };
        let err = err.to_string();
        assert!(err.contains("dense features"), "{extra:+}: {err}");
    }
    assert_eq!(trainer.model.params.flat_values().expect("weights"), before, "no weight moved");
    trainer.train_batch(&batch).expect("the batch as read trains");
}
