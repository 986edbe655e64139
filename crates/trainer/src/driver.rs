//! The one training loop every run goes through: `sparrow train` (and
//! `demo`, Python, a Kafka stream), each cluster worker, the in-process
//! cluster job and a collocated node. A run is this loop with plug-ins:
//!
//! - its [`Run`]: a batch feed and a step (the local table, or the shards
//!   under a sync policy), with its own hooks after a step (checkpoints,
//!   exports, a policy's meeting) and when the feed runs dry;
//! - [`Cadence`]s, steps or seconds, for the log, evaluations, checkpoints
//!   and exports;
//! - [`Observers`]: the JSONL metrics file and TensorBoard ([`RunLog`]),
//!   the interval's figures (loss, samples/s, dedup), and whatever the run
//!   shows at each interval (a progress bar, gauges);
//! - one summary type (`run::RunSummary`).
//!
//! What differs between a local run and a worker lives in its `Run`;
//! what they share (the order of the hooks, the interval's figures, the
//! lines written, the weight check, periodic evaluation) is written here once.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use sparrow_core::Config;

use crate::TrainError;
use crate::evaluation::Figures;
use crate::tensorboard::TensorBoard;

/// What the loop does after a run's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Take the feed's next batch.
    Train,
    /// Training is over.
    Done,
}

/// The batch a step just trained (a skipped batch trained no samples).
#[derive(Clone, Copy, Debug, Default)]
pub struct StepDone {
    pub samples: u64,
    /// Its samples' weights (`[data.weighting]`; the samples otherwise).
    pub weight: f64,
    /// Its mean training loss.
    pub loss: f64,
    /// Its keys, and its unique keys (the dedup ratio's parts).
    pub keys: u64,
    pub unique_keys: u64,
}

/// Where a run stands after a step.
#[derive(Clone, Copy, Debug, Default)]
pub struct At {
    /// The job's step: what every line and event is plotted against, and
    /// what `train.eval_every_steps` counts.
    pub step: u64,
    /// This run's batches, trained or skipped: what
    /// `train.log_interval_steps` counts.
    pub batches: u64,
    /// Samples this run trained, and the job's (equal outside a cluster).
    pub samples: u64,
    pub job_samples: u64,
    pub epoch: u64,
}

/// A run as the loop drives it.
pub trait Run {
    type Error: From<TrainError>;

    /// Trains the feed's next batch; `None` when the feed ran dry (or the
    /// run must stop taking batches).
    fn step(&mut self) -> Result<Option<StepDone>, Self::Error>;

    /// Where the run stands.
    fn at(&self) -> At;

    /// The run's observers (they live in the run, so its hooks reach them).
    fn observers(&mut self) -> &mut Observers;

    /// At every log interval: no dense weight or optimizer moment is NaN or
    /// infinite (an update that overflowed; the per-step checks cover the
    /// loss and the gradients).
    fn check_weights(&mut self) -> Result<(), Self::Error>;

    /// At every log interval: the run's own fields and scalars for the line
    /// (beside the loop's), after showing `figures` where it shows them.
    fn describe(&mut self, figures: &IntervalFigures) -> Line;

    /// Scores `data.test` with the model as of now (every update applied);
    /// `None` when this run does not evaluate.
    fn evaluate(&mut self) -> Result<Option<Figures>, Self::Error>;

    /// After a step the loop counted, logged and evaluated: what follows it
    /// (a checkpoint or an export when due, a sync policy's hook).
    fn stepped(&mut self, done: StepDone) -> Result<Flow, Self::Error>;

    /// The feed ran dry: [`Flow::Train`] when it has more to give (a sync
    /// policy met the others and starts a new round).
    fn ran_dry(&mut self) -> Result<Flow, Self::Error>;
}

/// Runs `run` until its feed is used up or a hook says training is over.
pub fn drive<R: Run + ?Sized>(run: &mut R) -> Result<(), R::Error> {
    loop {
        let flow = match run.step()? {
            Some(done) => {
                run.observers().trained(&done);
                after_step(run)?;
                run.stepped(done)?
            }
            None => run.ran_dry()?,
        };
        if flow == Flow::Done {
            return Ok(());
        }
    }
}

