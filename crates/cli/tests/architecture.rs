//! The shape of the code, checked the way rust-analyzer keeps its
//! architecture: module graphs without cycles, protobuf types only in the
//! gRPC layer, libraries that log through `tracing`, crates that inherit the
//! workspace's settings. Each check names the file and line it objects to.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Source lines that are code (not comments), with their 1-based numbers.
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(path).expect("read source");
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

/// The library crates (everything under `crates/` but the binary and the fuzz bodies).
fn library_crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .expect("crates")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("src/lib.rs").exists() && !p.ends_with("fuzz"))
        .collect();
    out.sort();
    out
}

/// A crate's top-level module (`src/x.rs` or `src/x/…`) of a source file.
fn top_module(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("in src");
    let first = rel.components().next().expect("a component").as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// The first cycle in a graph, as a path `a -> b -> … -> a`.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_modules_of_every_library_crate_form_no_cycle() {
    for krate in library_crates() {
        let src = krate.join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &files {
            let from = top_module(&src, file);
            if from == "lib" {
                continue;
            }
            let deps = graph.entry(from.clone()).or_default();
            for (_, line) in code_lines(file) {
                for part in line.split("crate::").skip(1) {
                    let to: String = part.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    let is_module = src.join(format!("{to}.rs")).exists() || src.join(&to).is_dir();
                    if is_module && to != from {
                        deps.insert(to);
                    }
                }
            }
        }
        assert_eq!(find_cycle(&graph), None, "{}: modules that use each other", krate.display());
    }
}

#[test]
fn protobuf_types_stay_in_the_grpc_layer() {
    let root = workspace();
    let grpc = root.join("crates/cluster/src/grpc");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    // The fuzz bodies and the wire benchmark feed bytes to the gRPC layer's codecs.
    let exempt = [grpc, root.join("crates/proto"), root.join("crates/fuzz"), root.join("crates/cluster/benches")];
    // Spelled in parts, so this file does not match itself.
    let (krate, module) = (["sparrow", "_proto"].concat(), ["pb", "::"].concat());
    for file in files.iter().filter(|f| !exempt.iter().any(|e| f.starts_with(e))) {
        for (n, line) in code_lines(file) {
            assert!(
                !line.contains(&krate) && !line.contains(&module),
                "{}:{n}: a protobuf type outside crates/cluster/src/grpc/: {}",
                file.display(),
                line.trim()
            );
        }
    }
    for krate in library_crates().iter().filter(|k| !k.ends_with("cluster") && !k.ends_with("proto")) {
        let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("manifest");
        assert!(
            !manifest.contains("sparrow-proto"),
            "{}: only sparrow-cluster may depend on sparrow-proto",
            krate.display()
        );
    }
}

#[test]
fn libraries_log_through_tracing() {
    for krate in library_crates() {
        let mut files = Vec::new();
        rust_files(&krate.join("src"), &mut files);
        for file in &files {
            for (n, line) in code_lines(file) {
                assert!(
                    !line.contains("eprintln!(") && !line.contains("println!("),
                    "{}:{n}: a library prints; use tracing: {}",
                    file.display(),
                    line.trim()
                );
            }
        }
    }
}

#[test]
fn every_crate_inherits_the_workspace_settings() {
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(workspace().join("crates")).expect("crates").flatten().map(|e| e.path()).collect();
    crates.sort();
    for krate in crates {
        let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("manifest");
        for needed in ["rust-version.workspace = true", "publish = false", "[lints]\nworkspace = true"] {
            assert!(manifest.contains(needed), "{}/Cargo.toml lacks `{needed}`", krate.display());
        }
    }
}

