#![no_main]
//! See `sparrow_fuzz::checkpoint_embeddings`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sparrow_fuzz::checkpoint_embeddings(data));
