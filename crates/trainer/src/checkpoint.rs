//! Versioned, checksummed checkpoints written atomically.
//!
//! Layout of a checkpoint root:
//! ```text
//! ROOT/LATEST                      name of the newest complete version
//! ROOT/ckpt-000000000123/manifest.json
//!                       /dense.safetensors   dense weights + dense optimizer state
//!                       /embeddings.bin      every embedding row with its optimizer state
//!                       /filters.bin         feature-filter state (only with admit_min_count
//!                                            or ttl_steps): the lookup clock, the admission
//!                                            sketches, each row's last use (embeddings.bin's order)
//! ```
//! A version is written into a temporary directory, fsynced, then renamed into
//! place; `LATEST` is replaced by rename as well. A crash at any point leaves
//! the previous version intact and `LATEST` pointing at a complete one.
//!
//! A cluster version (`sparrow launch`) holds the rows in parts, one per
//! shard, each written by its shard ([`write_part`]: `part-0000.embeddings.bin`
//! and `part-0000.filters.bin`, the same formats), and its manifest lists them
//! under `parts`. An incremental version names the version it adds to
//! (`base`) and its parts hold only the rows used since that version's cut;
//! readers apply the chain from its full version on.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sparrow_core::Config;
use sparrow_core::batch::{DataPosition, StreamMark};
use sparrow_core::config::Rounding;
use sparrow_embedding::{EmbeddingDtype, EmbeddingTable, RowFormat};
use sparrow_model::{DenseModel, DenseOptimizer};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::TrainError;
use crate::trainer::Trainer;

mod read;
pub use read::*;

pub const FORMAT_VERSION: u32 = 1;
const EMB_MAGIC: &[u8; 8] = b"SPRWEMB\x01";
/// Rows whose vectors are stored in f16 or bf16 (`embedding.dtype`): the
/// header's word count is then the packed row's.
const EMB_MAGIC_F16: &[u8; 8] = b"SPRWEMBh";
const EMB_MAGIC_BF16: &[u8; 8] = b"SPRWEMBb";

fn emb_magic(dtype: EmbeddingDtype) -> &'static [u8; 8] {
    match dtype {
        EmbeddingDtype::F32 => EMB_MAGIC,
        EmbeddingDtype::F16 => EMB_MAGIC_F16,
        EmbeddingDtype::Bf16 => EMB_MAGIC_BF16,
    }
}

/// An embeddings file's header: magic (naming the dtype), dim, words per
/// packed row, rows.
fn emb_header(table: &EmbeddingTable, rows: u64) -> Vec<u8> {
    let format = table.row_format();
    let mut header = Vec::with_capacity(EMB_HEADER_BYTES as usize);
    header.extend_from_slice(emb_magic(format.dtype));
    header.extend_from_slice(&(table.dim() as u32).to_le_bytes());
    header.extend_from_slice(&(format.stored_len() as u32).to_le_bytes());
    header.extend_from_slice(&rows.to_le_bytes());
    header
}

/// Appends a row's record: key, then the row packed as the table stores it
/// (exact: the logical row was decoded from those words).
fn push_record(out: &mut Vec<u8>, format: RowFormat, packed: &mut [f32], key: u64, row: &[f32]) {
    out.extend_from_slice(&key.to_le_bytes());
    format.encode(row, packed);
    packed.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
}
const EMB_HEADER_BYTES: u64 = 8 + 4 + 4 + 8;
const DENSE_FILE: &str = "dense.safetensors";
const EMB_FILE: &str = "embeddings.bin";
const FILTERS_MAGIC: &[u8; 8] = b"SPRWFLT\x01";
const FILTERS_FILE: &str = "filters.bin";
pub const MANIFEST_FILE: &str = "manifest.json";
const LATEST_FILE: &str = "LATEST";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileEntry {
    pub bytes: u64,
    /// xxh3-64 of the whole file, hex.
    pub xxh3: String,
}

