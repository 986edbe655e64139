#![no_main]
//! See `sparrow_fuzz::line_parsers`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::line_parsers(data));
