//! The readers on real public CTR rows (Criteo Kaggle, Criteo CSV, Avazu) and
//! on Parquet, libsvm and libffm files written here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sparrow_core::Batch;
use sparrow_core::Config;
use sparrow_core::config::{DataConfig, DataFormat, Schema};
use sparrow_data::{BadRows, BatchStream, DataError};

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(name)
}

fn read_all(path: &Path, config: &DataConfig, batch: usize, bad: &BadRows) -> Result<Vec<Batch>, DataError> {
    BatchStream::spawn(path, &Config::with_data(config.clone()), batch, Default::default(), 1, bad.clone())?.collect()
}

fn criteo_schema() -> Schema {
    Schema {
        label: "label".into(),
        dense: (1..=13).map(|i| format!("I{i}")).collect(),
        sparse: (1..=26).map(|i| format!("C{i}")).collect(),
        ..Schema::default()
    }
}

#[test]
fn criteo_kaggle_rows_with_cut_off_trailing_fields_all_parse() {
    let bad = BadRows::new(0, 5);
    let batches = read_all(&testdata("criteo-kaggle-first1000.tsv"), &DataConfig::default(), 128, &bad).expect("reads");
    let rows: usize = batches.iter().map(Batch::rows).sum();
    assert_eq!(rows, 1000);
    assert_eq!(bad.total(), 0);
    assert_eq!(batches.len(), 8);
    let b = &batches[0];
    assert_eq!((b.num_fields, b.num_dense), (26, 13));
    assert_eq!(b.keys.len(), b.rows() * 26, "one key per field, missing values included");
    let positives: f32 = batches.iter().flat_map(|b| b.labels.iter()).sum();
    assert!(positives > 100.0 && positives < 500.0, "{positives} clicks");
    assert!(b.dense.iter().all(|x| x.is_finite() && *x >= 0.0));
    // The stream reports where it stands: the last batch ends at the file's end.
    let len = std::fs::metadata(testdata("criteo-kaggle-first1000.tsv")).expect("size").len();
    assert_eq!(batches.last().map(|b| b.end.offset), Some(len));
    assert_eq!(batches.last().map(|b| b.end.line), Some(1001));
}

#[test]
fn criteo_csv_with_header_and_schema() {
    let config = DataConfig { format: DataFormat::Csv, schema: Some(criteo_schema()), ..Default::default() };
    let bad = BadRows::new(0, 5);
    let batches = read_all(&testdata("criteo-sample-200.csv"), &config, 64, &bad).expect("reads");
    assert_eq!(batches.iter().map(Batch::rows).sum::<usize>(), 200);
    assert_eq!(batches[0].num_dense, 13);
    // First row: I1 empty, I2 = 3, I3 = 260.0 — raw by default, log1p on request.
    assert_eq!(&batches[0].dense[..3], &[0.0, 3.0, 260.0]);
    let mut schema = criteo_schema();
    schema.dense_transform = sparrow_core::config::DenseTransform::Log1p;
    let config = DataConfig { format: DataFormat::Csv, schema: Some(schema), ..Default::default() };
    let logged = read_all(&testdata("criteo-sample-200.csv"), &config, 64, &bad).expect("reads");
    assert_eq!(&logged[0].dense[..3], &[0.0, 4f32.ln(), 261f32.ln()]);
}

#[test]
fn avazu_csv_all_categorical() {
    let schema = Schema {
        label: "click".into(),
        dense: vec![],
        sparse: [
            "hour",
            "C1",
            "banner_pos",
            "site_id",
            "site_domain",
            "site_category",
            "app_id",
            "device_model",
            "C14",
            "C17",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        ..Schema::default()
    };
    let config = DataConfig { format: DataFormat::Csv, schema: Some(schema), ..Default::default() };
    let bad = BadRows::new(0, 5);
    let batches = read_all(&testdata("avazu-sample-100.csv"), &config, 1000, &bad).expect("reads");
    assert_eq!(batches[0].rows(), 100);
    assert_eq!(batches[0].num_fields, 10);
}

#[test]
fn schema_column_missing_from_header_is_named() {
    let mut schema = criteo_schema();
    schema.sparse.push("C99".into());
    let config = DataConfig { format: DataFormat::Csv, schema: Some(schema), ..Default::default() };
    let err = read_all(&testdata("criteo-sample-200.csv"), &config, 64, &BadRows::new(0, 5)).expect_err("C99");
    assert!(err.to_string().contains("C99") && err.to_string().contains("criteo-sample-200.csv"), "{err}");
}

#[test]
fn malformed_rows_are_skipped_within_budget_and_stop_the_job_past_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("bad.tsv");
    let good = "1\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\ta\tb";
    let text = format!("{good}\n7\tfoo\n{good}\n0\tnot-an-int\n{good}\n");
    std::fs::write(&path, text).expect("write");
    let bad = BadRows::new(2, 5);
    let batches = read_all(&path, &DataConfig::default(), 10, &bad).expect("within budget");
    assert_eq!(batches.iter().map(Batch::rows).sum::<usize>(), 3);
    assert_eq!(bad.total(), 2);

    let tight = BadRows::new(1, 5);
    let err = read_all(&path, &DataConfig::default(), 10, &tight).expect_err("over budget");
    let msg = err.to_string();
    assert!(msg.contains("bad.tsv") && msg.contains("line 4") && msg.contains("I1"), "{msg}");
}