/// Every check of a shared token goes through `sparrow_core::token`
/// (constant time): no library compares a token or an `Authorization`
/// value with `==` or `!=`, where the time to refuse tells how much of a
/// guess was right.
#[test]
fn tokens_are_compared_in_constant_time() {
    let mut dirs: Vec<PathBuf> = library_crates().into_iter().map(|c| c.join("src")).collect();
    dirs.push(workspace().join("python/src"));
    let mut found = Vec::new();
    for src in dirs {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            for (n, line) in code_lines(&file) {
                let lower = line.to_ascii_lowercase();
                let compares = line.contains("==") || line.contains("!=");
                let about_tokens =
                    ["token", "bearer", "authorization", "expected.as_bytes"].iter().any(|w| lower.contains(w));
                if compares && about_tokens && !line.contains("sparrow_core::token") {
                    found.push(format!("{}:{n}: {}", file.display(), line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "compare tokens with sparrow_core::token::bearer_matches:\n{}", found.join("\n"));
}

/// Lines of a source file before its `#[cfg(test)]` module.
fn lines_before_tests(file: &Path) -> usize {
    let text = std::fs::read_to_string(file).expect("read source");
    text.lines().position(|l| l.starts_with("#[cfg(test)]")).unwrap_or_else(|| text.lines().count())
}

/// No source file past 900 lines before its tests (the house rule): a
/// file that grows past it is split by subsystem.
#[test]
fn no_source_file_is_past_900_lines_before_its_tests() {
    let mut files = Vec::new();
    for krate in std::fs::read_dir(workspace().join("crates")).expect("crates").flatten() {
        let src = krate.path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    let mut long: Vec<String> = files
        .iter()
        .map(|f| (f, lines_before_tests(f)))
        .filter(|(_, n)| *n > 900)
        .map(|(f, n)| format!("{}: {n} lines", f.display()))
        .collect();
    long.sort();
    assert!(long.is_empty(), "files past 900 lines before #[cfg(test)]:\n{}", long.join("\n"));
}

/// Handlers that run no role code: they await tokio's own primitives alone
/// (nothing that blocks a runtime thread), and on the blocking pool each
/// would hold a thread for its whole wait. `wait_change`: the roles'
/// doorbell, a `watch` channel awaited up to a bound.
const ASYNC_ONLY_HANDLERS: [&str; 1] = ["wait_change"];

/// Every gRPC handler hands its work to tokio's blocking pool (the role
/// types block: locks, disk, waiting for other workers), so no handler
/// stalls the runtime's threads that carry every other RPC.
#[test]
fn grpc_handlers_run_on_the_blocking_pool() {
    let mut files = Vec::new();
    rust_files(&workspace().join("crates/cluster/src/grpc"), &mut files);
    let mut handlers = 0;
    let mut inline = Vec::new();
    for file in &files {
        let lines = code_lines(file);
        for (i, (n, line)) in lines.iter().enumerate() {
            let Some(rest) = line.strip_prefix("    async fn ") else { continue };
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let body: Vec<&str> =
                lines[i + 1..].iter().map(|(_, l)| l.as_str()).take_while(|l| *l != "    }").collect();
            handlers += 1;
            if !body.iter().any(|l| l.contains("blocking(")) && !ASYNC_ONLY_HANDLERS.contains(&name.as_str()) {
                inline.push(format!("{}:{n} {name}", file.display()));
            }
        }
    }
    assert!(handlers >= 15, "found only {handlers} handlers: the parser no longer sees them");
    assert!(inline.is_empty(), "handlers that do not go through `blocking(`:\n{}", inline.join("\n"));
}

/// Where a library reads the environment, ends the process, or declares a
/// process-wide `static` (outside `thread_local!`, whose values are
/// per-thread scratch), as `file:line text`, in the code before the file's
/// tests.
fn process_wide_state(file: &Path) -> Vec<String> {
    let before = lines_before_tests(file);
    let mut in_thread_local = false;
    let mut found = Vec::new();
    for (n, line) in code_lines(file).into_iter().filter(|(n, _)| *n <= before) {
        let code = line.trim();
        if code.starts_with("thread_local!") {
            in_thread_local = true;
        } else if in_thread_local && code == "}" {
            in_thread_local = false;
        }
        let reads_env = ["env::var(", "env::var_os(", "env::vars(", "env::temp_dir(", "env::args(", "process::exit("]
            .iter()
            .any(|call| code.contains(call));
        let rest = code.strip_prefix("pub ").or_else(|| code.strip_prefix("pub(crate) ")).unwrap_or(code);
        let a_static = rest.starts_with("static ") && !rest.starts_with("static ref") && !in_thread_local;
        if reads_env || a_static {
            found.push(format!("{}:{n} {code}", file.display()));
        }
    }
    found
}

/// Libraries neither read the environment, nor end the process, nor keep
/// process-wide state:
/// the binary and the Python module read it at the edge and pass values
/// in (a failpoint's exit, the launcher's restart rules, the benchmark's
/// work directory, `SPARROW_SIMD` as `train.simd`).
#[test]
fn libraries_read_no_environment_and_hold_no_statics() {
    let mut found = Vec::new();
    for krate in library_crates() {
        let mut files = Vec::new();
        rust_files(&krate.join("src"), &mut files);
        for file in files {
            found.extend(process_wide_state(&file));
        }
    }
    found.sort();
    assert!(found.is_empty(), "environment reads or statics in library code:\n{}", found.join("\n"));
}

/// The finder sees a read of the environment, an exit and a static, and leaves
/// thread-local scratch, constants and test code alone.
#[test]
fn the_state_finder_sees_environment_reads_and_statics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("lib.rs");
    std::fs::write(
        &file,
        "const A: u32 = 1;\n\
         thread_local! {\n    static SCRATCH: Cell<u32> = Cell::new(0);\n}\n\
         fn f() {\n    static ONCE: OnceLock<bool> = OnceLock::new();\n    let _ = std::env::var(\"X\");\n}\n\
         pub static COUNT: AtomicU64 = AtomicU64::new(0);\n\
         fn die() { std::process::exit(137); }\n\
         #[cfg(test)]\nmod tests {\n    fn g() { let _ = std::env::temp_dir(); }\n}\n",
    )
    .expect("write");
    let found: Vec<String> = process_wide_state(&file)
        .iter()
        .map(|f| f.rsplit_once("lib.rs:").expect("located").1.split(' ').next().unwrap_or_default().to_string())
        .collect();
    assert_eq!(found, ["6", "7", "9", "10"]);
}

/// Kafka is behind one crate: no other manifest names the client.
#[test]
fn only_the_stream_crate_talks_to_kafka() {
    let mut dirs = library_crates();
    dirs.push(workspace().join("crates/cli"));
    dirs.push(workspace().join("python"));
    for krate in dirs.iter().filter(|k| !k.ends_with("stream")) {
        let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("manifest");
        assert!(!manifest.contains("rskafka"), "{}: only sparrow-stream may depend on rskafka", krate.display());
    }
    let stream = std::fs::read_to_string(workspace().join("crates/stream/Cargo.toml")).expect("manifest");
    assert!(stream.contains("rskafka"), "the finder looks at the manifests it means to");
}
