//! Serving exports (S4.6): what a model server needs and nothing else — the
//! dense weights (safetensors), the embedding vectors without optimizer
//! state, the job's config (secrets dropped) and a manifest with checksums.
//!
//! ```text
//! EXPORT/manifest.json      format, step, dim, rows, layout, config, files {name: bytes, xxh3}
//! EXPORT/dense.safetensors  every dense parameter by name
//! EXPORT/embeddings.bin     "SPRWEMB1", dim u32, rows u64, then per row: key u64, dim × f32 (LE)
//!                           ("SPRWEH16" and dim × f16 for an export written with `--dtype f16`,
//!                           "SPRWEB16" and dim × bf16 for `--dtype bf16`)
//! ```
//!
//! `sparrow predict --model EXPORT` reads one ([`load_export`]); lazy
//! aggregation writes one per backup under `checkpoint.dir/exports/`.

use sparrow_core::Overrides;
use std::collections::BTreeMap;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sparrow_core::Config;
use sparrow_data::DataLayout;
use sparrow_model::DenseModel;
use xxhash_rust::xxh3::Xxh3;

use crate::TrainError;
use crate::checkpoint::{FileEntry, safetensors_bytes, stored_config, write_bytes_synced};
use crate::inference::Model;
use crate::trainer::Trainer;

pub const EXPORT_FORMAT: &str = "sparrow-export-v1";

/// A page of rows for an export: keys and their vectors (`dim` each); `None`: no more.
pub type RowPage = Option<(Vec<u64>, Vec<f32>)>;
const EMBEDDINGS_MAGIC: &[u8; 8] = b"SPRWEMB1";
const EMBEDDINGS_MAGIC_F16: &[u8; 8] = b"SPRWEH16";
const EMBEDDINGS_MAGIC_BF16: &[u8; 8] = b"SPRWEB16";

/// The type an export stores its vectors in (the dense weights stay f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VectorType {
    F32,
    /// IEEE half precision, rounded to nearest: half the bytes, about three
    /// significant digits.
    F16,
    /// bfloat16, rounded to nearest even: half the bytes, f32's range,
    /// about two significant digits. A table trained with
    /// `embedding.dtype = "bf16"` exports in it without loss.
    Bf16,
}

impl VectorType {
    pub fn parse(name: &str) -> Option<VectorType> {
        match name {
            "f32" => Some(VectorType::F32),
            "f16" => Some(VectorType::F16),
            "bf16" => Some(VectorType::Bf16),
            _ => None,
        }
    }

    /// The type that holds a table's rows (`embedding.dtype`) without loss
    /// in the fewest bytes.
    pub fn of_rows(dtype: sparrow_core::config::EmbeddingDtype) -> VectorType {
        use sparrow_core::config::EmbeddingDtype;
        match dtype {
            EmbeddingDtype::F32 => VectorType::F32,
            EmbeddingDtype::F16 => VectorType::F16,
            EmbeddingDtype::Bf16 => VectorType::Bf16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            VectorType::F32 => "f32",
            VectorType::F16 => "f16",
            VectorType::Bf16 => "bf16",
        }
    }

    fn magic(self) -> &'static [u8; 8] {
        match self {
            VectorType::F32 => EMBEDDINGS_MAGIC,
            VectorType::F16 => EMBEDDINGS_MAGIC_F16,
            VectorType::Bf16 => EMBEDDINGS_MAGIC_BF16,
        }
    }

    fn width(self) -> usize {
        match self {
            VectorType::F32 => 4,
            VectorType::F16 | VectorType::Bf16 => 2,
        }
    }
}

