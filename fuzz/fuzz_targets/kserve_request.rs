#![no_main]
//! See `sparrow_fuzz::kserve_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::kserve_request(data));
