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

/// What worker 0 scores (its cadence is its observers', `driver.rs`).
pub struct PeriodicEval {
    test: PathBuf,
    /// The job's config with training's weighting off (evaluation reads
    /// rows as they are, as the loader's evaluation does).
    config: Config,
    /// Batches scored so far (the next batch id's sequence number).
    batches: u64,
}

impl PeriodicEval {
    /// For worker `worker` of `config`, if it evaluates periodically.
    pub fn new(config: &Config, worker: usize) -> Option<PeriodicEval> {
        config.train.eval_every_steps.filter(|&n| n > 0)?;
        // With a validation set, `train.eval_every_steps` validates (at the
        // end of a generation: `epochs.rs`), and `data.test` waits for the end.
        if config.data.validation.is_some() {
            return None;
        }
        let test = PathBuf::from(config.data.test.as_deref()?);
        if worker != 0 {
            return None;
        }
        let mut unweighted = config.clone();
        unweighted.data = config.data.for_scoring();
        Some(PeriodicEval { test, config: unweighted, batches: 0 })
    }
}

impl Worker {
    /// Scores `data.test` now, as a periodic evaluation (every update of
    /// this worker pushed first, by the caller); `None`: this worker does
    /// not evaluate.
    pub(super) fn evaluate_now(&mut self, shards: &[Arc<dyn ShardService>]) -> Result<Option<Figures>, ClusterError> {
        let Some(periodic) = self.periodic_eval.as_mut() else { return Ok(None) };
        let (test, config) = (periodic.test.clone(), periodic.config.clone());
        let first_id = first_batch_id(self.generation, PERIODIC_EVAL_BATCH_ID) + periodic.batches;
        let scores = self.score_file(&test, &config, first_id, shards)?;
        if let Some(periodic) = self.periodic_eval.as_mut() {
            periodic.batches += scores.1;
        }
        Ok(Some(Figures::of(&config, &scores.0)))
    }

    /// Scores every row of `test`; also returns the batches read.
    pub(super) fn score_file(
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
