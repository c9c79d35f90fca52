//! Upscaler parity against spandrel 0.4.1 (tiny random weights in the real key layouts,
//! fixtures by `scripts/fixtures/make_upscaler_fixtures.py`): the detected architecture,
//! scale, channels and tags agree with spandrel's on each file, and the output is within
//! relative L2 1e-4 in f32.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{check, ne};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sd_models::run::run_cpu;
use sd_models::upscaler::{self, Upscaler, UpscalerArch};
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder};
use sd_tensor::DType;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/upscalers")
}

fn meta() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("upscalers.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn io(name: &str) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir().join(format!("{name}_io.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (k, (v.shape().to_vec(), data))
        })
        .collect()
}

/// The script's `synthetic_value`: splitmix64 of `(index << 32) + i`, top 24 bits as a
/// uniform in [-1, 1), scaled.
fn synthetic_values(index: u64, numel: usize, fan_in: Option<usize>, weight_1d: bool) -> Vec<f32> {
    (0..numel as u64)
        .map(|i| {
            let mut z = (index << 32)
                .wrapping_add(i)
                .wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0;
            let v = match fan_in {
                Some(f) => u / (f as f64).sqrt(),
                None if weight_1d => 1.0 + 0.2 * u,
                None => 0.1 * u,
            };
            v as f32
        })
        .collect()
}

