//! The fuzz targets' bodies: every parser and wire decoder of Sparrow, fed
//! arbitrary bytes, must return a value or an error — never panic, hang or
//! allocate without bound. `fuzz/` (cargo-fuzz, nightly) drives these by
//! hand for minutes; `tests/corpus_replay.rs` replays the committed corpus
//! through them on every `./scripts/test` (stable).

use sparrow_core::Overrides;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use prost::Message;
use sparrow_core::config::{DataConfig, DataFormat, Schema};
use sparrow_core::{BatchBuilder, Config};
use sparrow_data::BadRows;
use sparrow_data::stream::open_source;
use sparrow_data::text::{CriteoParser, CsvParser, LineParser, SvmParser};
use sparrow_proto::v1 as pb;

/// A target: takes any bytes, returns nothing, must not panic.
pub type Target = fn(&[u8]);

/// The targets, by the name of their corpus directory under `fuzz/corpus/`.
pub const TARGETS: &[(&str, Target)] = &[
    ("line_parsers", line_parsers),
    ("text_file", text_file),
    ("parquet_file", parquet_file),
    ("config", config),
    ("worker_batch", worker_batch),
    ("export_reply", export_reply),
    ("checkpoint_embeddings", checkpoint_embeddings),
    ("export_embeddings", export_embeddings),
    ("export_manifest", export_manifest),
    ("kserve_request", kserve_request),
];

fn csv_schema() -> Schema {
    Schema {
        label: "y".into(),
        dense: vec!["x".into()],
        sparse: vec!["a".into(), "b".into()],
        multi_hot_separator: Some("|".into()),
        ..Schema::default()
    }
}

/// Each line parser (Criteo, CSV, libsvm, libffm) on one line; the builder
/// must stay consistent whatever the parser says.
pub fn line_parsers(data: &[u8]) {
    let Ok(csv) = CsvParser::new(Path::new("fuzz.csv"), &csv_schema(), Some(b"y,x,a,b")) else { return };
    let parsers: Vec<(Box<dyn LineParser>, usize, usize, bool)> = vec![
        (Box::new(CriteoParser::default()), 26, 13, false),
        (Box::new(csv), 2, 1, false),
        (Box::new(SvmParser::libsvm()), 1, 0, true),
        (Box::new(SvmParser::libffm(4)), 4, 0, true),
    ];
    for (mut parser, fields, dense, weighted) in parsers {
        let mut b = BatchBuilder::new(fields, dense, weighted, 2);
        b.begin_row();
        match parser.parse(data, &mut b) {
            Ok(label) if b.end_row(label) => {}
            _ => b.rollback_row(),
        }
        let _ = parser.whole_without_newline(data);
        let _ = b.finish(Default::default());
    }
}

/// A scratch file of this process, rewritten for each input.
fn scratch(name: &str, data: &[u8]) -> Option<PathBuf> {
    let path = std::env::temp_dir().join(format!("sparrow-fuzz-{}-{name}", std::process::id()));
    std::fs::write(&path, data).ok()?;
    Some(path)
}

/// Removes every scratch file and directory this process's targets made
/// in the temporary directory (`sparrow-fuzz-<pid>-…`), for a caller that
/// is done with them: a test replaying the corpus leaves nothing behind.
/// The templates written once a process are not rewritten afterwards, so
/// call this only when no target runs again in this process.
pub fn remove_scratch() -> std::io::Result<()> {
    let prefix = format!("sparrow-fuzz-{}-", std::process::id());
    for entry in std::fs::read_dir(std::env::temp_dir())?.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let path = entry.path();
            if path.is_dir() { std::fs::remove_dir_all(&path)? } else { std::fs::remove_file(&path)? }
        }
    }
    Ok(())
}

fn read_all(path: &Path, config: &DataConfig) {
    // A bad-row budget large enough that every line is parsed.
    let bad = BadRows::new(u64::MAX, 0);
    let job = sparrow_core::Config { data: config.clone(), ..Default::default() };
    let Ok(mut source) = open_source(path, &job, bad.clone()) else { return };
    let mut batches = 0;
    while let Ok(Some(_)) = source.next_batch(64, 0) {
        batches += 1;
        if batches > 10_000 {
            break;
        }
    }
    let _ = bad.end_pass(path);
}

/// A whole input file in each text format: plain, gzip or zstd by its magic
/// bytes, a byte-order mark, lines of any length, no final newline.
pub fn text_file(data: &[u8]) {
    let Some(path) = scratch("text", data) else { return };
    for format in [DataFormat::Criteo, DataFormat::Csv, DataFormat::Libsvm, DataFormat::Libffm] {
        let config = DataConfig {
            format,
            schema: (format == DataFormat::Csv).then(csv_schema),
            num_fields: Some(4),
            ..DataConfig::default()
        };
        read_all(&path, &config);
    }
}

/// A Parquet file with the CSV target's schema.
pub fn parquet_file(data: &[u8]) {
    let Some(path) = scratch("parquet", data) else { return };
    let config = DataConfig { format: DataFormat::Parquet, schema: Some(csv_schema()), ..DataConfig::default() };
    read_all(&path, &config);
}

/// The job config: TOML text, then the same text as a `--set` value.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = Config::from_toml(text, "fuzz.toml", &Overrides::none());
    let _ = Overrides::parse(&[text.to_string()]).and_then(|o| Config::from_toml("", "fuzz.toml", &o));
}

