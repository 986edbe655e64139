//! Dense optimizers over a [`ParamStore`], with state that checkpoints exactly.
//!
//! The update runs as one fused loop over plain slices: as candle ops it was
//! a dozen allocating passes per parameter per step.

use std::collections::HashMap;

use std::cell::Cell;

use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Tensor, Var};
use rayon::prelude::*;
use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind, ScheduleConfig};
use sparrow_core::simd::Simd;

use crate::ModelError;
use crate::own_threads::{on_own_threads, param_sizes};
use crate::params::ParamStore;

/// One batch's dense gradients: per parameter in [`ParamStore`] order, the
/// gradient of the mean loss over `rows` samples (`None`: the parameter has
/// none and stays as it is). What a dense step hands to the data-parallel
/// sync (`sparrow_trainer::dense_sync`) and then to [`DenseOptimizer::apply`].
#[derive(Clone, Debug, Default)]
pub struct DenseGrads {
    pub grads: Vec<Option<Vec<f32>>>,
    pub rows: u64,
    /// The pass that wrote `grads` found every value finite (a step in
    /// halves checks each parameter's sum as it writes it, in cache), so
    /// [`check_finite`](Self::check_finite) has nothing to read. Whatever
    /// writes `grads` after that pass clears it.
    pub(crate) found_finite: bool,
}

impl DenseGrads {
    /// Gradients of the mean loss over `rows` samples, not yet checked.
    pub fn new(grads: Vec<Option<Vec<f32>>>, rows: u64) -> DenseGrads {
        DenseGrads { grads, rows, found_finite: false }
    }

    /// A replica without a batch: no gradient, no rows.
    pub fn idle(params: &ParamStore) -> DenseGrads {
        DenseGrads::new(vec![None; params.vars().len()], 0)
    }

    /// `Err(NonFinite)` naming the first parameter whose gradient is not
    /// finite. Each parameter is read on its own thread of the caller's
    /// pool (`own_threads.rs`): the multi-task kinds' hundred-odd small
    /// ones were read on one thread while the other waited. Gradients the
    /// pass that wrote them found finite are not read again.
    pub fn check_finite(&self, simd: Simd, params: &ParamStore) -> Result<(), ModelError> {
        if self.found_finite {
            return Ok(());
        }
        let jobs: Vec<_> = (params.vars().iter().zip(&self.grads).enumerate())
            .filter_map(|(i, ((name, _), g))| Some((i, (name, g.as_ref()?))))
            .collect();
        let checked = on_own_threads(&param_sizes(params), jobs, |(name, g)| {
            check_finite(simd, g, || format!("gradient of dense parameter `{name}`"))
        });
        checked.into_iter().collect()
    }

    /// Every parameter's gradient of the summed loss (rows × mean), flattened
    /// in [`ParamStore`] order, zeros where there is none: what replicas add up.
    pub fn flat_sum_terms(&self, params: &ParamStore) -> Vec<f32> {
        let scale = self.rows as f32;
        let mut flat = Vec::with_capacity(params.num_params());
        for ((_, var), g) in params.vars().iter().zip(&self.grads) {
            match g {
                Some(g) => flat.extend(g.iter().map(|&g| g * scale)),
                None => flat.resize(flat.len() + var.elem_count(), 0.0),
            }
        }
        flat
    }

    /// The mean gradient over `rows` samples from a sum of [`flat_sum_terms`](Self::flat_sum_terms).
    pub fn from_flat_sum(params: &ParamStore, flat: &[f32], rows: u64) -> DenseGrads {
        let inv = 1.0 / rows.max(1) as f32;
        let mut rest = flat;
        let mut grads = Vec::with_capacity(params.vars().len());
        for (_, var) in params.vars() {
            let (mine, tail) = rest.split_at(var.elem_count().min(rest.len()));
            grads.push(Some(mine.iter().map(|g| g * inv).collect()));
            rest = tail;
        }
        DenseGrads::new(grads, rows)
    }
}

/// Runs `update` once on a parameter's values: where they are stored on
/// the CPU (no copy out and back, as `Var::set` would need), on a copy
/// written back elsewhere.
/// One Adam step's constants (`c1`, `c2`: the bias corrections).
#[derive(Clone, Copy, Debug)]
struct AdamStep {
    lr: f32,
    /// Coupled L2 (`adam`): added to the gradient.
    wd: f32,
    /// Decoupled decay (`adamw`): the weight's factor, `1 − lr·wd` (1: none).
    decay: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    c1: f32,
    c2: f32,
    /// A second moment below this is stored as 0 ([`SUBNORMAL`] where that
    /// cannot move the step, see [`AdamStep::v_floor`]; else 0: none is).
    v_floor: f32,
}

