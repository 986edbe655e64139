//! A step policy: the batch's two halves, one a thread. The multi-task
//! kinds' passes (experts of 64 units, towers of 32, gates of a few
//! columns) take 10–100 µs each on a batch of 1024; split one by one
//! across two threads, each split costs a wake-up of the other thread (an
//! interprocessor interrupt on a VM) and the short ones run on one thread
//! alone. DIN's serial passes between its products (the unit's last layer,
//! the weighted sums, the head) read what the other thread wrote. Here
//! each half of the batch runs forward, its rows' loss and backward on a
//! thread of its own: one meeting a step, where the thread done first
//! waits for the other awake (`awake::join`), and one more at each batch
//! norm layer each way, where the kind's stacks normalize by the batch
//! (`meet.rs`: DIN's MLP; the multi-task kinds' experts, a level's at one
//! meeting, and towers).
//!
//! Only kinds whose rows are independent take it (`Direct::half_rows`;
//! dropout's masks are drawn by a value's place in the whole batch, the
//! second half's from `At::first_row`; a history item goes with its row's
//! half), only where any batch statistics meet (`Direct::meets_statistics`:
//! batch norm's and Dice's do), and only where each half has the rows, and so the work,
//! the kind asks for. The halves are cut by the batch's rows alone, their
//! batch statistics combined and their weight gradients summed first half
//! first, so the model is the same on any number of threads; a pool of one
//! runs the halves one after the other, up to each meeting. A prediction
//! of such a batch runs in halves too: a half's products are blocked by its
//! own rows, and so it gives the step's logits bit for bit (where the step
//! normalized by nothing of the batch). Each half's input gradient stays
//! in its own buffer, checked there, and the step hands the two on as the
//! parts of one [`InputGrad`].

use sparrow_core::simd::Simd;

use super::DenseModel;
use crate::ModelError;
use crate::input_grad::InputGrad;
use crate::kinds::{At, Direct, Grads};
use crate::meet::{self, Meeting, Side};
use crate::optimizer::DenseGrads;
use crate::own_threads::{on_own_threads, param_sizes};
use crate::step::{Scratch, Sequences};

/// The rows of the first half of a batch of `rows` (the second has the rest).
fn first_half(rows: usize) -> usize {
    rows.div_ceil(2)
}

impl DenseModel {
    /// Whether a training step or a prediction on `rows` rows runs as two
    /// halves, one a thread (see the module's comment for which kinds and
    /// settings).
    pub fn runs_in_halves(&self, rows: usize) -> bool {
        self.half_rows().is_some_and(|half| rows >= 2 * half)
    }

    /// The fewest rows a half takes where the model's step may run in
    /// halves (from a batch of twice that); `None` where it may not.
    pub fn half_rows(&self) -> Option<usize> {
        let half = self.net.direct().and_then(|d| d.half_rows());
        let meets = self.net.direct().is_some_and(|d| d.meets_statistics());
        half.filter(|_| meets || !self.params.has_statistics())
    }

    /// [`forward_direct`](Self::forward_direct) on each half, side by side:
    /// the logits of the batch, the first half's rows first.
    pub(super) fn forward_halves(
        &self,
        x: &[f32],
        rows: usize,
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let first = first_half(rows);
        let (x0, x1) = x.split_at((first * self.row_len()).min(x.len()));
        let mut second = s.second_half.take().unwrap_or_default();
        split_sequences(&mut s.sequences, (first, self.width()), &mut second.sequences);
        let (a, b) = rayon::join(
            || self.forward_direct(x0, first, draw, s),
            || self.forward_direct_at(x1, (rows - first, first), draw, &mut second),
        );
        s.second_half = Some(second);
        let mut logits = a?;
        logits.extend_from_slice(&b?);
        Ok(logits)
    }

