//! Numeric columns read for the model. `data.schema.dense_transform =
//! "standardize"`: the first pass's means and deviations are the columns'
//! (worked out here from the file), they are kept in the checkpoint's
//! config so evaluation reads as training did, a resumed run takes them
//! from its checkpoint, and given ones skip the pass.
//! `[[data.schema.buckets]]`: a column of numbers trains the model its
//! bucket numbers, written out as IDs, train.

use std::path::Path;

use sparrow_core::config::{DataFormat, DenseTransform, Schema, ValidationSet, held_out};
use sparrow_core::{Config, Overrides};
use sparrow_trainer::checkpoint::load_trainer;
use sparrow_trainer::{evaluate_checkpoint, train};

const DENSE: usize = 13;

fn config(data: &Path, dir: &Path, transform: DenseTransform) -> Config {
    let mut c = Config::default();
    c.data.format = DataFormat::Csv;
    c.data.train = Some(data.join("train.csv").display().to_string());
    c.data.test = Some(data.join("test.csv").display().to_string());
    c.data.schema = Some(Schema {
        dense: (1..=DENSE).map(|i| format!("I{i}")).collect(),
        sparse: (1..=26).map(|i| format!("C{i}")).collect(),
        dense_transform: transform,
        ..Schema::default()
    });
    c.model.kind = sparrow_core::config::ModelKind::named("mlp");
    c.model.embedding_dim = 4;
    c.model.hidden = vec![16];
    c.train.batch_size = 128;
    c.train.threads = 2;
    c.checkpoint.dir = Some(dir.display().to_string());
    c
}

/// Each dense column's mean and population deviation over the lines
/// `keep` admits (numbered from 1, the header being line 1), empty = 0.
fn column_stats(file: &Path, keep: impl Fn(u64) -> bool) -> Vec<[f64; 2]> {
    let text = std::fs::read_to_string(file).expect("csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let columns: Vec<usize> =
        (1..=DENSE).map(|i| header.iter().position(|h| *h == format!("I{i}")).expect("column")).collect();
    let mut values = vec![Vec::new(); DENSE];
    for (i, line) in lines.enumerate() {
        if !keep(i as u64 + 2) {
            continue;
        }
        let cells: Vec<&str> = line.split(',').collect();
        for (j, &c) in columns.iter().enumerate() {
            values[j].push(if cells[c].is_empty() { 0.0 } else { cells[c].parse::<f64>().expect("number") });
        }
    }
    values
        .iter()
        .map(|v| {
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
            [mean, var.sqrt()]
        })
        .collect()
}

fn saved_stats(dir: &Path) -> Vec<[f64; 2]> {
    let (t, _, _) = load_trainer(dir, &Overrides::none()).expect("load");
    t.config.data.schema.and_then(|s| s.standardize_stats).expect("statistics in the checkpoint")
}

fn close(a: &[[f64; 2]], b: &[[f64; 2]]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (0..2).all(|k| (x[k] - y[k]).abs() <= 1e-9 * (1.0 + y[k].abs())))
}

#[test]
fn the_first_pass_takes_each_columns_statistics_and_evaluation_reads_through_them() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    sparrow_data::synth::generate_days(&data, 3000, 500, 1, false, 7).expect("generate");
    let ck = tmp.path().join("ck");
    let s = train(&config(&data, &ck, DenseTransform::Standardize), true).expect("train");
    let stats = saved_stats(&ck);
    assert!(close(&stats, &column_stats(&data.join("train.csv"), |_| true)), "{stats:?}");
    // `sparrow eval` on the checkpoint reads the test file as training's
    // evaluation did: the same AUC to the bit.
    let scored = evaluate_checkpoint(&ck, &data.join("test.csv"), &Overrides::none(), None).expect("eval");
    assert_eq!(Some(scored.auc.to_bits()), s.test_auc.map(f64::to_bits));

    // Held-out rows are no training rows: they are left out of the pass.
    let mut held = config(&data, &tmp.path().join("held"), DenseTransform::Standardize);
    held.data.validation = Some(ValidationSet::Fraction(0.3));
    train(&held, true).expect("train");
    let expected = column_stats(&data.join("train.csv"), |line| !held_out(line, 0.3));
    assert!(close(&saved_stats(&tmp.path().join("held")), &expected));

    // Given statistics skip the pass and are what is applied: a mean of 0
    // and a deviation of 1 read every value as it is.
    let mut given = config(&data, &tmp.path().join("given"), DenseTransform::Standardize);
    if let Some(schema) = given.data.schema.as_mut() {
        schema.standardize_stats = Some(vec![[0.0, 1.0]; DENSE]);
    }
    let identity = train(&given, true).expect("train");
    let plain = train(&config(&data, &tmp.path().join("plain"), DenseTransform::None), true).expect("train");
    assert_eq!(identity.test_auc.map(f64::to_bits), plain.test_auc.map(f64::to_bits));
    assert_ne!(identity.test_auc, s.test_auc, "the first pass's statistics change what the model sees");
}

