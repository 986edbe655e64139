//! Towers that all read one input (ESMM's two, on the embeddings and the
//! dense features), their first layers' products taken as one each way
//! with the layers' weights side by side (`[fan_in, Σ fan_out]`):
//! - forward, `x·[W_1 | W_2]` reads the input once, and each tower takes
//!   its columns as its first layer's output (a [`FirstProduct`]), its
//!   bias and ReLU added as they are copied out;
//! - backward, each tower puts its gradient at that output beside the
//!   others', and then `xᵀ·[g_1 | g_2]` is every tower's `dW` at once and
//!   `[g_1 | g_2]·[W_1 | W_2]ᵀ` the sum of their input gradients, summed
//!   in the product instead of by a product a tower and a pass adding
//!   them.
//!
//! One thread, a half batch of 512 rows, ESMM's `[81] → [32]` twice, an
//! AVX-512 Xeon: the towers' six first-layer products and the sum took
//! 103 µs, the three products side by side 86.
//!
//! In fp32, and in bf16 on `vdpbf16ps` (AMX's path keeps a bf16 stack's
//! products as tiles of its own, the rounded path its rounded operands):
//! each output of the forward product and of the weights' gradient is the
//! one chain over the input's columns (or the rows) that the tower's own
//! product sums, so those have the bits they had (tested); the input's
//! gradient is one chain over every tower's columns, so its last bits
//! differ from two products added.

use super::lay_columns::{RowGrad, lay_in_columns};
use crate::ModelError;
use crate::bf16::{Arith, Bf16Path};
use crate::matrix::{Operand, sgemm_threads};
use crate::meet::Side;
use crate::mlp::first_product::{FirstGrad, FirstProduct};
use crate::mlp::{First, Mlp, MlpScratch, cpu, matmul, sized};
use sparrow_core::simd::Simd;

/// Buffers kept between steps.
#[derive(Default)]
pub(super) struct OneInputTowers {
    /// The towers' first layers' weights side by side, `[fan_in, width]`.
    weights: Vec<f32>,
    /// Forward, `x·weights`; backward, the gradients at the first layers'
    /// outputs side by side; `[rows, width]` both.
    values: Vec<f32>,
    /// `xᵀ·values` backward, `[fan_in, width]`.
    weight_grads: Vec<f32>,
}

/// Whether towers that read one input take their first products side by
/// side: several, of one arithmetic, fp32 or bf16 on `vdpbf16ps` (AMX's
/// path keeps a bf16 stack's products as tiles, the rounded path its
/// rounded operands, on paths of their own), with first layers of one
/// width in.
pub(super) fn applies(towers: &[Mlp]) -> bool {
    let fan_in = |t: &Mlp| t.first_weights().map(|(_, fan_in, _)| fan_in);
    let arith = towers.first().map(Mlp::arith);
    let side_by_side = matches!(arith, Some(Arith::F32(_) | Arith::Bf16(Bf16Path::Native)));
    towers.len() > 1
        && side_by_side
        && towers.iter().all(|t| Some(t.arith()) == arith && fan_in(t).is_some() && fan_in(t) == fan_in(&towers[0]))
}

/// Where each tower's columns start, and the width of them all.
fn columns(towers: &[Mlp]) -> (Vec<usize>, usize) {
    let mut width = 0;
    let starts = towers
        .iter()
        .map(|t| {
            let at = width;
            width += t.first_weights().map_or(0, |(_, _, fan_out)| fan_out);
            at
        })
        .collect();
    (starts, width)
}

/// The towers' input width, checked against `x` (`rows` of it): a
/// mismatch is an error naming it, not a product's failed assertion.
fn input_width(towers: &[Mlp], x: &[f32], rows: usize) -> Result<usize, ModelError> {
    let fan_in = towers.first().and_then(Mlp::first_weights).map_or(0, |(_, fan_in, _)| fan_in);
    if x.len() != rows * fan_in {
        return Err(ModelError::BadInput { what: "the towers' input", len: x.len(), rows, per_row: fan_in });
    }
    Ok(fan_in)
}

