//! The config's parsing and validation, key by key.

use super::*;

fn parse(text: &str, sets: &[&str]) -> Result<Config, ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Overrides::parse(&sets).and_then(|o| Config::from_toml(text, "test.toml", &o))
}

#[test]
fn issue_example_parses() {
    let c = parse(
        r#"
        [data]
        format = "criteo"
        train = "a.tsv"
        test = "b.tsv"
        [model]
        kind = "dlrm"
        embedding_dim = 16
        hidden = [256, 128]
        [train]
        batch_size = 1024
        epochs = 1
        threads = 2
        seed = 1
        [embedding]
        optimizer = "adagrad"
        learning_rate = 0.05
        init = { kind = "uniform", scale = 0.01 }
        [dense_optimizer]
        kind = "adam"
        learning_rate = 0.001
        [checkpoint]
        dir = "ck"
        "#,
        &[],
    )
    .expect("parses");
    assert_eq!(c.model.kind, ModelKind::named("dlrm"));
    assert_eq!(c.data.train.as_deref(), Some("a.tsv"));
    assert_eq!(c.checkpoint.dir.as_deref(), Some("ck"));
}

#[test]
fn overrides_numbers_and_bare_words() {
    let c =
        parse("", &["embedding.learning_rate=0.1", "embedding.optimizer=adam", "model.hidden=[8]"]).expect("parses");
    assert_eq!(c.embedding.learning_rate, 0.1);
    assert_eq!(c.embedding.optimizer, SparseOptimizerKind::Adam);
    assert_eq!(c.model.hidden, vec![8]);
}

/// An override is one dotted key and one value: a key with a line
/// break, spaces or brackets, or a value that smuggles a table in, is
/// refused (it was read as `train.seed = 1` with the rest dropped).
#[test]
fn overrides_are_one_dotted_key_and_one_value() {
    for bad in [
        "train.seed=1\n[evil]\nx=2",
        "train.seed=1\n[evil]\nx",
        "train.se ed=1",
        "train.[seed]=1",
        "train\n.seed=1",
        "data.train=a\nb",
    ] {
        let err = parse("", &[bad]).expect_err(bad);
        assert!(matches!(err, ConfigError::BadAssignment { .. }), "{bad:?}: {err}");
    }
    let c = parse("", &["train.seed=7", "data.train=/data/day-1.tsv", "model.hidden=[8, 4]"]).expect("parses");
    assert_eq!(c.train.seed, 7);
    assert_eq!(c.data.train.as_deref(), Some("/data/day-1.tsv"));
}

#[test]
fn unknown_key_is_named() {
    let err = parse("[train]\nbatch_sise = 3\n", &[]).expect_err("unknown key");
    assert!(err.to_string().contains("batch_sise"), "{err}");
    let err = parse("", &["embeding.learning_rate=1"]).expect_err("unknown section");
    assert!(err.to_string().contains("embeding"), "{err}");
}

#[test]
fn wrong_type_is_reported() {
    let err = parse("[train]\nbatch_size = \"big\"\n", &[]).expect_err("wrong type");
    let msg = err.to_string();
    assert!(msg.contains("batch_size") || msg.contains("invalid type"), "{msg}");
    assert!(parse("", &["nokey"]).is_err());
    assert!(parse("", &["train.batch_size=0"]).is_err());
}

/// `embedding.rounding`: stochastic needs half rows; an unknown value is
/// refused naming the key.
#[test]
fn stochastic_rounding_needs_half_rows() {
    let c = parse("", &["embedding.dtype=\"bf16\"", "embedding.rounding=\"stochastic\""]).expect("parses");
    assert_eq!(c.embedding.rounding, Rounding::Stochastic);
    assert_eq!(parse("", &[]).expect("parses").embedding.rounding, Rounding::Nearest);
    let err = parse("", &["embedding.rounding=\"stochastic\""]).expect_err("f32 rows");
    assert!(err.to_string().contains("embedding.rounding") && err.to_string().contains("embedding.dtype"), "{err}");
    let err = parse("", &["embedding.rounding=\"random\""]).expect_err("unknown");
    assert!(err.to_string().contains("embedding.rounding"), "{err}");
}

