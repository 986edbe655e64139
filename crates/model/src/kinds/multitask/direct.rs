//! The multi-task kinds' direct CPU step: the same math as their graph
//! (`multitask.rs`) and its autograd (tested), outside candle's graph. On
//! the graph each expert, gate, softmax, stack and weighted sum was an op
//! allocating a batch-sized tensor each way, and at the sizes these kinds
//! run (experts of 64 units on a batch of 256) those costs were most of the
//! step. Here:
//! - the experts of a level run side by side (rayon), each its fused MLP
//!   on buffers kept between steps (bf16 as `model.precision` says);
//! - a gate is one product (fp32 whatever the precision: `gates_arith`); then
//!   every gate's softmax and weighted sum of its experts are one pass
//!   over the rows (`gates.rs`);
//! - backward, every gate's softmax adjoint and the experts' output
//!   gradients are one pass; the experts' backward passes run side by
//!   side; each input's gradient is its parts summed in one pass;
//! - the towers run side by side, each task's seed its columns of the
//!   logits' (ESMM: through logit(σ(a)·σ(b))); ESMM's, which read one
//!   input, take their first layers' products as one each way
//!   (`one_input_towers.rs`);
//! - on a half of a batch (`models/halves.rs`), batch-normed experts and
//!   towers meet the other half's at their statistics (`meet.rs`): a
//!   level's experts run one after another on the half's thread, each up
//!   to its meeting, and the halves meet once for all of them
//!   (`meet::side_by_side`); without batch norm they take the pool side by
//!   side, as on a whole batch.
//!
//! Every buffer is summed in a fixed order, so the step's bits do not
//! depend on the threads.

use rayon::prelude::*;

use super::{Level, MultiTask, Which, gates, gates_arith, one_input_gates, one_input_towers};
use crate::ModelError;
use crate::bf16::{Arith, PackedLeft, Read};
use crate::kinds::{At, Direct, Grads, Met};
use crate::matrix::Operand;
use crate::meet::{self, Side};
use crate::mlp::{First, Mlp, MlpScratch, cpu, linear_grads, matmul, sized};
use crate::params::Linear;
use crate::step::Scratch;

/// One level's buffers.
#[derive(Default)]
struct LevelBufs {
    /// Each expert's, in [`Level::experts`]' order.
    experts: Vec<MlpScratch>,
    /// Each gate's softmax weights `[rows, K]`, in [`Level::gates`]' order.
    weights: Vec<Vec<f32>>,
    /// Each gate's mix `[rows, width]`: the next level's inputs (the towers'
    /// at the top), the tasks' then the shared one.
    mixes: Vec<Vec<f32>>,
    /// Backward: d loss / d each expert's output.
    d_experts: Vec<Vec<f32>>,
}

/// The multi-task kinds' buffers, kept between steps (`Scratch::of_kind`).
#[derive(Default)]
pub(super) struct MultiScratch {
    levels: Vec<LevelBufs>,
    towers: Vec<MlpScratch>,
    /// Each tower's seed, its task's columns of the logits' seed.
    tower_seeds: Vec<Vec<f32>>,
    /// Backward, at a level's inputs: d loss / d each task's input, then
    /// the shared one's; the level below's, being summed.
    d_inputs: Vec<Vec<f32>>,
    d_below: Vec<Vec<f32>>,
    /// Each gate's d loss / d logits, and its input gradient.
    d_logits: Vec<Vec<f32>>,
    d_gate_in: Vec<Vec<f32>>,
    /// ESMM: each row's d ctcvr / d a and d b, from the forward pass (the
    /// backward pass computed the three exponentials again).
    ctcvr_slopes: Vec<(f32, f32)>,
    /// A level's gates that read one input, side by side.
    gates: one_input_gates::SideBySide,
    /// Buffers for the inputs several experts read, packed once (`pack_shared`).
    packed_spare: Vec<Vec<u32>>,
    /// ESMM's towers, which read one input: their first products side by side.
    one_input_towers: one_input_towers::OneInputTowers,
}

impl Level {
    /// Its experts: the shared ones, then each task's own, task by task.
    fn experts(&self) -> impl Iterator<Item = &Mlp> {
        self.shared.iter().chain(self.own.iter().flatten())
    }

    /// Its gates: each task's, then the shared one.
    fn gates(&self) -> impl Iterator<Item = &Linear> {
        self.gates.iter().chain(&self.shared_gate)
    }

