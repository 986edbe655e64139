//! The dense step of every model kind on CPU, outside candle's graph: the
//! same math as [`DenseModel::forward`] and its autograd (tested), as plain
//! passes over slices. Around the fused MLPs, candle's graph (narrow,
//! concatenations, broadcast adds, the adjoint of each, and a tensor
//! allocated for each) cost Wide&Deep, DeepFM and DLRM a third of their dense
//! step; here the buffers are kept between steps and each value is written
//! once.

use candle_core::Var;
use rayon::prelude::*;

use super::{DenseModel, Net};
use crate::ModelError;
use crate::fused::{first_order_fm_grad_row, first_order_fm_row, pairwise_dots_grad_row, pairwise_dots_row};
use crate::mlp::{CrossGrads, Mlp, MlpScratch, cpu, cross_backward, cross_forward, sized};
use crate::optimizer::DenseGrads;
use crate::params::Linear;

/// Buffers of the direct step, kept between steps.
#[derive(Default)]
pub(super) struct Scratch {
    /// The deep (DLRM: top) MLP's.
    pub(super) deep: MlpScratch,
    /// DLRM's bottom MLP's.
    pub(super) bottom: MlpScratch,
    /// The deep MLP's input rows (DCN-v2: the cross layers' `x₀`; DLRM: the top MLP's).
    x: Vec<f32>,
    /// DLRM: each row's `n` interacting vectors, the bottom MLP's output first.
    t: Vec<f32>,
    /// DCN-v2: each cross layer's output and gate.
    cross_out: Vec<Vec<f32>>,
    gates: Vec<Vec<f32>>,
    /// Backward buffers: DCN-v2's gradients at `x₀`, at a layer's input and
    /// at its gate; DLRM's at the interacting vectors.
    grad_x0: Vec<f32>,
    grad_in: Vec<f32>,
    grad_gate: Vec<f32>,
    grad_t: Vec<f32>,
}

