//! Model configuration detection: which CLIP / UNet / VAE configs a checkpoint needs.
//!
//! A safetensors file may carry its configs in the `__metadata__` key [`CONFIG_KEY`]
//! (`sd-rs.config`): a JSON object with `unet`, `vae` and `clip` sections whose keys are the
//! field names of [`UnetConfig`], [`VaeConfig`] and [`ClipTextConfig`] (missing keys keep the
//! SD1 defaults), plus optional top-level `name`, `prediction` (`eps` / `v`), `width`,
//! `height` and `cfg_scale`, and `vae.scaling_factor`. Without it the SD1 / SD2 defaults are
//! chosen from the tensors with [`sd_residency::names::detect_version`].

use sd_models::clip::ClipTextConfig;
use sd_models::nn::Activation;
use sd_models::unet::{HeadSpec, UnetConfig};
use sd_models::vae::VaeConfig;
use sd_residency::files::{FileMetadata, ModelLoader};
use sd_residency::names::{detect_version, SdVersion};
use serde_json::{Map, Value};
use thiserror::Error;

use crate::sampling::Prediction;

/// The safetensors metadata key holding an sd-rs config.
pub const CONFIG_KEY: &str = "sd-rs.config";

/// SD1's and SD2's VAE latent scaling factor.
pub const SD_SCALING_FACTOR: f32 = 0.18215;

/// An error of config detection.
#[derive(Debug, Error)]
pub enum ModelConfigError {
    /// The `sd-rs.config` metadata is not valid.
    #[error("invalid {CONFIG_KEY} metadata: {0}")]
    Invalid(String),
    /// The model is not an SD1 / SD2 checkpoint.
    #[error("unsupported model: {0}")]
    Unsupported(String),
}

/// Everything the SD1 / SD2 pipeline needs to know about a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// A display name (from the metadata; else empty).
    pub name: String,
    /// The detected architecture.
    pub version: SdVersion,
    /// The text encoder.
    pub clip: ClipTextConfig,
    /// The UNet.
    pub unet: UnetConfig,
    /// The autoencoder (decoder only is enough for txt2img).
    pub vae: VaeConfig,
    /// The VAE latent scaling factor.
    pub scaling_factor: f32,
    /// What the UNet predicts.
    pub prediction: Prediction,
    /// The native resolution `(width, height)`, when the metadata names one.
    pub native_size: Option<(usize, usize)>,
    /// The recommended CFG scale, when the metadata names one.
    pub cfg_scale: Option<f32>,
}

impl ModelConfig {
    /// SD1.x defaults.
    pub fn sd1() -> Self {
        ModelConfig {
            name: String::new(),
            version: SdVersion::Sd1,
            clip: ClipTextConfig::sd1(),
            unet: UnetConfig::sd1(),
            vae: VaeConfig::default(),
            scaling_factor: SD_SCALING_FACTOR,
            prediction: Prediction::Eps,
            native_size: None,
            cfg_scale: None,
        }
    }

    /// SD2.x defaults (eps prediction; the 768-v checkpoints cannot be told apart by weight).
    pub fn sd2() -> Self {
        ModelConfig {
            version: SdVersion::Sd2,
            clip: ClipTextConfig::sd2(),
            unet: UnetConfig::sd2(),
            ..Self::sd1()
        }
    }

    /// The spatial factor image sizes must be multiples of: the VAE factor times
    /// `2^(unet levels - 1)`.
    pub fn size_multiple(&self) -> usize {
        self.vae.downsample_factor() << self.unet.channel_mult.len().saturating_sub(1)
    }

    /// Detects the config of the files in `loader` (before or after canonicalization).
    pub fn detect(loader: &ModelLoader) -> Result<Self, ModelConfigError> {
        for f in loader.files() {
            if let FileMetadata::Safetensors(map) = &f.metadata {
                if let Some(text) = map.get(CONFIG_KEY) {
                    return Self::from_json(text);
                }
            }
        }
        let version = detect_version(
            loader
                .tensors()
                .map(|t| (t.name.as_str(), t.shape.as_slice())),
        );
        match version {
            Some(SdVersion::Sd1) => Ok(Self::sd1()),
            Some(SdVersion::Sd2) => Ok(Self::sd2()),
            Some(v) => Err(ModelConfigError::Unsupported(format!(
                "{v:?} (only SD1.x and SD2.x txt2img models are supported so far)"
            ))),
            None => Err(ModelConfigError::Unsupported(
                "no Stable Diffusion architecture recognised in the tensors".into(),
            )),
        }
    }

