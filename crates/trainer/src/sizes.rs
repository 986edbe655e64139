//! Sizes checked against the machine before anything is allocated: a config
//! asking for more memory than the machine has fails naming the key, instead
//! of aborting on an allocation (exit 134) or being killed.

use sparrow_core::config::{ModelConfig, Storage};
use sparrow_core::{Config, ConfigError};
use sparrow_data::DataLayout;
use sparrow_model::ModelShape;
use sparrow_model::kinds::{self, Kind};

/// Bytes of memory this machine has (`MemTotal`), if the kernel says.
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

fn shape(config: &Config, layout: &DataLayout) -> ModelShape {
    ModelShape { num_fields: layout.num_fields, num_dense: layout.num_dense, embedding_dim: config.model.embedding_dim }
}

/// Dense parameters of the configured model (weights and biases), as its kind counts them.
fn dense_params(kind: &dyn Kind, config: &Config, layout: &DataLayout) -> u128 {
    kind.dense_params(config, shape(config, layout))
}

/// The dense model in memory: weights, gradient and two Adam moments.
fn dense_bytes(kind: &dyn Kind, config: &Config, layout: &DataLayout) -> u128 {
    dense_params(kind, config, layout) * 4 * 4
}

/// The key that makes the dense model large: the one whose default would
/// shrink it most.
fn dense_culprit(kind: &dyn Kind, config: &Config, layout: &DataLayout) -> &'static str {
    /// Sets one key back to its default.
    type Reset = fn(&mut Config);
    // Every key a kind's dense parameters grow with: a key no candidate
    // names ties them all, and the first was named in its place.
    let candidates: [(&'static str, Reset); 10] = [
        ("model.embedding_dim", |c| c.model.embedding_dim = ModelConfig::default().embedding_dim),
        ("model.hidden", |c| c.model.hidden = ModelConfig::default().hidden),
        ("model.cross_layers", |c| c.model.cross_layers = ModelConfig::default().cross_layers),
        ("model.bottom_hidden", |c| c.model.bottom_hidden = ModelConfig::default().bottom_hidden),
        ("model.experts", |c| c.model.experts = ModelConfig::default().experts),
        ("model.expert_hidden", |c| c.model.expert_hidden = ModelConfig::default().expert_hidden),
        ("model.task_experts", |c| c.model.task_experts = ModelConfig::default().task_experts),
        ("model.levels", |c| c.model.levels = ModelConfig::default().levels),
        ("model.tower_hidden", |c| c.model.tower_hidden = ModelConfig::default().tower_hidden),
        ("model.attention_hidden", |c| c.model.attention_hidden = ModelConfig::default().attention_hidden),
    ];
    candidates
        .iter()
        .map(|(key, reset)| {
            let mut c = config.clone();
            reset(&mut c);
            (*key, dense_bytes(kind, &c, layout))
        })
        .min_by_key(|&(_, bytes)| bytes)
        .map_or("model.hidden", |(key, _)| key)
}

/// What each key asks for, in bytes (rough, on the low side: an estimate
/// that is too large must be far too large).
fn estimates(kind: &dyn Kind, config: &Config, layout: &DataLayout) -> Vec<(&'static str, u128)> {
    let m = &config.model;
    let f = layout.num_fields as u128;
    let w = kind.embedding_width(m.embedding_dim) as u128;
    let batch = config.train.batch_size as u128;
    let widest = m.hidden.iter().chain(&m.bottom_hidden).copied().max().unwrap_or(1) as u128;
    // A parsed batch: a key, an inverse index and an offset per field, the
    // dense values and the label per row.
    let raw_batch = batch * (f * 16 + layout.num_dense as u128 * 4 + 4);
    // The step: pooled rows and their gradients, the widest layer's
    // activations and gradients, what else the kind keeps a row (DCN-v2's cross input,
    // the multi-task kinds' experts and towers, DIN's attention a history item).
    let step = batch * 4 * (2 * f * w + 2 * widest + kind.step_floats_per_row(config, shape(config, layout)));
    let mut out = vec![
        (dense_culprit(kind, config, layout), dense_bytes(kind, config, layout)),
        ("train.batch_size", raw_batch + step),
        ("data.prefetch_batches", 2 * config.data.prefetch_batches as u128 * raw_batch),
        // A lock shard's bookkeeping, before any row.
        ("embedding.table_shards", config.embedding.table_shards as u128 * 256),
        ("embedding.admit_sketch_counters", config.embedding.admit_sketch_counters as u128),
    ];
    if config.embedding.storage == Storage::Ssd {
        let row = (w * 2 + 2) * 4 + 64;
        out.push(("embedding.cache_capacity_rows", config.embedding.cache_capacity_rows as u128 * row));
    }
    out
}

fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Refuses a config one of whose sizes alone needs more than `memory` bytes,
/// naming the key (the first in the order above whose share is too large:
/// the dense model's key before the batch's, which every size grows with).
pub fn check_against(config: &Config, layout: &DataLayout, memory: u64) -> Result<(), ConfigError> {
    let all = estimates(kinds::configured(config)?, config, layout);
    let total: u128 = all.iter().map(|e| e.1).sum();
    let too_large = |bytes: u128| bytes > u128::from(memory) || (total > u128::from(memory) && bytes * 2 > total);
    match all.iter().find(|(_, bytes)| too_large(*bytes)) {
        Some((key, bytes)) => Err(ConfigError::Invalid {
            key: key.to_string(),
            message: format!(
                "too large: this job would need about {} for it, and this machine has {}",
                gib(*bytes),
                gib(u128::from(memory))
            ),
        }),
        None => Ok(()),
    }
}

