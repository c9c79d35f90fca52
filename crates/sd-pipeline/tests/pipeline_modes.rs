//! Generation modes end to end on the built-in model: img2img (strength 0 is the VAE round
//! trip; a real run keeps the init image's dominant colour), component files equal the
//! checkpoint, tiled VAE decoding, batches, clip skip and weight type conversion.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sd_pipeline::generate::{GenerateError, LoadOptions, ModelFiles, Pipeline, Txt2Img};
use sd_pipeline::runtime::RuntimeOptions;
use sd_pipeline::sampling::Prediction;
use sd_pipeline::vae_tiling::VaeTiling;
use sd_tensor::{DType, Image};

fn builtin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sd-pipeline-modes");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn params(prompt: &str, seed: u64) -> Txt2Img {
    Txt2Img {
        prompt: prompt.into(),
        width: 64,
        height: 64,
        steps: 4,
        cfg_scale: 5.0,
        seed,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn load(files: &ModelFiles, runtime: RuntimeOptions, clip_skip: Option<usize>) -> Pipeline {
    Pipeline::open(
        files,
        LoadOptions {
            runtime,
            clip_skip,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

fn cpu() -> RuntimeOptions {
    RuntimeOptions {
        threads: 2,
        ..RuntimeOptions::default()
    }
}

fn one(p: &mut Pipeline, params: &Txt2Img) -> Image {
    p.txt2img(params, &mut |_, _| {}).unwrap().remove(0)
}

/// Mean absolute difference of two images' bytes.
fn mad(a: &Image, b: &Image) -> f64 {
    assert_eq!((a.width(), a.height()), (b.width(), b.height()));
    let s: f64 = a
        .pixels()
        .iter()
        .zip(b.pixels())
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .sum();
    s / a.pixels().len() as f64
}

/// Share of pixels within 60 (per channel) of `rgb`.
fn share_near(img: &Image, rgb: [u8; 3]) -> f64 {
    let mut n = 0;
    for y in 0..img.height() {
        for x in 0..img.width() {
            let p = img.pixel(x, y).unwrap();
            if (0..3).all(|c| (p[c] as i32 - rgb[c] as i32).abs() < 60) {
                n += 1;
            }
        }
    }
    n as f64 / (img.width() * img.height()) as f64
}

/// A yellow 64x64 image with a blue square in the middle.
fn blue_square_on_yellow() -> Image {
    let mut px = Vec::with_capacity(64 * 64 * 3);
    for y in 0..64 {
        for x in 0..64 {
            if (20..44).contains(&x) && (20..44).contains(&y) {
                px.extend_from_slice(&[30, 40, 220]);
            } else {
                px.extend_from_slice(&[235, 220, 30]);
            }
        }
    }
    Image::from_rgb(64, 64, px).unwrap()
}

#[test]
fn img2img_strength_zero_is_the_vae_round_trip_and_a_real_run_keeps_the_colours() {
    let mut p = load(&ModelFiles::single(builtin()), cpu(), None);
    assert!(p.has_vae_encoder());
    let init = blue_square_on_yellow();
    let prm = params("a blue circle on a yellow background", 1);

    let zero = p
        .img2img(&prm, &init, 0.0, &mut |_, _| {})
        .unwrap()
        .remove(0);
    let latents = p.encode(&init, None).unwrap();
    let round_trip = p.decode(&latents, None).unwrap();
    // Tiled encoding: one tile of the whole image is the whole encode; small overlapping
    // tiles stay close.
    let tile = |t, o| VaeTiling {
        tile: t,
        overlap: o,
    };
    let one_tile = p.encode(&init, Some(tile(16, 8))).unwrap();
    assert_eq!(one_tile.data(), latents.data());
    let tiled = p.encode(&init, Some(tile(8, 4))).unwrap();
    let err = tiled
        .data()
        .iter()
        .zip(latents.data())
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / latents.data().len() as f32;
    eprintln!("tiled encode: mean abs latent difference {err:.4}");
    assert!(err > 0.0 && err < 0.2, "tiled encode differs by {err}");
    assert_eq!(zero.pixels(), round_trip.pixels());
    // The tiny VAE reconstructs its training drawings closely.
    assert!(
        mad(&zero, &init) < 25.0,
        "round trip differs by {}",
        mad(&zero, &init)
    );

    let mut steps = Vec::new();
    let out = p
        .img2img(&prm, &init, 0.5, &mut |s, t| steps.push((s, t)))
        .unwrap()
        .remove(0);
    // Half of the 4 steps are sampled.
    assert_eq!(steps.last(), Some(&(2, 2)));
    let yellow = share_near(&out, [235, 220, 30]);
    eprintln!(
        "img2img 0.5: yellow share {yellow:.2}, round trip {:.2}",
        mad(&zero, &init)
    );
    assert!(yellow > 0.4, "yellow share {yellow}");
    assert!(mad(&out, &zero) > 1.0, "strength 0.5 changed nothing");

    // Bad values are setting errors.
    let e = p.img2img(&prm, &init, 1.5, &mut |_, _| {}).unwrap_err();
    assert!(matches!(
        e,
        GenerateError::InvalidSetting {
            flag: "strength",
            ..
        }
    ));
    let small = Image::filled(32, 32, &[0, 0, 0]).unwrap();
    let e = p.img2img(&prm, &small, 0.5, &mut |_, _| {}).unwrap_err();
    assert!(matches!(
        e,
        GenerateError::InvalidSetting {
            flag: "init-img",
            ..
        }
    ));
}

/// Writes the built-in model's tensors whose names start with `prefix` (prefix removed)
/// to a new safetensors file, with the built-in model's metadata when `metadata`.
fn write_component(prefix: &str, name: &str, metadata: bool) -> PathBuf {
    let bytes = std::fs::read(builtin()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    for (k, v) in &header {
        if k == "__metadata__" {
            if metadata {
                out_header.insert(k.clone(), v.clone());
            }
            continue;
        }
        let Some(rest) = k.strip_prefix(prefix) else {
            continue;
        };
        let off = v["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let start = out_data.len();
        out_data.extend_from_slice(&data[a..b]);
        let mut entry = v.clone();
        entry["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(rest.to_string(), entry);
    }
    let mut h = serde_json::to_string(&out_header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(h.as_bytes());
    file.extend_from_slice(&out_data);
    let path = scratch(name);
    std::fs::write(&path, file).unwrap();
    path
}

#[test]
fn component_files_equal_the_checkpoint() {
    let prm = params("a red square on a white background", 4);
    let whole = one(&mut load(&ModelFiles::single(builtin()), cpu(), None), &prm);

    // Bare component files (original layout, no prefixes), as sd.cpp users pass them.
    let unet = write_component("model.diffusion_model.", "unet.safetensors", true);
    let vae = write_component("first_stage_model.", "vae.safetensors", false);
    let clip = write_component("cond_stage_model.transformer.", "clip_l.safetensors", false);
    let files = ModelFiles::default()
        .with("diffusion-model", unet.clone())
        .with("vae", vae.clone())
        .with("clip_l", clip);
    let parts = one(&mut load(&files, cpu(), None), &prm);
    assert_eq!(parts.pixels(), whole.pixels());

    // --vae replaces the checkpoint's autoencoder (here with the same weights).
    let files = ModelFiles::single(builtin()).with("vae", vae.clone());
    let replaced = one(&mut load(&files, cpu(), None), &prm);
    assert_eq!(replaced.pixels(), whole.pixels());

    // A missing component is an error naming the flag to use.
    let files = ModelFiles::default()
        .with("diffusion-model", unet)
        .with("vae", vae);
    let e = Pipeline::open(
        &files,
        LoadOptions {
            runtime: cpu(),
            ..LoadOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--clip_l") && e.contains("unet.safetensors"),
        "{e}"
    );
}

/// A component file for a slot the detected family does not have (SD2's `--clip_h` with an
/// SD1 model) is an error naming the flag and the family's own flags; a model without the
/// metadata's family is one too.
#[test]
fn a_component_of_another_family_is_an_error() {
    let clip = write_component("cond_stage_model.transformer.", "clip_h.safetensors", false);
    let open = |files: &ModelFiles| {
        Pipeline::open(
            files,
            LoadOptions {
                runtime: cpu(),
                ..LoadOptions::default()
            },
        )
        .unwrap_err()
        .to_string()
    };
    let e = open(&ModelFiles::single(builtin()).with("clip_h", clip));
    assert!(
        e.contains("--clip_h") && e.contains("SD 1.x") && e.contains("--clip_l"),
        "{e}"
    );
    let e = open(&ModelFiles::single(builtin()).with("clip_x", builtin()));
    assert!(e.contains("clip_x"), "{e}");
}

#[test]
fn tiled_decoding_batches_clip_skip_and_weight_types() {
    let mut p = load(&ModelFiles::single(builtin()), cpu(), None);
    let base = params("a green triangle on a black background", 9);
    let whole = one(&mut p, &base);

    // Tiles as large as the latents (16x16) are the whole decode; smaller overlapping
    // tiles stay close to it.
    let big = Txt2Img {
        vae_tiling: Some(VaeTiling {
            tile: 16,
            overlap: 8,
        }),
        ..base.clone()
    };
    assert_eq!(one(&mut p, &big).pixels(), whole.pixels());
    let small = Txt2Img {
        vae_tiling: Some(VaeTiling {
            tile: 8,
            overlap: 4,
        }),
        ..base.clone()
    };
    let tiled = one(&mut p, &small);
    let d = mad(&tiled, &whole);
    eprintln!("tiled decode: mean abs difference {d:.2}");
    assert!(d > 0.0 && d < 6.0, "tiled decode differs by {d}");

    // A batch: image i uses seed + i.
    let batch = Txt2Img {
        batch: 2,
        ..base.clone()
    };
    let images = p.txt2img(&batch, &mut |_, _| {}).unwrap();
    assert_eq!(images.len(), 2);
    assert_eq!(images[0].pixels(), whole.pixels());
    let second = one(
        &mut p,
        &Txt2Img {
            seed: base.seed + 1,
            ..base.clone()
        },
    );
    assert_eq!(images[1].pixels(), second.pixels());

    // Clip skip 2 conditions on another layer: another image; beyond the 3 layers: an error.
    let skip2 = one(
        &mut load(&ModelFiles::single(builtin()), cpu(), Some(2)),
        &base,
    );
    assert_ne!(skip2.pixels(), whole.pixels());
    let e = Pipeline::open(
        &ModelFiles::single(builtin()),
        LoadOptions {
            runtime: cpu(),
            clip_skip: Some(4),
            ..LoadOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(
        e,
        GenerateError::InvalidSetting {
            flag: "clip-skip",
            ..
        }
    ));

    // Weight types: f32 is the f16 file's values exactly (f32 arithmetic either way up to
    // the matmul kernels), q8_0 quantizes the linear weights and stays close.
    for (t, limit) in [(DType::F32, 1.0), (DType::Q8_0, 3.0)] {
        let mut q = load(
            &ModelFiles::single(builtin()),
            RuntimeOptions {
                weight_type: Some(t),
                ..cpu()
            },
            None,
        );
        let unet = q.handles().unet;
        let params = q.runtime().params(unet).unwrap();
        let w = &params.tensors["model.diffusion_model.middle_block.1.proj_in.weight"];
        let lin = &params.tensors
            ["model.diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight"];
        assert_eq!(lin.dtype(), Some(t));
        assert!(w.dtype() == Some(t) || t.is_quantized());
        let img = one(&mut q, &base);
        let d = mad(&img, &whole);
        eprintln!("--type {t}: mean abs difference {d:.2}");
        assert!(d < limit, "{t}: differs by {d}");
    }
}

/// `--prediction`: eps given explicitly is the model's default (the same image); v reads
/// the same UNet output as a velocity, which gives another image.
#[test]
fn prediction_override_changes_the_denoiser() {
    let files = ModelFiles::single(builtin());
    let with = |prediction| {
        Pipeline::open(
            &files,
            LoadOptions {
                runtime: cpu(),
                prediction,
                ..LoadOptions::default()
            },
        )
        .unwrap()
    };
    let base = params("a red circle on a white background", 3);
    let default = one(&mut with(None), &base);
    let eps = one(&mut with(Some(Prediction::Eps)), &base);
    let v = one(&mut with(Some(Prediction::V)), &base);
    assert_eq!(eps.pixels(), default.pixels());
    let d = mad(&v, &default);
    assert!(d > 1.0, "v prediction changed the image by only {d}");
}
