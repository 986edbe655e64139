//! The step engine: the one loop every training step runs through, in
//! `sparrow train` and in a cluster worker alike.
//!
//! A step looks a batch's rows up from a [`RowSource`] (the local table, or
//! the remote shards), runs the dense half (pool → forward/backward → dense
//! sync → optimizer → unpool, [`dense_step`]), and hands the summed
//! gradients of the batch's unique keys back to the source. With a lookahead
//! of depth d (`train.pipeline_depth`):
//!
//! - **d = 0 (exact):** lookup, dense step, update, one after another. A
//!   source that stages rows ([`RowSource::stages`], the SSD tier) readies
//!   the next batch's rows beside the dense step, touching only rows this
//!   batch does not use, so the model is the same.
//! - **d ≥ 1:** the next d batches are already looked up. Beside batch t's
//!   dense step, one branch applies batch t−1's update and then looks batch
//!   t+d up, so batch t+d misses the updates of batches t … t+d−1 on the keys
//!   they share: stale by d, in the same order on every run, so the same
//!   model on every run. Batch t's update waits for the next step (or
//!   [`StepEngine::flush`]).
//!
//! Work beside a dense step that fails after the dense update was made does
//! not undo the step: the engine completes it (its update applied or left
//! pending) and returns the error in [`Stepped::deferred`], so a checkpoint
//! taken then holds exactly that step.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sparrow_core::config::Pooling;
use sparrow_model::{DenseModel, DenseOptimizer, ModelError};

use crate::TrainError;
use crate::dense_sync::DenseSync;
use crate::pooling::{Bags, gather_sequences, pool, pool_into, scatter_item_grads, unpool, unpool_rows};

/// Where a step's embedding rows come from and where its gradients go.
pub trait RowSource: Sync {
    type Batch: Send + Sync;
    /// What the update of a looked-up batch needs beside the batch (the
    /// rows' slots; nothing for remote shards, which keep that themselves).
    type Ticket: Send + Sync;
    type Error: From<TrainError> + Send;

    /// A training lookup: the batch's unique rows (`num_unique × width`),
    /// unseen keys inserted.
    fn look_up(&self, batch: Self::Batch) -> Result<Looked<Self::Batch, Self::Ticket>, Self::Error>;

    /// Applies a looked-up batch's summed gradients (per unique key, in the
    /// lookup's order) at the rows' learning rate times `grads.lr_scale`.
    fn update(&self, batch: &Self::Batch, ticket: Self::Ticket, grads: RowGrads) -> Result<(), Self::Error>;

    /// Lets go of a looked-up batch whose update was skipped (its dense half
    /// was not finite and `train.on_non_finite = "skip_batch"`): nothing is
    /// updated; a source that holds the batch for its update (remote
    /// shards) forgets it.
    fn release(&self, _batch: &Self::Batch, _ticket: Self::Ticket) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Whether [`stage`](Self::stage) does anything: then, at depth 0, the
    /// engine takes the next batch one step early.
    fn stages(&self) -> bool {
        false
    }

    /// At depth 0, beside a batch's dense step: readies `next`'s rows
    /// without changing the model (S3.5).
    fn stage(&self, _next: &Self::Batch) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Whether lookups and updates block on something other than the
    /// compute pool (the network): then they run on a thread of their own
    /// instead of the pool the dense step uses.
    fn blocks(&self) -> bool {
        false
    }
}

/// A batch with its rows looked up.
pub struct Looked<B, T> {
    pub batch: B,
    pub unique_rows: Vec<f32>,
    pub ticket: T,
}

/// A step the engine completed.
pub struct Stepped<R, E> {
    /// What the dense half returned.
    pub out: R,
    /// Seconds waited for lookups outside the dense step's shadow (d = 0:
    /// the lookup; d ≥ 1: start-up, and the branch outlasting the dense step).
    pub lookup_secs: f64,
    /// Seconds waited for the driver's next batches (`next`): a reader or
    /// a loader that did not keep ahead. Counted in no other span.
    pub next_batch_secs: f64,
    /// Seconds of the dense half.
    pub dense_secs: f64,
    /// Seconds of updates (beside the dense step at d ≥ 1).
    pub update_secs: f64,
    /// The work beside the dense step failed after the step was completed:
    /// report it once the step is counted.
    pub deferred: Option<E>,
}

