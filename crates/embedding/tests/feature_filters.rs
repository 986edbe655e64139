//! Feature filters (`embedding.admit_min_count`, `embedding.ttl_steps`): a key
//! gets a row only after enough sightings, and rows nobody uses expire; the
//! training path (lookup → update) sees neither filtered key nor expired row.

use sparrow_core::config::{CachePolicy, InitConfig};
use sparrow_embedding::table::SsdOptions;
use sparrow_embedding::{EmbeddingTable, FeatureFilters, Initializer, SparseOptimizer};

const DIM: usize = 4;

fn opt() -> SparseOptimizer {
    SparseOptimizer::Adagrad { lr: 0.1, eps: 1e-8 }
}

fn init() -> Initializer {
    Initializer::new(InitConfig::default(), 7)
}

fn filtered(filters: FeatureFilters) -> EmbeddingTable {
    EmbeddingTable::new(DIM, opt(), init(), 4).with_filters(filters).expect("filters")
}

/// One training step over `keys`: lookup, then a gradient of ones per unique key.
fn step(table: &EmbeddingTable, keys: &[u64]) -> Vec<f32> {
    let plan = table.plan(keys);
    let mut rows = vec![0.0; plan.num_unique() * DIM];
    let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
    table.apply_gradients_at(&plan, &slots, &vec![1.0; rows.len()]).expect("update");
    rows
}

/// A table on the SSD tier with a 4-row cache (one per lock shard).
fn tiny_ssd_table(dir: &std::path::Path) -> EmbeddingTable {
    let ssd = SsdOptions { dir: dir.to_path_buf(), cache_capacity_rows: 4, policy: CachePolicy::Lru };
    EmbeddingTable::with_ssd(DIM, opt(), init(), 4, &ssd).expect("ssd")
}

fn initial(key: u64) -> Vec<f32> {
    let mut w = vec![0.0; DIM];
    init().fill(key, &mut w);
    w
}

#[test]
fn a_key_gets_a_row_on_its_third_sighting() {
    let t = filtered(FeatureFilters { admit_min_count: 3, admit_sketch_counters: 4096, ..Default::default() });
    for sighting in 1..=2 {
        // Not admitted: reads as its initial vector, its gradient is dropped.
        assert_eq!(step(&t, &[42, 42]), initial(42), "sighting {sighting}");
        assert_eq!(t.len(), 0);
        assert_eq!(t.get_row(42), None);
    }
    assert_eq!(step(&t, &[42]), initial(42), "admitted with a fresh row");
    assert_eq!(t.len(), 1);
    let row = t.get_row(42).expect("row");
    assert!(row[..DIM].iter().zip(initial(42)).all(|(w, w0)| *w < w0), "the third update was applied");
    // From now on the trained row is what a lookup returns.
    assert_eq!(step(&t, &[42]), row[..DIM].to_vec());
    let s = t.filter_stats();
    assert_eq!((s.not_admitted, s.admitted, s.expired), (2, 1, 0));
}

#[test]
fn without_filters_every_key_is_admitted_at_once() {
    let t = filtered(FeatureFilters::default());
    step(&t, &[1, 2, 3]);
    assert_eq!(t.len(), 3);
    assert_eq!(t.filter_stats(), Default::default());
}

#[test]
fn rows_unused_for_ttl_steps_expire_and_come_back_fresh() {
    let ttl = 8;
    let t = filtered(FeatureFilters { ttl_steps: ttl, ttl_floor: 2, ..Default::default() });
    let cold: Vec<u64> = (100..140).collect();
    step(&t, &cold);
    let trained = t.get_row(100).expect("row");
    assert_ne!(trained[..DIM], initial(100)[..]);
    for _ in 0..ttl {
        step(&t, &[1, 2]);
    }
    assert_eq!(t.len(), 42, "ttl lookups later the cold rows are still there");
    // A sweep runs every ttl/8 lookups: within 9/8 ttl + 1 they are gone.
    for _ in 0..ttl / 8 + 2 {
        step(&t, &[1, 2]);
    }
    assert_eq!(t.len(), 2, "only the rows in use are left");
    assert_eq!(t.filter_stats().expired, 40);
    assert_eq!(t.get_row(100), None);
    // A paged walk (checkpoints, cluster export) sees only live rows.
    let mut seen = Vec::new();
    let mut cursor = Some((0, 0));
    while let Some(at) = cursor {
        cursor = t.rows_from(at, 3, |key, _, _| seen.push(key)).expect("walk");
    }
    seen.sort_unstable();
    assert_eq!(seen, vec![1, 2]);
    // The freed slots are reused; the key returns as a new row.
    let bytes = t.allocated_bytes();
    assert_eq!(step(&t, &cold)[..DIM], initial(100)[..]);
    assert_eq!(t.len(), 42);
    assert_eq!(t.allocated_bytes(), bytes, "no new memory for returning keys");
    let mut rows = 0;
    t.for_each_row(|_, _, _| {
        rows += 1;
        Ok(())
    })
    .expect("rows");
    assert_eq!(rows, 42);
}

