//! What the LDM families (SD1.x, SD2.x: one CLIP text encoder, a UNet, an AutoencoderKL)
//! share: their `serde` configuration and CLIP conditioning.
//!
//! The sd-rs metadata ([`super::CONFIG_KEY`]) of such a file is a JSON object with optional
//! top-level `family` (`sd1`, `sd2`), `name`, `prediction` (`eps` / `v`), `width`, `height`,
//! `steps`, `cfg_scale`, and `unet`, `vae` and `clip` sections whose keys are the field names
//! of [`UnetConfig`], [`VaeConfig`] and [`ClipTextConfig`], plus `vae.scaling_factor` (as
//! diffusers keeps it in the VAE's `config.json`). Keys given replace the family's defaults
//! ([`LdmConfig`] values of [`super::sd1`] / [`super::sd2`]); unknown keys are errors.

use sd_models::clip::ClipTextConfig;
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::unet::UnetConfig;
use sd_models::vae::VaeConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    Conditioning, Defaults, Family, LatentFormat, ModelConfigError, ModelSpec, Slot, TextCond,
    TextEncode, DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::{encode_cfg, ConditioningError};
use crate::sampling::Prediction;
use crate::schedule::Schedule;
use crate::tokenizer::ClipTokenizer;

/// What an LDM network predicts, as the metadata names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PredictionName {
    /// The noise (`parameterization: eps`).
    Eps,
    /// The velocity (`parameterization: v`).
    V,
}

impl From<PredictionName> for Prediction {
    fn from(p: PredictionName) -> Self {
        match p {
            PredictionName::Eps => Prediction::Eps,
            PredictionName::V => Prediction::V,
        }
    }
}

/// The configuration of an LDM checkpoint (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LdmConfig {
    /// The family id (`sd1`, `sd2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    /// A display name.
    #[serde(default)]
    pub name: String,
    /// What the UNet predicts.
    pub prediction: PredictionName,
    /// Native image width.
    pub width: usize,
    /// Native image height.
    pub height: usize,
    /// Recommended sampling steps.
    pub steps: usize,
    /// Recommended CFG scale.
    pub cfg_scale: f32,
    /// The VAE latent scaling factor (`scale_factor`).
    pub scaling_factor: f32,
    /// The UNet (`unet_config.params`).
    pub unet: UnetConfig,
    /// The autoencoder (`first_stage_config.params.ddconfig`).
    pub vae: VaeConfig,
    /// The text encoder.
    pub clip: ClipTextConfig,
}

