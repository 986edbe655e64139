//! The AMX kernels proper (x86-64 Linux): tiles, packing, products.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::{Epilogue, Left, Out, Relu, Right};
use crate::matrix::Operand;
use crate::pairs::{lanes, pairs_across, pairs_of, transpose};

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

/// A task's buffers: its left operand's block and two blocks of sums.
struct TaskBuffers {
    sums: [Sums; 2],
    own: Vec<super::Line>,
}

impl Default for TaskBuffers {
    fn default() -> TaskBuffers {
        TaskBuffers { sums: [Sums([0.0; B * B]), Sums([0.0; B * B])], own: Vec::new() }
    }
}

thread_local! {
    /// This thread's task buffers, reused task to task (taken while in
    /// use): a product's tasks are many and small (PLE's experts), and
    /// zeroing 8 KB of sums and a block buffer for each cost them 5%.
    static TASK: std::cell::Cell<Option<Box<TaskBuffers>>> = const { std::cell::Cell::new(None) };
}

/// `out = op(a)·op(b)` (`m×n`, over `k`), the operands packed here or
/// kept packed by earlier products, on tasks of a few row blocks (all of
/// it one task where `min_len` is `usize::MAX`).
pub fn gemm((m, n, k): (usize, usize, usize), a: Left<'_>, b: Right<'_>, out: Out<'_>, min_len: usize) {
    let chunks = k.div_ceil(2 * T);
    let (row_blocks, col_blocks) = (m.div_ceil(B), n.div_ceil(B));
    let per_block = 2 * chunks * TILE;
    let (mut lines_a, mut lines_b) = super::take_buffers();
    // A transposed `a` (a weight gradient's `xᵀ`) is packed ahead, a
    // chunk of its stored rows a task. A plain one is packed a block of
    // 32 rows at a time by the task that uses it, into a buffer that
    // stays in L1: no pass writing and reading back a packed copy.
    let (packed_here, plain) = match &a {
        Left::Values(op, _) if op.transposed => (Some(op.data), None),
        Left::Values(op, _) => (None, Some(op.data)),
        Left::Packed(_) => (None, None),
    };
    let ahead = plain.is_none();
    let b_values = match &b {
        Right::Values(op) => Some(*op),
        Right::Packed(_) => None,
    };
    let a_len = if packed_here.is_some() { row_blocks * per_block } else { 0 };
    let b_len = if b_values.is_some() { col_blocks * per_block } else { 0 };
    let (pa_out, pb_out) = (super::dwords(&mut lines_a, a_len), super::dwords(&mut lines_b, b_len));
    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
    let mut pack_a = move || {
        if let Some(data) = packed_here {
            // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16.
            unsafe { pack_across(data, (k, m), chunks, pa_out, true, min_len) }
        }
    };
    #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
    let mut pack_b = move || {
        if let Some(op) = &b_values {
            // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16.
            unsafe { pack_cols(k, n, op, chunks, pb_out, min_len) }
        }
    };
    if min_len == 1 {
        rayon::join(pack_a, pack_b);
    } else {
        pack_a();
        pack_b();
    }
    let pa: &[u32] = match &a {
        Left::Packed(p) => p.tiles(row_blocks * per_block),
        Left::Values(..) => super::dwords(&mut lines_a, a_len),
    };
    let pb: &[u32] = match &b {
        Right::Packed(p) => p.tiles(col_blocks * per_block),
        Right::Values(_) => super::dwords(&mut lines_b, b_len),
    };
    // A plain `a`'s blocks also kept as its transpose's tiles (chunk rb:
    // rows 32rb.. of `a`), for a later weight gradient.
    let kept_t = match a {
        Left::Values(op, Some(kept)) if !op.transposed => {
            let tiles = 2 * chunks;
            Some(ByChunk::new(kept.resized(tiles * row_blocks * TILE), tiles, row_blocks))
        }
        _ => None,
    };
    let outputs = Outputs::new((m, n), out, row_blocks, col_blocks);
    // fp32 outputs are written a row block at a time, each output line
    // whole while in cache (column panels first left lines half written,
    // read back for their other half: 15% of the largest `d x`).
    let rows_first = matches!(outputs.to, Target::Values(..));
    if outputs.in_order() {
        assert_eq!(min_len, usize::MAX, "column sums are summed in row order, on one task");
    }
    // Tasks of a few row blocks (about eight a thread: the thread woken
    // last, 30–40 µs late, takes fewer).
    let per_task = row_blocks.div_ceil(8 * rayon::current_num_threads()).clamp(1, 8);
    let tasks = row_blocks.div_ceil(per_task);
    (0..tasks).into_par_iter().with_min_len(min_len).for_each(|task| {
        let first = task * per_task;
        let blocks = first..(first + per_task).min(row_blocks);
        let mut buffers = TASK.take().unwrap_or_default();
        let TaskBuffers { sums, own } = &mut *buffers;
        let tiles = Tiles::configure();
        // A block's sums are read back one block later: vector loads right
        // after `tilestored` wait for it to leave the core (no store
        // forwarding from the tiles), which cost the largest `d x` 60% of
        // its time. The stores keep their order (column sums included).
        let mut pending: Option<(usize, usize)> = None;
        let mut slot = 0;
        let store_pending = |sums: &mut Sums, pending: Option<(usize, usize)>| {
            if let Some(at) = pending {
                // SAFETY: task `task` alone owns row blocks `blocks`.
                #[expect(unsafe_code, reason = "tasks writing disjoint row blocks")]
                unsafe {
                    outputs.store(sums, at)
                };
            }
        };
        let mut run = |rb: usize, cb: usize, a_block: &[u32]| {
            // SAFETY: as above.
            #[expect(unsafe_code, reason = "tasks writing disjoint row blocks")]
            if let Some((out, stride)) = unsafe { outputs.in_place((rb, cb)) } {
                block(chunks, (a_block, per_block / 2), (&pb[cb * per_block..], per_block / 2), out, stride, &tiles);
                return;
            }
            let [first, second] = &mut *sums;
            let (now, before) = if slot == 0 { (first, second) } else { (second, first) };
            block(chunks, (a_block, per_block / 2), (&pb[cb * per_block..], per_block / 2), &mut now.0, B, &tiles);
            store_pending(before, pending.replace((rb, cb)));
            slot = 1 - slot;
        };
        if ahead && rows_first {
            for rb in blocks {
                for cb in 0..col_blocks {
                    run(rb, cb, &pa[rb * per_block..]);
                }
            }
        } else if ahead {
            // Tiles: a column panel stays in L1 while the task's row
            // blocks pass over it.
            for cb in 0..col_blocks {
                for rb in blocks.clone() {
                    run(rb, cb, &pa[rb * per_block..]);
                }
            }
        } else {
            let data = plain.expect("a plain left operand");
            for rb in blocks {
                let a_block = super::dwords(own, per_block);
                let i0 = rb * B;
                // SAFETY: `cpu_has_amx` checked AVX-512F and AVX-512-BF16;
                // this task alone writes chunk rb of the kept tiles.
                #[expect(unsafe_code, reason = "calling a target_feature function after run-time detection")]
                unsafe {
                    pack_block(&data[i0 * k..], (B.min(m - i0), k), chunks, a_block);
                    if let Some(kept) = &kept_t {
                        pack_chunk(data, (m, k), rb, kept, true);
                    }
                };
                for cb in 0..col_blocks {
                    run(rb, cb, a_block);
                }
            }
        }
        let last = if slot == 0 { &mut sums[1] } else { &mut sums[0] };
        store_pending(last, pending);
        // SAFETY: this task stored these row blocks, all of them by now.
        #[expect(unsafe_code, reason = "reading back a task's own row blocks")]
        unsafe {
            outputs.check(first..(first + per_task).min(row_blocks))
        };
        drop(tiles);
        TASK.set(Some(buffers));
    });
    super::keep_buffers(lines_a, lines_b);
}

