//! The multi-task kinds (MMoE, PLE, ESMM) run a batch as two halves, one
//! a thread (`models/halves.rs`), where each half has the work to pay for
//! waking a thread. That step is still candle's graph and its autograd:
//! logits, loss, the pooled embeddings' gradient in the batch's row order,
//! every dense gradient (the halves' summed) and the weights and running
//! statistics after two optimizer steps, over an odd batch, masked labels
//! and sample weights, both precisions, layer norm, batch norm and Dice
//! (every expert's and tower's statistics meeting across the halves,
//! `meet.rs`), and dropout (the second half's masks drawn by their place
//! in the whole batch); a prediction of the batch gives the step's logits,
//! bit for bit, where the step dropped nothing and normalized by nothing
//! of the batch.
//! Its bits do not depend on the threads: pools of one, two and three give
//! the same model.

use candle_core::Device;
use sparrow_core::config::{Activation, DenseOptimizerConfig, ModelConfig, ModelKind, Norm, Precision, Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, Heads, ModelShape};

mod halves_common;
use halves_common::{AFTER_ADAM, Batch, CASCADE, Run, TIGHT, Tolerance, assert_same_bits, bits, close};

const FIELDS: usize = 4;
const DIM: usize = 5;
const DENSE: usize = 2;

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

fn model(kind: &str, precision: Precision, norm: Norm) -> DenseModel {
    model_with(kind, (precision, norm, 0.0, Activation::Relu))
}

fn model_with(kind: &str, (precision, norm, dropout, activation): Case) -> DenseModel {
    let config = ModelConfig {
        kind: ModelKind::named(kind),
        embedding_dim: DIM,
        experts: 3,
        expert_hidden: vec![48, 6],
        task_experts: 2,
        levels: 2,
        tower_hidden: vec![40],
        precision,
        norm: norm.into(),
        dropout,
        activation,
        ..Default::default()
    };
    let shape = ModelShape { num_fields: FIELDS, num_dense: DENSE, embedding_dim: DIM };
    DenseModel::with_attention(&config, shape, heads(kind), &[], 17, Device::Cpu, Default::default()).expect("model")
}

/// A batch one row past the fewest `model` runs in halves: odd, so its
/// halves differ by a row.
fn rows(model: &DenseModel) -> usize {
    2 * model.half_rows().expect("runs in halves") + 1
}

fn batch(rows: usize, tasks: usize, rng: &mut Rng) -> Batch {
    halves_common::batch(rows, tasks, (FIELDS * DIM, DENSE), rng)
}

/// Precision, norm, dropout rate and activation.
type Case = (Precision, Norm, f32, Activation);

const CASES: [Case; 11] = [
    (Precision::F32, Norm::None, 0.0, Activation::Relu),
    (Precision::Bf16, Norm::None, 0.0, Activation::Relu),
    (Precision::F32, Norm::Layer, 0.0, Activation::Relu),
    (Precision::F32, Norm::None, 0.3, Activation::Relu),
    (Precision::Bf16, Norm::Layer, 0.2, Activation::Relu),
    // An activation other than ReLU applies the masks to the gradient again.
    (Precision::F32, Norm::None, 0.3, Activation::Gelu),
    // Batch norm: every expert's and tower's statistics meet across the halves.
    (Precision::F32, Norm::Batch, 0.0, Activation::Relu),
    (Precision::F32, Norm::Batch, 0.3, Activation::Prelu),
    (Precision::Bf16, Norm::Batch, 0.2, Activation::Relu),
    // Dice's statistics meet too.
    (Precision::F32, Norm::None, 0.0, Activation::Dice),
    (Precision::F32, Norm::Batch, 0.3, Activation::Dice),
];

/// How close `case`'s step in halves comes to the graph's.
fn tolerance((precision, norm, _, activation): Case) -> Tolerance {
    let statistics = norm == Norm::Batch || activation == Activation::Dice;
    if precision == Precision::Bf16 && statistics { CASCADE } else { TIGHT }
}

