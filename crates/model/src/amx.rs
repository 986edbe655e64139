//! bf16 matrix products on AMX, the CPU's tile unit (`amx_bf16`: Intel
//! Sapphire Rapids and later). Where a CPU has it, `model.precision =
//! "bf16"` runs its products here (`Bf16Path::Amx`); `train.simd =
//! "avx512"` keeps AVX-512-BF16's `vdpbf16ps` instead, for comparison.
//!
//! Both operands are rounded to bf16 as `vdpbf16ps`'s path rounds them,
//! and packed into tiles of 16 rows × 16 bf16 pairs (1 KB each, k padded
//! with zeros to a multiple of 32, rows and columns to a multiple of 32).
//! A block of 2×2 tiles (32×32 outputs) then runs `tdpbf16ps` over all of k
//! in one pass, its sums in the tile registers. Each output is one chain of
//! `tdpbf16ps`, over k's 32-value chunks in order. Its value depends only on
//! its row of `op(a)` and its column of `op(b)`, so neither the blocking,
//! the threads nor the product's other rows change it. The instruction sums
//! a chunk's 32 products in an order of its own, not a chain of pairs (measured
//! here: 129 of 256 outputs equal the correctly rounded sum, fewer each
//! pairwise chain). So this path's bits are AMX's, not those of
//! `vdpbf16ps` or the portable kernel. The accuracy is the same: fp32 sums
//! of exact products of bf16 values.
//!
//! The CPU must say so (CPUID: AMX-TILE, AMX-BF16, the 16×64-byte palette),
//! and Linux must grant the process the tiles' state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), asked once. Where it refuses (a
//! kernel before 5.16, a sandbox), bf16 stays on AVX-512-BF16, and the
//! refusal is named ([`refusal`]). The tile instructions are written with
//! stable inline assembly: no C++ library, and the arithmetic is the
//! instruction's alone (oneDNN would pick its own blocking and
//! k-splitting by shape and threads).

use sparrow_core::simd::Simd;

use crate::matrix::{Epilogue, Operand};

/// Whether bf16 products may run on AMX here under `simd`: the CPU has
/// it and Linux granted the tiles (asked once a process).
pub fn available(simd: Simd) -> bool {
    simd.allows_amx() && grant().is_ok()
}

/// Why a CPU that has AMX cannot use it here (the kernel refused the
/// tiles' state); None where it can, or where the CPU has no AMX.
pub fn refusal() -> Option<String> {
    match grant() {
        Err(Refused::ByKernel(why)) => Some(why),
        _ => None,
    }
}

/// The smallest product AMX takes: smaller ones (a layer of one output,
/// an outer product) stay on `vdpbf16ps`, chosen by shape alone so that a
/// product always takes the same path.
pub(crate) fn takes(m: usize, n: usize, k: usize) -> bool {
    m >= 16 && n >= 16 && k >= 16
}

#[derive(Clone)]
enum Refused {
    /// No AMX-BF16 on this CPU (or not the tile palette written for).
    NoCpu,
    ByKernel(String),
}

thread_local! {
    /// This thread's answer from [`grant`]: asked once a thread (the
    /// kernel's grant is the process's, and asking again is granted again).
    static GRANT: std::cell::OnceCell<Result<(), Refused>> = const { std::cell::OnceCell::new() };
}

/// Whether the CPU has AMX and Linux granted the process its tiles.
fn grant() -> Result<(), Refused> {
    GRANT.with(|grant| {
        grant
            .get_or_init(|| {
                #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                {
                    if !x86::cpu_has_amx() {
                        return Err(Refused::NoCpu);
                    }
                    x86::request_tiles().map_err(Refused::ByKernel)
                }
                #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
                Err(Refused::NoCpu)
            })
            .clone()
    })
}