/// A slice that tasks write in disjoint parts.
struct Disjoint<V> {
    ptr: *mut V,
    len: usize,
}

// SAFETY: tasks write disjoint parts through it (`part`'s contract).
#[expect(unsafe_code, reason = "tasks writing disjoint parts of one slice")]
unsafe impl<V: Send> Sync for Disjoint<V> {}

impl<V> Disjoint<V> {
    fn new(out: &mut [V]) -> Disjoint<V> {
        Disjoint { ptr: out.as_mut_ptr(), len: out.len() }
    }

    /// `len` values from `at` (fewer at the end).
    ///
    /// # Safety
    /// No other reference to them may live meanwhile.
    #[expect(unsafe_code, reason = "a part of a slice tasks share")]
    #[expect(clippy::mut_from_ref, reason = "disjoint parts, one task each")]
    unsafe fn part(&self, at: usize, len: usize) -> &mut [V] {
        assert!(at <= self.len);
        // SAFETY: within the slice (asserted); exclusive by the contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len.min(self.len - at)) }
    }
}

/// Where a product's blocks go (see [`Out`]).
struct Outputs<'a> {
    shape: (usize, usize),
    to: Target<'a>,
    /// [`Out::Checked`]'s flag: each task checks the rows it wrote.
    finite: Option<&'a AtomicBool>,
}

