//! Per-column passes over a row-major `[rows, width]` buffer: bias
//! gradients (Σ_rows g) and batch norm's statistics. Each column is summed
//! over the rows in order, as a loop adding one row at a time into an
//! accumulator does, so the bits are that loop's; but a tile of columns is
//! summed in registers over all the rows before the next tile. The loop
//! adding a row into an accumulator in memory stored and reloaded it every
//! row, four floats at a time in the baseline build (a bias of one column
//! made that one float a row, each add waiting on the last store). Batch
//! norm's passes take a tile a task, so both threads sum a batch. An
//! AVX-512F build is taken where `train.simd` allows and the CPU has it,
//! else an AVX2 build where it has AVX2 and FMA (a Zen 3): the same
//! operations, sixteen or eight lanes.

use rayon::prelude::*;
use sparrow_core::simd::Simd;

/// Columns a tile sums in registers: four AVX-512 registers a sum.
pub(crate) const TILE: usize = 64;
/// Columns of the narrow tile a right edge is summed in.
const EDGE: usize = 16;

/// Whether `simd` allows the AVX-512F build and the CPU has it.
pub(crate) fn avx512f(simd: Simd) -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd.allows_avx512() && std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Whether `simd` allows an AVX2 build and the CPU has AVX2 and FMA.
pub(crate) fn avx2_fma(simd: Simd) -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd.allows() && std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// The build a pass over columns runs: the same code compiled for
/// AVX-512F, for AVX2 and FMA, or the crate's baseline (four floats a
/// vector).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wide {
    Avx512,
    Avx2,
    Baseline,
}

impl Wide {
    /// The widest build `simd` allows and the CPU has.
    fn of(simd: Simd) -> Wide {
        if avx512f(simd) {
            Wide::Avx512
        } else if avx2_fma(simd) {
            Wide::Avx2
        } else {
            Wide::Baseline
        }
    }
}