/// One cluster shard's rows in a version: its files, and the clock the
/// next incremental version starts from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Part {
    /// File names in the version directory.
    pub embeddings: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filters: Option<String>,
    /// Rows in this part's file.
    pub rows: u64,
    /// The shard's clock at the cut: rows used after it have a later last use.
    pub clock: u64,
    /// An incremental part: it holds the rows used after this clock only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<u64>,
    /// `embedding.ttl_secs`: the shard's lookup clock against the records'
    /// time (as the manifest's `event_clock` is `train`'s).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_clock: Vec<(u64, i64)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub model_kind: String,
    pub num_fields: usize,
    pub num_dense: usize,
    pub embedding_dim: usize,
    pub embedding_width: usize,
    /// Floats of a logical row (vector then optimizer state).
    pub row_len: usize,
    /// How the vectors are stored (`embedding.dtype`); older checkpoints: f32.
    #[serde(default)]
    pub embedding_dtype: EmbeddingDtype,
    /// How updated half vectors were rounded (`embedding.rounding`); older
    /// checkpoints: to nearest.
    #[serde(default)]
    pub embedding_rounding: Rounding,
    pub sparse_optimizer: String,
    pub step: u64,
    pub samples_trained: u64,
    pub dense_optimizer_step: u64,
    pub position: DataPosition,
    pub embedding_rows: u64,
    pub files: BTreeMap<String, FileEntry>,
    /// The full config of the run that wrote it (TOML).
    pub config: String,
    pub created_unix_secs: u64,
    /// A cluster version's rows, one part per shard (no `embeddings.bin`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    /// An incremental version: the version directory (a sibling) it adds to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// A cluster version: batches past `position` its workers trained
    /// already (one worker ran ahead of another's batch); a resumed loader
    /// drops them. Empty in `train`'s versions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skip: Vec<TrainedBatch>,
    /// `[data.stream]`: each partition's next offset (and the reader's
    /// turn) after the last trained batch: a resumed run reads on from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamMark>,
    /// `embedding.ttl_secs`: the lookup clock against the records' time
    /// (see `bounds.rs`), so a resumed run deletes rows when the
    /// uninterrupted one would have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_clock: Vec<(u64, i64)>,
    /// `data.validation`: the step last validated and its figures, and under
    /// `[train.early_stopping]` the best figure so far and the evaluations
    /// since it, so a resumed run validates, reports and stops as this one would.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<crate::early_stopping::StoppingState>,
}

/// Where a trained batch starts and ends in the training data.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainedBatch {
    pub start: DataPosition,
    pub end: DataPosition,
    /// `[data.stream]`: the stream's mark after the batch (its records are
    /// `from..offsets` of each partition it read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamMark>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::io(path, e)
}

fn fsync_dir(dir: &Path) -> Result<(), TrainError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// A writer that hashes what passes through it.
struct HashingWriter<W: Write> {
    inner: W,
    hasher: Xxh3,
    bytes: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn hashing_writer(path: &Path) -> Result<HashingWriter<BufWriter<File>>, TrainError> {
    let file = File::create(path).map_err(io(path))?;
    Ok(HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hasher: Xxh3::new(), bytes: 0 })
}

fn finish_synced(mut w: HashingWriter<BufWriter<File>>, path: &Path) -> Result<FileEntry, TrainError> {
    w.flush().map_err(io(path))?;
    let entry = FileEntry { bytes: w.bytes, xxh3: format!("{:016x}", w.hasher.digest()) };
    let file = w.inner.into_inner().map_err(|e| TrainError::io(path, e.into_error()))?;
    file.sync_all().map_err(io(path))?;
    Ok(entry)
}

/// Writes embeddings.bin and, when the table has feature filters,
/// filters.bin (its last-use list follows embeddings.bin's row order).
fn write_embeddings(trainer: &Trainer, dir: &Path) -> Result<Vec<(&'static str, FileEntry)>, TrainError> {
    let path = &dir.join(EMB_FILE);
    let mut w = hashing_writer(path)?;
    let table = &trainer.table;
    // The walk skips expired rows still on the SSD store: delete them first.
    table.sweep_expired()?;
    let rows = table.len() as u64;
    w.write_all(&emb_header(table, rows)).map_err(io(path))?;

    let embedding = &trainer.config.embedding;
    let ages = embedding.deletes_rows();
    let filters_path = &dir.join(FILTERS_FILE);
    let mut filters = if ages || embedding.admit_min_count > 1 { Some(hashing_writer(filters_path)?) } else { None };
    if let Some(f) = &mut filters {
        f.write_all(&filters_head(table)).map_err(io(filters_path))?;
        f.write_all(&(if ages { rows } else { 0 }).to_le_bytes()).map_err(io(filters_path))?;
    }

    let format = table.row_format();
    let mut packed = vec![0.0f32; format.stored_len()];
    let mut record = Vec::with_capacity(8 + packed.len() * 4);
    // The walk reports one error: remember which file it came from.
    let mut filters_failed = false;
    let walked = table.for_each_row(|key, last_use, row| {
        record.clear();
        push_record(&mut record, format, &mut packed, key, row);
        if ages && let Some(f) = &mut filters {
            f.write_all(&last_use.to_le_bytes()).inspect_err(|_| filters_failed = true)?;
        }
        w.write_all(&record)
    });
    walked.map_err(io(if filters_failed { filters_path } else { path }))?;
    let mut entries = vec![(EMB_FILE, finish_synced(w, path)?)];
    if let Some(f) = filters {
        entries.push((FILTERS_FILE, finish_synced(f, filters_path)?));
    }
    Ok(entries)
}

