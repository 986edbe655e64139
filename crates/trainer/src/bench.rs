//! `sparrow bench`: figures, never assertions. Embedding lookup+update on
//! power-law keys beside this machine's random-gather ceiling (the C program
//! `shared/tools/gather-limit.c`, which the `sparrow` binary compiles and runs
//! in the same invocation and hands in as [`BenchOptions::gather_limit`]), and
//! the training step of the reference model on batches already in memory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use sparrow_core::batch::BatchBuilder;
use sparrow_core::config::{EmbeddingConfig, EmbeddingDtype, InitConfig, ModelKind, Rounding, SparseOptimizerKind};
use sparrow_core::key::mix64;
use sparrow_core::rng::Rng;
use sparrow_core::simd::Simd;
use sparrow_core::{Batch, Config};
use sparrow_data::synth::Alias;
use sparrow_data::{BadRows, BatchStream, DataLayout};
use sparrow_embedding::{EmbeddingTable, Initializer, RowFormat, SparseOptimizer};

use crate::TrainError;
use crate::trainer::{PhaseSecs, Trainer};

mod kinds;
mod tier;

pub use kinds::KindBench;
use kinds::bench_kinds;
pub use tier::{TierBench, TierBenchOptions, bench_tier};

/// The peer's training loop alone (PyTorch + TorchRec, data in memory) as
/// `scripts/bench-peer` last measured it on this machine: the median of its
/// `torchrec-loop` runs in `runs` (JSON lines), if that file exists.
pub fn measured_peer_loop(runs: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(runs).ok()?;
    let mut rates: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["run"] == "torchrec-loop")
        .filter_map(|r| r["samples_per_sec"].as_f64())
        .collect();
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied()
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub dims: Vec<usize>,
    /// `embedding.dtype`s the embedding path is measured with.
    pub dtypes: Vec<EmbeddingDtype>,
    /// `embedding.optimizer`s the embedding path is measured with.
    pub optimizers: Vec<SparseOptimizerKind>,
    /// `embedding.rounding`s the half dtypes are measured with (f32 rows
    /// have only `nearest`).
    pub roundings: Vec<Rounding>,
    /// Distinct IDs in the embedding table under test.
    pub table_rows: usize,
    /// Batches timed per embedding configuration.
    pub batches: usize,
    pub batch_size: usize,
    pub fields: usize,
    pub zipf_exponent: f64,
    pub thread_counts: Vec<usize>,
    /// Training steps timed on the reference model (0 skips it).
    pub train_steps: usize,
    /// Training steps timed per model kind and precision (0 skips them).
    pub kind_steps: usize,
    /// The model kinds timed for the flop-floor table.
    pub kinds: Vec<ModelKind>,
    /// Rows inserted for the resident-memory measurement (0 skips it).
    pub memory_rows: usize,
    /// This machine's random-gather ceiling, measured by the caller (the
    /// `sparrow` binary compiles and runs `gather-limit.c`; the library runs
    /// no compiler).
    pub gather_limit: GatherLimit,
    /// Where the benchmark's data files go.
    pub work_dir: PathBuf,
    /// `train.simd` for every kernel timed (the ceilings aside).
    pub simd: Simd,
    /// `scripts/bench-peer`'s run log, for `train_step.ratio_to_peer`.
    pub peer_runs: PathBuf,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            dims: vec![16, 64],
            dtypes: vec![EmbeddingDtype::F32, EmbeddingDtype::F16],
            optimizers: vec![SparseOptimizerKind::Adagrad, SparseOptimizerKind::RowwiseAdagrad],
            roundings: vec![Rounding::Nearest],
            table_rows: 2_000_000,
            batches: 200,
            batch_size: 1024,
            fields: 26,
            zipf_exponent: 1.05,
            thread_counts: vec![1, 2],
            train_steps: 300,
            kind_steps: 100,
            kinds: sparrow_model::kinds::KINDS.iter().map(|k| ModelKind::named(k.name())).collect(),
            memory_rows: 4_000_000,
            gather_limit: GatherLimit::default(),
            work_dir: PathBuf::from("target/sparrow-bench"),
            simd: Simd::Auto,
            peer_runs: PathBuf::from("target/bench-peer/runs.jsonl"),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct GatherLimit {
    pub source: String,
    /// dim → (plain, prefetched) rows/s.
    pub rows_per_sec: Vec<(usize, f64, f64)>,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingBench {
    pub dim: usize,
    pub threads: usize,
    pub optimizer: &'static str,
    /// `embedding.dtype` of the table's vectors.
    pub dtype: &'static str,
    /// `embedding.rounding` of its updates.
    pub rounding: &'static str,
    /// Key + vector + optimizer state as stored.
    pub payload_bytes_per_row: usize,
    /// `payload_bytes_per_row` over an f32 row's with the same optimizer and dim.
    pub payload_vs_f32: f64,
    pub table_rows: usize,
    pub keys_per_batch: usize,
    pub dedup_ratio: f64,
    /// Batch keys (duplicates included) through dedup + lookup + update per second.
    pub keys_per_sec: f64,
    /// The same in this configuration's fastest round (the configurations
    /// of one dim and thread count take turns, round by round).
    pub best_round_keys_per_sec: f64,
    /// Unique rows looked up and updated per second.
    pub unique_rows_per_sec: f64,
    /// unique_rows_per_sec over the prefetched gather ceiling at this dim.
    pub unique_rows_vs_gather_prefetched: Option<f64>,
    pub keys_vs_gather_prefetched: Option<f64>,
    pub table_bytes_per_row: f64,
    /// Fractions of the time in dedup + partition, lookup, and update.
    pub phase_share: PhaseShare,
}

#[derive(Debug, Serialize)]
pub struct PhaseShare {
    pub plan: f64,
    pub lookup: f64,
    pub update: f64,
}

#[derive(Debug, Serialize)]
pub struct TrainBench {
    pub model: &'static str,
    pub batch_size: usize,
    pub threads: usize,
    pub steps: usize,
    pub samples_per_sec: f64,
    /// The peer's loop alone from `scripts/bench-peer`'s last runs on this
    /// machine (`target/bench-peer/runs.jsonl`); absent if it never ran.
    pub peer_train_loop_samples_per_sec: Option<f64>,
    pub ratio_to_peer: Option<f64>,
    /// Where the timed steps' wall time went.
    pub step_phase_secs: crate::trainer::PhaseSecs,
    /// The dense step's arithmetic: flops per sample (forward and both
    /// gradients of every layer), what it achieved over the `dense` phase,
    /// and that over the fp32 FMA ceiling measured in the same run.
    pub dense_flops_per_sample: f64,
    pub dense_gflops: f64,
    pub dense_share_of_fp32_peak: Option<f64>,
}

/// The machine's measured arithmetic ceilings (`sparrow_model::peak`), on
/// the reference model's thread count, and matrix products of the
/// reference MLP's forward shapes in fp32 (gemm) and in bf16
/// (`sparrow_model::bf16`).
#[derive(Debug, Serialize)]
pub struct Arithmetic {
    pub peaks: sparrow_model::peak::Peaks,
    /// bf16 ceiling over fp32's (2 on a CPU whose bf16 dot products run at
    /// the FMA rate: the target of `model.precision = "bf16"`).
    pub bf16_over_fp32: Option<f64>,
    /// AMX's bf16 ceiling over fp32's (where the CPU has AMX-BF16).
    pub amx_bf16_over_fp32: Option<f64>,
    pub gemm: Vec<GemmBench>,
}

/// One matrix product `m×k · k×n`, timed in fp32 and in bf16.
#[derive(Debug, Serialize)]
pub struct GemmBench {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub fp32_gflops: f64,
    pub bf16_gflops: f64,
    pub bf16_over_fp32: f64,
    /// The same bf16 product through the portable kernel (what a CPU
    /// without AVX-512-BF16 runs; its AVX2 build where the CPU has AVX2).
    pub bf16_portable_gflops: f64,
}

fn bench_gemm(simd: Simd, m: usize, n: usize, k: usize, threads: usize) -> Result<GemmBench, TrainError> {
    use sparrow_model::mlp::Operand;
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut c = vec![0f32; m * n];
    let pool = crate::run::compute_pool(threads)?;
    let mut time = |f: &mut dyn FnMut(&mut [f32])| {
        f(&mut c);
        let (start, mut runs) = (Instant::now(), 0u32);
        while start.elapsed().as_secs_f64() < 0.3 {
            f(&mut c);
            runs += 1;
        }
        2.0 * (m * n * k) as f64 * f64::from(runs) / start.elapsed().as_secs_f64() / 1e9
    };
    let fp32 = pool
        .install(|| time(&mut |c| sparrow_model::mlp::sgemm(simd, m, n, k, Operand::plain(&a), Operand::plain(&b), c)));
    let path = sparrow_model::bf16::path(simd);
    let bf16 = pool.install(|| {
        time(&mut |c| sparrow_model::bf16::gemm_bf16(path, m, n, k, Operand::plain(&a), Operand::plain(&b), c))
    });
    let portable = pool.install(|| {
        time(&mut |c| sparrow_model::bf16::gemm_bf16_portable(simd, m, n, k, Operand::plain(&a), Operand::plain(&b), c))
    });
    Ok(GemmBench {
        m,
        n,
        k,
        fp32_gflops: fp32,
        bf16_gflops: bf16,
        bf16_over_fp32: bf16 / fp32,
        bf16_portable_gflops: portable,
    })
}

#[derive(Debug, Serialize)]
pub struct MemoryBench {
    pub rows: usize,
    pub dim: usize,
    pub optimizer: &'static str,
    /// Resident set growth while the rows were inserted, over the row count.
    pub resident_bytes_per_row: f64,
    /// 8-byte key + vector + optimizer state, in f32.
    pub payload_bytes_per_row: usize,
    pub ratio_to_payload: f64,
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub gather_limit: GatherLimit,
    pub embedding: Vec<EmbeddingBench>,
    pub memory: Option<MemoryBench>,
    pub train_step: Option<TrainBench>,
    /// Every model kind's dense step against its flop floor.
    pub kinds: Vec<KindBench>,
    pub arithmetic: Arithmetic,
    /// `SPARROW_SIMD` for this run: `auto`, `avx512`, `avx2` (every kernel
    /// as on a CPU without AVX-512, the ceilings too) or `portable` (every
    /// kernel chosen at run time took its portable version, the ceilings aside).
    pub simd: &'static str,
    /// The path each `model.precision` takes on this CPU.
    pub precision_paths: PrecisionPaths,
}

/// How each `model.precision` runs here: its kernel, and for bf16 what
/// that means for speed and bits (`sparrow_model::bf16::Bf16Path`).
#[derive(Debug, Serialize)]
pub struct PrecisionPaths {
    pub f32: &'static str,
    /// The kernel of fp32's narrow products (the experts', gates', towers'
    /// and DIN's unit's, up to 64 columns): `avx512`, `avx2` (a CPU with
    /// AVX2 and FMA but not AVX-512F, or `SPARROW_SIMD=avx2`) or `gemm`
    /// (the `gemm` crate's).
    pub f32_narrow: &'static str,
    /// The `gemm` crate's kernels on this CPU (`avx512f`, `avx2_fma` or
    /// `baseline`), which take every other fp32 product (wider than 64
    /// columns, or deeper than 512: the reference MLP's layers): `train.simd`
    /// does not reach them, so under `avx2` on an AVX-512 CPU a kind built
    /// of such products reads faster than an AVX2 CPU runs it (its share of
    /// the AVX2 ceiling can pass 1).
    pub f32_gemm: &'static str,
    /// `amx_bf16`, `avx512_bf16`, `f32_kernels_on_bf16_inputs` or `portable`.
    pub bf16: &'static str,
    pub bf16_note: &'static str,
}

impl PrecisionPaths {
    pub fn here(simd: Simd) -> PrecisionPaths {
        let bf16 = sparrow_model::bf16::path(simd);
        let f32_narrow = sparrow_model::matrix::narrow_kernel(simd);
        let f32_gemm = sparrow_model::matrix::gemm_kernels();
        PrecisionPaths { f32: "fp32_gemm", f32_narrow, f32_gemm, bf16: bf16.name(), bf16_note: bf16.describe() }
    }
}

/// Resident bytes per row of a table of `rows` Adagrad rows at `dim`,
/// measured as the growth of this process's RSS.
fn bench_memory(rows: usize, dim: usize) -> Result<MemoryBench, TrainError> {
    let pool = crate::run::compute_pool(2)?;
    pool.install(|| {
        let before = crate::rss_bytes();
        let opt = SparseOptimizer::Adagrad { lr: 0.05, eps: 1e-8 };
        let table = EmbeddingTable::new(dim, opt, Initializer::new(InitConfig::default(), 1), 64);
        let mut scratch = Vec::new();
        for first in (0..rows as u64).step_by(1 << 16) {
            let keys: Vec<u64> = (first..(first + (1 << 16)).min(rows as u64)).map(|i| mix64(i ^ 0x77)).collect();
            let plan = table.plan(&keys);
            scratch.resize(plan.num_unique() * dim, 0.0);
            table.lookup_or_insert(&plan, &mut scratch)?;
        }
        drop(scratch);
        let grown = crate::rss_bytes().saturating_sub(before);
        let payload = 8 + 4 * (dim + opt.state_len(dim));
        let per_row = grown as f64 / table.len() as f64;
        Ok(MemoryBench {
            rows: table.len(),
            dim,
            optimizer: "adagrad",
            resident_bytes_per_row: per_row,
            payload_bytes_per_row: payload,
            ratio_to_payload: per_row / payload as f64,
        })
    })
}

/// The embedding path with `optimizer` at learning rate 0.05.
fn bench_optimizer(optimizer: SparseOptimizerKind) -> SparseOptimizer {
    SparseOptimizer::from_config(&EmbeddingConfig { optimizer, learning_rate: 0.05, ..Default::default() })
}

/// Refuses, before anything is filled, a set of embedding tables that
/// cannot fit in `available` bytes (a dim of 1024 at 2M rows needs tens of
/// GB: the OOM killer would end the run minutes in, without a report). Every
/// (optimizer, dtype) table of one dim lives at once; a row costs its
/// stored bytes, its key and about as much again for the index and the
/// arena's slack (`table_bytes_per_row` measured 94 for a 76-byte row).
fn check_embedding_memory(o: &BenchOptions, available: Option<u64>) -> Result<(), TrainError> {
    let Some(available) = available else { return Ok(()) };
    let table_bytes_per_row = |stored: u64| stored + stored / 4 + 24;
    // The resident-memory phase: one Adagrad table of dim 16.
    let memory_row =
        RowFormat { dtype: EmbeddingDtype::F32, dim: 16, state_len: 16, simd: Simd::Auto }.stored_bytes() as u64;
    let need = table_bytes_per_row(memory_row).saturating_mul(o.memory_rows as u64);
    if need > available {
        return Err(TrainError::Argument {
            flag: "--memory-rows",
            value: o.memory_rows.to_string(),
            message: format!(
                "a table of this many rows needs about {:.1} GB, more than the {:.1} GB available",
                need as f64 / 1e9,
                available as f64 / 1e9
            ),
        });
    }
    for &dim in &o.dims {
        let per_row: u64 = o
            .optimizers
            .iter()
            .flat_map(|&kind| embedding_configs(o).map(move |(dtype, rounding)| (kind, dtype, rounding)))
            .map(|(kind, dtype, rounding)| {
                // Stochastic rounding keeps the row's update count: one more word.
                let state_len = bench_optimizer(kind).state_len(dim) + usize::from(rounding == Rounding::Stochastic);
                table_bytes_per_row(RowFormat { dtype, dim, state_len, simd: Simd::Auto }.stored_bytes() as u64)
            })
            .sum();
        // The batches' keys, and one batch of gradients.
        let keys_per_batch = (o.batch_size * o.fields) as u64;
        let batches = keys_per_batch * (8 * o.batches as u64 + 4 * dim as u64);
        let need = per_row.saturating_mul(o.table_rows as u64).saturating_add(batches);
        if need > available {
            return Err(TrainError::Argument {
                flag: "--dims",
                value: dim.to_string(),
                message: format!(
                    "the bench's tables at this dim ({} rows each, {} optimizer(s) x {} dtype(s)) need about {:.1} GB, \
                     more than the {:.1} GB available; lower --table-rows or --dims, or name fewer --optimizers/--dtypes",
                    o.table_rows,
                    o.optimizers.len(),
                    o.dtypes.len(),
                    need as f64 / 1e9,
                    available as f64 / 1e9
                ),
            });
        }
    }
    Ok(())
}

/// The (dtype, rounding) pairs measured per optimizer: f32 rows to nearest
/// (they are not rounded), each half dtype with every rounding asked for.
fn embedding_configs(o: &BenchOptions) -> impl Iterator<Item = (EmbeddingDtype, Rounding)> + '_ {
    o.dtypes.iter().flat_map(move |&dtype| {
        let roundings = if dtype == EmbeddingDtype::F32 { vec![Rounding::Nearest] } else { o.roundings.clone() };
        roundings.into_iter().map(move |rounding| (dtype, rounding))
    })
}