#[test]
fn an_oversized_line_is_a_bad_row_and_reading_goes_on() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("huge.tsv");
    let good = "1\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\ta\tb";
    let huge = "x".repeat(3 << 20);
    std::fs::write(&path, format!("{good}\n{huge}\n{good}\n")).expect("write");
    let bad = BadRows::new(5, 5);
    let batches = read_all(&path, &DataConfig::default(), 10, &bad).expect("reads");
    assert_eq!(batches.iter().map(Batch::rows).sum::<usize>(), 2);
    assert_eq!(bad.total(), 1);
    assert_eq!(batches.last().map(|b| b.end.line), Some(4), "line numbers stay right after the skip");
    let err = read_all(&path, &DataConfig::default(), 10, &BadRows::new(0, 5)).expect_err("over budget");
    assert!(err.to_string().contains("line 2") && err.to_string().contains("limit"), "{err}");
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let err = BatchStream::spawn(
        Path::new("/nonexistent/train.tsv"),
        &Config::default(),
        8,
        Default::default(),
        1,
        BadRows::new(0, 1),
    )
    .err()
    .expect("missing file");
    assert!(err.to_string().contains("/nonexistent/train.tsv"), "{err}");
}

#[test]
fn stream_resumes_exactly_at_a_batch_boundary() {
    let path = testdata("criteo-kaggle-first1000.tsv");
    let config = DataConfig::default();
    let all = read_all(&path, &config, 100, &BadRows::new(0, 1)).expect("reads");
    let resumed: Vec<Batch> =
        BatchStream::spawn(&path, &Config::with_data(config.clone()), 100, all[3].end, 1, BadRows::new(0, 1))
            .expect("opens")
            .collect::<Result<_, _>>()
            .expect("reads");
    assert_eq!(resumed.len(), all.len() - 4);
    for (a, b) in all[4..].iter().zip(&resumed) {
        assert_eq!(a.keys, b.keys);
        assert_eq!(a.labels, b.labels);
        assert_eq!(a.end, b.end);
    }
}

#[test]
fn libsvm_and_libffm_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let svm = dir.path().join("a.libsvm");
    std::fs::write(&svm, "+1 1:0.5 7:1\n-1 3:2\n0 2:1 9:0.25 11:1\n").expect("write");
    let config = DataConfig { format: DataFormat::Libsvm, ..Default::default() };
    let b = read_all(&svm, &config, 10, &BadRows::new(0, 1)).expect("reads");
    assert_eq!(b[0].labels, vec![1.0, 0.0, 0.0]);
    assert_eq!(b[0].bag(2, 0).len(), 3, "multi-hot field");

    let ffm = dir.path().join("a.libffm");
    std::fs::write(&ffm, "1 0:1:1 1:5:1 1:6:0.5\n0 2:3:1\n").expect("write");
    let config = DataConfig { format: DataFormat::Libffm, num_fields: Some(3), ..Default::default() };
    let b = read_all(&ffm, &config, 10, &BadRows::new(0, 1)).expect("reads");
    assert_eq!(b[0].bag(0, 1).len(), 2);
    assert_eq!(b[0].bag(1, 2).len(), 1);
}

