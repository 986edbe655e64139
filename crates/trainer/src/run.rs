//! The `train`, `eval` and `predict` jobs.

use sparrow_core::Overrides;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sparrow_core::Config;
use sparrow_core::metrics::sigmoid;
use sparrow_core::metrics::tasks::TaskFigures;
use sparrow_data::synth::Truth;
use sparrow_data::{BadRows, DataError, DataLayout};
use sparrow_embedding::{EmbeddingTable, FilterStats, TierStats};
use std::collections::BTreeMap;

use crate::checkpoint;
use crate::driver::{At, Observers, RunLog};
use crate::evaluation::{Figures, Scores, predict_file};
use crate::inference::Model;
use crate::input::{StreamReport, TrainingInput};
use crate::local_run::LocalRun;
use crate::online::OnlineReport;
use crate::progress::{Progress, ProgressUpdate};
use crate::trainer::{PhaseSecs, Trainer};
use crate::validation::{Validation, ValidationReport};
use crate::{TrainError, peak_rss_bytes};

/// The last stdout line of `sparrow train` and of `sparrow launch`: a
/// contract read by scripts. One type for both: `phases` is how the step's
/// time is broken down where it ran, `extra` the fields only one of them has
/// (flattened into the same JSON object).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunSummary<P, X> {
    pub test_auc: Option<f64>,
    pub test_logloss: Option<f64>,
    /// Samples trained by this run.
    pub train_rows: u64,
    /// Training phase only (reading runs alongside in its own thread).
    pub samples_per_sec: f64,
    pub wall_secs: f64,
    pub peak_rss_bytes: u64,
    pub embedding_rows: u64,
    pub bad_rows: u64,
    pub model: String,
    pub steps: u64,
    pub train_secs: f64,
    pub eval_secs: f64,
    pub test_rows: u64,
    /// Test rows whose prediction was NaN (ranked last by `test_auc`).
    pub test_nan_predictions: u64,
    /// Batches skipped for a non-finite loss or gradient (`train.on_non_finite = "skip_batch"`).
    pub skipped_batches: u64,
    /// `[data.weighting]`: training samples folded into identical ones,
    /// merged samples dropped as too light, and the trained samples' weights
    /// summed (without weighting: 0, 0 and `train_rows`).
    pub merged_samples: u64,
    pub dropped_samples: u64,
    pub sample_weight_sum: f64,
    /// `data.schema.sequence`: trained samples' sequences cut to their
    /// `max_len` (each kept its newest IDs).
    pub truncated_sequences: u64,
    /// Mean training log-loss over the last logging interval.
    pub train_logloss: Option<f64>,
    /// Keys per batch before / after the first dedup, averaged.
    pub dedup_ratio: f64,
    /// Bytes of keys per sample a shuffle to their owners carries after the
    /// first dedup (8 per unique key); without the dedup it would be
    /// `dedup_ratio` times this.
    pub shuffle_bytes_per_sample: f64,
    /// The SSD tier and the feature filters (a cluster sums its shards').
    #[serde(flatten)]
    pub table: TableReport,
    /// Bytes the table holds per row (arena + index); null where the table
    /// is in other processes.
    pub embedding_bytes_per_row: Option<f64>,
    pub checkpoint: Option<String>,
    pub resumed_from_step: Option<u64>,
    /// Wall seconds per phase of the training step (where the time goes).
    pub step_phase_secs: P,
    /// From `truth.json` beside the test file, when the data is generated.
    pub bayes_auc: Option<f64>,
    pub bayes_logloss: Option<f64>,
    /// `[data.stream]`: offsets, records, malformed records, lag.
    #[serde(flatten)]
    pub stream: StreamReport,
    /// Progressive validation (`train.online_window_samples`).
    #[serde(flatten)]
    pub online: OnlineReport,
    /// Every task's test figures by name (none without `data.test`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tasks: BTreeMap<String, TaskFigures>,
    /// `data.validation` and `[train.early_stopping]`.
    #[serde(flatten)]
    pub validation: ValidationReport,
    #[serde(flatten)]
    pub extra: X,
}

