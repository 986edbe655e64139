//! Synthetic behaviour data with a known answer for several tasks and
//! behaviour sequences (`sparrow gen --tasks --sequence --classes K`), CSV
//! with a header.
//!
//! The hidden world: users with a few favourite item categories, items in
//! categories, sites. A row is an impression of a candidate item to a user
//! on a site, with the user's recent items (`hist_items`, newest last, 0 to
//! 30 of them, most from the user's favourite categories).
//! - `click` (DIN's setting): its logit has per-user, per-item and per-site
//!   terms, a price term, and the user's interest in the candidate: how many
//!   history items share its category (log(1 + count)).
//! - `conversion` (ESMM's setting): converting depends on the item, the user,
//!   the price and factors the click shares (the item's quality, the
//!   interest), and only a click can convert: the label is click ∧
//!   converts, over every impression. `converts` is the draw itself (whether
//!   the impression would convert if clicked), for judging a CVR model over
//!   all impressions; `cvr` is it where a click observed it and empty
//!   elsewhere (a CVR model trained on clicked samples only reads that).
//! - `ad_type` (`--classes K`): the class of content the impression is
//!   (video, music, game, ...), drawn from a softmax of user and item terms.
//!
//! `truth.json` gives each task's Bayes figures on the test rows.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::Serialize;
use sparrow_core::key::mix64;
use sparrow_core::metrics::{log_loss_from_probs, sigmoid};
use sparrow_core::rng::Rng;

use crate::error::DataError;
use crate::synth::{Alias, Truth, auc_f64};

const GENERATOR: &str = "sparrow-synth-tasks-v1";
const USERS: usize = 20_000;
const ITEMS: usize = 5_000;
const CATEGORIES: usize = 40;
const SITES: usize = 50;
const MAX_HISTORY: u64 = 30;
/// Weight of the interest term in the click logit.
const INTEREST: f64 = 1.2;

/// What to write.
#[derive(Clone, Copy, Debug, Default)]
pub struct Shape {
    /// `click` and `conversion` (and `converts`); without it `click` only.
    pub tasks: bool,
    /// The `hist_items` column.
    pub sequence: bool,
    /// An `ad_type` column of this many classes.
    pub classes: Option<u32>,
    /// Added to every click logit (`--click-shift`): −2 takes the click
    /// rate from about 17% to a production ad's few percent.
    pub click_shift: f64,
}

/// One task's figures on the test rows, from the true probabilities.
#[derive(Clone, Debug, Serialize)]
pub struct TaskTruth {
    /// Binary tasks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bayes_auc: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bayes_logloss: Option<f64>,
    /// Of the labels: the positive rate (binary) or the most frequent
    /// class's share (multiclass).
    pub rate: f64,
    /// Multiclass: the expected accuracy of predicting the likeliest class.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bayes_accuracy: Option<f64>,
}

/// `truth.json` of behaviour data. `bayes_auc`/`bayes_logloss`/`test_ctr`
/// are the first task's (`click`), as the Criteo generator's are.
#[derive(Clone, Debug, Serialize)]
pub struct TasksTruth {
    /// The fields every `truth.json` has (what `train` reads beside the test file).
    #[serde(flatten)]
    pub truth: Truth,
    /// The CSV's columns.
    pub header: Vec<String>,
    pub tasks: std::collections::BTreeMap<String, TaskTruth>,
}

struct World {
    seed: u64,
    users: Alias,
    items: Alias,
    sites: Alias,
    user_bias: Vec<f32>,
    user_cvr: Vec<f32>,
    /// Each user's favourite categories.
    favourites: Vec<[u16; 3]>,
    item_category: Vec<u16>,
    item_bias: Vec<f32>,
    item_cvr: Vec<f32>,
    item_price: Vec<f32>,
    /// Items of each category, for drawing histories.
    by_category: Vec<Vec<u32>>,
    site_bias: Vec<f32>,
    /// `--classes`: per user and per item, a term for each class.
    user_class: Vec<f32>,
    item_class: Vec<f32>,
    classes: usize,
    click_shift: f64,
}

/// One impression and its truth.
struct Row {
    user: usize,
    item: usize,
    site: usize,
    history: Vec<u32>,
    price: f64,
    p_click: f64,
    p_convert: f64,
    class_probs: Vec<f64>,
}

