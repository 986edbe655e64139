//! An input that several bf16 products read as their left operand, packed
//! as bf16 pairs once, not once a product: a level's experts all read the
//! same input (MMoE's four read `x`, PLE's seven at the bottom), forward as
//! `x·W` and backward as `xᵀ·g`. In MMoE's bf16 step packing left operands
//! was 12% of the time, the experts' copies of `x` about half of it.
//!
//! The caller packs the input ([`pack_once`]) and hands the pairs to each
//! product with the operand ([`gemm_bf16_lent`](super::gemm_bf16_lent));
//! a product reads them only where they are that operand's (the same
//! address and length, shape and layout) and else packs its own. The
//! pairs are the ones the product would have packed: the bits do not
//! change.

use super::{Bf16Path, PackedRows};
use crate::matrix::Operand;

/// How the products read a packed input `x` (`[rows, cols]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    /// `x·W` (`W`: `[cols, n]`): a layer's forward product.
    Forward,
    /// `xᵀ·g` (`g`: `[rows, n]`): its weights' gradient.
    WeightGrads,
}

/// A left operand packed as bf16 pairs, and which operand it is.
pub(crate) struct PackedLeft {
    pub(super) rows: PackedRows,
    at: usize,
    len: usize,
    m: usize,
    k: usize,
    transposed: bool,
}

impl PackedLeft {
    /// Whether these are the pairs of `a` (`m`×`k`) as a product packs them.
    pub(super) fn fits(&self, a: &Operand<'_>, m: usize, k: usize) -> bool {
        let operand = (a.data.as_ptr() as usize, a.data.len(), a.transposed);
        operand == (self.at, self.len, self.transposed) && (m, k) == (self.m, self.k)
    }

    /// Its buffer, for the next packing.
    pub(crate) fn into_buffer(self) -> Vec<u32> {
        self.rows.data
    }
}

/// `x` (`[rows, cols]`) packed as the products that read it as `read`, of
/// `n` output columns, take their left operand, into `buf`; None (and
/// `buf` back) where they would not pack it: another path than
/// AVX-512-BF16's tile kernel, a narrow product, or one turned round (its
/// left operand packed as the right one).
pub(crate) fn pack_once(
    path: Bf16Path,
    (x, rows): (&[f32], usize),
    (read, n): (Read, usize),
    buf: Vec<u32>,
) -> Result<PackedLeft, Vec<u32>> {
    let cols = x.len() / rows.max(1);
    let ((m, k), a) = match read {
        Read::Forward => ((rows, cols), Operand::plain(x)),
        Read::WeightGrads => ((cols, rows), Operand::t(x)),
    };
    #[cfg(target_arch = "x86_64")]
    if packs_left(path, (m, n, k), a.transposed) {
        let rows_to = m.div_ceil(super::simd::MR) * super::simd::MR;
        let rows = super::pack_rows(m, k, &a, rows_to, super::Convert::Simd, buf);
        let (at, len, transposed) = (x.as_ptr() as usize, x.len(), a.transposed);
        return Ok(PackedLeft { rows, at, len, m, k, transposed });
    }
    let _ = (path, m, n, k, a);
    Err(buf)
}

/// Whether a product of that shape on `path` packs its left operand in the
/// tile kernel: AVX-512-BF16's path (and this CPU has it), neither narrow
/// kernel, and not turned round.
#[cfg(target_arch = "x86_64")]
fn packs_left(path: Bf16Path, (m, n, k): (usize, usize, usize), a_transposed: bool) -> bool {
    path == Bf16Path::Native
        && super::simd::available(sparrow_core::simd::Simd::Auto)
        && m > 0
        && n > 0
        && k > 0
        && !crate::bf16_narrow::takes((m, n, k), a_transposed, crate::bf16_narrow::MAX_COLUMNS)
        && !(n < super::simd::NR && m > n)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::bf16::{Epilogue, gemm_bf16_lent, gemm_bf16_then};

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn native() -> Option<Bf16Path> {
        let path = crate::bf16::path(sparrow_core::simd::Simd::Auto);
        (path == Bf16Path::Native || path == Bf16Path::Amx).then_some(Bf16Path::Native)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// `op(a)·b` (`m`×`k` by `k`×`n`), reading `packed` where given.
    fn product(
        path: Bf16Path,
        (m, n, k): (usize, usize, usize),
        (a, packed): (Operand<'_>, Option<&PackedLeft>),
        b: &[f32],
    ) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        gemm_bf16_lent(path, (m, n, k), (a, packed), Operand::plain(b), &mut out, Epilogue::default());
        out
    }

    #[test]
    fn a_packed_input_gives_each_products_bits() {
        let Some(path) = native() else {
            return;
        };
        let (rows, cols, n) = (100, 81, 64);
        let x = values(rows * cols, 1);
        let (w, g) = (values(cols * n, 2), values(rows * n, 3));
        let forward = pack_once(path, (&x, rows), (Read::Forward, n), Vec::new()).expect("packed");
        let grads = pack_once(path, (&x, rows), (Read::WeightGrads, n), Vec::new()).expect("packed");
        let mut y = vec![0f32; rows * n];
        gemm_bf16_then(path, rows, n, cols, Operand::plain(&x), Operand::plain(&w), &mut y, Epilogue::default());
        let mut dw = vec![0f32; cols * n];
        gemm_bf16_then(path, cols, n, rows, Operand::t(&x), Operand::plain(&g), &mut dw, Epilogue::default());
        let lent_y = product(path, (rows, n, cols), (Operand::plain(&x), Some(&forward)), &w);
        let lent_dw = product(path, (cols, n, rows), (Operand::t(&x), Some(&grads)), &g);
        assert_eq!(bits(&lent_y), bits(&y));
        assert_eq!(bits(&lent_dw), bits(&dw));
        // Pairs that are not the operand's are not read: the other layout's,
        // or another slice's (a copy of x, negated).
        let crossed = product(path, (rows, n, cols), (Operand::plain(&x), Some(&grads)), &w);
        assert_eq!(bits(&crossed), bits(&y));
        let negated: Vec<f32> = x.iter().map(|v| -v).collect();
        let other = product(path, (rows, n, cols), (Operand::plain(&negated), Some(&forward)), &w);
        assert_eq!(bits(&other), y.iter().map(|v| (-v).to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn a_packed_input_is_read_only_by_products_of_its_shape() {
        let Some(path) = native() else { return };
        let (rows, cols, n) = (64, 40, 48);
        let x = values(rows * cols, 4);
        let w = values(2 * cols * n, 5);
        let packed = pack_once(path, (&x, rows), (Read::Forward, n), Vec::new()).expect("packed");
        // The same slice as half the rows, each twice as long.
        let shape = (rows / 2, n, 2 * cols);
        let reference = product(path, shape, (Operand::plain(&x), None), &w);
        assert_eq!(bits(&product(path, shape, (Operand::plain(&x), Some(&packed)), &w)), bits(&reference));
    }

    #[test]
    fn a_narrow_product_or_another_path_packs_nothing() {
        let x = values(64 * 16, 6);
        let narrow = pack_once(Bf16Path::Native, (&x, 64), (Read::Forward, 8), vec![7]);
        assert_eq!(narrow.err(), Some(vec![7]), "given back untouched");
        assert!(
            pack_once(Bf16Path::Rounded(sparrow_core::simd::Simd::Auto), (&x, 64), (Read::Forward, 64), Vec::new())
                .is_err()
        );
    }
}