#[test]
fn feature_filter_limits_are_named() {
    let c = parse("", &["embedding.admit_min_count=5", "embedding.ttl_steps=1000"]).expect("parses");
    assert_eq!((c.embedding.admit_min_count, c.embedding.ttl_steps), (5, 1000));
    let err = parse("", &["embedding.admit_min_count=300"]).expect_err("too many");
    assert!(err.to_string().contains("embedding.admit_min_count"), "{err}");
    let ssd = ["embedding.storage=ssd", "embedding.path=\"x\"", "embedding.ttl_steps=10"];
    assert_eq!(parse("", &ssd).expect("ttl on ssd").embedding.ttl_steps, 10);
    assert_eq!(parse("", &["train.pipeline_depth=16"]).expect("parses").train.pipeline_depth, 16);
    let err = parse("", &["train.pipeline_depth=17"]).expect_err("too deep");
    assert!(err.to_string().contains("train.pipeline_depth"), "{err}");
}

#[test]
fn nonsense_numbers_are_refused_naming_the_key() {
    for (set, key) in [
        ("embedding.learning_rate=nan", "embedding.learning_rate"),
        ("embedding.learning_rate=inf", "embedding.learning_rate"),
        ("embedding.learning_rate=-0.1", "embedding.learning_rate"),
        ("dense_optimizer.learning_rate=-inf", "dense_optimizer.learning_rate"),
        ("dense_optimizer.learning_rate=nan", "dense_optimizer.learning_rate"),
        ("dense_optimizer.eps=-1.0", "dense_optimizer.eps"),
        ("train.epochs=0", "train.epochs"),
        ("data.num_fields=0", "data.num_fields"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("checkpoint.dir=\"\"", "checkpoint.dir"),
        ("data.train=\"\"", "data.train"),
        ("data.test=\" \"", "data.test"),
        ("train.metrics_path=\"\"", "train.metrics_path"),
        ("train.tensorboard_dir=\"\"", "train.tensorboard_dir"),
        ("embedding.path=\"\"", "embedding.path"),
        ("checkpoint.resume_from=\"\"", "checkpoint.resume_from"),
        ("checkpoint.export_every_secs=5", "checkpoint.export_every_secs"),
        ("train.online_window_samples=1000000000000", "train.online_window_samples"),
        // Record time comes from a stream only.
        ("embedding.ttl_secs=60", "embedding.ttl_secs"),
        ("embedding.l2=-0.1", "embedding.l2"),
        ("model.dropout=1.0", "model.dropout"),
        ("model.dropout=-0.5", "model.dropout"),
        ("model.dropout=nan", "model.dropout"),
        ("model.batch_norm_momentum=0.0", "model.batch_norm_momentum"),
        ("model.batch_norm_momentum=1.5", "model.batch_norm_momentum"),
        ("model.batch_norm_momentum=nan", "model.batch_norm_momentum"),
        ("train.schedule.kind=\"cosine\"", "train.schedule.decay_steps"),
        ("train.schedule.kind=\"step\"", "train.schedule.step_every"),
        ("dense_optimizer.kind=\"lamb\"", "dense_optimizer.kind"),
    ] {
        let err = parse("", &[set]).expect_err(set);
        assert!(err.to_string().contains(key), "{set}: {err}");
    }
    // FTRL keeps its own rates: a schedule of the rows' rate is refused
    // (a dense-only one is not).
    let ftrl = ["embedding.optimizer=\"ftrl\"", "train.schedule.warmup_steps=10"];
    let err = parse("", &ftrl).expect_err("ftrl under a schedule").to_string();
    assert!(err.contains("train.schedule.embedding"), "{err}");
    assert!(parse("", &[ftrl[0], ftrl[1], "train.schedule.embedding=false"]).is_ok());
    let c = parse("", &["train.on_non_finite=skip_batch"]).expect("parses");
    assert_eq!(c.train.on_non_finite, OnNonFinite::SkipBatch);
    assert!(parse("", &["train.on_non_finite=ignore"]).is_err());
}

/// `data.validation` reads a path or a fraction; early stopping without
/// what it needs, or with values that cannot be right, is refused by key.
#[test]
fn validation_and_early_stopping_are_checked_by_key() {
    let base = "[data]\ntrain = \"a.tsv\"\n";
    let c = parse(base, &["data.validation=0.1"]).expect("a fraction");
    assert_eq!(c.data.validation, Some(ValidationSet::Fraction(0.1)));
    let c = parse(base, &["data.validation=\"v.tsv\""]).expect("a file");
    assert_eq!(c.data.validation, Some(ValidationSet::File("v.tsv".into())));
    let ok = ["data.validation=0.2", "checkpoint.dir=\"ck\"", "train.early_stopping.patience=3"];
    let c = parse(base, &ok).expect("complete");
    assert_eq!(c.train.early_stopping.as_ref().map(|e| e.patience), Some(3));
    let refused: [(&[&str], &str); 7] = [
        (&["data.validation=1.5"], "data.validation"),
        (&["data.validation=0"], "data.validation"),
        (&["train.early_stopping.patience=2", "checkpoint.dir=\"ck\""], "needs data.validation"),
        (&["train.early_stopping.patience=2", "data.validation=0.1"], "needs checkpoint.dir"),
        (&["data.validation=0.1", "checkpoint.dir=\"ck\"", "train.early_stopping.patience=0"], "patience"),
        (&["data.validation=0.1", "checkpoint.dir=\"ck\"", "train.early_stopping.task=\"buy\""], "no task is named"),
        (&["data.validation=0.1", "checkpoint.dir=\"ck\"", "train.early_stopping.metric=\"gauc\""], "metric"),
    ];
    for (sets, needle) in refused {
        let err = parse(base, sets).expect_err(needle).to_string();
        assert!(err.contains(needle), "{sets:?}: {err}");
    }
    let err = parse(base, &["train.eval_every_steps=10"]).expect_err("nothing to evaluate").to_string();
    assert!(err.contains("data.validation or data.test"), "{err}");
}

/// `standardize` applies to a schema's columns: given statistics must
/// match them, and a file format without a schema is refused by key.
#[test]
fn standardize_settings_are_checked_by_key() {
    let csv = "[data]\nformat = \"csv\"\ntrain = \"a.csv\"\n[data.schema]\ndense = [\"a\", \"b\"]\n";
    parse(csv, &["data.schema.dense_transform=\"standardize\""]).expect("csv");
    let refused: [(&str, &[&str], &str); 3] = [
        (csv, &["data.schema.standardize_stats=[[0.0, 1.0]]"], "2 dense columns"),
        (csv, &["data.schema.standardize_stats=[[0.0, 1.0], [1.0, -2.0]]"], "std >= 0"),
        ("[data]\ntrain = \"a.tsv\"\n", &["data.schema.dense_transform=\"standardize\""], "csv and parquet"),
    ];
    for (text, sets, needle) in refused {
        let err = parse(text, sets).expect_err(needle).to_string();
        assert!(err.contains(needle) && err.contains("data.schema"), "{sets:?}: {err}");
    }
}

/// Buckets name a sparse column and increasing finite boundaries.
#[test]
fn buckets_are_checked_by_key() {
    let csv = "[data]\nformat = \"csv\"\ntrain = \"a.csv\"\n[data.schema]\nsparse = [\"age\"]\n";
    let with = |b: &str| format!("{csv}[[data.schema.buckets]]\n{b}\n");
    parse(&with("column = \"age\"\nboundaries = [18, 30]"), &[]).expect("good");
    for (b, needle) in [
        ("column = \"height\"\nboundaries = [1]", "not a column of data.schema.sparse"),
        ("column = \"age\"\nboundaries = []", "one or more finite"),
        ("column = \"age\"\nboundaries = [30, 18]", "must increase"),
    ] {
        let err = parse(&with(b), &[]).expect_err(needle).to_string();
        assert!(err.contains(needle) && err.contains("data.schema.buckets"), "{err}");
    }
}
