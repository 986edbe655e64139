//! What a worker process prints as its last stdout line, which `launch`
//! combines into the job's summary, and the latency quantiles it holds.

use serde::Serialize;
use sparrow_trainer::run::RunSummary;

/// Latency quantiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize)]
pub struct LatencyMs {
    pub p50: f64,
    pub p99: f64,
    pub count: usize,
}

impl LatencyMs {
    pub fn of(secs: &[f32]) -> LatencyMs {
        if secs.is_empty() {
            return LatencyMs::default();
        }
        let mut sorted = secs.to_vec();
        sorted.sort_by(f32::total_cmp);
        let at = |q: f64| f64::from(sorted[((sorted.len() - 1) as f64 * q).round() as usize]) * 1e3;
        LatencyMs { p50: at(0.5), p99: at(0.99), count: sorted.len() }
    }
}

/// What a worker process prints as its last stdout line: `sparrow
/// train`'s summary (figures only worker 0 has are null on the others)
/// with the worker's own fields; launch combines them into the job's.
pub type WorkerRunSummary = RunSummary<crate::worker::WorkerPhaseSecs, WorkerFields>;

/// The fields of a worker's summary that `train`'s has not: what launch
/// needs to combine the workers' (their traffic, latencies, weights'
/// fingerprint, sync counters, stream mark and online counts).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct WorkerFields {
    pub worker: usize,
    pub batches: u64,
    pub bytes_from_loader: u64,
    pub bytes_from_shards: u64,
    pub keys: u64,
    pub unique_keys: u64,
    pub pull_latency_ms: LatencyMs,
    pub push_latency_ms: LatencyMs,
    pub dense_checksum: String,
    /// Bytes sent and received to agree on the dense weights.
    pub dense_sync_bytes: u64,
    /// `sync = "round"`: rounds merged and every worker's items over them.
    pub rounds: u64,
    pub round_items: Vec<u64>,
    /// `sync = "lazy"`: what the scheduler counted (from the final weights),
    /// and the seconds this worker spent asking for and waiting on instructions.
    pub lazy: Option<crate::lazy::LazyReport>,
    pub lazy_wait_secs: f64,
    /// `cluster.mode = "collocated"`: the shards' second levels (worker 0),
    /// the loader's pass counters, and row bytes from other nodes' shards.
    pub second_level: Option<crate::second_level::SecondLevelStats>,
    pub passes: crate::messages::PassCounters,
    pub bytes_from_remote_shards: u64,
    /// `[data.stream]`: the mark after this worker's furthest batch.
    #[serde(default, deserialize_with = "sparrow_trainer::input::from_json_value")]
    pub stream_mark: Option<sparrow_core::batch::StreamMark>,
    /// Progressive validation's counts, which launch adds up across workers.
    pub online_tally: Option<sparrow_trainer::online::OnlineTally>,
}

