//! Replays every input under `fuzz/corpus/<target>/` through its target (the
//! seeds, and what earlier fuzzing runs kept): a short, deterministic check
//! that no input a fuzzer once found interesting panics today.

use std::path::Path;

#[test]
fn every_corpus_input_is_handled_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut replayed = 0;
    for (target, run) in sparrow_fuzz::TARGETS {
        let dir = root.join(target);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .flatten()
            .map(|e| e.path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{target}: no corpus");
        for input in inputs {
            let data = std::fs::read(&input).expect("read input");
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{target}: {} panicked", input.display());
            replayed += 1;
        }
    }
    println!("replayed {replayed} inputs");
}
