//! An input that several bf16 products read as their left operand, packed
//! as bf16 pairs once, not once a product: a level's experts all read the
//! same input (MMoE's four read `x`, PLE's seven at the bottom), forward as
//! `x·W` and backward as `xᵀ·g`. In MMoE's bf16 step packing left operands
//! was 12% of the time, the experts' copies of `x` about half of it.
//!
//! The caller lends the input for a scope ([`lend`]); a product in it whose
//! left operand is that slice (the same address and length, shape and
//! layout) reads the packed pairs instead of packing its own. The borrow
//! keeps the slice unchanged while the scope runs, and its entry goes when
//! the scope ends (a panic included), so no later slice at that address
//! can meet it. The pairs are the ones the product would have packed: the
//! bits do not change.

#[cfg(target_arch = "x86_64")]
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use super::Bf16Path;
#[cfg(target_arch = "x86_64")]
use super::{Convert, PackedRows, pack_rows};
#[cfg(target_arch = "x86_64")]
use crate::matrix::Operand;

/// A left operand as a product sees it.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    at: usize,
    len: usize,
    m: usize,
    k: usize,
    transposed: bool,
}

#[cfg(target_arch = "x86_64")]
impl Key {
    fn of(a: &Operand<'_>, m: usize, k: usize) -> Key {
        Key { at: a.data.as_ptr() as usize, len: a.data.len(), m, k, transposed: a.transposed }
    }
}

/// The inputs lent now, each packed.
#[cfg(target_arch = "x86_64")]
static LENT: RwLock<Vec<(Key, Arc<PackedRows>)>> = RwLock::new(Vec::new());
/// Buffers of ended scopes, for the next (fresh ones cost page faults).
#[cfg(target_arch = "x86_64")]
static SPARE: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());

/// How the products in a scope read a lent input `x` (`[rows, cols]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    /// `x·W` (`W`: `[cols, n]`): a layer's forward product.
    Forward,
    /// `xᵀ·g` (`g`: `[rows, n]`): its weights' gradient.
    WeightGrads,
}

/// An input to lend: `x` (`[rows, cols]`), read as `read` by products of
/// `n` output columns.
pub(crate) struct Input<'a> {
    pub x: &'a [f32],
    pub rows: usize,
    pub read: Read,
    pub n: usize,
}

impl Input<'_> {
    /// The product's shape (m, k) and its left operand.
    #[cfg(target_arch = "x86_64")]
    fn operand(&self) -> ((usize, usize), Operand<'_>) {
        let cols = self.x.len() / self.rows.max(1);
        match self.read {
            Read::Forward => ((self.rows, cols), Operand::plain(self.x)),
            Read::WeightGrads => ((cols, self.rows), Operand::t(self.x)),
        }
    }
}

/// Whether a product of that shape on `path` packs its left operand in the
/// tile kernel (the one that reads lent inputs): AVX-512-BF16's path,
/// neither narrow kernel, and not turned round (a narrow product's left
/// operand is packed as the right one).
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

/// Removes its scope's entries when the scope ends.
#[cfg(target_arch = "x86_64")]
struct Scope(Vec<Key>);

#[cfg(target_arch = "x86_64")]
impl Drop for Scope {
    fn drop(&mut self) {
        let mut lent = LENT.write().unwrap_or_else(PoisonError::into_inner);
        let mut spare = Vec::new();
        lent.retain_mut(|(key, rows)| {
            let ours = self.0.contains(key);
            if ours && let Some(rows) = Arc::get_mut(rows) {
                spare.push(std::mem::take(&mut rows.data));
            }
            !ours
        });
        drop(lent);
        SPARE.lock().unwrap_or_else(PoisonError::into_inner).extend(spare);
    }
}

/// `then()` with each of `inputs` that its products pack (see
/// `packs_left`) packed once and lent to them; on any other path, or
/// for an input no product packs, `then()` alone.
#[cfg(target_arch = "x86_64")]
pub(crate) fn lend<T>(path: Bf16Path, inputs: &[Input<'_>], then: impl FnOnce() -> T) -> T {
    let packed: Vec<(Key, PackedRows)> = inputs
        .iter()
        .filter_map(|input| {
            let ((m, k), a) = input.operand();
            packs_left(path, (m, input.n, k), a.transposed).then(|| {
                let buf = SPARE.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default();
                let rows_to = m.div_ceil(super::simd::MR) * super::simd::MR;
                (Key::of(&a, m, k), pack_rows(m, k, &a, rows_to, Convert::Simd, buf))
            })
        })
        .collect();
    if packed.is_empty() {
        return then();
    }
    let scope = Scope(packed.iter().map(|(key, _)| *key).collect());
    LENT.write()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(packed.into_iter().map(|(key, rows)| (key, Arc::new(rows))));
    let out = then();
    drop(scope);
    out
}

/// Without x86's kernels nothing packs: `then()`.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn lend<T>(path: Bf16Path, inputs: &[Input<'_>], then: impl FnOnce() -> T) -> T {
    let _ = (path, inputs);
    then()
}