/// `sparrow train` has no fields beyond the common ones.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct NoExtra {}

/// What `sparrow train` prints.
pub type TrainSummary = RunSummary<PhaseSecs, NoExtra>;

/// What the embedding table's SSD tier and feature filters did: part of
/// `train`'s and `launch`'s JSON (a cluster sums its shards' counters).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TableReport {
    /// SSD tier (`embedding.storage = "ssd"`; null in memory): lookups of
    /// known keys served by the memory cache without a store read on their
    /// behalf (a prefetched row counts as a miss).
    pub cache_hit_rate: Option<f64>,
    /// Store reads a training lookup had to make itself (the prefetch stage
    /// missed them); 0 in steady state.
    pub lookup_misses_after_prefetch: Option<u64>,
    /// Rows the SSD tier's cache holds at the end, and rows written back to the store.
    pub cached_rows: Option<u64>,
    pub ssd_writebacks: Option<u64>,
    /// `embedding.admit_min_count`: keys given a row after enough sightings,
    /// and training lookups of keys not admitted yet.
    pub admitted_keys: u64,
    pub not_admitted_lookups: u64,
    /// `embedding.ttl_steps` / `ttl_secs`: rows deleted for not being used.
    pub expired_rows: u64,
    /// `embedding.max_rows`: rows evicted (least recently used) to stay within it.
    pub evicted_rows: u64,
}

impl TableReport {
    pub fn new(tier: Option<TierStats>, cached_rows: u64, filters: FilterStats) -> TableReport {
        TableReport {
            cache_hit_rate: tier.map(|t| t.cache_hit_rate()),
            lookup_misses_after_prefetch: tier.map(|t| t.loads),
            cached_rows: tier.map(|_| cached_rows),
            ssd_writebacks: tier.map(|t| t.writebacks),
            admitted_keys: filters.admitted,
            not_admitted_lookups: filters.not_admitted,
            expired_rows: filters.expired,
            evicted_rows: filters.evicted,
        }
    }

    pub fn of(table: &EmbeddingTable) -> TableReport {
        TableReport::new(table.tier_stats(), table.cached_rows() as u64, table.filter_stats())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct EvalSummary {
    pub auc: f64,
    pub logloss: f64,
    pub rows: u64,
    /// Rows whose prediction was NaN (a diverged model): ranked last by `auc`.
    pub nan_predictions: u64,
    pub bad_rows: u64,
    pub checkpoint_step: u64,
    pub wall_secs: f64,
    /// Every task's figures by name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tasks: BTreeMap<String, TaskFigures>,
}

/// The rayon pool a job's compute runs in (`train.threads` threads: matmuls,
/// table shards, pooling): the one place such a pool is built.
pub fn compute_pool(threads: usize) -> Result<rayon::ThreadPool, TrainError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("sparrow-compute-{i}"))
        .build()
        .map_err(TrainError::ThreadPool)
}

/// Trains as configured, evaluates on `data.test`, writes the checkpoint.
pub fn train(config: &Config, quiet: bool) -> Result<TrainSummary, TrainError> {
    train_until(config, quiet, &AtomicBool::new(false))
}

/// [`train`], stopping after the current step once `stop` is set (Ctrl-C):
/// the checkpoint is written and [`TrainError::Interrupted`] returned.
pub fn train_until(config: &Config, quiet: bool, stop: &AtomicBool) -> Result<TrainSummary, TrainError> {
    train_observed(config, quiet, stop, &|_| {})
}

/// [`train_until`], telling `observer` where the run stands at every
/// logging interval (from the training thread).
pub fn train_observed(
    config: &Config,
    quiet: bool,
    stop: &AtomicBool,
    observer: &(dyn Fn(&ProgressUpdate) + Sync),
) -> Result<TrainSummary, TrainError> {
    let wall = Instant::now();
    let pool = compute_pool(config.train.threads)?;
    pool.install(|| {
        let config = crate::standardize::with_dense_statistics(config, stop)?;
        train_in_pool(&config, quiet, wall, stop, observer)
    })
}

