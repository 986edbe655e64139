#![no_main]
//! See `sparrow_fuzz::parquet_file`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::parquet_file(data));