    /// A training step in halves: each half's forward pass, its rows'
    /// losses and seed, and its backward pass on a thread of its own, so
    /// the threads meet once a step (the loss over the whole batch between
    /// the passes made it three times). Returns the batch's loss (the rows'
    /// losses summed in row order), its logits, and the halves' gradients
    /// summed (the first's plus the second's); d loss / d input of the
    /// first half's rows is in `s.grad_x`, of the second's in its own
    /// scratch's (`s.second_half`), each checked for values that are not
    /// finite (`grad_x_finite`). Every value is the one the batch would
    /// get with its loss taken whole between passes in halves: a row's seed
    /// is its own loss's, over the whole batch's rows.
    pub(super) fn step_halves(
        &self,
        x: &[f32],
        (labels, weights): (&[f32], Option<&[f32]>),
        draw: Option<u64>,
        s: &mut Scratch,
    ) -> Result<(f64, Vec<f32>, DenseGrads), ModelError> {
        let tasks = self.heads.tasks().max(1);
        let rows = labels.len() / tasks;
        let stride = self.row_len();
        if x.len() != rows * stride {
            return Err(ModelError::BadInput { what: "input rows", len: x.len(), rows, per_row: stride });
        }
        if !self.heads.is_one_binary() {
            self.heads.check_labels(labels)?;
        }
        let inv_b = 1.0 / rows.max(1) as f64;
        let first = first_half(rows);
        let (x0, x1) = x.split_at(first * stride);
        let (labels0, labels1) = labels.split_at(first * tasks);
        let (weights0, weights1) = match weights {
            Some(w) => {
                let (a, b) = w.split_at(first.min(w.len()));
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let direct = self.direct().ok_or(ModelError::NotPacked { kind: self.kind.name() })?;
        let half = |(x, rows, at), (labels, weights), s, side| {
            self.half_step(direct, (x, rows, at), (labels, weights), (inv_b, s, side))
        };
        let mut second = s.second_half.take().unwrap_or_default();
        let split = split_sequences(&mut s.sequences, (first, self.width()), &mut second.sequences);
        let meeting = Meeting::new();
        let (at0, at1) = (self.at.drawn(draw), self.at.drawn(draw).from_row(first));
        let result = meet::both(
            &meeting,
            half((x0, first, &at0), (labels0, weights0), s, meeting.side(0)),
            half((x1, rows - first, &at1), (labels1, weights1), &mut second, meeting.side(1)),
        );
        let result = result.and_then(|((mut losses, mut logits, grads), (their_losses, their_logits, theirs))| {
            losses.extend_from_slice(&their_losses);
            let loss = crate::heads::sum_in_order(&losses) * inv_b;
            self.check_loss(loss)?;
            let mut grads = self.in_param_order(grads, first);
            let theirs = self.in_param_order(theirs, rows - first);
            logits.extend_from_slice(&their_logits);
            add_into(self.simd, &param_sizes(&self.params), &mut grads, &theirs);
            // Each half's input gradient stays in its buffer: the step
            // hands them on as two parts (`InputGrad`), not joined.
            s.grad_x.truncate(first * stride);
            second.grad_x.truncate((rows - first) * stride);
            if s.grad_x.len() + second.grad_x.len() != rows * stride {
                return Err(ModelError::Halves { what: "the halves' input gradients do not cover the batch's rows" });
            }
            join_item_grads(&mut s.item_grads, &second.item_grads, split, self.width());
            // The second half's buffers, spent, are its next step's.
            self.recycle_direct(theirs.grads.into_iter().flatten().collect(), &mut second);
            Ok((loss, logits, grads))
        });
        s.second_half = Some(second);
        result
    }

    /// A half's step: its forward pass, its rows' losses and seed (a row's
    /// seed is its own loss's, over the whole batch's `1 / inv_b` rows) and
    /// its backward pass, meeting the other half at `side` where the kind
    /// meets at its batch statistics. A half's backward pass runs whatever
    /// its loss: the batch's loss is checked first, so a NaN loss is the
    /// error a step reports.
    async fn half_step<'a: 'b, 'b>(
        &'a self,
        direct: &'a dyn Direct,
        (x, rows, at): (&'b [f32], usize, &'b At),
        (labels, weights): (&'b [f32], Option<&'b [f32]>),
        (inv_b, s, side): (f64, &'b mut Scratch, Side<'b>),
    ) -> Result<(Vec<f64>, Vec<f32>, Grads<'a>), ModelError> {
        let logits = direct.forward_met(at, (x, rows), s, Some(side)).await?;
        let (losses, seed) = self.rows_loss_and_seed_of(&logits, labels, weights, inv_b);
        let grads = direct.backward_met(at, (x, &seed), s, Some(side)).await?;
        // Each half checks its own input gradient, on its own thread.
        s.grad_x_finite = crate::optimizer::all_finite(self.simd, &s.grad_x);
        Ok((losses, logits, grads))
    }
}

/// d loss / d the input rows the last step left in `s`: a step in halves
/// (`halves`) hands on each half's where it is, the second's in
/// `s.second_half`. A part a backward pass checked as it wrote it
/// (`grad_x_finite`: each half checks its own) spares the pass over it
/// here; one not checked that holds a NaN or an infinity is an error
/// naming its element in the whole.
pub(super) fn checked_input_grad(s: &Scratch, halves: bool, simd: Simd) -> Result<InputGrad<'_>, ModelError> {
    let second = s.second_half.as_deref().filter(|_| halves);
    let input_grad = match second {
        Some(second) => InputGrad::in_parts(&s.grad_x, &second.grad_x),
        None => InputGrad::whole(&s.grad_x),
    };
    if !(s.grad_x_finite && second.is_none_or(|s| s.grad_x_finite)) {
        input_grad.check_finite(simd, "gradient of the embedding inputs")?;
    }
    Ok(input_grad)
}

