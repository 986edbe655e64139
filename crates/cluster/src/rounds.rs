//! Round queues with local updates (S2, `cluster.sync = "round"`).
//!
//! A round's items wait in a queue on the loader ([`crate::loader::RoundQueue`]);
//! each worker takes one at a time and steps its own dense replica after
//! each (sparse gradients go to the shards per batch, as in every mode).
//! When the queue is empty for it, the worker sends one message: the sum of
//! its local updates, Δ_k = its weights − the round's starting weights, and
//! M_k, the items it trained. The coordinator merges the round
//! ([`RoundMerge`]) and every worker starts the next round from
//! start + merged Δ: no worker takes an item of round r+1 before round r is
//! merged.
//!
//! The merge rule is `cluster.round_merge`:
//! - `mean` (default): Σ_k M_k·Δ_k / Σ_k M_k, each worker weighted by the
//!   items it trained (coefficients formed in f64, summed in f64, in worker order);
//! - `sum`: Σ_k Δ_k, the seed's plain accumulation.

use std::sync::Arc;

use sparrow_core::config::RoundMergeRule;

use crate::generation::Generation;
use crate::rendezvous::Rendezvous;
use crate::transport::ClusterError;

/// A worker's end of a round.
#[derive(Clone, Debug)]
pub struct RoundUpdate {
    pub worker: usize,
    pub generation: Generation,
    pub round: u64,
    /// Its weights minus the round's starting weights (flat, `ParamStore` order).
    pub delta: Vec<f32>,
    /// Items (batches) it trained in the round: M.
    pub items: u64,
    /// Samples in those items.
    pub samples: u64,
}

/// A merged round: what every worker adds to the round's starting weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MergedRound {
    pub delta: Vec<f32>,
    /// Each worker's M, in worker order.
    pub items: Vec<u64>,
    /// Samples the round trained, all workers.
    pub samples: u64,
}

impl MergedRound {
    /// Items the round trained, all workers (0: the data is over).
    pub fn total_items(&self) -> u64 {
        self.items.iter().sum()
    }
}

/// Merges the updates of one round by `rule` (worker order; the updates of
/// workers with M = 0 are zero and weigh nothing).
pub fn merge(rule: RoundMergeRule, updates: &[(Vec<f32>, u64)]) -> Vec<f32> {
    let len = updates.iter().map(|(d, _)| d.len()).max().unwrap_or(0);
    let total: u64 = updates.iter().map(|(_, m)| m).sum();
    let mut acc = vec![0f64; len];
    for (delta, items) in updates {
        let coefficient = match rule {
            RoundMergeRule::Mean if total == 0 => continue,
            RoundMergeRule::Mean => *items as f64 / total as f64,
            RoundMergeRule::Sum => 1.0,
        };
        if coefficient == 0.0 {
            continue;
        }
        acc.iter_mut().zip(delta).for_each(|(a, &d)| *a += coefficient * f64::from(d));
    }
    acc.into_iter().map(|a| a as f32).collect()
}

/// The coordinator's meeting point of a generation's rounds.
pub struct RoundMerge {
    rule: RoundMergeRule,
    meet: Rendezvous<(Vec<f32>, u64, u64), Arc<MergedRound>>,
}

impl RoundMerge {
    /// Round merges of `workers` workers in generation 0 (a job in one process).
    pub fn new(workers: usize, rule: RoundMergeRule) -> Self {
        RoundMerge::in_generation(workers, rule, Generation::NONE)
    }

    pub fn in_generation(workers: usize, rule: RoundMergeRule, generation: Generation) -> Self {
        RoundMerge { rule, meet: Rendezvous::new("round", workers, generation) }
    }

