//! `embedding.dtype = "f16" | "bf16"`: a table whose vectors are stored in
//! half precision trains exactly like f32 arithmetic that rounds the vector
//! once per update (nearest even), in memory and on the SSD tier alike, and
//! its rows take fewer bytes.

use std::collections::HashMap;

use sparrow_core::config::{CachePolicy, InitConfig, InitKind, Rounding};
use sparrow_embedding::table::SsdOptions;
use sparrow_embedding::{EmbeddingDtype, EmbeddingTable, Initializer, RowFormat, SparseOptimizer};

const DIM: usize = 5; // odd: the last word holds one coordinate and padding

fn init() -> Initializer {
    Initializer::new(InitConfig { kind: InitKind::Uniform, scale: 0.3 }, 11)
}

fn optimizers() -> [SparseOptimizer; 5] {
    [
        SparseOptimizer::Sgd { lr: 0.07 },
        SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 },
        SparseOptimizer::RowwiseAdagrad { lr: 0.05, eps: 1e-8 },
        SparseOptimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
        SparseOptimizer::Ftrl { alpha: 0.1, beta: 1.0, l1: 0.01, l2: 0.01 },
    ]
}

/// Batches of keys (with repeats) and a deterministic gradient per position.
fn batches() -> Vec<Vec<u64>> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..30)
        .map(|_| {
            (0..40)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 97
                })
                .collect()
        })
        .collect()
}

fn grad_of(key: u64, step: usize, d: usize) -> f32 {
    ((key as f32 * 0.37 + step as f32 * 1.3 + d as f32).sin()) * 0.5
}

/// What the lookups of a run read: (step, key, vector bits), sorted.
type Reads = Vec<(usize, u64, Vec<u32>)>;

/// Trains `table` and returns what every lookup read.
fn train(table: &EmbeddingTable) -> Reads {
    let mut read = Vec::new();
    for (step, keys) in batches().iter().enumerate() {
        let plan = table.plan(keys);
        let mut rows = vec![0.0; plan.num_unique() * DIM];
        let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
        let mut grads = vec![0.0; rows.len()];
        for (i, &k) in keys.iter().enumerate() {
            let u = plan.inverse[i] as usize;
            for d in 0..DIM {
                grads[u * DIM + d] += grad_of(k, step, d);
            }
        }
        table.apply_gradients_at(&plan, &slots, &grads).expect("update");
        let unique = &plan.unique;
        read.extend(unique.iter().enumerate().map(|(u, &k)| (step, k, bits(&rows[u * DIM..(u + 1) * DIM]))));
    }
    read.sort();
    read
}

/// The same steps in plain f32 arithmetic, rounding the vector after its
/// initialisation and after every update (with `stochastic`, its seed:
/// stochastically, the row's last word counting its updates): the table
/// must equal it bit for bit.
fn reference(opt: SparseOptimizer, format: RowFormat, stochastic: Option<u64>) -> (Reads, HashMap<u64, Vec<f32>>) {
    let mut rows: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut read = Vec::new();
    for (step, keys) in batches().iter().enumerate() {
        let mut unique: Vec<u64> = Vec::new();
        let mut summed: HashMap<u64, Vec<f32>> = HashMap::new();
        for &k in keys {
            if !summed.contains_key(&k) {
                unique.push(k);
            }
            let g = summed.entry(k).or_insert_with(|| vec![0.0; DIM]);
            for (d, g) in g.iter_mut().enumerate() {
                *g += grad_of(k, step, d);
            }
        }
        for &k in &unique {
            let row = rows.entry(k).or_insert_with(|| {
                let mut row = vec![0.0; format.logical_len()];
                let (w, state) = row.split_at_mut(DIM);
                init().fill(k, w);
                format.round(w);
                opt.init_state(w, state);
                row
            });
            read.push((step, k, bits(&row[..DIM])));
        }
        for &k in &unique {
            let row = rows.get_mut(&k).expect("row");
            let (w, state) = row.split_at_mut(DIM);
            match stochastic {
                Some(seed) => {
                    let (count, state) = state.split_last_mut().expect("the count word");
                    opt.apply(w, state, &summed[&k]);
                    format.round_stochastic(w, seed, k, count);
                }
                None => {
                    opt.apply(w, state, &summed[&k]);
                    format.round(w);
                }
            }
        }
    }
    read.sort();
    (read, rows)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn half_tables_equal_f32_arithmetic_rounded_once_per_update() {
    for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
        for opt in optimizers() {
            let table = EmbeddingTable::typed(DIM, dtype, opt, init(), 1);
            let read = train(&table);
            let (want_read, want_rows) = reference(opt, table.row_format(), None);
            assert_eq!(read, want_read, "{dtype:?} {}: lookups", opt.name());
            assert_eq!(table.len(), want_rows.len());
            for (k, row) in &want_rows {
                let got = table.get_row(*k).expect("row");
                assert_eq!(bits(&got), bits(row), "{dtype:?} {}: key {k}", opt.name());
            }
        }
    }
}

