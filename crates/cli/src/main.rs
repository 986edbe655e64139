//! The `sparrow` command: argument parsing and wiring only.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

mod args;
mod config_command;
mod config_reference;
mod edge;
mod export_command;
mod gather_limit;
mod produce_command;
mod serve_command;
mod train_metrics;

use edge::{edge_overrides, env_token, load_config, simd_from_env, with_env_token, with_secrets};

use anyhow::Context;
use clap::{Parser, Subcommand};
use sparrow_core::Config;
use sparrow_core::config::{EmbeddingDtype, ModelKind};

#[derive(Parser)]
#[command(
    name = "sparrow",
    version,
    about = "Sparrow: training for CTR and recommendation models with huge embedding tables"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate Criteo-format train/test data whose true click probabilities are known.
    Gen {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1_000_000)]
        train_rows: u64,
        #[arg(long, default_value_t = 100_000)]
        test_rows: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// `criteo` (train.tsv, test.tsv) or `csv` (train.csv, test.csv with a
        /// header and a `ts` column of Unix seconds).
        #[arg(long, value_enum)]
        format: Option<args::GenFormat>,
        /// CSV: spread the training rows over this many days, the click model
        /// drifting from day to day; the test rows are the newest day's.
        #[arg(long)]
        days: Option<u32>,
        /// CSV: write the training rows in a random order instead of oldest first.
        #[arg(long)]
        shuffled: bool,
        /// Behaviour data (CSV, train.csv/test.csv): labels `click` and
        /// `conversion` (click ∧ converts, ESMM's setting) and `converts`.
        #[arg(long)]
        tasks: bool,
        /// Behaviour data: a `hist_items` column, the user's recent items
        /// (newest last, `|`-separated); clicks follow the candidate's match
        /// with it (DIN's setting).
        #[arg(long)]
        sequence: bool,
        /// Behaviour data: an `ad_type` label of K classes.
        #[arg(long, value_name = "K")]
        classes: Option<u32>,
        /// Behaviour data: added to every click logit (−2: a few percent of clicks, as production ads have).
        #[arg(long, value_name = "X", allow_negative_numbers = true)]
        click_shift: Option<f64>,
    },
    /// Train (and evaluate on data.test) as a TOML config says.
    Train {
        #[arg(long)]
        config: PathBuf,
        /// Override any config key, e.g. --set embedding.learning_rate=0.1
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Resume from a checkpoint (same as --set checkpoint.resume_from=DIR).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// No progress output on stderr.
        #[arg(long)]
        quiet: bool,
        /// Serve Prometheus metrics on http://ADDR/metrics while training:
        /// progress, the stream's lag and progressive validation, updated
        /// every train.log_interval_steps (off loopback: needs cluster.auth_token).
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    /// Print a config as TOML: every key with its default (`--defaults`),
    /// or a config file as a job reads it, defaults and `--set` applied.
    /// `--schema`: the config's JSON Schema (descriptions, defaults, allowed
    /// values); `--reference`: the same as the book's Markdown chapter.
    Config {
        #[arg(long, conflicts_with_all = ["config", "set", "schema", "reference"])]
        defaults: bool,
        #[arg(long, conflicts_with_all = ["config", "set", "reference"])]
        schema: bool,
        #[arg(long, conflicts_with_all = ["config", "set"])]
        reference: bool,
        #[arg(long, required_unless_present_any = ["defaults", "schema", "reference"])]
        config: Option<PathBuf>,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Every model kind `model.kind` can name: its name, what it is built
    /// for, and one line about it.
    Kinds,
    /// AUC and log-loss of a checkpoint on a data file.
    Eval {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        data: PathBuf,
        /// Override keys of the checkpoint's config (e.g. data.format=csv).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Write one click probability per row of a data file.
    Predict {
        /// A checkpoint (or its directory of versions)…
        #[arg(long, required_unless_present = "model", conflicts_with = "model")]
        checkpoint: Option<PathBuf>,
        /// …or a serving export (or `checkpoint.dir/exports`, whose LATEST names the newest).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Write a serving export of a checkpoint: dense weights (safetensors),
    /// embedding vectors without optimizer state, the model config and a
    /// manifest with checksums (what `predict --model` reads); or, with
    /// `--format onnx`, the model as an ONNX graph.
    Export(export_command::ExportArgs),
    /// Serve a serving export over the Open Inference Protocol (KServe v2
    /// REST) until SIGINT/SIGTERM; `/metrics` for Prometheus.
    Serve(serve_command::ServeArgs),
    /// Append rows to a Kafka topic at a given rate, one row a record (a
    /// file's lines, or generated rows): for demos and tests of [data.stream].
    Produce(produce_command::ProduceArgs),
    /// One self-contained HTML page of runs' metrics (`train.metrics_path`):
    /// loss, AUC and throughput over samples, and the step's phases.
    Report {
        /// The run's metrics file.
        #[arg(long)]
        metrics: PathBuf,
        /// Other runs' metrics files, drawn beside it.
        #[arg(long, num_args = 1..)]
        compare: Vec<PathBuf>,
        /// The HTML file to write.
        #[arg(long)]
        out: PathBuf,
        /// The data's truth.json, for the best possible AUC (default: one
        /// beside the metrics file).
        #[arg(long)]
        truth: Option<PathBuf>,
        #[arg(long)]
        title: Option<String>,
    },
    /// Benchmarks: embedding lookup+update beside the gather ceiling, and the training step.
    Bench {
        /// Embedding dimensions to measure.
        #[arg(long, value_delimiter = ',', default_value = "16,64")]
        dims: Vec<usize>,
        /// Distinct IDs in the table under test.
        #[arg(long, default_value_t = 2_000_000)]
        table_rows: usize,
        /// Batches timed per embedding configuration.
        #[arg(long, default_value_t = 200)]
        batches: usize,
        /// Thread counts to measure the embedding path with.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        threads: Vec<usize>,
        /// `embedding.dtype`s to measure the embedding path with (f32, f16, bf16).
        #[arg(long, value_enum, value_delimiter = ',', default_value = "f32,f16")]
        dtypes: Vec<args::Dtype>,
        /// `embedding.optimizer`s to measure the embedding path with.
        #[arg(long, value_enum, value_delimiter = ',', default_value = "adagrad,rowwise_adagrad")]
        optimizers: Vec<args::Optimizer>,
        /// `embedding.rounding`s to measure the half dtypes with (nearest, stochastic); f32 rows are not rounded.
        #[arg(long, value_enum, value_delimiter = ',', default_value = "nearest")]
        roundings: Vec<args::RoundingArg>,
        /// Training steps timed on the reference model (0 skips it).
        #[arg(long, default_value_t = 300)]
        train_steps: usize,
        /// Training steps timed per model kind and precision for the flop-floor table, in 5 rounds of at least one step (0 skips it).
        #[arg(long, default_value_t = 100)]
        kind_steps: usize,
        /// Model kinds in the flop-floor table, comma-separated (default: every kind, as `sparrow kinds` lists them; the kinds for several tasks and sequences on behaviour data).
        #[arg(long, value_delimiter = ',', value_parser = args::model_kind)]
        kinds: Vec<ModelKind>,
        /// Rows inserted to measure resident bytes per embedding row (0 skips it).
        #[arg(long, default_value_t = 4_000_000)]
        memory_rows: usize,
        /// The C program that measures the random-gather ceiling.
        #[arg(long, default_value = "../shared/tools/gather-limit.c")]
        gather_limit: PathBuf,
    },
    /// Run a whole cluster on this machine: a coordinator, a loader, N shards
    /// and M workers as separate processes on loopback.
    Launch {
        #[arg(long)]
        config: PathBuf,
        #[arg(long, default_value_t = 2)]
        shards: usize,
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// `cluster.sync = "lazy"`: aggregator processes (`sparrow
        /// aggregator`); worker k goes to `cluster.lazy.aggregator_of[k]`, or k mod K.
        #[arg(long, default_value_t = 1)]
        aggregators: usize,
        /// `cluster.mode = "collocated"` (S1): N `sparrow node` processes
        /// (a shard and a worker each) in place of --shards and --workers.
        #[arg(long)]
        nodes: Option<usize>,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Do not forward the roles' logs to stderr.
        #[arg(long)]
        quiet: bool,
    },
    /// The coordinator role: membership, shard map, heartbeats, the workers'
    /// gradient rounds. The other roles receive its config.
    Coordinator {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[arg(long)]
        shards: usize,
        #[arg(long)]
        workers: usize,
        /// `cluster.sync = "lazy"`: the aggregator processes (`sparrow
        /// aggregator`) that register; the scheduler runs in this process.
        #[arg(long, default_value_t = 1)]
        aggregators: usize,
        /// gRPC address (a non-loopback address needs an auth token).
        #[arg(long, default_value = "127.0.0.1:7000")]
        listen: SocketAddr,
        /// Prometheus metrics endpoint.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
    },
    /// An embedding shard role.
    Shard {
        #[command(flatten)]
        role: RoleFlags,
        /// Ask for this shard index (e.g. a StatefulSet ordinal); default: the next free one.
        #[arg(long)]
        index: Option<usize>,
        /// Prometheus metrics endpoint.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
    },
    /// The loader role: reads, batches, de-duplicates and routes keys to the shards.
    Loader {
        #[command(flatten)]
        role: RoleFlags,
        /// Prometheus metrics endpoint.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
    },
    /// An aggregator role (`cluster.sync = "lazy"`, S4): sums its workers'
    /// contributions and sends the scheduler one partial sum per aggregation.
    Aggregator {
        #[command(flatten)]
        role: RoleFlags,
        /// Ask for this aggregator index; default: the next free one.
        #[arg(long)]
        index: Option<usize>,
        /// Prometheus metrics endpoint (the scheduler probes it).
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
    },
    /// A collocated node (`cluster.mode = "collocated"`, S1): shard and
    /// worker `--index` in one process. --listen is the shard's gRPC address.
    Node {
        #[command(flatten)]
        role: RoleFlags,
        #[arg(long)]
        index: Option<usize>,
        /// The shard's Prometheus metrics endpoint.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
    },
    /// A worker role: trains the dense model; worker 0 also evaluates. Its
    /// --listen address serves its Prometheus metrics.
    Worker {
        #[command(flatten)]
        role: RoleFlags,
        #[arg(long)]
        index: Option<usize>,
    },
    /// The reference model's training loop over a large table, in memory or
    /// on SSD behind a cache (run each storage separately: peak RSS is per process).
    BenchTier {
        /// Keys in the table (power-law access).
        #[arg(long, default_value_t = 20_000_000)]
        rows: usize,
        /// memory | ssd
        #[arg(long, value_enum, default_value_t = args::StorageArg::Ssd)]
        storage: args::StorageArg,
        #[arg(long, default_value_t = 2_000_000)]
        cache_rows: usize,
        /// lru | lfu
        #[arg(long, value_enum, default_value_t = args::Policy::Lfu)]
        policy: args::Policy,
        #[arg(long, default_value = "target/bench-tier")]
        path: PathBuf,
        #[arg(long, default_value_t = 300)]
        steps: usize,
        /// Untimed steps first: filling the table in rank order leaves the
        /// coldest rows cached, and the cache must turn over (at 20M rows and
        /// a 10% cache, ~1000 steps of misses) before it reaches steady state.
        #[arg(long, default_value_t = 1500)]
        warmup_steps: usize,
    },
    /// Generate data (if missing) and train the default DLRM on it: the quick start.
    Demo {
        #[arg(long, default_value = "target/demo-data")]
        dir: PathBuf,
        #[arg(long, default_value_t = 1_000_000)]
        train_rows: u64,
        #[arg(long, default_value_t = 100_000)]
        test_rows: u64,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
}

#[derive(clap::Args)]
struct RoleFlags {
    /// The coordinator's address.
    #[arg(long)]
    coordinator: String,
    /// Address to bind (port 0: any free port; a non-loopback address needs an auth token).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address the other roles use to reach this one (default: the bound address).
    #[arg(long)]
    advertise: Option<String>,
    /// How long to keep retrying the coordinator (with backoff) before giving up.
    #[arg(long, default_value_t = 20_000)]
    connect_timeout_ms: u64,
}

impl RoleFlags {
    fn args(
        self,
        index: Option<usize>,
        metrics_listen: Option<SocketAddr>,
    ) -> anyhow::Result<sparrow_cluster::roles::RoleArgs> {
        Ok(sparrow_cluster::roles::RoleArgs {
            coordinator: self.coordinator,
            listen: self.listen,
            advertise: self.advertise,
            metrics_listen,
            index,
            connect_timeout_ms: self.connect_timeout_ms,
            token: env_token()?,
            env: |name| std::env::var_os(name),
        })
    }
}

/// Where the libraries' `tracing` goes: stderr (`RUST_LOG` filters, default
/// info). A job (`train`, `launch`, …) prints plain lines, as a person reads
/// them (progress, warnings about the data, where the model was saved); a
/// role process logs with time and level.
fn init_logging(role: bool) {
    // The Kafka client's connection chatter is kept out; its retries (a
    // broker gone) are shown.
    let default = if role {
        "info,h2=warn,tower=warn,hyper=warn,rskafka=warn,rskafka::backoff=info"
    } else {
        "info,rskafka=warn,rskafka::backoff=info"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    let _ = if role {
        fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).try_init()
    } else {
        fmt.with_ansi(false).without_time().with_level(false).try_init()
    };
}

/// A child of `sparrow launch` exits when the launcher goes away (its stdin
/// pipe closes), so no role outlives a killed launcher. The lines the
/// launcher writes meanwhile (to the coordinator: which role died) come out
/// of the returned channel.
fn exit_with_parent() -> Option<crossbeam_channel::Receiver<String>> {
    std::env::var_os(sparrow_cluster::launch::EXIT_WITH_PARENT_ENV)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
        // The launcher held our stderr too: writing may fail (no panic here).
        let _ = writeln!(std::io::stderr(), "error: the launcher went away; stopping");
        std::process::exit(3);
    });
    Some(rx)
}

// Tensor-sized allocations (MBs, freed every step) made glibc map and unmap
// pages each step: 20% of the time went to page clearing and TLB shootdowns.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DEMO_CONFIG: &str = include_str!("../../../configs/dlrm.toml");

pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(value)?)?;
    out.flush()?;
    Ok(())
}