fn f32_type() -> String {
    "f32".into()
}
const DENSE: &str = "dense.safetensors";
const EMBEDDINGS: &str = "embeddings.bin";
const MANIFEST: &str = "manifest.json";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExportManifest {
    pub format: String,
    /// The job's step (in rounds and lazy aggregation: the aggregation's number).
    pub step: u64,
    pub dim: usize,
    pub rows: u64,
    pub num_fields: usize,
    pub num_dense: usize,
    pub config: String,
    pub files: BTreeMap<String, FileEntry>,
    /// The vectors' type (`f32` in exports written before it was recorded).
    #[serde(default = "f32_type")]
    pub dtype: String,
    /// An incremental export: the export (a sibling directory) whose model
    /// this one updates; `embeddings.bin` then holds only the rows updated
    /// since that one was taken. None: a full export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// When the model was taken (Unix milliseconds): staleness is measured from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_unix_ms: Option<u64>,
    /// `[data.stream]`: where the stream stood when the model was taken
    /// (each partition's next offset): the export has trained on every
    /// record before them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<sparrow_core::batch::StreamMark>,
}

/// What sets one export apart from another of the same model.
#[derive(Clone, Debug, Default)]
pub struct ExportMeta {
    pub dtype: Option<VectorType>,
    pub base: Option<String>,
    pub taken_unix_ms: Option<u64>,
    pub stream: Option<sparrow_core::batch::StreamMark>,
}

/// Writes an export into `dir` (created; must not exist yet): `rows` gives
/// (key, vector) pages.
pub fn write_export(
    dir: &Path,
    config: &Config,
    layout: &DataLayout,
    step: u64,
    model: &DenseModel,
    rows: impl FnMut() -> Result<RowPage, TrainError>,
) -> Result<ExportManifest, TrainError> {
    write_export_as(dir, config, layout, step, model, VectorType::F32, rows)
}

/// [`write_export`] with the vectors stored as `dtype`.
pub fn write_export_as(
    dir: &Path,
    config: &Config,
    layout: &DataLayout,
    step: u64,
    model: &DenseModel,
    dtype: VectorType,
    rows: impl FnMut() -> Result<RowPage, TrainError>,
) -> Result<ExportManifest, TrainError> {
    let meta = ExportMeta { dtype: Some(dtype), ..Default::default() };
    write_export_with(dir, config, layout, step, model, &meta, rows)
}

/// [`write_export`] as `meta` says (vector type, base of an incremental export).
pub fn write_export_with(
    dir: &Path,
    config: &Config,
    layout: &DataLayout,
    step: u64,
    model: &DenseModel,
    meta: &ExportMeta,
    rows: impl FnMut() -> Result<RowPage, TrainError>,
) -> Result<ExportManifest, TrainError> {
    let new = crate::new_dir::NewDir::create(dir, "--out")?;
    let manifest = write_export_files(new.staging(), config, layout, step, model, meta, rows)?;
    new.commit()?;
    Ok(manifest)
}

/// An export's files into `staging`, an empty directory (the caller puts
/// it in place).
pub fn write_export_files(
    staging: &Path,
    config: &Config,
    layout: &DataLayout,
    step: u64,
    model: &DenseModel,
    meta: &ExportMeta,
    rows: impl FnMut() -> Result<RowPage, TrainError>,
) -> Result<ExportManifest, TrainError> {
    let dtype = meta.dtype.unwrap_or(VectorType::F32);
    // A row's width: the vector each key has (LR: 1, FM and the wide kinds: 1 + dim).
    let dim = model.width();
    let (entry, count) = write_embeddings(&staging.join(EMBEDDINGS), dtype, dim, rows)?;
    write_export_manifest(staging, config, layout, step, model, meta, vec![(EMBEDDINGS.to_string(), entry)], count)
}

/// The name of shard `index`'s rows in a cluster's export (one file per
/// shard, each in the format of `embeddings.bin`).
pub fn part_name(index: usize) -> String {
    format!("embeddings-{index:04}.bin")
}

