//! Output files, checked before any work and written safely.
//!
//! - `-o -` writes to standard output.
//! - A character device or a FIFO at the path (`/dev/null`, a named pipe) is written in
//!   place, never replaced.
//! - Anything else is written to a fresh temporary file in the same directory (created with
//!   `O_CREAT | O_EXCL` under a random name by the `tempfile` crate, so a planted symlink is
//!   never followed), then renamed over the path; an existing file's permissions are kept,
//!   and the temporary file is removed on every error.
//! - The directory must exist and be writable, the name must fit the file system and end in
//!   `.png`, `.jpg`/`.jpeg` or `.webp`: the format written ([`crate::encode`]). Standard
//!   output and devices get PNG unless their name asks for another format.

use std::ffi::OsString;
use std::fs::{self, OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The longest file name (bytes) most file systems take (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// An output problem, found before any work (a usage error) or when writing.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The path cannot be an output (a usage error: exit code 2).
    #[error("-o/--output: {0}")]
    Invalid(String),
    /// Writing failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The output.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where an image goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Standard output (`-o -`).
    Stdout,
    /// A character device or FIFO, written in place; every image of a batch goes to it.
    InPlace(PathBuf),
    /// A regular file (existing or not), replaced atomically; image `i > 0` of a batch goes
    /// to `STEM_{i+1}.EXT`.
    File(PathBuf),
}

impl Target {
    /// The format written: the file name's, PNG for standard output and names without one.
    pub fn format(&self) -> crate::encode::Format {
        match self {
            Target::Stdout => crate::encode::Format::Png,
            Target::InPlace(p) | Target::File(p) => {
                crate::encode::Format::from_path(p).unwrap_or(crate::encode::Format::Png)
            }
        }
    }

    /// A display name for messages.
    pub fn display(&self, i: usize) -> String {
        match self {
            Target::Stdout => "<stdout>".into(),
            Target::InPlace(p) => p.display().to_string(),
            Target::File(p) => numbered(p, i).display().to_string(),
        }
    }
}

/// The path of image `i` of a batch: `path` for the first, then `STEM_2.EXT`, ...
pub fn numbered(path: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return path.to_path_buf();
    }
    let mut name = OsString::from(path.file_stem().unwrap_or_default());
    name.push(format!("_{}", i + 1));
    if let Some(ext) = path.extension() {
        name.push(".");
        name.push(ext);
    }
    path.with_file_name(name)
}

fn invalid(msg: String) -> OutputError {
    OutputError::Invalid(msg)
}

/// The directory a file is written in.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Checks an output path before any work; `count` images will be written (a batch adds
/// `_N` to the name). Probes the directory by creating and removing a temporary file.
pub fn check(path: &Path, count: usize) -> Result<Target, OutputError> {
    if path.as_os_str() == "-" {
        return Ok(Target::Stdout);
    }
    let shown = path.display();
    if let Ok(meta) = fs::symlink_metadata(path) {
        let ft = meta.file_type();
        if ft.is_dir() {
            return Err(invalid(format!("{shown} is a directory")));
        }
        if ft.is_char_device() || ft.is_fifo() {
            return Ok(Target::InPlace(path.to_path_buf()));
        }
        if ft.is_block_device() || ft.is_socket() {
            return Err(invalid(format!(
                "{shown} is a block device or socket; name a regular file, a FIFO or -"
            )));
        }
        if ft.is_file() && meta.permissions().readonly() {
            return Err(invalid(format!("{shown} is read-only")));
        }
        // A symlink is replaced by the new file; its target is left alone.
    }
    let Some(name) = path.file_name() else {
        return Err(invalid(format!("{shown} names no file")));
    };
    if crate::encode::Format::from_path(path).is_none() {
        return Err(invalid(format!(
            "{shown}: the name must end in .png, .jpg, .jpeg or .webp (the formats sd writes)"
        )));
    }
    let longest = numbered(path, count.saturating_sub(1));
    let longest_len = longest.file_name().map_or(name.len(), |n| n.len());
    if longest_len > NAME_MAX {
        return Err(invalid(format!(
            "the file name is {longest_len} bytes; at most {NAME_MAX} fit"
        )));
    }
    let dir = parent_dir(path);
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(invalid(format!("{} is not a directory", dir.display()))),
        Err(_) => {
            return Err(invalid(format!(
                "cannot write {shown}: the directory {} does not exist",
                dir.display()
            )))
        }
    }
    // The one real test of writability (permissions, read-only mounts, root).
    tempfile::Builder::new()
        .prefix(".sd-probe.")
        .tempfile_in(dir)
        .map_err(|e| {
            invalid(format!(
                "cannot write {shown}: the directory {} is not writable ({e})",
                dir.display()
            ))
        })?;
    Ok(Target::File(path.to_path_buf()))
}

