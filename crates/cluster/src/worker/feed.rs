//! Where a sync policy's batches come from: the loader's stream of this
//! worker's batches (fetched one ahead on a thread of its own, or when the
//! step asks), or a round's items (`round.rs`). The worker's loop
//! (`drive.rs`) takes them through [`BatchFeed`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{Scope, ScopedJoinHandle};

use crossbeam_channel::Receiver;

use crate::generation::Generation;
use crate::messages::WorkerBatch;
use crate::transport::{ClusterError, LoaderService, Polled};

/// The batches a policy trains, as the step engine asks for them.
pub trait BatchFeed {
    /// The next batch (`ahead`: batches taken and not yet trained); `None`
    /// when there is none now: the data's end, or (rounds) the round's.
    fn next(&mut self, ahead: usize) -> Result<Option<WorkerBatch>, ClusterError>;

    /// Ends the feed: the error that stopped it on its own, if any (the
    /// loop reports it over its symptom, the batches ending early).
    fn close(self: Box<Self>) -> Result<(), ClusterError> {
        Ok(())
    }
}

/// The loader's training batches for worker `index`, each fetched when the
/// step asks for it.
pub struct LoaderStream<'e> {
    loader: &'e dyn LoaderService,
    index: usize,
    generation: Generation,
    /// The worker's progress count (see [`next_training_batch`]).
    progress: Arc<AtomicU64>,
}

impl<'e> LoaderStream<'e> {
    pub fn new(loader: &'e dyn LoaderService, index: usize, generation: Generation, progress: Arc<AtomicU64>) -> Self {
        LoaderStream { loader, index, generation, progress }
    }
}

impl BatchFeed for LoaderStream<'_> {
    fn next(&mut self, _ahead: usize) -> Result<Option<WorkerBatch>, ClusterError> {
        let never = AtomicBool::new(false);
        next_training_batch(self.loader, self.index, self.generation, &self.progress, &never)
    }
}

/// Worker `index`'s next training batch, however long the data takes to
/// come (an idle stream: `data.stream.stop_when_idle_secs = 0` runs until
/// stopped). Each time the loader answers that it is alive and waiting,
/// `progress` moves, so the coordinator sees a waiting worker, not a hung
/// one; `None` at the data's end, or once `stop` is set.
fn next_training_batch(
    loader: &dyn LoaderService,
    index: usize,
    generation: Generation,
    progress: &AtomicU64,
    stop: &AtomicBool,
) -> Result<Option<WorkerBatch>, ClusterError> {
    while !stop.load(Ordering::Relaxed) {
        match loader.poll_batch(index, generation)? {
            Polled::Batch(batch) => return Ok(Some(*batch)),
            Polled::End => return Ok(None),
            Polled::Waiting => {
                progress.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(None)
}

/// The loader's training batches for worker `index`, the next one fetched
/// on a thread of its own while this one trains (a batch carries no
/// embeddings, so fetching early changes nothing in the model).
pub struct Prefetched<'s> {
    batches: Receiver<Option<WorkerBatch>>,
    thread: ScopedJoinHandle<'s, Result<(), ClusterError>>,
    /// Set at [`close`](BatchFeed::close): the thread stops waiting on the loader.
    stop: Arc<AtomicBool>,
}

impl<'s> Prefetched<'s> {
    pub fn spawn<'e: 's>(
        scope: &'s Scope<'s, 'e>,
        loader: &'e dyn LoaderService,
        index: usize,
        generation: Generation,
        progress: Arc<AtomicU64>,
    ) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = scope.spawn(move || -> Result<(), ClusterError> {
            loop {
                let batch = next_training_batch(loader, index, generation, &progress, &stopped)?;
                let end = batch.is_none();
                if tx.send(batch).is_err() || end {
                    return Ok(());
                }
            }
        });
        Prefetched { batches: rx, thread, stop }
    }
}

impl BatchFeed for Prefetched<'_> {
    /// `None` at the end of the data, or when the thread stopped on an
    /// error (which [`close`](BatchFeed::close) reports).
    fn next(&mut self, _ahead: usize) -> Result<Option<WorkerBatch>, ClusterError> {
        Ok(self.batches.recv().ok().flatten())
    }

    fn close(self: Box<Self>) -> Result<(), ClusterError> {
        let Prefetched { batches, thread, stop } = *self;
        // A thread waiting to hand a batch over sees the queue closed and
        // ends; one waiting on the loader ends at the loader's next answer.
        stop.store(true, Ordering::Relaxed);
        drop(batches);
        thread.join().unwrap_or_else(|_| Err(ClusterError::Setup("the prefetch thread panicked".into())))
    }
}