/// Whether a file an export lists holds rows: `embeddings.bin`, or a
/// shard's part ([`part_name`]).
fn holds_rows(name: &str) -> bool {
    name == EMBEDDINGS
        || name
            .strip_prefix("embeddings-")
            .and_then(|n| n.strip_suffix(".bin"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Streams (key, vector) pages into an embeddings file at `path` (created,
/// synced), `dim` values a key stored as `dtype`. Returns its entry and the
/// rows written.
pub fn write_embeddings(
    path: &Path,
    dtype: VectorType,
    dim: usize,
    mut rows: impl FnMut() -> Result<RowPage, TrainError>,
) -> Result<(FileEntry, u64), TrainError> {
    let io = |e: std::io::Error| TrainError::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    // The count goes into the header at the end.
    let mut header = dtype.magic().to_vec();
    header.extend_from_slice(&(dim as u32).to_le_bytes());
    header.extend_from_slice(&0u64.to_le_bytes());
    w.write_all(&header).map_err(io)?;
    let mut count = 0u64;
    while let Some((keys, vectors)) = rows()? {
        if vectors.len() != keys.len() * dim {
            return Err(TrainError::checkpoint(path, format!("{} keys with {} values", keys.len(), vectors.len())));
        }
        for (key, v) in keys.iter().zip(vectors.chunks_exact(dim.max(1))) {
            w.write_all(&key.to_le_bytes()).map_err(io)?;
            for &x in v {
                match dtype {
                    VectorType::F32 => w.write_all(&x.to_le_bytes()),
                    VectorType::F16 => w.write_all(&half::f16::from_f32(x).to_le_bytes()),
                    VectorType::Bf16 => w.write_all(&half::bf16::from_f32(x).to_le_bytes()),
                }
                .map_err(io)?;
            }
        }
        count += keys.len() as u64;
    }
    let mut file = w.into_inner().map_err(|e| TrainError::io(path, e.into_error()))?;
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(12)).map_err(io)?;
    file.write_all(&count.to_le_bytes()).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    Ok((hash_file(path)?, count))
}

/// The rest of an export whose rows are written (`parts`: the row files in
/// `staging` and their entries, `rows` in all): the dense weights and the
/// manifest.
#[allow(clippy::too_many_arguments)]
pub fn write_export_manifest(
    staging: &Path,
    config: &Config,
    layout: &DataLayout,
    step: u64,
    model: &DenseModel,
    meta: &ExportMeta,
    parts: Vec<(String, FileEntry)>,
    rows: u64,
) -> Result<ExportManifest, TrainError> {
    let dense_path = staging.join(DENSE);
    let bytes = safetensors_bytes(&model.params.to_map(), &dense_path)?;
    write_bytes_synced(&dense_path, &bytes)?;
    let mut files: BTreeMap<String, FileEntry> = parts.into_iter().collect();
    files.insert(
        DENSE.to_string(),
        FileEntry { bytes: bytes.len() as u64, xxh3: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)) },
    );
    let manifest = ExportManifest {
        format: EXPORT_FORMAT.into(),
        step,
        dim: model.width(),
        rows,
        num_fields: layout.num_fields,
        num_dense: layout.num_dense,
        config: stored_config(config),
        files,
        dtype: meta.dtype.unwrap_or(VectorType::F32).name().into(),
        base: meta.base.clone(),
        taken_unix_ms: meta.taken_unix_ms,
        stream: meta.stream.clone(),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| TrainError::checkpoint(staging, e.to_string()))?;
    write_bytes_synced(&staging.join(MANIFEST), &json)?;
    Ok(manifest)
}

fn hash_file(path: &Path) -> Result<FileEntry, TrainError> {
    let mut f = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let (mut hasher, mut buf, mut bytes) = (Xxh3::new(), vec![0u8; 1 << 20], 0u64);
    loop {
        let n = f.read(&mut buf).map_err(|e| TrainError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileEntry { bytes, xxh3: format!("{:016x}", hasher.digest()) })
}

/// `dir` itself, or the export its `LATEST` file names (a plain name of a
/// directory beside it: see [`crate::confined`]).
pub fn resolve_export(dir: &Path) -> Result<PathBuf, TrainError> {
    if dir.join(MANIFEST).is_file() {
        return Ok(dir.to_path_buf());
    }
    match crate::confined::read_latest(dir)? {
        Some(name) => Ok(dir.join(name)),
        None => Err(TrainError::checkpoint(dir, "not a serving export (no manifest.json, no LATEST)")),
    }
}

/// Whether `path` is a serving export (or a directory whose LATEST names one)
/// rather than a checkpoint.
pub fn is_export(path: &Path) -> bool {
    // A checkpoint has a manifest.json (and an embeddings.bin) too: the
    // manifest's `format` tells them apart.
    let Ok(dir) = resolve_export(path) else { return false };
    crate::confined::read_at_most(&dir, MANIFEST, crate::confined::MAX_MANIFEST_BYTES)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .is_some_and(|m| m.get("format").and_then(serde_json::Value::as_str) == Some(EXPORT_FORMAT))
}

/// An export read from disk and verified (sizes and checksums), ready to
/// be applied to a model: its dense weights and its rows.
pub struct ExportData {
    pub dir: PathBuf,
    pub manifest: ExportManifest,
    tensors: std::collections::HashMap<String, candle_core::Tensor>,
    keys: Vec<u64>,
    /// `dim` values per key.
    vectors: Vec<f32>,
}

impl ExportData {
    /// Reads the export in `dir` (not LATEST: the directory itself). Every
    /// file the manifest lists is read whole within its stated size and its
    /// checksum checked before any of it is used; sizes in the files are
    /// checked arithmetic (a crafted row count cannot wrap them).
    pub fn read(dir: &Path) -> Result<ExportData, TrainError> {
        let manifest = read_manifest(dir)?;
        let mut contents = std::collections::HashMap::new();
        for (name, entry) in &manifest.files {
            crate::confined::plain_name(dir, name, "the manifest")?;
            let bytes = crate::confined::read_exact_size(dir, name, entry.bytes)?;
            let xxh3 = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
            if xxh3 != entry.xxh3 {
                return Err(TrainError::checkpoint(
                    &dir.join(name),
                    format!("checksum mismatch (xxh3 {xxh3}, the manifest says {})", entry.xxh3),
                ));
            }
            contents.insert(name.as_str(), bytes);
        }
        let mut listed = |name: &str| {
            contents.remove(name).ok_or_else(|| {
                TrainError::checkpoint(&dir.join(MANIFEST), format!("lists no {name}: not a whole export"))
            })
        };
        let dense = listed(DENSE)?;
        let dense_path = dir.join(DENSE);
        let tensors = candle_core::safetensors::load_buffer(&dense, &candle_core::Device::Cpu)
            .map_err(|e| TrainError::checkpoint(&dense_path, e.to_string()))?;
        // `embeddings.bin`, or a cluster's parts (one a shard), in name order.
        let mut parts: Vec<_> = contents.into_iter().filter(|(name, _)| holds_rows(name)).collect();
        parts.sort_by(|a, b| a.0.cmp(b.0));
        if parts.is_empty() {
            return Err(TrainError::checkpoint(
                &dir.join(MANIFEST),
                format!("lists no {EMBEDDINGS} (nor a shard's part): not a whole export"),
            ));
        }
        let (mut keys, mut vectors) = (Vec::new(), Vec::new());
        for (name, data) in parts {
            let (k, v) =
                parse_embeddings(&data, manifest.dim).map_err(|what| TrainError::checkpoint(&dir.join(name), what))?;
            keys.extend(k);
            vectors.extend(v);
        }
        if keys.len() as u64 != manifest.rows {
            return Err(TrainError::checkpoint(
                &dir.join(EMBEDDINGS),
                format!("{} rows, the manifest says {}", keys.len(), manifest.rows),
            ));
        }
        Ok(ExportData { dir: dir.to_path_buf(), manifest, tensors, keys, vectors })
    }

    /// Rows this export holds (for an incremental one: the rows it updates).
    pub fn rows(&self) -> usize {
        self.keys.len()
    }

    /// Puts the dense weights and the rows into `trainer`'s model (rows
    /// with fresh optimizer state).
    pub fn apply(&self, model: &Model) -> Result<(), TrainError> {
        let dim = model.table.dim();
        let emb_path = self.dir.join(EMBEDDINGS);
        if dim != self.manifest.dim {
            return Err(TrainError::checkpoint(
                &emb_path,
                format!("dim {} does not match the model's {dim}", self.manifest.dim),
            ));
        }
        model.network.params.load_map(&self.tensors)?;
        let mut row = vec![0f32; model.table.row_len()];
        for (key, vector) in self.keys.iter().zip(self.vectors.chunks_exact(dim.max(1))) {
            row[..dim].copy_from_slice(vector);
            model.table.put_row(*key, &row).map_err(|e| TrainError::checkpoint(&emb_path, e.to_string()))?;
        }
        Ok(())
    }
}

/// An export's `embeddings.bin`: its keys and `dim` values a key. Every
/// size is checked against the file's length with checked arithmetic.
pub fn parse_embeddings(data: &[u8], dim: usize) -> Result<(Vec<u64>, Vec<f32>), String> {
    let dtype = match data.get(..8) {
        Some(magic) if magic == EMBEDDINGS_MAGIC => VectorType::F32,
        Some(magic) if magic == EMBEDDINGS_MAGIC_F16 => VectorType::F16,
        Some(magic) if magic == EMBEDDINGS_MAGIC_BF16 => VectorType::Bf16,
        _ => return Err("not an export's embeddings file".into()),
    };
    let (Some(dim_bytes), Some(rows_bytes)) = (data.get(8..12), data.get(12..20)) else {
        return Err("not an export's embeddings file (truncated header)".into());
    };
    let width = dtype.width();
    let file_dim = u32::from_le_bytes(dim_bytes.try_into().unwrap_or_default()) as usize;
    let rows = u64::from_le_bytes(rows_bytes.try_into().unwrap_or_default());
    let record = (width as u64).checked_mul(file_dim as u64).and_then(|v| v.checked_add(8));
    let expected = record.and_then(|r| r.checked_mul(rows)).and_then(|b| b.checked_add(20));
    if file_dim != dim || expected != Some(data.len() as u64) {
        return Err(format!(
            "dim {file_dim} and {rows} rows do not match the file ({} bytes) or the manifest (dim {dim})",
            data.len()
        ));
    }
    // Bounded by the file's length, checked just above.
    let rows = rows as usize;
    let (mut keys, mut vectors) = (Vec::with_capacity(rows), Vec::with_capacity(rows * dim));
    for chunk in data[20..].chunks_exact(8 + width * dim) {
        keys.push(u64::from_le_bytes(chunk[..8].try_into().unwrap_or_default()));
        vectors.extend(chunk[8..].chunks_exact(width).map(|b| match dtype {
            VectorType::F32 => f32::from_le_bytes(b.try_into().unwrap_or_default()),
            VectorType::F16 => half::f16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32(),
            VectorType::Bf16 => half::bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32(),
        }));
    }
    Ok((keys, vectors))
}

fn read_manifest(dir: &Path) -> Result<ExportManifest, TrainError> {
    let manifest_path = dir.join(MANIFEST);
    let bytes = crate::confined::read_at_most(dir, MANIFEST, crate::confined::MAX_MANIFEST_BYTES)?;
    let m: ExportManifest = serde_json::from_slice(&bytes)
        .map_err(|e| TrainError::checkpoint(&manifest_path, format!("manifest is corrupt or truncated: {e}")))?;
    if m.format != EXPORT_FORMAT {
        return Err(TrainError::checkpoint(&manifest_path, format!("format {}, expected {EXPORT_FORMAT}", m.format)));
    }
    if let Some(base) = &m.base {
        crate::confined::plain_name(dir, base, "the manifest's `base`")?;
    }
    Ok(m)
}

/// The directories of the exports that make up `dir`'s model, oldest (a
/// full export) first: `dir` itself for a full export, else its `base`
/// chain. Only manifests are read.
pub fn export_chain(dir: &Path) -> Result<Vec<(PathBuf, ExportManifest)>, TrainError> {
    let mut chain = vec![(dir.to_path_buf(), read_manifest(dir)?)];
    while let Some(base) = chain.last().and_then(|(_, m)| m.base.clone()) {
        let (newest, _) = &chain[chain.len() - 1];
        let base_dir = newest.parent().map_or_else(|| PathBuf::from(&base), |p| p.join(&base));
        if !base_dir.join(MANIFEST).is_file() {
            return Err(TrainError::checkpoint(
                newest,
                format!(
                    "is an incremental export of `{base}`, which is gone ({} has no manifest.json)",
                    base_dir.display()
                ),
            ));
        }
        if chain.len() > 1 << 16 || chain.iter().any(|(d, _)| *d == base_dir) {
            return Err(TrainError::checkpoint(newest, "the chain of incremental exports does not end"));
        }
        let m = read_manifest(&base_dir)?;
        chain.push((base_dir, m));
    }
    chain.reverse();
    Ok(chain)
}

/// A fresh in-memory model for an export (no rows, initial weights).
pub fn empty_model(m: &ExportManifest, source: &Path, overrides: &Overrides) -> Result<Model, TrainError> {
    let config = Config::from_stored_toml(&m.config, &source.display().to_string(), overrides)?;
    let layout = DataLayout {
        num_fields: m.num_fields,
        num_dense: m.num_dense,
        weighted: DataLayout::from_config(&config.data).weighted,
        num_tasks: DataLayout::from_config(&config.data).num_tasks,
    };
    Model::initial(&config, layout)
}

/// An export's model,
/// every file's size and checksum verified first; an incremental export is
/// its full base with each later export's rows applied in order.
pub fn load_export(dir: &Path, overrides: &Overrides) -> Result<(Model, ExportManifest), TrainError> {
    let dir = resolve_export(dir)?;
    let chain = export_chain(&dir)?;
    let (_, newest) = &chain[chain.len() - 1];
    let model = empty_model(newest, &dir.join(MANIFEST), overrides)?;
    for (part, _) in &chain {
        ExportData::read(part)?.apply(&model)?;
    }
    Ok((model, newest.clone()))
}

/// Pages of (key, vector) from `table` for [`write_export`], the rows that
/// `keep(key, last_use, row)` accepts.
pub fn row_pages<'a>(
    table: &'a sparrow_embedding::EmbeddingTable,
    mut keep: impl FnMut(u64, u64, &[f32]) -> bool + 'a,
) -> impl FnMut() -> Result<RowPage, TrainError> + 'a {
    let dim = table.dim();
    let mut cursor = Some((0usize, 0usize));
    move || {
        let Some(at) = cursor else { return Ok(None) };
        let (mut keys, mut vectors) = (Vec::new(), Vec::new());
        cursor = table.rows_from(at, 4096, |key, last_use, row| {
            if keep(key, last_use, row) {
                keys.push(key);
                vectors.extend_from_slice(&row[..dim]);
            }
        })?;
        Ok(Some((keys, vectors)))
    }
}

