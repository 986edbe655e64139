//! `[train.schedule]`: the learning rates' factor by dense step — a linear
//! warmup, then constant, linear, cosine or step decay — for the dense
//! optimizer and (unless turned off) the embedding rows' optimizer.
//!
//! The factor is a function of the steps taken, which the checkpoint keeps
//! (the dense optimizer's step count): a resumed run takes the same rates.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// What follows the warmup.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// The configured rates (after the warmup).
    #[default]
    Constant,
    /// From 1 down to `final_factor` over `decay_steps`, in a straight line.
    Linear,
    /// From 1 down to `final_factor` over `decay_steps`, along half a cosine
    /// (PyTorch's CosineAnnealingLR with eta_min = final_factor · lr).
    Cosine,
    /// Multiplied by `step_gamma` every `step_every` steps (PyTorch's StepLR).
    Step,
}

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// `constant`, `linear`, `cosine` or `step`: the factor after the warmup.
    pub kind: ScheduleKind,
    /// Steps whose factor rises linearly to 1: step t (from 0) takes
    /// (t + 1) / warmup_steps. 0: none.
    pub warmup_steps: u64,
    /// `linear` and `cosine`: the steps after the warmup over which the
    /// factor falls to `final_factor` (and stays there).
    pub decay_steps: u64,
    /// `linear` and `cosine`: the factor at the end of the decay.
    pub final_factor: f64,
    /// `step`: the steps after the warmup between two cuts.
    pub step_every: u64,
    /// `step`: what each cut multiplies the factor by.
    pub step_gamma: f64,
    /// Whether the embedding rows' learning rate (`embedding.learning_rate`)
    /// follows the schedule too, as the dense one always does.
    pub embedding: bool,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            kind: ScheduleKind::Constant,
            warmup_steps: 0,
            decay_steps: 0,
            final_factor: 0.0,
            step_every: 0,
            step_gamma: 0.1,
            embedding: true,
        }
    }
}

impl ScheduleConfig {
    /// Whether every step takes the configured rates (factor 1 throughout).
    pub fn is_constant(&self) -> bool {
        self.kind == ScheduleKind::Constant && self.warmup_steps == 0
    }

    /// The learning rates' factor for the step after `steps_taken` steps
    /// (exactly 1 where the schedule leaves the rates alone).
    pub fn factor(&self, steps_taken: u64) -> f64 {
        let t = steps_taken;
        if t < self.warmup_steps {
            return (t + 1) as f64 / self.warmup_steps as f64;
        }
        let after = t - self.warmup_steps;
        let progress = || (after as f64 / self.decay_steps.max(1) as f64).min(1.0);
        match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => 1.0 - (1.0 - self.final_factor) * progress(),
            ScheduleKind::Cosine => {
                self.final_factor + (1.0 - self.final_factor) * 0.5 * (1.0 + (std::f64::consts::PI * progress()).cos())
            }
            ScheduleKind::Step => {
                let cuts = after / self.step_every.max(1);
                self.step_gamma.powi(cuts.min(i32::MAX as u64) as i32)
            }
        }
    }

    /// The keys each kind needs, in range.
    pub fn check(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, message: String| Err(ConfigError::Invalid { key: format!("train.schedule.{key}"), message });
        let needs_decay = matches!(self.kind, ScheduleKind::Linear | ScheduleKind::Cosine);
        if needs_decay && self.decay_steps == 0 {
            return invalid("decay_steps", "must be at least 1 for a linear or cosine schedule".into());
        }
        if !(0.0..=1.0).contains(&self.final_factor) {
            return invalid("final_factor", format!("must be in [0, 1], not {}", self.final_factor));
        }
        if self.kind == ScheduleKind::Step && self.step_every == 0 {
            return invalid("step_every", "must be at least 1 for a step schedule".into());
        }
        if !(self.step_gamma > 0.0 && self.step_gamma <= 1.0) {
            return invalid("step_gamma", format!("must be in (0, 1], not {}", self.step_gamma));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{ScheduleConfig, ScheduleKind};

    fn schedule(kind: ScheduleKind, warmup_steps: u64) -> ScheduleConfig {
        ScheduleConfig {
            kind,
            warmup_steps,
            decay_steps: 10,
            final_factor: 0.1,
            step_every: 4,
            step_gamma: 0.5,
            ..Default::default()
        }
    }

    /// Each kind's factors, worked by hand: the warmup's ramp, then the
    /// line, the half cosine (its middle at the mean of 1 and the final
    /// factor) and the cuts; the decay holds its final factor after it ends.
    #[test]
    fn each_schedule_gives_its_factors() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let warm = schedule(ScheduleKind::Constant, 4);
        assert_eq!([0, 1, 2, 3, 4, 100].map(|t| warm.factor(t)), [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
        assert!(ScheduleConfig::default().is_constant());
        assert_eq!(ScheduleConfig::default().factor(12345), 1.0);
        let linear = schedule(ScheduleKind::Linear, 2);
        assert_eq!(linear.factor(1), 1.0); // the warmup's last step
        assert!(close(linear.factor(2), 1.0));
        assert!(close(linear.factor(7), 1.0 - 0.9 * 0.5));
        assert!(close(linear.factor(12), 0.1) && close(linear.factor(500), 0.1));
        let cosine = schedule(ScheduleKind::Cosine, 0);
        assert!(close(cosine.factor(0), 1.0));
        assert!(close(cosine.factor(5), 0.55));
        assert!(close(cosine.factor(10), 0.1) && close(cosine.factor(11), 0.1));
        let step = schedule(ScheduleKind::Step, 1);
        assert_eq!([1, 4, 5, 8, 9].map(|t| step.factor(t)), [1.0, 1.0, 0.5, 0.5, 0.25]);
    }

    /// A schedule missing what its kind needs is refused naming the key.
    #[test]
    fn incomplete_schedules_are_refused_by_key() {
        let bad = [
            (ScheduleConfig { kind: ScheduleKind::Cosine, ..Default::default() }, "decay_steps"),
            (ScheduleConfig { kind: ScheduleKind::Step, ..Default::default() }, "step_every"),
            (ScheduleConfig { final_factor: 2.0, ..Default::default() }, "final_factor"),
            (ScheduleConfig { step_gamma: 0.0, ..Default::default() }, "step_gamma"),
        ];
        for (s, key) in bad {
            let err = s.check().expect_err(key).to_string();
            assert!(err.contains(&format!("train.schedule.{key}")), "{err}");
        }
    }
}