/// Says, in one line, how `model.precision = "bf16"` runs on this CPU:
/// on AMX's tiles (and that its bits are AMX's), on AVX-512-BF16 (only
/// where its product is no faster than fp32's FMA, measured: about 30 ms of its own CPU time,
/// once a run; or where the CPU has AMX but Linux refused its tiles), on
/// the fp32 kernels, or on the portable kernel.
pub fn note_precision(model: &sparrow_core::config::ModelConfig, simd: sparrow_core::simd::Simd) {
    use sparrow_core::config::Precision;
    use sparrow_model::bf16::Bf16Path;
    let has_products = sparrow_model::kinds::find(&model.kind).is_ok_and(|k| k.has_products());
    if model.precision != Precision::Bf16 || !has_products {
        return;
    }
    match sparrow_model::bf16::path(simd) {
        path @ Bf16Path::Amx => tracing::info!("model.precision = \"bf16\": {}", path.describe()),
        Bf16Path::Native => {
            if let (Some(refused), true) = (sparrow_model::amx::refusal(), simd.allows_amx()) {
                tracing::warn!("model.precision = \"bf16\": this CPU has AMX, but {refused}: AVX-512-BF16 instead");
            }
            let peaks = sparrow_model::peak::measure_one_thread(5, std::time::Duration::from_millis(3));
            if let Some(slow) = sparrow_model::peak::slow_bf16(&peaks) {
                tracing::warn!("model.precision = \"bf16\": {slow}")
            }
        }
        path @ Bf16Path::Rounded(_) => {
            tracing::info!("model.precision = \"bf16\": {}", path.describe())
        }
        path @ Bf16Path::Portable => {
            tracing::warn!("model.precision = \"bf16\": {}", path.describe())
        }
    }
}