impl OneInputTowers {
    /// Every tower's forward pass on `x` (`[rows, fan_in]`, rows from
    /// `first_row` of the batch), the outputs in `scratches`. The towers
    /// take their columns one after the other: the product, which is most
    /// of the work, runs on the pool. On a half of a batch (`meet`) each
    /// tower's batch norm meets the other half's, a tower at a time (each
    /// reads the one buffer of columns).
    pub(super) async fn forward(
        &mut self,
        towers: &[Mlp],
        (x, (rows, first_row)): (&[f32], (usize, usize)),
        (draw, simd): (Option<u64>, Simd),
        scratches: &mut [MlpScratch],
        meet: Option<Side<'_>>,
    ) -> Result<(), ModelError> {
        let (starts, width) = columns(towers);
        let fan_in = input_width(towers, x, rows)?;
        let weights = sized(&mut self.weights, fan_in * width);
        for (t, &at) in towers.iter().zip(&starts) {
            let Some((w, t_in, fan_out)) = t.first_weights() else { continue };
            if t_in != fan_in {
                return Err(ModelError::BadInput { what: "a tower's input", len: x.len(), rows, per_row: t_in });
            }
            let (ps, pl) = t.params().storage_and_layout();
            let p = cpu(&ps, pl)?;
            for (row, w) in weights.chunks_exact_mut(width).zip(p[w..w + fan_in * fan_out].chunks_exact(fan_out)) {
                row[at..at + fan_out].copy_from_slice(w);
            }
        }
        let values = sized(&mut self.values, rows * width);
        let arith = towers[0].arith();
        matmul(arith, None, rows, width, fan_in, Operand::plain(x), Operand::plain(&self.weights), values);
        for ((t, s), &at) in towers.iter().zip(scratches).zip(&starts) {
            let mut first = Columns { values: &mut self.values, width, at, simd };
            match meet {
                None => t.forward_cpu_from_at(&mut first, (rows, first_row), draw, s)?,
                Some(meet) => t.forward_met(First::Product(&mut first), (rows, first_row), (draw, meet), s).await?,
            }
        }
        Ok(())
    }

    /// Every tower's backward pass of the last [`forward`](Self::forward),
    /// from d loss / d each one's output (`seeds`): their parameters'
    /// gradients, in order; d loss / d x (every tower's summed) in `grad_x`.
    pub(super) async fn backward(
        &mut self,
        towers: &[Mlp],
        (x, rows): (&[f32], usize),
        (seeds, simd): (&[Vec<f32>], Simd),
        (scratches, grad_x): (&mut [MlpScratch], &mut Vec<f32>),
        meet: Option<Side<'_>>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let (starts, width) = columns(towers);
        let fan_in = input_width(towers, x, rows)?;
        if seeds.len() != towers.len() || scratches.len() != towers.len() {
            return Err(ModelError::BadInput { what: "the towers' seeds", len: seeds.len(), rows, per_row: 1 });
        }
        let values = sized(&mut self.values, rows * width);
        let mut grads = Vec::with_capacity(towers.len());
        for (((t, s), seed), &at) in towers.iter().zip(scratches).zip(seeds).zip(&starts) {
            let mut first = Columns { values: &mut *values, width, at, simd };
            grads.push(match meet {
                None => t.backward_cpu_from(&mut first, seed, s)?,
                Some(meet) => t.backward_met(First::Product(&mut first), (seed, false), s, meet).await?,
            });
        }
        let (values, weights) = (&self.values[..rows * width], &self.weights[..fan_in * width]);
        let dw = sized(&mut self.weight_grads, fan_in * width);
        let dx = sized(grad_x, rows * fan_in);
        if rows == 0 {
            dw.fill(0.0);
        } else {
            let arith = towers[0].arith();
            rayon::join(
                || matmul(arith, Some(1), fan_in, width, rows, Operand::t(x), Operand::plain(values), dw),
                || matmul(arith, Some(1), rows, fan_in, width, Operand::plain(values), Operand::t(weights), dx),
            );
        }
        for ((t, g), &at) in towers.iter().zip(&mut grads).zip(&starts) {
            let Some((w, _, fan_out)) = t.first_weights() else { continue };
            for (g, dw) in g[w..w + fan_in * fan_out].chunks_exact_mut(fan_out).zip(dw.chunks_exact(width)) {
                g.copy_from_slice(&dw[at..at + fan_out]);
            }
        }
        Ok(grads)
    }
}

/// A tower's columns of the products side by side: its first layer's
/// product. Backward it writes its gradient there and sums its bias's;
/// its weights' gradient is [`OneInputTowers::backward`]'s to write, once
/// every tower's gradient is in.
struct Columns<'a> {
    values: &'a mut [f32],
    width: usize,
    at: usize,
    simd: Simd,
}

