//! Bags of keys ↔ one vector per (row, field): sum or mean pooling, weighted by
//! the keys' values, and its exact adjoint for the backward pass.

use rayon::prelude::*;
use sparrow_core::Batch;
use sparrow_core::config::Pooling;
use sparrow_embedding::KeyPlan;
use sparrow_model::Sequences;

/// What pooling needs of a batch: its bags, and for every key position the
/// index of that key among the batch's unique keys. No raw keys: a cluster
/// worker pools from this without ever seeing an ID (S0.1).
#[derive(Clone, Copy, Debug)]
pub struct Bags<'a> {
    pub rows: usize,
    pub num_fields: usize,
    /// `rows × num_fields + 1` offsets into the key positions.
    pub bag_offsets: &'a [u32],
    /// Per key position; `None` = all 1.
    pub key_weights: Option<&'a [f32]>,
    /// Per key position: index into the unique keys (and their rows).
    pub inverse: &'a [u32],
    pub num_unique: usize,
}

impl<'a> Bags<'a> {
    pub fn of(batch: &'a Batch, plan: &'a KeyPlan) -> Bags<'a> {
        Bags {
            rows: batch.rows(),
            num_fields: batch.num_fields,
            bag_offsets: &batch.bag_offsets,
            key_weights: batch.key_weights.as_deref(),
            inverse: &plan.inverse,
            num_unique: plan.num_unique(),
        }
    }

    #[inline]
    fn bag(&self, row: usize, field: usize) -> std::ops::Range<usize> {
        let i = row * self.num_fields + field;
        self.bag_offsets[i] as usize..self.bag_offsets[i + 1] as usize
    }

    #[inline]
    fn weight(&self, i: usize) -> f32 {
        self.key_weights.map_or(1.0, |w| w[i])
    }
}

#[inline]
fn bag_scale(pooling: Pooling, len: usize) -> f32 {
    match pooling {
        Pooling::Sum => 1.0,
        Pooling::Mean => 1.0 / len.max(1) as f32,
    }
}

/// Pools into `out`, whose rows are `row_stride` floats apart: row r's
/// fields fill `out[r·row_stride .. r·row_stride + fields·width]` and the rest
/// of the row is row r's dense values (`dense`, `row_stride − fields·width`
/// a row), or zeros where `dense` is `None`. `out` can be reused across steps.
/// Each row is written whole by the thread that pools it: a model that
/// runs a batch's halves on two threads (`sparrow_model`'s `halves.rs`)
/// reads the second half's rows on the thread that most likely pooled
/// them, where the dense values copied afterwards on the caller's thread
/// pulled a line of every row into its cache.
pub fn pool_into(
    bags: &Bags<'_>,
    unique_rows: &[f32],
    width: usize,
    pooling: Pooling,
    (out, row_stride): (&mut [f32], usize),
    dense: Option<&[f32]>,
) {
    let f = bags.num_fields;
    assert!(row_stride >= f * width && out.len() == bags.rows * row_stride, "pool_into: output layout");
    let num_dense = row_stride - f * width;
    assert!(dense.is_none_or(|d| d.len() == bags.rows * num_dense), "pool_into: dense values");
    const ROWS_PER_TASK: usize = 64;
    out.par_chunks_mut(row_stride * ROWS_PER_TASK).enumerate().for_each(|(chunk, rows)| {
        // Zero the task's rows in one block first: a large fill writes
        // whole cache lines without reading them, while the slots below are
        // partial-line writes that each wait for the line to be read in. In
        // training the buffer is out of cache by the time the next batch
        // pools (the dense step in between evicts it): the reference MLP's
        // pool took 2× as long without this (docs/benchmarks.md).
        rows.fill(0.0);
        for (r, row_out) in rows.chunks_mut(row_stride).enumerate() {
            let row = chunk * ROWS_PER_TASK + r;
            if let Some(dense) = dense {
                row_out[f * width..].copy_from_slice(&dense[row * num_dense..(row + 1) * num_dense]);
            }
            for (field, slot) in row_out[..f * width].chunks_mut(width).enumerate() {
                let range = bags.bag(row, field);
                if range.is_empty() {
                    slot.fill(0.0);
                    continue;
                }
                let scale = bag_scale(pooling, range.len());
                // The first key's vector is written, the others added: no
                // zero-fill per slot (a memset call for 64 bytes cost more than
                // the pooling itself).
                let first = range.start;
                for i in range {
                    let u = bags.inverse[i] as usize;
                    let w = bags.weight(i) * scale;
                    let src = &unique_rows[u * width..(u + 1) * width];
                    match (i == first, w == 1.0) {
                        (true, true) => copy_vector(slot, src),
                        (true, false) => slot.iter_mut().zip(src).for_each(|(o, s)| *o = w * s),
                        (false, true) => slot.iter_mut().zip(src).for_each(|(o, s)| *o += s),
                        (false, false) => slot.iter_mut().zip(src).for_each(|(o, s)| *o += w * s),
                    }
                }
            }
        }
    });
}

