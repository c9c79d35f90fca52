//! Stable Diffusion XL, base and refiner.
//!
//! Base (`sgm` `configs/inference/sd_xl_base.yaml`): CLIP ViT-L/14 and OpenCLIP ViT-bigG/14,
//! both at their penultimate layer without the final layer norm, concatenated per token to a
//! 2048-wide context; the SDXL UNet ([`UnetConfig::sdxl`]) with `label_emb` on the vector
//! `y` = bigG's pooled, projected output (1280) ++ sinusoidal embeddings (256 each) of the
//! original size `(h, w)`, the crop's top-left corner `(0, 0)` and the target size `(h, w)`
//! (2816); eps on the `scaled_linear` schedule; latents scaled by 0.13025; 1024x1024. An
//! empty negative prompt is all zeros, context and pooled (diffusers'
//! `force_zeros_for_empty_prompt`, stable-diffusion.cpp's zero embeddings for SDXL).
//!
//! Refiner (`sd_xl_refiner.yaml`): bigG only (1280-wide context), the refiner UNet
//! ([`UnetConfig::sdxl_refiner`]), `y` = pooled ++ embeddings of the original size, the
//! crop and the aesthetic score (6 for the prompt, 2.5 for the negative, diffusers'
//! defaults) (2560); the negative prompt is encoded even when empty.
//!
//! The sd-rs metadata ([`super::CONFIG_KEY`]) of such a file has the keys of
//! [`SdxlConfig`]; those given replace the family's defaults.

use sd_formats::names::SdVersion;
use sd_models::clip::ClipTextConfig;
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::nn::sinusoidal_embedding;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::unet::UnetConfig;
use sd_models::vae::VaeConfig;
use sd_tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::ldm::{config_over, hoist_vae_scale, PredictionName};
use super::{
    Conditioning, Defaults, Family, LatentFormat, ModelConfigError, ModelSpec, Slot, TextCond,
    TextEncode, CLIP_G_SLOT, CLIP_L_SLOT, DIFFUSION_SLOT, VAE_SLOT,
};
use crate::conditioning::{encode_tokens, ConditioningError};
use crate::sampling::SampleMethod;
use crate::schedule::{AysTable, Schedule};
use crate::tokenizer::{ClipTokenizer, WeightedTokens};

/// The configuration of an SDXL checkpoint, base or refiner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SdxlConfig {
    /// The family id (`sdxl`, `sdxl-refiner`).
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
    /// The VAE latent scaling factor (`scale_factor: 0.13025`).
    pub scaling_factor: f32,
    /// The UNet.
    pub unet: UnetConfig,
    /// The autoencoder.
    pub vae: VaeConfig,
    /// The first text encoder (CLIP-L; `None` for the refiner).
    pub clip_l: Option<ClipTextConfig>,
    /// OpenCLIP-bigG.
    pub clip_g: ClipTextConfig,
}

/// SDXL base defaults (see the module documentation); 20 steps, CFG 7 as
/// stable-diffusion.cpp defaults them.
pub fn config() -> SdxlConfig {
    SdxlConfig {
        family: None,
        name: String::new(),
        prediction: PredictionName::Eps,
        width: 1024,
        height: 1024,
        steps: 20,
        cfg_scale: 7.0,
        scaling_factor: 0.13025,
        unet: UnetConfig::sdxl(),
        vae: VaeConfig::default(),
        clip_l: Some(ClipTextConfig::sdxl_clip_l()),
        clip_g: ClipTextConfig::sdxl_clip_g(),
    }
}

/// SDXL refiner defaults.
pub fn refiner_config() -> SdxlConfig {
    SdxlConfig {
        unet: UnetConfig::sdxl_refiner(),
        clip_l: None,
        ..config()
    }
}

impl SdxlConfig {
    /// Parses sd-rs metadata `text` over `defaults` (`vae.scaling_factor` accepted, as
    /// diffusers keeps it).
    pub fn from_json_over(defaults: &SdxlConfig, text: &str) -> Result<Self, ModelConfigError> {
        config_over(defaults, text, hoist_vae_scale)
    }