enum Target<'a> {
    Values(Disjoint<f32>, Epilogue<'a>),
    /// Tiles as a left operand (row tile 2rb + h, chunk cb) and across
    /// the rows (tile 2cb + h, chunk rb), and the ReLU's bits (u32 per
    /// row and column block).
    Packed {
        rows: ByChunk,
        across: ByChunk,
        transposed: bool,
        relu: ReluAt<'a>,
    },
}

enum ReluAt<'a> {
    Apply(&'a [f32], Disjoint<u32>),
    Mask(&'a [u32], Disjoint<f32>),
}

impl<'a> Outputs<'a> {
    fn new((m, n): (usize, usize), out: Out<'a>, row_blocks: usize, col_blocks: usize) -> Outputs<'a> {
        let mut finite = None;
        let to = match out {
            Out::Values(dst, epilogue) => {
                assert!(dst.len() >= m * n);
                Target::Values(Disjoint::new(&mut dst[..m * n]), epilogue)
            }
            Out::Checked(dst, flag) => {
                assert!(dst.len() >= m * n);
                finite = Some(flag);
                Target::Values(Disjoint::new(&mut dst[..m * n]), Epilogue::default())
            }
            Out::Packed(kept) => {
                let rows =
                    ByChunk::new(kept.rows.resized(2 * row_blocks * col_blocks * TILE), 2 * row_blocks, col_blocks);
                let across =
                    ByChunk::new(kept.across.resized(2 * col_blocks * row_blocks * TILE), 2 * col_blocks, row_blocks);
                let bits = row_blocks * B * col_blocks;
                let relu = match kept.relu {
                    Relu::Apply { bias, passed } => {
                        assert!(bias.len() >= n);
                        passed.resize(bits, 0);
                        ReluAt::Apply(bias, Disjoint::new(passed))
                    }
                    Relu::Mask { passed, sums } => {
                        assert!(passed.len() >= bits && sums.len() >= n);
                        ReluAt::Mask(passed, Disjoint::new(sums))
                    }
                };
                Target::Packed { rows, across, transposed: kept.transposed, relu }
            }
        };
        Outputs { shape: (m, n), to, finite }
    }

    /// [`Out::Checked`]: whether row blocks `blocks`, which this task
    /// stored, are all finite, the flag cleared where not.
    ///
    /// # Safety
    /// As [`store`](Self::store), and every store to them done.
    #[expect(unsafe_code, reason = "reading back a task's own row blocks")]
    unsafe fn check(&self, blocks: std::ops::Range<usize>) {
        let (Some(flag), Target::Values(dst, _)) = (self.finite, &self.to) else { return };
        let (m, n) = self.shape;
        let rows = blocks.start * B..(blocks.end * B).min(m);
        // SAFETY: these rows are this task's, and written (the contract).
        let written = unsafe { dst.part(rows.start * n, rows.len() * n) };
        if !crate::optimizer::all_finite(sparrow_core::simd::Simd::Auto, written) {
            flag.store(false, Ordering::Relaxed);
        }
    }

    /// Where block (rb, cb) may be stored by the tiles themselves, and
    /// its rows' stride: a whole block of fp32 values with no epilogue.
    ///
    /// # Safety
    /// As [`store`](Self::store).
    #[expect(unsafe_code, reason = "tasks writing disjoint row blocks")]
    #[expect(clippy::mut_from_ref, reason = "disjoint row blocks, one task each")]
    unsafe fn in_place(&self, (rb, cb): (usize, usize)) -> Option<(&mut [f32], usize)> {
        let (m, n) = self.shape;
        match &self.to {
            Target::Values(dst, Epilogue { bias: None, relu: false }) if (rb + 1) * B <= m && (cb + 1) * B <= n => {
                // SAFETY: row block rb is this task's (the contract).
                Some((unsafe { dst.part(rb * B * n + cb * B, (B - 1) * n + B) }, n))
            }
            _ => None,
        }
    }

    /// Whether blocks must come in row order on one task (column sums).
    fn in_order(&self) -> bool {
        matches!(self.to, Target::Packed { relu: ReluAt::Mask(..), .. })
    }

    /// Block (rb, cb)'s sums stored (`sums` is overwritten).
    ///
    /// # Safety
    /// No other task may store row block rb meanwhile (nor, for column
    /// sums, any block: [`in_order`](Self::in_order)).
    #[expect(unsafe_code, reason = "tasks writing disjoint row blocks")]
    unsafe fn store(&self, sums: &mut Sums, (rb, cb): (usize, usize)) {
        let (m, n) = self.shape;
        let (height, j0) = (B.min(m - rb * B), cb * B);
        let width = B.min(n - j0);
        // SAFETY: row block rb is this task's (the contract); the CPU has
        // AVX-512F and AVX-512-BF16 (`cpu_has_amx`).
        unsafe {
            match &self.to {
                Target::Values(dst, epilogue) => {
                    let out = dst.part(rb * B * n, height * n);
                    store(sums, out, (n, height), (j0, width), *epilogue)
                }
                Target::Packed { rows, across, transposed, relu } => {
                    let cols = n.div_ceil(B);
                    match relu {
                        ReluAt::Apply(bias, passed) => {
                            let bits = passed.part(rb * B * cols, B * cols);
                            through_relu(sums, (height, width), Some(&bias[j0..j0 + width]), (bits, cols, cb))
                        }
                        ReluAt::Mask(passed, db) => {
                            let bits = &passed[rb * B * cols..(rb + 1) * B * cols];
                            masked(sums, (height, width), (bits, cols, cb), db.part(j0, width))
                        }
                    }
                    keep_block(sums, (rb, cb), rows, across, *transposed)
                }
            }
        }
    }
}

/// Forward: `v + bias[j]`, through the ReLU (rows past `height` and
/// columns past `width` zero), each row's bits passed set in
/// `bits[r·cols + cb]`.
#[target_feature(enable = "avx512f")]
fn through_relu(
    sums: &mut Sums,
    (height, width): (usize, usize),
    bias: Option<&[f32]>,
    (bits, cols, cb): (&mut [u32], usize, usize),
) {
    let zero = _mm512_setzero_ps();
    for r in 0..B {
        let mut word = 0u32;
        for h in 0..2 {
            let live = if r < height { lanes(width.saturating_sub(16 * h).min(16)) } else { 0 };
            // SAFETY: row r of `sums` holds 32 floats, of which this reads
            // and writes 16 from 16·h; the bias load reads its live lanes.
            #[expect(unsafe_code, reason = "SIMD loads and stores behind run-time feature detection")]
            unsafe {
                let at = sums.0.as_mut_ptr().add(r * B + 16 * h);
                let mut v = _mm512_maskz_mov_ps(live, _mm512_load_ps(at));
                if let Some(b) = bias {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, b.as_ptr().add(16 * h)));
                }
                let passed = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(live, v, zero);
                _mm512_store_ps(at, _mm512_maskz_mov_ps(passed, v));
                word |= u32::from(passed) << (16 * h);
            }
        }
        bits[r * cols + cb] = word;
    }
}