enum Written {
    Done(PathBuf),
    NeedsFull,
}

/// `checkpoint.export_every_steps`: serving exports written while training
/// goes on, into `checkpoint.dir/exports/NNNNNNNNNNNN` (the step), each
/// holding only the rows updated since the previous one; the first of a
/// run, every `checkpoint.full_every`-th, and all of them with
/// rows deleted while training (`ttl_steps`, `ttl_secs`, `max_rows`: a
/// delta cannot delete a row) are full.
/// `exports/LATEST` names the newest. When a full export lands, the exports
/// older than the full one before it are removed (a reader still applying
/// the previous chain finds it whole).
pub struct IncrementalExports {
    root: PathBuf,
    full_every: u64,
    /// Every export is full (rows expire).
    always_full: bool,
    /// The newest export of this run: its name and the table's clock when taken.
    previous: Option<(String, u64)>,
    since_full: u64,
    last_full: Option<String>,
    /// The step of the newest export written.
    pub last_step: Option<u64>,
    /// Rows are told changed by their content instead of the table's clocks
    /// (exports of checkpoints loaded one by one, whose clocks are not
    /// comparable): each key's vector digest as last exported.
    digests: Option<std::collections::HashMap<u64, u128>>,
}

impl IncrementalExports {
    /// None unless the config asks for exports.
    pub fn new(config: &Config) -> Option<IncrementalExports> {
        let timed = config.checkpoint.export_every_secs.is_some_and(|s| s > 0);
        if !timed {
            config.checkpoint.export_every_steps.filter(|&n| n > 0)?;
        }
        let dir = config.checkpoint.dir.as_ref()?;
        Some(IncrementalExports {
            root: Path::new(dir).join("exports"),
            full_every: config.checkpoint.full_every.max(1),
            always_full: config.embedding.deletes_rows(),
            previous: None,
            since_full: 0,
            last_full: None,
            last_step: None,
            digests: None,
        })
    }

