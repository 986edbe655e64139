//! The halves of a step (`models/halves.rs`) meeting where a value depends
//! on the whole batch: batch norm's column statistics, forward (each
//! column's mean and variance) and backward (Σ d y and Σ d y·x̂). Each half
//! runs as a future that, at such a value, posts its own rows' share and
//! waits ([`Side::exchange`]); the driver ([`both`]) polls the two halves
//! side by side, one a thread (`awake::join`), until both wait or end,
//! combines the posted shares (the first half's first) and hands the
//! whole batch's value back to each. On a pool of one thread the halves
//! run one after the other up to each meeting, so the model is the same on
//! any number of threads: the arithmetic is fixed by the batch's rows.
//!
//! A half whose passes run side by side (a level's experts) polls each in
//! turn up to its meeting ([`side_by_side`]): every share it posted is
//! numbered, the two halves' shares of one number combine, and the halves
//! meet once for all the passes.
//!
//! A future is how a half stops mid-pass and resumes with its stack (the
//! layers' loop, a kind's own passes around its MLP) kept, without a
//! thread of its own; no executor is involved, and a pass that meets no
//! one completes in one poll ([`unmet`]).

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use crate::ModelError;

/// How two halves' shares make the whole batch's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Combine {
    /// Each value summed: the first half's plus the second's.
    Sum,
    /// `[mean | M2]` of each of the columns (M2: the sum of squared
    /// deviations from the half's own mean), combined as Chan, Golub and
    /// LeVeque's pairwise update: δ = mean₂ − mean₁, mean = mean₁ +
    /// δ·n₂/n, M2 = M2₁ + M2₂ + δ²·n₁·n₂/n.
    Moments,
}

/// What a half posted since the last meeting, and what it gets back. A
/// half may post several shares before it waits (its passes run side by
/// side, [`side_by_side`]): each is numbered by the half's posts so far, and the
/// two halves' shares of one number are combined.
#[derive(Default)]
struct Post {
    posted: usize,
    sent: Vec<(usize, Combine, Share)>,
    back: Vec<(usize, Share)>,
}

/// A half's values and the rows (or history items) they are of; once
/// combined, the whole batch's.
type Share = (Vec<f32>, usize);

/// Where the two halves of a batch meet.
#[derive(Default)]
pub struct Meeting {
    posts: [Mutex<Post>; 2],
    /// How many times the halves met (for tests and benchmarks).
    meetings: AtomicUsize,
}

impl Meeting {
    pub(crate) fn new() -> Meeting {
        Meeting::default()
    }

    /// How many times the halves have met.
    #[cfg(test)]
    pub(crate) fn meetings(&self) -> usize {
        self.meetings.load(Ordering::Relaxed)
    }

    /// Either side's end of it: 0 the first half, 1 the second.
    pub(crate) fn side(&self, index: usize) -> Side<'_> {
        Side { meeting: self, index }
    }

    /// The shares posted, each combined with the other half's of its
    /// number, handed back to both; an error where the halves did not post
    /// alike (a bug: they run one code), or posted nothing (both waiting,
    /// neither for a meeting).
    fn combine(&self) -> Result<(), ModelError> {
        let uneven = || ModelError::Halves { what: "one half met where the other did not" };
        let [a, b] = &self.posts;
        let (mut a, mut b) = (a.lock().map_err(|_| ModelError::Poisoned)?, b.lock().map_err(|_| ModelError::Poisoned)?);
        let (mine, theirs) = (std::mem::take(&mut a.sent), std::mem::take(&mut b.sent));
        if mine.is_empty() || mine.len() != theirs.len() {
            return Err(uneven());
        }
        self.meetings.fetch_add(1, Ordering::Relaxed);
        for ((number, how, (mine, n1)), (their_number, their_how, (theirs, n2))) in mine.into_iter().zip(theirs) {
            if number != their_number || how != their_how || mine.len() != theirs.len() {
                return Err(uneven());
            }
            let whole = match how {
                Combine::Sum => mine.iter().zip(&theirs).map(|(a, b)| a + b).collect(),
                Combine::Moments => moments(&mine, &theirs, [n1, n2]),
            };
            b.back.push((number, (whole.clone(), n1 + n2)));
            a.back.push((number, (whole, n1 + n2)));
        }
        Ok(())
    }
}

