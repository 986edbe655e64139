//! `train.simd` (and the `SPARROW_SIMD` environment variable, which the
//! `sparrow` binary and the Python module turn into that key): whether the
//! kernels Sparrow picks at run time by CPU feature (bf16 matrix products
//! and the portable product's AVX2 build, DLRM's interaction, f16 and bf16
//! row conversions and steps, dense Adam, the first-order and FM passes, the
//! multi-task gates' passes, batch norm's passes and the per-column sums of
//! bias gradients, the finiteness check of gradients) may take
//! their SIMD versions, and bf16 products AMX's tiles. `avx512` takes the
//! SIMD versions but keeps AMX out: bf16 products on AVX-512-BF16, whose
//! bits the portable kernels give (AMX's sums are other bits), to compare
//! the paths on one machine. `portable`
//! makes every one of them take its portable version, as on a CPU without
//! those features: the same bits, slower. It lets one machine show that a
//! model trained without the features equals the one trained with them, and
//! works around a CPU that misreports a feature. `auto` (the default): use
//! what the CPU has. The machine's measured ceilings (`sparrow bench`)
//! ignore it, as does the fp32 matrix product (the `gemm` crate picks its
//! kernels by CPU, and Sparrow's narrow and one-column kernels give gemm's bits).
//!
//! The choice is a value: the model, its optimizer and the embedding table
//! are built with it (from their config) and hand it to each kernel they
//! call. No library reads the environment for it.

use serde::{Deserialize, Serialize};

/// The environment variable the binary and the Python module read.
pub const VARIABLE: &str = "SPARROW_SIMD";

/// Whether run-time-chosen SIMD kernels may be used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Simd {
    /// The SIMD kernels the CPU supports.
    #[default]
    Auto,
    /// The SIMD kernels up to AVX-512, not AMX's tiles: bf16 products on
    /// AVX-512-BF16 where the CPU has AMX too (its bits, for comparison).
    /// Elsewhere the same as `auto`.
    Avx512,
    /// Portable kernels only.
    Portable,
}

impl Simd {
    /// A value of `SPARROW_SIMD` (empty reads as `auto`); anything else is an
    /// error naming the variable.
    pub fn parse(value: &str) -> Result<Simd, String> {
        match value {
            "" | "auto" => Ok(Simd::Auto),
            "avx512" => Ok(Simd::Avx512),
            "portable" => Ok(Simd::Portable),
            other => Err(format!("{VARIABLE}={other}: expected `auto`, `avx512` or `portable`")),
        }
    }

    /// Whether a SIMD kernel may run (the CPU must still have its features).
    #[inline]
    pub fn allows(self) -> bool {
        self != Simd::Portable
    }

    /// Whether AMX's tiles may run (the CPU and the OS must still grant them).
    #[inline]
    pub fn allows_amx(self) -> bool {
        self == Simd::Auto
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Auto => "auto",
            Simd::Avx512 => "avx512",
            Simd::Portable => "portable",
        }
    }
}
