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