/// After a step: at `train.log_interval_steps` the weight check and a log
/// line; when `train.eval_every_steps` is due, an evaluation.
pub fn after_step<R: Run + ?Sized>(run: &mut R) -> Result<(), R::Error> {
    let at = run.at();
    if run.observers().interval.take(at.batches) {
        run.check_weights()?;
        let figures = run.observers().close_interval(at.batches);
        let line = run.describe(&figures);
        run.observers().log_interval(at, &figures, line)?;
    }
    evaluate_if_due(run)
}

/// An evaluation, if `train.eval_every_steps` is due at the job's step (a
/// step may be an idle round or a round's merge, which train no batch).
pub fn evaluate_if_due<R: Run + ?Sized>(run: &mut R) -> Result<(), R::Error> {
    let at = run.at();
    if run.observers().eval.take(at.step)
        && let Some(figures) = run.evaluate()?
    {
        run.observers().log_eval(at, Some(&figures))?;
    }
    Ok(())
}

/// Every so many steps, or every so many seconds, whichever comes first.
#[derive(Clone, Debug)]
pub struct Cadence {
    steps: Option<u64>,
    secs: Option<Duration>,
    /// The step it was last due at (or started from), and when.
    last_step: u64,
    since: Instant,
}

impl Cadence {
    /// Due every `steps` steps and every `secs` seconds (either may be
    /// off: `None` or 0), counting from `start`.
    pub fn new(steps: Option<u64>, secs: Option<u64>, start: u64) -> Cadence {
        Cadence {
            steps: steps.filter(|&n| n > 0),
            secs: secs.filter(|&s| s > 0).map(Duration::from_secs),
            last_step: start,
            since: Instant::now(),
        }
    }

    /// Never due.
    pub fn never() -> Cadence {
        Cadence::new(None, None, 0)
    }

    /// Whether `step` passed a multiple of the step interval since it was
    /// last due (a step may jump several: a round's merge), or the seconds
    /// ran out; when it is, it counts from `step` again.
    pub fn take(&mut self, step: u64) -> bool {
        let by_steps = self.steps.is_some_and(|n| step / n > self.last_step / n);
        let by_time = self.secs.is_some_and(|s| self.since.elapsed() >= s);
        if by_steps || by_time {
            self.restart(step);
        }
        by_steps || by_time
    }

    /// Counts from `step` now (it was done for another reason).
    pub fn restart(&mut self, step: u64) {
        self.last_step = step;
        self.since = Instant::now();
    }
}

/// What the loop measured over a log interval.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntervalFigures {
    /// Mean training loss over its samples, and samples a second.
    pub loss: f64,
    pub samples_per_sec: f64,
    /// Keys per unique key.
    pub dedup_ratio: f64,
    /// The batches it spans.
    pub batches: u64,
}

/// A run's own part of a log line.
#[derive(Debug, Default)]
pub struct Line {
    /// Fields beside the loop's (`step`, `epoch`, `samples`,
    /// `train_logloss`, `samples_per_sec`, `dedup_ratio`, `elapsed_secs`).
    pub fields: Map<String, Value>,
    /// Cumulative seconds by phase (any struct of numbers): the line's
    /// `phase_secs`, and `step_ms/<phase>` per batch on TensorBoard.
    pub phase_secs: Value,
    /// Further TensorBoard scalars.
    pub scalars: Vec<(String, f64)>,
}

/// The interval being measured.
#[derive(Clone, Copy, Debug)]
struct Since {
    at: Instant,
    batches: u64,
    loss_sum: f64,
    samples: u64,
    keys: u64,
    unique_keys: u64,
}

impl Since {
    fn new(batches: u64) -> Since {
        Since { at: Instant::now(), batches, loss_sum: 0.0, samples: 0, keys: 0, unique_keys: 0 }
    }
}

/// What watches a run: the log interval and its figures, periodic
/// evaluation's cadence, and the run's log ([`RunLog`]).
pub struct Observers {
    interval: Cadence,
    eval: Cadence,
    since: Since,
    /// The loss of the last interval closed.
    last_loss: Option<f64>,
    /// Keys and unique keys over the whole run.
    keys: (u64, u64),
    log: Option<RunLog>,
}

