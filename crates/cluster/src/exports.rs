//! Serving exports of a cluster job (`checkpoint.export_every_steps`,
//! `export_every_secs`), written in a cut as a checkpoint is: the workers
//! meet at a step ([`crate::coordinator`]'s commit), every shard writes the
//! rows used since its part of the export before into one file of the
//! export ([`PartRequest::export`](crate::transport::PartRequest)), worker
//! 0's dense weights come from the cut's staging directory, and the
//! coordinator writes the manifest and points `exports/LATEST` at it. No
//! table crosses the network or is loaded whole: an export costs what
//! changed since the last one.
//!
//! The export is full (every row) when it is the coordinator's first, when
//! the one before it was taken in another generation (a recovery may have
//! rolled rows back), every `checkpoint.full_every`-th, and always when
//! rows are deleted while training (a delta cannot delete a row).

use std::path::{Path, PathBuf};
use std::time::Instant;

use sparrow_core::Config;
use sparrow_core::batch::StreamMark;
use sparrow_trainer::export::{ExportMeta, RowsPart, VectorType};

use crate::generation::Generation;
use crate::transport::ClusterError;

/// The newest export written: its name, the generation of its cut and
/// each shard's clock then.
struct Previous {
    name: String,
    generation: Generation,
    clocks: Vec<u64>,
}

/// When exports are due, and what the next one builds on.
pub struct ClusterExports {
    root: PathBuf,
    every: Option<u64>,
    every_secs: Option<u64>,
    /// The timed meetings are at least `every_secs` apart: each one exports.
    each_meeting: bool,
    full_every: u64,
    always_full: bool,
    last_time: Option<Instant>,
    previous: Option<Previous>,
    since_full: u64,
    last_full: Option<String>,
}

/// An export decided for a cut: where the shards write their parts, and
/// the clock each part starts after.
#[derive(Clone, Debug)]
pub struct ExportPlan {
    root: PathBuf,
    name: String,
    staging: PathBuf,
    step: u64,
    generation: Generation,
    base: Option<String>,
    since: Vec<Option<u64>>,
}

impl ClusterExports {
    /// None unless the config asks for exports (and has a `checkpoint.dir`).
    pub fn new(config: &Config) -> Option<ClusterExports> {
        let every = config.checkpoint.export_every_steps.filter(|&n| n > 0);
        let every_secs = config.checkpoint.export_every_secs.filter(|&s| s > 0);
        if every.is_none() && every_secs.is_none() {
            return None;
        }
        let dir = config.checkpoint.dir.as_ref()?;
        Some(ClusterExports {
            root: Path::new(dir).join("exports"),
            every,
            every_secs,
            each_meeting: every_secs
                .is_some_and(|e| crate::checkpoint::meet_every_secs(config).is_some_and(|m| m >= e)),
            full_every: config.checkpoint.full_every.max(1),
            always_full: config.embedding.deletes_rows(),
            last_time: None,
            previous: None,
            since_full: 0,
            last_full: None,
        })
    }

    /// Whether the cut at `step` of `generation` writes an export: on the
    /// step cadence, `every_secs` after the last one (or at each timed
    /// meeting, `timed`, when the meetings are as far apart as the
    /// exports), or at the job's last cut (`last`). `shards`: the job's
    /// shard count.
    pub fn due(
        &mut self,
        step: u64,
        generation: Generation,
        timed: bool,
        last: bool,
        shards: usize,
    ) -> Option<ExportPlan> {
        let by_steps = self.every.is_some_and(|every| step.is_multiple_of(every));
        let by_time = self
            .every_secs
            .is_some_and(|s| (timed && self.each_meeting) || self.last_time.is_none_or(|t| t.elapsed().as_secs() >= s));
        let name = format!("{step:012}");
        let again = self.previous.as_ref().is_some_and(|p| p.generation == generation && p.name == name);
        if !(by_steps || by_time || last) || again {
            // (Again: the job's end met at the step an export was just taken at, the same model.)
            return None;
        }
        self.last_time = Some(Instant::now());
        let previous = self.previous.as_ref().filter(|p| p.generation == generation && p.clocks.len() == shards);
        let full = previous.is_none() || self.always_full || self.since_full + 1 >= self.full_every;
        let since = match (full, previous) {
            (false, Some(p)) => p.clocks.iter().map(|&c| Some(c)).collect(),
            _ => vec![None; shards],
        };
        Some(ExportPlan {
            staging: self.root.join(format!(".tmp-{name}-g{generation}")),
            root: self.root.clone(),
            name,
            step,
            generation,
            base: if full { None } else { previous.map(|p| p.name.clone()) },
            since,
        })
    }

    /// `plan`'s export landed with these parts (in shard order): the next
    /// builds on it. Returns the full export before it, whose elders can go.
    pub fn landed(&mut self, plan: &ExportPlan, parts: &[RowsPart]) -> Option<String> {
        let clocks = parts.iter().map(|p| p.clock).collect();
        self.previous = Some(Previous { name: plan.name.clone(), generation: plan.generation, clocks });
        if plan.base.is_none() {
            self.since_full = 0;
            self.last_full.replace(plan.name.clone())
        } else {
            self.since_full += 1;
            None
        }
    }

    /// `plan`'s export failed: the next one is full.
    pub fn failed(&mut self) {
        self.previous = None;
    }
}

