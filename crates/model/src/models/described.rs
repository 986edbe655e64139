//! [`DenseModel::spec`]: the network as plain data for an exporter.

use crate::ModelError;
use crate::spec::NetSpec;

use super::DenseModel;

impl DenseModel {
    /// Its structure and weights (each kind's `Net::spec`).
    pub fn spec(&self) -> Result<NetSpec, ModelError> {
        self.net.spec()
    }
}
