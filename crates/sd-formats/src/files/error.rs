//! [`FileError`]: everything that can go wrong reading a model file.

use std::io;
use std::path::{Path, PathBuf};

use sd_tensor::convert::ConvertError;
use thiserror::Error;

/// An error reading or loading a model file.
///
/// Every message names the file (its path as given when it was opened) and, where the problem
/// belongs to one tensor, that tensor. No input makes a reader panic: every problem ends up
/// here.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FileError {
    /// The operating system reported an error (open, stat, read, map).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The first bytes match none of the supported formats.
    #[error("{}: not a safetensors, GGUF or PyTorch (.ckpt/.pt/.pth) file", path.display())]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The file ends before a structure that it declares.
    #[error("{}: truncated: reading at byte {offset} needs bytes up to {end} but only {len} are available", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Where the read started.
        offset: u64,
        /// The end of the needed range.
        end: u64,
        /// The file (or section) length.
        len: u64,
    },
    /// A header that declares more bytes than a sane header has.
    #[error("{}: header of {len} bytes is larger than the limit of {limit}", path.display())]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// The declared length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// The file's structure is invalid (not tied to one tensor).
    #[error("{}: malformed: {detail}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// One tensor's description is invalid (bad shape, bad arguments, ...).
    #[error("{}: tensor `{tensor}`: {detail}", path.display())]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
    /// A tensor's element type is one sd-rs does not read (u8, bool, f8, ...).
    #[error("{}: tensor `{tensor}` has unsupported dtype {dtype}", path.display())]
    UnsupportedDType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype as the file names it.
        dtype: String,
    },
    /// A GGUF tensor with a ggml type id that sd-rs does not know.
    #[error("{}: tensor `{tensor}` has unknown or unsupported ggml type id {type_id}", path.display())]
    UnknownGgmlType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The type id in the file.
        type_id: u32,
    },
    /// A tensor's bytes lie (partly) outside the file or its section.
    #[error("{}: tensor `{tensor}`: bytes {offset}..{offset}+{size} lie outside the {limit} bytes available", path.display())]
    OutOfBounds {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Offset of the first byte.
        offset: u64,
        /// Byte count.
        size: u64,
        /// End of the region the bytes must lie in.
        limit: u64,
    },
    /// Two tensors' byte ranges overlap.
    #[error("{}: the bytes of tensors `{first}` and `{second}` overlap", path.display())]
    Overlap {
        /// The file.
        path: PathBuf,
        /// One tensor.
        first: String,
        /// The other.
        second: String,
    },
    /// The stored byte count does not match dtype and shape.
    #[error("{}: tensor `{tensor}` is stored in {actual} bytes but {dtype} x {shape:?} takes {expected}", path.display())]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Element type.
        dtype: sd_tensor::DType,
        /// Shape, outermost first.
        shape: Vec<u64>,
        /// Bytes the dtype and shape take.
        expected: u64,
        /// Bytes in the file.
        actual: u64,
    },
    /// A PyTorch tensor that is not contiguous (only contiguous tensors are read).
    #[error("{}: tensor `{tensor}` is not contiguous (shape {shape:?}, stride {stride:?})", path.display())]
    NonContiguous {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Shape.
        shape: Vec<u64>,
        /// Strides in elements.
        stride: Vec<u64>,
    },
    /// A pickle names a global outside the allowlist. Nothing is ever executed.
    #[error("{}: pickle refers to forbidden global `{module}.{name}` (not executed)", path.display())]
    ForbiddenGlobal {
        /// The file.
        path: PathBuf,
        /// The global's module.
        module: String,
        /// The global's name.
        name: String,
    },
    /// A pickle stream that the restricted VM cannot or will not run.
    #[error("{}: pickle at byte {offset}: {detail}", path.display())]
    Pickle {
        /// The file.
        path: PathBuf,
        /// Offset of the opcode in the pickle stream.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// A zip entry holding tensor data is compressed or encrypted: its bytes cannot be used
    /// in place.
    #[error("{}: zip entry `{entry}` is {method}; PyTorch storages must be stored uncompressed", path.display())]
    CompressedEntry {
        /// The file.
        path: PathBuf,
        /// The entry name.
        entry: String,
        /// The compression method (or "encrypted").
        method: String,
    },
    /// The zip container is invalid.
    #[error("{}: zip: {detail}", path.display())]
    Zip {
        /// The file.
        path: PathBuf,
        /// What the zip reader reported.
        detail: String,
    },
    /// A valid file using a feature sd-rs does not support (GGUF v1, big endian, ...).
    #[error("{}: unsupported: {detail}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is unsupported.
        detail: String,
    },
    /// The same tensor name twice in one file.
    #[error("{}: tensor `{tensor}` appears twice", path.display())]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor name that no opened file holds.
    #[error("tensor `{name}` is not in any opened model file")]
    NotFound {
        /// The name asked for.
        name: String,
    },
    /// A file id that the catalog did not hand out.
    #[error("no model file with id {0}")]
    NoSuchFile(crate::FileId),
    /// A rename produced the same name from two entries.
    #[error("{}: renaming produced `{name}` twice (from `{first}` and `{second}`)", path.display())]
    RenameCollision {
        /// The file holding the second entry.
        path: PathBuf,
        /// The produced name.
        name: String,
        /// The first source entry.
        first: String,
        /// The second source entry.
        second: String,
    },
    /// A dtype conversion failed while reading a tensor.
    #[error("{}: tensor `{tensor}`: {source}", path.display())]
    Convert {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The conversion error.
        #[source]
        source: ConvertError,
    },
    /// The file on disk changed since it was opened.
    #[error("{}: the file changed since it was opened ({detail})", path.display())]
    Changed {
        /// The file.
        path: PathBuf,
        /// What changed.
        detail: String,
    },
}

/// The file being read: its path (for messages) and length (for bounds).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx<'a> {
    pub path: &'a Path,
}

impl<'a> Ctx<'a> {
    pub fn new(path: &'a Path) -> Self {
        Ctx { path }
    }

    pub fn p(&self) -> PathBuf {
        self.path.to_path_buf()
    }

    pub fn io(&self, source: io::Error) -> FileError {
        FileError::Io {
            path: self.p(),
            source,
        }
    }

    pub fn malformed(&self, detail: impl Into<String>) -> FileError {
        FileError::Malformed {
            path: self.p(),
            detail: detail.into(),
        }
    }

    pub fn unsupported(&self, detail: impl Into<String>) -> FileError {
        FileError::Unsupported {
            path: self.p(),
            detail: detail.into(),
        }
    }

    pub fn bad_tensor(&self, tensor: &str, detail: impl Into<String>) -> FileError {
        FileError::BadTensor {
            path: self.p(),
            tensor: tensor.to_string(),
            detail: detail.into(),
        }
    }

    pub fn truncated(&self, offset: u64, end: u64, len: u64) -> FileError {
        FileError::Truncated {
            path: self.p(),
            offset,
            end,
            len,
        }
    }

    pub fn unsupported_dtype(&self, tensor: &str, dtype: impl Into<String>) -> FileError {
        FileError::UnsupportedDType {
            path: self.p(),
            tensor: tensor.to_string(),
            dtype: dtype.into(),
        }
    }

    pub fn duplicate(&self, tensor: &str) -> FileError {
        FileError::DuplicateTensor {
            path: self.p(),
            tensor: tensor.to_string(),
        }
    }
}