impl FirstProduct for Columns<'_> {
    fn forward(&mut self, _w: &[f32], rows: usize, fan_out: usize, (bias, relu): (&[f32], bool), out: &mut [f32]) {
        let (width, at) = (self.width, self.at);
        let from = self.values.chunks_exact(width).take(rows);
        for (out, row) in out.chunks_exact_mut(fan_out).zip(from) {
            let pairs = out.iter_mut().zip(&row[at..at + fan_out]).zip(bias);
            // As `add_bias` after a product of the tower's own.
            match relu {
                true => pairs.for_each(|((o, y), b)| *o = (y + b).max(0.0)),
                false => pairs.for_each(|((o, y), b)| *o = y + b),
            }
        }
    }

    fn backward(
        &mut self,
        _w: &[f32],
        (rows, fan_out): (usize, usize),
        (g, relu): (FirstGrad<'_>, Option<(&[f32], f32)>),
        (_dw, db): (&mut [f32], &mut [f32]),
    ) {
        let (width, at) = (self.width, self.at);
        let place = (&mut *self.values, (width, at, fan_out));
        match g {
            FirstGrad::Laid(g) => {
                lay_in_columns(self.simd, place, (rows, relu), db, RowGrad::Laid(&g[..rows * fan_out]));
            }
            FirstGrad::Outer { seed, w, into: _, next_dw } => {
                if let Some((next_in, next_dw)) = next_dw {
                    sgemm_threads(self.simd, fan_out, 1, rows, Operand::t(next_in), Operand::plain(seed), next_dw, 1);
                }
                // Each the one rounded product the outer product gives.
                lay_in_columns(self.simd, place, (rows, relu), db, RowGrad::Outer { seed, w });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::{Activation, Norm, Precision};
    use sparrow_core::rng::Rng;

    use super::*;
    use crate::mlp::StackStyle;
    use crate::params::ParamStore;

    fn same_bits(x: &[f32], y: &[f32]) -> bool {
        x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
    }

    /// Towers side by side give each tower the outputs and parameter
    /// gradients of its own pass bit for bit, and d x within rounding of
    /// the towers' own summed: ESMM's towers (`[32] → 1`, whose first
    /// layer takes the next one's gradient as an outer product), deeper
    /// and wider ones, dropout (a scale), layer and batch norm, PReLU and Dice
    /// (no ReLU in the product), rows from a half's first row, on a pool of
    /// two; in fp32, and in bf16 on `vdpbf16ps` where the CPU has it.
    #[test]
    fn towers_side_by_side_give_each_towers_own_pass() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let plain = StackStyle::PLAIN;
        let styles = [
            (&[32usize, 1][..], 0.0f32, plain),
            (&[24, 16, 2][..], 0.0, plain),
            (&[32, 1][..], 0.25, plain),
            (&[40, 1][..], 0.25, plain),
            (&[16, 1][..], 0.0, StackStyle { norm: Norm::Layer, ..plain }),
            (&[32, 1][..], 0.1, StackStyle { activation: Activation::Prelu, ..plain }),
            (&[16, 1][..], 0.0, StackStyle { norm: Norm::Batch, ..plain }),
            (&[24, 1][..], 0.0, StackStyle { activation: Activation::Dice, ..plain }),
        ];
        let mut rng = Rng::new(3);
        let mut ariths = vec![Arith::F32(Simd::Auto)];
        if crate::bf16::path(Simd::Avx512) == Bf16Path::Native {
            ariths.push(Arith::Bf16(Bf16Path::Native));
        }
        let cases = ariths.into_iter().flat_map(|arith| styles.map(|style| (arith, style)));
        for (arith, (sizes, dropout, style)) in cases {
            for (rows, first_row, fan_in) in [(512, 512, 81), (37, 0, 41), (100, 3, 16)] {
                let mut ps = ParamStore::new(7, Device::Cpu);
                let towers: Vec<Mlp> = (0..2)
                    .map(|t| {
                        let tower = Mlp::new_normed(&mut ps, &format!("tower.{t}"), fan_in, sizes, false, arith, style);
                        tower.expect("tower").with_dropout(dropout, Simd::Auto)
                    })
                    .collect();
                assert!(applies(&towers));
                let x: Vec<f32> = (0..rows * fan_in).map(|_| rng.normal() as f32).collect();
                let outputs = sizes[sizes.len() - 1];
                let seeds: Vec<Vec<f32>> =
                    (0..2).map(|_| (0..rows * outputs).map(|_| rng.normal() as f32).collect()).collect();
                let draw = Some(41);
                let (norm, activation) = (style.norm, style.activation);
                let case = format!("{arith:?} {sizes:?}, dropout {dropout}, {norm:?}, {activation:?}, {rows} rows");
                pool.install(|| {
                    let mut own = vec![MlpScratch::default(), MlpScratch::default()];
                    let mut own_grads = Vec::new();
                    for ((t, s), seed) in towers.iter().zip(&mut own).zip(&seeds) {
                        t.forward_cpu_at(&x, (rows, first_row), draw, s).expect("forward");
                        own_grads.push(t.backward_cpu(&x, seed, s).expect("backward"));
                    }
                    let own_dx: Vec<f32> =
                        own[0].grad_input.iter().zip(&own[1].grad_input).map(|(a, b)| a + b).collect();
                    let mut side = OneInputTowers::default();
                    let mut scratches = vec![MlpScratch::default(), MlpScratch::default()];
                    let mut dx = vec![f32::NAN; 3];
                    // Twice: the second step reuses every buffer.
                    for _ in 0..2 {
                        let forward =
                            side.forward(&towers, (&x, (rows, first_row)), (draw, Simd::Auto), &mut scratches, None);
                        crate::meet::unmet(forward).expect("forward");
                        for (s, o) in scratches.iter().zip(&own) {
                            assert!(same_bits(&s.output, &o.output), "{case}: outputs");
                        }
                        let grads =
                            side.backward(&towers, (&x, rows), (&seeds, Simd::Auto), (&mut scratches, &mut dx), None);
                        for (g, o) in crate::meet::unmet(grads).expect("backward").iter().zip(&own_grads) {
                            let first = g.iter().zip(o).position(|(a, b)| a.to_bits() != b.to_bits());
                            assert!(same_bits(g, o), "{case}: parameters' gradients, first difference at {first:?}");
                        }
                        assert_eq!(dx.len(), own_dx.len(), "{case}: d x");
                        for (i, (a, b)) in dx.iter().zip(&own_dx).enumerate() {
                            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{case}: d x[{i}] {a} against {b}");
                        }
                    }
                });
            }
        }
    }

    /// An input of the wrong size is an error naming it, before any product.
    #[test]
    fn an_input_of_the_wrong_size_is_refused() {
        let mut ps = ParamStore::new(7, Device::Cpu);
        let f32 = crate::bf16::Arith::new(Precision::F32, Simd::Auto);
        let towers: Vec<Mlp> =
            (0..2).map(|t| Mlp::new(&mut ps, &format!("t{t}"), 6, &[4, 1], false, f32).expect("t")).collect();
        let mut side = OneInputTowers::default();
        let mut scratches = vec![MlpScratch::default(), MlpScratch::default()];
        let x = vec![0.5f32; 3 * 6 + 1];
        let forward = side.forward(&towers, (&x, (3, 0)), (None, Simd::Auto), &mut scratches, None);
        let err = crate::meet::unmet(forward).expect_err("forward");
        assert!(err.to_string().contains("the towers' input"), "{err}");
        let seeds = vec![vec![1.0f32; 3]; 2];
        let mut dx = Vec::new();
        let err = side.backward(&towers, (&x, 3), (&seeds, Simd::Auto), (&mut scratches, &mut dx), None);
        assert!(crate::meet::unmet(err).expect_err("backward").to_string().contains("the towers' input"));
    }

    /// Towers of other widths in, of two arithmetics, or in bf16 on AMX's
    /// tiles or rounded operands keep a pass each.
    #[test]
    fn only_towers_of_one_width_and_arithmetic_go_side_by_side() {
        let mut ps = ParamStore::new(7, Device::Cpu);
        let mut tower = |fan_in, arith| Mlp::new(&mut ps, "t", fan_in, &[8, 1], false, arith).expect("tower");
        let (f32, native) = (Arith::F32(Simd::Auto), Arith::Bf16(Bf16Path::Native));
        assert!(applies(&[tower(10, f32), tower(10, f32)]));
        assert!(applies(&[tower(10, native), tower(10, native)]));
        assert!(!applies(&[tower(10, f32)]), "one tower");
        assert!(!applies(&[tower(10, f32), tower(12, f32)]), "widths in");
        assert!(!applies(&[tower(10, f32), tower(10, native)]), "two arithmetics");
        for path in [Bf16Path::Amx, Bf16Path::Rounded(Simd::Auto), Bf16Path::Portable] {
            assert!(!applies(&[tower(10, Arith::Bf16(path)), tower(10, Arith::Bf16(path))]), "{path:?}");
        }
    }
}
