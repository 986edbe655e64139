//! A step policy: the batch's two halves, one a thread. The multi-task
//! kinds' passes (experts of 64 units, towers of 32, gates of a few
//! columns) take 10–100 µs each on a batch of 1024; split one by one
//! across two threads, each split costs a wake-up of the other thread (an
//! interprocessor interrupt on a VM) and the short ones run on one thread
//! alone. Here each half of the batch runs forward, its rows' loss and
//! backward on a thread of its own: one meeting a step, where the thread
//! done first waits for the other awake (`awake::join`).
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

    /// A training step in halves: each half's forward pass, its rows'
    /// losses and seed, and its backward pass on a thread of its own, so
    /// the threads meet once a step (the loss over the whole batch between
    /// the passes made it three times). Returns the batch's loss (the rows'
    /// losses summed in row order), its logits, and the halves' gradients
    /// summed (the first's plus the second's); d loss / d input of the
    /// whole batch is in `s.grad_x`. Every value is the one the batch would
    /// get with its loss taken whole between passes in halves: a row's seed
    /// is its own loss's, over the whole batch's rows.
    pub(super) fn step_halves(
        &self,
        x: &[f32],
        (labels, weights): (&[f32], Option<&[f32]>),
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<(f64, Vec<f32>, DenseGrads), ModelError> {
        let tasks = self.heads.tasks().max(1);
        let rows = labels.len() / tasks;
        let stride = self.row_len();
        if x.len() != rows * stride {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: stride });
        }
        if !self.heads.is_one_binary() {
            self.heads.check_labels(labels)?;
        }
        let inv_b = 1.0 / rows.max(1) as f64;
        let first = first_half(rows);
        let (x0, x1) = x.split_at(first * stride);
        let (labels0, labels1) = labels.split_at(first * tasks);
        let (weights0, weights1) = match weights {
            Some(w) => {
                let (a, b) = w.split_at(first.min(w.len()));
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        // A half's backward pass runs whatever its loss; the batch's loss
        // is checked first, so a NaN loss is the error a step reports.
        let half = |x: &[f32], (rows, first_row): (usize, usize), labels, weights, s: &mut Scratch| {
            let logits = self.forward_direct_at(x, (rows, first_row), draw, s)?;
            let (losses, seed) = self.rows_loss_and_seed_of(&logits, labels, weights, inv_b);
            let grads = self.backward_direct(x, &seed, s);
            Ok::<_, ModelError>((losses, logits, grads))
        };
        let mut second = s.second_half.take().unwrap_or_default();
        let (a, b) = crate::awake::join(
            || half(x0, (first, 0), labels0, weights0, s),
            || half(x1, (rows - first, first), labels1, weights1, &mut second),
        );
        let result = a.and_then(|(mut losses, mut logits, grads)| {
            let (their_losses, their_logits, theirs) = b?;
            losses.extend_from_slice(&their_losses);
            let loss = crate::heads::sum_in_order(&losses) * inv_b;
            self.check_loss(loss)?;
            let (mut grads, theirs) = (grads?, theirs?);
            logits.extend_from_slice(&their_logits);
            add_into(&mut grads, &theirs);
            s.grad_x.truncate(first * stride);
            s.grad_x.extend_from_slice(&second.grad_x);
            // The second half's buffers, spent, are its next step's.
            self.recycle_direct(theirs.grads.into_iter().flatten().collect(), &mut second);
            Ok((loss, logits, grads))
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