/// Worker `worker`'s summary after training; worker 0 passes its test
/// `figures`, its evaluation's seconds and its shards' summed report.
pub fn of_worker(
    config: &sparrow_core::Config,
    worker: &crate::worker::Worker,
    figures: Option<sparrow_trainer::evaluation::Figures>,
    eval_secs: f64,
    shards: Option<crate::transport::ShardReport>,
) -> Result<WorkerRunSummary, crate::transport::ClusterError> {
    let s = &worker.stats;
    let f = figures.as_ref();
    Ok(RunSummary {
        test_auc: f.map(|f| f.auc),
        test_logloss: f.map(|f| f.logloss),
        train_rows: s.rows,
        samples_per_sec: s.rows as f64 / s.train_secs.max(1e-9),
        wall_secs: s.train_secs + eval_secs,
        peak_rss_bytes: sparrow_trainer::peak_rss_bytes(),
        embedding_rows: shards.as_ref().map_or(0, |t| t.rows),
        bad_rows: s.bad_rows,
        model: config.model.kind.name().to_string(),
        steps: s.steps,
        train_secs: s.train_secs,
        eval_secs,
        test_rows: f.map_or(0, |f| f.rows),
        test_nan_predictions: f.map_or(0, |f| f.nan_predictions),
        skipped_batches: s.skipped_batches,
        merged_samples: s.merged_samples,
        dropped_samples: s.dropped_samples,
        sample_weight_sum: s.sample_weight_sum,
        truncated_sequences: s.truncated_sequences,
        train_logloss: worker.train_logloss(),
        dedup_ratio: s.keys as f64 / s.unique_keys.max(1) as f64,
        shuffle_bytes_per_sample: 8.0 * s.unique_keys as f64 / s.rows.max(1) as f64,
        table: shards.as_ref().map(|t| t.table_report()).unwrap_or_default(),
        embedding_bytes_per_row: None,
        checkpoint: worker.last_checkpoint().map(|d| d.display().to_string()),
        resumed_from_step: None,
        step_phase_secs: s.phase_secs,
        bayes_auc: None,
        bayes_logloss: None,
        stream: sparrow_trainer::input::StreamReport::of(s.last_stream.as_ref()),
        online: sparrow_trainer::online::OnlineReport::of(worker.online.as_ref()),
        tasks: figures.map(|f| f.tasks).unwrap_or_default(),
        validation: Default::default(),
        extra: WorkerFields {
            worker: worker.index,
            batches: s.batches,
            bytes_from_loader: s.bytes_from_loader,
            bytes_from_shards: s.bytes_from_shards,
            keys: s.keys,
            unique_keys: s.unique_keys,
            pull_latency_ms: LatencyMs::of(&s.pull_secs),
            push_latency_ms: LatencyMs::of(&s.push_secs),
            dense_checksum: format!("{:016x}", worker.dense_checksum()?),
            dense_sync_bytes: s.dense_sync_bytes,
            rounds: s.rounds,
            round_items: s.round_items.clone(),
            lazy: worker.lazy_report.clone(),
            lazy_wait_secs: s.lazy_wait_secs,
            second_level: shards.and_then(|t| t.second_level),
            passes: s.passes,
            bytes_from_remote_shards: s.bytes_from_remote_shards,
            stream_mark: s.last_stream.clone(),
            online_tally: worker.online.as_ref().map(sparrow_trainer::online::OnlineTally::of),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Launch reads what a worker prints: every field a worker fills comes
    /// back, the flattened stream offsets (integer keys) and task figures
    /// (a NaN AUC is printed as null) included.
    #[test]
    fn a_worker_summary_reads_back_as_it_was_printed() {
        let mark = sparrow_core::batch::StreamMark {
            offsets: [(0, 17), (3, 2)].into_iter().collect(),
            records: 19,
            ..Default::default()
        };
        use sparrow_core::metrics::tasks::TaskFigures;
        let one_class =
            TaskFigures::Binary { auc: f64::NAN, logloss: 0.5, ne: 0.9, calibration: 1.0, gauc: None, rows: 4 };
        let summary = WorkerRunSummary {
            test_auc: Some(0.75),
            train_rows: 1000,
            model: "mlp".into(),
            stream: sparrow_trainer::input::StreamReport::of(Some(&mark)),
            tasks: [("click".to_string(), one_class)].into_iter().collect(),
            validation: Default::default(),
            extra: WorkerFields {
                worker: 1,
                batches: 8,
                keys: 90,
                dense_checksum: "00ff".into(),
                round_items: vec![3, 5],
                stream_mark: Some(mark.clone()),
                online_tally: Some(Default::default()),
                lazy: Some(Default::default()),
                second_level: Some(Default::default()),
                ..Default::default()
            },
            ..Default::default()
        };
        let line = serde_json::to_string(&summary).expect("printed");
        let read: WorkerRunSummary = serde_json::from_str(&line).expect("read back");
        assert_eq!((read.test_auc, read.train_rows, read.model.as_str()), (Some(0.75), 1000, "mlp"));
        assert_eq!(read.stream.stream_offsets, Some(mark.offsets.clone()));
        assert_eq!(read.extra.stream_mark, Some(mark));
        assert_eq!((read.extra.worker, read.extra.batches, read.extra.keys), (1, 8, 90));
        assert_eq!((read.extra.dense_checksum.as_str(), read.extra.round_items), ("00ff", vec![3, 5]));
        assert!(read.extra.online_tally.is_some() && read.extra.lazy.is_some() && read.extra.second_level.is_some());
        assert!(matches!(read.tasks["click"], TaskFigures::Binary { auc, rows: 4, .. } if auc.is_nan()));
    }
}
