//! Pipeline stages between the reader and the training step (S3.10).
//!
//! The dedup + partition of a batch's keys (S3.2/S3.3) depends only on the
//! keys, not on the table's contents, so it runs on its own thread while the
//! previous batch trains. The plan is the same as the step would compute, so
//! results are bit-identical with or without the stage.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, bounded};
use sparrow_core::Batch;
use sparrow_data::{BatchStream, DataError};
use sparrow_embedding::{KeyPlan, Partitioner};

pub struct PlannedBatches {
    rx: Option<Receiver<Result<(Batch, KeyPlan), DataError>>>,
    handle: Option<JoinHandle<()>>,
}

impl PlannedBatches {
    /// Plans every batch of `stream`, at most `depth` ahead of the consumer.
    pub fn spawn(stream: BatchStream, partitioner: Partitioner, depth: usize) -> std::io::Result<PlannedBatches> {
        let (tx, rx) = bounded(depth.max(1));
        let handle = std::thread::Builder::new().name("sparrow-planner".into()).spawn(move || {
            for item in stream {
                let planned = item.map(|batch| {
                    let plan = partitioner.plan(&batch.keys);
                    (batch, plan)
                });
                let failed = planned.is_err();
                if tx.send(planned).is_err() || failed {
                    return;
                }
            }
        })?;
        Ok(PlannedBatches { rx: Some(rx), handle: Some(handle) })
    }
}

impl Iterator for PlannedBatches {
    type Item = Result<(Batch, KeyPlan), DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.rx.as_ref()?.recv().ok();
        if item.is_none()
            && let Some(h) = self.handle.take()
            && h.join().is_err()
        {
            return Some(Err(DataError::ReaderPanicked));
        }
        item
    }
}

impl Drop for PlannedBatches {
    fn drop(&mut self) {
        // Closing the channel stops the planner, which drops (and so stops) the reader.
        self.rx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
