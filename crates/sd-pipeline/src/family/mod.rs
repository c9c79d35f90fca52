//! Model families: what the pipeline knows about each kind of checkpoint, in one place.
//!
//! A [`Family`] (one file each: [`sd1`], [`sd2`], [`sdxl`], [`flux`], [`sd3`], [`qwen_image`]) owns everything that differs between
//! models above the networks: detection (from [`detect_version`]), its component
//! [`Slot`]s with their CLI flags and canonical name prefixes, the generation [`Defaults`],
//! its configuration (a `serde` struct whose defaults cite the upstream YAML/`config.json`),
//! the networks it builds ([`ModelSpec`]: text encoders, diffusion network, first stage),
//! what the network predicts and on which schedule, the latent format, and text
//! conditioning (tokenizers, which encoder outputs go where, the `y` vector).
//!
//! [`FAMILIES`] lists them; [`detect`] picks one for a catalog of tensors. Everything else
//! ([`crate::pipeline::Pipeline`], [`crate::generate`], the CLI) is family-agnostic. Adding a
//! family is a new file here, its entry in [`FAMILIES`], and its networks in `sd-models`.

pub mod flux;
pub mod ldm;
pub mod qwen_image;
pub mod sd1;
pub mod sd2;
pub mod sd3;
pub mod sdxl;

use std::fmt;

use sd_formats::files::{FileMetadata, TensorCatalog};
use sd_formats::names::{
    detect_version, SdVersion, CLIP_G_PREFIX, CLIP_PREFIX, UNET_PREFIX, VAE_PREFIX,
};
use sd_models::diffusion::DiffusionArch;
use sd_models::first_stage::FirstStageArch;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::ModelError;
use sd_tensor::Tensor;
use thiserror::Error;

use crate::conditioning::ConditioningError;
use crate::sampling::{Prediction, SampleMethod};
use crate::schedule::{AysTable, Schedule, Scheduler};

/// The safetensors metadata key holding an sd-rs config (a JSON object; see [`ldm`]).
pub const CONFIG_KEY: &str = "sd-rs.config";

/// Every family, in detection order.
pub static FAMILIES: &[&dyn Family] = &[
    &sd1::Sd1,
    &sd2::Sd2,
    &sdxl::Sdxl,
    &sdxl::SdxlRefiner,
    &flux::Flux,
    &sd3::Sd3,
    &qwen_image::QwenImage,
];

/// An error of family detection or configuration.
#[derive(Debug, Error)]
pub enum ModelConfigError {
    /// The `sd-rs.config` metadata is not valid.
    #[error("invalid {CONFIG_KEY} metadata: {0}")]
    Invalid(String),
    /// No family handles the model.
    #[error("unsupported model: {0}")]
    Unsupported(String),
}

/// What a component slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotKind {
    /// The diffusion network (UNet, DiT).
    Diffusion,
    /// A text encoder.
    TextEncoder,
    /// The first stage (VAE).
    FirstStage,
}

/// A component of a family's model: one network, which a file given alone can supply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// What it holds.
    pub kind: SlotKind,
    /// The slot's name (`clip_l`); the CLI flag without its dashes.
    pub name: &'static str,
    /// The CLI flag that gives a file for it (`--clip_l`).
    pub flag: &'static str,
    /// The canonical name prefix of its tensors (`cond_stage_model.transformer.`).
    pub prefix: &'static str,
    /// A description for messages (`CLIP-L text encoder`).
    pub what: &'static str,
}

/// The diffusion network of LDM checkpoints (`--diffusion-model`).
pub const DIFFUSION_SLOT: Slot = Slot {
    kind: SlotKind::Diffusion,
    name: "diffusion-model",
    flag: "--diffusion-model",
    prefix: UNET_PREFIX,
    what: "diffusion model",
};

