//! Qwen-Image: Alibaba's 20 B dual-stream rectified-flow transformer
//! ([`sd_models::qwen_image`]) conditioned on the last hidden states of Qwen2.5-VL-7B's
//! language model ([`sd_models::llm`]), with the Wan-2.1 autoencoder run on single images
//! ([`sd_models::wan_vae`]) and its per-channel latent statistics.
//!
//! Defaults cite `Qwen/Qwen-Image` (`scheduler/scheduler_config.json`:
//! `FlowMatchEulerDiscreteScheduler`, `use_dynamic_shifting`, base/max shift 0.5/0.9 over
//! 256/8192 tokens, `shift_terminal` 0.02; `vae/config.json`: `latents_mean`/`latents_std`)
//! and diffusers' `QwenImagePipeline` (1024x1024, 50 steps, `true_cfg_scale` 4 with a
//! negative prompt, the guided prediction rescaled per packed token to the norm of the
//! prompt's).
//!
//! Conditioning, as `QwenImagePipeline._get_qwen_prompt_embeds`: the prompt wrapped in the
//! chat template ([`crate::tokenizer_qwen`]), through the LLM (causal, no padding), the
//! final-norm hidden states with the template's first 34 tokens dropped: a `[n, 3584]`
//! context whose length follows the prompt. The negative prompt (`" "` when empty, as
//! diffusers needs one for true CFG) is encoded the same way; the two contexts differ in
//! length and run as separate passes.
//!
//! Differences from stable-diffusion.cpp, which sd-rs does not follow: it samples with a
//! constant flow shift of 3 and plain CFG (its docs use `--cfg-scale 2.5`); `--flow-shift`
//! gives the constant shift here too.

use std::sync::OnceLock;

use sd_formats::names::{SdVersion, LLM_PREFIX};
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::llm::LlmConfig;
use sd_models::qwen_image::QwenImageConfig;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::wan_vae::{WanVaeConfig, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD};
use serde::{Deserialize, Serialize};

use super::ldm::config_over;
use super::{
    ChannelStats, Conditioning, Defaults, Family, LatentFormat, ModelConfigError, ModelSpec, Slot,
    SlotKind, TextCond, TextEncode, DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::ConditioningError;
use crate::sampling::{Prediction, SampleMethod};
use crate::schedule::{AysTable, FlowSpacing, ResolutionShift, Schedule};
use crate::tokenizer_qwen::{QwenTokenizer, TemplatedIds, QWEN_IMAGE_MAX_PROMPT_TOKENS};

/// The LLM text encoder (`--llm`).
pub const LLM_SLOT: Slot = Slot {
    kind: SlotKind::TextEncoder,
    name: "llm",
    flag: "--llm",
    prefix: LLM_PREFIX,
    what: "Qwen2.5-VL text encoder",
};

/// The longest context the family passes (diffusers' `tokenizer_max_length`: 1024 prompt
/// tokens after the template's); the memory preflight plans for it.
pub const MAX_PROMPT_TOKENS: usize = QWEN_IMAGE_MAX_PROMPT_TOKENS;

/// The slots of a Qwen-Image model.
static SLOTS: [Slot; 3] = [LLM_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// The per-channel latent statistics of the Wan-2.1 autoencoder.
pub static WAN21_STATS: ChannelStats = ChannelStats {
    mean: &WAN21_LATENTS_MEAN,
    std: &WAN21_LATENTS_STD,
};

/// The configuration of a Qwen-Image model (sd-rs metadata keys overlay it). The
/// networks' sizes are read from their tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QwenImageFamilyConfig {
    /// The family id (`qwen-image`).
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
    /// Recommended guidance scale (`true_cfg_scale`).
    pub cfg_scale: f32,
}

/// `Qwen/Qwen-Image`'s defaults (see the module documentation).
pub fn config() -> QwenImageFamilyConfig {
    QwenImageFamilyConfig {
        family: None,
        name: String::new(),
        width: 1024,
        height: 1024,
        steps: 50,
        cfg_scale: 4.0,
    }
}

/// The shipped Qwen2 tokenizer, built once per process (decompressing and building the
/// 151,387 merges takes a fraction of a second: not once per generation).
fn builtin_tokenizer() -> Result<&'static QwenTokenizer, ConditioningError> {
    static TOKENIZER: OnceLock<Result<QwenTokenizer, String>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| QwenTokenizer::builtin().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ConditioningError::Mismatch(e.clone()))
}

/// The Qwen-Image family.
#[derive(Clone, Copy, Debug)]
pub struct QwenImage;

impl Family for QwenImage {
    fn id(&self) -> &'static str {
        "qwen-image"
    }

    fn name(&self) -> &'static str {
        "Qwen-Image"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::QwenImage
    }

    fn slots(&self) -> &'static [Slot] {
        &SLOTS
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            width: 1024,
            height: 1024,
            steps: 50,
            cfg_scale: 4.0,
            sampler: SampleMethod::Euler,
            scheduler: None,
            ays: AysTable::Sdxl,
        }
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        let c = match config_json {
            Some(text) => config_over(&config(), text, |_| {})?,
            None => config(),
        };
        let mut llm = TextEncoderArch::Llm(LlmConfig::qwen2_5_vl_7b());
        llm.set_prefix(LLM_SLOT.prefix);
        let mut net = DiffusionArch::QwenImage(QwenImageConfig::default());
        net.set_prefix(DIFFUSION_SLOT.prefix);
        let mut vae = FirstStageArch::Wan(WanVaeConfig::default());
        vae.set_prefix(VAE_SLOT.prefix);
        Ok(ModelSpec {
            family: self,
            name: c.name,
            text_encoders: vec![(LLM_SLOT, llm)],
            diffusion: (DIFFUSION_SLOT, net),
            first_stage: (VAE_SLOT, vae),
            prediction: Prediction::Flow { time_scale: 1.0 },
            schedule: Schedule::Flow {
                shift: 1.0,
                resolution_shift: Some(ResolutionShift::QWEN_IMAGE),
                spacing: FlowSpacing::Linspace,
            },
            latent: LatentFormat {
                scale: 1.0,
                shift: 0.0,
                channels: Some(WAN21_STATS),
            },
            defaults: Defaults {
                width: c.width,
                height: c.height,
                steps: c.steps,
                cfg_scale: c.cfg_scale,
                ..self.defaults()
            },
        })
    }

    fn cfg_renorm(&self) -> Option<usize> {
        // diffusers' norms are over a packed token: a 2x2 patch of the latent.
        Some(2)
    }

    fn condition(
        &self,
        _spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        _size: (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        let tokenizer = builtin_tokenizer()?;
        let mut one = |p: &str| -> Result<TextCond, ConditioningError> {
            let TemplatedIds { ids, drop } = tokenizer
                .encode_qwen_image(p)
                .map_err(|e| ConditioningError::Mismatch(e.to_string()))?;
            let states = text
                .encode(0, &ids)
                .map_err(|e| ConditioningError::Encoder {
                    chunk: 0,
                    source: Box::new(e),
                })?;
            let n = states.shape()[0];
            let context = states
                .slice(0, drop, n)
                .map_err(|e| ConditioningError::Mismatch(e.to_string()))?;
            Ok(TextCond { context, y: None })
        };
        // diffusers runs true CFG only with a negative prompt; " " is its usual empty one.
        let negative = if negative.is_empty() { " " } else { negative };
        Ok(Conditioning {
            cond: one(prompt)?,
            uncond: one(negative)?,
        })
    }
}
