//! The multi-task kinds' direct CPU step: the same math as their graph
//! (`multitask.rs`) and its autograd (tested), outside candle's graph. On
//! the graph each expert, gate, softmax, stack and weighted sum was an op
//! allocating a batch-sized tensor each way, and at the sizes these kinds
//! run (experts of 64 units on a batch of 256) those costs were most of the
//! step. Here:
//! - the experts of a level run side by side (rayon), each its fused MLP
//!   on buffers kept between steps (bf16 as `model.precision` says);
//! - a gate is one product, then its softmax and the weighted sum of its
//!   experts in one pass over a row;
//! - backward, a gate's softmax adjoint and the experts' output gradients
//!   are one pass each; the experts' backward passes run side by side;
//! - the towers run side by side, each task's seed its columns of the
//!   logits' (ESMM: through logit(σ(a)·σ(b))).
//!
//! Every buffer is summed in a fixed order, so the step's bits do not
//! depend on the threads.

use rayon::prelude::*;

use super::{Level, MultiTask, Which};
use crate::ModelError;
use crate::bf16::Arith;
use crate::kinds::{At, Direct, Grads};
use crate::matrix::{Operand, dot};
use crate::mlp::{Mlp, MlpScratch, cpu, linear_grads, matmul, sized};
use crate::params::Linear;
use crate::step::Scratch;

/// Rows a task of an element-wise pass takes (as the MLP's).
const ROWS_PER_TASK: usize = 64;

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
    /// A gate's d loss / d logits, and its input gradient.
    d_logits: Vec<f32>,
    d_gate_in: Vec<f32>,
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

