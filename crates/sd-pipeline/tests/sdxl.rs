//! SDXL through the pipeline's runtime: the tiny SDXL checkpoint
//! (`scripts/fixtures/make_sdxl_fixtures.py pipeline`) under a `--max-vram` budget on the
//! simulated device gives the unbudgeted image byte for byte with the device peak within the
//! budget, and a checkpoint without its second text encoder is an error naming the slot and
//! its flag.

mod common;

use std::path::{Path, PathBuf};

use common::files::without;

use sd_pipeline::generate::{LoadOptions, ModelFiles, Pipeline, Txt2Img};
use sd_pipeline::runtime::{ComputeDevice, ParamsLocation, RuntimeOptions};
use sd_residency::capacity::MaxVram;
use sd_tensor::Image;

fn tiny_sdxl() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline/tiny_sdxl.safetensors")
}

fn params() -> Txt2Img {
    Txt2Img {
        prompt: "a lighthouse at dusk".into(),
        negative: "blurry".into(),
        width: 32,
        height: 32,
        steps: 2,
        cfg_scale: 5.0,
        seed: 11,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn options(max_vram: Option<u64>) -> RuntimeOptions {
    RuntimeOptions {
        compute: ComputeDevice::Sim {
            bytes: 256 << 20,
            page: 0,
        },
        params: ParamsLocation::Disk,
        max_vram: max_vram
            .map(|b| MaxVram::parse(&format!("{}", b as f64 / (1u64 << 30) as f64)).unwrap()),
        threads: 2,
        planning_headroom: Some(256 << 10),
        ..RuntimeOptions::default()
    }
}

fn generate(path: &Path, opts: RuntimeOptions) -> (Image, Pipeline) {
    let mut p = Pipeline::load(path, opts).unwrap();
    let mut images = p.txt2img(&params(), &mut |_, _| {}).unwrap();
    (images.remove(0), p)
}

#[test]
fn sdxl_under_a_budget_equals_the_whole_run() {
    let (whole, p) = generate(&tiny_sdxl(), options(None));
    let h = p.handles();
    assert_eq!(h.text_encoders.len(), 2, "CLIP-L and bigG");
    assert_eq!(p.runtime().last_segments(h.unet).len(), 1);

    let budget = 3u64 << 19;
    let (seg, p) = generate(&tiny_sdxl(), options(Some(budget)));
    let unet = p.runtime().last_segments(h.unet).len();
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    println!("budget {budget}: unet in {unet} segments, peak {peak}");
    assert!(unet > 2, "unet ran in {unet} segment(s)");
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    assert_eq!(seg.pixels(), whole.pixels());
}

#[test]
fn sdxl_without_its_second_text_encoder_names_the_slot_and_flag() {
    let dir = std::env::temp_dir().join(format!("sd-rs-sdxl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("no_clip_g.safetensors");
    without(&tiny_sdxl(), "conditioner.embedders.1.", &path);
    let Err(err) = Pipeline::load(&path, options(None)) else {
        panic!("an SDXL checkpoint without bigG loaded");
    };
    let text = err.to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        text.contains("--clip_g") && text.contains("OpenCLIP-bigG"),
        "{text}"
    );
}

/// The same tiny SDXL as a diffusers pipeline folder (`unet/`, `vae/`, `text_encoder/`,
/// `text_encoder_2/` with diffusers and transformers names, q/k/v separate) loads through
/// the name tables to the same model: the same image as the single file, byte for byte.
#[test]
fn a_diffusers_folder_gives_the_single_files_image() {
    let folder = tiny_sdxl().with_file_name("tiny_sdxl_diffusers");
    let (from_file, _) = generate(&tiny_sdxl(), options(None));
    let (from_folder, p) = generate(&folder, options(None));
    assert_eq!(p.spec().family.id(), "sdxl");
    assert_eq!(from_folder.pixels(), from_file.pixels());

    // A folder that is not a diffusers pipeline: an error naming it.
    let dir = std::env::temp_dir().join(format!("sd-rs-not-diffusers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Err(err) = Pipeline::load(&dir, options(None)) else {
        panic!("an empty folder loaded");
    };
    let text = err.to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        text.contains("not a diffusers pipeline folder") && text.contains("sd-rs-not-diffusers"),
        "{text}"
    );
}

/// A GGUF UNet (f16 matrices, f32 vectors; original names) given with `--diffusion-model`
/// replaces the checkpoint's UNet: its weights stay f16 and the image stays within a few
/// levels of the f32 checkpoint's (the f16 rounding of the weights).
#[test]
fn a_gguf_unet_through_diffusion_model_replaces_the_checkpoints() {
    let gguf = tiny_sdxl().with_file_name("tiny_sdxl_unet_f16.gguf");
    let (from_file, _) = generate(&tiny_sdxl(), options(None));
    let files = ModelFiles::single(tiny_sdxl()).with("diffusion-model", gguf);
    let mut p = Pipeline::open(
        &files,
        LoadOptions {
            runtime: options(None),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let unet = p.handles().unet;
    let f16 = p
        .runtime()
        .params(unet)
        .unwrap()
        .tensors
        .values()
        .filter(|t| t.dtype() == Some(sd_tensor::DType::F16))
        .count();
    assert!(f16 > 50, "{f16} f16 UNet tensors");
    let img = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    let max = img
        .pixels()
        .iter()
        .zip(from_file.pixels())
        .map(|(a, b)| (*a as i32 - *b as i32).abs())
        .max()
        .unwrap();
    println!("GGUF f16 UNet vs f32 checkpoint: max difference {max} levels");
    assert!(max <= 4, "max difference {max} levels");
}
