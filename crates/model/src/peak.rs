//! The machine's arithmetic ceiling, measured rather than looked up: how many
//! fp32 FMA flops/s and bf16 dot-product flops/s (AVX-512-BF16's
//! `vdpbf16ps`: two bf16 products per fp32 lane, accumulated in fp32) the
//! cores sustain, with the widest kernel this CPU has (chosen at run time).
//! `sparrow bench` prints them beside what the dense step achieves.
//!
//! [`dpbf16_portable`] is `vdpbf16ps`'s arithmetic for one lane, written
//! out (Intel SDM: the odd pair's product added first, then the even
//! pair's; each product and sum rounded to nearest even; denormal inputs
//! read as zero and denormal results flushed to zero): the numerics any
//! bf16 kernel of ours must reproduce on a CPU without the instruction.

use std::time::{Duration, Instant};

use serde::Serialize;
use sparrow_core::simd::Simd;

/// One measured ceiling.
#[derive(Clone, Debug, Serialize)]
pub struct Peak {
    pub gflops: f64,
    /// The instruction measured (`avx512f vfmadd`, `avx2 vfmadd`, `scalar`, `avx512bf16 vdpbf16ps`).
    pub kernel: &'static str,
}

/// The fp32 and bf16 ceilings on `threads` threads.
#[derive(Clone, Debug, Serialize)]
pub struct Peaks {
    pub threads: usize,
    pub fp32_fma: Peak,
    /// None: this CPU has no AVX-512-BF16.
    pub bf16_dot: Option<Peak>,
    /// AMX's `tdpbf16ps` on tiles in registers. None: this CPU has no
    /// AMX-BF16, or Linux did not grant its tiles.
    pub amx_bf16: Option<Peak>,
}

/// Independent accumulators per kernel: enough to cover the FMA latency
/// (4 cycles) on two pipes.
const CHAINS: usize = 12;

/// Runs `block` (returning the flops it did) on `threads` threads for
/// about `duration`; flops per second over all of them.
fn throughput(threads: usize, duration: Duration, block: Block) -> f64 {
    let threads = threads.max(1);
    let start = Instant::now();
    let flops: f64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let mut flops = 0.0;
                    while start.elapsed() < duration {
                        flops += block();
                    }
                    flops
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    flops / start.elapsed().as_secs_f64()
}

/// Iterations of one timed block (a few milliseconds).
const ITERS: usize = 1 << 18;