    /// The input each expert reads: `tasks` for the shared ones (the shared input), a task's own.
    fn expert_inputs(&self, tasks: usize) -> Vec<usize> {
        let own = self.own.iter().enumerate().flat_map(|(t, es)| std::iter::repeat_n(t, es.len()));
        std::iter::repeat_n(tasks, self.shared.len()).chain(own).collect()
    }

    /// The experts gate `g` mixes, as indices into [`experts`](Self::experts):
    /// a task's gate its own then the shared ones, the shared gate all of them.
    fn pool(&self, g: usize) -> Vec<usize> {
        let shared = self.shared.len();
        if g < self.gates.len() {
            let own_start = shared + self.own.iter().take(g).map(Vec::len).sum::<usize>();
            let own = self.own.get(g).map_or(0, Vec::len);
            (own_start..own_start + own).chain(0..shared).collect()
        } else {
            (0..shared + self.own.iter().map(Vec::len).sum::<usize>()).collect()
        }
    }
}

/// `then` with each gate's weights as stored (`[fan_in, k]`) and its `k`
/// (its pool's size).
fn with_gate_weights<T>(
    gates: &[&Linear],
    pools: &[Vec<usize>],
    then: impl FnOnce(&[(&[f32], usize)]) -> T,
) -> Result<T, ModelError> {
    let stored: Vec<_> = gates.iter().map(|g| g.weight().storage_and_layout()).collect();
    let weights = (stored.iter().zip(pools))
        .map(|(w, pool)| Ok((cpu(&w.0, w.1)?, pool.len())))
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(then(&weights))
}

/// `logits = input·W` of a gate of `k` experts (its bias is added with its softmax).
fn gate_logits(
    arith: Arith,
    (input, rows): (&[f32], usize),
    (gate, k): (&Linear, usize),
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let fan_in = input.len() / rows.max(1);
    let ws = gate.weight().storage_and_layout();
    let w = cpu(&ws.0, ws.1)?;
    matmul(arith, None, rows, k, fan_in, Operand::plain(input), Operand::plain(w), sized(logits, rows * k));
    Ok(())
}

impl MultiTask {
    /// Each task's tower input and the shared one at level `l` (`x` at the bottom).
    fn level_inputs<'a>(&self, x: &'a [f32], below: &'a [LevelBufs], tasks: usize) -> Vec<&'a [f32]> {
        match below.last() {
            None => vec![x; tasks + 1],
            Some(prev) => (0..=tasks).map(|t| prev.mixes.get(t).map_or(x, |m| &m[..])).collect(),
        }
    }

