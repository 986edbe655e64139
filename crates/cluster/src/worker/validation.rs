//! `data.validation` at an epoch's end, as a worker takes part in it
//! (`epochs.rs` has the whole): every worker tracks the step last
//! validated (so all of them agree that the epoch's checkpoint follows);
//! worker 0 scores the set through the shards' evaluation pulls (which
//! insert no row), logs its `validation` line and judges
//! `[train.early_stopping]`, whose state its checkpoint cut carries.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sparrow_core::Config;
use sparrow_trainer::early_stopping::{LastValidation, StoppingState, Verdict, watched};
use sparrow_trainer::evaluation::Figures;
use sparrow_trainer::validation::ValidationReport;

use super::Worker;
use crate::loader::FIRST_EVAL_BATCH_ID;
use crate::messages::first_batch_id;
use crate::transport::{ClusterError, LoaderService, ShardService};

/// Batch ids of validation scoring: the evaluation bit, bit 63 and bit 39
/// (periodic evaluations, bit 63 alone, never run beside it).
const VALIDATION_BATCH_ID: u64 = FIRST_EVAL_BATCH_ID | (1 << 63) | (1 << 39);

/// A validating job's epochs, as this worker sees them.
pub struct EpochValidation {
    /// Where early stopping stands (restored with the checkpoint).
    pub state: StoppingState,
    /// Worker 0: the set and how it is read (training's weighting off).
    scored: Option<(PathBuf, Config)>,
    /// The figures this worker last scored.
    pub last: Option<Figures>,
}

impl EpochValidation {
    /// For worker `worker` of `config`, if it validates.
    pub fn new(config: &Config, worker: usize) -> Option<EpochValidation> {
        let (path, data) = config.data.for_validation()?;
        let scored = (worker == 0).then(|| (PathBuf::from(path), Config { data, ..config.clone() }));
        Some(EpochValidation { state: StoppingState::default(), scored, last: None })
    }

    /// The state kept in the checkpoint generation restores from.
    pub fn restore(&mut self, dir: &Path) -> Result<(), ClusterError> {
        self.state = sparrow_trainer::checkpoint::read_manifest(dir)?.early_stopping.unwrap_or_default();
        Ok(())
    }
}

impl Worker {
    /// The training data ended at an epoch's end not yet validated: worker
    /// 0 scores and judges it (every update is on the shards). Returns
    /// whether it was such an end: then every worker checkpoints, even at
    /// a step a periodic checkpoint already took (that one lacks the
    /// judgement).
    pub(super) fn validate_epoch(
        &mut self,
        ended_at_epoch_end: bool,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<bool, ClusterError> {
        let step = self.job_step();
        let Some(v) = self.epochs.as_mut() else { return Ok(false) };
        if !ended_at_epoch_end || v.state.validated_step == Some(step) {
            return Ok(false);
        }
        v.state.validated_step = Some(step);
        let Some((path, config)) = v.scored.clone() else { return Ok(true) };
        let first_id = first_batch_id(self.generation, VALIDATION_BATCH_ID);
        let (scores, _) = self.score_file(&path, &config, first_id, shards)?;
        let figures = Figures::of(&config, &scores);
        let at = self.at();
        self.observers.log_validation(at, &figures)?;
        let Some(v) = self.epochs.as_mut() else { return Ok(true) };
        v.state.last = Some(LastValidation::of(&figures));
        if let Some(rule) = &config.train.early_stopping {
            let metric = watched(&config, rule, &figures);
            if v.state.judge(rule, metric, step, at.epoch) == Verdict::Stop {
                let best = v.state.best;
                tracing::info!(
                    "early stopping at step {step}: the validation figure has not improved for {} evaluations (best \
                     {:.6} at step {})",
                    rule.patience,
                    best.map_or(f64::NAN, |b| b.metric),
                    best.map_or(0, |b| b.step)
                );
            }
        }
        v.last = Some(figures);
        Ok(true)
    }

    /// Whether the job trains on after this generation, which restored
    /// `restored` (`epochs::after`, the coordinator's rule, on the version
    /// this worker last committed).
    pub(crate) fn job_goes_on(&self, config: &Config, restored: Option<&Path>) -> bool {
        let committed = self.checkpoints.as_ref().and_then(|c| c.last.as_deref());
        crate::epochs::after(config, committed, restored).is_some()
    }

    /// Worker 0's end: `data.test` scored with the last model (through the
    /// shards), or under `restore_best` with the best one (loaded whole from
    /// `best`, as `sparrow train` loads it); and the validation report.
    pub(crate) fn final_figures(
        &mut self,
        config: &Config,
        loader: &dyn LoaderService,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<(Option<Figures>, ValidationReport), ClusterError> {
        let mut report = self.validation_report(config);
        let Some(test) = config.data.test.as_deref() else { return Ok((None, report)) };
        let best = config.train.early_stopping.as_ref().filter(|r| r.restore_best).and(report.best_step);
        let scores = match &report.best_checkpoint {
            Some(dir) if best.is_some_and(|step| step != self.job_step()) => {
                let (model, _) = sparrow_trainer::run::load_model(Path::new(dir), &Default::default())?;
                let bad = sparrow_data::BadRows::from_config(&config.data);
                sparrow_trainer::evaluation::predict_file(model.scoring(), Path::new(test), &config.data, &bad)?
            }
            _ => self.run_eval(loader, shards)?,
        };
        let best_used = report.best_checkpoint.is_some() && best.is_some_and(|step| step != self.job_step());
        report.test_model = self.epochs.as_ref().map(|_| if best_used { "best" } else { "last" }.to_string());
        Ok((Some(Figures::of(config, &scores)), report))
    }

    /// Worker 0's figures for the final JSON: the last validation (this
    /// generation's, else the one its checkpoint kept, as `sparrow train`
    /// reports after a resume), the best evaluation and where it is kept.
    fn validation_report(&self, config: &Config) -> ValidationReport {
        let Some(v) = self.epochs.as_ref().filter(|v| v.scored.is_some()) else { return ValidationReport::default() };
        let stopped = crate::epochs::stopped(config, &v.state);
        ValidationReport::from_state(config, v.last.as_ref(), &v.state, stopped)
    }
}
