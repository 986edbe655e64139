//! [`DenseModel::spec`]: the network as plain data for an exporter.

use crate::ModelError;
use crate::params::Linear;
use crate::spec::{DenseLayer, NetSpec};

use super::{DenseModel, Net};

pub(super) fn linear(l: &Linear) -> Result<DenseLayer, ModelError> {
    let (w, b) = (l.weight().as_tensor(), l.bias().as_tensor());
    let (fan_in, fan_out) = w.dims2()?;
    Ok(DenseLayer { fan_in, fan_out, weight: w.flatten_all()?.to_vec1()?, bias: b.to_vec1()?, relu: false })
}

impl DenseModel {
    /// Its structure and weights.
    pub fn spec(&self) -> Result<NetSpec, ModelError> {
        let dense = |l: &Option<Linear>| l.as_ref().map(linear).transpose();
        let bias = || -> Result<f32, ModelError> {
            Ok(match &self.bias {
                Some(b) => b.as_tensor().to_vec1::<f32>()?[0],
                None => 0.0,
            })
        };
        Ok(match &self.net {
            Net::Lr { dense: l } => NetSpec::FirstOrder { second_order: false, dense: dense(l)?, bias: bias()? },
            Net::Fm { dense: l } => NetSpec::FirstOrder { second_order: true, dense: dense(l)?, bias: bias()? },
            Net::Mlp { mlp } => NetSpec::Mlp { layers: mlp.layers()? },
            Net::WideDeep { dense: l, deep } => {
                NetSpec::WideDeep { second_order: false, dense: dense(l)?, bias: bias()?, deep: deep.layers()? }
            }
            Net::DeepFm { dense: l, deep } => {
                NetSpec::WideDeep { second_order: true, dense: dense(l)?, bias: bias()?, deep: deep.layers()? }
            }
            Net::Dlrm { bottom, top, .. } => {
                NetSpec::Dlrm { bottom: bottom.as_ref().map(|m| m.layers()).transpose()?, top: top.layers()? }
            }
            Net::Dcn { cross, deep, .. } => {
                NetSpec::Dcn { cross: cross.iter().map(linear).collect::<Result<_, _>>()?, deep: deep.layers()? }
            }
            Net::MultiTask(net) => net.spec()?,
            Net::Din(net) => net.spec()?,
        })
    }
}