/// A worker batch as the loader sends it.
pub fn worker_batch(data: &[u8]) {
    if let Ok(message) = pb::WorkerBatch::decode(data) {
        let _ = sparrow_cluster::grpc::loader::from_proto(message, "fuzz");
    }
}

/// A page of a shard's rows, as worker 0 reads them for a checkpoint.
pub fn export_reply(data: &[u8]) {
    if let Ok(message) = pb::ExportReply::decode(data) {
        let _ = sparrow_cluster::grpc::shard::export_page_from_proto(message, "fuzz");
    }
}

/// A small real checkpoint, written once per process: the template whose
/// `embeddings.bin` each input replaces.
fn checkpoint_template() -> Option<&'static (PathBuf, Config)> {
    static TEMPLATE: OnceLock<Option<(PathBuf, Config)>> = OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("sparrow-fuzz-{}-template", std::process::id()));
            let data = dir.join("data");
            sparrow_data::synth::generate(&data, 300, 0, 1).ok()?;
            let mut config = Config::default();
            config.data.train = Some(data.join("train.tsv").display().to_string());
            config.model.kind = sparrow_core::config::ModelKind::named("lr");
            config.model.embedding_dim = 2;
            config.train.batch_size = 100;
            config.train.threads = 1;
            config.embedding.table_shards = 2;
            config.checkpoint.dir = Some(dir.join("ck").display().to_string());
            sparrow_trainer::train(&config, true).ok()?;
            Some((dir.join("ck"), config))
        })
        .as_ref()
}

/// `dir/embeddings.bin` replaced by `data`, the manifest's size and checksum
/// of it made to match, so a reader gets past the checksum to the parsing.
fn with_embeddings(dir: &Path, data: &[u8]) -> Option<()> {
    let text = std::fs::read_to_string(dir.join("manifest.json")).ok()?;
    let mut manifest = serde_json::from_str::<serde_json::Value>(&text).ok()?;
    manifest["files"]["embeddings.bin"] = serde_json::json!({
        "bytes": data.len(),
        "xxh3": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(data)),
    });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).ok()?;
    std::fs::write(dir.join("embeddings.bin"), data).ok()
}

/// `embeddings.bin` of a checkpoint, with a manifest whose size and checksum
/// match it, so the reader's parsing (not only the checksum) is exercised.
pub fn checkpoint_embeddings(data: &[u8]) {
    let Some((root, _)) = checkpoint_template() else { return };
    let Ok(version) = sparrow_trainer::checkpoint::resolve(root) else { return };
    let dir = std::env::temp_dir().join(format!("sparrow-fuzz-{}-ckpt", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    for name in ["dense.safetensors", "manifest.json"] {
        if std::fs::copy(version.join(name), dir.join(name)).is_err() {
            return;
        }
    }
    if with_embeddings(&dir, data).is_none() {
        return;
    }
    let _ = sparrow_trainer::checkpoint::load_trainer(&dir, &Overrides::none());
}

/// A serving export of the checkpoint template, written once per process.
fn export_template() -> Option<&'static PathBuf> {
    static TEMPLATE: OnceLock<Option<PathBuf>> = OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let (root, _) = checkpoint_template()?;
            let dir = std::env::temp_dir().join(format!("sparrow-fuzz-{}-export", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            sparrow_trainer::run::export_checkpoint(root, &dir, sparrow_trainer::export::VectorType::F32).ok()?;
            Some(dir)
        })
        .as_ref()
}

/// A copy of the export template in a scratch directory of this process.
fn scratch_export() -> Option<PathBuf> {
    let template = export_template()?;
    let dir = std::env::temp_dir().join(format!("sparrow-fuzz-{}-export-input", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).ok()?;
    for name in ["dense.safetensors", "embeddings.bin", "manifest.json"] {
        std::fs::copy(template.join(name), dir.join(name)).ok()?;
    }
    Some(dir)
}

/// An export's `embeddings.bin` (its manifest's size and checksum made to
/// match, so the parsing is exercised), parsed alone and loaded whole.
pub fn export_embeddings(data: &[u8]) {
    for dim in [1, 2, 8] {
        let _ = sparrow_trainer::export::parse_embeddings(data, dim);
    }
    let Some(dir) = scratch_export() else { return };
    if with_embeddings(&dir, data).is_none() {
        return;
    }
    let _ = sparrow_trainer::export::load_export(&dir, &Overrides::none());
}

/// An export's `manifest.json` (file names, sizes, base, layout, config)
/// over the template's files: read without leaving the directory.
pub fn export_manifest(data: &[u8]) {
    let Some(dir) = scratch_export() else { return };
    if std::fs::write(dir.join("manifest.json"), data).is_err() {
        return;
    }
    let _ = sparrow_trainer::export::is_export(&dir);
    let _ = sparrow_trainer::export::export_chain(&dir);
    let _ = sparrow_trainer::export::load_export(&dir, &Overrides::none());
}

/// A KServe v2 `infer` body: plain JSON, then (the first two bytes a
/// length) as the binary extension's JSON header and tensors.
pub fn kserve_request(data: &[u8]) {
    use sparrow_serve::request::{Body, Limits};
    let limits = Limits { max_rows: 64, max_inputs: 8, max_ids: 256 };
    let decode = |header: Option<&[u8]>, body: &[u8]| {
        if let Ok(body) = Body::new(header, body.to_vec().into()) {
            let _ = body.decode(&limits);
        }
    };
    decode(None, data);
    if let [hi, lo, rest @ ..] = data {
        let header = (usize::from(*hi) << 8 | usize::from(*lo)).to_string();
        decode(Some(header.as_bytes()), rest);
    }
}
