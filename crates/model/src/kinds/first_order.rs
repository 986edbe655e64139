//! The first-order part of `lr`, `fm`, `wide_deep`, `deepfm` and `nfm`:
//! `Σ_f w_f` (each field's leading column), FM's second order
//! `½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²]` where asked, the dense values'
//! weights and a bias; on candle's graph and as direct passes over packed
//! rows, with its share of the backward pass.

use candle_core::{Tensor, Var};
use rayon::prelude::*;

use super::{At, Grads, WholeStep};
use crate::ModelError;
use crate::fused::{FM_ROWS_AT_ONCE, FirstOrderFm, GradRows, Simd, first_order_fm_grad_rows, first_order_fm_rows};
use crate::logistic;
use crate::mlp::sized;
use crate::optimizer::all_finite;
use crate::params::{Linear, ParamStore};
use crate::spec::DenseLayer;
use crate::step::Scratch;

/// Rows a task of the first-order and FM passes takes.
const ROWS_PER_TASK: usize = 4 * FM_ROWS_AT_ONCE;

pub(crate) struct FirstOrder {
    /// The dense values' weights (none without dense values).
    pub(crate) dense: Option<Linear>,
    /// The scalar bias.
    pub(crate) bias: Var,
    /// FM's second order over columns 1...
    pub(crate) fm: bool,
}

/// The part's parameters as values, and the input's layout, for the
/// passes over blocks of rows.
struct Terms {
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

impl Terms {
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

/// Each row's field vectors from column `offset` of each field (1 skips
/// the first-order weight) followed by its dense values, into `out`.
pub(crate) fn deep_input(at: &At, x: &[f32], offset: usize, out: &mut Vec<f32>) {
    let (f, nd, w) = (at.shape.num_fields, at.shape.num_dense, at.width);
    let d = w - offset;
    let out_len = f * d + nd;
    out.resize(x.len() / at.row_len() * out_len, 0.0);
    out.par_chunks_mut(out_len).zip(x.par_chunks(at.row_len())).for_each(|(out, x)| {
        for (dst, field) in out.chunks_exact_mut(d).zip(x[..f * w].chunks_exact(w)) {
            dst.copy_from_slice(&field[offset..]);
        }
        out[f * d..].copy_from_slice(&x[f * w..]);
    });
}

impl FirstOrder {
    /// The bias, then the dense values' weights (the parameters' order).
    pub(crate) fn new(ps: &mut ParamStore, num_dense: usize, fm: bool) -> Result<FirstOrder, ModelError> {
        let bias = ps.zeros("bias".into(), &[1])?;
        Ok(FirstOrder { dense: super::parts::with_dense(ps, num_dense)?, bias, fm })
    }

    /// `[B, 1]` on candle's graph from pooled embeddings `emb` `[B, F, width]`.
    pub(crate) fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor) -> Result<Tensor, ModelError> {
        let mut t = if emb.device().is_cpu() {
            emb.contiguous()?.apply_op1(FirstOrderFm { second_order: self.fm })? // [B, 1]
        } else {
            let t = emb.narrow(2, 0, 1)?.sum(1)?;
            if self.fm {
                // ½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²]
                let v = emb.narrow(2, 1, at.shape.embedding_dim)?;
                let s = v.sum(1)?.sqr()?;
                let q = v.sqr()?.sum(1)?;
                (t + ((s - q)?.sum_keepdim(1)? * 0.5)?)?
            } else {
                t
            }
        };
        if let Some(lin) = &self.dense {
            t = (t + lin.forward(dense)?)?;
        }
        Ok(t.broadcast_add(self.bias.as_tensor())?)
    }

    /// The dense values' layer and the bias, for an exporter.
    pub(crate) fn spec(&self) -> Result<(Option<DenseLayer>, f32), ModelError> {
        let dense = self.dense.as_ref().map(crate::step::linear_spec).transpose()?;
        Ok((dense, values(&self.bias)?[0]))
    }

    fn terms(&self, at: &At) -> Result<Terms, ModelError> {
        let lin = self
            .dense
            .as_ref()
            .map(|l| Ok::<_, ModelError>((values(l.weight())?, values(l.bias())?[0])))
            .transpose()?;
        Ok(Terms {
            fields: at.shape.num_fields,
            width: at.width,
            row: at.row_len(),
            fm: self.fm,
            lin,
            bias: values(&self.bias)?[0],
            simd: at.simd,
        })
    }

    /// The first-order part of each logit of input rows `x`, in candle's
    /// order of additions; FM's Σ_f v_f of each row go to `sums` for the
    /// backward pass.
    pub(crate) fn logits(&self, at: &At, x: &[f32], sums: &mut Vec<f32>) -> Result<Vec<f32>, ModelError> {
        let terms = self.terms(at)?;
        let row = at.row_len();
        let rows = x.len() / row;
        let mut out = vec![0.0f32; rows];
        let per_row = terms.sums_per_row();
        let sums = sized(sums, rows * per_row); // overwritten whole (LR: unused)
        let tasks = out.par_chunks_mut(ROWS_PER_TASK).zip(x.par_chunks(ROWS_PER_TASK * row));
        let tasks = tasks.zip(sums.par_chunks_mut(ROWS_PER_TASK * per_row));
        tasks.for_each(|((out, x), sums)| terms.logits(x, sums, out));
        Ok(out)
    }

