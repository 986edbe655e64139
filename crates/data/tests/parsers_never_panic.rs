//! Every line parser, fed arbitrary bytes or mangled real rows, returns a row
//! or a reason, never panics, and leaves the batch consistent.

use std::path::Path;

use proptest::prelude::*;
use sparrow_core::BatchBuilder;
use sparrow_core::batch::DataPosition;
use sparrow_core::config::Schema;
use sparrow_data::text::{CriteoParser, CsvParser, LineParser, SvmParser};

fn parsers() -> Vec<(Box<dyn LineParser>, usize, usize, bool)> {
    let schema = Schema {
        label: "y".into(),
        dense: vec!["x".into()],
        sparse: vec!["a".into(), "b".into()],
        multi_hot_separator: Some("|".into()),
        ..Schema::default()
    };
    let csv = CsvParser::new(Path::new("fuzz.csv"), &schema, Some(b"y,x,a,b")).expect("schema");
    vec![
        (Box::new(CriteoParser::default()), 26, 13, false),
        (Box::new(csv), 2, 1, false),
        (Box::new(SvmParser::libsvm()), 1, 0, true),
        (Box::new(SvmParser::libffm(4)), 4, 0, true),
    ]
}

fn feed(line: &[u8]) {
    for (mut parser, fields, dense, weighted) in parsers() {
        let mut b = BatchBuilder::new(fields, dense, weighted, 4);
        for _ in 0..2 {
            b.begin_row();
            match parser.parse(line, &mut b) {
                Ok(label) => {
                    if !b.end_row(label) {
                        b.rollback_row();
                    }
                }
                Err(_) => b.rollback_row(),
            }
        }
        let batch = b.finish(DataPosition::default());
        assert_eq!(batch.bag_offsets.len(), batch.rows() * fields + 1);
        assert_eq!(batch.dense.len(), batch.rows() * dense);
        assert_eq!(batch.bag_offsets.last().copied().unwrap_or(0) as usize, batch.keys.len());
        assert!(batch.labels.iter().all(|&l| l == 0.0 || l == 1.0));
    }
}

const SAMPLE: &str = "1\t5\t\t-3\t7\t0\t1\t2\t3\t4\t5\t6\t7\t8\t68fd1e64\t80e26c9b\tfb936136";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes(line in proptest::collection::vec(any::<u8>(), 0..300)) {
        feed(&line);
    }

    #[test]
    fn mangled_rows(cut in 0usize..80, at in 0usize..80, byte in any::<u8>(), tabs in 0usize..50) {
        let mut line = SAMPLE.as_bytes().to_vec();
        line.truncate(cut.max(1).min(line.len()));
        let at = at.min(line.len());
        line.insert(at, byte);
        line.extend(std::iter::repeat_n(b'\t', tabs));
        feed(&line);
        feed(b"1 0:1:1 3:2:0.5 9:9:9 -1:1:1 1:1:nan 2::1 :: : 1:1:1e40");
        feed(b"+1 1:1 2:inf 3:-0 4:1e-50 x:y");
        feed(b"\"1\",\"2.5\",\"a|b||c\",\"\"\"q\"\"\"");
    }
}
