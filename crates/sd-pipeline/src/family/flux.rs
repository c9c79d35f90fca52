//! FLUX.1 (dev and schnell): Black Forest Labs' rectified-flow transformer
//! ([`sd_models::flux`]) with T5-XXL states as context, CLIP-L's pooled output as `y`, and a
//! 16-channel autoencoder.
//!
//! Defaults cite `black-forest-labs/FLUX.1-dev` (`model_index.json`, `scheduler_config.json`:
//! `FlowMatchEulerDiscreteScheduler`, `use_dynamic_shifting`, base/max shift 0.5/1.15;
//! `vae/config.json`: `latent_channels: 16`, `scaling_factor: 0.3611`, `shift_factor: 0.1159`,
//! no quant convs) and diffusers' `FluxPipeline` (1024x1024, 28 steps, guidance 3.5,
//! `max_sequence_length` 512). stable-diffusion.cpp pads T5 to 256-token chunks; sd-rs
//! follows diffusers (512). schnell (no `guidance_in`): unshifted sigmas, 4 steps.
//!
//! Conditioning: the prompt through T5 (padded to 512 tokens with `</s>` and 0s, no
//! attention mask) gives the context; through CLIP-L (77 tokens, end-of-text padding) its
//! unprojected pooled output (final layer norm at the first end-of-text) gives `y`. CFG is
//! off by default (`--cfg-scale 1`); with a scale above 1 the negative prompt is encoded
//! the same way ("true CFG").

use sd_formats::files::TensorCatalog;
use sd_formats::names::{SdVersion, T5_PREFIX};
use sd_models::clip::ClipTextConfig;
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::flux::{FluxConfig, FluxLayout};
use sd_models::t5::T5Config;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::vae::VaeConfig;
use serde::{Deserialize, Serialize};

