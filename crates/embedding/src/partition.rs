//! Which shard owns a key (S3.1), at both levels: the cluster's shards
//! ([`owner`]) and a table's lock shards ([`Partitioner`]). Both hash the key
//! with `mix64` and read different bits, so the keys of one cluster shard
//! still spread over all of its table's lock shards and index buckets.

use sparrow_core::key::mix64;

use crate::plan::KeyPlan;

/// The cluster shard that owns `key` among `shards`: bits 40 and up of
/// `mix64(key)`, independent of the lock-shard (32..) and bucket (low) bits.
pub fn owner(key: u64, shards: usize) -> usize {
    ((mix64(key) >> 40) % shards as u64) as usize
}

/// Which shard owns a key (S3.1: by hash; the bits differ from the bucket bits).
#[derive(Clone, Copy, Debug)]
pub struct Partitioner {
    pub(crate) mask: u64,
}

impl Partitioner {
    #[inline]
    pub fn shard_of(self, key: u64) -> usize {
        ((mix64(key) >> 32) & self.mask) as usize
    }

    pub fn shards(self) -> usize {
        self.mask as usize + 1
    }

    /// Dedup + partition, on the calling thread.
    pub fn plan(self, keys: &[u64]) -> KeyPlan {
        KeyPlan::new(keys, self.shards(), |k| self.shard_of(k))
    }
}
