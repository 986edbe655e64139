//! `train.on_non_finite` in a worker: a batch whose loss or gradients are
//! not finite stops the job (`"stop"`) or is skipped (`"skip_batch"`), as
//! in `sparrow train`. A skipped batch updates nothing: its shards let it go
//! without a row updated (`ShardService::release`, through the step
//! engine), and the worker does not meet the dense sync for it: it takes
//! its next batch for the same step. (A contribution with no samples would
//! read, to the others, as a worker out of data: a round where every worker
//! has none ends their training.) Only a batch refused before the sync is
//! skipped: one refused after it (the replicas' sum overflowed) stops the
//! job, since the others have already met this one.

use sparrow_model::DenseGrads;
use sparrow_trainer::TrainError;

use super::Worker;
use crate::messages::WorkerBatch;
use crate::transport::ClusterError;

/// Warnings before the rest go uncounted to stderr (the summary counts them all).
const WARNED_SKIPS: u64 = 5;

impl Worker {
    /// This worker's own dense gradients, checked before they reach the
    /// sync when batches may be skipped (the sync checks them too, but a
    /// refusal there would leave the others' round without this worker).
    pub(super) fn non_finite_dense_grads(&self, grads: &DenseGrads, step: u64) -> Option<TrainError> {
        if !self.skip_non_finite {
            return None;
        }
        match grads.check_finite(self.optimizer.simd(), &self.model.params) {
            Err(sparrow_model::ModelError::NonFinite { what }) => Some(TrainError::NonFinite { step, what }),
            _ => None,
        }
    }

    /// A batch's dense half failed with `error`: skipped if it is a
    /// non-finite one and the config says so, else the worker's error.
    pub(super) fn skip_or_fail(&mut self, batch: &WorkerBatch, error: TrainError) -> Result<(), ClusterError> {
        let TrainError::NonFinite { step, what } = error else { return Err(error.into()) };
        if !self.skip_non_finite {
            return Err(TrainError::NonFinite { step, what }.into());
        }
        if self.stats.skipped_batches < WARNED_SKIPS {
            tracing::warn!("warning: worker {}: skipping the batch of step {step}: non-finite {what}", self.index);
        } else if self.stats.skipped_batches == WARNED_SKIPS {
            tracing::warn!(
                "warning: worker {}: more batches skipped; the final JSON's skipped_batches counts them all",
                self.index
            );
        }
        self.stats.skipped_batches += 1;
        self.consumed(batch);
        Ok(())
    }
}
