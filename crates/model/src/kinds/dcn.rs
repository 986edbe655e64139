//! `dcn`: DCN-v2 (Wang et al. 2021), `model.cross_layers` cross layers
//! `x_{l+1} = x₀ ⊙ (x_l·W_l + b_l) + x_l` on the fields' vectors and the
//! dense values, then an MLP of `model.hidden`.

use candle_core::Tensor;
use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::parts::{flat_with_dense, head, mlp_params, stack_flops};
use super::{At, Build, Direct, Grads, Kind, Net};
use crate::ModelError;
use crate::bf16::Arith;
use crate::cross::{CrossGrads, cross_backward, cross_forward};
use crate::mlp::{Mlp, MlpScratch, cpu, sized};
use crate::params::Linear;
use crate::spec::NetSpec;
use crate::step::{ModelShape, Scratch, linear_spec};

pub(super) struct Dcn;

struct DcnNet {
    cross: Vec<Linear>,
    deep: Mlp,
    arith: Arith,
}

impl Kind for Dcn {
    fn name(&self) -> &'static str {
        "dcn"
    }

    fn about(&self) -> &'static str {
        "DCN-v2: `cross_layers` cross layers beside an MLP."
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        let x_dim = at.flat_len();
        let cross = (0..at.config.cross_layers)
            .map(|l| Linear::new(at.ps, &format!("cross.{l}"), x_dim, x_dim))
            .collect::<Result<Vec<_>, _>>()?;
        let deep = Mlp::new_normed(
            at.ps,
            "deep",
            x_dim,
            &head(&at.config.hidden, at.outputs()),
            false,
            at.arith,
            at.normed(),
        )?
        .with_dropout(at.config.dropout, at.simd);
        Ok(Box::new(DcnNet { cross, deep, arith: at.arith }))
    }

    /// A cross layer `6·x² + 6·x` (its product and the gating), then the MLP.
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        config.cross_layers as f64 * (6.0 * x * x + 6.0 * x) + stack_flops(x, &head(&config.hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128;
        config.model.cross_layers as u128 * (x * x + x) + mlp_params(x, &config.model.hidden)
    }

    /// The cross layers' input and its gradient.
    fn step_floats_per_row(&self, _config: &Config, shape: ModelShape) -> u128 {
        2 * (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128
    }
}

impl Net for DcnNet {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let x0 = flat_with_dense(at, emb, dense)?;
        let mut x = x0.clone();
        for layer in &self.cross {
            x = crate::cross::cross(self.arith, &x0, &x, layer.weight().as_tensor(), layer.bias().as_tensor())?;
        }
        self.deep.forward(&x, at.dropout)
    }

    fn spec(&self) -> Result<NetSpec, ModelError> {
        let cross = self.cross.iter().map(linear_spec).collect::<Result<_, _>>()?;
        Ok(NetSpec::Dcn { cross, deep: self.deep.layers()? })
    }

    fn direct(&self) -> Option<&dyn Direct> {
        Some(self)
    }
}

impl Direct for DcnNet {
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        // The input rows are x₀.
        let x_dim = at.row_len();
        s.cross_out.resize_with(self.cross.len(), Vec::new);
        s.gates.resize_with(self.cross.len(), Vec::new);
        for (l, layer) in self.cross.iter().enumerate() {
            let (w, b) = (layer.weight().storage_and_layout(), layer.bias().storage_and_layout());
            let (w, b) = (cpu(&w.0, w.1)?, cpu(&b.0, b.1)?);
            let (done, rest) = s.cross_out.split_at_mut(l);
            let input: &[f32] = if l == 0 { x } else { &done[l - 1] };
            // Both overwritten whole.
            let out = sized(&mut rest[0], rows * x_dim);
            let gate = sized(&mut s.gates[l], rows * x_dim);
            cross_forward(self.arith, x_dim, (x, input), (w, b), gate, out);
        }
        let input: &[f32] = s.cross_out.last().map_or(x, |v| v);
        self.deep.forward_cpu(input, rows, at.dropout, &mut s.deep)?;
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
        let x_dim = at.row_len();
        let rows = x.len() / x_dim.max(1);
        let input: &[f32] = s.cross_out.last().map_or(x, |v| v);
        grads.push((self.deep.params(), self.deep.backward_cpu(input, seed, &mut s.deep)?));
        // `g`: the gradient at the current layer's output, from the deep MLP's input down.
        let mut g = std::mem::take(&mut s.deep.grad_input);
        // d x₀, the step's input gradient: summed from every layer's
        // gating, and the first layer's input.
        s.grad_x.clear();
        s.grad_x.resize(rows * x_dim, 0.0);
        for (l, layer) in self.cross.iter().enumerate().rev() {
            let w = layer.weight().storage_and_layout();
            let w = cpu(&w.0, w.1)?;
            let input: &[f32] = if l == 0 { x } else { &s.cross_out[l - 1] };
            let (mut dw, mut db) = (vec![0.0f32; x_dim * x_dim], vec![0.0f32; x_dim]);
            let dxl = sized(&mut s.grad_in, rows * x_dim); // overwritten whole
            let to = CrossGrads { x0: &mut s.grad_x, w: &mut dw, b: &mut db, xl: dxl };
            cross_backward(self.arith, x_dim, (x, input, w), &s.gates[l], &g, &mut s.grad_gate, to);
            grads.push((layer.weight(), dw));
            grads.push((layer.bias(), db));
            std::mem::swap(&mut g, &mut s.grad_in);
        }
        s.grad_x.iter_mut().zip(&g).for_each(|(a, g)| *a += g);
        s.deep.grad_input = g;
        Ok(())
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        vec![(&self.deep, &mut s.deep)]
    }
    /// Its MLP ends in every task's outputs.
    fn several_outputs(&self) -> bool {
        true
    }
}
