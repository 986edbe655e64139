//! DIN's direct CPU step: the same math as its graph (`din.rs`) and its
//! autograd (tested), outside candle's graph. The local activation unit
//! runs once over every (row, history item) pair of the batch, as one fused
//! MLP on a `[positions, 4·d]` matrix of `[q, k, q − k, q ⊙ k]`; the
//! weighted sum, its adjoint and the features' adjoint are one pass each.
//! On the graph the same step was some forty ops a sequence (index
//! selects, concatenations, broadcasts, an index add, and each one's
//! adjoint), each allocating.

use rayon::prelude::*;

use super::DinNet;
use super::positions::{self, Slots};
use super::product::{ProductBufs, UnitInput};
use crate::ModelError;
use crate::kinds::{At, Direct, Grads, Met};
use crate::meet::Side;
use crate::mlp::{First, Mlp, MlpScratch, sized};
use crate::step::Scratch;

/// Positions a task of a pass over history items takes.
const POSITIONS_PER_TASK: usize = 256;

/// The fewest rows a half of a batch run in halves takes. `dense_step din
/// f32 ROWS dim=8 hidden=64,32` (the behaviour benchmark's DIN), whole
/// against halves, an AVX-512 Xeon, two threads, best ms of 60: 32 rows
/// 0.057 / 0.054–0.056, 64 rows 0.084–0.086 / 0.070–0.075, 128 rows
/// 0.180–0.192 / 0.124–0.129; at 256 rows 0.372–0.392 / 0.215–0.234.
const HALF_ROWS: usize = 16;

/// DIN's buffers, kept between steps (`Scratch::of_kind`).
#[derive(Default)]
pub(super) struct DinScratch {
    /// Each sequence's attention unit's.
    units: Vec<MlpScratch>,
    /// Each sequence's unit's first product's buffers (`product.rs`).
    products: Vec<ProductBufs>,
    /// A sequence's d loss / d score, a position.
    d_scores: Vec<f32>,
    /// Each sequence's positions' shares of their queries' gradients
    /// (every element written each step: kept, not zeroed, between steps).
    d_queries: Vec<Vec<f32>>,
}

impl Direct for DinNet {
    fn forward_met<'a>(
        &'a self,
        at: &'a At,
        input: (&'a [f32], usize),
        s: &'a mut Scratch,
        meet: Option<Side<'a>>,
    ) -> Met<'a, Vec<f32>> {
        Box::pin(self.forward_with(at, input, s, meet))
    }

    fn backward_met<'a: 'b, 'b>(
        &'a self,
        at: &'b At,
        (_x, seed): (&'b [f32], &'b [f32]),
        s: &'b mut Scratch,
        meet: Option<Side<'b>>,
    ) -> Met<'b, Grads<'a>> {
        Box::pin(self.backward_with(at, seed, s, meet))
    }

    /// Its MLP's batch norm and Dice's statistics, in the MLP or a unit,
    /// meet across the halves (`meet.rs`).
    fn meets_statistics(&self) -> bool {
        true
    }

    fn mlps<'s>(&'s self, s: &'s mut Scratch) -> Vec<(&'s Mlp, &'s mut MlpScratch)> {
        let mut mlps = vec![(&self.mlp, &mut s.deep)];
        let ds: &mut DinScratch = match s.kind.as_mut().and_then(|k| k.downcast_mut::<DinScratch>()) {
            Some(ds) => ds,
            None => return mlps,
        };
        mlps.extend(self.units.iter().zip(ds.units.iter_mut()));
        mlps
    }

    fn several_outputs(&self) -> bool {
        true
    }

    /// A batch's rows split cleanly: each history item is its row's, and
    /// the MLP's batch norm meets across the halves. Run whole, DIN's step
    /// splits each product across the threads and its passes between them
    /// (the unit's last layer, the weighted sums, the head) read what the
    /// other thread wrote; as halves, a row's values stay with the thread
    /// that made them, and the threads meet at each batch-normed layer
    /// each way and at the end, not at every product. So the halves pay
    /// from far fewer rows than the multi-task kinds' ([`HALF_ROWS`]).
    fn half_rows(&self) -> Option<usize> {
        Some(HALF_ROWS)
    }
}