#[test]
fn a_row_looked_up_but_not_yet_updated_never_expires() {
    let t = filtered(FeatureFilters { ttl_steps: 1, ttl_floor: 2, ..Default::default() });
    step(&t, &[5]);
    for _ in 0..5 {
        step(&t, &[6]);
    }
    // Key 7's lookup is in flight while another lookup sweeps (pipeline depth 1).
    let plan = t.plan(&[7]);
    let mut rows = vec![0.0; DIM];
    let slots = t.lookup_or_insert(&plan, &mut rows).expect("lookup");
    step(&t, &[6]);
    t.apply_gradients_at(&plan, &slots, &[1.0; DIM]).expect("update");
    assert!(t.get_row(7).expect("still there")[..DIM].iter().zip(initial(7)).all(|(w, w0)| *w < w0));
    assert_eq!(t.get_row(5), None, "the old row expired");
}

#[test]
fn a_key_restored_onto_the_ssd_tier_counts_as_admitted() {
    let tmp = tempfile::tempdir().expect("tmp");
    let filters = FeatureFilters { admit_min_count: 5, admit_sketch_counters: 4096, ..Default::default() };
    let t = tiny_ssd_table(tmp.path()).with_filters(filters).expect("filters");
    let restored: Vec<f32> = (0..t.row_len()).map(|i| i as f32 + 0.5).collect();
    for key in 0..64u64 {
        t.put_row(key, &restored).expect("restore");
    }
    assert!(t.cached_rows() < 64, "most restored rows went to the store");
    assert_eq!(step(&t, &(0..64).collect::<Vec<_>>()), restored[..DIM].repeat(64));
    assert_eq!(t.len(), 64);
    assert_eq!(t.filter_stats().not_admitted, 0);
    // A new key on the same table is still filtered.
    step(&t, &[1000]);
    assert_eq!(t.len(), 64);
}

fn walk_keys(t: &EmbeddingTable) -> Vec<u64> {
    let mut seen = Vec::new();
    let mut cursor = Some((0, 0));
    while let Some(at) = cursor {
        cursor = t.rows_from(at, 3, |key, _, _| seen.push(key)).expect("walk");
    }
    seen.sort_unstable();
    seen
}

fn store_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir).expect("dir").map(|e| e.expect("entry").metadata().expect("meta").len()).sum()
}

const TTL: u64 = 64;

/// An SSD-tier table with `ttl_steps = ttl` and keys 100..140 trained one per
/// lookup (ticks 2..=41), so that each evicts the last one of its lock shard.
fn ssd_table_with_cold_rows(dir: &std::path::Path, ttl: u64) -> (EmbeddingTable, Vec<u64>) {
    let t = tiny_ssd_table(dir).with_filters(FeatureFilters { ttl_steps: ttl, ..Default::default() }).expect("ttl");
    let cold: Vec<u64> = (100..140).collect();
    for &k in &cold {
        step(&t, &[k]);
    }
    (t, cold)
}

/// `ttl_steps` on the SSD tier: rows written to the store expire there too
/// (deleted by the sweep), and their records are reused.
#[test]
fn rows_on_the_ssd_tier_expire_and_their_records_are_reused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (t, cold) = ssd_table_with_cold_rows(tmp.path(), TTL);
    let ttl = TTL;
    assert_eq!(t.len(), 40);
    assert!(t.len() - t.cached_rows() >= 30, "{} of 40 rows cached", t.cached_rows());
    let trained = t.get_row(100).expect("used within ttl_steps: read back from the store");
    assert_ne!(trained[..DIM], initial(100)[..]);
    // Past the ttl, plus a whole sweep of the store (a quarter every ttl/8
    // lookups). Key 100 is read back and used all along: its old stored copy
    // is not its age.
    for _ in 0..ttl + 4 * (ttl / 8) + 2 {
        step(&t, &[1, 2, 100]);
    }
    assert_eq!(t.len(), 3, "only the rows in use are left");
    assert_eq!(t.filter_stats().expired, 39);
    assert_eq!(t.get_row(101), None);
    assert_ne!(t.get_row(100).expect("in use")[..DIM], trained[..DIM], "trained on");
    assert_eq!(walk_keys(&t), vec![1, 2, 100]);
    // The keys return as new rows, in the deleted records: the store does not grow.
    let (bytes, writebacks) = (store_bytes(tmp.path()), t.tier_stats().expect("tier").writebacks);
    for &k in &cold[1..] {
        assert_eq!(step(&t, &[k])[..DIM], initial(k)[..]);
    }
    assert_eq!(t.len(), 42);
    assert!(t.tier_stats().expect("tier").writebacks >= writebacks + 30, "the returning rows went to the store");
    assert_eq!(store_bytes(tmp.path()), bytes);
}

