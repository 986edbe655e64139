//! `nfm` (He & Chua 2017, "Neural Factorization Machines"): LR's
//! first-order terms beside an MLP of `model.hidden` on the bi-interaction
//! pooling of the fields' vectors, `½ [(Σ_f v_f)² − Σ_f v_f²]` (element by
//! element, one `d`-vector a row: FM's pairwise products before they are
//! summed), and the dense values. Graph step only (candle's autograd); its
//! export is generic operations ([`Op`]).

use candle_core::Tensor;
use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::first_order::FirstOrder;
use super::parts::{head, mlp_params, stack_flops, vectors};
use super::{At, Build, Kind, Net};
use crate::ModelError;
use crate::mlp::Mlp;
use crate::spec::{NetSpec, Op};
use crate::step::ModelShape;

pub(super) struct Nfm;

struct NfmNet {
    first: FirstOrder,
    deep: Mlp,
    /// Floats of a field: its first-order weight, then its vector.
    width: usize,
}

impl Kind for Nfm {
    fn name(&self) -> &'static str {
        "nfm"
    }

    fn about(&self) -> &'static str {
        "NFM: first-order terms beside an MLP on the fields' bi-interaction pooling (FM's products, unsummed)."
    }

    fn embedding_width(&self, embedding_dim: usize) -> usize {
        1 + embedding_dim
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        let first = FirstOrder::new(at.ps, at.shape.num_dense, false)?;
        let input = at.shape.embedding_dim + at.shape.num_dense;
        let deep = Mlp::new_normed(
            at.ps,
            "deep",
            input,
            &head(&at.config.hidden, at.outputs()),
            false,
            at.arith,
            at.normed(),
        )?
        .with_dropout(at.config.dropout, at.simd);
        Ok(Box::new(NfmNet { first, deep, width: 1 + at.shape.embedding_dim }))
    }

    /// The first-order terms, the pooling's `5·f·d` (as FM's second order)
    /// and the MLP on `d + num_dense`.
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let (f, nd, d) = (shape.num_fields as f64, shape.num_dense as f64, shape.embedding_dim as f64);
        2.0 * f + 6.0 * nd + 5.0 * f * d + stack_flops(d + nd, &head(&config.hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let nd = shape.num_dense as u128;
        nd + 1 + mlp_params(shape.embedding_dim as u128 + nd, &config.model.hidden)
    }
}

impl Net for NfmNet {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let v = vectors(at, emb)?; // [B, F, d]
        let sum = v.sum(1)?; // [B, d]
        let pooled = ((sum.sqr()? - v.sqr()?.sum(1)?)? * 0.5)?;
        let x = if at.shape.num_dense > 0 { Tensor::cat(&[&pooled, dense], 1)? } else { pooled };
        let deep = self.deep.forward(&x, at.dropout)?;
        Ok(self.first.forward(at, emb, dense)?.broadcast_add(&deep)?)
    }

    fn spec(&self) -> Result<NetSpec, ModelError> {
        let (dense, bias) = self.first.spec()?;
        let d_end = self.width;
        let mut ops = vec![
            Op::SumFields { start: 1, end: d_end },       // 0: Σ_f v_f
            Op::Mul(0, 0),                                // 1: its square
            Op::SumFieldSquares { start: 1, end: d_end }, // 2: Σ_f v_f²
            Op::Sub(1, 2),
            Op::Scale(3, 0.5), // 4: the pooling
        ];
        let deep_in = if dense.is_some() {
            ops.push(Op::DenseValues); // 5
            ops.push(Op::Concat(vec![4, 5])); // 6
            6
        } else {
            4
        };
        ops.push(Op::Layers(deep_in, self.deep.layers()?));
        let deep = ops.len() - 1;
        ops.push(Op::SumFields { start: 0, end: 1 }); // Σ_f w_f
        let mut first = ops.len() - 1;
        if let Some(layer) = dense {
            ops.push(Op::DenseValues);
            ops.push(Op::Layers(ops.len() - 1, vec![layer]));
            ops.push(Op::Add(first, ops.len() - 1));
            first = ops.len() - 1;
        }
        ops.push(Op::Offset(first, bias));
        ops.push(Op::Add(ops.len() - 1, deep));
        Ok(NetSpec::Ops(ops))
    }
}
