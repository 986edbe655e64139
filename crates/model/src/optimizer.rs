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

/// What a replica's contribution to a round of gradient sums led to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundOutcome {
    /// The round is still open (another replica has not contributed yet): no
    /// step now; the next batch's gradient, at the same weights, adds to it.
    Open,
    /// The round closed: the buffer holds the sum over all replicas' batches,
    /// `rows` in total (0: no replica had a batch).
    Closed { rows: u64 },
}

/// Combines dense gradients across data-parallel replicas (SPEC S0.6, with
/// S2.2: a faster replica contributes more batches to a round).
pub trait GradientSync: Send + Sync {
    /// `grads` holds this replica's gradient of the summed loss over its
    /// `rows` samples (0: no batch left), every parameter flattened in
    /// [`ParamStore`] order. When the round closes it holds the elementwise
    /// sum over all contributions, added in a fixed order, so every replica
    /// gets the same bits.
    fn sum(&mut self, grads: &mut [f32], rows: u64) -> Result<RoundOutcome, ModelError>;
}

/// `Err(NonFinite)` naming `what` (built only on failure) if `values` holds a NaN or an infinity.
pub fn check_finite(values: &[f32], what: impl FnOnce() -> String) -> Result<(), ModelError> {
    // A float is NaN or infinite exactly when its exponent bits are all
    // ones; OR-ing that test over chunks has no early exit, so it vectorises.
    const EXPONENT: u32 = 0x7f80_0000;
    let all_finite =
        values.chunks(256).all(|c| !c.iter().fold(false, |bad, v| bad | (v.to_bits() & EXPONENT == EXPONENT)));
    if all_finite {
        return Ok(());
    }
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(ModelError::NonFinite { what: format!("{} (element {i} is {})", what(), values[i]) }),
        None => Ok(()),
    }
}

/// Each parameter's combined gradient (in [`ParamStore`] order) and the rows behind it.
type Combined = (Vec<Vec<f32>>, u64);

pub struct DenseOptimizer {
    config: DenseOptimizerConfig,
    /// Adam first and second moments per parameter name.
    moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
    pub step: u64,
    /// Samples behind the steps taken (with a sync: every replica's rows).
    pub samples_stepped: u64,
    /// Set on data-parallel replicas: every step applies the combined gradient.
    sync: Option<Box<dyn GradientSync>>,
}

impl DenseOptimizer {
    pub fn new(config: DenseOptimizerConfig) -> Self {
        DenseOptimizer { config, moments: HashMap::new(), step: 0, samples_stepped: 0, sync: None }
    }

    /// A replica's optimizer: each step first sums the gradients of all
    /// replicas through `sync` and applies Σ rows·grad / Σ rows.
    pub fn with_sync(config: DenseOptimizerConfig, sync: Box<dyn GradientSync>) -> Self {
        DenseOptimizer { sync: Some(sync), ..Self::new(config) }
    }

    /// One step with the gradients of candle's backward pass over `rows` samples.
    pub fn step(&mut self, params: &ParamStore, grads: &GradStore, rows: usize) -> Result<bool, ModelError> {
        self.step_with(params, rows, |_, var| match grads.get(var.as_tensor()) {
            Some(g) => Ok(Some(g.flatten_all()?.to_vec1::<f32>()?)),
            None => Ok(None),
        })
    }

    /// A replica without a batch left still joins each round (so the others
    /// are not kept waiting) and applies the same update. Returns false,
    /// changing nothing, when no replica had a batch (or there is no sync).
    pub fn idle_step(&mut self, params: &ParamStore) -> Result<bool, ModelError> {
        if self.sync.is_none() {
            return Ok(false);
        }
        self.step_with(params, 0, |_, _| Ok(None))
    }

