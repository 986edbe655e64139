//! `model.precision = "bf16"` on AMX for a plain stack (ReLU, no norm,
//! dropout or other activation, its input laid out): what each product
//! reads next is kept as the bf16 tiles it will be read as, not as fp32.
//!
//! The step was bound by memory, not by the tiles: every fp32 activation
//! and gradient was written, read back to be rounded and packed (once as
//! a left operand, once across its rows for a weight gradient), and read
//! again by the ReLU's pass. Here a hidden layer's forward product stores
//! its output, through bias and ReLU, straight into the tiles of the next
//! layer's input and of the `xᵀ` of that layer's weight gradient, and a
//! bit per output for the ReLU; the first layer keeps its input's `xᵀ`
//! tiles as it packs its blocks. Going back, the product giving the
//! gradient at a hidden layer's output masks it by those bits, sums its
//! bias gradient, and stores it as the tiles its two products read.
//!
//! The values are the ones the fp32 buffers would have been rounded to,
//! and each output is the same chain of `tdpbf16ps`: the model is the
//! unkept path's bit for bit (tested), only fewer bytes move.

use std::sync::atomic::AtomicBool;

use sparrow_core::config::Activation;

use super::{First, MlpShape};
use crate::amx::{self, Kept, Left, Out, Packed, Relu, Right};
use crate::bf16::{Arith, Bf16Path, Epilogue};
use crate::matrix::Operand;

/// The tiles one forward pass keeps for its backward pass.
#[derive(Default)]
pub(crate) struct KeptTiles {
    /// Nothing kept, ever (the tests' reference).
    #[cfg(test)]
    unkept: bool,
    /// The last forward pass's plan (None: nothing kept).
    plan: Option<Plan>,
    /// The input's `xᵀ`, the first layer's weight gradient's left operand.
    input_t: Packed,
    /// Per hidden layer kept: its output as the next layer's input, and
    /// as the `xᵀ` of the next layer's weight gradient; its ReLU's bits.
    outputs: Vec<Packed>,
    outputs_t: Vec<Packed>,
    passed: Vec<Vec<u32>>,
    /// The gradient at a kept output (as a left operand, and across its
    /// rows as a right one); the two pairs take turns going back.
    grads: [(Packed, Packed); 2],
    /// Whether the last backward pass found the first layer's `d x` (the
    /// step's input gradient) all finite, checked as its product stored it
    /// (false: not checked, or not finite).
    input_grad_finite: bool,
}

/// Which products run on AMX, and which outputs are kept as tiles.
#[derive(Clone)]
struct Plan {
    /// Per layer: its three products are AMX's ([`amx::takes`]).
    tiles: Vec<bool>,
    /// Per layer: its output is kept as tiles only.
    kept: Vec<bool>,
    /// Which of `grads` holds the gradient at the current layer's output.
    grad: usize,
}

impl KeptTiles {
    /// Plans a forward pass of `rows` rows: None (the fp32 buffers, as
    /// before) unless the stack is plain and bf16 runs on AMX.
    pub(super) fn plan(&mut self, shape: &MlpShape, x: &First<'_>, rows: usize) {
        let plain = shape.arith == Arith::Bf16(Bf16Path::Amx)
            && shape.activation == Activation::Relu
            && !shape.dropout.is_on()
            && shape.layers.iter().all(|l| l.norm.is_none())
            && matches!(x, First::Input(_));
        #[cfg(test)]
        let plain = plain && !self.unkept;
        self.plan = plain.then(|| {
            let layers = &shape.layers;
            // A layer in fp32 (a head, `NARROW_OUTPUTS`) is not AMX's.
            let on_amx = |l: &super::LayerSlot| l.arith == shape.arith && amx::takes(rows, l.fan_out, l.fan_in);
            let tiles: Vec<bool> = layers.iter().map(on_amx).collect();
            let kept = (0..layers.len()).map(|i| i + 1 < layers.len() && layers[i].relu && tiles[i] && tiles[i + 1]);
            let kept = kept.collect();
            Plan { tiles, kept, grad: 0 }
        });
        let layers = shape.layers.len();
        self.input_grad_finite = false;
        self.outputs.resize_with(layers, Packed::default);
        self.outputs_t.resize_with(layers, Packed::default);
        self.passed.resize_with(layers, Vec::new);
    }

    /// Whether layer `layer`'s output is kept as tiles (no fp32 values).
    pub(super) fn kept(&self, layer: usize) -> bool {
        self.plan.as_ref().is_some_and(|p| p.kept[layer])
    }

