//! Model file readers and the tensor catalog.
//!
//! - [`safetensors`], [`gguf`] and [`torch`] (with its restricted [`pickle`] VM) read a file's
//!   header into [`TensorStorage`] entries: name, dtype, shape (outermost first) and the
//!   absolute byte range of the tensor in the file. They validate everything before returning
//!   (bounds, overlaps, sizes against dtype and shape, checked arithmetic) and never panic or
//!   allocate more than the file's size on any input.
//! - [`TensorCatalog`] (in [`catalog`]) is the catalog of every opened file's tensors: prefixes,
//!   renaming, reading (copying, converting, in parallel, or mapped without copies).
//!
//! Formats are recognised by their first bytes, not by their file names.

pub mod catalog;
pub mod diffusers_folder;
mod error;
pub mod gguf;
mod layout;
pub mod pickle;
pub mod safetensors;
pub mod sharded;
mod source;
pub mod torch;

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::Path;

pub use catalog::{CatalogOptions, FileRecord, LoadError, MappedTensor, TensorCatalog, TensorSink};
pub use error::FileError;
pub use gguf::{GgufArray, GgufHeader, GgufValue};
pub use layout::MAX_DIMS;
pub use pickle::GlobalPolicy;
pub use source::{FileSource, Source};

use crate::{FileId, TensorStorage};
use error::Ctx;

/// The on-disk format of a model file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileFormat {
    /// safetensors.
    Safetensors,
    /// GGUF v2 or v3.
    Gguf,
    /// PyTorch zip archive (`torch.save` since 1.6).
    TorchZip,
    /// PyTorch legacy format (a sequence of pickles and raw storages).
    TorchLegacy,
}

impl fmt::Display for FileFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileFormat::Safetensors => "safetensors",
            FileFormat::Gguf => "gguf",
            FileFormat::TorchZip => "pytorch-zip",
            FileFormat::TorchLegacy => "pytorch-legacy",
        })
    }
}

/// Format-specific header data kept besides the tensors.
#[derive(Clone, Debug, Default)]
pub enum FileMetadata {
    /// Nothing (PyTorch files).
    #[default]
    None,
    /// safetensors `__metadata__`.
    Safetensors(BTreeMap<String, String>),
    /// The GGUF header with its key-value metadata.
    Gguf(GgufHeader),
}

/// Options for reading files.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadOptions {
    /// What the pickle VM does with globals outside its allowlist.
    pub pickle_globals: GlobalPolicy,
}

/// One file's header, read and validated.
#[derive(Clone, Debug)]
pub struct ParsedFile {
    /// The format.
    pub format: FileFormat,
    /// Tensors in file order, with the [`FileId`] passed to the reader.
    pub tensors: Vec<TensorStorage>,
    /// Format-specific metadata.
    pub metadata: FileMetadata,
}

/// Recognises a format from a file's first bytes (at least 9 are needed for safetensors).
pub fn detect(head: &[u8]) -> Option<FileFormat> {
    if head.starts_with(gguf::MAGIC) {
        Some(FileFormat::Gguf)
    } else if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        Some(FileFormat::TorchZip)
    } else if head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]) {
        Some(FileFormat::TorchLegacy)
    } else if head.len() >= 9 && head[8] == b'{' {
        Some(FileFormat::Safetensors)
    } else {
        None
    }
}

/// Reads and validates the header of the model file at `path`.
pub fn read_file(path: &Path, file: FileId, opts: ReadOptions) -> Result<ParsedFile, FileError> {
    let ctx = Ctx::new(path);
    let f = File::open(path).map_err(|e| ctx.io(e))?;
    let src = FileSource::new(f).map_err(|e| ctx.io(e))?;
    parse(&src, path, file, opts)
}

/// Reads and validates a model file held by `src`; `path` is only used in messages.
pub fn parse(
    src: &dyn Source,
    path: &Path,
    file: FileId,
    opts: ReadOptions,
) -> Result<ParsedFile, FileError> {
    let ctx = Ctx::new(path);
    let _span = tracing::debug_span!("read_model_header", path = %path.display()).entered();
    let mut head = [0u8; 16];
    let n = (src.len().min(16)) as usize;
    src.read_at(0, &mut head[..n]).map_err(|e| ctx.io(e))?;
    let format = detect(&head[..n]).ok_or(FileError::UnknownFormat {
        path: path.to_path_buf(),
    })?;
    let (tensors, metadata) = match format {
        FileFormat::Safetensors => {
            let st = safetensors::read(src, ctx, file)?;
            (st.tensors, FileMetadata::Safetensors(st.metadata))
        }
        FileFormat::Gguf => {
            let g = gguf::read(src, ctx, file)?;
            (g.tensors, FileMetadata::Gguf(g.header))
        }
        FileFormat::TorchZip => (
            torch::read_zip(src, ctx, file, opts.pickle_globals)?,
            FileMetadata::None,
        ),
        FileFormat::TorchLegacy => (
            torch::read_legacy(src, ctx, file, opts.pickle_globals)?,
            FileMetadata::None,
        ),
    };
    tracing::debug!(format = %format, tensors = tensors.len(), "read model header");
    Ok(ParsedFile {
        format,
        tensors,
        metadata,
    })
}
