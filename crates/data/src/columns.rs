//! Rows given as typed columns (a KServe request's tensors, numpy arrays,
//! DataFrame columns): into a batch through the same rules as the file
//! readers, value by value, with no text in between. A model scores such a
//! row exactly as `sparrow predict` scores the line of its data file that
//! holds the same values. `sparrow serve` and the Python `Model.predict`
//! both build their batches here ([`ModelInputs::batch`]).

use std::borrow::Cow;
use std::ops::Range;

use sparrow_core::batch::{Batch, DataPosition};
use sparrow_core::config::{DataConfig, DataFormat, DenseScale, Schema};
use sparrow_core::{BatchBuilder, feature_key};

use crate::layout::{CRITEO_DENSE, CRITEO_SPARSE, DataLayout};
use crate::text::{criteo_dense, parse_int, push_sequence, split_bytes};

/// The inputs a model reads, dense then sparse, named as its data schema
/// names them (Criteo: `I1`..`I13`, `C1`..`C26`), and the rules its data
/// file's reader applies to their values.
#[derive(Clone, Debug)]
pub struct ModelInputs {
    /// Every label column (one per task; never empty): accepted, not read.
    pub labels: Vec<String>,
    pub dense: Vec<String>,
    pub sparse: Vec<String>,
    /// `data.schema.sequence`: lists of IDs, after the sparse inputs.
    pub sequences: Vec<SequenceInput>,
    /// A CSV schema's timestamp column: a row may carry it, scoring reads none.
    pub timestamp: Option<String>,
    pub rules: ColumnRules,
    /// The data file's delimiter: a value one of its lines could not hold
    /// is refused, as `sparrow predict` could not be asked it.
    pub separator: char,
}

/// A behaviour sequence's input: its IDs take the keys of sparse field
/// `table`; the newest `max_len` are kept.
#[derive(Clone, Debug)]
pub struct SequenceInput {
    pub name: String,
    pub table: u32,
    pub max_len: usize,
}

/// What a column name is to a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputColumn {
    Dense(usize),
    Sparse(usize),
    /// A behaviour sequence: a list of IDs a row.
    Sequence(usize),
    /// The label or the timestamp: accepted, not read.
    Unused,
}

impl ModelInputs {
    /// The inputs of a model trained on `data`; only Criteo and CSV data
    /// have named columns.
    pub fn of(data: &DataConfig) -> Result<ModelInputs, String> {
        match data.format {
            DataFormat::Criteo => Ok(ModelInputs {
                labels: vec!["label".into()],
                sequences: Vec::new(),
                dense: (1..=CRITEO_DENSE).map(|i| format!("I{i}")).collect(),
                sparse: (1..=CRITEO_SPARSE).map(|i| format!("C{i}")).collect(),
                timestamp: None,
                rules: ColumnRules::Criteo,
                separator: '\t',
            }),
            DataFormat::Csv => {
                let schema = data.schema.clone().unwrap_or_default();
                let sequences = schema
                    .sequence
                    .iter()
                    .map(|q| {
                        let table = schema.sparse.iter().position(|f| *f == q.table).ok_or_else(|| {
                            format!("sequence `{}`: table `{}` is not a sparse field", q.field, q.table)
                        })?;
                        Ok(SequenceInput { name: q.field.clone(), table: table as u32, max_len: q.max_len })
                    })
                    .collect::<Result<_, String>>()?;
                let labels = if schema.labels.is_empty() { vec![schema.label.clone()] } else { schema.labels.clone() };
                Ok(ModelInputs {
                    labels,
                    sequences,
                    dense: schema.dense.clone(),
                    sparse: schema.sparse.clone(),
                    timestamp: schema.timestamp.clone(),
                    rules: ColumnRules::csv(&schema),
                    separator: schema.delimiter.chars().next().unwrap_or(','),
                })
            }
            other => Err(format!(
                "the model was trained on data.format = {other:?}; rows given as columns are read for Criteo and CSV \
                 models"
            )),
        }
    }

    /// The first task's label column (a one-task model's only one).
    pub fn label(&self) -> &str {
        self.labels.first().map_or("label", String::as_str)
    }

