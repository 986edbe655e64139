//! `dlrm` (Naumov et al. 2019): a bottom MLP of `model.bottom_hidden` on
//! the dense values (its output a vector like a field's), the dot product
//! of every pair of vectors, and a top MLP of `model.hidden` on the bottom
//! output and the dots.

use candle_core::Tensor;
use rayon::prelude::*;
use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::parts::{head, mlp_params, stack_flops};
use super::{At, Build, Direct, Grads, Kind, Net};
use crate::ModelError;
use crate::fused::{PairwiseDots, RowBuf, Vectors, pairwise_dots_grad_row, pairwise_dots_row};
use crate::mlp::{Mlp, MlpScratch, sized};
use crate::spec::NetSpec;
use crate::step::{ModelShape, Scratch};

pub(super) struct Dlrm;

struct DlrmNet {
    bottom: Option<Mlp>,
    top: Mlp,
    /// Upper triangle (i < j) of the n×n dot-product matrix, flattened.
    pairs: Tensor,
    /// Vectors a row: the fields', and the bottom output's if any.
    n: usize,
}

impl Kind for Dlrm {
    fn name(&self) -> &'static str {
        "dlrm"
    }

    fn about(&self) -> &'static str {
        "DLRM: a bottom MLP on the dense values, pairwise dot products of every vector, a top MLP."
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        let (f, nd, d) = (at.shape.num_fields, at.shape.num_dense, at.shape.embedding_dim);
        let bottom = if nd == 0 {
            None
        } else {
            let sizes: Vec<usize> = at.config.bottom_hidden.iter().copied().chain(std::iter::once(d)).collect();
            Some(
                Mlp::new_normed(at.ps, "bottom", nd, &sizes, true, at.arith, at.normed())?
                    .with_dropout(at.config.dropout, at.simd),
            )
        };
        let n = f + usize::from(nd > 0);
        let pairs: Vec<u32> = (0..n).flat_map(|i| ((i + 1)..n).map(move |j| (i * n + j) as u32)).collect();
        let num_pairs = pairs.len();
        let pairs = Tensor::from_vec(pairs, num_pairs, at.device)?;
        let top_in = num_pairs + if nd > 0 { d } else { 0 };
        let top = Mlp::new_normed(
            at.ps,
            "top",
            top_in,
            &head(&at.config.hidden, at.outputs()),
            false,
            at.arith,
            at.normed(),
        )?
        .with_dropout(at.config.dropout, at.simd);
        Ok(Box::new(DlrmNet { bottom, top, pairs, n }))
    }

    /// The MLPs and `6·d` a pair for the dots.
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let (f, nd, d) = (shape.num_fields as f64, shape.num_dense as f64, shape.embedding_dim as f64);
        let bottom = if nd > 0.0 {
            let sizes: Vec<usize> = config.bottom_hidden.iter().copied().chain([shape.embedding_dim]).collect();
            stack_flops(nd, &sizes)
        } else {
            0.0
        };
        let n = f + if nd > 0.0 { 1.0 } else { 0.0 };
        let pairs = n * (n - 1.0) / 2.0;
        let top_in = pairs + if nd > 0.0 { d } else { 0.0 };
        bottom + 6.0 * d * pairs + stack_flops(top_in, &head(&config.hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let (f, nd, d) = (shape.num_fields as u128, shape.num_dense as u128, shape.embedding_dim as u128);
        let m = &config.model;
        let n = f + u128::from(nd > 0);
        let bottom = if nd > 0 { mlp_params(nd, &m.bottom_hidden) + (d + 1) * d } else { 0 };
        bottom + mlp_params(n * n.saturating_sub(1) / 2 + d, &m.hidden)
    }
}

impl Net for DlrmNet {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let (b, n) = (emb.dim(0)?, self.n);
        let (t, bottom_out) = match &self.bottom {
            Some(mlp) => {
                let x = mlp.forward(dense, at.dropout)?; // [B, d]
                (Tensor::cat(&[&x.unsqueeze(1)?, emb], 1)?, Some(x))
            }
            None => (emb.clone(), None),
        };
        let inter = if t.device().is_cpu() {
            t.contiguous()?.apply_op1(PairwiseDots(at.simd))?
        } else {
            // [B, n, n] dot products, then their upper triangle.
            t.matmul(&t.t()?)?.reshape((b, n * n))?.index_select(&self.pairs, 1)?
        };
        let top_in = match bottom_out {
            Some(x) => Tensor::cat(&[&x, &inter], 1)?,
            None => inter,
        };
        self.top.forward(&top_in, at.dropout)
    }

    fn spec(&self) -> Result<NetSpec, ModelError> {
        Ok(NetSpec::Dlrm { bottom: self.bottom.as_ref().map(|m| m.layers()).transpose()?, top: self.top.layers()? })
    }

    fn direct(&self) -> Option<&dyn Direct> {
        Some(self)
    }
}

impl Direct for DlrmNet {
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        let (f, d, row) = (at.shape.num_fields, at.shape.embedding_dim, at.row_len());
        let (n, simd) = (self.n, at.simd);
        let pairs = n * (n - 1) / 2;
        if let Some(mlp) = &self.bottom {
            s.dense.clear();
            for x in x.chunks_exact(row) {
                s.dense.extend_from_slice(&x[f * d..]);
            }
            mlp.forward_cpu(&s.dense, rows, at.dropout, &mut s.bottom)?;
        }
        // The top MLP reads [bottom output | pairwise dots of
        // (bottom output, the fields' vectors)].
        let lead = if self.bottom.is_some() { d } else { 0 };
        s.x.resize(rows * (lead + pairs), 0.0);
        let below = &s.bottom.output;
        let rows_in = s.x.par_chunks_mut(lead + pairs).zip(x.par_chunks(row)).enumerate();
        rows_in.for_each_init(RowBuf::default, |buf, (r, (top_in, x))| {
            let head = &below[r * lead..(r + 1) * lead];
            top_in[..lead].copy_from_slice(head);
            pairwise_dots_row(simd, Vectors { head, tail: &x[..f * d], d }, &mut top_in[lead..], buf);
        });
        self.top.forward_cpu(&s.x, rows, at.dropout, &mut s.deep)?;
        Ok(s.deep.output.clone())
    }

    fn backward<'a>(
        &'a self,
        at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        let (f, nd, d, row) = (at.shape.num_fields, at.shape.num_dense, at.shape.embedding_dim, at.row_len());
        let (rows, n, simd) = (seed.len(), self.n, at.simd);
        let pairs = n * (n - 1) / 2;
        let lead = if self.bottom.is_some() { d } else { 0 };
        grads.push((self.top.params(), self.top.backward_cpu(&s.x, seed, &mut s.deep)?));
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
        if let Some(mlp) = &self.bottom {
            grads.push((mlp.params(), mlp.backward_cpu(&s.dense, grad_below, &mut s.bottom)?));
        }
        // The dense values' gradient, through the bottom MLP.
        let from_below = &s.bottom.grad_input;
        grad_x.par_chunks_mut(row).enumerate().for_each(|(r, out)| {
            out[f * d..].copy_from_slice(&from_below[r * nd..(r + 1) * nd]);
        });
        Ok(())
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        let mut v = vec![(&self.top, &mut s.deep)];
        if let Some(b) = &self.bottom {
            v.push((b, &mut s.bottom));
        }
        v
    }
}