/// Writes `bytes` as image `i` of `target`.
pub fn write(target: &Target, i: usize, bytes: &[u8]) -> Result<(), OutputError> {
    let err = |source| OutputError::Write {
        path: target.display(i),
        source,
    };
    match target {
        Target::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|_| out.flush()).map_err(err)
        }
        Target::InPlace(path) => write_in_place(path, bytes).map_err(err),
        Target::File(path) => write_file(&numbered(path, i), bytes).map_err(err),
    }
}

fn write_in_place(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // No `create`, no `truncate`: a device or FIFO is written, never made.
    let mut f = OpenOptions::new().write(true).open(path)?;
    f.write_all(bytes)?;
    f.flush()
}

fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // What is at the path now (it may have changed since `check`).
    let existing = fs::symlink_metadata(path).ok();
    if let Some(m) = &existing {
        let ft = m.file_type();
        if ft.is_char_device() || ft.is_fifo() {
            return write_in_place(path, bytes);
        }
        if !(ft.is_file() || ft.is_symlink()) {
            return Err(std::io::Error::other(
                "not a regular file (a directory, block device or socket appeared)",
            ));
        }
    }
    let mode = match &existing {
        Some(m) if m.file_type().is_file() => m.permissions().mode() & 0o7777,
        // A new file: rw for all, less the umask (applied by open).
        _ => 0o666,
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(Permissions::from_mode(mode))
        .tempfile_in(parent_dir(path))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    if existing.as_ref().is_some_and(|m| m.file_type().is_file()) {
        // open() applied the umask; an existing file's mode is kept exactly.
        fs::set_permissions(tmp.path(), Permissions::from_mode(mode))?;
    }
    // On failure the temporary file is dropped, which removes it.
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_names() {
        assert_eq!(numbered(Path::new("a/b.png"), 0), Path::new("a/b.png"));
        assert_eq!(numbered(Path::new("a/b.png"), 2), Path::new("a/b_3.png"));
    }

    #[test]
    fn keeps_mode_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.png");
        fs::write(&path, b"old").unwrap();
        fs::set_permissions(&path, Permissions::from_mode(0o640)).unwrap();
        let t = check(&path, 1).unwrap();
        write(&t, 0, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    use crate::encode::Format;

    #[test]
    fn refusals() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["x.gif", "x", "x.txt", "x.png.bak"] {
            assert!(check(&dir.path().join(name), 1).is_err(), "{name}");
        }
        for (name, format) in [
            ("x.png", Format::Png),
            ("x.JPG", Format::Jpeg),
            ("x.jpeg", Format::Jpeg),
            ("x.webp", Format::WebP),
        ] {
            assert_eq!(check(&dir.path().join(name), 1).unwrap().format(), format);
        }
        assert_eq!(Target::Stdout.format(), Format::Png);
        assert!(check(dir.path(), 1).is_err());
        let long = "a".repeat(260) + ".png";
        assert!(check(&dir.path().join(long), 1).is_err());
        assert!(check(&dir.path().join("none/x.png"), 1).is_err());
        assert_eq!(check(Path::new("-"), 1).unwrap(), Target::Stdout);
        assert_eq!(
            check(Path::new("/dev/null"), 1).unwrap(),
            Target::InPlace("/dev/null".into())
        );
    }
}
