//! The MLP's bias-and-ReLU pass forward and its ReLU mask backward, in
//! blocks of rows across the pool; and a caller's way to take an MLP's
//! output gradient through its last ReLU as it writes it.

use rayon::prelude::*;

use super::{First, Mlp, MlpScratch, ROWS_PER_TASK, err};
use crate::ModelError;

/// `out += b` a row, then ReLU where `relu`.
pub(super) fn add_bias(out: &mut [f32], b: &[f32], relu: bool) {
    if b.is_empty() {
        return;
    }
    out.par_chunks_mut(b.len() * ROWS_PER_TASK).for_each(|rows| {
        for row in rows.chunks_exact_mut(b.len()) {
            if relu {
                row.iter_mut().zip(b).for_each(|(o, b)| *o = (*o + b).max(0.0));
            } else {
                row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
    });
}

/// `g` through a ReLU whose output was `a`: zero where `a` is not
/// positive. After dropout (`scale` ≠ 1) a dropped value is 0 too, and a
/// kept one was multiplied by `scale`, as its gradient is here.
pub(super) fn relu_mask(g: &mut [f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(a.par_chunks(block)).for_each(|(g, a)| through_relu(g, a, scale));
}

/// [`relu_mask`] of a few rows, on the caller's thread.
#[inline(always)]
pub(crate) fn through_relu(g: &mut [f32], a: &[f32], scale: f32) {
    if scale == 1.0 {
        g.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g } else { 0.0 });
    } else {
        g.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g * scale } else { 0.0 });
    }
}

/// [`relu_mask`] of `from`, written to `g`.
pub(super) fn relu_mask_from(g: &mut [f32], from: &[f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    g.par_chunks_mut(block).zip(from.par_chunks(block)).zip(a.par_chunks(block)).for_each(|((g, from), a)| {
        let pairs = g.iter_mut().zip(from).zip(a);
        if scale == 1.0 {
            pairs.for_each(|((g, &f), &a)| *g = if a > 0.0 { f } else { 0.0 });
        } else {
            pairs.for_each(|((g, &f), &a)| *g = if a > 0.0 { f * scale } else { 0.0 });
        }
    });
}

impl Mlp {
    /// Where the last layer ends in a ReLU, what a caller that writes d
    /// loss / d output can take it through that ReLU with as it writes it
    /// ([`through_relu`] with the output and this scale), for [`backward_cpu_masked`](Self::backward_cpu_masked):
    /// the scale of the last forward pass's dropout (1: none).
    pub fn output_mask(&self, scratch: &MlpScratch) -> Option<f32> {
        self.shape.masks_output().then_some(scratch.dropout_scale)
    }

    /// [`backward_cpu`](Self::backward_cpu) from d loss / d output already
    /// through the last layer's ReLU ([`output_mask`](Self::output_mask)):
    /// the pass that masks it is skipped (the multi-task gates' adjoint
    /// masks each expert's gradient as it writes it).
    pub fn backward_cpu_masked(
        &self,
        x: &[f32],
        grad_out: &[f32],
        scratch: &mut MlpScratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.backward_masked_laid(First::Input(x), grad_out, scratch)
    }

    /// [`backward_cpu_masked`](Self::backward_cpu_masked) on a laid-out
    /// input, perhaps packed ([`First::Packed`]).
    pub(crate) fn backward_masked_laid(
        &self,
        x: First<'_>,
        grad_out: &[f32],
        scratch: &mut MlpScratch,
    ) -> Result<Vec<f32>, ModelError> {
        if !self.shape.masks_output() {
            return Err(ModelError::Candle(err("a gradient through the last ReLU, for layers without one")));
        }
        self.backward_laid(x, (grad_out, true), scratch)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::Precision;
    use sparrow_core::rng::Rng;
    use sparrow_core::simd::Simd;

    use super::*;
    use crate::bf16::Arith;
    use crate::params::ParamStore;

    /// A gradient taken through the last ReLU by the caller, with and
    /// without dropout's scale, gives the bits of the stack's own masking
    /// pass; a stack whose last layer has no ReLU refuses it by name.
    #[test]
    fn a_gradient_masked_by_the_caller_is_the_stacks_own() {
        for dropout in [0.0, 0.25] {
            let mut ps = ParamStore::new(3, Device::Cpu);
            let arith = Arith::new(Precision::F32, Simd::Auto);
            let mlp = Mlp::new(&mut ps, "m", 7, &[9, 6], true, arith).expect("mlp").with_dropout(dropout, Simd::Auto);
            let mut rng = Rng::new(6);
            let rows = 11;
            let x: Vec<f32> = (0..rows * 7).map(|_| rng.normal() as f32).collect();
            let grad_out: Vec<f32> = (0..rows * 6).map(|_| rng.normal() as f32).collect();
            let (mut own, mut masked) = (MlpScratch::default(), MlpScratch::default());
            let draw = (dropout > 0.0).then_some(17);
            mlp.forward_cpu(&x, rows, draw, &mut own).expect("forward");
            mlp.forward_cpu(&x, rows, draw, &mut masked).expect("forward");
            let scale = mlp.output_mask(&masked).expect("the last layer ends in a ReLU");
            assert_eq!(scale == 1.0, dropout == 0.0, "dropout's scale");
            let mut through = grad_out.clone();
            through_relu(&mut through, &masked.output, scale);
            assert!(through.contains(&0.0) && through.iter().any(|&g| g != 0.0), "some masked, some not");
            let a = mlp.backward_cpu(&x, &grad_out, &mut own).expect("backward");
            let b = mlp.backward_cpu_masked(&x, &through, &mut masked).expect("backward, masked");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "dropout {dropout}: the weights' gradients");
            assert_eq!(bits(&own.grad_input), bits(&masked.grad_input), "dropout {dropout}: d input");
        }
        let mut ps = ParamStore::new(3, Device::Cpu);
        let arith = Arith::new(Precision::F32, Simd::Auto);
        let tower = Mlp::new(&mut ps, "t", 4, &[3, 1], false, arith).expect("mlp");
        let mut s = MlpScratch::default();
        tower.forward_cpu(&[0.5; 8], 2, None, &mut s).expect("forward");
        assert_eq!(tower.output_mask(&s), None, "no last ReLU, no mask");
        let err = tower.backward_cpu_masked(&[0.5; 8], &[1.0; 2], &mut s).expect_err("refused");
        assert!(err.to_string().contains("last ReLU"), "{err}");
    }
}
