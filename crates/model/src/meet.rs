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
//! A future is how a half stops mid-pass and resumes with its stack (the
//! layers' loop, a kind's own passes around its MLP) kept, without a
//! thread of its own; no executor is involved, and a pass that meets no
//! one completes in one poll ([`unmet`]).

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Mutex;
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

/// What a half posted, and what it gets back.
#[derive(Default)]
struct Post {
    sent: Option<(Combine, Vec<f32>)>,
    back: Option<Vec<f32>>,
}

/// Where the two halves of a batch of `rows[0] + rows[1]` rows meet.
pub struct Meeting {
    rows: [usize; 2],
    posts: [Mutex<Post>; 2],
}

impl Meeting {
    pub(crate) fn new(first: usize, second: usize) -> Meeting {
        Meeting { rows: [first, second], posts: Default::default() }
    }

    /// Either side's end of it: 0 the first half, 1 the second.
    pub(crate) fn side(&self, index: usize) -> Side<'_> {
        Side { meeting: self, index }
    }

    /// The two shares posted, combined, handed back to both; an error
    /// where the halves did not post alike (a bug: they run one code).
    fn combine(&self) -> Result<(), ModelError> {
        let uneven = || ModelError::Halves { what: "one half met where the other did not" };
        let [a, b] = &self.posts;
        let (mut a, mut b) = (a.lock().map_err(|_| ModelError::Poisoned)?, b.lock().map_err(|_| ModelError::Poisoned)?);
        let ((how, mine), (theirs_how, theirs)) =
            (a.sent.take().ok_or_else(uneven)?, b.sent.take().ok_or_else(uneven)?);
        if how != theirs_how || mine.len() != theirs.len() {
            return Err(uneven());
        }
        let whole = match how {
            Combine::Sum => mine.iter().zip(&theirs).map(|(a, b)| a + b).collect(),
            Combine::Moments => moments(&mine, &theirs, self.rows),
        };
        b.back = Some(whole.clone());
        a.back = Some(whole);
        Ok(())
    }
}

/// [`Combine::Moments`] of two halves' `[mean | M2]` of `rows[0]` and `rows[1]` rows.
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
    /// Rows of the whole batch (both halves).
    pub(crate) fn rows(&self) -> usize {
        self.meeting.rows.iter().sum()
    }

    /// Posts `values`, this half's share, and waits for the other half's:
    /// `values` becomes the whole batch's, combined as `how` says.
    pub(crate) async fn exchange(self, how: Combine, values: &mut [f32]) -> Result<(), ModelError> {
        let post = &self.meeting.posts[self.index];
        post.lock().map_err(|_| ModelError::Poisoned)?.sent = Some((how, values.to_vec()));
        let whole = std::future::poll_fn(|_| match post.lock() {
            Ok(mut post) => post.back.take().map_or(Poll::Pending, |whole| Poll::Ready(Ok(whole))),
            Err(_) => Poll::Ready(Err(ModelError::Poisoned)),
        })
        .await?;
        values.copy_from_slice(&whole);
        Ok(())
    }
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
    /// pass over all its rows has them: halves even and not, one of a row.
    #[test]
    fn the_halves_moments_are_the_whole_batchs() {
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 + 10.0
        };
        for (n1, n2) in [(50, 50), (51, 50), (1, 90), (200, 3)] {
            let width = 3;
            let values: Vec<Vec<f32>> = (0..n1 + n2).map(|_| (0..width).map(|_| next()).collect()).collect();
            let of = |rows: &[Vec<f32>]| {
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
    async fn twice(side: Side<'_>, mine: f32) -> Result<([f32; 2], [f32; 2], usize), ModelError> {
        let mut v = [mine, 10.0 * mine];
        side.exchange(Combine::Sum, &mut v).await?;
        let first = v;
        v = [v[0] * 2.0, 0.0];
        side.exchange(Combine::Sum, &mut v).await?;
        Ok((first, v, side.rows()))
    }

    /// A half that posts `len` ones once.
    async fn posts(side: Side<'_>, len: usize) -> Result<(), ModelError> {
        side.exchange(Combine::Sum, &mut vec![1.0; len]).await
    }

    /// Halves that meet twice get the combined values back each time, on
    /// a pool of one (one after the other) as on two.
    #[test]
    fn the_halves_meet_as_often_as_they_post_on_any_pool() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let meeting = Meeting::new(2, 3);
            let (a, b) = pool
                .install(|| both(&meeting, twice(meeting.side(0), 1.0), twice(meeting.side(1), 2.0)))
                .expect("the halves");
            assert_eq!(a, ([3.0, 30.0], [12.0, 0.0], 5), "{threads} threads");
            assert_eq!(a, b, "{threads} threads: both halves get the whole batch's");
        }
    }

    /// A half that meets where the other does not, or an error in one half
    /// while the other waits, ends the step with an error, not a hang.
    #[test]
    fn halves_that_meet_unevenly_end_with_an_error() {
        let meeting = Meeting::new(1, 1);
        let err = both(&meeting, posts(meeting.side(0), 1), async { Ok(()) }).expect_err("uneven");
        assert!(err.to_string().contains("waited to meet"), "{err}");
        let meeting = Meeting::new(1, 1);
        let fails = async { Err::<(), _>(ModelError::NonFinite { what: "a half's loss".into() }) };
        let err = both(&meeting, fails, posts(meeting.side(1), 1)).expect_err("its error");
        assert!(err.to_string().contains("a half's loss"), "{err}");
        let meeting = Meeting::new(1, 1);
        let err = both(&meeting, posts(meeting.side(0), 2), posts(meeting.side(1), 3)).expect_err("lengths");
        assert!(err.to_string().contains("did not"), "{err}");
    }
}
