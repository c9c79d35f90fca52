//! SD3 and SD3.5 (Medium, Large, Large Turbo): Stability AI's MMDiT ([`sd_models::mmdit`])
//! conditioned on CLIP-L, OpenCLIP bigG and T5-XXL, with a 16-channel autoencoder.
//!
//! Defaults cite `stabilityai/stable-diffusion-3.5-large` (`scheduler/scheduler_config.json`:
//! `FlowMatchEulerDiscreteScheduler`, `shift: 3.0`; `vae/config.json`: `latent_channels:
//! 16`, `scaling_factor: 1.5305`, `shift_factor: 0.0609`, no quant convs) and diffusers'
//! `StableDiffusion3Pipeline` (1024x1024, 28 steps, guidance 7, `max_sequence_length` 256).
//!
//! Conditioning, as `StableDiffusion3Pipeline.encode_prompt`: the prompt through CLIP-L
//! and bigG (77 tokens each, truncated; CLIP-L padded with end-of-text, bigG with 0), the
//! penultimate hidden states of both concatenated (768 + 1280) and zero-padded to T5's
//! width, followed by T5's 256 tokens (padded, no attention mask): a `[333, 4096]` context.
//! The pooled vector is both encoders' projected pooled outputs concatenated (2048).
//! The negative prompt (empty by default) is encoded the same way, not zeroed.
//!
//! Differences from stable-diffusion.cpp, which sd-rs does not follow: its CLIP-L pooled
//! vector is unprojected (an identity projection); it pads T5 to 77-token chunks (a
//! 154-token context); its flow schedule ends at sigma 0.003 instead of diffusers' 0.0089
//! ([`crate::schedule::sd3_sigmas`]).

