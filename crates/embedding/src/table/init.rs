//! Initial rows: a key's initial vector depends only on (seed, key).

use sparrow_core::config::{InitConfig, InitKind};
use sparrow_core::key::mix64;
use sparrow_core::rng::Rng;

/// Deterministic per-key initialisation: the same key gets the same initial
/// vector whatever the insertion order or thread, so runs are reproducible.
#[derive(Clone, Copy, Debug)]
pub struct Initializer {
    pub kind: InitKind,
    pub scale: f32,
    pub seed: u64,
}

impl Initializer {
    pub fn new(config: InitConfig, seed: u64) -> Self {
        Initializer { kind: config.kind, scale: config.scale, seed }
    }

    pub fn fill(&self, key: u64, w: &mut [f32]) {
        let mut rng = Rng::new(self.seed ^ mix64(key));
        match self.kind {
            InitKind::Zeros => w.fill(0.0),
            InitKind::Uniform => {
                for x in w {
                    *x = ((rng.next_f64() * 2.0 - 1.0) as f32) * self.scale;
                }
            }
            InitKind::Normal => {
                for x in w {
                    *x = rng.normal() as f32 * self.scale;
                }
            }
        }
    }
}