/// The dense half's verdict on a batch: its result for the driver, and the
/// gradients to hand back to the source (`None`: the batch was skipped and
/// nothing is updated).
pub type DenseVerdict<R> = (R, Option<RowGrads>);

/// A batch's gradients for its rows: the summed gradient per unique key and
/// the factor on the rows' learning rate of the step that made them
/// (`[train.schedule]`; 1 without one), which travels with them to the
/// table or the shards however late the update runs.
#[derive(Clone, Debug, PartialEq)]
pub struct RowGrads {
    pub values: Vec<f32>,
    pub lr_scale: f32,
}

impl RowGrads {
    /// Gradients at the configured rate.
    pub fn at_full_rate(values: Vec<f32>) -> RowGrads {
        RowGrads { values, lr_scale: 1.0 }
    }
}

/// The embedding rows' factor for a step whose dense factor is `dense`:
/// the same where `train.schedule.embedding`, else 1.
pub fn row_lr_scale(schedule: &sparrow_core::config::ScheduleConfig, dense: f64) -> f32 {
    if schedule.embedding { dense as f32 } else { 1.0 }
}

/// A batch's update, waiting for the next step (d ≥ 1).
struct Pending<B, T> {
    batch: B,
    ticket: T,
    grads: RowGrads,
}

/// The lookahead state between steps, for batches of type `B` whose update
/// needs a `T` (the [`RowSource`] is given to each call, so a view of a
/// table the caller owns can serve).
pub struct StepEngine<B, T> {
    depth: usize,
    ahead: VecDeque<Looked<B, T>>,
    pending: Option<Pending<B, T>>,
    /// d = 0 with staging: the next batch, its rows staged.
    staged: Option<B>,
    /// Waited for batches by steps that found none left (the data's end):
    /// no `Stepped` reports it ([`take_end_wait`](Self::take_end_wait)).
    end_wait: Duration,
}

/// `next(taken)`, the time it took added to `waited`.
fn timed<T>(next: &mut dyn FnMut(usize) -> Option<T>, taken: usize, waited: &mut Duration) -> Option<T> {
    let t = Instant::now();
    let batch = next(taken);
    *waited += t.elapsed();
    batch
}