/// The signal that stopped the run (0: none), for the exit code 128 + n.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

fn signal_name(signal: i32) -> &'static str {
    match signal {
        signal_hook::consts::SIGINT => "SIGINT",
        signal_hook::consts::SIGTERM => "SIGTERM",
        signal_hook::consts::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// SIGINT (Ctrl-C), SIGTERM (Kubernetes, Docker, systemd, `timeout`) and
/// SIGHUP (a closed terminal) all stop a run the same way: the returned flag
/// is set, training stops after the current step and checkpoints, and the
/// process exits with 128 + the signal's number. A second signal exits at once.
fn stop_on_signals() -> Arc<AtomicBool> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let flag = Arc::new(AtomicBool::new(false));
    let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("warning: signals will not checkpoint: {e}");
            return flag;
        }
    };
    let seen = flag.clone();
    std::thread::spawn(move || {
        for signal in signals.forever() {
            if seen.load(Ordering::SeqCst) {
                std::process::exit(128 + signal);
            }
            // The signal first: the run may see the flag and end at once.
            STOP_SIGNAL.store(signal, Ordering::SeqCst);
            seen.store(true, Ordering::SeqCst);
            eprintln!("{}: stopping after this step (send it again to quit at once)", signal_name(signal));
        }
    });
    flag
}

