//! Synthetic CTR data with a known answer. IDs per field are power-law
//! (Zipf) over vocabularies from tens to hundreds of thousands; the true logit
//! has per-ID terms, pairwise field interactions (low-rank, as FM/DLRM can
//! model and plain LR cannot) and dense terms. Since the generator knows every
//! row's true click probability, the Bayes-optimal AUC and log-loss of the test
//! rows are exact, and a trained model is judged against them.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sparrow_core::key::mix64;
use sparrow_core::metrics::{auc, log_loss_from_probs, sigmoid};
use sparrow_core::rng::Rng;

use crate::error::DataError;
use crate::layout::{CRITEO_DENSE, CRITEO_SPARSE};

/// Rank of the low-rank interaction vectors.
const RANK: usize = 4;
/// Rows generated per parallel chunk (each chunk has its own RNG stream).
const CHUNK_ROWS: u64 = 16_384;
const MIN_VOCAB: f64 = 20.0;
const MAX_VOCAB: f64 = 400_000.0;
const GENERATOR: &str = "sparrow-synth-v1";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Truth {
    pub generator: String,
    pub seed: u64,
    pub train_rows: u64,
    pub test_rows: u64,
    /// AUC of the true click probabilities on the test rows: no model can do
    /// better in expectation.
    pub bayes_auc: f64,
    pub bayes_logloss: f64,
    pub test_ctr: f64,
    pub train_ctr: f64,
    pub vocab_sizes: Vec<u64>,
    pub interaction_pairs: Vec<(usize, usize)>,
}

/// Walker's alias table: O(1) draws from a fixed discrete distribution.
pub struct Alias {
    prob: Vec<f32>,
    alias: Vec<u32>,
}

