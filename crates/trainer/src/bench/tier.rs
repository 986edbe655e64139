//! `sparrow bench-tier`: the reference model's training loop over a large
//! table, in memory or on the SSD tier behind a cache.

use super::*;

/// `sparrow bench-tier`: the reference MLP's training loop over a table of
/// `rows` keys (power-law access), all in memory or on SSD behind a cache.
/// Run each storage in its own process: the peak RSS is the process's.
#[derive(Clone, Debug)]
pub struct TierBenchOptions {
    pub rows: usize,
    pub storage: sparrow_core::config::Storage,
    pub cache_rows: usize,
    pub policy: sparrow_core::config::CachePolicy,
    pub path: PathBuf,
    pub steps: usize,
    pub warmup_steps: usize,
    pub zipf_exponent: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TierBench {
    pub storage: &'static str,
    pub table_rows: usize,
    pub cache_capacity_rows: Option<usize>,
    pub dim: usize,
    pub steps: usize,
    pub samples_per_sec: f64,
    pub fill_secs: f64,
    /// Over the timed steps: lookups of known keys served from memory.
    pub cache_hit_rate: Option<f64>,
    pub lookup_misses_after_prefetch: Option<u64>,
    pub cached_rows: usize,
    pub peak_rss_bytes: u64,
    /// RSS before the table existed (the key sampler and the batches).
    pub baseline_rss_bytes: u64,
    /// What the table added to the peak: `peak_rss_bytes - baseline_rss_bytes`.
    pub table_rss_bytes: u64,
    pub step_phase_secs: PhaseSecs,
}

fn current_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

pub fn bench_tier(o: &TierBenchOptions) -> Result<TierBench, TrainError> {
    use sparrow_core::config::Storage;
    let (batch_size, fields, dense) = (1024usize, 26usize, 13usize);
    let mut config = Config::default();
    config.model.kind = ModelKind::named("mlp");
    config.model.hidden = vec![256, 128];
    config.train.batch_size = batch_size;
    config.train.threads = 2;
    config.embedding.storage = o.storage;
    config.embedding.path = Some(o.path.display().to_string());
    config.embedding.cache_capacity_rows = o.cache_rows;
    config.embedding.cache_policy = o.policy;
    let layout = DataLayout { num_fields: fields, num_dense: dense, weighted: false, num_tasks: 1 };
    // Keys by power-law rank, the same for both storages (same seed).
    let zipf = Alias::zipf(o.rows, o.zipf_exponent);
    let key_of_rank = |r: usize| mix64(r as u64 ^ 0x7ab1e);
    let mut rng = Rng::new(11);
    let batches: Vec<Batch> = (0..o.warmup_steps + o.steps)
        .map(|_| {
            let mut b = BatchBuilder::new(fields, dense, false, batch_size);
            for _ in 0..batch_size {
                b.begin_row();
                for d in 0..dense {
                    b.push_dense((d as f32 * 0.1).sin());
                }
                for f in 0..fields {
                    b.push_key(f, key_of_rank(zipf.draw(&mut rng)), 1.0);
                }
                b.end_row(f32::from(rng.below(4) == 0));
            }
            b.finish(Default::default())
        })
        .collect();
    let baseline_rss_bytes = current_rss_bytes();
    let pool = crate::run::compute_pool(2)?;
    pool.install(|| {
        let mut trainer = Trainer::new(&config, layout)?;
        let fill = Instant::now();
        let mut chunk = Vec::with_capacity(1 << 16);
        for r in 0..o.rows {
            chunk.push(key_of_rank(r));
            if chunk.len() == 1 << 16 || r + 1 == o.rows {
                let plan = trainer.table.plan(&chunk);
                let mut rows = vec![0.0; plan.num_unique() * trainer.table.dim()];
                trainer.table.lookup_or_insert(&plan, &mut rows)?;
                chunk.clear();
            }
        }
        let fill_secs = fill.elapsed().as_secs_f64();
        // The loop `sparrow train` runs: each step prefetches the next
        // batch's rows (planning, on its own thread there, is timed here).
        let partitioner = trainer.table.partitioner();
        let mut taken = 0usize;
        let mut step = |trainer: &mut Trainer, limit: usize| -> Result<(), TrainError> {
            let mut next = |_: usize| {
                let batch = batches.get(taken).filter(|_| taken < limit)?;
                taken += 1;
                Some(Ok((batch.clone(), partitioner.plan(&batch.keys))))
            };
            if let Some(report) = trainer.step(&mut next)?
                && let Some(e) = report.deferred
            {
                return Err(e);
            }
            Ok(())
        };
        for _ in 0..o.warmup_steps {
            step(&mut trainer, o.warmup_steps)?;
        }
        trainer.phase_secs = Default::default();
        let before = trainer.table.tier_stats();
        let start = Instant::now();
        let mut samples = 0usize;
        for batch in batches.iter().skip(o.warmup_steps) {
            step(&mut trainer, batches.len())?;
            samples += batch.rows();
        }
        let samples_per_sec = samples as f64 / start.elapsed().as_secs_f64();
        let after = trainer.table.tier_stats();
        let (hit_rate, misses) = match (before, after) {
            (Some(b), Some(a)) => {
                let timed = sparrow_embedding::table::TierStats {
                    hits: a.hits - b.hits,
                    loads: a.loads - b.loads,
                    inits: a.inits - b.inits,
                    writebacks: a.writebacks - b.writebacks,
                    prefetch_loads: a.prefetch_loads - b.prefetch_loads,
                    prefetch_inits: a.prefetch_inits - b.prefetch_inits,
                };
                (Some(timed.cache_hit_rate()), Some(timed.loads))
            }
            _ => (None, None),
        };
        let peak_rss_bytes = crate::peak_rss_bytes();
        Ok(TierBench {
            storage: if o.storage == Storage::Ssd { "ssd" } else { "memory" },
            table_rows: trainer.table.len(),
            cache_capacity_rows: (o.storage == Storage::Ssd).then_some(o.cache_rows),
            dim: trainer.table.dim(),
            steps: o.steps,
            samples_per_sec,
            fill_secs,
            cache_hit_rate: hit_rate,
            lookup_misses_after_prefetch: misses,
            cached_rows: trainer.table.cached_rows(),
            peak_rss_bytes,
            baseline_rss_bytes,
            table_rss_bytes: peak_rss_bytes.saturating_sub(baseline_rss_bytes),
            step_phase_secs: trainer.phase_secs,
        })
    })
}
