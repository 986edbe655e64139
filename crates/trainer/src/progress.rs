//! Progress on stderr: a bar on a terminal, periodic plain lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// Where a training run stands, handed to an observer at every logging
/// interval (`train.log_interval_steps`): what the Python package draws its
/// progress bar from.
#[derive(Clone, Debug, Serialize)]
pub struct ProgressUpdate {
    pub step: u64,
    pub epoch: u64,
    pub samples: u64,
    /// How far into the training data the run is, over all epochs: bytes of
    /// text read, and of the whole run (None for a compressed file, whose
    /// size says nothing about its text).
    pub bytes_done: u64,
    pub bytes_total: Option<u64>,
    /// Mean training log-loss and samples/s over the interval.
    pub train_logloss: f64,
    pub samples_per_sec: f64,
    /// Rows in the table, and rows deleted so far by `ttl_steps`/`ttl_secs`
    /// and by `max_rows`.
    pub embedding_rows: u64,
    pub expired_rows: u64,
    pub evicted_rows: u64,
    /// Progressive validation (`train.online_window_samples`), if on.
    pub online: Option<crate::online::OnlineFigures>,
    /// `[data.stream]`: records behind the partitions' ends, and seconds
    /// behind the newest trained record.
    pub stream_lag_records: Option<u64>,
    pub stream_lag_secs: Option<f64>,
    /// Records stamped past `data.stream.max_future_secs` ahead, so far.
    pub stream_future_records: Option<u64>,
    /// Offsets the broker skipped, and logs found gone backwards, so far.
    pub stream_gap_records: Option<u64>,
    pub stream_offset_resets: Option<u64>,
}

pub struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    /// `total` is in the unit of later `set_position` calls (bytes of input).
    pub fn new(total: Option<u64>, quiet: bool) -> Progress {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total.unwrap_or(0));
            let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Progress { bar, quiet }
    }

    pub fn set_position(&self, pos: u64, message: &str) {
        if let Some(bar) = &self.bar {
            bar.set_position(pos);
            bar.set_message(message.to_string());
        }
    }

    /// A plain status line (only when there is no bar, so logs stay readable).
    pub fn line(&self, text: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(_) => {}
            None => tracing::info!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
