//! `data.validation` in a cluster job: one epoch a generation (or, with
//! `train.eval_every_steps`, one stretch of that many steps).
//!
//! `sparrow train` scores the validation set at each epoch's end before
//! the next epoch's first batch, and after every `train.eval_every_steps`
//! steps. A cluster does it with the machinery it has for recovery, so
//! every sync policy keeps its own end of data:
//! - the loader's stream ends with the epoch it starts in
//!   (`Loader::one_epoch`), or at the next multiple of
//!   `train.eval_every_steps` ([`batches_to_validation`]), and says whether
//!   the training batches ran out at such a point
//!   (`LoaderService::training_ended_at_epoch_end`);
//! - the workers meet as at the data's end; once every update is on the
//!   shards worker 0 scores the validation set through them and judges
//!   `[train.early_stopping]` (`worker/validation.rs`); every worker then
//!   takes part in the checkpoint there, which keeps the judgement;
//! - the coordinator copies a new best to `checkpoint.dir/best` and, when
//!   every worker finished, starts the next stretch as a generation of its
//!   own from that checkpoint ([`after`]), or ends the job (the
//!   last epoch, patience spent, `train.max_steps`, a stop).
//!
//! A role that dies at any point restores the last committed checkpoint as
//! in any generation: a validation point's own checkpoint is only ever
//! written after its judgement, so nothing is judged twice. One restored at
//! a validation point not yet judged (a periodic checkpoint of its step, a
//! stop right there) gets a stream that ends at once: that point is
//! validated before training goes on, as `sparrow train` does on a resume
//! from there.

use std::path::Path;

use sparrow_core::Config;
use sparrow_core::config::SyncMode;
use sparrow_trainer::checkpoint::{Manifest, read_manifest};
use sparrow_trainer::early_stopping::StoppingState;

use crate::transport::ClusterError;

/// Why a cluster job cannot validate as asked, naming the keys.
pub fn check(config: &Config) -> Result<(), ClusterError> {
    if config.data.validation.is_none() {
        return Ok(());
    }
    let refuse = |why: &str| Err(ClusterError::Setup(format!("data.validation in a cluster job: {why}")));
    if config.checkpoint.dir.is_none() {
        return refuse(
            "each epoch ends with a checkpoint the next one starts from (and `best` is kept beside them): set \
             checkpoint.dir",
        );
    }
    if config.data.stream.is_some() {
        return refuse("a [data.stream] has no epochs to validate at the end of");
    }
    // Found now, not after the first epoch's training.
    if let Some((path, _)) = config.data.for_validation()
        && let Err(e) = std::fs::File::open(&path)
    {
        return refuse(&format!("{path}: {e}"));
    }
    Ok(())
}

/// Whether `state` says training stops (patience spent).
pub fn stopped(config: &Config, state: &StoppingState) -> bool {
    config.train.early_stopping.as_ref().is_some_and(|rule| state.since_best >= rule.patience)
}

/// Whether the checkpoint `manifest` was validated at its step (an
/// epoch's end whose judgement it keeps).
pub fn validated_at(manifest: &Manifest) -> bool {
    manifest.early_stopping.as_ref().is_some_and(|s| s.validated_step == Some(manifest.step))
}

/// Whether the checkpoint `manifest` was judged at its step and stops there.
pub fn stops_at(config: &Config, manifest: &Manifest) -> bool {
    validated_at(manifest) && manifest.early_stopping.as_ref().is_some_and(|s| stopped(config, s))
}

/// `train.eval_every_steps` beside `data.validation`: how many batches a
/// generation restored at job step `step` hands out before its validation
/// point, the next multiple (none when the checkpoint there is at one not
/// yet `validated`: it is validated first). A job step is a batch with
/// one worker, and under `round` and `lazy` sync; under `step` sync it
/// takes a batch from each of `workers` (more from a faster one, so there
/// the points come about every so many steps). `None`: epochs' ends only.
pub fn batches_to_validation(config: &Config, step: u64, validated: bool, workers: usize) -> Option<u64> {
    config.data.validation.as_ref()?;
    let every = config.train.eval_every_steps.filter(|&n| n > 0)?;
    let steps = match step % every {
        0 if step > 0 && !validated => 0,
        done => every - done,
    };
    let per_step = if config.cluster.sync == SyncMode::Step { workers.max(1) as u64 } else { 1 };
    Some(steps * per_step)
}