    /// Whether the last backward pass checked the first layer's `d x` and
    /// found every value finite (false: not checked, or not finite).
    pub(super) fn input_grad_finite(&self) -> bool {
        self.input_grad_finite
    }

    /// Layer `layer`'s forward product where the plan has it on AMX
    /// (false: not this one's), into tiles where its output is kept, else
    /// into `out` through bias and ReLU.
    pub(super) fn forward(
        &mut self,
        layer: usize,
        (rows, fan_in, fan_out): (usize, usize, usize),
        input: &[f32],
        w: &[f32],
        (bias, relu): (&[f32], bool),
        out: &mut [f32],
    ) -> bool {
        let Some(plan) = &self.plan else { return false };
        if !plan.tiles[layer] {
            return false;
        }
        let (done, rest) = self.outputs.split_at_mut(layer);
        let a = match layer {
            0 => Left::Values(Operand::plain(input), Some(&mut self.input_t)),
            _ if plan.kept[layer - 1] => Left::Packed(&done[layer - 1]),
            _ => Left::Values(Operand::plain(input), None),
        };
        let out = match plan.kept[layer] {
            true => Out::Packed(Kept {
                rows: &mut rest[0],
                across: &mut self.outputs_t[layer],
                transposed: true,
                relu: Relu::Apply { bias, passed: &mut self.passed[layer] },
            }),
            false => Out::Values(out, Epilogue { bias: Some(bias), relu }),
        };
        amx::product((rows, fan_out, fan_in), a, Right::Values(Operand::plain(w)), out, None);
        true
    }