/// filters.bin up to its row count: magic, the table's lookup clock, its
/// admission sketches.
fn filters_head(table: &EmbeddingTable) -> Vec<u8> {
    let state = table.filter_state();
    let sketch_len = state.sketches.first().map_or(0, Vec::len);
    let mut head = Vec::new();
    head.extend_from_slice(FILTERS_MAGIC);
    head.extend_from_slice(&state.tick.to_le_bytes());
    head.extend_from_slice(&(state.sketches.len() as u32).to_le_bytes());
    head.extend_from_slice(&(sketch_len as u32).to_le_bytes());
    for sketch in &state.sketches {
        head.extend_from_slice(sketch);
    }
    head
}

pub(crate) fn write_bytes_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// Writes a new version under `root` and points `LATEST` at it; keeps the
/// newest `keep` versions. Returns the version directory.
pub fn save(trainer: &Trainer, root: &Path, keep: usize) -> Result<PathBuf, TrainError> {
    assert!(!trainer.has_pending_update(), "a checkpoint must hold every trained step's update (flush_update first)");
    std::fs::create_dir_all(root).map_err(io(root))?;
    let tmp = root.join(format!(".tmp-ckpt-{:012}-{}", trainer.step, std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;

    let mut files = BTreeMap::new();
    files.insert(DENSE_FILE.to_string(), write_dense(&trainer.model, &trainer.dense_optimizer, &tmp)?);
    for (name, entry) in write_embeddings(trainer, &tmp)? {
        files.insert(name.to_string(), entry);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        model_kind: trainer.config.model.kind.name().to_string(),
        num_fields: trainer.layout.num_fields,
        num_dense: trainer.layout.num_dense,
        embedding_dim: trainer.config.model.embedding_dim,
        embedding_width: trainer.table.dim(),
        embedding_dtype: trainer.table.row_format().dtype,
        embedding_rounding: trainer.table.rounding(),
        row_len: trainer.table.row_len(),
        sparse_optimizer: trainer.table.optimizer().name().to_string(),
        step: trainer.step,
        samples_trained: trainer.samples_trained,
        dense_optimizer_step: trainer.dense_optimizer.step,
        position: trainer.position,
        embedding_rows: trainer.table.len() as u64,
        files,
        config: stored_config(&trainer.config),
        created_unix_secs: unix_secs(),
        parts: Vec::new(),
        base: None,
        skip: Vec::new(),
        stream: trainer.stream.as_deref().cloned(),
        event_clock: trainer.bounds.as_ref().map(|b| b.saved()).unwrap_or_default(),
        // With a validation set, early stopping or not: the step last
        // validated and its figures are what a resumed run reports.
        early_stopping: trainer.config.data.validation.as_ref().map(|_| trainer.early_stopping.clone()),
    };
    commit(root, &tmp, &manifest, keep)
}

pub fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Dense weights and dense optimizer state, one safetensors file in `dir`.
pub fn write_dense(model: &DenseModel, optimizer: &DenseOptimizer, dir: &Path) -> Result<FileEntry, TrainError> {
    let mut tensors = model.params.to_map();
    tensors.extend(optimizer.state_tensors(&model.params)?);
    let path = dir.join(DENSE_FILE);
    let bytes = safetensors_bytes(&tensors, &path)?;
    write_bytes_synced(&path, &bytes)?;
    Ok(FileEntry { bytes: bytes.len() as u64, xxh3: format!("{:016x}", xxh3_64(&bytes)) })
}

/// Makes the version written into `staging` (a directory under `root`) the
/// newest: its manifest is written and synced, the directory renamed to
/// `ckpt-<step>` (with a suffix if that name is taken: a version is never
/// replaced in place, `LATEST` may name it), and `LATEST` replaced by
/// rename. Then versions beyond the newest `keep` are removed, except those
/// an incremental version still builds on. Returns the version directory.
pub fn commit(root: &Path, staging: &Path, manifest: &Manifest, keep: usize) -> Result<PathBuf, TrainError> {
    let manifest_path = staging.join(MANIFEST_FILE);
    let json =
        serde_json::to_vec_pretty(manifest).map_err(|e| TrainError::checkpoint(&manifest_path, e.to_string()))?;
    write_bytes_synced(&manifest_path, &json)?;
    fsync_dir(staging)?;
    let base = format!("ckpt-{:012}", manifest.step);
    let name = (0..)
        .map(|n| if n == 0 { base.clone() } else { format!("{base}-{n}") })
        .find(|n| !root.join(n).exists())
        .unwrap_or(base);
    let final_dir = root.join(&name);
    std::fs::rename(staging, &final_dir).map_err(io(&final_dir))?;
    let latest_tmp = root.join(format!(".{LATEST_FILE}.tmp-{}", std::process::id()));
    write_bytes_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_tmp, root.join(LATEST_FILE)).map_err(io(root))?;
    fsync_dir(root)?;
    prune(root, &name, keep)?;
    Ok(final_dir)
}

/// xxh3 and size of a file, read in a stream (the committer's check of a part).
pub fn hash_file(path: &Path) -> Result<FileEntry, TrainError> {
    let mut file = BufReader::with_capacity(1 << 20, File::open(path).map_err(io(path))?);
    let (mut hasher, mut bytes, mut buf) = (Xxh3::new(), 0u64, vec![0u8; 1 << 20]);
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileEntry { bytes, xxh3: format!("{:016x}", hasher.digest()) })
}