impl Alias {
    /// Zipf(s) over ranks 0..n (rank 0 most frequent).
    pub fn zipf(n: usize, s: f64) -> Alias {
        let w: Vec<f64> = (1..=n).map(|r| (r as f64).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        let mut scaled: Vec<f64> = w.iter().map(|x| x * n as f64 / total).collect();
        let mut prob = vec![1.0f32; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) = (0..n).partition(|&i| scaled[i] < 1.0);
        while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
            prob[s] = scaled[s] as f32;
            alias[s] = l as u32;
            scaled[l] -= 1.0 - scaled[s];
            if scaled[l] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        Alias { prob, alias }
    }

    #[inline]
    pub fn draw(&self, rng: &mut Rng) -> usize {
        let i = rng.below(self.prob.len() as u64) as usize;
        if (rng.next_f64() as f32) < self.prob[i] { i } else { self.alias[i] as usize }
    }
}

struct Field {
    sampler: Alias,
    /// Per rank: [w, u_0..u_RANK] (rank = vocabulary position, 0 = most frequent).
    params: Vec<f32>,
    importance: f64,
    missing_rate: f64,
    /// Parameters of the "missing" value.
    missing_params: [f32; 1 + RANK],
}

/// The hidden world behind the data.
struct World {
    seed: u64,
    fields: Vec<Field>,
    pairs: Vec<(usize, usize, f64)>,
    dense_mu: [f64; CRITEO_DENSE],
    dense_beta: [f64; CRITEO_DENSE],
    dense_missing: [f64; CRITEO_DENSE],
    bias: f64,
}

const SIGMA_ID: f64 = 0.3;
const SIGMA_U: f64 = 0.4;

impl World {
    fn new(seed: u64) -> World {
        let mut rng = Rng::new(seed ^ 0x5eed_0fa1);
        // Vocabulary sizes log-spaced from tens to hundreds of thousands, in a shuffled field order.
        let mut vocab: Vec<usize> = (0..CRITEO_SPARSE)
            .map(|f| {
                let t = f as f64 / (CRITEO_SPARSE - 1) as f64;
                (MIN_VOCAB.ln() + t * (MAX_VOCAB.ln() - MIN_VOCAB.ln())).exp().round() as usize
            })
            .collect();
        for i in (1..vocab.len()).rev() {
            vocab.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let fields = vocab
            .iter()
            .enumerate()
            .map(|(f, &n)| {
                let s = rng.uniform(1.05, 1.3);
                let mut prng = Rng::new(mix64(seed ^ ((f as u64 + 1) << 40)));
                let params = (0..n * (1 + RANK))
                    .map(|i| {
                        let sigma = if i % (1 + RANK) == 0 { SIGMA_ID } else { SIGMA_U };
                        (prng.normal() * sigma) as f32
                    })
                    .collect();
                let missing_rate = if f % 4 == 1 { rng.uniform(0.05, 0.4) } else { 0.0 };
                let mut missing_params = [0.0f32; 1 + RANK];
                for p in &mut missing_params {
                    *p = (prng.normal() * 0.3) as f32;
                }
                Field {
                    sampler: Alias::zipf(n, s),
                    params,
                    importance: rng.uniform(0.3, 1.0),
                    missing_rate,
                    missing_params,
                }
            })
            .collect();
        let mut pairs = Vec::new();
        while pairs.len() < 30 {
            let a = rng.below(CRITEO_SPARSE as u64) as usize;
            let b = rng.below(CRITEO_SPARSE as u64) as usize;
            if a < b && !pairs.iter().any(|&(x, y, _)| (x, y) == (a, b)) {
                let sign = if rng.next_f64() < 0.5 { -1.0 } else { 1.0 };
                pairs.push((a, b, sign * rng.uniform(0.4, 0.9)));
            }
        }
        let mut dense_mu = [0.0; CRITEO_DENSE];
        let mut dense_beta = [0.0; CRITEO_DENSE];
        let mut dense_missing = [0.0; CRITEO_DENSE];
        for j in 0..CRITEO_DENSE {
            dense_mu[j] = rng.uniform(0.0, 4.0);
            dense_beta[j] = rng.normal() * 0.25;
            dense_missing[j] = if j % 3 == 0 { rng.uniform(0.0, 0.3) } else { 0.0 };
        }
        World { seed, fields, pairs, dense_mu, dense_beta, dense_missing, bias: -1.5 }
    }

    /// Appends one Criteo TSV row to `out`; returns the true click probability and the label.
    fn row(&self, rng: &mut Rng, out: &mut Vec<u8>) -> (f64, u8) {
        self.row_as(rng, out, &Style::TSV)
    }

    /// One row in `style`: tab- or comma-separated, with its sparse terms
    /// drifting toward a second parameter set and a timestamp column.
    fn row_as(&self, rng: &mut Rng, out: &mut Vec<u8>, style: &Style<'_>) -> (f64, u8) {
        let mut logit = self.bias;
        // Dense: counts, log-normal, some missing; log1p transform as Criteo readers apply.
        let mut z = [0.0f64; CRITEO_DENSE];
        let mut dense_text = [None; CRITEO_DENSE];
        for j in 0..CRITEO_DENSE {
            if rng.next_f64() < self.dense_missing[j] {
                continue;
            }
            let x = ((self.dense_mu[j] + 1.2 * rng.normal()).exp() - 1.0).floor().max(0.0) as u64;
            dense_text[j] = Some(x);
            z[j] = (x as f64).ln_1p();
        }
        for ((z, beta), mu) in z.iter().zip(&self.dense_beta).zip(&self.dense_mu) {
            logit += beta * (z - mu);
        }
        logit += 0.35 * (z[0] - 2.0).tanh() * (z[1] - self.dense_mu[1]) * 0.5;
        // Sparse: per-ID terms and low-rank pairwise interactions.
        let mut params: [&[f32]; CRITEO_SPARSE] = [&[]; CRITEO_SPARSE];
        let mut drifted: [&[f32]; CRITEO_SPARSE] = [&[]; CRITEO_SPARSE];
        let mut ranks = [None; CRITEO_SPARSE];
        for (f, field) in self.fields.iter().enumerate() {
            let width = 1 + RANK;
            if field.missing_rate > 0.0 && rng.next_f64() < field.missing_rate {
                params[f] = &field.missing_params;
                drifted[f] = style.drift.map_or(&field.missing_params[..], |(d, _)| &d.missing[f][..]);
            } else {
                let r = field.sampler.draw(rng);
                ranks[f] = Some(r);
                params[f] = &field.params[r * width..(r + 1) * width];
                drifted[f] = style.drift.map_or(params[f], |(d, _)| &d.params[f][r * width..(r + 1) * width]);
            }
        }
        // Summed onto `s` term by term (the order the TSV data was always made in).
        let sparse = |params: &[&[f32]; CRITEO_SPARSE], mut s: f64| {
            for (f, field) in self.fields.iter().enumerate() {
                s += field.importance * f64::from(params[f][0]);
            }
            for &(a, b, c) in &self.pairs {
                let dot: f32 = params[a][1..].iter().zip(&params[b][1..]).map(|(x, y)| x * y).sum();
                s += c * f64::from(dot);
            }
            s
        };
        logit = match style.drift {
            Some((_, t)) => logit + (1.0 - t) * sparse(&params, 0.0) + t * sparse(&drifted, 0.0),
            None => sparse(&params, logit),
        };
        let p = sigmoid(logit);
        let label = u8::from(rng.next_f64() < p);
        out.push(b'0' + label);
        for v in dense_text {
            out.push(style.separator);
            if let Some(x) = v {
                out.extend_from_slice(x.to_string().as_bytes());
            }
        }
        for (f, r) in ranks.iter().enumerate() {
            out.push(style.separator);
            if let Some(r) = r {
                let h = mix64(self.seed ^ ((f as u64) << 48) ^ (*r as u64)) as u32;
                out.extend_from_slice(format!("{h:08x}").as_bytes());
            }
        }
        if let Some((start, span)) = style.time {
            out.push(style.separator);
            let ts = start + (rng.next_f64() * span as f64) as i64;
            out.extend_from_slice(ts.to_string().as_bytes());
        }
        out.push(b'\n');
        (p, label)
    }

    /// A second parameter set of the same shape: where the click model drifts to.
    fn drift(&self, seed: u64) -> Drift {
        let mut prng = Rng::new(mix64(seed ^ 0xd1f7));
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let sigma = if i % (1 + RANK) == 0 { SIGMA_ID } else { SIGMA_U };
                    (prng.normal() * sigma) as f32
                })
                .collect()
        };
        let params = self.fields.iter().map(|f| draw(f.params.len())).collect();
        let missing = self
            .fields
            .iter()
            .map(|_| {
                let v = draw(1 + RANK);
                std::array::from_fn(|i| v[i] * 0.75)
            })
            .collect();
        Drift { params, missing }
    }
}

