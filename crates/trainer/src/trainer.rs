//! The single-process trainer: the local embedding table as the step
//! engine's [`RowSource`], the dense model with the [`LocalSync`] policy, and
//! what a step counts (step number, data position, samples, non-finite
//! batches skipped).

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use std::sync::Arc;

use sparrow_core::batch::{DataPosition, StreamMark};
use sparrow_core::config::OnNonFinite;
use sparrow_core::metrics::online::ProgressiveEval;

use crate::bounds::TableBounds;
use sparrow_core::{Batch, Config};
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingTable, KeyPlan, RowSlots, Staged};
use sparrow_model::{DenseModel, DenseOptimizer, ModelError};

use crate::TrainError;
use crate::dense_sync::LocalSync;
use crate::engine::{DenseInputs, DenseStepOut, Looked, RowGrads, RowSource, StepEngine, dense_step, row_lr_scale};
use crate::inference::{Model, Scoring};
pub use crate::inference::{initial_model, model_table, seeds, ttl_floor};
use crate::pooling::Bags;

/// A batch with its keys deduplicated and partitioned for the table.
pub type PlannedBatch = (Batch, KeyPlan);

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
    /// `[data.stream]`: where the stream stands after the last trained batch.
    pub stream: Option<Arc<StreamMark>>,
    /// Samples trained so far (across resumes).
    pub samples_trained: u64,
    /// Behaviour sequences of the samples trained by this process that
    /// were cut to their `max_len`.
    pub truncated_sequences: u64,
    pub phase_secs: PhaseSecs,
    /// Batches skipped for a non-finite loss or gradient
    /// (`train.on_non_finite = "skip_batch"`), by this run.
    pub skipped_batches: u64,
    /// Progressive validation (`train.online_window_samples`): each batch's
    /// scores before its update. This run's samples only.
    pub online: Option<ProgressiveEval>,
    /// `embedding.ttl_secs` / `max_rows`: deletes rows after each step.
    pub bounds: Option<TableBounds>,
    /// `[train.early_stopping]`: the best validation figure so far.
    pub early_stopping: crate::early_stopping::StoppingState,
    engine: StepEngine<PlannedBatch, RowSlots>,
    dense_sync: LocalSync,
    /// Input buffer of models that take packed rows, reused across steps.
    packed_input: Vec<f32>,
    /// SSD tier at depth 0: the next batch's rows, staged, stay cached
    /// until its lookup.
    staged: Mutex<Staged>,
    /// A failed table operation left the table between two steps.
    torn: AtomicBool,
}

/// The local table as a [`RowSource`]: lookups insert unseen keys, updates
/// go to the slots the lookup found, and (SSD tier) the next batch's rows
/// are staged into the cache beside a dense step.
struct LocalRows<'a> {
    table: &'a EmbeddingTable,
    staged: &'a Mutex<Staged>,
    torn: &'a AtomicBool,
    /// Feature filters count sightings and ages in a lookup: one that fails
    /// part way leaves the table in no step's state.
    filtered: bool,
}

impl<'a> LocalRows<'a> {
    fn new(config: &Config, table: &'a EmbeddingTable, staged: &'a Mutex<Staged>, torn: &'a AtomicBool) -> Self {
        let filtered = config.embedding.admit_min_count > 1 || config.embedding.deletes_rows();
        LocalRows { table, staged, torn, filtered }
    }

    /// A lookup or prefetch failed part way. Rows it inserted hold their
    /// initial vectors, which is what a resumed run would insert, so the
    /// table is still exactly a step's, unless a feature filter counted
    /// the sightings or ages of that partial lookup.
    fn failed_lookup(&self, e: sparrow_embedding::TableError) -> TrainError {
        if self.filtered {
            self.torn.store(true, Ordering::Relaxed);
        }
        e.into()
    }
}