/// A file written front to back whose header counts are patched in at the
/// end (a part does not know its row count before the walk).
struct PatchedFile {
    path: PathBuf,
    writer: BufWriter<File>,
    bytes: u64,
}

impl PatchedFile {
    fn create(path: PathBuf) -> Result<PatchedFile, TrainError> {
        let file = File::create(&path).map_err(io(&path))?;
        Ok(PatchedFile { path, writer: BufWriter::with_capacity(1 << 20, file), bytes: 0 })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), TrainError> {
        self.writer.write_all(bytes).map_err(io(&self.path))?;
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// Writes `value` at `offset`, syncs; returns the file's size.
    fn finish(self, offset: u64, value: u64) -> Result<u64, TrainError> {
        use std::io::{Seek, SeekFrom};
        let path = self.path;
        let mut file = self.writer.into_inner().map_err(|e| TrainError::io(&path, e.into_error()))?;
        file.seek(SeekFrom::Start(offset)).map_err(io(&path))?;
        file.write_all(&value.to_le_bytes()).map_err(io(&path))?;
        file.sync_all().map_err(io(&path))?;
        Ok(self.bytes)
    }
}

/// Part `index`'s file names (embeddings, filters).
pub fn part_files(index: usize) -> (String, String) {
    (format!("part-{index:04}.embeddings.bin"), format!("part-{index:04}.filters.bin"))
}

/// What a shard wrote for a version: its part and each file's size (the
/// committer checksums them).
#[derive(Clone, Debug)]
pub struct WrittenPart {
    pub part: Part,
    pub files: Vec<(String, u64)>,
}

/// Writes a cluster shard's rows into `dir` as part `index`, in the formats
/// of `embeddings.bin` and `filters.bin`: every row, or (`since`) only the
/// rows used after that clock (an incremental part). Pages of rows stream
/// from the table to the files; no copy of the table is made. The caller
/// keeps every update out while it runs (a consistent cut). Rows past
/// `ttl_steps` are deleted first, as the live table reads them; a reader of
/// an incremental chain deletes them the same way after the last delta.
pub fn write_part(
    table: &EmbeddingTable,
    dir: &Path,
    index: usize,
    since: Option<u64>,
    config: &Config,
) -> Result<WrittenPart, TrainError> {
    table.sweep_expired()?;
    let clock = table.settled_clock();
    let (emb_name, filters_name) = part_files(index);
    let embedding = &config.embedding;
    let ages = embedding.deletes_rows() || config.checkpoint.incremental;
    let mut emb = PatchedFile::create(dir.join(&emb_name))?;
    emb.write(&emb_header(table, 0))?;
    let mut filters = None;
    if ages || embedding.admit_min_count > 1 {
        let mut f = PatchedFile::create(dir.join(&filters_name))?;
        f.write(&filters_head(table))?;
        let count_at = f.bytes;
        f.write(&0u64.to_le_bytes())?;
        filters = Some((f, count_at));
    }
    let (mut rows, mut cursor) = (0u64, Some((0, 0)));
    let (mut page, mut uses) = (Vec::new(), Vec::new());
    let format = table.row_format();
    let mut packed = vec![0.0f32; format.stored_len()];
    while let Some(at) = cursor {
        page.clear();
        uses.clear();
        cursor = table.rows_from(at, 4096, |key, last_use, row| {
            if since.is_some_and(|s| last_use <= s) {
                return;
            }
            push_record(&mut page, format, &mut packed, key, row);
            uses.extend_from_slice(&last_use.to_le_bytes());
            rows += 1;
        })?;
        emb.write(&page)?;
        if let (true, Some((f, _))) = (ages, &mut filters) {
            f.write(&uses)?;
        }
    }
    let mut files = vec![(emb_name.clone(), emb.finish(16, rows)?)];
    let mut part = Part { embeddings: emb_name, filters: None, rows, clock, since, event_clock: Vec::new() };
    if let Some((f, count_at)) = filters {
        files.push((filters_name.clone(), f.finish(count_at, if ages { rows } else { 0 })?));
        part.filters = Some(filters_name);
    }
    fsync_dir(dir)?;
    Ok(WrittenPart { part, files })
}

/// The config as a checkpoint stores it (TOML): a checkpoint is copied and
/// shared, so it holds no secret (the cluster's token is dropped).
pub fn stored_config(config: &Config) -> String {
    let mut c = config.clone();
    c.cluster.auth_token = None;
    c.to_toml()
}

pub(crate) fn safetensors_bytes(
    tensors: &HashMap<String, candle_core::Tensor>,
    path: &Path,
) -> Result<Vec<u8>, TrainError> {
    // candle writes safetensors to a path; write to a scratch file and read it
    // back so the bytes can be checksummed before they land.
    let scratch = path.with_extension("scratch");
    candle_core::safetensors::save(tensors, &scratch).map_err(|e| TrainError::checkpoint(path, e.to_string()))?;
    let bytes = std::fs::read(&scratch).map_err(io(&scratch))?;
    std::fs::remove_file(&scratch).map_err(io(&scratch))?;
    Ok(bytes)
}

/// Removes versions older than the newest `keep` (never `current`, nor a
/// version a kept incremental one builds on) and stale temporaries.
fn prune(root: &Path, current: &str, keep: usize) -> Result<(), TrainError> {
    let mut versions = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with("ckpt-") {
            versions.push(name);
        } else if name.starts_with(".tmp-ckpt-") && !name.ends_with(&format!("-{}", std::process::id())) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    versions.sort();
    let excess = versions.len().saturating_sub(keep.max(1));
    let mut needed: std::collections::HashSet<String> = versions[excess..].iter().cloned().collect();
    needed.insert(current.to_string());
    let mut chain: Vec<String> = needed.iter().cloned().collect();
    while let Some(name) = chain.pop() {
        if let Ok(m) = read_manifest(&root.join(&name))
            && let Some(base) = m.base
            && needed.insert(base.clone())
        {
            chain.push(base);
        }
    }
    for name in versions.into_iter().take(excess) {
        if !needed.contains(&name) {
            remove_version(&root.join(&name))?;
        }
    }
    Ok(())
}

/// Removes a version: the files its manifest names, and the manifest; what
/// the checkpoint did not write (an export put inside it) stays, with its
/// directory. A version whose manifest cannot be read is kept, with a
/// warning: what it wrote is not known.
fn remove_version(dir: &Path) -> Result<(), TrainError> {
    let m = match read_manifest(dir) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("kept the old version {}: {e}", dir.display());
            return Ok(());
        }
    };
    let parts = m.parts.iter().flat_map(|p| std::iter::once(p.embeddings.as_str()).chain(p.filters.as_deref()));
    let names = m.files.keys().map(String::as_str).chain(parts).chain([MANIFEST_FILE]);
    crate::new_dir::remove_written(dir, names)
}
