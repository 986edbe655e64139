//! Prometheus gauges of online training: progressive validation's figures
//! and the stream's lag, as `sparrow train --metrics-listen` and each
//! cluster worker's metrics endpoint show them. Made once per process (a
//! gauge registered again would not be the one served) and set as the run
//! goes.

use prometheus::Gauge;
use sparrow_core::batch::StreamMark;
use sparrow_trainer::online::OnlineFigures;

use crate::metrics::RoleMetrics;

#[derive(Clone)]
pub struct OnlineGauges {
    lag_records: Gauge,
    lag_secs: Gauge,
    future_records: Gauge,
    gap_records: Gauge,
    offset_resets: Gauge,
    /// (window, run) × (auc, logloss, normalized entropy, calibration).
    online: [[Gauge; 4]; 2],
}

impl OnlineGauges {
    pub fn new(metrics: &RoleMetrics) -> OnlineGauges {
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
        OnlineGauges {
            lag_records: metrics.gauge("stream_lag_records", "Records behind the ends of the topic's partitions"),
            lag_secs: metrics.gauge("stream_lag_seconds", "Seconds from the newest trained record's append to now"),
            future_records: metrics.gauge(
                "stream_future_records",
                "Records stamped more than data.stream.max_future_secs ahead of the reader's clock (trained; their \
                 time moved no clock)",
            ),
            gap_records: metrics.gauge(
                "stream_gap_records",
                "Offsets the broker skipped inside the topic's partitions (data.stream.on_gap), across resumes",
            ),
            offset_resets: metrics.gauge(
                "stream_offset_resets",
                "Partition logs found gone backwards and moved past (data.stream.on_offset_reset), across resumes",
            ),
            online: [online("window"), online("run")],
        }
    }

    pub fn set_online(&self, figures: &OnlineFigures) {
        for (gauges, m) in self.online.iter().zip([figures.window, figures.run]) {
            for (gauge, value) in gauges.iter().zip([m.auc, m.log_loss, m.normalized_entropy, m.calibration]) {
                gauge.set(value);
            }
        }
    }

    pub fn set_lag(&self, records: Option<u64>, secs: Option<f64>) {
        if let Some(records) = records {
            self.lag_records.set(records as f64);
        }
        if let Some(secs) = secs {
            self.lag_secs.set(secs);
        }
    }

    /// Records stamped too far ahead, so far.
    pub fn set_future(&self, records: Option<u64>) {
        if let Some(records) = records {
            self.future_records.set(records as f64);
        }
    }

    /// The lag after a stream's batch.
    pub fn set_lag_of(&self, mark: &StreamMark) {
        self.set_lag(Some(mark.lag_records), sparrow_trainer::input::lag_secs(mark));
        self.set_future(Some(mark.future_records));
        self.set_continuity(Some(mark.gap_records), Some(mark.offset_resets));
    }

    /// Offsets the broker skipped, and logs found gone backwards, so far.
    pub fn set_continuity(&self, gap_records: Option<u64>, offset_resets: Option<u64>) {
        if let Some(n) = gap_records {
            self.gap_records.set(n as f64);
        }
        if let Some(n) = offset_resets {
            self.offset_resets.set(n as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::metrics::online::ProgressiveEval;

    /// What a worker sets is what its endpoint serves, under the names
    /// `sparrow train --metrics-listen` uses; registering them once per
    /// process is what keeps a later generation's values on the endpoint.
    #[test]
    fn the_figures_and_the_lag_are_served_under_their_names() {
        let metrics = RoleMetrics::new("worker");
        let gauges = OnlineGauges::new(&metrics);
        let mut eval = ProgressiveEval::new(4);
        eval.add(&[2.0, -2.0, 1.0, -1.0], &[1.0, 0.0, 0.0, 1.0]);
        gauges.set_online(&OnlineFigures::of(&eval));
        gauges.set_lag_of(&StreamMark { lag_records: 7, gap_records: 3, offset_resets: 1, ..Default::default() });
        let text = metrics.render();
        for line in [
            r#"sparrow_online_window_auc{role="worker"} 0.75"#,
            r#"sparrow_online_run_auc{role="worker"} 0.75"#,
            r#"sparrow_stream_lag_records{role="worker"} 7"#,
            r#"sparrow_stream_gap_records{role="worker"} 3"#,
            r#"sparrow_stream_offset_resets{role="worker"} 1"#,
        ] {
            assert!(text.contains(line), "missing `{line}` in\n{text}");
        }
        // A mark without a record time leaves the seconds as they were.
        assert!(text.contains(r#"sparrow_stream_lag_seconds{role="worker"} 0"#), "{text}");
    }
}
