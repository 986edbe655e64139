//! A model for scoring only: the embedding rows and the dense weights, with
//! the config and data layout that read its inputs. `sparrow serve`, the
//! Python `Model`, `sparrow predict` and evaluation hold one of these (or
//! score through a trainer's [`Scoring`] view between its steps); training
//! state (optimizer, step engine, data position) lives in [`Trainer`](crate::Trainer) only.
//! [`load_model`](crate::run::load_model) reads one from a checkpoint or an
//! export.

use candle_core::Device;
use sparrow_core::{Batch, Config};
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, Initializer};
use sparrow_model::{DenseModel, ModelShape};

use crate::TrainError;
use crate::pooling::{Bags, gather_sequences, pool};

/// A trained model, loaded to score rows.
pub struct Model {
    pub config: Config,
    pub layout: DataLayout,
    /// One row a key: its vector (the optimizer state beside it is unused).
    pub table: EmbeddingTable,
    pub network: DenseModel,
}

impl Model {
    /// The model `config`'s seed starts from, its rows in memory (an
    /// export's rows and weights are then applied to it).
    pub fn initial(config: &Config, layout: DataLayout) -> Result<Model, TrainError> {
        let mut config = config.clone();
        config.embedding.storage = sparrow_core::config::Storage::Memory;
        crate::sizes::check(&config, &layout)?;
        let table = model_table(&config, None)?;
        let network = initial_model(&config, &layout)?;
        Ok(Model { config, layout, table, network })
    }

    pub fn scoring(&self) -> Scoring<'_> {
        Scoring { config: &self.config, layout: &self.layout, table: &self.table, network: &self.network }
    }

    /// Logits of a batch; the table is only read (unseen keys read as their
    /// initial vector and are not inserted).
    pub fn predict_batch(&self, batch: &Batch) -> Result<Vec<f32>, TrainError> {
        self.scoring().predict_batch(batch)
    }
}

/// A model's parts, borrowed to score batches: a [`Model`]'s, or a
/// trainer's between two steps.
#[derive(Clone, Copy)]
pub struct Scoring<'a> {
    pub config: &'a Config,
    pub layout: &'a DataLayout,
    pub table: &'a EmbeddingTable,
    pub network: &'a DenseModel,
}

impl Scoring<'_> {
    /// Logits of a batch; the table is only read.
    pub fn predict_batch(&self, batch: &Batch) -> Result<Vec<f32>, TrainError> {
        let width = self.table.dim();
        let plan = self.table.plan(&batch.keys);
        let mut unique_rows = vec![0.0f32; plan.num_unique() * width];
        self.table.lookup(&plan, &mut unique_rows)?;
        let bags = Bags::of(batch, &plan);
        let pooled = pool(&bags, &unique_rows, width, self.config.model.pooling);
        let pairs = self.network.attention();
        let sequences = (!pairs.is_empty()).then(|| gather_sequences(&bags, &unique_rows, width, pairs));
        Ok(self.network.predict_with(pooled, batch.dense.clone(), batch.rows(), sequences.as_ref())?)
    }
}

/// The shortest `ttl_steps` a table counts: the lookups one trainer keeps
/// ahead of its updates (the batch in hand, `pipeline_depth` ahead of it,
/// one more being prefetched). One formula for `train` and every shard, so
/// both expire rows alike.
pub fn ttl_floor(config: &Config) -> u64 {
    config.train.pipeline_depth as u64 + 2
}

/// Seeds of the independent random streams (embedding init, dense init),
/// derived from `train.seed`. Every role that builds a part of the model uses
/// these, so a cluster and a single process start from the same model.
pub fn seeds(seed: u64) -> (u64, u64) {
    (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xe3b, seed.wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ 0xd15)
}

/// The embedding table `embedding.*` describes, built the same way by
/// `sparrow train` (`subdir` none) and by every cluster shard (its SSD tier
/// in `embedding.path/<subdir>`): the same widths, initial rows and floor.
pub fn model_table(config: &Config, subdir: Option<&str>) -> Result<EmbeddingTable, sparrow_embedding::TableError> {
    let (emb_seed, _) = seeds(config.train.seed);
    let kind = sparrow_model::kinds::configured(config).map_err(|e| {
        let message = match e {
            sparrow_core::ConfigError::Invalid { message, .. } => message,
            other => other.to_string(),
        };
        sparrow_embedding::TableError::Config { key: "model.kind", message }
    })?;
    let width = kind.embedding_width(config.model.embedding_dim);
    let init = Initializer::new(config.embedding.init, emb_seed);
    let table =
        EmbeddingTable::from_config(width, &config.embedding, init, subdir, ttl_floor(config), config.train.simd)?;
    // Incremental checkpoints and exports write the rows used since the previous one.
    let incremental = config.checkpoint.incremental
        || config.checkpoint.export_every_steps.is_some_and(|n| n > 0)
        || config.checkpoint.export_every_secs.is_some_and(|s| s > 0);
    Ok(match (config.embedding.ttl_secs > 0 || config.embedding.max_rows > 0, incremental) {
        (true, _) => table.with_deletable_rows(),
        (false, true) => table.track_last_use(),
        (false, false) => table,
    })
}

/// The dense network as the config's seed starts it: what every replica,
/// the lazy scheduler and a fresh job begin from.
pub fn initial_model(config: &Config, layout: &DataLayout) -> Result<DenseModel, TrainError> {
    let (_, dense_seed) = seeds(config.train.seed);
    let shape = ModelShape {
        num_fields: layout.num_fields,
        num_dense: layout.num_dense,
        embedding_dim: config.model.embedding_dim,
    };
    let heads = sparrow_model::Heads::of(&config.tasks());
    // The kinds' own refusals, before anything is built.
    sparrow_model::kinds::check(config)?;
    // Only a model that attends (`din`) reads the sequences' pairs.
    let attends = sparrow_model::kinds::find(&config.model.kind)?.attends();
    let pairs = if attends { config.attention_pairs() } else { Vec::new() };
    Ok(DenseModel::with_attention(&config.model, shape, heads, &pairs, dense_seed, Device::Cpu, config.train.simd)?)
}
