//! A step policy: the batch's two halves, one a thread. The multi-task
//! kinds' passes (experts of 64 units, towers of 32, gates of a few
//! columns) take 10–100 µs each on a batch of 1024; split one by one
//! across two threads, each split costs a wake-up of the other thread (an
//! interprocessor interrupt on a VM) and the short ones run on one thread
//! alone. Here each half of the batch runs forward on a thread of its own,
//! and backward again after the loss: two meetings a step.
//!
//! Only kinds whose rows are independent take it (`Direct::half_rows`;
//! dropout's masks are drawn by a value's place in the whole batch, the
//! second half's from `At::first_row`), only without batch statistics
//! (batch norm, Dice), and only where each half has the rows, and so the
//! work, the kind asks for. The halves are cut by the batch's rows alone
//! and their weight gradients summed first half first, so the model is the
//! same on any number of threads; a pool of one runs the halves one after
//! the other. A prediction of such a batch runs in halves too: a half's
//! products are blocked by its own rows, and so it gives the step's logits
//! bit for bit.

use super::DenseModel;
use crate::ModelError;
use crate::optimizer::DenseGrads;
use crate::step::Scratch;

/// The rows of the first half of a batch of `rows` (the second has the rest).
fn first_half(rows: usize) -> usize {
    rows.div_ceil(2)
}

impl DenseModel {
    /// Whether a training step or a prediction on `rows` rows runs as two
    /// halves, one a thread (see the module's comment for which kinds and
    /// settings).
    pub fn runs_in_halves(&self, rows: usize) -> bool {
        self.half_rows().is_some_and(|half| rows >= 2 * half)
    }

    /// The fewest rows a half takes where the model's step may run in
    /// halves (from a batch of twice that); `None` where it may not.
    pub fn half_rows(&self) -> Option<usize> {
        let half = self.net.direct().and_then(|d| d.half_rows());
        half.filter(|_| self.attention().is_empty() && !self.params.has_statistics())
    }

    /// [`forward_direct`](Self::forward_direct) on each half, side by side:
    /// the logits of the batch, the first half's rows first.
    pub(super) fn forward_halves(
        &self,
        x: &[f32],
        rows: usize,
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let first = first_half(rows);
        let (x0, x1) = x.split_at((first * self.row_len()).min(x.len()));
        let mut second = s.second_half.take().unwrap_or_default();
        let (a, b) = rayon::join(
            || self.forward_direct(x0, first, draw, s),
            || self.forward_direct_at(x1, (rows - first, first), draw, &mut second),
        );
        s.second_half = Some(second);
        let mut logits = a?;
        logits.extend_from_slice(&b?);
        Ok(logits)
    }

    /// The backward pass of the last [`forward_halves`](Self::forward_halves):
    /// each half's gradients, summed (the first half's plus the
    /// second's), and d loss / d input of the whole batch in `s.grad_x`.
    pub(super) fn backward_halves(&self, x: &[f32], seed: &[f32], s: &mut Scratch) -> Result<DenseGrads, ModelError> {
        let stride = self.row_len().max(1);
        let rows = x.len() / stride;
        let first = first_half(rows);
        let outputs = seed.len() / rows.max(1);
        let (x0, x1) = x.split_at((first * stride).min(x.len()));
        let (seed0, seed1) = seed.split_at((first * outputs).min(seed.len()));
        let forward = || ModelError::BadInput {
            what: "a backward pass in halves before its forward",
            len: 0,
            rows,
            per_row: stride,
        };
        let mut second = s.second_half.take().ok_or_else(forward)?;
        let (a, b) =
            rayon::join(|| self.backward_direct(x0, seed0, s), || self.backward_direct(x1, seed1, &mut second));
        let result = a.and_then(|mut grads| {
            let theirs = b?;
            add_into(&mut grads, &theirs);
            s.grad_x.truncate(first * stride);
            s.grad_x.extend_from_slice(&second.grad_x);
            // The second half's buffers, spent, are its next step's.
            self.recycle_direct(theirs.grads.into_iter().flatten().collect(), &mut second);
            Ok(grads)
        });
        s.second_half = Some(second);
        result
    }
}

/// `grads += theirs`, parameter by parameter (a parameter only one half
/// has a gradient for takes that one).
fn add_into(grads: &mut DenseGrads, theirs: &DenseGrads) {
    for (mine, theirs) in grads.grads.iter_mut().zip(&theirs.grads) {
        match (mine, theirs) {
            (Some(mine), Some(theirs)) => mine.iter_mut().zip(theirs).for_each(|(m, t)| *m += t),
            (mine @ None, Some(theirs)) => *mine = Some(theirs.clone()),
            (_, None) => {}
        }
    }
    grads.rows += theirs.rows;
}