    fn into_spec(self, family: &'static dyn Family, defaults: Defaults) -> ModelSpec {
        let mut text_encoders = Vec::new();
        if let Some(l) = self.clip_l {
            let mut arch = TextEncoderArch::Clip(l);
            arch.set_prefix(CLIP_L_SLOT.prefix);
            text_encoders.push((CLIP_L_SLOT, arch));
        }
        let mut g = TextEncoderArch::Clip(self.clip_g);
        g.set_prefix(CLIP_G_SLOT.prefix);
        text_encoders.push((CLIP_G_SLOT, g));
        let mut unet = DiffusionArch::Unet(self.unet);
        unet.set_prefix(DIFFUSION_SLOT.prefix);
        let mut vae = FirstStageArch::AutoencoderKl(self.vae);
        vae.set_prefix(VAE_SLOT.prefix);
        ModelSpec {
            family,
            name: self.name,
            text_encoders,
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

fn spec_of(
    family: &'static dyn Family,
    defaults: &SdxlConfig,
    config_json: Option<&str>,
) -> Result<ModelSpec, ModelConfigError> {
    let cfg = match config_json {
        Some(text) => SdxlConfig::from_json_over(defaults, text)?,
        None => defaults.clone(),
    };
    if cfg.clip_g.projection_dim.is_none() {
        return Err(ModelConfigError::Invalid(
            "clip_g.projection_dim: SDXL needs bigG's pooled projection".into(),
        ));
    }
    Ok(cfg.into_spec(family, family.defaults()))
}

/// The defaults shared by base and refiner.
fn sdxl_defaults() -> Defaults {
    Defaults {
        width: 1024,
        height: 1024,
        steps: 20,
        cfg_scale: 7.0,
        sampler: SampleMethod::Euler,
        scheduler: None,
        ays: AysTable::Sdxl,
    }
}

/// The SDXL base family.
#[derive(Clone, Copy, Debug)]
pub struct Sdxl;

/// The slots of an SDXL base model.
static SLOTS: [Slot; 4] = [CLIP_L_SLOT, CLIP_G_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// The SDXL refiner family.
#[derive(Clone, Copy, Debug)]
pub struct SdxlRefiner;

/// The slots of an SDXL refiner.
static REFINER_SLOTS: [Slot; 3] = [CLIP_G_SLOT, DIFFUSION_SLOT, VAE_SLOT];

/// The token position the pooled output is read at: the first largest id (end of text in
/// the CLIP vocabulary), as transformers and OpenCLIP take it.
pub(crate) fn pool_position(ids: &[i32]) -> usize {
    let max = ids.iter().copied().max().unwrap_or(0);
    ids.iter().position(|&v| v == max).unwrap_or(0)
}

/// Encodes `tokens` with text encoder `index`; with `pooled`, also the pooled output of the
/// first chunk.
pub(crate) fn encode(
    text: &mut dyn TextEncode,
    index: usize,
    tokens: &WeightedTokens,
    pooled: Option<&mut Option<Tensor<f32>>>,
) -> Result<Tensor<f32>, ConditioningError> {
    let mut pooled = pooled;
    encode_tokens(tokens, |ids: &[i32]| match pooled.as_deref_mut() {
        Some(slot @ None) => {
            let (hidden, p) = text.encode_pooled(index, ids, pool_position(ids))?;
            *slot = Some(p);
            Ok::<_, sd_models::ModelError>(hidden)
        }
        _ => text.encode(index, ids),
    })
}

/// Concatenates two contexts `[T, a]` and `[T, b]` per token into `[T, a + b]`.
fn concat_features(a: &Tensor<f32>, b: &Tensor<f32>) -> Result<Tensor<f32>, ConditioningError> {
    let (sa, sb) = (a.shape(), b.shape());
    if sa.len() != 2 || sb.len() != 2 || sa[0] != sb[0] {
        return Err(ConditioningError::Mismatch(format!(
            "contexts {sa:?} and {sb:?} do not have the same tokens"
        )));
    }
    let (t, wa, wb) = (sa[0], sa[1], sb[1]);
    let mut data = Vec::with_capacity(t * (wa + wb));
    for (ra, rb) in a.data().chunks(wa).zip(b.data().chunks(wb)) {
        data.extend_from_slice(ra);
        data.extend_from_slice(rb);
    }
    Ok(Tensor::new([t, wa + wb], data)?)
}

/// `y` = `pooled` ++ the sinusoidal embedding of each of `ids`, checked against the UNet's
/// `label_emb` width: the embedding width is what is left of it, shared equally.
fn vector(
    spec: &ModelSpec,
    pooled: &Tensor<f32>,
    ids: &[f32],
) -> Result<Tensor<f32>, ConditioningError> {
    let DiffusionArch::Unet(unet) = &spec.diffusion.1 else {
        return Err(ConditioningError::Mismatch(
            "SDXL's vector conditions a UNet".into(),
        ));
    };
    let adm = unet.adm_in_channels.ok_or_else(|| {
        ConditioningError::Mismatch("the UNet has no `label_emb` for SDXL's vector".into())
    })?;
    let p = pooled.data();
    let rest = adm.saturating_sub(p.len());
    if rest == 0 || !rest.is_multiple_of(ids.len()) {
        return Err(ConditioningError::Mismatch(format!(
            "`label_emb` takes {adm} values: pooled text {} and {} embeddings do not fit",
            p.len(),
            ids.len()
        )));
    }
    let mut y = p.to_vec();
    y.extend(sinusoidal_embedding(ids, rest / ids.len()));
    Ok(Tensor::new([adm], y)?)
}

/// Tokenizes prompt and negative with `tokenizer`, padded to `n` chunks or more.
fn tokenize_pair(
    tokenizer: &ClipTokenizer,
    prompt: &str,
    negative: &str,
    n: usize,
) -> (WeightedTokens, WeightedTokens) {
    let mut c = tokenizer.tokenize_weighted(prompt);
    let mut u = tokenizer.tokenize_weighted(negative);
    let n = n.max(c.num_chunks()).max(u.num_chunks());
    c.pad_to_chunks(n);
    u.pad_to_chunks(n);
    (c, u)
}

fn zeros_like(t: &Tensor<f32>) -> Result<Tensor<f32>, ConditioningError> {
    Ok(Tensor::new(t.shape().to_vec(), vec![0.0; t.data().len()])?)
}

impl Family for Sdxl {
    fn id(&self) -> &'static str {
        "sdxl"
    }

    fn name(&self) -> &'static str {
        "SDXL"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::Sdxl
    }

    fn slots(&self) -> &'static [Slot] {
        &SLOTS
    }

    fn defaults(&self) -> Defaults {
        sdxl_defaults()
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        spec_of(self, &config(), config_json)
    }

    fn condition(
        &self,
        spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        (width, height): (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        // Both tokenizers split alike (one vocabulary); pad all four to one chunk count.
        let tok_l = ClipTokenizer::sd1();
        let tok_g = ClipTokenizer::sd2();
        let (first, _) = tokenize_pair(&tok_l, prompt, negative, 1);
        let (gc, gu) = tokenize_pair(&tok_g, prompt, negative, first.num_chunks());
        let (lc, lu) = tokenize_pair(&tok_l, prompt, negative, gc.num_chunks());

        let mut pooled_c = None;
        let ctx_c = concat_features(
            &encode(text, 0, &lc, None)?,
            &encode(text, 1, &gc, Some(&mut pooled_c))?,
        )?;
        let pooled_c = pooled_c
            .ok_or_else(|| ConditioningError::Mismatch("no pooled output from bigG".into()))?;
        let (ctx_u, pooled_u) = if negative.trim().is_empty() {
            (zeros_like(&ctx_c)?, zeros_like(&pooled_c)?)
        } else {
            let mut pooled_u = None;
            let ctx = concat_features(
                &encode(text, 0, &lu, None)?,
                &encode(text, 1, &gu, Some(&mut pooled_u))?,
            )?;
            let p = pooled_u
                .ok_or_else(|| ConditioningError::Mismatch("no pooled output from bigG".into()))?;
            (ctx, p)
        };
        // original size (h, w), crop top-left (0, 0), target size (h, w).
        let (h, w) = (height as f32, width as f32);
        let ids = [h, w, 0.0, 0.0, h, w];
        Ok(Conditioning {
            cond: TextCond {
                context: ctx_c,
                y: Some(vector(spec, &pooled_c, &ids)?),
            },
            uncond: TextCond {
                context: ctx_u,
                y: Some(vector(spec, &pooled_u, &ids)?),
            },
        })
    }
}

/// The refiner's aesthetic score for the prompt (diffusers' `aesthetic_score`).
pub const AESTHETIC_SCORE: f32 = 6.0;
/// The refiner's aesthetic score for the negative prompt (`negative_aesthetic_score`).
pub const NEGATIVE_AESTHETIC_SCORE: f32 = 2.5;

impl Family for SdxlRefiner {
    fn id(&self) -> &'static str {
        "sdxl-refiner"
    }

    fn name(&self) -> &'static str {
        "SDXL refiner"
    }

