//! The config reference cannot go stale: the shipped JSON Schema and the
//! book's configuration chapter are exactly what the binary generates from
//! the config's types (`scripts/generate-docs` rewrites both).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn generated(flag: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sparrow")).args(["config", flag]).output().expect("sparrow runs");
    assert!(out.status.success(), "sparrow config {flag}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8")
}

fn assert_current(flag: &str, file: &str) {
    let path = repo().join(file);
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let fresh = generated(flag);
    if committed != fresh {
        let line = committed.lines().zip(fresh.lines()).position(|(a, b)| a != b).map_or_else(
            || format!("the lengths differ ({} and {} lines)", committed.lines().count(), fresh.lines().count()),
            |i| format!("first difference at line {}", i + 1),
        );
        panic!("{file} is stale ({line}): run scripts/generate-docs and commit the result");
    }
}

#[test]
fn the_shipped_schema_is_what_the_config_types_generate() {
    assert_current("--schema", "docs/book/src/config.schema.json");
    let schema: serde_json::Value = serde_json::from_str(&generated("--schema")).expect("the schema is JSON");
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-07/schema#");
}

#[test]
fn the_books_configuration_chapter_is_what_the_config_types_generate() {
    assert_current("--reference", "docs/book/src/configuration.md");
    let chapter = generated("--reference");
    // Every table, nested and repeated ones included, has its section.
    for heading in [
        "## `[data]`",
        "## `[data.stream]`",
        "## `[[data.schema.sequence]]`",
        "## `[[model.tasks]]`",
        "## `[cluster.lazy]`",
    ] {
        assert!(chapter.contains(heading), "{heading} missing");
    }
    // A key's entry holds its description, type, default and values.
    let entry = &chapter[chapter.find("### `model.kind`").expect("model.kind")..];
    let entry = &entry[..entry[3..].find("\n### ").expect("next key")];
    for part in ["The dense network", "- Default: `\"dlrm\"`", "  - `\"din\"`: ", "- Type: "] {
        assert!(entry.contains(part), "{part:?} missing from {entry}");
    }
}

/// The book's table of kinds (docs/book/src/models.md) names every kind of
/// the registry, and no kind the registry lacks.
#[test]
fn the_book_lists_every_registered_kind() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let book = std::fs::read_to_string(root.join("docs/book/src/models.md")).expect("models.md");
    let listed: Vec<&str> = book
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| *name != "model.kind")
        .collect();
    assert_eq!(listed, sparrow_model::kinds::names(), "models.md's table against the registry");
}