/// The packed pairs of `a` (`m`×`k`) where a scope lent it.
#[cfg(target_arch = "x86_64")]
pub(super) fn lent(a: &Operand<'_>, m: usize, k: usize) -> Option<Arc<PackedRows>> {
    let key = Key::of(a, m, k);
    let lent = LENT.read().unwrap_or_else(PoisonError::into_inner);
    lent.iter().find(|(k, _)| *k == key).map(|(_, rows)| Arc::clone(rows))
}

/// How many layouts of `x` are lent now.
#[cfg(all(test, target_arch = "x86_64"))]
fn lent_now(x: &[f32]) -> usize {
    let lent = LENT.read().unwrap_or_else(PoisonError::into_inner);
    lent.iter().filter(|(key, _)| key.at == x.as_ptr() as usize).count()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::bf16::{Epilogue, gemm_bf16_then};

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

    #[test]
    fn a_lent_input_gives_the_products_bits_and_goes_with_its_scope() {
        let Some(path) = native() else {
            eprintln!("no AVX-512-BF16 here: the products do not pack their left operands");
            return;
        };
        let (rows, cols, n) = (100, 81, 64);
        let mut x = values(rows * cols, 1);
        let w = values(cols * n, 2);
        let g = values(rows * n, 3);
        let forward = |x: &[f32]| {
            let mut out = vec![0f32; rows * n];
            gemm_bf16_then(path, rows, n, cols, Operand::plain(x), Operand::plain(&w), &mut out, Epilogue::default());
            out
        };
        let grads = |x: &[f32]| {
            let mut dw = vec![0f32; cols * n];
            gemm_bf16_then(path, cols, n, rows, Operand::t(x), Operand::plain(&g), &mut dw, Epilogue::default());
            dw
        };
        let (y, dw) = (forward(&x), grads(&x));
        let inputs = [Input { x: &x, rows, read: Read::Forward, n }, Input { x: &x, rows, read: Read::WeightGrads, n }];
        let (lent_y, lent_dw, entries) = lend(path, &inputs, || (forward(&x), grads(&x), lent_now(&x)));
        assert_eq!(entries, 2, "both layouts lent");
        assert_eq!(
            lent_y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            lent_dw.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            dw.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // Once the scope ends the same slice, changed, is packed afresh.
        x.iter_mut().for_each(|v| *v = -*v);
        let negated: Vec<u32> = y.iter().map(|v| (-v).to_bits()).collect();
        assert_eq!(forward(&x).iter().map(|v| v.to_bits()).collect::<Vec<_>>(), negated);
    }

    #[test]
    fn a_lent_input_is_read_only_by_products_of_its_shape() {
        let Some(path) = native() else { return };
        let (rows, cols, n) = (64, 40, 48);
        let x = values(rows * cols, 4);
        let w = values(cols * n, 5);
        // The first half of x: the same address, another length.
        let half = &x[..rows / 2 * cols];
        let product = || {
            let mut out = vec![0f32; (rows / 2) * n];
            let (a, b) = (Operand::plain(half), Operand::plain(&w));
            gemm_bf16_then(path, rows / 2, n, cols, a, b, &mut out, Epilogue::default());
            out
        };
        let reference = product();
        let inputs = [Input { x: &x, rows, read: Read::Forward, n }];
        assert_eq!(lend(path, &inputs, product), reference);
    }

    #[test]
    fn a_narrow_or_other_path_lends_nothing() {
        let x = values(64 * 16, 6);
        let narrow = [Input { x: &x, rows: 64, read: Read::Forward, n: 8 }];
        assert_eq!(lend(Bf16Path::Native, &narrow, || lent_now(&x)), 0);
        let wide = [Input { x: &x, rows: 64, read: Read::Forward, n: 64 }];
        assert_eq!(lend(Bf16Path::Rounded, &wide, || lent_now(&x)), 0);
        assert_eq!(lent_now(&x), 0);
    }
}
