//! The pool's other threads kept awake through a step whose parallel
//! sections are short and many (DIN's: a product, then a pass on one
//! thread, then another product). A rayon worker that finds no work
//! yields 33 times and then sleeps on a futex, in all some 10–20 µs on
//! a 2-core VM; each section after a longer serial pass then pays a
//! wake-up on both threads (the waker's `futex_wake`, the sleeper's
//! context switch), 10–13% of DIN's step in `perf`. Here a task holds
//! an idle worker in a loop that runs whatever the step hands the pool
//! (`rayon::yield_now`), yielding the core to other threads (the
//! loader's, the pipelined lookups') while there is none, until the
//! step ends. DIN's step at batch 1024 (`dense_step`, best of 30, two
//! threads, an AVX-512 Xeon): 4.79–5.17 ms → 4.20–4.31 ms; the kinds
//! whose halves meet once a step move within noise.
//!
//! [`join`] is the same for a join's caller: done with its side first, it
//! waits for the other awake, where `rayon::join`'s caller would sleep
//! and be woken.
//!
//! A job the held thread runs is nested in its loop, so `through` returns
//! only once that job has: a pool that also ran jobs waiting on the
//! step's caller could deadlock here. The compute pool runs none: the
//! step's own sections, and lookups beside it that never wait on it.
//!
//! [`through_step`] holds them through a whole training step (lookup,
//! pooling, the dense step, unpooling, the update), whose serial
//! stretches between parallel sections each let the other thread sleep.
//! A thread held there that finds no job for [`STEP_IDLE`] goes back to
//! the pool, so a step blocked on its data (a quiet topic) does not keep
//! a core busy. `scripts/bench-tasks`' runs (batch 256, two threads, an
//! AMX Xeon VM, five alternations, medians): ESMM 872k → 946k samples/s
//! (its dense phase 0.308 → 0.260 s), PLE 264k → 279k (its update
//! 0.174 → 0.117 s), MMoE 472k → 493k, the MLP 955k → 1,032k, DIN level.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

thread_local! {
    /// The count of threads held by the hold this thread is inside, if any.
    static HOLDING: RefCell<Option<Arc<AtomicUsize>>> = const { RefCell::new(None) };
}

/// `op()` with the current pool's other threads kept awake until it
/// returns (or unwinds). Off a pool, or on a pool of one thread, it is
/// `op()` alone.
pub(crate) fn through<R>(op: impl FnOnce() -> R) -> R {
    held((None, Arc::default()), op)
}

/// How long a thread held through a training step looks for a job before
/// it goes back to the pool (to sleep there): far longer than a step's
/// serial stretches (tens of µs at batch 1024), far shorter than a wait
/// for data that is not there.
pub const STEP_IDLE: Duration = Duration::from_millis(1);

/// [`through`] for a whole training step: a held thread that finds no job
/// for [`STEP_IDLE`] stops holding, and the step's later parallel
/// sections wake it as they would have unheld.
pub fn through_step<R>(op: impl FnOnce() -> R) -> R {
    held((Some(STEP_IDLE), Arc::default()), op)
}

/// `op()` with the pool's other threads held: each until `op` returns, or
/// (`idle`) until it has found no job for that long. `holding` counts
/// the threads held at each moment. Inside a hold of this thread's that
/// still holds every other thread (a dense step in a training step's),
/// `op()` runs as it is: a second hold's spinner, nested in the first's,
/// cost 1.5–2 µs a step, and a step waited for it to end, milliseconds
/// where its thread was switched out (`sparrow bench`'s kinds table, an
/// AMX Xeon VM).
fn held<R>((idle, holding): (Option<Duration>, Arc<AtomicUsize>), op: impl FnOnce() -> R) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2 || rayon::current_thread_index().is_none() {
        return op();
    }
    let outer = HOLDING.with_borrow(Option::clone);
    if outer.is_some_and(|outer| outer.load(Ordering::Acquire) + 1 >= threads) {
        return op();
    }
    let _inside = Inside::enter(holding.clone());
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        // The spinners sit at the bottom of this thread's deque, beneath
        // every job the step pushes: this thread pops its own newest jobs
        // first, so it only reaches them at the scope's end, once `done`
        // is set, and a thief takes them before any of the step's.
        for _ in 1..threads {
            s.spawn(|_| {
                holding.fetch_add(1, Ordering::AcqRel);
                let mut last_job = Instant::now();
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        last_job = Instant::now();
                    } else if idle.is_some_and(|idle| last_job.elapsed() >= idle) {
                        break;
                    } else {
                        std::thread::yield_now();
                    }
                }
                holding.fetch_sub(1, Ordering::AcqRel);
            });
        }
        // Set on unwinding too: a spinner never outlives the step.
        let _done = Done(&done);
        op()
    })
}

/// This thread inside a hold (its held threads' count) until dropped,
/// when the hold it was inside before is restored.
struct Inside(Option<Arc<AtomicUsize>>);

