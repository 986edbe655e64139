//! Failure injection by name in the roles' code paths (the `fail` crate, as
//! TiKV uses it). Every point is off unless a test (`fail::cfg`) or the
//! `FAILPOINTS` environment variable of a role process switches it on, e.g.
//! `FAILPOINTS='shard.push=20*off->return'`: the 21st push kills the shard.
//! Action `return` raises an [`Injected`] panic: the `sparrow` binary's
//! panic hook ends the process on seeing it, on the spot, as SIGKILL would
//! (exit code 137, no cleanup, nothing flushed); code that links the library
//! sees a panic. The library never exits the process itself. `panic`
//! panics there.
//!
//! The points: `shard.pull`, `shard.push`, `shard.write_part` (before the
//! part is written), `shard.part_written` (written, not yet reported: a death
//! in the middle of a checkpoint), `shard.restore`, `loader.next_batch`,
//! `worker.step` (after a step), `worker.checkpoint`, `coordinator.commit`
//! (every part verified, the manifest not yet renamed into place),
//! `coordinator.sum`, `coordinator.merge`, `coordinator.aggregate` (a lazy
//! contribution or partial sum arrived), `aggregator.partial` (an aggregator
//! process has its workers' contributions, its partial sum not yet sent),
//! `worker.round` (a round's items trained, its update not yet sent), and
//! `worker.<i>.step`: after each step
//! of worker i only, e.g. `worker.1.step=sleep(20)` makes worker 1 slower.
//!
//! `sparrow launch` hands `FAILPOINTS` to the first process of each role
//! only: a restarted role runs without it (set `SPARROW_FAILPOINTS_ON_RESTART=1`
//! to keep it, e.g. to spend the restart budget).

/// Evaluates failpoint `name` (nothing without the crate's `failpoints`
/// feature, which the `sparrow` binary turns on).
#[cfg(feature = "failpoints")]
pub fn point(name: &str) {
    fail::fail_point!(name, |_| die(name));
}

#[cfg(not(feature = "failpoints"))]
pub fn point(_name: &str) {}

/// Failpoint `worker.<index>.step`: one worker's steps only.
#[cfg(feature = "failpoints")]
pub fn worker_step(index: usize) {
    point(&format!("worker.{index}.step"));
}

#[cfg(not(feature = "failpoints"))]
pub fn worker_step(_index: usize) {}

/// The payload of the panic a failpoint's `return` action raises (the
/// failpoint's name): what to do with the process is the binary's choice.
#[derive(Debug)]
pub struct Injected(pub String);

#[cfg(feature = "failpoints")]
fn die(name: &str) {
    std::panic::panic_any(Injected(name.to_string()));
}
