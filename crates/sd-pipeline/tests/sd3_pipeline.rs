//! SD3.5 end to end against diffusers' `StableDiffusion3Pipeline` steps: a tiny random
//! checkpoint in Stability's single-file layout (MMDiT with QK norm and MMDiT-X attention,
//! CLIP-L, bigG, T5 with the real vocabulary, 16-channel VAE;
//! `scripts/fixtures/make_sd3_fixtures.py pipeline`), the prompt through three tokenizers,
//! the joint context, the scheduler's shifted sigmas, CFG with a negative prompt and with
//! the empty one, skip-layer guidance, Euler steps, decode with scale and shift: latents within relative L2 1e-3,
//! images within 1 level.

mod common;

use std::path::{Path, PathBuf};

use sd_pipeline::generate::{Callbacks, Pipeline, Txt2Img};
use sd_pipeline::params::SkipLayerGuidance;
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::RuntimeOptions;
use sd_pipeline::sampling::SampleMethod;
use sd_pipeline::schedule::sd3_sigmas;
use sd_testutil::rel_l2;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline")
}

/// A reference tensor of `runs_sd3.safetensors`.
fn reference(name: &str) -> Vec<f32> {
    common::reference::tensor(&fixtures().join("runs_sd3.safetensors"), name)
}

/// A run's skip-layer guidance (`null`: none).
fn slg(v: &Value) -> Option<SkipLayerGuidance> {
    let f = |k: &str| v[k].as_f64().unwrap() as f32;
    v.is_object().then(|| SkipLayerGuidance {
        scale: f("scale"),
        layers: v["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().unwrap() as usize)
            .collect(),
        start: f("start"),
        end: f("end"),
    })
}

/// The settings of a fixture run.
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
        slg: slg(&run["slg"]),
        ..Txt2Img::default()
    }
}

/// Generates `params` with `p`: the final latents and the images.
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

/// The tiny checkpoint with its token embeddings made whole, in `dir`.
pub fn tiny_sd3(dir: &Path) -> PathBuf {
    let path = dir.join("tiny_sd3.safetensors");
    common::files::expand_sparse(&fixtures().join("tiny_sd3.safetensors"), &path);
    path
}

#[test]
fn tiny_sd35_matches_diffusers() {
    let text = std::fs::read_to_string(fixtures().join("runs_sd3.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let tmp = std::env::temp_dir().join(format!("sd-rs-sd3-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut p = Pipeline::load(
        tiny_sd3(&tmp),
        RuntimeOptions {
            threads: 2,
            ..RuntimeOptions::default()
        },
    )
    .unwrap();
    std::fs::remove_dir_all(&tmp).ok();
    assert_eq!(p.spec().family.id(), "sd3");
    for run in v["runs"].as_array().unwrap() {
        let name = run["name"].as_str().unwrap();
        let steps = run["steps"].as_u64().unwrap() as usize;
        let want_sigmas: Vec<f64> = run["sigmas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (g, w) in sd3_sigmas(steps, 3.0).unwrap().iter().zip(&want_sigmas) {
            assert!((*g as f64 - w).abs() < 1e-6, "{name}: sigma {g} vs {w}");
        }
        assert_eq!(params(run).steps, steps);
        let (latents, images) = generate(&mut p, &params(run));
        let e = rel_l2(&latents, &reference(&format!("{name}.latents")));
        let want = reference(&format!("{name}.image"));
        let max = common::reference::max_level_diff(&images[0], &want);
        println!("{name}: latents relative L2 {e:.2e}, image max difference {max} levels");
        assert!(e <= 1e-3, "{name}: latents relative L2 {e:.3e}");
        assert!(max <= 1, "{name}: a pixel differs by {max} levels");
    }
}

/// Stability's transformer files without sd-rs metadata are detected as SD3 from their
/// tensor names; the MMDiT's sizes (QK norm, MMDiT-X blocks) come from the tensors once
/// loaded.
#[test]
fn sai_transformer_files_are_detected_as_sd3() {
    use sd_pipeline::family::ModelSpec;
    use sd_pipeline::sampling::Prediction;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sd-models/tests/fixtures/sd3");
    for file in ["sd3_tiny.safetensors", "sd35_tiny.safetensors"] {
        let mut cat = sd_formats::files::TensorCatalog::new();
        cat.add_file(dir.join(file), None).unwrap();
        let spec = ModelSpec::detect(&cat).unwrap();
        assert_eq!(spec.family.id(), "sd3", "{file}");
        assert_eq!(spec.prediction, Prediction::Flow { time_scale: 1000.0 });
        assert_eq!((spec.latent.scale, spec.latent.shift), (1.5305, 0.0609));
        assert_eq!(spec.size_multiple(), 16);
    }
}

/// A diffusers pipeline folder (`transformer/` in diffusers' names, `text_encoder/`,
/// `text_encoder_2/`, `text_encoder_3/`, `vae/`) of the tiny checkpoint draws what the
/// single file draws.
#[test]
fn a_diffusers_folder_matches_diffusers() {
    let text = std::fs::read_to_string(fixtures().join("runs_sd3.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let run = &v["runs"][0];
    let tmp = std::env::temp_dir().join(format!("sd-rs-sd3-folder-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let single = tiny_sd3(&tmp);
    let folder = tmp.join("tiny-sd3-diffusers");
    for (sub, file) in [
        ("transformer", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
        ("text_encoder_2", "model.safetensors"),
        ("text_encoder_3", "model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
    ] {
        let dir = folder.join(sub);
        std::fs::create_dir_all(&dir).unwrap();
        let dst = dir.join(file);
        match sub {
            "transformer" => common::files::sd3_to_diffusers(&single, 2, &dst),
            "text_encoder" => {
                common::files::strip(&single, "text_encoders.clip_l.transformer.", &dst)
            }
            "text_encoder_2" => {
                common::files::strip(&single, "text_encoders.clip_g.transformer.", &dst)
            }
            "text_encoder_3" => {
                common::files::strip(&single, "text_encoders.t5xxl.transformer.", &dst)
            }
            _ => common::files::strip(&single, "vae.", &dst),
        }
    }
    std::fs::write(
        folder.join("model_index.json"),
        r#"{"_class_name": "StableDiffusion3Pipeline"}"#,
    )
    .unwrap();
    let mut p = Pipeline::load(
        &folder,
        RuntimeOptions {
            threads: 2,
            ..RuntimeOptions::default()
        },
    )
    .unwrap();
    std::fs::remove_dir_all(&tmp).ok();
    assert_eq!(p.spec().family.id(), "sd3");
    let name = run["name"].as_str().unwrap();
    let (latents, _) = generate(&mut p, &params(run));
    let e = rel_l2(&latents, &reference(&format!("{name}.latents")));
    println!("{name} from a diffusers folder: latents relative L2 {e:.2e}");
    assert!(e <= 1e-3, "{name}: latents relative L2 {e:.3e}");
}
