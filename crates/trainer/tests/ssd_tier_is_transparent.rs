//! `embedding.storage = "ssd"`: a memory cache far smaller than the table in
//! front of the SSD store trains exactly the model of the all-in-memory table
//! (rows evicted and read back keep every bit), writes the same checkpoint
//! rows, keeps only the cache's rows in memory, and (with each batch's rows
//! prefetched beside the previous dense step) never waits for the store in a
//! lookup.

mod common;

use sparrow_core::config::{CachePolicy, Storage};
use sparrow_trainer::train;

fn embeddings_digest(dir: &std::path::Path) -> String {
    let m = sparrow_trainer::checkpoint::read_manifest(&sparrow_trainer::checkpoint::resolve(dir).expect("resolve"))
        .expect("manifest");
    m.files["embeddings.bin"].xxh3.clone()
}

#[test]
fn a_small_cache_over_ssd_trains_the_in_memory_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 3000, 500);
    let mut base = common::small_config(&data, "dlrm");
    base.train.batch_size = 32;
    base.embedding.table_shards = 4;
    base.checkpoint.dir = Some(tmp.path().join("mem-ckpt").display().to_string());
    let memory = train(&base, true).expect("memory");
    assert_eq!(memory.table.cache_hit_rate, None);

    for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
        let mut ssd = base.clone();
        ssd.embedding.storage = Storage::Ssd;
        ssd.embedding.path = Some(tmp.path().join(format!("ssd-{policy:?}")).display().to_string());
        ssd.embedding.cache_capacity_rows = 1200;
        ssd.embedding.cache_policy = policy;
        ssd.checkpoint.dir = Some(tmp.path().join(format!("ssd-ckpt-{policy:?}")).display().to_string());
        let s = train(&ssd, true).expect("ssd");
        assert!(s.embedding_rows > 5 * 1200, "the table ({} rows) is much larger than the cache", s.embedding_rows);
        assert_eq!(s.embedding_rows, memory.embedding_rows, "{policy:?}");
        assert_eq!(s.test_auc.map(f64::to_bits), memory.test_auc.map(f64::to_bits), "{policy:?}: same model");
        let cached = s.table.cached_rows.expect("cached rows");
        assert!(cached < s.embedding_rows / 3, "{policy:?}: {cached} rows cached of {}", s.embedding_rows);
        assert!(s.table.ssd_writebacks.expect("writebacks") > 0);
        // Each batch's rows were staged beside the previous dense step (S3.5).
        assert_eq!(s.table.lookup_misses_after_prefetch, Some(0), "{policy:?}");
        let hit = s.table.cache_hit_rate.expect("hit rate");
        assert!(hit > 0.0 && hit < 1.0, "{policy:?}: hit rate {hit}");
        // The checkpoint walks cache and store: the same rows, byte for byte.
        assert_eq!(
            embeddings_digest(std::path::Path::new(s.checkpoint.as_deref().expect("ckpt"))),
            embeddings_digest(std::path::Path::new(memory.checkpoint.as_deref().expect("ckpt"))),
            "{policy:?}"
        );
    }
}

/// With both feature filters on, the SSD tier still trains the in-memory
/// model bit for bit: a row past `ttl_steps` is gone whether it was cached or
/// stored when next read, and a prefetch neither ages nor re-counts a row.
#[test]
fn feature_filters_give_the_same_model_in_memory_and_on_ssd() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    common::small_data(&data, 3000, 500);
    let mut base = common::small_config(&data, "dlrm");
    base.train.batch_size = 32;
    base.embedding.admit_min_count = 2;
    base.embedding.ttl_steps = 20;
    let memory = train(&base, true).expect("memory");
    assert!(memory.table.expired_rows > 0 && memory.table.not_admitted_lookups > 0, "{:?}", memory.table);

    let mut ssd = base.clone();
    ssd.embedding.storage = Storage::Ssd;
    ssd.embedding.path = Some(tmp.path().join("ssd").display().to_string());
    ssd.embedding.cache_capacity_rows = 300;
    let s = train(&ssd, true).expect("ssd");
    assert!(s.table.ssd_writebacks.expect("writebacks") > 0, "rows went through the store");
    assert_eq!(s.test_auc.map(f64::to_bits), memory.test_auc.map(f64::to_bits), "same model");
    assert_eq!(s.embedding_rows, memory.embedding_rows);
    assert_eq!(
        (s.table.expired_rows, s.table.admitted_keys, s.table.not_admitted_lookups),
        (memory.table.expired_rows, memory.table.admitted_keys, memory.table.not_admitted_lookups)
    );
}
