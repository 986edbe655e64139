//! The reader's hot path: Criteo TSV rows into batches of 1024 on one
//! thread, as the background reader does — the whole file through
//! `TextSource` (read a line, split, parse the integers, hash the 26
//! categorical values, fill the batch), and the line parser alone over rows
//! already in memory. Rows from the generator (`sparrow gen`'s format).
//!
//! `cargo bench -p sparrow-data --bench parse`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sparrow_core::batch::{BatchBuilder, DataPosition};
use sparrow_data::text::{CriteoParser, LineParser};
use sparrow_data::{BadRows, open_source};

const ROWS: u64 = 32 * 1024;

fn bench(c: &mut Criterion) {
    let dir = std::env::temp_dir().join("sparrow-parse-bench");
    sparrow_data::synth::generate(&dir, ROWS, 1, 1).expect("generate");
    let path = dir.join("train.tsv");
    let text = std::fs::read(&path).expect("read");
    let config = sparrow_core::Config::default();
    let mut group = c.benchmark_group("parse");
    group.sample_size(20);

    group.throughput(Throughput::Elements(ROWS));
    let mut source = open_source(&path, &config, BadRows::new(0, 1)).expect("open");
    group.bench_function("text_source_rows", |b| {
        b.iter(|| {
            source.seek(DataPosition::default()).expect("seek");
            let mut rows = 0;
            while let Some(batch) = source.next_batch(1024, 0).expect("batch") {
                rows += batch.labels.len();
            }
            assert_eq!(rows as u64, ROWS);
        })
    });

    let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    let mut parser = CriteoParser::default();
    group.bench_function("criteo_line_parser_rows", |b| {
        b.iter(|| {
            for chunk in lines.chunks(1024) {
                let mut batch = BatchBuilder::new(26, 13, false, chunk.len());
                for line in chunk {
                    batch.begin_row();
                    let label = parser.parse(line, &mut batch).expect("parse");
                    assert!(batch.end_row(label));
                }
                std::hint::black_box(batch.finish(DataPosition::default()));
            }
        })
    });
    group.finish();
    println!("{} rows, {:.1} bytes a row", ROWS, text.len() as f64 / ROWS as f64);
}

criterion_group!(benches, bench);
criterion_main!(benches);