    /// Adds a worker's update and waits until every worker's is in; returns
    /// the merged round (the same bits to every worker).
    pub fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        let RoundUpdate { worker, generation, round, delta, items, samples } = u;
        let fits = |(mine, _, _): &(Vec<f32>, u64, u64), other: Option<&(Vec<f32>, u64, u64)>| match other {
            Some((first, _, _)) if first.len() != mine.len() => Err(format!(
                "worker {worker}: round {round}: {} values, other workers sent {}",
                mine.len(),
                first.len()
            )),
            _ => Ok(()),
        };
        let rule = self.rule;
        let close = |updates: Vec<(Vec<f32>, u64, u64)>| {
            let samples = updates.iter().map(|u| u.2).sum();
            let items = updates.iter().map(|u| u.1).collect();
            let pairs: Vec<(Vec<f32>, u64)> = updates.into_iter().map(|(d, m, _)| (d, m)).collect();
            Ok(Arc::new(MergedRound { delta: merge(rule, &pairs), items, samples }))
        };
        self.meet
            .arrive(generation, round, worker, (delta, items, samples), fits, close)
            .map_err(|p| p.into_cluster_error("the coordinator", || format!("worker {worker}'s round update")))
    }

    /// Wakes every waiting worker with an error (a role died, the job failed).
    pub fn fail(&self, reason: String) {
        self.meet.fail(reason);
    }

    /// Generation `generation` starts: waiting workers are released.
    pub fn advance(&self, generation: Generation) {
        self.meet.advance(generation);
    }
}

/// Anything that merges rounds: the in-process [`RoundMerge`], the
/// coordinator, or the coordinator over gRPC.
pub trait RoundMerger: Send + Sync {
    fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError>;
}

impl RoundMerger for RoundMerge {
    fn merge_round(&self, u: RoundUpdate) -> Result<Arc<MergedRound>, ClusterError> {
        RoundMerge::merge_round(self, u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_weighs_each_update_by_its_items_and_the_sum_adds_them() {
        // Worker 0 trained 3 items and moved (0.3, -0.6); worker 1 one item and (0.1, 0.2).
        let updates = vec![(vec![0.3f32, -0.6], 3), (vec![0.1f32, 0.2], 1)];
        // By hand: (3·0.3 + 1·0.1)/4 = 0.25, (3·(−0.6) + 1·0.2)/4 = −0.4.
        let mean = merge(RoundMergeRule::Mean, &updates);
        assert!((mean[0] - 0.25).abs() < 1e-7 && (mean[1] + 0.4).abs() < 1e-7, "{mean:?}");
        // By hand: 0.3 + 0.1 = 0.4, −0.6 + 0.2 = −0.4.
        let sum = merge(RoundMergeRule::Sum, &updates);
        assert!((sum[0] - 0.4).abs() < 1e-7 && (sum[1] + 0.4).abs() < 1e-7, "{sum:?}");
        // One worker's round is its own update, bit for bit.
        let alone = vec![(vec![0.1f32, 1e-9, -3.7], 7)];
        assert_eq!(merge(RoundMergeRule::Mean, &alone), alone[0].0);
        assert_eq!(merge(RoundMergeRule::Sum, &alone), alone[0].0);
    }

    #[test]
    fn every_worker_gets_the_same_merge_once_all_are_in() {
        let m = Arc::new(RoundMerge::in_generation(2, RoundMergeRule::Mean, Generation(1)));
        let other = {
            let m = m.clone();
            std::thread::spawn(move || {
                m.merge_round(RoundUpdate {
                    worker: 1,
                    generation: Generation(1),
                    round: 0,
                    delta: vec![1.0],
                    items: 1,
                    samples: 10,
                })
            })
        };
        let mine = m
            .merge_round(RoundUpdate {
                worker: 0,
                generation: Generation(1),
                round: 0,
                delta: vec![0.0],
                items: 3,
                samples: 30,
            })
            .expect("merged");
        let theirs = other.join().expect("thread").expect("merged");
        assert_eq!(mine, theirs);
        assert_eq!(mine.items, vec![3, 1]);
        assert_eq!(mine.samples, 40);
        assert_eq!(mine.delta, vec![0.25]);
        // A second update to the same round is refused; a failure wakes waiters.
        m.fail("gone".into());
        assert!(
            m.merge_round(RoundUpdate {
                worker: 0,
                generation: Generation(1),
                round: 1,
                delta: vec![0.0],
                items: 1,
                samples: 1
            })
            .is_err()
        );
    }
}