fn fp32_scalar_block() -> f64 {
    let mut acc = [0f32; CHAINS];
    let (x, y) = (std::hint::black_box(1.0f32), std::hint::black_box(1e-7f32));
    for _ in 0..ITERS {
        for a in acc.iter_mut() {
            *a = a.mul_add(x, y);
        }
    }
    std::hint::black_box(acc);
    (ITERS * CHAINS * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{CHAINS, ITERS};

    #[target_feature(enable = "avx512f")]
    fn fma512() -> [f32; 16] {
        let (x, y) = (_mm512_set1_ps(std::hint::black_box(1.0)), _mm512_set1_ps(std::hint::black_box(1e-7)));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..ITERS {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        let mut out = [0f32; 16];
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: `out` holds 16 f32, the width of one __m512 store.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), sum)
        };
        out
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma256() -> [f32; 8] {
        let (x, y) = (_mm256_set1_ps(std::hint::black_box(1.0)), _mm256_set1_ps(std::hint::black_box(1e-7)));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..ITERS {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        let mut out = [0f32; 8];
        let sum = acc.iter().fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: `out` holds 8 f32, the width of one __m256 store.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), sum)
        };
        out
    }

    #[target_feature(enable = "avx512bf16,avx512f")]
    fn dpbf16() -> [f32; 16] {
        // 1.0 and 2^-20 in bf16, as pairs in each 32-bit lane.
        let one = _mm512_set1_epi32(std::hint::black_box(0x3f80_3f80u32 as i32));
        let tiny = _mm512_set1_epi32(std::hint::black_box(0x3580_3580u32 as i32));
        let (a, b) = (_mm512_castsi512_ph_bh(one), _mm512_castsi512_ph_bh(tiny));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..ITERS {
            for c in acc.iter_mut() {
                *c = _mm512_dpbf16_ps(*c, a, b);
            }
        }
        let mut out = [0f32; 16];
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: `out` holds 16 f32, the width of one __m512 store.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), sum)
        };
        out
    }

    /// `_mm512_castsi512_…` for the bf16 vector type: a reinterpretation.
    #[target_feature(enable = "avx512bf16,avx512f")]
    fn _mm512_castsi512_ph_bh(v: __m512i) -> __m512bh {
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: __m512i and __m512bh are both 512-bit vectors; every bit
        // pattern is a valid value of either.
        unsafe {
            std::mem::transmute::<__m512i, __m512bh>(v)
        }
    }

    pub fn fma512_block() -> f64 {
        assert!(is_x86_feature_detected!("avx512f"));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: the CPU has AVX-512F (asserted just above).
        std::hint::black_box(unsafe { fma512() });
        (ITERS * CHAINS * 16 * 2) as f64
    }

    pub fn fma256_block() -> f64 {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: the CPU has AVX2 and FMA (asserted just above).
        std::hint::black_box(unsafe { fma256() });
        (ITERS * CHAINS * 8 * 2) as f64
    }

    pub fn dpbf16_block() -> f64 {
        assert!(is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f"));
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: the CPU has AVX-512F and AVX-512-BF16 (asserted just above).
        std::hint::black_box(unsafe { dpbf16() });
        // Each lane: two products and two additions.
        (ITERS * CHAINS * 16 * 4) as f64
    }

    /// `vdpbf16ps` on 16 lanes: `acc[i] += a[2i+1]·b[2i+1] + a[2i]·b[2i]`.
    #[target_feature(enable = "avx512bf16,avx512f")]
    fn dpbf16_lanes(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> [f32; 16] {
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: each pointer covers exactly 64 bytes (16 f32 or 32 u16),
        // the width of the unaligned loads and the store.
        unsafe {
            let va = _mm512_castsi512_ph_bh(_mm512_loadu_si512(a.as_ptr().cast()));
            let vb = _mm512_castsi512_ph_bh(_mm512_loadu_si512(b.as_ptr().cast()));
            let r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc.as_ptr()), va, vb);
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), r);
            out
        }
    }

    /// The instruction itself, where the CPU has it.
    pub fn dpbf16_simd(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> Option<[f32; 16]> {
        if !(is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")) {
            return None;
        }
        #[expect(unsafe_code, reason = "SIMD intrinsics behind run-time feature detection")]
        // SAFETY: the CPU has AVX-512F and AVX-512-BF16 (checked just above).
        Some(unsafe { dpbf16_lanes(acc, a, b) })
    }
}

/// bf16 → f32 with denormals read as zero (sign kept).
#[inline]
pub(crate) fn bf16_daz(x: u16) -> f32 {
    ftz(f32::from_bits(u32::from(x) << 16))
}

/// A result flushed to zero when denormal (sign kept). On the bits (a zero
/// exponent: zero or denormal), so a loop of it vectorises.
#[inline(always)]
fn ftz(v: f32) -> f32 {
    let bits = v.to_bits();
    if bits & 0x7f80_0000 == 0 { f32::from_bits(bits & 0x8000_0000) } else { v }
}

/// One lane of `vdpbf16ps`, portable: `acc + a1·b1 + a0·b0`, in that order,
/// each sum rounded once (to nearest even, a denormal flushed to zero) from
/// its exact value: a bf16 product is exact in f64 and f64 holds each sum
/// closely enough that rounding it to f32 rounds the exact sum (measured
/// against the instruction on products beyond f32's range both ways).
pub fn dpbf16_portable(acc: f32, a: [u16; 2], b: [u16; 2]) -> f32 {
    dpbf16_lane(acc, (bf16_daz(a[1]), bf16_daz(a[0])), (bf16_daz(b[1]), bf16_daz(b[0])))
}

/// [`dpbf16_portable`] on the pairs already widened with [`bf16_daz`],
/// `(high, low)`: the one place its arithmetic is written.
#[inline(always)]
pub(crate) fn dpbf16_lane(acc: f32, (a_hi, a_lo): (f32, f32), (b_hi, b_lo): (f32, f32)) -> f32 {
    let high = ftz((f64::from(ftz(acc)) + f64::from(a_hi) * f64::from(b_hi)) as f32);
    ftz((f64::from(high) + f64::from(a_lo) * f64::from(b_lo)) as f32)
}