impl Observers {
    /// A run's observers, as `config` asks: a line every
    /// `train.log_interval_steps` batches counted from `batches`, an
    /// evaluation every `train.eval_every_steps` job steps counted from
    /// `step` when `evaluates`, and the log (`worker`: the line's tag and
    /// TensorBoard subfolder in a cluster job).
    pub fn new(config: &Config, at: At, evaluates: bool, log: Option<RunLog>) -> Observers {
        // The set it scores: the validation set if there is one, else the test set.
        let scored = config.data.validation.is_some() || config.data.test.is_some();
        let eval_every = config.train.eval_every_steps.filter(|_| evaluates && scored);
        Observers {
            interval: Cadence::new(Some(config.train.log_interval_steps.max(1)), None, at.batches),
            eval: Cadence::new(eval_every, None, at.step),
            since: Since::new(at.batches),
            last_loss: None,
            keys: (0, 0),
            log,
        }
    }

    /// Counts intervals and evaluations from `at` (a run that starts there:
    /// a worker resumed from a checkpoint, or recovered).
    pub fn start(&mut self, at: At) {
        self.interval.restart(at.batches);
        self.eval.restart(at.step);
        self.since = Since::new(at.batches);
        if let Some(log) = self.log.as_mut() {
            log.last_batches = at.batches;
        }
    }

    /// A batch trained (or skipped: no samples).
    pub fn trained(&mut self, done: &StepDone) {
        let s = &mut self.since;
        s.loss_sum += done.loss * done.samples as f64;
        s.samples += done.samples;
        s.keys += done.keys;
        s.unique_keys += done.unique_keys;
        self.keys.0 += done.keys;
        self.keys.1 += done.unique_keys;
    }

    /// Whether a periodic evaluation is due at job step `step` (it then counts from it).
    pub fn evaluation_due(&mut self, step: u64) -> bool {
        self.eval.take(step)
    }

    /// Ends the interval at `batches`: its figures.
    fn close_interval(&mut self, batches: u64) -> IntervalFigures {
        let s = std::mem::replace(&mut self.since, Since::new(batches));
        let loss = s.loss_sum / s.samples.max(1) as f64;
        self.last_loss = Some(loss);
        IntervalFigures {
            loss,
            samples_per_sec: s.samples as f64 / s.at.elapsed().as_secs_f64().max(1e-9),
            dedup_ratio: s.keys as f64 / s.unique_keys.max(1) as f64,
            batches: batches.saturating_sub(s.batches),
        }
    }

    /// The training loss last measured: over the samples since the last
    /// line if there are any, else the last line's.
    pub fn last_loss(&self) -> Option<f64> {
        match self.since.samples {
            0 => self.last_loss,
            n => Some(self.since.loss_sum / n as f64),
        }
    }

    /// Keys per unique key over the whole run.
    pub fn dedup_ratio(&self) -> f64 {
        self.keys.0 as f64 / self.keys.1.max(1) as f64
    }

    /// Unique keys over the whole run.
    pub fn unique_keys(&self) -> u64 {
        self.keys.1
    }

    fn log_interval(&mut self, at: At, figures: &IntervalFigures, line: Line) -> Result<(), TrainError> {
        match self.log.as_mut() {
            Some(log) => log.interval(at, figures, line),
            None => Ok(()),
        }
    }

    /// An evaluation's `eval` line and test scalars (`None`: a run's last
    /// evaluation without `data.test`, a line of nulls).
    pub fn log_eval(&mut self, at: At, figures: Option<&Figures>) -> Result<(), TrainError> {
        match self.log.as_mut() {
            Some(log) => log.eval(at, figures, Scored::Test),
            None => Ok(()),
        }
    }

    /// A validation's `validation` line and scalars (`data.validation`).
    pub fn log_validation(&mut self, at: At, figures: &Figures) -> Result<(), TrainError> {
        match self.log.as_mut() {
            Some(log) => log.eval(at, Some(figures), Scored::Validation),
            None => Ok(()),
        }
    }
}

impl Default for Observers {
    /// No log, no evaluation, a weight check every 100 batches.
    fn default() -> Observers {
        Observers::new(&Config::default(), At::default(), false, None)
    }
}

