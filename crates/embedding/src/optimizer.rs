//! Per-row sparse optimizers. A row's optimizer state lives right after its
//! weights, so one cache line fetch serves both (S3.7).

use sparrow_core::config::{EmbeddingConfig, SparseOptimizerKind};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SparseOptimizer {
    Sgd {
        lr: f32,
    },
    /// Per-coordinate Adagrad: `acc += g²; w -= lr·g/(√acc + eps)`.
    Adagrad {
        lr: f32,
        eps: f32,
    },
    /// Row-wise Adagrad (FBGEMM's `EXACT_ROWWISE_ADAGRAD`): one accumulator
    /// per row, `acc += mean(g²); w -= lr·g/(√acc + eps)`.
    RowwiseAdagrad {
        lr: f32,
        eps: f32,
    },
    /// Lazy Adam: moments and the step count are per row, advanced only when
    /// the row receives a gradient.
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
    },
    /// FTRL-Proximal (McMahan et al. 2013), per coordinate, `alpha` = learning rate.
    Ftrl {
        alpha: f32,
        beta: f32,
        l1: f32,
        l2: f32,
    },
}

impl SparseOptimizer {
    pub fn from_config(c: &EmbeddingConfig) -> Self {
        match c.optimizer {
            SparseOptimizerKind::Sgd => SparseOptimizer::Sgd { lr: c.learning_rate },
            SparseOptimizerKind::Adagrad => SparseOptimizer::Adagrad { lr: c.learning_rate, eps: c.eps },
            SparseOptimizerKind::RowwiseAdagrad => SparseOptimizer::RowwiseAdagrad { lr: c.learning_rate, eps: c.eps },
            SparseOptimizerKind::Adam => {
                SparseOptimizer::Adam { lr: c.learning_rate, beta1: c.beta1, beta2: c.beta2, eps: c.eps }
            }
            SparseOptimizerKind::Ftrl => {
                SparseOptimizer::Ftrl { alpha: c.learning_rate, beta: c.ftrl_beta, l1: c.ftrl_l1, l2: c.ftrl_l2 }
            }
        }
    }

