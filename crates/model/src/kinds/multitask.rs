//! The network of the multi-task kinds (`esmm.rs`, `mmoe.rs`, `ple.rs`), on candle's graph (their gradients are its
//! autograd's, checked against finite differences):
//! - `mmoe` (Ma et al. 2018): shared experts; each task mixes them with a
//!   softmax gate of its own over the input and puts the mix through its
//!   tower.
//! - `ple` (Tang et al. 2020): `model.levels` extraction layers of shared
//!   and task-specific experts; at each level a task's gate mixes its own
//!   experts and the shared ones, and (below the top) a shared gate mixes
//!   them all; each level's mixes are the next level's inputs.
//! - `esmm` (Ma et al. 2018): a CTR tower and a CVR tower on the shared
//!   embeddings; the first task (click) is pCTR, the second (conversion =
//!   click ∧ converts, over every impression) is pCTCVR = pCTR × pCVR, so
//!   the CVR tower learns from every impression. Its logit is
//!   logit(σ(a)·σ(b)) = −log(e^{−a} + e^{−b} + e^{−a−b}), a log-sum-exp.
//!
//! Every expert and tower is an MLP of the fused op; towers end in their
//! task's outputs. On CPU the step is `direct.rs`'s, outside the graph.

use candle_core::{D, Tensor};
use sparrow_core::config::ModelConfig;

use crate::ModelError;
use crate::bf16::Arith;
use crate::heads::Heads;
use crate::mlp::Mlp;
use crate::params::{Linear, ParamStore};

mod direct;
mod gates;
mod lay_columns;
mod one_input_gates;
mod one_input_towers;

/// One level of experts and their gates.
struct Level {
    /// Shared experts, then each task's own (PLE), task by task.
    shared: Vec<Mlp>,
    own: Vec<Vec<Mlp>>,
    /// Each task's gate (over its own and the shared experts), then the
    /// shared gate (over every expert; PLE below the top).
    gates: Vec<Linear>,
    shared_gate: Option<Linear>,
}

/// The gates' products (`x·W`, `xᵀ·d logits`, `d logits·Wᵀ`) are fp32
/// whatever `model.precision` says, as DIN's attention units are: each
/// has one column an expert it mixes (5 to 22 in all at the defaults),
/// and at such widths the bf16 products ran slower than fp32's. Timed
/// alone (Zen 5, one thread, 512 rows), fp32 against bf16: PLE's top
/// gates' `dW` `[64, 512]·[512, 5]` 1.7 against 8.4 µs, their `d x`
/// `[512, 5]·[5, 64]` 3.4 against 7.7, the bottom's four gates' `dW`
/// side by side `[81, 512]·[512, 22]` 13.2 against 15.7; with the gates
/// in fp32 PLE's bf16 step took 8–10% less. On the kernels `train.simd`
/// allows, as the model's own fp32 products.
fn gates_arith(simd: sparrow_core::simd::Simd) -> Arith {
    Arith::F32(simd)
}

/// Which of the multi-task kinds a [`MultiTask`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Which {
    Esmm,
    Mmoe,
    Ple,
}

pub(super) struct MultiTask {
    which: Which,
    levels: Vec<Level>,
    towers: Vec<Mlp>,
    /// `model.precision`: the experts' (their shared inputs are packed for it).
    arith: Arith,
    /// `train.simd`: whether the gates' passes may take their AVX-512 build.
    simd: sparrow_core::simd::Simd,
}

fn experts(
    ps: &mut ParamStore,
    name: &str,
    n: usize,
    input: usize,
    sizes: &[usize],
    (arith, dropout, simd, norm): (Arith, f32, sparrow_core::simd::Simd, crate::mlp::StackStyle),
) -> Result<Vec<Mlp>, ModelError> {
    (0..n)
        .map(|e| {
            Ok(Mlp::new_normed(ps, &format!("{name}.{e}"), input, sizes, true, arith, norm)?
                .with_dropout(dropout, simd))
        })
        .collect()
}

