//! The split data path (S0) over the in-process transport: loader, 3 shards
//! and one worker end with exactly the model `sparrow train` produces (in S0
//! and in worker_lookup mode), f16 rows and bf16 products included;
//! data-parallel workers keep identical dense weights; the shards refuse
//! batches they do not hold.

use sparrow_core::Overrides;
use std::sync::Arc;

use sparrow_cluster::generation::Generation;
use sparrow_cluster::shard::shard_table;
use sparrow_cluster::sync::{RoundSum, RoundSummer};
use sparrow_cluster::worker::WorkerStats;
use sparrow_cluster::worker::{StepPolicy, new_worker};
use sparrow_cluster::{ClusterError, LoaderServer, LoaderService, Mode, ShardServer, ShardService, train_local};
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
    Overrides::parse(&overrides).and_then(|o| Config::from_toml(&text, "test", &o)).expect("config")
}

/// `kind`, or `kind-f16rows` (`embedding.dtype = "f16"`), or
/// `kind-srf16rows` (f16 rows rounded stochastically), or `kind-bf16`
/// (`model.precision = "bf16"`), or `kind-regularized` (`embedding.l2`,
/// AdamW's weight decay, dropout and layer norm), or `kind-scheduled` (a warmup and
/// cosine decay of both rates), or `kind-batchnorm` (`model.norm = "batch"`),
/// or `kind-dice` (batch norm and Dice's statistics).
fn variant(dir: &std::path::Path, name: &str) -> Config {
    if let Some(kind) = name.strip_suffix("-srf16rows") {
        config_with(dir, kind, &["embedding.dtype=\"f16\"", "embedding.rounding=\"stochastic\""])
    } else if let Some(kind) = name.strip_suffix("-f16rows") {
        config_with(dir, kind, &["embedding.dtype=\"f16\""])
    } else if let Some(kind) = name.strip_suffix("-regularized") {
        let decay = [
            "embedding.l2=0.001",
            "dense_optimizer.kind=\"adamw\"",
            "dense_optimizer.weight_decay=0.01",
            "model.dropout=0.2",
            "model.norm=\"layer\"",
        ];
        config_with(dir, kind, &decay)
    } else if let Some(kind) = name.strip_suffix("-dice") {
        config_with(dir, kind, &["model.norm=\"batch\"", "model.activation=\"dice\""])
    } else if let Some(kind) = name.strip_suffix("-batchnorm") {
        config_with(dir, kind, &["model.norm=\"batch\"", "model.batch_norm_momentum=0.2"])
    } else if let Some(kind) = name.strip_suffix("-scheduled") {
        let schedule = [
            "train.schedule.kind=\"cosine\"",
            "train.schedule.warmup_steps=5",
            "train.schedule.decay_steps=15",
            "train.schedule.final_factor=0.1",
        ];
        config_with(dir, kind, &schedule)
    } else if let Some(kind) = name.strip_suffix("-bf16") {
        config_with(dir, kind, &["model.precision=\"bf16\""])
    } else {
        config(dir, name)
    }
}