    /// The levels' forward passes; on a half of a batch (`meet`), the
    /// experts' batch norm meets the other half's, every expert's at once.
    async fn forward_levels(
        &self,
        at: &At,
        (x, rows): (&[f32], usize),
        m: &mut MultiScratch,
        meet: Option<Side<'_>>,
    ) -> Result<(), ModelError> {
        let tasks = self.towers.len();
        m.levels.resize_with(self.levels.len(), LevelBufs::default);
        for (l, level) in self.levels.iter().enumerate() {
            let (below, rest) = m.levels.split_at_mut(l);
            let bufs = &mut rest[0];
            let inputs = self.level_inputs(x, below, tasks);
            let experts: Vec<&Mlp> = level.experts().collect();
            bufs.experts.resize_with(experts.len(), MlpScratch::default);
            let reads = level.expert_inputs(tasks);
            let rows_at = (rows, at.first_row);
            let spare = &mut m.packed_spare;
            let packed = pack_shared(self.arith, &experts, (&inputs, rows), (&reads, Read::Forward), spare);
            let passes = match meet {
                None => (experts.par_iter().zip(bufs.experts.par_iter_mut()).zip(reads.par_iter()))
                    .map(|((e, s), &i)| e.forward_laid_at(first_of(inputs[i], &packed), rows_at, at.dropout, s))
                    .collect::<Result<Vec<()>, _>>(),
                Some(meet) => {
                    let passes = (experts.iter().zip(bufs.experts.iter_mut()).zip(&reads)).map(|((e, s), &i)| {
                        e.forward_met(first_of(inputs[i], &packed), rows_at, (at.dropout, meet), s)
                    });
                    meet::side_by_side(passes.collect()).await
                }
            };
            spare.extend(packed.into_iter().map(|(_, p)| p.into_buffer()));
            passes?;
            let gates: Vec<&Linear> = level.gates().collect();
            bufs.weights.resize_with(gates.len(), Vec::new);
            bufs.mixes.resize_with(gates.len(), Vec::new);
            let width = experts[0].outputs();
            let pools: Vec<Vec<usize>> = (0..gates.len()).map(|g| level.pool(g)).collect();
            let gate_inputs: Vec<&[f32]> = (0..gates.len()).map(|g| inputs[g.min(tasks)]).collect();
            let ks: Vec<usize> = pools.iter().map(Vec::len).collect();
            let fan_in = gate_inputs.first().map_or(0, |i| i.len() / rows.max(1));
            if one_input_gates::share_an_input(&gate_inputs)
                && one_input_gates::columns_alike(gates_arith(self.simd), (rows, fan_in, false), &ks)
            {
                let side = &mut m.gates;
                with_gate_weights(&gates, &pools, |weights| {
                    side.logits(gates_arith(self.simd), (gate_inputs[0], rows), weights, &mut bufs.weights)
                })?;
            } else {
                // Each gate's product is too small to split: the gates take
                // turns on the threads instead.
                (gates.par_iter().zip(bufs.weights.par_iter_mut()).enumerate())
                    .map(|(g, (gate, logits))| {
                        gate_logits(gates_arith(self.simd), (gate_inputs[g], rows), (gate, pools[g].len()), logits)
                    })
                    .collect::<Result<Vec<()>, _>>()?;
            }
            let biases = gates.iter().map(|g| g.bias().storage_and_layout()).collect::<Vec<_>>();
            let outs: Vec<&[f32]> = bufs.experts.iter().map(|s| &s.output[..]).collect();
            let mut forward = Vec::with_capacity(gates.len());
            for (((logits, mix), pool), b) in
                bufs.weights.iter_mut().zip(bufs.mixes.iter_mut()).zip(&pools).zip(&biases)
            {
                let mix = sized(mix, rows * width);
                forward.push(gates::GateForward { logits, bias: cpu(&b.0, b.1)?, pool, mix });
            }
            gates::softmax_mix(self.simd, &outs, width, forward);
        }
        Ok(())
    }

    /// Each gate's own layer, a gate at a time (the gates read inputs of
    /// their own): `dW = inᵀ·d logits`, `db = Σ_rows d logits` and `d in =
    /// d logits·Wᵀ` into `d_gate_in`.
    fn gate_grads(
        &self,
        gates: &[&Linear],
        (inputs, rows): (&[&[f32]], usize),
        pools: &[Vec<usize>],
        (d_logits, d_gate_in): (&[Vec<f32>], &mut [Vec<f32>]),
    ) -> Result<Vec<one_input_gates::GateGrads>, ModelError> {
        (gates.par_iter().zip(d_gate_in.par_iter_mut()).enumerate())
            .map(|(g, (gate, d_gate_in))| {
                let (k, input) = (pools[g].len(), inputs[g]);
                let fan_in = input.len() / rows.max(1);
                let gw = gate.weight().storage_and_layout();
                let gw = cpu(&gw.0, gw.1)?;
                let (mut dw, mut db) = (vec![0.0f32; fan_in * k], vec![0.0f32; k]);
                let d_gate_in = sized(d_gate_in, rows * fan_in);
                let arith = (gates_arith(self.simd), self.simd);
                linear_grads(arith, (rows, fan_in, k), (input, None), gw, &d_logits[g], (&mut dw, &mut db), d_gate_in);
                Ok((dw, db))
            })
            .collect()
    }

