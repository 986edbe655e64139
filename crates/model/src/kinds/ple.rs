//! `ple` (Tang et al. 2020): `model.levels` extraction layers of shared
//! and task experts; at each level a task's gate mixes its own experts and
//! the shared ones, and (below the top) a shared gate mixes them all
//! (`multitask.rs`).

use sparrow_core::config::ModelConfig;
use sparrow_core::{Config, ConfigError};

use super::multitask::{self, Which, check_experts, experts_params};
use super::parts::{head, stack_flops};
use super::{Build, Family, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct Ple;

impl Kind for Ple {
    fn name(&self) -> &'static str {
        "ple"
    }

    fn about(&self) -> &'static str {
        "Several tasks: shared and task experts, progressive extraction."
    }

    fn family(&self) -> Family {
        Family::MultiTask
    }

    fn check(&self, config: &Config) -> Result<(), ConfigError> {
        check_experts(config)
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        multitask::build(Which::Ple, at)
    }

    /// Each level's experts and a tower (one output), gates left out.
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        let expert_out = config.expert_hidden.last().copied().unwrap_or(1) as f64;
        let per_level = (config.experts + config.task_experts) as f64;
        let experts = per_level * stack_flops(x, &config.expert_hidden)
            + per_level * (config.levels.saturating_sub(1)) as f64 * stack_flops(expert_out, &config.expert_hidden);
        experts + stack_flops(expert_out, &head(&config.tower_hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        experts_params(&config.model, shape, config.model.levels as u128)
    }
}