/// `embedding.rounding = "stochastic"`: a half table (one lock shard or
/// four) trains exactly like f32 arithmetic that rounds stochastically after
/// every update, with draws from the initializer's seed, the key and the
/// row's update count (one more word a row).
#[test]
fn stochastic_half_tables_equal_their_definition() {
    for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
        for opt in optimizers() {
            for shards in [1, 4] {
                let table = EmbeddingTable::typed(DIM, dtype, opt, init(), shards).with_rounding(Rounding::Stochastic);
                assert_eq!(table.row_len(), DIM + opt.state_len(DIM) + 1, "the update count's word");
                assert_eq!(table.stochastic_seed(), Some(init().seed));
                let read = train(&table);
                let (want_read, want_rows) = reference(opt, table.row_format(), Some(init().seed));
                assert_eq!(read, want_read, "{dtype:?} {} {shards} shards: lookups", opt.name());
                for (k, row) in &want_rows {
                    let got = table.get_row(*k).expect("row");
                    assert_eq!(bits(&got), bits(row), "{dtype:?} {}: key {k}", opt.name());
                }
                let nearest = reference(opt, EmbeddingTable::typed(DIM, dtype, opt, init(), 1).row_format(), None).0;
                assert_ne!(read, nearest, "{dtype:?} {}: stochastic rounding rounds otherwise", opt.name());
            }
        }
    }
}

/// Updates smaller than half a gap between stored values: rounding to
/// nearest loses every one (the row never moves), stochastic rounding keeps
/// them on average (SGD, a constant gradient: after n steps the row moved by
/// about n · lr · g).
#[test]
fn stochastic_rounding_keeps_updates_that_rounding_to_nearest_loses() {
    let (lr, g, steps) = (0.01f32, 0.03f32, 400usize);
    let zeros = Initializer::new(InitConfig { kind: InitKind::Zeros, scale: 0.0 }, 3);
    for dtype in [EmbeddingDtype::F16, EmbeddingDtype::Bf16] {
        let run = |rounding: Rounding| {
            let table =
                EmbeddingTable::typed(DIM, dtype, SparseOptimizer::Sgd { lr }, zeros, 1).with_rounding(rounding);
            let keys: Vec<u64> = (0..256).collect();
            let plan = table.plan(&keys);
            // Start every row at 1.0, where a step of lr·g = 3e-4 is below
            // half of f16's gap (2^-10 ≈ 9.8e-4) and of bf16's (2^-7).
            let mut rows = vec![0.0; keys.len() * DIM];
            let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
            table.apply_gradients_at(&plan, &slots, &vec![-1.0 / lr; rows.len()]).expect("to 1.0");
            for _ in 0..steps {
                let slots = table.lookup_or_insert(&plan, &mut rows).expect("lookup");
                table.apply_gradients_at(&plan, &slots, &vec![-g; rows.len()]).expect("update");
            }
            table.lookup_or_insert(&plan, &mut rows).expect("lookup");
            rows.iter().map(|&x| f64::from(x)).sum::<f64>() / rows.len() as f64
        };
        let want = 1.0 + f64::from(lr * g) * steps as f64;
        assert_eq!(run(Rounding::Nearest), 1.0, "{dtype:?}: to nearest, every update is lost");
        let mean = run(Rounding::Stochastic);
        assert!((mean - want).abs() < 0.05 * (want - 1.0), "{dtype:?}: mean {mean}, f32 arithmetic {want}");
    }
}