/// How the sequences' positions split between the halves: at a position
/// (positions in row order), or each position's half.
enum Split {
    InOrder,
    ByPosition(Vec<Vec<bool>>),
}

/// Moves the positions of the second half's rows (from `first` on) into
/// `second`, their rows counted from the second half's first; the first
/// half's stay.
fn split_sequences(seq: &mut Sequences, (first, width): (usize, usize), second: &mut Sequences) -> Split {
    second.rows.resize_with(seq.rows.len(), Vec::new);
    second.items.resize_with(seq.items.len(), Vec::new);
    let in_second = |r: &u32| *r as usize >= first;
    let sorted = seq.rows.iter().all(|rows| rows.is_sorted());
    let mut sides = Vec::new();
    for ((rows, items), (their_rows, their_items)) in
        seq.rows.iter_mut().zip(&mut seq.items).zip(second.rows.iter_mut().zip(&mut second.items))
    {
        their_rows.clear();
        their_items.clear();
        if sorted {
            let cut = rows.partition_point(|r| !in_second(r));
            their_rows.extend(rows[cut..].iter().map(|&r| r - first as u32));
            their_items.extend_from_slice(&items[cut * width..]);
            rows.truncate(cut);
            items.truncate(cut * width);
            continue;
        }
        let side: Vec<bool> = rows.iter().map(in_second).collect();
        let (mut kept, mut kept_items) = (Vec::new(), Vec::new());
        for (p, (&r, &theirs)) in rows.iter().zip(&side).enumerate() {
            let item = &items[p * width..(p + 1) * width];
            match theirs {
                true => {
                    their_rows.push(r - first as u32);
                    their_items.extend_from_slice(item);
                }
                false => {
                    kept.push(r);
                    kept_items.extend_from_slice(item);
                }
            }
        }
        (*rows, *items) = (kept, kept_items);
        sides.push(side);
    }
    if sorted { Split::InOrder } else { Split::ByPosition(sides) }
}

/// The halves' history items' gradients as the whole batch's positions had them.
fn join_item_grads(mine: &mut [Vec<f32>], theirs: &[Vec<f32>], split: Split, width: usize) {
    match split {
        Split::InOrder => mine.iter_mut().zip(theirs).for_each(|(m, t)| m.extend_from_slice(t)),
        Split::ByPosition(sides) => {
            for ((m, t), side) in mine.iter_mut().zip(theirs).zip(sides) {
                let (mut a, mut b) = (m.chunks_exact(width), t.chunks_exact(width));
                let whole: Vec<f32> = side
                    .iter()
                    .flat_map(|&theirs| if theirs { b.next() } else { a.next() })
                    .flatten()
                    .copied()
                    .collect();
                *m = whole;
            }
        }
    }
}

