//! A step's per-parameter passes after the backward pass (the halves'
//! gradients summed, their finiteness checked, Adam) with each parameter on
//! the same thread of the pool every step. Handed to the pool as jobs,
//! a parameter went to whichever thread took it, and its weights, moments
//! and gradient were in the other core's caches half the time. On the
//! 2-core VMs measured this costs little while both cores share an L3
//! cache, and a lot when they do not: in `dense_step`'s slow state (PLE,
//! 0.80–0.86 ms a step against 0.59–0.65) Adam took 4.7 times as long,
//! the products 1.07 times, and the atomic operations of rayon and of
//! candle's locks 2–4 times, the mark of lines moving between the cores.
//!
//! Each thread takes a contiguous run of the parameters holding about an
//! equal share of the weights, the same run every step (by its index in
//! the pool).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

/// Below this many weights in all, the passes run on the calling thread:
/// handing a share to the other thread (a spawn, its take, its results
/// back) took longer than the share's work.
const SMALL_WEIGHTS: usize = 16 << 10;

/// Each parameter's weights, in `params`' order: what [`on_own_threads`]
/// shares out.
pub(crate) fn param_sizes(params: &crate::params::ParamStore) -> Vec<usize> {
    params.vars().iter().map(|(_, v)| v.elem_count()).collect()
}

/// Thread `t`'s parameters: `shares[t]`, contiguous, about `1 / threads`
/// of the weights each (a parameter is not split).
fn shares(sizes: &[usize], threads: usize) -> Vec<Range<usize>> {
    let total: usize = sizes.iter().sum();
    let mut bounds = vec![0];
    let mut before = 0;
    for (i, size) in sizes.iter().enumerate() {
        // A parameter goes to the thread its middle weight falls in.
        while bounds.len() < threads && (before + size / 2) * threads >= bounds.len() * total {
            bounds.push(i);
        }
        before += size;
    }
    bounds.resize(threads, sizes.len());
    bounds.push(sizes.len());
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// `op` on each job, a job on the thread that owns its parameter (`jobs`:
/// (parameter index, job), in index order; `sizes`: every parameter's
/// weights), the results in `jobs`' order. Each thread of the pool takes
/// the share of its index first, then any share no thread has begun: a
/// thread busy elsewhere (a lookup beside the step) leaves its share to the
/// others rather than hold the step up, and no one waits on a thread that
/// has not started (as `rayon::broadcast` would: inside `awake::through`
/// its caller could then run its own spinner, and never return). Off a
/// pool or on a pool of one thread, the jobs side by side as any pool
/// runs them.
pub(crate) fn on_own_threads<J: Send, R: Send>(
    sizes: &[usize],
    jobs: Vec<(usize, J)>,
    op: impl Fn(J) -> R + Sync,
) -> Vec<R> {
    let threads = rayon::current_num_threads();
    if threads < 2 || rayon::current_thread_index().is_none() {
        return jobs.into_par_iter().map(|(_, j)| op(j)).collect();
    }
    if sizes.iter().sum::<usize>() < SMALL_WEIGHTS {
        return jobs.into_iter().map(|(_, j)| op(j)).collect();
    }
    let shares = shares(sizes, threads);
    let mut parts: Vec<Vec<J>> = shares.iter().map(|_| Vec::new()).collect();
    for (index, job) in jobs {
        let owner = shares.iter().position(|s| s.contains(&index)).unwrap_or(threads - 1);
        parts[owner].push(job);
    }
    let parts: Vec<Mutex<Option<Vec<J>>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    let done: Vec<Mutex<Vec<R>>> = shares.iter().map(|_| Mutex::new(Vec::new())).collect();
    let work = || {
        let me = rayon::current_thread_index().unwrap_or(0) % threads;
        for t in (0..threads).map(|k| (me + k) % threads) {
            let part = parts[t].lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(part) = part {
                let results: Vec<R> = part.into_iter().map(&op).collect();
                *done[t].lock().unwrap_or_else(PoisonError::into_inner) = results;
            }
        }
    };
    // The caller, done with its shares, waits for the others awake (as
    // `awake::join`'s does): in the scope's own wait it fell asleep and was
    // woken, 6–8 µs of PLE's Adam pass of about 60 (`dense_step`, `avx2`).
    let finished = AtomicUsize::new(1);
    rayon::in_place_scope(|s| {
        for _ in 1..threads {
            s.spawn(|_| {
                // Counted on unwinding too: the scope resumes the panic.
                let _finished = Finished(&finished);
                work();
            });
        }
        work();
        // A share's job no thread took is this thread's newest: the first
        // `yield_now` runs it (it finds every share taken). A thief takes
        // the oldest job first, so one that took a share's job took every
        // older one (a hold's spinners) before it: this loop runs none.
        while finished.load(Ordering::Acquire) < threads {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::yield_now();
            }
        }
    });
    done.into_iter().flat_map(|d| d.into_inner().unwrap_or_else(PoisonError::into_inner)).collect()
}

