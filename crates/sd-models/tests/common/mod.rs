//! Shared helpers of the parity tests: fixture paths, catalogs in canonical names, the
//! reference tensors and the relative L2 error.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use sd_formats::files::TensorCatalog;
use sd_models::weights::canonicalize;
#[allow(unused_imports)]
pub use sd_testutil::{check_close as check, rel_l2};

/// The folder of the model fixtures.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

/// The folder of the SDXL fixtures (`scripts/fixtures/make_sdxl_fixtures.py`).
pub fn sdxl_fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sdxl")
}

/// The catalog of fixture `name` (diffusers names), converted to canonical names.
pub fn catalog(name: &str) -> TensorCatalog {
    catalog_in(&fixtures(), name)
}

/// The catalog of `<dir>/<name>.safetensors`, converted to canonical names.
pub fn catalog_in(dir: &std::path::Path, name: &str) -> TensorCatalog {
    let mut loader = TensorCatalog::new();
    loader
        .add_file(dir.join(format!("{name}.safetensors")), None)
        .expect("open fixture weights");
    canonicalize(&mut loader, None).expect("canonical names");
    loader
}

/// A reference tensor: shape (PyTorch order) and f32 values.
pub struct Ref {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Every tensor of `<name>_io.safetensors`.
pub fn io(name: &str) -> HashMap<String, Ref> {
    io_in(&fixtures(), name)
}

/// Every tensor of `<dir>/<name>_io.safetensors`.
pub fn io_in(dir: &std::path::Path, name: &str) -> HashMap<String, Ref> {
    let bytes = std::fs::read(dir.join(format!("{name}_io.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{k}");
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (
                k,
                Ref {
                    shape: v.shape().to_vec(),
                    data,
                },
            )
        })
        .collect()
}

/// The config of fixture `name` from `models.json`.
pub fn config(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("models.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v[name].clone()
}

/// PyTorch dims to ggml `ne` (reversed).
pub fn ne(shape: &[usize]) -> Vec<usize> {
    shape.iter().rev().copied().collect()
}
