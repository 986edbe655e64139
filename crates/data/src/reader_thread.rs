//! A thread that reads data (a file, a topic) for a consumer, and may be
//! blocked in a read that never returns: a pipe nobody writes, a device, a
//! broker that hangs. A consumer that stops waits a while for it to see its
//! stop flag, then leaves it behind: a stopped run must end.

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

#[cfg(test)]
mod tests {
    use super::*;

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