/// Which set an evaluation scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scored {
    Test,
    Validation,
}

/// The keys of the run's log, named in its errors.
const METRICS: &str = "train.metrics_path";
const BOARD: &str = "train.tensorboard_dir";

/// `train.metrics_path` (JSONL: a line every log interval, an `eval` line
/// for each evaluation) and `train.tensorboard_dir` (the same as scalars).
/// In a cluster job each line is tagged with its `worker`, every worker of
/// a job on one machine appends to the one file (a whole line a write), and
/// each worker's scalars are a TensorBoard run of their own (`worker-<i>/`).
pub struct RunLog {
    worker: Option<usize>,
    metrics: Option<(PathBuf, File)>,
    board: Option<TensorBoard>,
    started: Instant,
    /// Show per-task figures in `eval` lines.
    show_tasks: bool,
    /// The cumulative phase seconds and batches at the last line.
    last_phases: Value,
    last_batches: u64,
}

impl RunLog {
    /// The log `config` asks for, if any; `worker`: a cluster worker's
    /// (which appends to a file [`start_metrics_file`] started).
    pub fn open(config: &Config, worker: Option<usize>, at: At) -> Result<Option<RunLog>, TrainError> {
        let (metrics_path, board_dir) = (config.train.metrics_path.as_deref(), config.train.tensorboard_dir.as_deref());
        if metrics_path.is_none() && board_dir.is_none() {
            return Ok(None);
        }
        let metrics = match metrics_path.map(PathBuf::from) {
            Some(path) => {
                let fresh = worker.is_none() && config.checkpoint.resume_from.is_none();
                Some((path.clone(), open_metrics(&path, fresh).map_err(|e| e.of_key(METRICS))?))
            }
            None => None,
        };
        let board = match (board_dir.map(Path::new), worker) {
            (Some(dir), Some(w)) => Some(TensorBoard::create(&dir.join(format!("worker-{w}")))),
            (Some(dir), None) => Some(TensorBoard::create(dir)),
            (None, _) => None,
        };
        let board = board.transpose().map_err(|e| e.of_key(BOARD))?;
        Ok(Some(RunLog {
            worker,
            metrics,
            board,
            started: Instant::now(),
            show_tasks: config.tasks().len() > 1 || config.eval.group_by.is_some(),
            last_phases: Value::Null,
            last_batches: at.batches,
        }))
    }

    fn interval(&mut self, at: At, figures: &IntervalFigures, line: Line) -> Result<(), TrainError> {
        let mut fields = line.fields;
        fields.insert("step".into(), at.step.into());
        fields.insert("epoch".into(), at.epoch.into());
        fields.insert("samples".into(), at.samples.into());
        fields.insert("train_logloss".into(), figures.loss.into());
        fields.insert("samples_per_sec".into(), figures.samples_per_sec.into());
        fields.insert("dedup_ratio".into(), figures.dedup_ratio.into());
        fields.insert("elapsed_secs".into(), self.started.elapsed().as_secs_f64().into());
        fields.insert("phase_secs".into(), line.phase_secs.clone());
        if let Some(w) = self.worker {
            fields.insert("worker".into(), w.into());
            fields.insert("worker_batches".into(), at.batches.into());
        }
        self.write(Value::Object(fields))?;
        let batches = at.batches.saturating_sub(self.last_batches).max(1) as f64;
        self.last_batches = at.batches;
        let then = std::mem::replace(&mut self.last_phases, line.phase_secs);
        let Some(board) = self.board.as_mut() else { return Ok(()) };
        let mut scalars = vec![
            ("train/logloss".to_string(), figures.loss),
            ("train/samples_per_sec".to_string(), figures.samples_per_sec),
            ("train/dedup_ratio".to_string(), figures.dedup_ratio),
        ];
        scalars.extend(line.scalars);
        if let Value::Object(now) = &self.last_phases {
            for (phase, secs) in now {
                let before = then.get(phase).and_then(Value::as_f64).unwrap_or(0.0);
                let ms = (secs.as_f64().unwrap_or(0.0) - before) / batches * 1e3;
                scalars.push((format!("step_ms/{phase}"), ms));
            }
        }
        let scalars: Vec<(&str, f64)> = scalars.iter().map(|(t, v)| (t.as_str(), *v)).collect();
        board.scalars(at.step, &scalars).map_err(|e| e.of_key(BOARD))
    }

