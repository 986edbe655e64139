//! The command line's closed sets of names, as clap `ValueEnum`s: clap
//! refuses any other value before a command runs, naming the flag and the
//! values it takes (`--help` lists them). Each maps onto the config's own
//! type; the names are the config's (`rowwise_adagrad`, `wide_deep`).

use clap::ValueEnum;
use sparrow_core::config::{CachePolicy, EmbeddingDtype, ModelKind, Rounding, SparseOptimizerKind, Storage};

/// `sparrow gen --format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GenFormat {
    /// train.tsv and test.tsv in Criteo's layout.
    Criteo,
    /// train.csv and test.csv with a header and a `ts` column.
    Csv,
}

/// What `sparrow export` writes (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// A serving export: `sparrow serve`, `predict --model`, Python.
    Serving,
    /// An ONNX graph (`model.onnx`) for ONNX Runtime and Triton.
    Onnx,
}

/// An embedding vector type (`export --dtype`, `bench --dtypes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl From<Dtype> for EmbeddingDtype {
    fn from(d: Dtype) -> EmbeddingDtype {
        match d {
            Dtype::F32 => EmbeddingDtype::F32,
            Dtype::F16 => EmbeddingDtype::F16,
            Dtype::Bf16 => EmbeddingDtype::Bf16,
        }
    }
}

/// `embedding.optimizer`'s names (`bench --optimizers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Optimizer {
    Sgd,
    Adagrad,
    #[value(name = "rowwise_adagrad")]
    RowwiseAdagrad,
    Adam,
    Ftrl,
}

impl From<Optimizer> for SparseOptimizerKind {
    fn from(o: Optimizer) -> SparseOptimizerKind {
        match o {
            Optimizer::Sgd => SparseOptimizerKind::Sgd,
            Optimizer::Adagrad => SparseOptimizerKind::Adagrad,
            Optimizer::RowwiseAdagrad => SparseOptimizerKind::RowwiseAdagrad,
            Optimizer::Adam => SparseOptimizerKind::Adam,
            Optimizer::Ftrl => SparseOptimizerKind::Ftrl,
        }
    }
}

/// `embedding.rounding`'s names (`bench --roundings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoundingArg {
    Nearest,
    Stochastic,
}

impl From<RoundingArg> for Rounding {
    fn from(r: RoundingArg) -> Rounding {
        match r {
            RoundingArg::Nearest => Rounding::Nearest,
            RoundingArg::Stochastic => Rounding::Stochastic,
        }
    }
}

/// A kind of the registry (`bench --kinds`): its name, or an error listing
/// the names there are.
pub fn model_kind(name: &str) -> Result<ModelKind, String> {
    let names = sparrow_model::kinds::names();
    if names.contains(&name) {
        Ok(ModelKind::named(name))
    } else {
        Err(format!("`{name}` is not a model kind; the kinds are {}", names.join(", ")))
    }
}

/// `embedding.storage`'s names (`bench-tier --storage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StorageArg {
    Memory,
    Ssd,
}

impl From<StorageArg> for Storage {
    fn from(s: StorageArg) -> Storage {
        match s {
            StorageArg::Memory => Storage::Memory,
            StorageArg::Ssd => Storage::Ssd,
        }
    }
}

/// `embedding.cache_policy`'s names (`bench-tier --policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    Lru,
    Lfu,
}

impl From<Policy> for CachePolicy {
    fn from(p: Policy) -> CachePolicy {
        match p {
            Policy::Lru => CachePolicy::Lru,
            Policy::Lfu => CachePolicy::Lfu,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name the command line takes is the config's name for the same
    /// value, and every config value has a name here.
    #[test]
    fn the_command_lines_names_are_the_configs() {
        let name = |v: &dyn Fn() -> Option<clap::builder::PossibleValue>| v().expect("named").get_name().to_string();
        assert_eq!(model_kind("wide_deep").expect("a kind").name(), "wide_deep");
        assert_eq!(model_kind("din").expect("a kind").name(), "din");
        let err = model_kind("transformer").expect_err("not a kind");
        assert!(err.contains("transformer") && err.contains("mmoe") && err.contains("dcn"), "{err}");
        for o in Optimizer::value_variants() {
            let config = serde_json::to_value(SparseOptimizerKind::from(*o)).expect("serializes");
            assert_eq!(config, serde_json::Value::from(name(&|| o.to_possible_value())));
        }
        for d in Dtype::value_variants() {
            let config = serde_json::to_value(EmbeddingDtype::from(*d)).expect("serializes");
            assert_eq!(config, serde_json::Value::from(name(&|| d.to_possible_value())));
        }
        for r in RoundingArg::value_variants() {
            let config = serde_json::to_value(Rounding::from(*r)).expect("serializes");
            assert_eq!(config, serde_json::Value::from(name(&|| r.to_possible_value())));
        }
        for s in StorageArg::value_variants() {
            let config = serde_json::to_value(Storage::from(*s)).expect("serializes");
            assert_eq!(config, serde_json::Value::from(name(&|| s.to_possible_value())));
        }
        for p in Policy::value_variants() {
            let config = serde_json::to_value(CachePolicy::from(*p)).expect("serializes");
            assert_eq!(config, serde_json::Value::from(name(&|| p.to_possible_value())));
        }
    }
}