use sd_formats::names::SdVersion;
use sd_models::clip::ClipTextConfig;
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::mmdit::MmditConfig;
use sd_models::t5::T5Config;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::vae::VaeConfig;
use sd_tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::flux::T5_SLOT;
use super::ldm::config_over;
use super::sdxl::pool_position;
use super::{
    Conditioning, Defaults, Family, LatentFormat, ModelConfigError, ModelSpec, Slot, TextCond,
    TextEncode, CLIP_G_SLOT, CLIP_L_SLOT, DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::{encode_tokens, ConditioningError};
use crate::sampling::{Prediction, SampleMethod};
use crate::schedule::{AysTable, FlowSpacing, Schedule};
use crate::tokenizer::ClipTokenizer;
use crate::tokenizer_t5::T5Tokenizer;

/// T5 tokens of the context (`StableDiffusion3Pipeline`'s `max_sequence_length`).
pub const T5_TOKENS: usize = 256;
/// CLIP tokens of the context (one 77-token chunk).
pub const CLIP_TOKENS: usize = 77;
/// Tokens of the whole context: CLIP's, then T5's.
pub const CONTEXT_TOKENS: usize = CLIP_TOKENS + T5_TOKENS;

/// The slots of an SD3 model.
static SLOTS: [Slot; 5] = [CLIP_L_SLOT, CLIP_G_SLOT, T5_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// The configuration of an SD3 checkpoint (sd-rs metadata keys overlay it). The
/// transformer's sizes are read from its tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sd3FamilyConfig {
    /// The family id (`sd3`).
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
    /// Recommended guidance scale.
    pub cfg_scale: f32,
    /// The flow schedule's shift (`shift` of the scheduler config).
    pub flow_shift: f32,
    /// The VAE latent scaling factor.
    pub scaling_factor: f32,
    /// The VAE latent shift factor.
    pub shift_factor: f32,
    /// The autoencoder.
    pub vae: VaeConfig,
    /// CLIP-L.
    pub clip_l: ClipTextConfig,
    /// OpenCLIP bigG.
    pub clip_g: ClipTextConfig,
    /// The T5 encoder.
    pub t5: T5Config,
}

/// SD3's CLIP-L: SDXL's first encoder (penultimate layer, no final norm) with its pooled
/// output projected (`CLIPTextModelWithProjection`, `projection_dim: 768`).
pub fn clip_l() -> ClipTextConfig {
    ClipTextConfig {
        projection_dim: Some(768),
        ..ClipTextConfig::sdxl_clip_l()
    }
}

/// SD3.5's defaults (see the module documentation).
pub fn config() -> Sd3FamilyConfig {
    Sd3FamilyConfig {
        family: None,
        name: String::new(),
        width: 1024,
        height: 1024,
        steps: 28,
        cfg_scale: 7.0,
        flow_shift: 3.0,
        scaling_factor: 1.5305,
        shift_factor: 0.0609,
        vae: VaeConfig {
            z_channels: 16,
            use_quant_conv: false,
            ..VaeConfig::default()
        },
        clip_l: clip_l(),
        clip_g: ClipTextConfig::sdxl_clip_g(),
        t5: T5Config::xxl(),
    }
}

impl Sd3FamilyConfig {
    /// Parses sd-rs metadata `text` over `defaults` (nested objects merge key by key).
    pub fn from_json_over(defaults: &Self, text: &str) -> Result<Self, ModelConfigError> {
        config_over(defaults, text, |_| {})
    }
}

/// The SD3 / SD3.5 family.
#[derive(Clone, Copy, Debug)]
pub struct Sd3;

impl Family for Sd3 {
    fn id(&self) -> &'static str {
        "sd3"
    }

    fn name(&self) -> &'static str {
        "SD3"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::Sd3
    }

    fn slots(&self) -> &'static [Slot] {
        &SLOTS
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            width: 1024,
            height: 1024,
            steps: 28,
            cfg_scale: 7.0,
            sampler: SampleMethod::Euler,
            scheduler: None,
            ays: AysTable::Sdxl,
        }
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        let c = match config_json {
            Some(text) => Sd3FamilyConfig::from_json_over(&config(), text)?,
            None => config(),
        };
        if c.clip_l.projection_dim.is_none() || c.clip_g.projection_dim.is_none() {
            return Err(ModelConfigError::Invalid(
                "SD3's pooled vector needs both CLIP encoders' projections (projection_dim)".into(),
            ));
        }
        let mut l = TextEncoderArch::Clip(c.clip_l);
        l.set_prefix(CLIP_L_SLOT.prefix);
        let mut g = TextEncoderArch::Clip(c.clip_g);
        g.set_prefix(CLIP_G_SLOT.prefix);
        let mut t5 = TextEncoderArch::T5(c.t5);
        t5.set_prefix(T5_SLOT.prefix);
        let mut net = DiffusionArch::Mmdit(MmditConfig::sd35_large());
        net.set_prefix(DIFFUSION_SLOT.prefix);
        let mut vae = FirstStageArch::AutoencoderKl(c.vae);
        vae.set_prefix(VAE_SLOT.prefix);
        Ok(ModelSpec {
            family: self,
            name: c.name,
            text_encoders: vec![(CLIP_L_SLOT, l), (CLIP_G_SLOT, g), (T5_SLOT, t5)],
            diffusion: (DIFFUSION_SLOT, net),
            first_stage: (VAE_SLOT, vae),
            prediction: Prediction::Flow { time_scale: 1000.0 },
            schedule: Schedule::Flow {
                shift: c.flow_shift,
                resolution_shift: None,
                spacing: FlowSpacing::TrainingRange,
            },
            latent: LatentFormat::scaled(c.scaling_factor, c.shift_factor),
            defaults: Defaults {
                width: c.width,
                height: c.height,
                steps: c.steps,
                cfg_scale: c.cfg_scale,
                ..self.defaults()
            },
        })
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
        let (tok_l, tok_g) = (ClipTokenizer::sd1(), ClipTokenizer::sd2());
        let mut one = |p: &str| -> Result<TextCond, ConditioningError> {
            let (hl, pl) = clip_first_chunk(text, 0, &tok_l, p)?;
            let (hg, pg) = clip_first_chunk(text, 1, &tok_g, p)?;
            let ids = t5
                .encode_padded(p, T5_TOKENS)
                .map_err(|e| ConditioningError::Mismatch(e.to_string()))?;
            let ht = text
                .encode(2, &ids)
                .map_err(|e| ConditioningError::Encoder {
                    chunk: 0,
                    source: Box::new(e),
                })?;
            let mut y = pl.data().to_vec();
            y.extend_from_slice(pg.data());
            let pooled = y.len();
            Ok(TextCond {
                context: joint_context(&hl, &hg, &ht)?,
                y: Some(Tensor::new([pooled], y)?),
            })
        };
        Ok(Conditioning {
            cond: one(prompt)?,
            uncond: one(negative)?,
        })
    }
}

