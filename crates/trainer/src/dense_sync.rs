//! How data-parallel replicas agree on the dense weights: a policy the step
//! engine calls once per step, between a batch's backward pass and the dense
//! optimizer. Every replica applies the same combined gradient, so replicas
//! that start equal stay equal bit for bit.
//!
//! [`LocalSync`] is one replica on its own (`sparrow train`). The cluster's
//! every-step sum over workers (S0.6 with S2.2) is `sparrow_cluster::sync::RoundSync`;
//! later policies (rounds, lazy aggregation) go beside it without touching
//! the step loop.

use sparrow_model::{DenseGrads, ParamStore};

use crate::TrainError;

pub trait DenseSync: Send {
    /// Combines this replica's gradients for one dense step (`grads.rows`
    /// samples; 0 when it has no batch left) with the other replicas'.
    /// Returns the gradients to apply, or `None`: no step now (the round is
    /// still open and this replica should train another batch at the same
    /// weights, or no replica had a batch).
    fn combine(&mut self, params: &ParamStore, grads: DenseGrads) -> Result<Option<DenseGrads>, TrainError>;
}

/// One replica: its own gradients, a step per batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalSync;

impl DenseSync for LocalSync {
    fn combine(&mut self, _: &ParamStore, grads: DenseGrads) -> Result<Option<DenseGrads>, TrainError> {
        Ok((grads.rows > 0).then_some(grads))
    }
}
