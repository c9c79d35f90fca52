//! The tensor storage map entry shared by file readers, name conversion and loading.

use std::fmt;

use sd_tensor::DType;

/// Identifies one opened model file in a catalog (index into the catalog's file list).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId(pub u32);

impl fmt::Display for FileId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file#{}", self.0)
    }
}

/// Where one tensor's bytes are in a model file.
///
/// `shape` is outermost dimension first (PyTorch order) for every file format; GGUF's `ne`
/// order is reversed when read. `offset` is the absolute byte offset in the file and `size`
/// the byte count, `dtype.bytes_for(numel)` for contiguous tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorStorage {
    /// Full dotted name, after any prefix and name conversion.
    pub name: String,
    /// Element type as stored in the file.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// The file holding the bytes.
    pub file: FileId,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Number of bytes.
    pub size: u64,
}

impl TensorStorage {
    /// Number of elements (saturating; shapes are validated when files are read).
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Splits this storage along its outermost dimension into `parts` equal storages (a
    /// fused `in_proj_weight` into q, k, v). Returns `None` if the outer dimension does not
    /// divide evenly or the rows are not whole blocks.
    pub fn split_outer(&self, parts: u64, names: &[String]) -> Option<Vec<TensorStorage>> {
        if parts == 0 || names.len() as u64 != parts || self.shape.is_empty() {
            return None;
        }
        let outer = self.shape[0];
        if !outer.is_multiple_of(parts) || !self.size.is_multiple_of(parts) {
            return None;
        }
        let part_size = self.size / parts;
        let mut shape = self.shape.clone();
        shape[0] = outer / parts;
        Some(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| TensorStorage {
                    name: n.clone(),
                    dtype: self.dtype,
                    shape: shape.clone(),
                    file: self.file,
                    offset: self.offset + part_size * i as u64,
                    size: part_size,
                })
                .collect(),
        )
    }
}
