//! `din` (Zhou et al. 2018, "Deep Interest Network"): a behaviour sequence
//! pooled by attention. For each history item `k` of a row, a local
//! activation unit (an MLP of `model.attention_hidden`, ending in one
//! score) reads `[q, k, q − k, q ⊙ k]`, where `q` is the row's candidate
//! item (the field whose table the sequence shares), and the sequence's
//! slot becomes Σ score(q, k)·k: a weighted sum, unnormalised, as in the
//! paper (its scores keep the intensity of the user's interest). The other
//! fields and the dense values are as the MLP sees them; an MLP of
//! `model.hidden` reads the lot.
//!
//! History items arrive unpooled and ragged (each position with the row it
//! belongs to, [`Sequences`](crate::Sequences)): nothing is padded. On
//! CPU the step is `direct.rs`'s; elsewhere candle's autograd
//! (index_select's and index_add's adjoints). Both are checked against
//! finite differences and each other.

use candle_core::{DType, Tensor};
use sparrow_core::config::{ModelConfig, Norm};
use sparrow_core::{Config, ConfigError};

use super::parts::{head, mlp_params, stack_flops, units};
use super::{At, Build, Family, Kind, Net};
use crate::ModelError;
use crate::bf16::Arith;
use crate::mlp::Mlp;
use crate::params::ParamStore;
use crate::step::ModelShape;

mod direct;
mod positions;
mod product;

pub(super) struct Din;

impl Kind for Din {
    fn name(&self) -> &'static str {
        "din"
    }

    fn about(&self) -> &'static str {
        "A behaviour sequence pooled by attention: each history item weighed against the candidate item (DIN)."
    }

    fn family(&self) -> Family {
        Family::Sequence
    }

    /// Batch norm in its MLP, as the DIN paper's and torch-rechub's DIN: the
    /// attended slot's scale moves with the attention weights, unnormalized
    /// and summed over up to `max_len` items. On the Instacart log it was
    /// worth 0.010 of validation AUC (docs/benchmarks.md, "On real logs").
    fn default_norm(&self) -> Norm {
        Norm::Batch
    }

    fn attends(&self) -> bool {
        true
    }

    fn check(&self, config: &Config) -> Result<(), ConfigError> {
        if config.sequence_fields().is_empty() {
            return Err(ConfigError::Invalid {
                key: "model.kind".into(),
                message: "\"din\" attends over a behaviour sequence: set data.schema.sequence (with data.format = \
                          \"csv\" or \"parquet\")"
                    .into(),
            });
        }
        Ok(())
    }

    fn build(&self, at: &mut Build<'_>) -> Result<Box<dyn Net>, ModelError> {
        let f = at.shape.num_fields;
        if at.pairs.is_empty() || at.pairs.iter().any(|&(s, q)| s >= f || q >= f) {
            return Err(ModelError::Sequences { expected: at.pairs.len().max(1), found: 0 });
        }
        let input = at.flat_len();
        Ok(Box::new(DinNet::new(at.ps, at.config, at.pairs, input, at.outputs(), (at.arith, at.simd))?))
    }

    /// The MLP; the attention's work is a history item's
    /// ([`step_flops_per_history_item`](Kind::step_flops_per_history_item)).
    fn step_flops_per_sample(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as f64;
        stack_flops(x, &head(&config.hidden, 1))
    }

    /// The attention unit on `[q, k, q − k, q ⊙ k]` (4·d inputs, one
    /// score), and the item's share of the weighted sum (`6·d`: forward, the
    /// score's and the item's gradients); building the features is left out.
    /// The model's nominal flops: the fp32 step computes the unit's first
    /// layer from 2·d values an item and d a row (`din/product.rs`), so
    /// its share of the ceiling counts work it did not do.
    fn step_flops_per_history_item(&self, config: &ModelConfig, shape: ModelShape) -> f64 {
        let d = shape.embedding_dim as f64;
        stack_flops(4.0 * d, &head(&config.attention_hidden, 1)) + 6.0 * d
    }

    /// The MLP and an attention unit per sequence.
    fn dense_params(&self, config: &Config, shape: ModelShape) -> u128 {
        let (m, d) = (&config.model, shape.embedding_dim as u128);
        let x = (shape.num_fields * shape.embedding_dim + shape.num_dense) as u128;
        mlp_params(x, &m.hidden) + (config.sequence_fields().len() as u128) * mlp_params(4 * d, &m.attention_hidden)
    }

    /// Each history item's unit input `[q, k, q−k, q⊙k]` and layers, 3
    /// floats a unit at each of a sequence's `max_len` items (peak memory
    /// grew by 3.48 a unit of `[h]`, `max_len` 20, batch 256).
    fn step_floats_per_row(&self, config: &Config, shape: ModelShape) -> u128 {
        let unit = 4 * shape.embedding_dim as u128 + units(&config.model.attention_hidden);
        config.sequence_fields().iter().map(|s| 3 * s.max_len as u128 * unit).sum()
    }
}

struct DinNet {
    /// (sequence slot, candidate slot) among the fields, one per sequence.
    pairs: Vec<(usize, usize)>,
    /// One local activation unit per sequence.
    units: Vec<Mlp>,
    mlp: Mlp,
    /// `train.simd`, for the passes over history items.
    simd: sparrow_core::simd::Simd,
}

