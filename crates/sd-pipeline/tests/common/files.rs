//! Fixture files rewritten for bad-input and variant tests.

use std::path::Path;

/// Rewrites the safetensors file `src` without the tensors whose names start with `drop`.
pub fn without(src: &Path, drop: &str, dst: &Path) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    for (name, v) in header {
        if name == "__metadata__" {
            out_header.insert(name, v);
            continue;
        }
        if name.starts_with(drop) {
            continue;
        }
        let offs = v["data_offsets"].as_array().unwrap();
        let (a, b) = (
            offs[0].as_u64().unwrap() as usize,
            offs[1].as_u64().unwrap() as usize,
        );
        let start = out_data.len();
        out_data.extend_from_slice(&data[a..b]);
        let mut v = v.clone();
        v["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(name, v);
    }
    let mut h = serde_json::to_vec(&out_header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&out_data);
    std::fs::write(dst, out).unwrap();
}
