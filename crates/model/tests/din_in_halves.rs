//! DIN runs a batch as two halves, one a thread (`models/halves.rs`), each
//! history item with its row's half, its MLP's batch norm and Dice (the
//! MLP's and the attention unit's, over the batch's history items) meeting
//! across the halves (`meet.rs`: each layer's column statistics forward,
//! Σ d y and Σ d y·x̂ backward). That step is still candle's graph and its autograd:
//! logits, loss, the pooled embeddings' and every history item's gradient
//! in the batch's order, every dense gradient and the running statistics
//! handed on, and the weights after two optimizer steps; over an odd
//! batch, histories empty, one item and `max_len` long (in row order or
//! not, or none in the second half), masked labels and sample weights, both precisions, batch and layer
//! norm, dropout and other activations. Its bits do not depend on the
//! threads: pools of one, two and three give the same model.

use candle_core::Device;
use sparrow_core::config::{Activation, DenseOptimizerConfig, ModelConfig, ModelKind, Norm, Precision, Task, TaskKind};
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, Heads, ModelShape, Sequences};

mod halves_common;
use halves_common::{Batch, FLIPS, Run, TIGHT, Tolerance, assert_same_bits, bits, close};

const FIELDS: usize = 4;
const DIM: usize = 5;
const DENSE: usize = 2;
/// Field 3 is the history's slot, field 0 its candidate.
const PAIR: (usize, usize) = (3, 0);
/// Row lengths of the histories, cycled: empty, one item and `max_len` (4) among them.
const HISTORY: [usize; 7] = [0, 1, 4, 2, 0, 3, 1];

fn heads() -> Heads {
    let task = |name: &str, kind, outputs, weight| Task { name: name.into(), kind, outputs, weight };
    Heads::of(&[
        task("click", TaskKind::Binary, 1, 1.0),
        task("conversion", TaskKind::Binary, 1, 2.0),
        task("kind", TaskKind::Multiclass, 3, 0.5),
    ])
}

/// Precision, norm, dropout rate and activation.
type Case = (Precision, Norm, f32, Activation);

/// Dice (`Activation::Dice`) is the MLP's and the unit's: the unit's
/// statistics are over the batch's history items.
const CASES: [Case; 9] = [
    (Precision::F32, Norm::Batch, 0.0, Activation::Relu),
    (Precision::Bf16, Norm::Batch, 0.3, Activation::Relu),
    (Precision::F32, Norm::Batch, 0.2, Activation::Silu),
    (Precision::F32, Norm::None, 0.0, Activation::Relu),
    (Precision::F32, Norm::None, 0.3, Activation::Prelu),
    (Precision::Bf16, Norm::Layer, 0.0, Activation::Gelu),
    (Precision::F32, Norm::None, 0.0, Activation::Dice),
    (Precision::F32, Norm::Batch, 0.2, Activation::Dice),
    (Precision::Bf16, Norm::None, 0.0, Activation::Dice),
];

/// bf16: the unit runs in fp32 whatever the precision (`kinds/din.rs`),
/// its first product summed from its parts on the step and from the
/// laid-out features on the graph, so the MLP's bf16 inputs can differ in
/// a last bit and flip roundings (`FLIPS`; measured with layer norm: 5 of
/// 645 logits past 1e-5, within 2.1e-4). With batch norm a flipped value
/// also moves its column's statistics and with them every row's gradient
/// a little: 212 of a weight gradient's 1,581 values past 1e-5, each
/// within 1.4e-4, 4.7e-6 on average.
const UNIT_FLIPS: Tolerance = Tolerance { share: 0.2, ..FLIPS };

/// How close `case`'s step in halves comes to the graph's: bf16 flips
/// roundings (`FLIPS`, `UNIT_FLIPS` with batch norm); Dice's statistics,
/// in bf16 too, keep every value within 1e-5 here.
fn tolerance((precision, norm, ..): Case) -> Tolerance {
    match (precision, norm) {
        (Precision::Bf16, Norm::Batch) => UNIT_FLIPS,
        (Precision::Bf16, _) => FLIPS,
        _ => TIGHT,
    }
}

fn model((precision, norm, dropout, activation): Case) -> DenseModel {
    let config = ModelConfig {
        kind: ModelKind::named("din"),
        embedding_dim: DIM,
        hidden: vec![40, 12],
        attention_hidden: vec![6, 4],
        precision,
        norm: norm.into(),
        dropout,
        activation,
        attention_activation: if activation == Activation::Dice { Activation::Dice } else { Activation::Relu },
        ..Default::default()
    };
    let shape = ModelShape { num_fields: FIELDS, num_dense: DENSE, embedding_dim: DIM };
    DenseModel::with_attention(&config, shape, heads(), &[PAIR], 17, Device::Cpu, Default::default()).expect("model")
}

/// A batch that runs in halves, odd, so its halves differ by a row.
fn rows(model: &DenseModel) -> usize {
    8 * model.half_rows().expect("runs in halves") + 1
}

/// Where a batch's history positions are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    InRowOrder,
    Reversed,
    /// Only the first half's rows have histories: the second half has none.
    FirstHalfOnly,
}

/// A batch of `rows`, its history positions laid out as `layout` says.
fn batch(rows: usize, tasks: usize, layout: Layout, rng: &mut Rng) -> Batch {
    let mut b = halves_common::batch(rows, tasks, (FIELDS * DIM, DENSE), rng);
    let length = |r: usize| if layout == Layout::FirstHalfOnly && r >= rows / 2 { 0 } else { HISTORY[r % 7] };
    let mut at: Vec<u32> = (0..rows).flat_map(|r| std::iter::repeat_n(r as u32, length(r))).collect();
    if layout == Layout::Reversed {
        at.reverse();
    }
    let items = (0..at.len() * DIM).map(|_| rng.uniform(-0.8, 0.8) as f32).collect();
    b.sequences = Some(Sequences { rows: vec![at], items: vec![items] });
    b
}

