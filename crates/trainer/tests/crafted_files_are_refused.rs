//! Exports and checkpoints crafted by someone else are refused with an
//! error, never a panic, and never read outside their directory: a row
//! count that would wrap the size check, manifest names that climb out
//! (`../../etc/passwd`, `/dev/zero`), an absolute `base`, a LATEST or a file
//! that is a symlink.

mod common;

use sparrow_core::Overrides;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sparrow_trainer::checkpoint::{load_trainer, resolve};
use sparrow_trainer::export::{VectorType, load_export};

/// A trained checkpoint root (with filters.bin) and an export of it.
fn checkpoint_and_export(tmp: &Path) -> (PathBuf, PathBuf) {
    let data = tmp.join("data");
    common::small_data(&data, 1500, 300);
    let mut c = common::small_config(&data, "dlrm");
    let ck = tmp.join("ck");
    c.checkpoint.dir = Some(ck.display().to_string());
    // Rows that age: filters.bin lists each row's last use.
    c.embedding.ttl_steps = 1000;
    sparrow_trainer::train(&c, true).expect("train");
    let export = tmp.join("export");
    sparrow_trainer::run::export_checkpoint(&ck, &export, VectorType::F32).expect("export");
    (ck, export)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest")).expect("json")
}

fn write_manifest(dir: &Path, m: &Value) {
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec_pretty(m).expect("json")).expect("write");
}

/// Rewrites `name` in `dir` with `bytes`, its manifest entry corrected (a
/// crafted file passes the checksum).
fn craft(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).expect("write");
    let mut m = manifest(dir);
    m["files"][name] = serde_json::json!({
        "bytes": bytes.len(),
        "xxh3": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes)),
    });
    write_manifest(dir, &m);
}

/// The row count that makes `rows × record` wrap to the true size: records
/// of `2^a · odd` bytes repeat every `2^(64 − a)` rows.
fn wrapping_rows(true_rows: u64, record: u64) -> u64 {
    true_rows.wrapping_add(1u64 << (64 - record.trailing_zeros()))
}

#[test]
fn a_row_count_that_wraps_the_size_is_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (ck, export) = checkpoint_and_export(tmp.path());

    // The export: "SPRWEMB1", dim u32, rows u64; records of key + dim f32.
    let crafted = tmp.path().join("crafted-export");
    copy_dir(&export, &crafted);
    let mut bytes = std::fs::read(crafted.join("embeddings.bin")).expect("read");
    let dim = u64::from(u32::from_le_bytes(bytes[8..12].try_into().expect("4")));
    let rows = u64::from_le_bytes(bytes[12..20].try_into().expect("8"));
    let huge = wrapping_rows(rows, 8 + 4 * dim);
    assert_eq!(huge.wrapping_mul(8 + 4 * dim), rows * (8 + 4 * dim), "the count wraps to the true size");
    bytes[12..20].copy_from_slice(&huge.to_le_bytes());
    craft(&crafted, "embeddings.bin", &bytes);
    let e = load_export(&crafted, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("embeddings.bin") && e.contains(&format!("{huge} rows")), "{e}");

    // The checkpoint: "SPRWEMB…", dim u32, words u32, rows u64.
    let version = resolve(&ck).expect("version");
    let crafted = tmp.path().join("crafted-ck");
    copy_dir(&version, &crafted);
    let mut bytes = std::fs::read(crafted.join("embeddings.bin")).expect("read");
    let words = u64::from(u32::from_le_bytes(bytes[12..16].try_into().expect("4")));
    let rows = u64::from_le_bytes(bytes[16..24].try_into().expect("8"));
    bytes[16..24].copy_from_slice(&wrapping_rows(rows, 8 + 4 * words).to_le_bytes());
    craft(&crafted, "embeddings.bin", &bytes);
    let e = load_trainer(&crafted, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("embeddings.bin") && e.contains("row count"), "{e}");

    // filters.bin's row count of last uses (8 bytes each), after the sketches.
    let crafted = tmp.path().join("crafted-filters");
    copy_dir(&version, &crafted);
    let mut bytes = std::fs::read(crafted.join("filters.bin")).expect("read");
    let count = u64::from(u32::from_le_bytes(bytes[16..20].try_into().expect("4")));
    let len = u64::from(u32::from_le_bytes(bytes[20..24].try_into().expect("4")));
    let at = (24 + count * len) as usize;
    let age_rows = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
    bytes[at..at + 8].copy_from_slice(&wrapping_rows(age_rows, 8).to_le_bytes());
    craft(&crafted, "filters.bin", &bytes);
    let e = load_trainer(&crafted, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("filters.bin") && e.contains("row count"), "{e}");
}