    /// d loss / d each input of the levels, from the top's mixes' gradients
    /// in `m.d_inputs`; the bottom's summed into `grad_x`.
    async fn backward_levels<'a>(
        &'a self,
        (x, rows): (&[f32], usize),
        m: &mut MultiScratch,
        grad_x: &mut Vec<f32>,
        grads: &mut Grads<'a>,
        meet: Option<Side<'_>>,
    ) -> Result<(), ModelError> {
        let tasks = self.towers.len();
        for (l, level) in self.levels.iter().enumerate().rev() {
            let (below, rest) = m.levels.split_at_mut(l);
            let bufs = &mut rest[0];
            let inputs = self.level_inputs(x, below, tasks);
            let fan_in = inputs[0].len() / rows.max(1);
            let experts: Vec<&Mlp> = level.experts().collect();
            let width = experts[0].outputs();
            let gates: Vec<&Linear> = level.gates().collect();
            let pools: Vec<Vec<usize>> = (0..gates.len()).map(|g| level.pool(g)).collect();
            // Every gate's d logits and the experts' output gradients, one pass.
            bufs.d_experts.resize_with(experts.len(), Vec::new);
            m.d_logits.resize_with(gates.len(), Vec::new);
            let outs: Vec<&[f32]> = bufs.experts.iter().map(|s| &s.output[..]).collect();
            // The adjoint takes each expert's gradient through its last ReLU.
            let masks: Vec<Option<f32>> = experts.iter().zip(&bufs.experts).map(|(e, s)| e.output_mask(s)).collect();
            let backward = (m.d_logits.iter_mut().zip(&pools).enumerate())
                .map(|(g, (d_logits, pool))| gates::GateBackward {
                    weights: &bufs.weights[g],
                    d_mix: &m.d_inputs[g],
                    pool,
                    d_logits: sized(d_logits, rows * pool.len()),
                })
                .collect();
            let pooled = gates::adjoint(self.simd, (&outs, &masks), width, backward, &mut bufs.d_experts);
            // An expert no gate mixes (none today) has no gradient: zeros.
            for (d, _) in bufs.d_experts.iter_mut().zip(&pooled).filter(|(_, p)| !**p) {
                d.clear();
                d.resize(rows * width, 0.0);
            }
            // Each gate's own layer: dW = inᵀ·d logits, db = Σ_rows d logits, d in = d logits·Wᵀ.
            m.d_gate_in.resize_with(gates.len(), Vec::new);
            let gate_inputs: Vec<&[f32]> = (0..gates.len()).map(|g| inputs[g.min(tasks)]).collect();
            let ks: Vec<usize> = pools.iter().map(Vec::len).collect();
            let gate_grads = if one_input_gates::share_an_input(&gate_inputs)
                && one_input_gates::columns_alike(gates_arith(self.simd), (fan_in, rows, true), &ks)
            {
                let (input, arith) = ((gate_inputs[0], rows), (gates_arith(self.simd), self.simd));
                let (side, d_logits, d_gate_in) = (&mut m.gates, &mut m.d_logits, &mut m.d_gate_in);
                with_gate_weights(&gates, &pools, |weights| side.grads(arith, input, weights, d_logits, d_gate_in))?
            } else {
                self.gate_grads(&gates, (&gate_inputs, rows), &pools, (&m.d_logits, &mut m.d_gate_in))?
            };
            for (gate, (dw, db)) in gates.iter().zip(gate_grads) {
                grads.push((gate.weight(), dw));
                grads.push((gate.bias(), db));
            }
            let reads = level.expert_inputs(tasks);
            let spare = &mut m.packed_spare;
            let packed = pack_shared(self.arith, &experts, (&inputs, rows), (&reads, Read::WeightGrads), spare);
            let expert_grads = match meet {
                None => (experts.par_iter().zip(bufs.experts.par_iter_mut()).zip(bufs.d_experts.par_iter()))
                    .zip(reads.par_iter().zip(&pooled))
                    .map(|(((e, s), d), (&i, &pooled))| {
                        let x = first_of(inputs[i], &packed);
                        match e.output_mask(s).is_some() && pooled {
                            true => e.backward_masked_laid(x, d, s),
                            false => e.backward_laid(x, (d, false), s),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>(),
                Some(meet) => {
                    let passes = (experts.iter().zip(bufs.experts.iter_mut()).zip(&bufs.d_experts).zip(&reads))
                        .zip(&pooled)
                        .map(|((((e, s), d), &i), &pooled)| {
                            let masked = e.output_mask(s).is_some() && pooled;
                            e.backward_met(first_of(inputs[i], &packed), (d, masked), s, meet)
                        });
                    meet::side_by_side(passes.collect()).await
                }
            };
            spare.extend(packed.into_iter().map(|(_, p)| p.into_buffer()));
            let expert_grads = expert_grads?;
            for (e, g) in experts.iter().zip(expert_grads) {
                grads.push((e.params(), g));
            }
            // At the level's inputs (the tasks', then the shared one): the
            // gradients of the gates that read each, then of its experts.
            let mut parts: Vec<Vec<&[f32]>> = vec![Vec::new(); tasks + 1];
            for (g, d) in m.d_gate_in.iter().take(gates.len()).enumerate() {
                parts[if g < tasks { g } else { tasks }].push(d);
            }
            for (s, &i) in bufs.experts.iter().zip(&reads) {
                parts[i].push(&s.grad_input);
            }
            if l == 0 {
                // At the bottom every input is `x`: its gradient is their sum.
                gates::sum_of_sums_into(self.simd, grad_x, x.len(), &parts);
            } else {
                let mut d_in = std::mem::take(&mut m.d_below);
                d_in.resize_with(tasks + 1, Vec::new);
                for (d, parts) in d_in.iter_mut().zip(&parts) {
                    gates::sum_into(self.simd, d, rows * fan_in, parts);
                }
                m.d_below = std::mem::replace(&mut m.d_inputs, d_in);
            }
        }
        Ok(())
    }
}

/// Each input that more than one of a level's experts read
/// (`inputs[reads[e]]`, `[rows, ·]`; one slice may stand for several
/// inputs, each is `x` at the bottom), packed once for their first layers'
/// bf16 products read as `read` (`bf16/lent.rs`), into buffers from
/// `spare`: MMoE's four experts packed `x` four times each way. None in
/// fp32, or where the products would not pack it.
fn pack_shared<'a>(
    arith: Arith,
    experts: &[&Mlp],
    (inputs, rows): (&[&'a [f32]], usize),
    (reads, read): (&[usize], Read),
    spare: &mut Vec<Vec<u32>>,
) -> Vec<(&'a [f32], PackedLeft)> {
    let Arith::Bf16(path) = arith else { return Vec::new() };
    let mut packed: Vec<(&[f32], PackedLeft)> = Vec::new();
    for (e, &i) in reads.iter().enumerate() {
        let x = inputs[i];
        let readers = reads.iter().filter(|&&j| std::ptr::eq(inputs[j], x)).count();
        if readers < 2 || packed.iter().any(|(y, _)| std::ptr::eq(*y, x)) {
            continue;
        }
        // The experts reading one input have one shape (`model.expert_hidden`).
        let Some((_, _, n)) = experts[e].first_weights() else { continue };
        match crate::bf16::pack_once(path, (x, rows), (read, n), spare.pop().unwrap_or_default()) {
            Ok(p) => packed.push((x, p)),
            Err(buf) => spare.push(buf),
        }
    }
    packed
}

/// An expert's input `x`, with its pairs where [`pack_shared`] packed it.
fn first_of<'b>(x: &'b [f32], packed: &'b [(&[f32], PackedLeft)]) -> First<'b> {
    match packed.iter().find(|(y, _)| std::ptr::eq(*y, x)) {
        Some((_, p)) => First::Packed(x, p),
        None => First::Input(x),
    }
}

/// ESMM's second logit, logit(σ(a)·σ(b)) = −log(e^{−a} + e^{−b} + e^{−a−b}),
/// as the graph computes it, and its derivatives in a and b.
fn ctcvr(a: f32, b: f32) -> (f32, (f32, f32)) {
    let z = [-a, -b, -a - b];
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    // e⁰ is 1 exactly: the largest term's exponential is not taken.
    let e = z.map(|z| if z == max && max.is_finite() { 1.0 } else { (z - max).exp() });
    let sum = e[0] + e[1] + e[2];
    (-(sum.ln() + max), ((e[0] + e[2]) / sum, (e[1] + e[2]) / sum))
}

impl MultiTask {
    /// Whether the towers read `x` (ESMM's, there being no experts) and
    /// take their first products side by side (`one_input_towers.rs`).
    fn towers_read_x(&self) -> bool {
        self.levels.is_empty() && one_input_towers::applies(&self.towers)
    }
}

impl MultiTask {
    /// Whether any of its stacks reads statistics of the batch (batch
    /// norm, Dice): on a half of a batch, those meet the other half's (a
    /// stack without meets no one, and its experts take the pool side by
    /// side).
    fn batch_statistics(&self) -> bool {
        let mut mlps = self.levels.iter().flat_map(Level::experts).chain(&self.towers);
        mlps.any(Mlp::batch_statistics)
    }

    /// The forward pass: the logits. On a half of a batch (`meet`) the
    /// stacks' batch norm meets the other half's: every expert of a level
    /// at once, then every tower (ESMM's, which read one input, one by one).
    async fn forward_with(
        &self,
        at: &At,
        (x, rows): (&[f32], usize),
        s: &mut Scratch,
        meet: Option<Side<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        let meet = meet.filter(|_| self.batch_statistics());
        let m: &mut MultiScratch = s.of_kind();
        self.forward_levels(at, (x, rows), m, meet).await?;
        let tasks = self.towers.len();
        m.towers.resize_with(tasks, MlpScratch::default);
        let inputs: Vec<&[f32]> = match m.levels.last() {
            Some(top) => top.mixes.iter().take(tasks).map(|v| &v[..]).collect(),
            None => vec![x; tasks],
        };
        let rows_at = (rows, at.first_row);
        if self.towers_read_x() {
            let draw = (at.dropout, self.simd);
            m.one_input_towers.forward(&self.towers, (x, rows_at), draw, &mut m.towers, meet).await?;
        } else if let Some(meet) = meet {
            let passes = (self.towers.iter().zip(m.towers.iter_mut()).zip(&inputs))
                .map(|((t, s), x)| t.forward_met(First::Input(x), rows_at, (at.dropout, meet), s));
            meet::side_by_side(passes.collect()).await?;
        } else {
            self.towers
                .par_iter()
                .zip(m.towers.par_iter_mut())
                .zip(inputs.par_iter())
                .map(|((t, s), x)| t.forward_cpu_at(x, rows_at, at.dropout, s))
                .collect::<Result<Vec<()>, _>>()?;
        }
        if self.which == Which::Esmm {
            let (a, b) = (&m.towers[0].output, &m.towers[1].output);
            m.ctcvr_slopes.clear();
            let mut logits = Vec::with_capacity(2 * rows);
            for (&a, &b) in a.iter().zip(b) {
                let (logit, slopes) = ctcvr(a, b);
                logits.extend([a, logit]);
                m.ctcvr_slopes.push(slopes);
            }
            return Ok(logits);
        }
        let outputs: usize = self.towers.iter().map(Mlp::outputs).sum();
        let mut logits = vec![0.0f32; rows * outputs];
        let mut offset = 0;
        for (tower, s) in self.towers.iter().zip(&m.towers) {
            let o = tower.outputs();
            for (row, out) in logits.chunks_exact_mut(outputs).zip(s.output.chunks_exact(o)) {
                gates::copy_few(&mut row[offset..offset + o], out);
            }
            offset += o;
        }
        Ok(logits)
    }

    /// The backward pass of the last [`forward_with`](Self::forward_with),
    /// meeting where it met: the dense gradients.
    async fn backward_with<'a>(
        &'a self,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        meet: Option<Side<'_>>,
    ) -> Result<Grads<'a>, ModelError> {
        let meet = meet.filter(|_| self.batch_statistics());
        let mut grads = Vec::new();
        let mut grad_x = std::mem::take(&mut s.grad_x);
        let m: &mut MultiScratch = s.of_kind();
        let tasks = self.towers.len();
        let outputs: usize = self.towers.iter().map(Mlp::outputs).sum();
        let rows = seed.len() / outputs.max(1);
        m.tower_seeds.resize_with(tasks, Vec::new);
        if self.which == Which::Esmm {
            let (a, b) = (&m.towers[0].output, &m.towers[1].output);
            let (da, db) = m.tower_seeds.split_at_mut(1);
            let (da, db) = (sized(&mut da[0], rows), sized(&mut db[0], rows));
            // The forward pass's slopes where they are this batch's rows.
            let kept = m.ctcvr_slopes.len() == rows;
            for (r, s) in seed.chunks_exact(2).enumerate() {
                let (d_a, d_b) = match kept {
                    true => m.ctcvr_slopes[r],
                    false => ctcvr(a[r], b[r]).1,
                };
                da[r] = s[0] + s[1] * d_a;
                db[r] = s[1] * d_b;
            }
        } else {
            let mut offset = 0;
            for (tower, ts) in self.towers.iter().zip(m.tower_seeds.iter_mut()) {
                let o = tower.outputs();
                ts.clear();
                ts.extend(seed.chunks_exact(outputs).flat_map(|row| &row[offset..offset + o]));
                offset += o;
            }
        }
        let inputs: Vec<&[f32]> = match m.levels.last() {
            Some(top) => top.mixes.iter().take(tasks).map(|v| &v[..]).collect(),
            None => vec![x; tasks],
        };
        let side_by_side = self.towers_read_x();
        let tower_grads = if side_by_side {
            // d x is every tower's, summed in their products side by side.
            let seeds = (&m.tower_seeds[..], self.simd);
            m.one_input_towers.backward(&self.towers, (x, rows), seeds, (&mut m.towers, &mut grad_x), meet).await?
        } else if let Some(meet) = meet {
            let passes = (self.towers.iter().zip(m.towers.iter_mut()).zip(&m.tower_seeds).zip(&inputs))
                .map(|(((t, s), seed), x)| t.backward_met(First::Input(x), (seed, false), s, meet));
            meet::side_by_side(passes.collect()).await?
        } else {
            self.towers
                .par_iter()
                .zip(m.towers.par_iter_mut())
                .zip(m.tower_seeds.par_iter())
                .zip(inputs.par_iter())
                .map(|(((t, s), seed), x)| t.backward_cpu(x, seed, s))
                .collect::<Result<Vec<_>, _>>()?
        };
        for (t, g) in self.towers.iter().zip(tower_grads) {
            grads.push((t.params(), g));
        }
        if self.levels.is_empty() && !side_by_side {
            // ESMM: both towers read x; their gradients summed in one pass.
            let (a, b) = (&m.towers[0].grad_input, &m.towers[1].grad_input);
            grad_x.clear();
            grad_x.extend(a.iter().zip(b).map(|(a, b)| a + b));
        } else if !self.levels.is_empty() {
            // The top level's mixes are the towers' inputs; it has no shared
            // mix. A buffer past the tasks' (the shared input's gradient
            // of the step before) stays, unread here, for the level below
            // to refill: dropped, it was allocated and zeroed again a step.
            if m.d_inputs.len() < tasks {
                m.d_inputs.resize_with(tasks, Vec::new);
            }
            // Taken, not copied: the tower's next backward pass refills
            // the buffer it gets back.
            for (d, t) in m.d_inputs.iter_mut().zip(&mut m.towers) {
                std::mem::swap(d, &mut t.grad_input);
            }
            self.backward_levels((x, rows), m, &mut grad_x, &mut grads, meet).await?;
        }
        s.grad_x = grad_x;
        Ok(grads)
    }
}

impl Direct for MultiTask {
    fn forward_met<'a>(
        &'a self,
        at: &'a At,
        input: (&'a [f32], usize),
        s: &'a mut Scratch,
        meet: Option<Side<'a>>,
    ) -> Met<'a, Vec<f32>> {
        Box::pin(self.forward_with(at, input, s, meet))
    }

    fn backward_met<'a: 'b, 'b>(
        &'a self,
        _at: &'b At,
        (x, seed): (&'b [f32], &'b [f32]),
        s: &'b mut Scratch,
        meet: Option<Side<'b>>,
    ) -> Met<'b, Grads<'a>> {
        Box::pin(self.backward_with(x, seed, s, meet))
    }

    /// Its stacks' batch norm and Dice's statistics meet across the
    /// halves (`meet.rs`).
    fn meets_statistics(&self) -> bool {
        true
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        let m: &mut MultiScratch = s.of_kind();
        let experts =
            self.levels.iter().zip(m.levels.iter_mut()).flat_map(|(l, b)| l.experts().zip(b.experts.iter_mut()));
        experts.chain(self.towers.iter().zip(m.towers.iter_mut())).collect()
    }

    fn several_outputs(&self) -> bool {
        true
    }

    /// Experts of 64 and towers of 32 units on a batch of 1024: each pass
    /// is 10–100 µs, too short to split across threads one by one (a
    /// wake-up each), so the batch's halves take a thread each instead,
    /// where a half has the work to pay for waking the other thread twice
    /// a step (`kinds::half_rows_for`).
    fn half_rows(&self) -> Option<usize> {
        let mlps = || self.levels.iter().flat_map(Level::experts).chain(&self.towers);
        let gates = self.levels.iter().flat_map(Level::gates).map(|g| g.weight().elem_count());
        let weights: usize = mlps().map(|m| m.params().elem_count()).chain(gates).sum();
        // A weight's multiply-add a row forward, two backward.
        let flops_per_row = 6 * weights.max(1);
        Some(crate::kinds::half_rows_for(flops_per_row))
    }
}
