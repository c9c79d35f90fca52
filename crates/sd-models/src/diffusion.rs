//! The diffusion networks as one closed set: [`DiffusionArch`] (a configuration) builds a
//! [`DiffusionNet`], which every pipeline feeds the same [`DiffusionInputs`].
//!
//! A network takes what it needs from the inputs and rejects what it cannot use (a `y` given
//! to a UNet without `label_emb`, guidance given to a network that is not guidance
//! distilled), so a family that wires its inputs wrongly fails with [`ModelError::Input`]
//! instead of computing something else.

use sd_tensor::ggml::GTensor;

use crate::dit::TextTokens;
use crate::flux::{FluxConfig, FluxModel};
use crate::mmdit::{MmditConfig, MmditModel};
use crate::qwen_image::{QwenImageConfig, QwenImageModel};
use crate::unet::{UnetConfig, UnetModel};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// The inputs of one diffusion step, as graph tensors (ggml order, innermost first).
#[derive(Clone, Copy, Debug)]
pub struct DiffusionInputs<'a> {
    /// Latents `[W, H, C, B]` (or packed tokens for transformer networks).
    pub x: &'a GTensor,
    /// Timesteps (or sigmas, for flow networks) f32 `[B]`.
    pub timesteps: &'a GTensor,
    /// Text tokens `[hidden, n_tokens, B]`.
    pub context: Option<&'a GTensor>,
    /// Whether `context` holds the network's own embedding of the text
    /// ([`DiffusionNet::embed_text`]) instead of the text encoder's states.
    pub context_embedded: bool,
    /// The class / ADM vector `[adm, B]` (SDXL's pooled text and size embeddings).
    pub y: Option<&'a GTensor>,
    /// Distilled guidance strength f32 `[B]` (Flux dev).
    pub guidance: Option<&'a GTensor>,
    /// Position ids of the tokens (RoPE networks).
    pub pos_ids: Option<&'a GTensor>,
    /// Blocks to skip (skip-layer guidance's extra pass; MMDiT only).
    pub skip_blocks: &'a [usize],
}

impl<'a> DiffusionInputs<'a> {
    /// Inputs with latents and timesteps only; set the other fields as the network needs.
    pub fn new(x: &'a GTensor, timesteps: &'a GTensor) -> Self {
        DiffusionInputs {
            x,
            timesteps,
            context: None,
            context_embedded: false,
            y: None,
            guidance: None,
            pos_ids: None,
            skip_blocks: &[],
        }
    }
}

/// The configuration of a diffusion network.
#[derive(Clone, Debug, PartialEq)]
pub enum DiffusionArch {
    /// An LDM UNet (SD1.x, SD2.x, SDXL).
    Unet(UnetConfig),
    /// The FLUX.1 transformer (dev, schnell).
    Flux(FluxConfig),
    /// The SD3 / SD3.5 MMDiT.
    Mmdit(MmditConfig),
    /// The Qwen-Image transformer.
    QwenImage(QwenImageConfig),
}

impl DiffusionArch {
    /// The latent channels the network reads.
    pub fn in_channels(&self) -> usize {
        match self {
            DiffusionArch::Unet(c) => c.in_channels,
            DiffusionArch::Flux(c) => c.in_channels / 4,
            DiffusionArch::Mmdit(c) => c.in_channels,
            DiffusionArch::QwenImage(c) => c.in_channels / 4,
        }
    }

    /// The factor latent sizes must be multiples of (a UNet halves them `levels - 1` times).
    pub fn latent_multiple(&self) -> usize {
        match self {
            DiffusionArch::Unet(c) => 1 << c.channel_mult.len().saturating_sub(1),
            // 2x2 patches.
            DiffusionArch::Flux(_) | DiffusionArch::QwenImage(_) => 2,
            DiffusionArch::Mmdit(c) => c.patch_size,
        }
    }

