//! Docs that cannot name what does not exist. Every backticked file path in
//! ARCHITECTURE.md, README.md and the book exists, and every backticked
//! name that looks like Rust (`Type`, `Type::item`, `module::item`, a
//! longer path) is defined in the workspace: a type, a module's item, a
//! type's method, field, variant or associated item, a protobuf message or
//! RPC, a Python exception the package defines. Names of other projects
//! (std, ONNX operators, Python's built-ins) are listed below. The index is
//! read from the source as tokens, without a compiler: generous (a name
//! defined anywhere in a module counts), never inventive.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// Names of other projects the docs may cite.
const OTHER_PROJECTS: &[&str] = &[
    // Rust's standard library and crates the workspace uses.
    "std",
    "core",
    "tokio",
    "tonic",
    "prost",
    "serde",
    "serde_json",
    "candle_core",
    "candle_nn",
    "rayon",
    "axum",
    "hyper",
    "hyper_util",
    "parking_lot",
    "crossbeam_channel",
    "clap",
    "anyhow",
    "schemars",
    "rskafka",
    "pyo3",
    "tracing",
    "libc",
    "mimalloc",
    "fail",
    "half",
    "memmap2",
    "xxhash_rust",
    "futures",
    "bytes",
    "prometheus",
    "signal_hook",
    "HashMap",
    "BTreeMap",
    "Vec",
    "Option",
    "Result",
    "Arc",
    "Mutex",
    "RwLock",
    "Condvar",
    "String",
    "JoinHandle",
    "CustomOp2",
    "NaN",
    // Python and its libraries.
    "np",
    "pd",
    "torch",
    "torchrec",
    "KeyboardInterrupt",
    "ValueError",
    "TypeError",
    "OSError",
    "EventAccumulator",
    // HTML.
    "IFrame",
    // ONNX operators.
    "StringSplit",
    "LabelEncoder",
    "Gather",
    "LayerNormalization",
    "PRelu",
    "Gelu",
    "Sigmoid",
    "ReduceSum",
    "MatMul",
];

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Punct(char),
}

/// `text` as identifiers and punctuation, comments and literals left out.
fn tokens(text: &str) -> Vec<Token> {
    let b = text.as_bytes();
    let (mut out, mut i) = (Vec::new(), 0);
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
            // A raw string: r"…", r#"…"#.
            let hashes = b[i + 1..].iter().take_while(|&&h| h == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
            i += 2 + hashes;
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
        } else if c == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3; // a char literal
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Token::Ident(text[start..i].to_string()));
        } else {
            if !c.is_ascii_whitespace() {
                out.push(Token::Punct(c as char));
            }
            i += 1;
        }
    }
    out
}

fn ident(t: Option<&Token>) -> Option<&str> {
    match t {
        Some(Token::Ident(s)) => Some(s),
        _ => None,
    }
}

