//! Property test of the split path (S3.2–S3.7 across shards): for random
//! batches with duplicate keys and 1–5 shards, the loader's first dedup and
//! partition, the shards' second dedup and lookup, and the restore through
//! the inverse index give every key position its naive per-key row; pushing
//! the summed gradients updates each key once, as a naive per-key optimizer.

// The reference is written index by index, as the formulas are.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use sparrow_cluster::{Mode, ShardServer, ShardService};
use sparrow_core::config::{InitConfig, InitKind};
use sparrow_embedding::owner;
use sparrow_embedding::{EmbeddingTable, Initializer, KeyPlan, SparseOptimizer};

const DIM: usize = 3;

fn naive_apply(opt: &SparseOptimizer, w: &mut [f64], acc: &mut [f64], g: &[f64]) {
    match *opt {
        SparseOptimizer::Sgd { lr } => (0..DIM).for_each(|i| w[i] -= f64::from(lr) * g[i]),
        SparseOptimizer::Adagrad { lr, eps } => {
            for i in 0..DIM {
                acc[i] += g[i] * g[i];
                w[i] -= f64::from(lr) * g[i] / (acc[i].sqrt() + f64::from(eps));
            }
        }
        _ => unreachable!("only SGD and Adagrad are generated"),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 2e-4 + 2e-4 * b.abs()
}

type Batches = Vec<Vec<(u64, [f32; DIM])>>;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    #[test]
    fn pull_restore_push_equals_naive_per_key(
        adagrad: bool,
        lr in 0.01f32..0.5,
        shards in 1usize..6,
        batches in proptest::collection::vec(
            proptest::collection::vec((0u64..50, prop::array::uniform3(-1.0f32..1.0)), 1..80), 1..6),
    ) {
        let batches: Batches = batches;
        let opt = if adagrad { SparseOptimizer::Adagrad { lr, eps: 1e-8 } } else { SparseOptimizer::Sgd { lr } };
        let init = Initializer::new(InitConfig { kind: InitKind::Uniform, scale: 0.1 }, 5);
        let servers: Vec<Arc<ShardServer>> =
            (0..shards).map(|i| Arc::new(ShardServer::new(i, EmbeddingTable::new(DIM, opt, init, 2)))).collect();
        let mut naive: HashMap<u64, (Vec<f64>, Vec<f64>)> = HashMap::new();

        for (b, batch) in batches.iter().enumerate() {
            let id = b as u64;
            let keys: Vec<u64> = batch.iter().map(|(k, _)| *k).collect();
            // Loader: first dedup, partition by owner, each shard its keys.
            let plan = KeyPlan::new(&keys, shards, |k| owner(k, shards));
            for (s, server) in servers.iter().enumerate() {
                if !plan.shard_keys(s).is_empty() {
                    server.enqueue(id, plan.shard_keys(s).to_vec(), Mode::Train, None).expect("enqueue");
                }
            }
            // Worker: pull each shard's rows by batch id, restore every position.
            let mut unique_rows = Vec::new();
            for (s, server) in servers.iter().enumerate() {
                if !plan.shard_keys(s).is_empty() {
                    unique_rows.extend(server.pull(id).expect("pull"));
                }
            }
            prop_assert_eq!(unique_rows.len(), plan.num_unique() * DIM);
            let mut rows = Vec::new();
            plan.restore(&unique_rows, DIM, &mut rows);
            for (i, &k) in keys.iter().enumerate() {
                let (w, _) = naive.entry(k).or_insert_with(|| {
                    let mut w0 = [0.0f32; DIM];
                    init.fill(k, &mut w0);
                    (w0.iter().map(|&x| f64::from(x)).collect(), vec![0.0; DIM])
                });
                for d in 0..DIM {
                    prop_assert!(close(f64::from(rows[i * DIM + d]), w[d]), "key {} at {}: {} vs {}", k, i, rows[i * DIM + d], w[d]);
                }
            }
            // Backward: duplicates summed per unique key, pushed to the owners.
            let mut grads = vec![0.0f32; plan.num_unique() * DIM];
            for (i, (_, g)) in batch.iter().enumerate() {
                let u = plan.inverse[i] as usize;
                (0..DIM).for_each(|d| grads[u * DIM + d] += g[d]);
            }
            let mut rest = grads.as_slice();
            for (s, server) in servers.iter().enumerate() {
                let (mine, tail) = rest.split_at(plan.shard_keys(s).len() * DIM);
                rest = tail;
                if !mine.is_empty() {
                    server.push(id, mine.to_vec(), 1.0).expect("push");
                }
            }
            let mut summed: HashMap<u64, [f64; DIM]> = HashMap::new();
            for (k, g) in batch {
                let e = summed.entry(*k).or_insert([0.0; DIM]);
                (0..DIM).for_each(|d| e[d] += f64::from(g[d]));
            }
            for (k, g) in summed {
                let (w, acc) = naive.get_mut(&k).expect("seen");
                naive_apply(&opt, w, acc, &g);
            }
        }
        // Every key lives on its owner only, with the naive weights.
        for (k, (w, _)) in &naive {
            for (s, server) in servers.iter().enumerate() {
                let row = server.table().get_row(*k);
                prop_assert_eq!(row.is_some(), s == owner(*k, shards), "key {} on shard {}", k, s);
                if let Some(row) = row {
                    for d in 0..DIM {
                        prop_assert!(close(f64::from(row[d]), w[d]), "key {}: {} vs {}", k, row[d], w[d]);
                    }
                }
            }
        }
    }
}