    /// Parses an `sd-rs.config` JSON text.
    pub fn from_json(text: &str) -> Result<Self, ModelConfigError> {
        let v: Value = serde_json::from_str(text).map_err(|e| inv(e.to_string()))?;
        let top = v.as_object().ok_or_else(|| inv("not a JSON object"))?;
        let mut cfg = Self::sd1();
        if let Some(name) = top.get("name") {
            cfg.name = name.as_str().ok_or_else(|| inv("name"))?.to_string();
        }
        if let Some(p) = top.get("prediction") {
            cfg.prediction = match p.as_str() {
                Some("eps") => Prediction::Eps,
                Some("v") => Prediction::V,
                _ => return Err(inv(format!("prediction {p}"))),
            };
        }
        if let (Some(w), Some(h)) = (top.get("width"), top.get("height")) {
            cfg.native_size = Some((usize_of(w, "width")?, usize_of(h, "height")?));
        }
        if let Some(c) = top.get("cfg_scale") {
            cfg.cfg_scale = Some(f32_of(c, "cfg_scale")?);
        }
        if let Some(u) = section(top, "unet")? {
            parse_unet(u, &mut cfg.unet)?;
        }
        if let Some(s) = section(top, "vae")? {
            parse_vae(s, &mut cfg.vae)?;
            if let Some(f) = s.get("scaling_factor") {
                cfg.scaling_factor = f32_of(f, "vae.scaling_factor")?;
            }
        }
        if let Some(s) = section(top, "clip")? {
            parse_clip(s, &mut cfg.clip)?;
        }
        Ok(cfg)
    }
}

fn inv(msg: impl Into<String>) -> ModelConfigError {
    ModelConfigError::Invalid(msg.into())
}

fn section<'a>(
    top: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, ModelConfigError> {
    match top.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_object()
            .map(Some)
            .ok_or_else(|| inv(format!("{key} is not an object"))),
    }
}

fn usize_of(v: &Value, what: &str) -> Result<usize, ModelConfigError> {
    v.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| inv(format!("{what}: expected a non-negative integer, got {v}")))
}

fn f32_of(v: &Value, what: &str) -> Result<f32, ModelConfigError> {
    v.as_f64()
        .map(|n| n as f32)
        .ok_or_else(|| inv(format!("{what}: expected a number, got {v}")))
}

fn bool_of(v: &Value, what: &str) -> Result<bool, ModelConfigError> {
    v.as_bool()
        .ok_or_else(|| inv(format!("{what}: expected a boolean, got {v}")))
}

fn list_of(v: &Value, what: &str) -> Result<Vec<usize>, ModelConfigError> {
    v.as_array()
        .ok_or_else(|| inv(format!("{what}: expected a list, got {v}")))?
        .iter()
        .map(|x| usize_of(x, what))
        .collect()
}

fn parse_unet(s: &Map<String, Value>, c: &mut UnetConfig) -> Result<(), ModelConfigError> {
    for (k, v) in s {
        let w = format!("unet.{k}");
        match k.as_str() {
            "in_channels" => c.in_channels = usize_of(v, &w)?,
            "out_channels" => c.out_channels = usize_of(v, &w)?,
            "model_channels" => c.model_channels = usize_of(v, &w)?,
            "channel_mult" => c.channel_mult = list_of(v, &w)?,
            "num_res_blocks" => c.num_res_blocks = usize_of(v, &w)?,
            "attention_resolutions" => c.attention_resolutions = list_of(v, &w)?,
            "heads" => {
                c.heads = match v {
                    Value::Number(_) => HeadSpec::Heads(usize_of(v, &w)?),
                    Value::Object(o) => match (o.get("Heads"), o.get("HeadDim")) {
                        (Some(h), None) => HeadSpec::Heads(usize_of(h, &w)?),
                        (None, Some(d)) => HeadSpec::HeadDim(usize_of(d, &w)?),
                        _ => return Err(inv(format!("{w}: {v}"))),
                    },
                    _ => return Err(inv(format!("{w}: {v}"))),
                }
            }
            "transformer_depth" => {
                c.transformer_depth = match v {
                    Value::Array(_) => list_of(v, &w)?,
                    _ => {
                        let d = usize_of(v, &w)?;
                        c.transformer_depth_middle = d;
                        vec![d]
                    }
                }
            }
            "transformer_depth_middle" => c.transformer_depth_middle = usize_of(v, &w)?,
            "adm_in_channels" => c.adm_in_channels = Some(usize_of(v, &w)?),
            "context_dim" => c.context_dim = usize_of(v, &w)?,
            "use_linear_in_transformer" => c.use_linear_in_transformer = bool_of(v, &w)?,
            "norm_groups" => c.norm_groups = usize_of(v, &w)?,
            _ => return Err(inv(format!("unknown key {w}"))),
        }
    }
    // One depth for every level (LDM's integer `transformer_depth`).
    if let [d] = c.transformer_depth[..] {
        c.transformer_depth = vec![d; c.channel_mult.len()];
    }
    // Not given: the default's depth at every level of the given `channel_mult`.
    if !s.contains_key("transformer_depth") && c.transformer_depth.len() != c.channel_mult.len() {
        c.transformer_depth = vec![c.transformer_depth_middle; c.channel_mult.len()];
    }
    Ok(())
}

