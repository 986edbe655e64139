//! For every model kind, the gradient handed back to the embedding store
//! equals the finite-difference derivative of the mean logistic loss.

use candle_core::Device;
use sparrow_core::config::{DenseOptimizerConfig, ModelConfig, ModelKind, Precision};
use sparrow_core::metrics::logistic_loss;
use sparrow_core::rng::Rng;
use sparrow_model::kinds::{self, Family};
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};

/// Every one-task kind of the registry: a new kind is checked here by being registered.
fn one_task_kinds() -> Vec<ModelKind> {
    kinds::of_family(Family::OneTask).map(|k| ModelKind::named(k.name())).collect()
}

fn mean_loss(model: &DenseModel, emb: &[f32], dense: &[f32], labels: &[f32]) -> f64 {
    let logits = model.predict(emb.to_vec(), dense.to_vec(), labels.len()).expect("forward");
    logits.iter().zip(labels).map(|(&x, &y)| logistic_loss(f64::from(x), f64::from(y))).sum::<f64>()
        / labels.len() as f64
}

/// A small model of each kind: DLRM's bottom MLP of 6, two DCN-v2 cross layers.
fn config(kind: ModelKind, embedding_dim: usize, hidden: &[usize], precision: Precision) -> ModelConfig {
    ModelConfig {
        kind,
        embedding_dim,
        hidden: hidden.to_vec(),
        bottom_hidden: vec![6],
        cross_layers: 2,
        precision,
        ..Default::default()
    }
}

#[test]
fn embedding_gradient_is_exact_for_every_model() {
    let shape = ModelShape { num_fields: 3, num_dense: 2, embedding_dim: 4 };
    for kind in one_task_kinds() {
        let model = DenseModel::new(
            &config(kind.clone(), 4, &[8, 5], Precision::F32),
            shape,
            11,
            Device::Cpu,
            sparrow_core::simd::Simd::Auto,
        )
        .expect("model");
        let width = model.width();
        let rows = 5;
        let mut rng = Rng::new(3);
        let emb: Vec<f32> = (0..rows * 3 * width).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let dense: Vec<f32> = (0..rows * 2).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
        let labels: Vec<f32> = (0..rows).map(|i| (i % 2) as f32).collect();

        // No optimizer step: the weights stay fixed while we probe them.
        let (out, _) = model.forward_backward(emb.clone(), dense.clone(), &labels).expect("step");
        assert!((out.loss - mean_loss(&model, &emb, &dense, &labels)).abs() < 1e-5, "{kind}: loss");
        assert!(out.emb_grad.iter().any(|&g| g != 0.0), "{kind}: gradient is all zero");

        // The packed step (a kind with a direct CPU step) hands back d loss
        // / d input rows `[embeddings | dense values]`: its dense part, too,
        // is the derivative.
        if model.packed_row_len().is_some() {
            check_packed_dense_gradient(&model, (&emb, &dense, &labels), &out.emb_grad, &kind);
        }
        let h = 1e-2f32;
        for i in (0..emb.len()).step_by(3) {
            let (mut plus, mut minus) = (emb.clone(), emb.clone());
            plus[i] += h;
            minus[i] -= h;
            let numeric = (mean_loss(&model, &plus, &dense, &labels) - mean_loss(&model, &minus, &dense, &labels))
                / (2.0 * f64::from(h));
            let analytic = f64::from(out.emb_grad[i]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{kind}: d loss / d emb[{i}] = {analytic} analytically, {numeric} numerically"
            );
        }
    }
}

