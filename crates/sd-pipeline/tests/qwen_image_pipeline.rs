//! Qwen-Image end to end against the steps of diffusers' `QwenImagePipeline`: a tiny random
//! checkpoint (the transformer, a Qwen2.5-VL text model, the Wan-2.1 autoencoder;
//! `scripts/fixtures/make_qwen_image_fixtures.py pipeline`), the prompt in the chat template
//! through the Qwen2 tokenizer (the shipped vocabulary) and the LLM with the template's 34
//! states dropped, the dynamically shifted sigmas stretched to 0.02, true CFG with the
//! negative prompt as its own pass (contexts of different lengths) and the per-token norm
//! rescale, Euler steps, decode through the per-channel latent statistics: latents within
//! relative L2 1e-3, images within 1 level. Also the same model from separate component
//! files (`--diffusion-model`, `--llm`, `--vae` as users download them).

mod common;

use std::path::{Path, PathBuf};

use sd_pipeline::generate::{Callbacks, LoadOptions, ModelFiles, Pipeline, Txt2Img};
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::RuntimeOptions;
use sd_pipeline::sampling::SampleMethod;
use sd_pipeline::schedule::{shifted_sigmas, ResolutionShift};
use sd_testutil::rel_l2;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline")
}

fn reference(name: &str) -> Vec<f32> {
    common::reference::tensor(&fixtures().join("runs_qwen_image.safetensors"), name)
}

fn runs() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("runs_qwen_image.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["runs"].as_array().unwrap().clone()
}

fn params(run: &Value) -> Txt2Img {
    Txt2Img {
        prompt: run["prompt"].as_str().unwrap().into(),
        negative: run["negative"].as_str().unwrap().into(),
        width: run["width"].as_u64().unwrap() as usize,
        height: run["height"].as_u64().unwrap() as usize,
        steps: run["steps"].as_u64().unwrap() as usize,
        cfg_scale: run["cfg_scale"].as_f64().unwrap() as f32,
        seed: run["seed"].as_u64().unwrap(),
        sampler: SampleMethod::Euler,
        threads: 2,
        rng: RngKind::Cpu,
        ..Txt2Img::default()
    }
}

fn generate(p: &mut Pipeline, params: &Txt2Img) -> (Vec<f32>, Vec<sd_tensor::Image>) {
    let mut latents = Vec::new();
    let images = p
        .generate(
            params,
            None,
            Callbacks {
                on_step: &mut |_, _| {},
                on_latents: &mut |_, l| latents = l.data().to_vec(),
                on_image: &mut |_, _| {},
            },
        )
        .unwrap();
    (latents, images)
}

/// The tiny checkpoint with its token embedding made whole, in `dir`.
fn tiny_qwen_image(dir: &Path) -> PathBuf {
    let path = dir.join("tiny_qwen_image.safetensors");
    common::files::expand_sparse(&fixtures().join("tiny_qwen_image.safetensors"), &path);
    path
}

fn options() -> RuntimeOptions {
    RuntimeOptions {
        threads: 2,
        ..RuntimeOptions::default()
    }
}