/// What a pass adds a row's value of a column to its sums with.
#[derive(Clone, Copy)]
pub(crate) enum Terms<'a> {
    /// `sum += v` (a column sum, a bias gradient).
    Values,
    /// `sum += (v − mean)·(v − mean)`, each column's mean given.
    Squares(&'a [f32]),
    /// `sum += g`, and `products += g·x` beside it (`x` another buffer of
    /// the same shape): batch norm's backward sums.
    WithProducts(&'a [f32]),
}

/// Columns `first..first + sums.len()` of `values` (rows of `width`)
/// summed over the rows in order into `sums` (and `products`, for
/// [`Terms::WithProducts`]), each starting from its value there.
fn tile_into(wide: Wide, values: &[f32], width: usize, first: usize, terms: Terms<'_>, sums: (&mut [f32], &mut [f32])) {
    #[cfg(target_arch = "x86_64")]
    match wide {
        Wide::Avx512 => {
            #[target_feature(enable = "avx512f")]
            fn tile_avx512(
                values: &[f32],
                width: usize,
                first: usize,
                terms: Terms<'_>,
                sums: (&mut [f32], &mut [f32]),
            ) {
                tile_sums(values, width, first, terms, sums);
            }
            // SAFETY: `Wide::Avx512` only where AVX-512F was detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { tile_avx512(values, width, first, terms, sums) };
        }
        Wide::Avx2 => {
            #[target_feature(enable = "avx2,fma")]
            fn tile_avx2(values: &[f32], width: usize, first: usize, terms: Terms<'_>, sums: (&mut [f32], &mut [f32])) {
                tile_sums(values, width, first, terms, sums);
            }
            // SAFETY: `Wide::Avx2` only where AVX2 and FMA were detected.
            #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
            return unsafe { tile_avx2(values, width, first, terms, sums) };
        }
        Wide::Baseline => {}
    }
    tile_sums(values, width, first, terms, sums);
}

/// [`tile_into`]'s sums: tiles of [`TILE`] columns, then of 32 and of
/// [`EDGE`] (each of its columns' sums a chain of adds, row after row: the
/// wider a tile, the more chains run side by side), the last of fewer
/// columns zero-padded, its padding's sums dropped; a last single column
/// is a tile of its own.
#[inline(always)]
fn tile_sums(values: &[f32], width: usize, first: usize, terms: Terms<'_>, (sums, products): (&mut [f32], &mut [f32])) {
    let mut at = 0;
    while at < sums.len() {
        let n = match sums.len() - at {
            left if left >= TILE => TILE,
            left if left >= 32 => 32,
            // One column (a one-logit layer's bias) read in place: copied
            // into sixteen zeroed lanes a row, column sums took 6% of ESMM's step.
            1 => 1,
            left => left.min(EDGE),
        };
        let cols = first + at..first + at + n;
        let out = (&mut sums[at..at + n], products.get_mut(at..at + n).unwrap_or_default());
        match n {
            TILE => tile::<TILE>(values, width, cols.start, terms, out),
            32 => tile::<32>(values, width, cols.start, terms, out),
            1 => tile::<1>(values, width, cols.start, terms, out),
            _ => tile::<EDGE>(values, width, cols.start, terms, out),
        }
        at += n;
    }
}

/// `n ≤ N` columns from `first` (`sums.len()` of them), in `N` lanes: a
/// full tile reads each row's columns in place (their length known, so
/// the lanes are registers). An edge reads `N` values in place too where
/// the buffer holds them, its lanes past `n` then the next row's values,
/// whose sums are dropped; only the last rows, near the buffer's end, are
/// copied into zeroed lanes (a copy a row took 1.07 µs for 128 rows of a
/// gate's 5 columns, 5× a full tile of 64).
#[inline(always)]
fn tile<const N: usize>(
    values: &[f32],
    width: usize,
    first: usize,
    terms: Terms<'_>,
    (sums, products): (&mut [f32], &mut [f32]),
) {
    let n = sums.len();
    let lanes = |s: &[f32]| {
        let mut a = [0.0f32; N];
        a.iter_mut().zip(s).for_each(|(a, &v)| *a = v);
        a
    };
    let (mut s, mut p) = (lanes(sums), lanes(products));
    let m = match terms {
        Terms::Squares(mean) => lanes(&mean[first..first + n]),
        _ => [0.0; N],
    };
    // The passes over the rows `$rows` gives of each buffer `$buf`, each
    // row `$r` read by `$read`. `for` loops, not `for_each`: its `fold`
    // was compiled apart from the AVX-512 build that calls it, without
    // its features, and held the sums on the stack (73% of an edge's
    // time).
    macro_rules! passes {
        ($buf:ident in $rows:expr, $r:ident => $read:expr) => {{
            let rows = {
                let $buf = values;
                $rows
            };
            match terms {
                Terms::Values => {
                    for $r in rows {
                        let v = $read;
                        (0..N).for_each(|j| s[j] += v[j]);
                    }
                }
                Terms::Squares(_) => {
                    for $r in rows {
                        let v = $read;
                        (0..N).for_each(|j| s[j] += (v[j] - m[j]) * (v[j] - m[j]));
                    }
                }
                Terms::WithProducts(x) => {
                    let xs = {
                        let $buf = x;
                        $rows
                    };
                    for ($r, xr) in rows.zip(xs) {
                        let g = $read;
                        let x = {
                            let $r = xr;
                            $read
                        };
                        (0..N).for_each(|j| {
                            s[j] += g[j];
                            p[j] += g[j] * x[j];
                        });
                    }
                }
            }
        }};
    }
    let w = width.max(1);
    if n == N {
        passes!(b in b.chunks_exact(w), r => <&[f32; N]>::try_from(&r[first..first + N]).expect("a full tile"));
    } else {
        // The rows whose `N` values from `first` lie in the buffer, read
        // in place (each row `r` the buffer from its start on), then the
        // rest copied.
        let rows = values.len() / w;
        let in_place = match values.len().checked_sub(first + N) {
            Some(room) => (room / w + 1).min(rows),
            None => 0,
        };
        passes!(b in (0..in_place).map(move |i| &b[i * w..]), r => <&[f32; N]>::try_from(&r[first..first + N]).expect("N values"));
        passes!(b in (in_place..rows).map(move |i| &b[i * w..]), r => lanes(&r[first..first + n]));
    }
    sums.copy_from_slice(&s[..n]);
    if !products.is_empty() {
        products.copy_from_slice(&p[..n]);
    }
}

/// `sums[j] += Σ_rows values[r][j]`, in row order, on this thread (a bias's
/// gradient: its callers run beside other work).
pub(crate) fn add_column_sums(simd: Simd, values: &[f32], width: usize, sums: &mut [f32]) {
    tile_into(Wide::of(simd), values, width, 0, Terms::Values, (sums, &mut []));
}

/// Every column's sums over the rows in order, from zero, a tile of
/// [`TILE`] columns a task: `sums` (`width` of them) by `terms`, and
/// `products` too for [`Terms::WithProducts`] (empty otherwise).
pub(crate) fn column_sums(
    simd: Simd,
    values: &[f32],
    width: usize,
    terms: Terms<'_>,
    sums: &mut [f32],
    products: &mut [f32],
) {
    sums.fill(0.0);
    products.fill(0.0);
    let tiles = sums.par_chunks_mut(TILE).enumerate();
    let wide = Wide::of(simd);
    if matches!(terms, Terms::WithProducts(_)) {
        let tiles = tiles.zip(products.par_chunks_mut(TILE));
        tiles.for_each(|((t, s), p)| tile_into(wide, values, width, t * TILE, terms, (s, p)));
    } else {
        tiles.for_each(|(t, s)| tile_into(wide, values, width, t * TILE, terms, (s, &mut [])));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-at-a-time loops these passes replace.
    fn by_rows(values: &[f32], width: usize, terms: Terms<'_>, start: f32) -> (Vec<f32>, Vec<f32>) {
        let (mut s, mut p) = (vec![start; width], vec![start; width]);
        for (r, row) in values.chunks_exact(width).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                match terms {
                    Terms::Values => s[j] += v,
                    Terms::Squares(m) => s[j] += (v - m[j]) * (v - m[j]),
                    Terms::WithProducts(x) => {
                        s[j] += v;
                        p[j] += v * x[r * width + j];
                    }
                }
            }
        }
        (s, p)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// Values whose sums depend on their order (mixed magnitudes), and −0.
    fn values(rows: usize, width: usize, salt: u32) -> Vec<f32> {
        let mut rng = sparrow_core::rng::Rng::new(u64::from(salt));
        (0..rows * width)
            .map(|i| match i % 7 {
                0 => -0.0,
                3 => rng.uniform(-1e4, 1e4) as f32,
                _ => rng.uniform(-1.0, 1.0) as f32 * 1e-3,
            })
            .collect()
    }

    /// Each build of the tiles the CPU has (an AVX-512 machine runs the
    /// AVX2 build too), from the values in `sums`: the bits of a row at a
    /// time.
    #[test]
    fn each_build_of_the_tiles_gives_the_bits_of_a_row_at_a_time() {
        let mut builds = vec![Wide::Baseline];
        if avx512f(Simd::Auto) {
            builds.push(Wide::Avx512);
        }
        if avx2_fma(Simd::Auto) {
            builds.push(Wide::Avx2);
        }
        for width in [1, 6, 16, 32, 36, 50, 64, 100] {
            let rows = 37;
            let (v, x) = (values(rows, width, 3), values(rows, width, 4));
            let mean: Vec<f32> = (0..width).map(|j| j as f32 * 0.5 - 7.0).collect();
            for terms in [Terms::Values, Terms::Squares(&mean), Terms::WithProducts(&x)] {
                let (want_s, want_p) = by_rows(&v, width, terms, -0.0);
                for &wide in &builds {
                    let (mut s, mut p) = (vec![-0.0; width], vec![-0.0; width]);
                    let products = if matches!(terms, Terms::WithProducts(_)) { &mut p[..] } else { &mut [] };
                    tile_into(wide, &v, width, 0, terms, (&mut s, products));
                    assert_eq!(bits(&s), bits(&want_s), "sums, width {width}, {wide:?}");
                    if matches!(terms, Terms::WithProducts(_)) {
                        assert_eq!(bits(&p), bits(&want_p), "products, width {width}, {wide:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_pass_gives_the_bits_of_a_row_at_a_time_on_every_build() {
        for simd in [Simd::Auto, Simd::Portable] {
            // Full tiles, a right edge of a narrow tile and a part of one, one column.
            for width in [1, 6, 16, 32, 36, 50, 64, 100, 128, 256] {
                let rows = 37;
                let (v, x) = (values(rows, width, 1), values(rows, width, 2));
                let mean: Vec<f32> = (0..width).map(|j| j as f32 * 0.25 - 3.0).collect();
                for terms in [Terms::Values, Terms::Squares(&mean), Terms::WithProducts(&x)] {
                    let (want_s, want_p) = by_rows(&v, width, terms, 0.0);
                    let (mut s, mut p) = (vec![7.0; width], vec![7.0; width]);
                    let products = if matches!(terms, Terms::WithProducts(_)) { &mut p[..] } else { &mut [] };
                    column_sums(simd, &v, width, terms, &mut s, products);
                    assert_eq!(bits(&s), bits(&want_s), "sums, width {width}, {simd:?}");
                    if matches!(terms, Terms::WithProducts(_)) {
                        assert_eq!(bits(&p), bits(&want_p), "products, width {width}, {simd:?}");
                    }
                }
                // A bias's gradient adds to what is there.
                let (want, _) = by_rows(&v, width, Terms::Values, -0.0);
                let mut s = vec![-0.0; width];
                add_column_sums(simd, &v, width, &mut s);
                assert_eq!(bits(&s), bits(&want), "added sums, width {width}, {simd:?}");
            }
        }
    }
}