    /// Tells the rows a delta holds by their content: a row is in it when
    /// its vector differs from the one last exported (xxh3-128 digests, 16
    /// bytes a row kept here) or it is new; when a row is gone (expired),
    /// the export is full. For successive trainers loaded from
    /// checkpoints, whose tables' clocks cannot be compared.
    pub fn by_content(mut self) -> IncrementalExports {
        self.digests = Some(std::collections::HashMap::new());
        self.always_full = false;
        self
    }

    /// Writes the trainer's model now (its pending update applied by the caller).
    pub fn write(&mut self, trainer: &Trainer) -> Result<PathBuf, TrainError> {
        let full = self.previous.is_none() || self.always_full || self.since_full + 1 >= self.full_every;
        match self.write_as(trainer, full)? {
            Written::Done(dir) => Ok(dir),
            // By content, a row was gone: only a full export drops it.
            Written::NeedsFull => match self.write_as(trainer, true)? {
                Written::Done(dir) => Ok(dir),
                Written::NeedsFull => Err(TrainError::checkpoint(&self.root, "a full export was refused")),
            },
        }
    }

    fn write_as(&mut self, trainer: &Trainer, full: bool) -> Result<Written, TrainError> {
        std::fs::create_dir_all(&self.root).map_err(|e| TrainError::io(&self.root, e))?;
        let clock = trainer.table.settled_clock();
        let since = if full || self.digests.is_some() { None } else { self.previous.as_ref().map(|(_, c)| *c) };
        let previous_digests = if full { None } else { self.digests.as_ref() };
        let mut next_digests = self.digests.as_ref().map(|d| std::collections::HashMap::with_capacity(d.len()));
        let mut kept = 0usize;
        let name = format!("{:012}", trainer.step);
        let dir = self.root.join(&name);
        if dir.exists() {
            // A resumed run reaches this step again: the same model, written anew.
            remove_export(&dir)?;
        }
        let taken_unix_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let dim = trainer.table.dim();
        let mut bytes = Vec::with_capacity(dim * 4);
        let pages = row_pages(&trainer.table, |key, last_use, row| {
            if since.is_some_and(|s| last_use <= s) {
                return false;
            }
            if let Some(next) = next_digests.as_mut() {
                bytes.clear();
                bytes.extend(row[..dim].iter().flat_map(|x| x.to_le_bytes()));
                let digest = xxhash_rust::xxh3::xxh3_128(&bytes);
                next.insert(key, digest);
                if let Some(before) = previous_digests.and_then(|d| d.get(&key)) {
                    kept += 1;
                    return *before != digest;
                }
            }
            true
        });
        let meta = ExportMeta {
            // Half rows are written as they are stored: half the bytes, no loss.
            dtype: Some(VectorType::of_rows(trainer.config.embedding.dtype)),
            base: if full { None } else { self.previous.as_ref().map(|(n, _)| n.clone()) },
            taken_unix_ms: Some(taken_unix_ms),
            stream: trainer.stream.as_deref().cloned(),
        };
        write_export_with(&dir, &trainer.config, &trainer.layout, trainer.step, &trainer.model, &meta, pages)?;
        if let Some(previous) = previous_digests
            && kept < previous.len()
        {
            std::fs::remove_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
            return Ok(Written::NeedsFull);
        }
        if next_digests.is_some() {
            self.digests = next_digests;
        }
        point_latest(&self.root, &name)?;
        if full {
            if let Some(older) = self.last_full.replace(name.clone()) {
                remove_exports_before(&self.root, &older);
            }
            self.since_full = 0;
        } else {
            self.since_full += 1;
        }
        self.previous = Some((name, clock));
        self.last_step = Some(trainer.step);
        Ok(Written::Done(dir))
    }
}

