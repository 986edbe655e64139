//! One training step of the single-process path: first dedup + partition →
//! lookup (insert on first sight) → pool → dense forward/backward/step →
//! unpool (sum duplicate gradients) → sparse optimizer update.

use std::time::Instant;

use candle_core::Device;
use sparrow_core::batch::DataPosition;
use sparrow_core::{Batch, Config};
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, Initializer, KeyPlan, SparseOptimizer};
use sparrow_model::{DenseModel, DenseOptimizer, ModelShape};

use crate::TrainError;
use crate::pooling::{pool, pool_into, unpool, unpool_strided};

pub struct Trainer {
    pub config: Config,
    pub layout: DataLayout,
    pub table: EmbeddingTable,
    pub model: DenseModel,
    pub dense_optimizer: DenseOptimizer,
    /// Steps taken so far (across resumes).
    pub step: u64,
    /// Where the training data continues after the last trained batch.
    pub position: DataPosition,
    /// Samples trained so far (across resumes).
    pub samples_trained: u64,
    pub phase_secs: PhaseSecs,
    /// Input buffer of models that take packed rows, reused across steps.
    packed_input: Vec<f32>,
}

/// Wall time spent in each phase of the training step (this process).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PhaseSecs {
    pub lookup: f64,
    pub pool: f64,
    pub dense: f64,
    pub unpool: f64,
    pub update: f64,
}

pub struct StepStats {
    pub rows: usize,
    pub loss: f64,
    pub keys: usize,
    pub unique_keys: usize,
}

/// Seeds of the independent random streams, derived from `train.seed`.
fn seeds(seed: u64) -> (u64, u64) {
    (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xe3b, seed.wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ 0xd15)
}

impl Trainer {
    pub fn new(config: &Config, layout: DataLayout) -> Result<Trainer, TrainError> {
        let (emb_seed, dense_seed) = seeds(config.train.seed);
        let width = DenseModel::embedding_width(config.model.kind, config.model.embedding_dim);
        let table = EmbeddingTable::new(
            width,
            SparseOptimizer::from_config(&config.embedding),
            Initializer::new(config.embedding.init, emb_seed),
            config.embedding.table_shards,
        );
        let shape = ModelShape {
            num_fields: layout.num_fields,
            num_dense: layout.num_dense,
            embedding_dim: config.model.embedding_dim,
        };
        let model = DenseModel::new(&config.model, shape, dense_seed, Device::Cpu)?;
        Ok(Trainer {
            config: config.clone(),
            layout,
            table,
            model,
            dense_optimizer: DenseOptimizer::new(config.dense_optimizer.clone()),
            step: 0,
            position: DataPosition::default(),
            samples_trained: 0,
            phase_secs: PhaseSecs::default(),
            packed_input: Vec::new(),
        })
    }

    pub fn train_batch(&mut self, batch: &Batch) -> Result<StepStats, TrainError> {
        let plan = self.table.plan(&batch.keys);
        self.train_planned(batch, &plan)
    }

    /// A step with the batch's dedup + partition already done (by a pipeline
    /// stage, see `PlannedBatches`); `plan` must be this table's plan of `batch.keys`.
    pub fn train_planned(&mut self, batch: &Batch, plan: &KeyPlan) -> Result<StepStats, TrainError> {
        let width = self.table.dim();
        let t0 = Instant::now();
        let mut unique_rows = vec![0.0f32; plan.num_unique() * width];
        let slots = self.table.lookup_or_insert(plan, &mut unique_rows)?;
        let t1 = Instant::now();
        let pooling = self.config.model.pooling;
        let (loss, grads, t2, t3) = match self.model.packed_row_len() {
            // The model reads [embeddings | dense] rows: pool straight into
            // that buffer (reused across steps) and unpool straight from the
            // input gradient.
            Some(stride) => {
                let mut x = std::mem::take(&mut self.packed_input);
                x.resize(batch.rows() * stride, 0.0);
                pool_into(batch, plan, &unique_rows, width, pooling, &mut x, stride);
                let fw = batch.num_fields * width;
                for (row, dense) in x.chunks_exact_mut(stride).zip(batch.dense.chunks_exact(batch.num_dense.max(1))) {
                    row[fw..].copy_from_slice(&dense[..batch.num_dense]);
                }
                let t2 = Instant::now();
                let (loss, _, (grads, t3)) =
                    self.model.train_step_packed(&x, &batch.labels, &mut self.dense_optimizer, |grad_x| {
                        let t3 = Instant::now();
                        (unpool_strided(batch, plan, grad_x, stride, width, pooling), t3)
                    })?;
                self.packed_input = x;
                (loss, grads, t2, t3)
            }
            None => {
                let pooled = pool(batch, plan, &unique_rows, width, pooling);
                let t2 = Instant::now();
                let out =
                    self.model.train_step(pooled, batch.dense.clone(), &batch.labels, &mut self.dense_optimizer)?;
                let t3 = Instant::now();
                (out.loss, unpool(batch, plan, &out.emb_grad, width, pooling), t2, t3)
            }
        };
        let t4 = Instant::now();
        self.table.apply_gradients_at(plan, &slots, &grads);
        let t5 = Instant::now();
        let p = &mut self.phase_secs;
        p.lookup += (t1 - t0).as_secs_f64();
        p.pool += (t2 - t1).as_secs_f64();
        p.dense += (t3 - t2).as_secs_f64();
        p.unpool += (t4 - t3).as_secs_f64();
        p.update += (t5 - t4).as_secs_f64();
        self.step += 1;
        self.samples_trained += batch.rows() as u64;
        self.position = batch.end;
        Ok(StepStats { rows: batch.rows(), loss, keys: batch.keys.len(), unique_keys: plan.num_unique() })
    }

    /// Logits of a batch; the table is only read (unseen keys read as their
    /// initial vector and are not inserted).
    pub fn predict_batch(&self, batch: &Batch) -> Result<Vec<f32>, TrainError> {
        let width = self.table.dim();
        let plan = self.table.plan(&batch.keys);
        let mut unique_rows = vec![0.0f32; plan.num_unique() * width];
        self.table.lookup(&plan, &mut unique_rows);
        let pooled = pool(batch, &plan, &unique_rows, width, self.config.model.pooling);
        Ok(self.model.predict(pooled, batch.dense.clone(), batch.rows())?)
    }
}
