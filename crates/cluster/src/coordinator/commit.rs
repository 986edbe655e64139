//! Checkpoint commit and exports: the workers meet at a checkpoint step
//! (a [`Rendezvous`], one step at a time); the worker that completes the
//! meeting has every shard write its part, checks the files and commits the
//! version, outside every lock; every worker goes on with the committed
//! directory. Also the data progress the checkpoints record, the serving
//! exports of committed versions, and a lazy job's backups.
//!
//! Locks: the rendezvous' and the progress slot's (leaves), and `exports`,
//! taken by the committing worker and the job's end to decide on an export;
//! the wait for the previous export's thread runs outside it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::lock_order::{OrderedMutex, Rank};
use sparrow_core::Config;

use super::per_generation::{OtherGeneration, PerGeneration};
use super::{Coordinator, Event};
use crate::checkpoint::{Committed, DataProgress, Pace, WorkerCut, staging_dir};
use crate::exports::{ClusterExports, ExportPlan};
use crate::faults;
use crate::generation::Generation;
use crate::lazy::BackupCut;
use crate::rendezvous::{Parted, Rendezvous};
use crate::transport::{ClusterError, PartRequest, PartWritten};
use sparrow_core::batch::StreamMark;
use sparrow_trainer::export::RowsPart;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

pub struct Commits {
    meet: Rendezvous<WorkerCut, Committed>,
    /// Timed checkpoints: where the next one falls.
    pace: Pace,
    /// Where the training data stands in the current generation (its
    /// checkpoints' positions), from its restored checkpoint on; an error
    /// if that checkpoint could not be read.
    progress: PerGeneration<Result<DataProgress, String>>,
    /// Serving exports (`checkpoint.export_every_steps`, `export_every_secs`).
    exports: OrderedMutex<Option<ClusterExports>>,
    /// A meeting for an export alone added trained batches to `progress`:
    /// the next checkpoint records them.
    unsaved_progress: AtomicBool,
}

impl Commits {
    pub fn new(config: &Config, workers: usize, generation: Generation, restore: Option<&Path>) -> Commits {
        Commits {
            meet: Rendezvous::new("checkpoint", workers, generation).one_at_a_time(),
            pace: Pace::new(config),
            progress: PerGeneration::new(generation, progress_from(generation, restore)),
            exports: OrderedMutex::new(Rank::Leaf, "commits.exports", ClusterExports::new(config)),
            unsaved_progress: AtomicBool::new(false),
        }
    }

    /// Generation `generation` started (under the generations lock).
    pub fn advance(&self, generation: Generation) {
        self.meet.advance(generation);
        self.progress.pending(generation);
    }

    /// Reads the data progress of `generation` from its restored checkpoint
    /// (outside every lock).
    pub fn restore_progress(&self, generation: Generation, restore: Option<&Path>) {
        let _ = self.progress.install(generation, progress_from(generation, restore));
    }

    pub fn fail(&self, reason: &str) {
        self.meet.fail(reason.to_string());
    }

    /// The generation's data progress with the cuts' trained batches added.
    fn data_progress(&self, generation: Generation, cuts: &[WorkerCut]) -> Result<DataProgress, ClusterError> {
        let added = self.progress.with(generation, |progress| {
            let progress = progress.as_mut().map_err(|e| ClusterError::Setup(e.clone()))?;
            progress.add(cuts.iter().flat_map(|c| c.trained.iter().cloned()));
            Ok(progress.clone())
        });
        added.map_err(|OtherGeneration(serving)| ClusterError::StaleGeneration {
            peer: "the coordinator".into(),
            what: "a checkpoint".into(),
            found: generation,
            serving,
        })?
    }
}

/// A generation's data progress, from the checkpoint it restores (read now:
/// later commits may prune it).
fn progress_from(generation: Generation, restore: Option<&Path>) -> Result<DataProgress, String> {
    let manifest = restore.map(sparrow_trainer::checkpoint::read_manifest).transpose().map_err(|e| e.to_string())?;
    Ok(DataProgress::restored(generation, manifest.as_ref()))
}