/// `grads += theirs`, parameter by parameter (a parameter only one half
/// has a gradient for takes that one), each on its own thread of the
/// caller's pool (`own_threads.rs`), the one its Adam step runs on: one
/// thread summed PLE's 56k weights while the other waited. Each sum is
/// checked for values that are not finite as it is written, in cache: the
/// optimizer's own pass over every gradient (a second handing-out to the
/// threads and a read of 224 KB for PLE, 1.2% of its step in
/// `dense_step`) is left for the sums that hold one, to name it.
fn add_into(simd: Simd, sizes: &[usize], grads: &mut DenseGrads, theirs: &DenseGrads) {
    let jobs = grads.grads.iter_mut().zip(&theirs.grads).enumerate().collect();
    let finite = on_own_threads(sizes, jobs, |(mine, theirs)| {
        match (&mut *mine, theirs) {
            (Some(mine), Some(theirs)) => mine.iter_mut().zip(theirs).for_each(|(m, t)| *m += t),
            (mine @ None, Some(theirs)) => *mine = Some(theirs.clone()),
            (_, None) => {}
        }
        mine.as_deref().is_none_or(|sum| crate::optimizer::all_finite(simd, sum))
    });
    grads.rows += theirs.rows;
    grads.found_finite = finite.into_iter().all(|f| f);
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use sparrow_core::config::{ModelConfig, ModelKind, Task, TaskKind};
    use sparrow_core::rng::Rng;

    use super::*;
    use crate::{Heads, ModelShape};

    /// Each half flags its own input gradient as it finds it: a NaN
    /// sample weight on a row of the second half (its loss and its seed
    /// NaN, the step refused) leaves the first half's flagged finite and
    /// the second's not.
    #[test]
    fn each_half_checks_its_own_input_gradient() {
        let config = ModelConfig {
            kind: ModelKind::named("esmm"),
            embedding_dim: 4,
            tower_hidden: vec![8],
            ..Default::default()
        };
        let task = |name: &str| Task { name: name.into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 };
        let heads = Heads::of(&[task("click"), task("conversion")]);
        let shape = ModelShape { num_fields: 3, num_dense: 1, embedding_dim: 4 };
        let model = DenseModel::with_attention(&config, shape, heads, &[], 5, Device::Cpu, Simd::Auto).expect("model");
        let rows = 2 * model.half_rows().expect("esmm runs in halves");
        let row = model.row_len();
        let mut rng = Rng::new(9);
        let labels: Vec<f32> = (0..2 * rows).map(|i| (i % 3 == 0) as u8 as f32).collect();
        let x: Vec<f32> = (0..rows * row).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        for poisoned in [None, Some(rows - 2)] {
            let mut weights = vec![1.0f32; rows];
            if let Some(r) = poisoned {
                weights[r] = f32::NAN;
            }
            let mut s = Scratch::default();
            let step = model.step_halves(&x, (&labels, Some(&weights)), None, &mut s);
            let second = s.second_half.as_deref().expect("the second half's buffers");
            assert_eq!(step.is_ok(), poisoned.is_none(), "{poisoned:?}");
            assert!(s.grad_x_finite, "{poisoned:?}: the first half's input gradient is finite");
            assert_eq!(second.grad_x_finite, poisoned.is_none(), "{poisoned:?}: the second half's");
            if poisoned.is_none() {
                let whole = checked_input_grad(&s, true, Simd::Auto).expect("finite");
                assert_eq!(whole.len(), rows * row);
                assert_eq!(whole.parts()[1].as_ptr(), second.grad_x.as_ptr(), "the second half's, not copied");
            }
        }
    }

    /// The input gradient a step left: in two parts after a step in halves
    /// (only then: a second half's buffers left from an earlier step are
    /// not read); a part not flagged finite is read, and a NaN there is an
    /// error naming its element in the whole batch.
    #[test]
    fn the_input_gradient_is_checked_where_no_half_checked_it() {
        let mut s = Scratch { grad_x: vec![1.0; 6], grad_x_finite: true, ..Default::default() };
        let second = Scratch { grad_x: vec![2.0, f32::NAN, 2.0], grad_x_finite: false, ..Default::default() };
        s.second_half = Some(Box::new(second));
        let err = checked_input_grad(&s, true, Simd::Auto).expect_err("a NaN in the second part").to_string();
        assert!(err.contains("gradient of the embedding inputs (element 7 is NaN)"), "{err}");
        let whole = checked_input_grad(&s, false, Simd::Auto).expect("a whole step's own buffer");
        assert_eq!(whole.to_vec(), vec![1.0; 6]);
        s.grad_x[2] = f32::INFINITY;
        s.grad_x_finite = false;
        let err = checked_input_grad(&s, false, Simd::Auto).expect_err("an infinity").to_string();
        assert!(err.contains("element 2 is inf"), "{err}");
    }

    /// The halves' sum flags its gradients finite only where every sum is:
    /// a NaN or an infinity in either half's gradient of any parameter (one
    /// that only one half has included) leaves them unflagged, and the
    /// optimizer's check then reads them and names the parameter; sums that
    /// are all finite it does not read again. On a pool of two and off one.
    #[test]
    fn the_halves_sum_flags_its_gradients_finite_only_where_every_sum_is() {
        // Over `SMALL_WEIGHTS` in all: the sums run on both threads.
        let sizes = [9_000usize, 3, 9_000, 5];
        let mut params = crate::params::ParamStore::new(1, Device::Cpu);
        for (p, &n) in sizes.iter().enumerate() {
            params.push(format!("p{p}"), vec![0.5; n], &[n]).expect("a parameter");
        }
        // Parameter 1 has a gradient from the first half only, 3 from the second only.
        let half = |value: f32, missing: usize| {
            let grads = sizes.iter().enumerate().map(|(p, &n)| (p != missing).then(|| vec![value; n]));
            DenseGrads::new(grads.collect(), 4)
        };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        // (half, parameter, value): both halves' sums, and one half's alone.
        let bad_values =
            [None, Some((0, 0, f32::NAN)), Some((0, 1, f32::INFINITY)), Some((1, 2, f32::NAN)), Some((1, 3, f32::NAN))];
        for (bad, on_pool) in bad_values.into_iter().flat_map(|b| [(b, true), (b, false)]) {
            let (mut mine, mut theirs) = (half(0.25, 3), half(0.5, 1));
            if let Some((side, p, value)) = bad {
                let g = if side == 0 { &mut mine } else { &mut theirs };
                g.grads[p].as_mut().expect("a gradient")[1] = value;
            }
            let sum = |mine: &mut DenseGrads| {
                add_into(Simd::Auto, &sizes, mine, &theirs);
                mine.check_finite(Simd::Auto, &params)
            };
            let checked = if on_pool { pool.install(|| sum(&mut mine)) } else { sum(&mut mine) };
            assert_eq!(mine.found_finite, bad.is_none(), "{bad:?}, on a pool: {on_pool}");
            assert_eq!(mine.rows, 8);
            match bad {
                None => {
                    checked.expect("every sum finite");
                    assert_eq!(mine.grads[0].as_deref(), Some(&[0.75f32; 9_000][..]));
                    assert_eq!(mine.grads[1].as_deref(), Some(&[0.25f32; 3][..]), "the first half's alone");
                    assert_eq!(mine.grads[3].as_deref(), Some(&[0.5f32; 5][..]), "the second half's alone");
                }
                Some((_, p, _)) => {
                    let err = checked.expect_err("a value that is not finite").to_string();
                    assert!(err.contains(&format!("gradient of dense parameter `p{p}` (element 1 is")), "{err}");
                }
            }
        }
    }

    /// A step in halves hands its gradients on flagged finite, unless the
    /// model keeps running statistics (batch norm): their batch values take
    /// their parameters' slots after the sum was checked, so the optimizer
    /// reads them.
    #[test]
    fn batch_statistics_leave_the_gradients_to_be_checked() {
        for norm in [sparrow_core::config::NormSetting::None, sparrow_core::config::NormSetting::Batch] {
            let config = ModelConfig {
                kind: ModelKind::named("mmoe"),
                embedding_dim: 4,
                experts: 2,
                expert_hidden: vec![8],
                tower_hidden: vec![4],
                norm,
                ..Default::default()
            };
            let task = |name: &str| Task { name: name.into(), kind: TaskKind::Binary, outputs: 1, weight: 1.0 };
            let heads = Heads::of(&[task("click"), task("conversion")]);
            let shape = ModelShape { num_fields: 3, num_dense: 1, embedding_dim: 4 };
            let model =
                DenseModel::with_attention(&config, shape, heads, &[], 5, Device::Cpu, Simd::Auto).expect("model");
            let rows = 2 * model.half_rows().expect("mmoe runs in halves");
            assert!(model.runs_in_halves(rows));
            let mut rng = Rng::new(4);
            let labels: Vec<f32> = (0..2 * rows).map(|i| (i % 3 == 0) as u8 as f32).collect();
            let x: Vec<f32> = (0..rows * model.row_len()).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
            let (_, _, (), grads) = model.forward_backward_packed(&x, &labels, |_| ()).expect("a step");
            let statistics = model.params.has_statistics();
            assert_eq!(statistics, norm == sparrow_core::config::NormSetting::Batch);
            assert_eq!(grads.found_finite, !statistics, "{norm:?}");
        }
    }
}
