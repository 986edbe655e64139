//! The dense step of every model kind on CPU, outside candle's graph: the
//! same math as [`DenseModel::forward`] and its autograd (tested), as plain
//! passes over slices. Around the fused MLPs, candle's graph (narrow,
//! concatenations, broadcast adds, the adjoint of each, and a tensor
//! allocated for each) cost Wide&Deep, DeepFM and DLRM a third of their dense
//! step; here the buffers are kept between steps and each value is written
//! once.
//!
//! The step reads input rows `[pooled embeddings | dense values]` (the
//! engine pools straight into them) and leaves d loss / d input in the same
//! layout, the dense values' part included, for the engine to unpool from.

use candle_core::Var;
use rayon::prelude::*;

use super::{DenseModel, Net};
use crate::ModelError;
use crate::fused::{
    FM_ROWS_AT_ONCE, GradRows, RowBuf, Simd, Vectors, first_order_fm_grad_rows, first_order_fm_rows,
    pairwise_dots_grad_row, pairwise_dots_row,
};
use crate::mlp::{CrossGrads, Mlp, MlpScratch, cpu, cross_backward, cross_forward, sized};
use crate::optimizer::{DenseGrads, all_finite};
use crate::params::Linear;
use sparrow_core::config::ModelKind;

/// Rows a task of the first-order and FM passes takes.
const ROWS_PER_TASK: usize = 4 * FM_ROWS_AT_ONCE;

/// Buffers of the direct step, kept between steps.
#[derive(Default)]
pub(super) struct Scratch {
    /// The deep (DLRM: top) MLP's.
    pub(super) deep: MlpScratch,
    /// DLRM's bottom MLP's.
    pub(super) bottom: MlpScratch,
    /// The deep MLP's input rows where they are not the input's (Wide&Deep
    /// and DeepFM: without the first-order columns; DLRM: the top MLP's).
    x: Vec<f32>,
    /// DLRM: the dense values alone (the bottom MLP's input).
    dense: Vec<f32>,
    /// DCN-v2: each cross layer's output and gate.
    cross_out: Vec<Vec<f32>>,
    gates: Vec<Vec<f32>>,
    /// FM and DeepFM: each row's Σ_f v_f from the forward pass, for the backward.
    fm_sums: Vec<f32>,
    /// d loss / d input, in the input's layout: what the step hands back.
    pub(super) grad_x: Vec<f32>,
    /// Backward buffers: DCN-v2's gradients at a layer's input and at its
    /// gate; DLRM's at the bottom MLP's output.
    grad_in: Vec<f32>,
    grad_gate: Vec<f32>,
    grad_t: Vec<f32>,
}

/// What [`DenseModel::first_order_step`] computed.
pub(super) struct FirstOrderStep {
    pub(super) loss: f64,
    pub(super) logits: Vec<f32>,
    pub(super) grads: DenseGrads,
    /// Whether every value of the input gradient (`Scratch::grad_x`) is finite.
    pub(super) finite: bool,
}

/// LR's and FM's parameters as values, and the input's layout, for the
/// passes over blocks of rows.
struct FirstOrderTerms {
    fields: usize,
    width: usize,
    /// Floats of an input row.
    row: usize,
    fm: bool,
    /// The dense values' weights and bias.
    lin: Option<(Vec<f32>, f32)>,
    bias: f32,
    simd: Simd,
}

impl FirstOrderTerms {
    /// Floats of `sums` a row (LR's width 1 leaves no sums: one unused
    /// float a row keeps the blocks paired).
    fn sums_per_row(&self) -> usize {
        (self.width - 1).max(1)
    }

