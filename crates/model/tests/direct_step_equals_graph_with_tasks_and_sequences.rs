//! The direct CPU step of the kinds built for several tasks and behaviour
//! sequences (MMoE, PLE, ESMM, DIN), and of the one-task kinds whose MLP
//! ends in every task's outputs (MLP, DCN-v2), equals candle's graph and
//! its autograd: logits, loss, the gradients of the pooled embeddings, of
//! each history item and of every dense weight, and the weights after two
//! optimizer steps. With a binary, a weighted binary and a multiclass task
//! (ESMM: its two binary tasks), masked labels, sample weights, histories
//! that are empty, one item long and `max_len` long, in both precisions,
//! with and without dropout.

use candle_core::Device;
use sparrow_core::config::{Activation, DenseOptimizerConfig, ModelConfig, ModelKind, Norm, Precision, Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, Heads, ModelShape, Sequences};

const ROWS: usize = 7;
const FIELDS: usize = 4;
const DIM: usize = 5;
/// DIN: field 3 is the history's slot, field 0 its candidate.
const PAIR: (usize, usize) = (3, 0);
/// Each row's history length: empty, one item and `max_len` (4) among them.
const HISTORY: [usize; ROWS] = [0, 1, 4, 2, 0, 3, 1];

fn heads(kind: &str) -> Heads {
    let task = |name: &str, kind, outputs, weight| Task { name: name.into(), kind, outputs, weight };
    if kind == "esmm" {
        return Heads::of(&[task("click", TaskKind::Binary, 1, 1.0), task("conversion", TaskKind::Binary, 1, 2.0)]);
    }
    Heads::of(&[
        task("click", TaskKind::Binary, 1, 1.0),
        task("conversion", TaskKind::Binary, 1, 2.0),
        task("kind", TaskKind::Multiclass, 3, 0.5),
    ])
}

/// Experts of two layers (or of one, as the default's).
fn model(kind: &str, precision: Precision, num_dense: usize) -> DenseModel {
    model_with(kind, precision, num_dense, (&[7, 6], UNIT), (0.0, Norm::None, Activation::Relu))
}

/// DIN's attention unit: two layers. With one (`[36]`, DIN's default),
/// the unit's first layer computes its last's input gradient itself.
const UNIT: &[usize] = &[6, 4];

fn model_with(
    kind: &str,
    precision: Precision,
    num_dense: usize,
    (expert_hidden, attention_hidden): (&[usize], &[usize]),
    (dropout, norm, activation): (f32, Norm, Activation),
) -> DenseModel {
    let config = ModelConfig {
        kind: ModelKind::named(kind),
        embedding_dim: DIM,
        hidden: vec![8, 6],
        cross_layers: 2,
        experts: 3,
        expert_hidden: expert_hidden.to_vec(),
        task_experts: 2,
        levels: 2,
        tower_hidden: vec![5],
        attention_hidden: attention_hidden.to_vec(),
        precision,
        dropout,
        norm: norm.into(),
        activation,
        // DIN's unit takes its own: Dice there too when the stacks have it.
        attention_activation: if activation == Activation::Dice { Activation::Dice } else { Activation::Relu },
        ..Default::default()
    };
    let shape = ModelShape { num_fields: FIELDS, num_dense, embedding_dim: DIM };
    let pairs: &[(usize, usize)] = if kind == "din" { &[PAIR] } else { &[] };
    DenseModel::with_attention(&config, shape, heads(kind), pairs, 17, Device::Cpu, Default::default()).expect("model")
}

/// Rows × tasks of labels, some masked (NaN).
fn labels(tasks: usize, rng: &mut Rng) -> Vec<f32> {
    (0..ROWS * tasks)
        .map(|i| match (i % tasks, i % 5) {
            (_, 3) => f32::NAN,
            (2, _) => (rng.next_u64() % 3) as f32,
            _ => (rng.next_u64() % 2) as f32,
        })
        .collect()
}

fn sequences(histories: &[usize], rng: &mut Rng) -> Sequences {
    let rows: Vec<u32> = histories.iter().enumerate().flat_map(|(r, &n)| std::iter::repeat_n(r as u32, n)).collect();
    let items = (0..rows.len() * DIM).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    Sequences { rows: vec![rows], items: vec![items] }
}

fn close(what: &str, a: &[f32], b: &[f32], tolerance: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tolerance * (1.0 + y.abs()), "{what}[{i}]: direct {x}, graph {y}");
    }
}