impl World {
    fn new(seed: u64, classes: usize, click_shift: f64) -> World {
        let mut rng = Rng::new(seed ^ 0x7a5c_5eed);
        let mut normal = |sigma: f64, n: usize| -> Vec<f32> { (0..n).map(|_| (rng.normal() * sigma) as f32).collect() };
        let user_bias = normal(0.4, USERS);
        let user_cvr = normal(0.5, USERS);
        let item_bias = normal(0.4, ITEMS);
        let item_cvr = normal(0.7, ITEMS);
        let site_bias = normal(0.3, SITES);
        let user_class = normal(0.8, USERS * classes);
        let item_class = normal(0.8, ITEMS * classes);
        let mut rng = Rng::new(seed ^ 0x17e_ca7e);
        let item_category: Vec<u16> = (0..ITEMS).map(|_| rng.below(CATEGORIES as u64) as u16).collect();
        let item_price: Vec<f32> = (0..ITEMS).map(|_| (rng.normal() * 0.6 + 3.0).exp() as f32).collect();
        let favourites = (0..USERS).map(|_| std::array::from_fn(|_| rng.below(CATEGORIES as u64) as u16)).collect();
        let mut by_category = vec![Vec::new(); CATEGORIES];
        for (i, &c) in item_category.iter().enumerate() {
            by_category[c as usize].push(i as u32);
        }
        World {
            seed,
            users: Alias::zipf(USERS, 1.05),
            items: Alias::zipf(ITEMS, 1.1),
            sites: Alias::zipf(SITES, 1.0),
            user_bias,
            user_cvr,
            favourites,
            item_category,
            item_bias,
            item_cvr,
            item_price,
            by_category,
            site_bias,
            user_class,
            item_class,
            classes,
            click_shift,
        }
    }

    fn row(&self, rng: &mut Rng) -> Row {
        let (user, item, site) = (self.users.draw(rng), self.items.draw(rng), self.sites.draw(rng));
        let len = rng.below(MAX_HISTORY + 1);
        let history: Vec<u32> = (0..len)
            .map(|_| {
                if rng.next_f64() < 0.7 {
                    let c = self.favourites[user][rng.below(3) as usize] as usize;
                    let pool = &self.by_category[c];
                    if pool.is_empty() {
                        self.items.draw(rng) as u32
                    } else {
                        pool[rng.below(pool.len() as u64) as usize]
                    }
                } else {
                    self.items.draw(rng) as u32
                }
            })
            .collect();
        let category = self.item_category[item];
        let same = history.iter().filter(|&&h| self.item_category[h as usize] == category).count();
        let price = f64::from(self.item_price[item]);
        let interest = INTEREST * (same as f64).ln_1p();
        let click_logit = -2.2
            + self.click_shift
            + f64::from(self.user_bias[user])
            + f64::from(self.item_bias[item])
            + f64::from(self.site_bias[site])
            + interest
            - 0.15 * (price / 20.0).ln();
        // Converting shares factors with clicking (a better item, a closer
        // match with the user's history) besides its own: related tasks.
        let convert_logit = -1.6
            + f64::from(self.user_cvr[user])
            + f64::from(self.item_cvr[item])
            + f64::from(self.item_bias[item])
            + 0.8 * interest
            - 0.5 * (price / 20.0).ln();
        let class_probs = if self.classes > 0 {
            let k = self.classes;
            let logits: Vec<f64> = (0..k)
                .map(|c| f64::from(self.user_class[user * k + c]) + f64::from(self.item_class[item * k + c]))
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.iter().map(|v| v / sum).collect()
        } else {
            Vec::new()
        };
        Row {
            user,
            item,
            site,
            history,
            price,
            p_click: sigmoid(click_logit),
            p_convert: sigmoid(convert_logit),
            class_probs,
        }
    }
}

/// The labels a row was given.
struct Drawn {
    click: bool,
    converts: bool,
    class: usize,
}

fn header(shape: Shape) -> Vec<String> {
    let mut h: Vec<&str> = vec!["click"];
    if shape.tasks {
        h.extend(["conversion", "converts", "cvr"]);
    }
    if shape.classes.is_some() {
        h.push("ad_type");
    }
    h.extend(["user_id", "item_id", "item_category", "site"]);
    if shape.sequence {
        h.push("hist_items");
    }
    h.push("price");
    h.into_iter().map(String::from).collect()
}

fn write_row(out: &mut Vec<u8>, shape: Shape, world: &World, row: &Row, d: &Drawn) {
    let b = |v: bool| if v { "1" } else { "0" };
    let mut line = b(d.click).to_string();
    if shape.tasks {
        // `cvr`: the conversion where it is observed (a click), else masked.
        let cvr = if d.click { b(d.converts) } else { "" };
        line += &format!(",{},{},{cvr}", b(d.click && d.converts), b(d.converts));
    }
    if shape.classes.is_some() {
        line += &format!(",{}", d.class);
    }
    line += &format!(",u{},i{},c{},s{}", row.user, row.item, world.item_category[row.item], row.site);
    if shape.sequence {
        let ids: Vec<String> = row.history.iter().map(|h| format!("i{h}")).collect();
        line += &format!(",{}", ids.join("|"));
    }
    line += &format!(",{:.2}\n", row.price);
    out.extend_from_slice(line.as_bytes());
}

/// What one split's rows were: true probabilities and labels per task.
#[derive(Default)]
struct Split {
    click: (Vec<f64>, Vec<f32>),
    conversion: (Vec<f64>, Vec<f32>),
    class_best: Vec<f64>,
    class_labels: Vec<usize>,
}