impl Coordinator {
    /// A worker at a meeting step: returns the committed version once every
    /// worker reached the step and every shard wrote its part (or, at a
    /// meeting for a serving export alone, the last checkpoint before it).
    pub fn checkpoint(&self, cut: WorkerCut) -> Result<Committed, ClusterError> {
        let (generation, step, worker) = (cut.generation, cut.step, cut.worker);
        let close = |cuts: Vec<WorkerCut>| {
            let outcome = self.commit(&cuts, false).map_err(|e| e.to_string());
            if let Err(e) = &outcome {
                tracing::error!("checkpoint at step {step}: {e}");
            }
            outcome
        };
        let committed = self.commits.meet.arrive(generation, step, worker, cut, |_, _| Ok(()), close);
        committed.map_err(|parted| match parted {
            Parted::Stale { serving, .. } => ClusterError::GenerationChanged { generation: serving },
            Parted::CloseFailed(e) => ClusterError::Setup(format!("the checkpoint failed: {e}")),
            other => other.into_cluster_error("the coordinator", || format!("worker {worker}'s checkpoint")),
        })
    }

    /// The cut the workers' `cuts` describe: a checkpoint (always with
    /// `checkpoint`), a serving export, or both, every shard writing its
    /// parts in one cut. Returns the version, and the step of the next
    /// timed meeting.
    pub(super) fn commit(&self, cuts: &[WorkerCut], checkpoint: bool) -> Result<Committed, ClusterError> {
        let start = Instant::now();
        let first = &cuts[0];
        let (generation, step) = (first.generation, first.step);
        let root = PathBuf::from(
            self.config.checkpoint.dir.as_deref().ok_or_else(|| ClusterError::Setup("no checkpoint.dir".into()))?,
        );
        let dialer = self.dialer.as_ref().ok_or_else(|| ClusterError::Setup("no way to reach the shards".into()))?;
        let staging = staging_dir(&root, step, generation);
        std::fs::create_dir_all(&staging)
            .map_err(|e| ClusterError::Io { what: format!("creating {}", staging.display()), source: e })?;
        let shards = dialer.dial(&self.members.view(generation).shards)?;
        let (committed, deltas_since_full) = self.generations.committed();
        let pace = &self.commits.pace;
        // A meeting one off the named step is the job's last, or the first after a recovery.
        let named = pace.named(step);
        let last = cuts.iter().any(|c| c.last) || !named;
        let on_steps = crate::checkpoint::checkpoint_every(&self.config).is_some_and(|e| step.is_multiple_of(e.max(1)));
        // Only a timed meeting on schedule may write an export alone.
        let checkpoint =
            checkpoint || committed.is_none() || !pace.timed() || last || on_steps || pace.checkpoint_due();
        let mut plan =
            self.commits.exports.lock().as_mut().and_then(|e| e.due(step, generation, named, last, self.num_shards));
        if let Some(Err(e)) = plan.as_ref().map(ExportPlan::prepare) {
            tracing::warn!("step {step}: no serving export: {e}");
            self.export_failed(plan.take());
        }
        // Incremental on the last commit when it has a part per shard and
        // the full version is not due.
        let incremental =
            self.config.checkpoint.incremental && deltas_since_full + 1 < self.config.checkpoint.full_every;
        let (base, since) = match (&committed, incremental && checkpoint) {
            (Some((dir, _)), true) => match sparrow_trainer::checkpoint::read_manifest(dir) {
                Ok(m) if m.parts.len() == self.num_shards => {
                    (Some(dir.clone()), m.parts.iter().map(|p| Some(p.clock)).collect::<Vec<_>>())
                }
                _ => (None, vec![None; self.num_shards]),
            },
            _ => (None, vec![None; self.num_shards]),
        };
        let requests: Vec<PartRequest> = (0..shards.len())
            .map(|i| PartRequest {
                checkpoint: checkpoint.then(|| staging.clone()),
                since: since.get(i).copied().flatten(),
                export: plan.as_ref().map(|p| p.request(i)),
            })
            .collect();
        let written: Result<Vec<PartWritten>, ClusterError> = std::thread::scope(|scope| {
            let handles: Vec<_> = shards
                .iter()
                .zip(&requests)
                .map(|(shard, request)| scope.spawn(move || shard.write_part(generation, request)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(ClusterError::Setup("a part writer panicked".into()))))
                .collect()
        });
        let written = match written {
            Ok(written) => written,
            Err(e) => {
                self.export_failed(plan);
                return Err(e);
            }
        };
        let trained = cuts.iter().any(|c| !c.trained.is_empty());
        let progress = match trained || (checkpoint && self.commits.unsaved_progress.load(Relaxed)) {
            true => Some(self.commits.data_progress(generation, cuts)?),
            false => None,
        };
        let mark = crate::checkpoint::resume_point(cuts, progress.as_ref()).2;
        let (dir, dense_dir) = if checkpoint {
            let dir =
                self.commit_checkpoint(cuts, &written, base.as_deref(), &root, &staging, progress.as_ref(), start)?;
            self.commits.unsaved_progress.store(false, Relaxed);
            (dir.clone(), dir)
        } else {
            // A checkpoint was committed before (else this meeting would be one).
            let (dir, _) =
                committed.ok_or_else(|| ClusterError::Setup("an export's cut before any checkpoint".into()))?;
            self.commits.unsaved_progress.fetch_or(trained, Relaxed);
            (dir, staging.clone())
        };
        if let Some(plan) = plan {
            self.land_export(plan, &written, &dense_dir, mark);
        }
        if !checkpoint {
            // Worker 0's dense weights, read for the export: the cut leaves no version.
            let _ = std::fs::remove_dir_all(&staging);
        }
        let (next_step, _) = pace.committed(step);
        Ok(Committed { dir, next_step, checkpoint })
    }