/// [`check_against`] this machine's memory (no check where it is unknown).
pub fn check(config: &Config, layout: &DataLayout) -> Result<(), ConfigError> {
    match machine_memory_bytes() {
        Some(memory) => check_against(config, layout, memory),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::Overrides;

    fn config(sets: &[&str]) -> Config {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Overrides::parse(&sets).and_then(|o| Config::from_toml("", "test", &o)).expect("config")
    }

    /// Sizes past the machine (set on the struct: the config's own upper
    /// bounds refuse most of these first, this check stands behind them).
    #[test]
    fn sizes_beyond_the_machine_are_refused_naming_the_key() {
        let layout = DataLayout { num_fields: 26, num_dense: 13, weighted: false, num_tasks: 1 };
        let memory = 24 << 30;
        check_against(&config(&[]), &layout, memory).expect("the defaults fit");
        type Set = fn(&mut Config);
        let cases: [(Set, &str); 6] = [
            (|c| c.train.batch_size = 1_000_000_000, "train.batch_size"),
            (|c| c.data.prefetch_batches = 1_000_000_000, "data.prefetch_batches"),
            (|c| c.embedding.table_shards = 1 << 30, "embedding.table_shards"),
            (|c| c.model.hidden = vec![100_000, 100_000], "model.hidden"),
            (|c| c.embedding.admit_sketch_counters = 100_000_000_000, "embedding.admit_sketch_counters"),
            (
                |c| {
                    c.model.kind = sparrow_core::config::ModelKind::named("dcn");
                    c.model.cross_layers = 100_000;
                },
                "model.cross_layers",
            ),
        ];
        for (set, key) in cases {
            let mut c = config(&[]);
            set(&mut c);
            let err = check_against(&c, &layout, memory).expect_err(key);
            assert!(err.to_string().contains(key), "{key}: {err}");
        }
        // Within the config's bounds and still past the machine.
        let dcn = config(&["model.kind=dcn", "model.cross_layers=64", "model.embedding_dim=4096"]);
        check_against(&dcn, &layout, memory).expect_err("cross layers of 26 × 4096 inputs");
        // Large but possible: a batch of 65536 rows.
        check_against(&config(&["train.batch_size=65536"]), &layout, memory).expect("fits");
    }

    /// The multi-task and sequence kinds' own keys, each named where it
    /// alone makes the model too large: each was named `model.hidden` or
    /// `model.cross_layers`, keys these kinds do not read. And their steps'
    /// activations, which grow with the batch: MMoE's and ESMM's batches
    /// refused here were killed by the kernel for memory on a 24 GiB
    /// machine (DIN's, estimated at 294 GiB, was not run); PLE's and 8 experts of
    /// MMoE's, let through, trained in 13.7 and 5.9 GB.
    #[test]
    fn the_kinds_own_keys_are_named_when_too_large() {
        const TWO_TASKS: &str = r#"
            [data]
            format = "csv"
            [data.schema]
            labels = ["click", "conversion"]
            sparse = ["user", "item"]
            multi_hot_separator = "|"
            sequence = [{ field = "history", table = "item", max_len = 20 }]
            [[model.tasks]]
            name = "click"
            [[model.tasks]]
            name = "conversion"
        "#;
        let cases: [(&str, &str, &str); 11] = [
            ("mmoe", "model.expert_hidden=[60000]", "model.expert_hidden"),
            ("mmoe", "model.tower_hidden=[100000,100000]", "model.tower_hidden"),
            ("ple", "model.expert_hidden=[100000]", "model.expert_hidden"),
            ("esmm", "model.tower_hidden=[100000,100000]", "model.tower_hidden"),
            ("din", "model.attention_hidden=[100000,100000]", "model.attention_hidden"),
            ("mmoe", "model.experts=64 model.expert_hidden=[1024] train.batch_size=65536", "train.batch_size"),
            ("esmm", "model.tower_hidden=[20000] train.batch_size=65536", "train.batch_size"),
            ("din", "model.attention_hidden=[20000] train.batch_size=65536", "train.batch_size"),
            // Large but possible.
            ("ple", "model.levels=64", ""),
            ("ple", "model.expert_hidden=[1024] train.batch_size=65536", ""),
            ("mmoe", "model.experts=8 model.expert_hidden=[1024] train.batch_size=65536", ""),
        ];
        for (kind, set, key) in cases {
            let mut sets = vec![format!("model.kind=\"{kind}\"")];
            sets.extend(set.split(' ').map(String::from));
            let c = Overrides::parse(&sets).and_then(|o| Config::from_toml(TWO_TASKS, "test", &o)).expect(set);
            let layout = DataLayout::from_config(&c.data);
            let checked = check_against(&c, &layout, 24 << 30);
            match key {
                "" => checked.expect(set),
                key => {
                    let err = checked.expect_err(set).to_string();
                    assert!(err.starts_with(&format!("config: {key}: too large")), "{kind} {set}: {err}");
                }
            }
        }
    }

    /// An unknown kind is refused here (before any allocation) naming
    /// `model.kind` once, as every other entry says it.
    #[test]
    fn an_unknown_kind_is_refused_naming_the_key_once() {
        let c = config(&["model.kind=\"transformer\""]);
        let layout = DataLayout::from_config(&c.data);
        let err = check_against(&c, &layout, u64::MAX).expect_err("unknown").to_string();
        assert!(err.starts_with("config: model.kind: \"transformer\" is not a kind; the kinds are lr, "), "{err}");
    }
}
