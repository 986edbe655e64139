//! Which lookups are still in flight: a lookup's slots are handed to its
//! update later (a pipeline step, a worker's push), and a slot must not
//! change hands in between. Each training lookup (and each prefetch, whose
//! staged rows wait for their lookup) holds a [`Lease`] on its tick until it
//! is dropped; a row used at or after the oldest leased tick is never evicted
//! or expired. Protection thus follows the batches actually in flight,
//! however many lookups a fast worker makes while a slow one holds its slots.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// The leased ticks of one table (tick → number of leases on it).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    leases: Mutex<BTreeMap<u64, u32>>,
}

/// Holds its tick in flight until dropped.
#[derive(Debug)]
pub(crate) struct Lease {
    registry: Arc<InFlight>,
    tick: u64,
}

impl InFlight {
    /// A new lookup: the next tick of `clock`, leased. Taken and leased under
    /// one lock, so no tick is ever leased below one that
    /// [`oldest`](Self::oldest) already reported.
    pub(crate) fn begin_lookup(self: &Arc<Self>, clock: &AtomicU64) -> Lease {
        let mut leases = self.leases.lock();
        let tick = clock.fetch_add(1, Ordering::Relaxed) + 1;
        *leases.entry(tick).or_insert(0) += 1;
        Lease { registry: Arc::clone(self), tick }
    }

    /// A prefetch: the current tick, leased (its staged rows carry it).
    pub(crate) fn begin_prefetch(self: &Arc<Self>, clock: &AtomicU64) -> Lease {
        let mut leases = self.leases.lock();
        let tick = clock.load(Ordering::Relaxed);
        *leases.entry(tick).or_insert(0) += 1;
        Lease { registry: Arc::clone(self), tick }
    }

    /// Rows last used at or after this tick may be in flight; older ones are
    /// free to go. With nothing in flight, every future lookup's tick is above
    /// `clock`'s current one.
    pub(crate) fn oldest(&self, clock: &AtomicU64) -> u64 {
        let leases = self.leases.lock();
        leases.keys().next().copied().unwrap_or_else(|| clock.load(Ordering::Relaxed).saturating_add(1))
    }
}

impl Lease {
    pub(crate) fn tick(&self) -> u64 {
        self.tick
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut leases = self.registry.leases.lock();
        if let Some(n) = leases.get_mut(&self.tick) {
            *n -= 1;
            if *n == 0 {
                leases.remove(&self.tick);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_tick_in_flight_moves_on_as_leases_are_dropped() {
        let registry = Arc::new(InFlight::default());
        let clock = AtomicU64::new(0);
        assert_eq!(registry.oldest(&clock), 1, "nothing in flight: the next lookup's tick");
        let a = registry.begin_lookup(&clock);
        let staged = registry.begin_prefetch(&clock);
        let b = registry.begin_lookup(&clock);
        assert_eq!((a.tick(), staged.tick(), b.tick()), (1, 1, 2));
        drop(a);
        assert_eq!(registry.oldest(&clock), 1, "the prefetch still holds tick 1");
        drop(staged);
        assert_eq!(registry.oldest(&clock), 2);
        drop(b);
        assert_eq!(registry.oldest(&clock), 3);
    }
}
