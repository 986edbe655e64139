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
use sparrow_core::batch::DataPosition;
use sparrow_core::config::Rounding;
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingDtype, EmbeddingTable, RowFormat};
use sparrow_model::{DenseModel, DenseOptimizer};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::TrainError;
use crate::trainer::Trainer;

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
const MANIFEST_FILE: &str = "manifest.json";
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
}

/// Where a trained batch starts and ends in the training data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainedBatch {
    pub start: DataPosition,
    pub end: DataPosition,
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
    let ages = embedding.ttl_steps > 0;
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
    let ages = embedding.ttl_steps > 0 || config.checkpoint.incremental;
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
    let mut part = Part { embeddings: emb_name, filters: None, rows, clock, since };
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
            let p = root.join(&name);
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// The checkpoint version to resume from, if `checkpoint.resume_from` is set.
pub fn resume_dir(config: &Config) -> Result<Option<PathBuf>, TrainError> {
    config.checkpoint.resume_from.as_deref().map(|from| resolve(Path::new(from))).transpose()
}

/// A checkpoint root (with `LATEST`) or one version directory → the version directory.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(name) = crate::confined::read_latest(path)? {
        let dir = path.join(&name);
        if !dir.join(MANIFEST_FILE).is_file() {
            return Err(TrainError::checkpoint(path, format!("LATEST names `{name}`, which has no manifest.json")));
        }
        return Ok(dir);
    }
    if !path.exists() {
        return Err(TrainError::checkpoint(path, "does not exist"));
    }
    Err(TrainError::checkpoint(path, "is not a checkpoint (no manifest.json and no LATEST)"))
}

/// A version's manifest, read within bounds; every file name it gives
/// (files, parts, base) must be a plain name inside the version's
/// directory (its base: beside it).
pub fn read_manifest(dir: &Path) -> Result<Manifest, TrainError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = crate::confined::read_at_most(dir, MANIFEST_FILE, crate::confined::MAX_MANIFEST_BYTES)?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| TrainError::checkpoint(&path, format!("manifest is corrupt or truncated: {e}")))?;
    if m.format_version != FORMAT_VERSION {
        return Err(TrainError::checkpoint(
            &path,
            format!("format version {} is not supported (this build reads {FORMAT_VERSION})", m.format_version),
        ));
    }
    let names = m.files.keys().chain(m.parts.iter().flat_map(|p| std::iter::once(&p.embeddings).chain(&p.filters)));
    for name in names.chain(&m.base) {
        crate::confined::plain_name(dir, name, "the manifest")?;
    }
    Ok(m)
}

/// Checks size and checksum of one file named in the manifest.
fn verify_entry(
    dir: &Path,
    name: &str,
    entry: &FileEntry,
    bytes_on_disk: u64,
    digest: Option<u64>,
) -> Result<(), TrainError> {
    let path = dir.join(name);
    if bytes_on_disk != entry.bytes {
        return Err(TrainError::checkpoint(
            &path,
            format!("truncated or damaged: {bytes_on_disk} bytes on disk, the manifest says {}", entry.bytes),
        ));
    }
    if let Some(d) = digest
        && format!("{d:016x}") != entry.xxh3
    {
        return Err(TrainError::checkpoint(
            &path,
            format!("checksum mismatch (xxh3 {d:016x}, manifest {})", entry.xxh3),
        ));
    }
    Ok(())
}

fn entry<'a>(dir: &Path, m: &'a Manifest, name: &str) -> Result<&'a FileEntry, TrainError> {
    m.files.get(name).ok_or_else(|| TrainError::checkpoint(dir, format!("manifest lists no {name}")))
}

/// Loads a checkpoint version into a fresh `trainer`, whose model must be of
/// the same kind and shape. On error the trainer is partly loaded and must be
/// discarded.
pub fn load_into(trainer: &mut Trainer, dir: &Path) -> Result<Manifest, TrainError> {
    load_into_filtered(trainer, dir, |_| true)
}

