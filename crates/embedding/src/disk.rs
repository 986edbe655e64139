//! The SSD tier's store (S3.8): an open-addressing hash table in a file, one
//! per table lock shard. Record = `[tag u32 | uses u32 | key u64 | row f32 ×
//! row_len]`, little-endian, at bucket `mix64(key) & mask`, linear probing;
//! tag 0 = empty, `u32::MAX` = deleted (a tombstone: probes go on past it,
//! inserts reuse it), otherwise 1 + the lookup tick that last used the row
//! (for `ttl_steps`). `uses` is the cache's use count of the row when it was
//! evicted: an LFU cache that reads a row back resumes its count instead of
//! starting from zero (a count lost on eviction makes warm rows churn).
//!
//! Why this and not an index in memory (OneEmbedding's persistent table) or an
//! LSM (fjall): the key index of a file-with-index costs memory per row, so
//! resident memory would grow with the table, and an LSM rewrites every row
//! several times (compaction) for a workload that updates rows in place. Here
//! nothing per row lives in memory; a lookup is one `pread` of a few records
//! (from the page cache when warm, which does not count as resident memory).
//!
//! The file is working storage, rebuilt at every start: durability is the
//! checkpoint's job (it copies every row, see the table's `for_each_row`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sparrow_core::key::mix64;

/// Grow (double and rehash) before more than 3/5 of the buckets are used.
const MAX_LOAD_NUM: u64 = 3;
const MAX_LOAD_DEN: u64 = 5;
/// Records read per probe window (one `pread`).
const WINDOW_BYTES: usize = 512;

/// The tag of a deleted record.
const TOMBSTONE: u32 = u32::MAX;

pub struct DiskStore {
    file: File,
    path: PathBuf,
    row_len: usize,
    geometry: Geometry,
    buckets: u64,
    len: u64,
    /// Deleted records: they lengthen probes until the next rebuild.
    tombstones: u64,
    buf: Vec<u8>,
    /// Bumped by every growth: positions handed out before are stale.
    growths: u64,
}

/// Where buckets lie in the file: whole records per 4 KiB page (the rest of
/// the page is padding), so that reading or writing a record touches one
/// page-cache page, not two.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    record_bytes: usize,
    page_bytes: usize,
    per_page: u64,
}

impl Geometry {
    fn new(record_bytes: usize) -> Geometry {
        let page_bytes = record_bytes.max(4096);
        Geometry { record_bytes, page_bytes, per_page: (page_bytes / record_bytes) as u64 }
    }

    fn offset(self, bucket: u64) -> u64 {
        (bucket / self.per_page) * self.page_bytes as u64 + (bucket % self.per_page) * self.record_bytes as u64
    }

    fn pages(self, buckets: u64) -> u64 {
        buckets.div_ceil(self.per_page)
    }

    /// Buckets from `bucket` to the end of its page.
    fn left_in_page(self, bucket: u64) -> u64 {
        self.per_page - bucket % self.per_page
    }
}

/// Where a key's record is, as long as the store has not grown since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorePos {
    growths: u64,
    bucket: u64,
}

/// What a read found besides the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    pub pos: StorePos,
    pub how: Use,
}

/// The tag of a live record last used at `tick`.
fn live_tag(tick: u64) -> u32 {
    1 + tick.min(u64::from(TOMBSTONE - 2)) as u32
}

/// Where a probe stopped.
struct Probed {
    bucket: u64,
    found: bool,
    /// Not found, and `bucket` is a tombstone an insert can reuse.
    reuses_tombstone: bool,
}

fn err(path: &Path, what: &str, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
}

impl DiskStore {
    /// Creates (or truncates) the store at `path` for rows of `row_len` floats.
    pub fn create(path: &Path, row_len: usize) -> std::io::Result<DiskStore> {
        let geometry = Geometry::new(16 + 4 * row_len);
        let buckets = 1024;
        let file = Self::new_file(path, buckets, geometry)?;
        Ok(DiskStore {
            file,
            path: path.to_path_buf(),
            row_len,
            geometry,
            buckets,
            len: 0,
            tombstones: 0,
            buf: Vec::new(),
            growths: 0,
        })
    }