/// A cluster role holds no state of its own to save yet (checkpoints are
/// written by worker 0 at the end of the job), so a stop signal ends it at
/// once, saying why, with 128 + the signal's number; the coordinator (or
/// `launch`) then reports the role as gone.
fn exit_on_signals(role: &'static str) {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    if let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        std::thread::spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let _ = writeln!(std::io::stderr(), "error: {role} stopped by {}", signal_name(signal));
                std::process::exit(128 + signal);
            }
        });
    }
}

fn run(cli: Cli, from_launcher: Option<crossbeam_channel::Receiver<String>>) -> anyhow::Result<()> {
    let role = matches!(
        cli.command,
        Command::Coordinator { .. }
            | Command::Shard { .. }
            | Command::Loader { .. }
            | Command::Worker { .. }
            | Command::Aggregator { .. }
            | Command::Node { .. }
    );
    init_logging(role);
    match cli.command {
        Command::Gen {
            out,
            train_rows,
            test_rows,
            seed,
            format,
            days,
            shuffled,
            tasks,
            sequence,
            classes,
            click_shift,
        } => {
            if tasks || sequence || classes.is_some() || click_shift.is_some() {
                if days.is_some() || shuffled || format.is_some() {
                    anyhow::bail!(
                        "--tasks, --sequence and --classes write behaviour CSV: leave out --format, --days and --shuffled"
                    );
                }
                let click_shift = click_shift.unwrap_or(0.0);
                let shape = sparrow_data::synth_tasks::Shape { tasks, sequence, classes, click_shift };
                return print_json(&sparrow_data::synth_tasks::generate_tasks(
                    &out, train_rows, test_rows, shape, seed,
                )?);
            }
            let truth = match (format.unwrap_or(args::GenFormat::Criteo), days) {
                (args::GenFormat::Criteo, None) if shuffled => {
                    anyhow::bail!("--shuffled goes with --format csv --days")
                }
                (args::GenFormat::Criteo, None) => sparrow_data::synth::generate(&out, train_rows, test_rows, seed)?,
                (args::GenFormat::Criteo, Some(_)) => {
                    anyhow::bail!("--days writes CSV with a ts column: add --format csv")
                }
                (args::GenFormat::Csv, days) => {
                    let days = days.unwrap_or(1);
                    sparrow_data::synth::generate_days(&out, train_rows, test_rows, days, shuffled, seed)?
                }
            };
            print_json(&truth)
        }
        Command::Train { config, mut set, resume, quiet, metrics_listen } => {
            if let Some(r) = resume {
                set.push(format!("checkpoint.resume_from={:?}", r.display().to_string()));
            }
            let config = with_secrets(load_config(&config, &set)?)?;
            let summary = match metrics_listen {
                None => sparrow_trainer::train_until(&config, quiet, &stop_on_signals())?,
                Some(addr) => train_metrics::train_serving_metrics(&config, quiet, &stop_on_signals(), addr)?,
            };
            print_json(&summary)
        }
        Command::Config { schema: true, .. } => config_command::print_schema(),
        Command::Config { reference: true, .. } => config_command::print_reference(),
        Command::Config { config, set, .. } => {
            let loaded = match config {
                Some(path) => Some(load_config(&path, &set)?),
                None => None,
            };
            config_command::print(loaded.as_ref())
        }
        Command::Kinds => config_command::print_kinds(),
        Command::Eval { checkpoint, data, set } => {
            print_json(&sparrow_trainer::evaluate_checkpoint(&checkpoint, &data, &edge_overrides(&set)?, None)?)
        }
        Command::Predict { checkpoint, model, data, out, set } => {
            let set = edge_overrides(&set)?;
            let summary = match (checkpoint, model) {
                (Some(checkpoint), _) => sparrow_trainer::predict_checkpoint(&checkpoint, &data, &out, &set)?,
                (None, Some(model)) => sparrow_trainer::run::predict_export(&model, &data, &out, &set)?,
                (None, None) => anyhow::bail!("predict needs --checkpoint DIR or --model EXPORT"),
            };
            print_json(&summary)
        }
        Command::Export(args) => export_command::run(args),
        Command::Serve(args) => serve_command::run(args),
        Command::Produce(args) => produce_command::run(args),
        Command::Report { metrics, mut compare, out, truth, title } => {
            compare.insert(0, metrics);
            print_json(&sparrow_report::write_report(&compare, truth.as_deref(), title.as_deref(), &out)?)
        }
        Command::Bench {
            dims,
            table_rows,
            batches,
            threads,
            dtypes,
            optimizers,
            roundings,
            train_steps,
            kind_steps,
            kinds,
            memory_rows,
            gather_limit,
        } => {
            let dtypes = dtypes.into_iter().map(EmbeddingDtype::from).collect();
            // Nothing to time is a mistake, not a report of nulls (or a panic).
            for (flag, value) in [("--table-rows", table_rows), ("--batches", batches)] {
                if value == 0 {
                    anyhow::bail!("{flag} must be at least 1");
                }
            }
            // A dim a config would refuse (0 panicked in the table), and 0
            // threads, which rayon reads as "all cores" (reported as 0).
            let max_dim = sparrow_core::config::MAX_EMBEDDING_DIM;
            if let Some(dim) = dims.iter().find(|&&d| d == 0 || d > max_dim) {
                anyhow::bail!("--dims: {dim} is not between 1 and {max_dim}");
            }
            if threads.contains(&0) {
                anyhow::bail!("--threads: every count must be at least 1");
            }
            let optimizers = optimizers.into_iter().map(Into::into).collect();
            let roundings = roundings.into_iter().map(Into::into).collect();
            let work_dir = std::env::temp_dir().join("sparrow-bench");
            std::fs::create_dir_all(&work_dir).with_context(|| format!("creating {}", work_dir.display()))?;
            tracing::info!("bench: this machine's random-gather ceiling ({})", gather_limit.display());
            let gather_limit = gather_limit::measure(&gather_limit, &dims, &work_dir);
            let options = sparrow_trainer::bench::BenchOptions {
                dims,
                dtypes,
                optimizers,
                roundings,
                table_rows,
                batches,
                thread_counts: threads,
                train_steps,
                kind_steps,
                // None named: every kind of the registry (the default's).
                kinds: if kinds.is_empty() { sparrow_trainer::bench::BenchOptions::default().kinds } else { kinds },
                memory_rows,
                gather_limit,
                work_dir,
                simd: simd_from_env()?.unwrap_or_default(),
                ..Default::default()
            };
            print_json(&sparrow_trainer::bench::run(&options)?)
        }
        Command::Launch { config: path, shards, workers, aggregators, nodes, set, quiet } => {
            // The password is read here to fail early; the loader reads it again.
            let config = with_secrets(with_env_token(load_config(&path, &set)?)?)?;
            let options = sparrow_cluster::launch::LaunchOptions {
                config_path: path,
                set,
                shards,
                workers,
                aggregators,
                nodes,
                quiet,
                failpoints_on_restart: std::env::var_os("SPARROW_FAILPOINTS_ON_RESTART").is_some(),
            };
            let stop = stop_on_signals();
            let summary = sparrow_cluster::launch::launch(&options, &config, &stop)?;
            print_json(&summary)?;
            if stop.load(Ordering::SeqCst) {
                let checkpoint = summary.checkpoint.clone().unwrap_or_else(|| "none written".into());
                return Err(sparrow_cluster::ClusterError::Stopped(checkpoint).into());
            }
            Ok(())
        }
        Command::Coordinator { config, set, shards, workers, aggregators, listen, metrics_listen } => {
            exit_on_signals("coordinator");
            let config = with_env_token(load_config(&config, &set)?)?;
            let notices = from_launcher;
            let on_bound = |bound| {
                println!("listening on {bound}");
                let _ = std::io::stdout().flush();
            };
            // `sparrow launch` reads these lines (checkpoints, recoveries, hung roles).
            let on_event = |event: &sparrow_cluster::coordinator::Event| {
                if let Ok(json) = serde_json::to_string(event) {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "event {json}");
                    let _ = out.flush();
                }
            };
            let args = sparrow_cluster::roles::CoordinatorArgs {
                num_shards: shards,
                num_workers: workers,
                aggregators,
                listen,
                metrics_listen,
                notices,
            };
            sparrow_cluster::roles::run_coordinator(&config, args, on_bound, on_event)?;
            Ok(())
        }
        Command::Shard { role, index, metrics_listen } => {
            exit_on_signals("shard");
            Ok(sparrow_cluster::roles::run_shard(&role.args(index, metrics_listen)?)?)
        }
        Command::Loader { role, metrics_listen } => {
            exit_on_signals("loader");
            Ok(sparrow_cluster::roles::run_loader(&role.args(None, metrics_listen)?, from_launcher)?)
        }
        Command::Aggregator { role, index, metrics_listen } => {
            exit_on_signals("aggregator");
            Ok(sparrow_cluster::roles::run_aggregator(&role.args(index, metrics_listen)?)?)
        }
        Command::Node { role, index, metrics_listen } => {
            exit_on_signals("node");
            print_json(&sparrow_cluster::roles::run_node(&role.args(index, metrics_listen)?)?)
        }
        Command::Worker { role, index } => {
            exit_on_signals("worker");
            print_json(&sparrow_cluster::roles::run_worker(&role.args(index, None)?)?)
        }
        Command::BenchTier { rows, storage, cache_rows, policy, path, steps, warmup_steps } => {
            let (storage, policy) = (storage.into(), policy.into());
            let options = sparrow_trainer::bench::TierBenchOptions {
                rows,
                storage,
                cache_rows,
                policy,
                path,
                steps,
                warmup_steps,
                zipf_exponent: 1.05,
            };
            print_json(&sparrow_trainer::bench::bench_tier(&options)?)
        }
        Command::Demo { dir, train_rows, test_rows, mut set } => {
            let truth = dir.join("truth.json");
            let have = std::fs::read_to_string(&truth)
                .ok()
                .and_then(|t| serde_json::from_str::<sparrow_data::synth::Truth>(&t).ok())
                .is_some_and(|t| t.train_rows == train_rows && t.test_rows == test_rows);
            if !have {
                eprintln!("generating {train_rows} train and {test_rows} test rows in {}", dir.display());
                sparrow_data::synth::generate(&dir, train_rows, test_rows, 1)?;
            }
            let d = dir.display().to_string();
            let mut overrides = vec![
                format!("data.train={:?}", format!("{d}/train.tsv")),
                format!("data.test={:?}", format!("{d}/test.tsv")),
                format!("train.metrics_path={:?}", format!("{d}/metrics.jsonl")),
                format!("checkpoint.dir={:?}", format!("{d}/checkpoint")),
            ];
            overrides.append(&mut set);
            let config = Config::from_toml(DEMO_CONFIG, "configs/dlrm.toml", &edge_overrides(&overrides)?)?;
            let summary = sparrow_trainer::train_until(&config, false, &stop_on_signals())?;
            eprintln!("{}", demo_line(&summary));
            print_json(&summary)
        }
    }
}