    fn eval(&mut self, at: At, figures: Option<&Figures>, set: Scored) -> Result<(), TrainError> {
        let (event, prefix) = match set {
            Scored::Test => ("eval", "test"),
            Scored::Validation => ("validation", "validation"),
        };
        let mut line = serde_json::json!({
            "step": at.step,
            "event": event,
            "epoch": at.epoch,
            "samples": at.job_samples,
            format!("{prefix}_auc"): figures.map(|f| f.auc),
            format!("{prefix}_logloss"): figures.map(|f| f.logloss),
            format!("{prefix}_rows"): figures.map_or(0, |f| f.rows),
        });
        if let Some(w) = self.worker {
            line["worker"] = w.into();
        }
        if let Some(f) = figures.filter(|_| self.show_tasks) {
            line["tasks"] = serde_json::to_value(&f.tasks).unwrap_or_default();
        }
        self.write(line)?;
        let (Some(board), Some(f)) = (self.board.as_mut(), figures) else { return Ok(()) };
        let mut tagged = crate::evaluation::tagged(prefix, &f.tasks);
        tagged.extend([(format!("{prefix}/auc"), f.auc), (format!("{prefix}/logloss"), f.logloss)]);
        let scalars: Vec<(&str, f64)> = tagged.iter().map(|(t, v)| (t.as_str(), *v)).collect();
        board.scalars(at.step, &scalars).map_err(|e| e.of_key(BOARD))
    }

    /// One whole line in one write (other workers' appends interleave by line).
    fn write(&mut self, value: Value) -> Result<(), TrainError> {
        if let Some((path, file)) = &mut self.metrics {
            let mut text = value.to_string();
            text.push('\n');
            file.write_all(text.as_bytes()).map_err(|e| TrainError::io(path, e).of_key(METRICS))?;
        }
        Ok(())
    }
}

/// Starts a job's metrics file before any of its workers appends to it: a
/// job that does not resume starts it empty, as `sparrow train` does.
pub fn start_metrics_file(config: &Config) -> Result<(), TrainError> {
    match config.train.metrics_path.as_deref() {
        Some(path) => open_metrics(Path::new(path), config.checkpoint.resume_from.is_none())
            .map(drop)
            .map_err(|e| e.of_key(METRICS)),
        None => Ok(()),
    }
}

/// The metrics file for appending, its folder made (a fresh data folder
/// has no place for it yet), emptied first when `fresh`.
fn open_metrics(path: &Path, fresh: bool) -> Result<File, TrainError> {
    if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| TrainError::io(parent, e))?;
    }
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| TrainError::io(path, e))?;
    if fresh {
        file.set_len(0).map_err(|e| TrainError::io(path, e))?;
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cadence_is_due_when_a_step_passes_a_multiple_even_by_a_jump() {
        let mut every_ten = Cadence::new(Some(10), None, 0);
        let due: Vec<u64> = (1..=30).filter(|&s| every_ten.take(s)).collect();
        assert_eq!(due, vec![10, 20, 30]);
        // A round's merge may move the step from 8 to 13: 10 was passed.
        let mut rounds = Cadence::new(Some(10), None, 0);
        assert!(!rounds.take(8));
        assert!(rounds.take(13));
        assert!(!rounds.take(19));
        // A resumed run counts from its step: 100 is not due again.
        let mut resumed = Cadence::new(Some(100), None, 100);
        assert!(!resumed.take(100));
        assert!(resumed.take(200));
        assert!(!Cadence::never().take(u64::MAX));
        assert!(!Cadence::new(Some(0), Some(0), 0).take(1_000));
    }

    #[test]
    fn a_cadence_in_seconds_is_due_once_they_ran_out() {
        let mut timed = Cadence::new(None, Some(1), 0);
        assert!(!timed.take(1));
        timed.since -= Duration::from_secs(2);
        assert!(timed.take(2));
        assert!(!timed.take(3), "it counts from its last time");
    }
}