impl DinNet {
    /// The forward pass; a half of a batch (`meet`) meets the other at its
    /// MLP's batch norm and at Dice's statistics (in the MLP or a unit: a
    /// unit's over the history items of the whole batch, so a half with
    /// none of a sequence's items still meets, with a share of none).
    async fn forward_with(
        &self,
        at: &At,
        (x, rows): (&[f32], usize),
        s: &mut Scratch,
        meet: Option<Side<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        let (d, stride) = (at.width, at.row_len());
        if s.sequences.items.len() != self.pairs.len() {
            return Err(ModelError::Sequences { expected: self.pairs.len(), found: s.sequences.items.len() });
        }
        // The MLP's input: the rows with each sequence's slot replaced by its attention pooling.
        let mut input = std::mem::take(&mut s.x);
        input.clear();
        input.extend_from_slice(x);
        let sequences = std::mem::take(&mut s.sequences);
        let ds: &mut DinScratch = s.of_kind();
        ds.units.resize_with(self.units.len(), MlpScratch::default);
        ds.products.resize_with(self.units.len(), ProductBufs::default);
        for (j, (&(slot, query), unit)) in self.pairs.iter().zip(&self.units).enumerate() {
            let (keys, at_rows) = (&sequences.items[j], &sequences.rows[j]);
            let positions = at_rows.len();
            for row in input.chunks_exact_mut(stride) {
                row[slot * d..(slot + 1) * d].fill(0.0);
            }
            let unit_meets = meet.filter(|_| unit.batch_statistics());
            if positions == 0 {
                if let Some(meet) = unit_meets {
                    unit.forward_met(First::Input(&[]), (0, 0), (at.dropout, meet), &mut ds.units[j]).await?;
                }
                continue;
            }
            // The unit is fp32 (`kinds/din.rs`): its first layer from its parts.
            let mut first =
                UnitInput::new((x, stride, rows), (query, d), keys, (at_rows, self.simd), &mut ds.products[j]);
            match unit_meets {
                Some(meet) => {
                    let first = First::Product(&mut first);
                    unit.forward_met(first, (positions, 0), (at.dropout, meet), &mut ds.units[j]).await?;
                }
                None => unit.forward_cpu_from(&mut first, positions, at.dropout, &mut ds.units[j])?,
            }
            let slots = Slots { values: &mut input, stride, offset: slot * d };
            positions::add_to_slots(self.simd, d, (keys, Some(&ds.units[j].output)), at_rows, slots);
        }
        s.sequences = sequences;
        let rows = (rows, at.first_row);
        let result = match meet {
            Some(meet) => self.mlp.forward_met(First::Input(&input), rows, (at.dropout, meet), &mut s.deep).await,
            None => self.mlp.forward_cpu_at(&input, rows, at.dropout, &mut s.deep),
        };
        s.x = input;
        result?;
        Ok(s.deep.output.clone())
    }

