//! A shard's key → slot index: open addressing with linear probing over packed
//! 8-byte entries `fingerprint << 32 | (slot + 1)` (0 = empty).
//!
//! Why not a general hash map: a batch lookup wants to prefetch the bucket of
//! key i + 2D and the row of key i + D while it finishes key i; that needs the
//! bucket's address before probing, which hashbrown does not expose. Entries
//! hold only a 32-bit fingerprint of the key; the full key lives in its row, so
//! a fingerprint match is a candidate the caller confirms (and on a collision
//! probing continues from the next bucket). A key's home bucket is a hash of
//! its fingerprint, so an entry alone tells where its probe run starts:
//! growing and removal (a cache tier evicting a row, shifting the following
//! entries of the run back, so no tombstones) never read a row.

use sparrow_core::key::mix64;

/// The index grows (doubles) before more than 4/5 of its buckets are full:
/// linear probing stays short, and an entry costs 10–20 bytes per row.
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;

/// Keys are already hashes (xxh3 of field and value), so their low 32 bits
/// serve as the fingerprint.
#[inline]
pub fn fingerprint(key: u64) -> u32 {
    key as u32
}

/// Where a fingerprint's probe run starts (before masking).
#[inline]
fn home_hash(fp: u32) -> u64 {
    mix64(u64::from(fp))
}

#[inline]
pub fn bucket_hash(key: u64) -> u64 {
    home_hash(fingerprint(key))
}

#[inline]
fn pack(fp: u32, slot: u32) -> u64 {
    (u64::from(fp) << 32) | (u64::from(slot) + 1)
}

#[derive(Debug, Default)]
pub struct SlotIndex {
    entries: Vec<u64>,
    len: usize,
}

/// Where a probe stopped: a candidate slot at `pos`, or the empty bucket `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Candidate { slot: u32, pos: usize },
    Vacant,
}

impl SlotIndex {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn buckets(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    /// The bucket where `key`'s probe starts (to prefetch it).
    #[inline]
    pub fn home(&self, key: u64) -> Option<&u64> {
        self.entries.get(bucket_hash(key) as usize & self.mask())
    }

    /// First bucket at or after `from` whose fingerprint matches `key`'s.
    #[inline]
    pub fn probe_from(&self, key: u64, from: usize) -> Probe {
        if self.entries.is_empty() {
            return Probe::Vacant;
        }
        let (fp, mask) = (fingerprint(key), self.mask());
        let mut pos = from & mask;
        loop {
            let e = self.entries[pos];
            if e == 0 {
                return Probe::Vacant;
            }
            if (e >> 32) as u32 == fp {
                return Probe::Candidate { slot: (e as u32).wrapping_sub(1), pos };
            }
            pos = (pos + 1) & mask;
        }
    }

    #[inline]
    pub fn probe(&self, key: u64) -> Probe {
        self.probe_from(key, bucket_hash(key) as usize)
    }

    /// `key`'s slot, confirming candidates with `key_of(slot)`; a candidate
    /// whose key differs (a fingerprint collision) continues the search.
    #[inline]
    pub fn find(&self, key: u64, key_of: impl Fn(u32) -> u64) -> Option<u32> {
        let mut probe = self.probe(key);
        loop {
            match probe {
                Probe::Vacant => return None,
                Probe::Candidate { slot, pos } => {
                    if key_of(slot) == key {
                        return Some(slot);
                    }
                    probe = self.probe_from(key, pos + 1);
                }
            }
        }
    }

    /// Resolves an earlier probe of `key`, taken before any number of other
    /// keys were inserted: a matching candidate's slot is still right (slots
    /// never change) and a vacancy still means absent (`key` was not inserted
    /// since), but its position may be stale after a growth, so a collision
    /// restarts the search.
    #[inline]
    pub fn confirm(&self, key: u64, probe: Probe, key_of: impl Fn(u32) -> u64) -> Option<u32> {
        match probe {
            Probe::Vacant => None,
            Probe::Candidate { slot, .. } if key_of(slot) == key => Some(slot),
            Probe::Candidate { .. } => self.find(key, key_of),
        }
    }

    /// Adds `key` → `slot`; `key` must not be present.
    pub fn insert(&mut self, key: u64, slot: u32) {
        assert!(slot < u32::MAX, "slot {slot} out of range");
        if (self.len + 1) * MAX_LOAD_DEN > self.entries.len() * MAX_LOAD_NUM {
            self.grow();
        }
        self.place(pack(fingerprint(key), slot), bucket_hash(key) as usize);
        self.len += 1;
    }

    fn place(&mut self, entry: u64, hash: usize) {
        let mask = self.mask();
        let mut pos = hash & mask;
        while self.entries[pos] != 0 {
            pos = (pos + 1) & mask;
        }
        self.entries[pos] = entry;
    }

    fn grow(&mut self) {
        let buckets = (self.entries.len() * 2).max(16);
        let old = std::mem::replace(&mut self.entries, vec![0; buckets]);
        for e in old.into_iter().filter(|&e| e != 0) {
            self.place(e, home_hash((e >> 32) as u32) as usize);
        }
    }

    /// Removes `key` (present at `slot`): the entries after it in its probe
    /// run move back to close the gap (backward-shift deletion), so every
    /// other key stays reachable from its home bucket without tombstones.
    pub fn remove(&mut self, key: u64, slot: u32) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        let mask = self.mask();
        let target = pack(fingerprint(key), slot);
        let mut gap = bucket_hash(key) as usize & mask;
        loop {
            match self.entries[gap] {
                0 => return false,
                e if e == target => break,
                _ => gap = (gap + 1) & mask,
            }
        }
        let mut next = (gap + 1) & mask;
        loop {
            let e = self.entries[next];
            if e == 0 {
                break;
            }
            let home = home_hash((e >> 32) as u32) as usize & mask;
            // The entry may move into the gap unless its home lies cyclically
            // after the gap and at or before its position.
            let stays = if gap <= next { gap < home && home <= next } else { gap < home || home <= next };
            if !stays {
                self.entries[gap] = e;
                gap = next;
            }
            next = (next + 1) & mask;
        }
        self.entries[gap] = 0;
        self.len -= 1;
        true
    }

