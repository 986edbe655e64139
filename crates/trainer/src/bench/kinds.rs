//! `sparrow bench`'s kinds table: every model kind's dense step against
//! its flop floor and the machine's ceilings. The one-task kinds train on
//! the reference data; the kinds built for several tasks and behaviour
//! sequences on behaviour data with three tasks and a history.

use std::time::{Duration, Instant};

use serde::Serialize;
use sparrow_core::config::{ModelKind, Precision};
use sparrow_core::{Batch, Config};
use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_model::kinds::{Family, Kind};

use super::{BenchOptions, bench_batches, bench_config};
use crate::TrainError;
use crate::trainer::Trainer;

/// One model kind's training step (`sparrow bench`'s `kinds`): the bench's
/// batch, `hidden = [256, 128]`, dim 16, the defaults otherwise (experts
/// of [64], towers of [32], DIN's unit of [36]). The one-task kinds read
/// the reference data; the kinds for several tasks and sequences read
/// behaviour data (`sparrow gen --tasks --sequence --classes 4`: three
/// tasks, ESMM its two binary ones, a history of up to 20 items).
#[derive(Debug, Serialize)]
pub struct KindBench {
    pub kind: &'static str,
    /// `reference` (the Criteo-layout data) or `behaviour`.
    pub data: &'static str,
    /// The timed batches' history items a sample (DIN's attention runs
    /// once an item: its flops a sample count this many items); 0 for a
    /// kind that does not attend.
    pub history_items_per_sample: f64,
    pub precision: &'static str,
    pub samples_per_sec: f64,
    /// The dense phase over the timed steps' wall time.
    pub dense_share_of_step: f64,
    /// The dense step's flop floor (`DenseModel::step_flops_per_sample`,
    /// plus `step_flops_per_history_item` times the history items a sample).
    pub flops_per_sample: f64,
    /// Floor flops over the dense phase's time.
    pub dense_gflops: f64,
    /// That over the ceiling of its precision measured in the same run
    /// (fp32 FMA, or bf16 dot products).
    pub share_of_ceiling: Option<f64>,
    /// The same two in the fastest of the rounds the kinds took turns in.
    pub best_round_dense_gflops: f64,
    pub best_round_share_of_ceiling: Option<f64>,
    /// A bf16 row's `dense_gflops` over the AVX-512-BF16 (`vdpbf16ps`)
    /// ceiling measured in the same run, whichever path it took: on a CPU
    /// with AMX, whose ceiling `share_of_ceiling` divides by, this reads the
    /// step against the bf16 dot products it would otherwise run on. None
    /// for an f32 row, or where that ceiling was not measured (no
    /// AVX-512-BF16, or `simd` keeping it out).
    pub share_of_bf16_dot_ceiling: Option<f64>,
    /// The bytes the dense step cannot avoid moving a sample: its input
    /// row read and that row's gradient written (f32), weights and
    /// activations left out.
    pub bytes_per_sample: f64,
    /// Those bytes over the dense phase's time, GB/s.
    pub dense_gbytes_per_sec: f64,
    /// What copying a buffer the size of a batch's input into another
    /// sustains on the step's threads, measured in the same run (read and
    /// written bytes counted together, GB/s): the bandwidth ceiling of a
    /// pass over the batch.
    pub copy_gbytes_per_sec: f64,
    /// `dense_gbytes_per_sec` over it: the dense step against its memory
    /// floor (for LR and FM, whose few flops a sample are no floor at all).
    pub share_of_copy_bandwidth: f64,
    pub best_round_share_of_copy_bandwidth: f64,
    /// The largest `share_of_ceiling` the bytes allow (the roofline): a step
    /// that moved `bytes_per_sample` at `copy_gbytes_per_sec` and did
    /// nothing else would reach `flops_per_sample · copy ÷ bytes_per_sample`
    /// GFLOP/s, this over the ceiling (capped at 1). Below 0.5 no
    /// implementation reaches half its flop floor on this machine.
    pub share_of_ceiling_bytes_allow: Option<f64>,
}

/// Rounds the kinds table's trainers take turns in.
const KIND_ROUNDS: usize = 5;