    /// The same optimizer at `factor` times its learning rate (FTRL: its
    /// alpha); a factor of 1 is itself, bit for bit.
    pub fn scaled(self, factor: f32) -> SparseOptimizer {
        if factor == 1.0 {
            return self;
        }
        match self {
            SparseOptimizer::Sgd { lr } => SparseOptimizer::Sgd { lr: lr * factor },
            SparseOptimizer::Adagrad { lr, eps } => SparseOptimizer::Adagrad { lr: lr * factor, eps },
            SparseOptimizer::RowwiseAdagrad { lr, eps } => SparseOptimizer::RowwiseAdagrad { lr: lr * factor, eps },
            SparseOptimizer::Adam { lr, beta1, beta2, eps } => {
                SparseOptimizer::Adam { lr: lr * factor, beta1, beta2, eps }
            }
            SparseOptimizer::Ftrl { alpha, beta, l1, l2 } => {
                SparseOptimizer::Ftrl { alpha: alpha * factor, beta, l1, l2 }
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            SparseOptimizer::Sgd { .. } => "sgd",
            SparseOptimizer::Adagrad { .. } => "adagrad",
            SparseOptimizer::RowwiseAdagrad { .. } => "rowwise_adagrad",
            SparseOptimizer::Adam { .. } => "adam",
            SparseOptimizer::Ftrl { .. } => "ftrl",
        }
    }

    /// f32 slots of optimizer state per row of width `dim`.
    pub fn state_len(&self, dim: usize) -> usize {
        match self {
            SparseOptimizer::Sgd { .. } => 0,
            SparseOptimizer::Adagrad { .. } => dim,
            SparseOptimizer::RowwiseAdagrad { .. } => 1,
            SparseOptimizer::Adam { .. } => 2 * dim + 1,
            SparseOptimizer::Ftrl { .. } => 2 * dim,
        }
    }

    /// State of a freshly initialised row with weights `w`. For FTRL, `z` is
    /// chosen so that the proximal step reproduces `w` (the random init is kept).
    pub fn init_state(&self, w: &[f32], state: &mut [f32]) {
        state.fill(0.0);
        if let SparseOptimizer::Ftrl { alpha, beta, l1, l2 } = *self {
            let denom = beta / alpha + l2;
            let (z, _n) = state.split_at_mut(w.len());
            for (z, &w) in z.iter_mut().zip(w) {
                *z = -w * denom - w.signum() * l1 * f32::from(w != 0.0);
            }
        }
    }

    /// Applies one (already summed) gradient `g` to a row.
    #[inline]
    pub fn apply(&self, w: &mut [f32], state: &mut [f32], g: &[f32]) {
        match self.coordinate_rule(state, g) {
            Some(CoordinateRule::Scaled { step }) => {
                for (w, &g) in w.iter_mut().zip(g) {
                    *w -= step * g;
                }
            }
            Some(CoordinateRule::Adagrad { lr, eps }) => {
                for ((w, acc), &g) in w.iter_mut().zip(state.iter_mut()).zip(g) {
                    *acc += g * g;
                    *w -= lr * g / (acc.sqrt() + eps);
                }
            }
            None => self.apply_coupled(w, state, g),
        }
    }

    /// For the optimizers whose step is one rule applied to each coordinate
    /// on its own (SGD, Adagrad, row-wise Adagrad): advances the state the
    /// row shares (row-wise Adagrad's accumulator) and returns the rule, so
    /// a kernel can run it on a stored half vector without leaving
    /// registers. `None`, touching nothing, for Adam and FTRL.
    #[inline]
    pub fn coordinate_rule(&self, state: &mut [f32], g: &[f32]) -> Option<CoordinateRule> {
        match *self {
            SparseOptimizer::Sgd { lr } => Some(CoordinateRule::Scaled { step: lr }),
            SparseOptimizer::Adagrad { lr, eps } => Some(CoordinateRule::Adagrad { lr, eps }),
            SparseOptimizer::RowwiseAdagrad { lr, eps } => {
                let n = g.len().max(1);
                // Dividing by a power of two is multiplying by its exact
                // inverse (the same bits), which the CPU does off the
                // chain of dependent steps from g to the new weights.
                let mean_square = if n.is_power_of_two() {
                    sum_of_squares(g) * (1.0 / n as f32)
                } else {
                    sum_of_squares(g) / n as f32
                };
                state[0] += mean_square;
                Some(CoordinateRule::Scaled { step: lr / (state[0].sqrt() + eps) })
            }
            SparseOptimizer::Adam { .. } | SparseOptimizer::Ftrl { .. } => None,
        }
    }

    /// Adam and FTRL, whose coordinates read the row's step count or each
    /// other's state.
    fn apply_coupled(&self, w: &mut [f32], state: &mut [f32], g: &[f32]) {
        match *self {
            SparseOptimizer::Adam { lr, beta1, beta2, eps } => {
                let dim = w.len();
                let (m, rest) = state.split_at_mut(dim);
                let (v, t) = rest.split_at_mut(dim);
                t[0] += 1.0;
                let step = t[0];
                let c1 = 1.0 - beta1.powf(step);
                let c2 = 1.0 - beta2.powf(step);
                for i in 0..dim {
                    m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
                    v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
                    let m_hat = m[i] / c1;
                    let v_hat = v[i] / c2;
                    w[i] -= lr * m_hat / (v_hat.sqrt() + eps);
                }
            }
            SparseOptimizer::Ftrl { alpha, beta, l1, l2 } => {
                let dim = w.len();
                let (z, n) = state.split_at_mut(dim);
                for i in 0..dim {
                    let n_new = n[i] + g[i] * g[i];
                    let sigma = (n_new.sqrt() - n[i].sqrt()) / alpha;
                    z[i] += g[i] - sigma * w[i];
                    n[i] = n_new;
                    w[i] = if z[i].abs() <= l1 {
                        0.0
                    } else {
                        -(z[i] - z[i].signum() * l1) / ((beta + n[i].sqrt()) / alpha + l2)
                    };
                }
            }
            SparseOptimizer::Sgd { .. } | SparseOptimizer::Adagrad { .. } | SparseOptimizer::RowwiseAdagrad { .. } => {
                unreachable!("{} has a coordinate rule", self.name())
            }
        }
    }
}

/// One coordinate's step, for [`SparseOptimizer::coordinate_rule`]: the
/// weight `w`, its gradient `g` and (Adagrad) its accumulator `acc`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CoordinateRule {
    /// `w -= step·g` (SGD: `step` = lr; row-wise Adagrad: lr / (√acc + eps)).
    Scaled { step: f32 },
    /// `acc += g²; w -= lr·g / (√acc + eps)`.
    Adagrad { lr: f32, eps: f32 },
}

/// Σ g² in 8 running sums (coordinate i in sum i mod 8), then added in a
/// fixed order: the same bits on every CPU, and a loop the compiler
/// vectorises, where one running sum is a chain of dependent adds (at dim
/// 16 that chain was most of a row-wise Adagrad step).
#[inline]
fn sum_of_squares(g: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = g.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += x * x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(rest) {
        *a += x * x;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_of_squares_counts_every_coordinate_once() {
        for len in [0usize, 1, 5, 8, 13, 16, 17, 64, 100] {
            let g: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37 - 2.0) * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
            let exact: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let got = f64::from(sum_of_squares(&g));
            assert!((got - exact).abs() <= 1e-6 * exact.max(1.0), "len {len}: {got} vs {exact}");
        }
    }

    #[test]
    fn dividing_by_a_power_of_two_is_multiplying_by_its_inverse() {
        let mut x = 0x9e37_79b9u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = f32::from_bits(x);
            for n in [1u32, 2, 16, 64, 1024] {
                let (div, mul) = (v / n as f32, v * (1.0 / n as f32));
                assert!(div.to_bits() == mul.to_bits() || (div.is_nan() && mul.is_nan()), "{v:e} / {n}");
            }
        }
    }
}
