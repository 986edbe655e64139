//! Replays every input under `fuzz/corpus/<target>/` (the seeds, and what
//! fuzzing runs kept; `cargo fuzz cmin` may rename or drop any of them) and
//! `fuzz/regressions/<target>/` (inputs that once broke something, kept by
//! name) through its target: a short, deterministic check that none panics.

use std::path::Path;

/// Removes the targets' scratch under the temporary directory when the
/// replay ends, a failed one too.
struct Scratch;

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = sparrow_fuzz::remove_scratch();
    }
}

/// This process's scratch entries under the temporary directory.
fn scratch_entries() -> usize {
    let prefix = format!("sparrow-fuzz-{}-", std::process::id());
    std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .count()
}

#[test]
fn every_corpus_input_is_handled_without_a_panic() {
    let _cleanup = Scratch;
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut replayed = 0;
    for (target, run) in sparrow_fuzz::TARGETS {
        let corpus = fuzz.join("corpus").join(target);
        let mut inputs: Vec<_> = std::fs::read_dir(&corpus)
            .unwrap_or_else(|e| panic!("{}: {e}", corpus.display()))
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(!inputs.is_empty(), "{target}: no corpus");
        if let Ok(regressions) = std::fs::read_dir(fuzz.join("regressions").join(target)) {
            inputs.extend(regressions.flatten().map(|e| e.path()));
        }
        inputs.sort();
        for input in inputs {
            let data = std::fs::read(&input).expect("read input");
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{target}: {} panicked", input.display());
            replayed += 1;
        }
    }
    println!("replayed {replayed} inputs");
    // The targets' files are this test's to remove: none is left behind.
    assert!(scratch_entries() > 0, "the targets wrote no scratch: nothing to check");
    sparrow_fuzz::remove_scratch().expect("remove the targets' scratch");
    assert_eq!(scratch_entries(), 0, "scratch left under {}", std::env::temp_dir().display());
}