impl Inside {
    fn enter(holding: Arc<AtomicUsize>) -> Inside {
        Inside(HOLDING.replace(Some(holding)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        HOLDING.set(self.0.take());
    }
}

/// Sets its flag when dropped: on return and on unwinding alike.
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// `rayon::join(a, b)` whose caller, done with `a` while another thread
/// still runs `b`, waits awake: it runs what jobs there are and yields
/// the core, where `rayon::join`'s caller sleeps after some 33 yields and
/// is woken by `b`'s thread (a futex wake and a context switch, tens of
/// µs on a VM). The halves of a step (`models/halves.rs`) meet so once a
/// step: ESMM's at batch 1024 (`dense_step`, an AVX-512 Xeon) ran 240–250
/// µs each and their join took 298–310 µs, 275–282 µs with this (most of
/// the rest is the other thread's wake-up as the step starts). Off a
/// pool, or on a pool of one thread, it is `rayon::join`. A panic in
/// either reaches the caller, once both ended.
pub(crate) fn join<RA: Send, RB: Send>(a: impl FnOnce() -> RA + Send, b: impl FnOnce() -> RB + Send) -> (RA, RB) {
    if rayon::current_num_threads() < 2 || rayon::current_thread_index().is_none() {
        return rayon::join(a, b);
    }
    let b_done = AtomicBool::new(false);
    let mut rb = None;
    let ra = rayon::in_place_scope(|s| {
        s.spawn(|_| {
            let _done = Done(&b_done);
            rb = Some(b());
        });
        let ra = a();
        // `b` is this thread's to run if no other has taken it: it is the
        // newest job on its deque, the first `yield_now` runs. If a thief
        // took it, it took every older job first (a held step's spinners
        // among them), so this loop never runs a spinner of its own step.
        while !b_done.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::yield_now();
            }
        }
        ra
    });
    match rb {
        Some(rb) => (ra, rb),
        // The scope resumes `b`'s panic before this point.
        None => unreachable!("the scope ended with `b` neither run nor panicked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool")
    }