/// `MemAvailable` from `/proc/meminfo`, where there is one.
fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Rounds the embedding configurations of one (dim, threads) take turns in,
/// so that a noisy stretch of the machine's time hits them all alike.
const EMBEDDING_ROUNDS: usize = 10;

/// One table under test and what its batches took.
struct EmbeddingRun {
    table: EmbeddingTable,
    optimizer: SparseOptimizer,
    dtype: EmbeddingDtype,
    rounding: Rounding,
    unique: usize,
    keys: usize,
    secs: f64,
    /// Dedup + partition, lookup, update.
    phase_secs: [f64; 3],
    best_round_keys_per_sec: f64,
}

impl EmbeddingRun {
    /// Times `batches` through dedup + lookup + update, adding to the totals.
    fn time(&mut self, batches: &[Vec<u64>], grads_seed: &[f32], dim: usize) -> Result<(), TrainError> {
        let (mut rows, mut grads) = (Vec::new(), Vec::new());
        let start = Instant::now();
        for keys in batches {
            let t0 = Instant::now();
            let plan = self.table.plan(keys);
            let t1 = Instant::now();
            rows.resize(plan.num_unique() * dim, 0.0);
            let slots = self.table.lookup_or_insert(&plan, &mut rows)?;
            let t2 = Instant::now();
            grads.clear();
            grads.extend_from_slice(&grads_seed[..plan.num_unique() * dim]);
            self.table.apply_gradients_at(&plan, &slots, &grads)?;
            let t3 = Instant::now();
            self.unique += plan.num_unique();
            self.keys += keys.len();
            for (phase, (a, b)) in self.phase_secs.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
                *phase += (b - a).as_secs_f64();
            }
        }
        let secs = start.elapsed().as_secs_f64();
        self.secs += secs;
        let rate = batches.iter().map(Vec::len).sum::<usize>() as f64 / secs;
        self.best_round_keys_per_sec = self.best_round_keys_per_sec.max(rate);
        Ok(())
    }
}