impl MultiTask {
    /// The network of kind `which` on inputs of `input` values, a tower per head.
    pub(super) fn new(
        which: Which,
        ps: &mut ParamStore,
        config: &ModelConfig,
        input: usize,
        heads: &Heads,
        (arith, simd): (Arith, sparrow_core::simd::Simd),
    ) -> Result<MultiTask, ModelError> {
        let normed = crate::kinds::stack_style(config);
        let tower = |ps: &mut ParamStore, t: usize, input: usize, outputs: usize| {
            let sizes: Vec<usize> = config.tower_hidden.iter().copied().chain([outputs]).collect();
            Ok::<_, ModelError>(
                Mlp::new_normed(ps, &format!("tower.{t}"), input, &sizes, false, arith, normed)?
                    .with_dropout(config.dropout, simd),
            )
        };
        let tasks = heads.tasks();
        let expert_out = config.expert_hidden.last().copied().unwrap_or(input);
        let mut levels = Vec::new();
        let mut towers = Vec::new();
        match which {
            Which::Esmm => {
                if tasks != 2 || heads.iter().any(|h| h.multiclass) {
                    return Err(ModelError::Heads { kind: "esmm", outputs: heads.outputs() });
                }
                // The CTR tower (click's output) and the CVR tower.
                towers.push(tower(ps, 0, input, 1)?);
                towers.push(tower(ps, 1, input, 1)?);
            }
            Which::Mmoe => {
                let shared = experts(
                    ps,
                    "expert",
                    config.experts,
                    input,
                    &config.expert_hidden,
                    (arith, config.dropout, simd, normed),
                )?;
                let gates = (0..tasks)
                    .map(|t| Linear::new(ps, &format!("gate.{t}"), input, config.experts))
                    .collect::<Result<_, _>>()?;
                levels.push(Level { shared, own: Vec::new(), gates, shared_gate: None });
                for (t, h) in heads.iter().enumerate() {
                    towers.push(tower(ps, t, expert_out, h.outputs)?);
                }
            }
            Which::Ple => {
                let mut fan_in = input;
                for l in 0..config.levels {
                    let top = l + 1 == config.levels;
                    let shared = experts(
                        ps,
                        &format!("level.{l}.shared"),
                        config.experts,
                        fan_in,
                        &config.expert_hidden,
                        (arith, config.dropout, simd, normed),
                    )?;
                    let own = (0..tasks)
                        .map(|t| {
                            experts(
                                ps,
                                &format!("level.{l}.task.{t}"),
                                config.task_experts,
                                fan_in,
                                &config.expert_hidden,
                                (arith, config.dropout, simd, normed),
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let gates = (0..tasks)
                        .map(|t| {
                            Linear::new(
                                ps,
                                &format!("level.{l}.gate.{t}"),
                                fan_in,
                                config.task_experts + config.experts,
                            )
                        })
                        .collect::<Result<_, _>>()?;
                    let shared_gate = (!top)
                        .then(|| {
                            Linear::new(
                                ps,
                                &format!("level.{l}.gate.shared"),
                                fan_in,
                                config.experts + tasks * config.task_experts,
                            )
                        })
                        .transpose()?;
                    levels.push(Level { shared, own, gates, shared_gate });
                    fan_in = expert_out;
                }
                for (t, h) in heads.iter().enumerate() {
                    towers.push(tower(ps, t, expert_out, h.outputs)?);
                }
            }
        }
        Ok(MultiTask { which, levels, towers, arith, simd })
    }

    /// Logits `[B, outputs]` from input rows `x` `[B, input]`; `draw`: the
    /// step's dropout draw.
    pub(super) fn forward(&self, x: &Tensor, draw: Option<u64>) -> Result<Tensor, ModelError> {
        let outs = match self.which {
            Which::Esmm => {
                let a = self.towers[0].forward(x, draw)?;
                let b = self.towers[1].forward(x, draw)?;
                // −log(e^{−a} + e^{−b} + e^{−a−b}) as −logsumexp(−a, −b, −a−b).
                let z = Tensor::cat(&[&a.neg()?, &b.neg()?, &(a.neg()? - &b)?], 1)?;
                let m = z.max_keepdim(D::Minus1)?;
                let lse = (z.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &m)?;
                vec![a, lse.neg()?]
            }
            _ => {
                let tasks = self.towers.len();
                // Every task's input and the shared input, level by level.
                let (mut inputs, mut shared_in) = (vec![x.clone(); tasks], x.clone());
                for level in &self.levels {
                    let shared: Vec<Tensor> =
                        level.shared.iter().map(|e| e.forward(&shared_in, draw)).collect::<Result<_, _>>()?;
                    let own: Vec<Vec<Tensor>> = level
                        .own
                        .iter()
                        .zip(&inputs)
                        .map(|(es, x)| es.iter().map(|e| e.forward(x, draw)).collect::<Result<Vec<_>, _>>())
                        .collect::<Result<_, _>>()?;
                    let mut next = Vec::with_capacity(tasks);
                    for (t, gate) in level.gates.iter().enumerate() {
                        let mut pool: Vec<&Tensor> = own.get(t).map(|o| o.iter().collect()).unwrap_or_default();
                        pool.extend(shared.iter());
                        // MMoE's gates read the input itself; PLE's, the task's input.
                        next.push(mix(&self.gate(gate, &inputs[t])?, &pool)?);
                    }
                    if let Some(gate) = &level.shared_gate {
                        let mut pool: Vec<&Tensor> = shared.iter().collect();
                        pool.extend(own.iter().flatten());
                        shared_in = mix(&self.gate(gate, &shared_in)?, &pool)?;
                    }
                    inputs = next;
                }
                self.towers.iter().zip(&inputs).map(|(t, x)| t.forward(x, draw)).collect::<Result<_, _>>()?
            }
        };
        let outs: Vec<&Tensor> = outs.iter().collect();
        Ok(Tensor::cat(&outs, 1)?)
    }
}

impl MultiTask {
    /// A gate's logits `x·W + b`, the product in fp32 ([`gates_arith`]).
    fn gate(&self, gate: &Linear, x: &Tensor) -> Result<Tensor, ModelError> {
        let product = crate::mlp::matmul_in(gates_arith(self.simd), x, gate.weight().as_tensor())?;
        Ok(product.broadcast_add(gate.bias().as_tensor())?)
    }

    /// Its structure and weights for an exporter.
    pub(super) fn spec(&self) -> Result<crate::spec::NetSpec, ModelError> {
        let mlps = |v: &[Mlp]| v.iter().map(Mlp::layers).collect::<Result<Vec<_>, _>>();
        let levels = self
            .levels
            .iter()
            .map(|l| {
                Ok(crate::spec::LevelSpec {
                    shared: mlps(&l.shared)?,
                    own: l.own.iter().map(|o| mlps(o)).collect::<Result<_, ModelError>>()?,
                    gates: l.gates.iter().map(crate::step::linear_spec).collect::<Result<_, _>>()?,
                    shared_gate: l.shared_gate.as_ref().map(crate::step::linear_spec).transpose()?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(crate::spec::NetSpec::MultiTask { esmm: self.which == Which::Esmm, levels, towers: mlps(&self.towers)? })
    }
}

impl super::Net for MultiTask {
    fn forward(
        &self,
        at: &super::At,
        emb: &Tensor,
        dense: &Tensor,
        _: &[(Tensor, Tensor)],
    ) -> Result<Tensor, ModelError> {
        MultiTask::forward(self, &super::parts::flat_with_dense(at, emb, dense)?, at.dropout)
    }

    fn spec(&self) -> Result<crate::spec::NetSpec, ModelError> {
        MultiTask::spec(self)
    }

    fn direct(&self) -> Option<&dyn super::Direct> {
        Some(self)
    }
}

/// The network of kind `which` on the flattened fields and dense values.
pub(super) fn build(which: Which, at: &mut super::Build<'_>) -> Result<Box<dyn super::Net>, ModelError> {
    let input = at.flat_len();
    Ok(Box::new(MultiTask::new(which, at.ps, at.config, input, at.heads, (at.arith, at.simd))?))
}

/// MMoE's and PLE's `model.expert_hidden`, which sets the experts' width.
pub(super) fn check_experts(config: &sparrow_core::Config) -> Result<(), sparrow_core::ConfigError> {
    if config.model.expert_hidden.is_empty() {
        return Err(sparrow_core::ConfigError::Invalid {
            key: "model.expert_hidden".into(),
            message: "needs a layer (the experts' width is its last)".into(),
        });
    }
    Ok(())
}

/// MMoE's and PLE's dense parameters over `levels` levels: experts (ending
/// in their widths, not in 1: a bound), gates, towers.
pub(super) fn experts_params(config: &ModelConfig, shape: crate::step::ModelShape, levels: u128) -> u128 {
    use super::parts::mlp_params;
    let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128;
    let width = config.expert_hidden.last().copied().unwrap_or(1) as u128;
    let per_level = (config.experts + config.task_experts) as u128;
    levels * per_level * (mlp_params(x.max(width), &config.expert_hidden) + (x + 1) * per_level)
        + 8 * mlp_params(width, &config.tower_hidden)
}

/// Floats a row of MMoE's step (one level, no task experts, no shared
/// gate) or PLE's holds beyond its input, for the memory estimate: each
/// expert's and tower's layers, outputs and their gradients (MMoE's peak
/// memory grew by 2.07 floats a row for each expert unit), and each gate's
/// logits and mix.
pub(super) fn experts_step_floats(
    config: &ModelConfig,
    levels: u128,
    (task_experts, shared_gate): (u128, bool),
) -> u128 {
    let tasks = config.tasks.len().max(1) as u128;
    let layers = super::parts::units(&config.expert_hidden);
    let width = config.expert_hidden.last().copied().unwrap_or(1) as u128;
    let experts = config.experts as u128 + tasks * task_experts;
    let gates = tasks + u128::from(shared_gate);
    let towers = super::parts::units(&config.tower_hidden);
    levels * (2 * experts * layers + gates * (experts + width)) + 2 * tasks * towers
}

/// Σ_k softmax(gate)_k · expert_k: `gate` `[B, K]`, each expert `[B, H]`.
fn mix(gate: &Tensor, experts: &[&Tensor]) -> Result<Tensor, ModelError> {
    let m = gate.max_keepdim(D::Minus1)?;
    // The direct step's exponentials (`exp.rs`), so it is compared with
    // this graph to its last bits.
    let e = gate.broadcast_sub(&m)?.contiguous()?.apply_op1(crate::exp::Exp)?;
    let w = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    let stacked = Tensor::stack(experts, 1)?; // [B, K, H]
    Ok(stacked.broadcast_mul(&w.unsqueeze(2)?)?.sum(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// ESMM's second output is the logit of pCTR × pCVR, the towers'
    /// probabilities' product, exactly; its first is the CTR tower's.
    #[test]
    fn esmm_ctcvr_is_the_product_of_the_towers_probabilities() {
        use sparrow_core::config::{Task, TaskKind};
        let heads = Heads::of(&[
            Task { name: "click".into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 },
            Task { name: "conversion".into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 },
        ]);
        let config = ModelConfig { tower_hidden: vec![5], ..ModelConfig::default() };
        let mut ps = ParamStore::new(3, Device::Cpu);
        let arith = Arith::new(config.precision, Default::default());
        let net = MultiTask::new(Which::Esmm, &mut ps, &config, 4, &heads, (arith, Default::default())).expect("esmm");
        // Inputs large enough that a tower saturates in some rows.
        let x: Vec<f32> = (0..40).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.9).collect();
        let x = Tensor::from_vec(x, (10, 4), &Device::Cpu).expect("x");
        let values = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
        let out = values(net.forward(&x, None).expect("forward"));
        let (a, b) = (
            values(net.towers[0].forward(&x, None).expect("ctr")),
            values(net.towers[1].forward(&x, None).expect("cvr")),
        );
        let sigmoid = |x: f32| 1.0 / (1.0 + (-f64::from(x)).exp());
        for r in 0..10 {
            assert_eq!(out[2 * r], a[r], "row {r}: the CTR output is the CTR tower's");
            let (p, product) = (sigmoid(out[2 * r + 1]), sigmoid(a[r]) * sigmoid(b[r]));
            assert!((p - product).abs() <= 1e-6 * product + 1e-12, "row {r}: σ(ctcvr) {p}, pCTR·pCVR {product}");
        }
    }

    /// In a bf16 model the gates' logits are fp32's `x·W + b` ([`gates_arith`]);
    /// the experts' products take bf16 (the direct step is the graph's:
    /// `a_step_in_halves_is_the_graphs` fails when only one takes fp32).
    #[test]
    fn a_bf16_models_gates_are_fp32() {
        use sparrow_core::config::{Precision, Task, TaskKind};
        let task = |name: &str| Task { name: name.into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 };
        let heads = Heads::of(&[task("click"), task("conversion")]);
        let config = ModelConfig { precision: Precision::Bf16, ..ModelConfig::default() };
        let mut ps = ParamStore::new(3, Device::Cpu);
        let arith = Arith::new(config.precision, Default::default());
        assert!(matches!(arith, Arith::Bf16(_)));
        let net = MultiTask::new(Which::Mmoe, &mut ps, &config, 12, &heads, (arith, Default::default())).expect("mmoe");
        // Values whose bf16 rounding shows in the products.
        let x: Vec<f32> = (0..120).map(|i| ((i * 7919 % 1013) as f32 / 997.0 - 0.507) * 1.37).collect();
        let x = Tensor::from_vec(x, (10, 12), &Device::Cpu).expect("x");
        let values = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
        let gate = &net.levels[0].gates[0];
        let fp32 = x.matmul(gate.weight().as_tensor()).and_then(|p| p.broadcast_add(gate.bias().as_tensor()));
        let logits = values(net.gate(gate, &x).expect("gate"));
        assert_eq!(logits, values(fp32.expect("fp32 logits")), "a gate's logits are fp32's");
        // The bf16 product of the same operands differs: the check can fail.
        let bf16 = crate::mlp::matmul_in(arith, &x, gate.weight().as_tensor()).expect("bf16 product");
        let bf16 = values(bf16.broadcast_add(gate.bias().as_tensor()).expect("bf16 logits"));
        assert_ne!(logits, bf16, "bf16's logits");
    }
}
