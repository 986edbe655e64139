//! The network of `wide_deep` and `deepfm`: the first-order part (with
//! FM's second order for DeepFM) beside an MLP of `model.hidden` on the
//! fields' vectors (without their first-order column) and the dense values.

use candle_core::Tensor;

use super::first_order::{FirstOrder, deep_input};
use super::parts::{flat_with_dense, head, vectors};
use super::{At, Build, Direct, Grads, Net};
use crate::ModelError;
use crate::mlp::{Mlp, MlpScratch, sized};
use crate::spec::NetSpec;
use crate::step::Scratch;

pub(super) struct Beside {
    first: FirstOrder,
    deep: Mlp,
}

impl Beside {
    /// The bias, the dense values' weights, then the MLP (the parameters' order).
    pub(super) fn build(at: &mut Build<'_>, fm: bool) -> Result<Beside, ModelError> {
        let first = FirstOrder::new(at.ps, at.shape.num_dense, fm)?;
        let sizes = head(&at.config.hidden, at.outputs());
        Ok(Beside {
            first,
            deep: Mlp::new_normed(at.ps, "deep", at.flat_len(), &sizes, false, at.arith, at.normed())?
                .with_dropout(at.config.dropout, at.simd),
        })
    }
}

impl Net for Beside {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let deep = self.deep.forward(&flat_with_dense(at, &vectors(at, emb)?, dense)?, at.dropout)?;
        Ok(self.first.forward(at, emb, dense)?.broadcast_add(&deep)?)
    }

    fn spec(&self) -> Result<NetSpec, ModelError> {
        let (dense, bias) = self.first.spec()?;
        Ok(NetSpec::WideDeep { second_order: self.first.fm, dense, bias, deep: self.deep.layers()? })
    }

    fn direct(&self) -> Option<&dyn Direct> {
        Some(self)
    }
}

impl Direct for Beside {
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        deep_input(at, x, 1, &mut s.x);
        self.deep.forward_cpu(&s.x, rows, at.dropout, &mut s.deep)?;
        let mut logits = self.first.logits(at, x, &mut s.fm_sums)?;
        logits.iter_mut().zip(&s.deep.output).for_each(|(a, b)| *a += b);
        Ok(logits)
    }

    fn backward<'a>(
        &'a self,
        at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        grads.push((self.deep.params(), self.deep.backward_cpu(&s.x, seed, &mut s.deep)?));
        let grad_x = sized(&mut s.grad_x, seed.len() * at.row_len()); // every value written
        let deep_grad = (Some(&s.deep.grad_input[..]), 1);
        self.first.grads(at, &s.fm_sums, x, seed, deep_grad, grad_x, grads)
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        vec![(&self.deep, &mut s.deep)]
    }
}
