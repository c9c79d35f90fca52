//! Conversion between host tensors and ggml tensors.
//!
//! A host tensor's shape is outermost first (`[N, C, H, W]`); the matching ggml tensor has
//! `ne` reversed (`[W, H, C, N]`). Both are row-major/contiguous, so the data is the same.

use super::context::Context;
use super::error::{GgmlError, Result};
use super::tensor::GTensor;
use crate::dtype::DType;
use crate::host::Tensor;

/// ggml dims for a host shape (reversed, 1 to 4 dims).
pub fn ne_for_shape(shape: &[usize]) -> Result<Vec<usize>> {
    if shape.is_empty() || shape.len() > 4 {
        return Err(GgmlError::InvalidOperands {
            op: "host tensor",
            detail: format!("shape {shape:?} has {} dims (1 to 4)", shape.len()),
        });
    }
    Ok(shape.iter().rev().copied().collect())
}

impl Context {
    /// A new tensor of `dtype` shaped like a host shape (outermost first).
    pub fn new_tensor_for_shape(&self, dtype: DType, shape: &[usize]) -> Result<GTensor> {
        self.new_tensor(dtype, &ne_for_shape(shape)?)
    }
}

impl GTensor {
    /// Writes a host tensor into this tensor (same element count and shape, up to trailing
    /// ggml dims of 1), converting f32 to the tensor's type.
    pub fn write_host(&self, t: &Tensor<f32>) -> Result<()> {
        let want = ne_for_shape(t.shape())?;
        let ne = self.ne();
        let matches = (0..4).all(|i| *want.get(i).unwrap_or(&1) == ne[i]);
        if !matches {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: format!("host shape {:?} does not match ggml ne {:?}", t.shape(), ne),
            });
        }
        self.write_f32(t.data())
    }

    /// Reads this tensor as a host f32 tensor with `n_dims` dims (outermost first).
    pub fn read_host(&self, n_dims: usize) -> Result<Tensor<f32>> {
        let n = n_dims.clamp(1, 4);
        let ne = self.ne();
        if ne[n..].iter().any(|&d| d != 1) {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: format!("ne {ne:?} does not fit in {n} dims"),
            });
        }
        let data = self.read_f32()?;
        Tensor::new(self.shape(n), data).map_err(|e| GgmlError::DataMismatch {
            name: self.name(),
            detail: e.to_string(),
        })
    }
}
