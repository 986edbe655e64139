//! `data.schema.dense_transform = "standardize"`: each dense column's mean
//! and standard deviation from a first pass over the training rows, put in
//! the config (`data.schema.standardize_stats`) before anything reads the
//! data. The config travels with the model (checkpoints, exports, a
//! cluster's roles), so every reader after it, and the ONNX graph, reads
//! values as training did. A resumed run takes its checkpoint's.

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use sparrow_core::Config;
use sparrow_core::config::DenseTransform;
use sparrow_data::{BadRows, BatchStream};

use crate::TrainError;
use crate::checkpoint;

/// `config` with its standardization statistics, computed (or taken from
/// the checkpoint it resumes) where it asks for them and has none yet.
/// `stop` (Ctrl-C, SIGTERM) ends the first pass between batches: nothing
/// is trained yet, so nothing is lost.
pub fn with_dense_statistics<'a>(config: &'a Config, stop: &AtomicBool) -> Result<Cow<'a, Config>, TrainError> {
    let Some(schema) = config.data.schema.as_ref() else { return Ok(Cow::Borrowed(config)) };
    let standardize = schema.dense_transform == DenseTransform::Standardize;
    if !standardize || schema.standardize_stats.is_some() || schema.dense.is_empty() {
        return Ok(Cow::Borrowed(config));
    }
    let resumed = match &config.checkpoint.resume_from {
        Some(from) => saved_statistics(Path::new(from))?,
        None => None,
    };
    let stats = match resumed {
        Some(stats) => stats,
        None => first_pass(config, stop)?,
    };
    let mut prepared = config.clone();
    if let Some(schema) = prepared.data.schema.as_mut() {
        schema.standardize_stats = Some(stats);
    }
    Ok(Cow::Owned(prepared))
}

/// The statistics a checkpoint's run used, if it standardized.
fn saved_statistics(from: &Path) -> Result<Option<Vec<[f64; 2]>>, TrainError> {
    let dir = checkpoint::resolve(from)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let saved = Config::from_stored_toml(&manifest.config, &dir.display().to_string(), &Default::default())?;
    Ok(saved.data.schema.and_then(|s| s.standardize_stats))
}

/// Each dense column's mean and population standard deviation over the
/// training rows (the held-out ones left out), as read: a missing cell is
/// 0. Malformed rows are skipped here and reported by the training pass.
fn first_pass(config: &Config, stop: &AtomicBool) -> Result<Vec<[f64; 2]>, TrainError> {
    let Some(train) = config.data.train.as_deref() else {
        return Err(TrainError::Config(sparrow_core::ConfigError::Invalid {
            key: "data.schema.dense_transform".into(),
            message: "\"standardize\" computes its statistics from data.train: set it, or give \
                      data.schema.standardize_stats"
                .into(),
        }));
    };
    let mut job = config.clone();
    // The rows as the file holds them: no weighting, grouping or shuffle.
    job.data.weighting = None;
    job.data.group_by_label = false;
    job.data.shuffle = false;
    let stream = BatchStream::spawn(Path::new(train), &job, 8192, Default::default(), 1, BadRows::new(u64::MAX, 0))?;
    let columns = stream.layout.num_dense;
    let mut sums = vec![Welford::default(); columns];
    for batch in stream {
        if stop.load(Ordering::Relaxed) {
            return Err(TrainError::Interrupted { step: 0 });
        }
        let batch = batch?;
        for row in batch.dense.chunks_exact(columns.max(1)) {
            for (w, &x) in sums.iter_mut().zip(row) {
                w.add(f64::from(x));
            }
        }
    }
    if sums.first().is_some_and(|w| w.n == 0) {
        return Err(sparrow_data::DataError::NoRows {
            path: train.into(),
            why: "no good row to take the standardization statistics from".into(),
        }
        .into());
    }
    Ok(sums.iter().map(|w| [w.mean, w.variance().sqrt()]).collect())
}

/// A running mean and sum of squared deviations (Welford), in f64.
#[derive(Clone, Copy, Debug, Default)]
struct Welford {
    n: u64,
    mean: f64,
    m2: f64,
}

impl Welford {
    fn add(&mut self, x: f64) {
        self.n += 1;
        let delta = x - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (x - self.mean);
    }

    /// The population variance (as scikit-learn's StandardScaler).
    fn variance(&self) -> f64 {
        if self.n == 0 { 0.0 } else { self.m2 / self.n as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::Welford;

    #[test]
    fn welford_gives_the_mean_and_population_deviation() {
        let mut w = Welford::default();
        for x in [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0] {
            w.add(x);
        }
        assert_eq!(w.mean, 5.0);
        assert_eq!(w.variance().sqrt(), 2.0);
    }
}
