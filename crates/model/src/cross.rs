//! DCN-v2's cross layer as one CPU op, beside the MLP stacks it shares the
//! products and buffers of (`mlp.rs`).

use std::sync::Mutex;

use candle_core::{CpuStorage, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::ModelError;
use crate::bf16::Arith;
use crate::mlp::{Operand, contiguous, cpu, err, linear_grads, matmul, matmul_in, sized};

/// One DCN-v2 cross layer, `x₀ ⊙ (x_l·W + b) + x_l`, forward and backward
/// as one CPU op (`wb` is `[W; b]`, `[x + 1, x]`): the product through
/// [`matmul`] in the model's precision, the gating in the same passes. As
/// candle ops the layer was a product and five element-wise passes each
/// way, each allocating a batch-sized tensor. The same arithmetic as those
/// ops (tested): `x₀·(u + b) + x_l`, rounded after each operation.
pub fn cross_layer(arith: Arith, x0: &Tensor, xl: &Tensor, wb: &Tensor) -> Result<Tensor, ModelError> {
    let op = CrossLayer { arith, gate: Mutex::new(Vec::new()) };
    Ok(x0.contiguous()?.apply_op3(&xl.contiguous()?, &wb.contiguous()?, op)?)
}

/// A DCN-v2 cross layer with weights `w: [x, x]` and bias `b: [x]`: the
/// fused op on CPU ([`cross_layer`]), candle's ops elsewhere.
pub fn cross(arith: Arith, x0: &Tensor, xl: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor, ModelError> {
    if x0.device().is_cpu() {
        cross_layer(arith, x0, xl, &Tensor::cat(&[w, &b.unsqueeze(0)?], 0)?)
    } else {
        let gate = matmul_in(arith, xl, w)?.broadcast_add(b)?;
        Ok(((x0 * gate)? + xl)?)
    }
}

/// One cross layer on slices of rows of `x` values: `gate = x_l·W + b`
/// (kept for the backward pass), `out = x₀ ⊙ gate + x_l`.
pub(crate) fn cross_forward(
    arith: Arith,
    x: usize,
    (x0, xl): (&[f32], &[f32]),
    (w, b): (&[f32], &[f32]),
    gate: &mut [f32],
    out: &mut [f32],
) {
    let rows = xl.len() / x.max(1);
    matmul(arith, None, rows, x, x, Operand::plain(xl), Operand::plain(w), gate);
    out.par_chunks_mut(x).zip(gate.par_chunks_mut(x)).zip(x0.par_chunks(x).zip(xl.par_chunks(x))).for_each(
        |((out, gate), (x0, xl))| {
            for j in 0..x {
                gate[j] += b[j];
                out[j] = x0[j] * gate[j] + xl[j];
            }
        },
    );
}

/// Where [`cross_backward`] puts a cross layer's gradients: `x0` and `b`
/// are added into (x₀ also feeds the other layers), `w` and `xl` are
/// overwritten.
pub(crate) struct CrossGrads<'a> {
    pub x0: &'a mut [f32],
    pub w: &'a mut [f32],
    pub b: &'a mut [f32],
    pub xl: &'a mut [f32],
}

/// The adjoint of [`cross_forward`] from `g = d loss / d out`:
/// `d x₀ += g ⊙ gate`, `d gate = g ⊙ x₀` (in `grad_gate`, a buffer),
/// `d W = x_lᵀ·d gate`, `d b += Σ_rows d gate`, `d x_l = d gate·Wᵀ + g`.
pub(crate) fn cross_backward(
    arith: Arith,
    x: usize,
    (x0, xl, w): (&[f32], &[f32], &[f32]),
    gate: &[f32],
    g: &[f32],
    grad_gate: &mut Vec<f32>,
    grads: CrossGrads<'_>,
) {
    let rows = xl.len() / x.max(1);
    let grad_gate = sized(grad_gate, rows * x);
    grads.x0.par_chunks_mut(x).zip(grad_gate.par_chunks_mut(x)).zip(g.par_chunks(x)).enumerate().for_each(
        |(r, ((dx0, dgate), g))| {
            let (gate, x0) = (&gate[r * x..(r + 1) * x], &x0[r * x..(r + 1) * x]);
            for j in 0..x {
                dx0[j] += g[j] * gate[j];
                dgate[j] = g[j] * x0[j];
            }
        },
    );
    // The bias's sums give the same bits on every build.
    let arith = (arith, sparrow_core::simd::Simd::Auto);
    linear_grads(arith, (rows, x, x), (xl, None), w, grad_gate, (grads.w, grads.b), grads.xl);
    grads.xl.iter_mut().zip(g).for_each(|(d, g)| *d += g);
}

struct CrossLayer {
    arith: Arith,
    /// `x_l·W + b` of the forward pass, for the backward pass.
    gate: Mutex<Vec<f32>>,
}

/// `[rows, x]`, `[rows, x]` and `[x + 1, x]`, checked.
fn cross_dims(l0: &Layout, l1: &Layout, lw: &Layout) -> candle_core::Result<(usize, usize)> {
    match (l0.dims(), l1.dims(), lw.dims()) {
        (&[rows, x], &[rows1, x1], &[x2, x3]) if rows == rows1 && x == x1 && x2 == x + 1 && x3 == x => Ok((rows, x)),
        (a, b, c) => Err(err(format!("cross layer: shapes {a:?}, {b:?}, {c:?} do not fit"))),
    }
}

impl candle_core::CustomOp3 for CrossLayer {
    fn name(&self) -> &'static str {
        "cross-layer"
    }

    fn cpu_fwd(
        &self,
        s0: &CpuStorage,
        l0: &Layout,
        s1: &CpuStorage,
        l1: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, x) = cross_dims(l0, l1, lw)?;
        let (x0, xl, wb) = (contiguous(s0, l0)?, contiguous(s1, l1)?, contiguous(sw, lw)?);
        let (w, b) = wb.split_at(x * x);
        let mut gate = self.gate.lock().map_err(|_| err("poisoned"))?;
        gate.resize(rows * x, 0.0);
        let mut out = vec![0f32; rows * x];
        cross_forward(self.arith, x, (x0, xl), (w, b), &mut gate, &mut out);
        Ok((CpuStorage::F32(out), Shape::from((rows, x))))
    }

    fn bwd(
        &self,
        x0: &Tensor,
        xl: &Tensor,
        wb: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gate = self.gate.lock().map_err(|_| err("poisoned"))?;
        let (rows, x) = cross_dims(x0.layout(), xl.layout(), wb.layout())?;
        if gate.len() != rows * x {
            return Err(err("cross layer: backward without a matching forward"));
        }
        let grad = grad_res.contiguous()?;
        let (grad_x0, grad_xl, grad_wb) = {
            let (s0, l0) = x0.storage_and_layout();
            let (s1, l1) = xl.storage_and_layout();
            let (sw, lw) = wb.storage_and_layout();
            let (sg, lg) = grad.storage_and_layout();
            let (x0, xl, wb, g) = (cpu(&s0, l0)?, cpu(&s1, l1)?, cpu(&sw, lw)?, cpu(&sg, lg)?);
            let mut grad_x0 = vec![0f32; rows * x];
            let mut grad_wb = vec![0f32; (x + 1) * x];
            let mut grad_xl = vec![0f32; rows * x];
            let mut grad_gate = Vec::new();
            let (dw, db) = grad_wb.split_at_mut(x * x);
            let grads = CrossGrads { x0: &mut grad_x0, w: dw, b: db, xl: &mut grad_xl };
            cross_backward(self.arith, x, (x0, xl, &wb[..x * x]), &gate, g, &mut grad_gate, grads);
            (grad_x0, grad_xl, grad_wb)
        };
        let grad_x0 = Tensor::from_vec(grad_x0, x0.shape(), x0.device())?;
        let grad_xl = Tensor::from_vec(grad_xl, xl.shape(), xl.device())?;
        let grad_wb = Tensor::from_vec(grad_wb, wb.shape(), wb.device())?;
        Ok((Some(grad_x0), Some(grad_xl), Some(grad_wb)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use sparrow_core::config::Precision;
    use sparrow_core::rng::Rng;

    use super::*;

    fn arith(p: Precision) -> Arith {
        Arith::new(p, sparrow_core::simd::Simd::Auto)
    }

    /// The fused cross layer against the same layer from candle's ops (its
    /// product through `matmul_in`, so in the same precision): the output
    /// and every gradient, in f32 and in bf16. Only the bias gradient's sum
    /// over rows may round differently.
    #[test]
    fn fused_cross_layer_equals_candle_ops_in_both_precisions() {
        let (rows, x) = (11, 19);
        let mut rng = Rng::new(12);
        let mut draw = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
        let (x0v, xlv, wv, bv, seedv) = (draw(rows * x), draw(rows * x), draw(x * x), draw(x), draw(rows * x));
        let dev = Device::Cpu;
        for precision in [Precision::F32, Precision::Bf16] {
            let run = |fused: bool| {
                let var = |v: &Vec<f32>, shape: &[usize]| {
                    Var::from_tensor(&Tensor::from_vec(v.clone(), shape, &dev).expect("t")).expect("var")
                };
                let (x0, xl, w, b) = (var(&x0v, &[rows, x]), var(&xlv, &[rows, x]), var(&wv, &[x, x]), var(&bv, &[x]));
                let y = if fused {
                    let wb = Tensor::cat(&[w.as_tensor(), &b.as_tensor().unsqueeze(0).expect("row")], 0).expect("cat");
                    cross_layer(arith(precision), x0.as_tensor(), xl.as_tensor(), &wb).expect("fused")
                } else {
                    let u = matmul_in(arith(precision), xl.as_tensor(), w.as_tensor()).expect("product");
                    let gate = u.broadcast_add(b.as_tensor()).expect("bias");
                    ((x0.as_tensor() * gate).expect("gate") + xl.as_tensor()).expect("residual")
                };
                let seed = Tensor::from_vec(seedv.clone(), (rows, x), &dev).expect("seed");
                let g = (&y * &seed).expect("mul").sum_all().expect("sum").backward().expect("backward");
                let flat = |t: &Tensor| t.flatten_all().expect("flat").to_vec1::<f32>().expect("vec");
                let grad = |v: &Var| flat(g.get(v.as_tensor()).expect("grad"));
                [flat(&y), grad(&x0), grad(&xl), grad(&w), grad(&b)]
            };
            let (fused, ops) = (run(true), run(false));
            for (what, a, b) in
                ["y", "d x0", "d xl", "d W", "d b"].iter().zip(&fused).zip(&ops).map(|((w, a), b)| (w, a, b))
            {
                assert_eq!(a.len(), b.len(), "{what}");
                for (u, v) in a.iter().zip(b) {
                    if *what == "d b" {
                        assert!((u - v).abs() <= 1e-5 * (1.0 + v.abs()), "{precision:?} {what}: {u} vs {v}");
                    } else {
                        assert_eq!(u.to_bits(), v.to_bits(), "{precision:?} {what}: {u} vs {v}");
                    }
                }
            }
        }
    }
}