#[test]
fn loss_is_finite_when_logits_saturate() {
    let shape = ModelShape { num_fields: 2, num_dense: 0, embedding_dim: 1 };
    let config = ModelConfig { kind: ModelKind::named("lr"), embedding_dim: 1, ..Default::default() };
    let model = DenseModel::new(&config, shape, 1, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
    // Huge first-order weights push the logit to ±1e4: σ saturates in f32.
    let emb = vec![5e3f32, 5e3, -5e3, -5e3];
    let (out, _) = model.forward_backward(emb, vec![], &[0.0, 1.0]).expect("step");
    assert!(out.loss.is_finite() && out.loss > 1e3, "loss {}", out.loss);
    assert!(out.emb_grad.iter().all(|g| g.is_finite()));
}

/// Every kind's direct CPU step equals its candle graph (values, gradients
/// and the weights after two optimizer steps), in both precisions, with and
/// without dense features (DLRM without them has no bottom MLP), and with
/// each `model.norm` (batch norm's running statistics included).
#[test]
fn direct_path_equals_autograd_path_for_every_model() {
    use sparrow_core::config::{Activation, Norm};
    let relu = Activation::Relu;
    for (kind, precision, num_dense, (norm, activation)) in one_task_kinds().into_iter().flat_map(|k| {
        [
            (k.clone(), Precision::F32, 3, (Norm::None, relu)),
            (k.clone(), Precision::Bf16, 3, (Norm::None, relu)),
            (k.clone(), Precision::F32, 0, (Norm::None, relu)),
            (k.clone(), Precision::F32, 3, (Norm::Layer, relu)),
            (k.clone(), Precision::F32, 3, (Norm::Batch, relu)),
            (k.clone(), Precision::Bf16, 3, (Norm::Batch, relu)),
            (k.clone(), Precision::F32, 3, (Norm::None, Activation::Prelu)),
            (k.clone(), Precision::F32, 3, (Norm::Layer, Activation::Gelu)),
            (k.clone(), Precision::Bf16, 3, (Norm::None, Activation::Silu)),
            (k, Precision::F32, 3, (Norm::Batch, Activation::Dice)),
        ]
    }) {
        let shape = ModelShape { num_fields: 4, num_dense, embedding_dim: 5 };
        let config = ModelConfig { norm: norm.into(), activation, ..config(kind.clone(), 5, &[16, 8], precision) };
        let what = format!("{kind} {precision:?} with {num_dense} dense, norm {norm:?}, {activation:?}");
        let direct = DenseModel::new(&config, shape, 21, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
        let graph = DenseModel::new(&config, shape, 21, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
        let (mut opt_d, mut opt_g) = (
            DenseOptimizer::new(DenseOptimizerConfig::default(), sparrow_core::simd::Simd::Auto),
            DenseOptimizer::new(DenseOptimizerConfig::default(), sparrow_core::simd::Simd::Auto),
        );
        let mut rng = Rng::new(9);
        let rows = 6;
        let width = direct.width();
        for _ in 0..2 {
            let emb: Vec<f32> = (0..rows * 4 * width).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
            let dense: Vec<f32> = (0..rows * num_dense).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
            let labels: Vec<f32> = (0..rows).map(|i| (i % 3 == 0) as u8 as f32).collect();
            let (a, grads_a) = direct.forward_backward(emb.clone(), dense.clone(), &labels).expect("direct");
            let (b, grads_b) = graph.forward_backward_autograd(emb.clone(), dense.clone(), &labels).expect("autograd");
            // Predict normalizes by the running statistics, not the batch's.
            let predicted = direct.predict(emb, dense, rows).expect("predict");
            // (Batch norm and Dice: by their running statistics.)
            assert_eq!(predicted == a.logits, !direct.params.has_statistics(), "{what}: predict");
            assert!((a.loss - b.loss).abs() < 1e-6, "{what}: loss");
            assert_eq!(a.emb_grad.len(), b.emb_grad.len());
            for (x, y) in a.logits.iter().zip(&b.logits).chain(a.emb_grad.iter().zip(&b.emb_grad)) {
                assert!((x - y).abs() < 1e-5, "{what}: {x} vs {y}");
            }
            for (ga, gb) in grads_a.grads.iter().zip(&grads_b.grads) {
                let (ga, gb) = (ga.as_ref().expect("direct gradient"), gb.as_ref().expect("graph gradient"));
                assert_eq!(ga.len(), gb.len(), "{what}");
                for (x, y) in ga.iter().zip(gb) {
                    assert!((x - y).abs() < 1e-5, "{what}: dense gradient {x} vs {y}");
                }
            }
            opt_d.apply(&direct.params, grads_a).expect("step");
            opt_g.apply(&graph.params, grads_b).expect("step");
        }
        for ((_, v), (_, w)) in direct.params.vars().iter().zip(graph.params.vars()) {
            let (v, w) =
                (v.flatten_all().and_then(|t| t.to_vec1::<f32>()), w.flatten_all().and_then(|t| t.to_vec1::<f32>()));
            for (x, y) in v.expect("v").iter().zip(&w.expect("w")) {
                assert!((x - y).abs() < 1e-5, "{what}: weights after two steps: {x} vs {y}");
            }
        }
    }
}

/// `[data.weighting]`: each sample's loss times its weight, over the row
/// count. A sample of weight 0 contributes nothing; the weighted gradient of
/// the batch is the weighted sum of the single-row gradients (every model).
#[test]
fn sample_weights_scale_each_rows_loss_and_gradient() {
    let shape = ModelShape { num_fields: 2, num_dense: 1, embedding_dim: 4 };
    for kind in one_task_kinds() {
        let config = ModelConfig {
            kind: kind.clone(),
            embedding_dim: 4,
            hidden: vec![6],
            bottom_hidden: vec![4],
            ..Default::default()
        };
        let model = DenseModel::new(&config, shape, 5, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
        let width = model.width();
        let mut rng = Rng::new(9);
        let emb: Vec<f32> = (0..2 * 2 * width).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let dense = vec![0.3f32, 1.1];
        let labels = [1.0f32, 0.0];
        let weights = [0.25f32, 0.0];
        let (weighted, _) =
            model.forward_backward_weighted(emb.clone(), dense.clone(), &labels, Some(&weights)).expect("step");
        let (plain, _) = model.forward_backward(emb.clone(), dense.clone(), &labels).expect("step");
        // Row 0 alone, as a batch of one: its loss is 2 × its share of the batch of two.
        let row = 2 * width;
        let (alone, _) = model.forward_backward(emb[..row].to_vec(), dense[..1].to_vec(), &labels[..1]).expect("row");
        assert!((weighted.loss - 0.25 * alone.loss / 2.0).abs() < 1e-6, "{kind}: {} vs {}", weighted.loss, alone.loss);
        for i in 0..row {
            let expect = 0.25 * alone.emb_grad[i] / 2.0;
            assert!((weighted.emb_grad[i] - expect).abs() < 1e-6, "{kind}: row 0 gradient {i}");
        }
        assert!(weighted.emb_grad[row..].iter().all(|&g| g == 0.0), "{kind}: a weight of 0 contributes nothing");
        assert_ne!(weighted.loss, plain.loss);
    }
}

/// Several tasks on one body (a binary, a masked binary, a multiclass head,
/// weighted): for every kind with a deep part, and MMoE, PLE and ESMM
/// (ESMM: the two binary tasks), the embedding gradient is
/// the finite-difference derivative of the summed, masked, weighted loss,
/// and the dense weights' gradients are too.
#[test]
fn embedding_gradient_is_exact_with_several_heads() {
    use sparrow_core::config::{Task, TaskKind};
    use sparrow_model::Heads;
    let task = |name: &str, kind, outputs, weight| Task { name: name.into(), kind, outputs, weight };
    let heads = Heads::of(&[
        task("click", TaskKind::Binary, 1, 1.0),
        task("conversion", TaskKind::Binary, 1, 2.0),
        task("kind", TaskKind::Multiclass, 3, 0.5),
    ]);
    let shape = ModelShape { num_fields: 3, num_dense: 2, embedding_dim: 4 };
    let rows = 4;
    // Rows × tasks; NaN masks a task for a row.
    let labels = [1.0, 0.0, 2.0, 0.0, f32::NAN, 1.0, 1.0, 1.0, f32::NAN, 0.0, f32::NAN, 0.0];
    let esmm_heads =
        Heads::of(&[task("click", TaskKind::Binary, 1, 1.0), task("conversion", TaskKind::Binary, 1, 2.0)]);
    // Every kind with a deep part but the ones that attend.
    let kinds = kinds::KINDS.iter().filter(|k| k.has_products() && k.family() != Family::Sequence);
    let kinds: Vec<ModelKind> = kinds.map(|k| ModelKind::named(k.name())).collect();
    for kind in kinds {
        // ESMM takes two binary tasks: the first two columns of the labels.
        let (heads, labels): (&Heads, Vec<f32>) = if kind.is("esmm") {
            (&esmm_heads, labels.chunks(3).flat_map(|l| [l[0], l[1]]).collect())
        } else {
            (&heads, labels.to_vec())
        };
        let (labels, outputs) = (&labels[..], heads.outputs());
        let summed_loss = |model: &DenseModel, emb: &[f32], dense: &[f32]| {
            let logits = model.predict(emb.to_vec(), dense.to_vec(), rows).expect("forward");
            assert_eq!(logits.len(), rows * outputs);
            heads.loss_and_seed(&logits, labels, None).0
        };
        let config = ModelConfig {
            experts: 3,
            expert_hidden: vec![6],
            task_experts: 1,
            levels: 2,
            tower_hidden: vec![4],
            ..config(kind.clone(), 4, &[8, 5], Precision::F32)
        };
        let model =
            DenseModel::with_heads(&config, shape, heads.clone(), 11, Device::Cpu, sparrow_core::simd::Simd::Auto)
                .expect("model");
        let width = model.width();
        let mut rng = Rng::new(3);
        let emb: Vec<f32> = (0..rows * 3 * width).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let dense: Vec<f32> = (0..rows * 2).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
        let (out, grads) = model.forward_backward(emb.clone(), dense.clone(), labels).expect("step");
        assert!((out.loss - summed_loss(&model, &emb, &dense)).abs() < 1e-5, "{kind}: loss");
        assert!(out.emb_grad.iter().any(|&g| g != 0.0), "{kind}: gradient is all zero");
        let h = 1e-2f32;
        for i in (0..emb.len()).step_by(2) {
            let (mut plus, mut minus) = (emb.clone(), emb.clone());
            plus[i] += h;
            minus[i] -= h;
            let numeric =
                (summed_loss(&model, &plus, &dense) - summed_loss(&model, &minus, &dense)) / (2.0 * f64::from(h));
            let analytic = f64::from(out.emb_grad[i]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{kind}: d loss / d emb[{i}] = {analytic} analytically, {numeric} numerically"
            );
        }
        // The dense weights' gradients (of the mean over rows), probed the same way.
        let flat: Vec<f32> = grads.grads.iter().flat_map(|g| g.clone().unwrap_or_default()).collect();
        let weights = model.params.flat_values().expect("weights");
        assert_eq!(flat.len(), weights.len(), "{kind}: a gradient for every weight");
        for i in (0..weights.len()).step_by(7) {
            let at = |d: f32| {
                let mut w = weights.clone();
                w[i] += d;
                model.params.set_flat(&w).expect("set");
                summed_loss(&model, &emb, &dense)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
            model.params.set_flat(&weights).expect("restore");
            assert!(
                (numeric - f64::from(flat[i])).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{kind}: d loss / d weight[{i}] = {} analytically, {numeric} numerically",
                flat[i]
            );
        }
    }
}

/// One task whose label can be masked (`data.schema.labels = ["cvr"]`, an
/// empty cell): on every kind's own CPU path a masked row adds nothing to
/// the loss (still divided by all rows) and gets no gradient.
#[test]
fn a_masked_label_adds_nothing_on_every_kinds_own_path() {
    let shape = ModelShape { num_fields: 3, num_dense: 2, embedding_dim: 4 };
    for kind in one_task_kinds() {
        let model = DenseModel::new(
            &config(kind.clone(), 4, &[8, 5], Precision::F32),
            shape,
            11,
            Device::Cpu,
            Default::default(),
        )
        .expect("model");
        let (width, rows) = (model.width(), 3);
        let mut rng = Rng::new(5);
        let emb: Vec<f32> = (0..rows * 3 * width).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let dense: Vec<f32> = (0..rows * 2).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
        let (out, _) = model.forward_backward(emb.clone(), dense.clone(), &[1.0, f32::NAN, 0.0]).expect("step");
        let logits = model.predict(emb, dense, rows).expect("forward");
        let expected = (logistic_loss(f64::from(logits[0]), 1.0) + logistic_loss(f64::from(logits[2]), 0.0)) / 3.0;
        assert!((out.loss - expected).abs() < 1e-6, "{kind}: loss {} vs {expected}", out.loss);
        let masked = &out.emb_grad[3 * width..6 * width];
        assert!(masked.iter().all(|&g| g == 0.0), "{kind}: the masked row's gradient {masked:?}");
    }
}

/// A class id past its task's classes (a batch off the wire) is an error
/// naming the task, not a panic in the loss.
#[test]
fn a_class_id_past_the_classes_is_refused_by_the_step() {
    use sparrow_core::config::{Task, TaskKind};
    use sparrow_model::Heads;
    let heads = Heads::of(&[Task { name: "kind".into(), kind: TaskKind::Multiclass, outputs: 3, weight: 1.0 }]);
    let shape = ModelShape { num_fields: 2, num_dense: 1, embedding_dim: 4 };
    let model = DenseModel::with_heads(
        &config(ModelKind::named("mlp"), 4, &[6], Precision::F32),
        shape,
        heads,
        3,
        Device::Cpu,
        Default::default(),
    )
    .expect("model");
    let (emb, dense) = (vec![0.1f32; 2 * 2 * 4], vec![0.5f32; 2]);
    let err = match model.forward_backward(emb, dense, &[1.0, 3.0]) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a class id of 3 for 3 classes trained"),
    };
    assert!(err.contains("task `kind`") && err.contains("label 3"), "{err}");
}

/// The packed step's input gradient: the embeddings' part is the step's,
/// the dense values' part matches finite differences.
fn check_packed_dense_gradient(
    model: &DenseModel,
    (emb, dense, labels): (&[f32], &[f32], &[f32]),
    emb_grad: &[f32],
    kind: &ModelKind,
) {
    let (width, rows) = (model.width(), labels.len());
    let (emb, dense) = (emb.to_vec(), dense.to_vec());
    let row = 3 * width + 2;
    let packed: Vec<f32> = (0..rows)
        .flat_map(|r| emb[r * 3 * width..(r + 1) * 3 * width].iter().chain(&dense[r * 2..(r + 1) * 2]))
        .copied()
        .collect();
    let (_, _, grad_x, _) = model.forward_backward_packed(&packed, labels, |g| g.to_vec()).expect("packed step");
    let h = 1e-2f32;
    for r in 0..rows {
        assert_eq!(&grad_x[r * row..r * row + 3 * width], &emb_grad[r * 3 * width..(r + 1) * 3 * width]);
        for k in 0..2 {
            let (mut plus, mut minus) = (dense.clone(), dense.clone());
            plus[r * 2 + k] += h;
            minus[r * 2 + k] -= h;
            let numeric =
                (mean_loss(model, &emb, &plus, labels) - mean_loss(model, &emb, &minus, labels)) / (2.0 * f64::from(h));
            let analytic = f64::from(grad_x[r * row + 3 * width + k]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{kind}: d loss / d dense[{r}][{k}] = {analytic} analytically, {numeric} numerically"
            );
        }
    }
}