/// Runs `dense` on this thread and `side` beside it: on the compute pool
/// (`rayon::join`), or on a thread of its own when `side` blocks.
fn beside<A: Send, B: Send>(blocks: bool, dense: impl FnOnce() -> A + Send, side: impl FnOnce() -> B + Send) -> (A, B) {
    if blocks {
        std::thread::scope(|scope| {
            let side = scope.spawn(side);
            let a = dense();
            (a, side.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
        })
    } else {
        rayon::join(dense, side)
    }
}

impl<B: Send + Sync, T: Send + Sync> StepEngine<B, T> {
    pub fn new(depth: usize) -> Self {
        StepEngine {
            depth,
            ahead: VecDeque::with_capacity(depth),
            pending: None,
            staged: None,
            end_wait: Duration::ZERO,
        }
    }

    /// Seconds waited for batches by the steps that found none (the wait
    /// for the data's end, a `next_batch` no step reported), since the last call.
    pub fn take_end_wait(&mut self) -> f64 {
        std::mem::take(&mut self.end_wait).as_secs_f64()
    }

    /// Whether a batch's update is still waiting (d ≥ 1).
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Applies the update left waiting: before the rows are read as trained
    /// (checkpoint, evaluation) or at the end.
    pub fn flush<S: RowSource<Batch = B, Ticket = T>>(&mut self, source: &S) -> Result<f64, S::Error> {
        let t = Instant::now();
        if let Some(p) = self.pending.take() {
            source.update(&p.batch, p.ticket, p.grads)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// One step. `next(taken)` gives the driver's next batch, `taken` being
    /// the batches already taken and not yet trained (so that no lookahead
    /// goes past a step limit); `None` ends the data. `dense` runs the dense
    /// half of the batch in hand. Returns `None` once no batch is left.
    pub fn step<S: RowSource<Batch = B, Ticket = T>, R: Send>(
        &mut self,
        source: &S,
        next: &mut dyn FnMut(usize) -> Option<Result<S::Batch, S::Error>>,
        dense: impl FnOnce(&Looked<S::Batch, S::Ticket>) -> Result<DenseVerdict<R>, S::Error> + Send,
    ) -> Result<Option<Stepped<R, S::Error>>, S::Error> {
        if self.depth == 0 { self.step_exact(source, next, dense) } else { self.step_ahead(source, next, dense) }
    }

    fn step_exact<S: RowSource<Batch = B, Ticket = T>, R: Send>(
        &mut self,
        source: &S,
        next: &mut dyn FnMut(usize) -> Option<Result<S::Batch, S::Error>>,
        dense: impl FnOnce(&Looked<S::Batch, S::Ticket>) -> Result<DenseVerdict<R>, S::Error> + Send,
    ) -> Result<Option<Stepped<R, S::Error>>, S::Error> {
        let mut waited = Duration::ZERO;
        let batch = match self.staged.take() {
            Some(batch) => batch,
            None => match timed(next, 0, &mut waited) {
                Some(batch) => batch?,
                None => {
                    self.end_wait += waited;
                    return Ok(None);
                }
            },
        };
        let t0 = Instant::now();
        let looked = source.look_up(batch)?;
        let t1 = Instant::now();
        let mut deferred = None;
        let waited_before = waited;
        let (verdict, staged) = if source.stages() {
            // A read error of the next batch is reported after this one trains.
            let upcoming = match timed(next, 1, &mut waited) {
                Some(Ok(b)) => Some(b),
                Some(Err(e)) => {
                    deferred = Some(e);
                    None
                }
                None => None,
            };
            let looked = &looked;
            let (verdict, staged) = beside(
                source.blocks(),
                move || dense(looked),
                || upcoming.map(|b| source.stage(&b).map(|()| b)).transpose(),
            );
            (verdict, Some(staged))
        } else {
            (dense(&looked), None)
        };
        let t2 = Instant::now();
        match staged {
            Some(Ok(staged)) => self.staged = staged,
            // The dense update is made: the step is completed first.
            Some(Err(e)) => deferred = Some(e),
            None => {}
        }
        let (out, grads) = verdict?;
        match grads {
            Some(grads) => source.update(&looked.batch, looked.ticket, grads)?,
            None => source.release(&looked.batch, looked.ticket)?,
        }
        let update_secs = t2.elapsed().as_secs_f64();
        Ok(Some(Stepped {
            out,
            lookup_secs: (t1 - t0).as_secs_f64(),
            next_batch_secs: waited.as_secs_f64(),
            // The next batch, taken before its staging beside the dense
            // step, counts as `next_batch_secs` alone.
            dense_secs: (t2 - t1).saturating_sub(waited - waited_before).as_secs_f64(),
            update_secs,
            deferred,
        }))
    }

    fn step_ahead<S: RowSource<Batch = B, Ticket = T>, R: Send>(
        &mut self,
        source: &S,
        next: &mut dyn FnMut(usize) -> Option<Result<S::Batch, S::Error>>,
        dense: impl FnOnce(&Looked<S::Batch, S::Ticket>) -> Result<DenseVerdict<R>, S::Error> + Send,
    ) -> Result<Option<Stepped<R, S::Error>>, S::Error> {
        let t0 = Instant::now();
        let mut taking = Duration::ZERO;
        // Start-up: the first d batches are looked up one after another.
        while self.ahead.len() < self.depth {
            match timed(next, self.ahead.len(), &mut taking) {
                Some(batch) => self.ahead.push_back(source.look_up(batch?)?),
                None => break,
            }
        }
        let Some(looked) = self.ahead.pop_front() else {
            self.end_wait += taking;
            return Ok(None);
        };
        let mut deferred = None;
        let upcoming = match timed(next, 1 + self.ahead.len(), &mut taking) {
            Some(Ok(b)) => Some(b),
            // A read error of the batch d ahead: reported after this one trains.
            Some(Err(e)) => {
                deferred = Some(e);
                None
            }
            None => None,
        };
        let previous = self.pending.take();
        let t1 = Instant::now();
        let looked_ref = &looked;
        let (verdict, (branch, update_secs, branch_done)) = beside(
            source.blocks(),
            move || {
                let verdict = dense(looked_ref);
                (verdict, Instant::now())
            },
            || {
                let t = Instant::now();
                if let Some(p) = previous
                    && let Err(e) = source.update(&p.batch, p.ticket, p.grads)
                {
                    return (Err(BranchError::Update(e)), t.elapsed().as_secs_f64(), Instant::now());
                }
                let update_secs = t.elapsed().as_secs_f64();
                let next_looked = upcoming.map(|b| source.look_up(b)).transpose().map_err(BranchError::Lookup);
                (next_looked, update_secs, Instant::now())
            },
        );
        let (verdict, dense_done) = verdict;
        let waited = branch_done.saturating_duration_since(dense_done);
        match branch {
            Ok(Some(next_looked)) => self.ahead.push_back(next_looked),
            Ok(None) => {}
            // The previous batch's update failed part way: nothing to complete.
            Err(BranchError::Update(e)) => return Err(e),
            // The dense update is made: the step is completed (its update
            // left pending) before the lookup's error is reported.
            Err(BranchError::Lookup(e)) => {
                self.ahead.clear();
                deferred = Some(e);
            }
        }
        let (out, grads) = verdict?;
        match grads {
            Some(grads) => self.pending = Some(Pending { batch: looked.batch, ticket: looked.ticket, grads }),
            None => source.release(&looked.batch, looked.ticket)?,
        }
        Ok(Some(Stepped {
            out,
            // The batches taken between t0 and t1 count as `next_batch_secs` alone.
            lookup_secs: ((t1 - t0).saturating_sub(taking) + waited).as_secs_f64(),
            next_batch_secs: taking.as_secs_f64(),
            dense_secs: (dense_done - t1).as_secs_f64(),
            update_secs,
            deferred,
        }))
    }
}

enum BranchError<E> {
    Update(E),
    Lookup(E),
}

/// A batch as the dense half of a step sees it: no raw keys.
pub struct DenseInputs<'a> {
    pub bags: Bags<'a>,
    /// The unique keys' embedding rows (`bags.num_unique × width`).
    pub unique_rows: &'a [f32],
    pub dense: &'a [f32],
    pub labels: &'a [f32],
    /// Each sample's weight in the loss (`[data.weighting]`); `None`: all 1.
    pub weights: Option<&'a [f32]>,
    /// `embedding.l2`: `row_l2 · w` joins each unique row's gradient.
    pub row_l2: f32,
    /// `model.dropout`: the step's draw ([`dropout_draw`]); `None`: off.
    pub dropout: Option<u64>,
}

/// `model.dropout`'s draw for the whole job (`None`: off), from its seed.
pub fn dropout_base(config: &sparrow_core::Config) -> Option<u64> {
    (config.model.dropout > 0.0).then(|| sparrow_core::key::mix64(config.train.seed ^ 0x0064_726f_706f_7574))
}

/// The dropout draw of the dense step after `steps_taken` steps of worker
/// `worker` (0 in `sparrow train`): the same step of the same job draws
/// the same masks, resumed or not, and a one-worker cluster draws
/// `train`'s; other workers draw other masks.
pub fn dropout_draw(base: Option<u64>, steps_taken: u64, worker: usize) -> Option<u64> {
    use sparrow_core::key::mix64;
    base.map(|b| mix64(b ^ steps_taken.wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ mix64(worker as u64))
}

pub struct DenseStepOut {
    pub loss: f64,
    /// The batch's scores from the forward pass, before this step's update
    /// (progressive validation reads them).
    pub logits: Vec<f32>,
    /// Summed gradient per unique key (`num_unique × width`).
    pub grads: Vec<f32>,
    /// Seconds pooling, in the model (forward, backward, sync, optimizer)
    /// and unpooling.
    pub pool_secs: f64,
    pub model_secs: f64,
    pub unpool_secs: f64,
}

/// The dense half of a step: pool → forward/backward → `sync` → dense
/// optimizer → unpool. The one place where a replica's dense weights move.
/// `packed_input` is a buffer reused across steps. Its two parts are
/// [`dense_grads`] (this replica alone) and [`dense_apply`] (the sync).
pub fn dense_step(
    model: &DenseModel,
    optimizer: &mut DenseOptimizer,
    sync: &mut dyn DenseSync,
    packed_input: &mut Vec<f32>,
    inputs: DenseInputs<'_>,
    pooling: Pooling,
) -> Result<DenseStepOut, TrainError> {
    let half = dense_grads(model, packed_input, inputs, pooling)?;
    dense_apply(model, optimizer, sync, half)
}

/// A batch's gradients before the sync: what [`dense_grads`] made.
pub struct DenseHalf {
    pub loss: f64,
    pub logits: Vec<f32>,
    /// Summed gradient per unique key (`num_unique × width`).
    pub grads: Vec<f32>,
    /// The dense parameters' gradients, this replica's alone.
    pub dense_grads: sparrow_model::DenseGrads,
    started: Instant,
    pooled_at: Instant,
    unpooled: std::time::Duration,
}

/// Pool → forward/backward → unpool: this replica's gradients of a batch.
/// Nothing moves and no other replica is met, so a non-finite batch
/// refused here (`TrainError::Model(NonFinite)`) can still be skipped
/// whole.
pub fn dense_grads(
    model: &DenseModel,
    packed_input: &mut Vec<f32>,
    inputs: DenseInputs<'_>,
    pooling: Pooling,
) -> Result<DenseHalf, TrainError> {
    let DenseInputs { bags, unique_rows, dense, labels, weights, row_l2, dropout } = inputs;
    let width = model.width();
    let num_dense = model.shape.num_dense;
    let started = Instant::now();
    let (loss, logits, grads, dense_grads, pooled_at, unpooled) = match model.packed_row_len() {
        // The model reads [embeddings | dense] rows: pool straight into that
        // buffer and unpool straight from the input gradient.
        Some(stride) => {
            packed_input.resize(bags.rows * stride, 0.0);
            if dense.len() != bags.rows * num_dense {
                let (len, rows, per_row) = (dense.len(), bags.rows, num_dense);
                return Err(TrainError::Model(ModelError::BadInput { what: "dense features", len, rows, per_row }));
            }
            pool_into(&bags, unique_rows, width, pooling, (packed_input, stride), Some(dense));
            // A model that attends (`din`) reads its sequences' items unpooled.
            let pairs = model.attention();
            let sequences = (!pairs.is_empty()).then(|| gather_sequences(&bags, unique_rows, width, pairs));
            let pooled_at = Instant::now();
            let (loss, logits, (grads, unpool_secs), dense_grads) = model.forward_backward_packed_with(
                packed_input,
                labels,
                weights,
                sequences,
                dropout,
                |grad_x, items| {
                    let t = Instant::now();
                    let mut grads = unpool_rows(&bags, grad_x.rows(stride), width, pooling);
                    scatter_item_grads(&bags, items, width, pairs, &mut grads);
                    (grads, t.elapsed())
                },
            )?;
            (loss, logits, grads, dense_grads, pooled_at, unpool_secs)
        }
        None => {
            let pooled = pool(&bags, unique_rows, width, pooling);
            // A model that attends (`din`) reads its sequences' items unpooled.
            let pairs = model.attention();
            let sequences = (!pairs.is_empty()).then(|| gather_sequences(&bags, unique_rows, width, pairs));
            let pooled_at = Instant::now();
            let (out, dense_grads) =
                model.forward_backward_with(pooled, dense.to_vec(), labels, weights, sequences.as_ref(), dropout)?;
            let t = Instant::now();
            let mut grads = unpool(&bags, &out.emb_grad, width, pooling);
            scatter_item_grads(&bags, &out.item_grads, width, pairs, &mut grads);
            (out.loss, out.logits, grads, dense_grads, pooled_at, t.elapsed())
        }
    };
    let mut grads = grads;
    add_row_l2(&mut grads, unique_rows, row_l2);
    Ok(DenseHalf { loss, logits, grads, dense_grads, started, pooled_at, unpooled })
}

/// `embedding.l2`: the gradient of `l2/2 · ‖w‖²` at the values the batch
/// read, `l2 · w`, added once to each unique row's gradient (so a row seen
/// in many samples is not decayed more). The loss reported leaves it out,
/// as the libraries' `loss` does.
fn add_row_l2(grads: &mut [f32], unique_rows: &[f32], l2: f32) {
    if l2 == 0.0 {
        return;
    }
    grads.iter_mut().zip(unique_rows).for_each(|(g, &w)| *g += l2 * w);
}

/// `sync` → dense optimizer: the replicas' gradients combined and applied.
pub fn dense_apply(
    model: &DenseModel,
    optimizer: &mut DenseOptimizer,
    sync: &mut dyn DenseSync,
    half: DenseHalf,
) -> Result<DenseStepOut, TrainError> {
    let DenseHalf { loss, logits, grads, dense_grads, started, pooled_at, unpooled } = half;
    if let Some(combined) = sync.combine(&model.params, dense_grads)? {
        model.recycle(optimizer.apply(&model.params, combined)?);
    }
    let total = started.elapsed();
    let pooling = pooled_at - started;
    Ok(DenseStepOut {
        loss,
        logits,
        grads,
        pool_secs: pooling.as_secs_f64(),
        model_secs: total.saturating_sub(pooling).saturating_sub(unpooled).as_secs_f64(),
        unpool_secs: unpooled.as_secs_f64(),
    })
}

/// A replica without a batch left still joins the dense sync's rounds (so
/// the others are not kept waiting) and applies the same step. Returns
/// false, changing nothing, when no replica had a batch.
pub fn idle_step(
    model: &DenseModel,
    optimizer: &mut DenseOptimizer,
    sync: &mut dyn DenseSync,
) -> Result<bool, TrainError> {
    match sync.combine(&model.params, sparrow_model::DenseGrads::idle(&model.params))? {
        Some(combined) => {
            optimizer.apply(&model.params, combined)?;
            Ok(true)
        }
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-row "table" that logs what the engine asks of it: a lookup
    /// reads the number of updates applied so far.
    #[derive(Default)]
    struct Counter {
        updates: parking_lot::Mutex<u32>,
        log: parking_lot::Mutex<Vec<String>>,
        fail_lookup_of: Option<u32>,
        stages: bool,
    }

    impl RowSource for Counter {
        type Batch = u32;
        type Ticket = ();
        type Error = TrainError;

        fn look_up(&self, batch: u32) -> Result<Looked<u32, ()>, TrainError> {
            if self.fail_lookup_of == Some(batch) {
                return Err(TrainError::Interrupted { step: u64::from(batch) });
            }
            self.log.lock().push(format!("L{batch}"));
            Ok(Looked { batch, unique_rows: vec![*self.updates.lock() as f32], ticket: () })
        }

        fn update(&self, batch: &u32, _: (), _: RowGrads) -> Result<(), TrainError> {
            self.log.lock().push(format!("U{batch}"));
            *self.updates.lock() += 1;
            Ok(())
        }

        fn stages(&self) -> bool {
            self.stages
        }

        fn stage(&self, next: &u32) -> Result<(), TrainError> {
            self.log.lock().push(format!("S{next}"));
            Ok(())
        }
    }

    /// Runs batches 1..=n at `depth` (no more than `limit` steps); returns
    /// the updates each batch saw at its lookup.
    fn run(source: &Counter, depth: usize, n: u32, limit: u64) -> Vec<(u32, u32)> {
        let mut engine = StepEngine::new(depth);
        let (mut fed, mut steps, mut seen) = (0u32, 0u64, Vec::new());
        loop {
            let mut next = |taken: usize| {
                if steps + taken as u64 >= limit || fed == n {
                    return None;
                }
                fed += 1;
                Some(Ok(fed))
            };
            let stepped = engine
                .step(source, &mut next, |looked: &Looked<u32, ()>| {
                    Ok(((looked.batch, looked.unique_rows[0] as u32), Some(RowGrads::at_full_rate(vec![1.0]))))
                })
                .expect("step");
            let Some(stepped) = stepped else { break };
            assert!(stepped.deferred.is_none());
            seen.push(stepped.out);
            steps += 1;
        }
        engine.flush(source).expect("flush");
        seen
    }

    #[test]
    fn depth_0_looks_up_trains_and_updates_in_turn() {
        let source = Counter::default();
        assert_eq!(run(&source, 0, 3, 100), vec![(1, 0), (2, 1), (3, 2)]);
        assert_eq!(*source.log.lock(), ["L1", "U1", "L2", "U2", "L3", "U3"]);
    }

    #[test]
    fn depth_d_sees_every_update_but_the_last_d() {
        for depth in 1..4 {
            let source = Counter::default();
            let seen = run(&source, depth, 8, 100);
            let expected: Vec<(u32, u32)> = (1..=8u32).map(|t| (t, t.saturating_sub(1 + depth as u32))).collect();
            assert_eq!(seen, expected, "depth {depth}");
            assert_eq!(*source.updates.lock(), 8, "depth {depth}: every update applied once");
        }
    }

    #[test]
    fn no_lookahead_goes_past_the_step_limit() {
        for depth in 0..4 {
            let source = Counter::default();
            assert_eq!(run(&source, depth, 10, 3).len(), 3);
            let lookups = source.log.lock().iter().filter(|op| op.starts_with('L')).count();
            assert_eq!(lookups, 3, "depth {depth}: no batch past the limit was looked up");
        }
    }

    #[test]
    fn staging_runs_beside_the_dense_step_and_changes_no_lookup() {
        let source = Counter { stages: true, ..Counter::default() };
        assert_eq!(run(&source, 0, 3, 100), vec![(1, 0), (2, 1), (3, 2)]);
        assert_eq!(*source.log.lock(), ["L1", "S2", "U1", "L2", "S3", "U2", "L3", "U3"]);
    }

    /// The time spent taking batches (a reader that did not keep ahead)
    /// is `next_batch_secs` and counted in no other span: the spans a step
    /// reports are disjoint, so they sum to no more than the step took.
    /// Before, at d ≥ 1 the lookup's span held the batches taken in it,
    /// and at d = 0 with staging the dense span held the next one. The
    /// step that finds the data's end reports its wait apart.
    #[test]
    fn waiting_for_batches_is_its_own_span() {
        const TAKING: Duration = Duration::from_millis(15);
        for (depth, stages) in [(0, false), (0, true), (1, false), (2, false)] {
            let source = Counter { stages, ..Counter::default() };
            let mut engine = StepEngine::new(depth);
            let mut fed = 0u32;
            // A slow reader: each batch takes `TAKING` (spun, not slept).
            let mut next = |_: usize| {
                let t = Instant::now();
                while t.elapsed() < TAKING {
                    std::hint::spin_loop();
                }
                (fed < 4).then(|| {
                    fed += 1;
                    Ok(fed)
                })
            };
            let mut steps = 0;
            loop {
                let t = Instant::now();
                let stepped = engine
                    .step(&source, &mut next, |_: &Looked<u32, ()>| Ok(((), Some(RowGrads::at_full_rate(vec![1.0])))))
                    .expect("step");
                let took = t.elapsed().as_secs_f64();
                let what = format!("depth {depth}, staging {stages}, step {}", steps + 1);
                let Some(stepped) = stepped else {
                    // The step that found the data's end waited for it too.
                    let end = engine.take_end_wait();
                    assert!(end >= TAKING.as_secs_f64() && end <= took, "{what}: the end's wait {end} s");
                    assert_eq!(engine.take_end_wait(), 0.0, "{what}: taken once");
                    break;
                };
                steps += 1;
                assert!(stepped.next_batch_secs >= TAKING.as_secs_f64(), "{what}: {}", stepped.next_batch_secs);
                let spans = stepped.next_batch_secs + stepped.lookup_secs + stepped.dense_secs;
                assert!(spans <= took, "{what}: the spans ({spans} s) overlap: the step took {took} s");
            }
            assert_eq!(steps, 4, "depth {depth}, staging {stages}: every batch trained");
        }
    }

    /// A lookahead that fails after the dense step does not undo the step:
    /// its update waits as usual and the error comes with the step.
    #[test]
    fn a_failed_lookahead_completes_the_step_and_defers_its_error() {
        let source = Counter { fail_lookup_of: Some(2), ..Counter::default() };
        let mut engine = StepEngine::new(1);
        let mut fed = 0;
        let mut next = |_: usize| {
            fed += 1;
            Some(Ok(fed))
        };
        let stepped = engine
            .step(&source, &mut next, |_: &Looked<u32, ()>| Ok(((), Some(RowGrads::at_full_rate(vec![1.0])))))
            .expect("step 1 completes")
            .expect("a batch");
        assert!(matches!(stepped.deferred, Some(TrainError::Interrupted { step: 2 })));
        assert!(engine.has_pending(), "batch 1's update is kept");
        engine.flush(&source).expect("flush");
        assert_eq!(*source.log.lock(), ["L1", "U1"]);
    }
}
