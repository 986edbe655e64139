use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] sparrow_core::ConfigError),
    #[error(transparent)]
    Data(#[from] sparrow_data::DataError),
    #[error("dense model: {0}")]
    Model(#[from] sparrow_model::ModelError),
    #[error("embedding table: {0}")]
    Table(#[from] sparrow_embedding::TableError),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("interrupted after step {step}")]
    Interrupted { step: u64 },
    #[error("thread pool: {0}")]
    ThreadPool(String),
}

impl TrainError {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        TrainError::Io { path: path.to_path_buf(), error: source }
    }

    pub fn checkpoint(path: &std::path::Path, message: impl Into<String>) -> Self {
        TrainError::Checkpoint { path: path.to_path_buf(), message: message.into() }
    }
}
