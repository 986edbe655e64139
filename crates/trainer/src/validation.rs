//! `data.validation` in a local run: the set scored with the model as of
//! now (every update applied), its `validation` line, and what
//! `[train.early_stopping]` makes of it: the best model saved as
//! `checkpoint.dir/best`, or the run stopped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sparrow_core::Config;
use sparrow_core::config::DataConfig;
use sparrow_core::metrics::tasks::TaskFigures;
use sparrow_data::BadRows;

use crate::TrainError;
use crate::checkpoint;
use crate::driver::{At, Observers};
use crate::early_stopping::{LastValidation, StoppingState, Verdict, watched};
use crate::evaluation::{Figures, predict_file};
use crate::trainer::Trainer;

/// Where the best model is kept: `checkpoint.dir/best` (a checkpoint
/// directory of its own, one version).
pub fn best_dir(config: &Config) -> Option<PathBuf> {
    config.checkpoint.dir.as_deref().map(|d| Path::new(d).join("best"))
}

/// A local run's validation set.
pub struct Validation {
    /// The file scored and how it is read (the training file's held-out
    /// rows, or the validation file as it is).
    path: PathBuf,
    data: DataConfig,
    /// The figures last scored.
    pub last: Option<Figures>,
    /// Early stopping said stop.
    pub stop: bool,
    /// The epoch's validation is done: the next epoch's first batch may go.
    pub released: bool,
}

impl Validation {
    /// `data.validation`, if set.
    pub fn of(config: &Config) -> Option<Validation> {
        let (path, data) = config.data.for_validation()?;
        Some(Validation { path: PathBuf::from(path), data, last: None, stop: false, released: false })
    }

    /// Fails before training, not after it, when the file is missing.
    pub fn check_exists(&self) -> Result<(), TrainError> {
        std::fs::File::open(&self.path).map(drop).map_err(|e| TrainError::io(&self.path, e).of_key("data.validation"))
    }

    /// Scores the set at `at` (unless it was at this step already), logs the
    /// line and judges it: a new best is saved as `best`; patience spent
    /// sets [`Validation::stop`].
    pub fn run(&mut self, trainer: &mut Trainer, observers: &mut Observers, at: At) -> Result<(), TrainError> {
        // Once a step: an epoch's end that is also the data's end, or a
        // resume from a checkpoint taken just before the epoch's validation.
        if trainer.early_stopping.validated_step == Some(at.step) {
            return Ok(());
        }
        trainer.flush_update()?;
        let bad = BadRows::from_config(&self.data);
        let scores = predict_file(trainer.scoring(), &self.path, &self.data, &bad)?;
        let figures = Figures::of(&trainer.config, &scores);
        observers.log_validation(at, &figures)?;
        trainer.early_stopping.validated_step = Some(at.step);
        trainer.early_stopping.last = Some(LastValidation::of(&figures));
        if let Some(rule) = trainer.config.train.early_stopping.clone() {
            let metric = watched(&trainer.config, &rule, &figures);
            match trainer.early_stopping.judge(&rule, metric, at.step, at.epoch) {
                Verdict::Improved => {
                    if let Some(dir) = best_dir(&trainer.config) {
                        checkpoint::save(trainer, &dir, 1)?;
                    }
                }
                Verdict::NotBetter => {}
                Verdict::Stop => {
                    let best = trainer.early_stopping.best;
                    tracing::info!(
                        "early stopping at step {}: the validation figure has not improved for {} evaluations (best \
                         {:.6} at step {})",
                        at.step,
                        rule.patience,
                        best.map_or(f64::NAN, |b| b.metric),
                        best.map_or(0, |b| b.step)
                    );
                    self.stop = true;
                }
            }
        }
        self.last = Some(figures);
        Ok(())
    }
}

/// What the final JSON says of the validation set and early stopping
/// (flattened into `sparrow train`'s summary; null without them).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ValidationReport {
    /// The last validation's figures (first task, as `test_auc`).
    pub validation_auc: Option<f64>,
    pub validation_logloss: Option<f64>,
    pub validation_rows: Option<u64>,
    /// The last validation's figures for every task by name, as `tasks`
    /// gives the test set's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub validation_tasks: BTreeMap<String, TaskFigures>,
    /// `[train.early_stopping]`: the best evaluation's step, epoch (from
    /// 0, as in the metrics lines) and watched figure, and where that model is.
    pub best_step: Option<u64>,
    pub best_epoch: Option<u64>,
    pub best_validation: Option<f64>,
    pub best_checkpoint: Option<String>,
    /// Training stopped before its epochs were done, for want of an improvement.
    pub stopped_early: bool,
    /// Which model `test_*` scored: `best` or `last`.
    pub test_model: Option<String>,
}

impl ValidationReport {
    /// The report of a finished run; `test_model` is set by the caller.
    pub fn of(validation: Option<&Validation>, trainer: &Trainer) -> ValidationReport {
        let Some(v) = validation else { return ValidationReport::default() };
        ValidationReport::from_state(&trainer.config, v.last.as_ref(), &trainer.early_stopping, v.stop)
    }

    /// The report from the last validation's figures (this run's, else the
    /// ones `state` kept from before a resume) and where early stopping
    /// stands (a cluster's worker 0 keeps them itself); `best` named if it
    /// was kept.
    pub fn from_state(
        config: &Config,
        last: Option<&Figures>,
        state: &StoppingState,
        stopped_early: bool,
    ) -> ValidationReport {
        let best = config.train.early_stopping.as_ref().and(state.best);
        let best_checkpoint = best.and_then(|_| best_dir(config)).filter(|d| d.join("LATEST").exists());
        let last = last.map(LastValidation::of).or_else(|| state.last.clone());
        ValidationReport {
            validation_auc: last.as_ref().map(|f| f.auc),
            validation_logloss: last.as_ref().map(|f| f.logloss),
            validation_rows: last.as_ref().map(|f| f.rows),
            validation_tasks: last.map(|f| f.tasks).unwrap_or_default(),
            best_step: best.map(|b| b.step),
            best_epoch: best.map(|b| b.epoch),
            best_validation: best.map(|b| b.metric),
            best_checkpoint: best_checkpoint.map(|d| d.display().to_string()),
            stopped_early,
            test_model: None,
        }
    }
}
