//! `data.shuffle`: the training file's rows in a seeded order, drawn anew
//! each epoch, in bounded memory.
//!
//! A policy of `regroup.rs`: the reader reads a window of
//! `data.shuffle_window_rows` rows (the file's order), permutes them with a
//! generator seeded from `train.seed`, the epoch and where the window
//! starts, and hands them out in batches. Rows mix within a window; the
//! windows come in the file's order, so a window at least as large as the
//! file is a full shuffle. A resume reads its window again, permutes it
//! the same way and skips the batches already trained: the same model as
//! an uninterrupted run.

use sparrow_core::Batch;
use sparrow_core::batch::DataPosition;

use crate::regroup::{Regrouped, Regrouping, shuffle, window_rng};
use crate::source::BatchSource;

/// Tells the shuffle's draws from label groups' of the same seed.
const SALT: u64 = 0x7368_7566_666c_6521;

/// Permutes a window's rows.
pub struct Shuffled {
    seed: u64,
}

/// Any reader's rows, shuffled window by window.
pub type Shuffle = Regrouped<Shuffled>;

impl Regrouped<Shuffled> {
    /// `inner`'s rows shuffled in windows of `window_rows`, the order drawn from `seed`.
    pub fn new(inner: Box<dyn BatchSource>, window_rows: usize, seed: u64) -> Shuffle {
        Regrouped::with_policy(inner, Shuffled { seed: seed ^ SALT }, window_rows)
    }
}

impl Regrouping for Shuffled {
    fn split(&self, rows: &Batch, batch_size: usize, start: DataPosition) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..rows.rows()).collect();
        shuffle(&mut order, &mut window_rng(self.seed, start));
        order.chunks(batch_size.max(1)).map(<[usize]>::to_vec).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regroup::tests::{Rows, assert_complete_and_resumable};

    fn shuffled(seed: u64, window: usize) -> Box<dyn BatchSource> {
        Box::new(Shuffle::new(Rows::boxed(100), window, seed))
    }

    fn keys(batches: &[(Vec<u64>, Vec<u32>, DataPosition)]) -> Vec<u64> {
        batches.iter().flat_map(|b| b.0.clone()).collect()
    }

    /// Every row once a pass, in an order that is not the file's, repeats
    /// for a seed and an epoch, and changes with either; rows mix within a
    /// window only; a resume from any batch continues the same order.
    #[test]
    fn rows_come_in_a_seeded_order_per_epoch_within_windows_and_resume_exactly() {
        let first = keys(&assert_complete_and_resumable(&|| shuffled(5, 40), 100, 0));
        assert_ne!(first, (0..100).collect::<Vec<_>>(), "shuffled");
        assert_eq!(keys(&assert_complete_and_resumable(&|| shuffled(5, 40), 100, 0)), first, "repeatable");
        let next_epoch = keys(&assert_complete_and_resumable(&|| shuffled(5, 40), 100, 1));
        assert_ne!(next_epoch, first, "another order each epoch");
        assert_ne!(keys(&assert_complete_and_resumable(&|| shuffled(6, 40), 100, 0)), first, "another seed");
        // Windows of 40: rows 0..40 come first, in some order, then 40..80.
        let mut head = first[..40].to_vec();
        head.sort_unstable();
        assert_eq!(head, (0..40).collect::<Vec<_>>());
        // A window as large as the file mixes all of it.
        let whole = keys(&assert_complete_and_resumable(&|| shuffled(5, 1000), 100, 0));
        assert!(whole[..40].iter().any(|&k| k >= 40), "{whole:?}");
    }
}