/// Where a drifting click model goes: per field, parameters for every rank
/// and for the missing value.
struct Drift {
    params: Vec<Vec<f32>>,
    missing: Vec<[f32; 1 + RANK]>,
}

/// How a row is written.
struct Style<'a> {
    separator: u8,
    /// The drift and how far along it (0: the base model, 1: the drifted one).
    drift: Option<(&'a Drift, f64)>,
    /// A timestamp column: uniform in [start, start + span) seconds.
    time: Option<(i64, i64)>,
}

impl Style<'_> {
    const TSV: Style<'static> = Style { separator: b'\t', drift: None, time: None };
}

/// Writes `rows` rows to `path`; returns the true probabilities and labels.
fn write_split(world: &World, path: &Path, rows: u64, stream: u64) -> Result<(Vec<f64>, Vec<f32>), DataError> {
    let file = File::create(path).map_err(|e| DataError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let chunks = rows.div_ceil(CHUNK_ROWS);
    let mut probs = Vec::with_capacity(rows as usize);
    let mut labels = Vec::with_capacity(rows as usize);
    // A window of chunks at a time keeps memory bounded for any row count.
    let window = 32u64;
    for first in (0..chunks).step_by(window as usize) {
        let parts: Vec<(Vec<u8>, Vec<f64>, Vec<f32>)> = (first..(first + window).min(chunks))
            .into_par_iter()
            .map(|c| {
                let n = CHUNK_ROWS.min(rows - c * CHUNK_ROWS);
                let mut rng = Rng::new(mix64(world.seed ^ (stream << 56) ^ c));
                let mut text = Vec::with_capacity(n as usize * 200);
                let mut ps = Vec::with_capacity(n as usize);
                let mut ls = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let (p, l) = world.row(&mut rng, &mut text);
                    ps.push(p);
                    ls.push(f32::from(l));
                }
                (text, ps, ls)
            })
            .collect();
        for (text, ps, ls) in parts {
            w.write_all(&text).map_err(|e| DataError::io(path, e))?;
            probs.extend(ps);
            labels.extend(ls);
        }
    }
    w.flush().map_err(|e| DataError::io(path, e))?;
    Ok((probs, labels))
}

