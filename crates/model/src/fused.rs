//! Fused candle ops: DLRM's pairwise-dot interaction and its adjoint (the
//! MLP layers' bias + ReLU are fused inside `mlp.rs`'s op). CPU only for now;
//! a CUDA kernel goes in `cuda_fwd` without touching callers.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

fn contiguous_f32<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<f32>()?[start..end]),
        None => Err(candle_core::Error::Msg(format!("{op}: input must be contiguous"))),
    }
}

/// DLRM's interaction: for `t: [rows, n, d]`, the dot product of every pair
/// `i < j` of the n vectors of a row, `[rows, n(n-1)/2]`, pairs in row-major
/// upper-triangle order. As candle ops (a batched n×d·d×n matmul, then an
/// index_select of the upper triangle) a step spent more in a thousand tiny
/// matmuls and in index_add than in the whole top MLP.
pub struct PairwiseDots;

fn rows_n_d(op: &str, l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match l.dims() {
        [rows, n, d] => Ok((*rows, *n, *d)),
        dims => Err(candle_core::Error::Msg(format!("{op}: expected [rows, n, d], got {dims:?}"))),
    }
}

/// Dot product with 8 independent accumulators: a plain `sum()` is one long
/// dependency chain of float adds, which the compiler may not reorder.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl CustomOp1 for PairwiseDots {
    fn name(&self) -> &'static str {
        "pairwise-dots"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = contiguous_f32(self.name(), s, l)?;
        let (rows, n, d) = rows_n_d(self.name(), l)?;
        let pairs = n * n.saturating_sub(1) / 2;
        let mut out = vec![0.0f32; rows * pairs];
        if pairs > 0 {
            out.par_chunks_mut(pairs).zip(t.par_chunks(n * d)).for_each(|(out, v)| {
                let mut k = 0;
                for i in 0..n {
                    for j in i + 1..n {
                        out[k] = dot(&v[i * d..(i + 1) * d], &v[j * d..(j + 1) * d]);
                        k += 1;
                    }
                }
            });
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, pairs))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(grad_res, &PairwiseDotsGrad)?))
    }
}

/// d loss / d t of [`PairwiseDots`]: `grad[i] += g_ij · t[j]`, `grad[j] += g_ij · t[i]`.
struct PairwiseDotsGrad;

impl CustomOp2 for PairwiseDotsGrad {
    fn name(&self) -> &'static str {
        "pairwise-dots-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = contiguous_f32(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let (rows, n, d) = rows_n_d(self.name(), l1)?;
        let pairs = n * n.saturating_sub(1) / 2;
        if g.len() != rows * pairs {
            return Err(candle_core::Error::Msg(format!("pairwise-dots-grad: gradient {:?}", l2.dims())));
        }
        let mut grad = vec![0.0f32; rows * n * d];
        if pairs > 0 {
            grad.par_chunks_mut(n * d).zip(t.par_chunks(n * d)).zip(g.par_chunks(pairs)).for_each(|((grad, v), g)| {
                let mut k = 0;
                for i in 0..n {
                    for j in i + 1..n {
                        let gij = g[k];
                        k += 1;
                        let (lo, hi) = grad.split_at_mut(j * d);
                        let (gi, gj) = (&mut lo[i * d..(i + 1) * d], &mut hi[..d]);
                        gi.iter_mut().zip(&v[j * d..(j + 1) * d]).for_each(|(a, b)| *a += gij * b);
                        gj.iter_mut().zip(&v[i * d..(i + 1) * d]).for_each(|(a, b)| *a += gij * b);
                    }
                }
            });
        }
        Ok((CpuStorage::F32(grad), l1.shape().clone()))
    }
}

/// The sparse part of the first-order and FM models, from `emb: [rows, f,
/// 1 + d]` (each field's leading column is its first-order weight, the rest
/// its factor vector `v`): `Σ_f emb[f][0]`, plus with `second_order`
/// FM's `½ Σ_k [(Σ_f v_fk)² − Σ_f v_fk²]`, as `[rows, 1]`. As candle ops
/// (narrow, sums, squares and their adjoints) FM's dense step took 7 ms a
/// batch of 1024 for 2k flops a sample.
pub struct FirstOrderFm {
    pub second_order: bool,
}

impl CustomOp1 for FirstOrderFm {
    fn name(&self) -> &'static str {
        "first-order-fm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let e = contiguous_f32(self.name(), s, l)?;
        let (rows, f, w) = rows_n_d(self.name(), l)?;
        let mut out = vec![0.0f32; rows];
        let d = w.saturating_sub(1);
        if f * w > 0 {
            let rows_in = out.par_iter_mut().zip(e.par_chunks(f * w));
            rows_in.for_each_init(
                || vec![0.0f32; d],
                |sum, (out, e)| {
                    sum.fill(0.0);
                    let (mut first, mut squares) = (0.0f32, 0.0f32);
                    for field in e.chunks_exact(w) {
                        first += field[0];
                        if self.second_order {
                            let v = &field[1..];
                            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
                            squares += v.iter().map(|x| x * x).sum::<f32>();
                        }
                    }
                    let second =
                        if self.second_order { 0.5 * (sum.iter().map(|s| s * s).sum::<f32>() - squares) } else { 0.0 };
                    *out = first + second;
                },
            );
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, 1))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = FirstOrderFmGrad { second_order: self.second_order };
        Ok(Some(arg.apply_op2_no_bwd(grad_res, &grad)?))
    }
}

