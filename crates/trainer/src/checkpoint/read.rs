//! Reading checkpoints: resolving a root's `LATEST`, the manifest (its
//! names confined to the version's directory, see [`crate::confined`]),
//! every file verified (size first, checksum while parsed), the rows into
//! a trainer's table, a cluster version's parts and incremental chain.

use sparrow_core::Overrides;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use sparrow_core::Config;
use sparrow_data::DataLayout;
use sparrow_embedding::{EmbeddingDtype, RowFormat};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::{
    DENSE_FILE, EMB_FILE, EMB_HEADER_BYTES, FILTERS_FILE, FILTERS_MAGIC, FORMAT_VERSION, FileEntry, MANIFEST_FILE,
    Manifest, Part, emb_magic,
};
use crate::TrainError;
use crate::trainer::Trainer;

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
    trainer.stream = m.stream.clone().map(std::sync::Arc::new);
    trainer.early_stopping = m.early_stopping.clone().unwrap_or_default();
    if let Some(bounds) = trainer.bounds.as_mut() {
        bounds.restore(&m.event_clock);
    }
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
    check_same_norm(trainer, dir, m)?;
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

/// The MLP stacks' norm, as the checkpoint's config and this run's resolve
/// it (`auto` by the kind): a dense model of another shape would be refused
/// by its parameters' sizes, without saying which key made them differ.
fn check_same_norm(trainer: &Trainer, dir: &Path, m: &Manifest) -> Result<(), TrainError> {
    use sparrow_core::config::Norm;
    use sparrow_model::kinds::stack_style;
    let Ok(saved) = Config::from_stored_toml(&m.config, "the checkpoint's config", &Overrides::none()) else {
        return Ok(());
    };
    let name = |n: Norm| match n {
        Norm::None => "none",
        Norm::Layer => "layer",
        Norm::Batch => "batch",
    };
    let (then, now) = (stack_style(&saved.model).norm, stack_style(&trainer.config.model).norm);
    if then != now {
        return Err(TrainError::checkpoint(
            dir,
            format!(
                "its model was trained with model.norm = \"{}\", this run's is \"{}\" (`auto`, the default, is \
                 batch norm for din): set model.norm = \"{}\" to resume it",
                name(then),
                name(now),
                name(then)
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
    trainer.stream = m.stream.clone().map(std::sync::Arc::new);
    trainer.early_stopping = m.early_stopping.clone().unwrap_or_default();
    if let Some(bounds) = trainer.bounds.as_mut() {
        bounds.restore(&m.event_clock);
    }
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
/// `overrides` apply to the stored config, e.g. another data format.
pub fn load_trainer(path: &Path, overrides: &Overrides) -> Result<(Trainer, Manifest, PathBuf), TrainError> {
    let dir = resolve(path)?;
    let m = read_manifest(&dir)?;
    let config = Config::from_stored_toml(&m.config, &dir.join(MANIFEST_FILE).display().to_string(), overrides)?;
    let layout = DataLayout {
        num_fields: m.num_fields,
        num_dense: m.num_dense,
        weighted: DataLayout::from_config(&config.data).weighted,
        num_tasks: DataLayout::from_config(&config.data).num_tasks,
    };
    let mut trainer = Trainer::new(&config, layout)?;
    let m = load_into(&mut trainer, &dir)?;
    Ok((trainer, m, dir))
}