/// candle 0.11 runs elementwise ops on its own spinning thread pool sized to
/// the cores; on top of our compute pool (whose threads run the matmuls) it
/// oversubscribes the CPU. One candle thread runs those ops inline instead.
/// Only the environment reaches that setting (candle reads it when its pool
/// starts, after this), so it is set unless the user set it.
fn configure_candle() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        #[expect(unsafe_code, reason = "set_var before any thread exists")]
        // SAFETY: called first thing in main, while the process has one
        // thread, so no other thread can read the environment concurrently.
        unsafe {
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
    }
}

/// `mi_option_purge_delay`: its place in mimalloc.h's `mi_option_e` (v2 and
/// v3 alike); libmimalloc-sys names no constant for it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc returns freed pages to the OS after a delay (1 s in v3); the next step then
/// faults them back in (zeroing 2 MiB huge pages). Steps reuse the same
/// sizes, so freed memory is kept (unless the user set
/// `MIMALLOC_PURGE_DELAY`, which mimalloc reads before `main`). Set through
/// mimalloc's API: an environment variable set now would not be read.
fn configure_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        #[expect(unsafe_code, reason = "FFI call into mimalloc")]
        // SAFETY: mi_option_set takes any option id and value and only
        // stores the value (options are plain integers read at each purge).
        unsafe {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

/// A panic the parquet reader raises on a malformed file becomes an error
/// naming the file; its message would only be noise before that error.
fn quiet_handled_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // An injected failure (FAILPOINTS, action `return`): this process
        // dies on the spot, as SIGKILL would: exit 137, no cleanup, nothing
        // flushed. The library only raised it; ending the process is ours.
        if let Some(injected) = info.payload().downcast_ref::<sparrow_cluster::faults::Injected>() {
            tracing::error!("failpoint {}: this process dies here", injected.0);
            std::process::exit(137);
        }
        if !sparrow_data::parquet_source::panic_is_handled() {
            default(info);
        }
    }));
}