/// Lookup + update of every (optimizer, dtype) pair at one dim and thread
/// count: one table each, filled to `table_rows`, then the same power-law
/// batches through each in turn, `EMBEDDING_ROUNDS` times.
fn bench_embedding(
    o: &BenchOptions,
    dim: usize,
    threads: usize,
    ceiling: Option<f64>,
) -> Result<Vec<EmbeddingBench>, TrainError> {
    let pool = crate::run::compute_pool(threads)?;
    pool.install(|| {
        let all: Vec<u64> = (0..o.table_rows as u64).map(|i| mix64(i ^ 0xabc)).collect();
        let mut runs = Vec::new();
        for &optimizer in &o.optimizers {
            let optimizer = bench_optimizer(optimizer);
            for (dtype, rounding) in embedding_configs(o) {
                let table =
                    EmbeddingTable::typed(dim, dtype, optimizer, Initializer::new(InitConfig::default(), 1), 64)
                        .with_simd(o.simd)
                        .with_rounding(rounding);
                // Fill the table so lookups hit a table of the stated size.
                for chunk in all.chunks(1 << 16) {
                    let plan = table.plan(chunk);
                    let mut rows = vec![0.0; plan.num_unique() * dim];
                    table.lookup_or_insert(&plan, &mut rows)?;
                }
                runs.push(EmbeddingRun {
                    table,
                    optimizer,
                    dtype,
                    rounding,
                    unique: 0,
                    keys: 0,
                    secs: 0.0,
                    phase_secs: [0.0; 3],
                    best_round_keys_per_sec: 0.0,
                });
            }
        }
        let zipf = Alias::zipf(o.table_rows, o.zipf_exponent);
        let mut rng = Rng::new(7);
        let keys_per_batch = o.batch_size * o.fields;
        let batches: Vec<Vec<u64>> =
            (0..o.batches).map(|_| (0..keys_per_batch).map(|_| all[zipf.draw(&mut rng)]).collect()).collect();
        let grads_seed: Vec<f32> = (0..keys_per_batch * dim).map(|i| ((i % 13) as f32 - 6.0) * 1e-3).collect();
        let per_round = o.batches.div_ceil(EMBEDDING_ROUNDS).max(1);
        for round in batches.chunks(per_round) {
            for run in &mut runs {
                tracing::debug!(
                    "bench: embedding dim {dim}, {} ({}), {}",
                    run.dtype.name(),
                    run.rounding.name(),
                    run.optimizer.name()
                );
                run.time(round, &grads_seed, dim)?;
            }
        }
        Ok(runs
            .into_iter()
            .map(|run| {
                let (table, opt, secs) = (&run.table, run.optimizer, run.secs);
                let unique_rate = run.unique as f64 / secs;
                let keys_per_sec = run.keys as f64 / secs;
                let stored = 8 + table.row_format().stored_bytes();
                let f32_row = RowFormat { dtype: EmbeddingDtype::F32, ..table.row_format() };
                EmbeddingBench {
                    dim,
                    threads,
                    optimizer: opt.name(),
                    dtype: run.dtype.name(),
                    rounding: run.rounding.name(),
                    payload_bytes_per_row: stored,
                    payload_vs_f32: stored as f64 / (8 + f32_row.stored_bytes()) as f64,
                    table_rows: o.table_rows,
                    keys_per_batch,
                    dedup_ratio: run.keys as f64 / run.unique as f64,
                    keys_per_sec,
                    best_round_keys_per_sec: run.best_round_keys_per_sec,
                    unique_rows_per_sec: unique_rate,
                    unique_rows_vs_gather_prefetched: ceiling.map(|c| unique_rate / c),
                    keys_vs_gather_prefetched: ceiling.map(|c| keys_per_sec / c),
                    table_bytes_per_row: table.allocated_bytes() as f64 / table.len() as f64,
                    phase_share: PhaseShare {
                        plan: run.phase_secs[0] / secs,
                        lookup: run.phase_secs[1] / secs,
                        update: run.phase_secs[2] / secs,
                    },
                }
            })
            .collect())
    })
}