/// Overlays `over` onto `base`, objects key by key.
pub(crate) fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// Parses the sd-rs metadata `text` (a JSON object) over `defaults`, objects merged key by
/// key ([`merge`]); `adjust` rewrites the overlay first (the LDM files' `vae.scaling_factor`).
pub(crate) fn config_over<T: serde::Serialize + serde::de::DeserializeOwned>(
    defaults: &T,
    text: &str,
    adjust: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> Result<T, ModelConfigError> {
    let inv = |e: String| ModelConfigError::Invalid(e);
    let mut over: Value = serde_json::from_str(text).map_err(|e| inv(e.to_string()))?;
    adjust(
        over.as_object_mut()
            .ok_or_else(|| inv("not a JSON object".into()))?,
    );
    let mut base = serde_json::to_value(defaults).map_err(|e| inv(e.to_string()))?;
    merge(&mut base, over);
    serde_json::from_value(base).map_err(|e| inv(e.to_string()))
}

/// Moves `vae.scaling_factor` to the top level (where the LDM configs keep it; the file
/// format keeps it in the `vae` section).
pub(crate) fn hoist_vae_scale(obj: &mut serde_json::Map<String, Value>) {
    let scale = match obj.get_mut("vae") {
        Some(Value::Object(vae)) => vae.remove("scaling_factor"),
        _ => None,
    };
    if let Some(s) = scale {
        obj.insert("scaling_factor".into(), s);
    }
}

impl LdmConfig {
    /// Parses sd-rs metadata `text` over `defaults`.
    pub fn from_json_over(defaults: &LdmConfig, text: &str) -> Result<Self, ModelConfigError> {
        let cfg = config_over(defaults, text, hoist_vae_scale)?;
        if cfg.vae.ch_mult.is_empty() {
            return Err(ModelConfigError::Invalid("vae.ch_mult is empty".into()));
        }
        Ok(cfg)
    }

    /// The model spec of `family` with this configuration; the text encoder goes in
    /// `text_slot`.
    pub fn into_spec(
        self,
        family: &'static dyn Family,
        text_slot: Slot,
        defaults: Defaults,
    ) -> ModelSpec {
        let mut clip = TextEncoderArch::Clip(self.clip);
        clip.set_prefix(text_slot.prefix);
        let mut unet = DiffusionArch::Unet(self.unet);
        unet.set_prefix(DIFFUSION_SLOT.prefix);
        let mut vae = FirstStageArch::AutoencoderKl(self.vae);
        vae.set_prefix(VAE_SLOT.prefix);
        ModelSpec {
            family,
            name: self.name,
            text_encoders: vec![(text_slot, clip)],
            diffusion: (DIFFUSION_SLOT, unet),
            first_stage: (VAE_SLOT, vae),
            prediction: self.prediction.into(),
            schedule: Schedule::scaled_linear(),
            latent: LatentFormat::scaled(self.scaling_factor, 0.0),
            defaults: Defaults {
                width: self.width,
                height: self.height,
                steps: self.steps,
                cfg_scale: self.cfg_scale,
                ..defaults
            },
        }
    }
}

/// The spec of an LDM family: `defaults` with the metadata `config` applied.
pub fn ldm_spec(
    family: &'static dyn Family,
    defaults: &LdmConfig,
    text_slot: Slot,
    config: Option<&str>,
) -> Result<ModelSpec, ModelConfigError> {
    let cfg = match config {
        Some(text) => LdmConfig::from_json_over(defaults, text)?,
        None => defaults.clone(),
    };
    Ok(cfg.into_spec(family, text_slot, family.defaults()))
}

/// One CLIP encoder's conditioning: prompt and negative prompt tokenized with `tokenizer`
/// (padded to the same number of 77-token chunks), encoded by text encoder 0.
pub fn clip_condition(
    tokenizer: &ClipTokenizer,
    text: &mut dyn TextEncode,
    prompt: &str,
    negative: &str,
) -> Result<Conditioning, ConditioningError> {
    let c = encode_cfg(tokenizer, prompt, negative, |ids: &[i32]| {
        text.encode(0, ids)
    })?;
    Ok(Conditioning {
        cond: TextCond {
            context: c.cond,
            y: None,
        },
        uncond: TextCond {
            context: c.uncond,
            y: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use sd_models::unet::HeadSpec;

    use super::*;
    use crate::family::{sd1, sd2, CLIP_H_SLOT, CLIP_L_SLOT};

    #[test]
    fn metadata_overlays_the_family_defaults() {
        let text = r#"{"name":"tiny","width":64,"height":64,"cfg_scale":5.0,
            "unet":{"model_channels":32,"channel_mult":[1,2,2],"heads":{"Heads":4},
                    "context_dim":32,"norm_groups":8,"attention_resolutions":[1,2]},
            "vae":{"ch":32,"ch_mult":[1,2,2],"num_res_blocks":1,"norm_groups":8,
                   "scaling_factor":0.2},
            "clip":{"hidden_size":32,"num_hidden_layers":3,"hidden_act":"quick_gelu"}}"#;
        let c = LdmConfig::from_json_over(&sd1::config(), text).unwrap();
        assert_eq!(c.name, "tiny");
        assert_eq!(c.unet.model_channels, 32);
        assert_eq!(c.unet.heads, HeadSpec::Heads(4));
        assert_eq!(c.unet.num_res_blocks, 2);
        assert_eq!(c.vae.downsample_factor(), 4);
        assert_eq!(c.scaling_factor, 0.2);
        assert_eq!(c.clip.hidden_size, 32);
        assert_eq!((c.width, c.height, c.cfg_scale), (64, 64, 5.0));
        let spec = c.into_spec(&crate::family::sd1::Sd1, CLIP_L_SLOT, sd1::Sd1.defaults());
        assert_eq!(spec.size_multiple(), 16);
        assert_eq!(spec.latent_shape(64, 32), [1, 4, 8, 16]);
        assert_eq!((spec.defaults.width, spec.defaults.cfg_scale), (64, 5.0));

        // Keys not given keep the family's values, not SD1's.
        let c =
            LdmConfig::from_json_over(&sd2::config(), r#"{"unet":{"model_channels":32}}"#).unwrap();
        assert_eq!(c.unet.heads, HeadSpec::HeadDim(64));
        assert!(c.unet.use_linear_in_transformer);
        assert_eq!(c.clip.clip_skip, 2);
        let spec = c.into_spec(&crate::family::sd2::Sd2, CLIP_H_SLOT, sd2::Sd2.defaults());
        let TextEncoderArch::Clip(clip) = &spec.text_encoders[0].1 else {
            panic!("SD2's text encoder is not a CLIP");
        };
        assert_eq!(clip.prefix, "cond_stage_model.transformer.text_model");
    }

    #[test]
    fn rejects_bad_configs() {
        for bad in [
            "[]",
            "{",
            r#"{"unet":{"nope":1}}"#,
            r#"{"unet":{"heads":"x"}}"#,
            r#"{"clip":{"hidden_act":"relu"}}"#,
            r#"{"prediction":"x0"}"#,
            r#"{"vae":{"ch_mult":[]}}"#,
            r#"{"colour":"blue"}"#,
        ] {
            assert!(
                LdmConfig::from_json_over(&sd1::config(), bad).is_err(),
                "{bad}"
            );
        }
    }
}
