//! `[[data.schema.buckets]]`: a sparse field whose cells are numbers, read
//! as the bucket their value falls in rather than as the text they are.

use serde::{Deserialize, Serialize};

/// One bucketized field.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BucketField {
    /// The column, one of `data.schema.sparse`: its cells are numbers.
    pub column: String,
    /// Increasing boundaries b₀ < b₁ < …: a value x falls in bucket i = how
    /// many boundaries are ≤ x (x < b₀: 0; x ≥ the last: their count), the
    /// field's ID. An empty cell is the field's missing ID, as for any field.
    pub boundaries: Vec<f64>,
}

/// The ID a cell reads as under `boundaries`: its bucket's number as text;
/// an empty cell stays empty (missing). A cell that is no number is a
/// malformed row.
pub fn bucket_id(boundaries: &[f64], raw: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(raw).map_err(|_| "a bucketized cell is not UTF-8".to_string())?.trim();
    if text.is_empty() {
        return Ok(String::new());
    }
    let x: f64 = text.parse().map_err(|_| format!("`{text}` is not a number (data.schema.buckets)"))?;
    if x.is_nan() {
        return Ok(String::new());
    }
    Ok(boundaries.partition_point(|&b| b <= x).to_string())
}

impl super::Schema {
    /// Each sparse field's boundaries, if it is bucketized.
    pub fn bucket_boundaries(&self) -> Vec<Option<Vec<f64>>> {
        self.sparse
            .iter()
            .map(|name| self.buckets.iter().find(|b| &b.column == name).map(|b| b.boundaries.clone()))
            .collect()
    }

    /// The buckets' rules, each refusal naming the key.
    pub(super) fn check_buckets(&self) -> Result<(), super::ConfigError> {
        let invalid =
            |message: String| Err(super::ConfigError::Invalid { key: "data.schema.buckets".to_string(), message });
        for (i, b) in self.buckets.iter().enumerate() {
            if !self.sparse.contains(&b.column) {
                return invalid(format!("`{}` is not a column of data.schema.sparse", b.column));
            }
            if self.buckets[..i].iter().any(|a| a.column == b.column) {
                return invalid(format!("`{}` is bucketized twice", b.column));
            }
            if b.boundaries.is_empty() || b.boundaries.iter().any(|x| !x.is_finite()) {
                return invalid(format!("`{}`: give one or more finite boundaries", b.column));
            }
            if b.boundaries.windows(2).any(|w| w[0] >= w[1]) {
                return invalid(format!("`{}`: the boundaries must increase, {:?} do not", b.column, b.boundaries));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::bucket_id;

    #[test]
    fn a_value_falls_in_the_bucket_of_the_boundaries_at_or_below_it() {
        let b = [18.0, 25.0, 65.0];
        let ids: Vec<String> = ["3", "18", "24.9", "25", " 64 ", "65", "1e9", ""]
            .iter()
            .map(|c| bucket_id(&b, c.as_bytes()).expect("id"))
            .collect();
        assert_eq!(ids, ["0", "1", "1", "2", "2", "3", "3", ""]);
        assert!(bucket_id(&b, b"old").expect_err("no number").contains("not a number"));
    }
}