/// The first 77-token chunk of `prompt` through CLIP encoder `index` (prompt weights
/// applied): hidden states `[77, width]` and the pooled output.
fn clip_first_chunk(
    text: &mut dyn TextEncode,
    index: usize,
    tokenizer: &ClipTokenizer,
    prompt: &str,
) -> Result<(Tensor<f32>, Tensor<f32>), ConditioningError> {
    let mut tokens = tokenizer.tokenize_weighted(prompt);
    tokens.truncate_to_chunks(1);
    let mut pooled = None;
    let hidden = encode_tokens(&tokens, |ids: &[i32]| {
        let (h, p) = text.encode_pooled(index, ids, pool_position(ids))?;
        pooled = Some(p);
        Ok::<_, sd_models::ModelError>(h)
    })?;
    let pooled = pooled.ok_or_else(|| {
        ConditioningError::Mismatch(format!("no pooled output from text encoder {index}"))
    })?;
    Ok((hidden, pooled))
}

/// `[concat(l, g) zero-padded to T5's width; t5]` along the tokens.
fn joint_context(
    l: &Tensor<f32>,
    g: &Tensor<f32>,
    t5: &Tensor<f32>,
) -> Result<Tensor<f32>, ConditioningError> {
    let (sl, sg, st) = (l.shape(), g.shape(), t5.shape());
    if sl.len() != 2 || sg.len() != 2 || st.len() != 2 || sl[0] != sg[0] {
        return Err(ConditioningError::Mismatch(format!(
            "contexts {sl:?}, {sg:?} and {st:?} do not join"
        )));
    }
    let (n, wl, wg, wt) = (sl[0], sl[1], sg[1], st[1]);
    if wl + wg > wt {
        return Err(ConditioningError::Mismatch(format!(
            "CLIP widths {wl} + {wg} exceed T5's {wt}"
        )));
    }
    let mut data = Vec::with_capacity((n + st[0]) * wt);
    for (rl, rg) in l.data().chunks(wl).zip(g.data().chunks(wg)) {
        data.extend_from_slice(rl);
        data.extend_from_slice(rg);
        data.extend(std::iter::repeat_n(0.0, wt - wl - wg));
    }
    data.extend_from_slice(t5.data());
    Ok(Tensor::new([n + st[0], wt], data)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_joins_clip_and_t5() {
        let l = Tensor::new([2, 1], vec![1.0, 2.0]).unwrap();
        let g = Tensor::new([2, 2], vec![3.0, 4.0, 5.0, 6.0]).unwrap();
        let t = Tensor::new([1, 4], vec![7.0, 8.0, 9.0, 10.0]).unwrap();
        let c = joint_context(&l, &g, &t).unwrap();
        assert_eq!(c.shape(), &[3, 4]);
        assert_eq!(
            c.data(),
            &[1.0, 3.0, 4.0, 0.0, 2.0, 5.0, 6.0, 0.0, 7.0, 8.0, 9.0, 10.0]
        );
        let narrow = Tensor::new([1, 2], vec![0.0; 2]).unwrap();
        assert!(joint_context(&l, &g, &narrow).is_err());
    }

    #[test]
    fn defaults_follow_diffusers() {
        let spec = Sd3.spec(None).unwrap();
        assert_eq!(spec.text_encoders.len(), 3);
        assert_eq!((spec.latent.scale, spec.latent.shift), (1.5305, 0.0609));
        assert_eq!(spec.prediction, Prediction::Flow { time_scale: 1000.0 });
        assert_eq!((spec.defaults.steps, spec.defaults.cfg_scale), (28, 7.0));
    }
}