/// `buf` with exactly `n` elements, all zero.
fn zeroed(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    buf.clear();
    buf.resize(n, 0.0);
    buf
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
        self.params.device().is_cpu()
    }

    fn check_sizes(&self, emb: &[f32], dense: &[f32], rows: usize) -> Result<(), ModelError> {
        let (f, nd) = (self.shape.num_fields, self.shape.num_dense);
        for (what, len, per_row) in
            [("pooled embeddings", emb.len(), f * self.width()), ("dense values", dense.len(), nd)]
        {
            if len != rows * per_row {
                return Err(ModelError::BadInput { what, len, rows, per_row });
            }
        }
        Ok(())
    }

    /// Each row's field vectors (from column `offset` of each field's row:
    /// 1 skips the first-order weight) followed by its dense values, into `x`.
    fn deep_input(&self, emb: &[f32], dense: &[f32], rows: usize, offset: usize, x: &mut Vec<f32>) {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let d = w - offset;
        let stride = f * d + nd;
        x.resize(rows * stride, 0.0);
        x.par_chunks_mut(stride).zip(emb.par_chunks(f * w)).enumerate().for_each(|(r, (x, e))| {
            for (dst, field) in x.chunks_exact_mut(d).zip(e.chunks_exact(w)) {
                dst.copy_from_slice(&field[offset..]);
            }
            x[f * d..].copy_from_slice(&dense[r * nd..(r + 1) * nd]);
        });
    }

    /// The first-order part of each logit: `Σ_f w_f`, FM's second order if
    /// `fm`, `dense·w + b`, the shared bias; in candle's order of additions.
    fn first_order(&self, lin: &Option<Linear>, fm: bool, emb: &[f32], dense: &[f32]) -> Result<Vec<f32>, ModelError> {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let lin = lin.as_ref().map(|l| Ok::<_, ModelError>((values(l.weight())?, values(l.bias())?[0]))).transpose()?;
        let bias = self.bias.as_ref().map(values).transpose()?.map_or(0.0, |b| b[0]);
        let rows = emb.len() / (f * w).max(1);
        let mut out = vec![0.0f32; rows];
        out.par_iter_mut().enumerate().for_each_init(
            || vec![0.0f32; w - 1],
            |sum, (r, out)| {
                let mut t = first_order_fm_row(&emb[r * f * w..(r + 1) * f * w], w, fm, sum);
                if let Some((lw, lb)) = &lin {
                    let x = &dense[r * nd..(r + 1) * nd];
                    t += x.iter().zip(lw).fold(0.0f32, |s, (x, w)| s + x * w) + lb;
                }
                *out = t + bias;
            },
        );
        Ok(out)
    }

    /// The first-order part's gradients for the logits' gradient `seed`:
    /// into `emb_grad` (each field's leading column; FM's factors), and the
    /// first-order dense weights' and the bias's.
    fn first_order_grads<'a>(
        &'a self,
        lin: &'a Option<Linear>,
        fm: bool,
        (emb, dense): (&[f32], &[f32]),
        seed: &[f32],
        emb_grad: &mut [f32],
        grads: &mut Grads<'a>,
    ) {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        emb_grad.par_chunks_mut(f * w).zip(emb.par_chunks(f * w)).zip(seed.par_iter()).for_each_init(
            || vec![0.0f32; w - 1],
            |sum, ((grad, e), &g)| first_order_fm_grad_row(e, w, g, fm, sum, grad),
        );
        let seed_sum = seed.iter().sum::<f32>();
        if let Some(lin) = lin {
            let mut dw = vec![0.0f32; nd];
            for (x, &g) in dense.chunks_exact(nd).zip(seed) {
                dw.iter_mut().zip(x).for_each(|(d, x)| *d += g * x);
            }
            grads.push((lin.weight(), dw));
            grads.push((lin.bias(), vec![seed_sum]));
        }
        if let Some(bias) = &self.bias {
            grads.push((bias, vec![seed_sum]));
        }
    }

    /// Adds the deep MLP's input gradient `gx` (rows of [`deep_input`](Self::deep_input)) into `emb_grad`.
    fn add_deep_grad(&self, gx: &[f32], offset: usize, emb_grad: &mut [f32]) {
        let (f, nd, w) = (self.shape.num_fields, self.shape.num_dense, self.width());
        let d = w - offset;
        emb_grad.par_chunks_mut(f * w).zip(gx.par_chunks(f * d + nd)).for_each(|(grad, gx)| {
            for (field, g) in grad.chunks_exact_mut(w).zip(gx.chunks_exact(d)) {
                field[offset..].iter_mut().zip(g).for_each(|(a, g)| *a += g);
            }
        });
    }

    /// Logits of a batch; what the backward pass needs stays in `s`.
    pub(super) fn forward_direct(
        &self,
        emb: &[f32],
        dense: &[f32],
        rows: usize,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_sizes(emb, dense, rows)?;
        let (f, nd, d) = (self.shape.num_fields, self.shape.num_dense, self.shape.embedding_dim);
        let deep = |mlp: &Mlp, x: &[f32], s: &mut MlpScratch| mlp.forward_cpu(x, rows, s);
        let plus = |mut first: Vec<f32>, deep: &[f32]| {
            first.iter_mut().zip(deep).for_each(|(a, b)| *a += b);
            first
        };
        Ok(match &self.net {
            Net::Lr { dense: lin } => self.first_order(lin, false, emb, dense)?,
            Net::Fm { dense: lin } => self.first_order(lin, true, emb, dense)?,
            Net::Mlp { mlp } => {
                self.deep_input(emb, dense, rows, 0, &mut s.x);
                deep(mlp, &s.x, &mut s.deep)?;
                s.deep.output.clone()
            }
            Net::WideDeep { dense: lin, deep: mlp } | Net::DeepFm { dense: lin, deep: mlp } => {
                let fm = matches!(self.net, Net::DeepFm { .. });
                self.deep_input(emb, dense, rows, 1, &mut s.x);
                deep(mlp, &s.x, &mut s.deep)?;
                plus(self.first_order(lin, fm, emb, dense)?, &s.deep.output)
            }
            Net::Dlrm { bottom, top, n, .. } => {
                let n = *n;
                let pairs = n * (n - 1) / 2;
                // [bottom output | the fields' vectors] per row.
                let t: &[f32] = match bottom {
                    Some(mlp) => {
                        deep(mlp, dense, &mut s.bottom)?;
                        s.t.resize(rows * n * d, 0.0);
                        let below = &s.bottom.output;
                        s.t.par_chunks_mut(n * d).zip(emb.par_chunks(f * d)).enumerate().for_each(|(r, (t, e))| {
                            t[..d].copy_from_slice(&below[r * d..(r + 1) * d]);
                            t[d..].copy_from_slice(e);
                        });
                        &s.t
                    }
                    None => emb,
                };
                // The top MLP reads [bottom output | pairwise dots].
                let lead = if bottom.is_some() { d } else { 0 };
                s.x.resize(rows * (lead + pairs), 0.0);
                let below = &s.bottom.output;
                let rows_in = s.x.par_chunks_mut(lead + pairs).zip(t.par_chunks(n * d)).enumerate();
                rows_in.for_each_init(Vec::new, |buf, (r, (x, t))| {
                    x[..lead].copy_from_slice(&below[r * lead..(r + 1) * lead]);
                    pairwise_dots_row(t, d, &mut x[lead..], buf);
                });
                deep(top, &s.x, &mut s.deep)?;
                s.deep.output.clone()
            }
            Net::Dcn { cross, deep: mlp, precision } => {
                let x = f * d + nd;
                self.deep_input(emb, dense, rows, 0, &mut s.x);
                s.cross_out.resize_with(cross.len(), Vec::new);
                s.gates.resize_with(cross.len(), Vec::new);
                for (l, layer) in cross.iter().enumerate() {
                    let (w, b) = (layer.weight().storage_and_layout(), layer.bias().storage_and_layout());
                    let (w, b) = (cpu(&w.0, w.1)?, cpu(&b.0, b.1)?);
                    let (done, rest) = s.cross_out.split_at_mut(l);
                    let input: &[f32] = if l == 0 { &s.x } else { &done[l - 1] };
                    // Both overwritten whole.
                    let out = sized(&mut rest[0], rows * x);
                    let gate = sized(&mut s.gates[l], rows * x);
                    cross_forward(*precision, x, (&s.x, input), (w, b), gate, out);
                }
                let input: &[f32] = s.cross_out.last().unwrap_or(&s.x);
                deep(mlp, input, &mut s.deep)?;
                s.deep.output.clone()
            }
        })
    }

    /// The backward pass of the last [`forward_direct`](Self::forward_direct)
    /// on the same inputs and scratch, from `seed = d loss / d logits`:
    /// d loss / d pooled embeddings and the dense gradients.
    pub(super) fn backward_direct(
        &self,
        emb: &[f32],
        dense: &[f32],
        seed: &[f32],
        s: &mut Scratch,
    ) -> Result<(Vec<f32>, DenseGrads), ModelError> {
        let rows = seed.len();
        let (f, nd, d) = (self.shape.num_fields, self.shape.num_dense, self.shape.embedding_dim);
        let mut emb_grad = vec![0.0f32; emb.len()];
        let mut grads: Grads<'_> = Vec::new();
        match &self.net {
            Net::Lr { dense: lin } => self.first_order_grads(lin, false, (emb, dense), seed, &mut emb_grad, &mut grads),
            Net::Fm { dense: lin } => self.first_order_grads(lin, true, (emb, dense), seed, &mut emb_grad, &mut grads),
            Net::Mlp { mlp } => {
                grads.push((mlp.params(), mlp.backward_cpu(&s.x, seed, &mut s.deep)?));
                self.add_deep_grad(&s.deep.grad_input, 0, &mut emb_grad);
            }
            Net::WideDeep { dense: lin, deep } | Net::DeepFm { dense: lin, deep } => {
                let fm = matches!(self.net, Net::DeepFm { .. });
                self.first_order_grads(lin, fm, (emb, dense), seed, &mut emb_grad, &mut grads);
                grads.push((deep.params(), deep.backward_cpu(&s.x, seed, &mut s.deep)?));
                self.add_deep_grad(&s.deep.grad_input, 1, &mut emb_grad);
            }
            Net::Dlrm { bottom, top, n, .. } => {
                let n = *n;
                let pairs = n * (n - 1) / 2;
                let lead = if bottom.is_some() { d } else { 0 };
                grads.push((top.params(), top.backward_cpu(&s.x, seed, &mut s.deep)?));
                let g_top = &s.deep.grad_input;
                let t: &[f32] = if bottom.is_some() { &s.t } else { emb };
                let grad_t = sized(&mut s.grad_t, rows * n * d); // overwritten whole
                let rows_in = grad_t.par_chunks_mut(n * d).zip(t.par_chunks(n * d)).zip(g_top.par_chunks(lead + pairs));
                rows_in.for_each_init(Vec::new, |buf, ((grad, t), g)| {
                    // The dots' gradient, then the bottom output's from the top MLP.
                    pairwise_dots_grad_row(t, d, &g[lead..], grad, buf);
                    grad[..lead].iter_mut().zip(&g[..lead]).for_each(|(a, g)| *a += g);
                });
                emb_grad.par_chunks_mut(f * d).zip(grad_t.par_chunks(n * d)).for_each(|(e, g)| {
                    e.copy_from_slice(&g[lead..]);
                });
                if let Some(mlp) = bottom {
                    let g_below: Vec<f32> = grad_t.chunks_exact(n * d).flat_map(|g| &g[..d]).copied().collect();
                    grads.push((mlp.params(), mlp.backward_cpu(dense, &g_below, &mut s.bottom)?));
                }
            }
            Net::Dcn { cross, deep, precision } => {
                let x = f * d + nd;
                let input: &[f32] = s.cross_out.last().unwrap_or(&s.x);
                grads.push((deep.params(), deep.backward_cpu(input, seed, &mut s.deep)?));
                // `g`: the gradient at the current layer's output, from the deep MLP's input down.
                let mut g = std::mem::take(&mut s.deep.grad_input);
                let grad_x0 = zeroed(&mut s.grad_x0, rows * x);
                for (l, layer) in cross.iter().enumerate().rev() {
                    let w = layer.weight().storage_and_layout();
                    let w = cpu(&w.0, w.1)?;
                    let input: &[f32] = if l == 0 { &s.x } else { &s.cross_out[l - 1] };
                    let (mut dw, mut db) = (vec![0.0f32; x * x], vec![0.0f32; x]);
                    let dxl = sized(&mut s.grad_in, rows * x); // overwritten whole
                    let to = CrossGrads { x0: grad_x0, w: &mut dw, b: &mut db, xl: dxl };
                    cross_backward(*precision, x, (&s.x, input, w), &s.gates[l], &g, &mut s.grad_gate, to);
                    grads.push((layer.weight(), dw));
                    grads.push((layer.bias(), db));
                    std::mem::swap(&mut g, &mut s.grad_in);
                }
                // The first layer's input is x₀ itself.
                grad_x0.iter_mut().zip(&g).for_each(|(a, g)| *a += g);
                s.deep.grad_input = g;
                self.add_deep_grad(grad_x0, 0, &mut emb_grad);
            }
        }
        let mut grads_in_order = Vec::with_capacity(self.params.vars().len());
        for (_, var) in self.params.vars() {
            let at = grads.iter().position(|(v, _)| v.as_tensor().id() == var.as_tensor().id());
            grads_in_order.push(at.map(|i| std::mem::take(&mut grads[i].1)));
        }
        Ok((emb_grad, DenseGrads { grads: grads_in_order, rows: rows as u64 }))
    }

    /// Each MLP's buffers with the gradient buffer of its size, if one came back.
    pub(super) fn recycle_direct(&self, mut buffers: Vec<Vec<f32>>, s: &mut Scratch) {
        let mlps: Vec<(&Mlp, &mut MlpScratch)> = match &self.net {
            Net::Lr { .. } | Net::Fm { .. } => Vec::new(),
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
