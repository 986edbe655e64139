//! Reading the files a checkpoint's or an export's manifest (or `LATEST`)
//! names, without ever reading outside the directory or past the sizes the
//! manifest gives: a name is a plain file name (no `/`, no `..`, not
//! absolute), only a regular file is opened (no symlink, FIFO or device:
//! `/dev/zero` would never end), and no more bytes are read than were
//! expected. A file that breaks a rule is refused by its name alone, before
//! any of its content is read (no size or checksum of another file is ever
//! reported).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::TrainError;

/// `LATEST` names a directory: a few bytes.
const MAX_LATEST_BYTES: u64 = 4096;
/// A manifest holds the job's config and a file list: kilobytes; this is
/// far past any real one.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// Refuses a name that is not one plain file name inside its directory.
pub fn plain_name<'a>(dir: &Path, name: &'a str, what: &str) -> Result<&'a str, TrainError> {
    let plain = !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !name.chars().any(char::is_control);
    if plain {
        Ok(name)
    } else {
        Err(TrainError::checkpoint(
            dir,
            format!(
                "{what} names {:?}: only a plain file name inside the directory is read (no `/`, `..` or \
                 absolute path)",
                shown(name)
            ),
        ))
    }
}

/// A name as shown in an error: at most 80 characters, control bytes escaped.
fn shown(name: &str) -> String {
    let mut out: String = name.chars().take(80).flat_map(char::escape_debug).collect();
    if name.chars().count() > 80 {
        out.push('…');
    }
    out
}

/// Opens `dir/name` for reading if it is a regular file (not following a
/// symlink, never blocking on a FIFO); its size.
pub fn open_regular(dir: &Path, name: &str) -> Result<(File, u64, PathBuf), TrainError> {
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => TrainError::checkpoint(&path, "is a symbolic link: only regular files are read"),
            _ => TrainError::io(&path, e),
        })?;
    let meta = file.metadata().map_err(|e| TrainError::io(&path, e))?;
    if !meta.file_type().is_file() {
        return Err(TrainError::checkpoint(&path, "is not a regular file: only regular files are read"));
    }
    Ok((file, meta.len(), path))
}

/// The whole of `dir/name`, a regular file of at most `max` bytes.
pub fn read_at_most(dir: &Path, name: &str, max: u64) -> Result<Vec<u8>, TrainError> {
    let (file, len, path) = open_regular(dir, name)?;
    if len > max {
        return Err(TrainError::checkpoint(&path, format!("{len} bytes: larger than any such file ({max} at most)")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // `take`: a file that grows while read still yields at most `max` bytes.
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| TrainError::io(&path, e))?;
    if bytes.len() as u64 > max {
        return Err(TrainError::checkpoint(&path, format!("grew past {max} bytes while read")));
    }
    Ok(bytes)
}

/// The whole of `dir/name`, which the manifest says is `expected` bytes: a
/// file of another size is refused before it is read.
pub fn read_exact_size(dir: &Path, name: &str, expected: u64) -> Result<Vec<u8>, TrainError> {
    let (file, len, path) = open_regular(dir, name)?;
    if len != expected {
        return Err(TrainError::checkpoint(
            &path,
            format!("truncated or damaged: {len} bytes on disk, the manifest says {expected}"),
        ));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(expected).read_to_end(&mut bytes).map_err(|e| TrainError::io(&path, e))?;
    if bytes.len() as u64 != expected {
        return Err(TrainError::checkpoint(&path, format!("{} bytes read, the manifest says {expected}", bytes.len())));
    }
    Ok(bytes)
}

/// What `dir/LATEST` names (a plain name, checked), or None without a LATEST.
pub fn read_latest(dir: &Path) -> Result<Option<String>, TrainError> {
    match std::fs::symlink_metadata(dir.join("LATEST")) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        _ => {}
    }
    let bytes = read_at_most(dir, "LATEST", MAX_LATEST_BYTES)?;
    let latest = dir.join("LATEST");
    let text = std::str::from_utf8(&bytes).map_err(|_| TrainError::checkpoint(&latest, "is not UTF-8 text"))?;
    let name = text.trim();
    plain_name(dir, name, "LATEST")?;
    Ok(Some(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_pass() {
        let dir = Path::new("/x");
        for good in ["embeddings.bin", "part-0.emb", "000000000008", "ckpt-1", ".hidden"] {
            assert!(plain_name(dir, good, "a manifest").is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "../x", "/etc/passwd", "a/b", "a\\b", "a\0b", "a\nb", &"x".repeat(256)] {
            let e = plain_name(dir, bad, "a manifest").expect_err(bad).to_string();
            assert!(e.contains("plain file name"), "{e}");
        }
    }

    #[test]
    fn only_regular_files_are_read_and_never_past_their_size() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path();
        std::fs::write(dir.join("f"), b"12345").expect("write");
        assert_eq!(read_exact_size(dir, "f", 5).expect("read"), b"12345");
        let e = read_exact_size(dir, "f", 4).expect_err("size").to_string();
        assert!(e.contains("5 bytes on disk, the manifest says 4"), "{e}");
        assert!(read_at_most(dir, "f", 4).expect_err("too big").to_string().contains("larger than"));
        std::os::unix::fs::symlink(dir.join("f"), dir.join("link")).expect("symlink");
        assert!(read_at_most(dir, "link", 10).expect_err("link").to_string().contains("symbolic link"));
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).expect("symlink");
        assert!(read_at_most(dir, "zero", 10).is_err());
        assert!(open_regular(Path::new("/dev"), "zero").expect_err("device").to_string().contains("regular file"));
        std::fs::create_dir(dir.join("d")).expect("dir");
        assert!(read_at_most(dir, "d", 10).expect_err("dir").to_string().contains("regular file"));
    }

    #[test]
    fn latest_names_a_plain_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path();
        assert_eq!(read_latest(dir).expect("none"), None);
        std::fs::write(dir.join("LATEST"), "000000000008\n").expect("write");
        assert_eq!(read_latest(dir).expect("read").as_deref(), Some("000000000008"));
        std::fs::write(dir.join("LATEST"), "../../etc\n").expect("write");
        assert!(read_latest(dir).expect_err("escape").to_string().contains("plain file name"));
        std::fs::remove_file(dir.join("LATEST")).expect("rm");
        std::os::unix::fs::symlink("/dev/zero", dir.join("LATEST")).expect("symlink");
        assert!(read_latest(dir).expect_err("a link to /dev/zero").to_string().contains("symbolic link"));
    }
}