/// Points `root/LATEST` at the export `name` (written aside, synced, renamed).
pub fn point_latest(root: &Path, name: &str) -> Result<(), TrainError> {
    let tmp = root.join(".LATEST.tmp");
    write_bytes_synced(&tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&tmp, root.join("LATEST")).map_err(|e| TrainError::io(&root.join("LATEST"), e))
}

/// Removes the exports in `root` older than `keep_from` (best effort: a
/// failure leaves a directory behind, never the model's chain broken).
pub fn remove_exports_before(root: &Path, keep_from: &str) {
    let Ok(keep_from) = keep_from.parse::<u64>() else { return };
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.parse::<u64>().is_ok_and(|n| n < keep_from)
            && let Err(e) = remove_export(&entry.path())
        {
            tracing::warn!("could not remove the old export {}: {e}", entry.path().display());
        }
    }
}

/// Removes an export's own files (its manifest's, and the manifest), and
/// its directory once empty; what someone else put there stays. An export
/// whose manifest cannot be read is kept, with a warning.
pub fn remove_export(dir: &Path) -> Result<(), TrainError> {
    match read_manifest(dir) {
        Ok(m) => crate::new_dir::remove_written(dir, m.files.keys().map(String::as_str).chain([MANIFEST])),
        Err(e) => {
            tracing::warn!("kept the old export {}: {e}", dir.display());
            Ok(())
        }
    }
}

/// A shard's rows in a cluster's serving export ([`write_rows_part`]).
#[derive(Clone, Debug)]
pub struct RowsPart {
    /// The file's name in the export ([`part_name`]).
    pub name: String,
    pub entry: FileEntry,
    pub rows: u64,
    /// The table's clock when written: the next delta holds the rows used after it.
    pub clock: u64,
}

/// Writes the rows of `table` used after clock `since` (every row: none)
/// into `dir`/[`part_name`]`(index)`, stored as `dtype`: a shard's part of
/// a cluster's serving export. The caller keeps updates out meanwhile.
pub fn write_rows_part(
    table: &sparrow_embedding::EmbeddingTable,
    dir: &Path,
    index: usize,
    since: Option<u64>,
    dtype: VectorType,
) -> Result<RowsPart, TrainError> {
    let clock = table.settled_clock();
    let name = part_name(index);
    let pages = row_pages(table, |_, last_use, _| since.is_none_or(|s| last_use > s));
    let (entry, rows) = write_embeddings(&dir.join(&name), dtype, table.dim(), pages)?;
    Ok(RowsPart { name, entry, rows, clock })
}