impl RowSource for LocalRows<'_> {
    type Batch = PlannedBatch;
    type Ticket = RowSlots;
    type Error = TrainError;

    fn look_up(&self, batch: PlannedBatch) -> Result<Looked<PlannedBatch, RowSlots>, TrainError> {
        let mut unique_rows = vec![0.0f32; batch.1.num_unique() * self.table.dim()];
        let slots = self.table.lookup_or_insert(&batch.1, &mut unique_rows).map_err(|e| self.failed_lookup(e))?;
        // Its staged rows are looked up: they need no more protection.
        *self.staged.lock() = Staged::default();
        Ok(Looked { batch, unique_rows, ticket: slots })
    }

    fn update(&self, batch: &PlannedBatch, slots: RowSlots, grads: RowGrads) -> Result<(), TrainError> {
        self.table.apply_gradients_scaled(&batch.1, &slots, &grads.values, grads.lr_scale).map_err(|e| {
            // Rows before the refused one were updated: no step's state.
            self.torn.store(true, Ordering::Relaxed);
            e.into()
        })
    }

    fn stages(&self) -> bool {
        self.table.is_tiered()
    }

    fn stage(&self, next: &PlannedBatch) -> Result<(), TrainError> {
        *self.staged.lock() = self.table.prefetch(&next.1).map_err(|e| self.failed_lookup(e))?;
        Ok(())
    }
}

/// Wall time spent in each phase of the training step (this process).
/// Lookups and updates that run beside the dense step (`pipeline_depth ≥ 1`,
/// SSD staging) count only where they kept it waiting (`lookup`) or in full
/// (`update`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PhaseSecs {
    pub lookup: f64,
    pub pool: f64,
    pub dense: f64,
    pub unpool: f64,
    pub update: f64,
    /// Waiting for the reader's next batch (parsing that did not keep
    /// ahead of the step): in no phase above.
    pub next_batch: f64,
}

#[derive(Default)]
pub struct StepStats {
    /// Samples trained (0 for a skipped batch).
    pub rows: usize,
    pub loss: f64,
    pub keys: usize,
    pub unique_keys: usize,
    /// The batch was skipped for a non-finite loss or gradient (nothing updated).
    pub skipped: bool,
}

/// A step [`Trainer::step`] completed.
pub struct StepReport {
    pub stats: StepStats,
    /// Work beside the step failed after it was completed (a read error of
    /// a batch ahead, a failed lookahead): the run reports it now.
    pub deferred: Option<TrainError>,
}

/// What a step learns of its batch from the dense half (the engine owns the batch).
struct BatchCounts {
    rows: usize,
    truncated_sequences: u64,
    keys: usize,
    unique_keys: usize,
    end: DataPosition,
    stream: Option<Arc<StreamMark>>,
}

/// What the dense half made of a batch.
enum DenseOutcome {
    Trained {
        loss: f64,
        timings: (f64, f64, f64),
    },
    /// Non-finite, and `train.on_non_finite = "skip_batch"`.
    Skipped {
        step: u64,
        what: String,
    },
}

/// A step's dense half with a non-finite error named: the step, and the
/// embedding row at fault if a looked-up row is not finite.
fn named_non_finite(
    step: Result<DenseStepOut, TrainError>,
    step_number: u64,
    plan: &KeyPlan,
    unique_rows: &[f32],
    width: usize,
) -> Result<DenseStepOut, TrainError> {
    match step {
        Err(TrainError::Model(ModelError::NonFinite { what })) => {
            // The loss is where a bad input shows: name the row behind it.
            let row = unique_rows
                .chunks_exact(width.max(1))
                .position(|r| r.iter().any(|v| !v.is_finite()))
                .map(|i| format!("embedding row of key {:#018x}", plan.unique[i]));
            let what = match row {
                Some(row) => format!("{row} (looked up for this batch; the loss was {what})"),
                None => what,
            };
            Err(TrainError::NonFinite { step: step_number, what })
        }
        other => other,
    }
}

impl From<Trainer> for Model {
    /// The trainer's rows and weights; its optimizer and engine are dropped.
    fn from(trainer: Trainer) -> Model {
        Model { config: trainer.config, layout: trainer.layout, table: trainer.table, network: trainer.model }
    }
}

