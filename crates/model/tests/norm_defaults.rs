//! `model.norm = "auto"` (the default): each kind's own norm, batch norm in
//! DIN's MLP (not its attention unit) and none elsewhere; a norm written
//! out is every kind's.

use candle_core::Device;
use sparrow_core::config::{ModelConfig, ModelKind, Norm, NormSetting};
use sparrow_model::kinds::stack_style;
use sparrow_model::spec::NetSpec;
use sparrow_model::{DenseModel, Heads, ModelShape};

fn kind(name: &str, norm: NormSetting) -> ModelConfig {
    ModelConfig { kind: ModelKind::named(name), norm, ..Default::default() }
}

#[test]
fn auto_is_batch_norm_for_din_and_none_for_every_other_kind() {
    for name in sparrow_model::kinds::names() {
        let expected = if name == "din" { Norm::Batch } else { Norm::None };
        assert_eq!(stack_style(&kind(name, NormSetting::Auto)).norm, expected, "{name}");
        // Written out, the setting is the kind's whatever it is.
        assert_eq!(stack_style(&kind(name, NormSetting::None)).norm, Norm::None, "{name}");
        assert_eq!(stack_style(&kind(name, NormSetting::Layer)).norm, Norm::Layer, "{name}");
        assert_eq!(stack_style(&kind(name, NormSetting::Batch)).norm, Norm::Batch, "{name}");
    }
    assert_eq!(ModelConfig::default().norm, NormSetting::Auto);
}

#[test]
fn a_din_built_from_the_defaults_batch_norms_its_mlp_and_not_its_attention_unit() {
    let din = |norm| {
        let config = ModelConfig { hidden: vec![8, 5], attention_hidden: vec![6], ..kind("din", norm) };
        let shape = ModelShape { num_fields: 3, num_dense: 1, embedding_dim: 4 };
        let heads = Heads::of(&[]);
        let model = DenseModel::with_attention(&config, shape, heads, &[(2, 0)], 1, Device::Cpu, Default::default())
            .expect("din");
        match model.spec().expect("spec") {
            NetSpec::Din { units, mlp, .. } => (units, mlp),
            other => panic!("a din's spec: {other:?}"),
        }
    };
    let (units, mlp) = din(NormSetting::Auto);
    let hidden: Vec<_> = mlp.iter().filter(|l| l.activation.is_some()).collect();
    assert_eq!(hidden.len(), 2);
    assert!(
        hidden.iter().all(|l| l.norm.as_ref().is_some_and(|n| n.running.is_some())),
        "each hidden layer of the MLP is batch-normed, with running statistics"
    );
    assert!(units.iter().flatten().all(|l| l.norm.is_none()), "the attention unit is not normed");
    let (_, plain) = din(NormSetting::None);
    assert!(plain.iter().all(|l| l.norm.is_none()), "`none` written out keeps DIN's MLP plain");
}

/// A batch of one row under batch statistics (batch norm, DIN's default;
/// Dice) is refused naming `train.batch_size` and the setting behind it:
/// one row's variance is 0, and a model trained so evaluated at a
/// log-loss in the hundreds without a word.
#[test]
fn a_batch_of_one_row_is_refused_where_a_layer_normalizes_by_the_batch() {
    let config = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let overrides = sparrow_core::Overrides::parse(&sets).expect("overrides");
        // A behaviour job, as DIN needs one (its attention's sequence).
        let job = "[data]\nformat = \"csv\"\n[data.schema]\nlabels = [\"click\"]\n\
                   sparse = [\"user_id\", \"item_id\"]\nmulti_hot_separator = \"|\"\n\
                   sequence = [{ field = \"hist\", table = \"item_id\", max_len = 5 }]\n";
        sparrow_core::Config::from_toml(job, "test", &overrides).expect("config")
    };
    let refused = [
        (&["model.kind=\"din\"", "train.batch_size=1"][..], "model.norm = \"auto\" (batch norm for din)"),
        (&["model.norm=\"batch\"", "train.batch_size=1"][..], "model.norm = \"batch\""),
        (&["model.kind=\"mmoe\"", "model.activation=\"dice\"", "train.batch_size=1"][..], "model.activation"),
    ];
    for (sets, named) in refused {
        let err = sparrow_model::kinds::check(&config(sets)).expect_err("a batch of one row").to_string();
        assert!(err.contains("train.batch_size") && err.contains(named), "{sets:?}: {err}");
    }
    // Two rows, or no batch statistics, or a kind without MLP stacks: trained.
    for sets in [
        &["model.kind=\"din\"", "train.batch_size=2"][..],
        &["model.kind=\"din\"", "model.norm=\"layer\"", "train.batch_size=1"][..],
        &["model.norm=\"batch\"", "model.kind=\"lr\"", "train.batch_size=1"][..],
        &["train.batch_size=1"][..],
    ] {
        sparrow_model::kinds::check(&config(sets)).unwrap_or_else(|e| panic!("{sets:?}: {e}"));
    }
}