/// [`load_into`], keeping only the embedding rows whose key passes `keep`
/// (a cluster shard keeps the keys it owns; every row is still read and
/// verified). A cluster version's parts are read one after another, their
/// filter states merged.
pub fn load_into_filtered(
    trainer: &mut Trainer,
    dir: &Path,
    keep: impl Fn(u64) -> bool,
) -> Result<Manifest, TrainError> {
    load_rows(trainer, dir, &keep, None)
}

/// The rows of cluster shard `index` of `num_shards` (its keys pass `keep`).
/// From a version written by as many shards it reads its own part only,
/// whose filter state (clock, admission counters) is then exactly the
/// shard's at the cut; otherwise as [`load_into_filtered`].
pub fn load_shard_into(
    trainer: &mut Trainer,
    dir: &Path,
    index: usize,
    num_shards: usize,
    keep: impl Fn(u64) -> bool,
) -> Result<Manifest, TrainError> {
    let m = read_manifest(dir)?;
    let own = (m.parts.len() == num_shards).then_some(index);
    load_rows(trainer, dir, &keep, own)
}

/// The dense model, its optimizer state and the run's position, without
/// the rows (a cluster worker's part of a restore).
pub fn load_dense_into(trainer: &mut Trainer, dir: &Path) -> Result<Manifest, TrainError> {
    let m = read_manifest(dir)?;
    check_compatible(trainer, dir, &m)?;
    load_dense(trainer, dir, &m)?;
    trainer.step = m.step;
    trainer.samples_trained = m.samples_trained;
    trainer.position = m.position;
    Ok(m)
}

fn check_compatible(trainer: &Trainer, dir: &Path, m: &Manifest) -> Result<(), TrainError> {
    let want_kind = trainer.config.model.kind.name();
    if m.model_kind != want_kind {
        return Err(TrainError::checkpoint(
            dir,
            format!("holds a `{}` model, the config asks for `{want_kind}`", m.model_kind),
        ));
    }
    let data = (trainer.layout.num_fields, trainer.layout.num_dense);
    if (m.num_fields, m.num_dense) != data {
        return Err(TrainError::DataShape { checkpoint: dir.to_path_buf(), saved: (m.num_fields, m.num_dense), data });
    }
    // The rows' state must mean what this run's optimizer and rounding read
    // it as (with stochastic rounding's count word, two optimizers can have
    // rows of one length: SGD's and row-wise Adagrad's, FTRL's and Adam's).
    let optimizer = trainer.table.optimizer().name();
    if !m.sparse_optimizer.is_empty() && m.sparse_optimizer != optimizer {
        return Err(TrainError::checkpoint(
            dir,
            format!("its rows hold `{}` state, this run's embedding.optimizer is `{optimizer}`", m.sparse_optimizer),
        ));
    }
    if m.embedding_rounding != trainer.table.rounding() {
        return Err(TrainError::checkpoint(
            dir,
            format!(
                "was written with embedding.rounding = \"{}\", this run asks for \"{}\" \
                 (stochastic rounding keeps an update count in every row)",
                m.embedding_rounding.name(),
                trainer.table.rounding().name()
            ),
        ));
    }
    let shape = (m.embedding_dim, m.row_len);
    let ours = (trainer.config.model.embedding_dim, trainer.table.row_len());
    if shape != ours {
        return Err(TrainError::checkpoint(
            dir,
            format!(
                "(embedding_dim, row floats) = {shape:?} differs from this run's {ours:?} \
                 (a different model.embedding_dim or embedding.optimizer)"
            ),
        ));
    }
    Ok(())
}

/// Dense part: verify, then load.
fn load_dense(trainer: &mut Trainer, dir: &Path, m: &Manifest) -> Result<(), TrainError> {
    let dense_path = dir.join(DENSE_FILE);
    let entry = entry(dir, m, DENSE_FILE)?;
    let dense_bytes = crate::confined::read_exact_size(dir, DENSE_FILE, entry.bytes)?;
    verify_entry(dir, DENSE_FILE, entry, dense_bytes.len() as u64, Some(xxh3_64(&dense_bytes)))?;
    let tensors = candle_core::safetensors::load_buffer(&dense_bytes, &candle_core::Device::Cpu)
        .map_err(|e| TrainError::checkpoint(&dense_path, e.to_string()))?;
    trainer.model.params.load_map(&tensors)?;
    trainer.dense_optimizer.load_state(&tensors, m.dense_optimizer_step)?;
    Ok(())
}

