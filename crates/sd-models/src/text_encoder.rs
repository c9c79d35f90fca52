//! The text encoders as one closed set: [`TextEncoderArch`] builds a [`TextEncoder`] that
//! maps token ids to hidden states: CLIP (SD1, SD2, SDXL), T5 v1.1 (FLUX.1, SD3) and a
//! decoder-only LLM (Qwen2.5-VL-7B of Qwen-Image).

use sd_tensor::ggml::GTensor;

use crate::clip::{ClipTextConfig, ClipTextModel};
use crate::llm::{LlmConfig, LlmModel};
use crate::t5::{T5Config, T5EncoderModel};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, Result};

/// The configuration of a text encoder.
#[derive(Clone, Debug, PartialEq)]
pub enum TextEncoderArch {
    /// A CLIP text transformer (CLIP-L, OpenCLIP-H, OpenCLIP-bigG).
    Clip(ClipTextConfig),
    /// A T5 v1.1 encoder (T5-XXL); its dimensions are read from the tensors when the
    /// encoder is built (see [`T5Config::with_shapes_of`]).
    T5(T5Config),
    /// A decoder-only LLM (Qwen2.5-VL's language model); its dimensions are read from the
    /// tensors when the encoder is built (see [`LlmConfig::with_shapes_of`]).
    Llm(LlmConfig),
}

impl TextEncoderArch {
    /// The width of the hidden states the encoder returns.
    pub fn hidden_size(&self) -> usize {
        match self {
            TextEncoderArch::Clip(c) => c.hidden_size,
            TextEncoderArch::T5(c) => c.d_model,
            TextEncoderArch::Llm(c) => c.hidden_size,
        }
    }

    /// The most tokens one evaluation takes.
    pub fn max_tokens(&self) -> usize {
        match self {
            TextEncoderArch::Clip(c) => c.max_position_embeddings,
            TextEncoderArch::T5(c) => c.max_tokens,
            TextEncoderArch::Llm(c) => c.max_tokens,
        }
    }

    /// The width of the pooled output, for encoders that have one (SDXL's bigG).
    pub fn pooled_size(&self) -> Option<usize> {
        match self {
            TextEncoderArch::Clip(c) => c.projection_dim,
            TextEncoderArch::T5(_) | TextEncoderArch::Llm(_) => None,
        }
    }

    /// Sets the name prefix of the parameters (the canonical prefix of the component slot;
    /// a CLIP's transformer lives under `PREFIX` + `text_model`, a T5's `shared` and
    /// `encoder` and an LLM's `model` right under `PREFIX`).
    pub fn set_prefix(&mut self, prefix: &str) {
        match self {
            TextEncoderArch::Clip(c) => c.prefix = format!("{prefix}text_model"),
            TextEncoderArch::T5(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
            TextEncoderArch::Llm(c) => c.prefix = prefix.trim_end_matches('.').to_string(),
        }
    }
}

/// A text encoder with its parameters declared.
#[derive(Clone, Debug)]
pub enum TextEncoder {
    /// A CLIP text transformer.
    Clip(ClipTextModel),
    /// A T5 v1.1 encoder.
    T5(T5EncoderModel),
    /// A decoder-only LLM.
    Llm(LlmModel),
}

/// Descriptor and node capacity of one CLIP evaluation (about 40 nodes per layer).
const CLIP_GRAPH: usize = 4096;

impl TextEncoder {
    /// Declares the parameters of `arch` under its prefix in `pb`.
    pub fn new(pb: &ParamBuilder<'_>, arch: &TextEncoderArch) -> Result<Self> {
        Ok(match arch {
            TextEncoderArch::Clip(c) => TextEncoder::Clip(ClipTextModel::new(pb, c.clone())?),
            TextEncoderArch::T5(c) => TextEncoder::T5(T5EncoderModel::new(pb, c.clone())?),
            TextEncoderArch::Llm(c) => TextEncoder::Llm(LlmModel::new(pb, c.clone())?),
        })
    }

    /// Builds the forward pass of `input_ids` (I32 `[n_tokens, B]`); returns the hidden
    /// states `[hidden, n_tokens, B]` the family conditions on.
    pub fn forward(&self, g: &mut GraphCtx, input_ids: &GTensor) -> Result<GTensor> {
        match self {
            TextEncoder::Clip(m) => m.forward(g, input_ids),
            TextEncoder::T5(m) => m.forward(g, input_ids),
            TextEncoder::Llm(m) => m.forward(g, input_ids),
        }
    }

    /// Like [`TextEncoder::forward`], and also the pooled output `[pooled, B]` taken at
    /// token `pool_at[b]` of sequence `b` (end of text); an error for encoders without one.
    pub fn forward_with_pooled(
        &self,
        g: &mut GraphCtx,
        input_ids: &GTensor,
        pool_at: &[usize],
    ) -> Result<(GTensor, GTensor)> {
        match self {
            TextEncoder::Clip(m) => m.forward_with_pooled(g, input_ids, pool_at),
            TextEncoder::T5(_) => Err(crate::ModelError::Config(
                "pooled output asked of a T5 encoder (it has none)".into(),
            )),
            TextEncoder::Llm(_) => Err(crate::ModelError::Config(
                "pooled output asked of an LLM encoder (it has none)".into(),
            )),
        }
    }

    /// Descriptor and node capacity of one evaluation's graph.
    pub fn graph_size(&self) -> usize {
        match self {
            TextEncoder::Clip(m) => CLIP_GRAPH.max((64 * m.layers.len()).next_power_of_two()),
            TextEncoder::T5(m) => m.graph_size(),
            TextEncoder::Llm(m) => m.graph_size(),
        }
    }

    /// The width of the hidden states.
    pub fn hidden_size(&self) -> usize {
        match self {
            TextEncoder::Clip(m) => m.config.hidden_size,
            TextEncoder::T5(m) => m.config.d_model,
            TextEncoder::Llm(m) => m.config.hidden_size,
        }
    }
}
