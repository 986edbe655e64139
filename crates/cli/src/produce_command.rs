//! `sparrow produce`: rows appended to a Kafka topic at a given rate, one
//! row a record: a file's lines, or the generator's rows (with the test
//! file and truth written beside, for evaluation).

use std::io::BufReader;
use std::path::PathBuf;

use anyhow::Context;
use sparrow_stream::produce::{ProduceOptions, produce};

#[derive(clap::Args)]
pub struct ProduceArgs {
    /// Bootstrap brokers, comma-separated host:port (default: --config's
    /// data.stream.brokers, else 127.0.0.1:9092).
    #[arg(long)]
    brokers: Option<String>,
    /// The topic (default: --config's data.stream.topic).
    #[arg(long)]
    topic: Option<String>,
    /// A job's config: its [data.stream] brokers, topic, [data.stream.tls]
    /// and [data.stream.sasl] (the password read from where it says).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key of --config, e.g. --set data.stream.sasl.username=producer
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "config")]
    set: Vec<String>,
    /// Records per second; 0: as fast as the broker takes them.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Records per produce request (one record batch) and partition. The
    /// default, 1, suits every broker: tansu 0.6.0 answers a fetch that
    /// starts inside a batch from the next batch on, so a run resumed
    /// there would miss records.
    #[arg(long, default_value_t = 1)]
    batch_records: usize,
    /// Partitions of the topic, when it does not exist yet and is created.
    #[arg(long, default_value_t = 1)]
    partitions: i32,
    /// Append this file's lines (one record each) instead of generated rows.
    #[arg(long, conflicts_with_all = ["rows", "out", "days"])]
    from: Option<PathBuf>,
    /// Generated rows: how many.
    #[arg(long, default_value_t = 100_000)]
    rows: u64,
    /// Generated rows: where the test file and truth.json go (and the rows
    /// produced, as a file too).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Generated rows: CSV with a `ts` column, spread over this many days,
    /// the click model drifting from day to day; the test rows are the
    /// newest day's.
    #[arg(long)]
    days: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// --from: each record's timestamp is the row's time, this column
    /// (0-based, Unix seconds; comma-separated for a .csv file, tab
    /// otherwise). Generated --days rows always carry their `ts` this way.
    #[arg(long, requires = "from")]
    timestamp_column: Option<usize>,
    /// --from: the file's first line is a header (not sent).
    #[arg(long, requires = "from")]
    skip_header: bool,
}

pub fn run(args: ProduceArgs) -> anyhow::Result<()> {
    if !(args.rate.is_finite() && args.rate >= 0.0) {
        anyhow::bail!("--rate must be a number of records per second >= 0 (0: unlimited), not {}", args.rate);
    }
    if args.batch_records < 1 {
        anyhow::bail!("--batch-records must be at least 1");
    }
    if args.partitions < 1 {
        anyhow::bail!("--partitions must be at least 1");
    }
    let stream = match &args.config {
        Some(path) => {
            let config = crate::edge::with_secrets(crate::edge::load_config(path, &args.set)?)?;
            let stream = config.data.stream.clone();
            Some(stream.with_context(|| format!("{}: no [data.stream] to produce to", path.display()))?)
        }
        None => None,
    };
    let brokers: Vec<String> = match (&args.brokers, &stream) {
        (Some(list), _) => list.split(',').map(|b| b.trim().to_string()).filter(|b| !b.is_empty()).collect(),
        (None, Some(s)) => s.brokers.clone(),
        (None, None) => vec!["127.0.0.1:9092".into()],
    };
    let topic = match (args.topic, &stream) {
        (Some(t), _) => t,
        (None, Some(s)) => s.topic.clone(),
        (None, None) => anyhow::bail!("name the topic: --topic NAME (or --config with a [data.stream] topic)"),
    };
    let access = match &stream {
        Some(s) => sparrow_stream::Access::new(&brokers, s.tls.as_ref(), s.sasl.as_ref())?,
        None => sparrow_stream::Access::plain(&brokers),
    };
    let mut options = ProduceOptions {
        access,
        topic,
        partitions: args.partitions,
        rate: args.rate,
        batch_records: args.batch_records,
        timestamp_column: args.timestamp_column,
        delimiter: b'\t',
        skip_lines: usize::from(args.skip_header),
    };
    let (path, truth) = match args.from {
        Some(path) => (path, None),
        None => {
            let scratch;
            let out = match args.out {
                Some(out) => out,
                None => {
                    scratch = tempfile_dir()?;
                    scratch.clone()
                }
            };
            let (truth, file) = match args.days {
                None => (sparrow_data::synth::generate(&out, args.rows, args.rows / 10 + 1, args.seed)?, "train.tsv"),
                Some(days) => (
                    sparrow_data::synth::generate_days(&out, args.rows, args.rows / 10 + 1, days, false, args.seed)?,
                    "train.csv",
                ),
            };
            (out.join(file), Some(truth))
        }
    };
    if path.extension().is_some_and(|e| e == "csv") {
        options.delimiter = b',';
    }
    // Generated CSV: its header is not a record (it goes in
    // data.stream.header), and each record carries its row's `ts`.
    let header = match args.days {
        Some(_) => {
            let mut first = String::new();
            std::io::BufRead::read_line(&mut BufReader::new(std::fs::File::open(&path)?), &mut first)?;
            let header = first.trim_end().to_string();
            options.skip_lines = 1;
            options.timestamp_column = header.split(',').position(|c| c == "ts");
            Some(header)
        }
        None => None,
    };
    let file = std::fs::File::open(&path).with_context(|| format!("{}", path.display()))?;
    let produced = produce(&options, BufReader::with_capacity(1 << 20, file))?;
    let mut json = serde_json::to_value(&produced)?;
    if let Some(header) = header {
        json["header"] = header.into();
    }
    if let Some(truth) = truth {
        json["truth"] = serde_json::to_value(&truth)?;
        json["rows_file"] = path.display().to_string().into();
    }
    println!("{json}");
    Ok(())
}

/// A fresh directory for generated rows nobody asked to keep.
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("sparrow-produce-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("{}", dir.display()))?;
    Ok(dir)
}