fn parse_vae(s: &Map<String, Value>, c: &mut VaeConfig) -> Result<(), ModelConfigError> {
    for (k, v) in s {
        let w = format!("vae.{k}");
        match k.as_str() {
            "in_channels" => c.in_channels = usize_of(v, &w)?,
            "out_channels" => c.out_channels = usize_of(v, &w)?,
            "ch" => c.ch = usize_of(v, &w)?,
            "ch_mult" => c.ch_mult = list_of(v, &w)?,
            "num_res_blocks" => c.num_res_blocks = usize_of(v, &w)?,
            "z_channels" => c.z_channels = usize_of(v, &w)?,
            "norm_groups" => c.norm_groups = usize_of(v, &w)?,
            "eps" => c.eps = f32_of(v, &w)?,
            "use_quant_conv" => c.use_quant_conv = bool_of(v, &w)?,
            "scaling_factor" => {}
            _ => return Err(inv(format!("unknown key {w}"))),
        }
    }
    if c.ch_mult.is_empty() {
        return Err(inv("vae.ch_mult is empty"));
    }
    Ok(())
}

fn parse_clip(s: &Map<String, Value>, c: &mut ClipTextConfig) -> Result<(), ModelConfigError> {
    for (k, v) in s {
        let w = format!("clip.{k}");
        match k.as_str() {
            "vocab_size" => c.vocab_size = usize_of(v, &w)?,
            "hidden_size" => c.hidden_size = usize_of(v, &w)?,
            "intermediate_size" => c.intermediate_size = usize_of(v, &w)?,
            "num_hidden_layers" => c.num_hidden_layers = usize_of(v, &w)?,
            "num_attention_heads" => c.num_attention_heads = usize_of(v, &w)?,
            "max_position_embeddings" => c.max_position_embeddings = usize_of(v, &w)?,
            "hidden_act" => {
                c.hidden_act = match v.as_str() {
                    Some("quick_gelu") => Activation::QuickGelu,
                    Some("gelu") => Activation::Gelu,
                    _ => return Err(inv(format!("{w}: {v}"))),
                }
            }
            "layer_norm_eps" => c.layer_norm_eps = f32_of(v, &w)?,
            "clip_skip" => c.clip_skip = usize_of(v, &w)?,
            "final_layer_norm" => c.final_layer_norm = bool_of(v, &w)?,
            _ => return Err(inv(format!("unknown key {w}"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sections_over_sd1_defaults() {
        let text = r#"{"name":"tiny","width":64,"height":64,"cfg_scale":5.0,
            "unet":{"model_channels":32,"channel_mult":[1,2,2],"heads":{"Heads":4},
                    "context_dim":32,"norm_groups":8,"attention_resolutions":[1,2]},
            "vae":{"ch":32,"ch_mult":[1,2,2],"num_res_blocks":1,"norm_groups":8,
                   "scaling_factor":0.2},
            "clip":{"hidden_size":32,"num_hidden_layers":3,"hidden_act":"quick_gelu"}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.name, "tiny");
        assert_eq!(c.unet.model_channels, 32);
        assert_eq!(c.unet.heads, HeadSpec::Heads(4));
        assert_eq!(c.unet.num_res_blocks, 2);
        assert_eq!(c.vae.downsample_factor(), 4);
        assert_eq!(c.size_multiple(), 16);
        assert_eq!(c.scaling_factor, 0.2);
        assert_eq!(c.clip.hidden_size, 32);
        assert_eq!(c.native_size, Some((64, 64)));
        assert_eq!(c.cfg_scale, Some(5.0));
        assert_eq!(ModelConfig::sd1().size_multiple(), 64);
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
        ] {
            assert!(ModelConfig::from_json(bad).is_err(), "{bad}");
        }
    }
}
