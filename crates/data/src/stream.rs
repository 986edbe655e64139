//! A batch source runs on a background thread and hands finished batches to
//! the trainer through a bounded channel: parsing overlaps the training step
//! and memory stays bounded by `prefetch_batches`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Receiver, bounded};
use sparrow_core::Batch;
use sparrow_core::Config;
use sparrow_core::batch::DataPosition;
use sparrow_core::config::DataFormat;

use crate::error::{BadRows, DataError};
use crate::label_groups::LabelGroups;
use crate::layout::DataLayout;
use crate::parquet_source::ParquetSource;
use crate::reader_thread::{READER_GRACE, ReaderThread};
use crate::shuffle::Shuffle;
use crate::source::BatchSource;
use crate::text::TextSource;

/// Opens `path` as the configured format. A missing file fails here, at once.
pub fn open_source(path: &Path, config: &Config, bad: BadRows) -> Result<Box<dyn BatchSource>, DataError> {
    let source: Box<dyn BatchSource> = match config.data.format {
        DataFormat::Parquet => Box::new(ParquetSource::open(path, config, bad)?),
        _ => Box::new(TextSource::open(path, config, bad)?),
    };
    // S0.7 and the shuffle apply to the training file only.
    let is_train = config.data.train.as_deref().is_some_and(|t| Path::new(t) == path);
    Ok(match (config.data.group_by_label, is_train, config.group_task()) {
        (true, true, Some(task)) => {
            Box::new(LabelGroups::new(source, task, config.data.group_window_rows, config.train.seed))
        }
        (_, true, _) if config.data.shuffle => {
            Box::new(Shuffle::new(source, config.data.shuffle_window_rows, config.train.seed))
        }
        _ => source,
    })
}

pub struct BatchStream {
    rx: Option<Receiver<Result<Batch, DataError>>>,
    stop: Arc<AtomicBool>,
    reader: ReaderThread,
    pub layout: DataLayout,
}

impl BatchStream {
    /// Streams `epochs` passes over `path`, starting at `start`.
    pub fn spawn(
        path: &Path,
        config: &Config,
        batch_size: usize,
        start: DataPosition,
        epochs: u64,
        bad: BadRows,
    ) -> Result<BatchStream, DataError> {
        let mut source = open_source(path, config, bad.clone())?;
        let source_path = path.to_path_buf();
        let layout = source.layout().clone();
        let read = move |tx: &crossbeam_channel::Sender<Result<Batch, DataError>>, stop: &AtomicBool| {
            for epoch in start.epoch..epochs {
                let pos =
                    if epoch == start.epoch { start } else { DataPosition { epoch, offset: 0, line: 1, skip: 0 } };
                if let Err(e) = source.seek(pos) {
                    let _ = tx.send(Err(e));
                    return;
                }
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match source.next_batch(batch_size, epoch) {
                        Ok(Some(b)) => {
                            if tx.send(Ok(b)).is_err() {
                                return;
                            }
                        }
                        Ok(None) => {
                            if let Err(e) = bad.end_pass(&source_path) {
                                let _ = tx.send(Err(e));
                                return;
                            }
                            break;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    }
                }
            }
        };
        BatchStream::from_thread(layout, config.data.prefetch_batches, "sparrow-reader", read)
            .map_err(|e| DataError::io(path, e))
    }

    /// The flag that stops the reader (set when the stream is dropped): a
    /// consumer that hands the stream to another thread keeps it, so that
    /// dropping the consumer stops a reader waiting for data that may
    /// never come (an idle topic).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Runs `body` on a reader thread named `name`: it sends batches (or
    /// the error that ends the stream) until it returns, or until the
    /// stop flag it is given is set (the stream was dropped).
    pub fn from_thread(
        layout: DataLayout,
        prefetch_batches: usize,
        name: &str,
        body: impl FnOnce(&crossbeam_channel::Sender<Result<Batch, DataError>>, &AtomicBool) + Send + 'static,
    ) -> std::io::Result<BatchStream> {
        let (tx, rx) = bounded(prefetch_batches);
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let reader = ReaderThread::spawn(name, move || body(&tx, &stop_flag))?;
        Ok(BatchStream { rx: Some(rx), stop, reader, layout })
    }
}

impl Iterator for BatchStream {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.rx.as_ref()?.recv().ok();
        if item.is_none() {
            // Channel closed: the reader finished, or died.
            if self.reader.join() {
                return Some(Err(DataError::ReaderPanicked));
            }
        }
        item
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receiver unblocks a reader waiting on a full channel;
        // one blocked in a read is left behind after a while.
        self.rx.take();
        self.reader.join_within(READER_GRACE);
    }
}
