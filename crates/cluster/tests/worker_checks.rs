//! A cluster worker checks its dense weights and optimizer moments every
//! `train.log_interval_steps`, as `sparrow train` does: an update that
//! overflowed is caught at the interval it happened, named, not a step
//! later as a non-finite loss.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use sparrow_cluster::shard::shard_table;
use sparrow_cluster::worker::new_worker;
use sparrow_cluster::{LoaderServer, ShardServer, ShardService};
use sparrow_core::{Config, Overrides};

fn config(dir: &std::path::Path, interval: u64) -> Config {
    let d = dir.display();
    let text = format!(
        "[data]\ntrain = \"{d}/train.tsv\"\n[model]\nkind = \"mlp\"\nembedding_dim = 4\nhidden = [16, 8]\n\
         [train]\nbatch_size = 128\nseed = 3\nlog_interval_steps = {interval}\n"
    );
    Config::from_toml(&text, "test", &Overrides::none()).expect("config")
}

#[test]
fn a_non_finite_weight_is_caught_at_the_log_interval_it_appeared() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 2000, 100, 13).expect("generate");
    for interval in [1u64, 1000] {
        let c = config(tmp.path(), interval);
        let layout = sparrow_data::DataLayout::from_config(&c.data);
        let shards: Vec<Arc<dyn ShardService>> = (0..2)
            .map(|i| Arc::new(ShardServer::new(i, shard_table(&c, i).expect("table"))) as Arc<dyn ShardService>)
            .collect();
        let loader = LoaderServer::start(&c, shards.clone()).expect("loader");
        let mut worker = new_worker(&c, &layout, 0).expect("worker");
        // A NaN in the first parameter's Adam moment: the first update makes
        // that parameter NaN while the first step's loss is still finite.
        let (name, var) = worker.model.params.vars().first().cloned().expect("a parameter");
        let state = HashMap::from([
            (format!("adam.m.{name}"), Tensor::full(f32::NAN, var.shape(), &Device::Cpu).expect("nan")),
            (format!("adam.v.{name}"), Tensor::zeros(var.shape(), DType::F32, &Device::Cpu).expect("zeros")),
        ]);
        worker.optimizer.load_state(&state, 0).expect("state");
        let err = worker.run_training(&loader, &shards).expect_err("non-finite").to_string();
        match interval {
            1 => assert!(err.contains("non-finite") && err.contains("at step 1") && err.contains(&name), "{err}"),
            _ => assert!(err.contains("non-finite") && err.contains("at step 2"), "without the check: {err}"),
        }
    }
}

/// The in-process cluster runs one generation, so it does not validate
/// (`launch` and the roles do, one epoch a generation): it says so, naming
/// the key, before it starts (rather than training without it).
#[test]
fn the_in_process_cluster_refuses_validation_and_early_stopping_by_key() {
    let tmp = tempfile::tempdir().expect("tmp");
    sparrow_data::synth::generate(tmp.path(), 500, 100, 13).expect("generate");
    let mut c = config(tmp.path(), 10);
    c.data.validation = Some(sparrow_core::config::ValidationSet::Fraction(0.1));
    let err = sparrow_cluster::train_local(&c, 1, 1).expect_err("refused").to_string();
    assert!(err.contains("data.validation") && err.contains("sparrow launch"), "{err}");
    c.checkpoint.dir = Some(tmp.path().join("ck").display().to_string());
    c.train.early_stopping = Some(Default::default());
    let err = sparrow_cluster::train_local(&c, 1, 1).expect_err("refused").to_string();
    assert!(err.contains("train.early_stopping"), "{err}");
}