/// The smallest normal f32: a moment below it is subnormal, and every
/// operation on a subnormal takes a slow microcode path on x86 (Adam's
/// loop ran at 9–10 ns a weight instead of 1 on an Intel Xeon). A weight
/// whose gradient stays 0 (a ReLU unit that no longer fires) decays its
/// first moment through that range in ~150 steps and its second in ~16k.
const SUBNORMAL: f32 = f32::MIN_POSITIVE;

impl AdamStep {
    /// `SUBNORMAL` where a subnormal second moment is lost in `√(v/c2) + eps`
    /// (√(2⁻¹²⁶/c2) under a quarter of eps's last place), so storing it as 0
    /// leaves the denominator's bits; 0 where it is not (`eps` = 0, or a
    /// bias correction so small that it would count).
    fn v_floor(eps: f32, c2: f32) -> f32 {
        let largest_root = (f64::from(SUBNORMAL) / f64::from(c2)).sqrt();
        if largest_root <= f64::from(eps) * 2f64.powi(-25) { SUBNORMAL } else { 0.0 }
    }
}

/// Adam on a run of weights, each on its own: the bits do not depend on
/// how the loop is vectorised (no fused multiply-add, and division and
/// square root are exactly rounded at any width). A subnormal first moment
/// is stored as 0: its share of the step, `lr·m/c1` over a denominator of
/// at least eps, is ~10⁻³² of a weight; a second moment as `v_floor` says.
///
/// A bias correction of exactly 1 divides by 1, which leaves every value
/// as it is: the loop runs without that division, with the same bits. In
/// f32, `c1 = 1 − 0.9ᵗ` is 1 from step 165 on and `c2 = 1 − 0.999ᵗ` from
/// step 17,321 on. Adam was 2.6–9.2% of a PLE run's samples, the most
/// when the VM ran slow; there a division less took 1.4% off PLE's
/// `dense_step`.
#[inline(always)]
fn adam(k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    match (k.c1 == 1.0, k.c2 == 1.0) {
        (true, true) => adam_corrected::<true, true>(k, w, g, m, v),
        (true, false) => adam_corrected::<true, false>(k, w, g, m, v),
        (false, true) => adam_corrected::<false, true>(k, w, g, m, v),
        (false, false) => adam_corrected::<false, false>(k, w, g, m, v),
    }
}

/// [`adam`] where `C1_IS_ONE` (`k.c1` is 1) and `C2_IS_ONE` say which
/// bias corrections it skips.
#[inline(always)]
fn adam_corrected<const C1_IS_ONE: bool, const C2_IS_ONE: bool>(
    k: AdamStep,
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g + k.wd * *w;
        let m_next = k.b1 * *m + (1.0 - k.b1) * g;
        *m = if m_next.abs() < SUBNORMAL { 0.0 } else { m_next };
        let v_next = k.b2 * *v + (1.0 - k.b2) * g * g;
        *v = if v_next < k.v_floor { 0.0 } else { v_next };
        let m_hat = if C1_IS_ONE { *m } else { *m / k.c1 };
        let v_hat = if C2_IS_ONE { *v } else { *v / k.c2 };
        // `w · 1` is `w`: plain Adam keeps its bits.
        *w = *w * k.decay - k.lr * m_hat / (v_hat.sqrt() + k.eps);
    }
}

/// [`adam`] compiled for AVX-512F where the CPU has it (16 lanes a
/// division or square root instead of the x86-64 baseline's 4: about 1.5x
/// on the loop, 1-2% of a DLRM step), for AVX2 where it has that (8 lanes:
/// the portable loop was 4% of PLE's `dense_step` under `avx2`), the
/// portable build elsewhere; the same bits (tested: no fused multiply-add
/// is enabled, and LLVM does not fuse on its own).
fn adam_for_cpu(simd: Simd, k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd.allows_avx512() && std::arch::is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f")]
        fn adam_avx512(k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
            adam(k, w, g, m, v);
        }
        // SAFETY: AVX-512F was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            adam_avx512(k, w, g, m, v)
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn adam_avx2(k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
            adam(k, w, g, m, v);
        }
        // SAFETY: AVX2 was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        unsafe {
            adam_avx2(k, w, g, m, v)
        };
        return;
    }
    adam(k, w, g, m, v);
}

/// One parameter's step: Adam (or AdamW) where it has moments, SGD where
/// it has none; chunks of a large parameter in parallel on the caller's
/// pool. Chunks of 4k weights (about 3 µs of Adam on an AVX-512 core):
/// the reference MLP's 143k weights are one parameter, and in chunks of
/// 16k the thread that joined late took 3 or 4 of 9 (Adam 86–90 µs a step
/// against 65–71; an AMX Xeon, 2 threads).
fn update_weights(w: &mut [f32], g: &[f32], moments: Option<&mut (Vec<f32>, Vec<f32>)>, k: AdamStep, simd: Simd) {
    const CHUNK: usize = 4 * 1024;
    match moments {
        None => {
            let (lr, wd) = (k.lr, k.wd);
            w.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(w, g)| {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * (g + wd * *w);
                }
            });
        }
        Some((m, v)) => {
            w.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .for_each(|(((w, g), m), v)| adam_for_cpu(simd, k, w, g, m, v));
        }
    }
}