/// `weights = softmax(input·W + b)` a row, then `mix = Σ_k weights_k · pooled_k`.
fn gate_forward(
    arith: Arith,
    (input, fan_in): (&[f32], usize),
    gate: &Linear,
    pooled: &[&[f32]],
    width: usize,
    (weights_out, mix): (&mut Vec<f32>, &mut Vec<f32>),
) -> Result<(), ModelError> {
    let rows = input.len() / fan_in.max(1);
    let k = pooled.len();
    // Read where candle stores them (the guards held to the end).
    let (ws, bs) = (gate.weight().storage_and_layout(), gate.bias().storage_and_layout());
    let (w, b) = (cpu(&ws.0, ws.1)?, cpu(&bs.0, bs.1)?);
    let logits = sized(weights_out, rows * k);
    matmul(arith, None, rows, k, fan_in, Operand::plain(input), Operand::plain(w), logits);
    let mix = sized(mix, rows * width);
    logits.par_chunks_mut(k * ROWS_PER_TASK).zip(mix.par_chunks_mut(width * ROWS_PER_TASK)).enumerate().for_each(
        |(chunk, (logits, mix))| {
            for (i, (g, m)) in logits.chunks_exact_mut(k).zip(mix.chunks_exact_mut(width)).enumerate() {
                let r = chunk * ROWS_PER_TASK + i;
                // As the graph: bias, less the row's max, exp, over the sum.
                g.iter_mut().zip(b).for_each(|(g, b)| *g += b);
                let max = g.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                g.iter_mut().for_each(|v| *v = (*v - max).exp());
                let sum: f32 = g.iter().sum();
                g.iter_mut().for_each(|v| *v /= sum);
                m.fill(0.0);
                for (&wk, e) in g.iter().zip(pooled) {
                    m.iter_mut().zip(&e[r * width..(r + 1) * width]).for_each(|(m, e)| *m += wk * e);
                }
            }
        },
    );
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

    fn forward_levels(
        &self,
        x: &[f32],
        rows: usize,
        draw: Option<u64>,
        m: &mut MultiScratch,
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
            experts
                .par_iter()
                .zip(bufs.experts.par_iter_mut())
                .zip(reads.par_iter())
                .map(|((e, s), &i)| e.forward_cpu(inputs[i], rows, draw, s))
                .collect::<Result<Vec<()>, _>>()?;
            let gates: Vec<&Linear> = level.gates().collect();
            bufs.weights.resize_with(gates.len(), Vec::new);
            bufs.mixes.resize_with(gates.len(), Vec::new);
            for (g, gate) in gates.iter().enumerate() {
                let input = inputs[if g < tasks { g } else { tasks }];
                let pooled: Vec<&[f32]> = level.pool(g).iter().map(|&e| &bufs.experts[e].output[..]).collect();
                let width = experts[0].outputs();
                let (w, mix) = (&mut bufs.weights[g], &mut bufs.mixes[g]);
                gate_forward(self.arith, (input, input.len() / rows.max(1)), gate, &pooled, width, (w, mix))?;
            }
        }
        Ok(())
    }

    /// d loss / d each input of the levels, from the top's mixes' gradients
    /// in `m.d_inputs`; the bottom's summed into `grad_x`.
    fn backward_levels<'a>(
        &'a self,
        x: &[f32],
        rows: usize,
        m: &mut MultiScratch,
        grad_x: &mut Vec<f32>,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let tasks = self.towers.len();
        for (l, level) in self.levels.iter().enumerate().rev() {
            let (below, rest) = m.levels.split_at_mut(l);
            let bufs = &mut rest[0];
            let inputs = self.level_inputs(x, below, tasks);
            let fan_in = inputs[0].len() / rows.max(1);
            // At the level's inputs: the tasks', then the shared one. Each
            // buffer's first contribution is copied in, the rest added: no
            // zero-filled buffer to add into (6% of MMoE's bf16 step).
            let mut d_in = std::mem::take(&mut m.d_below);
            d_in.resize_with(tasks + 1, Vec::new);
            let mut d_in_filled = vec![false; tasks + 1];
            let experts: Vec<&Mlp> = level.experts().collect();
            let width = experts[0].outputs();
            bufs.d_experts.resize_with(experts.len(), Vec::new);
            let mut d_experts_filled = vec![false; experts.len()];
            for (g, gate) in level.gates().enumerate() {
                let d_mix = &m.d_inputs[g];
                let pool = level.pool(g);
                let k = pool.len();
                let w = &bufs.weights[g];
                // d logits = w ⊙ (d w − Σ_j w_j d w_j), d w_k = ⟨d mix, expert_k⟩.
                let d_logits = sized(&mut m.d_logits, rows * k);
                let outs: Vec<&[f32]> = pool.iter().map(|&e| &bufs.experts[e].output[..]).collect();
                d_logits.par_chunks_mut(k * ROWS_PER_TASK).enumerate().for_each(|(chunk, dl)| {
                    for (i, dl) in dl.chunks_exact_mut(k).enumerate() {
                        let r = chunk * ROWS_PER_TASK + i;
                        let dy = &d_mix[r * width..(r + 1) * width];
                        for (d, e) in dl.iter_mut().zip(&outs) {
                            *d = dot(dy, &e[r * width..(r + 1) * width]);
                        }
                        let wr = &w[r * k..(r + 1) * k];
                        let s: f32 = wr.iter().zip(dl.iter()).map(|(w, d)| w * d).sum();
                        dl.iter_mut().zip(wr).for_each(|(d, w)| *d = w * (*d - s));
                    }
                });
                // d expert_k += w_k · d mix, each expert's buffer on its own.
                let mut targets: Vec<(usize, &mut Vec<f32>, &mut bool)> = bufs
                    .d_experts
                    .iter_mut()
                    .zip(d_experts_filled.iter_mut())
                    .enumerate()
                    .filter_map(|(e, (d, filled))| pool.iter().position(|&p| p == e).map(|j| (j, d, filled)))
                    .collect();
                targets.par_iter_mut().for_each(|(j, d, filled)| {
                    if !**filled {
                        sized(d, rows * width);
                    }
                    for (r, d) in d.chunks_exact_mut(width).enumerate() {
                        let wk = w[r * k + *j];
                        let g = d_mix[r * width..(r + 1) * width].iter();
                        if **filled {
                            d.iter_mut().zip(g).for_each(|(d, g)| *d += wk * g);
                        } else {
                            d.iter_mut().zip(g).for_each(|(d, g)| *d = wk * g);
                        }
                    }
                    **filled = true;
                });
                // The gate's own layer: dW = inᵀ·d logits, db = Σ_rows d logits, d in = d logits·Wᵀ.
                let input = inputs[if g < tasks { g } else { tasks }];
                let gw = gate.weight().storage_and_layout();
                let gw = cpu(&gw.0, gw.1)?;
                let (mut dw, mut db) = (vec![0.0f32; fan_in * k], vec![0.0f32; k]);
                let d_gate_in = sized(&mut m.d_gate_in, rows * fan_in);
                linear_grads(self.arith, (rows, fan_in, k), input, gw, d_logits, (&mut dw, &mut db), d_gate_in);
                let at = if g < tasks { g } else { tasks };
                add_or_copy(&mut d_in[at], &mut d_in_filled[at], d_gate_in);
                grads.push((gate.weight(), dw));
                grads.push((gate.bias(), db));
            }
            // An expert no gate mixes (none today) has no gradient: zeros.
            for (d, filled) in bufs.d_experts.iter_mut().zip(&d_experts_filled) {
                if !filled {
                    d.clear();
                    d.resize(rows * width, 0.0);
                }
            }
            let reads = level.expert_inputs(tasks);
            let expert_grads = experts
                .par_iter()
                .zip(bufs.experts.par_iter_mut())
                .zip(bufs.d_experts.par_iter())
                .zip(reads.par_iter())
                .map(|(((e, s), d), &i)| e.backward_cpu(inputs[i], d, s))
                .collect::<Result<Vec<_>, _>>()?;
            for ((e, g), (s, &i)) in experts.iter().zip(expert_grads).zip(bufs.experts.iter().zip(&reads)) {
                grads.push((e.params(), g));
                add_or_copy(&mut d_in[i], &mut d_in_filled[i], &s.grad_input);
            }
            // An input nothing read (none today) has no gradient: zeros.
            for (d, filled) in d_in.iter_mut().zip(&d_in_filled) {
                if !filled {
                    d.clear();
                    d.resize(rows * fan_in, 0.0);
                }
            }
            m.d_below = std::mem::replace(&mut m.d_inputs, d_in);
        }
        // At the bottom every input is `x`: its gradient is their sum.
        grad_x.clear();
        grad_x.resize(rows * x.len() / rows.max(1), 0.0);
        for d in &m.d_inputs {
            grad_x.iter_mut().zip(d).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }
}

