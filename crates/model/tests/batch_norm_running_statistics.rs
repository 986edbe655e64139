//! `model.norm = "batch"`: a training step normalizes by its batch and
//! moves the running statistics towards the batch's by the momentum (not
//! by the optimizer's rate or decay); scoring normalizes by the running
//! statistics, each row on its own.

use candle_core::Device;
use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind, ModelConfig, ModelKind, Norm};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};

fn values(model: &DenseModel, name: &str) -> Vec<f64> {
    let (_, var) = model.params.vars().iter().find(|(n, _)| n == name).expect("variable");
    var.as_tensor().to_vec1::<f32>().expect("values").into_iter().map(f64::from).collect()
}

/// An `mlp` of one hidden layer of 4, batch-normed with `momentum`, on 2 fields of dimension 3 and a dense value.
fn model(momentum: f32) -> DenseModel {
    let config = ModelConfig {
        kind: ModelKind::named("mlp"),
        embedding_dim: 3,
        hidden: vec![4],
        norm: Norm::Batch.into(),
        batch_norm_momentum: momentum,
        ..Default::default()
    };
    let shape = ModelShape { num_fields: 2, num_dense: 1, embedding_dim: 3 };
    DenseModel::new(&config, shape, 5, Device::Cpu, Default::default()).expect("model")
}

/// The `mlp` of [`model`]: the input row is the
/// fields' vectors then the dense value (7 values), the parameters
/// `[W₀ (7×4) | b₀ | γ | β | W₁ (4×1) | b₁]`.
#[test]
fn a_step_moves_the_running_statistics_by_the_momentum_and_scoring_takes_them() {
    let model = model(0.25);
    let (rows, input, hidden) = (6, 7, 4);
    assert_eq!(model.width() * 2 + 1, input);
    let mut rng = Rng::new(8);
    let emb: Vec<f32> = (0..rows * 6).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let dense: Vec<f32> = (0..rows).map(|_| rng.uniform(0.0, 3.0) as f32).collect();
    let labels: Vec<f32> = (0..rows).map(|i| (i % 2) as f32).collect();
    let row = |r: usize| -> Vec<f64> {
        emb[r * 6..r * 6 + 6].iter().chain(&dense[r..r + 1]).map(|&v| f64::from(v)).collect()
    };
    let pre_activation = |p: &[f64], r: usize| -> Vec<f64> {
        let x = row(r);
        (0..hidden).map(|c| (0..input).map(|i| x[i] * p[i * hidden + c]).sum::<f64>() + p[input * hidden + c]).collect()
    };
    // The batch's statistics by hand, from the weights the step read.
    let p = values(&model, "mlp.params");
    let z: Vec<Vec<f64>> = (0..rows).map(|r| pre_activation(&p, r)).collect();
    let mean: Vec<f64> = (0..hidden).map(|c| z.iter().map(|z| z[c]).sum::<f64>() / rows as f64).collect();
    let var: Vec<f64> =
        (0..hidden).map(|c| z.iter().map(|z| (z[c] - mean[c]).powi(2)).sum::<f64>() / (rows - 1) as f64).collect();
    assert_eq!(values(&model, "mlp.running"), [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], "mean 0, variance 1");

    // AdamW with a large decay: a statistic is neither stepped nor decayed.
    let optimizer = DenseOptimizerConfig { kind: DenseOptimizerKind::AdamW, weight_decay: 0.5, ..Default::default() };
    let mut optimizer = DenseOptimizer::new(optimizer, Default::default());
    let (_, grads) = model.forward_backward(emb.clone(), dense.clone(), &labels).expect("step");
    optimizer.apply(&model.params, grads).expect("apply");
    let running = values(&model, "mlp.running");
    for c in 0..hidden {
        let (want_mean, want_var) = (0.25 * mean[c], 0.75 + 0.25 * var[c]);
        assert!((running[c] - want_mean).abs() < 1e-5, "mean {c}: {} vs {want_mean}", running[c]);
        assert!((running[hidden + c] - want_var).abs() < 1e-5, "variance {c}: {} vs {want_var}", running[hidden + c]);
    }
    assert_ne!(values(&model, "mlp.params"), p, "the weights stepped");

    // Scoring: each row by the running statistics, on its own.
    let p = values(&model, "mlp.params");
    let (gamma, beta) = (&p[input * hidden + hidden..], &p[input * hidden + 2 * hidden..]);
    let (w1, b1) = (&p[input * hidden + 3 * hidden..], p[input * hidden + 4 * hidden]);
    let scores = model.predict(emb.clone(), dense.clone(), rows).expect("predict");
    for (r, &score) in scores.iter().enumerate() {
        let z = pre_activation(&p, r);
        let logit = (0..hidden)
            .map(|c| {
                let y = (z[c] - running[c]) / (running[hidden + c] + 1e-5).sqrt() * gamma[c] + beta[c];
                y.max(0.0) * w1[c]
            })
            .sum::<f64>()
            + b1;
        assert!((f64::from(score) - logit).abs() < 1e-5, "row {r}: {score} vs {logit}");
        let alone = model.predict(emb[r * 6..r * 6 + 6].to_vec(), dense[r..r + 1].to_vec(), 1).expect("predict");
        assert!((alone[0] - score).abs() < 1e-6, "row {r} alone: {} vs {score}", alone[0]);
    }
}

/// A cluster's every-step sync adds the workers' `flat_sum_terms` and takes
/// `from_flat_sum` over all their rows: a batch statistic comes out as the
/// row-weighted mean of the workers' batch statistics, so every replica
/// moves its running statistics by all the batches together.
#[test]
fn the_dense_sync_averages_the_workers_batch_statistics_by_their_rows() {
    let model = model(0.1);
    let running = model.params.vars().iter().position(|(n, _)| n == "mlp.running").expect("running");
    let mut rng = Rng::new(4);
    let mut batch = |rows: usize| {
        let emb: Vec<f32> = (0..rows * 6).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
        let dense: Vec<f32> = (0..rows).map(|_| rng.uniform(0.0, 3.0) as f32).collect();
        let labels: Vec<f32> = (0..rows).map(|i| (i % 2) as f32).collect();
        let (_, grads) = model.forward_backward(emb, dense, &labels).expect("step");
        grads
    };
    let (a, b) = (batch(6), batch(2));
    let (sa, sb) = (a.grads[running].clone().expect("a's statistics"), b.grads[running].clone().expect("b's"));
    let sum: Vec<f32> =
        a.flat_sum_terms(&model.params).iter().zip(b.flat_sum_terms(&model.params)).map(|(x, y)| x + y).collect();
    let combined = sparrow_model::DenseGrads::from_flat_sum(&model.params, &sum, 8);
    let got = combined.grads[running].as_ref().expect("combined statistics");
    for ((g, x), y) in got.iter().zip(&sa).zip(&sb) {
        let want = (6.0 * f64::from(*x) + 2.0 * f64::from(*y)) / 8.0;
        assert!((f64::from(*g) - want).abs() < 1e-5 * (1.0 + want.abs()), "{g} vs {want}");
    }
    assert_ne!(sa, sb, "two batches, two sets of statistics");
}
