//! Writes the seed inputs of `fuzz/corpus/` (run by hand, then commit):
//! `cargo test --release -p sparrow-fuzz --test write_seeds -- --ignored`.
//! Each seed is a valid input of its target, so fuzzing starts from the
//! shapes real data and real messages have.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message;
use sparrow_proto::v1 as pb;

fn corpus(target: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    dir
}

fn seed(target: &str, name: &str, bytes: &[u8]) {
    std::fs::write(corpus(target).join(name), bytes).expect("write seed");
}

fn testdata(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(name)).expect("testdata")
}

fn first_lines(bytes: &[u8], n: usize) -> Vec<u8> {
    let text = String::from_utf8_lossy(bytes);
    text.lines().take(n).map(|l| format!("{l}\n")).collect::<String>().into_bytes()
}

fn write_parquet(path: &Path) {
    use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int32Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = Arc::new(
        parse_message_type(
            "message ctr { REQUIRED INT32 y; REQUIRED DOUBLE x; REQUIRED BYTE_ARRAY a (UTF8);
             OPTIONAL GROUP b (LIST) { REPEATED GROUP list { OPTIONAL BYTE_ARRAY element (UTF8); } } }",
        )
        .expect("schema"),
    );
    let file = std::fs::File::create(path).expect("create");
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build())).expect("writer");
    let mut rg = writer.next_row_group().expect("row group");
    let mut col = rg.next_column().expect("col").expect("y");
    col.typed::<Int32Type>().write_batch(&[1, 0], None, None).expect("y");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("x");
    col.typed::<DoubleType>().write_batch(&[0.5, 2.0], None, None).expect("x");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("a");
    col.typed::<ByteArrayType>().write_batch(&[ByteArray::from("u1"), ByteArray::from("u2")], None, None).expect("a");
    col.close().expect("close");
    let mut col = rg.next_column().expect("col").expect("b");
    let values = [ByteArray::from("t1"), ByteArray::from("t2")];
    col.typed::<ByteArrayType>().write_batch(&values, Some(&[3, 3, 1]), Some(&[0, 1, 0])).expect("b");
    col.close().expect("close");
    rg.close().expect("row group");
    writer.close().expect("file");
}

#[test]
#[ignore = "writes the committed seed corpus; run by hand"]
fn write_seed_corpus() {
    let criteo = testdata("criteo-kaggle-first1000.tsv");
    let lines = first_lines(&criteo, 20);
    for (i, line) in String::from_utf8_lossy(&lines).lines().take(3).enumerate() {
        seed("line_parsers", &format!("criteo-{i}"), line.as_bytes());
    }
    seed("line_parsers", "csv", b"1,0.5,u1|u2,\"q,\"\"x\"");
    seed("line_parsers", "libsvm", b"1 3:0.5 17:1 2:-2e3");
    seed("line_parsers", "libffm", b"-1 0:3:0.5 3:17:1 1:2:1");

    seed("text_file", "criteo.tsv", &lines);
    seed("text_file", "criteo-no-newline.tsv", lines.strip_suffix(b"\n").unwrap_or(&lines));
    seed("text_file", "bom.csv", b"\xef\xbb\xbfy,x,a,b\r\n1,0.5,u1,t1|t2\r\n0,,u2,\r\n");
    seed("text_file", "avazu.csv", &first_lines(&testdata("avazu-sample-100.csv"), 5));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&lines).expect("gzip");
    seed("text_file", "criteo.tsv.gz", &gz.finish().expect("gzip"));
    let zst = ruzstd::encoding::compress_to_vec(&lines[..], ruzstd::encoding::CompressionLevel::Fastest);
    seed("text_file", "criteo.tsv.zst", &zst);

    write_parquet(&corpus("parquet_file").join("two-rows.parquet"));

    for name in ["dlrm.toml", "reference-mlp.toml", "criteo-sample-csv.toml"] {
        let text = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name)).expect("cfg");
        seed("config", name, &text);
    }
    seed("config", "override", b"embedding.learning_rate=0.1");

    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let batch = pb::WorkerBatch {
        one_key_per_bag: false,
        batch_id: 7,
        rows: 2,
        num_fields: 2,
        num_dense: 1,
        labels: f32s(&[1.0, 0.0]),
        dense: f32s(&[0.5, 1.5]),
        bag_offsets: u32s(&[0, 1, 3, 4, 5]),
        has_key_weights: false,
        key_weights: Vec::new(),
        inverse: u32s(&[0, 1, 2, 0, 1]),
        shard_counts: vec![2, 1],
        keys: Vec::new(),
        end: Some(pb::DataPosition { epoch: 0, offset: 120, line: 3, skip: 0 }),
        bad_rows: 0,
        ..Default::default()
    };
    seed("worker_batch", "two-rows", &batch.encode_to_vec());
    let one_key =
        pb::WorkerBatch { one_key_per_bag: true, bag_offsets: Vec::new(), inverse: u32s(&[0, 1, 2, 0]), ..batch };
    seed("worker_batch", "one-key-per-bag", &one_key.encode_to_vec());

    let page = pb::ExportReply {
        keys: [3u64, 9].iter().flat_map(|k| k.to_le_bytes()).collect(),
        rows: f32s(&[0.1, 0.2, 0.3, 0.4]),
        done: false,
        next_shard_cursor: 1,
        next_slot_cursor: 4,
        last_uses: [5u64, 6].iter().flat_map(|k| k.to_le_bytes()).collect(),
        has_filters: true,
        filter_tick: 12,
        sketch_count: 2,
        sketches: vec![1, 2, 3, 4],
    };
    seed("export_reply", "page", &page.encode_to_vec());

    // A real embeddings.bin: the target's own template checkpoint.
    sparrow_fuzz::checkpoint_embeddings(b"");
    let template = std::env::temp_dir().join(format!("sparrow-fuzz-{}-template/ck", std::process::id()));
    let version = sparrow_trainer::checkpoint::resolve(&template).expect("template checkpoint");
    seed("checkpoint_embeddings", "lr-300-rows.bin", &std::fs::read(version.join("embeddings.bin")).expect("rows"));

    // A real export of that checkpoint: its rows and its manifest.
    sparrow_fuzz::export_manifest(b"");
    let export = std::env::temp_dir().join(format!("sparrow-fuzz-{}-export", std::process::id()));
    seed("export_embeddings", "lr-300-rows.bin", &std::fs::read(export.join("embeddings.bin")).expect("rows"));
    seed("export_manifest", "manifest.json", &std::fs::read(export.join("manifest.json")).expect("manifest"));

    let request = br#"{"id": "r1", "inputs": [{"name": "I1", "datatype": "FP32", "shape": [2], "data": [1, NaN]},
        {"name": "C1", "datatype": "BYTES", "shape": [2], "data": ["a", null]}],
        "outputs": [{"name": "probability", "parameters": {"binary_data": true}}]}"#;
    seed("kserve_request", "json", request);
    // The binary extension: two bytes of header length, the header, the tensors.
    let header =
        br#"{"inputs": [{"name": "I1", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        {"name": "C1", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 10}}]}"#;
    let mut binary = (header.len() as u16).to_be_bytes().to_vec();
    binary.extend_from_slice(header);
    binary.extend(f32s(&[3.0, f32::NAN]));
    for s in ["ab", ""] {
        binary.extend((s.len() as u32).to_le_bytes());
        binary.extend(s.as_bytes());
    }
    seed("kserve_request", "binary", &binary);
}