/// S1 (`cluster.mode = "collocated"`): every training pull and push goes to
/// the shards' second levels, staged pass by pass, and the model is still
/// `train`'s bit for bit: one list per pass or one per batch, passes of 5
/// batches or split by a small second-level capacity.
#[test]
fn collocated_passes_through_a_second_level_equal_train() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let settings: [&[&str]; 6] = [
        &["cluster.pass_batches=5"],
        &["cluster.pass_batches=5", "cluster.pass_request=\"per_batch\""],
        &["cluster.l2_capacity_rows=8000"],
        // Half rows: the second level rounds each update as level 1 stores it,
        // to nearest or stochastically (the same draws: key, seed, update count).
        &["cluster.pass_batches=5", "embedding.dtype=\"bf16\""],
        &["cluster.pass_batches=5", "embedding.dtype=\"bf16\"", "embedding.rounding=\"stochastic\""],
        // A warmup: the second level steps its rows at each batch's rate.
        &["cluster.pass_batches=5", "train.schedule.warmup_steps=10"],
    ];
    for extra in settings {
        let mut overrides = vec!["cluster.mode=\"collocated\""];
        overrides.extend_from_slice(extra);
        let c = config_with(tmp.path(), "dlrm", &overrides);
        let row_settings: Vec<&str> =
            extra.iter().copied().filter(|e| e.starts_with("embedding.") || e.starts_with("train.")).collect();
        let single = &sparrow_trainer::train(&config_with(tmp.path(), "dlrm", &row_settings), true).expect("train");
        for shards in [1, 3] {
            let cluster = train_local(&c, shards, 1).expect("collocated");
            assert_eq!(
                cluster.test_auc.map(f64::to_bits),
                single.test_auc.map(f64::to_bits),
                "{extra:?}, {shards} shards: {:?} vs {:?}",
                cluster.test_auc,
                single.test_auc
            );
            assert_eq!(cluster.embedding_rows, single.embedding_rows, "every row flushed into level 1");
            let l2 = cluster.second_level.expect("second-level counters");
            assert_eq!(l2.l1_reads_during_pass, 0);
            // 3000 rows in batches of 128: 24 batches.
            let expected_passes = if extra[0].contains("pass_batches") { 5 } else { 2 };
            assert!(l2.passes_staged >= expected_passes, "{extra:?}: {l2:?}");
            assert_eq!(l2.passes_staged, l2.passes_flushed, "every pass flushed: {l2:?}");
            assert_eq!(
                l2.rows_initialised + l2.rows_from_l1,
                l2.rows_flushed,
                "each staged row went back once: {l2:?}"
            );
            if extra[0].contains("l2_capacity_rows") {
                // Summed over the shards: each holds at most its capacity.
                assert!(l2.peak_rows <= 8000 * shards as u64, "the capacity holds: {l2:?}");
            }
        }
    }
    // A capacity one batch does not fit in (128 rows × 26 fields) is refused naming the key.
    let c = config_with(tmp.path(), "dlrm", &["cluster.mode=\"collocated\"", "cluster.l2_capacity_rows=100"]);
    let err = train_local(&c, 1, 1).expect_err("too small");
    assert!(err.to_string().contains("cluster.l2_capacity_rows"), "{err}");
}

#[test]
fn three_shards_one_worker_equals_train() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let mut checksums = Vec::new();
    let kinds = [
        "dlrm",
        "mlp",
        "mlp-f16rows",
        "mlp-srf16rows",
        "dlrm-bf16",
        "mlp-regularized",
        "dlrm-scheduled",
        "dlrm-batchnorm",
        "mlp-dice",
    ];
    for kind in kinds {
        let c = variant(tmp.path(), kind);
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
        checksums.push((kind, cluster.dense_checksums[0]));
    }
    // bf16 products round: a model of its own, not f32's under another name.
    assert_ne!(checksums[0], ("dlrm", checksums[3].1), "{checksums:x?}");
}