    /// `f()` on a thread of its own, or a failure naming the hang: a
    /// worker held past its step would keep `through` from returning.
    fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(value)) => value,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => panic!("{what}: never returned"),
        }
    }

    #[test]
    fn a_step_gets_what_it_computed_on_any_pool_and_off_one() {
        let sum = || {
            let (a, b) = rayon::join(|| (0..1000u64).sum::<u64>(), || (1000..2000u64).sum::<u64>());
            a + b
        };
        assert_eq!(through(sum), 1_999_000, "off a pool");
        for threads in [1, 2, 3] {
            let got = returns("a step", move || pool(threads).install(|| through(sum)));
            assert_eq!(got, 1_999_000, "{threads} threads");
        }
    }

    /// The held worker runs what the step hands the pool: here the step's
    /// first half waits until its second has run, which only another
    /// thread can do. A spinner that took no jobs would hang it. So for a
    /// whole training step's hold.
    #[test]
    fn a_held_worker_runs_the_steps_jobs() {
        fn halves() -> (Option<usize>, Option<usize>) {
            let ran = AtomicBool::new(false);
            rayon::join(
                || {
                    while !ran.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    rayon::current_thread_index()
                },
                || {
                    ran.store(true, Ordering::Release);
                    rayon::current_thread_index()
                },
            )
        }
        let (main, other) = returns("a step waiting on its other half", || pool(2).install(|| through(halves)));
        assert_ne!(main, other, "the second half ran on the other thread");
        let (main, other) =
            returns("a training step waiting on its other half", || pool(2).install(|| through_step(halves)));
        assert_ne!(main, other, "the second half ran on the other thread, in a training step's hold");
    }

    /// `op` waiting until `holding` reads `count`: it returns once a held
    /// thread has started (1) or let go (0).
    fn until(holding: &AtomicUsize, count: usize) {
        while holding.load(Ordering::Acquire) != count {
            std::hint::spin_loop();
        }
    }

    /// Inside a hold with an idle time: returns once the held thread has
    /// held (it runs `b`, this thread in `a` until it has) and let go.
    /// Waiting to see the count at 1 and then at 0 hung where this thread
    /// was switched out while the other held and let go (a busy machine).
    fn held_then_let_go(holding: &AtomicUsize) {
        let ran = AtomicBool::new(false);
        let wait = || {
            while !ran.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        };
        rayon::join(wait, || ran.store(true, Ordering::Release));
        until(holding, 0);
    }

    /// A training step's hold lets a thread go once it has found no job
    /// for its idle time, while the step still runs (a step blocked on
    /// its data): a hold that ignored it would hang this step.
    #[test]
    fn a_training_steps_hold_lets_an_idle_thread_go() {
        let value = returns("a step waiting for its held thread to go", || {
            pool(2).install(|| {
                let holding = Arc::new(AtomicUsize::new(0));
                held((Some(Duration::from_millis(1)), holding.clone()), || {
                    held_then_let_go(&holding);
                    7
                })
            })
        });
        assert_eq!(value, 7);
    }

    /// A dense step's hold has no idle time: its thread is held still
    /// when the step has run for many times a training step's.
    #[test]
    fn a_dense_steps_hold_lasts_the_step() {
        let still_held = returns("a dense step", || {
            pool(2).install(|| {
                let holding = Arc::new(AtomicUsize::new(0));
                held((None, holding.clone()), || {
                    until(&holding, 1);
                    let start = std::time::Instant::now();
                    while start.elapsed() < 20 * STEP_IDLE {
                        std::hint::spin_loop();
                    }
                    holding.load(Ordering::Acquire)
                })
            })
        });
        assert_eq!(still_held, 1, "the held thread let go before the step ended");
    }

    /// A hold inside one that holds every other thread spawns no spinner
    /// of its own (its count stays 0 while the held thread looks for work
    /// for 50 ms, where a spinner of its would be taken in microseconds);
    /// inside one whose thread has let go, it holds the thread itself.
    #[test]
    fn a_hold_inside_a_full_hold_adds_none() {
        let inner_held = returns("a hold inside a full hold", || {
            pool(2).install(|| {
                let outer = Arc::new(AtomicUsize::new(0));
                held((None, outer.clone()), || {
                    until(&outer, 1);
                    let inner = Arc::new(AtomicUsize::new(0));
                    held((None, inner.clone()), || {
                        let start = Instant::now();
                        while inner.load(Ordering::Acquire) == 0 && start.elapsed() < Duration::from_millis(50) {
                            std::hint::spin_loop();
                        }
                        inner.load(Ordering::Acquire)
                    })
                })
            })
        });
        assert_eq!(inner_held, 0, "the inner hold held a thread the outer one held");
        returns("a hold inside one that let go", || {
            pool(2).install(|| {
                let outer = Arc::new(AtomicUsize::new(0));
                held((Some(Duration::from_millis(1)), outer.clone()), || {
                    held_then_let_go(&outer);
                    let inner = Arc::new(AtomicUsize::new(0));
                    held((None, inner.clone()), || until(&inner, 1));
                })
            })
        });
    }

    /// A step that panics lets its held workers go, and its panic reaches
    /// the caller.
    #[test]
    fn a_panicking_step_lets_the_held_workers_go() {
        let caught = returns("a panicking step", || {
            pool(2).install(|| std::panic::catch_unwind(|| through(|| -> u32 { panic!("the step failed") })).is_err())
        });
        assert!(caught, "the step's panic reached the caller");
    }

    /// `join` gives both sides' values, whichever thread ran `b`: on
    /// pools of one, two and three threads, off a pool, and inside a held
    /// step (as the halves run).
    #[test]
    fn a_join_gets_both_values_on_any_pool_and_off_one() {
        let sums = || join(|| (0..1000u64).sum::<u64>(), || (1000..2000u64).sum::<u64>());
        assert_eq!(sums(), (499_500, 1_499_500), "off a pool");
        for threads in [1, 2, 3] {
            let got = returns("a join", move || pool(threads).install(sums));
            assert_eq!(got, (499_500, 1_499_500), "{threads} threads");
            let held = returns("a join in a held step", move || pool(threads).install(|| through(sums)));
            assert_eq!(held, (499_500, 1_499_500), "{threads} threads, held");
        }
    }

    /// With the pool's other thread held elsewhere (a job that waits for
    /// `b`), `b` is the waiting caller's to run: a wait that ran no jobs
    /// would hang here.
    #[test]
    fn a_join_runs_its_second_side_itself_when_no_other_thread_can() {
        let ran_on = returns("a join with the other thread held", || {
            pool(2).install(|| {
                let (started, b_ran) = (AtomicBool::new(false), AtomicBool::new(false));
                rayon::scope(|s| {
                    s.spawn(|_| {
                        started.store(true, Ordering::Release);
                        while !b_ran.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                    });
                    // The job runs on the other thread: this one only
                    // spins until it has started.
                    while !started.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    let (_, b_thread) = join(
                        || (),
                        || {
                            b_ran.store(true, Ordering::Release);
                            rayon::current_thread_index()
                        },
                    );
                    (rayon::current_thread_index(), b_thread)
                })
            })
        });
        assert_eq!(ran_on.0, ran_on.1, "the caller ran `b`");
    }

    /// A panic on either side reaches the caller, after the other side
    /// ended: a wait for a `b` that panicked would never end.
    #[test]
    fn a_panic_on_either_side_of_a_join_reaches_the_caller() {
        for threads in [1, 2] {
            let caught = returns("a join whose second side panics", move || {
                pool(threads).install(|| {
                    let a_ended = AtomicBool::new(false);
                    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        join(|| a_ended.store(true, Ordering::Release), || -> u32 { panic!("b failed") })
                    }))
                    .is_err();
                    (panicked, a_ended.load(Ordering::Acquire))
                })
            });
            assert_eq!(caught, (true, true), "{threads} threads: `b`'s panic, after `a` ended");
            let caught = returns("a join whose first side panics", move || {
                pool(threads).install(|| {
                    let b_ended = AtomicBool::new(false);
                    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        join(|| -> u32 { panic!("a failed") }, || b_ended.store(true, Ordering::Release))
                    }))
                    .is_err();
                    (panicked, b_ended.load(Ordering::Acquire))
                })
            });
            assert_eq!(caught, (true, true), "{threads} threads: `a`'s panic, after `b` ended");
        }
    }
}
