//! Property test: for random batches (with duplicate keys) and shard counts,
//! the table's batch path (dedup → lookup → summed gradient → one update per
//! key) equals a naive per-key optimizer written straight from the formulas.

// The reference is written index by index, as the formulas are.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;

use proptest::prelude::*;
use sparrow_core::config::{InitConfig, InitKind};
use sparrow_embedding::{EmbeddingTable, Initializer, SparseOptimizer};

const DIM: usize = 3;

/// The formulas, in f64, one key at a time.
struct NaiveRow {
    w: Vec<f64>,
    s1: Vec<f64>,
    s2: Vec<f64>,
    t: f64,
}

fn naive_new(opt: &SparseOptimizer, w0: &[f32]) -> NaiveRow {
    let w: Vec<f64> = w0.iter().map(|&x| f64::from(x)).collect();
    let mut s1 = vec![0.0; DIM];
    if let SparseOptimizer::Ftrl { alpha, beta, l1, l2 } = *opt {
        // z such that the FTRL closed form gives back w (see init_state).
        for i in 0..DIM {
            let sign = if w[i] > 0.0 {
                1.0
            } else if w[i] < 0.0 {
                -1.0
            } else {
                0.0
            };
            s1[i] = -w[i] * (f64::from(beta) / f64::from(alpha) + f64::from(l2)) - sign * f64::from(l1);
        }
    }
    NaiveRow { w, s1, s2: vec![0.0; DIM], t: 0.0 }
}

fn naive_apply(opt: &SparseOptimizer, r: &mut NaiveRow, g: &[f64]) {
    match *opt {
        SparseOptimizer::Sgd { lr } => {
            for i in 0..DIM {
                r.w[i] -= f64::from(lr) * g[i];
            }
        }
        SparseOptimizer::Adagrad { lr, eps } => {
            for i in 0..DIM {
                r.s1[i] += g[i] * g[i];
                r.w[i] -= f64::from(lr) * g[i] / (r.s1[i].sqrt() + f64::from(eps));
            }
        }
        SparseOptimizer::RowwiseAdagrad { lr, eps } => {
            r.s1[0] += g.iter().map(|g| g * g).sum::<f64>() / DIM as f64;
            for i in 0..DIM {
                r.w[i] -= f64::from(lr) * g[i] / (r.s1[0].sqrt() + f64::from(eps));
            }
        }
        SparseOptimizer::Adam { lr, beta1, beta2, eps } => {
            let (b1, b2) = (f64::from(beta1), f64::from(beta2));
            r.t += 1.0;
            for i in 0..DIM {
                r.s1[i] = b1 * r.s1[i] + (1.0 - b1) * g[i];
                r.s2[i] = b2 * r.s2[i] + (1.0 - b2) * g[i] * g[i];
                let m = r.s1[i] / (1.0 - b1.powf(r.t));
                let v = r.s2[i] / (1.0 - b2.powf(r.t));
                r.w[i] -= f64::from(lr) * m / (v.sqrt() + f64::from(eps));
            }
        }
        SparseOptimizer::Ftrl { alpha, beta, l1, l2 } => {
            let (a, b, l1, l2) = (f64::from(alpha), f64::from(beta), f64::from(l1), f64::from(l2));
            for i in 0..DIM {
                let n_new = r.s2[i] + g[i] * g[i];
                let sigma = (n_new.sqrt() - r.s2[i].sqrt()) / a;
                r.s1[i] += g[i] - sigma * r.w[i];
                r.s2[i] = n_new;
                let z = r.s1[i];
                r.w[i] = if z.abs() <= l1 { 0.0 } else { -(z - z.signum() * l1) / ((b + n_new.sqrt()) / a + l2) };
            }
        }
    }
}

fn optimizers() -> impl Strategy<Value = SparseOptimizer> {
    prop_oneof![
        (0.01f32..0.5).prop_map(|lr| SparseOptimizer::Sgd { lr }),
        (0.01f32..0.5).prop_map(|lr| SparseOptimizer::Adagrad { lr, eps: 1e-8 }),
        (0.01f32..0.5).prop_map(|lr| SparseOptimizer::RowwiseAdagrad { lr, eps: 1e-8 }),
        (0.001f32..0.1).prop_map(|lr| SparseOptimizer::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
        (0.05f32..0.5, 0.0f32..0.05, 0.0f32..0.1)
            .prop_map(|(alpha, l1, l2)| { SparseOptimizer::Ftrl { alpha, beta: 1.0, l1, l2 } }),
    ]
}

type Batches = Vec<Vec<(u64, [f32; DIM])>>;

fn batches() -> impl Strategy<Value = Batches> {
    proptest::collection::vec(proptest::collection::vec((0u64..40, prop::array::uniform3(-1.0f32..1.0)), 1..60), 1..6)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 2e-4 + 2e-4 * b.abs()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn batch_path_equals_naive_optimizer(opt in optimizers(), batches in batches(), shard_pow in 0u32..4) {
        let init = Initializer::new(InitConfig { kind: InitKind::Uniform, scale: 0.1 }, 3);
        let table = EmbeddingTable::new(DIM, opt, init, 1 << shard_pow);
        let mut naive: HashMap<u64, NaiveRow> = HashMap::new();

        for batch in &batches {
            let keys: Vec<u64> = batch.iter().map(|(k, _)| *k).collect();
            let plan = table.plan(&keys);

            // Lookup restores every key's current weights.
            let mut unique_rows = vec![0.0f32; plan.num_unique() * DIM];
            let slots = table.lookup_or_insert(&plan, &mut unique_rows).expect("lookup");
            let mut rows = Vec::new();
            plan.restore(&unique_rows, DIM, &mut rows);
            for (i, &k) in keys.iter().enumerate() {
                let r = naive.entry(k).or_insert_with(|| {
                    let mut w0 = [0.0f32; DIM];
                    init.fill(k, &mut w0);
                    naive_new(&opt, &w0)
                });
                for d in 0..DIM {
                    prop_assert!(close(f64::from(rows[i * DIM + d]), r.w[d]), "lookup key {k}: {} vs {}", rows[i * DIM + d], r.w[d]);
                }
            }

            // Backward: sum duplicate gradients onto the unique keys, update once.
            let mut grads = vec![0.0f32; plan.num_unique() * DIM];
            for (i, (_, g)) in batch.iter().enumerate() {
                let u = plan.inverse[i] as usize;
                for d in 0..DIM {
                    grads[u * DIM + d] += g[d];
                }
            }
            table.apply_gradients_at(&plan, &slots, &grads).expect("update");

            let mut summed: HashMap<u64, [f64; DIM]> = HashMap::new();
            for (k, g) in batch {
                let s = summed.entry(*k).or_insert([0.0; DIM]);
                for d in 0..DIM {
                    s[d] += f64::from(g[d]);
                }
            }
            for (k, g) in &summed {
                naive_apply(&opt, naive.get_mut(k).expect("seen"), g);
            }
        }

        prop_assert_eq!(table.len(), naive.len());
        for (k, r) in &naive {
            let row = table.get_row(*k).expect("row present");
            for d in 0..DIM {
                prop_assert!(close(f64::from(row[d]), r.w[d]), "{}: key {k} dim {d}: {} vs {}", opt.name(), row[d], r.w[d]);
            }
        }
    }
}