    fn detects(&self, version: SdVersion) -> bool {
        version == SdVersion::SdxlRefiner
    }

    fn slots(&self) -> &'static [Slot] {
        &REFINER_SLOTS
    }

    fn defaults(&self) -> Defaults {
        sdxl_defaults()
    }

    fn spec(&'static self, config_json: Option<&str>) -> Result<ModelSpec, ModelConfigError> {
        spec_of(self, &refiner_config(), config_json)
    }

    fn condition(
        &self,
        spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        (width, height): (usize, usize),
    ) -> Result<Conditioning, ConditioningError> {
        let (gc, gu) = tokenize_pair(&ClipTokenizer::sd2(), prompt, negative, 1);
        let (mut pc, mut pu) = (None, None);
        let ctx_c = encode(text, 0, &gc, Some(&mut pc))?;
        let ctx_u = encode(text, 0, &gu, Some(&mut pu))?;
        let missing = || ConditioningError::Mismatch("no pooled output from bigG".into());
        let (pc, pu) = (pc.ok_or_else(missing)?, pu.ok_or_else(missing)?);
        let (h, w) = (height as f32, width as f32);
        Ok(Conditioning {
            cond: TextCond {
                context: ctx_c,
                y: Some(vector(spec, &pc, &[h, w, 0.0, 0.0, AESTHETIC_SCORE])?),
            },
            uncond: TextCond {
                context: ctx_u,
                y: Some(vector(
                    spec,
                    &pu,
                    &[h, w, 0.0, 0.0, NEGATIVE_AESTHETIC_SCORE],
                )?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use sd_models::ModelError;

    use super::*;
    use crate::family::family_by_id;

    /// Encoders whose hidden state at token `i` is `index + i / 100` everywhere and whose
    /// pooled output is the pool position, so the test can see what went where.
    struct Fake {
        widths: Vec<usize>,
        pooled_at: Vec<usize>,
    }

    impl TextEncode for Fake {
        fn encode(&mut self, index: usize, ids: &[i32]) -> Result<Tensor<f32>, ModelError> {
            let w = self.widths[index];
            let data = (0..ids.len())
                .flat_map(|i| std::iter::repeat_n(index as f32 + i as f32 / 100.0, w))
                .collect();
            Ok(Tensor::new([ids.len(), w], data).unwrap())
        }

        fn encode_pooled(
            &mut self,
            index: usize,
            ids: &[i32],
            pool_at: usize,
        ) -> Result<(Tensor<f32>, Tensor<f32>), ModelError> {
            self.pooled_at.push(pool_at);
            let h = self.encode(index, ids)?;
            Ok((h, Tensor::new([4], vec![pool_at as f32; 4]).unwrap()))
        }
    }

    fn tiny_spec(family: &'static dyn Family, adm: usize) -> ModelSpec {
        let json = format!(r#"{{"unet": {{"adm_in_channels": {adm}}}}}"#);
        family.spec(Some(&json)).unwrap()
    }

    #[test]
    fn defaults_and_slots() {
        let spec = Sdxl.spec(None).unwrap();
        assert_eq!(spec.latent.scale, 0.13025);
        assert_eq!((spec.defaults.width, spec.defaults.height), (1024, 1024));
        assert_eq!(spec.defaults.ays, AysTable::Sdxl);
        let flags: Vec<&str> = spec.slots().iter().map(|s| s.flag).collect();
        assert_eq!(
            flags,
            ["--clip_l", "--clip_g", "--diffusion-model", "--vae"]
        );
        assert_eq!(spec.size_multiple(), 32);
        let refiner = family_by_id("sdxl-refiner").unwrap().spec(None).unwrap();
        let flags: Vec<&str> = refiner.slots().iter().map(|s| s.flag).collect();
        assert_eq!(flags, ["--clip_g", "--diffusion-model", "--vae"]);
        let DiffusionArch::Unet(u) = &refiner.diffusion.1 else {
            panic!("the refiner's network is not a UNet")
        };
        assert_eq!(u.adm_in_channels, Some(2560));
    }

    #[test]
    fn base_conditioning_layout() {
        // pooled 4 + 6 ids x 2 = 16.
        let spec = tiny_spec(&Sdxl, 16);
        let mut fake = Fake {
            widths: vec![3, 5],
            pooled_at: vec![],
        };
        let c = Sdxl
            .condition(&spec, &mut fake, "a cat", "", (64, 32))
            .unwrap();
        // Context: CLIP-L's 3 then bigG's 5 per token; one chunk.
        assert_eq!(c.cond.context.shape(), [77, 8]);
        let (l, g) = (1.0f32 / 100.0, 1.0 + 1.0f32 / 100.0);
        assert_eq!(&c.cond.context.data()[8..16], &[l, l, l, g, g, g, g, g]);
        // Pooled at the end of text: BOS, "a", "cat", EOS.
        assert_eq!(fake.pooled_at, [3]);
        let y = c.cond.y.unwrap();
        let want: Vec<f32> = [3.0f32; 4]
            .into_iter()
            .chain(sinusoidal_embedding(&[32.0, 64.0, 0.0, 0.0, 32.0, 64.0], 2))
            .collect();
        assert_eq!(y.data(), &want[..]);
        // Empty negative: zeros, the size embeddings kept.
        assert!(c.uncond.context.data().iter().all(|&v| v == 0.0));
        let yu = c.uncond.y.unwrap();
        assert!(yu.data()[..4].iter().all(|&v| v == 0.0));
        assert_eq!(&yu.data()[4..], &want[4..]);
        // A negative prompt is encoded.
        let c = Sdxl
            .condition(&spec, &mut fake, "a cat", "blurry", (64, 32))
            .unwrap();
        assert!(c.uncond.context.data().iter().any(|&v| v != 0.0));
    }

    #[test]
    fn refiner_conditioning_layout_and_mismatch() {
        let spec = tiny_spec(&SdxlRefiner, 4 + 5 * 2);
        let mut fake = Fake {
            widths: vec![5],
            pooled_at: vec![],
        };
        let c = SdxlRefiner
            .condition(&spec, &mut fake, "a cat", "", (64, 32))
            .unwrap();
        assert_eq!(c.cond.context.shape(), [77, 5]);
        let y = c.cond.y.unwrap();
        assert_eq!(
            &y.data()[4..],
            &sinusoidal_embedding(&[32.0, 64.0, 0.0, 0.0, AESTHETIC_SCORE], 2)[..]
        );
        let yu = c.uncond.y.unwrap();
        assert_eq!(
            &yu.data()[4..],
            &sinusoidal_embedding(&[32.0, 64.0, 0.0, 0.0, NEGATIVE_AESTHETIC_SCORE], 2)[..]
        );
        // A `label_emb` width the vector does not fill is an error.
        let spec = tiny_spec(&SdxlRefiner, 4 + 5 * 2 + 1);
        let err = SdxlRefiner
            .condition(&spec, &mut fake, "a cat", "", (64, 32))
            .unwrap_err();
        assert!(matches!(err, ConditioningError::Mismatch(_)), "{err}");
    }
}
