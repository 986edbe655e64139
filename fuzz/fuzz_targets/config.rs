#![no_main]
//! See `sparrow_fuzz::config`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::config(data));