impl Trainer {
    pub fn new(config: &Config, layout: DataLayout) -> Result<Trainer, TrainError> {
        crate::sizes::check(config, &layout)?;
        let table = model_table(config, None)?;
        let model = initial_model(config, &layout)?;
        Ok(Trainer {
            config: config.clone(),
            layout,
            table,
            model,
            dense_optimizer: DenseOptimizer::new(config.dense_optimizer.clone(), config.train.simd)
                .with_schedule(config.train.schedule.clone()),
            step: 0,
            position: DataPosition::default(),
            stream: None,
            samples_trained: 0,
            truncated_sequences: 0,
            phase_secs: PhaseSecs::default(),
            skipped_batches: 0,
            early_stopping: Default::default(),
            online: config.online_window().map(ProgressiveEval::new),
            bounds: TableBounds::new(&config.embedding),
            engine: StepEngine::new(config.train.pipeline_depth),
            dense_sync: LocalSync,
            packed_input: Vec::new(),
            staged: Mutex::new(Staged::default()),
            torn: AtomicBool::new(false),
        })
    }

    /// False after a failure left the table between two steps (a failed
    /// lookup that counted feature-filter sightings, an update refused part
    /// way): no checkpoint may be written from it.
    pub fn is_consistent(&self) -> bool {
        !self.torn.load(Ordering::Relaxed)
    }

    /// One step of the step engine on the next batch `next(taken)` gives
    /// (see [`StepEngine::step`]); `None` once the data is used up. The
    /// compute pool's other threads are held awake through it
    /// (`sparrow_model::awake::through_step`), so its parallel sections
    /// (lookup, the dense step, the update) do not each start by waking
    /// a sleeping thread.
    pub fn step(
        &mut self,
        next: &mut dyn FnMut(usize) -> Option<Result<PlannedBatch, TrainError>>,
    ) -> Result<Option<StepReport>, TrainError> {
        sparrow_model::awake::through_step(|| self.step_held(next))
    }

    /// [`step`](Self::step)'s work.
    fn step_held(
        &mut self,
        next: &mut dyn FnMut(usize) -> Option<Result<PlannedBatch, TrainError>>,
    ) -> Result<Option<StepReport>, TrainError> {
        let Trainer {
            config,
            table,
            model,
            dense_optimizer,
            engine,
            dense_sync,
            packed_input,
            staged,
            torn,
            online,
            ..
        } = self;
        let rows = LocalRows::new(config, table, staged, torn);
        let (pooling, policy, step_number, width) =
            (config.model.pooling, config.train.on_non_finite, self.step + 1, table.dim());
        let stepped = engine.step(&rows, next, |looked: &Looked<PlannedBatch, RowSlots>| {
            let (batch, plan) = &looked.batch;
            let counts = BatchCounts {
                rows: batch.rows(),
                truncated_sequences: batch.truncated_sequences,
                keys: batch.keys.len(),
                unique_keys: plan.num_unique(),
                end: batch.end,
                stream: batch.stream.clone(),
            };
            // The step's rate factor, before the step counts itself.
            let lr_scale = row_lr_scale(&config.train.schedule, dense_optimizer.lr_factor());
            let inputs = DenseInputs {
                bags: Bags::of(batch, plan),
                unique_rows: &looked.unique_rows,
                dense: &batch.dense,
                labels: &batch.labels,
                weights: batch.sample_weights.as_deref(),
                row_l2: config.embedding.l2,
                dropout: crate::engine::dropout_draw(crate::engine::dropout_base(config), dense_optimizer.step, 0),
            };
            let out = dense_step(model, dense_optimizer, dense_sync, packed_input, inputs, pooling);
            match named_non_finite(out, step_number, plan, &looked.unique_rows, width) {
                Ok(out) => {
                    if let Some(online) = online.as_mut() {
                        model.heads().with_first_binary(&out.logits, &batch.labels, |x, y| online.add(x, y));
                    }
                    let timings = (out.pool_secs, out.model_secs, out.unpool_secs);
                    Ok((
                        (counts, DenseOutcome::Trained { loss: out.loss, timings }),
                        Some(RowGrads { values: out.grads, lr_scale }),
                    ))
                }
                Err(TrainError::NonFinite { step, what }) if policy == OnNonFinite::SkipBatch => {
                    Ok(((counts, DenseOutcome::Skipped { step, what }), None))
                }
                Err(e) => Err(e),
            }
        })?;
        let Some(stepped) = stepped else {
            self.phase_secs.next_batch += self.engine.take_end_wait();
            return Ok(None);
        };
        let (counts, outcome) = stepped.out;
        let p = &mut self.phase_secs;
        p.lookup += stepped.lookup_secs;
        p.next_batch += stepped.next_batch_secs;
        p.update += stepped.update_secs;
        let stats = match outcome {
            DenseOutcome::Trained { loss, timings: (pool, dense, unpool) } => {
                p.pool += pool;
                p.dense += dense;
                p.unpool += unpool;
                self.samples_trained += counts.rows as u64;
                self.truncated_sequences += counts.truncated_sequences;
                StepStats {
                    rows: counts.rows,
                    loss,
                    keys: counts.keys,
                    unique_keys: counts.unique_keys,
                    skipped: false,
                }
            }
            DenseOutcome::Skipped { step, what } => {
                if self.skipped_batches < 5 {
                    tracing::warn!("warning: skipping the batch of step {step}: non-finite {what}");
                } else if self.skipped_batches == 5 {
                    tracing::warn!("warning: more batches skipped; the final JSON's skipped_batches counts them all");
                }
                self.skipped_batches += 1;
                StepStats { rows: 0, loss: 0.0, keys: counts.keys, unique_keys: counts.unique_keys, skipped: true }
            }
        };
        self.step += 1;
        self.position = counts.end;
        if counts.stream.is_some() {
            self.stream = counts.stream;
        }
        if let Some(bounds) = self.bounds.as_mut() {
            let newest = self.stream.as_ref().and_then(|m| m.newest_record_ms);
            if let Err(e) = bounds.after_step(&self.table, newest) {
                // Some shards may have deleted and others not.
                self.torn.store(true, Ordering::Relaxed);
                return Err(e.into());
            }
        }
        Ok(Some(StepReport { stats, deferred: stepped.deferred }))
    }