    /// Layer `layer`'s backward products where the plan has them on AMX
    /// (false: not this one's): `dW = xᵀ·g` and `db` beside `d x = g·Wᵀ`,
    /// `g` read from the tiles where the layer's output was kept (its
    /// `db` was summed as they were stored), else from `g`; `d x` stored as
    /// tiles, masked by the ReLU before it and summed into its bias
    /// gradient `db_before`, where that layer's output was kept, else
    /// into `dx`.
    pub(super) fn backward(
        &mut self,
        (layer, simd): (usize, sparrow_core::simd::Simd),
        (rows, fan_in, fan_out): (usize, usize, usize),
        (input, w, g): (&[f32], &[f32], &[f32]),
        (dw, db): (&mut [f32], &mut [f32]),
        db_before: &mut [f32],
        dx: &mut [f32],
    ) -> bool {
        let Some(plan) = &mut self.plan else { return false };
        if !plan.tiles[layer] {
            return false;
        }
        let g_kept = plan.kept[layer];
        let before_kept = layer > 0 && plan.kept[layer - 1];
        let [first, second] = &mut self.grads;
        let (now, next) = if plan.grad == 0 { (first, second) } else { (second, first) };
        let x_t = match layer {
            0 => Left::Packed(&self.input_t),
            _ if before_kept => Left::Packed(&self.outputs_t[layer - 1]),
            _ => Left::Values(Operand::t(input), None),
        };
        let (g_rows, g_across) = match g_kept {
            true => (Left::Packed(&now.0), Right::Packed(&now.1)),
            false => (Left::Values(Operand::plain(g), None), Right::Values(Operand::plain(g))),
        };
        // `d x` from this thread, `dW` from the one that steals it: the
        // larger product starts at once, the other once the other thread
        // wakes (30–40 µs here), and each takes the other's tasks once
        // done with its own; `d x` summing into `db_before` stays on one.
        // The first layer's `d x` (the step's input gradient) is checked
        // finite by each task as it stores its rows, while they are in its
        // core's cache (a pass after the step took 50 µs of a 1 ms step
        // on an AMX Xeon).
        let input_finite = AtomicBool::new(true);
        let out = match before_kept {
            true => Out::Packed(Kept {
                rows: &mut next.0,
                across: &mut next.1,
                transposed: false,
                relu: Relu::Mask { passed: &self.passed[layer - 1], sums: db_before },
            }),
            false if layer == 0 => Out::Checked(dx, &input_finite),
            false => Out::Values(dx, Epilogue::default()),
        };
        rayon::join(
            || {
                amx::product(
                    (rows, fan_in, fan_out),
                    g_rows,
                    Right::Values(Operand::t(w)),
                    out,
                    before_kept.then_some(1),
                );
            },
            || {
                amx::product((fan_in, fan_out, rows), x_t, g_across, Out::Values(dw, Epilogue::default()), None);
                if !g_kept {
                    crate::columns::add_column_sums(simd, g, fan_out, db);
                }
            },
        );
        if before_kept {
            plan.grad = 1 - plan.grad;
        }
        self.input_grad_finite = layer == 0 && !before_kept && input_finite.into_inner();
        true
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::Precision;
    use sparrow_core::rng::Rng;
    use sparrow_core::simd::Simd;

    use super::*;
    use crate::mlp::{Mlp, MlpScratch};
    use crate::params::ParamStore;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Kept tiles give the unkept path's model bit for bit: outputs,
    /// every parameter's gradient and d input, on stacks whose sizes are
    /// not multiples of a tile, some layers too narrow for AMX, over three
    /// steps (the buffers reused; the last with NaN and −∞ inputs).
    #[test]
    fn kept_tiles_train_the_unkept_model_bit_for_bit() {
        if !amx::available(Simd::Auto) {
            return; // Without AMX nothing is kept.
        }
        // Whether a `d x` checked on the tiles' path was found not finite, and finite.
        let mut checked = [false; 2];
        for (fan_in, layers, relu_last, rows) in [
            (45, &[40, 33, 1][..], false, 50),
            (429, &[256, 128, 1][..], false, 1024),
            (20, &[17, 70, 18, 24][..], true, 33),
            (31, &[8, 40, 20][..], false, 64),
        ] {
            let mut ps = ParamStore::new(3, Device::Cpu);
            let arith = Arith::new(Precision::Bf16, Simd::Auto);
            let mlp = Mlp::new(&mut ps, "m", fan_in, layers, relu_last, arith).expect("mlp");
            let mut rng = Rng::new(fan_in as u64);
            let (mut kept, mut unkept) = (MlpScratch::default(), MlpScratch::default());
            unkept.tiles.unkept = true;
            for step in 0..3 {
                // Some exact zeros and negatives, so the ReLUs mask; the
                // third step has NaN and infinite inputs too.
                let value = |i: usize, rng: &mut Rng| match i {
                    _ if i % 7 == 3 => 0.0,
                    _ if step == 2 && i % 97 == 5 => f32::NAN,
                    _ if step == 2 && i % 89 == 7 => f32::NEG_INFINITY,
                    _ => rng.normal() as f32,
                };
                let x: Vec<f32> = (0..rows * fan_in).map(|i| value(i, &mut rng)).collect();
                let out = *layers.last().expect("a layer");
                // The third step's output gradient has an infinity too:
                // `d x` is not all finite.
                let seed = |i: usize, rng: &mut Rng| match i {
                    1 if step == 2 => f32::INFINITY,
                    _ => rng.normal() as f32,
                };
                let grad_out: Vec<f32> = (0..rows * out).map(|i| seed(i, &mut rng)).collect();
                let run = |scratch: &mut MlpScratch| {
                    mlp.forward_cpu(&x, rows, None, scratch).expect("forward");
                    let output = scratch.output.clone();
                    (output, mlp.backward_cpu(&x, &grad_out, scratch).expect("backward"), scratch.grad_input.clone())
                };
                let (want, got) = (run(&mut unkept), run(&mut kept));
                let what = format!("{fan_in} → {layers:?}, {rows} rows, step {step}");
                let plan = kept.tiles.plan.as_ref().expect("a plan");
                assert_eq!(plan.kept.iter().any(|&k| k), layers[0] >= 16, "{what}: which outputs are kept");
                assert!(unkept.tiles.plan.is_none());
                assert_eq!(bits(&got.0), bits(&want.0), "{what}: outputs");
                assert_eq!(bits(&got.1), bits(&want.1), "{what}: parameter gradients");
                assert_eq!(bits(&got.2), bits(&want.2), "{what}: d input");
                // The first layer's `d x` was checked where it was written,
                // and the check saw what is there.
                let finite = got.2.iter().all(|v| v.is_finite());
                assert_eq!(kept.grad_input_finite(), plan.tiles[0] && finite, "{what}: d input checked");
                assert!(!unkept.grad_input_finite(), "{what}: nothing checked without tiles");
                checked[usize::from(finite)] |= plan.tiles[0];
                // (A NaN in most rows leaves the ReLUs nothing to pass.)
                let some = |v: &[f32]| v.iter().any(|&g| g != 0.0);
                assert!(step == 2 || (some(&got.1) && some(&got.2)), "{what}: no gradient");
            }
        }
        assert_eq!(checked, [true, true], "a d input checked both ways");
    }
}