fn write_split(world: &World, path: &Path, rows: u64, stream: u64, shape: Shape) -> Result<Split, DataError> {
    let file = File::create(path).map_err(|e| DataError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all((header(shape).join(",") + "\n").as_bytes()).map_err(|e| DataError::io(path, e))?;
    let mut rng = Rng::new(mix64(world.seed ^ (stream << 56) ^ 0x7a5c));
    let mut split = Split::default();
    let mut text = Vec::with_capacity(1 << 20);
    for _ in 0..rows {
        let row = world.row(&mut rng);
        let click = rng.next_f64() < row.p_click;
        let converts = rng.next_f64() < row.p_convert;
        let class = if row.class_probs.is_empty() {
            0
        } else {
            let (u, mut acc) = (rng.next_f64(), 0.0);
            row.class_probs
                .iter()
                .position(|p| {
                    acc += p;
                    u < acc
                })
                .unwrap_or(row.class_probs.len() - 1)
        };
        let drawn = Drawn { click, converts, class };
        write_row(&mut text, shape, world, &row, &drawn);
        split.click.0.push(row.p_click);
        split.click.1.push(f32::from(u8::from(click)));
        split.conversion.0.push(row.p_click * row.p_convert);
        split.conversion.1.push(f32::from(u8::from(click && converts)));
        if !row.class_probs.is_empty() {
            split.class_best.push(row.class_probs.iter().copied().fold(0.0, f64::max));
            split.class_labels.push(class);
        }
        if text.len() > (1 << 20) {
            w.write_all(&text).map_err(|e| DataError::io(path, e))?;
            text.clear();
        }
    }
    w.write_all(&text).map_err(|e| DataError::io(path, e))?;
    w.flush().map_err(|e| DataError::io(path, e))?;
    Ok(split)
}

/// Writes `dir/train.csv`, `dir/test.csv` and `dir/truth.json`.
pub fn generate_tasks(
    dir: &Path,
    train_rows: u64,
    test_rows: u64,
    shape: Shape,
    seed: u64,
) -> Result<TasksTruth, DataError> {
    if shape.classes.is_some_and(|k| !(2..=1000).contains(&k)) {
        return Err(DataError::io(dir, std::io::Error::other("--classes must be between 2 and 1000")));
    }
    std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    if !shape.click_shift.is_finite() {
        return Err(DataError::io(dir, std::io::Error::other("--click-shift must be a finite number")));
    }
    let world = World::new(seed, shape.classes.unwrap_or(0) as usize, shape.click_shift);
    let train = write_split(&world, &dir.join("train.csv"), train_rows, 1, shape)?;
    let test = write_split(&world, &dir.join("test.csv"), test_rows, 2, shape)?;
    let mean = |v: &[f32]| {
        if v.is_empty() { f64::NAN } else { v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64 }
    };
    let binary = |(p, l): &(Vec<f64>, Vec<f32>)| TaskTruth {
        bayes_auc: Some(auc_f64(p, l)),
        bayes_logloss: Some(log_loss_from_probs(p, l)),
        rate: mean(l),
        bayes_accuracy: None,
    };
    let mut tasks = std::collections::BTreeMap::new();
    tasks.insert("click".to_string(), binary(&test.click));
    if shape.tasks {
        tasks.insert("conversion".to_string(), binary(&test.conversion));
    }
    if let Some(k) = shape.classes {
        let mut counts = vec![0u64; k as usize];
        test.class_labels.iter().for_each(|&c| counts[c] += 1);
        let n = test.class_labels.len().max(1) as f64;
        tasks.insert(
            "ad_type".to_string(),
            TaskTruth {
                bayes_auc: None,
                bayes_logloss: None,
                rate: counts.iter().copied().max().unwrap_or(0) as f64 / n,
                bayes_accuracy: Some(test.class_best.iter().sum::<f64>() / n),
            },
        );
    }
    let truth = TasksTruth {
        truth: Truth {
            generator: GENERATOR.into(),
            seed,
            train_rows,
            test_rows,
            bayes_auc: auc_f64(&test.click.0, &test.click.1),
            bayes_logloss: log_loss_from_probs(&test.click.0, &test.click.1),
            test_ctr: mean(&test.click.1),
            train_ctr: mean(&train.click.1),
            vocab_sizes: vec![USERS as u64, ITEMS as u64, CATEGORIES as u64, SITES as u64],
            interaction_pairs: Vec::new(),
        },
        header: header(shape),
        tasks,
    };
    let path = dir.join("truth.json");
    let json = serde_json::to_string_pretty(&truth).map_err(|e| DataError::io(&path, std::io::Error::other(e)))?;
    std::fs::write(&path, json + "\n").map_err(|e| DataError::io(&path, e))?;
    Ok(truth)
}
