//! `SPARROW_SIMD`: whether the kernels Sparrow picks at run time by CPU
//! feature (bf16 matrix products and the portable product's AVX2 build,
//! DLRM's interaction, f16 row conversions and steps, dense Adam, the
//! first-order and FM passes, the finiteness check of gradients) may take
//! their SIMD versions. `SPARROW_SIMD=portable` makes
//! every one of them take its portable version, as on a CPU without those
//! features: the same bits, slower. It lets one machine show that a model
//! trained without the features equals the one trained with them, and works
//! around a CPU that misreports a feature. Unset, or `auto`: use what the
//! CPU has. The machine's measured ceilings (`sparrow bench`) ignore it.

use std::sync::OnceLock;

/// The environment variable.
pub const VARIABLE: &str = "SPARROW_SIMD";

/// What `SPARROW_SIMD` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdChoice {
    /// The SIMD kernels the CPU supports (the default).
    Auto,
    /// Portable kernels only.
    Portable,
}

impl SimdChoice {
    /// Reads `SPARROW_SIMD`; a value other than `auto` or `portable` is an
    /// error naming the variable (binaries check it before any work).
    pub fn from_env() -> Result<SimdChoice, String> {
        match std::env::var(VARIABLE) {
            Err(std::env::VarError::NotPresent) => Ok(SimdChoice::Auto),
            Ok(v) if v.is_empty() || v == "auto" => Ok(SimdChoice::Auto),
            Ok(v) if v == "portable" => Ok(SimdChoice::Portable),
            Ok(v) => Err(format!("{VARIABLE}={v}: expected `auto` or `portable`")),
            Err(std::env::VarError::NotUnicode(v)) => Err(format!("{VARIABLE}={v:?}: expected `auto` or `portable`")),
        }
    }
}

/// Whether run-time-chosen SIMD kernels may be used (read once per
/// process; a value `from_env` refuses reads as `auto` here).
#[inline]
pub fn allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| SimdChoice::from_env() != Ok(SimdChoice::Portable))
}