    /// Every input's name: dense, sparse, then sequences.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.dense.iter().chain(&self.sparse).chain(self.sequences.iter().map(|q| &q.name))
    }

    /// What column `name` is, or `None`: the model has no such column.
    pub fn column(&self, name: &str) -> Option<InputColumn> {
        if let Some(i) = self.dense.iter().position(|n| n == name) {
            return Some(InputColumn::Dense(i));
        }
        if let Some(i) = self.sparse.iter().position(|n| n == name) {
            return Some(InputColumn::Sparse(i));
        }
        if let Some(j) = self.sequences.iter().position(|q| q.name == name) {
            return Some(InputColumn::Sequence(j));
        }
        (self.labels.iter().any(|l| l == name) || self.timestamp.as_deref() == Some(name))
            .then_some(InputColumn::Unused)
    }

    /// Whether dense values are Criteo's integer counts (else CSV numbers).
    pub fn dense_are_counts(&self) -> bool {
        matches!(self.rules, ColumnRules::Criteo)
    }

    /// Refuses a categorical value that no line of the data file could
    /// hold: a line break, or (Criteo's TSV) a tab.
    pub fn check_text(&self, value: &str) -> Result<(), String> {
        let tsv = self.separator == '\t';
        if value.contains(['\n', '\r']) || (tsv && value.contains('\t')) {
            return Err(format!("{value:?} holds a line break{}", if tsv { " or a tab" } else { "" }));
        }
        Ok(())
    }

    /// Rows `rows` of `values` as one batch (label 0), read as the data
    /// file's reader reads the line holding the same values.
    pub fn batch<V: ColumnValues>(
        &self,
        layout: &DataLayout,
        values: &V,
        rows: Range<usize>,
    ) -> Result<Batch, V::Error> {
        let mut builder = BatchBuilder::new(layout.num_fields, layout.num_dense, false, rows.len());
        let mut sparse = Vec::with_capacity(self.sparse.len());
        for row in rows {
            builder.begin_row();
            for column in 0..self.dense.len() {
                let value = values.dense(column, row)?;
                self.rules
                    .push_dense(&mut builder, column, value)
                    .map_err(|e| values.refused(Some(InputColumn::Dense(column)), row, e))?;
            }
            sparse.clear();
            for column in 0..self.sparse.len() {
                sparse.push(values.sparse(column, row)?);
            }
            let pushed = self.rules.push_sparse(&mut builder, sparse.iter().map(|v| v.as_deref()));
            pushed.map_err(|e| values.refused(None, row, e))?;
            for (j, q) in self.sequences.iter().enumerate() {
                let ids = values.sequence(j, row)?;
                let ids: Vec<&[u8]> = ids.iter().map(|id| id.as_ref()).filter(|id| !id.is_empty()).collect();
                push_sequence(&mut builder, self.sparse.len() + j, q.table, q.max_len, &ids);
            }
            if !builder.end_row(0.0) {
                let e = format!("{} dense values for a model of {}", self.dense.len(), layout.num_dense);
                return Err(values.refused(None, row, e));
            }
        }
        Ok(builder.finish(DataPosition::default()))
    }
}

/// One request's values, column by column (columns numbered as in
/// [`ModelInputs::dense`] and [`ModelInputs::sparse`]; a column not given
/// reads as empty cells).
pub trait ColumnValues {
    type Error;
    /// Row `row` of dense input `column` (`None`: an empty cell, read as 0).
    fn dense(&self, column: usize, row: usize) -> Result<Option<f64>, Self::Error>;
    /// Row `row` of sparse input `column` as the file's cell holds it
    /// (`None`: an empty cell).
    fn sparse(&self, column: usize, row: usize) -> Result<Option<Cow<'_, [u8]>>, Self::Error>;
    /// The error for a row the data format's rules refuse (in `column`, when one column is to blame).
    fn refused(&self, column: Option<InputColumn>, row: usize, message: String) -> Self::Error;
    /// Row `row`'s IDs of sequence input `column`, oldest first (a model
    /// without sequences never asks; an input not given is an empty list).
    fn sequence(&self, _column: usize, _row: usize) -> Result<Vec<Cow<'_, [u8]>>, Self::Error> {
        Ok(Vec::new())
    }
}

/// How a data format reads a row's values.
#[derive(Clone, Debug)]
pub enum ColumnRules {
    /// Criteo: integer counts through log(1 + max(x, 0)); one key a field.
    Criteo,
    /// CSV with a schema: numbers through its `dense_transform`; one key a
    /// field, or with `multi_hot_separator` one per non-empty ID.
    Csv { scale: DenseScale, multi_hot: Option<Vec<u8>>, buckets: Vec<Option<Vec<f64>>> },
}

impl ColumnRules {
    /// What separates the IDs of a multi-hot or sequence cell (CSV's `multi_hot_separator`).
    pub fn separator(&self) -> Option<&str> {
        match self {
            ColumnRules::Csv { multi_hot: Some(sep), .. } => std::str::from_utf8(sep).ok(),
            _ => None,
        }
    }

    pub fn csv(schema: &Schema) -> ColumnRules {
        ColumnRules::Csv {
            scale: schema.dense_scale(),
            buckets: schema.bucket_boundaries(),
            multi_hot: schema.multi_hot_separator.as_ref().map(|s| s.as_bytes().to_vec()),
        }
    }

