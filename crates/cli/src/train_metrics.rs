//! `sparrow train --metrics-listen ADDR`: Prometheus gauges of a training
//! run, set at every logging interval from the run's progress updates, and
//! served on the same small HTTP endpoint as the cluster roles' metrics.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;

use sparrow_cluster::metrics::Gauge;
use sparrow_cluster::metrics::RoleMetrics;
use sparrow_cluster::net::NetSettings;
use sparrow_core::Config;
use sparrow_trainer::TrainSummary;
use sparrow_trainer::progress::ProgressUpdate;

/// The gauges, by the update field they show.
struct TrainGauges {
    step: Gauge,
    samples: Gauge,
    samples_per_sec: Gauge,
    train_logloss: Gauge,
    lag_records: Gauge,
    embedding_rows: Gauge,
    expired_rows: Gauge,
    evicted_rows: Gauge,
    lag_secs: Gauge,
    /// (window, run) × (auc, logloss, normalized entropy, calibration).
    online: [[Gauge; 4]; 2],
}

impl TrainGauges {
    fn new(metrics: &RoleMetrics) -> TrainGauges {
        let online = |scope: &str| {
            [
                ("auc", "AUC"),
                ("logloss", "log-loss"),
                ("normalized_entropy", "normalized entropy (log-loss over the base rate's entropy)"),
                ("calibration", "calibration (sum of predictions over sum of labels)"),
            ]
            .map(|(name, what)| {
                let of = if scope == "window" {
                    "over the last train.online_window_samples samples"
                } else {
                    "over the run"
                };
                metrics.gauge(
                    &format!("online_{scope}_{name}"),
                    &format!("Progressive validation: {what} of batches scored before training, {of}"),
                )
            })
        };
        TrainGauges {
            step: metrics.gauge("train_step", "Steps trained"),
            samples: metrics.gauge("train_samples", "Samples trained"),
            samples_per_sec: metrics.gauge("train_samples_per_second", "Samples per second over the last interval"),
            train_logloss: metrics.gauge("train_logloss", "Mean training log-loss over the last interval"),
            lag_records: metrics.gauge("stream_lag_records", "Records behind the ends of the topic's partitions"),
            embedding_rows: metrics.gauge("embedding_rows", "Rows in the embedding table"),
            expired_rows: metrics.gauge("embedding_expired_rows", "Rows deleted by embedding.ttl_steps or ttl_secs"),
            evicted_rows: metrics.gauge("embedding_evicted_rows", "Rows evicted to stay within embedding.max_rows"),
            lag_secs: metrics.gauge("stream_lag_seconds", "Seconds from the newest trained record's append to now"),
            online: [online("window"), online("run")],
        }
    }

    fn set(&self, u: &ProgressUpdate) {
        self.step.set(u.step as f64);
        self.samples.set(u.samples as f64);
        self.samples_per_sec.set(u.samples_per_sec);
        self.train_logloss.set(u.train_logloss);
        self.embedding_rows.set(u.embedding_rows as f64);
        self.expired_rows.set(u.expired_rows as f64);
        self.evicted_rows.set(u.evicted_rows as f64);
        if let Some(records) = u.stream_lag_records {
            self.lag_records.set(records as f64);
        }
        if let Some(secs) = u.stream_lag_secs {
            self.lag_secs.set(secs);
        }
        if let Some(online) = u.online {
            for (gauges, m) in self.online.iter().zip([online.window, online.run]) {
                for (gauge, value) in gauges.iter().zip([m.auc, m.log_loss, m.normalized_entropy, m.calibration]) {
                    gauge.set(value);
                }
            }
        }
    }
}

/// Trains as `sparrow train` does while serving the gauges on `addr`.
pub fn train_serving_metrics(
    config: &Config,
    quiet: bool,
    stop: &AtomicBool,
    addr: SocketAddr,
) -> anyhow::Result<TrainSummary> {
    let metrics = RoleMetrics::new("train");
    let gauges = TrainGauges::new(&metrics);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let settings = NetSettings::new(&config.cluster, std::env::var(sparrow_cluster::net::TOKEN_ENV).ok().as_deref());
    let bound = metrics.serve(addr, &settings, rt.handle())?;
    tracing::info!("train: metrics on http://{bound}/metrics");
    Ok(sparrow_trainer::run::train_observed(config, quiet, stop, &|u| gauges.set(u))?)
}