/// Counts a share's job finished when dropped.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares are contiguous, cover every parameter once, split the weights
    /// about evenly, and are the same for the same sizes.
    #[test]
    fn shares_split_the_weights_in_contiguous_runs() {
        let sizes = [2688, 210, 2688, 210, 4160, 4160, 294, 4160, 975, 2080, 33, 132];
        for threads in 1..=5 {
            let s = shares(&sizes, threads);
            assert_eq!(s.len(), threads);
            assert_eq!((s[0].start, s[threads - 1].end), (0, sizes.len()));
            assert!(s.windows(2).all(|w| w[0].end == w[1].start), "{s:?}");
            let total: usize = sizes.iter().sum();
            for r in &s {
                let mine: usize = sizes[r.clone()].iter().sum();
                assert!(mine.abs_diff(total / threads) <= 4160, "{threads} threads: {s:?}");
            }
            assert_eq!(s, shares(&sizes, threads));
        }
        assert_eq!(shares(&[], 2), vec![0..0, 0..0]);
        assert_eq!(shares(&[5], 3).iter().map(|r| r.len()).sum::<usize>(), 1);
    }

    /// Every job runs once, its result in the jobs' order; where every
    /// thread is in the pass (each share's first job waits at a barrier
    /// for all of them), each share runs on the thread of its index, step
    /// after step; a pool of one runs every share.
    #[test]
    fn each_thread_takes_the_share_of_its_index() {
        // 40 parameters of 2,000 to 4,220 weights: over `SMALL_WEIGHTS`.
        let sizes: Vec<usize> = (0..40).map(|i| 2000 + 370 * (i % 7)).collect();
        assert!(sizes.iter().sum::<usize>() >= SMALL_WEIGHTS);
        let firsts: Vec<usize> = shares(&sizes, 3).iter().map(|r| r.start).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        let barrier = std::sync::Barrier::new(3);
        let run = |pool: &rayon::ThreadPool| {
            pool.install(|| {
                // A parameter without a job (here, each one ≡ 3 mod 5 but a share's first).
                let jobs: Vec<(usize, usize)> =
                    (0..40).filter(|i| i % 5 != 3 || firsts.contains(i)).map(|i| (i, i)).collect();
                on_own_threads(&sizes, jobs, |i| {
                    if firsts.contains(&i) && rayon::current_num_threads() == 3 {
                        barrier.wait();
                    }
                    (i, rayon::current_thread_index())
                })
            })
        };
        let shares = shares(&sizes, 3);
        for _ in 0..20 {
            let got = run(&pool);
            let indices: Vec<usize> = got.iter().map(|&(i, _)| i).collect();
            assert_eq!(indices, (0..40).filter(|i| i % 5 != 3 || firsts.contains(i)).collect::<Vec<_>>());
            for &(i, thread) in &got {
                let share = shares.iter().position(|s| s.contains(&i));
                assert_eq!(thread, share, "job {i} ran on the thread of its share");
            }
        }
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        assert_eq!(run(&one).len(), run(&pool).len());
    }

    /// A model of few weights has its passes run on the calling thread, in
    /// order, as many results as jobs, while the pool's other thread is
    /// held awake looking for work (which takes a larger model's share).
    #[test]
    fn few_weights_stay_on_the_calling_thread() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        // A job long enough for the held thread to take its share's spawn.
        let slow = |i: usize| {
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_micros(200) {
                std::hint::spin_loop();
            }
            (i, rayon::current_thread_index())
        };
        let run = |sizes: &[usize; 4]| {
            pool.install(|| {
                let me = rayon::current_thread_index();
                let got = crate::awake::through(|| on_own_threads(sizes, (0..4).map(|i| (i, i)).collect(), slow));
                assert_eq!(got.iter().map(|&(i, _)| i).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
                got.iter().all(|&(_, thread)| thread == me)
            })
        };
        for _ in 0..20 {
            assert!(run(&[SMALL_WEIGHTS / 4 - 1; 4]), "a small model's passes left the calling thread");
        }
    }

    /// A share's job that panics on the other thread ends the pass with
    /// that panic, on the caller, which waited for it awake: it does not
    /// wait for good. Each share's first job waits at a barrier for both
    /// threads, so the panic is on the thread that is not the caller.
    #[test]
    fn a_panicking_share_ends_the_pass_with_its_panic() {
        let sizes: Vec<usize> = vec![SMALL_WEIGHTS; 4];
        let firsts: Vec<usize> = shares(&sizes, 2).iter().map(|r| r.start).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
            let barrier = std::sync::Barrier::new(2);
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| {
                    let caller = rayon::current_thread_index();
                    on_own_threads(&sizes, (0..4).map(|i| (i, i)).collect(), |i| {
                        if firsts.contains(&i) {
                            barrier.wait();
                        }
                        assert!(rayon::current_thread_index() == caller, "job {i} panics off the caller");
                        i
                    })
                })
            }));
            let _ = tx.send(got.map_err(|p| p.downcast_ref::<String>().cloned().unwrap_or_default()));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the pass ended");
        let message = got.expect_err("the other thread's share panicked");
        assert!(message.contains("panics off the caller"), "{message}");
    }
}
