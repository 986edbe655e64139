//! The job's attempt number. Every request between roles carries the
//! generation it belongs to, so nothing of an abandoned attempt reaches a
//! restored role (see [`crate::coordinator`]).

use std::fmt;

/// One attempt of the job, numbered from 1; `Generation::NONE` (0): no
/// attempt yet, or a job in one process that never restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl Generation {
    pub const NONE: Generation = Generation(0);
    /// A job's first attempt.
    pub const FIRST: Generation = Generation(1);

    /// The attempt after this one.
    pub fn next(self) -> Generation {
        Generation(self.0 + 1)
    }

    /// Its number, as the wire carries it.
    pub fn number(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