/// The multi-task kinds take the halves from twice the rows their work
/// asks for, with dropout too (its masks drawn by a value's place in the
/// whole batch), batch norm and Dice (their statistics meeting across the
/// halves); not the kinds whose products are large enough to split one by
/// one.
#[test]
fn the_multi_task_kinds_take_the_halves_where_their_rows_are_independent() {
    for kind in ["mmoe", "ple", "esmm"] {
        for case in CASES {
            let (precision, norm, ..) = case;
            let m = model_with(kind, case);
            let half = m.half_rows().expect("halves");
            assert!((64..5000).contains(&half), "{kind}: {half} rows a half");
            assert!(m.runs_in_halves(2 * half) && !m.runs_in_halves(2 * half - 1), "{kind} {precision:?} {norm:?}");
        }
    }
    assert_eq!(model("mlp", Precision::F32, Norm::None).half_rows(), None, "the MLP");
    // More work a row, fewer rows a half.
    let wide = |experts| {
        let config = ModelConfig { kind: ModelKind::named("mmoe"), embedding_dim: DIM, experts, ..Default::default() };
        let shape = ModelShape { num_fields: FIELDS, num_dense: DENSE, embedding_dim: DIM };
        let model = DenseModel::with_attention(&config, shape, heads("mmoe"), &[], 17, Device::Cpu, Default::default());
        model.expect("model").half_rows().expect("halves")
    };
    assert!(wide(8) < wide(2), "8 experts: {} rows, 2: {}", wide(8), wide(2));
}

#[test]
fn a_step_in_halves_is_the_graphs() {
    for kind in ["mmoe", "ple", "esmm"] {
        for case in CASES {
            let (dropout, tolerance) = (case.2, tolerance(case));
            let what = format!("{kind} {case:?}");
            let model = || model_with(kind, case);
            let (direct, graph) = (model(), model());
            let new_optimizer = || DenseOptimizer::new(DenseOptimizerConfig::default(), Default::default());
            let (mut opt_d, mut opt_g) = (new_optimizer(), new_optimizer());
            let mut rng = Rng::new(29);
            let rows = rows(&direct);
            for step in 0..2 {
                let what = format!("{what}, step {step}");
                let b = batch(rows, direct.heads().tasks(), &mut rng);
                // Both paths drop the same values: the second half's by their place in the batch.
                let draw = (dropout > 0.0).then_some(900 + step);
                let (a, grads_a) = direct
                    .forward_backward_with(b.emb.clone(), b.dense.clone(), &b.labels, Some(&b.weights), None, draw)
                    .expect("step in halves");
                let (g, grads_g) = graph
                    .forward_backward_autograd_with(
                        b.emb.clone(),
                        b.dense.clone(),
                        &b.labels,
                        Some(&b.weights),
                        None,
                        draw,
                    )
                    .expect("graph step");
                let loss = Tolerance { share: 1.0, ..tolerance };
                close(&format!("{what}: loss"), &[a.loss as f32], &[g.loss as f32], loss);
                // Each half takes its rows' losses: their sum is the whole
                // batch's loss of those logits, bit for bit.
                let whole = direct.heads().loss_and_seed(&a.logits, &b.labels, Some(&b.weights)).0;
                assert_eq!(a.loss.to_bits(), whole.to_bits(), "{what}: the halves' loss is the whole batch's");
                close(&format!("{what}: logits"), &a.logits, &g.logits, tolerance);
                close(&format!("{what}: d pooled"), &a.emb_grad, &g.emb_grad, tolerance);
                // The second half's rows have their gradients too.
                let second = &a.emb_grad[(rows / 2 + 1) * FIELDS * DIM..];
                assert!(second.iter().any(|&v| v != 0.0), "{what}: the second half's gradient");
                assert_eq!(grads_a.rows, rows as u64, "{what}: rows");
                for (i, (x, y)) in grads_a.grads.iter().zip(&grads_g.grads).enumerate() {
                    let (x, y) = (x.as_ref().expect("a gradient"), y.as_ref().expect("a gradient"));
                    close(&format!("{what}: dense gradient {i}"), x, y, tolerance);
                }
                // A prediction of the batch runs in halves too: the step's
                // logits, where the step dropped nothing and normalized by
                // nothing of the batch (a prediction takes the running statistics).
                let predicted = direct.predict(b.emb, b.dense, rows).expect("predict");
                let same = dropout == 0.0 && case.1 != Norm::Batch && case.3 != Activation::Dice;
                assert_eq!(bits(&predicted) == bits(&a.logits), same, "{what}: a prediction's logits");
                opt_d.apply(&direct.params, grads_a).expect("apply");
                opt_g.apply(&graph.params, grads_g).expect("apply");
            }
            let (v, w) = (direct.params.flat_values().expect("weights"), graph.params.flat_values().expect("weights"));
            let after = if case.3 == Activation::Dice && tolerance.share == 0.0 { AFTER_ADAM } else { tolerance };
            close(&format!("{what}: weights and running statistics after two steps"), &v, &w, after);
        }
    }
}