/// [`Combine::Moments`] of two halves' `[mean | M2]` of `rows[0]` and
/// `rows[1]` rows (either may be none: its mean and M2 are zeros).
fn moments(first: &[f32], second: &[f32], rows: [usize; 2]) -> Vec<f32> {
    let width = first.len() / 2;
    let (n1, n2) = (rows[0] as f32, rows[1] as f32);
    let n = (n1 + n2).max(1.0);
    let (mean1, m2_1) = first.split_at(width);
    let (mean2, m2_2) = second.split_at(width);
    let mut whole = vec![0.0f32; 2 * width];
    let (mean, m2) = whole.split_at_mut(width);
    for c in 0..width {
        let delta = mean2[c] - mean1[c];
        mean[c] = mean1[c] + delta * (n2 / n);
        m2[c] = m2_1[c] + m2_2[c] + delta * delta * (n1 * n2 / n);
    }
    whole
}

/// A half's end of a [`Meeting`].
#[derive(Clone, Copy)]
pub struct Side<'a> {
    meeting: &'a Meeting,
    index: usize,
}

impl Side<'_> {
    /// Posts `values`, this half's share of its `rows` (or history items),
    /// and waits for the other half's: `values` becomes the whole batch's,
    /// combined as `how` says. Returns the whole batch's rows.
    pub(crate) async fn exchange(self, how: Combine, values: &mut [f32], rows: usize) -> Result<usize, ModelError> {
        let post = &self.meeting.posts[self.index];
        let number = {
            let mut post = post.lock().map_err(|_| ModelError::Poisoned)?;
            let number = post.posted;
            post.posted += 1;
            post.sent.push((number, how, (values.to_vec(), rows)));
            number
        };
        let (whole, rows) = std::future::poll_fn(|_| match post.lock() {
            Ok(mut post) => match post.back.iter().position(|(n, _)| *n == number) {
                Some(i) => Poll::Ready(Ok(post.back.swap_remove(i).1)),
                None => Poll::Pending,
            },
            Err(_) => Poll::Ready(Err(ModelError::Poisoned)),
        })
        .await?;
        values.copy_from_slice(&whole);
        Ok(rows)
    }
}