/// Every one-task kind of the model registry trains the same model on two
/// shards and a worker as `sparrow train` does: a kind added to the
/// registry is held to train ≡ launch here without a line of its own.
#[test]
fn every_registered_one_task_kind_trains_the_single_process_model_on_a_cluster() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 1200, 300, 4).expect("generate");
    for kind in sparrow_model::kinds::of_family(sparrow_model::kinds::Family::OneTask) {
        let c = config(tmp.path(), kind.name());
        let single = sparrow_trainer::train(&c, true).expect("train");
        let cluster = train_local(&c, 2, 1).expect("cluster");
        assert_eq!(cluster.train_rows, single.train_rows, "{}", kind.name());
        assert!(single.test_auc.is_some_and(f64::is_finite), "{}: {:?}", kind.name(), single.test_auc);
        assert_eq!(
            cluster.test_auc.map(f64::to_bits),
            single.test_auc.map(f64::to_bits),
            "{}: {:?} vs {:?}",
            kind.name(),
            cluster.test_auc,
            single.test_auc
        );
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

/// `train.pipeline_depth = d`: the worker pulls batch t+d beside batch t's
/// dense step, after pushing batch t−1 — the staleness of `sparrow train` at
/// depth d, so one worker over 3 shards ends with train's exact model.
#[test]
fn a_pipelined_worker_trains_the_single_process_model_of_the_same_depth() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let exact = train_local(&config(tmp.path(), "dlrm"), 3, 1).expect("depth 0");
    for depth in [1, 2] {
        let c = config_with(tmp.path(), "dlrm", &[&format!("train.pipeline_depth={depth}")]);
        let single = sparrow_trainer::train(&c, true).expect("train");
        let cluster = train_local(&c, 3, 1).expect("cluster");
        assert_eq!(cluster.train_rows, 3000, "depth {depth}: every sample trained once");
        assert_eq!(cluster.embedding_rows, single.embedding_rows, "depth {depth}");
        assert_eq!(
            cluster.test_auc.map(f64::to_bits),
            single.test_auc.map(f64::to_bits),
            "depth {depth}: {:?} vs {:?}",
            cluster.test_auc,
            single.test_auc
        );
        assert_ne!(cluster.dense_checksums, exact.dense_checksums, "depth {depth} trained with stale rows");
        // Replicas stay identical when several workers pull ahead.
        let pair = train_local(&c, 2, 2).expect("two workers");
        assert_eq!(pair.train_rows, 3000, "depth {depth}");
        assert_eq!(pair.dense_checksums[0], pair.dense_checksums[1], "depth {depth}: replicas diverged");
    }
}

#[test]
fn data_parallel_workers_hold_identical_dense_weights() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 4000, 800, 11).expect("generate");
    // Batch norm: each worker normalizes its own batch, and the running
    // statistics move by all of them together, the same on every replica.
    for kind in ["dlrm", "mlp", "mlp-f16rows", "dlrm-bf16", "mlp-batchnorm", "dlrm-dice"] {
        let c = variant(tmp.path(), kind);
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
    shard.enqueue(7, vec![1, 2, 3], Mode::Train, None).expect("enqueue");
    let err = shard.push(7, vec![0.0; 12], 1.0).expect_err("push before pull");
    assert!(err.to_string().contains("shard 2"), "{err}");
    let rows = shard.pull(7).expect("pull");
    assert_eq!(rows.len(), 12);
    let err = shard.push(7, vec![0.0; 5], 1.0).expect_err("wrong size");
    assert!(matches!(err, ClusterError::WrongSize { shard: 2, .. }), "{err}");
    shard.push(7, vec![0.5; 12], 1.0).expect("push");
    assert!(shard.push(7, vec![0.5; 12], 1.0).is_err(), "a batch is applied once");
    // An evaluation batch reads without inserting.
    shard.enqueue(8, vec![1, 99], Mode::Eval, None).expect("enqueue");
    assert_eq!(shard.pull(8).expect("pull").len(), 8);
    assert_eq!(shard.table().len(), 3);
}