/// Writes a Parquet file with the parquet crate: a label, a dense double, a
/// string ID column and a list column (multi-hot).
fn write_parquet(path: &Path, rows: &[(i32, f64, &str, Vec<&str>)]) {
    use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int32Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    let schema = Arc::new(
        parse_message_type(
            "message ctr {
                REQUIRED INT32 label;
                REQUIRED DOUBLE price;
                REQUIRED BYTE_ARRAY site (UTF8);
                OPTIONAL GROUP tags (LIST) { REPEATED GROUP list { OPTIONAL BYTE_ARRAY element (UTF8); } }
            }",
        )
        .expect("schema"),
    );
    let file = std::fs::File::create(path).expect("create");
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build())).expect("writer");
    let mut rg = writer.next_row_group().expect("row group");
    let mut col = rg.next_column().expect("col").expect("label");
    col.typed::<Int32Type>().write_batch(&rows.iter().map(|r| r.0).collect::<Vec<_>>(), None, None).expect("label");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("price");
    col.typed::<DoubleType>().write_batch(&rows.iter().map(|r| r.1).collect::<Vec<_>>(), None, None).expect("price");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("site");
    let sites: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r.2)).collect();
    col.typed::<ByteArrayType>().write_batch(&sites, None, None).expect("site");
    col.close().expect("close");
    // List: definition level 3 = present element, 1 = empty list; repetition 0 starts a row.
    let (mut values, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        if r.3.is_empty() {
            def.push(1);
            rep.push(0);
        }
        for (i, t) in r.3.iter().enumerate() {
            values.push(ByteArray::from(*t));
            def.push(3);
            rep.push(if i == 0 { 0 } else { 1 });
        }
    }
    let mut col = rg.next_column().expect("col").expect("tags");
    col.typed::<ByteArrayType>().write_batch(&values, Some(&def), Some(&rep)).expect("tags");
    col.close().expect("close");
    rg.close().expect("row group");
    writer.close().expect("file");
}

#[test]
fn parquet_with_schema_mapping_and_list_column() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("ctr.parquet");
    write_parquet(&path, &[(1, 2.5, "a.com", vec!["x", "y"]), (0, 0.0, "b.com", vec![]), (1, 1.0, "a.com", vec!["z"])]);
    let schema = Schema {
        label: "label".into(),
        dense: vec!["price".into()],
        sparse: vec!["site".into(), "tags".into()],
        ..Schema::default()
    };
    let config = DataConfig { format: DataFormat::Parquet, schema: Some(schema.clone()), ..Default::default() };
    let b = read_all(&path, &config, 2, &BadRows::new(0, 1)).expect("reads");
    assert_eq!(b.len(), 2);
    assert_eq!(b[0].labels, vec![1.0, 0.0]);
    assert_eq!(b[0].dense, vec![2.5, 0.0]);
    assert_eq!(b[0].bag(0, 1).len(), 2, "list column is multi-hot");
    assert_eq!(b[0].bag(1, 1).len(), 0, "empty list is an empty bag");
    assert_eq!(b[1].keys[0], b[0].keys[0], "same site, same key");
    // Resume after the first batch.
    let rest: Vec<Batch> =
        BatchStream::spawn(&path, &Config::with_data(config.clone()), 2, b[0].end, 1, BadRows::new(0, 1))
            .expect("opens")
            .collect::<Result<_, _>>()
            .expect("reads");
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].keys, b[1].keys);
    // A column the file lacks is named.
    let mut wrong = schema;
    wrong.sparse.push("user".into());
    let config = DataConfig { format: DataFormat::Parquet, schema: Some(wrong), ..Default::default() };
    let err = read_all(&path, &config, 2, &BadRows::new(0, 1)).expect_err("no user column");
    assert!(err.to_string().contains("user"), "{err}");
}

/// Parquet with the issue-41 keys: a list column read as a behaviour
/// sequence (the newest `max_len` IDs, keyed as the field its `table`
/// names, truncations counted) and a label read by its task's kind (a
/// class id past `classes` is a bad row).
#[test]
fn parquet_sequences_and_task_labels() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("beh.parquet");
    write_parquet(
        &path,
        &[(1, 2.5, "a.com", vec!["b.com", "a.com"]), (3, 0.0, "b.com", vec![]), (0, 1.0, "b.com", vec!["c.com"])],
    );
    let text = format!(
        r#"
        [data]
        format = "parquet"
        train = "{}"
        [data.schema]
        labels = ["label"]
        dense = ["price"]
        sparse = ["site"]
        sequence = [{{ field = "tags", table = "site", max_len = 1 }}]
        [model]
        kind = "mlp"
        [[model.tasks]]
        name = "label"
        kind = "multiclass"
        classes = 2
        "#,
        path.display()
    );
    let job = Config::from_toml(&text, "t.toml", &sparrow_core::Overrides::none()).expect("config");
    let bad = BadRows::new(10, 0);
    let b: Vec<Batch> = BatchStream::spawn(&path, &job, 8, Default::default(), 1, bad.clone())
        .expect("opens")
        .collect::<Result<_, _>>()
        .expect("reads");
    assert_eq!(b.len(), 1);
    let b = &b[0];
    assert_eq!((b.rows(), b.num_fields), (2, 2));
    assert_eq!(b.labels, vec![1.0, 0.0]);
    assert_eq!(bad.total(), 1, "the class id 3 of two classes");
    // Row 0 keeps its newest ID, "a.com", keyed as the site field keys it.
    let seq: Vec<u64> = b.bag(0, 1).map(|k| b.keys[k]).collect();
    assert_eq!(seq, vec![sparrow_core::feature_key(0, b"a.com")]);
    assert_eq!(b.keys[b.bag(0, 0).start], seq[0], "a.com as the site and in the history: one key");
    assert_eq!(b.keys[b.bag(1, 1).start], sparrow_core::feature_key(0, b"c.com"));
    assert_eq!(b.truncated_sequences, 1);
}