/// `dst.copy_from_slice(src)`, as a few moves for the usual widths (16;
/// 17, FM's first-order weight and 16 factors): through libc's `memmove`, a
/// call for each 64-byte vector took a third of the reference MLP's pooling.
#[inline(always)]
fn copy_vector(dst: &mut [f32], src: &[f32]) {
    if let (Ok(d), Ok(s)) = (<&mut [f32; 16]>::try_from(&mut *dst), <&[f32; 16]>::try_from(src)) {
        *d = *s;
    } else if let (Ok(d), Ok(s)) = (<&mut [f32; 17]>::try_from(&mut *dst), <&[f32; 17]>::try_from(src)) {
        *d = *s;
    } else {
        dst.copy_from_slice(src);
    }
}

/// Pooled embeddings `[rows, fields, width]` from the unique rows.
pub fn pool(bags: &Bags<'_>, unique_rows: &[f32], width: usize, pooling: Pooling) -> Vec<f32> {
    let stride = bags.num_fields * width;
    let mut out = vec![0.0f32; bags.rows * stride];
    pool_into(bags, unique_rows, width, pooling, (&mut out, stride), None);
    out
}

/// Adjoint of [`pool_into`]: gradients per unique key, duplicates summed
/// (S3.7), from `grad` laid out like `pool_into`'s output.
pub fn unpool_strided(bags: &Bags<'_>, grad: &[f32], row_stride: usize, width: usize, pooling: Pooling) -> Vec<f32> {
    unpool_rows(bags, grad.chunks_exact(row_stride.max(1)), width, pooling)
}

/// [`unpool_strided`] from the rows' gradients one at a time, in order
/// (each row's fields' `width` values from its start): a step in halves
/// leaves its input gradient in two parts (`InputGrad::rows`).
pub fn unpool_rows<'a>(
    bags: &Bags<'_>,
    mut rows: impl Iterator<Item = &'a [f32]>,
    width: usize,
    pooling: Pooling,
) -> Vec<f32> {
    let f = bags.num_fields;
    let mut out = vec![0.0f32; bags.num_unique * width];
    for row in 0..bags.rows {
        // The step hands on every row's gradient (`DenseModel` checks the
        // halves cover the batch): one missing is a bug, as an index past
        // a buffer was.
        let grad = rows.next().expect("unpool: the input gradient has fewer rows than the batch");
        for field in 0..f {
            let range = bags.bag(row, field);
            let scale = bag_scale(pooling, range.len());
            let g = &grad[field * width..(field + 1) * width];
            for i in range {
                let u = bags.inverse[i] as usize;
                let w = bags.weight(i) * scale;
                out[u * width..(u + 1) * width].iter_mut().zip(g).for_each(|(o, g)| *o += w * g);
            }
        }
    }
    out
}

/// Adjoint of [`pool`].
pub fn unpool(bags: &Bags<'_>, grad: &[f32], width: usize, pooling: Pooling) -> Vec<f32> {
    unpool_strided(bags, grad, bags.num_fields * width, width, pooling)
}

/// Each attended sequence's history items, unpooled (`pairs`: each
/// sequence's slot among the fields first, as `DenseModel::attention`): per
/// position its key's row times its weight, and the row it sits in.
pub fn gather_sequences(bags: &Bags<'_>, unique_rows: &[f32], width: usize, pairs: &[(usize, usize)]) -> Sequences {
    let mut seq = Sequences::default();
    for &(slot, _) in pairs {
        let (mut items, mut at) = (Vec::new(), Vec::new());
        for row in 0..bags.rows {
            for i in bags.bag(row, slot) {
                let (u, w) = (bags.inverse[i] as usize, bags.weight(i));
                items.extend(unique_rows[u * width..(u + 1) * width].iter().map(|v| w * v));
                at.push(row as u32);
            }
        }
        seq.items.push(items);
        seq.rows.push(at);
    }
    seq
}