/// `dst (m×n) = bf16(op(a))·bf16(op(b))` on AMX, through `epilogue`, on
/// the current rayon pool, or on this thread alone where `threads` is 1
/// (a caller running two products side by side); false (nothing written)
/// where AMX is not granted or the product is too small for it ([`takes`]).
#[expect(clippy::too_many_arguments, reason = "a matrix product's shape, operands, epilogue and threads")]
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: &Operand<'_>,
    b: &Operand<'_>,
    dst: &mut [f32],
    epilogue: Epilogue<'_>,
    threads: Option<usize>,
) -> bool {
    if !takes(m, n, k) || grant().is_err() {
        return false;
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // The shortest run rayon may split off: all of it, on one thread.
        let min_len = if threads == Some(1) { usize::MAX } else { 1 };
        x86::gemm(m, n, k, a, b, dst, epilogue, min_len);
        true
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = (a, b, dst, epilogue, threads);
        false
    }
}

/// A timed block of `tdpbf16ps` on tiles in registers (returning its
/// flops), for the AMX ceiling (`peak::measure`); None where AMX is not
/// granted here.
pub(crate) fn ceiling_block() -> Option<fn() -> f64> {
    grant().ok()?;
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        Some(x86::peak_block)
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    None
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use super::Epilogue;
    use crate::matrix::Operand;

    /// A tile: 16 rows of 16 dwords (bf16 pairs, or fp32 sums).
    const T: usize = 16;
    /// Dwords in a tile.
    const TILE: usize = T * T;
    /// A block: 2×2 tiles of outputs.
    const B: usize = 2 * T;

    pub fn cpu_has_amx() -> bool {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
            return false;
        }
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE; leaf 0x1D
        // sub-leaf 1: palette 1, which must have 8 tiles of 16 × 64 bytes.
        let max_leaf = __cpuid(0).eax;
        if max_leaf < 0x1d {
            return false;
        }
        let leaf7 = __cpuid_count(7, 0);
        if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
            return false;
        }
        let palette = __cpuid_count(0x1d, 1);
        let (bytes_per_row, names, rows) = (palette.ebx & 0xffff, palette.ebx >> 16, palette.ecx & 0xffff);
        bytes_per_row >= 64 && names >= 8 && rows >= 16
    }

    /// Asks Linux for the tiles' state (XTILEDATA, feature 18) for this
    /// process, every thread included.
    pub fn request_tiles() -> Result<(), String> {
        // A refusal, for the test of the fallback (`FAILPOINTS=amx.grant=return`).
        fail::fail_point!("amx.grant", |_| Err("Linux refused the AMX tiles' state (failpoint amx.grant)".into()));
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only reads its integer
        // arguments and changes the process's permitted state.
        #[expect(unsafe_code, reason = "a system call with integer arguments")]
        let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!(
                "Linux refused the AMX tiles' state (arch_prctl(ARCH_REQ_XCOMP_PERM): {}; Linux 5.16 or later grants it)",
                std::io::Error::last_os_error()
            ))
        }
    }

    /// The tile configuration: palette 1, eight tiles of 16 rows × 64
    /// bytes (tmm0–3 the sums, tmm4–5 two row tiles of `a`, tmm6–7 two
    /// column tiles of `b`).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = T as u8;
            t += 1;
        }
        Config(c)
    };

    /// The tiles configured on this thread for as long as it lives; they
    /// are released (back to their initial state, so that a context switch
    /// saves nothing) when it is dropped. No rayon call runs while one
    /// lives, so no other work of this thread's runs between.
    struct Tiles;

    impl Tiles {
        fn configure() -> Tiles {
            // SAFETY: the process was granted the tiles and the CPU has them
            // (`grant`); CONFIG is a valid palette-1 configuration, 64
            // bytes, aligned.
            #[expect(unsafe_code, reason = "AMX instructions behind run-time detection")]
            unsafe {
                asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const Config, options(nostack, readonly))
            };
            Tiles
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: as in `configure`; tilerelease takes no operand.
            #[expect(unsafe_code, reason = "AMX instructions behind run-time detection")]
            unsafe {
                asm!("tilerelease", options(nostack, nomem))
            };
        }
    }

    /// One block: the 32×32 sums `Σ_chunk a·b` over `chunks` chunks, `a`
    /// the block's two row tiles (each `chunks` tiles in k order, the
    /// second `a_next` dwords after the first), `b` its two column tiles
    /// likewise, stored to `c` with rows `stride` floats apart.
    ///
    /// Tile registers are not renamed: a load into a tile waits for the
    /// products reading it. So each load comes right after the last
    /// product that reads the tile's old value, and the next chunk's loads
    /// overlap this chunk's last products.
    fn block(
        chunks: usize,
        (a, a_next): (&[u32], usize),
        (b, b_next): (&[u32], usize),
        c: &mut [f32],
        stride: usize,
        _: &Tiles,
    ) {
        assert!(chunks > 0 && a.len() >= a_next + chunks * TILE && b.len() >= b_next + chunks * TILE);
        assert!(stride >= B && c.len() >= (B - 1) * stride + B);
        // SAFETY: the tiles are configured (`Tiles`). Each tileloadd reads
        // 16 rows of 64 bytes, 64 bytes apart: one tile, which lies within
        // `a` or `b` for each of the `chunks` iterations (asserted above).
        // The four tilestored write 16 rows of 64 bytes, `stride` floats
        // apart, from rows 0 and 16 and columns 0 and 16 of `c`: all within
        // its 32 rows of 32 floats (asserted above).
        #[expect(unsafe_code, reason = "AMX instructions behind run-time detection")]
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 1024",
                "add {a1}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c00} + {cs}*1], tmm0",
                "tilestored [{c00} + {cs}*1 + 64], tmm1",
                "tilestored [{c10} + {cs}*1], tmm2",
                "tilestored [{c10} + {cs}*1 + 64], tmm3",
                a0 = inout(reg) a.as_ptr() => _,
                a1 = inout(reg) a.as_ptr().add(a_next) => _,
                b0 = inout(reg) b.as_ptr() => _,
                b1 = inout(reg) b.as_ptr().add(b_next) => _,
                n = inout(reg) chunks => _,
                s = in(reg) 64usize,
                c00 = in(reg) c.as_mut_ptr(),
                c10 = in(reg) c.as_mut_ptr().add(T * stride),
                cs = in(reg) 4 * stride,
                options(nostack),
            );
        }
    }

    /// A block of 64-byte-aligned sums.
    #[repr(C, align(64))]
    struct Sums([f32; B * B]);

    #[expect(clippy::too_many_arguments, reason = "a matrix product's shape, operands, epilogue and split")]
    pub fn gemm(
        m: usize,
        n: usize,
        k: usize,
        a: &Operand<'_>,
        b: &Operand<'_>,
        dst: &mut [f32],
        epilogue: Epilogue<'_>,
        min_len: usize,
    ) {
        let chunks = k.div_ceil(2 * T);
        let (row_blocks, col_blocks) = (m.div_ceil(B), n.div_ceil(B));
        let per_block = 2 * chunks * TILE;
        let (mut lines_a, mut lines_b) = super::take_buffers();
        let pb = super::dwords(&mut lines_b, col_blocks * per_block);
        // A transposed `a` (a weight gradient's `xᵀ`) is packed ahead, a
        // chunk of its stored rows a task. A plain one is packed a block of
        // 32 rows at a time by the task that uses it, into a buffer that
        // stays in L1: no pass writing and reading back a packed copy.
        let ahead = a.transposed;
        let pa = super::dwords(&mut lines_a, if ahead { row_blocks * per_block } else { 0 });
        let (pa_out, pb_out) = (&mut *pa, &mut *pb);
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        let mut pack_a = move || {
            if ahead {
                // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16.
                unsafe { pack_across(a.data, (k, m), chunks, pa_out, true, min_len) }
            }
        };
        #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
        // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16.
        let mut pack_b = move || unsafe { pack_cols(k, n, b, chunks, pb_out, min_len) };
        if min_len == 1 {
            rayon::join(pack_a, pack_b);
        } else {
            pack_a();
            pack_b();
        }
        let (pa, pb) = (&*pa, &*pb);
        // Tasks of a few row blocks (about four a thread).
        let per_task = row_blocks.div_ceil(4 * rayon::current_num_threads()).clamp(1, 8);
        dst.par_chunks_mut(per_task * B * n).with_min_len(min_len).enumerate().for_each(|(task, out)| {
            let rows = out.len() / n;
            let first = task * per_task;
            let mut own = Vec::new();
            let tiles = Tiles::configure();
            let mut sums = Sums([0.0; B * B]);
            let mut run = |rb: usize, cb: usize, a_block: &[u32]| {
                let (j0, width) = (cb * B, B.min(n - cb * B));
                block(chunks, (a_block, per_block / 2), (&pb[cb * per_block..], per_block / 2), &mut sums.0, B, &tiles);
                // SAFETY: `cpu_has_amx` checked AVX-512F.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    store(&sums, &mut out[rb * B * n..], (n, B.min(rows - rb * B)), (j0, width), epilogue)
                };
            };
            if ahead {
                // A column panel stays in L1 while the task's row blocks
                // pass over it.
                for cb in 0..col_blocks {
                    for rb in 0..rows.div_ceil(B) {
                        run(rb, cb, &pa[(first + rb) * per_block..]);
                    }
                }
            } else {
                for rb in 0..rows.div_ceil(B) {
                    let a_block = super::dwords(&mut own, per_block);
                    let i0 = (first + rb) * B;
                    // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16.
                    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                    unsafe {
                        pack_block(&a.data[i0 * k..], (B.min(m - i0), k), chunks, a_block)
                    };
                    for cb in 0..col_blocks {
                        run(rb, cb, a_block);
                    }
                }
            }
            drop(tiles);
        });
        super::keep_buffers(lines_a, lines_b);
    }

    /// A block's sums into `out` (rows `n` apart, `height` of them, columns
    /// `j0..j0 + width`), through the epilogue as [`Epilogue::row`] computes
    /// it: `v + bias[j]`, then `v > 0 ? v : 0` (NaN and −0 become +0).
    #[target_feature(enable = "avx512f")]
    fn store(
        sums: &Sums,
        out: &mut [f32],
        (n, height): (usize, usize),
        (j0, width): (usize, usize),
        epilogue: Epilogue<'_>,
    ) {
        assert!(height <= B && width <= B && j0 + width <= n && out.len() >= (height.max(1) - 1) * n + j0 + width);
        let zero = _mm512_setzero_ps();
        for h in 0..2 {
            let lanes_h = width.saturating_sub(16 * h).min(16);
            if lanes_h == 0 {
                break;
            }
            let mask = lanes(lanes_h);
            let j = j0 + 16 * h;
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let bias = epilogue.bias.map(|b| {
                assert!(b.len() >= j + lanes_h);
                // SAFETY: the masked load reads b[j..j + lanes_h], within
                // `b` (asserted); masked-off lanes are not accessed.
                unsafe { _mm512_maskz_loadu_ps(mask, b.as_ptr().add(j)) }
            });
            for r in 0..height {
                // SAFETY: row r of `sums` holds 32 floats, of which this
                // reads 16 from 16·h; the masked store writes `lanes_h`
                // floats at out[r·n + j..], within `out` (asserted above).
                #[expect(unsafe_code, reason = "SIMD loads and stores behind run-time feature detection")]
                unsafe {
                    let mut v = _mm512_load_ps(sums.0.as_ptr().add(r * B + 16 * h));
                    if let Some(bias) = bias {
                        v = _mm512_add_ps(v, bias);
                    }
                    if epilogue.relu {
                        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, zero), v);
                    }
                    _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * n + j), mask, v);
                }
            }
        }
    }

    /// 16 dwords: the bf16 pairs of up to 32 floats in order (zeros past
    /// the end), as `vcvtne2ps2bf16` rounds them.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn pairs_of(src: &[f32]) -> __m512i {
        let (lo, hi) = (src.len().min(16), src.len().saturating_sub(16).min(16));
        // SAFETY: the masked loads read lanes 0..lo and lo..lo+hi of `src`
        // (within it); masked-off lanes are not accessed.
        #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
        unsafe {
            let low = _mm512_maskz_loadu_ps(lanes(lo), src.as_ptr());
            let high = _mm512_maskz_loadu_ps(lanes(hi), src.as_ptr().add(lo));
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low))
        }
    }

    /// 16 dwords: the pairs `(even[j], odd[j])` of up to 16 columns (zeros
    /// past `len`; `odd` None: zero high halves).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn pairs_across(even: &[f32], odd: Option<&[f32]>, len: usize) -> __m512i {
        let mask = lanes(len);
        let widen = |src: &[f32]| {
            assert!(src.len() >= len);
            // SAFETY: the masked load reads lanes 0..len of `src` (within
            // it, asserted); a bf16 vector reinterpreted as 16-bit integers.
            #[expect(unsafe_code, reason = "SIMD loads behind run-time feature detection")]
            let halves = unsafe {
                let v = _mm512_maskz_loadu_ps(mask, src.as_ptr());
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
            };
            _mm512_cvtepu16_epi32(halves)
        };
        let low = widen(even);
        match odd {
            Some(odd) => _mm512_or_si512(low, _mm512_slli_epi32::<16>(widen(odd))),
            None => low,
        }
    }

    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
    }

    /// Rows of 16 dwords made columns (`v[r][c]` becomes `v[c][r]`): 64
    /// shuffles for 256 dwords.
    #[target_feature(enable = "avx512f")]
    fn transpose(v: &mut [__m512i; 16]) {
        // Per 128-bit lane L, rows 4g..4g+3 at column 4L+e land in u[4g+e].
        let mut t = [_mm512_setzero_si512(); 16];
        for g in 0..8 {
            t[2 * g] = _mm512_unpacklo_epi32(v[2 * g], v[2 * g + 1]);
            t[2 * g + 1] = _mm512_unpackhi_epi32(v[2 * g], v[2 * g + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (t0, t1, t2, t3) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_unpacklo_epi64(t0, t2);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
        // Column 4L+e is lane L of u[e], u[4+e], u[8+e], u[12+e] in turn.
        for e in 0..4 {
            let x0 = _mm512_shuffle_i32x4::<0x44>(u[e], u[4 + e]);
            let x1 = _mm512_shuffle_i32x4::<0xee>(u[e], u[4 + e]);
            let y0 = _mm512_shuffle_i32x4::<0x44>(u[8 + e], u[12 + e]);
            let y1 = _mm512_shuffle_i32x4::<0xee>(u[8 + e], u[12 + e]);
            v[e] = _mm512_shuffle_i32x4::<0x88>(x0, y0);
            v[4 + e] = _mm512_shuffle_i32x4::<0xdd>(x0, y0);
            v[8 + e] = _mm512_shuffle_i32x4::<0x88>(x1, y1);
            v[12 + e] = _mm512_shuffle_i32x4::<0xdd>(x1, y1);
        }
    }

    /// Writes 16 vectors as one tile's rows.
    #[target_feature(enable = "avx512f")]
    fn store_tile(v: &[__m512i; 16], tile: &mut [u32]) {
        for (row, v) in tile[..TILE].chunks_exact_mut(T).zip(v) {
            // SAFETY: `row` holds exactly 16 dwords, one 64-byte store.
            #[expect(unsafe_code, reason = "SIMD stores behind run-time feature detection")]
            unsafe {
                _mm512_storeu_si512(row.as_mut_ptr().cast(), *v)
            };
        }
    }

    /// Tiles that tasks write a chunk each: tile (t, c) at `(t·chunks +
    /// c)·256` of `ptr`, `tiles × chunks` of them.
    struct ByChunk {
        ptr: *mut u32,
        tiles: usize,
        chunks: usize,
    }

    // SAFETY: tasks write disjoint tiles through it (`tile`'s contract).
    #[expect(unsafe_code, reason = "tasks writing disjoint tiles of one buffer")]
    unsafe impl Sync for ByChunk {}

    impl ByChunk {
        fn new(out: &mut [u32], tiles: usize, chunks: usize) -> ByChunk {
            assert_eq!(out.len(), tiles * chunks * TILE);
            ByChunk { ptr: out.as_mut_ptr(), tiles, chunks }
        }

        /// Tile (t, c).
        ///
        /// # Safety
        /// No other reference to tile (t, c) may live meanwhile: each
        /// chunk's tiles are written by the one task that owns the chunk.
        #[expect(unsafe_code, reason = "a tile of a buffer tasks share by chunk")]
        #[expect(clippy::mut_from_ref, reason = "disjoint tiles, one task each")]
        unsafe fn tile(&self, t: usize, c: usize) -> &mut [u32] {
            assert!(t < self.tiles && c < self.chunks);
            // SAFETY: within the buffer (asserted); exclusive by the contract.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.add((t * self.chunks + c) * TILE), TILE) }
        }
    }

    /// Tiles of pairs across stored rows, from a row-major `src` of `k`
    /// rows × `width` columns: tile (t, c) at `(t·chunks + c)·256` holds,
    /// in its row p, the pairs of stored rows 32c + 2p and 32c + 2p + 1 at
    /// columns 16t..16t + 16 (a right operand's layout), or, `transpose`d,
    /// those pairs as its columns (a transposed left operand's rows: a
    /// weight gradient's `xᵀ`). Zeros past k and `width`. Each task reads
    /// its chunk's 32 stored rows in order, once.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn pack_across(
        src: &[f32],
        (k, width): (usize, usize),
        chunks: usize,
        out: &mut [u32],
        transpose_tiles: bool,
        min_len: usize,
    ) {
        let tiles = out.len() / (chunks * TILE);
        let out = ByChunk::new(out, tiles, chunks);
        (0..chunks).into_par_iter().with_min_len(min_len).for_each(|c| {
            for t in 0..tiles {
                let (j0, cols) = (t * T, width.saturating_sub(t * T).min(T));
                let mut v = [_mm512_setzero_si512(); 16];
                for (p, v) in v.iter_mut().enumerate().take(if cols > 0 { T } else { 0 }) {
                    let kk = 2 * (c * T + p);
                    if kk < k {
                        let even = &src[kk * width + j0..];
                        let odd = (kk + 1 < k).then(|| &src[(kk + 1) * width + j0..]);
                        *v = pairs_across(even, odd, cols);
                    }
                }
                if transpose_tiles {
                    transpose(&mut v);
                }
                // SAFETY: this task owns chunk c's tiles.
                #[expect(unsafe_code, reason = "a tile of a buffer tasks share by chunk")]
                store_tile(&v, unsafe { out.tile(t, c) });
            }
        });
    }

    /// `rows` (≤ 32) rows of a row-major `a` (k wide, from `src`'s start)
    /// as one block's two row tiles, `chunks` tiles each, in the layout of
    /// [`pack_across`]'s transposed tiles; zeros past the rows and k.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn pack_block(src: &[f32], (rows, k): (usize, usize), chunks: usize, out: &mut [u32]) {
        for (t, tiles) in out.chunks_exact_mut(chunks * TILE).enumerate() {
            let i0 = t * T;
            let rows = rows.saturating_sub(i0).min(T);
            for (c, tile) in tiles.chunks_exact_mut(TILE).enumerate() {
                let mut v = [_mm512_setzero_si512(); 16];
                let (k0, k1) = ((2 * T * c).min(k), (2 * T * (c + 1)).min(k));
                for (r, v) in v.iter_mut().enumerate().take(rows) {
                    *v = pairs_of(&src[(i0 + r) * k + k0..(i0 + r) * k + k1]);
                }
                store_tile(&v, tile);
            }
        }
    }

    /// `b` (k×n) as column tiles: tile (t, c) at `(t·chunks + c)·256`, its
    /// row p the pairs 16c + p of columns 16t..16t + 16; zeros past k and n.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn pack_cols(k: usize, n: usize, b: &Operand<'_>, chunks: usize, out: &mut [u32], min_len: usize) {
        let src = b.data;
        if !b.transposed {
            // Row-major k×n: a chunk's 32 rows give a tile's rows directly.
            pack_across(src, (k, n), chunks, out, false, min_len);
            return;
        }
        // Stored n×k: a column tile's 16 stored rows are read side by side,
        // each giving a column's pairs; transposed a tile at a time.
        out.par_chunks_mut(chunks * TILE).with_min_len(min_len).enumerate().for_each(|(t, tiles)| {
            let j0 = t * T;
            let cols = n.saturating_sub(j0).min(T);
            for (c, tile) in tiles.chunks_exact_mut(TILE).enumerate() {
                let mut v = [_mm512_setzero_si512(); 16];
                let (k0, k1) = ((2 * T * c).min(k), (2 * T * (c + 1)).min(k));
                for (j, v) in v.iter_mut().enumerate().take(cols) {
                    *v = pairs_of(&src[(j0 + j) * k + k0..(j0 + j) * k + k1]);
                }
                transpose(&mut v);
                store_tile(&v, tile);
            }
        });
    }

    /// Flops of one timed block of `tdpbf16ps` on tiles in registers
    /// (four independent sums; 16·16·32 products of 2 flops each).
    pub fn peak_block() -> f64 {
        const ITERS: usize = 1 << 14;
        let tiles = Tiles::configure();
        // SAFETY: the tiles are configured; the loop only multiplies tiles
        // in registers (zeros: the unit's speed does not depend on values).
        #[expect(unsafe_code, reason = "AMX instructions behind run-time detection")]
        unsafe {
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) ITERS => _,
                options(nostack, nomem),
            );
        }
        drop(tiles);
        (ITERS * 4 * T * T * 2 * T * 2) as f64
    }

    #[cfg(test)]
    pub(super) fn transpose_for_test(rows: &[[u32; 16]; 16]) -> [[u32; 16]; 16] {
        // SAFETY: [u32; 16] and __m512i are both 64 bytes.
        #[expect(unsafe_code, reason = "a test of a target_feature function after detection")]
        unsafe {
            let mut v: [__m512i; 16] = std::mem::transmute(*rows);
            transpose(&mut v);
            std::mem::transmute(v)
        }
    }
}

