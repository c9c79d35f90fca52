//! Fixture files rewritten for bad-input and variant tests.

use std::path::Path;

/// Rewrites the safetensors file `src` without the tensors whose names start with `drop`.
pub fn without(src: &Path, drop: &str, dst: &Path) {
    filter(src, dst, |name| {
        (!name.starts_with(drop)).then(|| name.to_string())
    });
}

/// Rewrites the safetensors file `src` with only the tensors whose names start with one of
/// `keep` (the metadata stays).
pub fn only(src: &Path, keep: &[&str], dst: &Path) {
    filter(src, dst, |name| {
        keep.iter()
            .any(|k| name.starts_with(k))
            .then(|| name.to_string())
    });
}

/// Rewrites the safetensors file `src` with only the tensors under `prefix`, the prefix
/// removed (a bare component file).
pub fn strip(src: &Path, prefix: &str, dst: &Path) {
    filter(src, dst, |name| {
        name.strip_prefix(prefix).map(str::to_string)
    });
}

/// Rewrites the safetensors file `src` with the tensors `keep` names (`None`: dropped).
fn filter(src: &Path, dst: &Path, keep: impl Fn(&str) -> Option<String>) {
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
        let Some(new_name) = keep(&name) else {
            continue;
        };
        let offs = v["data_offsets"].as_array().unwrap();
        let (a, b) = (
            offs[0].as_u64().unwrap() as usize,
            offs[1].as_u64().unwrap() as usize,
        );
        let start = out_data.len();
        out_data.extend_from_slice(&data[a..b]);
        let mut v = v.clone();
        v["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(new_name, v);
    }
    write(dst, out_header, &out_data);
}

/// Writes a safetensors file of `header` and `data`.
fn write(dst: &Path, header: serde_json::Map<String, serde_json::Value>, data: &[u8]) {
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(dst, out).unwrap();
}

/// Rewrites the safetensors file `src` with its sparse token embeddings made whole: each
/// tensor named in the `sd-rs.test.sparse` metadata (`{name: vocabulary}`) holds only the
/// rows listed in `<name>.rows` (i32); the output has the full `[vocabulary, width]` table
/// with those rows in place and zeros elsewhere (`scripts/fixtures/make_sd3_fixtures.py`).
pub fn expand_sparse(src: &Path, dst: &Path) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let slice = |v: &serde_json::Value| {
        let offs = v["data_offsets"].as_array().unwrap();
        &data[offs[0].as_u64().unwrap() as usize..offs[1].as_u64().unwrap() as usize]
    };
    let sparse: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
        header["__metadata__"]["sd-rs.test.sparse"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    for (name, v) in &header {
        if name == "__metadata__" {
            out_header.insert(name.clone(), v.clone());
            continue;
        }
        if name.ends_with(".rows") && sparse.contains_key(name.trim_end_matches(".rows")) {
            continue;
        }
        let mut v = v.clone();
        let start = out_data.len();
        match sparse.get(name) {
            Some(vocab) => {
                let vocab = vocab.as_u64().unwrap() as usize;
                let shape = v["shape"].as_array().unwrap();
                let width = shape[1].as_u64().unwrap() as usize;
                let elem = slice(&v).len() / (shape[0].as_u64().unwrap() as usize * width);
                let row = width * elem;
                let rows: Vec<usize> = slice(&header[&format!("{name}.rows")])
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as usize)
                    .collect();
                let mut table = vec![0u8; vocab * row];
                for (i, r) in rows.iter().enumerate() {
                    table[r * row..(r + 1) * row]
                        .copy_from_slice(&slice(&v)[i * row..(i + 1) * row]);
                }
                out_data.extend_from_slice(&table);
                v["shape"] = serde_json::json!([vocab, width]);
            }
            None => out_data.extend_from_slice(slice(&v)),
        }
        v["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(name.clone(), v);
    }
    write(dst, out_header, &out_data);
}

/// Rewrites the SD3 transformer under `model.diffusion_model.` of the safetensors file
/// `src` (f32, Stability's names) in diffusers' names without prefix
/// (`SD3Transformer2DModel`'s state dict): fused `qkv` split into q, k, v, the (shift,
/// scale) halves of the final and the last context modulation swapped. `depth`: the
/// number of joint blocks.
pub fn sd3_to_diffusers(src: &Path, depth: usize, dst: &Path) {
    use sd_models::mmdit::MmditLayout;
    let prefix = "model.diffusion_model.";
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    let last_ctx = format!(
        "joint_blocks.{}.context_block.adaLN_modulation.1",
        depth - 1
    );
    let mut push = |name: String, v: &serde_json::Value, shape: Vec<u64>, bytes: &[u8]| {
        let start = out_data.len();
        out_data.extend_from_slice(bytes);
        let mut v = v.clone();
        v["shape"] = serde_json::json!(shape);
        v["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(name, v);
    };
    for (name, v) in &header {
        let Some(rel) = name.strip_prefix(prefix) else {
            continue;
        };
        assert_eq!(v["dtype"], "F32", "{name}");
        let offs = v["data_offsets"].as_array().unwrap();
        let t = &data[offs[0].as_u64().unwrap() as usize..offs[1].as_u64().unwrap() as usize];
        let shape: Vec<u64> = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        if rel == "pos_embed" {
            push(MmditLayout::Diffusers.name("pos_embed"), v, shape, t);
            continue;
        }
        let (stem, leaf) = rel.rsplit_once('.').unwrap();
        let d = |sai: &str| format!("{}.{leaf}", MmditLayout::Diffusers.name(sai));
        if let Some(base) = stem.strip_suffix(".qkv") {
            let third = t.len() / 3;
            let mut part = shape.clone();
            part[0] /= 3;
            for (i, x) in ["q", "k", "v"].iter().enumerate() {
                push(
                    d(&format!("{base}.{x}")),
                    v,
                    part.clone(),
                    &t[i * third..(i + 1) * third],
                );
            }
        } else if stem == "final_layer.adaLN_modulation.1" || stem == last_ctx {
            let half = t.len() / 2;
            let swapped = [&t[half..], &t[..half]].concat();
            push(d(stem), v, shape, &swapped);
        } else {
            push(d(stem), v, shape, t);
        }
    }
    write(dst, out_header, &out_data);
}

/// Rewrites the safetensors file `src` with each tensor renamed by `name` (`None`: dropped).
pub fn rename(src: &Path, dst: &Path, name: impl Fn(&str) -> Option<String>) {
    filter(src, dst, name);
}