/// DIN takes the halves from twice the rows its work asks for, with batch
/// norm and Dice too, their statistics meeting.
#[test]
fn din_takes_the_halves_with_batch_norm_and_dice() {
    for case in CASES {
        let m = model(case);
        let half = m.half_rows().expect("halves");
        assert!((2..=64).contains(&half), "{case:?}: {half} rows a half");
        assert!(m.runs_in_halves(2 * half) && !m.runs_in_halves(2 * half - 1), "{case:?}");
    }
}

#[test]
fn a_din_step_in_halves_is_the_graphs() {
    let others = [
        (CASES[0], Layout::Reversed),
        (CASES[4], Layout::Reversed),
        (CASES[0], Layout::FirstHalfOnly),
        // The second half has no items: its unit meets with a share of none.
        (CASES[6], Layout::FirstHalfOnly),
        (CASES[7], Layout::Reversed),
    ];
    for (case, layout) in CASES.into_iter().map(|c| (c, Layout::InRowOrder)).chain(others) {
        let (dropout, norm) = (case.2, case.1);
        let what = format!("{case:?}, positions {layout:?}");
        let tolerance = tolerance(case);
        let (direct, graph) = (model(case), model(case));
        let new_optimizer = || DenseOptimizer::new(DenseOptimizerConfig::default(), Default::default());
        let (mut opt_d, mut opt_g) = (new_optimizer(), new_optimizer());
        let mut rng = Rng::new(29);
        let rows = rows(&direct);
        for step in 0..2 {
            let what = format!("{what}, step {step}");
            let b = batch(rows, direct.heads().tasks(), layout, &mut rng);
            let draw = (dropout > 0.0).then_some(900 + step);
            let seq = b.sequences.as_ref();
            let (a, grads_a) = direct
                .forward_backward_with(b.emb.clone(), b.dense.clone(), &b.labels, Some(&b.weights), seq, draw)
                .expect("step in halves");
            let (g, grads_g) = graph
                .forward_backward_autograd_with(b.emb.clone(), b.dense.clone(), &b.labels, Some(&b.weights), seq, draw)
                .expect("graph step");
            close(&format!("{what}: loss"), &[a.loss as f32], &[g.loss as f32], Tolerance { share: 1.0, ..tolerance });
            close(&format!("{what}: logits"), &a.logits, &g.logits, tolerance);
            close(&format!("{what}: d pooled"), &a.emb_grad, &g.emb_grad, tolerance);
            assert_eq!(a.item_grads.len(), 1, "{what}: one sequence");
            close(&format!("{what}: d history items"), &a.item_grads[0], &g.item_grads[0], tolerance);
            // Both halves' items have their gradients.
            let half_items = seq.map_or(0, |q| q.rows[0].len()) / 2 * DIM;
            for part in [&a.item_grads[0][..half_items], &a.item_grads[0][half_items..]] {
                assert!(part.iter().any(|&v| v != 0.0), "{what}: items' gradients");
            }
            assert_eq!(grads_a.rows, rows as u64, "{what}: rows");
            for (i, (x, y)) in grads_a.grads.iter().zip(&grads_g.grads).enumerate() {
                // Batch norm's running statistics are handed on as gradients' slots.
                match (x, y) {
                    (Some(x), Some(y)) => close(&format!("{what}: dense gradient {i}"), x, y, tolerance),
                    (x, y) => assert_eq!(x.is_some(), y.is_some(), "{what}: gradient {i} on one path only"),
                }
            }
            // A prediction runs in halves too: the step's logits, where
            // the step dropped nothing and normalized by nothing of the batch.
            let predicted = direct.predict_with(b.emb.clone(), b.dense.clone(), rows, seq).expect("predict");
            if dropout == 0.0 && norm != Norm::Batch && case.3 != Activation::Dice {
                assert_eq!(bits(&predicted), bits(&a.logits), "{what}: a prediction's logits");
            }
            opt_d.apply(&direct.params, grads_a).expect("apply");
            opt_g.apply(&graph.params, grads_g).expect("apply");
        }
        let (v, w) = (direct.params.flat_values().expect("weights"), graph.params.flat_values().expect("weights"));
        close(&format!("{what}: weights and running statistics after two steps"), &v, &w, tolerance);
    }
}

/// Three steps of DIN on a pool of `threads`, its histories laid out
/// each of the three ways.
fn trained(case: Case, threads: usize) -> Run {
    let mut rng = Rng::new(37);
    let step = |model: &DenseModel, step: u64| {
        let layout = [Layout::InRowOrder, Layout::Reversed, Layout::FirstHalfOnly][step as usize];
        let draw = (case.2 > 0.0).then_some(70 + step);
        (batch(rows(model), model.heads().tasks(), layout, &mut rng), draw)
    };
    halves_common::trained(threads, || model(case), step)
}

#[test]
fn din_halves_give_the_same_bits_on_pools_of_one_two_and_three() {
    for case in [CASES[0], CASES[1], CASES[3], CASES[7], CASES[8]] {
        let one = trained(case, 1);
        for threads in [2, 3] {
            assert_same_bits(&format!("{case:?}, {threads} threads"), &one, &trained(case, threads));
        }
    }
}