/// The autoencoder of LDM checkpoints (`--vae`).
pub const VAE_SLOT: Slot = Slot {
    kind: SlotKind::FirstStage,
    name: "vae",
    flag: "--vae",
    prefix: VAE_PREFIX,
    what: "autoencoder",
};

/// OpenAI's CLIP ViT-L/14 text encoder (SD1; SDXL's first encoder).
pub const CLIP_L_SLOT: Slot = Slot {
    kind: SlotKind::TextEncoder,
    name: "clip_l",
    flag: "--clip_l",
    prefix: CLIP_PREFIX,
    what: "CLIP-L text encoder",
};

/// OpenCLIP's ViT-H/14 text encoder (SD2).
pub const CLIP_H_SLOT: Slot = Slot {
    kind: SlotKind::TextEncoder,
    name: "clip_h",
    flag: "--clip_h",
    prefix: CLIP_PREFIX,
    what: "OpenCLIP-H text encoder",
};

/// OpenCLIP's ViT-bigG/14 text encoder (SDXL's second encoder, the refiner's only one).
pub const CLIP_G_SLOT: Slot = Slot {
    kind: SlotKind::TextEncoder,
    name: "clip_g",
    flag: "--clip_g",
    prefix: CLIP_G_PREFIX,
    what: "OpenCLIP-bigG text encoder",
};

/// Every slot of every family, each name once (the CLI's component flags).
pub fn all_slots() -> Vec<Slot> {
    let mut out: Vec<Slot> = Vec::new();
    for f in FAMILIES {
        for s in f.slots() {
            if !out.iter().any(|o| o.name == s.name) {
                out.push(*s);
            }
        }
    }
    out
}

/// The slot whose CLI flag is `flag` (`--clip_l`), over all families.
pub fn slot_by_flag(flag: &str) -> Option<Slot> {
    all_slots().into_iter().find(|s| s.flag == flag)
}

/// The slot named `name` (`clip_l`), over all families.
pub fn slot_by_name(name: &str) -> Option<Slot> {
    all_slots().into_iter().find(|s| s.name == name)
}

/// The family with id `id` (`sd1`).
pub fn family_by_id(id: &str) -> Option<&'static dyn Family> {
    FAMILIES.iter().copied().find(|f| f.id() == id)
}

/// A family's generation defaults (what the CLI uses for flags not given).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Defaults {
    /// Image width.
    pub width: usize,
    /// Image height.
    pub height: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Classifier-free guidance scale.
    pub cfg_scale: f32,
    /// The sampler.
    pub sampler: SampleMethod,
    /// The scheduler (`None`: the sampler's default, [`SampleMethod::default_scheduler`]).
    pub scheduler: Option<Scheduler>,
    /// The Align-Your-Steps table `--scheduler ays` uses.
    pub ays: AysTable,
}

/// How latents relate to the first stage's output: the diffusion network sees
/// `((z - mean_c) / std_c - shift) * scale` (per-channel statistics only where the family
/// has them), the decoder gets the inverse.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentFormat {
    /// The scaling factor (`scale_factor` of the LDM YAML; 0.18215 for SD1/SD2).
    pub scale: f32,
    /// The shift factor (0 for SD1/SD2/SDXL; Flux and SD3 have one).
    pub shift: f32,
    /// Per-channel mean and standard deviation (Qwen-Image's Wan-2.1 autoencoder).
    pub channels: Option<ChannelStats>,
}

/// Per-channel latent statistics (`latents_mean`, `latents_std` of a VAE config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChannelStats {
    /// The mean of each channel.
    pub mean: &'static [f32],
    /// The standard deviation of each channel.
    pub std: &'static [f32],
}

impl LatentFormat {
    /// A scale and a shift, no per-channel statistics.
    pub const fn scaled(scale: f32, shift: f32) -> Self {
        LatentFormat {
            scale,
            shift,
            channels: None,
        }
    }

