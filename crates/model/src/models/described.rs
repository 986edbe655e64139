//! [`DenseModel::spec`]: the network as plain data for an exporter.

use crate::ModelError;
use crate::params::Linear;
use crate::spec::{DenseLayer, NetSpec};

use super::DenseModel;

pub(crate) fn linear(l: &Linear) -> Result<DenseLayer, ModelError> {
    let (w, b) = (l.weight().as_tensor(), l.bias().as_tensor());
    let (fan_in, fan_out) = w.dims2()?;
    Ok(DenseLayer { fan_in, fan_out, weight: w.flatten_all()?.to_vec1()?, bias: b.to_vec1()?, relu: false })
}

impl DenseModel {
    /// Its structure and weights (each kind's `Net::spec`).
    pub fn spec(&self) -> Result<NetSpec, ModelError> {
        self.net.spec()
    }
}