/// Adjoint of [`gather_sequences`], added into `grads` (per unique key).
pub fn scatter_item_grads(
    bags: &Bags<'_>,
    item_grads: &[Vec<f32>],
    width: usize,
    pairs: &[(usize, usize)],
    grads: &mut [f32],
) {
    for (&(slot, _), g) in pairs.iter().zip(item_grads) {
        let mut p = 0;
        for row in 0..bags.rows {
            for i in bags.bag(row, slot) {
                let (u, w) = (bags.inverse[i] as usize, bags.weight(i));
                let g = &g[p * width..(p + 1) * width];
                grads[u * width..(u + 1) * width].iter_mut().zip(g).for_each(|(o, g)| *o += w * g);
                p += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparrow_core::BatchBuilder;
    use sparrow_core::batch::DataPosition;

    /// Every width (the usual ones copied inline, others through
    /// `copy_from_slice`) pools what a plain sum over each bag gives: single
    /// keys copied, several summed with their weights, empty bags zero.
    #[test]
    fn pooling_at_every_width_is_the_weighted_sum_of_each_bag() {
        let mut b = BatchBuilder::new(3, 0, true, 3);
        let rows = [vec![(0, 1, 1.0), (1, 2, 1.0), (1, 3, 0.5)], vec![(0, 3, 1.0), (2, 1, 2.0)]];
        for keys in &rows {
            b.begin_row();
            for &(f, k, w) in keys {
                assert!(b.push_key(f, k, w));
            }
            assert!(b.end_row(0.0));
        }
        let batch = b.finish(DataPosition::default());
        let plan = KeyPlan::new(&batch.keys, 1, |_| 0);
        let bags = Bags::of(&batch, &plan);
        for width in [1, 2, 15, 16, 17, 18, 33] {
            let x: Vec<f32> = (0..plan.num_unique() * width).map(|i| i as f32 * 0.25 - 3.0).collect();
            let stride = 3 * width + 2;
            let mut out = vec![f32::NAN; batch.rows() * stride];
            pool_into(&bags, &x, width, Pooling::Sum, (&mut out, stride), None);
            for (r, keys) in rows.iter().enumerate() {
                for field in 0..3 {
                    let mut want = vec![0.0f32; width];
                    for &(_, key, w) in keys.iter().filter(|(f, _, _)| *f == field) {
                        let u = plan.inverse[batch.keys.iter().position(|&k| k == key).expect("key")] as usize;
                        want.iter_mut().zip(&x[u * width..(u + 1) * width]).for_each(|(o, v)| *o += w * v);
                    }
                    let at = r * stride + field * width;
                    assert_eq!(&out[at..at + width], &want[..], "width {width}, row {r}, field {field}");
                }
            }
        }
    }

    /// <gather(x), g> == <x, scatter(g)>: the attended items' gradients
    /// reach their keys exactly, a key repeated in a history summed.
    #[test]
    fn gathering_and_scattering_history_items_are_adjoint() {
        let mut b = BatchBuilder::new(2, 0, true, 3);
        for keys in [vec![(0, 1, 1.0), (1, 2, 1.0), (1, 1, 1.0), (1, 2, 1.0)], vec![(0, 3, 1.0)]] {
            b.begin_row();
            for (f, k, w) in keys {
                assert!(b.push_key(f, k, w));
            }
            assert!(b.end_row(0.0));
        }
        let batch = b.finish(DataPosition::default());
        let plan = KeyPlan::new(&batch.keys, 1, |_| 0);
        let bags = Bags::of(&batch, &plan);
        let width = 3;
        let x: Vec<f32> = (0..plan.num_unique() * width).map(|i| i as f32 * 0.5 - 1.0).collect();
        let seq = gather_sequences(&bags, &x, width, &[(1, 0)]);
        assert_eq!(seq.rows, vec![vec![0, 0, 0]], "row 0's three items; row 1's history is empty");
        let u2 = plan.inverse[1] as usize;
        assert_eq!(&seq.items[0][..width], &x[u2 * width..(u2 + 1) * width]);
        let g: Vec<f32> = (0..3 * width).map(|i| (i as f32).cos()).collect();
        let mut grads = vec![0.0f32; x.len()];
        scatter_item_grads(&bags, std::slice::from_ref(&g), width, &[(1, 0)], &mut grads);
        let lhs: f32 = seq.items[0].iter().zip(&g).map(|(a, b)| a * b).sum();
        let rhs: f32 = x.iter().zip(&grads).map(|(a, b)| a * b).sum();
        assert!((lhs - rhs).abs() < 1e-5, "{lhs} vs {rhs}");
        let twice: Vec<f32> = (0..width).map(|c| g[c] + g[2 * width + c]).collect();
        assert_eq!(&grads[u2 * width..(u2 + 1) * width], &twice[..], "key 2's two positions summed");
    }

    #[test]
    fn pool_and_unpool_are_adjoint() {
        // <pool(x), g> == <x, unpool(g)> for any x, g: the backward is exact.
        let mut b = BatchBuilder::new(2, 0, true, 3);
        for (keys, label) in [(vec![(0, 1, 0.5), (0, 2, 2.0), (1, 1, 1.0)], 1.0), (vec![(1, 3, 1.0), (1, 3, 1.0)], 0.0)]
        {
            b.begin_row();
            for (f, k, w) in keys {
                assert!(b.push_key(f, k, w));
            }
            assert!(b.end_row(label));
        }
        let batch = b.finish(DataPosition::default());
        let plan = KeyPlan::new(&batch.keys, 1, |_| 0);
        let bags = Bags::of(&batch, &plan);
        let width = 2;
        let x: Vec<f32> = (0..plan.num_unique() * width).map(|i| i as f32 * 0.3 - 0.5).collect();
        let g: Vec<f32> = (0..batch.rows() * 2 * width).map(|i| (i as f32).sin()).collect();
        for pooling in [Pooling::Sum, Pooling::Mean] {
            let px = pool(&bags, &x, width, pooling);
            let ug = unpool(&bags, &g, width, pooling);
            let lhs: f32 = px.iter().zip(&g).map(|(a, b)| a * b).sum();
            let rhs: f32 = x.iter().zip(&ug).map(|(a, b)| a * b).sum();
            assert!((lhs - rhs).abs() < 1e-5, "{pooling:?}: {lhs} vs {rhs}");
        }
        // Strided layout (as the packed model input): same values, same adjoint.
        let stride = 2 * width + 3;
        let mut packed = vec![7.0f32; batch.rows() * stride];
        pool_into(&bags, &x, width, Pooling::Mean, (&mut packed, stride), None);
        let plain = pool(&bags, &x, width, Pooling::Mean);
        for r in 0..batch.rows() {
            assert_eq!(&packed[r * stride..r * stride + 2 * width], &plain[r * 2 * width..(r + 1) * 2 * width]);
            assert_eq!(&packed[r * stride + 2 * width..(r + 1) * stride], &[0.0; 3], "dense part zeroed");
        }
        // With the rows' dense values: each row's tail is its own three.
        let dense: Vec<f32> = (0..batch.rows() * 3).map(|i| i as f32 + 0.5).collect();
        pool_into(&bags, &x, width, Pooling::Mean, (&mut packed, stride), Some(&dense));
        for r in 0..batch.rows() {
            assert_eq!(&packed[r * stride..r * stride + 2 * width], &plain[r * 2 * width..(r + 1) * 2 * width]);
            assert_eq!(&packed[r * stride + 2 * width..(r + 1) * stride], &dense[r * 3..(r + 1) * 3], "row {r}");
        }
        let mut g_packed = vec![0.0f32; batch.rows() * stride];
        for r in 0..batch.rows() {
            g_packed[r * stride..r * stride + 2 * width].copy_from_slice(&g[r * 2 * width..(r + 1) * 2 * width]);
        }
        assert_eq!(
            unpool_strided(&bags, &g_packed, stride, width, Pooling::Mean),
            unpool(&bags, &g, width, Pooling::Mean)
        );
        // Sum pooling of bag (row 0, field 0) = 0.5·x[key1] + 2·x[key2].
        let px = pool(&bags, &x, width, Pooling::Sum);
        let u1 = plan.inverse[0] as usize;
        let u2 = plan.inverse[1] as usize;
        assert!((px[0] - (0.5 * x[u1 * 2] + 2.0 * x[u2 * 2])).abs() < 1e-6);
    }
}