/// Generated batches for the training benches (`train_steps` of them at most 200, cycled).
fn bench_batches(o: &BenchOptions, config: &Config) -> Result<Vec<Batch>, TrainError> {
    let data_dir = o.work_dir.join("train-data");
    let rows = (o.train_steps.max(o.kind_steps).min(200) * o.batch_size) as u64;
    sparrow_data::synth::generate(&data_dir, rows, 1, 1)?;
    let bad = BadRows::new(0, 5);
    Ok(BatchStream::spawn(&data_dir.join("train.tsv"), config, o.batch_size, Default::default(), 1, bad)?
        .collect::<Result<_, _>>()?)
}

/// Trains `steps` batches after a 20-batch warm-up (first sight of every key
/// is not the steady state): samples/s, the timed steps' phases, samples,
/// and the model's flops per sample.
fn time_steps(
    config: &Config,
    batches: &[Batch],
    steps: usize,
) -> Result<(f64, crate::trainer::PhaseSecs, usize, f64), TrainError> {
    let layout = DataLayout::from_config(&config.data);
    let pool = crate::run::compute_pool(config.train.threads)?;
    pool.install(|| {
        let mut trainer = Trainer::new(config, layout)?;
        for b in batches.iter().take(20) {
            trainer.train_batch(b)?;
        }
        trainer.phase_secs = Default::default();
        let start = Instant::now();
        let mut samples = 0usize;
        for i in 0..steps {
            let b = &batches[i % batches.len()];
            trainer.train_batch(b)?;
            samples += b.rows();
        }
        let rate = samples as f64 / start.elapsed().as_secs_f64();
        let flops = sparrow_model::DenseModel::step_flops_per_sample(&config.model, trainer.model.shape)?;
        Ok((rate, trainer.phase_secs, samples, flops))
    })
}