fn update_in_place(var: &Var, update: impl FnOnce(&mut [f32])) -> Result<(), ModelError> {
    if var.device().is_cpu() {
        var.as_tensor().inplace_op1(&InPlace { update: Cell::new(Some(update)) })?;
    } else {
        let mut w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        update(&mut w);
        var.set(&Tensor::from_vec(w, var.shape(), var.device())?)?;
    }
    Ok(())
}

struct InPlace<F> {
    update: Cell<Option<F>>,
}

impl<F: FnOnce(&mut [f32])> InplaceOp1 for InPlace<F> {
    fn name(&self) -> &'static str {
        "dense-update"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("dense-update: not contiguous".into()))?;
        let CpuStorage::F32(values) = storage else {
            return Err(candle_core::Error::Msg("dense-update: parameters are not f32".into()));
        };
        if let Some(update) = self.update.take() {
            update(&mut values[start..end]);
        }
        Ok(())
    }
}

/// `Err(NonFinite)` naming `what` (built only on failure) if `values` holds a NaN or an infinity.
pub fn check_finite(simd: Simd, values: &[f32], what: impl FnOnce() -> String) -> Result<(), ModelError> {
    if all_finite_on_pool(simd, values) {
        return Ok(());
    }
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(ModelError::NonFinite { what: format!("{} (element {i} is {})", what(), values[i]) }),
        None => Ok(()),
    }
}

/// [`all_finite`], a large buffer read on the pool's threads.
pub(crate) fn all_finite_on_pool(simd: Simd, values: &[f32]) -> bool {
    // A batch's input gradient (FM: 1024 rows × 455 floats) is read at
    // memory speed: both threads read half; small vectors stay on this one.
    const PER_THREAD: usize = 1 << 16;
    if values.len() > PER_THREAD {
        values.par_chunks(PER_THREAD).all(|c| all_finite(simd, c))
    } else {
        all_finite(simd, values)
    }
}

/// Whether every value is finite, compiled for AVX2 where the CPU has it:
/// 8 lanes a test instead of the x86-64 baseline's 4 (the check of FM's
/// input gradient took a sixth of its dense step). The same answer (tested).
pub(crate) fn all_finite(simd: Simd, values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd.allows() && std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn all_finite_avx2(values: &[f32]) -> bool {
            all_finite_portable(values)
        }
        // SAFETY: AVX2 was detected just above.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { all_finite_avx2(values) };
    }
    all_finite_portable(values)
}

#[inline(always)]
fn all_finite_portable(values: &[f32]) -> bool {
    // A float is NaN or infinite exactly when its exponent bits are all
    // ones; OR-ing that test over chunks has no early exit, so it vectorises.
    const EXPONENT: u32 = 0x7f80_0000;
    values.chunks(256).all(|c| !c.iter().fold(false, |bad, v| bad | (v.to_bits() & EXPONENT == EXPONENT)))
}

pub struct DenseOptimizer {
    config: DenseOptimizerConfig,
    /// `train.simd`: whether its checks and steps may take SIMD kernels.
    simd: Simd,
    /// `[train.schedule]`: the learning rate's factor by step.
    schedule: ScheduleConfig,
    /// Adam first and second moments per parameter name.
    moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
    pub step: u64,
    /// Samples behind the steps taken (with a data-parallel sync: every replica's rows).
    pub samples_stepped: u64,
}

impl DenseOptimizer {
    pub fn new(config: DenseOptimizerConfig, simd: Simd) -> Self {
        DenseOptimizer {
            config,
            simd,
            schedule: ScheduleConfig::default(),
            moments: HashMap::new(),
            step: 0,
            samples_stepped: 0,
        }
    }

    /// Its learning rate scaled by `schedule` step by step.
    pub fn with_schedule(mut self, schedule: ScheduleConfig) -> Self {
        self.schedule = schedule;
        self
    }

    /// Its `[train.schedule]`.
    pub fn schedule(&self) -> &ScheduleConfig {
        &self.schedule
    }

    /// The schedule's factor for the next step (1 without a schedule): the
    /// embedding rows' rate takes it too where `train.schedule.embedding`.
    pub fn lr_factor(&self) -> f64 {
        self.schedule.factor(self.step)
    }

    /// Whether its checks and steps may take SIMD kernels.
    pub fn simd(&self) -> Simd {
        self.simd
    }