/// Writes `dir/train.tsv`, `dir/test.tsv` and `dir/truth.json`.
pub fn generate(dir: &Path, train_rows: u64, test_rows: u64, seed: u64) -> Result<Truth, DataError> {
    std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    let world = World::new(seed);
    let (train_p, train_l) = write_split(&world, &dir.join("train.tsv"), train_rows, 1)?;
    let (test_p, test_l) = write_split(&world, &dir.join("test.tsv"), test_rows, 2)?;
    drop(train_p);
    write_truth(dir, &world, GENERATOR.into(), (train_rows, test_rows), &train_l, (&test_p, &test_l))
}

/// Writes `dir/truth.json`: the test rows' Bayes AUC and log-loss from their
/// true probabilities, the click rates, the world's shape.
fn write_truth(
    dir: &Path,
    world: &World,
    generator: String,
    (train_rows, test_rows): (u64, u64),
    train_labels: &[f32],
    (test_p, test_l): (&[f64], &[f32]),
) -> Result<Truth, DataError> {
    let mean = |v: &[f32]| {
        if v.is_empty() { f64::NAN } else { v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64 }
    };
    let truth = Truth {
        generator,
        seed: world.seed,
        train_rows,
        test_rows,
        bayes_auc: auc_f64(test_p, test_l),
        bayes_logloss: log_loss_from_probs(test_p, test_l),
        test_ctr: mean(test_l),
        train_ctr: mean(train_labels),
        vocab_sizes: world.fields.iter().map(|f| f.sampler.prob.len() as u64).collect(),
        interaction_pairs: world.pairs.iter().map(|&(a, b, _)| (a, b)).collect(),
    };
    let path = dir.join("truth.json");
    let json = serde_json::to_string_pretty(&truth).map_err(|e| DataError::io(&path, std::io::Error::other(e)))?;
    std::fs::write(&path, json + "\n").map_err(|e| DataError::io(&path, e))?;
    Ok(truth)
}

/// AUC on probabilities. Casting them to f32 would merge nearby values into
/// ties, so the f64 order is turned into (exact) f32 ranks first.
pub(crate) fn auc_f64(probs: &[f64], labels: &[f32]) -> f64 {
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| probs[a as usize].total_cmp(&probs[b as usize]));
    let ranks: Vec<f32> = {
        let mut r = vec![0f32; probs.len()];
        let mut i = 0;
        while i < order.len() {
            let mut j = i;
            while j < order.len() && probs[order[j] as usize] == probs[order[i] as usize] {
                j += 1;
            }
            for &o in &order[i..j] {
                r[o as usize] = i as f32;
            }
            i = j;
        }
        r
    };
    auc(&ranks, labels)
}

/// The first day of `generate_days` data (2023-11-14, Unix seconds): in the past on any machine.
pub const DAYS_START: i64 = 1_700_000_000 - 1_700_000_000 % 86_400;