fn train_in_pool(
    config: &Config,
    quiet: bool,
    wall: Instant,
    stop: &AtomicBool,
    observer: &(dyn Fn(&ProgressUpdate) + Sync),
) -> Result<TrainSummary, TrainError> {
    if config.train.simd == sparrow_core::simd::Simd::Avx2 {
        tracing::info!(
            "train.simd = \"avx2\": Sparrow's kernels run as on a CPU without AVX-512, in fp32 the same model as \
             \"auto\" at that path's speed; the gemm crate's products (layers wider than 64 outputs) keep this \
             CPU's widest kernels"
        );
    }
    note_precision(&config.model, config.train.simd);
    if config.checkpoint.incremental {
        tracing::warn!("checkpoint.incremental applies to sparrow launch; sparrow train writes full checkpoints");
    }
    // Fail before training, not after it, when the test file is missing.
    if let Some(test) = &config.data.test {
        std::fs::File::open(test).map_err(|e| TrainError::io(Path::new(test), e))?;
    }
    if let Some(validation) = Validation::of(config) {
        validation.check_exists()?;
    }
    // One run per checkpoint directory, and a directory we cannot write is
    // found now, not after training.
    let _lock = config
        .checkpoint
        .dir
        .as_deref()
        .map(|dir| crate::dir_lock::DirLock::acquire(Path::new(dir), "checkpoint.dir"))
        .transpose()?;
    let layout = DataLayout::from_config(&config.data);
    let mut trainer = Trainer::new(config, layout)?;
    let mut resumed_from_step = None;
    if let Some(from) = &config.checkpoint.resume_from {
        let dir = checkpoint::resolve(Path::new(from))?;
        let m = checkpoint::load_into(&mut trainer, &dir)?;
        resumed_from_step = Some(m.step);
        if !quiet {
            tracing::info!("resumed from {} (step {}, {} embedding rows)", dir.display(), m.step, m.embedding_rows);
        }
    }
    let bad = BadRows::from_config(&config.data);
    let input = TrainingInput::open(config, &trainer, &bad)?;
    let progress = Progress::new(input.bytes_total, quiet);
    let start_samples = trainer.samples_trained;
    let origin = input.origin.clone();
    let at = At { step: trainer.step, batches: trainer.step, ..At::default() };
    let observers = Observers::new(config, at, true, RunLog::open(config, None, at)?);
    let mut run = LocalRun::new(config, &mut trainer, input, observers, stop, bad, progress, observer);
    let mut outcome = crate::driver::drive(&mut run);
    // A stream's wait for records that never came, after the last step
    // (stop_when_idle_secs), is not training time.
    let waited_at_end = run.started.elapsed().saturating_sub(run.trained_for);
    let LocalRun { mut observers, bad, progress, mut exports, last_saved, started, validation, .. } = run;
    // A run that trained nothing did not succeed: an empty file, or one whose
    // every row was malformed (a resumed run may find its data used up).
    if outcome.is_ok()
        && trainer.samples_trained == start_samples
        && trainer.skipped_batches == 0
        && resumed_from_step.is_none()
    {
        let why = match (bad.total(), config.data.stream.is_some()) {
            (0, false) => sparrow_core::config::no_row_left(&config.data),
            (0, true) => crate::input::NO_RECORD.to_string(),
            (n, _) => format!("all {n} rows were malformed (the first ones are reported above)"),
        };
        outcome = Err(DataError::NoRows { path: origin.clone(), why }.into());
    }
    let flushed = trainer.flush_update();
    if outcome.is_ok()
        && let Err(e) = flushed
    {
        outcome = Err(e);
    }
    // Rows past ttl_steps leave the table before it is evaluated, reported
    // and saved.
    let swept = trainer.table.sweep_expired();
    if outcome.is_ok()
        && let Err(e) = swept
    {
        outcome = Err(e.into());
    }
    progress.finish();
    let train_secs = started.elapsed().saturating_sub(waited_at_end).as_secs_f64();

    // Whatever happened, what was trained is written before anything else
    // (unless the periodic checkpoint of this very step already holds it).
    // A failure that left the table between two steps writes nothing: a
    // checkpoint is exactly the state of one step, or it is not written.
    let consistent = trainer.is_consistent();
    // The final model is served too (unless this step's export holds it).
    if let Some((exports, _)) = exports.as_mut()
        && consistent
        && trainer.step > 0
        && exports.last_step != Some(trainer.step)
        && let Err(e) = exports.write(&trainer)
    {
        tracing::warn!("the final serving export was not written: {e}");
        if outcome.is_ok() {
            outcome = Err(e);
        }
    }
    let checkpoint_dir = match (&config.checkpoint.dir, last_saved) {
        (Some(_), Some((step, dir))) if step == trainer.step => Some(dir),
        (Some(_), _) if !consistent => None,
        (Some(dir), _) if trainer.step > 0 || outcome.is_ok() => {
            Some(checkpoint::save(&trainer, Path::new(dir), config.checkpoint.keep)?)
        }
        _ => None,
    };
    if let Err(e) = outcome {
        match &checkpoint_dir {
            Some(d) => tracing::info!(
                "stopped after step {}; the model so far is saved in {} (continue with --resume {})",
                trainer.step,
                d.display(),
                config.checkpoint.dir.as_deref().unwrap_or_default()
            ),
            None if !consistent => tracing::info!(
                "stopped during step {}; no checkpoint was written: the failure came after part of the step was \
                 applied (a failed lookup or prefetch had counted its keys in the feature filters, or the dense \
                 update was made before the embedding gradients overflowed), so the model is not the state of \
                 any one step (the last checkpoint written, if any, is the one LATEST names)",
                trainer.step + 1
            ),
            None if config.checkpoint.dir.is_some() => {
                tracing::info!("stopped after step {}; nothing was trained, so no checkpoint was written", trainer.step)
            }
            None => {
                tracing::info!("stopped after step {}; no checkpoint.dir is set, so nothing was saved", trainer.step)
            }
        }
        return Err(e);
    }

    let eval_start = Instant::now();
    let (mut figures, mut bayes) = (None, None);
    let mut report = ValidationReport::of(validation.as_ref(), &trainer);
    // `restore_best`: the test figures are the best model's (unless the
    // last one is the best).
    let best = config.train.early_stopping.as_ref().filter(|r| r.restore_best).and(report.best_step);
    let best_model = match (&config.data.test, &report.best_checkpoint) {
        (Some(_), Some(dir)) if best.is_some_and(|step| step != trainer.step) => {
            Some(load_model(Path::new(dir), &Overrides::default())?.0)
        }
        _ => None,
    };
    if config.data.test.is_some() {
        report.test_model = Some(if best_model.is_some() { "best" } else { "last" }.to_string());
    }
    if let Some(test) = &config.data.test {
        let test = Path::new(test);
        let scoring = best_model.as_ref().map_or_else(|| trainer.scoring(), Model::scoring);
        let scores = predict_file(scoring, test, &config.data, &bad)?;
        let f = Figures::of(config, &scores);
        warn_nan_predictions(f.nan_predictions, test);
        figures = Some(f);
        bayes = read_truth(test);
    }
    let eval_secs = eval_start.elapsed().as_secs_f64();
    let at = At {
        step: trainer.step,
        batches: trainer.step,
        samples: trainer.samples_trained,
        job_samples: trainer.samples_trained,
        epoch: trainer.position.epoch,
    };
    observers.log_eval(at, figures.as_ref())?;
    let (test_auc, test_logloss) = (figures.as_ref().map(|f| f.auc), figures.as_ref().map(|f| f.logloss));
    let (test_rows, test_nan_predictions) = figures.as_ref().map_or((0, 0), |f| (f.rows, f.nan_predictions));
    let train_rows = trainer.samples_trained - start_samples;
    let rows = trainer.table.len() as u64;
    // Taken after evaluation, which reads the store without counting.
    let table = TableReport::of(&trainer.table);
    Ok(RunSummary {
        test_auc,
        test_logloss,
        train_rows,
        samples_per_sec: train_rows as f64 / train_secs.max(1e-9),
        wall_secs: wall.elapsed().as_secs_f64(),
        peak_rss_bytes: peak_rss_bytes(),
        embedding_rows: rows,
        bad_rows: bad.total(),
        model: config.model.kind.name().to_string(),
        steps: trainer.step,
        train_secs,
        eval_secs,
        test_rows,
        test_nan_predictions,
        skipped_batches: trainer.skipped_batches,
        merged_samples: bad.weighting.merged.load(std::sync::atomic::Ordering::Relaxed),
        dropped_samples: bad.weighting.dropped.load(std::sync::atomic::Ordering::Relaxed),
        sample_weight_sum: match config.data.weighting {
            Some(_) => bad.weighting.weight_sum(),
            None => train_rows as f64,
        },
        truncated_sequences: trainer.truncated_sequences,
        train_logloss: observers.last_loss(),
        dedup_ratio: observers.dedup_ratio(),
        shuffle_bytes_per_sample: 8.0 * observers.unique_keys() as f64 / train_rows.max(1) as f64,
        table,
        embedding_bytes_per_row: Some(trainer.table.allocated_bytes() as f64 / rows.max(1) as f64),
        checkpoint: checkpoint_dir.map(|d| d.display().to_string()),
        resumed_from_step,
        step_phase_secs: trainer.phase_secs,
        bayes_auc: bayes.as_ref().map(|t| t.bayes_auc),
        bayes_logloss: bayes.as_ref().map(|t| t.bayes_logloss),
        stream: StreamReport::of(trainer.stream.as_deref()),
        online: OnlineReport::of(trainer.online.as_ref()),
        tasks: figures.map(|f| f.tasks).unwrap_or_default(),
        validation: report,
        extra: NoExtra {},
    })
}

