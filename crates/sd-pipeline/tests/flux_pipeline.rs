//! FLUX.1-dev and schnell end to end against diffusers' `FluxPipeline` steps: a tiny random checkpoint
//! (transformer with BFL names, CLIP-L, T5 with the real vocabulary, 16-channel VAE;
//! `scripts/fixtures/make_flux_fixtures.py pipeline`), the prompt through both tokenizers,
//! the resolution-shifted flow sigmas, guidance 3.5, Euler steps, decode with scale and
//! shift: latents within relative L2 1e-3, images within 1 level.

mod common;

use std::path::PathBuf;

use sd_pipeline::generate::{Callbacks, Pipeline, Txt2Img};
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::RuntimeOptions;
use sd_pipeline::sampling::SampleMethod;
use sd_pipeline::tokenizer_t5::T5Tokenizer;
use sd_testutil::rel_l2;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline")
}

/// A reference tensor of `runs_flux.safetensors`.
fn reference(name: &str) -> Vec<f32> {
    common::reference::tensor(&fixtures().join("runs_flux.safetensors"), name)
}

#[test]
fn tiny_flux_dev_and_schnell_match_diffusers() {
    let text = std::fs::read_to_string(fixtures().join("runs_flux.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let options = || RuntimeOptions {
        threads: 2,
        ..RuntimeOptions::default()
    };
    // The checkpoint with its token embeddings made whole.
    let tmp = std::env::temp_dir().join(format!("sd-rs-flux-schnell-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let dev_file = tmp.join("tiny_flux.safetensors");
    common::files::expand_sparse(&fixtures().join("tiny_flux.safetensors"), &dev_file);
    let mut dev = Pipeline::load(&dev_file, options()).unwrap();
    assert_eq!(dev.spec().family.id(), "flux");
    // schnell: the same checkpoint without its guidance embedding.
    let schnell_file = tmp.join("tiny_flux_schnell.safetensors");
    common::files::without(
        &dev_file,
        "model.diffusion_model.guidance_in.",
        &schnell_file,
    );
    let mut schnell = Pipeline::load(&schnell_file, options()).unwrap();
    std::fs::remove_dir_all(&tmp).ok();
    assert_eq!(schnell.spec().defaults.steps, 4);
    let t5 = T5Tokenizer::builtin().unwrap();
    for run in v["runs"].as_array().unwrap() {
        let name = run["name"].as_str().unwrap();
        let p = if name.contains("schnell") {
            &mut schnell
        } else {
            &mut dev
        };
        let prompt = run["prompt"].as_str().unwrap();
        let want_ids: Vec<i32> = run["t5_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as i32)
            .collect();
        assert_eq!(t5.encode_padded(prompt, 512).unwrap(), want_ids, "{name}");
        let size = run["width"].as_u64().unwrap() as usize;
        let params = Txt2Img {
            prompt: prompt.into(),
            negative: String::new(),
            width: size,
            height: size,
            steps: run["steps"].as_u64().unwrap() as usize,
            cfg_scale: 1.0,
            // schnell ignores it (no guidance embedding).
            guidance: run["guidance"].as_f64().unwrap_or(3.5) as f32,
            seed: run["seed"].as_u64().unwrap(),
            sampler: SampleMethod::Euler,
            threads: 2,
            rng: RngKind::Cpu,
            ..Txt2Img::default()
        };
        let mut latents = Vec::new();
        let images = p
            .generate(
                &params,
                None,
                Callbacks {
                    on_step: &mut |_, _| {},
                    on_latents: &mut |_, l| latents = l.data().to_vec(),
                    on_image: &mut |_, _| {},
                },
            )
            .unwrap();
        let e = rel_l2(&latents, &reference(&format!("{name}.latents")));
        let want = reference(&format!("{name}.image"));
        let max = common::reference::max_level_diff(&images[0], &want);
        println!("{name}: latents relative L2 {e:.2e}, image max difference {max} levels");
        assert!(e <= 1e-3, "{name}: latents relative L2 {e:.3e}");
        assert!(max <= 1, "{name}: a pixel differs by {max} levels");
    }
}

/// BFL transformer files without sd-rs metadata are detected as FLUX.1 from their tensor
/// names; the one without a guidance embedding is schnell (unshifted sigmas, 4 steps).
#[test]
fn flux_dev_and_schnell_are_told_apart_by_their_tensors() {
    use sd_pipeline::family::ModelSpec;
    use sd_pipeline::schedule::Schedule;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sd-models/tests/fixtures/flux");
    for (file, shifted, steps) in [
        ("flux_tiny.safetensors", true, 28),
        ("flux_tiny_schnell.safetensors", false, 4),
    ] {
        let mut cat = sd_formats::files::TensorCatalog::new();
        cat.add_file(dir.join(file), None).unwrap();
        let spec = ModelSpec::detect(&cat).unwrap();
        assert_eq!(spec.family.id(), "flux", "{file}");
        assert_eq!(
            spec.schedule,
            Schedule::Flow {
                shift: 1.0,
                resolution_shift: shifted.then_some(sd_pipeline::schedule::ResolutionShift::FLUX),
                spacing: sd_pipeline::schedule::FlowSpacing::Linspace,
            },
            "{file}"
        );
        assert_eq!(spec.defaults.steps, steps, "{file}");
        assert_eq!(spec.defaults.cfg_scale, 1.0);
    }
}
