//! Which persistent store backs the SSD tier (S3.8), by measurement. Each
//! candidate holds `--rows` rows of 128 bytes (dim 16 + Adagrad state) and
//! then serves the cache's traffic: per miss, one evicted row written back and
//! one row read, keys uniform over the table (a cache keeps the hot ones).
//!
//! - `hashfile`: Sparrow's `DiskStore` (open-addressing hash file, nothing per
//!   row in memory).
//! - `indexed`: a fixed-slot file with an in-memory key → slot index (the
//!   design of OneEmbedding's persistent table), built here on a `HashMap`.
//! - `fjall`: the fjall 3 LSM tree (one keyspace, 64 MiB block cache, no fsync).
//!
//! Run one store per process (resident memory is per process):
//! `cargo bench -p sparrow-embedding --bench store_compare -- fjall --rows 4000000`

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use sparrow_core::key::mix64;
use sparrow_core::rng::Rng;
use sparrow_embedding::disk::DiskStore;

const ROW_FLOATS: usize = 32;

trait Store {
    fn put(&mut self, key: u64, row: &[f32]);
    fn get(&mut self, key: u64, out: &mut [f32]) -> bool;
}

impl Store for DiskStore {
    fn put(&mut self, key: u64, row: &[f32]) {
        DiskStore::put(self, key, row).expect("put");
    }
    fn get(&mut self, key: u64, out: &mut [f32]) -> bool {
        DiskStore::get(self, key, out).expect("get").is_some()
    }
}

/// Fixed slots in a file, found through an in-memory map.
struct IndexedFile {
    file: File,
    slots: HashMap<u64, u64>,
    buf: Vec<u8>,
}

impl Store for IndexedFile {
    fn put(&mut self, key: u64, row: &[f32]) {
        let next = self.slots.len() as u64;
        let slot = *self.slots.entry(key).or_insert(next);
        self.buf.clear();
        row.iter().for_each(|x| self.buf.extend_from_slice(&x.to_le_bytes()));
        self.file.write_all_at(&self.buf, slot * (ROW_FLOATS as u64 * 4)).expect("write");
    }
    fn get(&mut self, key: u64, out: &mut [f32]) -> bool {
        let Some(&slot) = self.slots.get(&key) else { return false };
        self.buf.resize(ROW_FLOATS * 4, 0);
        self.file.read_exact_at(&mut self.buf, slot * (ROW_FLOATS as u64 * 4)).expect("read");
        for (x, b) in out.iter_mut().zip(self.buf.chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        true
    }
}

struct Fjall {
    _db: fjall::Database,
    ks: fjall::Keyspace,
    buf: Vec<u8>,
}

impl Store for Fjall {
    fn put(&mut self, key: u64, row: &[f32]) {
        self.buf.clear();
        row.iter().for_each(|x| self.buf.extend_from_slice(&x.to_le_bytes()));
        self.ks.insert(key.to_be_bytes(), &self.buf[..]).expect("insert");
    }
    fn get(&mut self, key: u64, out: &mut [f32]) -> bool {
        match self.ks.get(key.to_be_bytes()).expect("get") {
            Some(v) => {
                for (x, b) in out.iter_mut().zip(v.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                true
            }
            None => false,
        }
    }
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let m = e.metadata().expect("metadata");
        total += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
    }
    total
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let which = args.iter().skip(1).find(|a| ["hashfile", "indexed", "fjall"].contains(&a.as_str())).cloned();
    let Some(which) = which else {
        // `cargo bench` without a store name (all benches): nothing to do.
        eprintln!("store_compare: name a store (hashfile | indexed | fjall), see the file's header");
        return;
    };
    let rows: u64 = arg("--rows").map_or(2_000_000, |r| r.parse().expect("--rows"));
    let ops: u64 = arg("--ops").map_or(1_000_000, |r| r.parse().expect("--ops"));
    // Default: cargo's scratch directory for benches (under target/, on disk).
    let tmp = tempfile::tempdir_in(arg("--dir").unwrap_or_else(|| env!("CARGO_TARGET_TMPDIR").into())).expect("tmp");
    let rss0 = rss_bytes();
    let mut store: Box<dyn Store> = match which.as_str() {
        "hashfile" => Box::new(DiskStore::create(&tmp.path().join("store.bin"), ROW_FLOATS).expect("create")),
        "indexed" => Box::new(IndexedFile {
            file: File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(tmp.path().join("slots.bin"))
                .expect("create"),
            slots: HashMap::new(),
            buf: Vec::new(),
        }),
        _ => {
            let db =
                fjall::Database::builder(tmp.path().join("fjall")).cache_size(64 << 20).open().expect("open fjall");
            let ks = db.keyspace("rows", fjall::KeyspaceCreateOptions::default).expect("keyspace");
            Box::new(Fjall { _db: db, ks, buf: Vec::new() })
        }
    };
    let key = |i: u64| mix64(i ^ 0x5eed);
    let mut row = vec![0.0f32; ROW_FLOATS];
    let start = Instant::now();
    for i in 0..rows {
        row[0] = i as f32;
        store.put(key(i), &row);
    }
    let fill_secs = start.elapsed().as_secs_f64();
    let mut rng = Rng::new(3);
    let start = Instant::now();
    let mut found = 0u64;
    for _ in 0..ops {
        let (evicted, loaded) = (rng.below(rows), rng.below(rows));
        row[1] += 1.0;
        store.put(key(evicted), &row);
        found += u64::from(store.get(key(loaded), &mut row));
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(found, ops, "every row is found");
    let rss = rss_bytes().saturating_sub(rss0);
    println!(
        "{{\"store\":\"{which}\",\"rows\":{rows},\"fill_rows_per_sec\":{:.0},\"miss_pairs_per_sec\":{:.0},\"us_per_miss\":{:.2},\"rss_bytes_per_row\":{:.1},\"disk_bytes_per_row\":{:.1}}}",
        rows as f64 / fill_secs,
        ops as f64 / secs,
        secs * 1e6 / ops as f64,
        rss as f64 / rows as f64,
        dir_bytes(tmp.path()) as f64 / rows as f64,
    );
}