    /// The logits of a block of rows `x` into `out`, FM's Σ_f v_f into `sums`.
    fn logits(&self, x: &[f32], sums: &mut [f32], out: &mut [f32]) {
        let (f, w, row) = (self.fields, self.width, self.row);
        first_order_fm_rows(self.simd, x, row, (f, w), self.fm, sums, out);
        // Each row's dense dot product in order, row after row: the rows'
        // chains overlap (side by side, the compiler gathered the rows'
        // values into registers one lane at a time).
        if let Some((lw, lb)) = &self.lin {
            for (t, x) in out.iter_mut().zip(x.chunks(row)) {
                let dot = x[f * w..].iter().zip(lw).fold(0.0f32, |dot, (x, w)| dot + x * w);
                *t += dot + lb;
            }
        }
        out.iter_mut().for_each(|t| *t += self.bias);
    }

    /// d loss / d input of a block of rows `x` (the dense values' part
    /// included) for their logits' gradient `seed`, into `grad`; whether
    /// every value written is finite.
    fn input_grads(&self, x: &[f32], seed: &[f32], sums: &[f32], grad: &mut [f32]) -> bool {
        let (f, w, row) = (self.fields, self.width, self.row);
        let mut written = first_order_fm_grad_rows(
            self.simd,
            GradRows { x, stride: row, shape: (f, w), seeds: seed, second_order: self.fm, sums },
            grad,
        );
        for (grad, &g) in grad.chunks_exact_mut(row).zip(seed) {
            let grad_dense = &mut grad[f * w..];
            match &self.lin {
                Some((lw, _)) => {
                    grad_dense.iter_mut().zip(lw).for_each(|(o, w)| *o = g * w);
                    written.add(grad_dense);
                }
                None => grad_dense.fill(0.0),
            }
        }
        // A sum that proves nothing (a NaN, or finite values past f32's
        // range) sends the block to the exact check.
        written.proves_finite() || all_finite(self.simd, grad)
    }
}

/// A small parameter's values (a first-order weight vector, a bias).
fn values(var: &Var) -> Result<Vec<f32>, ModelError> {
    Ok(var.as_tensor().flatten_all()?.to_vec1::<f32>()?)
}

/// The gradients of the dense parameters, in any order, keyed by parameter.
type Grads<'a> = Vec<(&'a Var, Vec<f32>)>;

impl DenseModel {
    /// Every kind takes the direct step on CPU; other devices use candle's graph.
    pub(super) fn is_direct(&self) -> bool {
        // Several outputs (tasks) take the graph's path.
        self.params.device().is_cpu()
            && self.heads.is_one_binary()
            && !self.kind.is_multi_task()
            && self.kind != ModelKind::Din
    }

    /// Floats of an input row: `[pooled embeddings (fields × width) | dense values]`.
    pub(super) fn row_len(&self) -> usize {
        self.shape.num_fields * self.width() + self.shape.num_dense
    }

    /// Each row's field vectors from column `offset` of each field (1 skips
    /// the first-order weight) followed by its dense values, into `out`.
    fn deep_input(&self, x: &[f32], offset: usize, out: &mut Vec<f32>) {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let d = w - offset;
        let out_len = f * d + nd;
        out.resize(x.len() / self.row_len() * out_len, 0.0);
        out.par_chunks_mut(out_len).zip(x.par_chunks(self.row_len())).for_each(|(out, x)| {
            for (dst, field) in out.chunks_exact_mut(d).zip(x[..f * w].chunks_exact(w)) {
                dst.copy_from_slice(&field[offset..]);
            }
            out[f * d..].copy_from_slice(&x[f * w..]);
        });
    }

