//! `train.eval_every_steps` in a cluster job: the evaluating worker (0)
//! scores `data.test` whenever the job's step passes a multiple of it, as
//! `sparrow train` does, through the shards' evaluation pulls (which insert
//! no row: the model trained is the same with or without it). It reads the
//! file itself, so the loader's streams are untouched; its batch ids are
//! its own range (bit 63), so they never meet the loader's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sparrow_core::Config;
use sparrow_core::config::ClusterMode;
use sparrow_data::{BadRows, BatchStream};
use sparrow_trainer::evaluation::{Figures, Scores};

use super::Worker;
use crate::loader::{FIRST_EVAL_BATCH_ID, Loader};
use crate::messages::{Mode, first_batch_id};
use crate::transport::{ClusterError, ShardService};

/// Batch ids of periodic evaluations: the evaluation bit and bit 63.
const PERIODIC_EVAL_BATCH_ID: u64 = FIRST_EVAL_BATCH_ID | (1 << 63);

pub struct PeriodicEval {
    every: u64,
    test: PathBuf,
    /// The job's config with training's weighting off (evaluation reads
    /// rows as they are, as the loader's evaluation does).
    config: Config,
    /// The job step of the last evaluation (at the first check: the step
    /// before it, so a resumed job does not evaluate at once).
    last_step: Option<u64>,
    /// Batches scored so far (the next batch id's sequence number).
    batches: u64,
}

impl PeriodicEval {
    /// For worker `worker` of `config`, if it evaluates periodically.
    pub fn new(config: &Config, worker: usize) -> Option<PeriodicEval> {
        let every = config.train.eval_every_steps.filter(|&n| n > 0)?;
        let test = PathBuf::from(config.data.test.as_deref()?);
        if worker != 0 {
            return None;
        }
        let mut unweighted = config.clone();
        unweighted.data.weighting = None;
        unweighted.data.group_by_label = false;
        Some(PeriodicEval { every, test, config: unweighted, last_step: None, batches: 0 })
    }

    /// Whether the job's step passed a multiple of the interval since the last.
    pub fn due(&mut self, job_step: u64) -> bool {
        let last = *self.last_step.get_or_insert(job_step.saturating_sub(1));
        job_step / self.every > last / self.every
    }
}

impl Worker {
    /// Whether a periodic evaluation is due after this step.
    pub(super) fn evaluation_due(&mut self) -> bool {
        let step = self.job_step();
        self.periodic_eval.as_mut().is_some_and(|p| p.due(step))
    }

    /// Evaluates now (see [`evaluation_due`](Self::evaluation_due)): an
    /// `eval` line and the test scalars. Every update of this worker is
    /// pushed first (the caller's).
    pub(super) fn evaluate_now(&mut self, shards: &[Arc<dyn ShardService>]) -> Result<(), ClusterError> {
        let step = self.job_step();
        let Some(periodic) = self.periodic_eval.as_mut() else { return Ok(()) };
        periodic.last_step = Some(step);
        let (test, config) = (periodic.test.clone(), periodic.config.clone());
        let first_id = first_batch_id(self.generation, PERIODIC_EVAL_BATCH_ID) + periodic.batches;
        let scores = self.score_file(&test, &config, first_id, shards)?;
        if let Some(periodic) = self.periodic_eval.as_mut() {
            periodic.batches += scores.1;
        }
        let figures = Figures::of(&config, &scores.0);
        self.log_evaluation(&config, &figures)
    }

    /// Scores every row of `test`; also returns the batches read.
    fn score_file(
        &mut self,
        test: &Path,
        config: &Config,
        first_id: u64,
        shards: &[Arc<dyn ShardService>],
    ) -> Result<(Scores, u64), ClusterError> {
        let bad = BadRows::from_config(&config.data);
        let batch_rows = config.train.batch_size.max(1024);
        let stream = BatchStream::spawn(test, config, batch_rows, Default::default(), 1, bad.clone())?;
        // The worker gets the keys and looks them up itself (`predict`).
        let mut loader = Loader::new(stream, Vec::new(), Mode::Eval, ClusterMode::WorkerLookup, first_id, bad)
            .grouping(sparrow_trainer::evaluation::group_field(config));
        let (mut s, mut groups, mut grouped, mut batches) = (Scores::default(), Vec::new(), true, 0);
        while let Some(mut batch) = loader.next_batch()? {
            batches += 1;
            grouped &= batch.groups.len() == batch.rows && (batch.rows == 0 || !batch.groups.is_empty());
            groups.append(&mut batch.groups);
            s.labels.extend_from_slice(&batch.labels);
            s.logits.extend(self.predict(batch, shards)?);
        }
        s.groups = (grouped && !groups.is_empty()).then_some(groups);
        Ok((s, batches))
    }
}
