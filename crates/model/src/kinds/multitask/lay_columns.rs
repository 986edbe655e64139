//! A tower's gradient at its first layer's output, laid in its columns of
//! the towers' side-by-side buffer (`one_input_towers.rs`), through its
//! ReLU, its bias's gradient summed as it goes: one pass over the rows.
//!
//! Where the CPU has AVX-512F and the tower is at most 64 wide, the bias's
//! sums stay in registers across the rows: the compiled slice loop (256-bit
//! vectors, its sums loaded and stored back every row, a chain through
//! memory) was 10% of ESMM's half step (`perf`, `dense_step esmm f32 1024`,
//! an AMX Xeon). The arithmetic is the same: each value the one rounded
//! product or copy, the ReLU's `a > 0` (NaN not), dropout's scale, and each
//! sum taken in row order from the bias's gradient as it was.

use sparrow_core::simd::Simd;

/// Where a row's gradient comes from.
#[derive(Clone, Copy)]
pub(super) enum RowGrad<'a> {
    /// Laid out `[rows, fan_out]`: row `r` is copied.
    Laid(&'a [f32]),
    /// Row `r` is `seed[r]·w` (the next layer has one output), one rounded
    /// product each.
    Outer { seed: &'a [f32], w: &'a [f32] },
}

/// `rows` rows of a tower's gradient written into `values` (`[rows,
/// width]`, its columns `at..at + fan_out`), each value through the ReLU
/// as `relu_mask` takes it (its output `[rows, fan_out]` and dropout's
/// scale, where given) and then added to `db` (its bias's gradient, in
/// row order, as `add_column_sums` sums).
pub(super) fn lay_in_columns(
    simd: Simd,
    (values, (width, at, fan_out)): (&mut [f32], (usize, usize, usize)),
    (rows, relu): (usize, Option<(&[f32], f32)>),
    db: &mut [f32],
    grad: RowGrad<'_>,
) {
    assert!(at + fan_out <= width && rows * width <= values.len(), "lay_in_columns: values of {rows} rows");
    assert!(db.len() >= fan_out, "lay_in_columns: a bias of {fan_out}");
    assert!(relu.is_none_or(|(out, _)| out.len() >= rows * fan_out), "lay_in_columns: the ReLU's output");
    match grad {
        RowGrad::Laid(g) => assert!(g.len() >= rows * fan_out, "lay_in_columns: the gradient"),
        RowGrad::Outer { seed, w } => assert!(seed.len() >= rows && w.len() >= fan_out, "lay_in_columns: seed, w"),
    }
    let place = (values, (width, at, fan_out));
    #[cfg(target_arch = "x86_64")]
    if crate::columns::avx512f(simd) {
        if (1..=64).contains(&fan_out) {
            let (values, relu) = (place.0[at..].as_mut_ptr(), relu.map(|(out, scale)| (out.as_ptr(), scale)));
            let shape = (rows, width, fan_out);
            // SAFETY: AVX-512F was detected; the kernel reads and writes
            // rows `r < rows` of `values` at `r·width + c` from column `at`
            // for `c < fan_out ≤ width − at`, inside `rows·width` (asserted);
            // reads `out` and a laid gradient at `r·fan_out + c` (asserted
            // `rows·fan_out` long), `seed[r]`, `w[c]` and `db[c]` (asserted).
            // `NV` is `fan_out`'s count of 16-lane vectors.
            #[expect(unsafe_code, reason = "calling a target_feature kernel after run-time detection")]
            unsafe {
                match fan_out.div_ceil(16) {
                    1 => x86::rows::<1>(values, shape, relu, db.as_mut_ptr(), grad),
                    2 => x86::rows::<2>(values, shape, relu, db.as_mut_ptr(), grad),
                    3 => x86::rows::<3>(values, shape, relu, db.as_mut_ptr(), grad),
                    _ => x86::rows::<4>(values, shape, relu, db.as_mut_ptr(), grad),
                }
            }
            return;
        }
        #[target_feature(enable = "avx512f")]
        fn rows_avx512(
            place: (&mut [f32], (usize, usize, usize)),
            rows_relu: (usize, Option<(&[f32], f32)>),
            db: &mut [f32],
            grad: RowGrad<'_>,
        ) {
            rows_into(place, rows_relu, db, grad);
        }
        // SAFETY: `avx512f` is true only where AVX-512F was detected.
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        return unsafe { rows_avx512(place, (rows, relu), db, grad) };
    }
    let _ = simd;
    rows_into(place, (rows, relu), db, grad);
}

