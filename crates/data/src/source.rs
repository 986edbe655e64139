//! What every reader is: a seekable source of batches. The readers
//! (`text`, `parquet_source`) implement it; `stream` runs one on a thread.

use sparrow_core::Batch;
use sparrow_core::batch::DataPosition;

use crate::error::DataError;
use crate::layout::DataLayout;

pub trait BatchSource: Send {
    fn layout(&self) -> &DataLayout;
    /// Continue reading at `pos` (offset 0 = the first data row).
    fn seek(&mut self, pos: DataPosition) -> Result<(), DataError>;
    /// The next batch of at most `batch_size` good rows, `None` at the end.
    fn next_batch(&mut self, batch_size: usize, epoch: u64) -> Result<Option<Batch>, DataError>;
}
