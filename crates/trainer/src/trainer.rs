//! One training step of the single-process path: first dedup + partition →
//! lookup (insert on first sight) → pool → dense forward/backward/step →
//! unpool (sum duplicate gradients) → sparse optimizer update.

use std::time::Instant;

use candle_core::Device;
use sparrow_core::batch::DataPosition;
use sparrow_core::config::{OnNonFinite, Pooling};
use sparrow_core::{Batch, Config};
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, Initializer, KeyPlan};
use sparrow_model::{DenseModel, DenseOptimizer, ModelError, ModelShape, check_finite};

use crate::TrainError;
use crate::pooling::{Bags, pool, pool_into, unpool, unpool_strided};

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
    /// Pipelined path: the last batch's sparse update, applied beside the
    /// next dense step (see [`train_overlapped`](Self::train_overlapped)).
    pending_update: Option<SparseUpdate>,
    /// SSD tier, exact path: the next batch's rows, staged by a prefetch,
    /// stay cached until its lookup.
    staged: sparrow_embedding::Staged,
    /// Batches skipped for a non-finite loss or gradient
    /// (`train.on_non_finite = "skip_batch"`), by this run.
    pub skipped_batches: u64,
    /// A failed table operation left the table between two steps.
    torn: bool,
}

/// What failed in the sparse branch beside a pipelined dense step.
enum SparseFailure {
    /// The previous batch's update (the table is then in no step's state).
    Update(sparrow_embedding::TableError),
    /// The next batch's lookup.
    Lookup(sparrow_embedding::TableError),
}

/// A batch's summed gradients, waiting to be applied to its rows.
struct SparseUpdate {
    plan: KeyPlan,
    slots: sparrow_embedding::RowSlots,
    grads: Vec<f32>,
}

/// A batch as the dense half of a step sees it: no raw keys.
pub struct DenseInputs<'a> {
    pub bags: Bags<'a>,
    /// The unique keys' embedding rows (`bags.num_unique × width`).
    pub unique_rows: &'a [f32],
    pub dense: &'a [f32],
    pub labels: &'a [f32],
}

pub struct DenseStepOut {
    pub loss: f64,
    /// Summed gradient per unique key (`num_unique × width`).
    pub grads: Vec<f32>,
    pub pooled_at: Instant,
    pub stepped_at: Instant,
}