fn load_rows(
    trainer: &mut Trainer,
    dir: &Path,
    keep: &dyn Fn(u64) -> bool,
    own_part: Option<usize>,
) -> Result<Manifest, TrainError> {
    let m = read_manifest(dir)?;
    check_compatible(trainer, dir, &m)?;
    load_dense(trainer, dir, &m)?;
    if m.parts.is_empty() {
        // Embedding rows: verify size first, then parse while hashing.
        let emb_path = dir.join(EMB_FILE);
        let emb_entry = entry(dir, &m, EMB_FILE)?;
        let mut filters = match m.files.get(FILTERS_FILE) {
            Some(entry) => Some(FiltersReader::open(dir, FILTERS_FILE, entry, trainer)?),
            None => None,
        };
        let rows = read_embeddings(&emb_path, trainer, emb_entry, filters.as_mut(), keep)?;
        if let Some(f) = filters {
            f.finish(rows)?;
        }
        if rows != m.embedding_rows {
            return Err(TrainError::checkpoint(
                &emb_path,
                format!("{rows} rows, the manifest says {}", m.embedding_rows),
            ));
        }
    } else {
        load_parts(trainer, dir, &m, keep, own_part)?;
    }
    trainer.step = m.step;
    trainer.samples_trained = m.samples_trained;
    trainer.position = m.position;
    Ok(m)
}

/// The versions an incremental version builds on, from its full version to
/// itself.
pub fn chain(dir: &Path, m: &Manifest) -> Result<Vec<(PathBuf, Manifest)>, TrainError> {
    let mut out = vec![(dir.to_path_buf(), m.clone())];
    while let Some(base) = out.last().and_then(|(_, m)| m.base.clone()) {
        let (last_dir, _) = out.last().expect("not empty");
        let base_dir = last_dir.parent().unwrap_or(Path::new(".")).join(&base);
        if !base_dir.join(MANIFEST_FILE).is_file() {
            return Err(TrainError::checkpoint(
                last_dir,
                format!("is incremental on `{base}`, which is missing (removed or never copied)"),
            ));
        }
        if out.len() > 100_000 || out.iter().any(|(d, _)| *d == base_dir) {
            return Err(TrainError::checkpoint(dir, "the chain of incremental versions loops"));
        }
        let base_m = read_manifest(&base_dir)?;
        out.push((base_dir, base_m));
    }
    out.reverse();
    Ok(out)
}

/// A cluster version's rows: each version of its chain in turn (a later
/// row replaces an earlier one), then rows past `ttl_steps` deleted as of
/// the restored clock, as the live table had deleted them.
fn load_parts(
    trainer: &mut Trainer,
    dir: &Path,
    m: &Manifest,
    keep: &dyn Fn(u64) -> bool,
    own_part: Option<usize>,
) -> Result<(), TrainError> {
    for (version, vm) in chain(dir, m)? {
        if vm.parts.len() != m.parts.len() {
            return Err(TrainError::checkpoint(
                &version,
                format!("has {} parts, the version built on it {}", vm.parts.len(), m.parts.len()),
            ));
        }
        let parts: Vec<&Part> = match own_part {
            Some(i) => vm.parts.get(i).into_iter().collect(),
            None => vm.parts.iter().collect(),
        };
        for part in parts {
            let mut filters = match &part.filters {
                Some(name) => Some(FiltersReader::open(&version, name, entry(&version, &vm, name)?, trainer)?),
                None => None,
            };
            let emb_path = version.join(&part.embeddings);
            let emb_entry = entry(&version, &vm, &part.embeddings)?;
            let rows = read_embeddings(&emb_path, trainer, emb_entry, filters.as_mut(), keep)?;
            if let Some(f) = filters {
                f.finish(rows)?;
            }
            if rows != part.rows {
                return Err(TrainError::checkpoint(&emb_path, format!("{rows} rows, the manifest says {}", part.rows)));
            }
        }
    }
    trainer.table.sweep_expired()?;
    Ok(())
}