    /// One step on `batch` (planned here), at the configured depth: a
    /// convenience for benchmarks and tests that hold their batches. The
    /// batch is planned and taken as the step's first work, as a training
    /// run takes its next batch from the loader: the pool's other threads
    /// are held through it, not left to fall asleep and be woken at the
    /// step's first parallel section.
    pub fn train_batch(&mut self, batch: &Batch) -> Result<StepStats, TrainError> {
        let partitioner = self.table.partitioner();
        let mut one = Some(batch);
        match self.step(&mut |_| one.take().map(|b| Ok((b.clone(), partitioner.plan(&b.keys)))))? {
            Some(StepReport { deferred: Some(e), .. }) => Err(e),
            Some(StepReport { stats, deferred: None }) => Ok(stats),
            None => Ok(StepStats::default()),
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

    /// Applies the update the engine left waiting (`pipeline_depth ≥ 1`):
    /// before the table is read as trained (checkpoint, evaluation).
    pub fn flush_update(&mut self) -> Result<(), TrainError> {
        let rows = LocalRows::new(&self.config, &self.table, &self.staged, &self.torn);
        self.phase_secs.update += self.engine.flush(&rows)?;
        Ok(())
    }

    /// Whether a batch's update is still waiting (the table is not yet the
    /// model of [`step`](Self::step) steps).
    pub fn has_pending_update(&self) -> bool {
        self.engine.has_pending()
    }

    /// Logits of a batch; the table is only read (unseen keys read as their
    /// initial vector and are not inserted).
    pub fn predict_batch(&self, batch: &Batch) -> Result<Vec<f32>, TrainError> {
        self.scoring().predict_batch(batch)
    }

    /// The model as it stands, borrowed to score batches.
    pub fn scoring(&self) -> Scoring<'_> {
        Scoring { config: &self.config, layout: &self.layout, table: &self.table, network: &self.model }
    }
}