/// Pool → dense forward/backward/optimizer step → unpool: the worker's half
/// of a step, shared by the single-process [`Trainer`] and cluster workers.
/// `packed_input` is a buffer reused across steps.
pub fn dense_step(
    model: &DenseModel,
    optimizer: &mut DenseOptimizer,
    packed_input: &mut Vec<f32>,
    inputs: DenseInputs<'_>,
    pooling: Pooling,
) -> Result<DenseStepOut, TrainError> {
    let DenseInputs { bags, unique_rows, dense, labels } = inputs;
    let width = model.width();
    let num_dense = model.shape.num_dense;
    match model.packed_row_len() {
        // The model reads [embeddings | dense] rows: pool straight into that
        // buffer and unpool straight from the input gradient.
        Some(stride) => {
            packed_input.resize(bags.rows * stride, 0.0);
            pool_into(&bags, unique_rows, width, pooling, packed_input, stride);
            let fw = bags.num_fields * width;
            for (row, d) in packed_input.chunks_exact_mut(stride).zip(dense.chunks_exact(num_dense.max(1))) {
                row[fw..].copy_from_slice(&d[..num_dense]);
            }
            let pooled_at = Instant::now();
            let (loss, _, (grads, stepped_at)) =
                model.train_step_packed(packed_input, labels, optimizer, |grad_x| {
                    let stepped_at = Instant::now();
                    (unpool_strided(&bags, grad_x, stride, width, pooling), stepped_at)
                })?;
            Ok(DenseStepOut { loss, grads, pooled_at, stepped_at })
        }
        None => {
            let pooled = pool(&bags, unique_rows, width, pooling);
            let pooled_at = Instant::now();
            let out = model.train_step(pooled, dense.to_vec(), labels, optimizer)?;
            let stepped_at = Instant::now();
            Ok(DenseStepOut {
                loss: out.loss,
                grads: unpool(&bags, &out.emb_grad, width, pooling),
                pooled_at,
                stepped_at,
            })
        }
    }
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

/// A batch's rows as looked up, with their slots for the update.
pub struct LookedUp {
    pub unique_rows: Vec<f32>,
    pub slots: sparrow_embedding::RowSlots,
}

pub struct StepStats {
    /// Samples trained (0 for a skipped batch).
    pub rows: usize,
    pub loss: f64,
    pub keys: usize,
    pub unique_keys: usize,
    /// The batch was skipped for a non-finite loss or gradient (nothing updated).
    pub skipped: bool,
}

impl StepStats {
    fn trained(batch: &Batch, plan: &KeyPlan, loss: f64) -> StepStats {
        StepStats { rows: batch.rows(), loss, keys: batch.keys.len(), unique_keys: plan.num_unique(), skipped: false }
    }
}

/// A step's dense half with its gradients checked: `Err(NonFinite)` (from
/// the model, which then updated nothing, or for the embedding gradients)
/// is named here, with the step and the embedding row at fault if any.
fn checked_step(
    step: Result<DenseStepOut, TrainError>,
    step_number: u64,
    plan: &KeyPlan,
    unique_rows: &[f32],
    width: usize,
    policy: OnNonFinite,
    torn: &mut bool,
) -> Result<DenseStepOut, TrainError> {
    let non_finite_row = |rows: &[f32]| {
        rows.chunks_exact(width.max(1))
            .position(|r| r.iter().any(|v| !v.is_finite()))
            .map(|i| format!("embedding row of key {:#018x}", plan.unique[i]))
    };
    let step = match step {
        Err(TrainError::Model(ModelError::NonFinite { what })) => {
            // The loss is where a bad input shows: name the row behind it.
            let what = match non_finite_row(unique_rows) {
                Some(row) => format!("{row} (looked up for this batch; the loss was {what})"),
                None => what,
            };
            return Err(TrainError::NonFinite { step: step_number, what });
        }
        other => other?,
    };
    // The model checked the input gradients before stepping; only summing
    // duplicates (unpool) could overflow them here, after the dense update.
    // Skipping makes that a step without its sparse update; stopping would
    // leave no step's exact state, so nothing may be saved.
    if check_finite(&step.grads, String::new).is_err() {
        *torn |= policy == OnNonFinite::Stop;
        let what = non_finite_row(&step.grads).map_or_else(String::new, |row| format!("gradient of the {row}"));
        return Err(TrainError::NonFinite { step: step_number, what });
    }
    Ok(step)
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

impl Trainer {
    pub fn new(config: &Config, layout: DataLayout) -> Result<Trainer, TrainError> {
        crate::sizes::check(config, &layout)?;
        let (emb_seed, dense_seed) = seeds(config.train.seed);
        let width = DenseModel::embedding_width(config.model.kind, config.model.embedding_dim);
        let table = EmbeddingTable::from_config(
            width,
            &config.embedding,
            Initializer::new(config.embedding.init, emb_seed),
            None,
            ttl_floor(config),
        )?;
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
            pending_update: None,
            staged: sparrow_embedding::Staged::default(),
            skipped_batches: 0,
            torn: false,
        })
    }

    /// Looks a planned batch up (inserting unseen keys): its unique rows and
    /// their slots for the update.
    pub fn look_up(&mut self, plan: &KeyPlan) -> Result<LookedUp, TrainError> {
        let mut unique_rows = vec![0.0f32; plan.num_unique() * self.table.dim()];
        let slots = self.table.lookup_or_insert(plan, &mut unique_rows).inspect_err(|_| self.note_failed_table_op())?;
        Ok(LookedUp { unique_rows, slots })
    }

    /// A lookup or prefetch failed part way. Rows it inserted hold their
    /// initial vectors, which is what a resumed run would insert, so the
    /// table is still exactly a step's — unless a feature filter counted
    /// the sightings or ages of that partial lookup.
    fn note_failed_table_op(&mut self) {
        let e = &self.config.embedding;
        if e.admit_min_count > 1 || e.ttl_steps > 0 {
            self.torn = true;
        }
    }

    /// False after a failure left the table between two steps (see
    /// [`note_failed_table_op`](Self::note_failed_table_op)): no checkpoint
    /// may be written from it.
    pub fn is_consistent(&self) -> bool {
        !self.torn
    }

    /// A step of the pipelined path (`train.pipeline_depth = d ≥ 1`): `batch`
    /// was looked up d steps earlier (`looked_up`). Beside this batch's dense
    /// step, one sparse branch applies the previous batch's update and then
    /// looks `next` (the batch d ahead) up, so `next` sees every update up to
    /// the previous batch's and misses this one's on the keys they share
    /// (stale by d, the same model on every run). This batch's update waits
    /// for the next call, or for [`flush_update`](Self::flush_update).
    /// Returns `next`'s lookup.
    pub fn train_overlapped(
        &mut self,
        batch: &Batch,
        plan: KeyPlan,
        looked_up: LookedUp,
        next: Option<&KeyPlan>,
    ) -> Result<(StepStats, Option<LookedUp>), TrainError> {
        let t1 = Instant::now();
        let previous = self.pending_update.take();
        let (model, optimizer, packed_input, table) =
            (&self.model, &mut self.dense_optimizer, &mut self.packed_input, &self.table);
        let pooling = self.config.model.pooling;
        let inputs = DenseInputs {
            bags: Bags::of(batch, &plan),
            unique_rows: &looked_up.unique_rows,
            dense: &batch.dense,
            labels: &batch.labels,
        };
        let (step, (update_secs, next_lookup)) = rayon::join(
            || dense_step(model, optimizer, packed_input, inputs, pooling),
            || {
                let t = Instant::now();
                if let Some(u) = &previous
                    && let Err(e) = table.apply_gradients_at(&u.plan, &u.slots, &u.grads)
                {
                    return (0.0, Err(SparseFailure::Update(e)));
                }
                let update_secs = t.elapsed().as_secs_f64();
                let next_lookup = next
                    .map(|p| {
                        let mut unique_rows = vec![0.0f32; p.num_unique() * table.dim()];
                        table.lookup_or_insert(p, &mut unique_rows).map(|slots| LookedUp { unique_rows, slots })
                    })
                    .transpose()
                    .map_err(SparseFailure::Lookup);
                (update_secs, next_lookup)
            },
        );
        let width = table.dim();
        let step = checked_step(
            step,
            self.step + 1,
            &plan,
            &looked_up.unique_rows,
            width,
            self.config.train.on_non_finite,
            &mut self.torn,
        );
        // The lookahead failed (a full disk under the SSD tier): this step's
        // dense update is made, so the step is completed (its sparse update
        // left pending) before the error is reported — a checkpoint then
        // holds exactly this step. A failed lookup may have counted
        // sightings or ages (feature filters): then no step's state is exact.
        let next_lookup = match next_lookup {
            Ok(next) => next,
            Err(SparseFailure::Update(e)) => {
                self.torn = true;
                return Err(e.into());
            }
            Err(SparseFailure::Lookup(e)) => {
                self.note_failed_table_op();
                if let Ok(step) = step {
                    self.step += 1;
                    self.samples_trained += batch.rows() as u64;
                    self.position = batch.end;
                    self.pending_update = Some(SparseUpdate { plan, slots: looked_up.slots, grads: step.grads });
                }
                return Err(e.into());
            }
        };
        let t4 = Instant::now();
        let p = &mut self.phase_secs;
        // The update and the lookup overlap the dense step: counted there,
        // the update also on its own.
        p.dense += (t4 - t1).as_secs_f64();
        p.update += update_secs;
        let step = match self.skip_or_stop(step, batch, &plan)? {
            Ok(step) => step,
            Err(skipped) => return Ok((skipped, next_lookup)),
        };
        self.step += 1;
        self.samples_trained += batch.rows() as u64;
        self.position = batch.end;
        let stats = StepStats::trained(batch, &plan, step.loss);
        self.pending_update = Some(SparseUpdate { plan, slots: looked_up.slots, grads: step.grads });
        Ok((stats, next_lookup))
    }

    /// `train.on_non_finite`: a non-finite step either stops the run (the
    /// error) or, with `skip_batch`, is counted and passed over: the batch is
    /// consumed (step and data position advance) and nothing is updated.
    /// `Ok(Err(stats))` is a skipped batch.
    fn skip_or_stop(
        &mut self,
        step: Result<DenseStepOut, TrainError>,
        batch: &Batch,
        plan: &KeyPlan,
    ) -> Result<Result<DenseStepOut, StepStats>, TrainError> {
        match step {
            Err(TrainError::NonFinite { step, what }) if self.config.train.on_non_finite == OnNonFinite::SkipBatch => {
                if self.skipped_batches < 5 {
                    eprintln!("warning: skipping the batch of step {step}: non-finite {what}");
                } else if self.skipped_batches == 5 {
                    eprintln!("warning: more batches skipped; the final JSON's skipped_batches counts them all");
                }
                self.skipped_batches += 1;
                self.step += 1;
                self.position = batch.end;
                Ok(Err(StepStats {
                    rows: 0,
                    loss: 0.0,
                    keys: batch.keys.len(),
                    unique_keys: plan.num_unique(),
                    skipped: true,
                }))
            }
            other => other.map(Ok),
        }
    }

    /// The first dense weight or optimizer moment that is not finite, as a
    /// [`TrainError::NonFinite`] at this step (checked once per log interval).
    pub fn check_weights(&self) -> Result<(), TrainError> {
        self.model.check_finite(&self.dense_optimizer).map_err(|e| match e {
            ModelError::NonFinite { what } => TrainError::NonFinite { step: self.step, what },
            other => other.into(),
        })
    }

    /// Applies the update [`train_overlapped`](Self::train_overlapped) left
    /// waiting: before the table is read as trained (checkpoint, evaluation).
    pub fn flush_update(&mut self) -> Result<(), TrainError> {
        if let Some(u) = self.pending_update.take() {
            let t = Instant::now();
            self.apply_update(&u.plan, &u.slots, &u.grads)?;
            self.phase_secs.update += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// A batch's sparse update; one that fails part way leaves the table in
    /// no step's state (see [`is_consistent`](Self::is_consistent)).
    fn apply_update(
        &mut self,
        plan: &KeyPlan,
        slots: &sparrow_embedding::RowSlots,
        grads: &[f32],
    ) -> Result<(), TrainError> {
        self.table.apply_gradients_at(plan, slots, grads).map_err(|e| {
            self.torn = true;
            e.into()
        })
    }

    /// Whether a batch's update is still waiting (the table is not yet the
    /// model of [`step`](Self::step) steps).
    pub fn has_pending_update(&self) -> bool {
        self.pending_update.is_some()
    }

    /// A step of the exact path whose table has an SSD tier: the rows of
    /// `next` that are not cached are brought into the cache beside this
    /// batch's dense step (S3.5), so its lookup does not wait for the store.
    /// The model is the one of [`train_planned`](Self::train_planned).
    pub fn train_prefetched(
        &mut self,
        batch: &Batch,
        plan: &KeyPlan,
        next: Option<&KeyPlan>,
    ) -> Result<StepStats, TrainError> {
        let t0 = Instant::now();
        let looked_up = self.look_up(plan)?;
        // Its staged rows are looked up: they need no more protection.
        self.staged = sparrow_embedding::Staged::default();
        let t1 = Instant::now();
        let (model, optimizer, packed_input, table) =
            (&self.model, &mut self.dense_optimizer, &mut self.packed_input, &self.table);
        let inputs = DenseInputs {
            bags: Bags::of(batch, plan),
            unique_rows: &looked_up.unique_rows,
            dense: &batch.dense,
            labels: &batch.labels,
        };
        let pooling = self.config.model.pooling;
        let (step, prefetched) = rayon::join(
            || dense_step(model, optimizer, packed_input, inputs, pooling),
            || next.map_or(Ok(sparrow_embedding::Staged::default()), |p| table.prefetch(p)),
        );
        let width = self.table.dim();
        let step = checked_step(
            step,
            self.step + 1,
            plan,
            &looked_up.unique_rows,
            width,
            self.config.train.on_non_finite,
            &mut self.torn,
        );
        match prefetched {
            Ok(staged) => self.staged = staged,
            Err(e) => {
                // As in train_overlapped: the dense update is made, so the step
                // is completed before the prefetch's error is reported.
                self.note_failed_table_op();
                if let Ok(step) = step {
                    self.apply_update(plan, &looked_up.slots, &step.grads)?;
                    self.step += 1;
                    self.samples_trained += batch.rows() as u64;
                    self.position = batch.end;
                }
                return Err(e.into());
            }
        }
        let step = match self.skip_or_stop(step, batch, plan)? {
            Ok(step) => step,
            Err(skipped) => return Ok(skipped),
        };
        let t4 = Instant::now();
        self.apply_update(plan, &looked_up.slots, &step.grads)?;
        let t5 = Instant::now();
        let p = &mut self.phase_secs;
        p.lookup += (t1 - t0).as_secs_f64();
        // The prefetch overlaps the dense step: it is counted there.
        p.dense += (t4 - t1).as_secs_f64();
        p.update += (t5 - t4).as_secs_f64();
        self.step += 1;
        self.samples_trained += batch.rows() as u64;
        self.position = batch.end;
        Ok(StepStats::trained(batch, plan, step.loss))
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
        let slots = self.table.lookup_or_insert(plan, &mut unique_rows).inspect_err(|_| self.note_failed_table_op())?;
        let t1 = Instant::now();
        let step = dense_step(
            &self.model,
            &mut self.dense_optimizer,
            &mut self.packed_input,
            DenseInputs {
                bags: Bags::of(batch, plan),
                unique_rows: &unique_rows,
                dense: &batch.dense,
                labels: &batch.labels,
            },
            self.config.model.pooling,
        );
        let step = checked_step(
            step,
            self.step + 1,
            plan,
            &unique_rows,
            width,
            self.config.train.on_non_finite,
            &mut self.torn,
        );
        let step = match self.skip_or_stop(step, batch, plan)? {
            Ok(step) => step,
            Err(skipped) => return Ok(skipped),
        };
        let (loss, grads, t2, t3) = (step.loss, step.grads, step.pooled_at, step.stepped_at);
        let t4 = Instant::now();
        self.apply_update(plan, &slots, &grads)?;
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
        Ok(StepStats::trained(batch, plan, loss))
    }

    /// Logits of a batch; the table is only read (unseen keys read as their
    /// initial vector and are not inserted).
    pub fn predict_batch(&self, batch: &Batch) -> Result<Vec<f32>, TrainError> {
        let width = self.table.dim();
        let plan = self.table.plan(&batch.keys);
        let mut unique_rows = vec![0.0f32; plan.num_unique() * width];
        self.table.lookup(&plan, &mut unique_rows)?;
        let pooled = pool(&Bags::of(batch, &plan), &unique_rows, width, self.config.model.pooling);
        Ok(self.model.predict(pooled, batch.dense.clone(), batch.rows())?)
    }
}