/// One (kind, precision) of the kinds table: its trainer and timed rounds.
struct KindRun {
    kind: &'static dyn sparrow_model::kinds::Kind,
    data: &'static str,
    history_items_per_sample: f64,
    /// Its own batches (behaviour data); empty: the reference data's.
    batches: Vec<Batch>,
    precision: Precision,
    trainer: Trainer,
    flops: f64,
    samples: usize,
    secs: f64,
    /// The dense phase's seconds a sample in the fastest round.
    best_round_dense_per_sample: f64,
    /// Floats of an input row.
    row_len: usize,
}

/// Every model kind's dense step against its flop floor, in f32 and (for
/// the kinds with MLP stacks) with `model.precision = "bf16"`: every
/// trainer built and warmed up first, then `KIND_ROUNDS` rounds in which
/// each runs its share of `kind_steps` in turn, so a busy stretch of the
/// machine hits them alike; the mean and the fastest round are reported
/// (their shares of the ceilings are the caller's to fill in).
pub(super) fn bench_kinds(o: &BenchOptions) -> Result<Vec<KindBench>, TrainError> {
    let reference = bench_batches(o, &bench_config(o, ModelKind::named("mlp")))?;
    let pool = crate::run::compute_pool(bench_config(o, ModelKind::named("mlp")).train.threads)?;
    pool.install(|| {
        let mut runs = Vec::new();
        for name in &o.kinds {
            let kind = sparrow_model::kinds::find(name)?;
            let behaviour = kind.family() != Family::OneTask;
            let base = if behaviour { behaviour_config(o, kind)? } else { bench_config(o, name.clone()) };
            let own = if behaviour { behaviour_batches(o, &base)? } else { Vec::new() };
            let batches = if behaviour { &own } else { &reference };
            let stacked = kind.has_products();
            for precision in [Precision::F32, Precision::Bf16] {
                if precision == Precision::Bf16 && !stacked {
                    continue;
                }
                tracing::info!("bench: {} dense step, {precision:?}: warm-up", kind.name());
                let mut config = base.clone();
                config.model.precision = precision;
                let mut trainer = Trainer::new(&config, DataLayout::from_config(&config.data))?;
                for b in batches.iter().take(20) {
                    trainer.train_batch(b)?;
                }
                trainer.phase_secs = Default::default();
                let items = history_items_per_sample(batches, trainer.model.attention());
                let flops = kind.step_flops_per_sample(&config.model, trainer.model.shape)
                    + items * kind.step_flops_per_history_item(&config.model, trainer.model.shape);
                let shape = trainer.model.shape;
                let row_len =
                    trainer.model.packed_row_len().unwrap_or(shape.num_fields * shape.embedding_dim + shape.num_dense);
                runs.push(KindRun {
                    kind,
                    data: if behaviour { "behaviour" } else { "reference" },
                    history_items_per_sample: items,
                    batches: if behaviour { own.clone() } else { Vec::new() },
                    precision,
                    trainer,
                    flops,
                    samples: 0,
                    secs: 0.0,
                    best_round_dense_per_sample: f64::INFINITY,
                    row_len,
                });
            }
        }
        let per_round = o.kind_steps.div_ceil(KIND_ROUNDS);
        for round in 0..KIND_ROUNDS {
            tracing::info!("bench: model kinds, round {} of {KIND_ROUNDS}", round + 1);
            for run in &mut runs {
                let (dense_before, start) = (run.trainer.phase_secs.dense, Instant::now());
                let mut samples = 0;
                let batches = if run.batches.is_empty() { &reference } else { &run.batches };
                for b in batches.iter().cycle().skip(round * per_round).take(per_round) {
                    run.trainer.train_batch(b)?;
                    samples += b.rows();
                }
                run.secs += start.elapsed().as_secs_f64();
                run.samples += samples;
                let dense = run.trainer.phase_secs.dense - dense_before;
                run.best_round_dense_per_sample = run.best_round_dense_per_sample.min(dense / samples.max(1) as f64);
            }
        }
        let threads = rayon::current_num_threads();
        Ok(runs
            .into_iter()
            .map(|run| {
                let dense = run.trainer.phase_secs.dense.max(1e-9);
                let rate = run.samples as f64 / run.secs.max(1e-9);
                let dense_gflops = run.flops * run.samples as f64 / dense / 1e9;
                let best_round_dense_gflops = run.flops / run.best_round_dense_per_sample.max(1e-12) / 1e9;
                let bytes_per_sample = 8.0 * run.row_len as f64;
                let batch_bytes = 4 * run.row_len * o.batch_size;
                let copy = sparrow_model::peak::copy_bandwidth(threads, batch_bytes, Duration::from_millis(200)) / 1e9;
                let dense_gbytes_per_sec = bytes_per_sample * run.samples as f64 / dense / 1e9;
                let best_round_gbytes = bytes_per_sample / run.best_round_dense_per_sample.max(1e-12) / 1e9;
                KindBench {
                    kind: run.kind.name(),
                    data: run.data,
                    history_items_per_sample: run.history_items_per_sample,
                    precision: if run.precision == Precision::F32 { "f32" } else { "bf16" },
                    samples_per_sec: rate,
                    dense_share_of_step: dense / run.secs.max(1e-9),
                    flops_per_sample: run.flops,
                    dense_gflops,
                    // Filled in against the ceilings measured around the rounds.
                    share_of_ceiling: None,
                    best_round_dense_gflops,
                    best_round_share_of_ceiling: None,
                    share_of_bf16_dot_ceiling: None,
                    bytes_per_sample,
                    dense_gbytes_per_sec,
                    copy_gbytes_per_sec: copy,
                    share_of_copy_bandwidth: dense_gbytes_per_sec / copy,
                    best_round_share_of_copy_bandwidth: best_round_gbytes / copy,
                    // Filled in with the ceilings.
                    share_of_ceiling_bytes_allow: None,
                }
            })
            .collect())
    })
}