/// Checks every fixture run with `p`.
fn check_runs(p: &mut Pipeline) {
    for run in runs() {
        let name = run["name"].as_str().unwrap();
        let (w, h) = (
            run["width"].as_u64().unwrap(),
            run["height"].as_u64().unwrap(),
        );
        let tokens = (w as usize / 16) * (h as usize / 16);
        let steps = run["steps"].as_u64().unwrap() as usize;
        let want_sigmas: Vec<f64> = run["sigmas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let got = shifted_sigmas(steps, Some((tokens, ResolutionShift::QWEN_IMAGE))).unwrap();
        for (g, w) in got.iter().zip(&want_sigmas) {
            assert!((*g as f64 - w).abs() < 1e-6, "{name}: sigma {g} vs {w}");
        }
        let (latents, images) = generate(p, &params(&run));
        let e = rel_l2(&latents, &reference(&format!("{name}.latents")));
        let want = reference(&format!("{name}.image"));
        let max = common::reference::max_level_diff(&images[0], &want);
        println!("{name}: latents relative L2 {e:.2e}, image max difference {max} levels");
        assert!(e <= 1e-3, "{name}: latents relative L2 {e:.3e}");
        assert!(max <= 1, "{name}: a pixel differs by {max} levels");
    }
}

#[test]
fn tiny_qwen_image_matches_diffusers() {
    let guard = tempfile::tempdir().unwrap();
    let tmp = guard.path();
    let mut p = Pipeline::load(tiny_qwen_image(tmp), options()).unwrap();
    assert_eq!(p.spec().family.id(), "qwen-image");
    assert_eq!(p.spec().family.cfg_renorm(), Some(2));
    check_runs(&mut p);
}

/// The transformer, the LLM and the VAE as three bare files (ComfyUI's layout: no component
/// prefix; the VAE in diffusers' names) draw what the single file draws.
#[test]
fn separate_component_files_match_diffusers() {
    let guard = tempfile::tempdir().unwrap();
    let tmp = guard.path();
    let single = tiny_qwen_image(tmp);
    let (dit, llm, vae) = (
        tmp.join("qwen_image.safetensors"),
        tmp.join("qwen_2.5_vl.safetensors"),
        tmp.join("qwen_image_vae.safetensors"),
    );
    common::files::strip(&single, "model.diffusion_model.", &dit);
    common::files::strip(&single, "text_encoders.llm.", &llm);
    common::files::strip(&single, "vae.", &vae);
    let files = ModelFiles::default()
        .with("diffusion-model", dit)
        .with("llm", llm)
        .with("vae", vae);
    let mut p = Pipeline::open(
        &files,
        LoadOptions {
            runtime: options(),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(p.spec().family.id(), "qwen-image");
    check_runs(&mut p);
}

/// A generation keeps the transformer's text embeddings and RoPE tables on the device across
/// its steps (the runner cache): on a simulated device it gives the latents of a generation
/// that uploads them at every step, with fewer bytes uploaded, and releases them at the end.
#[test]
fn the_runner_cache_keeps_constants_across_steps_with_the_same_latents() {
    let guard = tempfile::tempdir().unwrap();
    let tmp = guard.path();
    let path = tiny_qwen_image(tmp);
    let run = &runs()[0];
    let generate_on_sim = |keep: bool| {
        let opts = RuntimeOptions {
            compute: sd_pipeline::runtime::ComputeDevice::Sim {
                bytes: 256 << 20,
                page: 0,
            },
            ..options()
        };
        let mut p = Pipeline::load(&path, opts).unwrap();
        let unet = p.handles().unet;
        if !keep {
            p.runtime_mut().keep_constants(unet, false).unwrap();
        }
        let (latents, _) = generate(&mut p, &params(run));
        let uploaded = p
            .runtime()
            .sim_device()
            .unwrap()
            .stats()
            .host_to_device_bytes;
        assert_eq!(p.runtime().constants_state(unet).unwrap(), (0, None));
        (latents, uploaded)
    };
    let (kept, kept_bytes) = generate_on_sim(true);
    let (uploaded, all_bytes) = generate_on_sim(false);
    assert_eq!(kept, uploaded);
    assert!(
        kept_bytes < all_bytes,
        "kept: {kept_bytes} B uploaded, not kept: {all_bytes} B"
    );
}

/// The diffusers pipeline folder (`Qwen/Qwen-Image` as `save_pretrained` writes it):
/// `transformer/`, `vae/` and the LLM in `text_encoder/` under transformers 4.52+'s names
/// (`model.language_model.*`, with `lm_head`) draws what the single file draws.
#[test]
fn a_diffusers_folder_matches_diffusers() {
    let guard = tempfile::tempdir().unwrap();
    let tmp = guard.path();
    let single = tiny_qwen_image(tmp);
    let dir = tmp.join("Qwen-Image");
    for sub in [
        "transformer",
        "text_encoder",
        "vae",
        "tokenizer",
        "scheduler",
    ] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    std::fs::write(
        dir.join("model_index.json"),
        "{\"_class_name\": \"QwenImagePipeline\"}",
    )
    .unwrap();
    common::files::strip(
        &single,
        "model.diffusion_model.",
        &dir.join("transformer/diffusion_pytorch_model.safetensors"),
    );
    common::files::rename(
        &single,
        &dir.join("text_encoder/model.safetensors"),
        |name| {
            let rel = name.strip_prefix("text_encoders.llm.")?;
            Some(match rel.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => rel.to_string(),
            })
        },
    );
    common::files::strip(
        &single,
        "vae.",
        &dir.join("vae/diffusion_pytorch_model.safetensors"),
    );
    let mut p = Pipeline::load(&dir, options()).unwrap();
    assert_eq!(p.spec().family.id(), "qwen-image");
    check_runs(&mut p);
}

/// Tiled decoding (`--vae-tiling`) through the Wan-2.1 autoencoder: on 8x8 latents, tiles of
/// 6 overlapping by 3 give the whole decode's image up to what a tile cannot see (the random
/// tiny VAE's mid-block attention spans the whole image): 7.5 levels apart on average when
/// written (tiles of 4: 17.8; misplaced tiles would be tens of levels off).
#[test]
fn tiled_decode_through_the_wan_vae_matches_the_whole_decode() {
    let guard = tempfile::tempdir().unwrap();
    let tmp = guard.path();
    let mut p = Pipeline::load(tiny_qwen_image(tmp), options()).unwrap();
    let run = &runs()[0];
    let mut params = params(run);
    params.steps = 2;
    let (_, whole) = generate(&mut p, &params);
    params.vae_tiling = Some(sd_pipeline::vae_tiling::VaeTiling {
        tile: 6,
        overlap: 3,
    });
    let (_, tiled) = generate(&mut p, &params);
    let (a, b) = (whole[0].pixels(), tiled[0].pixels());
    assert_eq!(a.len(), b.len());
    let mean = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .sum::<f64>()
        / a.len() as f64;
    let max = a.iter().zip(b).map(|(&x, &y)| x.abs_diff(y)).max().unwrap();
    println!("tiled vs whole decode: mean {mean:.2} levels, max {max}");
    assert!(
        mean < 12.0,
        "tiled decode differs by {mean:.2} levels on average"
    );
}
