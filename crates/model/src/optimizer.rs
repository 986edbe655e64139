//! Dense optimizers over a [`ParamStore`], with state that checkpoints exactly.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind};

use crate::ModelError;
use crate::params::ParamStore;

pub struct DenseOptimizer {
    config: DenseOptimizerConfig,
    /// Adam moments per parameter name.
    m: HashMap<String, Tensor>,
    v: HashMap<String, Tensor>,
    pub step: u64,
}

impl DenseOptimizer {
    pub fn new(config: DenseOptimizerConfig) -> Self {
        DenseOptimizer { config, m: HashMap::new(), v: HashMap::new(), step: 0 }
    }

    pub fn step(&mut self, params: &ParamStore, grads: &GradStore) -> Result<(), ModelError> {
        self.step += 1;
        let c = &self.config;
        let lr = c.learning_rate;
        for (name, var) in params.vars() {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = if c.weight_decay != 0.0 { (g + (var.as_tensor() * c.weight_decay)?)? } else { g.clone() };
            match c.kind {
                DenseOptimizerKind::Sgd => var.set(&(var.as_tensor() - (g * lr)?)?)?,
                DenseOptimizerKind::Adam => {
                    let m = match self.m.get(name) {
                        Some(m) => ((m * c.beta1)? + (&g * (1.0 - c.beta1))?)?,
                        None => (&g * (1.0 - c.beta1))?,
                    };
                    let v = match self.v.get(name) {
                        Some(v) => ((v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?,
                        None => (g.sqr()? * (1.0 - c.beta2))?,
                    };
                    let t = self.step as i32;
                    let m_hat = (&m / (1.0 - c.beta1.powi(t)))?;
                    let v_hat = (&v / (1.0 - c.beta2.powi(t)))?;
                    let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
                    var.set(&(var.as_tensor() - (update * lr)?)?)?;
                    self.m.insert(name.clone(), m);
                    self.v.insert(name.clone(), v);
                }
            }
        }
        Ok(())
    }

    /// Optimizer state as named tensors (for the checkpoint).
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (n, t) in &self.m {
            out.insert(format!("adam.m.{n}"), t.clone());
        }
        for (n, t) in &self.v {
            out.insert(format!("adam.v.{n}"), t.clone());
        }
        out
    }

    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) {
        self.m.clear();
        self.v.clear();
        for (k, t) in tensors {
            if let Some(n) = k.strip_prefix("adam.m.") {
                self.m.insert(n.to_string(), t.clone());
            } else if let Some(n) = k.strip_prefix("adam.v.") {
                self.v.insert(n.to_string(), t.clone());
            }
        }
        self.step = step;
    }
}
