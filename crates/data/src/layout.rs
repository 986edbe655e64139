use sparrow_core::config::{DataConfig, DataFormat};

/// Shape of the samples a data config produces: the model is built from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataLayout {
    pub num_fields: usize,
    pub num_dense: usize,
    /// Keys carry values (libsvm/libffm `idx:val`).
    pub weighted: bool,
    /// Labels a sample holds, one per task (`data.schema.labels`).
    pub num_tasks: usize,
}

pub const CRITEO_DENSE: usize = 13;
pub const CRITEO_SPARSE: usize = 26;

impl DataLayout {
    /// An empty batch of this shape, room for `rows`.
    pub fn builder(&self, rows: usize) -> sparrow_core::BatchBuilder {
        sparrow_core::BatchBuilder::new(self.num_fields, self.num_dense, self.weighted, rows).with_tasks(self.num_tasks)
    }

    pub fn from_config(c: &DataConfig) -> DataLayout {
        match c.format {
            DataFormat::Criteo => {
                DataLayout { num_fields: CRITEO_SPARSE, num_dense: CRITEO_DENSE, weighted: false, num_tasks: 1 }
            }
            DataFormat::Csv | DataFormat::Parquet => {
                let s = c.schema.clone().unwrap_or_default();
                // A sequence field's bag follows the sparse fields' (its own slot).
                DataLayout {
                    num_fields: s.sparse.len() + s.sequence.len(),
                    num_dense: s.dense.len(),
                    weighted: false,
                    num_tasks: s.labels.len().max(1),
                }
            }
            DataFormat::Libsvm => DataLayout { num_fields: 1, num_dense: 0, weighted: true, num_tasks: 1 },
            DataFormat::Libffm => {
                DataLayout { num_fields: c.num_fields.unwrap_or(1), num_dense: 0, weighted: true, num_tasks: 1 }
            }
        }
    }
}
