#![no_main]
//! See `sparrow_fuzz::export_manifest`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::export_manifest(data));
