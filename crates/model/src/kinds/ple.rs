//! `ple` (Tang et al. 2020): `model.levels` extraction layers of shared
//! and task experts; at each level a task's gate mixes its own experts and
//! the shared ones, and (below the top) a shared gate mixes them all
//! (`multitask.rs`).

use sparrow_core::config::ModelConfig;
use sparrow_core::{Config, ConfigError};

use super::multitask::{self, Which, check_experts, experts_params, experts_step_floats};
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

    /// Each level's experts (the shared ones and every task's own) and
    /// gates (each task's over its own and the shared experts; below the
    /// top, the shared gate over all), then each task's tower (one output
    /// each: a floor for a multiclass task's).
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        let expert_out = config.expert_hidden.last().copied().unwrap_or(1) as f64;
        let tasks = config.tasks.len().max(1);
        let experts = config.experts + tasks * config.task_experts;
        let mut total = tasks as f64 * stack_flops(expert_out, &head(&config.tower_hidden, 1));
        for level in 0..config.levels {
            let fan_in = if level == 0 { x } else { expert_out };
            total += experts as f64 * stack_flops(fan_in, &config.expert_hidden)
                + tasks as f64 * stack_flops(fan_in, &[config.task_experts + config.experts]);
            if level + 1 < config.levels {
                total += stack_flops(fan_in, &[experts]);
            }
        }
        total
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        experts_params(&config.model, shape, config.model.levels as u128)
    }

    fn step_floats_per_row(&self, config: &Config, _shape: ModelShape) -> u128 {
        let m = &config.model;
        experts_step_floats(m, m.levels as u128, (m.task_experts as u128, m.levels > 1))
    }
}