use super::ldm::config_over;
use super::sdxl::{encode, pool_position};
use super::{
    Conditioning, Defaults, Family, LatentFormat, ModelConfigError, ModelSpec, Slot, SlotKind,
    TextCond, TextEncode, CLIP_L_SLOT, DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::ConditioningError;
use crate::sampling::{Prediction, SampleMethod};
use crate::schedule::{AysTable, FlowSpacing, ResolutionShift, Schedule};
use crate::tokenizer::ClipTokenizer;
use crate::tokenizer_t5::T5Tokenizer;

/// The T5-XXL encoder of the DiT families (`--t5xxl`).
pub const T5_SLOT: Slot = Slot {
    kind: SlotKind::TextEncoder,
    name: "t5xxl",
    flag: "--t5xxl",
    prefix: T5_PREFIX,
    what: "T5-XXL text encoder",
};

/// T5 tokens of the context (`FluxPipeline`'s `max_sequence_length`).
pub const T5_TOKENS: usize = 512;

/// The slots of a FLUX.1 model.
static SLOTS: [Slot; 4] = [CLIP_L_SLOT, T5_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// The configuration of a FLUX.1 checkpoint (sd-rs metadata keys overlay it). The
/// transformer's sizes are read from its tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FluxFamilyConfig {
    /// The family id (`flux`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    /// A display name.
    #[serde(default)]
    pub name: String,
    /// Native image width.
    pub width: usize,
    /// Native image height.
    pub height: usize,
    /// Recommended sampling steps.
    pub steps: usize,
    /// The VAE latent scaling factor.
    pub scaling_factor: f32,
    /// The VAE latent shift factor.
    pub shift_factor: f32,
    /// The autoencoder.
    pub vae: VaeConfig,
    /// CLIP-L.
    pub clip_l: ClipTextConfig,
    /// The T5 encoder.
    pub t5: T5Config,
}

/// FLUX.1-dev's defaults (see the module documentation).
pub fn config() -> FluxFamilyConfig {
    FluxFamilyConfig {
        family: None,
        name: String::new(),
        width: 1024,
        height: 1024,
        steps: 28,
        scaling_factor: 0.3611,
        shift_factor: 0.1159,
        vae: VaeConfig {
            z_channels: 16,
            use_quant_conv: false,
            ..VaeConfig::default()
        },
        clip_l: ClipTextConfig::sd1(),
        t5: T5Config::xxl(),
    }
}

impl FluxFamilyConfig {
    /// Parses sd-rs metadata `text` over `defaults` (nested objects merge key by key).
    pub fn from_json_over(defaults: &Self, text: &str) -> Result<Self, ModelConfigError> {
        config_over(defaults, text, |_| {})
    }
}

/// The FLUX.1 family.
#[derive(Clone, Copy, Debug)]
pub struct Flux;

impl Family for Flux {
    fn id(&self) -> &'static str {
        "flux"
    }

    fn name(&self) -> &'static str {
        "FLUX.1"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::Flux
    }

    fn slots(&self) -> &'static [Slot] {
        &SLOTS
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            width: 1024,
            height: 1024,
            steps: 28,
            cfg_scale: 1.0,
            sampler: SampleMethod::Euler,
            scheduler: None,
            ays: AysTable::Sdxl,
        }
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        let c = match config_json {
            Some(text) => FluxFamilyConfig::from_json_over(&config(), text)?,
            None => config(),
        };
        let mut clip = TextEncoderArch::Clip(c.clip_l);
        clip.set_prefix(CLIP_L_SLOT.prefix);
        let mut t5 = TextEncoderArch::T5(c.t5);
        t5.set_prefix(T5_SLOT.prefix);
        let mut net = DiffusionArch::Flux(FluxConfig::dev());
        net.set_prefix(DIFFUSION_SLOT.prefix);
        let mut vae = FirstStageArch::AutoencoderKl(c.vae);
        vae.set_prefix(VAE_SLOT.prefix);
        Ok(ModelSpec {
            family: self,
            name: c.name,
            text_encoders: vec![(CLIP_L_SLOT, clip), (T5_SLOT, t5)],
            diffusion: (DIFFUSION_SLOT, net),
            first_stage: (VAE_SLOT, vae),
            prediction: Prediction::Flow { time_scale: 1.0 },
            schedule: Schedule::Flow {
                shift: 1.0,
                resolution_shift: Some(ResolutionShift::FLUX),
                spacing: FlowSpacing::Linspace,
            },
            latent: LatentFormat::scaled(c.scaling_factor, c.shift_factor),
            defaults: Defaults {
                width: c.width,
                height: c.height,
                steps: c.steps,
                ..self.defaults()
            },
        })
    }

    fn refine(&self, spec: &mut ModelSpec, catalog: &TensorCatalog) {
        // schnell has no guidance embedding: unshifted sigmas, 4 steps.
        let guided = [FluxLayout::Bfl, FluxLayout::Diffusers].iter().any(|l| {
            let probe = l.name("guidance_in.in_layer.weight");
            catalog
                .get(&format!("{}{probe}", DIFFUSION_SLOT.prefix))
                .is_some()
        });
        if !guided {
            spec.schedule = Schedule::Flow {
                shift: 1.0,
                resolution_shift: None,
                spacing: FlowSpacing::Linspace,
            };
            spec.defaults.steps = 4;
            if let DiffusionArch::Flux(c) = &mut spec.diffusion.1 {
                c.guidance_embed = false;
            }
        }
    }

    fn condition(
        &self,
        _spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        _size: (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        let t5 = T5Tokenizer::builtin().map_err(|e| ConditioningError::Mismatch(e.to_string()))?;
        let clip = ClipTokenizer::sd1();
        let mut one = |p: &str| -> Result<TextCond, ConditioningError> {
            let ids = t5
                .encode_padded(p, T5_TOKENS)
                .map_err(|e| ConditioningError::Mismatch(e.to_string()))?;
            let context = text
                .encode(1, &ids)
                .map_err(|e| ConditioningError::Encoder {
                    chunk: 0,
                    source: Box::new(e),
                })?;
            let tokens = clip.tokenize(p);
            let mut pooled = None;
            encode(text, 0, &tokens, Some(&mut pooled))?;
            let pooled = pooled.ok_or_else(|| {
                ConditioningError::Mismatch("no pooled output from CLIP-L".into())
            })?;
            Ok(TextCond {
                context,
                y: Some(pooled),
            })
        };
        Ok(Conditioning {
            cond: one(prompt)?,
            uncond: one(negative)?,
        })
    }
}

/// The CLIP ids' pooling position (the first end-of-text), for tests.
pub fn clip_pool_position(ids: &[i32]) -> usize {
    pool_position(ids)
}