impl ExportPlan {
    /// Shard `index`'s part: the staging directory and the clock its rows start after.
    pub fn request(&self, index: usize) -> (PathBuf, Option<u64>) {
        (self.staging.clone(), self.since.get(index).copied().flatten())
    }

    /// Creates the staging directory (a leftover of a failed attempt removed).
    pub fn prepare(&self) -> Result<(), ClusterError> {
        let io = |e| ClusterError::Io { what: format!("creating {}", self.staging.display()), source: e };
        if self.staging.exists() {
            std::fs::remove_dir_all(&self.staging).map_err(io)?;
        }
        std::fs::create_dir_all(&self.staging).map_err(io)
    }

    /// Removes the staging directory (best effort: the export was not written).
    pub fn abandon(&self) {
        let _ = std::fs::remove_dir_all(&self.staging);
    }

    /// Puts the export in place once every shard wrote its part: the dense
    /// weights from `dense_dir` (the cut's, as worker 0 wrote them), each
    /// part checked against the size and checksum its shard reported, the
    /// manifest, the directory renamed to its name, `LATEST` moved.
    pub fn put_in_place(
        &self,
        config: &Config,
        dense_dir: &Path,
        parts: &[RowsPart],
        stream: Option<StreamMark>,
    ) -> Result<PathBuf, ClusterError> {
        let layout = sparrow_data::DataLayout::from_config(&config.data);
        let model = sparrow_trainer::initial_model(config, &layout)?;
        let dense_path = dense_dir.join("dense.safetensors");
        let tensors = candle_core::safetensors::load(&dense_path, &candle_core::Device::Cpu)
            .map_err(|e| sparrow_trainer::TrainError::checkpoint(&dense_path, e.to_string()))?;
        model.params.load_map(&tensors).map_err(sparrow_trainer::TrainError::from)?;
        for part in parts {
            let entry = sparrow_trainer::checkpoint::hash_file(&self.staging.join(&part.name))?;
            if entry != part.entry {
                return Err(ClusterError::Setup(format!(
                    "{}: {} bytes (xxh3 {}) on disk, its shard wrote {} ({})",
                    self.staging.join(&part.name).display(),
                    entry.bytes,
                    entry.xxh3,
                    part.entry.bytes,
                    part.entry.xxh3
                )));
            }
        }
        let taken_unix_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let meta = ExportMeta {
            dtype: Some(VectorType::of_rows(config.embedding.dtype)),
            base: self.base.clone(),
            taken_unix_ms: Some(taken_unix_ms),
            stream,
        };
        let files = parts.iter().map(|p| (p.name.clone(), p.entry.clone())).collect();
        let rows = parts.iter().map(|p| p.rows).sum();
        sparrow_trainer::export::write_export_manifest(
            &self.staging,
            config,
            &layout,
            self.step,
            &model,
            &meta,
            files,
            rows,
        )?;
        let dir = self.root.join(&self.name);
        if dir.exists() {
            // A recovery reached this step again: the same cut, written anew.
            sparrow_trainer::export::remove_export(&dir)?;
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::rename(&self.staging, &dir).map_err(|e| ClusterError::Io {
            what: format!("renaming {} into place", self.staging.display()),
            source: e,
        })?;
        sparrow_trainer::export::point_latest(&self.root, &self.name)?;
        Ok(dir)
    }

    /// The exports older than `keep_from` go (a full export landed after it).
    pub fn prune(&self, keep_from: &str) {
        sparrow_trainer::export::remove_exports_before(&self.root, keep_from);
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether this export holds every row.
    pub fn full(&self) -> bool {
        self.base.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_trainer::checkpoint::FileEntry;

    fn part(clock: u64) -> RowsPart {
        RowsPart { name: String::new(), entry: FileEntry { bytes: 0, xxh3: String::new() }, rows: 0, clock }
    }

    /// The first export is full; the next builds on it from each shard's
    /// clock; another generation, every `full_every`-th (here 2nd) and a failure make
    /// it full again; the job's end at the step just exported writes none
    /// (it would name itself as its base).
    #[test]
    fn exports_build_on_the_last_within_a_generation() {
        let text = "[checkpoint]\ndir = \"c\"\nexport_every_steps = 1\nfull_every = 2\n";
        let config = Config::from_toml(text, "t", &Default::default()).expect("config");
        let mut exports = ClusterExports::new(&config).expect("exports");
        let (g1, g2) = (Generation(1), Generation(2));
        let first = exports.due(1, g1, true, false, 2).expect("due");
        assert!(first.full() && first.request(0).1.is_none());
        assert_eq!(exports.landed(&first, &[part(10), part(20)]), None);
        assert!(exports.due(1, g1, false, true, 2).is_none(), "the same step again");
        let second = exports.due(2, g1, true, false, 2).expect("due");
        assert_eq!((second.request(0).1, second.request(1).1), (Some(10), Some(20)));
        assert_eq!(second.base.as_deref(), Some("000000000001"));
        exports.landed(&second, &[part(11), part(21)]);
        let third = exports.due(3, g1, true, false, 2).expect("due");
        assert!(third.full(), "every second is full");
        assert_eq!(exports.landed(&third, &[part(12), part(22)]).as_deref(), Some("000000000001"));
        assert!(exports.due(4, g2, true, false, 2).expect("due").full(), "another generation");
        exports.failed();
        assert!(exports.due(5, g1, true, false, 2).expect("due").full(), "after a failure");
    }
}
