//! `embedding.admit_min_count` and `embedding.ttl_steps` in a training run:
//! fewer rows, the counts in the JSON, and a model that still learns.

mod common;

use sparrow_trainer::train;

#[test]
fn filters_shrink_the_table_and_the_model_still_learns() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 6000, 1000);
    let base = common::small_config(&data, "dlrm");
    let plain = train(&base, true).expect("plain");
    assert_eq!((plain.table.admitted_keys, plain.table.not_admitted_lookups, plain.table.expired_rows), (0, 0, 0));

    let mut admit = base.clone();
    admit.embedding.admit_min_count = 3;
    let a = train(&admit, true).expect("admit");
    assert!(a.embedding_rows < plain.embedding_rows, "{} vs {} rows", a.embedding_rows, plain.embedding_rows);
    assert_eq!(a.table.admitted_keys, a.embedding_rows, "every row was admitted by count");
    assert!(a.table.not_admitted_lookups >= 2 * a.table.admitted_keys);

    let mut ttl = base.clone();
    ttl.embedding.ttl_steps = 10;
    let t = train(&ttl, true).expect("ttl");
    assert!(t.table.expired_rows > 0);
    assert!(t.embedding_rows < plain.embedding_rows, "{} vs {} rows", t.embedding_rows, plain.embedding_rows);

    for (name, s) in [("admit", &a), ("ttl", &t)] {
        let (auc, base_auc) = (s.test_auc.expect("auc"), plain.test_auc.expect("auc"));
        assert!(auc > 0.6 && auc > base_auc - 0.05, "{name}: AUC {auc} vs {base_auc} unfiltered");
    }
}
