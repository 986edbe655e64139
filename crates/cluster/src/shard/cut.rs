//! A shard's checkpoint cut. Table work (enqueue, pull, push, stage) and the
//! walk that writes a checkpoint part exclude each other, so a part is a cut:
//! no row moves while the walk runs. It is a gate, not a lock held across
//! the walk's disk writes: the walk closes it once no table work is under
//! way and writes with no lock held; work that arrives meanwhile waits on
//! the gate's condition variable until the walk opens it. A walk waiting to
//! close the gate stops new work from starting, so it is not starved.

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct State {
    /// Table work under way.
    working: usize,
    /// A walk holds the gate closed.
    walking: bool,
    /// Walks waiting to close it (new work waits behind them).
    walks_waiting: usize,
    /// Work waiting for a walk to end (exposed for tests to order by).
    work_waiting: usize,
}

#[derive(Default)]
pub struct Cut {
    state: Mutex<State>,
    changed: Condvar,
}

/// Table work under way; dropping it lets a walk go.
pub struct Work<'a>(&'a Cut);

/// A walk holding the gate closed; dropping it opens the gate.
pub struct Walk<'a>(&'a Cut);

impl Cut {
    /// Starts table work, once no walk holds or waits for the gate.
    pub fn work(&self) -> Work<'_> {
        let mut state = self.state.lock();
        if state.walking || state.walks_waiting > 0 {
            state.work_waiting += 1;
            self.changed.notify_all();
            while state.walking || state.walks_waiting > 0 {
                self.changed.wait(&mut state);
            }
            state.work_waiting -= 1;
        }
        state.working += 1;
        Work(self)
    }

    /// Closes the gate once the work under way ended; the walk runs while
    /// the returned [`Walk`] lives.
    pub fn walk(&self) -> Walk<'_> {
        let mut state = self.state.lock();
        state.walks_waiting += 1;
        self.changed.notify_all();
        while state.walking || state.working > 0 {
            self.changed.wait(&mut state);
        }
        state.walks_waiting -= 1;
        state.walking = true;
        Walk(self)
    }

    /// Blocks until `n` pieces of work and `walks` walks wait (tests order
    /// by it).
    #[cfg(test)]
    fn wait_for_waiting(&self, work: usize, walks: usize) {
        let mut state = self.state.lock();
        while state.work_waiting < work || state.walks_waiting < walks {
            self.changed.wait(&mut state);
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.working -= 1;
        if state.working == 0 {
            self.0.changed.notify_all();
        }
    }
}

impl Drop for Walk<'_> {
    fn drop(&mut self) {
        self.0.state.lock().walking = false;
        self.0.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Work arriving during a walk waits for it; a walk waits for the work
    /// under way, and new work waits behind a waiting walk.
    #[test]
    fn work_and_a_walk_exclude_each_other() {
        let cut = Arc::new(Cut::default());
        let walk = cut.walk();
        let waiter = {
            let cut = cut.clone();
            std::thread::spawn(move || drop(cut.work()))
        };
        cut.wait_for_waiting(1, 0);
        assert!(!waiter.is_finished(), "work waits while the walk runs");
        drop(walk);
        waiter.join().expect("work went on");

        let work = cut.work();
        let (tx, rx) = std::sync::mpsc::channel();
        let walker = {
            let cut = cut.clone();
            std::thread::spawn(move || {
                let _walk = cut.walk();
                tx.send(()).expect("send");
            })
        };
        // The walk waits for `work`; once it waits, new work waits behind it.
        cut.wait_for_waiting(0, 1);
        let late = {
            let cut = cut.clone();
            std::thread::spawn(move || drop(cut.work()))
        };
        cut.wait_for_waiting(1, 1);
        assert!(rx.try_recv().is_err(), "the walk waits for the work under way");
        drop(work);
        rx.recv().expect("the walk ran");
        walker.join().expect("walker");
        late.join().expect("late work went on after the walk");
    }
}