/// Three steps of `kind` on a pool of `threads`.
fn trained(kind: &str, case: Case, threads: usize) -> Run {
    let mut rng = Rng::new(37);
    let step = |model: &DenseModel, step| {
        let draw = (case.2 > 0.0).then_some(70 + step);
        (batch(rows(model), model.heads().tasks(), &mut rng), draw)
    };
    halves_common::trained(threads, || model_with(kind, case), step)
}

#[test]
fn the_halves_give_the_same_bits_on_pools_of_one_two_and_three() {
    for kind in ["mmoe", "ple", "esmm"] {
        for case in CASES {
            let what = format!("{kind} {case:?}");
            let one = trained(kind, case, 1);
            assert_same_bits(&format!("{what}, 2 threads"), &one, &trained(kind, case, 2));
            assert_same_bits(&format!("{what}, 3 threads"), &one, &trained(kind, case, 3));
        }
    }
}

/// A NaN in the second half makes the batch's loss NaN: the step in halves
/// reports the loss, naming it, not the NaN gradients its half's backward
/// pass then made, and returns nothing to apply; with batch norm or Dice
/// too, whose meetings carry the NaN to both halves (an error, no hang).
#[test]
fn a_nan_loss_in_a_half_stops_the_step_with_the_loss_named() {
    let cases = [(Norm::None, Activation::Relu), (Norm::Batch, Activation::Relu), (Norm::None, Activation::Dice)];
    for (kind, (norm, activation)) in ["mmoe", "esmm"].into_iter().flat_map(|k| cases.map(|c| (k, c))) {
        let model = model_with(kind, (Precision::F32, norm, 0.0, activation));
        let rows = rows(&model);
        let tasks = model.heads().tasks();
        let mut b = batch(rows, tasks, &mut Rng::new(5));
        // The last row's weight NaN, its first task's label not masked:
        // its loss and its seed are NaN, and so its half's gradients.
        b.weights[rows - 1] = f32::NAN;
        b.labels[(rows - 1) * tasks] = 1.0;
        let Err(err) = model.forward_backward_with(b.emb, b.dense, &b.labels, Some(&b.weights), None, None) else {
            panic!("{kind} {norm:?} {activation:?}: a NaN loss stops the step");
        };
        assert!(err.to_string().contains("training loss"), "{kind} {norm:?} {activation:?}: {err}");
    }
}

/// Sample weights that are not one a row are refused by name, in halves
/// and whole: no index past the end of them.
#[test]
fn sample_weights_not_one_a_row_are_refused() {
    for (kind, halves) in [("mmoe", true), ("esmm", true), ("mmoe", false)] {
        let model = model(kind, Precision::F32, Norm::None);
        let rows = if halves { rows(&model) } else { 7 };
        assert_eq!(model.runs_in_halves(rows), halves, "{kind}");
        let b = batch(rows, model.heads().tasks(), &mut Rng::new(8));
        for weights in [&b.weights[..rows - 1], &[1.0; 3][..]] {
            let Err(err) =
                model.forward_backward_with(b.emb.clone(), b.dense.clone(), &b.labels, Some(weights), None, None)
            else {
                panic!("{kind}: {} weights for {rows} rows were taken", weights.len());
            };
            assert!(err.to_string().contains("sample weights"), "{kind}: {err}");
        }
    }
}