    /// One step with `grads` (the mean gradient over `grads.rows` samples).
    /// Every gradient is checked before any weight moves: a non-finite one
    /// leaves the model and the optimizer state as they were.
    /// Updates the weights where they are stored; returns the gradients'
    /// buffers, for the next step to reuse.
    pub fn apply(&mut self, params: &ParamStore, grads: DenseGrads) -> Result<Vec<Vec<f32>>, ModelError> {
        grads.check_finite(self.simd, params)?;
        let factor = self.lr_factor();
        self.samples_stepped += grads.rows;
        self.step += 1;
        let c = &self.config;
        // A factor of 1 leaves the rate's bits as they were.
        let lr = (c.learning_rate * factor) as f32;
        // AdamW's decay is decoupled from the gradient: a factor on the weight.
        let (wd, decay) = match c.kind {
            DenseOptimizerKind::AdamW => (0.0, 1.0 - lr * c.weight_decay as f32),
            DenseOptimizerKind::Adam | DenseOptimizerKind::Sgd => (c.weight_decay as f32, 1.0),
        };
        let t = self.step as i32;
        let (b1, b2, eps) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32);
        let (c1, c2) = (1.0 - c.beta1.powi(t) as f32, 1.0 - c.beta2.powi(t) as f32);
        // Every parameter's moments exist before the updates run side by side.
        let adam = matches!(c.kind, DenseOptimizerKind::Adam | DenseOptimizerKind::AdamW);
        if adam {
            for (index, ((name, var), g)) in params.vars().iter().zip(&grads.grads).enumerate() {
                if g.is_some() && params.statistic_momentum(index).is_none() && !self.moments.contains_key(name) {
                    self.moments.insert(name.clone(), (vec![0.0; var.elem_count()], vec![0.0; var.elem_count()]));
                }
            }
        }
        let mut moments: HashMap<&str, &mut (Vec<f32>, Vec<f32>)> =
            self.moments.iter_mut().map(|(name, m)| (name.as_str(), m)).collect();
        let jobs: Vec<_> = (params.vars().iter().zip(grads.grads).enumerate())
            .filter_map(|(index, ((name, var), g))| {
                Some((index, var, g?, moments.remove(name.as_str()).filter(|_| adam)))
            })
            .collect();
        let (v_floor, simd) = (AdamStep::v_floor(eps, c2), self.simd);
        let step = AdamStep { lr, wd, decay, b1, b2, eps, c1, c2, v_floor };
        // A model of many small parameters (the multi-task kinds' experts,
        // gates and towers: a few thousand weights each) had them updated
        // one after another on one thread; each parameter now is a job on
        // the pool thread that updated it the step before (`own_threads.rs`),
        // and a large one is split in chunks too. Each weight's update is
        // its own, so the bits do not depend on which thread runs it.
        let jobs = jobs.into_iter().map(|job| (job.0, job)).collect();
        let updated = on_own_threads(&param_sizes(params), jobs, |(index, var, g, moments)| {
            // A running statistic follows its batch values, at no rate.
            if let Some(m) = params.statistic_momentum(index) {
                update_in_place(var, |w| w.iter_mut().zip(&g).for_each(|(w, b)| *w = (1.0 - m) * *w + m * b))?;
                return Ok(g);
            }
            update_in_place(var, |w| update_weights(w, &g, moments, step, simd))?;
            Ok(g)
        });
        updated.into_iter().collect()
    }

    /// The first parameter or optimizer moment holding a NaN or an infinity,
    /// named (checked once per log interval: the per-step checks cover the
    /// gradients, this covers an update that overflowed).
    pub fn check_finite(&self, params: &ParamStore) -> Result<(), ModelError> {
        for (name, var) in params.vars() {
            let w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            check_finite(self.simd, &w, || format!("dense parameter `{name}`"))?;
            if let Some((m, v)) = self.moments.get(name) {
                check_finite(self.simd, m, || format!("Adam first moment of `{name}`"))?;
                check_finite(self.simd, v, || format!("Adam second moment of `{name}`"))?;
            }
        }
        Ok(())
    }

    /// Takes the state (moments, step counts) of `other`, keeping this
    /// optimizer's config (a replica resuming from a checkpoint).
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

#[cfg(test)]
mod tests {
    use super::{AdamStep, SUBNORMAL, adam, adam_for_cpu, all_finite, all_finite_portable, check_finite};
    use sparrow_core::simd::Simd;