    /// Checks and commits a checkpoint whose parts are written.
    #[allow(clippy::too_many_arguments)]
    fn commit_checkpoint(
        &self,
        cuts: &[WorkerCut],
        written: &[PartWritten],
        base: Option<&Path>,
        root: &Path,
        staging: &Path,
        progress: Option<&DataProgress>,
        start: Instant,
    ) -> Result<PathBuf, ClusterError> {
        let step = cuts[0].step;
        let manifest = crate::checkpoint::manifest(&self.config, cuts, written, base, staging, progress)?;
        faults::point("coordinator.commit");
        let dir = sparrow_trainer::checkpoint::commit(root, staging, &manifest, self.config.checkpoint.keep)?;
        let bytes: u64 = manifest.files.values().map(|f| f.bytes).sum();
        let secs = start.elapsed().as_secs_f64();
        let shard_mb_per_sec: Vec<f64> = written
            .iter()
            .map(|w| {
                let bytes = w.written.as_ref().map_or(0, |p| p.files.iter().map(|(_, b)| *b).sum::<u64>());
                bytes as f64 / 1e6 / w.secs.max(1e-9)
            })
            .collect();
        self.generations.record_commit(dir.clone(), step, base.is_some());
        crate::epochs::keep_best(&self.config, &dir)?;
        self.commits.pace.checkpointed();
        tracing::info!(
            "checkpoint at step {step} committed: {} ({bytes} bytes{}, {secs:.3} s)",
            dir.display(),
            if base.is_some() { ", incremental" } else { "" }
        );
        (self.events)(&Event::Committed {
            step,
            dir: dir.display().to_string(),
            bytes,
            secs,
            incremental: base.is_some(),
            shard_mb_per_sec,
        });
        Ok(dir)
    }

    /// Puts a serving export in place once the shards wrote their parts
    /// (a failure is a warning, and the next export is full: training goes on).
    fn land_export(&self, plan: ExportPlan, written: &[PartWritten], dense_dir: &Path, mark: Option<StreamMark>) {
        let start = Instant::now();
        let parts: Option<Vec<RowsPart>> = written.iter().map(|w| w.export.clone()).collect();
        let parts = parts.ok_or_else(|| ClusterError::Setup("a shard wrote no part of the export".into()));
        match parts.and_then(|parts| plan.put_in_place(&self.config, dense_dir, &parts, mark).map(|dir| (dir, parts))) {
            Ok((dir, parts)) => {
                let older = self.commits.exports.lock().as_mut().and_then(|e| e.landed(&plan, &parts));
                if let Some(older) = older {
                    plan.prune(&older);
                }
                tracing::info!(
                    "step {}: serving export {} ({} rows{}, {:.3} s)",
                    plan.step(),
                    dir.display(),
                    parts.iter().map(|p| p.rows).sum::<u64>(),
                    if plan.full() { ", full" } else { "" },
                    start.elapsed().as_secs_f64()
                );
            }
            Err(e) => {
                tracing::warn!("step {}: the serving export was not written: {e}", plan.step());
                self.export_failed(Some(plan));
            }
        }
    }