    /// Sets the name prefix of the parameters (the canonical prefix of the component slot).
    pub fn set_prefix(&mut self, prefix: &str) {
        match self {
            DiffusionArch::Unet(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
            DiffusionArch::Flux(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
            DiffusionArch::Mmdit(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
            DiffusionArch::QwenImage(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
        }
    }
}

/// A diffusion network with its parameters declared.
#[derive(Clone, Debug)]
pub enum DiffusionNet {
    /// An LDM UNet.
    Unet(UnetModel),
    /// The FLUX.1 transformer.
    Flux(FluxModel),
    /// The SD3 / SD3.5 MMDiT.
    Mmdit(MmditModel),
    /// The Qwen-Image transformer.
    QwenImage(QwenImageModel),
}

/// Graph nodes of one UNet evaluation per transformer block, plus a base for the
/// convolutional part (an SD1 UNet has 16 blocks: 16384).
const UNET_NODES_BASE: usize = 8192;
/// See [`UNET_NODES_BASE`].
const UNET_NODES_PER_TRANSFORMER: usize = 512;

impl DiffusionNet {
    /// Declares the parameters of `arch` under its prefix in `pb`.
    pub fn new(pb: &ParamBuilder<'_>, arch: &DiffusionArch) -> Result<Self> {
        Ok(match arch {
            DiffusionArch::Unet(c) => DiffusionNet::Unet(UnetModel::new(pb, c.clone())?),
            DiffusionArch::Flux(c) => DiffusionNet::Flux(FluxModel::new(pb, c.clone())?),
            DiffusionArch::Mmdit(c) => DiffusionNet::Mmdit(MmditModel::new(pb, c.clone())?),
            DiffusionArch::QwenImage(c) => {
                DiffusionNet::QwenImage(QwenImageModel::new(pb, c.clone())?)
            }
        })
    }

    /// Builds one evaluation; returns the prediction, shaped as `inputs.x`.
    pub fn forward(&self, g: &mut GraphCtx, inputs: &DiffusionInputs<'_>) -> Result<GTensor> {
        match self {
            DiffusionNet::Unet(_) | DiffusionNet::Flux(_) | DiffusionNet::QwenImage(_)
                if !inputs.skip_blocks.is_empty() =>
            {
                Err(ModelError::Input {
                    name: "skip_blocks",
                    detail: "skipping blocks (skip-layer guidance) needs an MMDiT (SD3)".into(),
                })
            }
            DiffusionNet::Unet(unet) => {
                reject(inputs.guidance, "guidance", "a UNet")?;
                reject(inputs.pos_ids, "pos_ids", "a UNet")?;
                if inputs.context_embedded {
                    return Err(ModelError::Input {
                        name: "context",
                        detail: "a UNet has no text embedding to skip".into(),
                    });
                }
                let context = inputs.context.ok_or_else(|| ModelError::Input {
                    name: "context",
                    detail: "a UNet needs text context".into(),
                })?;
                unet.forward(g, inputs.x, inputs.timesteps, context, inputs.y)
            }
            DiffusionNet::Flux(flux) => {
                // Position ids follow from the latent and context shapes.
                reject(inputs.pos_ids, "pos_ids", "FLUX (it makes its own)")?;
                if flux.guidance_in.is_none() {
                    reject(inputs.guidance, "guidance", "FLUX.1-schnell")?;
                }
                let context = inputs.context.ok_or_else(|| ModelError::Input {
                    name: "context",
                    detail: "FLUX needs T5 context".into(),
                })?;
                let y = inputs.y.ok_or_else(|| ModelError::Input {
                    name: "y",
                    detail: "FLUX needs the pooled CLIP vector".into(),
                })?;
                let text = self.text_tokens(inputs, context)?;
                flux.forward(g, inputs.x, inputs.timesteps, text, y, inputs.guidance)
            }
            DiffusionNet::Mmdit(mmdit) => {
                reject(inputs.guidance, "guidance", "an MMDiT")?;
                reject(inputs.pos_ids, "pos_ids", "an MMDiT")?;
                let context = inputs.context.ok_or_else(|| ModelError::Input {
                    name: "context",
                    detail: "an MMDiT needs text context".into(),
                })?;
                let y = inputs.y.ok_or_else(|| ModelError::Input {
                    name: "y",
                    detail: "an MMDiT needs the pooled text vector".into(),
                })?;
                let text = self.text_tokens(inputs, context)?;
                mmdit.forward_skipping(g, inputs.x, inputs.timesteps, text, y, inputs.skip_blocks)
            }
            DiffusionNet::QwenImage(qwen) => {
                reject(inputs.guidance, "guidance", "Qwen-Image")?;
                reject(inputs.pos_ids, "pos_ids", "Qwen-Image (it makes its own)")?;
                reject(inputs.y, "y", "Qwen-Image (it has no pooled vector)")?;
                let context = inputs.context.ok_or_else(|| ModelError::Input {
                    name: "context",
                    detail: "Qwen-Image needs the text encoder's states".into(),
                })?;
                let text = self.text_tokens(inputs, context)?;
                qwen.forward(g, inputs.x, inputs.timesteps, text)
            }
        }
    }

    /// The network's embedding of text encoder states `[context_dim, n, B]` into its text
    /// stream `[hidden, n, B]`, built into `g`: the part of a pass that depends on the prompt
    /// alone (the same at every step), which a caller may compute once and feed back with
    /// [`DiffusionInputs::context_embedded`]. `None` for networks without one (a UNet reads
    /// the states in every cross-attention).
    pub fn embed_text(&self, g: &mut GraphCtx, states: &GTensor) -> Result<Option<GTensor>> {
        Ok(match self {
            DiffusionNet::Unet(_) => None,
            DiffusionNet::Flux(f) => Some(f.embed_text(g, states)?),
            DiffusionNet::Mmdit(m) => Some(m.embed_text(g, states)?),
            DiffusionNet::QwenImage(q) => Some(q.embed_text(g, states)?),
        })
    }

    /// Whether the network has a text embedding ([`DiffusionNet::embed_text`]).
    pub fn has_text_embedding(&self) -> bool {
        !matches!(self, DiffusionNet::Unet(_))
    }

    /// The text of a transformer pass, an embedded one checked against the network's width.
    fn text_tokens<'t>(
        &self,
        inputs: &DiffusionInputs<'t>,
        context: &'t GTensor,
    ) -> Result<TextTokens<'t>> {
        if !inputs.context_embedded {
            return Ok(TextTokens::States(context));
        }
        let hidden = match self {
            DiffusionNet::Unet(_) => 0,
            DiffusionNet::Flux(f) => f.config.hidden_size,
            DiffusionNet::Mmdit(m) => m.config.hidden_size,
            DiffusionNet::QwenImage(q) => q.config.hidden_size,
        };
        if context.ne()[0] != hidden {
            return Err(ModelError::Input {
                name: "context",
                detail: format!(
                    "embedded text of width {} (the network's is {hidden})",
                    context.ne()[0]
                ),
            });
        }
        Ok(TextTokens::Embedded(context))
    }

    /// Whether the network embeds a distilled guidance strength (FLUX.1-dev).
    pub fn embeds_guidance(&self) -> bool {
        match self {
            DiffusionNet::Unet(_) | DiffusionNet::Mmdit(_) | DiffusionNet::QwenImage(_) => false,
            DiffusionNet::Flux(f) => f.guidance_in.is_some(),
        }
    }

    /// Descriptor and node capacity of one evaluation's graph.
    pub fn graph_size(&self) -> usize {
        match self {
            DiffusionNet::Unet(unet) => {
                let transformers: usize = unet
                    .input_blocks
                    .iter()
                    .chain(std::iter::once(&unet.middle_block))
                    .chain(&unet.output_blocks)
                    .flatten()
                    .map(|l| match l {
                        crate::unet::Layer::Attn(st) => st.transformer_blocks.len(),
                        _ => 0,
                    })
                    .sum();
                (UNET_NODES_BASE + UNET_NODES_PER_TRANSFORMER * transformers).next_power_of_two()
            }
            DiffusionNet::Flux(flux) => flux.graph_size(),
            DiffusionNet::Mmdit(mmdit) => mmdit.graph_size(),
            DiffusionNet::QwenImage(qwen) => qwen.graph_size(),
        }
    }
}

/// An input the network cannot use is an error, not silently ignored.
pub(crate) fn reject(t: Option<&GTensor>, name: &'static str, net: &str) -> Result<()> {
    match t {
        Some(t) => Err(ModelError::Input {
            name,
            detail: format!("{:?} given to {net}, which has no use for it", t.ne()),
        }),
        None => Ok(()),
    }
}
