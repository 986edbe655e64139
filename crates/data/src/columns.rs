//! Rows given as typed columns (a KServe request's tensors): into a batch
//! through the same rules as the file readers, value by value, with no text
//! in between. A model scores such a row exactly as `sparrow predict` scores
//! the line of its data file that holds the same values.

use sparrow_core::BatchBuilder;
use sparrow_core::config::{DenseTransform, Schema};
use sparrow_core::feature_key;

use crate::text::{criteo_dense, split_bytes};

/// How a data format reads a row's values.
#[derive(Clone, Debug)]
pub enum ColumnRules {
    /// Criteo: integer counts through log(1 + max(x, 0)); one key a field.
    Criteo,
    /// CSV with a schema: numbers through its `dense_transform`; one key a
    /// field, or with `multi_hot_separator` one per non-empty ID.
    Csv { transform: DenseTransform, multi_hot: Option<Vec<u8>> },
}

impl ColumnRules {
    pub fn csv(schema: &Schema) -> ColumnRules {
        ColumnRules::Csv {
            transform: schema.dense_transform,
            multi_hot: schema.multi_hot_separator.as_ref().map(|s| s.as_bytes().to_vec()),
        }
    }

    /// The row's next dense value (`None`: the cell is empty, read as 0).
    /// Criteo's must be an integer (the caller checks the range).
    pub fn push_dense(&self, out: &mut BatchBuilder, value: Option<f64>) -> Result<(), String> {
        let v = value.unwrap_or(0.0);
        match self {
            ColumnRules::Criteo => {
                if v.fract() != 0.0 || !v.is_finite() {
                    return Err(format!("{v} is not an integer"));
                }
                out.push_dense(criteo_dense(v));
            }
            ColumnRules::Csv { transform, .. } => {
                let v = as_file_reads_f32(v);
                if !v.is_finite() {
                    return Err("value is not finite".into());
                }
                out.push_dense(transform.apply(f64::from(v)) as f32);
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
            ColumnRules::Csv { multi_hot, .. } => {
                for (f, v) in values.enumerate() {
                    let raw = v.unwrap_or_default();
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