    /// The first-order part of each logit: `Σ_f w_f`, FM's second order if
    /// `fm`, `dense·w + b`, the shared bias; in candle's order of additions.
    /// FM's Σ_f v_f of each row go to `sums` for the backward pass.
    fn first_order(
        &self,
        lin: &Option<Linear>,
        fm: bool,
        x: &[f32],
        sums: &mut Vec<f32>,
    ) -> Result<Vec<f32>, ModelError> {
        let terms = self.first_order_terms(lin, fm)?;
        let row = self.row_len();
        let rows = x.len() / row;
        let mut out = vec![0.0f32; rows];
        let per_row = terms.sums_per_row();
        let sums = sized(sums, rows * per_row); // overwritten whole (LR: unused)
        let tasks = out.par_chunks_mut(ROWS_PER_TASK).zip(x.par_chunks(ROWS_PER_TASK * row));
        let tasks = tasks.zip(sums.par_chunks_mut(ROWS_PER_TASK * per_row));
        tasks.for_each(|((out, x), sums)| terms.logits(x, sums, out));
        Ok(out)
    }

    /// The first-order and FM model's parameters as values, for a pass.
    fn first_order_terms(&self, lin: &Option<Linear>, fm: bool) -> Result<FirstOrderTerms, ModelError> {
        let lin = lin.as_ref().map(|l| Ok::<_, ModelError>((values(l.weight())?, values(l.bias())?[0]))).transpose()?;
        let bias = self.bias.as_ref().map(values).transpose()?.map_or(0.0, |b| b[0]);
        Ok(FirstOrderTerms {
            fields: self.shape.num_fields,
            width: self.width(),
            row: self.row_len(),
            fm,
            lin,
            bias,
            simd: self.simd,
        })
    }