    /// A dense cell's text as the file reader reads it (`None`: empty).
    pub fn dense_text(&self, raw: &str) -> Result<Option<f64>, String> {
        if raw.is_empty() {
            return Ok(None);
        }
        match self {
            ColumnRules::Criteo => {
                parse_int(raw.as_bytes()).map(|v| Some(v as f64)).ok_or_else(|| format!("`{raw}` is not an integer"))
            }
            ColumnRules::Csv { .. } => {
                let v = raw.trim().parse::<f32>().map_err(|_| format!("`{raw}` is not a number"))?;
                Ok(Some(f64::from(v)))
            }
        }
    }

    /// The row's next dense value (`None`: the cell is empty, read as 0).
    /// Criteo's must be an integer (the caller checks the range).
    pub fn push_dense(&self, out: &mut BatchBuilder, column: usize, value: Option<f64>) -> Result<(), String> {
        let v = value.unwrap_or(0.0);
        match self {
            ColumnRules::Criteo => {
                if v.fract() != 0.0 || !v.is_finite() {
                    return Err(format!("{v} is not an integer"));
                }
                out.push_dense(criteo_dense(v));
            }
            ColumnRules::Csv { scale, .. } => {
                let v = as_file_reads_f32(v);
                if !v.is_finite() {
                    return Err("value is not finite".into());
                }
                out.push_dense(scale.apply(column, f64::from(v)) as f32);
            }
        }
        Ok(())
    }

