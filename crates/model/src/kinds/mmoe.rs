//! `mmoe` (Ma et al. 2018): `model.experts` shared experts; each task
//! mixes them with a softmax gate of its own and puts the mix through its
//! tower (`multitask.rs`).

use sparrow_core::config::ModelConfig;
use sparrow_core::{Config, ConfigError};

use super::multitask::{self, Which, check_experts, experts_params, experts_step_floats};
use super::parts::{head, stack_flops};
use super::{Build, Family, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct Mmoe;

impl Kind for Mmoe {
    fn name(&self) -> &'static str {
        "mmoe"
    }

    fn about(&self) -> &'static str {
        "Several tasks: shared experts, a gate and a tower per task."
    }

    fn family(&self) -> Family {
        Family::MultiTask
    }

    fn check(&self, config: &Config) -> Result<(), ConfigError> {
        check_experts(config)
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        multitask::build(Which::Mmoe, at)
    }

    /// The experts, then each task's gate (a product `x → experts`) and
    /// tower (one output each: a floor for a multiclass task's).
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        let expert_out = config.expert_hidden.last().copied().unwrap_or(1) as f64;
        let tasks = config.tasks.len().max(1) as f64;
        config.experts as f64 * stack_flops(x, &config.expert_hidden)
            + tasks * (stack_flops(x, &[config.experts]) + stack_flops(expert_out, &head(&config.tower_hidden, 1)))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        experts_params(&config.model, shape, 1)
    }

    fn step_floats_per_row(&self, config: &Config, _shape: ModelShape) -> u128 {
        experts_step_floats(&config.model, 1, (0, false))
    }
}
