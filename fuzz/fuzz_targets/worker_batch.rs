#![no_main]
//! See `sparrow_fuzz::worker_batch`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::worker_batch(data));