/// `vdpbf16ps` over 16 lanes: the instruction where the CPU has it (None otherwise).
pub fn dpbf16_simd(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> Option<[f32; 16]> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::dpbf16_simd(acc, a, b)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (acc, a, b);
        None
    }
}

/// Flops of one sample's dense step through an MLP of these layer widths
/// (input first): forward, the weight gradients and the input gradients
/// (the first layer's feed the embeddings), 2 flops per multiply-add each.
pub fn mlp_step_flops(widths: &[usize]) -> f64 {
    6.0 * widths.windows(2).map(|w| (w[0] * w[1]) as f64).sum::<f64>()
}

/// A timed block (returning the flops it did) and the instruction it runs.
type Block = fn() -> f64;
type Kernel = (Block, &'static str);

/// The fp32 kernel and the bf16 one (None: no AVX-512-BF16) this CPU runs;
/// under `train.simd = "avx2"` those of a CPU without AVX-512 (the
/// ceilings of the path its kernels take). Any other setting measures the
/// machine's own.
fn kernels(simd: Simd) -> (Kernel, Option<Kernel>) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = !simd.products_at_most_avx2();
        let fp32: Kernel = if avx512 && is_x86_feature_detected!("avx512f") {
            (x86::fma512_block, "avx512f vfmadd231ps")
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            (x86::fma256_block, "avx2 vfmadd231ps")
        } else {
            (fp32_scalar_block, "scalar mul_add")
        };
        let bf16 = (avx512 && is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f"))
            .then_some((x86::dpbf16_block as Block, "avx512bf16 vdpbf16ps"));
        (fp32, bf16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = simd;
        ((fp32_scalar_block, "scalar mul_add"), None)
    }
}

/// Measures the ceilings on `threads` threads, `duration` each: the
/// machine's, or under `avx2` those of a CPU without AVX-512 (no bf16 dot
/// product, no AMX).
pub fn measure(simd: Simd, threads: usize, duration: Duration) -> Peaks {
    let (fp32, bf16) = kernels(simd);
    let amx = crate::amx::ceiling_block().filter(|_| !simd.products_at_most_avx2());
    Peaks {
        threads,
        fp32_fma: Peak { gflops: throughput(threads, duration, fp32.0) / 1e9, kernel: fp32.1 },
        bf16_dot: bf16.map(|(block, kernel)| Peak { gflops: throughput(threads, duration, block) / 1e9, kernel }),
        amx_bf16: amx.map(|block| Peak { gflops: throughput(threads, duration, block) / 1e9, kernel: "amx tdpbf16ps" }),
    }
}

/// The CPU time the calling thread has run (Linux's per-thread clock);
/// None where there is none.
fn thread_cpu_time() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        #[expect(unsafe_code, reason = "clock_gettime has no safe wrapper in std")]
        // SAFETY: `ts` is a valid, writable timespec for the call's duration.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// `block`'s flops per second on the calling thread for about `duration`
/// of that thread's own CPU time (wall time where there is no such clock):
/// time another process takes the core for is not counted against it.
fn rate_here(duration: Duration, block: Block) -> f64 {
    let wall = Instant::now();
    let clock = || thread_cpu_time().unwrap_or_else(|| wall.elapsed());
    let start = clock();
    let mut flops = 0.0;
    loop {
        flops += block();
        let spent = clock().saturating_sub(start);
        if spent >= duration {
            return flops / spent.as_secs_f64();
        }
    }
}

/// The fp32 FMA and bf16 dot-product ceilings of one thread, each the best
/// of `rounds` rounds of about `round`, the two taken in turn, on the
/// thread's own CPU time: what decides [`slow_bf16`] when a run starts,
/// which a busy machine (other jobs, a test suite) must not sway. A
/// process that takes the core only lowers a round's figure (the
/// frequency and the caches it leaves behind), so the best of several,
/// alternated, is the CPU's. AMX is not measured (None).
///
/// The failpoint `peak.bf16_over_fp32` (`return(R)`) reports the bf16 rate
/// as R× the fp32 one, so that tests can set the ratio the warning reads.
pub fn measure_one_thread(rounds: usize, round: Duration) -> Peaks {
    let (fp32, bf16) = kernels(Simd::Auto);
    let (mut best_fp32, mut best_bf16) = (0f64, 0f64);
    for _ in 0..rounds.max(1) {
        best_fp32 = best_fp32.max(rate_here(round, fp32.0));
        if let Some((block, _)) = bf16 {
            best_bf16 = best_bf16.max(rate_here(round, block));
        }
    }
    let fp32_fma = Peak { gflops: best_fp32 / 1e9, kernel: fp32.1 };
    let set_ratio = || -> Option<f64> {
        fail::fail_point!("peak.bf16_over_fp32", |ratio: Option<String>| ratio.and_then(|r| r.parse().ok()));
        None
    };
    let bf16_gflops = set_ratio().map_or(best_bf16 / 1e9, |ratio| ratio * fp32_fma.gflops);
    Peaks {
        threads: 1,
        fp32_fma,
        bf16_dot: bf16.map(|(_, kernel)| Peak { gflops: bf16_gflops, kernel }),
        amx_bf16: None,
    }
}

/// bf16 products pay for their rounding and packing only where the CPU's
/// `vdpbf16ps` does clearly more flops than its fp32 FMA (AMD Zen 4: about
/// 1.85×). Below this ratio they are slower than fp32 end to end.
pub const BF16_PAYS_OFF_AT: f64 = 1.25;

/// One line for the user where this CPU's bf16 dot product runs at less
/// than [`BF16_PAYS_OFF_AT`]× its fp32 FMA rate (an Intel Xeon measured
/// 0.49×: `model.precision = "bf16"` trained slower than f32 there); None
/// where it pays off or the CPU has none.
pub fn slow_bf16(peaks: &Peaks) -> Option<String> {
    let bf16 = peaks.bf16_dot.as_ref()?;
    let ratio = bf16.gflops / peaks.fp32_fma.gflops;
    (ratio < BF16_PAYS_OFF_AT).then(|| {
        format!(
            "this CPU's bf16 dot product ({}) runs at {ratio:.2}× its fp32 FMA rate ({:.0} against {:.0} GFLOP/s \
             on {} thread(s)): bf16 products are no faster than fp32 here, and their inputs are rounded; \
             model.precision = \"f32\" is likely faster",
            bf16.kernel, bf16.gflops, peaks.fp32_fma.gflops, peaks.threads
        )
    })
}

/// Bytes per second (read and written, counted together) that `threads`
/// threads sustain copying a buffer of `bytes` bytes of floats into another
/// of the same size, each thread its own pair (`bytes` split between them),
/// for about `duration`: the bandwidth a pass that reads a batch's input and
/// writes its gradient can have at that batch's size (in cache or not).
pub fn copy_bandwidth(threads: usize, bytes: usize, duration: Duration) -> f64 {
    let threads = threads.max(1);
    let floats = (bytes / 4 / threads).max(16);
    let start = Instant::now();
    let moved: f64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let src: Vec<f32> = (0..floats).map(|i| i as f32).collect();
                    let mut dst = vec![0.0f32; floats];
                    let mut moved = 0.0;
                    // At least one copy: filling `src` may take the whole
                    // duration on a busy machine (a figure of 0 B/s).
                    loop {
                        dst.copy_from_slice(&src);
                        std::hint::black_box(&mut dst);
                        moved += 8.0 * floats as f64;
                        if start.elapsed() >= duration {
                            break moved;
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    moved / start.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 of an f32, rounded to nearest even (how inputs become bf16).
    fn bf16(x: f32) -> u16 {
        let bits = x.to_bits();
        let round = 0x7fff + ((bits >> 16) & 1);
        (bits.wrapping_add(round) >> 16) as u16
    }

    /// The warning reads the ratio of the two ceilings against
    /// [`BF16_PAYS_OFF_AT`], and names both figures.
    #[test]
    fn slow_bf16_warns_below_the_threshold_only() {
        let peaks = |bf16: Option<f64>| Peaks {
            threads: 1,
            fp32_fma: Peak { gflops: 100.0, kernel: "fp32" },
            bf16_dot: bf16.map(|gflops| Peak { gflops, kernel: "bf16" }),
            amx_bf16: None,
        };
        let slow = slow_bf16(&peaks(Some(49.0))).expect("a warning at 0.49×");
        assert!(slow.contains("0.49× its fp32 FMA rate (49 against 100 GFLOP/s on 1 thread(s))"), "{slow}");
        assert!(slow_bf16(&peaks(Some(124.0))).is_some());
        assert_eq!(slow_bf16(&peaks(Some(125.0))), None);
        assert_eq!(slow_bf16(&peaks(Some(185.0))), None);
        assert_eq!(slow_bf16(&peaks(None)), None, "no AVX-512-BF16: nothing to compare");
    }

    /// Each ceiling of one thread is a positive rate with its kernel named,
    /// and the bf16 one is there exactly where the CPU has AVX-512-BF16.
    #[test]
    fn one_threads_ceilings_are_measured_for_the_kernels_this_cpu_has() {
        let peaks = measure_one_thread(2, Duration::from_millis(1));
        assert_eq!(peaks.threads, 1);
        assert!(peaks.fp32_fma.gflops > 0.0 && peaks.fp32_fma.gflops.is_finite(), "{peaks:?}");
        assert_eq!(peaks.bf16_dot.is_some(), kernels(Simd::Auto).1.is_some(), "{peaks:?}");
        assert!(peaks.bf16_dot.iter().all(|b| b.gflops > 0.0 && b.kernel == "avx512bf16 vdpbf16ps"), "{peaks:?}");
        assert!(peaks.amx_bf16.is_none());
    }

    #[test]
    fn the_portable_lane_follows_the_documented_order_and_flushing() {
        // 1 + 2·3 + 4·5 = 27, all exact.
        assert_eq!(dpbf16_portable(1.0, [bf16(4.0), bf16(2.0)], [bf16(5.0), bf16(3.0)]), 27.0);
        // 2^24 + 1 rounds back to 2^24 (ties to even), twice: each sum is rounded.
        // The odd pair comes first: 0 - 2^24, then + 1, is exact.
        let big = 16_777_216.0f32;
        assert_eq!(dpbf16_portable(big, [bf16(1.0), bf16(1.0)], [bf16(1.0), bf16(1.0)]), big);
        assert_eq!(dpbf16_portable(0.0, [bf16(1.0), bf16(big)], [bf16(1.0), bf16(-1.0)]), -big + 1.0);
        // A denormal input reads as zero; a denormal product is flushed.
        let denormal = 0x0001u16;
        assert_eq!(dpbf16_portable(1.0, [0, denormal], [0, bf16(1.0e30)]), 1.0);
        let small = bf16(1.0e-30);
        assert_eq!(dpbf16_portable(0.0, [0, small], [0, small]), 0.0);
        // A product is exact, never flushed or overflowing on its own: a
        // denormal one still moves a sum just above the normal range, and
        // two beyond f32's range cancel before the sum is rounded.
        let (x, y) = (f32::from_bits(u32::from(bf16(1.0e-20)) << 16), f32::from_bits(u32::from(bf16(2.0e-19)) << 16));
        let min = f32::MIN_POSITIVE;
        assert_eq!(
            dpbf16_portable(min, [0, bf16(1.0e-20)], [0, bf16(2.0e-19)]),
            (f64::from(min) + f64::from(x) * f64::from(y)) as f32
        );
        assert!(dpbf16_portable(min, [0, bf16(1.0e-20)], [0, bf16(2.0e-19)]) > min);
        assert_eq!(dpbf16_portable(f32::MAX, [0, bf16(1.0e20)], [0, bf16(1.0e20)]), f32::INFINITY);
    }

    /// The instruction and the portable lane agree bit for bit on the same
    /// inputs (run where the CPU has AVX-512-BF16; elsewhere only the
    /// portable side exists and this has nothing to compare).
    #[test]
    fn simd_and_portable_agree_bit_for_bit() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut compared = 0;
        for round in 0..2000 {
            let mut acc = [0f32; 16];
            let (mut a, mut b) = ([0u16; 32], [0u16; 32]);
            for x in acc.iter_mut() {
                *x = ((next() % 20_001) as f32 - 10_000.0) / 1000.0;
            }
            for i in 0..32 {
                // Mostly ordinary values, some tiny (denormal products), some zero.
                let scale = match next() % 8 {
                    0 => 1e-20,
                    1 => 0.0,
                    _ => 1.0,
                };
                a[i] = bf16(((next() % 2001) as f32 - 1000.0) / 100.0 * scale);
                b[i] = bf16(((next() % 2001) as f32 - 1000.0) / 100.0 * scale);
            }
            if round % 50 == 0 {
                a[3] = 0x0001; // a denormal bf16
            }
            if round % 10 == 1 {
                // Products below f32's normal range meeting sums just above
                // it, and products beyond f32's range: a product is never
                // rounded or flushed on its own, only the sums are.
                for (lane, acc) in acc.iter_mut().enumerate() {
                    let (tiny, huge) = (lane % 2 == 0, lane % 4 == 1);
                    let (acc_scale, scale) = match (tiny, huge) {
                        (true, _) => (1.5e-39, 1e-20),
                        (_, true) => (3e37, 1e19),
                        _ => (0.0, 1.0),
                    };
                    if acc_scale != 0.0 {
                        *acc = ((next() % 2001) as f32 - 1000.0) / 100.0 * acc_scale;
                    }
                    for i in [2 * lane, 2 * lane + 1] {
                        a[i] = bf16(((next() % 2001) as f32 - 1000.0) / 100.0 * scale);
                        b[i] = bf16(((next() % 2001) as f32 - 1000.0) / 100.0 * scale);
                    }
                }
            }
            let Some(simd) = dpbf16_simd(&acc, &a, &b) else { return };
            for lane in 0..16 {
                let want = dpbf16_portable(acc[lane], [a[2 * lane], a[2 * lane + 1]], [b[2 * lane], b[2 * lane + 1]]);
                assert_eq!(simd[lane].to_bits(), want.to_bits(), "round {round} lane {lane}: {} vs {want}", simd[lane]);
                compared += 1;
            }
        }
        assert_eq!(compared, 2000 * 16);
    }

    #[test]
    fn the_reference_mlps_step_is_856k_flops_a_sample() {
        assert_eq!(mlp_step_flops(&[429, 256, 128, 1]), 856_320.0);
    }

    #[test]
    fn the_copy_bandwidth_is_measured() {
        for bytes in [0, 64 << 10, 4 << 20] {
            let b = copy_bandwidth(2, bytes, Duration::from_millis(20));
            assert!(b.is_finite() && b > 1e6, "{bytes} bytes: {b} B/s");
        }
    }

    #[test]
    fn bf16_is_called_slow_only_where_its_dot_product_trails_fp32s_fma() {
        let peaks = |fp32: f64, bf16: Option<f64>| Peaks {
            threads: 1,
            fp32_fma: Peak { gflops: fp32, kernel: "avx512f vfmadd231ps" },
            bf16_dot: bf16.map(|gflops| Peak { gflops, kernel: "avx512bf16 vdpbf16ps" }),
            amx_bf16: None,
        };
        // An Intel Xeon's figures (0.49×) and a Zen 4's (1.86×).
        let xeon = slow_bf16(&peaks(172.0, Some(85.0))).expect("called slow");
        assert!(xeon.contains("0.49×") && xeon.contains("model.precision = \"f32\""), "{xeon}");
        assert_eq!(slow_bf16(&peaks(115.0, Some(214.0))), None);
        assert_eq!(slow_bf16(&peaks(115.0, None)), None, "no bf16 dot product: nothing to compare");
    }

    #[test]
    fn the_ceilings_are_measured() {
        let peaks = measure(Simd::Auto, 1, Duration::from_millis(50));
        assert!(peaks.fp32_fma.gflops.is_finite() && peaks.fp32_fma.gflops > 0.0, "{peaks:?}");
        if let Some(bf16) = &peaks.bf16_dot {
            assert!(bf16.gflops.is_finite() && bf16.gflops > 0.0, "{peaks:?}");
        }
    }
}