/// Worker 1 is slow: its `n`-th batch waits until worker 0 has taken `2n`
/// (or has seen the data end), or at most half a second, when worker 0
/// cannot take more (a step fetches its next batch before it contributes
/// the one it trained, so worker 0 may be waiting on worker 1's). Worker 0
/// then finds worker 1 missing from rounds past its patience and trains
/// more batches in them instead of waiting (S2.2), and the replicas stay
/// identical. (It slept 40 ms a batch before, which a debug build's batch
/// on a loaded 2-core machine could outlast: both then took 16.)
#[test]
fn a_faster_worker_takes_more_batches_and_replicas_stay_identical() {
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    /// What worker 0 has taken: batches, and whether it saw the data end.
    #[derive(Default)]
    struct Taken {
        batches: u64,
        ended: bool,
    }
    struct SlowFor<'a> {
        inner: &'a dyn LoaderService,
        slow_worker: usize,
        fast: Mutex<(Taken, u64)>,
        changed: Condvar,
    }
    impl LoaderService for SlowFor<'_> {
        fn next_batch(
            &self,
            worker: usize,
            mode: Mode,
            generation: Generation,
        ) -> Result<Option<sparrow_cluster::WorkerBatch>, ClusterError> {
            if worker == self.slow_worker {
                let mut guard = self.fast.lock().expect("lock");
                guard.1 += 1;
                let wanted = 2 * guard.1;
                let (guard, _) = self
                    .changed
                    .wait_timeout_while(guard, Duration::from_millis(500), |(t, _)| t.batches < wanted && !t.ended)
                    .expect("lock");
                drop(guard);
                return self.inner.next_batch(worker, mode, generation);
            }
            let batch = self.inner.next_batch(worker, mode, generation)?;
            let mut guard = self.fast.lock().expect("lock");
            match batch {
                Some(_) => guard.0.batches += 1,
                None => guard.0.ended = true,
            }
            self.changed.notify_all();
            Ok(batch)
        }

        fn training_ended_at_epoch_end(&self, generation: Generation) -> Result<bool, ClusterError> {
            self.inner.training_ended_at_epoch_end(generation)
        }
    }
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 4000, 100, 13).expect("generate");
    let c = config(tmp.path(), "dlrm");
    let layout = sparrow_data::DataLayout::from_config(&c.data);
    let shards: Vec<Arc<dyn ShardService>> = (0..2)
        .map(|i| Arc::new(ShardServer::new(i, shard_table(&c, i).expect("table"))) as Arc<dyn ShardService>)
        .collect();
    let loader = LoaderServer::start(&c, shards.clone()).expect("loader");
    let slow = SlowFor { inner: &loader, slow_worker: 1, fast: Default::default(), changed: Condvar::new() };
    let rounds = Arc::new(RoundSum::new(2));
    let results: Vec<(WorkerStats, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|w| {
                let (layout, shards, slow, rounds) = (&layout, &shards, &slow, rounds.clone());
                let c = &c;
                scope.spawn(move || {
                    let policy = Box::new(StepPolicy::summing(
                        w,
                        Generation::NONE,
                        rounds as Arc<dyn RoundSummer>,
                        sparrow_core::simd::Simd::Auto,
                    ));
                    let mut worker = new_worker(c, layout, w).expect("worker").with_policy(policy);
                    worker.run_training(slow, shards).expect("train");
                    (worker.stats.clone(), worker.dense_checksum().expect("checksum"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let (fast, slow) = (&results[0].0, &results[1].0);
    assert_eq!(fast.rows + slow.rows, 4000, "every sample trained once");
    assert!(fast.batches > slow.batches, "fast {} batches, slow {}", fast.batches, slow.batches);
    assert_eq!(fast.steps, slow.steps, "one optimizer step per round on both");
    assert!(fast.steps < fast.batches, "rounds held several of the fast worker's batches");
    assert_eq!(results[0].1, results[1].1, "replicas diverged");
}

#[test]
fn the_admission_filter_gives_the_cluster_the_single_process_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let c = config_with(tmp.path(), "dlrm", &["embedding.admit_min_count=2"]);
    let single = sparrow_trainer::train(&c, true).expect("train");
    let cluster = train_local(&c, 3, 1).expect("cluster");
    assert!(single.table.not_admitted_lookups > 0 && single.table.admitted_keys > 0);
    assert_eq!(cluster.table, single.table, "each shard filtered its own keys the same way");
    assert_eq!(cluster.embedding_rows, single.embedding_rows);
    assert_eq!(cluster.test_auc.map(f64::to_bits), single.test_auc.map(f64::to_bits));
}

#[test]
fn ssd_shards_prefetch_queued_batches_and_train_the_same_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let memory = config_with(tmp.path(), "dlrm", &["train.batch_size=8"]);
    let ssd_dir = tmp.path().join("ssd");
    let ssd = config_with(
        tmp.path(),
        "dlrm",
        &[
            "train.batch_size=8",
            "embedding.storage=\"ssd\"",
            &format!("embedding.path=\"{}\"", ssd_dir.display()),
            "embedding.cache_capacity_rows=1024",
            "embedding.table_shards=4",
        ],
    );
    let single = sparrow_trainer::train(&memory, true).expect("train");
    let cluster = train_local(&ssd, 2, 1).expect("cluster");
    assert!(cluster.embedding_rows > 4 * 2 * 1024, "{} rows", cluster.embedding_rows);
    assert_eq!(cluster.embedding_rows, single.embedding_rows);
    assert_eq!(cluster.test_auc.map(f64::to_bits), single.test_auc.map(f64::to_bits));
    // Each shard staged a batch's rows when the loader queued it (S3.5).
    assert_eq!(cluster.table.lookup_misses_after_prefetch, Some(0));
    let hit = cluster.table.cache_hit_rate.expect("hit rate");
    assert!(hit > 0.0 && hit < 1.0, "hit rate {hit}");
    assert!(cluster.table.ssd_writebacks.expect("writebacks") > 0);
}

/// A cluster checkpoint keeps the shards' feature-filter state: every row's
/// last use (`ttl_steps`), the lookup clock and the admission counters, so a
/// resumed job (on any shard count) ages and admits keys where it stopped.
/// Written the way a job writes it: the worker, its updates pushed, meets the
/// coordinator, which has each shard write its part and commits the version.
#[test]
fn a_cluster_checkpoint_keeps_the_shards_filter_state() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 100, 9).expect("generate");
    let root = tmp.path().join("ck");
    let c = config_with(
        tmp.path(),
        "dlrm",
        &[
            "embedding.admit_min_count=3",
            "embedding.ttl_steps=200",
            &format!("checkpoint.dir={:?}", root.display().to_string()),
        ],
    );
    let layout = sparrow_data::DataLayout::from_config(&c.data);
    let servers: Vec<Arc<ShardServer>> = (0..2)
        .map(|i| Arc::new(ShardServer::new(i, shard_table(&c, i).expect("table")).for_generation(Generation(1), &c)))
        .collect();
    let shards: Vec<Arc<dyn ShardService>> = servers.iter().map(|s| s.clone() as Arc<dyn ShardService>).collect();
    let coordinator = Arc::new(
        sparrow_cluster::coordinator::Coordinator::new(&c, 2, 1)
            .expect("coordinator")
            .with_dialer(Arc::new(sparrow_cluster::coordinator::LocalShards(shards.clone()))),
    );
    let loader = LoaderServer::start_generation(&c, shards.clone(), Generation(1), None).expect("loader");
    let mut worker = sparrow_cluster::worker::new_worker_in(&c, &layout, 0, Generation(1)).expect("worker");
    worker.with_checkpoints(coordinator.clone(), root.clone(), None, false);
    worker.run_training(&loader, &shards).expect("train");
    let saved = worker.last_checkpoint().expect("the end of training is checkpointed").clone();
    assert_eq!(sparrow_trainer::checkpoint::resolve(&root).expect("LATEST"), saved);
    let (restored, _, _) = sparrow_trainer::checkpoint::load_trainer(&saved, &Overrides::none()).expect("load");

    let uses = |t: &EmbeddingTable| {
        let mut out = Vec::new();
        t.for_each_row(|key, last_use, _| {
            out.push((key, last_use));
            Ok(())
        })
        .expect("walk");
        out
    };
    let mut on_shards: Vec<(u64, u64)> = servers.iter().flat_map(|s| uses(s.table())).collect();
    on_shards.sort_unstable();
    let mut in_checkpoint = uses(&restored.table);
    in_checkpoint.sort_unstable();
    assert_eq!(in_checkpoint, on_shards, "every row with its last use");
    assert!(on_shards.iter().any(|&(_, used)| used > 1), "rows were used after the first lookup");

    let state = restored.table.filter_state();
    let shard_states: Vec<_> = servers.iter().map(|s| s.table().filter_state()).collect();
    assert_eq!(state.tick, shard_states.iter().map(|s| s.tick).max().expect("two shards"), "the later clock");
    // Per lock shard, each counter is the larger of the two shards'.
    for (i, sketch) in state.sketches.iter().enumerate() {
        for (j, &counter) in sketch.iter().enumerate() {
            let larger = shard_states.iter().map(|s| s.sketches[i][j]).max().expect("two shards");
            assert_eq!(counter, larger, "lock shard {i}, counter {j}");
        }
    }
    assert!(state.sketches.iter().flatten().any(|&c| c > 0), "keys were counted");
}

#[test]
fn rounds_and_lazy_aggregation_keep_replicas_identical_in_process() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 3000, 600, 9).expect("generate");
    let single = sparrow_trainer::train(&config(tmp.path(), "dlrm"), true).expect("train");
    // One worker in rounds: sequential training, the same AUC bit for bit.
    let one = train_local(&config_with(tmp.path(), "dlrm", &["cluster.sync=\"round\""]), 2, 1).expect("rounds");
    assert_eq!(one.test_auc.map(f64::to_bits), single.test_auc.map(f64::to_bits));
    // With batch norm the running statistics are merged with the weights.
    for (sync, norm) in [("round", "none"), ("lazy", "none"), ("round", "batch"), ("lazy", "batch")] {
        let settings = [format!("cluster.sync={sync:?}"), format!("model.norm={norm:?}")];
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        let three = train_local(&config_with(tmp.path(), "dlrm", &settings), 2, 3).expect("cluster");
        assert_eq!(three.train_rows, 3000, "{sync}, {norm}: every sample once");
        let sums = &three.dense_checksums;
        assert!(sums.windows(2).all(|w| w[0] == w[1]), "{sync}, {norm}: {sums:?}");
    }
}