    /// The row's sparse values, field by field (`None`: an empty cell).
    pub fn push_sparse<'a>(
        &self,
        out: &mut BatchBuilder,
        values: impl ExactSizeIterator<Item = Option<&'a [u8]>>,
    ) -> Result<(), String> {
        match self {
            ColumnRules::Criteo => {
                let fields = values.len();
                let keys: Vec<u64> =
                    values.enumerate().map(|(f, v)| feature_key(f as u32, v.unwrap_or_default())).collect();
                if !out.push_key_per_field(&keys) {
                    return Err(format!("a batch of {} fields for {fields} sparse columns", out.num_fields()));
                }
            }
            ColumnRules::Csv { multi_hot, buckets, .. } => {
                for (f, v) in values.enumerate() {
                    let raw = v.unwrap_or_default();
                    if let Some(boundaries) = buckets.get(f).and_then(Option::as_ref) {
                        let id = sparrow_core::config::bucket_id(boundaries, raw)?;
                        out.push_key(f, feature_key(f as u32, id.as_bytes()), 1.0);
                        continue;
                    }
                    match multi_hot {
                        Some(sep) => {
                            for id in split_bytes(raw, sep).filter(|s| !s.is_empty()) {
                                out.push_key(f, feature_key(f as u32, id), 1.0);
                            }
                        }
                        None => {
                            out.push_key(f, feature_key(f as u32, raw), 1.0);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// `v` as f32 the way a data file holding `v`'s shortest decimal reads it
/// (the CSV reader parses text straight to f32). That is `v as f32` unless
/// `v` lies exactly halfway between two f32 values: then the decimal, not
/// ties-to-even, decides.
pub fn as_file_reads_f32(v: f64) -> f32 {
    let near = v as f32;
    let back = f64::from(near);
    if back == v || !v.is_finite() || !near.is_finite() {
        return near;
    }
    let other = if back < v { near.next_up() } else { near.next_down() };
    if (back + f64::from(other)) / 2.0 != v {
        return near;
    }
    format!("{v}").parse::<f32>().unwrap_or(near)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{CriteoParser, CsvParser, LineParser};
    use sparrow_core::config::Schema;

    /// Cells as text, one `Vec` a row, in the inputs' order (dense, sparse).
    struct TextCells(Vec<Vec<&'static str>>, usize, ColumnRules);

    impl ColumnValues for TextCells {
        type Error = String;
        fn dense(&self, column: usize, row: usize) -> Result<Option<f64>, String> {
            self.2.dense_text(self.0[row][column])
        }
        fn sparse(&self, column: usize, row: usize) -> Result<Option<Cow<'_, [u8]>>, String> {
            Ok(Some(Cow::Borrowed(self.0[row][self.1 + column].as_bytes())))
        }
        fn refused(&self, _column: Option<InputColumn>, row: usize, message: String) -> String {
            format!("row {row}: {message}")
        }
    }

    fn parsed(parser: &mut dyn LineParser, layout: &DataLayout, lines: &[String]) -> Batch {
        let mut b = BatchBuilder::new(layout.num_fields, layout.num_dense, false, lines.len());
        for line in lines {
            b.begin_row();
            parser.parse(line.as_bytes(), &mut b).expect("parses");
            assert!(b.end_row(0.0));
        }
        b.finish(DataPosition::default())
    }

    fn same(a: &Batch, b: &Batch) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.dense), bits(&b.dense));
        assert_eq!(a.keys, b.keys);
        assert_eq!(a.bag_offsets, b.bag_offsets);
    }

    /// A row given as columns is the batch the file reader makes of the
    /// line holding the same cells (CSV with multi-hot IDs and a transform).
    #[test]
    fn csv_columns_make_the_batch_the_line_reader_makes() {
        let schema = Schema {
            label: "y".into(),
            dense: vec!["a".into(), "b".into()],
            sparse: vec!["u".into(), "tags".into()],
            delimiter: ",".into(),
            header: true,
            multi_hot_separator: Some("|".into()),
            dense_transform: sparrow_core::config::DenseTransform::Log1p,
            timestamp: None,
            ..Schema::default()
        };
        let data = DataConfig { format: DataFormat::Csv, schema: Some(schema.clone()), ..DataConfig::default() };
        let inputs = ModelInputs::of(&data).expect("csv inputs");
        let rows = vec![
            vec!["0.1", "", "user 1", "x|y||z"],
            vec!["-3.5", "1e10", "", ""],
            vec![" 7 ", "16777217", "say \"hi\"", "only"],
        ];
        let quote =
            |c: &str| if c.contains([',', '"']) { format!("\"{}\"", c.replace('"', "\"\"")) } else { c.to_string() };
        let lines: Vec<String> = rows
            .iter()
            .map(|r| std::iter::once("0".to_string()).chain(r.iter().map(|c| quote(c))).collect::<Vec<_>>().join(","))
            .collect();
        let layout = DataLayout { num_fields: 2, num_dense: 2, weighted: false, num_tasks: 1 };
        let mut parser = CsvParser::new(std::path::Path::new("t.csv"), &schema, Some(b"y,a,b,u,tags")).expect("parser");
        let from_lines = parsed(&mut parser, &layout, &lines);
        let cells = TextCells(rows, 2, inputs.rules.clone());
        let from_columns = inputs.batch(&layout, &cells, 0..3).expect("columns");
        same(&from_lines, &from_columns);
        assert_eq!(inputs.column("y"), Some(InputColumn::Unused));
        assert_eq!(inputs.column("tags"), Some(InputColumn::Sparse(1)));
        assert_eq!(inputs.column("nope"), None);
    }

    #[test]
    fn criteo_columns_make_the_batch_the_line_reader_makes() {
        let inputs = ModelInputs::of(&DataConfig::default()).expect("criteo inputs");
        let mut row: Vec<&'static str> =
            vec!["5", "", "-3", "0", "999999999999999999", "1", "2", "3", "4", "5", "6", "7", "8"];
        row.extend(["68fd1e64", "", "a b"].iter().chain(std::iter::repeat_n(&"k", 23)));
        let line = format!("0\t{}", row.join("\t"));
        let layout = DataLayout { num_fields: CRITEO_SPARSE, num_dense: CRITEO_DENSE, weighted: false, num_tasks: 1 };
        let from_line = parsed(&mut CriteoParser::default(), &layout, &[line]);
        let from_columns = inputs.batch(&layout, &TextCells(vec![row], CRITEO_DENSE, ColumnRules::Criteo), 0..1);
        same(&from_line, &from_columns.expect("columns"));
        // What the reader refuses, the columns refuse.
        for bad in ["1.5", "x", "1e3", "9999999999999999999"] {
            let mut row = vec!["0"; CRITEO_DENSE + CRITEO_SPARSE];
            row[0] = bad;
            let refused = inputs.batch(&layout, &TextCells(vec![row], CRITEO_DENSE, ColumnRules::Criteo), 0..1);
            assert!(refused.is_err_and(|e| e.contains("is not an integer")), "{bad}");
        }
        assert!(inputs.check_text("a\tb").is_err() && inputs.check_text("a b").is_ok());
    }

    /// Midpoints between two f32 are where a cast and the file reader
    /// differ; everywhere else they agree.
    #[test]
    fn a_value_reads_as_the_file_reader_reads_its_decimal() {
        let one_and_half_ulp = 1.0 + f64::from(f32::EPSILON) / 2.0; // exactly between 1 and 1 + ε
        assert_eq!(one_and_half_ulp as f32, 1.0, "ties to even");
        let text: f32 = format!("{one_and_half_ulp}").parse().expect("f32");
        assert_eq!(as_file_reads_f32(one_and_half_ulp), text);
        for v in [0.1f64, -3.75, 1e-30, 123456.789, 0.0, -0.0, 1e38, 16777217.0] {
            let text: f32 = format!("{v}").parse().expect("f32");
            assert_eq!(as_file_reads_f32(v).to_bits(), text.to_bits(), "{v}");
        }
    }
}