/// A half's passes side by side (a level's experts, say): each polled in
/// turn, in their order, until it waits or ends, so the half posts their
/// shares in one order and meets the other half once for all of them.
/// Their values in order, or the first error.
pub(crate) async fn side_by_side<T, F: Future<Output = Result<T, ModelError>>>(
    passes: Vec<F>,
) -> Result<Vec<T>, ModelError> {
    let mut passes: Vec<Pin<Box<F>>> = passes.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<T>> = passes.iter().map(|_| None).collect();
    std::future::poll_fn(|_| {
        for (pass, done) in passes.iter_mut().zip(done.iter_mut()).filter(|(_, d)| d.is_none()) {
            match poll(pass.as_mut()) {
                Poll::Ready(Ok(value)) => *done = Some(value),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        match done.iter().all(Option::is_some) {
            true => Poll::Ready(Ok(done.iter_mut().filter_map(Option::take).collect())),
            false => Poll::Pending,
        }
    })
    .await
}

/// A pass that meets no one, run to its end: it completes in one poll.
pub(crate) fn unmet<T>(pass: impl Future<Output = T>) -> T {
    let mut pass = pin!(pass);
    match poll(pass.as_mut()) {
        Poll::Ready(value) => value,
        // Only a half's pass, given a `Side`, ever waits; those run in `both`.
        Poll::Pending => unreachable!("a pass without a side waited to meet"),
    }
}

/// The two halves of a step, side by side on the pool (one after the other
/// on a pool of one), meeting at `meeting` as often as they post to it.
pub(crate) fn both<A: Send, B: Send>(
    meeting: &Meeting,
    first: impl Future<Output = Result<A, ModelError>> + Send,
    second: impl Future<Output = Result<B, ModelError>> + Send,
) -> Result<(A, B), ModelError> {
    let (mut first, mut second) = (pin!(first), pin!(second));
    let (mut a, mut b) = (None, None);
    loop {
        let (a_done, b_done) = (a.is_some(), b.is_some());
        let (pa, pb) =
            crate::awake::join(|| poll_unless(a_done, first.as_mut()), || poll_unless(b_done, second.as_mut()));
        if let Some(Poll::Ready(r)) = pa {
            a = Some(r);
        }
        if let Some(Poll::Ready(r)) = pb {
            b = Some(r);
        }
        match (a.take(), b.take()) {
            (Some(a), Some(b)) => return Ok((a?, b?)),
            (None, None) => meeting.combine()?,
            // One half ended while the other waits to meet: its error,
            // or (a bug) the meeting missed.
            (Some(Err(e)), None) | (None, Some(Err(e))) => return Err(e),
            _ => return Err(ModelError::Halves { what: "one half ended while the other waited to meet" }),
        }
    }
}

/// A poll of `half` unless it is `done`.
fn poll_unless<F: Future>(done: bool, half: Pin<&mut F>) -> Option<Poll<F::Output>> {
    (!done).then(|| poll(half))
}

/// One poll of a pass, which nothing wakes: its driver polls it again.
fn poll<F: Future>(pass: Pin<&mut F>) -> Poll<F::Output> {
    Future::poll(pass, &mut Context::from_waker(Waker::noop()))
}

#[cfg(test)]
mod tests {
    use super::{Combine, Meeting, Side, both, moments};
    use crate::ModelError;

    /// Two halves' `[mean | M2]` combine into the whole batch's, as an f64
    /// pass over all its rows has them: halves even and not, one of a row,
    /// one of none (DIN's history items may all be in one half).
    #[test]
    fn the_halves_moments_are_the_whole_batchs() {
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 + 10.0
        };
        for (n1, n2) in [(50, 50), (51, 50), (1, 90), (200, 3), (0, 7), (9, 0)] {
            let width = 3;
            let values: Vec<Vec<f32>> = (0..n1 + n2).map(|_| (0..width).map(|_| next()).collect()).collect();
            let of = |rows: &[Vec<f32>]| {
                if rows.is_empty() {
                    // A half of no rows posts zeros (`batch_norm::moments`).
                    return vec![0.0; 2 * width];
                }
                let n = rows.len() as f32;
                let mean: Vec<f32> = (0..width).map(|c| rows.iter().map(|r| r[c]).sum::<f32>() / n).collect();
                let m2 = (0..width).map(|c| rows.iter().map(|r| (r[c] - mean[c]).powi(2)).sum::<f32>());
                mean.iter().copied().chain(m2).collect::<Vec<f32>>()
            };
            let whole = moments(&of(&values[..n1]), &of(&values[n1..]), [n1, n2]);
            for c in 0..width {
                let n = (n1 + n2) as f64;
                let mean = values.iter().map(|r| f64::from(r[c])).sum::<f64>() / n;
                let m2: f64 = values.iter().map(|r| (f64::from(r[c]) - mean).powi(2)).sum();
                assert!(
                    (f64::from(whole[c]) - mean).abs() < 1e-5 * mean.abs(),
                    "{n1}+{n2}: mean {} vs {mean}",
                    whole[c]
                );
                let got = f64::from(whole[width + c]);
                assert!((got - m2).abs() < 1e-4 * m2, "{n1}+{n2}: M2 {got} vs {m2}");
            }
        }
    }

    /// A half that posts `[mine, 10·mine]`, then twice the first sum.
    /// `rows`: the half's; returns the whole batch's with the values.
    async fn twice(side: Side<'_>, mine: f32, rows: usize) -> Result<([f32; 2], [f32; 2], usize), ModelError> {
        let mut v = [mine, 10.0 * mine];
        side.exchange(Combine::Sum, &mut v, rows).await?;
        let first = v;
        v = [v[0] * 2.0, 0.0];
        let whole = side.exchange(Combine::Sum, &mut v, rows).await?;
        Ok((first, v, whole))
    }

    /// A half that posts `len` ones once.
    async fn posts(side: Side<'_>, len: usize) -> Result<(), ModelError> {
        side.exchange(Combine::Sum, &mut vec![1.0; len], 1).await.map(drop)
    }

    /// Halves that meet twice get the combined values back each time, on
    /// a pool of one (one after the other) as on two.
    #[test]
    fn the_halves_meet_as_often_as_they_post_on_any_pool() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let meeting = Meeting::new();
            let (a, b) = pool
                .install(|| both(&meeting, twice(meeting.side(0), 1.0, 2), twice(meeting.side(1), 2.0, 3)))
                .expect("the halves");
            assert_eq!(a, ([3.0, 30.0], [12.0, 0.0], 5), "{threads} threads");
            assert_eq!(a, b, "{threads} threads: both halves get the whole batch's");
        }
    }

    /// A pass that posts twice and, with `third`, once more.
    async fn pass(side: Side<'_>, mine: f32, third: bool) -> Result<([f32; 2], [f32; 2], f32), ModelError> {
        let (a, b, _) = twice(side, mine, 1).await?;
        let mut v = [mine];
        if !third {
            return Ok((a, b, 0.0));
        }
        side.exchange(Combine::Sum, &mut v, 1).await?;
        Ok((a, b, v[0]))
    }

    /// A half's two passes side by side.
    async fn two_passes(side: Side<'_>, mine: f32) -> Result<Vec<([f32; 2], [f32; 2], f32)>, ModelError> {
        super::side_by_side(vec![pass(side, mine, true), pass(side, 100.0 * mine, false)]).await
    }

    /// A half's two passes side by side ([`side_by_side`]), each posting twice and
    /// the first once more: a meeting combines every share of a number,
    /// so the halves meet three times, not five, and each pass gets its
    /// own share's whole, on a pool of one as on two.
    #[test]
    fn a_halfs_passes_side_by_side_meet_the_others_at_once() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let meeting = Meeting::new();
            let (a, b) = pool
                .install(|| both(&meeting, two_passes(meeting.side(0), 1.0), two_passes(meeting.side(1), 2.0)))
                .expect("the halves");
            assert_eq!(a[0], ([3.0, 30.0], [12.0, 0.0], 3.0), "{threads} threads: the first pass");
            assert_eq!(a[1], ([300.0, 3000.0], [1200.0, 0.0], 0.0), "{threads} threads: the second pass");
            assert_eq!(a, b, "{threads} threads: both halves get the whole batch's");
            assert_eq!(meeting.meetings(), 3, "{threads} threads: meetings");
        }
    }

    /// A half that meets where the other does not, or an error in one half
    /// while the other waits, ends the step with an error, not a hang.
    #[test]
    fn halves_that_meet_unevenly_end_with_an_error() {
        let meeting = Meeting::new();
        let err = both(&meeting, posts(meeting.side(0), 1), async { Ok(()) }).expect_err("uneven");
        assert!(err.to_string().contains("waited to meet"), "{err}");
        let meeting = Meeting::new();
        let fails = async { Err::<(), _>(ModelError::NonFinite { what: "a half's loss".into() }) };
        let err = both(&meeting, fails, posts(meeting.side(1), 1)).expect_err("its error");
        assert!(err.to_string().contains("a half's loss"), "{err}");
        let meeting = Meeting::new();
        let err = both(&meeting, posts(meeting.side(0), 2), posts(meeting.side(1), 3)).expect_err("lengths");
        assert!(err.to_string().contains("did not"), "{err}");
    }
}
