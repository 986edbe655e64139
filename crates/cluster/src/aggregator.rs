//! S4's aggregators as processes (`sparrow aggregator`, `launch
//! --aggregators K`).
//!
//! Worker k sends its contribution to aggregator `aggregator_of[k]` (or
//! k mod K). The aggregator waits for every participant of the instruction
//! that belongs to it, sums c_k·v_k over them in worker order (f64, the same
//! arithmetic as in process: [`crate::lazy::partial_sum`]) and sends the
//! scheduler one partial sum with each worker's share. The scheduler adds
//! the partial sums in aggregator order, divides by Σ c_k, computes the new
//! weights (and backs them up) and answers every aggregator, which hands
//! them to its workers that have not finished.

use std::sync::Arc;

use crate::generation::Generation;
use crate::lazy::{Aggregated, Contribution, Member, Partial, partial_sum};
use crate::rendezvous::{Parted, Rendezvous};
use crate::transport::ClusterError;

/// Where an aggregator sends its partial sums: the scheduler.
pub trait PartialSink: Send + Sync {
    fn contribute_partial(&self, p: Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError>;
}

/// What the scheduler answered for an instruction, shared by the
/// aggregator's waiting workers: its error says whether the scheduler may
/// have died (the workers then rejoin) or refused the sum.
type Outcome = Result<(Aggregated, Arc<Vec<f32>>), (bool, String)>;

/// Aggregator `index` for one generation of the job.
pub struct AggregatorServer {
    index: usize,
    generation: Generation,
    /// Worker → aggregator (`cluster.lazy.aggregator_of`, else k mod K).
    mapping: Vec<usize>,
    aggregators: usize,
    upstream: Arc<dyn PartialSink>,
    /// An instruction's participants that belong here meet at its number:
    /// at most one still summing, and answered ones until every participant
    /// took the answer (a finished worker may take it after the next
    /// instruction began). The last to arrive sends the partial sum.
    meet: Rendezvous<Contribution, Outcome>,
}

impl AggregatorServer {
    pub fn new(
        index: usize,
        generation: Generation,
        mapping: Vec<usize>,
        (workers, aggregators): (usize, usize),
        upstream: Arc<dyn PartialSink>,
    ) -> Self {
        AggregatorServer {
            index,
            generation,
            mapping,
            aggregators: aggregators.max(1),
            upstream,
            meet: Rendezvous::new("instruction", workers, generation).one_at_a_time(),
        }
    }

    fn name(&self) -> String {
        format!("aggregator {}", self.index)
    }

    fn owns(&self, worker: usize) -> bool {
        self.mapping.get(worker).copied().unwrap_or(worker % self.aggregators) == self.index
    }

    /// A worker's contribution: blocks until the scheduler answered the
    /// aggregation; the new weights, or none to a worker whose data is finished.
    pub fn contribute(&self, c: Contribution) -> Result<Aggregated, ClusterError> {
        if !self.owns(c.worker) {
            return Err(ClusterError::Setup(format!(
                "{}: worker {} belongs to another aggregator (cluster.lazy.aggregator_of)",
                self.name(),
                c.worker
            )));
        }
        let (worker, finished, id, generation) = (c.worker, c.finished, c.instruction, c.generation);
        let mine: Vec<usize> = c.participants.iter().copied().filter(|&w| self.owns(w)).collect();
        let answered = self.meet.arrive_among(generation, id, worker, &mine, c, |received| {
            // Every waiting worker gets the outcome, an error included.
            Ok(match self.partial(id, &received) {
                Ok(partial) => {
                    crate::faults::point("aggregator.partial");
                    self.upstream.contribute_partial(partial).map_err(|e| (e.may_be_a_death(), e.to_string()))
                }
                Err(e) => Err((false, e.to_string())),
            })
        });
        let name = self.name();
        match answered {
            Ok(Ok((aggregated, weights))) => Ok(Aggregated { weights: (!finished).then_some(weights), ..aggregated }),
            Ok(Err((true, message))) => Err(ClusterError::Rpc { peer: name, method: "contribute", message }),
            Ok(Err((false, message))) => Err(ClusterError::Setup(format!("{name}: {message}"))),
            Err(Parted::Failed(message)) => Err(ClusterError::Rpc { peer: name, method: "contribute", message }),
            Err(Parted::Refused(reason)) => Err(ClusterError::Setup(format!("{name}: {reason}"))),
            Err(parted) => Err(parted.into_cluster_error(&name, || format!("worker {worker}'s contribution"))),
        }
    }

    /// The partial sum over the received contributions (in worker order).
    fn partial(&self, instruction: u64, received: &[Contribution]) -> Result<Partial, ClusterError> {
        let len = received.first().map_or(0, |c| c.values.len());
        if let Some(c) = received.iter().find(|c| c.values.len() != len) {
            return Err(ClusterError::Setup(format!(
                "{}: worker {} sent {} values, another {len}",
                self.name(),
                c.worker,
                c.values.len()
            )));
        }
        let list: Vec<(&[f32], f64)> = received.iter().map(|c| (c.values.as_slice(), c.coefficient)).collect();
        let (sum, weight) = partial_sum(&list, len);
        let members = received.iter().map(Member::of).collect();
        Ok(Partial { aggregator: self.index, generation: self.generation, instruction, sum, weight, members })
    }

    /// This generation is over: every waiting worker gets an error.
    pub fn fail(&self, reason: String) {
        self.meet.fail(reason);
    }

