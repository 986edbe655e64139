//! What the tests of a batch run in halves share (`a_batch_in_halves.rs`,
//! `din_in_halves.rs`): a few steps trained on a pool of a given number of
//! threads, and the check that two such runs have the same bits.

use sparrow_core::config::DenseOptimizerConfig;
use sparrow_core::rng::Rng;
use sparrow_model::{DenseModel, DenseOptimizer, StepOutput};

/// One step's inputs: embeddings, dense values, labels, weights and,
/// for a kind that attends, the history sequences.
pub struct Batch {
    pub emb: Vec<f32>,
    pub dense: Vec<f32>,
    pub labels: Vec<f32>,
    pub weights: Vec<f32>,
    pub sequences: Option<sparrow_model::Sequences>,
}

/// A batch of `rows` without sequences: `width` pooled values and `dense`
/// dense values a row, labels of `tasks` tasks (every fifth masked, the
/// third task's a class of three) and sample weights.
pub fn batch(rows: usize, tasks: usize, (width, dense): (usize, usize), rng: &mut Rng) -> Batch {
    let emb = (0..rows * width).map(|_| rng.uniform(-0.6, 0.6) as f32).collect();
    let dense = (0..rows * dense).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
    let labels = (0..rows * tasks)
        .map(|i| match (i % tasks, i % 5) {
            (_, 3) => f32::NAN,
            (2, _) => (rng.next_u64() % 3) as f32,
            _ => (rng.next_u64() % 2) as f32,
        })
        .collect();
    let weights = (0..rows).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
    Batch { emb, dense, labels, weights, sequences: None }
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Each step's output and the weights after.
pub type Run = (Vec<StepOutput>, Vec<f32>);

/// Three steps of the model `make` builds, on a pool of `threads`, Adam
/// applied after each; `step(model, i)` gives step `i`'s batch and dropout draw.
pub fn trained(
    threads: usize,
    make: impl FnOnce() -> DenseModel + Send,
    mut step: impl FnMut(&DenseModel, u64) -> (Batch, Option<u64>) + Send,
) -> Run {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
    pool.install(|| {
        let model = make();
        let mut optimizer = DenseOptimizer::new(DenseOptimizerConfig::default(), Default::default());
        let mut outputs = Vec::new();
        for i in 0..3 {
            let (b, draw) = step(&model, i);
            let seq = b.sequences.as_ref();
            let (out, grads) =
                model.forward_backward_with(b.emb, b.dense, &b.labels, Some(&b.weights), seq, draw).expect("step");
            optimizer.apply(&model.params, grads).expect("apply");
            outputs.push(out);
        }
        (outputs, model.params.flat_values().expect("weights"))
    })
}

/// Two runs' bits are the same: each step's loss, logits, pooled and
/// history items' gradients, and the weights after.
pub fn assert_same_bits(what: &str, (one, weights_one): &Run, (other, weights_other): &Run) {
    for (step, (a, b)) in one.iter().zip(other).enumerate() {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: loss at step {step}");
        assert_eq!(bits(&a.logits), bits(&b.logits), "{what}: logits at step {step}");
        assert_eq!(bits(&a.emb_grad), bits(&b.emb_grad), "{what}: d pooled at step {step}");
        assert_eq!(a.item_grads.len(), b.item_grads.len(), "{what}: sequences at step {step}");
        for (x, y) in a.item_grads.iter().zip(&b.item_grads) {
            assert_eq!(bits(x), bits(y), "{what}: d history items at step {step}");
        }
    }
    assert_eq!(bits(weights_one), bits(weights_other), "{what}: the weights");
}
