//! A worker role's ways to the others, as its sync policy asks for them:
//! the coordinator for sums, merges and the scheduler, and with aggregator
//! processes its aggregator.

use std::sync::Arc;

use sparrow_core::Config;
use tokio::runtime::Runtime;

use crate::generation::Generation;
use crate::grpc::NetSettings;
use crate::grpc::aggregator::AggregatorClient;
use crate::grpc::coordinator::CoordinatorClient;
use crate::lazy::LazyLink;
use crate::metrics::RoleMetrics;
use crate::rounds::RoundMerger;
use crate::sync::RoundSummer;
use crate::transport::ClusterError;
use crate::worker::SyncLinks;

/// Where a worker role meets the others: the coordinator (sums, merges, the
/// scheduler) and, with aggregator processes, its aggregator.
pub(super) struct RoleLinks<'a> {
    pub(super) config: &'a Config,
    pub(super) coordinator: &'a CoordinatorClient,
    /// The generation's aggregator processes (empty: aggregators in the coordinator).
    pub(super) aggregators: &'a [String],
    pub(super) settings: &'a NetSettings,
    pub(super) rt: &'a Runtime,
    pub(super) metrics: &'a RoleMetrics,
}

impl SyncLinks for RoleLinks<'_> {
    fn summer(&self) -> Arc<dyn RoundSummer> {
        Arc::new(self.coordinator.clone())
    }

    fn merger(&self) -> Arc<dyn RoundMerger> {
        Arc::new(self.coordinator.clone())
    }

    fn lazy_link(&self, index: usize) -> Result<Arc<dyn LazyLink>, ClusterError> {
        if self.aggregators.is_empty() {
            return Ok(Arc::new(self.coordinator.clone()));
        }
        let of = self.config.cluster.lazy.aggregator_of.get(index).copied();
        let of = of.unwrap_or(index % self.aggregators.len());
        let address = self
            .aggregators
            .get(of)
            .ok_or_else(|| ClusterError::Setup(format!("worker {index}: aggregator {of} is not in the job")))?;
        let client = AggregatorClient::connect(of, address, self.settings, self.rt.handle(), self.metrics.clone())?;
        Ok(Arc::new(ThroughAggregator { scheduler: self.coordinator.clone(), aggregator: client }))
    }
}

/// A worker's lazy link with aggregator processes: instructions from the
/// scheduler (the coordinator), contributions to its aggregator.
struct ThroughAggregator {
    scheduler: CoordinatorClient,
    aggregator: AggregatorClient,
}

impl LazyLink for ThroughAggregator {
    fn poll(
        &self,
        worker: usize,
        generation: Generation,
        since: u64,
        finished: bool,
        wait: bool,
    ) -> Result<Option<crate::lazy::Instruction>, ClusterError> {
        self.scheduler.poll(worker, generation, since, finished, wait)
    }

    fn contribute(&self, c: crate::lazy::Contribution) -> Result<crate::lazy::Aggregated, ClusterError> {
        self.aggregator.contribute(c)
    }

    fn final_weights(&self, generation: Generation) -> Result<crate::lazy::FinalWeights, ClusterError> {
        self.scheduler.final_weights(generation)
    }
}