/// Backward: each output zeroed where its forward ReLU did not pass, then
/// added to its column's sum, row after row (as `columns.rs` sums them).
#[target_feature(enable = "avx512f")]
fn masked(sums: &mut Sums, (height, width): (usize, usize), (bits, cols, cb): (&[u32], usize, usize), db: &mut [f32]) {
    for h in 0..2 {
        let live = lanes(width.saturating_sub(16 * h).min(16));
        if live == 0 {
            continue;
        }
        // SAFETY: `db` holds `width` sums from column 16h's block start;
        // the masked loads and stores touch its live lanes only, and row r
        // of `sums` holds 32 floats.
        #[expect(unsafe_code, reason = "SIMD loads and stores behind run-time feature detection")]
        unsafe {
            let d = db.as_mut_ptr().add(16 * h);
            let mut total = _mm512_maskz_loadu_ps(live, d);
            for r in 0..B {
                let at = sums.0.as_mut_ptr().add(r * B + 16 * h);
                let pass = if r < height { (bits[r * cols + cb] >> (16 * h)) as u16 & live } else { 0 };
                let v = _mm512_maskz_mov_ps(pass, _mm512_load_ps(at));
                _mm512_store_ps(at, v);
                if r < height {
                    total = _mm512_add_ps(total, v);
                }
            }
            _mm512_mask_storeu_ps(d, live, total);
        }
    }
}

