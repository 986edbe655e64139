//! The coordinator's lock order, checked as locks are taken. Each lock of
//! the coordinator's parts, the rendezvous and the lazy scheduler is an
//! [`OrderedMutex`] with a [`Rank`]: a thread may take a lock only while
//! every lock it holds ranks lower. A thread that breaks the order panics
//! naming both locks, at once, instead of deadlocking one day with another
//! thread that takes them the other way round. The check is a thread-local
//! list of the held locks (a push and a pop a lock, nothing shared).

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Where a lock sits in the order: lower ranks are taken first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// The coordinator's generations (`recovery`): held while a new
    /// generation advances the leaves.
    Generations,
    /// The lazy scheduler's state: held while it reads its conditions and
    /// backup targets.
    LazyState,
    /// Everything else: no other lock is taken while one is held.
    Leaf,
}

thread_local! {
    /// The locks this thread holds, in the order taken: (rank, name).
    static HELD: RefCell<Vec<(Rank, &'static str)>> = const { RefCell::new(Vec::new()) };
}

/// A `parking_lot::Mutex` with a place in the lock order.
pub struct OrderedMutex<T> {
    rank: Rank,
    name: &'static str,
    inner: parking_lot::Mutex<T>,
}

impl<T> OrderedMutex<T> {
    pub fn new(rank: Rank, name: &'static str, value: T) -> Self {
        OrderedMutex { rank, name, inner: parking_lot::Mutex::new(value) }
    }

    /// Takes the lock; panics if this thread holds a lock of an equal or
    /// higher rank (the order would be broken).
    pub fn lock(&self) -> OrderedGuard<'_, T> {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(&(rank, name)) = held.iter().find(|(rank, _)| *rank >= self.rank) {
                let (me, my_rank) = (self.name, self.rank);
                drop(held);
                panic!("lock order: `{me}` ({my_rank:?}) taken while holding `{name}` ({rank:?})");
            }
            held.push((self.rank, self.name));
        });
        OrderedGuard { guard: self.inner.lock(), name: self.name }
    }
}

/// A held [`OrderedMutex`]; dropping it releases the lock.
pub struct OrderedGuard<'a, T> {
    guard: parking_lot::MutexGuard<'a, T>,
    name: &'static str,
}

impl<'a, T> OrderedGuard<'a, T> {
    /// The lock itself, for a condition variable to wait on (the thread
    /// takes no other lock while it waits).
    pub fn raw(&mut self) -> &mut parking_lot::MutexGuard<'a, T> {
        &mut self.guard
    }
}

impl<T> Deref for OrderedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for OrderedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for OrderedGuard<'_, T> {
    fn drop(&mut self) {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().rposition(|(_, name)| *name == self.name) {
                held.remove(at);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics(f: impl FnOnce() + std::panic::UnwindSafe) -> Option<String> {
        std::panic::catch_unwind(f).err().map(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
    }

    /// Down the order is allowed, in either release order; two leaves, or
    /// a lower rank under a higher one, is refused naming both locks.
    #[test]
    fn locks_are_taken_down_the_order_only() {
        let generations = OrderedMutex::new(Rank::Generations, "recovery", 0);
        let (a, b) = (OrderedMutex::new(Rank::Leaf, "a", 0), OrderedMutex::new(Rank::Leaf, "b", 0));
        {
            let g = generations.lock();
            let x = a.lock();
            drop(g);
            drop(x);
        }
        let _ = b.lock();
        let both = panics(std::panic::AssertUnwindSafe(|| {
            let _x = a.lock();
            let _y = b.lock();
        }));
        assert_eq!(both.as_deref(), Some("lock order: `b` (Leaf) taken while holding `a` (Leaf)"));
        let upward = panics(std::panic::AssertUnwindSafe(|| {
            let _x = a.lock();
            let _g = generations.lock();
        }));
        assert!(upward.is_some_and(|m| m.contains("`recovery` (Generations) taken while holding `a`")));
        // A panic releases what it held: the thread takes locks again.
        let _ = generations.lock();
        let _ = a.lock();
    }
}