#[test]
fn the_ssd_tier_keeps_half_rows_bit_for_bit() {
    let cases = [EmbeddingDtype::F16, EmbeddingDtype::Bf16]
        .into_iter()
        .flat_map(|dtype| [(dtype, Rounding::Nearest), (dtype, Rounding::Stochastic)]);
    for (dtype, rounding) in cases {
        let opt = SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 };
        let memory = EmbeddingTable::typed(DIM, dtype, opt, init(), 4).with_rounding(rounding);
        let dir = tempfile::tempdir().expect("tmp");
        let ssd = SsdOptions { dir: dir.path().to_path_buf(), cache_capacity_rows: 8, policy: CachePolicy::Lru };
        let tiered =
            EmbeddingTable::typed(DIM, dtype, opt, init(), 4).with_rounding(rounding).with_ssd_tier(&ssd).expect("ssd");
        assert_eq!(train(&memory), train(&tiered), "{dtype:?}: lookups");
        assert!(tiered.tier_stats().expect("tier").writebacks > 0, "rows went through the store");
        let mut walked = Vec::new();
        tiered
            .for_each_row(|key, _, row| {
                walked.push((key, bits(row)));
                Ok(())
            })
            .expect("walk");
        assert_eq!(walked.len(), memory.len());
        for (key, row) in walked {
            assert_eq!(Some(row), memory.get_row(key).map(|r| bits(&r)), "{dtype:?}: key {key}");
        }
    }
}

#[test]
fn half_rows_take_fewer_bytes_and_a_row_put_back_reads_the_same() {
    let opt = SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 };
    let f32s = EmbeddingTable::typed(16, EmbeddingDtype::F32, opt, init(), 1);
    let f16s = EmbeddingTable::typed(16, EmbeddingDtype::F16, opt, init(), 1);
    // key + vector + Adagrad's per-coordinate state.
    assert_eq!(8 + f32s.row_format().stored_bytes(), 136);
    assert_eq!(8 + f16s.row_format().stored_bytes(), 104);
    // Row-wise Adagrad keeps one accumulator: 8 + 32 + 4 bytes in f16.
    let rowwise = SparseOptimizer::RowwiseAdagrad { lr: 0.05, eps: 1e-8 };
    let f16_rowwise = EmbeddingTable::typed(16, EmbeddingDtype::F16, rowwise, init(), 1);
    assert_eq!(8 + f16_rowwise.row_format().stored_bytes(), 44);
    let keys: Vec<u64> = (0..20_000).collect();
    for t in [&f32s, &f16s] {
        let plan = t.plan(&keys);
        let mut rows = vec![0.0; keys.len() * 16];
        t.lookup_or_insert(&plan, &mut rows).expect("lookup");
    }
    let ratio = f16s.allocated_bytes() as f64 / f32s.allocated_bytes() as f64;
    assert!(ratio < 0.85, "f16 table takes {ratio:.3} of f32's bytes");
    // A logical row put back (as a checkpoint restore does) reads the same.
    let row = f16s.get_row(7).expect("row");
    f16s.put_row(1_000_000, &row).expect("put");
    assert_eq!(f16s.get_row(1_000_000).map(|r| bits(&r)), Some(bits(&row)));
}