    /// LR's and FM's whole step in one pass over the batch: each task's rows
    /// go forward, through the loss and backward, and their input gradient
    /// is checked for NaN and infinities, while the rows are in the core's
    /// caches (three passes over the batch, each its own parallel section,
    /// read the 1.8 MB input twice and the gradient once more). The same
    /// operations row by row as [`forward_direct`](Self::forward_direct), the
    /// loss and [`backward_direct`](Self::backward_direct), so the same bits
    /// (tested). `None` for the other kinds. The input gradient is left in
    /// `s.grad_x`; the flag says whether every value of it is finite.
    pub(super) fn first_order_step(
        &self,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        s: &mut Scratch,
    ) -> Result<Option<FirstOrderStep>, ModelError> {
        let (lin, fm) = match &self.net {
            Net::Lr { dense } => (dense, false),
            Net::Fm { dense } => (dense, true),
            _ => return Ok(None),
        };
        let (rows, row) = (labels.len(), self.row_len());
        if x.len() != rows * row {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: row });
        }
        let terms = self.first_order_terms(lin, fm)?;
        let inv_b = 1.0 / rows.max(1) as f64;
        let (mut logits, mut seed, mut losses) = (vec![0.0f32; rows], vec![0.0f32; rows], vec![0.0f64; rows]);
        let per_row = terms.sums_per_row();
        let sums = sized(&mut s.fm_sums, rows * per_row); // overwritten whole (LR: unused)
        let grad_x = sized(&mut s.grad_x, rows * row); // every value written
        let tasks = logits.par_chunks_mut(ROWS_PER_TASK).zip(seed.par_chunks_mut(ROWS_PER_TASK));
        let tasks = tasks.zip(losses.par_chunks_mut(ROWS_PER_TASK)).zip(x.par_chunks(ROWS_PER_TASK * row));
        let tasks =
            tasks.zip(sums.par_chunks_mut(ROWS_PER_TASK * per_row)).zip(grad_x.par_chunks_mut(ROWS_PER_TASK * row));
        let finite = tasks.enumerate().map(|(task, (((((logits, seed), losses), x), sums), grad))| {
            // Eight rows at a time through all three: their input rows are
            // still in the first-level cache (about 15 KB) when the backward reads them.
            let mut finite = true;
            let (per_block, in_block) = (FM_ROWS_AT_ONCE * per_row, FM_ROWS_AT_ONCE * row);
            let blocks = logits.chunks_mut(FM_ROWS_AT_ONCE).zip(seed.chunks_mut(FM_ROWS_AT_ONCE));
            let blocks = blocks.zip(losses.chunks_mut(FM_ROWS_AT_ONCE)).zip(x.chunks(in_block));
            let blocks = blocks.zip(sums.chunks_mut(per_block)).zip(grad.chunks_mut(in_block)).enumerate();
            for (block, (((((logits, seed), losses), x), sums), grad)) in blocks {
                terms.logits(x, sums, logits);
                let first_row = task * ROWS_PER_TASK + block * FM_ROWS_AT_ONCE;
                for (r, ((&logit, seed), loss)) in logits.iter().zip(seed.iter_mut()).zip(losses.iter_mut()).enumerate()
                {
                    let i = first_row + r;
                    let weight = weights.map_or(1.0, |w| f64::from(w[i]));
                    (*loss, *seed) = DenseModel::loss_and_seed_row(logit, labels[i], weight, inv_b);
                }
                finite &= terms.input_grads(x, seed, sums, grad);
            }
            finite
        });
        let finite = finite.reduce(|| true, |a, b| a && b);
        let loss = losses.iter().fold(0.0, |sum, l| sum + l) * inv_b;
        let mut grads: Grads<'_> = Vec::new();
        self.first_order_param_grads(lin, x, &seed, &mut grads)?;
        Ok(Some(FirstOrderStep { loss, logits, grads: self.in_param_order(grads, rows), finite }))
    }

    /// The gradients of the first-order part and of the deep MLP's input
    /// `deep_grad` (rows of [`deep_input`](Self::deep_input) at `offset`;
    /// none for LR and FM) for the logits' gradient `seed`: every value of
    /// `grad_x`, and the first-order dense weights' and the bias's gradients.
    /// `fm_sums`: FM's second order, with each row's Σ_f v_f from the forward pass.
    #[expect(clippy::too_many_arguments, reason = "the step's inputs, its two gradients and where they go")]
    fn first_order_grads<'a>(
        &'a self,
        lin: &'a Option<Linear>,
        fm_sums: Option<&[f32]>,
        x: &[f32],
        seed: &[f32],
        (deep_grad, offset): (Option<&[f32]>, usize),
        grad_x: &mut [f32],
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let row = self.row_len();
        let deep_len = f * (w - offset) + nd;
        let fm = fm_sums.is_some();
        let terms = self.first_order_terms(lin, fm)?;
        let tasks = grad_x.par_chunks_mut(ROWS_PER_TASK * row).zip(x.par_chunks(ROWS_PER_TASK * row));
        let tasks = tasks.zip(seed.par_chunks(ROWS_PER_TASK)).enumerate();
        let d = w - 1;
        tasks.for_each(|(task, ((grad, x), seeds))| {
            let first_row = task * ROWS_PER_TASK;
            let sums = fm_sums.map_or(&[][..], |sums| &sums[first_row * d..(first_row + seeds.len()) * d]);
            // The deep gradient is added below: the whole is checked after.
            let _ = terms.input_grads(x, seeds, sums, grad);
            let Some(deep_grad) = deep_grad else { return };
            for (r, grad) in grad.chunks_exact_mut(row).enumerate() {
                let (grad_emb, grad_dense) = grad.split_at_mut(f * w);
                let r = first_row + r;
                let gx = &deep_grad[r * deep_len..(r + 1) * deep_len];
                for (field, g) in grad_emb.chunks_exact_mut(w).zip(gx.chunks_exact(w - offset)) {
                    // Without FM the factors' only gradient is the deep one.
                    if fm {
                        field[offset..].iter_mut().zip(g).for_each(|(a, g)| *a += g);
                    } else {
                        field[offset..].copy_from_slice(g);
                    }
                }
                grad_dense.iter_mut().zip(&gx[deep_len - nd..]).for_each(|(a, g)| *a += g);
            }
        });
        self.first_order_param_grads(lin, x, seed, grads)
    }

    /// The first-order dense weights' and the biases' gradients for the
    /// logits' gradient `seed` (rows summed in order).
    fn first_order_param_grads<'a>(
        &'a self,
        lin: &'a Option<Linear>,
        x: &[f32],
        seed: &[f32],
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let row = self.row_len();
        let seed_sum = seed.iter().sum::<f32>();
        if let Some(lin) = lin {
            let mut dw = vec![0.0f32; nd];
            for (x, &g) in x.chunks_exact(row).zip(seed) {
                dw.iter_mut().zip(&x[f * w..]).for_each(|(d, x)| *d += g * x);
            }
            grads.push((lin.weight(), dw));
            grads.push((lin.bias(), vec![seed_sum]));
        }
        if let Some(bias) = &self.bias {
            grads.push((bias, vec![seed_sum]));
        }
        Ok(())
    }

    /// Logits of a batch of input rows `x` (see [`row_len`](Self::row_len));
    /// what the backward pass needs stays in `s`.
    pub(super) fn forward_direct(&self, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        let row = self.row_len();
        if x.len() != rows * row {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: row });
        }
        let (f, nd, d) = (self.shape.num_fields, self.shape.num_dense, self.shape.embedding_dim);
        let simd = self.simd;
        let deep = |mlp: &Mlp, x: &[f32], s: &mut MlpScratch| mlp.forward_cpu(x, rows, s);
        Ok(match &self.net {
            // The multi-task kinds take candle's graph (`is_direct` is false).
            Net::MultiTask(_) | Net::Din(_) => return Err(ModelError::NotPacked { kind: self.kind.name() }),
            Net::Lr { dense: lin } => self.first_order(lin, false, x, &mut s.fm_sums)?,
            Net::Fm { dense: lin } => self.first_order(lin, true, x, &mut s.fm_sums)?,
            Net::Mlp { mlp } => {
                deep(mlp, x, &mut s.deep)?;
                s.deep.output.clone()
            }
            Net::WideDeep { dense: lin, deep: mlp } | Net::DeepFm { dense: lin, deep: mlp } => {
                let fm = matches!(self.net, Net::DeepFm { .. });
                self.deep_input(x, 1, &mut s.x);
                deep(mlp, &s.x, &mut s.deep)?;
                let mut logits = self.first_order(lin, fm, x, &mut s.fm_sums)?;
                logits.iter_mut().zip(&s.deep.output).for_each(|(a, b)| *a += b);
                logits
            }
            Net::Dlrm { bottom, top, n, .. } => {
                let pairs = n * (n - 1) / 2;
                if let Some(mlp) = bottom {
                    s.dense.clear();
                    for x in x.chunks_exact(row) {
                        s.dense.extend_from_slice(&x[f * d..]);
                    }
                    deep(mlp, &s.dense, &mut s.bottom)?;
                }
                // The top MLP reads [bottom output | pairwise dots of
                // (bottom output, the fields' vectors)].
                let lead = if bottom.is_some() { d } else { 0 };
                s.x.resize(rows * (lead + pairs), 0.0);
                let below = &s.bottom.output;
                let rows_in = s.x.par_chunks_mut(lead + pairs).zip(x.par_chunks(row)).enumerate();
                rows_in.for_each_init(RowBuf::default, |buf, (r, (top_in, x))| {
                    let head = &below[r * lead..(r + 1) * lead];
                    top_in[..lead].copy_from_slice(head);
                    pairwise_dots_row(simd, Vectors { head, tail: &x[..f * d], d }, &mut top_in[lead..], buf);
                });
                deep(top, &s.x, &mut s.deep)?;
                s.deep.output.clone()
            }
            Net::Dcn { cross, deep: mlp, arith } => {
                // The input rows are x₀.
                let x_dim = f * d + nd;
                s.cross_out.resize_with(cross.len(), Vec::new);
                s.gates.resize_with(cross.len(), Vec::new);
                for (l, layer) in cross.iter().enumerate() {
                    let (w, b) = (layer.weight().storage_and_layout(), layer.bias().storage_and_layout());
                    let (w, b) = (cpu(&w.0, w.1)?, cpu(&b.0, b.1)?);
                    let (done, rest) = s.cross_out.split_at_mut(l);
                    let input: &[f32] = if l == 0 { x } else { &done[l - 1] };
                    // Both overwritten whole.
                    let out = sized(&mut rest[0], rows * x_dim);
                    let gate = sized(&mut s.gates[l], rows * x_dim);
                    cross_forward(*arith, x_dim, (x, input), (w, b), gate, out);
                }
                let input: &[f32] = s.cross_out.last().map_or(x, |v| v);
                deep(mlp, input, &mut s.deep)?;
                s.deep.output.clone()
            }
        })
    }

    /// The backward pass of the last [`forward_direct`](Self::forward_direct)
    /// on the same input and scratch, from `seed = d loss / d logits`: the
    /// dense gradients; d loss / d input (the input's layout) is left in
    /// `s.grad_x`.
    pub(super) fn backward_direct(&self, x: &[f32], seed: &[f32], s: &mut Scratch) -> Result<DenseGrads, ModelError> {
        let rows = seed.len();
        let row = self.row_len();
        let (f, nd, d) = (self.shape.num_fields, self.shape.num_dense, self.shape.embedding_dim);
        let simd = self.simd;
        let mut grads: Grads<'_> = Vec::new();
        match &self.net {
            Net::MultiTask(_) | Net::Din(_) => return Err(ModelError::NotPacked { kind: self.kind.name() }),
            // (Training takes `first_order_step` for these two: this is its reference.)
            Net::Lr { dense: lin } | Net::Fm { dense: lin } => {
                let fm_sums = matches!(self.net, Net::Fm { .. }).then_some(&s.fm_sums[..]);
                let grad_x = sized(&mut s.grad_x, rows * row); // every value written
                self.first_order_grads(lin, fm_sums, x, seed, (None, 0), grad_x, &mut grads)?;
            }
            Net::Mlp { mlp } => {
                grads.push((mlp.params(), mlp.backward_cpu(x, seed, &mut s.deep)?));
                // The MLP's input is the model's: its gradient is the step's.
                std::mem::swap(&mut s.grad_x, &mut s.deep.grad_input);
            }
            Net::WideDeep { dense: lin, deep } | Net::DeepFm { dense: lin, deep } => {
                let fm_sums = matches!(self.net, Net::DeepFm { .. }).then_some(&s.fm_sums[..]);
                grads.push((deep.params(), deep.backward_cpu(&s.x, seed, &mut s.deep)?));
                let grad_x = sized(&mut s.grad_x, rows * row); // every value written
                let deep_grad = (Some(&s.deep.grad_input[..]), 1);
                self.first_order_grads(lin, fm_sums, x, seed, deep_grad, grad_x, &mut grads)?;
            }
            Net::Dlrm { bottom, top, n, .. } => {
                let pairs = n * (n - 1) / 2;
                let lead = if bottom.is_some() { d } else { 0 };
                grads.push((top.params(), top.backward_cpu(&s.x, seed, &mut s.deep)?));
                let g_top = &s.deep.grad_input;
                let below = &s.bottom.output;
                // The fields' vectors' gradient straight into the input's
                // layout; the bottom output's into `grad_t`, then its
                // gradient from the top MLP added.
                let grad_x = sized(&mut s.grad_x, rows * row); // every value written
                // Its `lead` values a row are overwritten; without a bottom
                // MLP it holds one unused value a row, so the rows still pair up.
                let grad_below = sized(&mut s.grad_t, rows * lead.max(1));
                let rows_in = grad_x.par_chunks_mut(row).zip(grad_below.par_chunks_mut(lead.max(1)));
                let rows_in = rows_in.zip(x.par_chunks(row)).zip(g_top.par_chunks(lead + pairs)).enumerate();
                rows_in.for_each_init(RowBuf::default, |buf, (r, (((grad, grad_below), x), g))| {
                    let v = Vectors { head: &below[r * lead..(r + 1) * lead], tail: &x[..f * d], d };
                    let grad_below = &mut grad_below[..lead];
                    pairwise_dots_grad_row(simd, v, &g[lead..], (&mut *grad_below, &mut grad[..f * d]), buf);
                    grad_below.iter_mut().zip(&g[..lead]).for_each(|(a, g)| *a += g);
                });
                if let Some(mlp) = bottom {
                    grads.push((mlp.params(), mlp.backward_cpu(&s.dense, grad_below, &mut s.bottom)?));
                }
                // The dense values' gradient, through the bottom MLP.
                let from_below = &s.bottom.grad_input;
                grad_x.par_chunks_mut(row).enumerate().for_each(|(r, out)| {
                    out[f * d..].copy_from_slice(&from_below[r * nd..(r + 1) * nd]);
                });
            }
            Net::Dcn { cross, deep, arith } => {
                let x_dim = f * d + nd;
                let input: &[f32] = s.cross_out.last().map_or(x, |v| v);
                grads.push((deep.params(), deep.backward_cpu(input, seed, &mut s.deep)?));
                // `g`: the gradient at the current layer's output, from the deep MLP's input down.
                let mut g = std::mem::take(&mut s.deep.grad_input);
                // d x₀, the step's input gradient: summed from every layer's
                // gating, and the first layer's input.
                s.grad_x.clear();
                s.grad_x.resize(rows * x_dim, 0.0);
                for (l, layer) in cross.iter().enumerate().rev() {
                    let w = layer.weight().storage_and_layout();
                    let w = cpu(&w.0, w.1)?;
                    let input: &[f32] = if l == 0 { x } else { &s.cross_out[l - 1] };
                    let (mut dw, mut db) = (vec![0.0f32; x_dim * x_dim], vec![0.0f32; x_dim]);
                    let dxl = sized(&mut s.grad_in, rows * x_dim); // overwritten whole
                    let to = CrossGrads { x0: &mut s.grad_x, w: &mut dw, b: &mut db, xl: dxl };
                    cross_backward(*arith, x_dim, (x, input, w), &s.gates[l], &g, &mut s.grad_gate, to);
                    grads.push((layer.weight(), dw));
                    grads.push((layer.bias(), db));
                    std::mem::swap(&mut g, &mut s.grad_in);
                }
                s.grad_x.iter_mut().zip(&g).for_each(|(a, g)| *a += g);
                s.deep.grad_input = g;
            }
        }
        Ok(self.in_param_order(grads, rows))
    }

    /// The gradients in [`ParamStore`](crate::params::ParamStore) order,
    /// `None` where a parameter has none.
    fn in_param_order(&self, mut grads: Grads<'_>, rows: usize) -> DenseGrads {
        let mut grads_in_order = Vec::with_capacity(self.params.vars().len());
        for (_, var) in self.params.vars() {
            let at = grads.iter().position(|(v, _)| v.as_tensor().id() == var.as_tensor().id());
            grads_in_order.push(at.map(|i| std::mem::take(&mut grads[i].1)));
        }
        DenseGrads { grads: grads_in_order, rows: rows as u64 }
    }

    /// Each MLP's buffers with the gradient buffer of its size, if one came back.
    pub(super) fn recycle_direct(&self, mut buffers: Vec<Vec<f32>>, s: &mut Scratch) {
        let mlps: Vec<(&Mlp, &mut MlpScratch)> = match &self.net {
            Net::Lr { .. } | Net::Fm { .. } | Net::MultiTask(_) | Net::Din(_) => Vec::new(),
            Net::Mlp { mlp: m } | Net::WideDeep { deep: m, .. } | Net::DeepFm { deep: m, .. } => {
                vec![(m, &mut s.deep)]
            }
            Net::Dcn { deep, .. } => vec![(deep, &mut s.deep)],
            Net::Dlrm { bottom, top, .. } => {
                let mut v = vec![(top, &mut s.deep)];
                if let Some(b) = bottom {
                    v.push((b, &mut s.bottom));
                }
                v
            }
        };
        for (mlp, scratch) in mlps {
            let wanted = mlp.params().elem_count();
            if let Some(i) = buffers.iter().position(|b| b.len() == wanted) {
                scratch.spare_grad = buffers.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::{ModelConfig, ModelKind};
    use sparrow_core::rng::Rng;

    use super::{DenseModel, Scratch};
    use crate::ModelShape;

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// LR's and FM's one-pass step gives the bits of the three passes it
    /// replaces (forward, loss, backward): logits, loss, input gradient and
    /// every dense gradient, with and without dense values and sample
    /// weights, over several tasks and a partial one; its finiteness flag
    /// says whether the input gradient holds a NaN or an infinity.
    #[test]
    fn the_first_order_step_in_one_pass_is_the_three_passes() {
        let mut rng = Rng::new(41);
        for (kind, num_dense, weighted) in [
            (ModelKind::Lr, 13, false),
            (ModelKind::Lr, 0, true),
            (ModelKind::Fm, 13, true),
            (ModelKind::Fm, 0, false),
            (ModelKind::Fm, 2, false),
        ] {
            let shape = ModelShape { num_fields: 5, num_dense, embedding_dim: 16 };
            let config = ModelConfig { kind, embedding_dim: 16, ..Default::default() };
            let model = DenseModel::new(&config, shape, 3, Device::Cpu, sparrow_core::simd::Simd::Auto).expect("model");
            let (rows, row) = (77, model.row_len());
            let labels: Vec<f32> = (0..rows).map(|i| (i % 3 == 0) as u8 as f32).collect();
            let weights: Vec<f32> = (0..rows).map(|_| rng.uniform(0.0, 2.0) as f32).collect();
            let weights = weighted.then_some(&weights[..]);
            for poison in [None, Some(f32::NAN), Some(f32::INFINITY)] {
                let what = format!("{kind:?}, {num_dense} dense, weighted {weighted}, poison {poison:?}");
                let mut x: Vec<f32> = (0..rows * row).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
                if let Some(p) = poison {
                    x[40 * row + 3] = p;
                }
                let (mut one, mut three) = (Scratch::default(), Scratch::default());
                let step = model.first_order_step(&x, &labels, weights, &mut one).expect("step").expect("LR or FM");
                let logits = model.forward_direct(&x, rows, &mut three).expect("forward");
                let (loss, seed) = DenseModel::loss_and_seed(&logits, &labels, weights);
                let grads = model.backward_direct(&x, &seed, &mut three).expect("backward");
                assert_eq!(bits(&step.logits), bits(&logits), "{what}: logits");
                assert_eq!(step.loss.to_bits(), loss.to_bits(), "{what}: loss");
                assert_eq!(bits(&one.grad_x), bits(&three.grad_x), "{what}: input gradient");
                assert_eq!(step.grads.rows, grads.rows);
                for (a, b) in step.grads.grads.iter().zip(&grads.grads) {
                    assert_eq!(a.as_deref().map(bits), b.as_deref().map(bits), "{what}: dense gradient");
                }
                assert_eq!(step.finite, three.grad_x.iter().all(|v| v.is_finite()), "{what}: finite");
                // A NaN input reaches every gradient of its row; an infinite
                // one need not (LR's field weight: σ(∞) − y is finite).
                if poison.is_none() || poison.is_some_and(f32::is_nan) {
                    assert_eq!(step.finite, poison.is_none(), "{what}: the poison reaches the gradient");
                }
            }
        }
    }
}
