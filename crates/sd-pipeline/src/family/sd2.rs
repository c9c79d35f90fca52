//! Stable Diffusion 2.x: OpenCLIP ViT-H/14 (penultimate layer), the SD2 UNet (64-wide heads,
//! linear transformer projections), AutoencoderKL. Prompts are padded with token 0, as
//! OpenCLIP's tokenizer, diffusers' SD2 tokenizer (`pad_token: "!"`) and stable-diffusion.cpp
//! do. The 768-v checkpoints predict v; the weights do not tell, so eps is the default and
//! `--prediction v` (or `"prediction": "v"` in the metadata) selects it.

use sd_formats::names::SdVersion;
use sd_models::clip::ClipTextConfig;
use sd_models::unet::UnetConfig;
use sd_models::vae::VaeConfig;

use super::ldm::{clip_condition, ldm_spec, LdmConfig, PredictionName};
use super::{
    Conditioning, Defaults, Family, ModelConfigError, ModelSpec, Slot, TextEncode, CLIP_H_SLOT,
    DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::ConditioningError;
use crate::sampling::SampleMethod;
use crate::schedule::AysTable;
use crate::tokenizer::ClipTokenizer;

/// The SD2.x family.
#[derive(Clone, Copy, Debug)]
pub struct Sd2;

/// The slots of an SD2 model.
static SLOTS: [Slot; 3] = [CLIP_H_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// SD2.x: `configs/stable-diffusion/v2-inference.yaml` (eps; `scale_factor: 0.18215`, the
/// UNet of [`UnetConfig::sd2`], the SD1 autoencoder, OpenCLIP ViT-H/14 `layer: penultimate`
/// as [`ClipTextConfig::sd2`]); 512x512, 20 steps, CFG 7.
pub fn config() -> LdmConfig {
    LdmConfig {
        family: None,
        name: String::new(),
        prediction: PredictionName::Eps,
        width: 512,
        height: 512,
        steps: 20,
        cfg_scale: 7.0,
        scaling_factor: 0.18215,
        unet: UnetConfig::sd2(),
        vae: VaeConfig::default(),
        clip: ClipTextConfig::sd2(),
    }
}

impl Family for Sd2 {
    fn id(&self) -> &'static str {
        "sd2"
    }

    fn name(&self) -> &'static str {
        "SD 2.x"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::Sd2
    }

    fn slots(&self) -> &'static [Slot] {
        &SLOTS
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            width: 512,
            height: 512,
            steps: 20,
            cfg_scale: 7.0,
            sampler: SampleMethod::Euler,
            scheduler: None,
            ays: AysTable::Sd15,
        }
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        ldm_spec(self, &config(), CLIP_H_SLOT, config_json)
    }

    fn condition(
        &self,
        _spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        _size: (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        clip_condition(&ClipTokenizer::sd2(), text, prompt, negative)
    }
}