/// [`lay_in_columns`] a row at a time over slices.
#[inline(always)]
fn rows_into(
    (values, (width, at, fan_out)): (&mut [f32], (usize, usize, usize)),
    (rows, relu): (usize, Option<(&[f32], f32)>),
    db: &mut [f32],
    grad: RowGrad<'_>,
) {
    let db = &mut db[..fan_out];
    for (r, to) in values.chunks_exact_mut(width).take(rows).enumerate() {
        let to = &mut to[at..at + fan_out];
        match grad {
            RowGrad::Laid(g) => to.copy_from_slice(&g[r * fan_out..(r + 1) * fan_out]),
            RowGrad::Outer { seed, w } => to.iter_mut().zip(w).for_each(|(d, &w)| *d = seed[r] * w),
        }
        match relu {
            Some((out, 1.0)) => {
                let a = &out[r * fan_out..(r + 1) * fan_out];
                to.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g } else { 0.0 });
            }
            Some((out, scale)) => {
                let a = &out[r * fan_out..(r + 1) * fan_out];
                to.iter_mut().zip(a).for_each(|(g, &a)| *g = if a > 0.0 { *g * scale } else { 0.0 });
            }
            None => {}
        }
        db.iter_mut().zip(&*to).for_each(|(d, g)| *d += g);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::RowGrad;

    /// [`super::lay_in_columns`] for a `fan_out` of `NV` 16-lane vectors
    /// (the last holding 1 to 16 columns): `values` points at the tower's
    /// first column of row 0; `relu` is its output and dropout's scale.
    ///
    /// # Safety
    /// AVX-512F; `values` writable at `r·width + c`, `relu`'s output and a
    /// laid gradient readable at `r·fan_out + c`, a seed at `r`, `w` and
    /// `db` at `c`, for `r < rows`, `c < fan_out`.
    #[target_feature(enable = "avx512f")]
    #[expect(unsafe_code, reason = "AVX-512 loads and stores through raw pointers")]
    pub(super) unsafe fn rows<const NV: usize>(
        values: *mut f32,
        (rows, width, fan_out): (usize, usize, usize),
        relu: Option<(*const f32, f32)>,
        db: *mut f32,
        grad: RowGrad<'_>,
    ) {
        let tail = fan_out - 16 * (NV - 1);
        let masks: [__mmask16; NV] =
            std::array::from_fn(|v| if v + 1 == NV { ((1u32 << tail) - 1) as __mmask16 } else { 0xffff });
        // SAFETY: the bounds the caller promises; each load and store is
        // masked to the tower's `fan_out` columns.
        unsafe {
            let mut sums: [__m512; NV] = std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], db.add(16 * v)));
            let (laid, seed, w) = match grad {
                RowGrad::Laid(g) => (g.as_ptr(), std::ptr::null(), [_mm512_setzero_ps(); NV]),
                RowGrad::Outer { seed, w } => (
                    std::ptr::null(),
                    seed.as_ptr(),
                    std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], w.as_ptr().add(16 * v))),
                ),
            };
            let zero = _mm512_setzero_ps();
            for r in 0..rows {
                let to = values.add(r * width);
                let s = if seed.is_null() { zero } else { _mm512_set1_ps(*seed.add(r)) };
                for v in 0..NV {
                    let mut g = if seed.is_null() {
                        _mm512_maskz_loadu_ps(masks[v], laid.add(r * fan_out + 16 * v))
                    } else {
                        _mm512_mul_ps(s, w[v])
                    };
                    if let Some((out, scale)) = relu {
                        let a = _mm512_maskz_loadu_ps(masks[v], out.add(r * fan_out + 16 * v));
                        // `a > 0`, false for NaN; a value not kept is +0.
                        let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, zero);
                        g = if scale == 1.0 {
                            _mm512_maskz_mov_ps(keep, g)
                        } else {
                            _mm512_maskz_mul_ps(keep, g, _mm512_set1_ps(scale))
                        };
                    }
                    _mm512_mask_storeu_ps(to.add(16 * v), masks[v], g);
                    sums[v] = _mm512_add_ps(sums[v], g);
                }
            }
            for (v, sum) in sums.iter().enumerate() {
                _mm512_mask_storeu_ps(db.add(16 * v), masks[v], *sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use sparrow_core::rng::Rng;

    use super::*;

    /// The kernel gives the slice loop's values and sums bit for bit: every
    /// width up to 70 (whole vectors, a part of one, past the kernel's 64),
    /// a laid and an outer-product gradient, no ReLU, a ReLU and dropout's
    /// scale over outputs with zeros, −0, negatives and NaN, a bias's
    /// gradient already holding sums, columns beside others left as they were.
    #[test]
    fn the_kernel_lays_and_sums_as_the_slice_loop() {
        let mut rng = Rng::new(5);
        let mut normal = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        for fan_out in 1..=70 {
            let (rows, at) = (37, 3);
            let width = at + fan_out + 5;
            let mut out = normal(rows * fan_out);
            for (i, a) in out.iter_mut().enumerate() {
                *a = match i % 7 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::NAN,
                    _ => *a,
                };
            }
            let (laid, seed, w, db) = (normal(rows * fan_out), normal(rows), normal(fan_out), normal(fan_out));
            let values = normal(rows * width);
            let grads = [RowGrad::Laid(&laid), RowGrad::Outer { seed: &seed, w: &w }];
            for (grad, relu) in grads.into_iter().flat_map(|g| [None, Some(1.0f32), Some(1.25)].map(|r| (g, r))) {
                let relu = relu.map(|scale| (&out[..], scale));
                let lay = |simd| {
                    let (mut values, mut db) = (values.clone(), db.clone());
                    lay_in_columns(simd, (&mut values, (width, at, fan_out)), (rows, relu), &mut db, grad);
                    (values, db)
                };
                let (want, got) = (lay(Simd::Portable), lay(Simd::Auto));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let case = format!("fan_out {fan_out}, scale {:?}", relu.map(|r| r.1));
                assert_eq!(bits(&got.0), bits(&want.0), "{case}: values");
                assert_eq!(bits(&got.1), bits(&want.1), "{case}: the bias's gradient");
                assert_eq!(bits(&got.0[..at]), bits(&values[..at]), "{case}: the columns before");
            }
        }
    }
}
