//! The first-stage models (image <-> latent autoencoders) as one closed set:
//! [`FirstStageArch`] builds a [`FirstStage`]: LDM's AutoencoderKL and the Wan-2.1 VAE of
//! Qwen-Image (as a 2-D network). Latent scaling and shifting (Wan's per-channel
//! normalisation included, [`WanVaeConfig::normalize_latents`]) belong to the family, not to
//! the network.

use sd_tensor::ggml::GTensor;

use crate::vae::{AutoencoderKl, VaeConfig};
use crate::wan_vae::{WanVae, WanVaeConfig};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, Result};

/// The configuration of a first-stage model.
#[derive(Clone, Debug, PartialEq)]
pub enum FirstStageArch {
    /// LDM's AutoencoderKL.
    AutoencoderKl(VaeConfig),
    /// The Wan-2.1 VAE (Qwen-Image), 16 latent channels, factor 8.
    Wan(WanVaeConfig),
}

impl FirstStageArch {
    /// The spatial factor between image and latent.
    pub fn downsample_factor(&self) -> usize {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.downsample_factor(),
            FirstStageArch::Wan(c) => c.downsample_factor(),
        }
    }

    /// The latent channels.
    pub fn latent_channels(&self) -> usize {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.z_channels,
            FirstStageArch::Wan(c) => c.z_dim,
        }
    }

    /// Sets the name prefix of the parameters (the canonical prefix of the component slot).
    pub fn set_prefix(&mut self, prefix: &str) {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.prefix = prefix.trim_end_matches('.').into(),
            FirstStageArch::Wan(c) => c.prefix = prefix.trim_end_matches('.').into(),
        }
    }

    /// Declares the encoder too (`false`: decode only).
    pub fn set_with_encoder(&mut self, with: bool) {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.with_encoder = with,
            FirstStageArch::Wan(c) => c.with_encoder = with,
        }
    }

    /// The name of one tensor only the encoder has, under the configured prefix (to tell
    /// whether the files have an encoder).
    pub fn encoder_probe(&self) -> String {
        match self {
            FirstStageArch::AutoencoderKl(c) => format!("{}.encoder.conv_in.weight", c.prefix),
            FirstStageArch::Wan(c) => format!("{}.encoder.conv1.weight", c.prefix),
        }
    }
}

/// A first-stage model with its parameters declared.
#[derive(Clone, Debug)]
pub enum FirstStage {
    /// LDM's AutoencoderKL.
    AutoencoderKl(Box<AutoencoderKl>),
    /// The Wan-2.1 VAE.
    Wan(Box<WanVae>),
}

/// Descriptor and node capacity of one AutoencoderKL or Wan VAE encoder or decoder graph
/// (a Wan decoder has about 770 nodes, its encoder about 610, at any width or size).
const VAE_GRAPH: usize = 8192;

impl FirstStage {
    /// Declares the parameters of `arch` under its prefix in `pb`.
    pub fn new(pb: &ParamBuilder<'_>, arch: &FirstStageArch) -> Result<Self> {
        Ok(match arch {
            FirstStageArch::AutoencoderKl(c) => {
                FirstStage::AutoencoderKl(Box::new(AutoencoderKl::new(pb, c.clone())?))
            }
            FirstStageArch::Wan(c) => FirstStage::Wan(Box::new(WanVae::new(pb, c.clone())?)),
        })
    }

    /// Builds the encoder pass of images `[W, H, 3, B]` in [-1, 1]; returns the latent
    /// distribution's moments `[W/f, H/f, 2 C, B]` (mean, then log-variance).
    pub fn encode(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        match self {
            FirstStage::AutoencoderKl(m) => m.encode(g, x),
            FirstStage::Wan(m) => m.encode(g, x),
        }
    }

    /// Builds the decoder pass of (unscaled) latents `[w, h, C, B]`; returns images
    /// `[w f, h f, 3, B]` in about [-1, 1].
    pub fn decode(&self, g: &mut GraphCtx, z: &GTensor) -> Result<GTensor> {
        match self {
            FirstStage::AutoencoderKl(m) => m.decode(g, z),
            FirstStage::Wan(m) => m.decode(g, z),
        }
    }

    /// Whether the encoder was declared.
    pub fn has_encoder(&self) -> bool {
        match self {
            FirstStage::AutoencoderKl(m) => m.encoder.is_some(),
            FirstStage::Wan(m) => m.encoder.is_some(),
        }
    }

    /// The spatial factor between image and latent.
    pub fn downsample_factor(&self) -> usize {
        match self {
            FirstStage::AutoencoderKl(m) => m.config.downsample_factor(),
            FirstStage::Wan(m) => m.config.downsample_factor(),
        }
    }

    /// Descriptor and node capacity of one encoder or decoder graph.
    pub fn graph_size(&self) -> usize {
        match self {
            FirstStage::AutoencoderKl(_) | FirstStage::Wan(_) => VAE_GRAPH,
        }
    }
}