    /// The backward pass of the last [`forward_with`](Self::forward_with):
    /// the dense gradients.
    async fn backward_with<'a>(
        &'a self,
        at: &At,
        seed: &[f32],
        s: &mut Scratch,
        meet: Option<Side<'_>>,
    ) -> Result<Grads<'a>, ModelError> {
        let (d, stride) = (at.width, at.row_len());
        let mlp_grads = match meet {
            Some(meet) => self.mlp.backward_met(First::Input(&s.x), (seed, false), &mut s.deep, meet).await?,
            None => self.mlp.backward_cpu(&s.x, seed, &mut s.deep)?,
        };
        let mut grads = vec![(self.mlp.params(), mlp_grads)];
        // d loss / d x: the MLP's, but a sequence's slot (replaced) takes
        // nothing and its candidate also gets the attention's share.
        let mut grad_x = std::mem::replace(&mut s.deep.grad_input, std::mem::take(&mut s.grad_x));
        let mut item_grads = std::mem::take(&mut s.item_grads);
        item_grads.resize_with(self.pairs.len(), Vec::new);
        let sequences = std::mem::take(&mut s.sequences);
        let ds: &mut DinScratch = s.of_kind();
        let mut d_queries = std::mem::take(&mut ds.d_queries);
        d_queries.resize_with(self.pairs.len(), Vec::new);
        for (j, (&(slot, query), unit)) in self.pairs.iter().zip(&self.units).enumerate() {
            let (keys, at_rows) = (&sequences.items[j], &sequences.rows[j]);
            let positions = at_rows.len();
            // Every element is written below (d score's pass first).
            let dk = sized(&mut item_grads[j], positions * d);
            let dq = sized(&mut d_queries[j], positions * d);
            let unit_meets = meet.filter(|_| unit.batch_statistics());
            if positions == 0
                && let Some(meet) = unit_meets
            {
                // No items here, but the other half's meet this one's share of none.
                unit.backward_met(First::Input(&[]), (&[], false), &mut ds.units[j], meet).await?;
            }
            if positions > 0 {
                let scores = &ds.units[j].output;
                // d score_p = ⟨d pooled, k_p⟩; d k_p = score_p · d pooled (plus the unit's share, below).
                let d_scores = sized(&mut ds.d_scores, positions);
                let g = &grad_x;
                // A task's positions in one call, not a rayon item each.
                let task = POSITIONS_PER_TASK;
                d_scores.par_chunks_mut(task).zip(dk.par_chunks_mut(d * task)).enumerate().for_each(|(t, (ds, dk))| {
                    let items = t * task..t * task + ds.len();
                    let (keys, scores) = (&keys[items.start * d..items.end * d], &scores[items.clone()]);
                    positions::score_grads(
                        self.simd,
                        d,
                        (keys, scores),
                        &at_rows[items],
                        (g, stride, slot * d),
                        (ds, dk),
                    );
                });
                // Through the product's parts (`product.rs`); a row's share
                // of its query's gradient is added once.
                let rows = grad_x.len() / stride.max(1);
                let mut first = UnitInput { d, rows, at_rows, bufs: &mut ds.products[j], simd: self.simd };
                let unit_grads = match unit_meets {
                    Some(meet) => {
                        let input = First::Product(&mut first);
                        unit.backward_met(input, (d_scores, false), &mut ds.units[j], meet).await?
                    }
                    None => unit.backward_cpu_from(&mut first, d_scores, &mut ds.units[j])?,
                };
                grads.push((unit.params(), unit_grads));
                first.item_and_query_grads(keys, dk, dq);
                for (g, dq) in grad_x.chunks_exact_mut(stride).zip(first.bufs.dq_rows.chunks_exact(d)) {
                    g[query * d..(query + 1) * d].iter_mut().zip(dq).for_each(|(g, dq)| *g += dq);
                }
            }
        }
        for &(slot, _) in &self.pairs {
            for row in grad_x.chunks_exact_mut(stride) {
                row[slot * d..(slot + 1) * d].fill(0.0);
            }
        }
        for ((&(_, query), dq), at_rows) in self.pairs.iter().zip(&d_queries).zip(&sequences.rows) {
            let slots = Slots { values: &mut grad_x, stride, offset: query * d };
            positions::add_to_slots(self.simd, d, (dq, None), at_rows, slots);
        }
        s.of_kind::<DinScratch>().d_queries = d_queries;
        s.sequences = sequences;
        s.item_grads = item_grads;
        s.grad_x = grad_x;
        Ok(grads)
    }
}