impl DinNet {
    fn new(
        ps: &mut ParamStore,
        config: &ModelConfig,
        pairs: &[(usize, usize)],
        input: usize,
        outputs: usize,
        (arith, simd): (Arith, sparrow_core::simd::Simd),
    ) -> Result<DinNet, ModelError> {
        let d = config.embedding_dim;
        let score: Vec<usize> = config.attention_hidden.iter().copied().chain([1]).collect();
        let units = (0..pairs.len())
            .map(|j| {
                let style = crate::mlp::StackStyle::attention(config);
                // fp32 whatever `model.precision` says: the unit's products
                // are narrow (a few dozen columns over 2d or 4d values, a
                // product a history item) and its first one is taken from
                // its parts only in fp32 (`din/product.rs`); with the unit in
                // bf16, DIN's step was slower than in fp32 on every CPU
                // measured (1.7× this fp32 unit's time on an AMD Zen 5).
                Mlp::new_normed(ps, &format!("attention.{j}"), 4 * d, &score, false, Arith::F32(simd), style)
            })
            .collect::<Result<_, _>>()?;
        let sizes: Vec<usize> = config.hidden.iter().copied().chain([outputs]).collect();
        let mlp = Mlp::new_normed(ps, "mlp", input, &sizes, false, arith, crate::kinds::stack_style(config))?
            .with_dropout(config.dropout, simd);
        Ok(DinNet { pairs: pairs.to_vec(), units, mlp, simd })
    }
}

impl Net for DinNet {
    fn spec(&self) -> Result<crate::spec::NetSpec, ModelError> {
        Ok(crate::spec::NetSpec::Din {
            pairs: self.pairs.clone(),
            units: self.units.iter().map(Mlp::layers).collect::<Result<_, _>>()?,
            mlp: self.mlp.layers()?,
        })
    }

    fn attention(&self) -> &[(usize, usize)] {
        &self.pairs
    }

    fn direct(&self) -> Option<&dyn super::Direct> {
        Some(self)
    }

    /// Logits `[B, outputs]` from pooled fields `emb` `[B, F, D]` (a
    /// sequence's own slot is replaced), `dense` `[B, num_dense]` and each
    /// sequence's `items` `[P_j, D]` with the `rows` `[P_j]` (u32) they sit in.
    fn forward(&self, at: &At, emb: &Tensor, dense: &Tensor, items: &[(Tensor, Tensor)]) -> Result<Tensor, ModelError> {
        let (b, f, d) = emb.dims3()?;
        if items.len() != self.pairs.len() {
            return Err(ModelError::Sequences { expected: self.pairs.len(), found: items.len() });
        }
        let mut slots: Vec<Tensor> = (0..f).map(|i| emb.narrow(1, i, 1)).collect::<Result<_, _>>()?;
        for ((&(slot, query), unit), (keys, rows)) in self.pairs.iter().zip(&self.units).zip(items) {
            let pooled = if keys.dim(0)? == 0 {
                Tensor::zeros((b, 1, d), DType::F32, emb.device())?
            } else {
                let q = emb.narrow(1, query, 1)?.squeeze(1)?.contiguous()?.index_select(rows, 0)?; // [P, D]
                let features = Tensor::cat(&[&q, keys, &(&q - keys)?, &(&q * keys)?], 1)?;
                let score = unit.forward(&features, at.dropout)?; // [P, 1]
                let weighted = keys.broadcast_mul(&score)?;
                Tensor::zeros((b, d), DType::F32, emb.device())?.index_add(rows, &weighted, 0)?.unsqueeze(1)?
            };
            slots[slot] = pooled;
        }
        let slots: Vec<&Tensor> = slots.iter().collect();
        let flat = Tensor::cat(&slots, 1)?.reshape((b, f * d))?;
        let x = if dense.dim(1)? > 0 { Tensor::cat(&[&flat, dense], 1)? } else { flat };
        self.mlp.forward(&x, at.dropout)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::{ModelConfig, ModelKind};
    use sparrow_core::simd::Simd;

    use super::*;
    use crate::bf16::Bf16Path;

    /// A bf16 DIN runs its MLP in bf16 and its attention units in fp32, on
    /// every bf16 path.
    #[test]
    fn a_bf16_din_keeps_its_attention_units_in_fp32() {
        let config = ModelConfig {
            kind: ModelKind::named("din"),
            embedding_dim: 4,
            hidden: vec![8],
            attention_hidden: vec![6],
            ..Default::default()
        };
        for path in [Bf16Path::Amx, Bf16Path::Native, Bf16Path::Rounded(Simd::Auto), Bf16Path::Portable] {
            let mut ps = ParamStore::new(7, Device::Cpu);
            let arith = Arith::Bf16(path);
            let din = DinNet::new(&mut ps, &config, &[(2, 0), (3, 1)], 17, 1, (arith, Simd::Auto)).expect("din");
            assert_eq!(din.mlp.arith(), arith, "{path:?}: the MLP");
            assert!(din.units.iter().all(|u| u.arith().is_f32()), "{path:?}: the units");
        }
    }
}