/// The batch after the current one, for a stage working one batch ahead:
/// none past the last step (its keys would be inserted untrained); a read
/// error is kept in `deferred` to report once the current batch trained.
/// `truth.json` of a generated data set, if `test` is its test file.
pub fn read_truth(test: &Path) -> Option<Truth> {
    let path = test.parent()?.join("truth.json");
    let truth: Truth = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    (truth.test_rows > 0).then_some(truth)
}

/// The model in a checkpoint or a serving export (either, or a directory
/// whose LATEST names one), and the step it was taken at.
pub fn load_model(path: &Path, overrides: &Overrides) -> Result<(Model, u64), TrainError> {
    if crate::export::is_export(path) {
        let (model, manifest) = crate::export::load_export(path, overrides)?;
        Ok((model, manifest.step))
    } else {
        let (trainer, manifest, _) = checkpoint::load_trainer(path, overrides)?;
        Ok((Model::from(trainer), manifest.step))
    }
}

/// The logits `sparrow predict` turns into probabilities: one per good row
/// of `data`, read as `read` says (the model's `data.*`, or a variant of
/// it); and the malformed rows skipped. Runs in the current rayon pool (see
/// [`compute_pool`]).
pub fn score_file(
    model: &Model,
    data: &Path,
    read: &sparrow_core::config::DataConfig,
) -> Result<(Vec<f32>, u64), TrainError> {
    let bad = BadRows::from_config(read);
    let scores = predict_file(model.scoring(), data, read, &bad)?;
    Ok((scores.logits, bad.total()))
}

