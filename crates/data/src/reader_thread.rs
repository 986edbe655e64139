//! A thread that reads data (a file, a topic) for a consumer, and may be
//! blocked in a read that never returns: a pipe nobody writes, a device, a
//! broker that hangs. A consumer that stops waits a while for it to see its
//! stop flag, then leaves it behind: a stopped run must end.
//!
//! On Linux such a thread runs under `SCHED_BATCH`: as many CPU shares as
//! before, but it does not preempt the thread running where it wakes. On a
//! 2-core machine the reader and the planner share the cores with the
//! step's two compute threads; woken by a channel every batch, each
//! preempted the lookup beside the dense step whenever the scheduler had
//! put them on its core, and the compute threads' yields handed the core
//! back and forth (30k–73k context switches a run against 5k). The MLP on
//! `scripts/bench-tasks`' data ran at 0.75M–0.90M samples/s in such runs
//! and 1.2M–1.3M in the others (its `lookup` phase 0.44–0.60 s against
//! 0.18–0.21 s); under `SCHED_BATCH` no run's `lookup` was slow, and the
//! MLP's median rose 5–9% (every kind's 2–6%). Some runs are still slower
//! where the loaders sit on both cores (docs/benchmarks.md, "the MLP's
//! slow runs").

use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, bounded};

/// How long a stopping consumer waits for its reader thread.
pub const READER_GRACE: Duration = Duration::from_secs(5);

pub struct ReaderThread {
    handle: Option<JoinHandle<()>>,
    /// Disconnected once the thread has ended (its sender dropped with it).
    ended: Receiver<()>,
}

impl ReaderThread {
    pub fn spawn(name: &str, body: impl FnOnce() + Send + 'static) -> std::io::Result<ReaderThread> {
        let (ended_tx, ended) = bounded::<()>(0);
        let handle = std::thread::Builder::new().name(name.into()).spawn(move || {
            let _ended = ended_tx;
            run_as_batch();
            body()
        })?;
        Ok(ReaderThread { handle: Some(handle), ended })
    }

    /// Waits for the thread to end: whether it panicked (once; later calls
    /// say `false`).
    pub fn join(&mut self) -> bool {
        self.handle.take().is_some_and(|h| h.join().is_err())
    }

    /// Waits at most `grace` for the thread to end (its stop flag set by
    /// the caller), then leaves it running, with a warning.
    pub fn join_within(&mut self, grace: Duration) {
        if self.handle.is_none() {
            return;
        }
        match self.ended.recv_timeout(grace) {
            Err(RecvTimeoutError::Timeout) => {
                let name = self.handle.take().and_then(|h| h.thread().name().map(String::from)).unwrap_or_default();
                tracing::warn!("{name}: still blocked in a read {} s after the stop; left behind", grace.as_secs());
            }
            _ => {
                self.join();
            }
        }
    }
}

/// This thread under `SCHED_BATCH` (see the module's doc), where the OS
/// has it. Any thread may take it (no privilege); if it is refused the
/// thread reads as before, at the default policy.
fn run_as_batch() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        #[expect(unsafe_code, reason = "FFI call: sched_setscheduler, which std does not wrap")]
        // SAFETY: `param` is a valid `sched_param` that outlives the call; pid 0 is this thread.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            tracing::debug!("SCHED_BATCH refused for a reader thread: {}", std::io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader thread does not preempt the compute threads it wakes beside
    /// (the module's doc): it runs under `SCHED_BATCH`, the thread that
    /// spawned it under its own policy still.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_reader_thread_runs_under_sched_batch() {
        fn policy() -> i32 {
            #[expect(unsafe_code, reason = "FFI call: sched_getscheduler")]
            // SAFETY: no arguments but pid 0, this thread.
            unsafe {
                libc::sched_getscheduler(0)
            }
        }
        let before = policy();
        let (tx, rx) = bounded::<i32>(1);
        let mut reader = ReaderThread::spawn("policy", move || {
            let _ = tx.send(policy());
        })
        .expect("spawn");
        assert_eq!(rx.recv().expect("the reader's policy"), libc::SCHED_BATCH);
        assert!(!reader.join());
        assert_eq!(policy(), before, "the spawning thread's policy is its own");
    }

    /// A thread blocked for good (here on a channel no one sends to) is left
    /// behind after the grace; one that ends is joined.
    #[test]
    fn a_blocked_reader_is_left_behind_after_the_grace() {
        let (_never_tx, never) = bounded::<()>(0);
        let mut blocked = ReaderThread::spawn("blocked", move || {
            let _ = never.recv();
        })
        .expect("spawn");
        blocked.join_within(Duration::from_millis(50));
        assert!(blocked.handle.is_none(), "let go");
        let (go_tx, go) = bounded::<()>(0);
        let mut ends = ReaderThread::spawn("ends", move || {
            let _ = go.recv();
        })
        .expect("spawn");
        drop(go_tx);
        ends.join_within(Duration::from_secs(60));
        assert!(ends.handle.is_none() && !ends.join());
    }
}
