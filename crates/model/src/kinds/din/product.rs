//! DIN's local activation unit's first layer without its input laid out.
//! The unit reads `f = [q, k, q − k, q ⊙ k]` a (row, history item) pair;
//! with `W = [W_q; W_k; W_d; W_p]` (each `[d, h]`),
//! `f·W = q·(W_q + W_d) + [k, q ⊙ k]·[W_k − W_d; W_p]`: the first term is
//! a batch row's, computed once a row instead of once an item, and the
//! item's product reads `2·d` values, not `4·d`. Backward likewise:
//! `dW_q = Qᵀ·G_rows`, `[dW_k; dW_p] = [K, Q ⊙ K]ᵀ·G`, `dW_d = dW_q − dW_k`
//! (`G_rows`: each row's items' gradients summed), and the items' and the
//! queries' gradients from `G·[W_k − W_d; W_p]ᵀ` and `G_rows·(W_q + W_d)ᵀ`.
//! The same sums as the laid-out product, in another order (fp32).

use rayon::prelude::*;

use super::positions;
use crate::bf16::Arith;
use crate::matrix::Operand;
use crate::mlp::first_product::{FirstGrad, FirstProduct};
use crate::mlp::{matmul, sized};
use sparrow_core::simd::Simd;

/// Positions a task of a pass over history items takes.
const POSITIONS_PER_TASK: usize = 256;
/// The items' weights' gradient `[K, Q ⊙ K]ᵀ·G` is summed over parts of
/// this many positions, each one product, the parts then added in order:
/// a sum the narrow product takes whole (`matrix::narrow`), cut where this
/// says rather than where `gemm`'s cache sizes say (on the Xeon it was
/// measured on, `gemm` cut it at 512 too: the same bits as before).
const POSITIONS_PER_PART: usize = 512;

/// The product's buffers, kept between steps.
#[derive(Default)]
pub(super) struct ProductBufs {
    /// Each batch row's query `[rows, d]`.
    q_rows: Vec<f32>,
    /// `[k, q ⊙ k]` a position `[positions, 2·d]`.
    kq: Vec<f32>,
    /// `W_q + W_d` `[d, h]`, and `[W_k − W_d; W_p]` `[2·d, h]`.
    w_row: Vec<f32>,
    w_item: Vec<f32>,
    /// `q·(W_q + W_d)` a row `[rows, h]`.
    qw: Vec<f32>,
    /// Backward: the items' gradients summed a row `[rows, h]`, and
    /// `[dW_k; dW_p]` `[2·d, h]` and its parts' `[parts, 2·d, h]`.
    g_rows: Vec<f32>,
    dw_item: Vec<f32>,
    dw_parts: Vec<f32>,
    /// Backward: `G·[W_k − W_d; W_p]ᵀ` `[positions, 2·d]` (d k's linear
    /// part, then d (q ⊙ k)), and d q a row's share `[rows, d]`.
    pub(super) e: Vec<f32>,
    pub(super) dq_rows: Vec<f32>,
}

/// One sequence's unit input in a batch: the queries and items it is
/// built from, and the buffers.
pub(super) struct UnitInput<'a> {
    pub(super) d: usize,
    pub(super) rows: usize,
    /// The batch row of each position (ascending).
    pub(super) at_rows: &'a [u32],
    pub(super) bufs: &'a mut ProductBufs,
    /// `train.simd`: whether the passes over positions may take their
    /// AVX kernels (`positions.rs`).
    pub(super) simd: Simd,
}

impl<'a> UnitInput<'a> {
    /// Lays out the queries (the candidate's slot `query` of each of the
    /// `rows` rows of `x`, `stride` values a row) and `[k, q ⊙ k]`.
    pub(super) fn new(
        (x, stride, rows): (&[f32], usize, usize),
        (query, d): (usize, usize),
        keys: &[f32],
        (at_rows, simd): (&'a [u32], Simd),
        bufs: &'a mut ProductBufs,
    ) -> UnitInput<'a> {
        let q_rows = sized(&mut bufs.q_rows, rows * d);
        for (r, q) in q_rows.chunks_exact_mut(d).enumerate() {
            q.copy_from_slice(&x[r * stride + query * d..r * stride + (query + 1) * d]);
        }
        let q_rows = &bufs.q_rows;
        let kq = sized(&mut bufs.kq, at_rows.len() * 2 * d);
        kq.par_chunks_mut(2 * d * POSITIONS_PER_TASK).zip(at_rows.par_chunks(POSITIONS_PER_TASK)).enumerate().for_each(
            |(chunk, (kq, at))| {
                let first = chunk * POSITIONS_PER_TASK;
                let keys = &keys[first * d..(first + at.len()) * d];
                positions::items_and_products(simd, d, (keys, q_rows), at, kq);
            },
        );
        UnitInput { d, rows, at_rows, bufs, simd }
    }

    /// `W_q + W_d` and `[W_k − W_d; W_p]` from `W` (`[4·d, h]`).
    fn split_weights(&mut self, w: &[f32], h: usize) {
        let dh = self.d * h;
        let (wq, rest) = w.split_at(dh);
        let (wk, rest) = rest.split_at(dh);
        let (wd, wp) = rest.split_at(dh);
        let w_row = sized(&mut self.bufs.w_row, dh);
        w_row.iter_mut().zip(wq.iter().zip(wd)).for_each(|(o, (q, d))| *o = q + d);
        let w_item = sized(&mut self.bufs.w_item, 2 * dh);
        let (item_k, item_p) = w_item.split_at_mut(dh);
        item_k.iter_mut().zip(wk.iter().zip(wd)).for_each(|(o, (k, d))| *o = k - d);
        item_p.copy_from_slice(wp);
    }
}

