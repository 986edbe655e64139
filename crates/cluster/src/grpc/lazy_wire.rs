//! The lazy aggregation messages on the wire (S4): a worker's
//! contribution, an aggregator's partial sum, the answer with the new
//! weights, and the job's lazy totals; shared by the coordinator's and the
//! aggregators' services and clients.

use std::sync::Arc;

use sparrow_proto::v1 as pb;
use tonic::Status;

use super::coordinator::{position_from, position_to_proto, status};
use super::{bytes_to_f32s, f32s_to_bytes};
use crate::generation::Generation;
use crate::lazy::{Aggregated, Contribution as LazyContribution};
use crate::transport::ClusterError;

pub(super) fn lazy_report_to_pb(r: &crate::lazy::LazyReport) -> pb::LazyReport {
    pb::LazyReport {
        aggregations: r.aggregations,
        local_iterations: r.local_iterations,
        samples: r.samples,
        held_by_utilisation: r.held_by_utilisation,
        held_by_failure_rate: r.held_by_failure_rate,
        backups: r.backups,
        last_utilisation: r.last_utilisation,
        last_failure_rate: r.last_failure_rate,
    }
}

pub(super) fn lazy_report_from_pb(r: pb::LazyReport) -> crate::lazy::LazyReport {
    crate::lazy::LazyReport {
        aggregations: r.aggregations,
        local_iterations: r.local_iterations,
        samples: r.samples,
        held_by_utilisation: r.held_by_utilisation,
        held_by_failure_rate: r.held_by_failure_rate,
        backups: r.backups,
        last_utilisation: r.last_utilisation,
        last_failure_rate: r.last_failure_rate,
    }
}

/// A worker's contribution on the wire (to the scheduler or its aggregator).
pub fn contribution_request(c: LazyContribution) -> pb::LazyRequest {
    pb::LazyRequest {
        worker: c.worker as u32,
        generation: c.generation.number(),
        kind: pb::lazy_request::Kind::Contribute as i32,
        finished: c.finished,
        instruction: c.instruction,
        participants: c.participants.iter().map(|&w| w as u32).collect(),
        values: f32s_to_bytes(&c.values),
        coefficient: c.coefficient,
        iterations: c.iterations,
        samples: c.samples,
        position: Some(position_to_proto(c.position)),
        ..Default::default()
    }
}

/// A contribution as it arrived (the scheduler's or an aggregator's server).
pub fn contribution_from(r: pb::LazyRequest) -> Result<LazyContribution, Status> {
    let worker = r.worker as usize;
    let values = bytes_to_f32s(&r.values, &format!("worker {worker}"), "contribution").map_err(status)?;
    Ok(LazyContribution {
        worker,
        generation: Generation(r.generation),
        instruction: r.instruction,
        participants: r.participants.iter().map(|&w| w as usize).collect(),
        values,
        coefficient: r.coefficient,
        finished: r.finished,
        position: position_from(r.position),
        iterations: r.iterations,
        samples: r.samples,
    })
}

/// The answer to a contribution: the new weights (none to a finished
/// worker) and the job's totals.
pub fn aggregated_reply(done: Aggregated, weights: Option<Arc<Vec<f32>>>) -> pb::LazyReply {
    let weights = weights.or(done.weights);
    pb::LazyReply {
        has_weights: weights.is_some(),
        weights: weights.map(|w| f32s_to_bytes(&w)).unwrap_or_default(),
        job_batches: done.job_batches,
        job_samples: done.job_samples,
        committed: done.committed.is_some(),
        committed_step: done.committed.unwrap_or(0),
        ..Default::default()
    }
}

pub fn aggregated_from(reply: pb::LazyReply, peer: &str) -> Result<Aggregated, ClusterError> {
    let weights = match reply.has_weights {
        true => Some(Arc::new(bytes_to_f32s(&reply.weights, peer, "aggregated weights")?)),
        false => None,
    };
    Ok(Aggregated {
        weights,
        job_batches: reply.job_batches,
        job_samples: reply.job_samples,
        committed: reply.committed.then_some(reply.committed_step),
    })
}

pub(super) fn f64s_to_bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(super) fn partial_from(r: pb::LazyRequest) -> Result<crate::lazy::Partial, Status> {
    let aggregator = r.worker as usize;
    if !r.partial.len().is_multiple_of(8) {
        return Err(Status::invalid_argument(format!(
            "aggregator {aggregator}: a partial sum of {} bytes is not f64s",
            r.partial.len()
        )));
    }
    let sum = r.partial.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect();
    let members = r
        .members
        .into_iter()
        .map(|m| crate::lazy::Member {
            worker: m.worker as usize,
            finished: m.finished,
            position: position_from(m.position),
            iterations: m.iterations,
            samples: m.samples,
            coefficient: m.coefficient,
        })
        .collect();
    Ok(crate::lazy::Partial {
        aggregator,
        generation: Generation(r.generation),
        instruction: r.instruction,
        sum,
        weight: r.coefficient,
        members,
    })
}