/// A block's values (zero past the product's edges) as bf16 tiles: its
/// two row tiles as chunk cb of a left operand's row tiles 2rb and 2rb + 1,
/// and its two column halves, paired across its rows, as chunk rb of tiles
/// 2cb and 2cb + 1 (transposed: a left operand's `xᵀ`; else a right one).
#[target_feature(enable = "avx512f,avx512bf16")]
#[expect(unsafe_code, reason = "tiles of buffers tasks share by row block")]
unsafe fn keep_block(sums: &Sums, (rb, cb): (usize, usize), rows: &ByChunk, across: &ByChunk, transposed: bool) {
    let row = |r: usize| &sums.0[r * B..(r + 1) * B];
    for h in 0..2 {
        let mut v = [_mm512_setzero_si512(); 16];
        for (r, v) in v.iter_mut().enumerate() {
            *v = pairs_of(row(16 * h + r));
        }
        // SAFETY: row tiles 2rb, 2rb + 1 belong to row block rb's task.
        store_tile(&v, unsafe { rows.tile(2 * rb + h, cb) });
        for (p, v) in v.iter_mut().enumerate() {
            *v = pairs_across(&row(2 * p)[16 * h..], Some(&row(2 * p + 1)[16 * h..]), T);
        }
        if transposed {
            transpose(&mut v);
        }
        // SAFETY: chunk rb of every tile belongs to row block rb's task.
        store_tile(&v, unsafe { across.tile(2 * cb + h, rb) });
    }
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
        // SAFETY: this task owns chunk c's tiles; the caller checked
        // AVX-512F and AVX-512-BF16.
        #[expect(unsafe_code, reason = "a chunk of a buffer tasks share by chunk")]
        unsafe {
            pack_chunk(src, (k, width), c, &out, transpose_tiles)
        }
    });
}

/// Chunk `c` of [`pack_across`]'s tiles (stored rows 32c..32c + 32).
///
/// # Safety
/// No other reference to chunk c's tiles of `out` may live meanwhile.
#[target_feature(enable = "avx512f,avx512bf16")]
#[expect(unsafe_code, reason = "a chunk of a buffer tasks share by chunk")]
unsafe fn pack_chunk(src: &[f32], (k, width): (usize, usize), c: usize, out: &ByChunk, transpose_tiles: bool) {
    for t in 0..out.tiles {
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
        // SAFETY: the caller's contract.
        store_tile(&v, unsafe { out.tile(t, c) });
    }
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
