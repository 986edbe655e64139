//! The rules a parsed config must keep beyond its types: values that
//! cannot be right, keys that need others, and (in `bounds`, which the
//! schema states too) every integer key's range. Each refusal names the key.

use super::*;

impl Config {
    /// Checks the rules (`from_toml` calls it).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, message: &str| Err(ConfigError::Invalid { key: key.to_string(), message: message.to_string() });
        super::bounds::check(self)?;
        self.validate_tasks()?;
        if self.train.eval_every_steps.is_some_and(|n| n > 0)
            && self.data.test.is_none()
            && self.data.validation.is_none()
        {
            return invalid("train.eval_every_steps", "needs data.validation or data.test (the set it evaluates)");
        }
        self.validate_validation()?;
        if self.checkpoint.export_every_steps.is_some_and(|n| n > 0) && self.checkpoint.dir.is_none() {
            return invalid(
                "checkpoint.export_every_steps",
                "needs checkpoint.dir (the exports are written to checkpoint.dir/exports/)",
            );
        }
        if self.checkpoint.export_every_secs.is_some_and(|n| n > 0) && self.checkpoint.dir.is_none() {
            return invalid(
                "checkpoint.export_every_secs",
                "needs checkpoint.dir (the exports are written to checkpoint.dir/exports/)",
            );
        }
        if self.checkpoint.every_secs.is_some_and(|n| n > 0) && self.checkpoint.dir.is_none() {
            return invalid("checkpoint.every_secs", "needs checkpoint.dir");
        }
        if self.checkpoint.dir.as_deref().is_some_and(|d| d.trim().is_empty()) {
            return invalid(
                "checkpoint.dir",
                "is empty: name a directory, or leave the key out to write no checkpoint",
            );
        }
        // An empty path was read as the working directory (an SSD tier's
        // shard files and TensorBoard's events were written there) or
        // failed with an error that named no key.
        let paths = [
            ("data.train", &self.data.train, "the training data file"),
            ("data.test", &self.data.test, "the test data file, or leave the key out to test on none"),
            ("train.metrics_path", &self.train.metrics_path, "a file, or leave the key out to write no metrics"),
            ("train.tensorboard_dir", &self.train.tensorboard_dir, "a directory, or leave the key out"),
            ("embedding.path", &self.embedding.path, "the SSD tier's directory"),
            ("checkpoint.resume_from", &self.checkpoint.resume_from, "the checkpoint to resume from"),
        ];
        if let Some((key, _, what)) =
            paths.iter().find(|(_, path, _)| path.as_deref().is_some_and(|p| p.trim().is_empty()))
        {
            return invalid(key, &format!("is empty: name {what}"));
        }
        if self.data.max_bad_fraction.is_some_and(|f| !(0.0..=1.0).contains(&f)) {
            return invalid("data.max_bad_fraction", "must be between 0 and 1");
        }
        for (key, rate) in [
            ("embedding.learning_rate", f64::from(self.embedding.learning_rate)),
            ("dense_optimizer.learning_rate", self.dense_optimizer.learning_rate),
        ] {
            if !rate.is_finite() || rate < 0.0 {
                return invalid(key, &format!("must be a finite number >= 0, not {rate}"));
            }
        }
        for (key, value) in [
            ("embedding.eps", f64::from(self.embedding.eps)),
            ("embedding.beta1", f64::from(self.embedding.beta1)),
            ("embedding.beta2", f64::from(self.embedding.beta2)),
            ("embedding.ftrl_beta", f64::from(self.embedding.ftrl_beta)),
            ("embedding.ftrl_l1", f64::from(self.embedding.ftrl_l1)),
            ("embedding.ftrl_l2", f64::from(self.embedding.ftrl_l2)),
            ("embedding.l2", f64::from(self.embedding.l2)),
            ("embedding.init.scale", f64::from(self.embedding.init.scale)),
            ("dense_optimizer.beta1", self.dense_optimizer.beta1),
            ("dense_optimizer.beta2", self.dense_optimizer.beta2),
            ("dense_optimizer.eps", self.dense_optimizer.eps),
            ("dense_optimizer.weight_decay", self.dense_optimizer.weight_decay),
        ] {
            if !value.is_finite() || value < 0.0 {
                return invalid(key, &format!("must be a finite number >= 0, not {value}"));
            }
        }
        self.train.schedule.check()?;
        if self.train.schedule.embedding
            && !self.train.schedule.is_constant()
            && self.embedding.optimizer == SparseOptimizerKind::Ftrl
        {
            return invalid(
                "train.schedule.embedding",
                "FTRL's rows keep their own per-coordinate rates (embedding.ftrl_beta): set it to false, or pick \
                 another embedding.optimizer",
            );
        }
        let momentum = self.model.batch_norm_momentum;
        if !(momentum > 0.0 && momentum <= 1.0) {
            return invalid("model.batch_norm_momentum", &format!("must be in (0, 1], not {momentum}"));
        }
        let dropout = self.model.dropout;
        if !(0.0..1.0).contains(&dropout) {
            return invalid("model.dropout", &format!("must be a rate in [0, 1), not {dropout}"));
        }
        if let Some(token) = self.cluster.auth_token.as_deref().filter(|t| !t.is_empty()) {
            crate::token::check(token, "cluster.auth_token")
                .map_err(|m| ConfigError::Invalid { key: "cluster.auth_token".into(), message: m })?;
        }
        if self.cluster.progress_timeout_ms <= self.cluster.heartbeat_interval_ms {
            return invalid("cluster.progress_timeout_ms", "must be above cluster.heartbeat_interval_ms");
        }
        if !self.embedding.table_shards.is_power_of_two() {
            return invalid("embedding.table_shards", "must be a power of two");
        }
        if self.embedding.storage == Storage::Ssd {
            if self.embedding.path.is_none() {
                return invalid("embedding.path", "storage = \"ssd\" needs a directory for the SSD tier");
            }
            if self.embedding.cache_capacity_rows < self.embedding.table_shards {
                return invalid("embedding.cache_capacity_rows", "must be at least embedding.table_shards");
            }
        }
        if self.embedding.rounding == Rounding::Stochastic && self.embedding.dtype == EmbeddingDtype::F32 {
            return invalid(
                "embedding.rounding",
                "\"stochastic\" rounds half rows: it needs embedding.dtype = \"f16\" or \"bf16\" (f32 rows are not rounded)",
            );
        }
        if self.embedding.admit_min_count > 1 && self.embedding.admit_sketch_counters < self.embedding.table_shards {
            return invalid("embedding.admit_sketch_counters", "must be at least embedding.table_shards");
        }
        if let Some(stream) = &self.data.stream {
            stream.validate(&self.data)?;
        }
        if let Some(w) = &self.data.weighting {
            // A stream dates each sample by its record (the checks are in stream.rs).
            if self.data.stream.is_none() {
                if self.data.schema.as_ref().and_then(|s| s.timestamp.as_ref()).is_none() {
                    return invalid("data.weighting", "needs data.schema.timestamp (the column of Unix seconds)");
                }
                if !matches!(self.data.format, DataFormat::Csv | DataFormat::Parquet) {
                    return invalid("data.weighting", "needs format = \"csv\" or \"parquet\" (a timestamp column)");
                }
            }
            if !(w.decay_base.is_finite() && w.decay_base > 1.0) {
                return invalid("data.weighting.decay_base", "must be above 1 (default e)");
            }
            if !(w.age_unit_secs.is_finite() && w.age_unit_secs > 0.0) {
                return invalid("data.weighting.age_unit_secs", "must be above 0 (default 86400: a day)");
            }
            if !(w.drop_below.is_finite() && w.drop_below >= 0.0) {
                return invalid("data.weighting.drop_below", "must be ≥ 0 (default 0.001)");
            }
        }
        if self.embedding.ttl_secs > 0 && self.data.stream.is_none() {
            return invalid(
                "embedding.ttl_secs",
                "counts in the records' time, which [data.stream] gives (each record's append time); \
                 for a file use embedding.ttl_steps",
            );
        }
        if self.cluster.mode == ClusterMode::Collocated && (self.embedding.ttl_secs > 0 || self.embedding.max_rows > 0)
        {
            let key = if self.embedding.ttl_secs > 0 { "embedding.ttl_secs" } else { "embedding.max_rows" };
            return invalid(key, "bounded tables are not available with cluster.mode = \"collocated\" yet");
        }
        if self.cluster.mode == ClusterMode::Collocated {
            // The second level holds rows and optimizer state only.
            if self.embedding.admit_min_count > 1 {
                return invalid(
                    "embedding.admit_min_count",
                    "feature admission is not available with cluster.mode = \"collocated\" yet",
                );
            }
            if self.embedding.ttl_steps > 0 {
                return invalid(
                    "embedding.ttl_steps",
                    "row expiry is not available with cluster.mode = \"collocated\" yet",
                );
            }
            if self.checkpoint.incremental {
                return invalid(
                    "checkpoint.incremental",
                    "incremental checkpoints are not available with cluster.mode = \"collocated\" yet (full ones are)",
                );
            }
        }
        let lazy = &self.cluster.lazy;
        for (key, value) in
            [("max_net_utilisation", lazy.max_net_utilisation), ("max_failure_rate", lazy.max_failure_rate)]
        {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(&format!("cluster.lazy.{key}"), "must be a number ≥ 0 (a share: 0.3 is 30%)");
            }
        }
        let (net, failures) = (lazy.max_net_utilisation > 0.0, lazy.max_failure_rate > 0.0);
        let passable = match lazy.combine {
            Combine::And => net && failures,
            Combine::Or => net || failures,
        };
        if !passable {
            return invalid(
                "cluster.lazy.max_net_utilisation",
                "with this and cluster.lazy.max_failure_rate (combine) no instruction could ever pass: a condition \
                 passes strictly below its threshold, so a threshold of 0 never does",
            );
        }
        if !(lazy.link_bytes_per_sec.is_finite() && lazy.link_bytes_per_sec > 0.0) {
            return invalid("cluster.lazy.link_bytes_per_sec", "must be above 0");
        }
        if !(lazy.backup_min_change.is_finite() && lazy.backup_min_change >= 0.0) {
            return invalid("cluster.lazy.backup_min_change", "must be a number ≥ 0 (0.05: 5% relative L2 change)");
        }
        if self.cluster.heartbeat_timeout_ms <= self.cluster.heartbeat_interval_ms {
            return invalid("cluster.heartbeat_timeout_ms", "must be above cluster.heartbeat_interval_ms");
        }
        if matches!(self.data.format, DataFormat::Csv | DataFormat::Parquet) {
            match &self.data.schema {
                None => return invalid("data.schema", "csv and parquet need [data.schema]"),
                Some(s) if s.sparse.is_empty() && s.dense.is_empty() => {
                    return invalid("data.schema", "names no dense or sparse column");
                }
                Some(s) if s.delimiter.chars().count() != 1 => {
                    return invalid("data.schema.delimiter", "must be one character");
                }
                Some(_) => {}
            }
        }
        if self.data.format == DataFormat::Libffm && self.data.num_fields.is_none() {
            return invalid("data.num_fields", "libffm needs the number of fields");
        }
        Ok(())
    }
}
