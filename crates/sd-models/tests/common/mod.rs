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

/// One f32 tensor of a rewritten file: name, PyTorch shape, values.
pub type F32Tensor = (String, Vec<usize>, Vec<f32>);

/// Rewrites the f32 safetensors file `src` as `dst`, each tensor replaced by what `f`
/// returns for it (renamed, split, reordered; none: dropped).
pub fn rewrite_f32(
    src: &std::path::Path,
    dst: &std::path::Path,
    f: impl Fn(F32Tensor) -> Vec<F32Tensor>,
) {
    let bytes = std::fs::read(src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<F32Tensor> = Vec::new();
    for (name, v) in st.tensors() {
        assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
        let data: Vec<f32> = v
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.extend(f((name, v.shape().to_vec(), data)));
    }
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = out
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = raw
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, dst).unwrap();
}

/// Rows `[from, from + n)` of a row-major `[rows, ...]` tensor.
pub fn row_slice(t: &F32Tensor, from: usize, n: usize) -> (Vec<usize>, Vec<f32>) {
    let row: usize = t.1[1..].iter().product();
    let mut shape = t.1.clone();
    shape[0] = n;
    (shape, t.2[from * row..(from + n) * row].to_vec())
}

/// How many nodes named `name` the graph of `out` has (built in `ctx`, at most `capacity`
/// nodes): a test's check that a model took one of the project's kernels.
pub fn nodes_named(
    ctx: &sd_tensor::ggml::Context,
    out: &sd_tensor::ggml::GTensor,
    capacity: usize,
    name: &str,
) -> usize {
    let mut graph = sd_tensor::ggml::Graph::new(ctx, capacity).unwrap();
    graph.build_forward_expand(out).unwrap();
    graph.nodes().iter().filter(|n| n.name() == name).count()
}
