use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    // `error`, not `source`: the message already includes it, so it must not
    // be printed a second time as the cause.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error(
        "{path}: {bad_rows} malformed rows, more than data.max_bad_rows = {max_bad_rows} (last at line {line}: {reason})"
    )]
    TooManyBadRows { path: PathBuf, bad_rows: u64, max_bad_rows: u64, line: u64, reason: String },
    #[error("{path}: schema: {message}")]
    Schema { path: PathBuf, message: String },
    #[error("{path}: parquet: {message}")]
    Parquet { path: PathBuf, message: String },
    #[error("data.{key} is not set: {what}")]
    MissingPath { key: &'static str, what: &'static str },
    #[error("data stream stopped unexpectedly (its reader thread panicked)")]
    ReaderPanicked,
}

impl DataError {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        DataError::Io { path: path.to_path_buf(), error: source }
    }
}

/// Counts malformed rows, reports the first few one by one, and stops the
/// job once the budget is exceeded. The count is shared with the caller.
#[derive(Clone, Debug)]
pub struct BadRows {
    pub count: Arc<AtomicU64>,
    pub max_bad_rows: u64,
    pub report_first: u64,
}

impl BadRows {
    pub fn new(max_bad_rows: u64, report_first: u64) -> Self {
        BadRows { count: Arc::new(AtomicU64::new(0)), max_bad_rows, report_first }
    }

    pub fn total(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn record(&self, path: &std::path::Path, line: u64, reason: String) -> Result<(), DataError> {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= self.report_first {
            eprintln!("warning: skipped malformed row {}:{line}: {reason}", path.display());
        }
        if n > self.max_bad_rows {
            return Err(DataError::TooManyBadRows {
                path: path.to_path_buf(),
                bad_rows: n,
                max_bad_rows: self.max_bad_rows,
                line,
                reason,
            });
        }
        Ok(())
    }
}