/// filters.bin, read beside embeddings.bin: its header is checked and its
/// filter state given to the table at open; the last uses follow row by row.
struct FiltersReader {
    path: PathBuf,
    name: String,
    entry: FileEntry,
    reader: BufReader<File>,
    hasher: Xxh3,
    /// Rows with a last use listed (0, or embeddings.bin's row count).
    age_rows: u64,
}

impl FiltersReader {
    fn open(dir: &Path, name: &str, entry: &FileEntry, trainer: &Trainer) -> Result<FiltersReader, TrainError> {
        let (file, on_disk, path) = crate::confined::open_regular(dir, name)?;
        verify_entry(dir, name, entry, on_disk, None)?;
        let mut r = FiltersReader {
            path,
            name: name.to_string(),
            entry: entry.clone(),
            reader: BufReader::with_capacity(1 << 20, file),
            hasher: Xxh3::new(),
            age_rows: 0,
        };
        let head = r.read_bytes(8 + 8 + 4 + 4, "header")?;
        if &head[..8] != FILTERS_MAGIC {
            return Err(TrainError::checkpoint(&r.path, "not a Sparrow filters file (bad magic)"));
        }
        let tick = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(head[16..20].try_into().expect("4 bytes")) as u64;
        let len = u32::from_le_bytes(head[20..24].try_into().expect("4 bytes")) as u64;
        // Sizes from the file: checked arithmetic (a crafted count cannot wrap them).
        let sketch_bytes = (count * len).checked_add(24 + 8);
        if (count > 0 && !len.is_power_of_two()) || sketch_bytes.is_none_or(|b| b > entry.bytes) {
            return Err(TrainError::checkpoint(&r.path, format!("{count} sketches of {len} counters do not fit")));
        }
        let mut sketches = Vec::with_capacity(count as usize);
        for _ in 0..count {
            sketches.push(r.read_bytes(len as usize, "sketches")?);
        }
        r.age_rows = u64::from_le_bytes(r.read_bytes(8, "row count")?.try_into().expect("8 bytes"));
        let total = r.age_rows.checked_mul(8).and_then(|b| b.checked_add(24 + count * len + 8));
        if total != Some(entry.bytes) {
            return Err(TrainError::checkpoint(&r.path, "row count in the header does not match the file size"));
        }
        trainer.table.restore_filter_state(&sparrow_embedding::FilterState { tick, sketches });
        Ok(r)
    }

    fn read_bytes(&mut self, n: usize, what: &str) -> Result<Vec<u8>, TrainError> {
        let mut buf = vec![0u8; n];
        self.reader
            .read_exact(&mut buf)
            .map_err(|_| TrainError::checkpoint(&self.path, format!("truncated {what}")))?;
        self.hasher.update(&buf);
        Ok(buf)
    }

    /// The next row's last use, if the file lists them.
    fn next_last_use(&mut self) -> Result<Option<u64>, TrainError> {
        if self.age_rows == 0 {
            return Ok(None);
        }
        let bytes = self.read_bytes(8, "last uses")?;
        Ok(Some(u64::from_le_bytes(bytes.try_into().expect("8 bytes"))))
    }

