//! `sparrow train` as a [`Run`] of the one loop (`driver.rs`): the local
//! table's step on the planner's batches, a progress bar and the caller's
//! observer at each log interval, checkpoints and serving exports at their
//! cadences. `run.rs` sets it up and writes what it trained.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sparrow_core::Config;
use sparrow_data::BadRows;

use crate::TrainError;
use crate::checkpoint;
use crate::driver::{At, Cadence, Flow, IntervalFigures, Line, Observers, Run, StepDone};
use crate::evaluation::{Figures, predict_file};
use crate::export::IncrementalExports;
use crate::input::{TrainingInput, describe_lag, lag_secs};
use crate::online::OnlineFigures;
use crate::pipeline::PlannedBatches;
use crate::progress::{Progress, ProgressUpdate};
use crate::trainer::{PlannedBatch, Trainer};
use crate::validation::Validation;

/// A local run in progress.
pub struct LocalRun<'a> {
    pub config: &'a Config,
    /// Borrowed, never moved: an update still pending names its table by
    /// where it lives.
    pub trainer: &'a mut Trainer,
    pub batches: PlannedBatches,
    pub observers: Observers,
    pub stop: &'a AtomicBool,
    pub bad: BadRows,
    pub progress: Progress,
    /// The caller's observer (the Python package's progress bar).
    pub callback: &'a (dyn Fn(&ProgressUpdate) + Sync),
    /// A plain text file's size and all passes' bytes (progress has a total).
    pub file_bytes: Option<u64>,
    pub bytes_total: Option<u64>,
    pub checkpoints: Cadence,
    pub exports: Option<(IncrementalExports, Cadence)>,
    /// The last checkpoint this run wrote, and its step.
    pub last_saved: Option<(u64, PathBuf)>,
    /// Training time: from the start to the end of the last step (a
    /// stream's wait for records that never came is not training).
    pub started: Instant,
    pub trained_for: Duration,
    /// A failure beside the last step, reported once its hooks ran.
    deferred: Option<TrainError>,
    /// `data.validation`: scored at each epoch's end and every
    /// `train.eval_every_steps`.
    pub validation: Option<Validation>,
    /// The epoch of the batches handed to the step, and the first batch
    /// of the next one, held back until the epoch's validation.
    epoch: u64,
    next_epoch: Option<PlannedBatch>,
}

impl<'a> LocalRun<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &'a Config,
        trainer: &'a mut Trainer,
        input: TrainingInput,
        observers: Observers,
        stop: &'a AtomicBool,
        bad: BadRows,
        progress: Progress,
        callback: &'a (dyn Fn(&ProgressUpdate) + Sync),
    ) -> LocalRun<'a> {
        let (step, epoch) = (trainer.step, trainer.position.epoch);
        let c = &config.checkpoint;
        LocalRun {
            checkpoints: Cadence::new(c.every_steps, c.every_secs, step),
            exports: IncrementalExports::new(config)
                .map(|e| (e, Cadence::new(c.export_every_steps, c.export_every_secs, step))),
            config,
            trainer,
            batches: input.batches,
            observers,
            stop,
            bad,
            progress,
            callback,
            file_bytes: input.file_bytes,
            bytes_total: input.bytes_total,
            last_saved: None,
            started: Instant::now(),
            trained_for: Duration::ZERO,
            deferred: None,
            validation: Validation::of(config),
            epoch,
            next_epoch: None,
        }
    }

    fn interrupted(&self) -> TrainError {
        TrainError::Interrupted { step: self.trainer.step }
    }

    /// Bytes of text read over all epochs.
    fn bytes_done(&self) -> u64 {
        let p = self.trainer.position;
        p.epoch * self.file_bytes.unwrap_or(0) + p.offset
    }
}

