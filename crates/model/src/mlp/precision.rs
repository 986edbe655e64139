//! [`matmul_in`]: a product `x·w` of candle's graph in the model's
//! precision (DCN-v2's cross layers), as the MLP stacks compute theirs.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::{contiguous, cpu, matmul};
use crate::ModelError;
use crate::bf16::Arith;
use crate::matrix::Operand;

/// `x·w` for `x: [rows, k]` and `w: [k, n]` in the model's precision, with
/// its backward pass: on CPU one custom op whose three products go through
/// [`matmul`] (bf16 or the fp32 gemm), elsewhere candle's matmul. DCN-v2's
/// cross layers use it, so `model.precision` reaches them as it reaches the
/// MLP stacks.
pub fn matmul_in(arith: Arith, x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        Ok(x.contiguous()?.apply_op2(&w.contiguous()?, PrecisionMatmul { arith })?)
    } else {
        Ok(x.matmul(w)?)
    }
}

struct PrecisionMatmul {
    arith: Arith,
}

/// `[rows, k]` and `[k, n]` of a product's operands, checked.
fn product_dims(xl: &Layout, wl: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match (xl.dims(), wl.dims()) {
        (&[rows, k], &[k2, n]) if k == k2 => Ok((rows, k, n)),
        (x, w) => Err(candle_core::Error::Msg(format!("matmul: shapes {x:?} and {w:?} do not multiply"))),
    }
}

impl CustomOp2 for PrecisionMatmul {
    fn name(&self) -> &'static str {
        "precision-matmul"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, k, n) = product_dims(xl, wl)?;
        let (x, w) = (contiguous(xs, xl)?, contiguous(ws, wl)?);
        let mut out = vec![0f32; rows * n];
        matmul(self.arith, None, rows, n, k, Operand::plain(x), Operand::plain(w), &mut out);
        Ok((CpuStorage::F32(out), Shape::from((rows, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_w) = {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let grad = grad_res.contiguous()?;
            let (gs, gl) = grad.storage_and_layout();
            let (rows, k, n) = product_dims(xl, wl)?;
            let (x, w, g) = (cpu(&xs, xl)?, cpu(&ws, wl)?, cpu(&gs, gl)?);
            let (mut grad_x, mut grad_w) = (vec![0f32; rows * k], vec![0f32; k * n]);
            // As in the MLP's backward pass: the two products side by side.
            rayon::join(
                || matmul(self.arith, Some(1), rows, k, n, Operand::plain(g), Operand::t(w), &mut grad_x),
                || matmul(self.arith, Some(1), k, n, rows, Operand::t(x), Operand::plain(g), &mut grad_w),
            );
            (grad_x, grad_w)
        };
        let grad_x = Tensor::from_vec(grad_x, x.shape(), x.device())?;
        let grad_w = Tensor::from_vec(grad_w, w.shape(), w.device())?;
        Ok((Some(grad_x), Some(grad_w)))
    }
}