    /// The gradients of the first-order part and of the deep MLP's input
    /// `deep_grad` (rows of [`deep_input`] at `offset`; none for LR and FM)
    /// for the logits' gradient `seed`: every value of `grad_x`, and the
    /// first-order dense weights' and the bias's gradients. `fm_sums`: FM's
    /// second order, with each row's Σ_f v_f from the forward pass.
    #[expect(clippy::too_many_arguments, reason = "the step's inputs, its two gradients and where they go")]
    pub(crate) fn grads<'a>(
        &'a self,
        at: &At,
        fm_sums: &[f32],
        x: &[f32],
        seed: &[f32],
        (deep_grad, offset): (Option<&[f32]>, usize),
        grad_x: &mut [f32],
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let (f, nd, w) = (at.shape.num_fields, at.shape.num_dense, at.width);
        let row = at.row_len();
        let deep_len = f * (w - offset) + nd;
        let fm_sums = self.fm.then_some(fm_sums);
        let terms = self.terms(at)?;
        let tasks = grad_x.par_chunks_mut(ROWS_PER_TASK * row).zip(x.par_chunks(ROWS_PER_TASK * row));
        let tasks = tasks.zip(seed.par_chunks(ROWS_PER_TASK)).enumerate();
        let d = w - 1;
        let fm = self.fm;
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
        self.param_grads(at, x, seed, grads);
        Ok(())
    }

    /// The first-order dense weights' and the bias's gradients for the
    /// logits' gradient `seed` (rows summed in order).
    fn param_grads<'a>(&'a self, at: &At, x: &[f32], seed: &[f32], grads: &mut Grads<'a>) {
        let (f, nd, w) = (at.shape.num_fields, at.shape.num_dense, at.width);
        let row = at.row_len();
        let seed_sum = seed.iter().sum::<f32>();
        if let Some(lin) = &self.dense {
            let mut dw = vec![0.0f32; nd];
            for (x, &g) in x.chunks_exact(row).zip(seed) {
                dw.iter_mut().zip(&x[f * w..]).for_each(|(d, x)| *d += g * x);
            }
            grads.push((lin.weight(), dw));
            grads.push((lin.bias(), vec![seed_sum]));
        }
        grads.push((&self.bias, vec![seed_sum]));
    }
}

/// The part alone is `lr`'s and `fm`'s whole network.
impl super::Net for FirstOrder {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        FirstOrder::forward(self, at, emb, dense)
    }

    fn spec(&self) -> Result<crate::spec::NetSpec, ModelError> {
        let (dense, bias) = FirstOrder::spec(self)?;
        Ok(crate::spec::NetSpec::FirstOrder { second_order: self.fm, dense, bias })
    }

    fn direct(&self) -> Option<&dyn super::Direct> {
        Some(self)
    }
}

impl super::Direct for FirstOrder {
    fn forward(&self, at: &At, x: &[f32], _rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        self.logits(at, x, &mut s.fm_sums)
    }

    /// (Training takes [`whole_step`](super::Direct::whole_step): this is its reference.)
    fn backward<'a>(
        &'a self,
        at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let grad_x = sized(&mut s.grad_x, seed.len() * at.row_len()); // every value written
        self.grads(at, &s.fm_sums, x, seed, (None, 0), grad_x, grads)
    }

    /// LR's and FM's whole step in one pass over the batch: each task's rows
    /// go forward, through the loss and backward, and their input gradient
    /// is checked for NaN and infinities, while the rows are in the core's
    /// caches (three passes over the batch, each its own parallel section,
    /// read the 1.8 MB input twice and the gradient once more). The same
    /// operations row by row as the forward pass, the loss and the
    /// backward, so the same bits (tested). The input gradient is left in
    /// `s.grad_x`.
    fn whole_step<'a>(
        &'a self,
        at: &At,
        x: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        s: &mut Scratch,
    ) -> Result<Option<WholeStep<'a>>, ModelError> {
        let (rows, row) = (labels.len(), at.row_len());
        if x.len() != rows * row {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: row });
        }
        let terms = self.terms(at)?;
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
                // The block's rows side by side (a row at a time, the
                // loss's arithmetic is a chain of dependent operations).
                let n = logits.len();
                let y = &labels[first_row..first_row + n];
                let weights = weights.map(|w| &w[first_row..first_row + n]);
                let column = logistic::Column { x: logits, y, seed, strides: (1, 1) };
                let scale = logistic::Scale { task_weight: 1.0, weights, inv_b };
                logistic::add_column(at.simd, column, scale, losses);
                finite &= terms.input_grads(x, seed, sums, grad);
            }
            finite
        });
        let finite = finite.reduce(|| true, |a, b| a && b);
        let loss = losses.iter().fold(0.0, |sum, l| sum + l) * inv_b;
        let mut grads: Grads<'_> = Vec::new();
        self.param_grads(at, x, &seed, &mut grads);
        Ok(Some(WholeStep { loss, logits, grads, finite }))
    }
}