    /// Bytes held by the index.
    pub fn allocated_bytes(&self) -> usize {
        self.entries.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #[test]
        fn behaves_like_a_map(keys in proptest::collection::vec(any::<u64>(), 0..400), colliding in 0u64..8) {
            // Keys that share a fingerprint (low 32 bits) exercise the slow path.
            let keys: Vec<u64> = keys.into_iter().chain((0..colliding).map(|i| 0xdead_beef | (i << 40))).collect();
            let mut index = SlotIndex::default();
            let mut by_slot: Vec<u64> = Vec::new();
            let mut reference: HashMap<u64, u32> = HashMap::new();
            for &k in &keys {
                let found = index.find(k, |s| by_slot[s as usize]);
                prop_assert_eq!(found, reference.get(&k).copied());
                if found.is_none() {
                    let slot = by_slot.len() as u32;
                    by_slot.push(k);
                    index.insert(k, slot);
                    reference.insert(k, slot);
                }
            }
            prop_assert_eq!(index.len(), reference.len());
            for (&k, &slot) in &reference {
                prop_assert_eq!(index.find(k, |s| by_slot[s as usize]), Some(slot));
            }
            prop_assert_eq!(index.find(0x1234_5678_9abc, |s| by_slot[s as usize]), reference.get(&0x1234_5678_9abc).copied());
        }

        /// Inserts and removals in any order, slots reused as a cache reuses
        /// them: the index answers like a map throughout.
        #[test]
        fn removal_keeps_every_other_key_reachable(ops in proptest::collection::vec((0u64..300, any::<bool>()), 0..600)) {
            let mut index = SlotIndex::default();
            let mut key_at: Vec<u64> = Vec::new();
            let mut free: Vec<u32> = Vec::new();
            let mut reference: HashMap<u64, u32> = HashMap::new();
            for (k, insert) in ops {
                // Low 32 bits shared by pairs of keys: fingerprint collisions too.
                let k = (k % 150) | ((k / 150) << 40);
                match (insert, reference.get(&k).copied()) {
                    (true, None) => {
                        let slot = free.pop().unwrap_or_else(|| { key_at.push(0); key_at.len() as u32 - 1 });
                        key_at[slot as usize] = k;
                        index.insert(k, slot);
                        reference.insert(k, slot);
                    }
                    (false, Some(slot)) => {
                        prop_assert!(index.remove(k, slot));
                        reference.remove(&k);
                        free.push(slot);
                    }
                    _ => {}
                }
                prop_assert_eq!(index.len(), reference.len());
            }
            for k in 0..300u64 {
                let k = (k % 150) | ((k / 150) << 40);
                prop_assert_eq!(index.find(k, |s| key_at[s as usize]), reference.get(&k).copied());
            }
        }
    }
}
