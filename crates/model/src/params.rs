//! Named trainable tensors with deterministic initialisation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, Var};
use sparrow_core::rng::Rng;

use crate::ModelError;

pub struct ParamStore {
    vars: Vec<(String, Var)>,
    rng: Rng,
    device: Device,
    /// The running statistics among `vars` (PyTorch's buffers).
    statistics: Vec<Statistic>,
}

/// Where a training forward pass leaves its batch's value of a running
/// statistic, for the step to take ([`ParamStore::take_batch_statistics`]).
pub type BatchValue = Arc<Mutex<Option<Vec<f32>>>>;

/// A variable that is not learned by gradient but follows the batches: a
/// step hands its batch's value where a parameter's gradient goes (so a
/// cluster's dense sync averages it over the workers' batches, weighted by
/// rows), and the optimizer moves it by `momentum` towards that value
/// instead of stepping it (`DenseOptimizer::apply`).
struct Statistic {
    /// Its place in `vars`.
    index: usize,
    momentum: f32,
    batch: BatchValue,
}

impl ParamStore {
    pub fn new(seed: u64, device: Device) -> Self {
        ParamStore { vars: Vec::new(), rng: Rng::new(seed), device, statistics: Vec::new() }
    }

    /// Registers a running statistic with its initial values (see
    /// [`Statistic`]); returns it and where its batch values go.
    pub fn statistic(&mut self, name: String, data: Vec<f32>, momentum: f32) -> Result<(Var, BatchValue), ModelError> {
        let len = data.len();
        let var = self.push(name, data, &[len])?;
        let batch = BatchValue::default();
        self.statistics.push(Statistic { index: self.vars.len() - 1, momentum, batch: batch.clone() });
        Ok((var, batch))
    }

    /// The momentum of the variable at `index` if it is a running
    /// statistic (`None`: a parameter the optimizer steps).
    pub fn statistic_momentum(&self, index: usize) -> Option<f32> {
        self.statistics.iter().find(|s| s.index == index).map(|s| s.momentum)
    }

    /// Whether any variable is a running statistic.
    pub fn has_statistics(&self) -> bool {
        !self.statistics.is_empty()
    }

    /// Moves each running statistic's batch value, left by the training
    /// forward pass just run, into its slot of `grads` (a step's gradients
    /// in store order; `None`: none was left, and the statistic stays as
    /// it is).
    pub fn take_batch_statistics(&self, grads: &mut [Option<Vec<f32>>]) -> Result<(), ModelError> {
        for s in &self.statistics {
            let value = s.batch.lock().map_err(|_| ModelError::Poisoned)?.take();
            if let Some(slot) = grads.get_mut(s.index) {
                *slot = value;
            }
        }
        Ok(())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// A parameter drawn from U(−bound, bound) (PyTorch's default for Linear
    /// uses bound = 1/√fan_in for both weight and bias).
    pub fn uniform(&mut self, name: String, shape: &[usize], bound: f64) -> Result<Var, ModelError> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.rng.uniform(-bound, bound) as f32).collect();
        let var = Var::from_tensor(&Tensor::from_vec(data, shape, &self.device)?)?;
        self.vars.push((name, var.clone()));
        Ok(var)
    }

    /// `n` draws from U(−bound, bound), in the store's deterministic sequence.
    pub fn draw_uniform(&mut self, n: usize, bound: f64) -> Vec<f32> {
        (0..n).map(|_| self.rng.uniform(-bound, bound) as f32).collect()
    }

    /// Registers a parameter with the given values.
    pub fn push(&mut self, name: String, data: Vec<f32>, shape: &[usize]) -> Result<Var, ModelError> {
        let var = Var::from_tensor(&Tensor::from_vec(data, shape, &self.device)?)?;
        self.vars.push((name, var.clone()));
        Ok(var)
    }

    pub fn zeros(&mut self, name: String, shape: &[usize]) -> Result<Var, ModelError> {
        let var = Var::zeros(shape, DType::F32, &self.device)?;
        self.vars.push((name, var.clone()));
        Ok(var)
    }

    pub fn to_map(&self) -> HashMap<String, Tensor> {
        self.vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect()
    }

    /// Sets every parameter from `tensors`; all must be present with their shape.
    pub fn load_map(&self, tensors: &HashMap<String, Tensor>) -> Result<(), ModelError> {
        for (name, var) in &self.vars {
            let t = tensors.get(name).ok_or_else(|| ModelError::MissingParam { name: name.clone() })?;
            if t.dims() != var.dims() {
                return Err(ModelError::ShapeMismatch {
                    name: name.clone(),
                    expected: var.dims().to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }

    /// Every parameter's values, flattened in store order.
    pub fn flat_values(&self) -> Result<Vec<f32>, ModelError> {
        let mut flat = Vec::with_capacity(self.num_params());
        for (_, var) in &self.vars {
            flat.extend(var.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(flat)
    }

    /// Sets every parameter from `flat` (store order, [`num_params`](Self::num_params) values).
    pub fn set_flat(&self, flat: &[f32]) -> Result<(), ModelError> {
        if flat.len() != self.num_params() {
            return Err(ModelError::ShapeMismatch {
                name: "all dense parameters".into(),
                expected: vec![self.num_params()],
                found: vec![flat.len()],
            });
        }
        let mut rest = flat;
        for (_, var) in &self.vars {
            let (mine, tail) = rest.split_at(var.elem_count());
            var.set(&Tensor::from_slice(mine, var.shape(), var.device())?)?;
            rest = tail;
        }
        Ok(())
    }

    pub fn num_params(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }
}

/// y = x·W + b, with W stored `[in, out]` so the forward matmul is contiguous.
pub struct Linear {
    w: Var,
    b: Var,
}

impl Linear {
    pub fn new(ps: &mut ParamStore, name: &str, fan_in: usize, fan_out: usize) -> Result<Linear, ModelError> {
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        Ok(Linear {
            w: ps.uniform(format!("{name}.weight"), &[fan_in, fan_out], bound)?,
            b: ps.uniform(format!("{name}.bias"), &[fan_out], bound)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        Ok(x.matmul(self.w.as_tensor())?.broadcast_add(self.b.as_tensor())?)
    }

    /// `W`, `[fan_in, fan_out]`.
    pub fn weight(&self) -> &Var {
        &self.w
    }

    /// `b`, `[fan_out]`.
    pub fn bias(&self) -> &Var {
        &self.b
    }
}
