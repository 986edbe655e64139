//! One run per checkpoint directory: an exclusive advisory lock (`flock`) on
//! `DIR/.lock`, held for the whole run. Two runs sharing a directory would
//! prune each other's versions and temporaries; the second is refused,
//! naming the first one's PID. The lock dies with its process, so a crash
//! never leaves the directory locked.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::TrainError;

const LOCK_FILE: &str = ".lock";

/// Held while a run may write into a checkpoint directory; released on drop.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    pub dir: PathBuf,
}

impl DirLock {
    /// Creates `dir` if needed and locks it. `key` names the setting the
    /// directory came from, for the error. Also proves the directory is
    /// writable before any training starts, and removes the temporaries of
    /// runs that died while writing a checkpoint (no one else can be
    /// writing them now).
    pub fn acquire(dir: &Path, key: &str) -> Result<DirLock, TrainError> {
        let refuse = |what: String| TrainError::checkpoint(dir, format!("{key}: {what}"));
        std::fs::create_dir_all(dir).map_err(|e| refuse(format!("cannot create the directory: {e}")))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| refuse(format!("cannot write in the directory ({}: {e})", path.display())))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "unknown".to_string() } else { holder.to_string() };
                return Err(refuse(format!(
                    "in use by another run (pid {holder}); two runs in one checkpoint directory would delete \
                     each other's checkpoints: give this run its own {key}"
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(refuse(format!("cannot lock {}: {e}", path.display()))),
        }
        let pid = std::process::id();
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{pid}"))
            .and_then(|()| file.flush())
            .map_err(|e| refuse(format!("cannot write {}: {e}", path.display())))?;
        remove_stale_temporaries(dir);
        Ok(DirLock { _file: file, dir: dir.to_path_buf() })
    }
}

/// `.tmp-ckpt-*` and `.LATEST.tmp-*` of earlier runs (a full disk or a kill
/// interrupted them): never read, only in the way.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with(".tmp-ckpt-") {
            let _ = std::fs::remove_dir_all(entry.path());
        } else if name.starts_with(".LATEST.tmp-") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("ck");
        std::fs::create_dir_all(dir.join(".tmp-ckpt-000000000004-999")).expect("stale temp");
        let first = DirLock::acquire(&dir, "checkpoint.dir").expect("first");
        assert!(!dir.join(".tmp-ckpt-000000000004-999").exists(), "stale temporary removed");
        // flock is per open file: a second open in this process conflicts too.
        let err = DirLock::acquire(&dir, "checkpoint.dir").expect_err("second");
        let msg = err.to_string();
        assert!(msg.contains(&format!("pid {}", std::process::id())) && msg.contains("checkpoint.dir"), "{msg}");
        drop(first);
        DirLock::acquire(&dir, "checkpoint.dir").expect("free again");
    }
}
