//! Shared helpers of the `manager_*` tests: small safetensors files with known values and
//! descriptors for them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

/// One tensor of a test file.
#[derive(Clone, Debug)]
pub struct FileTensor {
    pub name: String,
    /// safetensors dtype name (`F32`, `F16`).
    pub dtype: &'static str,
    /// Outermost first.
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

/// f32 tensor with values `seed + i * 0.25`.
pub fn f32_tensor(name: &str, shape: &[u64], seed: f32) -> FileTensor {
    let n: u64 = shape.iter().product();
    let bytes = (0..n)
        .flat_map(|i| (seed + i as f32 * 0.25).to_le_bytes())
        .collect();
    FileTensor {
        name: name.to_string(),
        dtype: "F32",
        shape: shape.to_vec(),
        bytes,
    }
}

/// f32 tensor with given values.
pub fn f32_values(name: &str, shape: &[u64], values: &[f32]) -> FileTensor {
    FileTensor {
        name: name.to_string(),
        dtype: "F32",
        shape: shape.to_vec(),
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// A fresh path in the temp dir.
pub fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("sd-rs-manager-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!(
        "{tag}-{}.safetensors",
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Writes a safetensors file whose data section starts at a multiple of 64 bytes (tensor
/// sizes should be multiples of 64 for every tensor to be aligned). Returns the file length.
pub fn write_safetensors(path: &Path, tensors: &[FileTensor]) -> u64 {
    let bytes = sd_testutil::SafetensorsWriter::new()
        .tensors(tensors.iter().map(|t| sd_testutil::StTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: t.bytes.clone(),
        }))
        .to_bytes();
    std::fs::write(path, &bytes).unwrap();
    bytes.len() as u64
}

/// A descriptor context for `n` tensors.
pub fn ctx(n: usize) -> Context {
    Context::new_descriptors(n, 1, 0).unwrap()
}

/// A descriptor of `dtype` with a host shape (outermost first).
pub fn desc(ctx: &Context, dtype: DType, shape: &[u64]) -> GTensor {
    let ne: Vec<usize> = shape.iter().rev().map(|&d| d as usize).collect();
    ctx.new_tensor(dtype, &ne).unwrap()
}

/// Descriptors (f32, same shapes) for every file tensor.
pub fn descs_for(ctx: &Context, tensors: &[FileTensor]) -> Vec<(String, GTensor)> {
    tensors
        .iter()
        .map(|t| (t.name.clone(), desc(ctx, DType::F32, &t.shape)))
        .collect()
}

/// f32 values of little-endian bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
