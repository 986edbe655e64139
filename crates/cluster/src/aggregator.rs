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

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::generation::Generation;
use crate::lazy::{Aggregated, Contribution, Member, Partial, partial_sum};
use crate::transport::ClusterError;

/// Where an aggregator sends its partial sums: the scheduler.
pub trait PartialSink: Send + Sync {
    fn contribute_partial(&self, p: Partial) -> Result<(Aggregated, Arc<Vec<f32>>), ClusterError>;
}

/// What the scheduler answered for an instruction, shared by the
/// aggregator's waiting workers.
type Outcome = Result<(Aggregated, Arc<Vec<f32>>), (bool, String)>;

struct Open {
    instruction: u64,
    /// This aggregator's participants of the instruction.
    expected: Vec<usize>,
    received: BTreeMap<usize, Contribution>,
    outcome: Option<Outcome>,
    /// Participants that took the outcome (the instruction is dropped after the last).
    taken: usize,
}

/// Aggregator `index` for one generation of the job.
pub struct AggregatorServer {
    index: usize,
    generation: Generation,
    /// Worker → aggregator (`cluster.lazy.aggregator_of`, else k mod K).
    mapping: Vec<usize>,
    aggregators: usize,
    upstream: Arc<dyn PartialSink>,
    /// Instructions in progress, by id: at most one still summing, and
    /// answered ones until every participant took the answer (a finished
    /// worker may take it after the next instruction began).
    open: Mutex<BTreeMap<u64, Open>>,
    changed: Condvar,
    failed: Mutex<Option<String>>,
}

impl AggregatorServer {
    pub fn new(
        index: usize,
        generation: Generation,
        mapping: Vec<usize>,
        aggregators: usize,
        upstream: Arc<dyn PartialSink>,
    ) -> Self {
        AggregatorServer {
            index,
            generation,
            mapping,
            aggregators: aggregators.max(1),
            upstream,
            open: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
            failed: Mutex::new(None),
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
        if c.generation != self.generation {
            return Err(ClusterError::StaleGeneration {
                peer: self.name(),
                what: format!("worker {}'s contribution", c.worker),
                found: c.generation,
                serving: self.generation,
            });
        }
        if !self.owns(c.worker) {
            return Err(ClusterError::Setup(format!(
                "{}: worker {} belongs to another aggregator (cluster.lazy.aggregator_of)",
                self.name(),
                c.worker
            )));
        }
        let (worker, finished, id) = (c.worker, c.finished, c.instruction);
        let mut open = self.open.lock();
        if !open.contains_key(&id) {
            if let Some(o) = open.values().find(|o| o.outcome.is_none()) {
                return Err(ClusterError::Setup(format!(
                    "{}: worker {worker} sent for instruction {id} while instruction {} is still open",
                    self.name(),
                    o.instruction
                )));
            }
            let expected: Vec<usize> = c.participants.iter().copied().filter(|&w| self.owns(w)).collect();
            open.insert(id, Open { instruction: id, expected, received: BTreeMap::new(), outcome: None, taken: 0 });
        }
        let Some(o) = open.get_mut(&id) else {
            return Err(ClusterError::Setup(format!("{}: instruction {id} vanished", self.name())));
        };
        if !o.expected.contains(&worker) || o.received.contains_key(&worker) || o.outcome.is_some() {
            return Err(ClusterError::Setup(format!(
                "{}: worker {worker} is not expected for instruction {id}",
                self.name()
            )));
        }
        o.received.insert(worker, c);
        if o.received.len() == o.expected.len() {
            let partial = self.partial(o);
            drop(open);
            let outcome = match partial {
                Ok(partial) => {
                    crate::faults::point("aggregator.partial");
                    self.upstream.contribute_partial(partial).map_err(|e| (e.may_be_a_death(), e.to_string()))
                }
                // Every waiting worker gets the error, not a wait.
                Err(e) => Err((false, e.to_string())),
            };
            open = self.open.lock();
            if let Some(o) = open.get_mut(&id) {
                o.outcome = Some(outcome);
            }
            self.changed.notify_all();
        }
        loop {
            if let Some(reason) = self.failed.lock().clone() {
                return Err(ClusterError::Rpc { peer: self.name(), method: "contribute", message: reason });
            }
            let outcome = open.get_mut(&id).and_then(|o| {
                let outcome = o.outcome.clone()?;
                o.taken += 1;
                Some((outcome, o.taken == o.expected.len()))
            });
            let outcome = outcome.map(|(outcome, last)| {
                if last {
                    open.remove(&id);
                }
                outcome
            });
            match outcome {
                Some(Ok((aggregated, weights))) => {
                    return Ok(Aggregated { weights: (!finished).then_some(weights), ..aggregated });
                }
                Some(Err((true, message))) => {
                    return Err(ClusterError::Rpc { peer: self.name(), method: "contribute", message });
                }
                Some(Err((false, message))) => return Err(ClusterError::Setup(format!("{}: {message}", self.name()))),
                None => {}
            }
            self.changed.wait_for(&mut open, std::time::Duration::from_millis(100));
        }
    }

    /// The partial sum over the received contributions, in worker order.
    fn partial(&self, o: &Open) -> Result<Partial, ClusterError> {
        let len = o.received.values().next().map_or(0, |c| c.values.len());
        if let Some(c) = o.received.values().find(|c| c.values.len() != len) {
            return Err(ClusterError::Setup(format!(
                "{}: worker {} sent {} values, another {len}",
                self.name(),
                c.worker,
                c.values.len()
            )));
        }
        let list: Vec<(&[f32], f64)> = o.received.values().map(|c| (c.values.as_slice(), c.coefficient)).collect();
        let (sum, weight) = partial_sum(&list, len);
        let members = o.received.values().map(Member::of).collect();
        Ok(Partial {
            aggregator: self.index,
            generation: self.generation,
            instruction: o.instruction,
            sum,
            weight,
            members,
        })
    }

    /// This generation is over: every waiting worker gets an error.
    pub fn fail(&self, reason: String) {
        self.failed.lock().get_or_insert(reason);
        self.changed.notify_all();
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
                    Arc::new(AggregatorServer::new(i, Generation(1), vec![], 2, lazy.clone() as Arc<dyn PartialSink>))
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
            let a = Arc::new(AggregatorServer::new(0, Generation(1), vec![], 1, Arc::new(Echo)));
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
            std::thread::sleep(std::time::Duration::from_millis(2));
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
        let a = AggregatorServer::new(0, Generation(1), vec![], 2, lazy as Arc<dyn PartialSink>);
        let err = a.contribute(contribution(1, 1, &[0, 1], vec![1.0], 1.0)).expect_err("worker 1 is aggregator 1's");
        assert!(err.to_string().contains("belongs to another aggregator"), "{err}");
        let mut stale = contribution(0, 1, &[0, 1], vec![1.0], 1.0);
        stale.generation = Generation(0);
        assert!(matches!(a.contribute(stale), Err(ClusterError::StaleGeneration { .. })));
    }
}
