//! [`Txt2Img`]: the settings of a generation, and their checks against a model.

use crate::error::GenerateError;
use crate::family::ModelSpec;
use crate::rng::RngKind;
use crate::sampling::SampleMethod;
use crate::schedule::Scheduler;
use crate::vae_tiling::VaeTiling;

/// The settings of a txt2img run (stable-diffusion.cpp's flags of the same names).
#[derive(Clone, Debug, PartialEq)]
pub struct Txt2Img {
    /// The prompt (attention syntax `(word:1.2)` allowed).
    pub prompt: String,
    /// The negative prompt (empty: the unconditional embedding).
    pub negative: String,
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1: no guidance, the UNet runs on the prompt only).
    pub cfg_scale: f32,
    /// Distilled guidance strength for networks that embed one (FLUX.1-dev's `--guidance`,
    /// default 3.5); ignored by the others.
    pub guidance: f32,
    /// Seed of the first image; image `i` of a batch uses `seed + i`.
    pub seed: u64,
    /// The sampler.
    pub sampler: SampleMethod,
    /// The sigma scheduler.
    pub scheduler: Scheduler,
    /// CPU threads.
    pub threads: usize,
    /// Number of images.
    pub batch: usize,
    /// The noise generator (`--rng`; stable-diffusion.cpp defaults to `cuda`, sd-rs to `cpu`,
    /// torch's CPU generator).
    pub rng: RngKind,
    /// Decode the latents in tiles (`--vae-tiling`; `None`: whole).
    pub vae_tiling: Option<VaeTiling>,
}

impl Default for Txt2Img {
    fn default() -> Self {
        Txt2Img {
            prompt: String::new(),
            negative: String::new(),
            width: 512,
            height: 512,
            steps: 20,
            cfg_scale: 7.0,
            guidance: 3.5,
            seed: 42,
            sampler: SampleMethod::Euler,
            scheduler: Scheduler::Discrete,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            batch: 1,
            rng: RngKind::Cpu,
            vae_tiling: None,
        }
    }
}

/// Checks `p` against the model `spec`: sizes, steps, CFG scale and batch.
pub(crate) fn check_settings(spec: &ModelSpec, p: &Txt2Img) -> Result<(), GenerateError> {
    let multiple = spec.size_multiple();
    for (flag, v) in [("width", p.width), ("height", p.height)] {
        if v == 0 || v % multiple != 0 {
            return Err(GenerateError::InvalidSetting {
                flag,
                message: format!(
                    "{v} is not a positive multiple of {multiple} (the VAE factor {} x the \
                     diffusion network's latent multiple {})",
                    spec.first_stage.1.downsample_factor(),
                    spec.diffusion.1.latent_multiple()
                ),
            });
        }
    }
    if p.steps == 0 {
        return Err(GenerateError::InvalidSetting {
            flag: "steps",
            message: "must be at least 1".into(),
        });
    }
    if !p.cfg_scale.is_finite() {
        return Err(GenerateError::InvalidSetting {
            flag: "cfg-scale",
            message: format!("{} is not a finite number", p.cfg_scale),
        });
    }
    if p.batch == 0 {
        return Err(GenerateError::InvalidSetting {
            flag: "batch-count",
            message: "must be at least 1".into(),
        });
    }
    Ok(())
}