/// A resumed run reads its checkpoint's statistics, not the file's: the
/// same model as the uninterrupted run even when the training file has
/// changed under it since.
#[test]
fn a_resumed_run_keeps_its_checkpoints_statistics() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    sparrow_data::synth::generate_days(&data, 3000, 500, 1, false, 7).expect("generate");
    // 20 of the file's 24 batches: the rows appended below are never reached.
    let mut whole = config(&data, &tmp.path().join("full"), DenseTransform::Standardize);
    whole.train.max_steps = Some(20);
    let full = train(&whole, true).expect("full");
    let part = tmp.path().join("part");
    let mut first = config(&data, &part, DenseTransform::Standardize);
    first.train.max_steps = Some(9);
    train(&first, true).expect("first part");
    // Rows appended to the file after the cut would move a new pass's means.
    let text = std::fs::read_to_string(data.join("train.csv")).expect("csv");
    let extra: String = text.lines().skip(1).take(200).map(|l| format!("{l}\n")).collect();
    let moved = tmp.path().join("moved");
    std::fs::create_dir_all(&moved).expect("dir");
    std::fs::write(moved.join("train.csv"), text.clone() + &extra.replace(",0,", ",900,")).expect("write");
    let mut second = config(&data, &part, DenseTransform::Standardize);
    second.data.train = Some(moved.join("train.csv").display().to_string());
    second.checkpoint.resume_from = Some(part.display().to_string());
    second.train.max_steps = Some(full.steps);
    let resumed = train(&second, true).expect("resumed");
    assert_eq!(resumed.test_auc.map(f64::to_bits), full.test_auc.map(f64::to_bits));
    assert!(close(&saved_stats(&part), &saved_stats(&tmp.path().join("full"))));
}

/// `path` with a column `band` after the others: `cell(I3's cell)`.
fn with_band(path: &Path, out: &Path, cell: impl Fn(&str) -> String) {
    let text = std::fs::read_to_string(path).expect("csv");
    let mut lines = text.lines();
    let header = lines.next().expect("header");
    let i3 = header.split(',').position(|h| h == "I3").expect("I3");
    let mut written = format!("{header},band\n");
    for line in lines {
        let c = line.split(',').nth(i3).expect("cell");
        written.push_str(&format!("{line},{}\n", cell(c)));
    }
    std::fs::write(out, written).expect("write");
}

#[test]
fn a_bucketized_column_trains_the_model_of_its_bucket_ids() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    sparrow_data::synth::generate_days(&data, 3000, 500, 1, false, 7).expect("generate");
    let boundaries = [1.0, 5.0, 20.0, 100.0];
    let (raw, ids) = (tmp.path().join("raw"), tmp.path().join("ids"));
    for dir in [&raw, &ids] {
        std::fs::create_dir_all(dir).expect("dir");
    }
    for file in ["train.csv", "test.csv"] {
        with_band(&data.join(file), &raw.join(file), str::to_string);
        with_band(&data.join(file), &ids.join(file), |c| {
            sparrow_core::config::bucket_id(&boundaries, c.as_bytes()).expect("a number")
        });
    }
    let band = |data: &Path, dir: &str| {
        let mut c = config(data, &tmp.path().join(dir), DenseTransform::None);
        c.data.schema.as_mut().expect("schema").sparse.push("band".into());
        c
    };
    let mut bucketized = band(&raw, "a");
    bucketized.data.schema.as_mut().expect("schema").buckets =
        vec![sparrow_core::config::BucketField { column: "band".into(), boundaries: boundaries.to_vec() }];
    let a = train(&bucketized, true).expect("bucketized");
    let b = train(&band(&ids, "b"), true).expect("bucket IDs");
    assert_eq!(a.test_auc.map(f64::to_bits), b.test_auc.map(f64::to_bits));
    assert_eq!(a.embedding_rows, b.embedding_rows);
    // Without the buckets the column is its raw text: other IDs, other rows.
    let plain = train(&band(&raw, "c"), true).expect("raw");
    assert!(plain.embedding_rows > a.embedding_rows, "{} vs {}", plain.embedding_rows, a.embedding_rows);
    // A cell that is no number is a malformed row, named.
    let text = std::fs::read_to_string(raw.join("train.csv")).expect("csv");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines[1] = format!("{},old", lines[1].rsplit_once(',').expect("band").0);
    std::fs::write(raw.join("train.csv"), lines.join("\n") + "\n").expect("write");
    bucketized.data.max_bad_rows = 0;
    let err = train(&bucketized, true).expect_err("malformed").to_string();
    assert!(err.contains("`old` is not a number") && err.contains("band"), "{err}");
}

/// A signal during the first pass ends it (nothing is trained yet).
#[test]
fn a_stop_during_the_first_pass_ends_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    sparrow_data::synth::generate_days(&data, 500, 100, 1, false, 7).expect("generate");
    let c = config(&data, &tmp.path().join("ck"), DenseTransform::Standardize);
    let stop = std::sync::atomic::AtomicBool::new(true);
    let err = sparrow_trainer::standardize::with_dense_statistics(&c, &stop).expect_err("stopped");
    assert!(matches!(err, sparrow_trainer::TrainError::Interrupted { step: 0 }), "{err}");
    let run = sparrow_trainer::train_until(&c, true, &stop).expect_err("stopped");
    assert!(matches!(run, sparrow_trainer::TrainError::Interrupted { step: 0 }), "{run}");
}