fn bench_config(o: &BenchOptions, kind: ModelKind) -> Config {
    let mut config = Config::default();
    config.model.kind = kind;
    config.model.hidden = vec![256, 128];
    config.train.batch_size = o.batch_size;
    config.train.threads = 2;
    config.train.simd = o.simd;
    config
}

fn bench_train_step(o: &BenchOptions) -> Result<TrainBench, TrainError> {
    let config = bench_config(o, ModelKind::named("mlp"));
    let threads = config.train.threads;
    let peer = measured_peer_loop(&o.peer_runs);
    let batches = bench_batches(o, &config)?;
    {
        let (rate, phase_secs, samples, flops) = time_steps(&config, &batches, o.train_steps)?;
        let dense_gflops = flops * samples as f64 / phase_secs.dense.max(1e-9) / 1e9;
        Ok(TrainBench {
            model: "mlp 429-256-128-1, dim 16, adagrad + adam",
            batch_size: o.batch_size,
            threads,
            steps: o.train_steps,
            samples_per_sec: rate,
            peer_train_loop_samples_per_sec: peer,
            ratio_to_peer: peer.map(|p| rate / p),
            step_phase_secs: phase_secs,
            dense_flops_per_sample: flops,
            dense_gflops,
            dense_share_of_fp32_peak: None,
        })
    }
}

