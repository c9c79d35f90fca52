//! Stable Diffusion 1.x: CLIP ViT-L/14 (last layer), the SD1 UNet, AutoencoderKL; eps
//! prediction on the `scaled_linear` DDPM schedule. Prompts are padded with EOS.

use sd_formats::names::SdVersion;
use sd_models::clip::ClipTextConfig;
use sd_models::unet::UnetConfig;
use sd_models::vae::VaeConfig;

use super::ldm::{clip_condition, ldm_spec, LdmConfig, PredictionName};
use super::{
    Conditioning, Defaults, Family, ModelConfigError, ModelSpec, Slot, TextEncode, CLIP_L_SLOT,
    DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::ConditioningError;
use crate::sampling::SampleMethod;
use crate::schedule::AysTable;
use crate::tokenizer::ClipTokenizer;

/// The SD1.x family.
#[derive(Clone, Copy, Debug)]
pub struct Sd1;

/// The slots of an SD1 model.
static SLOTS: [Slot; 3] = [CLIP_L_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// SD1.x: `configs/stable-diffusion/v1-inference.yaml` (`parameterization` eps,
/// `scale_factor: 0.18215`, the UNet, `first_stage_config` and CLIP ViT-L/14 of
/// [`UnetConfig::sd1`], [`VaeConfig::default`], [`ClipTextConfig::sd1`]); 512x512, 20 steps
/// and CFG 7 as stable-diffusion.cpp defaults them.
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
        unet: UnetConfig::sd1(),
        vae: VaeConfig::default(),
        clip: ClipTextConfig::sd1(),
    }
}

impl Family for Sd1 {
    fn id(&self) -> &'static str {
        "sd1"
    }

    fn name(&self) -> &'static str {
        "SD 1.x"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::Sd1
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
        ldm_spec(self, &config(), CLIP_L_SLOT, config_json)
    }

    fn condition(
        &self,
        _spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        _size: (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        clip_condition(&ClipTokenizer::sd1(), text, prompt, negative)
    }
}