/// The generation after one whose last commit is `committed`, once every
/// worker finished it: where it starts (the step validated, and its
/// epoch), if training goes on (the checkpoint was judged, neither early
/// stopping nor `train.max_steps` ended the job, and epochs remain: with
/// `train.eval_every_steps` the last epoch's own end is not told from a
/// point inside it, so one more generation starts there and trains
/// nothing, which ends the job).
fn next_generation(config: &Config, committed: Option<&Path>) -> Option<(u64, u64)> {
    config.data.validation.as_ref()?;
    let m = read_manifest(committed?).ok()?;
    let epochs_left = m.position.epoch + 1 < config.train.epochs
        || (m.position.epoch + 1 == config.train.epochs && config.train.eval_every_steps.is_some_and(|n| n > 0));
    let more = epochs_left && config.train.max_steps.is_none_or(|n| m.step < n);
    (validated_at(&m) && more && !stops_at(config, &m)).then_some((m.step, m.position.epoch))
}

/// The generation after one that restored `restore` and whose newest
/// commit is `committed`, as [`next_generation`] says, once every worker
/// finished it; none after one that committed nothing new (it trained
/// nothing, as after a stop). The coordinator's rule; worker 0 reads it
/// too, and scores `data.test` in the job's last generation alone, as
/// `sparrow train` scores it once, at the end.
pub fn after(config: &Config, committed: Option<&Path>, restore: Option<&Path>) -> Option<(u64, u64)> {
    if committed == restore {
        return None;
    }
    next_generation(config, committed)
}

/// Keeps the committed version `dir` as `best` if its judgement made it the
/// best (the coordinator, after a commit; again at a generation's start,
/// in case it died in between): its files (and the versions an incremental
/// one builds on) copied, then committed there as a checkpoint of its own.
pub fn keep_best(config: &Config, dir: &Path) -> Result<(), ClusterError> {
    let Some(root) = sparrow_trainer::validation::best_dir(config).filter(|_| config.train.early_stopping.is_some())
    else {
        return Ok(());
    };
    let m = read_manifest(dir)?;
    let is_best = m
        .early_stopping
        .as_ref()
        .is_some_and(|s| s.validated_step == Some(m.step) && s.best.is_some_and(|b| b.step == m.step));
    let kept = sparrow_trainer::checkpoint::resolve(&root).and_then(|d| read_manifest(&d));
    if !is_best || kept.is_ok_and(|b| b.step == m.step) {
        return Ok(());
    }
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e: std::io::Error| ClusterError::Io {
            what: format!("keeping the best model: {}", p.display()),
            source: e,
        }
    };
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    // An incremental version reads its bases from beside it.
    let versions = dir.parent().ok_or_else(|| ClusterError::Setup(format!("{}: no parent", dir.display())))?;
    let mut base = m.base.clone();
    while let Some(name) = base {
        let (from, to) = (versions.join(&name), root.join(&name));
        if !to.exists() {
            copy_dir(&from, &root.join(format!(".tmp-{name}")), true, &io)?;
            std::fs::rename(root.join(format!(".tmp-{name}")), &to).map_err(io(&to))?;
        }
        base = read_manifest(&from)?.base;
    }
    let staging = root.join(format!(".tmp-best-{}-{}", m.step, std::process::id()));
    copy_dir(dir, &staging, false, &io)?;
    sparrow_trainer::checkpoint::commit(&root, &staging, &m, 1)?;
    tracing::info!("step {}: the best validation so far; kept in {}", m.step, root.display());
    Ok(())
}

/// Copies the files of version `from` into a fresh `to` (its manifest
/// only `with_manifest`: `commit` writes the top one's).
fn copy_dir<F>(from: &Path, to: &Path, with_manifest: bool, io: &impl Fn(&Path) -> F) -> Result<(), ClusterError>
where
    F: FnOnce(std::io::Error) -> ClusterError,
{
    if to.exists() {
        std::fs::remove_dir_all(to).map_err(io(to))?;
    }
    std::fs::create_dir_all(to).map_err(io(to))?;
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        if !with_manifest && entry.file_name() == sparrow_trainer::checkpoint::MANIFEST_FILE {
            continue;
        }
        let target = to.join(entry.file_name());
        std::fs::copy(entry.path(), &target).map_err(io(&target))?;
    }
    Ok(())
}