/// The index of the tokens `from` (a `{`) to its matching `}`.
fn closing(t: &[Token], from: usize) -> usize {
    let mut depth = 0;
    for (j, tok) in t.iter().enumerate().skip(from) {
        match tok {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    t.len()
}

#[derive(Default)]
struct Index {
    /// Module → the items defined or re-exported in it.
    modules: BTreeMap<String, BTreeSet<String>>,
    /// Type → its fields, variants, methods and associated items.
    types: BTreeMap<String, BTreeSet<String>>,
}

const ITEMS: &[&str] = &["fn", "struct", "enum", "trait", "type", "const", "static", "mod", "union"];

impl Index {
    fn add_rust(&mut self, module: &str, text: &str) {
        let t = tokens(text);
        let items = self.modules.entry(module.to_string()).or_default();
        let mut i = 0;
        while i < t.len() {
            let Some(word) = ident(t.get(i)) else {
                i += 1;
                continue;
            };
            let next = ident(t.get(i + 1)).map(str::to_string);
            match word {
                w if ITEMS.contains(&w) => {
                    if let Some(name) = &next {
                        items.insert(name.clone());
                    }
                }
                "macro_rules" | "create_exception" => {
                    // `macro_rules! name`, pyo3's `create_exception!(module, Name, …)`.
                    let at = if word == "macro_rules" { i + 2 } else { i + 5 };
                    if let Some(name) = ident(t.get(at)) {
                        items.insert(name.to_string());
                    }
                }
                "use"
                    if i > 0 && ident(t.get(i - 1)).is_some_and(|p| p == "pub")
                        || matches!(t.get(i.wrapping_sub(1)), Some(Token::Punct(')'))) =>
                {
                    while i < t.len() && t[i] != Token::Punct(';') {
                        if let Some(name) = ident(t.get(i)) {
                            items.insert(name.to_string());
                        }
                        i += 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        // Inline modules, types' bodies and impl blocks.
        let mut i = 0;
        while i < t.len() {
            match ident(t.get(i)) {
                Some("mod") if t.get(i + 2) == Some(&Token::Punct('{')) => {
                    let name = ident(t.get(i + 1)).unwrap_or_default().to_string();
                    let end = closing(&t, i + 2);
                    let inner = self.modules.entry(name).or_default();
                    for k in i + 3..end {
                        if ident(t.get(k)).is_some_and(|w| ITEMS.contains(&w))
                            && let Some(n) = ident(t.get(k + 1))
                        {
                            inner.insert(n.to_string());
                        }
                    }
                }
                Some("struct" | "enum" | "trait" | "union") => {
                    let name = ident(t.get(i + 1)).unwrap_or_default().to_string();
                    let body = (i + 2..t.len()).find(|&k| matches!(t[k], Token::Punct('{') | Token::Punct(';')));
                    let members = self.types.entry(name).or_default();
                    if let Some(open) = body.filter(|&k| t[k] == Token::Punct('{')) {
                        let end = closing(&t, open);
                        let mut depth = 0;
                        for k in open..end {
                            match &t[k] {
                                // `->` and `=>` close nothing.
                                Token::Punct('>') if matches!(t.get(k - 1), Some(Token::Punct('-' | '='))) => {}
                                Token::Punct('{' | '(' | '[' | '<') => depth += 1,
                                Token::Punct('}' | ')' | ']' | '>') => depth -= 1,
                                Token::Ident(n) if depth == 1 => {
                                    let follows =
                                        matches!(t.get(k + 1), Some(Token::Punct(':' | '(' | '{' | ',' | '=' | '}')));
                                    if follows || t.get(k.wrapping_sub(1)) == Some(&Token::Ident("fn".into())) {
                                        members.insert(n.clone());
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                }
                // A type alias names a type (its members are the aliased type's).
                Some("type") if matches!(t.get(i + 2), Some(Token::Punct('=' | '<'))) => {
                    self.types.entry(ident(t.get(i + 1)).unwrap_or_default().to_string()).or_default();
                }
                Some("impl") => {
                    let Some(open) = (i + 1..t.len()).find(|&k| t[k] == Token::Punct('{')) else { break };
                    let head = &t[i + 1..open];
                    let after_for = head.iter().position(|x| *x == Token::Ident("for".into()));
                    let mut depth = 0;
                    let mut name = None;
                    for (k, tok) in head.iter().enumerate() {
                        match tok {
                            Token::Punct('<') => depth += 1,
                            Token::Punct('>') => depth -= 1,
                            Token::Ident(n)
                                if depth == 0
                                    && after_for.is_none_or(|f| k > f)
                                    && !["dyn", "mut", "where", "for", "impl"].contains(&n.as_str()) =>
                            {
                                name = Some(n.clone());
                                break;
                            }
                            _ => {}
                        }
                    }
                    let end = closing(&t, open);
                    // `impl Trait for Type`: the items are the type's and the trait's.
                    let implemented = after_for.and_then(|f| head[..f].iter().rev().find_map(|x| ident(Some(x))));
                    for owner in name.into_iter().chain(implemented.map(str::to_string)) {
                        let members = self.types.entry(owner).or_default();
                        for k in open..end {
                            if ident(t.get(k)).is_some_and(|w| ["fn", "const", "type"].contains(&w))
                                && let Some(n) = ident(t.get(k + 1))
                            {
                                members.insert(n.to_string());
                            }
                        }
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }

    /// A protobuf file: its messages, enums, services and RPCs are types.
    fn add_proto(&mut self, text: &str) {
        let t = tokens(text);
        for k in 0..t.len() {
            if ident(t.get(k)).is_some_and(|w| ["message", "enum", "service", "rpc"].contains(&w))
                && let Some(n) = ident(t.get(k + 1))
            {
                self.types.entry(n.to_string()).or_default();
            }
        }
    }

    fn is_module(&self, name: &str) -> bool {
        self.modules.contains_key(name) || ["crate", "self", "super"].contains(&name)
    }

    /// Whether `path` (`a::b::c`, or one `Type`) names something defined.
    fn resolves(&self, path: &[&str]) -> bool {
        let first = path[0];
        if OTHER_PROJECTS.contains(&first) {
            return true;
        }
        if path.len() == 1 {
            // A type, or an enum's variant named alone.
            return self.types.contains_key(first) || self.types.values().any(|m| m.contains(first));
        }
        if !self.is_module(first) && !self.types.contains_key(first) {
            return false;
        }
        path.windows(2).all(|w| {
            let (cur, next) = (w[0], w[1]);
            self.modules.get(cur).is_some_and(|items| items.contains(next))
                || self.types.get(cur).is_some_and(|members| members.contains(next))
                || (self.is_module(cur) && self.is_module(next))
        })
    }
}

/// The workspace's index: every crate's sources (a crate's root under its
/// package name and its directory's), the Python module's, the protobuf.
fn index() -> Index {
    let root = workspace();
    let mut index = Index::default();
    let mut roots: Vec<(PathBuf, Vec<String>)> = Vec::new();
    for entry in std::fs::read_dir(root.join("crates")).expect("crates").flatten() {
        let dir = entry.path();
        let Ok(manifest) = std::fs::read_to_string(dir.join("Cargo.toml")) else { continue };
        let package = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = ").map(|n| n.trim_matches('"').replace('-', "_")))
            .unwrap_or_default();
        let short = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        roots.push((dir.join("src"), vec![package, short]));
    }
    roots.push((root.join("python/src"), vec!["sparrow".into(), "sparrow_python".into()]));
    for (src, names) in roots {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("source");
            let stem = file.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
            let modules: Vec<String> = match stem.as_str() {
                "lib" | "main" if file.parent() == Some(src.as_path()) => names.clone(),
                "mod" => vec![
                    file.parent()
                        .and_then(Path::file_name)
                        .map(|n| n.to_string_lossy().to_string())
                        .unwrap_or_default(),
                ],
                _ => vec![stem],
            };
            for module in modules {
                index.add_rust(&module, &text);
            }
        }
    }
    for entry in std::fs::read_dir(root.join("crates/proto/proto")).expect("proto").flatten() {
        index.add_proto(&std::fs::read_to_string(entry.path()).expect("proto"));
    }
    // The Python package's own classes (its exceptions).
    for entry in std::fs::read_dir(root.join("python/sparrow")).expect("python").flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            if let Some(name) = line.strip_prefix("class ").and_then(|r| r.split(['(', ':']).next()) {
                index.types.entry(name.trim().to_string()).or_default();
            }
        }
    }
    index
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level directories a backticked repository path starts with.
const TOP_DIRS: &[&str] = &["crates/", "docs/", "scripts/", "python/", "configs/", "deploy/", "fuzz/", ".ci/"];

/// Every backticked name or path in `text` (outside fenced code blocks)
/// that names nothing: (line, what, why).
fn unresolved(text: &str, index: &Index, root: &Path, source_files: &[PathBuf]) -> Vec<(usize, String, &'static str)> {
    let mut bad = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for (k, span) in line.split('`').enumerate() {
            if k % 2 == 0 || span.is_empty() {
                continue;
            }
            let span = span.trim();
            let word = span.split_once('(').map_or(span, |(w, _)| w);
            if TOP_DIRS.iter().any(|d| word.starts_with(d)) {
                let path = word.trim_end_matches('/');
                if !path.contains(['*', '{', '<', ' ']) && !root.join(path).exists() {
                    bad.push((n + 1, span.to_string(), "no such file"));
                }
                continue;
            }
            // A source file by its name, or by the end of its path (`table/cache.rs`).
            if word.ends_with(".rs") && !word.contains([' ', '*']) {
                let tail = format!("/{word}");
                if !source_files.iter().any(|f| f.to_string_lossy().ends_with(&tail)) {
                    bad.push((n + 1, span.to_string(), "no such source file"));
                }
                continue;
            }
            let segments: Vec<&str> = word.split("::").collect();
            let rustlike = segments.iter().all(|s| {
                !s.is_empty()
                    && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !s.starts_with(|c: char| c.is_ascii_digit())
            });
            let camel = segments.len() == 1 && {
                let s = segments[0];
                s.starts_with(|c: char| c.is_ascii_uppercase())
                    && s.chars().any(|c| c.is_ascii_lowercase())
                    && s.chars().skip(1).any(|c| c.is_ascii_uppercase())
            };
            if rustlike && (segments.len() > 1 || camel) && !index.resolves(&segments) {
                bad.push((n + 1, span.to_string(), "not defined in the workspace"));
            }
        }
    }
    bad
}

fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![root.join("ARCHITECTURE.md"), root.join("README.md")];
    let book = root.join("docs/book/src");
    for entry in std::fs::read_dir(&book).expect("book").flatten() {
        let p = entry.path();
        // The configuration chapter too: generated, but its prose is written by hand.
        if p.extension().is_some_and(|e| e == "md") {
            docs.push(p);
        }
    }
    docs.sort();
    docs
}

fn all_sources(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("python"), &mut files);
    files
}

#[test]
fn the_docs_name_only_what_exists() {
    let root = workspace();
    let (index, sources) = (index(), all_sources(&root));
    let mut bad = Vec::new();
    for doc in documents(&root) {
        let text = std::fs::read_to_string(&doc).expect("doc");
        for (line, what, why) in unresolved(&text, &index, &root, &sources) {
            bad.push(format!("{}:{line}: `{what}`: {why}", doc.strip_prefix(&root).unwrap_or(&doc).display()));
        }
    }
    assert!(bad.is_empty(), "the docs name what does not exist:\n{}", bad.join("\n"));
}

/// The check itself: made-up names and paths are caught, real ones pass.
#[test]
fn a_made_up_name_or_path_is_caught() {
    let root = workspace();
    let (index, sources) = (index(), all_sources(&root));
    let text = "`roles::Link` `NotExportable` `loader::owner` `crates/cluster/src/nope.rs` `table.rs` \
                `EmbeddingTable::not_a_method`\n\
                `roles::run_shard` `EmbeddingTable` `EmbeddingTable::lru_cutoff` `crates/trainer/src/new_dir.rs` \
                `new_dir.rs` `table/cache.rs` `sparrow_core::config::json_schema` `Cell::List` `WritePart` \
                `std::fs::rename`";
    let found: Vec<String> = unresolved(text, &index, &root, &sources).into_iter().map(|(_, w, _)| w).collect();
    assert_eq!(
        found,
        [
            "roles::Link",
            "NotExportable",
            "loader::owner",
            "crates/cluster/src/nope.rs",
            "table.rs",
            "EmbeddingTable::not_a_method"
        ]
    );
}
