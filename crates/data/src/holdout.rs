//! `data.validation = <fraction>`: which of the training file's rows a
//! reader skips. Training skips the held-out rows, the validation set is
//! only those, scoring reads all (`DataConfig::split`). A row is known by
//! its line (a Parquet file: its row number), so the split is the same for
//! every seed, shuffle and resume.

use std::path::Path;

use sparrow_core::Config;
use sparrow_core::config::{RowSplit, ValidationSet, held_out};

/// The rows of one file a reader leaves out.
#[derive(Clone, Copy, Debug)]
pub struct Holdout {
    fraction: f64,
    /// Keep the held-out rows (the validation set) rather than the others.
    keep_held_out: bool,
}

impl Holdout {
    /// What `job` holds out of `path`: nothing unless `path` is the
    /// training file and the validation set is a fraction of it.
    pub fn of(job: &Config, path: &Path) -> Option<Holdout> {
        let Some(ValidationSet::Fraction(fraction)) = job.data.validation else { return None };
        if job.data.train.as_deref().is_none_or(|t| Path::new(t) != path) {
            return None;
        }
        match job.data.split {
            RowSplit::Training => Some(Holdout { fraction, keep_held_out: false }),
            RowSplit::HeldOut => Some(Holdout { fraction, keep_held_out: true }),
            RowSplit::All => None,
        }
    }

    /// Whether the reader skips row `row`.
    pub fn skips(&self, row: u64) -> bool {
        held_out(row, self.fraction) != self.keep_held_out
    }
}