    fn new_file(path: &Path, buckets: u64, g: Geometry) -> std::io::Result<File> {
        let open = |flags| {
            OpenOptions::new().read(true).write(true).create(true).truncate(true).custom_flags(flags).open(path)
        };
        // No access-time update per read (measured: 1.5% of a miss-bound
        // step); refused for a file we do not own, which then opens normally.
        let file = match open(libc::O_NOATIME) {
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => open(0),
            other => other,
        }
        .map_err(|e| err(path, "creating the SSD store", e))?;
        // Sparse: unwritten buckets read as zeros (empty) and take no disk space.
        file.set_len(g.pages(buckets) * g.page_bytes as u64).map_err(|e| err(path, "sizing the SSD store", e))?;
        Ok(file)
    }

    /// Rows stored.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn window(&self) -> u64 {
        (WINDOW_BYTES / self.geometry.record_bytes).max(1) as u64
    }

    /// Probes for `key` from its home bucket, past tombstones, to the bucket
    /// holding `key` (then `buf` holds its record) or to the first empty one
    /// (then the result is the first tombstone on the way, if any, for an
    /// insert to reuse).
    fn probe(&self, key: u64, buf: &mut Vec<u8>) -> std::io::Result<Probed> {
        let mask = self.buckets - 1;
        let mut bucket = mix64(key) & mask;
        let g = self.geometry;
        let rb = g.record_bytes;
        let mut first_tombstone = None;
        loop {
            // A window of records, not past the end of its page or the file.
            let n = self.window().min(g.left_in_page(bucket)).min(self.buckets - bucket);
            buf.resize(n as usize * rb, 0);
            self.file.read_exact_at(buf, g.offset(bucket)).map_err(|e| err(&self.path, "reading", e))?;
            for i in 0..n as usize {
                let rec = &buf[i * rb..(i + 1) * rb];
                let tag = u32::from_le_bytes(rec[..4].try_into().unwrap_or_default());
                let at = bucket + i as u64;
                if tag == 0 {
                    return Ok(match first_tombstone {
                        Some(t) => Probed { bucket: t, found: false, reuses_tombstone: true },
                        None => Probed { bucket: at, found: false, reuses_tombstone: false },
                    });
                }
                if tag == TOMBSTONE {
                    first_tombstone.get_or_insert(at);
                    continue;
                }
                if u64::from_le_bytes(rec[8..16].try_into().unwrap_or_default()) == key {
                    buf.drain(..i * rb);
                    buf.truncate(rb);
                    return Ok(Probed { bucket: at, found: true, reuses_tombstone: false });
                }
            }
            bucket = (bucket + n) & mask;
        }
    }

    /// Copies `key`'s row into `out`; `None` if the store does not hold it.
    pub fn get(&self, key: u64, out: &mut [f32]) -> std::io::Result<Option<Stored>> {
        let mut buf = Vec::with_capacity(WINDOW_BYTES);
        self.read(key, out, &mut buf)
    }

    /// The tick that last used `key`'s row, if the store holds it (one
    /// probe, the row not decoded).
    pub fn last_use(&self, key: u64) -> std::io::Result<Option<u64>> {
        let mut buf = Vec::with_capacity(WINDOW_BYTES);
        let p = self.probe(key, &mut buf)?;
        Ok(p.found.then(|| record_tick(&buf)))
    }

    /// [`get`](Self::get), also telling where the record is (for a later
    /// [`put_at`](Self::put_at) that skips the probe).
    /// Reuses the store's buffer (no allocation per read).
    pub fn get_pos(&mut self, key: u64, out: &mut [f32]) -> std::io::Result<Option<Stored>> {
        let mut buf = std::mem::take(&mut self.buf);
        let pos = self.read(key, out, &mut buf);
        self.buf = buf;
        pos
    }

    /// The row, where it is, and its use record.
    fn read(&self, key: u64, out: &mut [f32], buf: &mut Vec<u8>) -> std::io::Result<Option<Stored>> {
        let p = self.probe(key, buf)?;
        let pos = StorePos { growths: self.growths, bucket: p.bucket };
        Ok(p.found.then(|| decode(buf, out)).flatten().map(|(_, how)| Stored { pos, how }))
    }

    /// Stores (inserts or overwrites) `key`'s row.
    pub fn put(&mut self, key: u64, row: &[f32]) -> std::io::Result<()> {
        self.put_at(key, row, Use::default(), None)
    }

    /// [`put`](Self::put); with the position a [`get_pos`](Self::get_pos)
    /// of `key` returned (records move only when the store grows), the row
    /// is written there without probing. `how` is kept beside the row.
    pub fn put_at(&mut self, key: u64, row: &[f32], how: Use, pos: Option<StorePos>) -> std::io::Result<()> {
        debug_assert_eq!(row.len(), self.row_len);
        let mut buf = std::mem::take(&mut self.buf);
        let (bucket, new_record, reuses_tombstone) = match pos {
            Some(p) if p.growths == self.growths => (p.bucket, false, false),
            _ => {
                if (self.len + self.tombstones + 1) * MAX_LOAD_DEN > self.buckets * MAX_LOAD_NUM {
                    // Mostly tombstones: rebuild at the same size; else double.
                    let live_half_full = (self.len + 1) * MAX_LOAD_DEN * 2 <= self.buckets * MAX_LOAD_NUM;
                    self.rebuild(if live_half_full { self.buckets } else { self.buckets * 2 })?;
                }
                let p = self.probe(key, &mut buf)?;
                (p.bucket, !p.found, p.reuses_tombstone)
            }
        };
        encode(&mut buf, key, how, row);
        // A full disk: the test of a failed write-back (the caller keeps the row).
        fail::fail_point!("disk_store::write", |_| Err(err(
            &self.path,
            "writing",
            std::io::Error::other("no space left on device (injected)")
        )));
        self.file.write_all_at(&buf, self.geometry.offset(bucket)).map_err(|e| err(&self.path, "writing", e))?;
        // Counted once the record is on the store, so a failed write leaves the count true.
        if new_record {
            self.len += 1;
            if reuses_tombstone {
                self.tombstones -= 1;
            }
        }
        self.buf = buf;
        Ok(())
    }

    /// Deletes (turns into tombstones) the records in `count` buckets from
    /// `from` on for which `dead(key, last_use)` holds, a chunk of pages at a
    /// time; returns the bucket to continue from (0 after the last) and how
    /// many were deleted. Other records keep their positions.
    pub fn sweep(
        &mut self,
        from: u64,
        count: u64,
        mut dead: impl FnMut(u64, u64) -> bool,
    ) -> std::io::Result<(u64, u64)> {
        let g = self.geometry;
        let end = (from + count).min(self.buckets);
        let pages_per_write = ((1 << 20) / g.page_bytes).max(1) as u64;
        let (mut page, last_page) = (from / g.per_page, g.pages(end));
        let (mut buf, mut deleted) = (Vec::new(), 0);
        while page < last_page {
            let n = pages_per_write.min(last_page - page);
            buf.resize(n as usize * g.page_bytes, 0);
            let at = page * g.page_bytes as u64;
            self.file.read_exact_at(&mut buf, at).map_err(|e| err(&self.path, "reading", e))?;
            let mut changed = false;
            for (p, bytes) in buf.chunks_exact_mut(g.page_bytes).enumerate() {
                let first = (page + p as u64) * g.per_page;
                for (i, rec) in bytes.chunks_exact_mut(g.record_bytes).take(g.per_page as usize).enumerate() {
                    let b = first + i as u64;
                    let tag = u32::from_le_bytes(rec[..4].try_into().unwrap_or_default());
                    if b < from || b >= end || tag == 0 || tag == TOMBSTONE {
                        continue;
                    }
                    let key = u64::from_le_bytes(rec[8..16].try_into().unwrap_or_default());
                    if dead(key, record_tick(rec)) {
                        rec[..4].copy_from_slice(&TOMBSTONE.to_le_bytes());
                        deleted += 1;
                        changed = true;
                    }
                }
            }
            if changed {
                self.file.write_all_at(&buf, at).map_err(|e| err(&self.path, "writing", e))?;
            }
            page += n;
        }
        self.len -= deleted;
        self.tombstones += deleted;
        Ok((if end >= self.buckets { 0 } else { end }, deleted))
    }

    /// Buckets in the file (live, empty and deleted).
    pub fn buckets(&self) -> u64 {
        self.buckets
    }

    /// Every stored row with its use record (`pos` is not set), in bucket order.
    pub fn for_each(&self, mut f: impl FnMut(u64, Use, &[f32])) -> std::io::Result<()> {
        let mut row = vec![0.0f32; self.row_len];
        self.walk(0, |_, rec| {
            if let Some((key, how)) = decode(rec, &mut row) {
                f(key, how, &row);
            }
            true
        })?;
        Ok(())
    }

    /// Calls `f` for stored rows from `bucket` on until it has accepted
    /// (returned true for) `max` of them; returns the bucket to continue from
    /// and how many were accepted, or `None` at the end of the file.
    pub fn scan_from(
        &self,
        bucket: u64,
        max: usize,
        mut f: impl FnMut(u64, Use, &[f32]) -> bool,
    ) -> std::io::Result<Option<(u64, usize)>> {
        let mut row = vec![0.0f32; self.row_len];
        let (mut stopped_at, mut accepted) = (None, 0);
        self.walk(bucket, |at, rec| {
            if accepted == max {
                stopped_at = Some(at);
                return false;
            }
            if let Some((key, how)) = decode(rec, &mut row)
                && f(key, how, &row)
            {
                accepted += 1;
            }
            true
        })?;
        Ok(match stopped_at {
            Some(at) => Some((at, accepted)),
            None if accepted > 0 => Some((self.buckets, accepted)),
            None => None,
        })
    }

    /// Calls `f(bucket, record)` for every bucket from `from` on, reading
    /// whole pages about a MiB at a time, until `f` returns false.
    fn walk(&self, from: u64, mut f: impl FnMut(u64, &[u8]) -> bool) -> std::io::Result<()> {
        let g = self.geometry;
        let pages_per_read = ((1 << 20) / g.page_bytes).max(1) as u64;
        let pages = g.pages(self.buckets);
        let mut buf = Vec::new();
        let mut page = from / g.per_page;
        while page < pages {
            let n = pages_per_read.min(pages - page);
            buf.resize(n as usize * g.page_bytes, 0);
            let at = page * g.page_bytes as u64;
            self.file.read_exact_at(&mut buf, at).map_err(|e| err(&self.path, "reading", e))?;
            for (p, bytes) in buf.chunks_exact(g.page_bytes).enumerate() {
                let first = (page + p as u64) * g.per_page;
                for (i, rec) in bytes.chunks_exact(g.record_bytes).take(g.per_page as usize).enumerate() {
                    let b = first + i as u64;
                    if b >= from && b < self.buckets && !f(b, rec) {
                        return Ok(());
                    }
                }
            }
            page += n;
        }
        Ok(())
    }

    /// Re-places every live row into `buckets` buckets (tombstones dropped)
    /// in a new file (placement tracked in a bitmap, so nothing is read
    /// back), which then replaces the old.
    fn rebuild(&mut self, buckets: u64) -> std::io::Result<()> {
        let tmp = self.path.with_extension("grow");
        let g = self.geometry;
        let file = Self::new_file(&tmp, buckets, g)?;
        let mut used = vec![0u64; buckets.div_ceil(64) as usize];
        let mut rec = Vec::with_capacity(g.record_bytes);
        let mut result = Ok(());
        self.for_each(|key, how, row| {
            if result.is_err() {
                return;
            }
            let mut b = mix64(key) & (buckets - 1);
            while used[(b / 64) as usize] & (1 << (b % 64)) != 0 {
                b = (b + 1) & (buckets - 1);
            }
            used[(b / 64) as usize] |= 1 << (b % 64);
            encode(&mut rec, key, how, row);
            result = file.write_all_at(&rec, g.offset(b)).map_err(|e| err(&tmp, "writing", e));
        })?;
        result?;
        std::fs::rename(&tmp, &self.path).map_err(|e| err(&self.path, "replacing after growth", e))?;
        self.file = file;
        self.buckets = buckets;
        self.tombstones = 0;
        self.growths += 1;
        Ok(())
    }
}