/// Writes `dir/train.csv` (rows spread evenly over `days` days, oldest
/// first, with a `ts` column), `dir/test.csv` (held-out rows of the newest
/// day) and `dir/truth.json`. The click model drifts from day to day: day
/// d's sparse terms are (1 − t)·today's model + t·another, t = d / (days − 1),
/// so the newest day is the furthest from the oldest. `shuffled`: the
/// training rows in a random order instead of oldest first (an offline log
/// shuffled before training).
pub fn generate_days(
    dir: &Path,
    train_rows: u64,
    test_rows: u64,
    days: u32,
    shuffled: bool,
    seed: u64,
) -> Result<Truth, DataError> {
    if days == 0 {
        return Err(DataError::io(dir, std::io::Error::other("--days must be at least 1")));
    }
    std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    let world = World::new(seed);
    let drift = world.drift(seed);
    let header = {
        let mut h = String::from("label");
        (1..=CRITEO_DENSE).for_each(|i| h.push_str(&format!(",I{i}")));
        (1..=CRITEO_SPARSE).for_each(|i| h.push_str(&format!(",C{i}")));
        h + ",ts\n"
    };
    let day = 86_400i64;
    let along = |d: u32| if days > 1 { f64::from(d) / f64::from(days - 1) } else { 1.0 };
    let write = |path: &Path, rows_of_day: &dyn Fn(u32) -> u64, stream: u64, shuffled: bool| {
        let file = File::create(path).map_err(|e| DataError::io(path, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(header.as_bytes()).map_err(|e| DataError::io(path, e))?;
        let (mut probs, mut labels) = (Vec::new(), Vec::new());
        let mut held: Vec<Vec<u8>> = Vec::new();
        for d in 0..days {
            let n = rows_of_day(d);
            if n == 0 {
                continue;
            }
            let style = Style {
                separator: b',',
                drift: Some((&drift, along(d))),
                time: Some((DAYS_START + i64::from(d) * day, day)),
            };
            let mut rng = Rng::new(mix64(world.seed ^ (stream << 56) ^ u64::from(d)));
            let mut text = Vec::with_capacity(n as usize * 200);
            for _ in 0..n {
                let at = text.len();
                let (p, l) = world.row_as(&mut rng, &mut text, &style);
                probs.push(p);
                labels.push(f32::from(l));
                if shuffled {
                    held.push(text.split_off(at));
                }
            }
            w.write_all(&text).map_err(|e| DataError::io(path, e))?;
        }
        // Fisher–Yates with the generator's own RNG: the same file for the same seed.
        let mut rng = Rng::new(mix64(world.seed ^ 0x5b0f));
        for i in (1..held.len()).rev() {
            held.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for row in &held {
            w.write_all(row).map_err(|e| DataError::io(path, e))?;
        }
        w.flush().map_err(|e| DataError::io(path, e))?;
        Ok::<_, DataError>((probs, labels))
    };
    let per_day = |d: u32| train_rows / u64::from(days) + u64::from(u64::from(d) < train_rows % u64::from(days));
    let (_, train_l) = write(&dir.join("train.csv"), &per_day, 1, shuffled)?;
    let (test_p, test_l) = write(&dir.join("test.csv"), &|d| if d + 1 == days { test_rows } else { 0 }, 2, false)?;
    let generator = format!("{GENERATOR}-days{days}{}", if shuffled { "-shuffled" } else { "" });
    write_truth(dir, &world, generator, (train_rows, test_rows), &train_l, (&test_p, &test_l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_table_follows_zipf() {
        let a = Alias::zipf(100, 1.1);
        let mut rng = Rng::new(1);
        let mut counts = [0u32; 100];
        for _ in 0..200_000 {
            counts[a.draw(&mut rng)] += 1;
        }
        let h1: f64 = (1..=100).map(|r| (r as f64).powf(-1.1)).sum();
        let p0 = 1.0 / h1;
        let got = f64::from(counts[0]) / 200_000.0;
        assert!((got - p0).abs() < 0.01, "{got} vs {p0}");
        assert!(counts[0] > counts[10] && counts[10] > counts[90]);
    }
}
