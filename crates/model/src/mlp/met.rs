//! An MLP's passes on a half of a batch run in halves whose batch norm
//! meets the other half's (`meet.rs`). A half waits at each meeting
//! holding no lock: with the parameters' read lock held, a writer queued
//! between the two halves' reads (the lock is fair: it blocks new
//! readers) would wait for the first half and the second for the writer.
//! So a half's forward pass reads a copy of the weights, kept in its
//! scratch for its backward pass (a step changes no weight).

use super::{First, Mlp, MlpScratch, backward_into, cpu, forward_into};
use crate::ModelError;
use crate::meet::Side;

impl Mlp {
    /// [`forward_cpu_at`](Self::forward_cpu_at) on a half of a batch,
    /// meeting the other half at `meet`.
    pub(crate) async fn forward_met(
        &self,
        x: &[f32],
        (rows, first_row): (usize, usize),
        (draw, meet): (Option<u64>, Side<'_>),
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        self.check_input(x.len(), rows)?;
        let running = if draw.is_some() { Vec::new() } else { self.running_values()? };
        let mut p = std::mem::take(&mut scratch.weights);
        {
            let (ps, pl) = self.params.storage_and_layout();
            p.clear();
            p.extend_from_slice(cpu(&ps, pl)?);
        }
        let input = (First::Input(x), (rows, first_row), (draw, Some(meet)));
        let done = forward_into(&self.shape, (&p, &running), input.0, input.1, input.2, scratch).await;
        scratch.weights = p;
        done?;
        self.hand_on(draw, rows, &scratch.batch_stats)
    }

    /// [`backward_cpu`](Self::backward_cpu) after a [`forward_met`](Self::forward_met),
    /// on the weights it read.
    pub(crate) async fn backward_met(
        &self,
        x: &[f32],
        grad_out: &[f32],
        scratch: &mut MlpScratch,
        meet: Side<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_input(x.len(), scratch.rows)?;
        let p = std::mem::take(&mut scratch.weights);
        let input = (First::Input(x), (grad_out, false));
        let grads = backward_into(&self.shape, &p, input.0, input.1, (scratch, Some(meet))).await;
        scratch.weights = p;
        grads
    }
}