/// What a first-time user reads at the end of `sparrow demo`, before the JSON.
fn demo_line(s: &sparrow_trainer::TrainSummary) -> String {
    let auc = |a: Option<f64>| a.map_or_else(|| "-".to_string(), |a| format!("{a:.4}"));
    let saved = s.checkpoint.as_deref().map_or_else(|| "no checkpoint".to_string(), |c| format!("checkpoint: {c}"));
    format!(
        "demo: test AUC {} (the best possible on this data: {}), {:.0} samples/s; {saved}",
        auc(s.test_auc),
        auc(s.bayes_auc),
        s.samples_per_sec
    )
}

/// Failure injection for the recovery tests: off unless `FAILPOINTS` names
/// points (`name=actions;name=actions`, the `fail` crate's syntax). A
/// malformed value is an error naming the entry, not a panic.
fn failpoints_from_env() -> anyhow::Result<()> {
    let Some(value) = std::env::var_os("FAILPOINTS") else { return Ok(()) };
    let value = value.into_string().map_err(|_| anyhow::anyhow!("FAILPOINTS is not UTF-8"))?;
    for entry in value.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, actions) = entry.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("FAILPOINTS: `{entry}` is not NAME=ACTIONS (e.g. shard.push=20*off->return)")
        })?;
        fail::cfg(name.trim(), actions.trim()).map_err(|e| anyhow::anyhow!("FAILPOINTS: `{entry}`: {e}"))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    configure_candle();
    configure_allocator();
    quiet_handled_panics();
    if let Err(e) = failpoints_from_env() {
        eprintln!("error: {e:#}");
        return ExitCode::from(2);
    }
    if let Err(e) = simd_from_env() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let from_launcher = exit_with_parent();
    match run(Cli::parse(), from_launcher) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            let interrupted = e
                .downcast_ref::<sparrow_trainer::TrainError>()
                .is_some_and(|t| matches!(t, sparrow_trainer::TrainError::Interrupted { .. }))
                || e.downcast_ref::<sparrow_cluster::ClusterError>().is_some_and(|c| {
                    matches!(c, sparrow_cluster::ClusterError::Interrupted | sparrow_cluster::ClusterError::Stopped(_))
                });
            let signal = STOP_SIGNAL.load(Ordering::SeqCst);
            // One meaning a code: the book's exit code table (docs/book/src/training.md).
            let failure = e.downcast_ref::<sparrow_cluster::ClusterError>().map_or(2, |c| c.exit_code());
            ExitCode::from(match (interrupted, signal) {
                (true, 0) => 130,
                (true, n) => (128 + n) as u8,
                (false, _) => failure,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Option 15 is the purge delay: mimalloc v3's default (1000 ms, in its
    /// options.c) before, and no purging (-1) once the binary set it.
    #[test]
    fn the_allocator_keeps_freed_memory_through_its_api() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        #[expect(unsafe_code, reason = "FFI call into mimalloc")]
        // SAFETY: mi_option_get only reads an option's value.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(get(), 1000, "mimalloc's default purge delay");
        configure_allocator();
        assert_eq!(get(), -1);
    }
}