/// Logits and labels of every good row of `data` under a checkpoint's model.
struct Scored {
    scores: Scores,
    /// The model's job (its tasks).
    config: Config,
    bad_rows: u64,
    step: u64,
}

fn score_checkpoint(
    checkpoint: &Path,
    data: &Path,
    overrides: &Overrides,
    threads: Option<usize>,
) -> Result<Scored, TrainError> {
    let (trainer, manifest, _) = checkpoint::load_trainer(checkpoint, overrides)?;
    let pool = compute_pool(threads.unwrap_or(trainer.config.train.threads))?;
    let bad = BadRows::from_config(&trainer.config.data);
    let scores = pool.install(|| predict_file(trainer.scoring(), data, &trainer.config.data, &bad))?;
    Ok(Scored { scores, config: trainer.config.clone(), bad_rows: bad.total(), step: manifest.step })
}

/// Says on stderr how many predictions were NaN, if any.
fn warn_nan_predictions(count: u64, data: &Path) {
    if count > 0 {
        tracing::warn!(
            "warning: {count} predictions on {} are NaN (the model diverged); AUC ranks them below every other score",
            data.display()
        );
    }
}

impl EvalSummary {
    fn new(s: &Scored, data: &Path, wall: Instant) -> Self {
        let f = Figures::of(&s.config, &s.scores);
        warn_nan_predictions(f.nan_predictions, data);
        EvalSummary {
            auc: f.auc,
            logloss: f.logloss,
            rows: f.rows,
            nan_predictions: f.nan_predictions,
            bad_rows: s.bad_rows,
            checkpoint_step: s.step,
            wall_secs: wall.elapsed().as_secs_f64(),
            tasks: f.tasks,
        }
    }
}

pub fn evaluate_checkpoint(
    checkpoint: &Path,
    data: &Path,
    overrides: &Overrides,
    threads: Option<usize>,
) -> Result<EvalSummary, TrainError> {
    let wall = Instant::now();
    let scored = score_checkpoint(checkpoint, data, overrides, threads)?;
    Ok(EvalSummary::new(&scored, data, wall))
}

/// `predict --out` must name a file that is not the input: refused before
/// anything is read or written.
fn check_predict_out(data: &Path, out: &Path) -> Result<(), TrainError> {
    let refuse = |message: &str| TrainError::Argument {
        flag: "--out",
        value: out.display().to_string(),
        message: message.to_string(),
    };
    if out.is_dir() || out.as_os_str().to_string_lossy().ends_with('/') || out.file_name().is_none() {
        return Err(refuse("is a directory; name the file to write the predictions to"));
    }
    if let (Ok(a), Ok(b)) = (std::fs::metadata(data), std::fs::metadata(out)) {
        use std::os::unix::fs::MetadataExt;
        if (a.dev(), a.ino()) == (b.dev(), b.ino()) {
            return Err(refuse("is the input file (--data); the predictions would overwrite it"));
        }
    }
    Ok(())
}