#[test]
fn the_direct_step_is_the_graphs_for_several_tasks_and_sequences() {
    let deep: &[usize] = &[7, 6];
    let relu = Activation::Relu;
    let plain = (0.0, Norm::None, relu);
    // Each kind also with dropout (`model.dropout`), in both precisions:
    // both paths drop the same values; and with each `model.norm`.
    let cases = ["mlp", "dcn", "mmoe", "ple", "esmm", "din"]
        .into_iter()
        .flat_map(|k| {
            [
                (k, Precision::F32, 2, (deep, UNIT), plain),
                (k, Precision::Bf16, 2, (deep, UNIT), plain),
                (k, Precision::F32, 0, (deep, UNIT), plain),
                (k, Precision::F32, 2, (deep, UNIT), (0.4, Norm::None, relu)),
                (k, Precision::Bf16, 0, (deep, UNIT), (0.25, Norm::None, relu)),
                (k, Precision::F32, 2, (deep, UNIT), (0.0, Norm::Layer, relu)),
                (k, Precision::Bf16, 2, (deep, UNIT), (0.0, Norm::Layer, relu)),
                // Batch norm: both paths normalize by the batch, hand the
                // same statistics on, and move the running ones alike.
                (k, Precision::F32, 2, (deep, UNIT), (0.0, Norm::Batch, relu)),
                (k, Precision::Bf16, 2, (deep, UNIT), (0.3, Norm::Batch, relu)),
                // The other activations (Dice also in DIN's unit).
                (k, Precision::F32, 2, (deep, UNIT), (0.2, Norm::None, Activation::Prelu)),
                (k, Precision::Bf16, 2, (deep, UNIT), (0.0, Norm::Layer, Activation::Gelu)),
                (k, Precision::F32, 2, (deep, UNIT), (0.0, Norm::Batch, Activation::Silu)),
                (k, Precision::F32, 2, (deep, UNIT), (0.3, Norm::None, Activation::Dice)),
            ]
        })
        .chain(["mmoe", "ple"].into_iter().flat_map(|k| {
            [
                (k, Precision::F32, 2, (&[7][..], UNIT), plain),
                (k, Precision::Bf16, 2, (&[7][..], UNIT), plain),
                (k, Precision::F32, 0, (&[7][..], UNIT), plain),
            ]
        }))
        // DIN's unit of one layer, fp32: its outer product computed where
        // its first layer's gradient pass reads it (11 items by 36).
        .chain([
            ("din", Precision::F32, 2, (deep, &[36][..]), plain),
            ("din", Precision::F32, 0, (deep, &[36][..]), (0.4, Norm::None, relu)),
            ("din", Precision::F32, 2, (deep, &[36][..]), (0.0, Norm::Batch, relu)),
            ("din", Precision::F32, 2, (deep, &[36][..]), (0.3, Norm::None, Activation::Dice)),
            ("din", Precision::Bf16, 2, (deep, &[36][..]), plain),
        ]);
    for (kind, precision, num_dense, (experts, unit), (dropout, norm, activation)) in cases {
        let what = format!(
            "{kind} {precision:?} with {num_dense} dense, experts {experts:?}, unit {unit:?}, dropout {dropout}, \
             norm {norm:?}, {activation:?}"
        );
        let model = || model_with(kind, precision, num_dense, (experts, unit), (dropout, norm, activation));
        let (direct, graph) = (model(), model());
        assert!(direct.packed_row_len().is_some(), "{what}: takes the direct step");
        let (mut opt_d, mut opt_g) = (
            DenseOptimizer::new(DenseOptimizerConfig::default(), Default::default()),
            DenseOptimizer::new(DenseOptimizerConfig::default(), Default::default()),
        );
        let mut rng = Rng::new(23);
        let tasks = direct.heads().tasks();
        // Two steps; the second with every history empty.
        for step in 0..2 {
            let emb: Vec<f32> = (0..ROWS * FIELDS * DIM).map(|_| rng.uniform(-0.6, 0.6) as f32).collect();
            let dense: Vec<f32> = (0..ROWS * num_dense).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
            let labels = labels(tasks, &mut rng);
            let weights: Vec<f32> = (0..ROWS).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
            let seq = sequences(if step == 0 { &HISTORY } else { &[0; ROWS] }, &mut rng);
            let seq = (kind == "din").then_some(&seq);
            let draw = (dropout > 0.0).then_some(900 + step);
            let (a, grads_a) = direct
                .forward_backward_with(emb.clone(), dense.clone(), &labels, Some(&weights), seq, draw)
                .expect("direct step");
            let (b, grads_b) = graph
                .forward_backward_autograd_with(emb.clone(), dense.clone(), &labels, Some(&weights), seq, draw)
                .expect("graph step");
            let predicted = direct.predict_with(emb, dense, ROWS, seq).expect("predict");
            // Predictions drop nothing: the step's logits unless it dropped
            // (or normalized by the batch where predict takes the running
            // statistics).
            let same = dropout == 0.0 && norm != Norm::Batch && activation != Activation::Dice;
            assert_eq!(predicted == a.logits, same, "{what}: predict gives the step's logits");
            assert!((a.loss - b.loss).abs() <= 1e-5 * (1.0 + b.loss.abs()), "{what}: loss {} vs {}", a.loss, b.loss);
            close(&format!("{what}: logits"), &a.logits, &b.logits, 1e-5);
            close(&format!("{what}: d pooled"), &a.emb_grad, &b.emb_grad, 1e-5);
            assert!(a.emb_grad.iter().any(|&g| g != 0.0), "{what}: a gradient");
            assert_eq!(a.item_grads.len(), b.item_grads.len(), "{what}: sequences");
            for (x, y) in a.item_grads.iter().zip(&b.item_grads) {
                close(&format!("{what}: d history items"), x, y, 1e-5);
            }
            if kind == "din" && step == 0 {
                assert!(a.item_grads[0].iter().any(|&g| g != 0.0), "{what}: the items get a gradient");
            }
            assert_eq!(grads_a.rows, grads_b.rows, "{what}: rows");
            for (i, (ga, gb)) in grads_a.grads.iter().zip(&grads_b.grads).enumerate() {
                match (ga, gb) {
                    (Some(ga), Some(gb)) => close(&format!("{what}: dense gradient {i}"), ga, gb, 1e-5),
                    // A unit that saw no history has no gradient on either path.
                    (None, None) => assert!(kind == "din" && step == 1, "{what}: parameter {i} has no gradient"),
                    _ => panic!("{what}: parameter {i} has a gradient on one path only"),
                }
            }
            opt_d.apply(&direct.params, grads_a).expect("apply");
            opt_g.apply(&graph.params, grads_b).expect("apply");
        }
        let (v, w) = (direct.params.flat_values().expect("weights"), graph.params.flat_values().expect("weights"));
        close(&format!("{what}: weights after two steps"), &v, &w, 1e-5);
    }
}