    /// Checks the row count against embeddings.bin's and the checksum.
    fn finish(self, rows: u64) -> Result<(), TrainError> {
        if self.age_rows != 0 && self.age_rows != rows {
            return Err(TrainError::checkpoint(
                &self.path,
                format!("lists {} last uses for {rows} rows", self.age_rows),
            ));
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        verify_entry(dir, &self.name, &self.entry, self.entry.bytes, Some(self.hasher.digest()))
    }
}

fn read_embeddings(
    path: &Path,
    trainer: &Trainer,
    entry: &FileEntry,
    mut filters: Option<&mut FiltersReader>,
    keep: &dyn Fn(u64) -> bool,
) -> Result<u64, TrainError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let dir = path.parent().unwrap_or(Path::new("."));
    let (file, on_disk, _) = crate::confined::open_regular(dir, &name)?;
    verify_entry(dir, &name, entry, on_disk, None)?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut hasher = Xxh3::new();
    let mut header = [0u8; EMB_HEADER_BYTES as usize];
    r.read_exact(&mut header).map_err(|_| TrainError::checkpoint(path, "truncated header"))?;
    hasher.update(&header);
    let Some(dtype) = [EmbeddingDtype::F32, EmbeddingDtype::F16, EmbeddingDtype::Bf16]
        .into_iter()
        .find(|&d| &header[..8] == emb_magic(d))
    else {
        return Err(TrainError::checkpoint(path, "not a Sparrow embeddings file (bad magic)"));
    };
    let u32_at = |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]) as usize;
    let (dim, words) = (u32_at(8), u32_at(12));
    let rows = u64::from_le_bytes(header[16..24].try_into().map_err(|_| TrainError::checkpoint(path, "header"))?);
    // The file's rows decode to f32 and the table stores them in its own
    // dtype: resuming with another `embedding.dtype` converts (f32 → half rounds).
    let ours = trainer.table.row_format();
    let file = RowFormat { dtype, ..ours };
    if dim != ours.dim || words != file.stored_len() {
        return Err(TrainError::checkpoint(
            path,
            format!(
                "rows are {dim} wide with {words} {} words, the table needs {} and {}",
                dtype.name(),
                ours.dim,
                file.stored_len()
            ),
        ));
    }
    let record_len = 8 + words * 4;
    // Checked: a crafted row count must not wrap the size it implies.
    if rows.checked_mul(record_len as u64).and_then(|b| b.checked_add(EMB_HEADER_BYTES)) != Some(entry.bytes) {
        return Err(TrainError::checkpoint(path, "row count in the header does not match the file size"));
    }
    let mut record = vec![0u8; record_len];
    let mut packed = vec![0f32; words];
    let mut row = vec![0f32; file.logical_len()];
    // Rows go straight into the table; a checksum failure at the end fails the
    // load, and the caller discards the half-filled trainer (loads happen
    // before any training, so nothing trained is lost).
    for _ in 0..rows {
        r.read_exact(&mut record).map_err(|_| TrainError::checkpoint(path, "truncated rows"))?;
        hasher.update(&record);
        let last_use = match filters.as_deref_mut() {
            Some(f) => f.next_last_use()?,
            None => None,
        };
        let key = u64::from_le_bytes(record[..8].try_into().map_err(|_| TrainError::checkpoint(path, "record"))?);
        if !keep(key) {
            continue;
        }
        for (x, b) in packed.iter_mut().zip(record[8..].chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        file.decode(&packed, &mut row);
        match last_use {
            Some(last_use) => trainer.table.put_row_used(key, &row, last_use)?,
            None => trainer.table.put_row(key, &row)?,
        }
    }
    let digest = hasher.digest();
    verify_entry(dir, &name, entry, entry.bytes, Some(digest))?;
    Ok(rows)
}

/// Rebuilds a trainer (config, layout, model and table) from a checkpoint.
/// `overrides` (`KEY=VALUE`) apply to the stored config, e.g. another data format.
pub fn load_trainer(path: &Path, overrides: &[String]) -> Result<(Trainer, Manifest, PathBuf), TrainError> {
    let dir = resolve(path)?;
    let m = read_manifest(&dir)?;
    let config =
        Config::from_toml_with_overrides(&m.config, &dir.join(MANIFEST_FILE).display().to_string(), overrides)?;
    let layout = DataLayout {
        num_fields: m.num_fields,
        num_dense: m.num_dense,
        weighted: DataLayout::from_config(&config.data).weighted,
    };
    let mut trainer = Trainer::new(&config, layout)?;
    let m = load_into(&mut trainer, &dir)?;
    Ok((trainer, m, dir))
}
