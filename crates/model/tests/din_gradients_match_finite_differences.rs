//! DIN's gradients: with respect to the pooled fields (the candidate's
//! included, which the attention reads), to each history item, and to the
//! dense weights, against finite differences of the summed task loss.

use candle_core::Device;
use sparrow_core::config::{ModelConfig, ModelKind, NormSetting, Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, Heads, ModelShape, Sequences};

const ROWS: usize = 4;

fn model(heads: &Heads) -> DenseModel {
    let config = ModelConfig {
        kind: ModelKind::named("din"),
        embedding_dim: 4,
        hidden: vec![8, 5],
        attention_hidden: vec![6],
        // No norm: the finite differences go through `predict_with`, which
        // batch norm (DIN's default) would take by its running statistics;
        // DIN with each norm is checked against the graph's autograd
        // (`direct_step_equals_graph_with_tasks_and_sequences.rs`).
        norm: NormSetting::None,
        ..Default::default()
    };
    // Fields: 0 the candidate item, 1 another, 2 the history (its slot).
    let shape = ModelShape { num_fields: 3, num_dense: 2, embedding_dim: 4 };
    DenseModel::with_attention(&config, shape, heads.clone(), &[(2, 0)], 11, Device::Cpu, Default::default())
        .expect("din")
}

#[test]
fn din_gradients_are_exact() {
    let task = |name: &str, kind, outputs| Task { name: name.into(), kind, outputs, weight: 1.0 };
    let heads = Heads::of(&[task("click", TaskKind::Binary, 1), task("kind", TaskKind::Multiclass, 3)]);
    let model = model(&heads);
    let labels = [1.0, 2.0, 0.0, f32::NAN, 1.0, 0.0, 0.0, 1.0];
    let mut rng = Rng::new(5);
    let emb: Vec<f32> = (0..ROWS * 3 * 4).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    let dense: Vec<f32> = (0..ROWS * 2).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
    // Histories of 2, 0, 3 and 1 items: ragged, one row empty.
    let at = vec![0u32, 0, 2, 2, 2, 3];
    let items: Vec<f32> = (0..at.len() * 4).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    let seq = |items: &[f32]| Sequences { rows: vec![at.clone()], items: vec![items.to_vec()] };
    let loss = |emb: &[f32], items: &[f32]| {
        let logits = model.predict_with(emb.to_vec(), dense.clone(), ROWS, Some(&seq(items))).expect("forward");
        heads.loss_and_seed(&logits, &labels, None).0
    };
    let (out, grads) =
        model.forward_backward_with(emb.clone(), dense.clone(), &labels, None, Some(&seq(&items)), None).expect("step");
    assert!((out.loss - loss(&emb, &items)).abs() < 1e-6, "the step's loss is the forward's");
    let h = 1e-2f32;
    let check = |what: &str, analytic: f32, numeric: f64| {
        assert!(
            (numeric - f64::from(analytic)).abs() <= 2e-3 + 2e-2 * numeric.abs(),
            "d loss / d {what} = {analytic} analytically, {numeric} numerically"
        );
    };
    for i in 0..emb.len() {
        let (mut plus, mut minus) = (emb.clone(), emb.clone());
        plus[i] += h;
        minus[i] -= h;
        check(
            &format!("emb[{i}]"),
            out.emb_grad[i],
            (loss(&plus, &items) - loss(&minus, &items)) / (2.0 * f64::from(h)),
        );
        if i % 12 >= 8 {
            // The history's pooled slot is replaced by the attention's sum.
            assert_eq!(out.emb_grad[i], 0.0, "the sequence slot's pooled value is not read");
        }
    }
    assert!(out.emb_grad.iter().any(|&g| g != 0.0));
    assert_eq!(out.item_grads.len(), 1);
    assert!(out.item_grads[0].iter().any(|&g| g != 0.0));
    for i in 0..items.len() {
        let (mut plus, mut minus) = (items.clone(), items.clone());
        plus[i] += h;
        minus[i] -= h;
        check(
            &format!("item[{i}]"),
            out.item_grads[0][i],
            (loss(&emb, &plus) - loss(&emb, &minus)) / (2.0 * f64::from(h)),
        );
    }
    let flat: Vec<f32> = grads.grads.iter().flat_map(|g| g.clone().unwrap_or_default()).collect();
    let weights = model.params.flat_values().expect("weights");
    assert_eq!(flat.len(), weights.len(), "a gradient for every weight, the attention unit's included");
    for i in (0..weights.len()).step_by(5) {
        let at = |d: f32| {
            let mut w = weights.clone();
            w[i] += d;
            model.params.set_flat(&w).expect("set");
            loss(&emb, &items)
        };
        let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
        model.params.set_flat(&weights).expect("restore");
        check(&format!("weight[{i}]"), flat[i], numeric);
    }
}

/// The attention weighs each item against the candidate: the same history
/// scores differently under another candidate, and a row's score reads
/// only its own items.
#[test]
fn din_attends_to_each_rows_own_history_with_its_candidate() {
    let model = model(&Heads::one_binary());
    let mut rng = Rng::new(9);
    let emb: Vec<f32> = (0..ROWS * 3 * 4).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    let dense = vec![0.5f32; ROWS * 2];
    let at = vec![0u32, 1, 1, 3];
    let items: Vec<f32> = (0..at.len() * 4).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    let predict = |emb: &[f32], items: &[f32]| {
        let seq = Sequences { rows: vec![at.clone()], items: vec![items.to_vec()] };
        model.predict_with(emb.to_vec(), dense.clone(), ROWS, Some(&seq)).expect("forward")
    };
    let base = predict(&emb, &items);
    // Row 1's second item changed: only row 1's score moves.
    let mut other = items.clone();
    other[2 * 4] += 0.5;
    let moved = predict(&emb, &other);
    for r in 0..ROWS {
        assert_eq!(base[r] != moved[r], r == 1, "row {r}");
    }
    // Row 3's candidate changed (its other fields kept): its score moves.
    let mut candidate = emb.clone();
    candidate[3 * 12] += 0.5;
    assert_ne!(predict(&candidate, &items)[3], base[3]);
    // The sequence slot's pooled sum is not read at all.
    let mut slot = emb.clone();
    slot[12 + 8] += 5.0;
    assert_eq!(predict(&slot, &items), base);
    // Without its sequences the model says so instead of guessing.
    let err = model.predict(emb.clone(), dense.clone(), ROWS).expect_err("sequences missing");
    assert!(err.to_string().contains("behaviour sequence"), "{err}");
}
