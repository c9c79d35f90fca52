//! The first-stage models (image <-> latent autoencoders) as one closed set:
//! [`FirstStageArch`] builds a [`FirstStage`]. Later ones (Wan's VAE) are new variants.
//! Latent scaling and shifting belong to the family, not to the network.

use sd_tensor::ggml::GTensor;

use crate::vae::{AutoencoderKl, VaeConfig};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, Result};

/// The configuration of a first-stage model.
#[derive(Clone, Debug, PartialEq)]
pub enum FirstStageArch {
    /// LDM's AutoencoderKL.
    AutoencoderKl(VaeConfig),
}

impl FirstStageArch {
    /// The spatial factor between image and latent.
    pub fn downsample_factor(&self) -> usize {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.downsample_factor(),
        }
    }

    /// The latent channels.
    pub fn latent_channels(&self) -> usize {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.z_channels,
        }
    }

    /// Sets the name prefix of the parameters (the canonical prefix of the component slot).
    pub fn set_prefix(&mut self, prefix: &str) {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.prefix = prefix.trim_end_matches('.').into(),
        }
    }

    /// Declares the encoder too (`false`: decode only).
    pub fn set_with_encoder(&mut self, with: bool) {
        match self {
            FirstStageArch::AutoencoderKl(c) => c.with_encoder = with,
        }
    }

    /// The name of one tensor only the encoder has, under the configured prefix (to tell
    /// whether the files have an encoder).
    pub fn encoder_probe(&self) -> String {
        match self {
            FirstStageArch::AutoencoderKl(c) => format!("{}.encoder.conv_in.weight", c.prefix),
        }
    }
}

/// A first-stage model with its parameters declared.
#[derive(Clone, Debug)]
pub enum FirstStage {
    /// LDM's AutoencoderKL.
    AutoencoderKl(AutoencoderKl),
}

/// Descriptor and node capacity of one AutoencoderKL encoder or decoder graph.
const VAE_GRAPH: usize = 8192;

impl FirstStage {
    /// Declares the parameters of `arch` under its prefix in `pb`.
    pub fn new(pb: &ParamBuilder<'_>, arch: &FirstStageArch) -> Result<Self> {
        Ok(match arch {
            FirstStageArch::AutoencoderKl(c) => {
                FirstStage::AutoencoderKl(AutoencoderKl::new(pb, c.clone())?)
            }
        })
    }

    /// Builds the encoder pass of images `[W, H, 3, B]` in [-1, 1]; returns the latent
    /// distribution's moments `[W/f, H/f, 2 C, B]` (mean, then log-variance).
    pub fn encode(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        match self {
            FirstStage::AutoencoderKl(m) => m.encode(g, x),
        }
    }

    /// Builds the decoder pass of (unscaled) latents `[w, h, C, B]`; returns images
    /// `[w f, h f, 3, B]` in about [-1, 1].
    pub fn decode(&self, g: &mut GraphCtx, z: &GTensor) -> Result<GTensor> {
        match self {
            FirstStage::AutoencoderKl(m) => m.decode(g, z),
        }
    }

    /// Whether the encoder was declared.
    pub fn has_encoder(&self) -> bool {
        match self {
            FirstStage::AutoencoderKl(m) => m.encoder.is_some(),
        }
    }

    /// The spatial factor between image and latent.
    pub fn downsample_factor(&self) -> usize {
        match self {
            FirstStage::AutoencoderKl(m) => m.config.downsample_factor(),
        }
    }

    /// Descriptor and node capacity of one encoder or decoder graph.
    pub fn graph_size(&self) -> usize {
        match self {
            FirstStage::AutoencoderKl(_) => VAE_GRAPH,
        }
    }
}
