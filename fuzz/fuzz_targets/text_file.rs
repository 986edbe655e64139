#![no_main]
//! See `sparrow_fuzz::text_file`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::text_file(data));
