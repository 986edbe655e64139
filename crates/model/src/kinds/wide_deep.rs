//! `wide_deep` (Cheng et al. 2016): a linear part, one weight per ID and
//! per dense value, beside an MLP of `model.hidden` (`beside.rs`).

use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::beside::Beside;
use super::parts::{head, mlp_params, stack_flops};
use super::{Build, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct WideDeep;

impl Kind for WideDeep {
    fn name(&self) -> &'static str {
        "wide_deep"
    }

    fn about(&self) -> &'static str {
        "Wide & Deep: a linear part (one weight per ID) beside an MLP."
    }

    fn embedding_width(&self, embedding_dim: usize) -> usize {
        1 + embedding_dim
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        Ok(Box::new(Beside::build(at, false)?))
    }

    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let (f, nd, d) = (shape.num_fields as f64, shape.num_dense as f64, shape.embedding_dim as f64);
        2.0 * f + 6.0 * nd + stack_flops(f * d + nd, &head(&config.hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let w = self.embedding_width(shape.embedding_dim);
        let x = (shape.num_fields * w + shape.num_dense) as u128;
        mlp_params(x, &config.model.hidden) + shape.num_dense as u128 + 1
    }
}
