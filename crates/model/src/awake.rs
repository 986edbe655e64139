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
//! A job the held thread runs is nested in its loop, so `through` returns
//! only once that job has: a pool that also ran jobs waiting on the
//! step's caller could deadlock here. The compute pool runs none: the
//! step's own sections, and lookups beside it that never wait on it.

use std::sync::atomic::{AtomicBool, Ordering};

/// `op()` with the current pool's other threads kept awake until it
/// returns (or unwinds). Off a pool, or on a pool of one thread, it is
/// `op()` alone.
pub(crate) fn through<R>(op: impl FnOnce() -> R) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2 || rayon::current_thread_index().is_none() {
        return op();
    }
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        // The spinners sit at the bottom of this thread's deque, beneath
        // every job the step pushes: this thread pops its own newest jobs
        // first, so it only reaches them at the scope's end, once `done`
        // is set, and a thief takes them before any of the step's.
        for _ in 1..threads {
            s.spawn(|_| {
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::thread::yield_now();
                    }
                }
            });
        }
        // Set on unwinding too: a spinner never outlives the step.
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let _done = Done(&done);
        op()
    })
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
            Err(_) => panic!("{what}: `through` never returned"),
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
    /// thread can do. A spinner that took no jobs would hang it.
    #[test]
    fn a_held_worker_runs_the_steps_jobs() {
        let (main, other) = returns("a step waiting on its other half", || {
            pool(2).install(|| {
                through(|| {
                    let ran = AtomicBool::new(false);
                    let (main, other) = rayon::join(
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
                    );
                    (main, other)
                })
            })
        });
        assert_ne!(main, other, "the second half ran on the other thread");
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
}