impl Run for LocalRun<'_> {
    type Error = TrainError;

    /// The planner's next batch; none past `train.max_steps` (no lookahead
    /// goes past it: its keys would be inserted untrained) or once `stop`
    /// is set (Ctrl-C: the run ends as interrupted).
    fn step(&mut self) -> Result<Option<StepDone>, TrainError> {
        let stop_at = self.config.train.max_steps;
        let step_now = self.trainer.step;
        if stop_at.is_some_and(|m| step_now >= m) {
            return Ok(None);
        }
        if self.stop.load(Ordering::Relaxed) {
            return Err(self.interrupted());
        }
        let (batches, stop) = (&mut self.batches, self.stop);
        // With a validation set, an epoch's last batch ends the feed: the
        // next epoch's first one waits for the epoch's validation (see
        // `ran_dry`), then comes first once nothing is in hand.
        let (epoch, held) = (&mut self.epoch, &mut self.next_epoch);
        let (validates, released) = (self.validation.is_some(), self.validation.as_ref().is_some_and(|v| v.released));
        let mut next = |taken: usize| -> Option<Result<PlannedBatch, TrainError>> {
            if stop_at.is_some_and(|m| step_now + taken as u64 >= m) {
                return None;
            }
            if held.is_some() {
                if taken > 0 || !released {
                    return None;
                }
                let first = held.take()?;
                *epoch = first.0.end.epoch;
                return Some(Ok(first));
            }
            match batches.next_unless(stop)? {
                Ok(b) if validates && b.0.end.epoch > *epoch => {
                    *held = Some(b);
                    None
                }
                item => Some(item.map_err(TrainError::from)),
            }
        };
        match self.trainer.step(&mut next)? {
            Some(report) => {
                self.trained_for = self.started.elapsed();
                self.deferred = report.deferred;
                let s = report.stats;
                Ok(Some(StepDone {
                    samples: s.rows as u64,
                    weight: s.rows as f64,
                    loss: s.loss,
                    keys: s.keys as u64,
                    unique_keys: s.unique_keys as u64,
                }))
            }
            None if self.stop.load(Ordering::Relaxed) => Err(self.interrupted()),
            None => Ok(None),
        }
        .inspect(|_| {
            if let Some(v) = self.validation.as_mut()
                && self.next_epoch.is_none()
            {
                v.released = false;
            }
        })
    }

    fn at(&self) -> At {
        let t = &self.trainer;
        At {
            step: t.step,
            batches: t.step,
            samples: t.samples_trained,
            job_samples: t.samples_trained,
            epoch: t.position.epoch,
        }
    }

    fn observers(&mut self) -> &mut Observers {
        &mut self.observers
    }

    fn check_weights(&mut self) -> Result<(), TrainError> {
        self.trainer.check_weights()
    }

    /// The progress bar and the caller's observer; the table's and the
    /// stream's fields.
    fn describe(&mut self, f: &IntervalFigures) -> Line {
        let t = &self.trainer;
        let online = t.online.as_ref().map(OnlineFigures::of);
        let deleted = t.table.filter_stats();
        let stream = t.stream.as_ref();
        let bytes_done = self.bytes_done();
        (self.callback)(&ProgressUpdate {
            step: t.step,
            epoch: t.position.epoch,
            samples: t.samples_trained,
            bytes_done,
            bytes_total: self.bytes_total,
            train_logloss: f.loss,
            samples_per_sec: f.samples_per_sec,
            online,
            embedding_rows: t.table.len() as u64,
            expired_rows: deleted.expired,
            evicted_rows: deleted.evicted,
            stream_lag_records: stream.map(|m| m.lag_records),
            stream_lag_secs: t.stream.as_deref().and_then(lag_secs),
            stream_future_records: stream.map(|m| m.future_records),
            stream_gap_records: stream.map(|m| m.gap_records),
            stream_offset_resets: stream.map(|m| m.offset_resets),
        });
        let (loss, rate) = (f.loss, f.samples_per_sec);
        let lag = t.stream.as_deref().map(describe_lag).unwrap_or_default()
            + &online.map(|o| o.describe()).unwrap_or_default();
        self.progress.set_position(bytes_done, &format!("step {} loss {loss:.4} {rate:.0} samples/s{lag}", t.step));
        self.progress.line(&format!(
            "step {} epoch {} samples {} train_logloss {loss:.5} samples/s {rate:.0}{lag}",
            t.step, t.position.epoch, t.samples_trained
        ));
        let hit_rate = t.table.tier_stats().map(|t| t.cache_hit_rate());
        let serde_json::Value::Object(fields) = serde_json::json!({
            "embedding_rows": t.table.len(),
            "expired_rows": deleted.expired,
            "evicted_rows": deleted.evicted,
            "bad_rows": self.bad.total(),
            "cache_hit_rate": hit_rate,
            "stream_records": stream.map(|m| m.records),
            "stream_lag_records": stream.map(|m| m.lag_records),
            "stream_lag_secs": t.stream.as_deref().and_then(lag_secs),
            "stream_newest_record_ms": stream.and_then(|m| m.newest_record_ms),
            "future_records": stream.map(|m| m.future_records),
            "stream_gap_records": stream.map(|m| m.gap_records),
            "stream_offset_resets": stream.map(|m| m.offset_resets),
            "online_window": online.map(|o| o.window),
            "online_run": online.map(|o| o.run),
        }) else {
            unreachable!("a JSON object literal")
        };
        let mut scalars = vec![("train/cache_hit_rate".to_string(), hit_rate.unwrap_or(f64::NAN))];
        if let Some(online) = online {
            scalars.extend(online.scalars().into_iter().map(|(t, v)| (t.to_string(), v)));
        }
        Line { fields, phase_secs: serde_json::to_value(t.phase_secs).unwrap_or_default(), scalars }
    }

    /// The pending update first: the figures are the model's after this
    /// step. With `data.validation`, the validation set (its own line,
    /// early stopping's judgement); `data.test` waits for the end.
    fn evaluate(&mut self) -> Result<Option<Figures>, TrainError> {
        let at = self.at();
        if let Some(v) = self.validation.as_mut() {
            v.run(self.trainer, &mut self.observers, at)?;
            return Ok(None);
        }
        let Some(test) = &self.config.data.test else { return Ok(None) };
        self.trainer.flush_update()?;
        let data = &self.config.data;
        let scores = predict_file(self.trainer.scoring(), Path::new(test), data, &BadRows::from_config(data))?;
        Ok(Some(Figures::of(self.config, &scores)))
    }

    /// A checkpoint and a serving export when due; then a failure beside
    /// the step, if one came (the model so far is saved by the caller).
    fn stepped(&mut self, _: StepDone) -> Result<Flow, TrainError> {
        let step = self.trainer.step;
        if let (true, Some(dir)) = (self.checkpoints.take(step), &self.config.checkpoint.dir) {
            self.trainer.flush_update()?;
            let saved = checkpoint::save(self.trainer, Path::new(dir), self.config.checkpoint.keep)?;
            self.last_saved = Some((step, saved));
        }
        if let Some((exports, cadence)) = self.exports.as_mut()
            && cadence.take(step)
        {
            self.trainer.flush_update()?;
            exports.write(self.trainer)?;
        }
        match self.deferred.take() {
            Some(e) => Err(e),
            None if self.validation.as_ref().is_some_and(|v| v.stop) => Ok(Flow::Done),
            None => Ok(Flow::Train),
        }
    }

    /// An epoch ended (its last batch trained): the validation set is
    /// scored, then the next epoch starts unless early stopping says stop.
    /// The data's end is the last epoch's; a stop at `train.max_steps`
    /// within an epoch is none (a run cut there to be resumed scores what
    /// the uninterrupted run scores).
    fn ran_dry(&mut self) -> Result<Flow, TrainError> {
        let at = self.at();
        let cut = self.config.train.max_steps.is_some_and(|m| at.step >= m) && self.next_epoch.is_none();
        let Some(v) = self.validation.as_mut().filter(|_| !cut) else { return Ok(Flow::Done) };
        v.run(self.trainer, &mut self.observers, at)?;
        if v.stop || self.next_epoch.is_none() {
            return Ok(Flow::Done);
        }
        v.released = true;
        Ok(Flow::Train)
    }
}
