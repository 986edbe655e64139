//! `esmm` (Ma et al. 2018): a CTR tower and a CVR tower of
//! `model.tower_hidden` on the shared embeddings; the second task is
//! pCTCVR = pCTR × pCVR (`multitask.rs`).

use sparrow_core::config::ModelConfig;
use sparrow_core::{Config, ConfigError};

use super::multitask::{self, Which};
use super::parts::{head, mlp_params, stack_flops, units};
use super::{Build, Family, Kind, Net};
use crate::ModelError;
use crate::step::ModelShape;

pub(super) struct Esmm;

impl Kind for Esmm {
    fn name(&self) -> &'static str {
        "esmm"
    }

    fn about(&self) -> &'static str {
        "Several tasks: ESMM's CTR and CTCVR towers."
    }

    fn family(&self) -> Family {
        Family::MultiTask
    }

    fn check(&self, config: &Config) -> Result<(), ConfigError> {
        let tasks = config.tasks();
        if tasks.len() != 2 || tasks.iter().any(|t| !t.is_binary()) {
            return Err(ConfigError::Invalid {
                key: "model.kind".into(),
                message: "\"esmm\" takes two binary tasks: the click, then the conversion over every impression \
                          (click and converted)"
                    .into(),
            });
        }
        Ok(())
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        multitask::build(Which::Esmm, at)
    }

    /// The two towers (one output each).
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        2.0 * stack_flops(x, &head(&config.tower_hidden, 1))
    }

    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128;
        2 * mlp_params(x, &config.model.tower_hidden)
    }

    /// Two towers' layers: 3 floats a unit and row each (peak memory grew
    /// by 6.03 floats a row for each unit of `[h]` towers, batch 65536).
    fn step_floats_per_row(&self, config: &Config, _shape: ModelShape) -> u128 {
        6 * units(&config.model.tower_hidden)
    }
}