/// ESMM's second logit, logit(σ(a)·σ(b)) = −log(e^{−a} + e^{−b} + e^{−a−b}),
/// as the graph computes it, and its derivatives in a and b.
fn ctcvr(a: f32, b: f32) -> (f32, f32, f32) {
    let z = [-a, -b, -a - b];
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let e = z.map(|z| (z - max).exp());
    let sum = e[0] + e[1] + e[2];
    (-(sum.ln() + max), (e[0] + e[2]) / sum, (e[1] + e[2]) / sum)
}

impl Direct for MultiTask {
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        let m: &mut MultiScratch = s.of_kind();
        self.forward_levels(x, rows, at.dropout, m)?;
        let tasks = self.towers.len();
        m.towers.resize_with(tasks, MlpScratch::default);
        let inputs: Vec<&[f32]> = match m.levels.last() {
            Some(top) => top.mixes.iter().take(tasks).map(|v| &v[..]).collect(),
            None => vec![x; tasks],
        };
        self.towers
            .par_iter()
            .zip(m.towers.par_iter_mut())
            .zip(inputs.par_iter())
            .map(|((t, s), x)| t.forward_cpu(x, rows, at.dropout, s))
            .collect::<Result<Vec<()>, _>>()?;
        if self.which == Which::Esmm {
            let (a, b) = (&m.towers[0].output, &m.towers[1].output);
            return Ok(a.iter().zip(b).flat_map(|(&a, &b)| [a, ctcvr(a, b).0]).collect());
        }
        let outputs: usize = self.towers.iter().map(Mlp::outputs).sum();
        let mut logits = vec![0.0f32; rows * outputs];
        let mut offset = 0;
        for (tower, s) in self.towers.iter().zip(&m.towers) {
            let o = tower.outputs();
            for (row, out) in logits.chunks_exact_mut(outputs).zip(s.output.chunks_exact(o)) {
                row[offset..offset + o].copy_from_slice(out);
            }
            offset += o;
        }
        Ok(logits)
    }

    fn backward<'a>(
        &'a self,
        _at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
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
            for (r, s) in seed.chunks_exact(2).enumerate() {
                let (_, d_a, d_b) = ctcvr(a[r], b[r]);
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
        let tower_grads = self
            .towers
            .par_iter()
            .zip(m.towers.par_iter_mut())
            .zip(m.tower_seeds.par_iter())
            .zip(inputs.par_iter())
            .map(|(((t, s), seed), x)| t.backward_cpu(x, seed, s))
            .collect::<Result<Vec<_>, _>>()?;
        for (t, g) in self.towers.iter().zip(tower_grads) {
            grads.push((t.params(), g));
        }
        if self.levels.is_empty() {
            // ESMM: both towers read x.
            grad_x.clear();
            grad_x.extend_from_slice(&m.towers[0].grad_input);
            grad_x.iter_mut().zip(&m.towers[1].grad_input).for_each(|(a, b)| *a += b);
        } else {
            // The top level's mixes are the towers' inputs; it has no shared mix.
            m.d_inputs.resize_with(tasks, Vec::new);
            for (d, t) in m.d_inputs.iter_mut().zip(&m.towers) {
                d.clear();
                d.extend_from_slice(&t.grad_input);
            }
            self.backward_levels(x, rows, m, &mut grad_x, grads)?;
        }
        s.grad_x = grad_x;
        Ok(())
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
}

/// `dst += src`, or `dst = src` for its first contribution (`filled` unset).
fn add_or_copy(dst: &mut Vec<f32>, filled: &mut bool, src: &[f32]) {
    if *filled {
        dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
    } else {
        dst.clear();
        dst.extend_from_slice(src);
        *filled = true;
    }
}