#[test]
fn an_export_manifest_never_reads_outside_its_directory() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (_, export) = checkpoint_and_export(tmp.path());
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, "the content an attacker wants to learn").expect("secret");
    let outside = format!("../{}", secret.file_name().expect("name").to_string_lossy());
    let absolute = secret.display().to_string();
    let entry = serde_json::json!({"bytes": 1, "xxh3": "0000000000000000"});

    for name in [outside.as_str(), absolute.as_str(), "/dev/zero", "../../../../etc/passwd"] {
        let dir = tmp.path().join("crafted-name");
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&export, &dir);
        let mut m = manifest(&dir);
        m["files"][name] = entry.clone();
        write_manifest(&dir, &m);
        let e = load_export(&dir, &Overrides::none()).err().expect("refused").to_string();
        assert!(e.contains("plain file name"), "{name}: {e}");
        // Nothing of the file named is told: neither its size nor its hash.
        let size = std::fs::metadata(name.trim_start_matches("../")).map(|m| m.len().to_string());
        assert!(!e.contains("bytes on disk") && !e.contains("checksum"), "{name}: {e}");
        if let Ok(size) = size {
            assert!(!e.contains(&format!(" {size} ")), "{name}: {e}");
        }
    }

    // An absolute or climbing `base`.
    for base in [absolute.as_str(), "../export", "/"] {
        let dir = tmp.path().join("crafted-base");
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&export, &dir);
        let mut m = manifest(&dir);
        m["base"] = Value::String(base.to_string());
        write_manifest(&dir, &m);
        let e = load_export(&dir, &Overrides::none()).err().expect("refused").to_string();
        assert!(e.contains("`base`") && e.contains("plain file name"), "{base}: {e}");
    }

    // A listed file that is a symlink (even to a file of the right size and
    // checksum) or a device.
    let dir = tmp.path().join("crafted-link");
    copy_dir(&export, &dir);
    std::fs::rename(dir.join("embeddings.bin"), tmp.path().join("rows-elsewhere")).expect("move");
    std::os::unix::fs::symlink(tmp.path().join("rows-elsewhere"), dir.join("embeddings.bin")).expect("symlink");
    let e = load_export(&dir, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("embeddings.bin") && e.contains("symbolic link"), "{e}");

    // LATEST climbing out, or a symlink to /dev/zero: refused at once.
    let root = tmp.path().join("exports");
    std::fs::create_dir_all(&root).expect("root");
    std::fs::write(root.join("LATEST"), "../export\n").expect("latest");
    let e = load_export(&root, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("LATEST") && e.contains("plain file name"), "{e}");
    std::fs::remove_file(root.join("LATEST")).expect("rm");
    std::os::unix::fs::symlink("/dev/zero", root.join("LATEST")).expect("symlink");
    let e = load_export(&root, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("LATEST") && e.contains("symbolic link"), "{e}");
}

#[test]
fn a_checkpoint_manifest_never_reads_outside_its_directory() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (ck, _) = checkpoint_and_export(tmp.path());
    let version = resolve(&ck).expect("version");
    let entry = serde_json::json!({"bytes": 1, "xxh3": "0000000000000000"});
    type Edit<'a> = Box<dyn Fn(&mut Value) + 'a>;
    let edits: Vec<(&str, Edit)> = vec![
        ("a file", Box::new(|m: &mut Value| m["files"]["../../../../etc/passwd"] = entry.clone())),
        ("a device", Box::new(|m: &mut Value| m["files"]["/dev/zero"] = entry.clone())),
        ("a base", Box::new(|m: &mut Value| m["base"] = Value::String("/etc".into()))),
        (
            "a part",
            Box::new(|m: &mut Value| {
                m["parts"] = serde_json::json!([{"embeddings": "/dev/zero", "rows": 0, "clock": 0}])
            }),
        ),
    ];
    for (what, edit) in edits {
        let dir = tmp.path().join("crafted");
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&version, &dir);
        let mut m = manifest(&dir);
        edit(&mut m);
        write_manifest(&dir, &m);
        let e = load_trainer(&dir, &Overrides::none()).err().expect("refused").to_string();
        assert!(e.contains("plain file name"), "{what}: {e}");
    }
    // A checkpoint root whose LATEST is a symlink to /dev/zero.
    let root = tmp.path().join("root");
    std::fs::create_dir_all(&root).expect("root");
    std::os::unix::fs::symlink("/dev/zero", root.join("LATEST")).expect("symlink");
    let e = load_trainer(&root, &Overrides::none()).err().expect("refused").to_string();
    assert!(e.contains("LATEST") && e.contains("symbolic link"), "{e}");
}
