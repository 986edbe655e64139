//! A step whose loss is finite but whose gradient at the embedding inputs
//! overflows is refused, naming that gradient, in both precisions: on a CPU
//! with AMX the bf16 MLP checks that gradient as its first layer's product
//! stores it (`amx::Out::Checked`) and the step skips its own pass, so the
//! flag the product sets is what stands between an infinity and the
//! embedding tables.

use candle_core::Device;
use sparrow_core::config::{ModelConfig, ModelKind, Precision, Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, Heads, ModelShape};

#[test]
fn an_overflowing_input_gradient_is_refused_in_both_precisions() {
    for precision in [Precision::F32, Precision::Bf16] {
        let config = ModelConfig {
            kind: ModelKind::named("mlp"),
            embedding_dim: 16,
            hidden: vec![256, 128],
            precision,
            ..Default::default()
        };
        let shape = ModelShape { num_fields: 4, num_dense: 1, embedding_dim: 16 };
        let heads = Heads::of(&[Task { name: "click".into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 }]);
        let model =
            DenseModel::with_attention(&config, shape, heads, &[], 5, Device::Cpu, Default::default()).expect("model");
        let rows = 64;
        let row = model.packed_row_len().expect("packed rows");
        let mut rng = Rng::new(3);
        // Tiny inputs, weights of about 1e13 and no biases: the logits stay
        // near 1e-30 · 1e39 · the layers' sums (a finite loss), while d x,
        // about 1e39 · those sums, overflows.
        let x: Vec<f32> = (0..rows * row).map(|_| 1e-30 * (0.5 + rng.next_f64() as f32)).collect();
        let labels: Vec<f32> = (0..rows).map(|r| (r % 2) as f32).collect();
        let step = |model: &DenseModel| {
            model.forward_backward_packed_with(&x, &labels, None, None, None, |g, _| g.iter().all(|v| v.is_finite()))
        };
        let (loss, _, finite, _) = step(&model).expect("a finite step at the initial weights");
        assert!(loss.is_finite() && finite, "{precision:?}: the initial step");
        // The MLP's one parameter: each layer's W (fan in × fan out), then its b.
        let layers = [(row, 256), (256, 128), (128, 1)];
        let [(_, var)] = model.params.vars() else { panic!("one parameter vector") };
        assert_eq!(var.elem_count(), layers.iter().map(|(i, o)| i * o + o).sum::<usize>());
        let mut weights = Vec::new();
        for (fan_in, fan_out) in layers {
            weights.extend((0..fan_in * fan_out).map(|_| 1e13 * (rng.next_f64() as f32 - 0.3)));
            weights.extend(std::iter::repeat_n(0.0f32, fan_out));
        }
        var.set(&candle_core::Tensor::from_vec(weights, var.shape(), &Device::Cpu).expect("weights")).expect("set");
        let Err(error) = step(&model).map(|(loss, ..)| loss) else {
            panic!("{precision:?}: a step whose input gradient is not finite went through");
        };
        let error = error.to_string();
        assert!(error.contains("gradient of the embedding inputs"), "{precision:?}: {error}");
    }
}