    /// Blocks until `n` workers wait at instruction `id` (tests order by it).
    pub fn wait_for_waiters(&self, id: u64, n: usize) {
        self.meet.wait_for_waiters(id, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lazy::{Lazy, LazyLink};
    use sparrow_core::config::LazyConfig;

    impl PartialSink for Lazy {
        fn contribute_partial(&self, p: Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError> {
            Lazy::contribute_partial(self, p)
        }
    }

    fn contribution(worker: usize, id: u64, participants: &[usize], values: Vec<f32>, c: f64) -> Contribution {
        Contribution {
            worker,
            generation: Generation(1),
            instruction: id,
            participants: participants.to_vec(),
            values,
            coefficient: c,
            finished: worker == 2,
            position: Default::default(),
            iterations: 1,
            samples: 4,
        }
    }

    /// Three workers, two aggregators (0 ← workers 0, 2; 1 ← worker 1): the
    /// weights equal the scheduler's own aggregation of the same
    /// contributions, bit for bit; the finished worker gets none.
    #[test]
    fn aggregators_summing_apart_give_the_schedulers_own_weights() {
        let cfg = LazyConfig { probe_interval_ms: 1, ..LazyConfig::default() };
        let start = vec![0.25f32, -1.0, 3.0];
        let values = [vec![0.1f32, 0.2, -0.3], vec![1e-3, 7.0, 0.5], vec![-0.7, 0.01, 2.0]];
        let coefficients = [0.8, 0.7, 0.5];
        let run = |apart: bool| -> Vec<Option<Arc<Vec<f32>>>> {
            let lazy = Arc::new(Lazy::new(&cfg, 3, 2, 0.1, start.clone()));
            std::thread::sleep(std::time::Duration::from_millis(2));
            let aggregators: Vec<Arc<AggregatorServer>> = (0..2)
                .map(|i| {
                    Arc::new(AggregatorServer::new(
                        i,
                        Generation(1),
                        vec![],
                        (3, 2),
                        lazy.clone() as Arc<dyn PartialSink>,
                    ))
                })
                .collect();
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..3)
                    .map(|w| {
                        let (lazy, aggregators, values) = (lazy.clone(), &aggregators, &values);
                        scope.spawn(move || {
                            let i = lazy.poll(w, 1, w == 2, true).expect("poll").expect("an instruction");
                            let c = contribution(w, i.id, &i.participants, values[w].clone(), coefficients[w]);
                            let done = match apart {
                                true => aggregators[w % 2].contribute(c),
                                false => LazyLink::contribute(&*lazy, c),
                            };
                            done.expect("aggregated").weights
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("worker")).collect()
            })
        };
        let in_process = run(false);
        let apart = run(true);
        assert!(apart[2].is_none() && in_process[2].is_none(), "a finished worker gets no weights");
        let apart = apart[0].clone().expect("weights");
        assert_eq!(Some(&apart), in_process[0].as_ref(), "the same weights, bit for bit");
        assert_eq!(apart_bits(&apart), apart_bits(in_process[1].as_ref().expect("weights")));
        // By hand: start + Σ c·v / Σ c.
        for (i, x) in apart.iter().enumerate() {
            let sum: f64 = (0..3).map(|w| coefficients[w] * f64::from(values[w][i])).sum();
            let expected = f64::from(start[i]) + sum / 2.0;
            assert!((f64::from(*x) - expected).abs() < 1e-6, "{i}: {x} vs {expected}");
        }
    }

    /// Answers every partial sum at once with its instruction number as weights.
    struct Echo;

    impl PartialSink for Echo {
        fn contribute_partial(&self, p: Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError> {
            let done = Aggregated { weights: None, job_batches: p.instruction, job_samples: 0, committed: None };
            Ok((done, Arc::new(vec![p.instruction as f32])))
        }
    }

    /// A finished worker may read its answer only after its aggregator's
    /// other worker went on to the next instruction: it still gets it
    /// (repeated: the order of the wake-ups is the scheduler's).
    #[test]
    fn a_finished_worker_gets_its_answer_after_the_next_instruction_began() {
        for _ in 0..200 {
            let a = Arc::new(AggregatorServer::new(0, Generation(1), vec![], (2, 1), Arc::new(Echo)));
            let (tx, rx) = crossbeam_channel::bounded(1);
            let finished = {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut c = contribution(0, 1, &[0, 1], vec![1.0], 1.0);
                    c.finished = true;
                    let _ = tx.send(a.contribute(c));
                })
            };
            // Worker 0 waits in its contribution; worker 1 completes
            // instruction 1, then sends for instruction 2 alone.
            a.wait_for_waiters(1, 1);
            let first = a.contribute(contribution(1, 1, &[0, 1], vec![2.0], 1.0)).expect("instruction 1");
            assert_eq!(first.job_batches, 1);
            let second = a.contribute(contribution(1, 2, &[1], vec![3.0], 1.0)).expect("instruction 2");
            assert_eq!(second.weights.as_deref(), Some(&vec![2.0f32]));
            let answer = rx.recv_timeout(std::time::Duration::from_secs(2)).expect("worker 0 was answered");
            assert_eq!(answer.expect("aggregated").job_batches, 1, "instruction 1's answer");
            finished.join().expect("thread");
        }
    }

    fn apart_bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_worker_of_another_aggregator_or_generation_is_refused() {
        let lazy = Arc::new(Lazy::new(&LazyConfig::default(), 2, 2, 0.1, vec![0.0]));
        let a = AggregatorServer::new(0, Generation(1), vec![], (2, 2), lazy as Arc<dyn PartialSink>);
        let err = a.contribute(contribution(1, 1, &[0, 1], vec![1.0], 1.0)).expect_err("worker 1 is aggregator 1's");
        assert!(err.to_string().contains("belongs to another aggregator"), "{err}");
        let mut stale = contribution(0, 1, &[0, 1], vec![1.0], 1.0);
        stale.generation = Generation(0);
        assert!(matches!(a.contribute(stale), Err(ClusterError::StaleGeneration { .. })));
    }
}