impl UnitInput<'_> {
    /// After [`backward`](FirstProduct::backward): each item's gradient
    /// (added to `dk`) and each position's share of its query's (`dq`,
    /// written); the rows' own share is `bufs.dq_rows`.
    pub(super) fn item_and_query_grads(&self, keys: &[f32], dk: &mut [f32], dq: &mut [f32]) {
        let d = self.d;
        let (e, q_rows, at_rows) = (&self.bufs.e, &self.bufs.q_rows, self.at_rows);
        // A task's positions in one loop (a rayon item a position cost as
        // much as the arithmetic at d = 8).
        let task = d * POSITIONS_PER_TASK;
        dq.par_chunks_mut(task).zip(dk.par_chunks_mut(task)).enumerate().for_each(|(t, (dq, dk))| {
            let first = t * POSITIONS_PER_TASK;
            let at = &at_rows[first..first + dq.len() / d.max(1)];
            let items = (&e[first * 2 * d..(first + at.len()) * 2 * d], &keys[first * d..(first + at.len()) * d]);
            positions::item_and_query(self.simd, d, (items, q_rows), at, (dk, dq));
        });
    }
}

impl FirstProduct for UnitInput<'_> {
    fn sums_next_dw(&self, h: usize) -> bool {
        positions::sums_next_dw(self.simd, h)
    }

    fn forward(&mut self, w: &[f32], positions: usize, h: usize, (bias, relu): (&[f32], bool), out: &mut [f32]) {
        assert_eq!(bias.len(), h, "the unit's first bias");
        let (d, rows) = (self.d, self.rows);
        self.split_weights(w, h);
        let b = &mut *self.bufs;
        let qw = sized(&mut b.qw, rows * h);
        matmul(Arith::F32(self.simd), None, rows, h, d, Operand::plain(&b.q_rows), Operand::plain(&b.w_row), qw);
        matmul(Arith::F32(self.simd), None, positions, h, 2 * d, Operand::plain(&b.kq), Operand::plain(&b.w_item), out);
        let (qw, at_rows, simd) = (&b.qw, self.at_rows, self.simd);
        out.par_chunks_mut(h * POSITIONS_PER_TASK).zip(at_rows.par_chunks(POSITIONS_PER_TASK)).for_each(|(o, at)| {
            positions::add_row_terms(simd, o, at, qw, (bias, relu));
        });
    }

    fn backward(
        &mut self,
        w: &[f32],
        (positions, h): (usize, usize),
        (g, relu): (FirstGrad<'_>, Option<(&[f32], f32)>),
        (dw, db): (&mut [f32], &mut [f32]),
    ) {
        let (d, rows) = (self.d, self.rows);
        assert_eq!(db.len(), h, "the unit's first bias's gradient");
        self.split_weights(w, h);
        let b = &mut *self.bufs;
        // One pass over the positions: each one's gradient (computed, for
        // an outer product) through the ReLU, then added to the bias's and
        // to its row's.
        let g_rows = sized(&mut b.g_rows, rows * h);
        g_rows.fill(0.0);
        let g: &[f32] = match g {
            FirstGrad::Laid(g) => {
                assert_eq!(g.len(), positions * h, "the unit's first gradients");
                positions::mask_and_sum(self.simd, (FirstGrad::Laid(&mut *g), relu), self.at_rows, (db, g_rows));
                g
            }
            FirstGrad::Outer { seed, w: w_next, into, next_dw } => {
                assert_eq!(into.len(), positions * h, "the unit's first gradients");
                let outer = FirstGrad::Outer { seed, w: w_next, into: &mut *into, next_dw };
                positions::mask_and_sum(self.simd, (outer, relu), self.at_rows, (db, g_rows));
                into
            }
        };
        let dh = d * h;
        let (dwq, rest) = dw.split_at_mut(dh);
        let (dwk, rest) = rest.split_at_mut(dh);
        let (dwd, dwp) = rest.split_at_mut(dh);
        matmul(Arith::F32(self.simd), None, d, h, rows, Operand::t(&b.q_rows), Operand::plain(&b.g_rows), dwq);
        let dw_parts = sized(&mut b.dw_parts, positions.div_ceil(POSITIONS_PER_PART) * 2 * dh);
        let (kq, per_part) = (&b.kq, POSITIONS_PER_PART);
        dw_parts.par_chunks_mut(2 * dh).zip(kq.par_chunks(2 * d * per_part).zip(g.par_chunks(h * per_part))).for_each(
            |(part, (kq, g))| {
                let n = g.len() / h;
                matmul(Arith::F32(self.simd), Some(1), 2 * d, h, n, Operand::t(kq), Operand::plain(g), part);
            },
        );
        let dw_item = sized(&mut b.dw_item, 2 * dh);
        dw_item.fill(0.0);
        for part in b.dw_parts.chunks_exact(2 * dh) {
            dw_item.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
        let (item_k, item_p) = dw_item.split_at(dh);
        dwk.copy_from_slice(item_k);
        dwp.copy_from_slice(item_p);
        dwd.iter_mut().zip(dwq.iter().zip(item_k)).for_each(|(o, (q, k))| *o = q - k);
        let e = sized(&mut b.e, positions * 2 * d);
        matmul(Arith::F32(self.simd), None, positions, 2 * d, h, Operand::plain(g), Operand::t(&b.w_item), e);
        let dq_rows = sized(&mut b.dq_rows, rows * d);
        matmul(Arith::F32(self.simd), None, rows, d, h, Operand::plain(&b.g_rows), Operand::t(&b.w_row), dq_rows);
    }
}
