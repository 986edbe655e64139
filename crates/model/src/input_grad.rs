//! d loss / d the input rows as a step leaves it: one buffer, or a step in
//! halves' two (`models/halves.rs`), handed on as they are. Joining the
//! second half's rows onto the first's was a copy of half the batch's
//! input gradient on one thread while the other waited: 6% of ESMM's
//! dense step (`perf`, batch 1024, two threads, an AMX Xeon).

use sparrow_core::simd::Simd;

use crate::ModelError;

/// d loss / d the input rows, in the input's layout (`[rows, row_len]`):
/// the first rows' part, then the rest's (empty where the step ran whole).
#[derive(Clone, Copy, Debug)]
pub struct InputGrad<'a> {
    parts: [&'a [f32]; 2],
}

impl<'a> InputGrad<'a> {
    /// The gradient of every row in one buffer.
    pub fn whole(values: &'a [f32]) -> Self {
        Self { parts: [values, &[]] }
    }

    /// The first rows' part, then the others'.
    pub(crate) fn in_parts(first: &'a [f32], second: &'a [f32]) -> Self {
        Self { parts: [first, second] }
    }

    /// Its parts in row order (the second empty where the step ran whole).
    pub fn parts(&self) -> [&'a [f32]; 2] {
        self.parts
    }

    /// Floats in all.
    pub fn len(&self) -> usize {
        self.parts[0].len() + self.parts[1].len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every value, in row order.
    pub fn iter(&self) -> impl Iterator<Item = &'a f32> + 'a {
        let [a, b] = self.parts;
        a.iter().chain(b)
    }

    /// The rows of `row_len` floats, in order (a part's rows never
    /// straddle the two parts: each holds whole rows).
    pub fn rows(&self, row_len: usize) -> impl Iterator<Item = &'a [f32]> + 'a {
        let [a, b] = self.parts;
        let row_len = row_len.max(1);
        a.chunks_exact(row_len).chain(b.chunks_exact(row_len))
    }

    /// Every value in one buffer (a copy).
    pub fn to_vec(&self) -> Vec<f32> {
        self.parts.concat()
    }

    /// `Err(NonFinite)` naming `what` and the element (counted over both
    /// parts) where a value is a NaN or an infinity.
    pub(crate) fn check_finite(&self, simd: Simd, what: &str) -> Result<(), ModelError> {
        let mut offset = 0;
        for part in self.parts {
            let bad = (!crate::optimizer::all_finite_on_pool(simd, part))
                .then(|| part.iter().position(|v| !v.is_finite()))
                .flatten();
            if let Some(i) = bad {
                let what = format!("{what} (element {} is {})", offset + i, part[i]);
                return Err(ModelError::NonFinite { what });
            }
            offset += part.len();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows, values and the copy run over both parts in order; a value
    /// that is not finite is named at its place in the whole.
    #[test]
    fn the_parts_read_as_one_buffer() {
        let whole: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let (a, b) = whole.split_at(6);
        let g = InputGrad::in_parts(a, b);
        assert_eq!(g.len(), 12);
        assert_eq!(g.to_vec(), whole);
        assert_eq!(g.iter().copied().collect::<Vec<_>>(), whole);
        let rows: Vec<&[f32]> = g.rows(3).collect();
        assert_eq!(rows, whole.chunks_exact(3).collect::<Vec<_>>());
        assert_eq!(InputGrad::whole(&whole).rows(3).count(), 4);
        assert!(g.check_finite(Simd::Auto, "d x").is_ok());
        let mut bad = whole.clone();
        bad[8] = f32::INFINITY;
        let (a, b) = bad.split_at(6);
        let err = InputGrad::in_parts(a, b).check_finite(Simd::Auto, "d x").expect_err("refused").to_string();
        assert!(err.contains("d x (element 8 is inf)"), "{err}");
        bad[8] = 8.0;
        bad[1] = f32::NAN;
        let err = InputGrad::whole(&bad).check_finite(Simd::Auto, "d x").expect_err("refused").to_string();
        assert!(err.contains("element 1 is NaN"), "{err}");
    }
}
