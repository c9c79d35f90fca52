//! [`Txt2Img`]: the settings of a generation, and their checks against a model.

use crate::error::GenerateError;
use crate::family::ModelSpec;
use crate::rng::RngKind;
use crate::sampling::SampleMethod;
use crate::schedule::Scheduler;
use crate::vae_tiling::VaeTiling;
use sd_models::diffusion::DiffusionArch;

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
    /// Skip-layer guidance (SD3; `None`: off).
    pub slg: Option<SkipLayerGuidance>,
    /// The flow models' timestep shift (`--flow-shift`; `None`: the model's): SD3's
    /// `shift` (3), or for FLUX.1 stable-diffusion.cpp's `mu` (a fixed
    /// `e^mu / (e^mu + 1/t - 1)` shift instead of the resolution-dependent one).
    pub flow_shift: Option<f32>,
}

/// Skip-layer guidance (SD3.5 Medium's recommendation; stable-diffusion.cpp's
/// `--slg-scale`, `--skip-layers`, `--skip-layer-start`, `--skip-layer-end`; diffusers'
/// `skip_guidance_layers`, `skip_layer_guidance_{scale,start,stop}`): at the steps `i` with
/// `start * steps < i < end * steps`, one more pass on the prompt without the listed
/// blocks, and the prediction moves by `scale * (prompt - skipped)`.
#[derive(Clone, Debug, PartialEq)]
pub struct SkipLayerGuidance {
    /// The strength (`--slg-scale`; 2.5 is stable-diffusion.cpp's suggestion for SD3.5
    /// Medium, 2.8 diffusers' default).
    pub scale: f32,
    /// The blocks left out (`--skip-layers`, default 7, 8, 9).
    pub layers: Vec<usize>,
    /// The fraction of the steps after which it starts (`--skip-layer-start`, 0.01).
    pub start: f32,
    /// The fraction of the steps before which it stops (`--skip-layer-end`, 0.2).
    pub end: f32,
}

impl SkipLayerGuidance {
    /// Whether step `step` (from 0) of `steps` gets the extra pass.
    pub fn active(&self, step: usize, steps: usize) -> bool {
        let (i, n) = (step as f32, steps as f32);
        i > n * self.start && i < n * self.end
    }
}

impl Default for SkipLayerGuidance {
    fn default() -> Self {
        SkipLayerGuidance {
            scale: 2.5,
            layers: vec![7, 8, 9],
            start: 0.01,
            end: 0.2,
        }
    }
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
            slg: None,
            flow_shift: None,
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
    if let Some(s) = p.flow_shift {
        if !matches!(spec.schedule, crate::schedule::Schedule::Flow { .. }) {
            return Err(GenerateError::InvalidSetting {
                flag: "flow-shift",
                message: format!("{} is not a flow model", spec.family.name()),
            });
        }
        if !s.is_finite() || s <= 0.0 {
            return Err(GenerateError::InvalidSetting {
                flag: "flow-shift",
                message: format!("{s} is not a positive number"),
            });
        }
    }
    if let Some(slg) = &p.slg {
        let DiffusionArch::Mmdit(m) = &spec.diffusion.1 else {
            return Err(GenerateError::InvalidSetting {
                flag: "slg-scale",
                message: format!(
                    "skip-layer guidance needs an SD3 model, not {}",
                    spec.family.name()
                ),
            });
        };
        if let Some(l) = slg.layers.iter().find(|&&l| l >= m.depth) {
            return Err(GenerateError::InvalidSetting {
                flag: "skip-layers",
                message: format!(
                    "block {l}: the model has {} joint blocks (0 to {})",
                    m.depth,
                    m.depth.saturating_sub(1)
                ),
            });
        }
        if !slg.scale.is_finite()
            || !(0.0..=1.0).contains(&slg.start)
            || !(0.0..=1.0).contains(&slg.end)
        {
            return Err(GenerateError::InvalidSetting {
                flag: "slg-scale",
                message: "the scale must be finite, start and end fractions in [0, 1]".into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// diffusers' `i > steps * start and i < steps * stop`.
    #[test]
    fn skip_layer_guidance_steps_follow_diffusers() {
        let slg = SkipLayerGuidance {
            end: 0.5,
            ..SkipLayerGuidance::default()
        };
        let on: Vec<usize> = (0..10).filter(|&i| slg.active(i, 10)).collect();
        assert_eq!(on, [1, 2, 3, 4]);
        let d = SkipLayerGuidance::default();
        assert_eq!((0..28).filter(|&i| d.active(i, 28)).count(), 5);
    }
}