/// Writes one click probability per good input row to `out` (atomically).
pub fn predict_checkpoint(
    checkpoint: &Path,
    data: &Path,
    out: &Path,
    overrides: &Overrides,
) -> Result<EvalSummary, TrainError> {
    let wall = Instant::now();
    check_predict_out(data, out)?;
    let scored = score_checkpoint(checkpoint, data, overrides, None)?;
    write_predictions(&scored, data, out, wall)
}

/// `sparrow predict --model EXPORT`: a serving export's predictions, as
/// [`predict_checkpoint`] writes them.
pub fn predict_export(model: &Path, data: &Path, out: &Path, overrides: &Overrides) -> Result<EvalSummary, TrainError> {
    let wall = Instant::now();
    check_predict_out(data, out)?;
    let (model, manifest) = crate::export::load_export(model, overrides)?;
    let pool = compute_pool(model.config.train.threads)?;
    let bad = BadRows::from_config(&model.config.data);
    let scores = pool.install(|| predict_file(model.scoring(), data, &model.config.data, &bad))?;
    let scored = Scored { scores, config: model.config.clone(), bad_rows: bad.total(), step: manifest.step };
    write_predictions(&scored, data, out, wall)
}

fn write_predictions(scored: &Scored, data: &Path, out: &Path, wall: Instant) -> Result<EvalSummary, TrainError> {
    // Beside `out` (same file system, so the rename is atomic), named so it
    // cannot be any input's name.
    let file_name = out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = out.with_file_name(format!(".{file_name}.partial-{}", std::process::id()));
    {
        let f = File::create(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
        let mut w = BufWriter::new(f);
        if scored.config.single_binary_task() {
            for &x in &scored.scores.logits {
                writeln!(w, "{}", sigmoid(f64::from(x)) as f32).map_err(|e| TrainError::io(&tmp, e))?;
            }
        } else {
            // A line a row: each task's probabilities, tab-separated.
            let (tasks, mut line) = (scored.config.tasks(), String::new());
            let outputs = tasks.iter().map(|t| t.outputs).sum::<usize>().max(1);
            for row in scored.scores.logits.chunks_exact(outputs) {
                line.clear();
                crate::evaluation::probabilities(&tasks, row, &mut line);
                writeln!(w, "{line}").map_err(|e| TrainError::io(&tmp, e))?;
            }
        }
        w.flush().map_err(|e| TrainError::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| TrainError::io(out, e))?;
    Ok(EvalSummary::new(scored, data, wall))
}

/// What `sparrow export` prints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExportSummary {
    pub export: String,
    pub checkpoint_step: u64,
    pub rows: u64,
    pub dim: usize,
    pub dtype: String,
    pub bytes: u64,
}

/// `sparrow export --checkpoint DIR --out EXPORT`: the serving export of a
/// checkpoint (the format lazy aggregation's backups write; see `export`).
pub fn export_checkpoint(
    checkpoint: &Path,
    out: &Path,
    dtype: crate::export::VectorType,
) -> Result<ExportSummary, TrainError> {
    // Refused before the checkpoint is loaded: a wrong --out fails at once.
    let new = crate::new_dir::NewDir::create(out, "--out")?;
    let (trainer, manifest, _) = checkpoint::load_trainer(checkpoint, &Overrides::none())?;
    let pages = crate::export::row_pages(&trainer.table, |_, _, _| true);
    let meta = crate::export::ExportMeta { dtype: Some(dtype), ..Default::default() };
    let written = crate::export::write_export_files(
        new.staging(),
        &trainer.config,
        &trainer.layout,
        manifest.step,
        &trainer.model,
        &meta,
        pages,
    )?;
    new.commit()?;
    Ok(ExportSummary {
        export: out.display().to_string(),
        checkpoint_step: written.step,
        rows: written.rows,
        dim: written.dim,
        dtype: written.dtype.clone(),
        bytes: written.files.values().map(|f| f.bytes).sum(),
    })
}