    /// The channel of element `i` of a `[B, C, h, w]` tensor, with its statistics.
    fn stats(&self, shape: &[usize], i: usize) -> (f32, f32) {
        match (&self.channels, shape) {
            (Some(c), [_, ch, h, w]) if *ch == c.mean.len() && *ch == c.std.len() => {
                let k = (i / (h * w)) % ch;
                (c.mean[k], c.std[k])
            }
            _ => (0.0, 1.0),
        }
    }

    /// First-stage latents to diffusion latents.
    pub fn to_diffusion(&self, z: &Tensor<f32>) -> Tensor<f32> {
        let mut out = z.clone();
        let shape = z.shape().to_vec();
        for (i, v) in out.data_mut().iter_mut().enumerate() {
            let (m, s) = self.stats(&shape, i);
            *v = ((*v - m) / s - self.shift) * self.scale;
        }
        out
    }

    /// Diffusion latents to first-stage latents.
    pub fn to_first_stage(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let mut out = x.clone();
        let shape = x.shape().to_vec();
        for (i, v) in out.data_mut().iter_mut().enumerate() {
            let (m, s) = self.stats(&shape, i);
            *v = (*v / self.scale + self.shift) * s + m;
        }
        out
    }
}

/// Everything the pipeline needs to build and run one model: made by
/// [`Family::spec`], usually through [`detect`].
#[derive(Clone)]
pub struct ModelSpec {
    /// The family.
    pub family: &'static dyn Family,
    /// A display name (from the metadata; else empty).
    pub name: String,
    /// The text encoders, in the order [`TextEncode::encode`] numbers them, with their slots.
    pub text_encoders: Vec<(Slot, TextEncoderArch)>,
    /// The diffusion network and its slot.
    pub diffusion: (Slot, DiffusionArch),
    /// The first stage and its slot.
    pub first_stage: (Slot, FirstStageArch),
    /// What the diffusion network predicts.
    pub prediction: Prediction,
    /// The training noise schedule.
    pub schedule: Schedule,
    /// The latent format.
    pub latent: LatentFormat,
    /// The generation defaults (the family's, with the file's metadata applied).
    pub defaults: Defaults,
}

impl fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelSpec")
            .field("family", &self.family.id())
            .field("name", &self.name)
            .field("text_encoders", &self.text_encoders)
            .field("diffusion", &self.diffusion)
            .field("first_stage", &self.first_stage)
            .field("prediction", &self.prediction)
            .field("latent", &self.latent)
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl ModelSpec {
    /// The factor image sizes must be multiples of: the first stage's factor times the
    /// diffusion network's latent multiple.
    pub fn size_multiple(&self) -> usize {
        self.first_stage.1.downsample_factor() * self.diffusion.1.latent_multiple()
    }

    /// The shape `[1, C, h, w]` of the latents of a `width` x `height` image.
    pub fn latent_shape(&self, width: usize, height: usize) -> [usize; 4] {
        let f = self.first_stage.1.downsample_factor();
        [1, self.diffusion.1.in_channels(), height / f, width / f]
    }

    /// Every slot of the model: text encoders, diffusion network, first stage.
    pub fn slots(&self) -> Vec<Slot> {
        let mut v: Vec<Slot> = self.text_encoders.iter().map(|(s, _)| *s).collect();
        v.push(self.diffusion.0);
        v.push(self.first_stage.0);
        v
    }

    /// Detects the family and configuration of the tensors in `loader` (see [`detect`]).
    pub fn detect(loader: &TensorCatalog) -> Result<Self, ModelConfigError> {
        detect(loader)
    }
}

/// The conditioning of one prompt: what the diffusion network reads besides the latents.
#[derive(Clone, Debug, PartialEq)]
pub struct TextCond {
    /// Text tokens `[T, hidden]`.
    pub context: Tensor<f32>,
    /// The class / ADM vector `[adm]` (SDXL), if the family has one.
    pub y: Option<Tensor<f32>>,
}

/// The conditioning of a guided generation: the prompt and the negative prompt, with the
/// same shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Conditioning {
    /// The prompt.
    pub cond: TextCond,
    /// The negative prompt.
    pub uncond: TextCond,
}