    /// An export that was not written: its staging goes, the next is full.
    fn export_failed(&self, plan: Option<ExportPlan>) {
        if let Some(plan) = plan {
            plan.abandon();
            if let Some(exports) = self.commits.exports.lock().as_mut() {
                exports.failed();
            }
        }
    }

    /// Commits a lazy job's backup as a checkpoint: the aggregated weights
    /// (with fresh Adam state: replicas' moments are their own and are never
    /// aggregated), every shard's part, the furthest data position aggregated.
    pub fn commit_backup(&self, cut: &BackupCut) -> Result<PathBuf, ClusterError> {
        let root = PathBuf::from(
            self.config.checkpoint.dir.as_deref().ok_or_else(|| ClusterError::Setup("no checkpoint.dir".into()))?,
        );
        let generation = self.generations.current();
        let model = self.model_with(&cut.weights)?;
        let optimizer = sparrow_model::DenseOptimizer::new(self.config.dense_optimizer.clone(), self.config.train.simd);
        crate::checkpoint::write_dense(&root, cut.step, generation, &model, &optimizer)?;
        let worker_cut = WorkerCut {
            worker: 0,
            generation,
            step: cut.step,
            samples_trained: cut.samples,
            dense_optimizer_step: 0,
            position: cut.position,
            wrote_dense: true,
            trained: Vec::new(),
            stream: None,
            last: false,
            // Early stopping moves only at an epoch's end (a worker's
            // checkpoint): a backup keeps the last committed one's state.
            early_stopping: self.generations.committed().0.and_then(|(dir, _)| {
                sparrow_trainer::checkpoint::read_manifest(&dir).ok().and_then(|m| m.early_stopping)
            }),
        };
        self.commit(&[worker_cut], true).map(|c| c.dir)
    }

    /// Writes backup `number` as a serving export under
    /// `checkpoint.dir/exports/`, the rows as the shards hold them now (not
    /// a cut: training goes on), and points `exports/LATEST` at it.
    pub fn write_backup(&self, number: u64, weights: &[f32]) -> Result<PathBuf, ClusterError> {
        let root = self.config.checkpoint.dir.as_ref().map(|d| PathBuf::from(d).join("exports"));
        let root = root.ok_or_else(|| ClusterError::Setup("backups need checkpoint.dir".into()))?;
        std::fs::create_dir_all(&root)
            .map_err(|e| ClusterError::Io { what: format!("creating {}", root.display()), source: e })?;
        let layout = sparrow_data::DataLayout::from_config(&self.config.data);
        let model = self.model_with(weights)?;
        let dialer = self.dialer.as_ref().ok_or_else(|| ClusterError::Setup("no way to reach the shards".into()))?;
        let shards = dialer.dial(&self.members.view(self.generations.current()).shards)?;
        let dim = self.config.model.embedding_dim;
        let (mut shard, mut cursor) = (0usize, Some((0usize, 0usize)));
        let pages = || -> Result<sparrow_trainer::export::RowPage, sparrow_trainer::TrainError> {
            while shard < shards.len() {
                let Some(at) = cursor else {
                    (shard, cursor) = (shard + 1, Some((0, 0)));
                    continue;
                };
                let page =
                    shards[shard].export(at, 4096).map_err(|e| sparrow_trainer::TrainError::DenseSync(Box::new(e)))?;
                cursor = page.next;
                let row_len = page.rows.len() / page.keys.len().max(1);
                let vectors = page.rows.chunks_exact(row_len.max(1)).flat_map(|r| r[..dim].iter().copied()).collect();
                return Ok(Some((page.keys, vectors)));
            }
            Ok(None)
        };
        let name = format!("{number:08}");
        let dir = root.join(&name);
        sparrow_trainer::export::write_export(&dir, &self.config, &layout, number, &model, pages)?;
        sparrow_trainer::export::point_latest(&root, &name)?;
        Ok(dir)
    }

    /// The job's dense model with `weights`.
    fn model_with(&self, weights: &[f32]) -> Result<sparrow_model::DenseModel, ClusterError> {
        let layout = sparrow_data::DataLayout::from_config(&self.config.data);
        let model = sparrow_trainer::initial_model(&self.config, &layout)?;
        model.params.set_flat(weights).map_err(sparrow_trainer::TrainError::from)?;
        Ok(model)
    }
}
