//! What a cluster job cannot do (yet), refused before any role starts.

use sparrow_core::Config;
use sparrow_core::config::SyncMode;

use crate::transport::ClusterError;

/// What a cluster job cannot do (yet), refused before any role starts.
pub(super) fn check_cluster_config(config: &Config) -> Result<(), ClusterError> {
    // Sizes beyond the machine fail here, before any role allocates.
    let layout = sparrow_data::DataLayout::from_config(&config.data);
    sparrow_trainer::sizes::check(config, &layout).map_err(|e| ClusterError::Train(e.into()))?;
    if config.data.stream.is_some() && config.cluster.sync == SyncMode::Lazy {
        return Err(ClusterError::Setup(
            "[data.stream] with cluster.sync = \"lazy\" is not available yet (a lazy checkpoint keeps the \
             furthest position aggregated, not each partition's offsets); use sync = \"step\" or \"round\""
                .into(),
        ));
    }
    if config.cluster.sync == SyncMode::Lazy
        && (config.checkpoint.every_secs.is_some() || config.checkpoint.export_every_secs.is_some())
    {
        return Err(ClusterError::Setup(
            "checkpoint.every_secs and export_every_secs with cluster.sync = \"lazy\" are not available yet \
             (a lazy job writes a serving export at every backup, and its checkpoint at its end)"
                .into(),
        ));
    }
    if let (Some(every), Some(checkpoints)) =
        (config.checkpoint.export_every_steps.filter(|&n| n > 0), config.checkpoint.every_steps)
        && (checkpoints == 0 || every % checkpoints != 0)
    {
        return Err(ClusterError::Setup(format!(
            "checkpoint.export_every_steps = {every}: a cluster job exports its committed checkpoints, so it \
             must be a multiple of checkpoint.every_steps = {checkpoints} (or leave every_steps unset: \
             checkpoints are then taken every export_every_steps)"
        )));
    }
    if config.cluster.sync == SyncMode::Lazy && config.checkpoint.export_every_steps.is_some() {
        return Err(ClusterError::Setup(
            "checkpoint.export_every_steps with cluster.sync = \"lazy\": a lazy job writes a serving export \
             at every backup already (checkpoint.dir/exports/)"
                .into(),
        ));
    }
    if config.cluster.sync == SyncMode::Lazy && config.checkpoint.every_steps.is_some() {
        return Err(ClusterError::Setup(
            "checkpoint.every_steps with cluster.sync = \"lazy\" is not available yet: a lazy job's checkpoint \
             is taken at its end"
                .into(),
        ));
    }
    Ok(())
}