/// The behaviour job a multi-task or sequence kind is timed on: three
/// tasks (ESMM: its two binary ones), four categorical fields, a price, a
/// history of up to 20 items sharing the candidate item's table; the
/// bench's batch, dim and MLP, the kind's defaults otherwise.
fn behaviour_config(o: &BenchOptions, kind: &dyn Kind) -> Result<Config, TrainError> {
    let esmm = kind.name() == "esmm";
    let labels = if esmm { r#"["click", "conversion"]"# } else { r#"["click", "conversion", "ad_type"]"# };
    let tasks = if esmm {
        ""
    } else {
        "[[model.tasks]]\nname = \"click\"\n[[model.tasks]]\nname = \"conversion\"\n\
         [[model.tasks]]\nname = \"ad_type\"\nkind = \"multiclass\"\nclasses = 4\n"
    };
    let text = format!(
        "[data]\nformat = \"csv\"\n[data.schema]\nlabels = {labels}\n\
         sparse = [\"user_id\", \"item_id\", \"item_category\", \"site\"]\ndense = [\"price\"]\n\
         dense_transform = \"log1p\"\nmulti_hot_separator = \"|\"\n\
         sequence = [{{ field = \"hist_items\", table = \"item_id\", max_len = 20 }}]\n\
         [model]\nkind = \"{}\"\nhidden = [256, 128]\n{tasks}",
        kind.name()
    );
    let mut config = Config::from_toml(&text, "the bench's behaviour job", &Default::default())?;
    let reference = bench_config(o, ModelKind::named(kind.name()));
    config.train = reference.train;
    config.model.embedding_dim = reference.model.embedding_dim;
    Ok(config)
}

/// Behaviour batches for `config` (`train_steps`/`kind_steps` of them, at most 200, cycled).
fn behaviour_batches(o: &BenchOptions, config: &Config) -> Result<Vec<Batch>, TrainError> {
    let dir = o.work_dir.join("behaviour-data");
    let rows = (o.kind_steps.clamp(20, 200) * o.batch_size) as u64;
    let shape = sparrow_data::synth_tasks::Shape { tasks: true, sequence: true, classes: Some(4), click_shift: 0.0 };
    sparrow_data::synth_tasks::generate_tasks(&dir, rows, 1000, shape, 1)?;
    let bad = BadRows::new(0, 5);
    Ok(BatchStream::spawn(&dir.join("train.csv"), config, o.batch_size, Default::default(), 1, bad)?
        .collect::<Result<_, _>>()?)
}

/// The history items a sample of the batches (every sequence the model attends over).
fn history_items_per_sample(batches: &[Batch], pairs: &[(usize, usize)]) -> f64 {
    let (mut items, mut rows) = (0usize, 0usize);
    for b in batches {
        rows += b.rows();
        for &(slot, _) in pairs {
            items += (0..b.rows()).map(|r| b.bag(r, slot).len()).sum::<usize>();
        }
    }
    items as f64 / rows.max(1) as f64
}