/// Writes the synthetic weights of `entry` as a safetensors file under a temporary folder.
fn write_synthetic(name: &str, entry: &serde_json::Value) -> PathBuf {
    let mut shapes: Vec<(String, Vec<usize>)> = entry["synthetic"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let shape = e[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (e[0].as_str().unwrap().to_string(), shape)
        })
        .collect();
    shapes.sort();
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let numel = s.iter().product();
            let fan_in = (s.len() >= 2).then(|| s[1..].iter().product());
            synthetic_values(i as u64, numel, fan_in, n.ends_with("weight"))
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    let tmp = std::env::temp_dir().join(format!("sd-models-upscalers-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join(format!("{name}.safetensors"));
    std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
    path
}

fn fixture_path(name: &str, entry: &serde_json::Value) -> PathBuf {
    if entry.get("synthetic").is_some() {
        write_synthetic(name, entry)
    } else {
        dir().join(entry["file"].as_str().unwrap())
    }
}

/// Reflect-pads `[C, H, W]` planes at the right and bottom to multiples of `m` (torch
/// `F.pad(.., mode="reflect")`, as spandrel's `pad_to_multiple`).
fn reflect_pad(x: &[f32], c: usize, h: usize, w: usize, m: usize) -> (Vec<f32>, usize, usize) {
    let (ph, pw) = (h.div_ceil(m) * m, w.div_ceil(m) * m);
    let refl = |i: usize, n: usize| if i < n { i } else { 2 * (n - 1) - i };
    let mut out = Vec::with_capacity(c * ph * pw);
    for ch in 0..c {
        for y in 0..ph {
            for xx in 0..pw {
                out.push(x[ch * h * w + refl(y, h) * w + refl(xx, w)]);
            }
        }
    }
    (out, ph, pw)
}

fn check_fixture(name: &str) {
    let all = meta();
    let entry = &all[name];
    let path = fixture_path(name, entry);
    let (cat, arch) = upscaler::open(&path).unwrap();

    // Detection agrees with spandrel's.
    assert_eq!(
        arch.id(),
        entry["arch"].as_str().unwrap(),
        "{name}: architecture"
    );
    assert_eq!(
        arch.scale() as u64,
        entry["scale"].as_u64().unwrap(),
        "{name}: scale"
    );
    assert_eq!(
        arch.input_channels() as u64,
        entry["input_channels"].as_u64().unwrap(),
        "{name}: input channels"
    );
    assert_eq!(
        arch.output_channels() as u64,
        entry["output_channels"].as_u64().unwrap(),
        "{name}: output channels"
    );
    let tags: Vec<String> = entry["tags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(arch.tags(), tags, "{name}: tags");

    let pb = ParamBuilder::new(Some(&cat), 4096).unwrap();
    let model = Upscaler::new(&pb, &arch).unwrap();
    let params = pb.finish();
    // Every tensor of the file is used.
    assert_eq!(params.tensors.len(), cat.len(), "{name}: parameter count");
    let _buf = load_all_to_cpu(&params, &cat).unwrap();

    let refs = io(name);
    let (xs, xd) = &refs["x"];
    let (ys, yd) = &refs["y"];
    let (c, h, w) = (xs[1], xs[2], xs[3]);
    let m = arch.size_multiple();
    let (xp, ph, pw) = reflect_pad(xd, c, h, w, m);
    // ggml's ops, then the project's CPU kernels (as `sd` runs CPU models).
    for host_kernels in [false, true] {
        let opts = ComputeOptions {
            host_kernels,
            ..ComputeOptions::default()
        };
        let mut g = GraphCtx::new(8192, 8192, opts).unwrap();
        let x = g.ctx.new_tensor(DType::F32, &[pw, ph, c, 1]).unwrap();
        let out = model.forward(&mut g, &x).unwrap();
        let s = arch.scale();
        assert_eq!(out.ne(), [pw * s, ph * s, ys[1], 1], "{name}: output shape");
        let got = run_cpu(&g, &[&out], &[(&x, HostData::F32(xp.clone()))], 8192, 2)
            .unwrap()
            .remove(0);
        // Crop the padding away (spandrel crops to `h * scale`, `w * scale`).
        let (oh, ow) = (ys[2], ys[3]);
        let mut cropped = Vec::with_capacity(yd.len());
        for ch in 0..ys[1] {
            for y in 0..oh {
                let row = ch * ph * s * pw * s + y * pw * s;
                cropped.extend_from_slice(&got[row..row + ow]);
            }
        }
        assert_eq!(ne(ys), vec![ow, oh, ys[1], 1]);
        check(
            &format!("{name} (host kernels {host_kernels})"),
            &cropped,
            yd,
            1e-4,
        );
    }
}

#[test]
fn esrgan_original_layout_pth_f16() {
    check_fixture("esrgan_old");
}

#[test]
fn real_esrgan_x4plus() {
    check_fixture("esrgan_x4plus");
}

#[test]
fn real_esrgan_x2plus_pixel_unshuffle() {
    check_fixture("esrgan_x2plus");
}

#[test]
fn bsrgan_layout() {
    check_fixture("esrgan_bsrgan");
}

#[test]
fn esrgan_plus_conv1x1_paths() {
    check_fixture("esrgan_plus");
}

#[test]
fn real_esrgan_anime_6b() {
    check_fixture("esrgan_anime6b");
}

#[test]
fn compact_x4_pth() {
    check_fixture("compact_x4");
}

#[test]
fn compact_x2() {
    check_fixture("compact_x2");
}

#[test]
fn mosr_pixel_shuffle() {
    check_fixture("mosr_ps");
}

#[test]
fn mosr_geo_ensemble_pixel_shuffle() {
    check_fixture("mosr_gps");
}

#[test]
fn anime_6b_has_six_blocks() {
    let all = meta();
    let (_, arch) = upscaler::open(fixture_path("esrgan_anime6b", &all["esrgan_anime6b"])).unwrap();
    match arch {
        UpscalerArch::Esrgan(c) => {
            assert_eq!(c.num_blocks, 6);
            assert_eq!(c.num_upsamples, 2);
            assert_eq!(c.growth, 32);
        }
        other => panic!("detected {other:?}"),
    }
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn corrupt_and_foreign_files_are_clear_errors() {
    let tmp = std::env::temp_dir().join(format!("sd-models-upscalers-bad-{}", std::process::id()));
    // Truncated .pth.
    let good = std::fs::read(dir().join("esrgan_old.pth")).unwrap();
    let p = tmp.join("truncated.pth");
    write(&p, &good[..good.len() / 2]);
    let e = upscaler::open(&p).unwrap_err();
    assert!(e.to_string().contains("truncated.pth"), "{e}");
    // Garbage.
    let p = tmp.join("garbage.safetensors");
    write(&p, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all");
    let e = upscaler::open(&p).unwrap_err();
    assert!(e.to_string().contains("garbage.safetensors"), "{e}");
    // A valid file that is not an upscaler.
    let d = 1f32.to_le_bytes();
    let v = TensorView::new(Dtype::F32, vec![1], &d).unwrap();
    let p = tmp.join("other.safetensors");
    write(
        &p,
        &safetensors::serialize([("foo.weight", v)], &None).unwrap(),
    );
    let e = upscaler::open(&p).unwrap_err();
    assert!(matches!(e, ModelError::Config(_)), "{e}");
    assert!(e.to_string().contains("not a supported upscaler"), "{e}");
    // An ESRGAN whose conv_last is missing.
    let mut cat = sd_formats::files::TensorCatalog::new();
    cat.add_file(dir().join("esrgan_old.pth"), None).unwrap();
    cat.retain(|t| t.name != "model.10.weight");
    let e = upscaler::detect(&mut cat).unwrap_err();
    assert!(e.to_string().contains("conv_last.weight"), "{e}");
}

#[test]
fn misshapen_tensor_names_the_tensor() {
    // A Compact model whose body.2 kernel has the wrong width: detection reads body.0,
    // declaration checks every shape.
    let all = meta();
    let entry = &all["compact_x2"];
    let (cat, mut arch) = upscaler::open(fixture_path("compact_x2", entry)).unwrap();
    if let UpscalerArch::Compact(c) = &mut arch {
        c.num_feat += 1;
    }
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let e = Upscaler::new(&pb, &arch).unwrap_err();
    assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
    assert!(e.to_string().contains("body.0.weight"), "{e}");
}
