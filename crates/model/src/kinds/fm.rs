//! `fm`: a factorization machine, LR's first-order terms plus the pairwise
//! dot products of the fields' vectors, `½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²]`.

use sparrow_core::Config;
use sparrow_core::config::ModelConfig;

use super::first_order::FirstOrder;
use super::{Build, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct Fm;

impl Kind for Fm {
    fn name(&self) -> &'static str {
        "fm"
    }

    fn about(&self) -> &'static str {
        "Factorization machine: first-order terms plus pairwise dot products."
    }

    fn embedding_width(&self, embedding_dim: usize) -> usize {
        1 + embedding_dim
    }

    fn has_products(&self) -> bool {
        false
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        Ok(Box::new(FirstOrder::new(at.ps, at.shape.num_dense, true)?))
    }

    /// The first-order terms and the second order's `5·f·d`.
    fn step_flops_per_sample(&self, _config: &ModelConfig, shape: ModelShape) -> f64 {
        let (f, nd, d) = (shape.num_fields as f64, shape.num_dense as f64, shape.embedding_dim as f64);
        2.0 * f + 6.0 * nd + 5.0 * f * d
    }

    fn dense_params(&self, _config: &Config, shape: ModelShape) -> u128 {
        shape.num_dense as u128 + 1
    }
}
