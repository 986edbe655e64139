#![no_main]
//! See `sparrow_fuzz::parquet_file`. The parquet library panics on some
//! malformed files; Sparrow catches that and returns an error naming the file.
//! libfuzzer-sys's panic hook aborts on every panic, caught or not, so the
//! default hook is put back: a panic Sparrow does not catch still escapes the
//! target and is reported as a crash.
libfuzzer_sys::fuzz_target!(
    init: {
        let _ = std::panic::take_hook();
    },
    |data: &[u8]| sparrow_fuzz::parquet_file(data)
);
