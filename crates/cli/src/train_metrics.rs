//! `sparrow train --metrics-listen ADDR`: Prometheus gauges of a training
//! run, set at every logging interval from the run's progress updates, and
//! served on the same small HTTP endpoint as the cluster roles' metrics.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;

use sparrow_cluster::metrics::Gauge;
use sparrow_cluster::metrics::RoleMetrics;
use sparrow_cluster::net::NetSettings;
use sparrow_cluster::stream_gauges::OnlineGauges;
use sparrow_core::Config;
use sparrow_trainer::TrainSummary;
use sparrow_trainer::progress::ProgressUpdate;

/// The gauges, by the update field they show.
struct TrainGauges {
    step: Gauge,
    samples: Gauge,
    samples_per_sec: Gauge,
    train_logloss: Gauge,
    embedding_rows: Gauge,
    expired_rows: Gauge,
    evicted_rows: Gauge,
    /// Progressive validation and the stream's lag (as a cluster worker's).
    online: OnlineGauges,
}

impl TrainGauges {
    fn new(metrics: &RoleMetrics) -> TrainGauges {
        TrainGauges {
            step: metrics.gauge("train_step", "Steps trained"),
            samples: metrics.gauge("train_samples", "Samples trained"),
            samples_per_sec: metrics.gauge("train_samples_per_second", "Samples per second over the last interval"),
            train_logloss: metrics.gauge("train_logloss", "Mean training log-loss over the last interval"),
            embedding_rows: metrics.gauge("embedding_rows", "Rows in the embedding table"),
            expired_rows: metrics.gauge("embedding_expired_rows", "Rows deleted by embedding.ttl_steps or ttl_secs"),
            evicted_rows: metrics.gauge("embedding_evicted_rows", "Rows evicted to stay within embedding.max_rows"),
            online: OnlineGauges::new(metrics),
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
        self.online.set_lag(u.stream_lag_records, u.stream_lag_secs);
        self.online.set_future(u.stream_future_records);
        self.online.set_continuity(u.stream_gap_records, u.stream_offset_resets);
        if let Some(online) = &u.online {
            self.online.set_online(online);
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
    let settings = NetSettings::new(&config.cluster, crate::env_token()?.as_deref());
    let bound = metrics.serve(addr, &settings, rt.handle())?;
    tracing::info!("train: metrics on http://{bound}/metrics");
    Ok(sparrow_trainer::run::train_observed(config, quiet, stop, &|u| gauges.set(u))?)
}