    /// Every NaN and infinity is found, wherever it lies in a short or a
    /// long (split between threads) vector, and named with its element.
    #[test]
    fn check_finite_finds_every_bad_value() {
        for len in [1, 255, 257, 1 << 16, (1 << 16) + 1, 300_000] {
            let mut v = vec![1.5f32; len];
            assert!(check_finite(Simd::Auto, &v, || "v".into()).is_ok());
            for at in [0, len / 2, len - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    v[at] = bad;
                    let err = check_finite(Simd::Auto, &v, || "v".into()).expect_err("bad value").to_string();
                    assert!(err.contains(&format!("element {at} is")), "{len}, {at}: {err}");
                    v[at] = -f32::MAX;
                }
            }
        }
    }

    /// A step's gradients checked side by side name the first parameter in
    /// order whose gradient is not finite, whichever thread finds which,
    /// and pass where the only bad values are in a parameter without a
    /// gradient.
    #[test]
    fn the_first_parameter_with_a_bad_gradient_is_named() {
        let sizes = [3usize, 70_000, 5, 40, 1, 9];
        let mut params = crate::params::ParamStore::new(1, candle_core::Device::Cpu);
        for (p, &n) in sizes.iter().enumerate() {
            params.push(format!("p{p}"), vec![0.5; n], &[n]).expect("a parameter");
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        for bad in [vec![], vec![1], vec![3, 5], vec![2, 4, 5], vec![5], vec![1, 3]] {
            let grads = super::DenseGrads {
                grads: (sizes.iter().enumerate())
                    .map(|(p, &n)| {
                        let mut g = vec![0.25f32; n];
                        if bad.contains(&p) {
                            g[n - 1] = f32::NAN;
                        }
                        Some(g)
                    })
                    .collect(),
                rows: 8,
                found_finite: false,
            };
            let got = pool.install(|| grads.check_finite(Simd::Auto, &params));
            match bad.first() {
                None => assert!(got.is_ok(), "no bad gradient"),
                Some(first) => {
                    let err = got.expect_err("a bad gradient").to_string();
                    assert!(err.contains(&format!("`p{first}`")), "{bad:?}: {err}");
                }
            }
            if !bad.is_empty() {
                // Nothing moves: not the weights, not the optimizer's step.
                let mut opt =
                    super::DenseOptimizer::new(sparrow_core::config::DenseOptimizerConfig::default(), Simd::Auto);
                let before = params.vars()[1].1.as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>());
                assert!(pool.install(|| opt.apply(&params, grads.clone())).is_err(), "{bad:?}: refused");
                let after = params.vars()[1].1.as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>());
                assert_eq!(before.expect("values"), after.expect("values"), "{bad:?}: weights kept");
                assert_eq!((opt.step, opt.moments.len()), (0, 0), "{bad:?}: no step taken");
            }
            let mut without = grads.clone();
            bad.iter().for_each(|&p| without.grads[p] = None);
            assert!(pool.install(|| without.check_finite(Simd::Auto, &params)).is_ok(), "{bad:?} without gradients");
        }
    }

    /// The finiteness test compiled for this CPU and the portable one agree
    /// on every kind of float (one bad value at each place of vectors that
    /// leave vector and chunk tails), and both find every NaN and infinity.
    #[test]
    fn the_finiteness_test_for_this_cpu_equals_the_portable_one() {
        let specials = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x7f80_0001)];
        let fine = [0.0, -0.0, f32::MAX, f32::MIN, f32::MIN_POSITIVE, f32::from_bits(1), 1.5];
        for len in [1usize, 7, 8, 9, 31, 256, 257, 1000] {
            let clean: Vec<f32> = (0..len).map(|i| fine[i % fine.len()]).collect();
            assert!(all_finite(Simd::Auto, &clean) && all_finite_portable(&clean), "len {len}");
            for at in 0..len {
                for bad in specials {
                    let mut v = clean.clone();
                    v[at] = bad;
                    assert!(!all_finite(Simd::Auto, &v), "len {len}, {bad} at {at}");
                    assert!(!all_finite_portable(&v), "len {len}, {bad} at {at} (portable)");
                }
            }
        }
    }

    /// The Adam step compiled for this CPU and the portable one give the
    /// same bits, over weights, gradients and moments of every magnitude
    /// (subnormal and zero included) and lengths that leave vector tails.
    #[test]
    fn adam_for_this_cpu_equals_the_portable_loop_bit_for_bit() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let exponent = (x >> 40) % 60;
            let magnitude = 2f32.powi(exponent as i32 - 50) * (1.0 + (x >> 11) as f32 / (1u64 << 53) as f32);
            if x & 1 == 0 { magnitude } else { -magnitude }
        };
        for (t, len) in [(1, 1usize), (2, 15), (7, 16), (30, 17), (1000, 1000), (3, 4099)] {
            let c = |beta: f64| 1.0 - beta.powi(t) as f32;
            // Adam's coupled L2, then AdamW's decoupled decay.
            for (wd, decay) in [(0.01, 1.0), (0.0, 1.0 - 0.001 * 0.01)] {
                let (c1, c2) = (c(0.9), c(0.999));
                let v_floor = AdamStep::v_floor(1e-8, c2);
                let k = AdamStep { lr: 0.001, wd, decay, b1: 0.9, b2: 0.999, eps: 1e-8, c1, c2, v_floor };
                let w: Vec<f32> = (0..len).map(|i| if i % 11 == 0 { 0.0 } else { next() }).collect();
                let g: Vec<f32> = (0..len).map(|i| if i % 13 == 0 { f32::from_bits(3) } else { next() }).collect();
                let m: Vec<f32> = (0..len).map(|_| next()).collect();
                let v: Vec<f32> = (0..len).map(|_| next().abs()).collect();
                let (mut w2, mut m2, mut v2) = (w.clone(), m.clone(), v.clone());
                adam(k, &mut w2, &g, &mut m2, &mut v2);
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                // Every build this CPU has: AVX-512F's, AVX2's.
                for simd in [Simd::Auto, Simd::Avx2] {
                    let (mut w1, mut m1, mut v1) = (w.clone(), m.clone(), v.clone());
                    adam_for_cpu(simd, k, &mut w1, &g, &mut m1, &mut v1);
                    assert_eq!(bits(&w1), bits(&w2), "weights, len {len}, {simd:?}");
                    assert_eq!(bits(&m1), bits(&m2), "first moments, len {len}, {simd:?}");
                    assert_eq!(bits(&v1), bits(&v2), "second moments, len {len}, {simd:?}");
                    assert_ne!(bits(&w1), bits(&w), "the step moved the weights");
                }
            }
        }
    }

    /// A step at the default betas and eps: `lr`, (coupled L2, decoupled
    /// decay factor), the bias corrections.
    fn default_betas(lr: f32, (wd, decay): (f32, f32), (c1, c2): (f32, f32)) -> AdamStep {
        AdamStep { lr, wd, decay, b1: 0.9, b2: 0.999, eps: 1e-8, c1, c2, v_floor: AdamStep::v_floor(1e-8, c2) }
    }

    /// The loop without a bias correction of 1 gives the bits of Adam's
    /// whole formula (each correction divided by), on every build, at
    /// corrections of 1 and not; and f32's corrections are 1 from the
    /// steps its comment says.
    #[test]
    fn a_bias_correction_of_one_is_skipped_with_the_same_bits() {
        let whole = |k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
            for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g + k.wd * *w;
                let m_next = k.b1 * *m + (1.0 - k.b1) * g;
                *m = if m_next.abs() < SUBNORMAL { 0.0 } else { m_next };
                let v_next = k.b2 * *v + (1.0 - k.b2) * g * g;
                *v = if v_next < k.v_floor { 0.0 } else { v_next };
                *w = *w * k.decay - k.lr * (*m / k.c1) / ((*v / k.c2).sqrt() + k.eps);
            }
        };
        let c = |beta: f64, t: i32| 1.0 - beta.powi(t) as f32;
        assert_eq!((c(0.9, 164) == 1.0, c(0.9, 165) == 1.0), (false, true), "c1");
        assert_eq!((c(0.999, 17_320) == 1.0, c(0.999, 17_321) == 1.0), (false, true), "c2");
        let mut rng = sparrow_core::rng::Rng::new(5);
        let mut values = |n: usize, scale: f64| -> Vec<f32> {
            (0..n).map(|i| if i % 17 == 0 { 0.0 } else { (rng.uniform(-1.0, 1.0) * scale) as f32 }).collect()
        };
        for t in [3, 164, 165, 5_000, 17_320, 17_321, 40_000] {
            let (c1, c2) = (c(0.9, t), c(0.999, t));
            let k = default_betas(0.001, (0.01, 1.0), (c1, c2));
            let (w, g, m) = (values(1037, 1.0), values(1037, 1e-3), values(1037, 1e-4));
            let v: Vec<f32> = values(1037, 1e-6).iter().map(|x| x * x).collect();
            let (mut w0, mut m0, mut v0) = (w.clone(), m.clone(), v.clone());
            whole(k, &mut w0, &g, &mut m0, &mut v0);
            for simd in [Simd::Auto, Simd::Avx2, Simd::Portable] {
                let (mut w1, mut m1, mut v1) = (w.clone(), m.clone(), v.clone());
                adam_for_cpu(simd, k, &mut w1, &g, &mut m1, &mut v1);
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&w1), bits(&w0), "weights, step {t}, {simd:?}");
                assert_eq!((bits(&m1), bits(&v1)), (bits(&m0), bits(&v0)), "moments, step {t}, {simd:?}");
            }
        }
    }

    /// Weights whose gradients stop (a ReLU unit that no longer fires, or
    /// one too small to square): their moments decay to 0 instead of
    /// through the subnormals, and every step moves the weights exactly as
    /// Adam without the flush does.
    #[test]
    fn moments_skip_the_subnormals_and_the_weights_keep_adams_bits() {
        fn unflushed(k: AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
            for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g + k.wd * *w;
                *m = k.b1 * *m + (1.0 - k.b1) * g;
                *v = k.b2 * *v + (1.0 - k.b2) * g * g;
                *w = *w * k.decay - k.lr * (*m / k.c1) / ((*v / k.c2).sqrt() + k.eps);
            }
        }
        let subnormal = |x: f32| x != 0.0 && x.abs() < SUBNORMAL;
        // Gradients of every size for 50 steps, then 0 (a tiny one squares to 0 at once).
        let first: [f32; 6] = [0.5, -1e-3, 1e-12, -1e-19, 1e-30, 3e-39];
        let n = first.len();
        let w0: Vec<f32> = (0..n).map(|i| 0.25 - 0.1 * i as f32).collect();
        let (mut w1, mut m1, mut v1) = (w0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
        let (mut w2, mut m2, mut v2) = (w0, vec![0.0f32; n], vec![0.0f32; n]);
        let (mut reference_went_subnormal, mut flushed) = (false, 0);
        for t in 1..=30_000 {
            let c = |beta: f64| 1.0 - beta.powi(t) as f32;
            let (c1, c2) = (c(0.9), c(0.999));
            let v_floor = AdamStep::v_floor(1e-8, c2);
            assert_eq!(v_floor, SUBNORMAL, "step {t}: eps 1e-8 hides every subnormal second moment");
            let k = AdamStep { lr: 0.001, wd: 0.0, decay: 1.0, b1: 0.9, b2: 0.999, eps: 1e-8, c1, c2, v_floor };
            let g: Vec<f32> = if t <= 50 { first.to_vec() } else { vec![0.0; n] };
            adam_for_cpu(Simd::Auto, k, &mut w1, &g, &mut m1, &mut v1);
            unflushed(k, &mut w2, &g, &mut m2, &mut v2);
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w1), bits(&w2), "step {t}: the weights");
            assert!(!m1.iter().chain(&v1).copied().any(subnormal), "step {t}: a subnormal moment {m1:?} {v1:?}");
            reference_went_subnormal |= m2.iter().chain(&v2).copied().any(subnormal);
            flushed += m1.iter().zip(&m2).chain(v1.iter().zip(&v2)).filter(|&(a, b)| *a == 0.0 && *b != 0.0).count();
        }
        assert!(reference_went_subnormal, "the case is not exercised: no moment went subnormal");
        assert!(flushed > 0, "no moment was flushed");
        assert!(m1.iter().all(|&x| x == 0.0), "every first moment decayed to 0: {m1:?}");
        assert!(v1[2..].iter().all(|&x| x == 0.0), "the small gradients' second moments decayed to 0: {v1:?}");
    }

    /// Where eps does not hide a subnormal second moment (eps = 0, or a
    /// bias correction tiny enough to lift it), none is flushed.
    #[test]
    fn a_second_moment_is_flushed_only_where_eps_hides_it() {
        assert_eq!(AdamStep::v_floor(0.0, 1.0), 0.0);
        assert_eq!(AdamStep::v_floor(1e-8, 1e-30), 0.0);
        assert_eq!(AdamStep::v_floor(1e-8, 1e-3), SUBNORMAL);
        assert_eq!(AdamStep::v_floor(1e-10, 1.0), SUBNORMAL);
        assert_eq!(AdamStep::v_floor(1e-13, 1.0), 0.0);
    }

    /// One step on w = 1 with g = 0.5, lr = 0.1, weight decay 0.1, worked
    /// by hand: Adam adds 0.1·w to the gradient (m̂ = √v̂ = 0.6, a step of
    /// lr) and lands on 0.9; AdamW scales w by 1 − lr·wd = 0.99 and then
    /// takes Adam's step on g alone (m̂ = √v̂ = 0.5, again lr): 0.89. SGD's
    /// coupled decay: 1 − 0.1·(0.5 + 0.1) = 0.94.
    #[test]
    fn adamw_decays_the_weight_apart_from_the_gradient() {
        use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind};
        for (kind, want) in
            [(DenseOptimizerKind::Adam, 0.9), (DenseOptimizerKind::AdamW, 0.89), (DenseOptimizerKind::Sgd, 0.94)]
        {
            let mut params = crate::params::ParamStore::new(1, candle_core::Device::Cpu);
            params.push("w".into(), vec![1.0], &[1]).expect("a parameter");
            let config = DenseOptimizerConfig { kind, learning_rate: 0.1, weight_decay: 0.1, ..Default::default() };
            let mut opt = super::DenseOptimizer::new(config, Simd::Auto);
            opt.apply(&params, super::DenseGrads::new(vec![Some(vec![0.5])], 1)).expect("a step");
            let w = params.flat_values().expect("values")[0];
            assert!((w - want).abs() < 1e-6, "{kind:?}: {w}, not {want}");
        }
    }

    /// Every parameter is its own job of the pool (and a large one is cut
    /// in chunks): on pools of one and of three threads, the weights and
    /// moments after three steps are those of each parameter stepped alone
    /// by the plain loop, bit for bit, for Adam, AdamW and SGD; an SGD
    /// optimizer holding moments (left by a checkpoint) does not use them.
    #[test]
    fn each_parameter_steps_as_it_would_alone_on_any_pool() {
        use sparrow_core::config::{DenseOptimizerConfig, DenseOptimizerKind};
        // Many small parameters, as the multi-task kinds have, and one
        // larger than a chunk.
        let sizes: Vec<usize> = (1..40).map(|i| i * 7 % 300 + 1).chain([40_000]).collect();
        let value = |p: usize, i: usize, step: usize| ((p * 131 + i * 17 + step * 7) % 1009) as f32 / 1009.0 - 0.45;
        let params_of = || {
            let mut params = crate::params::ParamStore::new(1, candle_core::Device::Cpu);
            for (p, &n) in sizes.iter().enumerate() {
                params.push(format!("p{p}"), (0..n).map(|i| value(p, i, 99)).collect(), &[n]).expect("a parameter");
            }
            params
        };
        let grads = |step: usize| super::DenseGrads {
            // The fifth parameter has no gradient this step: it stays as it was.
            grads: sizes
                .iter()
                .enumerate()
                .map(|(p, &n)| (p != 4 || step == 0).then(|| (0..n).map(|i| value(p, i, step)).collect()))
                .collect(),
            rows: 8,
            found_finite: false,
        };
        for kind in [DenseOptimizerKind::Adam, DenseOptimizerKind::AdamW, DenseOptimizerKind::Sgd] {
            let config = DenseOptimizerConfig { kind, learning_rate: 0.01, weight_decay: 0.01, ..Default::default() };
            // The reference: each parameter on its own, the plain loop.
            let mut expected: Vec<Vec<f32>> =
                sizes.iter().enumerate().map(|(p, &n)| (0..n).map(|i| value(p, i, 99)).collect()).collect();
            let mut moments: Vec<(Vec<f32>, Vec<f32>)> = sizes.iter().map(|&n| (vec![0.0; n], vec![0.0; n])).collect();
            let mut stepped = vec![0i32; sizes.len()];
            for step in 0..3 {
                for (p, g) in grads(step).grads.into_iter().enumerate() {
                    let Some(g) = g else { continue };
                    let lr = config.learning_rate as f32;
                    let w = &mut expected[p];
                    if kind == DenseOptimizerKind::Sgd {
                        w.iter_mut().zip(&g).for_each(|(w, g)| *w -= lr * (g + 0.01 * *w));
                        continue;
                    }
                    // Steps count the optimizer's, not the parameter's.
                    stepped[p] = step as i32 + 1;
                    let t = stepped[p];
                    let (c1, c2) = (1.0 - 0.9f64.powi(t) as f32, 1.0 - 0.999f64.powi(t) as f32);
                    let (wd, decay) =
                        if kind == DenseOptimizerKind::AdamW { (0.0, 1.0 - lr * 0.01) } else { (0.01, 1.0) };
                    let k = default_betas(lr, (wd, decay), (c1, c2));
                    let (m, v) = &mut moments[p];
                    adam(k, w, &g, m, v);
                }
            }
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
                let params = params_of();
                let mut opt = super::DenseOptimizer::new(config.clone(), Simd::Auto);
                if kind == DenseOptimizerKind::Sgd {
                    // Moments an SGD optimizer must not read.
                    opt.moments.insert("p0".into(), (vec![1.0; sizes[0]], vec![1.0; sizes[0]]));
                }
                pool.install(|| {
                    for step in 0..3 {
                        opt.apply(&params, grads(step)).expect("a step");
                    }
                });
                // The first value whose bits differ, if any (`usize::MAX`: the lengths).
                let differs = |a: &[f32], b: &[f32]| match a.len() == b.len() {
                    true => a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()),
                    false => Some(usize::MAX),
                };
                let flat = params.flat_values().expect("values");
                assert_eq!(differs(&flat, &expected.concat()), None, "{kind:?} weights on {threads} threads");
                if kind != DenseOptimizerKind::Sgd {
                    for (p, (m, v)) in moments.iter().enumerate() {
                        let mine = &opt.moments[&format!("p{p}")];
                        assert_eq!(differs(&mine.0, m), None, "{kind:?} first moments of p{p}");
                        assert_eq!(differs(&mine.1, v), None, "{kind:?} second moments of p{p}");
                    }
                }
            }
        }
    }
}
