//! Hints to the CPU, for the table's walk and the plan's dedup alike.

/// Asks the CPU to start loading the cache line holding `*x`.
#[inline]
pub(crate) fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "prefetch intrinsic; measured: see `sparrow bench` lookup figures")]
    // SAFETY: a prefetch is only a hint: it never faults, reads nothing into
    // the program and writes nothing; SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(x).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
