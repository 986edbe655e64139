use sparrow_core::config::{DataConfig, DataFormat};

/// Shape of the samples a data config produces: the model is built from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataLayout {
    pub num_fields: usize,
    pub num_dense: usize,
    /// Keys carry values (libsvm/libffm `idx:val`).
    pub weighted: bool,
}

pub const CRITEO_DENSE: usize = 13;
pub const CRITEO_SPARSE: usize = 26;

impl DataLayout {
    pub fn from_config(c: &DataConfig) -> DataLayout {
        match c.format {
            DataFormat::Criteo => DataLayout { num_fields: CRITEO_SPARSE, num_dense: CRITEO_DENSE, weighted: false },
            DataFormat::Csv | DataFormat::Parquet => {
                let s = c.schema.clone().unwrap_or_default();
                DataLayout { num_fields: s.sparse.len(), num_dense: s.dense.len(), weighted: false }
            }
            DataFormat::Libsvm => DataLayout { num_fields: 1, num_dense: 0, weighted: true },
            DataFormat::Libffm => DataLayout { num_fields: c.num_fields.unwrap_or(1), num_dense: 0, weighted: true },
        }
    }
}
