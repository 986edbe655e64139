//! Directories Sparrow writes and removes. A new directory a command
//! writes (an export, an ONNX graph): `out` is
//! resolved first (its parent's real path, its own name never `..`), must
//! not exist in any form (a file, a directory, a link, a dangling one), and
//! is written under a staging name of this process's beside it, then renamed
//! into place without replacing anything. A failed or stopped command
//! leaves nothing: the staging directory is removed on every error path.
//! Removing one (a checkpoint version past `checkpoint.keep`, an old
//! export) removes the files it wrote, never what someone else put there.

use std::path::{Component, Path, PathBuf};

use crate::error::TrainError;

/// A directory being written; [`commit`](NewDir::commit) puts it in place,
/// dropping it uncommitted removes what was written.
pub struct NewDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
}

impl NewDir {
    /// Stages `out`, as `flag` gave it (named in the errors).
    pub fn create(out: &Path, flag: &'static str) -> Result<NewDir, TrainError> {
        let refuse = |message: &str| TrainError::Argument {
            flag,
            value: out.display().to_string(),
            message: message.to_string(),
        };
        let Some(Component::Normal(name)) = out.components().next_back() else {
            return Err(refuse("does not end in a name (it ends in `..`, `.` or `/`): name the new directory itself"));
        };
        let name = name.to_os_string();
        let exists = "exists already (a file, a directory or a link): Sparrow writes a new directory, never over \
                      anything";
        if out.symlink_metadata().is_ok() {
            return Err(refuse(exists));
        }
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(parent).map_err(|e| TrainError::io(parent, e))?;
        let parent = parent.canonicalize().map_err(|e| TrainError::io(parent, e))?;
        let target = parent.join(&name);
        if target.symlink_metadata().is_ok() {
            return Err(refuse(exists));
        }
        remove_stale_staging(&parent, &name.to_string_lossy());
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let staging = parent.join(format!(".{}.staging-{}-{nanos:08x}", name.to_string_lossy(), std::process::id()));
        // `create_dir`, not `create_dir_all`: a name that exists is never reused.
        std::fs::create_dir(&staging).map_err(|e| TrainError::io(&staging, e))?;
        Ok(NewDir { target, staging, committed: false })
    }

    /// Where the files go until the commit.
    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// Where the directory ends up.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the staged directory to its name, failing (the staging
    /// removed) if something took the name meanwhile.
    pub fn commit(mut self) -> Result<PathBuf, TrainError> {
        rename_no_replace(&self.staging, &self.target).map_err(|e| TrainError::io(&self.target, e))?;
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for NewDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Removes the files named `names` (plain names) from `dir`, then `dir` if
/// that empties it. Anything else in it (an export a user wrote there) is
/// kept, and so is the directory, with a warning naming what stays.
pub fn remove_written<'a>(dir: &Path, names: impl IntoIterator<Item = &'a str>) -> Result<(), TrainError> {
    for name in names {
        let path = dir.join(crate::confined::plain_name(dir, name, "the manifest")?);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(TrainError::io(&path, e)),
            _ => {}
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
            let mut left: Vec<String> = std::fs::read_dir(dir)
                .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect())
                .unwrap_or_default();
            left.sort();
            tracing::warn!(
                "kept {}: it holds files Sparrow did not write there ({}); its own are removed",
                dir.display(),
                left.join(", ")
            );
            Ok(())
        }
        Err(e) => Err(TrainError::io(dir, e)),
    }
}

/// The staging directories of `name` that processes no longer running left
/// (killed before they could remove them).
fn remove_stale_staging(parent: &Path, name: &str) {
    let prefix = format!(".{name}.staging-");
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().to_string();
        let Some(pid) = file.strip_prefix(&prefix).and_then(|r| r.split('-').next()) else { continue };
        let gone = pid.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `from` renamed to `to`, only if `to` does not exist (a plain rename
/// would replace an empty directory there).
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
        let (from_c, to_c) = (c(from)?, c(to)?);
        #[expect(unsafe_code, reason = "FFI call: renameat2, which std does not wrap")]
        // SAFETY: both arguments are NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::renameat2(libc::AT_FDCWD, from_c.as_ptr(), libc::AT_FDCWD, to_c.as_ptr(), libc::RENAME_NOREPLACE)
        };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        // A filesystem without the flag: checked, then renamed.
        if !matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
            return Err(e);
        }
    }
    if to.symlink_metadata().is_ok() {
        return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "exists already"));
    }
    std::fs::rename(from, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .expect("read_dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        n.sort();
        n
    }

    /// `prod/v2/..` names `prod` itself: refused, and `prod/model.onnx` is
    /// untouched; a name that exists in any form is refused; nothing is
    /// left behind by a refusal or an uncommitted directory.
    #[test]
    fn an_out_that_names_something_else_or_exists_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let prod = tmp.path().join("prod");
        std::fs::create_dir(&prod).expect("prod");
        std::fs::write(prod.join("model.onnx"), "PRODUCTION").expect("write");
        std::os::unix::fs::symlink(tmp.path().join("nowhere"), tmp.path().join("dangling")).expect("link");
        for out in [prod.join("v2/.."), tmp.path().join("nonexist/.."), prod.clone(), prod.join("model.onnx")] {
            let e = NewDir::create(&out, "--out").err().expect("refused").to_string();
            assert!(e.starts_with("--out ") && (e.contains("ends in `..`") || e.contains("exists already")), "{e}");
        }
        let e = NewDir::create(&tmp.path().join("dangling"), "--out").err().expect("refused").to_string();
        assert!(e.contains("exists already"), "a dangling link counts: {e}");
        assert_eq!(std::fs::read_to_string(prod.join("model.onnx")).expect("read"), "PRODUCTION");
        assert_eq!(names(&prod), ["model.onnx"]);

        let new = NewDir::create(&tmp.path().join("a/b/export"), "--out").expect("new");
        std::fs::write(new.staging().join("f"), "x").expect("write");
        drop(new);
        assert!(names(&tmp.path().join("a/b")).is_empty(), "an uncommitted directory is removed");
        let new = NewDir::create(&tmp.path().join("a/b/export"), "--out").expect("new");
        std::fs::write(new.staging().join("f"), "x").expect("write");
        let done = new.commit().expect("commit");
        assert_eq!(names(&tmp.path().join("a/b")), ["export"]);
        assert_eq!(names(&done), ["f"]);
    }

    /// An empty directory that appears under the name while the export is
    /// written is not replaced (a plain rename would replace it).
    #[test]
    fn the_commit_never_replaces_what_took_the_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let out = tmp.path().join("export");
        let new = NewDir::create(&out, "--out").expect("new");
        std::fs::create_dir(&out).expect("someone else's");
        std::fs::write(new.staging().join("f"), "x").expect("write");
        let e = new.commit().expect_err("refused").to_string();
        assert!(e.contains("xists"), "{e}");
        assert!(names(&out).is_empty(), "theirs is untouched");
        assert_eq!(names(tmp.path()), ["export"], "the staging is removed");
    }
}
