use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] sparrow_core::ConfigError),
    #[error(transparent)]
    Data(#[from] sparrow_data::DataError),
    // Displayed with their cause, and not `source`s, so an error chain
    // (`{:#}`) does not repeat it.
    #[error("dense model: {0}")]
    Model(sparrow_model::ModelError),
    #[error("embedding table: {0}")]
    Table(sparrow_embedding::TableError),
    /// The data's layout is not the one the checkpoint was trained on.
    #[error(
        "the data has {} fields and {} dense values; the checkpoint {} was trained on {} and {} (data.* differs)",
        data.0, data.1, checkpoint.display(), saved.0, saved.1
    )]
    DataShape { checkpoint: PathBuf, saved: (usize, usize), data: (usize, usize) },
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    /// A failure on what a config key names (its file, its folder).
    #[error("{key}: {error}")]
    Key { key: &'static str, error: Box<TrainError> },
    #[error("interrupted after step {step}")]
    Interrupted { step: u64 },
    #[error(
        "non-finite {what} at step {step}: the model diverged (lower the learning rates, or set train.on_non_finite = \"skip_batch\" to skip such batches)"
    )]
    NonFinite { step: u64, what: String },
    /// A command-line argument that cannot be right (names the flag).
    #[error("{flag} {value}: {message}")]
    Argument { flag: &'static str, value: String, message: String },
    /// The data-parallel sync of the dense gradients failed (in a cluster:
    /// the coordinator's round, with the transport's error kept inside).
    #[error("dense gradient sync: {0}")]
    DenseSync(Box<dyn std::error::Error + Send + Sync>),
    #[error("starting the compute thread pool")]
    ThreadPool(#[source] rayon::ThreadPoolBuildError),
}

impl TrainError {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        TrainError::Io { path: path.to_path_buf(), error: source }
    }

    /// This error, said of what config key `key` names.
    pub fn of_key(self, key: &'static str) -> Self {
        TrainError::Key { key, error: Box::new(self) }
    }

    pub fn checkpoint(path: &std::path::Path, message: impl Into<String>) -> Self {
        TrainError::Checkpoint { path: path.to_path_buf(), message: message.into() }
    }
}

impl From<sparrow_model::ModelError> for TrainError {
    fn from(e: sparrow_model::ModelError) -> Self {
        TrainError::Model(e)
    }
}

impl From<sparrow_embedding::TableError> for TrainError {
    fn from(e: sparrow_embedding::TableError) -> Self {
        TrainError::Table(e)
    }
}
