//! A value that belongs to one generation and is made after it starts: the
//! lazy scheduler, the data progress. A new generation marks it *pending*
//! under the generations lock (no I/O), then the value is built from the
//! restored checkpoint outside every lock and installed; a request of that
//! generation waits for it meanwhile, a request of another one is told the
//! generation changed. Its lock is a leaf.

use crate::generation::Generation;
use parking_lot::Condvar;

use crate::lock_order::{OrderedMutex, Rank};

struct Slot<T> {
    generation: Generation,
    /// None while the generation's value is being made.
    value: Option<T>,
}

pub struct PerGeneration<T> {
    slot: OrderedMutex<Slot<T>>,
    installed: Condvar,
}

/// The slot holds another generation's value (the one given is over, or
/// not yet started): `.0` is the slot's.
#[derive(Debug, PartialEq, Eq)]
pub struct OtherGeneration(pub Generation);

impl<T> PerGeneration<T> {
    pub fn new(generation: Generation, value: T) -> Self {
        PerGeneration {
            slot: OrderedMutex::new(Rank::Leaf, "per_generation.slot", Slot { generation, value: Some(value) }),
            installed: Condvar::new(),
        }
    }

    /// Generation `generation` started: its value is being made. Returns
    /// the value of the one before, if any (to release its waiters).
    pub fn pending(&self, generation: Generation) -> Option<T> {
        let mut slot = self.slot.lock();
        if generation <= slot.generation {
            return None;
        }
        slot.generation = generation;
        let old = slot.value.take();
        self.installed.notify_all();
        old
    }

    /// The value of `generation`, unless another one started meanwhile
    /// (then it is handed back).
    pub fn install(&self, generation: Generation, value: T) -> Result<(), T> {
        let mut slot = self.slot.lock();
        if slot.generation != generation {
            return Err(value);
        }
        slot.value = Some(value);
        self.installed.notify_all();
        Ok(())
    }

    /// Runs `f` on `generation`'s value, waiting while it is being made.
    pub fn with<R>(&self, generation: Generation, f: impl FnOnce(&mut T) -> R) -> Result<R, OtherGeneration> {
        let mut slot = self.slot.lock();
        loop {
            if slot.generation != generation {
                return Err(OtherGeneration(slot.generation));
            }
            if let Some(value) = slot.value.as_mut() {
                return Ok(f(value));
            }
            self.installed.wait(slot.raw());
        }
    }

    /// The newest generation's value, if made.
    pub fn latest<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.slot.lock().value.as_ref().map(f)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_request_waits_for_its_generations_value_and_others_are_told_it_changed() {
        let p = Arc::new(PerGeneration::new(Generation(1), "one".to_string()));
        assert_eq!(p.with(Generation(1), |v| v.clone()), Ok("one".to_string()));
        assert_eq!(p.pending(Generation(2)), Some("one".to_string()));
        assert_eq!(p.pending(Generation(2)), None, "once");
        assert_eq!(p.with(Generation(1), |v| v.clone()), Err(OtherGeneration(Generation(2))));
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.with(Generation(2), |v| v.clone()))
        };
        assert_eq!(
            p.install(Generation(1), "late".into()),
            Err("late".to_string()),
            "an old generation's value is refused"
        );
        p.install(Generation(2), "two".into()).expect("install");
        assert_eq!(waiter.join().expect("thread"), Ok("two".to_string()));
        // A waiter whose generation is overtaken before its value came is released.
        p.pending(Generation(3));
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.with(Generation(3), |v| v.clone()))
        };
        p.pending(Generation(4));
        assert_eq!(waiter.join().expect("thread"), Err(OtherGeneration(Generation(4))));
        assert_eq!(p.latest(|v| v.clone()), None, "generation 4's value is not made yet");
    }
}