pub fn run(o: &BenchOptions) -> Result<BenchReport, TrainError> {
    std::fs::create_dir_all(&o.work_dir).map_err(|e| TrainError::io(&o.work_dir, e))?;
    check_embedding_memory(o, available_memory_bytes())?;
    // First, while nothing has been allocated and freed yet: later phases
    // leave freed memory that the allocator keeps and a new table would reuse.
    let memory = if o.memory_rows > 0 {
        tracing::info!("bench: resident memory of {} rows", o.memory_rows);
        Some(bench_memory(o.memory_rows, 16)?)
    } else {
        None
    };
    let gather = o.gather_limit.clone();
    let mut embedding = Vec::new();
    for &dim in &o.dims {
        let ceiling = gather.rows_per_sec.iter().find(|g| g.0 == dim).map(|g| g.2);
        for &t in &o.thread_counts {
            tracing::info!("bench: embedding dim {dim}, {t} thread(s), every optimizer and dtype in turn");
            embedding.extend(bench_embedding(o, dim, t, ceiling)?);
        }
    }
    let mut train_step = if o.train_steps > 0 {
        tracing::info!("bench: training step of the reference model");
        Some(bench_train_step(o)?)
    } else {
        None
    };
    tracing::info!("bench: fp32 FMA, bf16 dot-product and AMX ceilings");
    let threads = train_step.as_ref().map_or(2, |t| t.threads);
    let mut peaks = sparrow_model::peak::measure(o.simd, threads, Duration::from_millis(500));
    tracing::info!("bench: matrix products of the reference MLP's shapes, fp32 and bf16");
    let gemm = [(o.batch_size, 256, 429), (o.batch_size, 128, 256)]
        .iter()
        .map(|&(m, n, k)| bench_gemm(o.simd, m, n, k, threads))
        .collect::<Result<Vec<_>, _>>()?;
    let mut kinds = if o.kind_steps > 0 { bench_kinds(o)? } else { Vec::new() };
    if !kinds.is_empty() {
        // The ceilings once more, after the kinds' rounds: a busy stretch
        // only ever reads lower, so the higher of the two is the ceiling.
        let again = sparrow_model::peak::measure(o.simd, threads, Duration::from_millis(500));
        peaks = higher_ceilings(peaks, again);
    }
    let bf16_path = sparrow_model::bf16::path(o.simd);
    for k in &mut kinds {
        let ceiling = match k.precision {
            "bf16" => bf16_path.ceiling(&peaks).map(|b| b.gflops),
            _ => Some(peaks.fp32_fma.gflops),
        };
        k.share_of_ceiling = ceiling.map(|c| k.dense_gflops / c);
        let bf16_dot = peaks.bf16_dot.as_ref().filter(|_| k.precision == "bf16");
        k.share_of_bf16_dot_ceiling = bf16_dot.map(|b| k.dense_gflops / b.gflops);
        k.best_round_share_of_ceiling = ceiling.map(|c| k.best_round_dense_gflops / c);
        let bytes_bound_gflops = k.flops_per_sample * k.copy_gbytes_per_sec / k.bytes_per_sample;
        k.share_of_ceiling_bytes_allow = ceiling.map(|c| (bytes_bound_gflops / c).min(1.0));
    }
    if let Some(t) = train_step.as_mut() {
        t.dense_share_of_fp32_peak = Some(t.dense_gflops / peaks.fp32_fma.gflops);
    }
    let bf16_over_fp32 = peaks.bf16_dot.as_ref().map(|b| b.gflops / peaks.fp32_fma.gflops);
    let amx_bf16_over_fp32 = peaks.amx_bf16.as_ref().map(|b| b.gflops / peaks.fp32_fma.gflops);
    Ok(BenchReport {
        gather_limit: gather,
        embedding,
        memory,
        train_step,
        kinds,
        arithmetic: Arithmetic { peaks, bf16_over_fp32, amx_bf16_over_fp32, gemm },
        simd: o.simd.name(),
        precision_paths: PrecisionPaths::here(o.simd),
    })
}

