//! Pipeline stages between the reader and the training step (S3.10).
//!
//! The dedup + partition of a batch's keys (S3.2/S3.3) depends only on the
//! keys, not on the table's contents, so it runs on its own thread while the
//! previous batch trains. The plan is the same as the step would compute, so
//! results are bit-identical with or without the stage.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Receiver, bounded};
use sparrow_core::Batch;
use sparrow_data::reader_thread::{READER_GRACE, ReaderThread};
use sparrow_data::{BatchStream, DataError};
use sparrow_embedding::{KeyPlan, Partitioner};

pub struct PlannedBatches {
    rx: Option<Receiver<Result<(Batch, KeyPlan), DataError>>>,
    planner: ReaderThread,
    /// The reader's stop flag: the planner may be waiting on the reader.
    stop_reader: Arc<AtomicBool>,
}

impl PlannedBatches {
    /// Plans every batch of `stream`, at most `depth` ahead of the consumer.
    pub fn spawn(stream: BatchStream, partitioner: Partitioner, depth: usize) -> std::io::Result<PlannedBatches> {
        let (tx, rx) = bounded(depth.max(1));
        let stop_reader = stream.stop_flag();
        let planner = ReaderThread::spawn("sparrow-planner", move || {
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
        Ok(PlannedBatches { rx: Some(rx), planner, stop_reader })
    }

    /// The next batch, or `None` at the end or once `stop` is set: a
    /// stream may have no batch to give for a long time (an idle topic),
    /// and a signal must still end the run.
    pub fn next_unless(&mut self, stop: &AtomicBool) -> Option<Result<(Batch, KeyPlan), DataError>> {
        loop {
            match self.rx.as_ref()?.recv_timeout(std::time::Duration::from_millis(100)) {
                Ok(item) => return Some(item),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if stop.load(Ordering::Relaxed) => return None,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return self.next(),
            }
        }
    }
}

impl Iterator for PlannedBatches {
    type Item = Result<(Batch, KeyPlan), DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.rx.as_ref()?.recv().ok();
        if item.is_none() && self.planner.join() {
            return Some(Err(DataError::ReaderPanicked));
        }
        item
    }
}

impl Drop for PlannedBatches {
    fn drop(&mut self) {
        // Closing the channel stops a planner that is sending; one waiting
        // for the reader's next batch is let go by the reader, stopped (or,
        // the reader blocked in a read, left behind with it).
        self.rx.take();
        self.stop_reader.store(true, Ordering::Relaxed);
        self.planner.join_within(READER_GRACE);
    }
}
