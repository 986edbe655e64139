//! The MLP's bias-and-ReLU pass forward and its ReLU mask backward, in
//! blocks of rows across the pool; and a caller's way to take an MLP's
//! output gradient through its last ReLU as it writes it.

use rayon::prelude::*;
use sparrow_core::simd::Simd;

use super::{First, Mlp, MlpScratch, ROWS_PER_TASK, err};
use crate::ModelError;
use crate::columns::avx512f;

/// `out += b` a row, then ReLU where `relu`; in the AVX-512F build where
/// `simd` allows and the CPU has it (the crate's baseline build took
/// these passes four floats at a time).
pub(super) fn add_bias(simd: Simd, out: &mut [f32], b: &[f32], relu: bool) {
    if b.is_empty() {
        return;
    }
    let wide = avx512f(simd);
    out.par_chunks_mut(b.len() * ROWS_PER_TASK).for_each(|rows| {
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn bias_avx512(rows: &mut [f32], b: &[f32], relu: bool) {
                bias_rows(rows, b, relu);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { bias_avx512(rows, b, relu) };
        }
        bias_rows(rows, b, relu);
    });
}

/// [`add_bias`] of a block of rows, in `for` loops (no `for_each`, whose
/// `fold` can be compiled apart from the AVX-512 build calling it).
#[inline(always)]
fn bias_rows(rows: &mut [f32], b: &[f32], relu: bool) {
    for row in rows.chunks_exact_mut(b.len()) {
        if relu {
            for (o, b) in row.iter_mut().zip(b) {
                *o = (*o + b).max(0.0);
            }
        } else {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// `g` through a ReLU whose output was `a`: zero where `a` is not
/// positive. After dropout (`scale` ≠ 1) a dropped value is 0 too, and a
/// kept one was multiplied by `scale`, as its gradient is here.
pub(super) fn relu_mask(simd: Simd, g: &mut [f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    let wide = avx512f(simd);
    g.par_chunks_mut(block).zip(a.par_chunks(block)).for_each(|(g, a)| {
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn mask_avx512(g: &mut [f32], a: &[f32], scale: f32) {
                through_relu(g, a, scale);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { mask_avx512(g, a, scale) };
        }
        through_relu(g, a, scale);
    });
}

/// [`relu_mask`] of a few rows, on the caller's thread. `for` loops over
/// the pairs: vectorized in either build (indexing them was not, in the
/// baseline build), and no `for_each` whose `fold` may be compiled apart
/// from an AVX-512 caller.
#[inline(always)]
pub(crate) fn through_relu(g: &mut [f32], a: &[f32], scale: f32) {
    if scale == 1.0 {
        for (g, &a) in g.iter_mut().zip(a) {
            *g = if a > 0.0 { *g } else { 0.0 };
        }
    } else {
        for (g, &a) in g.iter_mut().zip(a) {
            *g = if a > 0.0 { *g * scale } else { 0.0 };
        }
    }
}

/// [`relu_mask`] of `from`, written to `g`.
pub(super) fn relu_mask_from(simd: Simd, g: &mut [f32], from: &[f32], a: &[f32], width: usize, scale: f32) {
    let block = width.max(1) * ROWS_PER_TASK;
    let wide = avx512f(simd);
    g.par_chunks_mut(block).zip(from.par_chunks(block)).zip(a.par_chunks(block)).for_each(|((g, from), a)| {
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[target_feature(enable = "avx512f")]
            fn mask_from_avx512(g: &mut [f32], from: &[f32], a: &[f32], scale: f32) {
                mask_from(g, from, a, scale);
            }
            // SAFETY: `wide` is true only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { mask_from_avx512(g, from, a, scale) };
        }
        mask_from(g, from, a, scale);
    });
}

/// [`relu_mask_from`] of a block of rows.
#[inline(always)]
fn mask_from(g: &mut [f32], from: &[f32], a: &[f32], scale: f32) {
    let pairs = g.iter_mut().zip(from).zip(a);
    if scale == 1.0 {
        for ((g, &f), &a) in pairs {
            *g = if a > 0.0 { f } else { 0.0 };
        }
    } else {
        for ((g, &f), &a) in pairs {
            *g = if a > 0.0 { f * scale } else { 0.0 };
        }
    }
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

    /// The bias-and-ReLU pass and the masks give the portable build's bits
    /// in the AVX-512F build (where the CPU has it), NaN, infinities and
    /// signed zeros included, at widths of whole vectors and not, with and
    /// without dropout's scale.
    #[test]
    fn the_passes_give_the_portable_bits_on_every_build() {
        let mut rng = Rng::new(9);
        let odd = [f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE / 4.0];
        let mut value = |i: usize| if i.is_multiple_of(11) { odd[i / 11 % odd.len()] } else { rng.normal() as f32 };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for width in [1, 5, 16, 41, 64] {
            let rows = 70;
            let out: Vec<f32> = (0..rows * width).map(&mut value).collect();
            let bias: Vec<f32> = (0..width).map(|i| value(i + 3)).collect();
            let (g, a): (Vec<f32>, Vec<f32>) = (0..rows * width).map(|i| (value(i + 1), value(i + 5))).unzip();
            for relu in [false, true] {
                let [mut wide, mut portable] = [out.clone(), out.clone()];
                add_bias(Simd::Auto, &mut wide, &bias, relu);
                add_bias(Simd::Portable, &mut portable, &bias, relu);
                assert_eq!(bits(&wide), bits(&portable), "add_bias, width {width}, relu {relu}");
            }
            for scale in [1.0, 1.25] {
                let [mut wide, mut portable] = [g.clone(), g.clone()];
                relu_mask(Simd::Auto, &mut wide, &a, width, scale);
                relu_mask(Simd::Portable, &mut portable, &a, width, scale);
                assert_eq!(bits(&wide), bits(&portable), "relu_mask, width {width}, scale {scale}");
                let mut by_rows = g.clone();
                through_relu(&mut by_rows, &a, scale);
                assert_eq!(bits(&wide), bits(&by_rows), "relu_mask and through_relu, width {width}");
                let [mut wide, mut portable] = [vec![7.0; g.len()], vec![7.0; g.len()]];
                relu_mask_from(Simd::Auto, &mut wide, &g, &a, width, scale);
                relu_mask_from(Simd::Portable, &mut portable, &g, &a, width, scale);
                assert_eq!(bits(&wide), bits(&portable), "relu_mask_from, width {width}, scale {scale}");
                assert_eq!(bits(&wide), bits(&by_rows), "relu_mask_from and relu_mask, width {width}");
            }
        }
    }
}