/// Each ceiling the higher of two measurements.
fn higher_ceilings(a: sparrow_model::peak::Peaks, b: sparrow_model::peak::Peaks) -> sparrow_model::peak::Peaks {
    let higher = |x: sparrow_model::peak::Peak, y: sparrow_model::peak::Peak| if y.gflops > x.gflops { y } else { x };
    sparrow_model::peak::Peaks {
        threads: a.threads,
        fp32_fma: higher(a.fp32_fma, b.fp32_fma),
        bf16_dot: match (a.bf16_dot, b.bf16_dot) {
            (Some(x), Some(y)) => Some(higher(x, y)),
            (x, y) => x.or(y),
        },
        amx_bf16: match (a.amx_bf16, b.amx_bf16) {
            (Some(x), Some(y)) => Some(higher(x, y)),
            (x, y) => x.or(y),
        },
    }
}

#[cfg(test)]
mod peer_tests {
    use super::measured_peer_loop;

    #[test]
    fn the_peer_figure_is_the_median_of_its_measured_loop_runs_or_absent() {
        let dir = tempfile::tempdir().expect("tmp");
        let runs = dir.path().join("runs.jsonl");
        assert_eq!(measured_peer_loop(&runs), None, "never measured: no figure");
        let lines = [
            r#"{"run": "sparrow-f32", "samples_per_sec": 150000.0}"#,
            r#"{"run": "torchrec-loop", "samples_per_sec": 70000.0}"#,
            r#"{"run": "torchrec-tsv", "samples_per_sec": 40000.0}"#,
            r#"{"run": "torchrec-loop", "samples_per_sec": 60000.0}"#,
            r#"{"run": "torchrec-loop", "samples_per_sec": 65000.0}"#,
            "not json",
        ];
        std::fs::write(&runs, lines.join("\n")).expect("write");
        assert_eq!(measured_peer_loop(&runs), Some(65000.0));
    }
}