/// d loss / d emb of [`FirstOrderFm`]: `g` on each leading column, and
/// `g · (Σ_f v_fk − v_fk)` on the factors.
struct FirstOrderFmGrad {
    second_order: bool,
}

impl CustomOp2 for FirstOrderFmGrad {
    fn name(&self) -> &'static str {
        "first-order-fm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let e = contiguous_f32(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let (rows, f, w) = rows_n_d(self.name(), l1)?;
        if g.len() != rows {
            return Err(candle_core::Error::Msg(format!("first-order-fm-grad: gradient {:?}", l2.dims())));
        }
        let mut grad = vec![0.0f32; rows * f * w];
        if f * w > 0 {
            let d = w - 1;
            let rows_in = grad.par_chunks_mut(f * w).zip(e.par_chunks(f * w)).zip(g.par_iter());
            rows_in.for_each_init(
                || vec![0.0f32; d],
                |sum, ((grad, e), &g)| {
                    sum.fill(0.0);
                    if self.second_order {
                        for field in e.chunks_exact(w) {
                            sum.iter_mut().zip(&field[1..]).for_each(|(s, x)| *s += x);
                        }
                    }
                    for (gf, field) in grad.chunks_exact_mut(w).zip(e.chunks_exact(w)) {
                        gf[0] = g;
                        if self.second_order {
                            for ((o, s), v) in gf[1..].iter_mut().zip(sum.iter()).zip(&field[1..]) {
                                *o = g * (s - v);
                            }
                        }
                    }
                },
            );
        }
        Ok((CpuStorage::F32(grad), l1.shape().clone()))
    }
}

/// Test helper: `a` and `b` (the same function built two ways) agree in
/// value, and in the gradients of `sum(out · weights)` w.r.t. `vars`.
#[cfg(test)]
pub(crate) fn assert_same_forward_and_backward(a: &Tensor, b: &Tensor, vars: &[&candle_core::Var]) {
    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    let close = |x: &[f32], y: &[f32], what: &str| {
        assert_eq!(x.len(), y.len(), "{what}: lengths");
        for (x, y) in x.iter().zip(y) {
            assert!((x - y).abs() < 1e-5, "{what}: {x} vs {y}");
        }
    };
    close(&flat(a), &flat(b), "forward");
    let n = a.elem_count();
    let w = Tensor::from_vec((0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>(), a.shape(), a.device())
        .expect("weights");
    let ga = (a * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
    let gb = (b * &w).and_then(|t| t.sum_all()).and_then(|t| t.backward()).expect("backward");
    for v in vars {
        close(&flat(ga.get(v.as_tensor()).expect("grad")), &flat(gb.get(v.as_tensor()).expect("grad")), "gradient");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn pairwise_dots_equal_the_candle_ops_version() {
        let dev = Device::Cpu;
        let (rows, n, d) = (3, 5, 4);
        let data: Vec<f32> = (0..rows * n * d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect();
        let t = Var::from_tensor(&Tensor::from_vec(data, (rows, n, d), &dev).expect("t")).expect("var");
        let pairs: Vec<u32> = (0..n).flat_map(|i| ((i + 1)..n).map(move |j| (i * n + j) as u32)).collect();
        let idx = Tensor::from_vec(pairs.clone(), pairs.len(), &dev).expect("idx");
        let fused = t.as_tensor().apply_op1(PairwiseDots).expect("fused");
        let plain = t
            .as_tensor()
            .matmul(&t.as_tensor().t().expect("t"))
            .and_then(|z| z.reshape((rows, n * n)))
            .and_then(|z| z.index_select(&idx, 1))
            .expect("plain");
        assert_same_forward_and_backward(&fused, &plain, &[&t]);
    }

    /// FM's sparse part (first order and second order) and LR's (first
    /// order, width 1) equal the candle ops they replace, values and gradients.
    #[test]
    fn first_order_fm_equals_the_candle_ops_version() {
        let dev = Device::Cpu;
        for (rows, f, w, second_order) in [(3, 5, 5, true), (4, 26, 17, true), (3, 5, 5, false), (2, 7, 1, false)] {
            let data: Vec<f32> = (0..rows * f * w).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.05).collect();
            let e = Var::from_tensor(&Tensor::from_vec(data, (rows, f, w), &dev).expect("e")).expect("var");
            let fused = e.as_tensor().apply_op1(FirstOrderFm { second_order }).expect("fused");
            let t = e.as_tensor();
            let mut plain = t.narrow(2, 0, 1).and_then(|x| x.sum(1)).expect("first");
            if second_order {
                let v = t.narrow(2, 1, w - 1).expect("v");
                let s = v.sum(1).and_then(|x| x.sqr()).expect("s");
                let q = v.sqr().and_then(|x| x.sum(1)).expect("q");
                let second = (s - q).and_then(|x| x.sum_keepdim(1)).and_then(|x| x * 0.5).expect("second");
                plain = (plain + second).expect("sum");
            }
            assert_same_forward_and_backward(&fused, &plain, &[&e]);
        }
    }
}
