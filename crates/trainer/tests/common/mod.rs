#![allow(dead_code)]
//! Shared fixtures: a small generated data set and a small config.

use sparrow_core::Overrides;
use std::path::Path;

use sparrow_core::Config;

pub fn small_data(dir: &Path, train_rows: u64, test_rows: u64) {
    sparrow_data::synth::generate(dir, train_rows, test_rows, 5).expect("generate");
}

pub fn small_config(dir: &Path, kind: &str) -> Config {
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
        threads = 2
        seed = 3
        log_interval_steps = 5
        "#
    );
    Config::from_toml(&text, "test", &Overrides::none()).expect("config")
}

/// The model a run of `config` leaves in `dir`: its dense weights and every
/// row (key, then the row's stored floats, optimizer state included), by key.
pub fn trained_model(config: &Config, dir: &Path) -> (Vec<f32>, Vec<(u64, Vec<f32>)>) {
    let mut c = config.clone();
    c.checkpoint.dir = Some(dir.display().to_string());
    sparrow_trainer::train(&c, true).expect("train");
    let (t, _, _) = sparrow_trainer::checkpoint::load_trainer(dir, &Overrides::none()).expect("load");
    let mut rows = Vec::new();
    t.table
        .for_each_row(|k, _, r| {
            rows.push((k, r.to_vec()));
            Ok(())
        })
        .expect("rows");
    rows.sort_by_key(|r| r.0);
    (t.model.params.flat_values().expect("dense"), rows)
}