/// A row expired on the store reads as absent even before the sweep reaches
/// it, each expired row is counted once, and a checkpoint (which sweeps all of
/// the store first) counts exactly the rows its walk visits.
#[test]
fn an_expired_stored_row_is_absent_before_the_sweep_reaches_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Lookup ticks 2..=41, one key each (most end up on the store)…
    let (t, _) = ssd_table_with_cold_rows(tmp.path(), TTL);
    // …then ticks 42..=74: rows last used before tick 74 - TTL = 10 are expired.
    for _ in 0..33 {
        step(&t, &[1, 2]);
    }
    for k in 100..108 {
        assert_eq!(t.get_row(k), None, "key {k} expired");
    }
    assert!(t.get_row(108).is_some(), "used at tick 10: not yet expired");
    // Used at tick 9: no sweep has deleted it yet, a lookup (tick 75) starts it afresh.
    assert_eq!(step(&t, &[107])[..DIM], initial(107)[..]);
    t.sweep_expired().expect("sweep");
    // At tick 75 the rows of ticks 2..=10 (keys 100..=108) are expired.
    assert_eq!(t.filter_stats().expired, 9, "each expired row counted once");
    let mut walked = 0;
    t.for_each_row(|_, _, _| {
        walked += 1;
        Ok(())
    })
    .expect("walk");
    assert_eq!((t.len(), walked), (42 - 9 + 1, 42 - 9 + 1));
}

/// `max_rows` and `ttl_secs` (the trainer picks the cutoff): the least
/// recently used rows go, counted by why, cached or only stored; rows of a
/// lookup not yet updated stay; a deleted key comes back fresh.
#[test]
fn rows_deleted_by_a_cutoff_are_the_least_recently_used_in_memory_and_on_the_ssd_tier() {
    let dir = tempfile::tempdir().expect("tmp");
    let memory = EmbeddingTable::new(DIM, opt(), init(), 4).with_deletable_rows();
    let ssd = tiny_ssd_table(dir.path()).with_deletable_rows();
    for t in [&memory, &ssd] {
        // Rows 0..30 used once each, in order, then 0..5 again.
        for k in 0..30u64 {
            step(t, &[k]);
        }
        step(t, &[0, 1, 2, 3, 4]);
        assert_eq!(t.len(), 30);
        let cutoff = t.lru_cutoff(12).expect("cutoff").expect("over 12 rows");
        assert_eq!(t.delete_used_before(cutoff, sparrow_embedding::Deletion::Evicted).expect("delete"), 18);
        let mut left = walk_keys(t);
        left.sort_unstable();
        assert_eq!(left, [0, 1, 2, 3, 4, 23, 24, 25, 26, 27, 28, 29], "the 12 used last");
        assert_eq!((t.filter_stats().evicted, t.filter_stats().expired), (18, 0));
        assert_eq!(t.lru_cutoff(12).expect("cutoff"), None, "within the bound");
        // In flight: looked up, not updated yet; a cutoff past it keeps it.
        let plan = t.plan(&[29]);
        let mut rows = vec![0.0; DIM];
        let slots = t.lookup_or_insert(&plan, &mut rows).expect("lookup");
        let deleted = t.delete_used_before(t.clock() + 1, sparrow_embedding::Deletion::Expired).expect("delete");
        assert_eq!(deleted, 11, "every row but the one in flight");
        t.apply_gradients_at(&plan, &slots, &[1.0; DIM]).expect("update");
        assert_eq!(walk_keys(t), vec![29]);
        assert_eq!(t.filter_stats().expired, 11);
        assert_eq!(step(t, &[5])[..DIM], initial(5)[..], "a deleted key starts afresh");
    }
}
