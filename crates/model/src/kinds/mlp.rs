//! `mlp`: the fields' pooled vectors and the dense values, concatenated,
//! into an MLP of `model.hidden`.

use candle_core::Tensor;
use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::parts::{flat_with_dense, head, mlp_params, stack_flops};
use super::{At, Build, Direct, Grads, Kind, Net};
use crate::ModelError;
use crate::mlp::{Mlp, MlpScratch};
use crate::spec::NetSpec;
use crate::step::{ModelShape, Scratch};

pub(super) struct MlpKind;

struct MlpNet {
    mlp: Mlp,
}

impl Kind for MlpKind {
    fn name(&self) -> &'static str {
        "mlp"
    }

    fn about(&self) -> &'static str {
        "The fields' pooled vectors and the dense values, concatenated, into an MLP."
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        let sizes = head(&at.config.hidden, at.outputs());
        Ok(Box::new(MlpNet {
            mlp: Mlp::new_normed(at.ps, "mlp", at.flat_len(), &sizes, false, at.arith, at.normed())?
                .with_dropout(at.config.dropout, at.simd),
        }))
    }

    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        stack_flops(x, &head(&config.hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128;
        mlp_params(x, &config.model.hidden) + shape.num_dense as u128 + 1
    }
}

impl Net for MlpNet {
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, _: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        self.mlp.forward(&flat_with_dense(at, emb, dense)?, at.dropout)
    }

    fn spec(&self) -> Result<NetSpec, ModelError> {
        Ok(NetSpec::Mlp { layers: self.mlp.layers()? })
    }

    fn direct(&self) -> Option<&dyn Direct> {
        Some(self)
    }
}

impl Direct for MlpNet {
    fn forward(&self, at: &At, x: &[f32], rows: usize, s: &mut Scratch) -> Result<Vec<f32>, ModelError> {
        self.mlp.forward_cpu(x, rows, at.dropout, &mut s.deep)?;
        Ok(s.deep.output.clone())
    }

    fn backward<'a>(
        &'a self,
        _at: &At,
        x: &[f32],
        seed: &[f32],
        s: &mut Scratch,
        grads: &mut Grads<'a>,
    ) -> Result<(), ModelError> {
        grads.push((self.mlp.params(), self.mlp.backward_cpu(x, seed, &mut s.deep)?));
        // The MLP's input is the model's: its gradient is the step's.
        std::mem::swap(&mut s.grad_x, &mut s.deep.grad_input);
        s.grad_x_finite = s.deep.grad_input_finite();
        Ok(())
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        vec![(&self.mlp, &mut s.deep)]
    }
    /// Its MLP ends in every task's outputs.
    fn several_outputs(&self) -> bool {
        true
    }
}