/// The text encoders of a loaded model, as a family's conditioning sees them.
pub trait TextEncode {
    /// The hidden states `[tokens, hidden]` of text encoder `index` (the order of
    /// [`ModelSpec::text_encoders`]) for one chunk of token ids.
    fn encode(&mut self, index: usize, ids: &[i32]) -> Result<Tensor<f32>, ModelError>;

    /// Like [`TextEncode::encode`], and also the pooled output `[pooled]` of encoders that
    /// have one (SDXL's bigG), taken at token `pool_at` (end of text).
    fn encode_pooled(
        &mut self,
        index: usize,
        ids: &[i32],
        pool_at: usize,
    ) -> Result<(Tensor<f32>, Tensor<f32>), ModelError>;
}

/// A model family (see the module documentation).
pub trait Family: Sync + Send {
    /// A short id (`sd1`), as the `family` key of sd-rs metadata names it.
    fn id(&self) -> &'static str;

    /// A display name (`SD 1.x`).
    fn name(&self) -> &'static str;

    /// Whether the family handles checkpoints detected as `version`.
    fn detects(&self, version: SdVersion) -> bool;

    /// The component slots, text encoders first.
    fn slots(&self) -> &'static [Slot];

    /// The generation defaults.
    fn defaults(&self) -> Defaults;

    /// The model spec for this family: from the sd-rs metadata JSON `config` when the file
    /// has one, else the family's defaults.
    fn spec(&'static self, config: Option<&str>) -> Result<ModelSpec, ModelConfigError>;

    /// Adjusts `spec` to what the tensors tell beyond the detected version (FLUX.1 schnell
    /// vs dev); the default changes nothing.
    fn refine(&self, _spec: &mut ModelSpec, _catalog: &TensorCatalog) {}

    /// Whether classifier-free guidance rescales its result, per patch of `n x n` latent
    /// pixels, to the norm of the prompt's prediction (Qwen-Image's reference pipeline);
    /// the default is plain CFG.
    fn cfg_renorm(&self) -> Option<usize> {
        None
    }

    /// Encodes `prompt` and `negative` for an image of `size` (width, height).
    fn condition(
        &self,
        spec: &ModelSpec,
        text: &mut dyn TextEncode,
        prompt: &str,
        negative: &str,
        size: (usize, usize),
    ) -> Result<Conditioning, ConditioningError>;
}

/// The `family` key of an sd-rs config (`sd1` when absent: the first files had none).
fn metadata_family(text: &str) -> Result<&'static dyn Family, ModelConfigError> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ModelConfigError::Invalid(e.to_string()))?;
    let id = match v.get("family") {
        None => "sd1",
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(ModelConfigError::Invalid(format!(
                "family: expected a string, got {other}"
            )))
        }
    };
    family_by_id(id).ok_or_else(|| {
        ModelConfigError::Unsupported(format!("family {id:?} (known: {})", known_ids()))
    })
}

