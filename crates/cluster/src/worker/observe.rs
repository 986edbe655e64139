//! A cluster worker's training log, with `sparrow train`'s keys and lines:
//! `train.metrics_path` gets a line every `train.log_interval_steps` steps
//! and an `eval` line for the job's evaluation, each tagged with its
//! `worker` (every worker of a job on one machine appends to the one file,
//! a whole line a write); `train.tensorboard_dir` gets each worker's
//! scalars as a run of its own (`worker-<i>/`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sparrow_core::Config;
use sparrow_trainer::evaluation::Figures;
use sparrow_trainer::tensorboard::TensorBoard;

use super::WorkerStats;
use crate::transport::ClusterError;

pub struct WorkerLog {
    worker: usize,
    every: u64,
    metrics: Option<(PathBuf, std::fs::File)>,
    board: Option<TensorBoard>,
    started: Instant,
    /// Since the last line: its time, the worker's batches and rows then,
    /// the loss summed over rows since, and the phase seconds then.
    last: (Instant, u64, u64, super::WorkerPhaseSecs),
    loss_sum: f64,
    loss_rows: u64,
}

/// Starts the job's metrics file (before any worker appends to it): a job
/// that does not resume starts it empty, as `sparrow train` does.
pub fn start_metrics_file(config: &Config) -> Result<(), ClusterError> {
    let Some(path) = config.train.metrics_path.as_deref().map(Path::new) else { return Ok(()) };
    if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    let resumes = config.checkpoint.resume_from.is_some();
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| io(path, e))?;
    if !resumes {
        file.set_len(0).map_err(|e| io(path, e))?;
    }
    Ok(())
}

/// An I/O error on the metrics file or its folder, naming the key.
fn io(path: &Path, e: std::io::Error) -> ClusterError {
    ClusterError::Io { what: format!("train.metrics_path {}", path.display()), source: e }
}

impl WorkerLog {
    /// Worker `worker`'s log, if the config asks for one.
    pub fn open(config: &Config, worker: usize) -> Result<Option<WorkerLog>, ClusterError> {
        let (metrics_path, board_dir) = (config.train.metrics_path.as_deref(), config.train.tensorboard_dir.as_deref());
        if metrics_path.is_none() && board_dir.is_none() {
            return Ok(None);
        }
        let metrics = match metrics_path.map(PathBuf::from) {
            Some(path) => {
                if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
                }
                let file =
                    std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io(&path, e))?;
                Some((path, file))
            }
            None => None,
        };
        let board = board_dir
            .map(|d| TensorBoard::create(&Path::new(d).join(format!("worker-{worker}"))))
            .transpose()
            .map_err(ClusterError::Train)?;
        let now = Instant::now();
        Ok(Some(WorkerLog {
            worker,
            every: config.train.log_interval_steps.max(1),
            metrics,
            board,
            started: now,
            last: (now, 0, 0, Default::default()),
            loss_sum: 0.0,
            loss_rows: 0,
        }))
    }

    /// A batch of `rows` trained at `loss`.
    pub fn trained(&mut self, loss: f64, rows: usize) {
        self.loss_sum += loss * rows as f64;
        self.loss_rows += rows as u64;
    }

    /// After a step: a line when the worker's batches reach the interval.
    pub fn stepped(&mut self, job_step: u64, stats: &WorkerStats) -> Result<(), ClusterError> {
        if stats.batches == 0 || !stats.batches.is_multiple_of(self.every) || stats.batches == self.last.1 {
            return Ok(());
        }
        let (then, batches, rows, phases) = self.last;
        let secs = then.elapsed().as_secs_f64().max(1e-9);
        let rate = (stats.rows - rows) as f64 / secs;
        let loss = self.loss_sum / self.loss_rows.max(1) as f64;
        let dedup = stats.keys as f64 / stats.unique_keys.max(1) as f64;
        let p = stats.phase_secs;
        self.line(serde_json::json!({
            "worker": self.worker,
            "step": job_step,
            "worker_batches": stats.batches,
            "epoch": stats.last_end.epoch,
            "samples": stats.rows,
            "train_logloss": loss,
            "samples_per_sec": rate,
            "elapsed_secs": self.started.elapsed().as_secs_f64(),
            "bad_rows": stats.bad_rows,
            "dedup_ratio": dedup,
            "phase_secs": p,
        }))?;
        if let Some(board) = self.board.as_mut() {
            let steps = (stats.batches - batches).max(1) as f64;
            let ms = |now: f64, then: f64| (now - then) / steps * 1e3;
            board
                .scalars(
                    job_step,
                    &[
                        ("train/logloss", loss),
                        ("train/samples_per_sec", rate),
                        ("train/dedup_ratio", dedup),
                        ("step_ms/next_batch", ms(p.next_batch, phases.next_batch)),
                        ("step_ms/pull", ms(p.pull, phases.pull)),
                        ("step_ms/dense", ms(p.dense, phases.dense)),
                        ("step_ms/push", ms(p.push, phases.push)),
                    ],
                )
                .map_err(ClusterError::Train)?;
        }
        self.last = (Instant::now(), stats.batches, stats.rows, p);
        (self.loss_sum, self.loss_rows) = (0.0, 0);
        Ok(())
    }

    /// The job's evaluation (`sparrow train`'s `eval` line and test scalars).
    pub fn evaluated(&mut self, config: &Config, job_step: u64, samples: u64, f: &Figures) -> Result<(), ClusterError> {
        let mut line = serde_json::json!({
            "worker": self.worker,
            "step": job_step,
            "event": "eval",
            "samples": samples,
            "test_auc": f.auc,
            "test_logloss": f.logloss,
            "test_rows": f.rows,
        });
        if f.tasks.len() > 1 || config.eval.group_by.is_some() {
            line["tasks"] = serde_json::to_value(&f.tasks).unwrap_or_default();
        }
        self.line(line)?;
        if let Some(board) = self.board.as_mut() {
            let tagged = sparrow_trainer::evaluation::tagged(&f.tasks);
            let mut scalars: Vec<(&str, f64)> = tagged.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            scalars.extend([("test/auc", f.auc), ("test/logloss", f.logloss)]);
            board.scalars(job_step, &scalars).map_err(ClusterError::Train)?;
        }
        Ok(())
    }

    /// One whole line in one write (appends of other workers interleave by line).
    fn line(&mut self, value: serde_json::Value) -> Result<(), ClusterError> {
        if let Some((path, file)) = &mut self.metrics {
            let mut text = value.to_string();
            text.push('\n');
            file.write_all(text.as_bytes()).map_err(|e| io(path, e))?;
        }
        Ok(())
    }
}
