//! `--watch`: a thread that reads `LATEST` every interval and serves each
//! new export it names. It outlives any error of an export (unreadable,
//! damaged, crafted, even a panic in a reader): the served model stays, the
//! error is logged once and counted on `/metrics`, and readiness turns
//! false once the newest export has failed for longer than `unready_after`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::served::Served;

/// Retries of an export that failed wait at most this long (each failure
/// doubles the wait from the interval): a bad export is not re-read and
/// re-hashed every interval.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Whether the watch keeps up: since when the newest export has failed, and why.
#[derive(Default)]
pub struct WatchHealth {
    failing: parking_lot::Mutex<Option<(Instant, String)>>,
    unready_after: Duration,
}

impl WatchHealth {
    pub fn new(unready_after: Duration) -> WatchHealth {
        WatchHealth { failing: parking_lot::Mutex::new(None), unready_after }
    }

    /// None while ready; else why not (for the readiness probe's body).
    pub fn unready(&self) -> Option<String> {
        let failing = self.failing.lock();
        let (since, error) = failing.as_ref()?;
        let for_long = since.elapsed();
        (for_long >= self.unready_after).then(|| {
            format!(
                "--watch has failed for {:.0} s (more than --watch-unready-after-ms): {error}",
                for_long.as_secs_f64()
            )
        })
    }

    fn ok(&self) {
        *self.failing.lock() = None;
    }

    /// Records a failure; whether it is a new one (to be logged).
    fn failed(&self, error: &str) -> bool {
        let mut failing = self.failing.lock();
        match failing.as_mut() {
            Some((_, last)) if last == error => false,
            Some((_, last)) => {
                *last = error.to_string();
                true
            }
            None => {
                *failing = Some((Instant::now(), error.to_string()));
                true
            }
        }
    }
}

/// Applies each new export `LATEST` names, every `every`, while `running`.
/// An export that failed is tried again after a wait that doubles up to
/// [`MAX_BACKOFF`], while LATEST still names it; LATEST itself is read
/// every interval, so a fixed LATEST is served at once.
pub fn watch(served: &Served, health: &WatchHealth, every: Duration, running: &AtomicBool) {
    // The export that failed, when to try it again, and the wait after that.
    let mut failed: Option<(std::path::PathBuf, Instant, Duration)> = None;
    while running.load(Ordering::SeqCst) {
        std::thread::sleep(every);
        let newest = served.newest().ok();
        if let (Some((dir, retry_at, _)), Some(newest)) = (&failed, &newest)
            && dir == newest
            && Instant::now() < *retry_at
        {
            continue;
        }
        // A reader's panic is an error like another: this thread must not die.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| served.refresh()))
            .map_err(|panic| panicked(&*panic))
            .and_then(|r| r.map_err(|e| e.to_string()));
        match outcome {
            Ok(swap) => {
                health.ok();
                served.metrics.watch_failing.set(0);
                failed = None;
                if let Some(swap) = swap {
                    log_swap(&swap);
                }
            }
            Err(message) => {
                served.metrics.watch_errors.inc();
                served.metrics.watch_failing.set(1);
                if health.failed(&message) {
                    tracing::warn!("--watch: still serving step {}: {message}", served.step());
                }
                let wait = match &failed {
                    Some((dir, _, wait)) if Some(dir) == newest.as_ref() => *wait,
                    _ => every,
                };
                failed = newest.map(|dir| (dir, Instant::now() + wait, (wait * 2).min(MAX_BACKOFF)));
            }
        }
    }
}

/// A reader's panic as an error: its message, with the export it was reading.
fn panicked(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    format!("reading the newest export failed: {what}")
}

fn log_swap(swap: &crate::served::Swap) {
    let secs = |d: Option<Duration>| d.map_or_else(|| "?".to_string(), |d| format!("{:.3}", d.as_secs_f64()));
    let what = match swap.deltas {
        0 => format!("full export, {} rows", swap.rows),
        n => format!("{n} incremental export(s), {} rows", swap.rows),
    };
    tracing::info!(
        "serving step {} from {} ({what}); requests waited {:.3} ms; updates {}–{} s old",
        swap.step,
        swap.export.display(),
        swap.locked.as_secs_f64() * 1e3,
        secs(swap.staleness_min),
        secs(swap.staleness_max),
    );
}

/// Sets the flag when dropped: the `--watch` thread ends with the server.
pub struct StopOnDrop(pub Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_turns_false_only_after_the_stated_time() {
        let health = WatchHealth::new(Duration::ZERO);
        assert_eq!(health.unready(), None);
        assert!(health.failed("bad export"));
        assert!(!health.failed("bad export"), "the same error is not new");
        assert!(health.unready().is_some_and(|m| m.contains("bad export")));
        health.ok();
        assert_eq!(health.unready(), None);
        let patient = WatchHealth::new(Duration::from_secs(3600));
        patient.failed("bad export");
        assert_eq!(patient.unready(), None, "failing for less than the stated time");
    }
}
