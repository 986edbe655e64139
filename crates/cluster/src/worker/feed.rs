//! Where a sync policy's batches come from: the loader's stream of this
//! worker's batches (fetched one ahead on a thread of its own, or when the
//! step asks), or a round's items (`round.rs`). The worker's loop
//! (`drive.rs`) takes them through [`BatchFeed`].

use std::thread::{Scope, ScopedJoinHandle};

use crossbeam_channel::Receiver;

use crate::generation::Generation;
use crate::messages::{Mode, WorkerBatch};
use crate::transport::{ClusterError, LoaderService};

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
}

impl<'e> LoaderStream<'e> {
    pub fn new(loader: &'e dyn LoaderService, index: usize, generation: Generation) -> Self {
        LoaderStream { loader, index, generation }
    }
}

impl BatchFeed for LoaderStream<'_> {
    fn next(&mut self, _ahead: usize) -> Result<Option<WorkerBatch>, ClusterError> {
        self.loader.next_batch(self.index, Mode::Train, self.generation)
    }
}

/// The loader's training batches for worker `index`, the next one fetched
/// on a thread of its own while this one trains (a batch carries no
/// embeddings, so fetching early changes nothing in the model).
pub struct Prefetched<'s> {
    batches: Receiver<Option<WorkerBatch>>,
    thread: ScopedJoinHandle<'s, Result<(), ClusterError>>,
}

impl<'s> Prefetched<'s> {
    pub fn spawn<'e: 's>(
        scope: &'s Scope<'s, 'e>,
        loader: &'e dyn LoaderService,
        index: usize,
        generation: Generation,
    ) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let thread = scope.spawn(move || -> Result<(), ClusterError> {
            loop {
                let batch = loader.next_batch(index, Mode::Train, generation)?;
                let end = batch.is_none();
                if tx.send(batch).is_err() || end {
                    return Ok(());
                }
            }
        });
        Prefetched { batches: rx, thread }
    }
}

impl BatchFeed for Prefetched<'_> {
    /// `None` at the end of the data, or when the thread stopped on an
    /// error (which [`close`](BatchFeed::close) reports).
    fn next(&mut self, _ahead: usize) -> Result<Option<WorkerBatch>, ClusterError> {
        Ok(self.batches.recv().ok().flatten())
    }

    fn close(self: Box<Self>) -> Result<(), ClusterError> {
        let Prefetched { batches, thread } = *self;
        // A thread waiting to hand a batch over sees the queue closed and ends.
        drop(batches);
        thread.join().unwrap_or_else(|_| Err(ClusterError::Setup("the prefetch thread panicked".into())))
    }
}
