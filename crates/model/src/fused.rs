//! Fused candle ops for the hot layer shape `relu(x·W + b)`.
//!
//! As separate candle ops, the bias add and ReLU cost two allocating passes
//! forward and about ten backward (ReLU's gradient alone is built from
//! `zeros_like`, `ge`, `to_dtype`, `mul` and an accumulation). Fused, they are
//! one pass forward and two backward. CPU only for now; a CUDA kernel goes in
//! `cuda_fwd` without touching callers.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

fn contiguous_f32<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<f32>()?[start..end]),
        None => Err(candle_core::Error::Msg(format!("{op}: input must be contiguous"))),
    }
}

/// `relu(z + b)` for `z: [rows, n]`, `b: [n]`.
pub struct BiasRelu;

impl CustomOp2 for BiasRelu {
    fn name(&self) -> &'static str {
        "bias-relu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let z = contiguous_f32(self.name(), s1, l1)?;
        let b = contiguous_f32(self.name(), s2, l2)?;
        if b.is_empty() || z.len() % b.len() != 0 || l1.dims().last() != Some(&b.len()) {
            return Err(candle_core::Error::Msg(format!("bias-relu: shapes {:?} and {:?}", l1.dims(), l2.dims())));
        }
        let mut out = Vec::with_capacity(z.len());
        for row in z.chunks_exact(b.len()) {
            out.extend(row.iter().zip(b).map(|(z, b)| (z + b).max(0.0)));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _z: &Tensor,
        _b: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_z = res.apply_op2_no_bwd(grad_res, &ReluMask)?;
        let grad_b = grad_z.apply_op1_no_bwd(&ColumnSum)?;
        Ok((Some(grad_z), Some(grad_b)))
    }
}

/// Sum over rows of a `[rows, n]` matrix, accumulated row by row: candle's
/// `sum(0)` walks the strided dimension and cost more than the ReLU itself.
struct ColumnSum;

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "column-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(self.name(), s, l)?;
        let n = match l.dims() {
            [_, n] if *n > 0 => *n,
            dims => return Err(candle_core::Error::Msg(format!("column-sum: shape {dims:?}"))),
        };
        let mut acc = vec![0.0f32; n];
        for row in x.chunks_exact(n) {
            acc.iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
        Ok((CpuStorage::F32(acc), Shape::from(n)))
    }
}

/// `grad` where `out > 0`, else 0 (the ReLU adjoint, from the ReLU's output).
struct ReluMask;

impl CustomOp2 for ReluMask {
    fn name(&self) -> &'static str {
        "relu-mask"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = contiguous_f32(self.name(), s1, l1)?;
        let grad = contiguous_f32(self.name(), s2, l2)?;
        if out.len() != grad.len() {
            return Err(candle_core::Error::Msg("relu-mask: shapes differ".into()));
        }
        let masked = out.iter().zip(grad).map(|(&o, &g)| if o > 0.0 { g } else { 0.0 }).collect();
        Ok((CpuStorage::F32(masked), l2.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_op_matches_separate_ops_forward_and_backward() {
        let dev = Device::Cpu;
        let z =
            Var::from_tensor(&Tensor::new(&[[0.5f32, -1.0, 2.0], [-0.2, 0.3, -3.0]], &dev).expect("z")).expect("var");
        let b = Var::from_tensor(&Tensor::new(&[0.1f32, 0.5, -2.5], &dev).expect("b")).expect("var");
        let w = Tensor::new(&[[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &dev).expect("w");

        let fused = z.as_tensor().apply_op2(b.as_tensor(), BiasRelu).expect("fused");
        let plain = z.as_tensor().broadcast_add(b.as_tensor()).and_then(|t| t.relu()).expect("plain");
        assert_eq!(fused.to_vec2::<f32>().expect("v"), plain.to_vec2::<f32>().expect("v"));

        let gf = (fused * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
        let gp = (plain * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
        for v in [&z, &b] {
            let a = gf.get(v.as_tensor()).expect("grad").flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("v");
            let e = gp.get(v.as_tensor()).expect("grad").flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("v");
            assert_eq!(a, e);
        }
    }
}
