//! `lr`: logistic regression, one weight per ID (a field's width-1 row)
//! and per dense value, and a bias.

use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::first_order::FirstOrder;
use super::{Build, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct Lr;

impl Kind for Lr {
    fn name(&self) -> &'static str {
        "lr"
    }

    fn about(&self) -> &'static str {
        "Logistic regression: one weight per ID and per dense value."
    }

    fn embedding_width(&self, _embedding_dim: usize) -> usize {
        1
    }

    fn has_products(&self) -> bool {
        false
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        Ok(Box::new(FirstOrder::new(at.ps, at.shape.num_dense, false)?))
    }

    fn step_flops_per_sample(&self, _config: &ModelConfig, shape: ModelShape) -> f64 {
        2.0 * shape.num_fields as f64 + 6.0 * shape.num_dense as f64
    }

    fn dense_params(&self, _config: &Config, shape: ModelShape) -> u128 {
        shape.num_dense as u128 + 1
    }
}
