//! An MLP's passes on a half of a batch run in halves whose batch norm
//! meets the other half's (`meet.rs`). A half waits at each meeting
//! holding no lock: with the parameters' read lock held, a writer queued
//! between the two halves' reads (the lock is fair: it blocks new
//! readers) would wait for the first half and the second for the writer.
//! So a half's forward pass reads a copy of the weights, kept in its
//! scratch for its backward pass (a step changes no weight).
//!
//! Its input is laid out or a product of the caller's ([`First`]: ESMM's
//! towers' columns side by side), and backward its output's gradient may
//! come through its last ReLU already (a multi-task expert's, from the
//! gates' adjoint), as the passes on a whole batch take them.

use super::{First, Mlp, MlpScratch, backward_into, cpu, forward_into};
use crate::ModelError;
use crate::meet::Side;

impl Mlp {
    /// [`forward_cpu_at`](Self::forward_cpu_at) (or, from a product,
    /// `forward_cpu_from_at`) on a half of a batch, meeting the other half
    /// at `meet`.
    pub(crate) async fn forward_met(
        &self,
        x: First<'_>,
        (rows, first_row): (usize, usize),
        (draw, meet): (Option<u64>, Side<'_>),
        scratch: &mut MlpScratch,
    ) -> Result<(), ModelError> {
        if let First::Input(x) = x {
            self.check_input(x.len(), rows)?;
        }
        let running = if draw.is_some() { Vec::new() } else { self.running_values()? };
        let mut p = std::mem::take(&mut scratch.weights);
        {
            let (ps, pl) = self.params.storage_and_layout();
            p.clear();
            p.extend_from_slice(cpu(&ps, pl)?);
        }
        let at = ((rows, first_row), (draw, Some(meet)));
        let done = forward_into(&self.shape, (&p, &running), x, at.0, at.1, scratch).await;
        scratch.weights = p;
        done?;
        self.hand_on(draw, rows, &scratch.batch_stats)
    }

    /// [`backward_cpu`](Self::backward_cpu) after a [`forward_met`](Self::forward_met),
    /// on the weights it read (from a product: `backward_cpu_from`); with
    /// `premasked`, from a gradient through the last ReLU already
    /// ([`backward_cpu_masked`](Self::backward_cpu_masked)).
    pub(crate) async fn backward_met(
        &self,
        x: First<'_>,
        (grad_out, premasked): (&[f32], bool),
        scratch: &mut MlpScratch,
        meet: Side<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        if let First::Input(x) = x {
            self.check_input(x.len(), scratch.rows)?;
        }
        if premasked && !self.shape.masks_output() {
            return Err(ModelError::Halves { what: "a gradient through the last ReLU, for layers without one" });
        }
        let p = std::mem::take(&mut scratch.weights);
        let grads = backward_into(&self.shape, &p, x, (grad_out, premasked), (scratch, Some(meet))).await;
        scratch.weights = p;
        grads
    }
}

impl Mlp {
    /// Whether its training pass reads statistics of the batch (batch
    /// norm, Dice): on a half of a batch they meet the other half's.
    pub(crate) fn batch_statistics(&self) -> bool {
        self.shape.layers.iter().any(|l| l.running.is_some() || l.dice_running.is_some())
    }
}