/// A dense column of the wrong type used to fail every row (one warning per
/// row until the bad-row budget ran out); it is one schema error now.
#[test]
fn a_parquet_type_mismatch_is_one_schema_error_not_one_per_row() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("ctr.parquet");
    write_parquet(&path, &[(1, 2.5, "a.com", vec!["x"]), (0, 0.0, "b.com", vec![])]);
    for (label, dense) in [("label", "tags"), ("tags", "price")] {
        let schema =
            Schema { label: label.into(), dense: vec![dense.into()], sparse: vec!["site".into()], ..Schema::default() };
        let config = DataConfig { format: DataFormat::Parquet, schema: Some(schema), ..Default::default() };
        let bad = BadRows::new(1_000_000, 5);
        let err = read_all(&path, &config, 2, &bad).expect_err("a list is no number");
        let msg = err.to_string();
        assert!(msg.contains("column `tags`") && msg.contains("group or list"), "{msg}");
        assert_eq!(bad.total(), 0, "no row was tried");
    }
}

/// `[data.weighting]` on Parquet: an INT64 column of Unix seconds; identical
/// rows of a day merge, a week-old row is dropped, a future time is a bad row.
#[test]
fn parquet_timestamps_weigh_merge_and_drop() {
    use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("dated.parquet");
    let day = 86_400i64;
    let newest = 1_700_000_000 - 1_700_000_000 % day + day - 1;
    let rows: [(i32, i64, &str); 5] = [
        (1, newest - 3600, "a.com"),
        (1, newest, "a.com"),           // the same sample the same day: merged, count 2
        (0, newest - 7 * day, "b.com"), // e^-7 < 0.001: dropped
        (1, 4_000_000_000, "c.com"),    // in the future: a bad row
        (0, newest - day, "d.com"),     // a day old: weight e^-1
    ];
    let schema = Arc::new(
        parse_message_type(
            "message dated { REQUIRED INT32 label; REQUIRED INT64 ts; REQUIRED BYTE_ARRAY site (UTF8); }",
        )
        .expect("schema"),
    );
    let file = std::fs::File::create(&path).expect("create");
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build())).expect("writer");
    let mut rg = writer.next_row_group().expect("row group");
    let mut col = rg.next_column().expect("col").expect("label");
    col.typed::<Int32Type>().write_batch(&rows.map(|r| r.0), None, None).expect("label");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("ts");
    col.typed::<Int64Type>().write_batch(&rows.map(|r| r.1), None, None).expect("ts");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("site");
    col.typed::<ByteArrayType>().write_batch(&rows.map(|r| ByteArray::from(r.2)), None, None).expect("site");
    col.close().expect("close");
    rg.close().expect("row group");
    writer.close().expect("file");

    let schema = Schema {
        label: "label".into(),
        sparse: vec!["site".into()],
        timestamp: Some("ts".into()),
        ..Schema::default()
    };
    let config = DataConfig {
        format: DataFormat::Parquet,
        train: Some(path.display().to_string()),
        schema: Some(schema),
        weighting: Some(sparrow_core::config::WeightingConfig::default()),
        ..Default::default()
    };
    let bad = BadRows::new(5, 5);
    let b = read_all(&path, &config, 10, &bad).expect("reads");
    assert_eq!(bad.total(), 1, "the future time");
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].labels, vec![1.0, 0.0]);
    let w = b[0].sample_weights.as_ref().expect("weights");
    assert!((w[0] - 2.0).abs() < 1e-6, "count 2, age 0: {w:?}");
    assert!((f64::from(w[1]) - (-1.0f64).exp()).abs() < 1e-6, "a day old: {w:?}");
    assert_eq!(bad.weighting.merged.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(bad.weighting.dropped.load(std::sync::atomic::Ordering::Relaxed), 1);
}
