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
    #[error("{path}: {bad_rows} of {rows} rows malformed, more than data.max_bad_fraction = {max_bad_fraction}")]
    TooLargeBadFraction { path: PathBuf, bad_rows: u64, rows: u64, max_bad_fraction: f64 },
    #[error("{path}: no training row: {why}")]
    NoRows { path: PathBuf, why: String },
    #[error("{path}: schema: {message}")]
    Schema { path: PathBuf, message: String },
    #[error("{path}: parquet: {message}")]
    Parquet { path: PathBuf, message: String },
    #[error("data.{key} is not set: {what}")]
    MissingPath { key: &'static str, what: &'static str },
    #[error("data stream stopped unexpectedly (its reader thread panicked)")]
    ReaderPanicked,
    #[error("{place}: {bad_rows} malformed records, more than data.max_bad_rows = {max_bad_rows} (the last: {reason})")]
    TooManyBadRecords { place: String, bad_rows: u64, max_bad_rows: u64, reason: String },
    /// `[data.stream]`: the broker, topic or partition, named in the message.
    #[error("{0}")]
    Stream(String),
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
    /// Malformed and good rows of the pass in progress, for `max_bad_fraction`.
    pass: Arc<(AtomicU64, AtomicU64)>,
    pub max_bad_fraction: Option<f64>,
    /// What `[data.weighting]` merged, dropped and weighed (shared like the count).
    pub weighting: Arc<crate::weighting::WeightCounters>,
}

impl BadRows {
    pub fn new(max_bad_rows: u64, report_first: u64) -> Self {
        BadRows {
            count: Arc::new(AtomicU64::new(0)),
            max_bad_rows,
            report_first,
            pass: Arc::default(),
            max_bad_fraction: None,
            weighting: Arc::default(),
        }
    }

    /// The budget `[data]` sets: `max_bad_rows`, `report_bad_rows`, `max_bad_fraction`.
    pub fn from_config(data: &sparrow_core::config::DataConfig) -> Self {
        BadRows { max_bad_fraction: data.max_bad_fraction, ..BadRows::new(data.max_bad_rows, data.report_bad_rows) }
    }

    /// Good rows read (the denominator of `max_bad_fraction`).
    pub fn record_good(&self, rows: u64) {
        self.pass.1.fetch_add(rows, Ordering::Relaxed);
    }

    /// At the end of a pass over `path`: fails past `max_bad_fraction`, then
    /// starts counting the next pass.
    pub fn end_pass(&self, path: &std::path::Path) -> Result<(), DataError> {
        let bad = self.pass.0.swap(0, Ordering::Relaxed);
        let rows = bad + self.pass.1.swap(0, Ordering::Relaxed);
        match self.max_bad_fraction {
            Some(max) if rows > 0 && bad as f64 > max * rows as f64 => Err(DataError::TooLargeBadFraction {
                path: path.to_path_buf(),
                bad_rows: bad,
                rows,
                max_bad_fraction: max,
            }),
            _ => Ok(()),
        }
    }

    pub fn total(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// A malformed stream record at `place` (topic, partition, offset):
    /// counted against the same budget as a file's rows.
    pub fn record_at(&self, place: &str, reason: String) -> Result<(), DataError> {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let reason = sparrow_core::printable(&reason).into_owned();
        let place = sparrow_core::printable(place).into_owned();
        if n <= self.report_first {
            tracing::warn!("warning: skipped malformed record ({place}): {reason}");
        }
        if n > self.max_bad_rows {
            return Err(DataError::TooManyBadRecords { place, bad_rows: n, max_bad_rows: self.max_bad_rows, reason });
        }
        Ok(())
    }

    pub fn record(&self, path: &std::path::Path, line: u64, reason: String) -> Result<(), DataError> {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        self.pass.0.fetch_add(1, Ordering::Relaxed);
        // The reason quotes the data: escaped, so a row cannot drive the terminal.
        let reason = sparrow_core::printable(&reason).into_owned();
        if n <= self.report_first {
            let shown = sparrow_core::printable(&path.display().to_string()).into_owned();
            tracing::warn!("warning: skipped malformed row {shown}:{line}: {reason}");
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