    /// With a sync: gather every parameter's gradient (zeros where there is
    /// none), scale by this replica's rows, sum across replicas, scale back by
    /// the total. `None` when the round is still open or no replica had rows.
    fn combined(
        sync: &mut dyn GradientSync,
        params: &ParamStore,
        rows: usize,
        grad_of: &mut impl FnMut(&str, &Var) -> Result<Option<Vec<f32>>, ModelError>,
    ) -> Result<Option<Combined>, ModelError> {
        let mut flat = Vec::with_capacity(params.num_params());
        for (name, var) in params.vars() {
            match grad_of(name, var)? {
                Some(g) => {
                    check_finite(&g, || format!("gradient of dense parameter `{name}`"))?;
                    flat.extend(g.iter().map(|&g| g * rows as f32))
                }
                None => flat.resize(flat.len() + var.elem_count(), 0.0),
            }
        }
        let total = match sync.sum(&mut flat, rows as u64)? {
            RoundOutcome::Closed { rows } if rows > 0 => rows,
            _ => return Ok(None),
        };
        let inv = 1.0 / total as f32;
        let mut rest = flat.as_mut_slice();
        let mut out = Vec::with_capacity(params.vars().len());
        for (_, var) in params.vars() {
            let (mine, tail) = rest.split_at_mut(var.elem_count());
            mine.iter_mut().for_each(|g| *g *= inv);
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok(Some((out, total)))
    }

    /// One step with gradients from any source: `grad_of(name, var)` gives a
    /// parameter's flat gradient of the mean loss over `rows` samples, or
    /// `None` to leave the parameter unchanged. Returns whether a step was
    /// taken (always without a sync; with one, when the round closed with rows).
    pub fn step_with(
        &mut self,
        params: &ParamStore,
        rows: usize,
        mut grad_of: impl FnMut(&str, &Var) -> Result<Option<Vec<f32>>, ModelError>,
    ) -> Result<bool, ModelError> {
        let mut combined = match self.sync.as_deref_mut() {
            Some(sync) => match Self::combined(sync, params, rows, &mut grad_of)? {
                Some((grads, total)) => {
                    self.samples_stepped += total;
                    Some(grads.into_iter())
                }
                None => return Ok(false),
            },
            None => {
                self.samples_stepped += rows as u64;
                None
            }
        };
        // Every gradient is checked before any weight moves: a non-finite
        // one leaves the model and the optimizer state as they were.
        let grads: Vec<Option<Vec<f32>>> = match combined.as_mut() {
            Some(grads) => params.vars().iter().map(|_| grads.next()).collect(),
            None => params.vars().iter().map(|(name, var)| grad_of(name, var)).collect::<Result<_, _>>()?,
        };
        for ((name, _), g) in params.vars().iter().zip(&grads) {
            if let Some(g) = g {
                check_finite(g, || format!("gradient of dense parameter `{name}`"))?;
            }
        }
        self.step += 1;
        let c = &self.config;
        let lr = c.learning_rate as f32;
        let wd = c.weight_decay as f32;
        let t = self.step as i32;
        let (b1, b2, eps) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32);
        let (c1, c2) = (1.0 - c.beta1.powi(t) as f32, 1.0 - c.beta2.powi(t) as f32);
        for ((name, var), g) in params.vars().iter().zip(grads) {
            let Some(g) = g else {
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
        Ok(true)
    }

    /// The first parameter or optimizer moment holding a NaN or an infinity,
    /// named (checked once per log interval: the per-step checks cover the
    /// gradients, this covers an update that overflowed).
    pub fn check_finite(&self, params: &ParamStore) -> Result<(), ModelError> {
        for (name, var) in params.vars() {
            let w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            check_finite(&w, || format!("dense parameter `{name}`"))?;
            if let Some((m, v)) = self.moments.get(name) {
                check_finite(m, || format!("Adam first moment of `{name}`"))?;
                check_finite(v, || format!("Adam second moment of `{name}`"))?;
            }
        }
        Ok(())
    }

    /// Takes the state (moments, step counts) of `other`, keeping this
    /// optimizer's config and sync (a replica resuming from a checkpoint).
    pub fn take_state_from(&mut self, other: DenseOptimizer) {
        self.moments = other.moments;
        self.step = other.step;
        self.samples_stepped = other.samples_stepped;
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