/// A batch whose history items do not fit it (more values than positions,
/// a position past the batch's rows) is refused naming the history, on the
/// direct step as on the graph's.
#[test]
fn history_items_that_do_not_fit_the_batch_are_refused() {
    let din = model("din", Precision::F32, 2);
    let mut rng = Rng::new(3);
    let emb: Vec<f32> = (0..ROWS * FIELDS * DIM).map(|_| rng.uniform(-0.6, 0.6) as f32).collect();
    let dense = vec![0.5f32; ROWS * 2];
    let labels = labels(3, &mut rng);
    let good = sequences(&HISTORY, &mut rng);
    let mut short = good.clone();
    short.items[0].pop();
    let mut past = good.clone();
    past.rows[0][0] = ROWS as u32;
    for bad in [short, past] {
        let err = din.forward_backward_with(emb.clone(), dense.clone(), &labels, None, Some(&bad), None).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("history items"), "refused naming the history: {err:?}");
    }
    let mut poisoned = good.clone();
    poisoned.items[0][3] = f32::NAN;
    let weights_before = din.params.flat_values().expect("weights");
    let err = din.forward_backward_with(emb.clone(), dense.clone(), &labels, None, Some(&poisoned), None).err();
    let err = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("non-finite"), "a NaN history item is refused: {err:?}");
    assert_eq!(din.params.flat_values().expect("weights"), weights_before, "nothing moved");
    let err = din.forward_backward_with(emb, dense, &labels, None, None, None).err().map(|e| e.to_string());
    assert!(err.unwrap_or_default().contains("behaviour sequence"), "a batch without its sequence is refused");
}

/// A batch of `rows` rows: embeddings, dense values and (histories of 0 to
/// 4 items) its sequences.
fn batch(rows: usize, num_dense: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>, Sequences) {
    let emb = (0..rows * FIELDS * DIM).map(|_| rng.uniform(-0.6, 0.6) as f32).collect();
    let dense = (0..rows * num_dense).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
    let histories: Vec<usize> = (0..rows).map(|r| (r * 7 + 3) % 5).collect();
    (emb, dense, sequences(&histories, rng))
}

#[test]
fn a_prediction_is_the_same_after_larger_and_other_batches() {
    // Predictions reuse buffers from one call to the next: what one batch
    // leaves in them (more rows, longer histories) must not reach another.
    let deep: &[usize] = &[7, 6];
    for (kind, style) in [
        ("mlp", (0.0, Norm::None, Activation::Relu)),
        ("dcn", (0.0, Norm::Batch, Activation::Relu)),
        ("mmoe", (0.0, Norm::Layer, Activation::Prelu)),
        ("ple", (0.0, Norm::Batch, Activation::Relu)),
        ("esmm", (0.0, Norm::None, Activation::Relu)),
        ("din", (0.0, Norm::Batch, Activation::Dice)),
        ("din", (0.0, Norm::None, Activation::Relu)),
    ] {
        let num_dense = 2;
        let mut rng = Rng::new(31);
        let small = batch(5, num_dense, &mut rng);
        let large = batch(300, num_dense, &mut rng);
        let other = batch(5, num_dense, &mut rng);
        let predict = |model: &DenseModel, (emb, dense, seq): &(Vec<f32>, Vec<f32>, Sequences), rows| {
            let seq = (kind == "din").then_some(seq);
            model.predict_with(emb.clone(), dense.clone(), rows, seq).expect("predict")
        };
        let fresh = model_with(kind, Precision::F32, num_dense, (deep, UNIT), style);
        let expected = predict(&fresh, &small, 5);
        let reused = model_with(kind, Precision::F32, num_dense, (deep, UNIT), style);
        predict(&reused, &large, 300);
        predict(&reused, &other, 5);
        let again = predict(&reused, &small, 5);
        let same = expected.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same && expected.len() == again.len(), "{kind} {style:?}: {expected:?} then {again:?}");
    }
}