fn known_ids() -> String {
    FAMILIES
        .iter()
        .map(|f| f.id())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Detects the family and configuration of the files in `loader` (canonical names): from the
/// sd-rs metadata ([`CONFIG_KEY`]) when a file has one, else from the tensors with
/// [`detect_version`].
pub fn detect(loader: &TensorCatalog) -> Result<ModelSpec, ModelConfigError> {
    for f in loader.files() {
        if let FileMetadata::Safetensors(map) = &f.metadata {
            if let Some(text) = map.get(CONFIG_KEY) {
                let family = metadata_family(text)?;
                let mut spec = family.spec(Some(text))?;
                family.refine(&mut spec, loader);
                return Ok(spec);
            }
        }
    }
    let version = detect_version(
        loader
            .tensors()
            .map(|t| (t.name.as_str(), t.shape.as_slice())),
    )
    .ok_or_else(|| {
        ModelConfigError::Unsupported(
            "no Stable Diffusion architecture recognised in the tensors".into(),
        )
    })?;
    let family = FAMILIES
        .iter()
        .copied()
        .find(|f| f.detects(version))
        .ok_or_else(|| {
            ModelConfigError::Unsupported(format!(
                "{version:?} (no family handles it yet; supported: {})",
                known_ids()
            ))
        })?;
    let mut spec = family.spec(None)?;
    family.refine(&mut spec, loader);
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_consistent_across_families() {
        // One name, one flag and prefix; every family has each kind once (text encoders aside).
        for a in all_slots() {
            assert_eq!(slot_by_flag(a.flag), Some(a));
            assert_eq!(a.flag.trim_start_matches('-'), a.name);
        }
        for f in FAMILIES {
            for s in f.slots() {
                assert_eq!(slot_by_name(s.name), Some(*s), "{}: {}", f.id(), s.name);
            }
            for kind in [SlotKind::Diffusion, SlotKind::FirstStage] {
                assert_eq!(f.slots().iter().filter(|s| s.kind == kind).count(), 1);
            }
            let spec = f.spec(None).unwrap();
            assert_eq!(spec.family.id(), f.id());
            assert_eq!(spec.slots(), f.slots(), "{}", f.id());
            assert_eq!(family_by_id(f.id()).map(|g| g.id()), Some(f.id()));
        }
    }

    #[test]
    fn versions_pick_their_family() {
        for (v, id) in [(SdVersion::Sd1, Some("sd1")), (SdVersion::Sd2, Some("sd2"))] {
            let found = FAMILIES.iter().find(|f| f.detects(v)).map(|f| f.id());
            assert_eq!(found, id);
        }
        assert_eq!(
            FAMILIES
                .iter()
                .filter(|f| f.detects(SdVersion::QwenImage))
                .map(|f| f.id())
                .collect::<Vec<_>>(),
            ["qwen-image"]
        );
        assert_eq!(
            FAMILIES
                .iter()
                .filter(|f| f.detects(SdVersion::Sd3))
                .map(|f| f.id())
                .collect::<Vec<_>>(),
            ["sd3"]
        );
        assert_eq!(
            FAMILIES
                .iter()
                .filter(|f| f.detects(SdVersion::Flux))
                .map(|f| f.id())
                .collect::<Vec<_>>(),
            ["flux"]
        );
        let Err(e) = metadata_family(r#"{"family":"sd9"}"#) else {
            panic!("unknown family accepted");
        };
        assert!(
            e.to_string().contains("sd9") && e.to_string().contains("sd1"),
            "{e}"
        );
        assert_eq!(metadata_family("{}").unwrap().id(), "sd1");
    }

    #[test]
    fn latent_format_round_trips() {
        let f = LatentFormat::scaled(0.5, 0.25);
        let z = Tensor::new([1, 1, 1, 2], vec![1.0, -2.0]).unwrap();
        let x = f.to_diffusion(&z);
        assert_eq!(x.data(), &[0.375, -1.125]);
        assert_eq!(f.to_first_stage(&x).data(), z.data());
    }

    /// Per-channel statistics: `(z - mean_c) / std_c` and back, channel by channel.
    #[test]
    fn latent_format_per_channel_round_trips() {
        static MEAN: [f32; 2] = [0.5, -1.0];
        static STD: [f32; 2] = [2.0, 0.25];
        let f = LatentFormat {
            scale: 1.0,
            shift: 0.0,
            channels: Some(ChannelStats {
                mean: &MEAN,
                std: &STD,
            }),
        };
        let z = Tensor::new([1, 2, 1, 2], vec![2.5, 0.5, -1.0, -0.5]).unwrap();
        let d = f.to_diffusion(&z);
        assert_eq!(d.data(), &[1.0, 0.0, 0.0, 2.0]);
        assert_eq!(f.to_first_stage(&d).data(), z.data());
    }
}