/// A row's use record as the store keeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Use {
    /// The cache's use count when the row was written (LFU).
    pub uses: u32,
    /// The lookup tick that last used the row (`ttl_steps`; saturates at
    /// `u32::MAX - 2`).
    pub last_use: u64,
}

/// The last-use tick of a live record.
fn record_tick(rec: &[u8]) -> u64 {
    u64::from(u32::from_le_bytes(rec[..4].try_into().unwrap_or_default()).saturating_sub(1))
}

/// A live record's key and use record, its row decoded into `row`; `None`
/// if empty or deleted.
fn decode(rec: &[u8], row: &mut [f32]) -> Option<(u64, Use)> {
    let tag = u32::from_le_bytes(rec[0..4].try_into().ok()?);
    if tag == 0 || tag == TOMBSTONE {
        return None;
    }
    for (x, b) in row.iter_mut().zip(rec[16..].chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let uses = u32::from_le_bytes(rec[4..8].try_into().ok()?);
    Some((u64::from_le_bytes(rec[8..16].try_into().ok()?), Use { uses, last_use: record_tick(rec) }))
}

fn encode(buf: &mut Vec<u8>, key: u64, how: Use, row: &[f32]) {
    buf.clear();
    buf.extend_from_slice(&live_tag(how.last_use).to_le_bytes());
    buf.extend_from_slice(&how.uses.to_le_bytes());
    buf.extend_from_slice(&key.to_le_bytes());
    for x in row {
        buf.extend_from_slice(&x.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(30))]

        /// Puts, gets and sweeps (deletions) in any order, across growths
        /// and rebuilds: answers like a map, use records included.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<u64>(), -1.0f32..1.0), 0..3000), small in 0u64..40) {
            let dir = tempfile::tempdir().expect("tmp");
            let mut store = DiskStore::create(&dir.path().join("s.bin"), 3).expect("create");
            let mut reference: HashMap<u64, ([f32; 3], Use)> = HashMap::new();
            let mut scratch = [0.0f32; 3];
            for (i, (k, v)) in ops.iter().enumerate() {
                if i % 500 == 499 {
                    // Delete a fifth of the keys, in two sweeps over halves of the file.
                    let phase = i as u64 / 500 % 5;
                    let dead = |key: u64, _| key % 5 == phase;
                    let half = store.buckets().div_ceil(2);
                    let (next, a) = store.sweep(0, half, dead).expect("sweep");
                    let (end, b) = store.sweep(next, half, dead).expect("sweep");
                    prop_assert_eq!(end, 0);
                    let before = reference.len();
                    reference.retain(|key, _| key % 5 != phase);
                    prop_assert_eq!((a + b) as usize, before - reference.len());
                    continue;
                }
                // Some keys repeat (overwrites), the rest are random.
                let k = if i % 3 == 0 { k % (small + 1) } else { *k };
                let row = [*v, v * 2.0, i as f32];
                let how = Use { uses: i as u32, last_use: 7 * i as u64 };
                // Overwrites go through a remembered position half of the time
                // (stale after a growth: then the store probes again).
                let pos = if i % 2 == 0 { store.get_pos(k, &mut scratch).expect("get") } else { None };
                store.put_at(k, &row, how, pos.map(|s| s.pos)).expect("put");
                reference.insert(k, (row, how));
            }
            prop_assert_eq!(store.len(), reference.len() as u64);
            let mut out = [0.0f32; 3];
            for (k, (row, how)) in &reference {
                let found = store.get_pos(*k, &mut out).expect("get");
                prop_assert_eq!(found.map(|s| s.how), Some(*how), "the use record comes back with the row");
                prop_assert_eq!(store.last_use(*k).expect("probe"), Some(how.last_use));
                prop_assert_eq!(&out, row);
            }
            prop_assert!(store.get(0xfeed_f00d_dead_beef, &mut out).expect("get").is_none() || reference.contains_key(&0xfeed_f00d_dead_beef));
            let reference: HashMap<u64, [f32; 3]> = reference.into_iter().map(|(k, (row, _))| (k, row)).collect();
            // A paged scan (pages of 37 rows) sees exactly what a full one does.
            let mut paged = HashMap::new();
            let mut from = 0;
            while let Some((next, _)) = store.scan_from(from, 37, |k, _, row| { paged.insert(k, [row[0], row[1], row[2]]); true }).expect("scan") {
                from = next;
            }
            prop_assert_eq!(&paged, &reference);
            let mut seen = HashMap::new();
            store.for_each(|k, _, row| { seen.insert(k, [row[0], row[1], row[2]]); }).expect("scan");
            prop_assert_eq!(seen, reference);
        }
    }
}