/// A cache line of packed pairs. Tiles start on a line: a tile row that
/// straddles two lines costs `tileloadd` two (measured: 2.7× slower
/// products on rows 16 bytes off, as a `Vec<u32>` from the allocator lies).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u32; 16]);

thread_local! {
    /// Packing buffers reused by this thread's products (taken while in
    /// use: a product nested on the same thread allocates its own).
    static BUFFERS: std::cell::Cell<(Vec<Line>, Vec<Line>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

fn take_buffers() -> (Vec<Line>, Vec<Line>) {
    BUFFERS.take()
}

fn keep_buffers(a: Vec<Line>, b: Vec<Line>) {
    BUFFERS.set((a, b));
}

/// `lines` grown to hold `len` dwords (a multiple of 16), as dwords; the
/// packing writes every one.
fn dwords(lines: &mut Vec<Line>, len: usize) -> &mut [u32] {
    assert_eq!(len % 16, 0, "whole lines");
    lines.resize(len / 16, Line([0; 16]));
    // SAFETY: `Line` is 16 u32 with no padding (repr(C), 64 bytes, align
    // 64), so `len / 16` lines are `len` initialized, aligned u32, borrowed
    // mutably from `lines` for the slice's lifetime.
    #[expect(unsafe_code, reason = "viewing aligned lines of dwords as dwords")]
    unsafe {
        std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u32>(), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn here() -> bool {
        // Without AMX-BF16 (or the kernel's grant) there is nothing to test.
        available(Simd::Auto)
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = sparrow_core::rng::Rng::new(seed);
        // Mixed magnitudes, both signs, a few zeros.
        (0..len)
            .map(|i| if i % 37 == 5 { 0.0 } else { (rng.next_f64() as f32 - 0.5) * 2f32.powi((i % 9) as i32 - 4) })
            .collect()
    }

    /// `x` rounded to bf16 as the packing rounds it (to nearest even; the
    /// values here are finite), read back with a denormal as zero.
    fn widened(x: f32) -> f64 {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        if rounded & 0x7f80_0000 == 0 { 0.0 } else { f64::from(f32::from_bits(rounded)) }
    }

    /// op(x)[i][j] of a row-major operand `rows`×`cols` as used.
    fn at(x: &Operand<'_>, (rows, cols): (usize, usize), i: usize, j: usize) -> f32 {
        if x.transposed { x.data[j * rows + i] } else { x.data[i * cols + j] }
    }

    #[test]
    fn the_transpose_makes_rows_columns() {
        if !here() {
            return;
        }
        let rows: [[u32; 16]; 16] = std::array::from_fn(|r| std::array::from_fn(|c| (r * 100 + c) as u32));
        let t = x86::transpose_for_test(&rows);
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(t[c][r], rows[r][c], "({r}, {c})");
            }
        }
    }

    /// Every layout of the operands, edges in m, n and k, the epilogue:
    /// each output within fp32 rounding of the exact sum of its bf16
    /// products (an index or a pair out of place is off by far more).
    #[test]
    fn products_match_the_exact_sums_of_bf16_products_in_every_layout() {
        if !here() {
            return;
        }
        for &(m, n, k) in &[(16, 16, 16), (33, 47, 77), (100, 64, 429), (64, 129, 1024), (1024, 36, 64), (20, 300, 31)]
        {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (a, b) = (values(m * k, 1 + m as u64), values(k * n, 2 + n as u64));
                let bias = values(n, 3);
                let (a, b) = (Operand { data: &a, transposed: ta }, Operand { data: &b, transposed: tb });
                for relu in [false, true] {
                    let mut dst = vec![f32::NAN; m * n];
                    let epilogue = Epilogue { bias: Some(&bias), relu };
                    assert!(gemm(m, n, k, &a, &b, &mut dst, epilogue, None));
                    for i in 0..m {
                        for j in 0..n {
                            let terms = (0..k).map(|p| widened(at(&a, (m, k), i, p)) * widened(at(&b, (k, n), p, j)));
                            let (sum, size) = terms.fold((0.0, 0.0), |(s, z), t: f64| (s + t, z + t.abs()));
                            let got = f64::from(dst[i * n + j]) - f64::from(bias[j]);
                            let tolerance = size * (k.div_ceil(32) + 32) as f64 * f64::from(f32::EPSILON) + 1e-30;
                            let want =
                                if relu { (sum + f64::from(bias[j])).max(0.0) - f64::from(bias[j]) } else { sum };
                            assert!(
                                (got - want).abs() <= tolerance + f64::from(bias[j]).abs() * 1e-7,
                                "({m}, {n}, {k}) ta {ta} tb {tb} relu {relu}: [{i}][{j}] = {got}, exact {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// An output's bits depend on its row of op(a) and its column of
    /// op(b) alone: the same in a product of other rows and columns
    /// around it, and on one thread or two.
    #[test]
    fn an_outputs_bits_do_not_depend_on_the_rest_of_the_product_or_the_threads() {
        if !here() {
            return;
        }
        let (m, n, k) = (70, 90, 333);
        let (a, b) = (values(m * k, 7), values(k * n, 8));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let mut dst = vec![0f32; m * n];
            let threads = (threads == 1).then_some(1);
            pool.install(|| {
                gemm(m, n, k, &Operand::plain(&a), &Operand::plain(&b), &mut dst, Epilogue::default(), threads)
            });
            dst
        };
        let whole = run(2);
        assert!(whole.iter().zip(run(1)).all(|(x, y)| x.to_bits() == y.to_bits()), "one thread against two");
        // Rows 21..50 and columns 17..40 on their own (other offsets in
        // the tiles, another count of blocks).
        let (rows, cols) = (21..50, 17..40);
        let sub_a: Vec<f32> = rows.clone().flat_map(|i| a[i * k..(i + 1) * k].to_vec()).collect();
        let sub_b: Vec<f32> = (0..k).flat_map(|p| b[p * n + cols.start..p * n + cols.end].to_vec()).collect();
        let (sm, sn) = (rows.len(), cols.len());
        let mut sub = vec![0f32; sm * sn];
        let (sa, sb) = (Operand::plain(&sub_a), Operand::plain(&sub_b));
        assert!(gemm(sm, sn, k, &sa, &sb, &mut sub, Epilogue::default(), None));
        for (r, i) in rows.enumerate() {
            for (c, j) in cols.clone().enumerate() {
                assert_eq!(sub[r * sn + c].to_bits(), whole[i * n + j].to_bits(), "[{i}][{j}]");
            }
        }
    }

    #[test]
    fn small_products_are_left_to_the_other_kernels() {
        let mut dst = vec![0f32; 15 * 64];
        let (a, b) = (vec![1.0; 15 * 64], vec![1.0; 64 * 64]);
        assert!(!gemm(15, 64, 64, &Operand::plain(&a), &Operand::plain(&b), &mut dst, Epilogue::default(), None));
        assert!(!takes(64, 1, 64) && !takes(64, 64, 15) && takes(16, 16, 16));
    }
}