/// `data.schema.dense_transform = "standardize"`: the job takes its first
/// pass once, before any role reads, and trains `train`'s model; so does a
/// bucketized column (`[[data.schema.buckets]]`, I5 also a field).
#[test]
fn standardized_and_bucketized_inputs_train_the_single_process_model_on_a_cluster() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate_days(tmp.path(), 2000, 400, 1, false, 9).expect("generate");
    let d = tmp.path().display();
    let dense: Vec<String> = (1..=13).map(|i| format!("\"I{i}\"")).collect();
    let sparse: Vec<String> = (1..=26).map(|i| format!("\"C{i}\"")).chain(["\"I5\"".to_string()]).collect();
    let text = format!(
        "[data]\nformat = \"csv\"\ntrain = \"{d}/train.csv\"\ntest = \"{d}/test.csv\"\n[data.schema]\n\
         dense = [{}]\nsparse = [{}]\ndense_transform = \"standardize\"\n\
         [[data.schema.buckets]]\ncolumn = \"I5\"\nboundaries = [1, 3, 10]\n[model]\nkind = \"dlrm\"\n\
         embedding_dim = 4\nhidden = [16]\nbottom_hidden = [8]\n[train]\nbatch_size = 128\nseed = 3\n",
        dense.join(","),
        sparse.join(",")
    );
    let c = Config::from_toml(&text, "test", &sparrow_core::Overrides::none()).expect("config");
    let single = sparrow_trainer::train(&c, true).expect("train");
    let cluster = train_local(&c, 2, 1).expect("cluster");
    assert_eq!(cluster.test_auc.map(f64::to_bits), single.test_auc.map(f64::to_bits));
    assert_eq!(cluster.embedding_rows, single.embedding_rows);
    let mut raw = c.clone();
    raw.data.schema.as_mut().expect("schema").dense_transform = sparrow_core::config::DenseTransform::None;
    assert_ne!(train_local(&raw, 2, 1).expect("cluster").test_auc, cluster.test_auc, "the statistics are applied");
}