#[cfg(test)]
mod memory_tests {
    use super::{BenchOptions, check_embedding_memory};
    use crate::TrainError;

    /// Tables that cannot fit are refused naming the flag and the dim; the
    /// default bench fits where its measured peak (3.0 GB) does; an unknown
    /// amount of memory refuses nothing.
    #[test]
    fn tables_larger_than_the_memory_left_are_refused_before_filling() {
        let gb = 1_000_000_000u64;
        let o = BenchOptions { dims: vec![16, 1024], ..Default::default() };
        match check_embedding_memory(&o, Some(20 * gb)) {
            Err(TrainError::Argument { flag: "--dims", value, message }) => {
                assert_eq!(value, "1024");
                assert!(message.contains("--table-rows"), "{message}");
            }
            other => panic!("expected --dims 1024 refused, got {other:?}"),
        }
        let default = BenchOptions::default();
        assert!(check_embedding_memory(&default, Some(4 * gb)).is_ok());
        assert!(check_embedding_memory(&default, Some(gb)).is_err(), "dim 64's four tables need about 3 GB");
        assert!(check_embedding_memory(&o, None).is_ok());
        let many = BenchOptions { memory_rows: 200_000_000, ..Default::default() };
        match check_embedding_memory(&many, Some(20 * gb)) {
            Err(TrainError::Argument { flag: "--memory-rows", .. }) => {}
            other => panic!("expected --memory-rows refused, got {other:?}"),
        }
    }
}
