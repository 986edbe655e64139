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
//! the paths on one machine. `avx2` takes what a CPU with AVX2 and FMA but
//! no AVX-512 takes (an AMD Zen 3): each kernel's AVX2 or baseline build,
//! the narrow fp32 product's AVX2 build, bf16 products on the fp32 kernels
//! (rounded inputs), no AMX; so one AVX-512 machine can time that path. Each
//! AVX2 build sums as its AVX-512 build does: in fp32 the model is the one
//! `auto` trains, bit for bit (tested). `portable`
//! makes every one of them take its portable version, as on a CPU without
//! those features: the same bits, slower. It lets one machine show that a
//! model trained without the features equals the one trained with them, and
//! works around a CPU that misreports a feature. `auto` (the default): use
//! what the CPU has. The fp32 matrix product ignores it but for `avx2` (the
//! `gemm` crate picks its kernels by CPU whatever it says, and Sparrow's
//! narrow and one-column kernels give gemm's bits; `avx2` takes the narrow
//! kernel's AVX2 build; `gemm`'s products, wider than 64 columns, still the
//! CPU's widest). The
//! machine's measured ceilings (`sparrow bench`) ignore it but for `avx2`,
//! whose fp32 ceiling is measured on 256-bit FMAs.
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
    /// The kernels a CPU with AVX2 and FMA but no AVX-512 takes (an AMD
    /// Zen 3), to time that path on any machine: no AVX-512, no AMX; the
    /// same model as `auto` in fp32.
    Avx2,
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
            "avx2" => Ok(Simd::Avx2),
            "portable" => Ok(Simd::Portable),
            other => Err(format!("{VARIABLE}={other}: expected `auto`, `avx512`, `avx2` or `portable`")),
        }
    }

    /// Whether a SIMD kernel may run (the CPU must still have its features).
    #[inline]
    pub fn allows(self) -> bool {
        self != Simd::Portable
    }

    /// Whether an AVX-512 build (of any of its extensions) may run, the
    /// CPU having it: not under `avx2`, nor `portable`.
    #[inline]
    pub fn allows_avx512(self) -> bool {
        matches!(self, Simd::Auto | Simd::Avx512)
    }

    /// Whether the fp32 products keep to their AVX2 builds (`avx2`): every
    /// other setting leaves them the CPU's widest, which give the same bits.
    #[inline]
    pub fn products_at_most_avx2(self) -> bool {
        self == Simd::Avx2
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
            Simd::Avx2 => "avx2",
            Simd::Portable => "portable",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each value reads back as itself; `avx2` keeps every AVX-512 build and
    /// AMX out and narrows the products, `avx512` only AMX, `portable` every
    /// SIMD build but leaves the products the CPU's widest (their bits are
    /// the same on every build).
    #[test]
    fn each_setting_allows_what_it_says() {
        for simd in [Simd::Auto, Simd::Avx512, Simd::Avx2, Simd::Portable] {
            assert_eq!(Simd::parse(simd.name()), Ok(simd));
        }
        assert_eq!(Simd::parse(""), Ok(Simd::Auto));
        let err = Simd::parse("avx9000").expect_err("not a setting");
        assert!(err.contains("SPARROW_SIMD=avx9000") && err.contains("`avx2`"), "{err}");
        let allows = |s: Simd| (s.allows(), s.allows_avx512(), s.allows_amx(), s.products_at_most_avx2());
        assert_eq!(allows(Simd::Auto), (true, true, true, false));
        assert_eq!(allows(Simd::Avx512), (true, true, false, false));
        assert_eq!(allows(Simd::Avx2), (true, false, false, true));
        assert_eq!(allows(Simd::Portable), (false, false, false, false));
    }
}
