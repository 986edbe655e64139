//! Dense optimizers over a [`ParamStore`], with state that checkpoints exactly.
//!
//! The update runs as one fused loop over plain slices: as candle ops it was
//! a dozen allocating passes per parameter per step.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use rayon::prelude::*;
use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind};

use crate::ModelError;
use crate::params::ParamStore;

pub struct DenseOptimizer {
    config: DenseOptimizerConfig,
    /// Adam first and second moments per parameter name.
    moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
    pub step: u64,
}

impl DenseOptimizer {
    pub fn new(config: DenseOptimizerConfig) -> Self {
        DenseOptimizer { config, moments: HashMap::new(), step: 0 }
    }

    /// One step with the gradients of candle's backward pass.
    pub fn step(&mut self, params: &ParamStore, grads: &GradStore) -> Result<(), ModelError> {
        self.step_with(params, |_, var| match grads.get(var.as_tensor()) {
            Some(g) => Ok(Some(g.flatten_all()?.to_vec1::<f32>()?)),
            None => Ok(None),
        })
    }

    /// One step with gradients from any source: `grad_of(name, var)` gives a
    /// parameter's flat gradient, or `None` to leave the parameter unchanged.
    pub fn step_with(
        &mut self,
        params: &ParamStore,
        mut grad_of: impl FnMut(&str, &Var) -> Result<Option<Vec<f32>>, ModelError>,
    ) -> Result<(), ModelError> {
        self.step += 1;
        let c = &self.config;
        let lr = c.learning_rate as f32;
        let wd = c.weight_decay as f32;
        let t = self.step as i32;
        let (b1, b2, eps) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32);
        let (c1, c2) = (1.0 - c.beta1.powi(t) as f32, 1.0 - c.beta2.powi(t) as f32);
        for (name, var) in params.vars() {
            let Some(g) = grad_of(name, var)? else {
                continue;
            };
            let mut w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            // Chunks in parallel on the caller's pool: the layers are up to
            // ~110k weights, a few tens of microseconds per chunk.
            const CHUNK: usize = 16 * 1024;
            match c.kind {
                DenseOptimizerKind::Sgd => {
                    w.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(w, g)| {
                        for (w, g) in w.iter_mut().zip(g) {
                            *w -= lr * (g + wd * *w);
                        }
                    });
                }
                DenseOptimizerKind::Adam => {
                    let (m, v) =
                        self.moments.entry(name.clone()).or_insert_with(|| (vec![0.0; w.len()], vec![0.0; w.len()]));
                    w.par_chunks_mut(CHUNK)
                        .zip(g.par_chunks(CHUNK))
                        .zip(m.par_chunks_mut(CHUNK))
                        .zip(v.par_chunks_mut(CHUNK))
                        .for_each(|(((w, g), m), v)| {
                            for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                                let g = g + wd * *w;
                                *m = b1 * *m + (1.0 - b1) * g;
                                *v = b2 * *v + (1.0 - b2) * g * g;
                                *w -= lr * (*m / c1) / ((*v / c2).sqrt() + eps);
                            }
                        });
                }
            }
            var.set(&Tensor::from_vec(w, var.shape(), var.device())?)?;
        }
        Ok(())
    }

    /// Optimizer state as named tensors (for the checkpoint).
    pub fn state_tensors(&self, params: &ParamStore) -> Result<HashMap<String, Tensor>, ModelError> {
        let mut out = HashMap::new();
        for (name, var) in params.vars() {
            if let Some((m, v)) = self.moments.get(name) {
                out.insert(format!("adam.m.{name}"), Tensor::from_vec(m.clone(), var.shape(), &Device::Cpu)?);
                out.insert(format!("adam.v.{name}"), Tensor::from_vec(v.clone(), var.shape(), &Device::Cpu)?);
            }
        }
        Ok(out)
    }

    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<(), ModelError> {
        self.moments.clear();
        for (k, m) in tensors {
            if let Some(name) = k.strip_prefix("adam.m.") {
                let v = tensors
                    .get(&format!("adam.v.{name}"))
                    .ok_or_else(|| ModelError::MissingParam { name: format!("adam.v.{name}") })?;
                self.moments
                    .insert(name.to_string(), (m.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?));
            }
        }
        self.step = step;
        Ok(())
    }
}
