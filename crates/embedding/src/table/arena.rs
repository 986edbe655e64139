//! A lock shard's rows in memory: a chunked arena of `[key | weights |
//! optimizer state]` rows that never move once allocated, and the helpers
//! that find a row by slot and hint the CPU to load it early.

use crate::dtype::RowFormat;

/// f32 slots that hold a row's key (its two 32-bit halves, as bit patterns).
pub(super) const KEY_FLOATS: usize = 2;

/// How many keys ahead a batch lookup probes the index and prefetches rows.
pub(super) const PREFETCH_DISTANCE: usize = 8;

pub(super) use crate::hint::prefetch;

/// Bytes in a cache line.
const LINE: usize = 64;

/// Prefetches every cache line of `data`. Rows are packed back to back, so
/// most do not start on a line: a 44-byte row (dim 16 in f16 with row-wise
/// Adagrad) crosses into a second line two times in three, a 76-byte one
/// into a third one time in eight.
#[inline]
pub(super) fn prefetch_lines(data: &[f32]) {
    for_each_prefetch_index(data.len(), |i| prefetch(&data[i]));
}

/// Calls `f` with indices into `len` f32s, at least one in each cache line
/// they touch wherever they start: every 16th (64 bytes apart) below the
/// last, then the last. How many depends on `len` alone: a loop over
/// exactly the lines touched ran once or twice by a row's alignment, a
/// branch the CPU could not predict; with it the update of f16 rows (dim
/// 16) took 294–298 µs a batch against 229–232 µs (docs/benchmarks.md,
/// session 12).
#[inline(always)]
fn for_each_prefetch_index(len: usize, mut f: impl FnMut(usize)) {
    let Some(last) = len.checked_sub(1) else { return };
    let mut i = 0;
    while i < last {
        f(i);
        i += LINE / std::mem::size_of::<f32>();
    }
    f(last);
}

#[inline]
pub(super) fn key_of(stored: &[f32]) -> u64 {
    u64::from(stored[0].to_bits()) | (u64::from(stored[1].to_bits()) << 32)
}

#[inline]
pub(super) fn set_key(stored: &mut [f32], key: u64) {
    stored[0] = f32::from_bits(key as u32);
    stored[1] = f32::from_bits((key >> 32) as u32);
}

/// Which rows of a shard's arena live in which chunk, and how they are stored.
#[derive(Clone, Copy)]
pub(super) struct Layout {
    pub(super) format: RowFormat,
    /// Floats the caller sees per row: weights + optimizer state.
    pub(super) row_len: usize,
    /// Words of a row without its key (what the SSD store keeps): the
    /// vector in `embedding.dtype`, then the optimizer state.
    pub(super) packed_len: usize,
    /// Words stored per row in the arena: key + packed row.
    pub(super) stored_len: usize,
    pub(super) dim: usize,
    /// Rows per chunk: as many as fill [`CHUNK_BYTES`], so a chunk lands
    /// exactly in an allocator size class (a power-of-two row count left up
    /// to 15% of every chunk unused).
    pub(super) chunk_rows: u32,
    /// ⌈2⁶⁴ / chunk_rows⌉: `slot / chunk_rows` as a multiply-shift, exact for
    /// 32-bit slots (Lemire, Kaser, Kurz 2019). A hardware division by a
    /// run-time value cost ~25 cycles on every row access.
    pub(super) chunk_magic: u64,
}

impl Layout {
    pub(super) fn new(format: RowFormat) -> Layout {
        let packed_len = format.stored_len();
        let stored_len = KEY_FLOATS + packed_len;
        let chunk_rows = (CHUNK_BYTES / (stored_len * 4)).clamp(2, 1 << 20) as u32;
        Layout {
            format,
            row_len: format.logical_len(),
            packed_len,
            stored_len,
            dim: format.dim,
            chunk_rows,
            chunk_magic: u64::MAX / u64::from(chunk_rows) + 1,
        }
    }

    /// Words of a packed row that hold the vector.
    #[inline]
    pub(super) fn vector_words(self) -> usize {
        self.packed_len - (self.row_len - self.dim)
    }

    #[inline]
    pub(super) fn chunk_rows(self) -> usize {
        self.chunk_rows as usize
    }

    /// (chunk index, float offset of the row in the chunk)
    #[inline]
    pub(super) fn locate(self, slot: u32) -> (usize, usize) {
        let chunk = ((u128::from(slot) * u128::from(self.chunk_magic)) >> 64) as u32;
        let row = slot - chunk * self.chunk_rows;
        (chunk as usize, row as usize * self.stored_len)
    }
}

#[inline]
pub(super) fn stored_in(chunks: &[Box<[f32]>], layout: Layout, slot: u32) -> &[f32] {
    let (chunk, start) = layout.locate(slot);
    &chunks[chunk][start..start + layout.stored_len]
}

/// Bytes of one arena chunk; small enough that a shard's tail waste stays low
/// (≤ shards × 64 KiB for the whole table).
pub(super) const CHUNK_BYTES: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_split_by_multiply_shift_equals_division() {
        for row_len in [1usize, 2, 3, 17, 32, 33, 63, 130, 1000, 40_000] {
            let format = RowFormat {
                dtype: crate::dtype::EmbeddingDtype::F32,
                dim: 1,
                state_len: row_len - 1,
                simd: crate::dtype::Simd::Auto,
            };
            let layout = Layout::new(format);
            let d = layout.chunk_rows;
            for slot in (0..200_000u32).chain([u32::MAX - 1, u32::MAX - d, 1 << 31, (1 << 31) + 7]) {
                let (chunk, start) = layout.locate(slot);
                assert_eq!(
                    (chunk as u32, start),
                    (slot / d, (slot % d) as usize * layout.stored_len),
                    "d={d} slot={slot}"
                );
            }
        }
    }

    #[test]
    fn a_prefetched_row_reaches_every_cache_line_it_spans() {
        for len in [0usize, 1, 11, 16, 17, 19, 35, 40, 67] {
            let mut indices = Vec::new();
            for_each_prefetch_index(len, |i| indices.push(i));
            assert!(indices.iter().all(|&i| i < len), "{len}: {indices:?}");
            // As many at every alignment: nothing for the CPU to predict.
            assert_eq!(indices.len(), len.saturating_sub(1).div_ceil(16) + usize::from(len > 0), "{len}");
            for addr in (4096..4096 + 2 * LINE).step_by(4) {
                let lines_of = |i: &usize| (addr + 4 * i) / LINE;
                let hit: std::collections::BTreeSet<usize> = indices.iter().map(lines_of).collect();
                let touched: std::collections::BTreeSet<usize> = (0..len).map(|i| lines_of(&i)).collect();
                assert_eq!(hit, touched, "{len} floats at {addr}");
            }
        }
    }
}
