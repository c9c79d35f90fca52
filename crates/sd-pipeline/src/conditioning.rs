//! Text conditioning: run a text encoder over the 77-token chunks of a prompt, apply the
//! attention weights the stable-diffusion.cpp way and join the chunks.
//!
//! The text encoder is any closure `FnMut(&[i32]) -> Result<Tensor<f32>, E>` taking the 77 token
//! ids of one chunk and returning its hidden states `[77, hidden]` (or `[1, 77, hidden]`); how
//! the CLIP model is run (sd-models, clip skip, SDXL's two encoders concatenated) is the
//! closure's business. Wrap an infallible closure with [`infallible`].
//!
//! Weighting ([`apply_token_weights`]): each token's hidden state is multiplied by its weight,
//! then the whole chunk is rescaled so that its mean over all elements is the unweighted mean.
//! Chunks are concatenated along the token axis: the context is `[77 n, hidden]`.

use std::convert::Infallible;
use std::error::Error;

use sd_tensor::host::ShapeError;
use sd_tensor::Tensor;
use thiserror::Error;

use crate::tokenizer::{ClipTokenizer, WeightedTokens, CHUNK_LEN};

/// An error of the text conditioning.
#[derive(Debug, Error)]
pub enum ConditioningError {
    /// The text encoder failed.
    #[error("text encoder failed on chunk {chunk}: {source}")]
    Encoder {
        /// Chunk index.
        chunk: usize,
        /// The encoder's error.
        #[source]
        source: Box<dyn Error + Send + Sync>,
    },
    /// The text encoder returned a tensor that is not `[77, hidden]` / `[1, 77, hidden]`.
    #[error(
        "text encoder returned shape {shape:?} for chunk {chunk}, expected [{tokens}, hidden]"
    )]
    EncoderShape {
        /// Chunk index.
        chunk: usize,
        /// The returned shape.
        shape: Vec<usize>,
        /// Expected token count.
        tokens: usize,
    },
    /// Chunks came back with different hidden sizes.
    #[error("hidden size {got} of chunk {chunk} differs from {expected} of chunk 0")]
    HiddenMismatch {
        /// Chunk index.
        chunk: usize,
        /// Hidden size of chunk 0.
        expected: usize,
        /// Hidden size of this chunk.
        got: usize,
    },
    /// The weights do not match the hidden states' token count.
    #[error("{weights} token weights for hidden states of shape {shape:?}")]
    WeightCount {
        /// Number of weights.
        weights: usize,
        /// Hidden states shape.
        shape: Vec<usize>,
    },
    /// A family's conditioning does not fit its networks (an encoder without the pooled
    /// output the family needs, a `y` width the UNet does not take).
    #[error("conditioning: {0}")]
    Mismatch(String),
    /// A tensor shape operation failed.
    #[error(transparent)]
    Shape(#[from] ShapeError),
}

/// Adapts an infallible encoder `FnMut(&[i32]) -> Tensor<f32>` to the fallible form taken here.
pub fn infallible<F>(mut f: F) -> impl FnMut(&[i32]) -> Result<Tensor<f32>, Infallible>
where
    F: FnMut(&[i32]) -> Tensor<f32>,
{
    move |tokens| Ok(f(tokens))
}

/// Applies per-token attention weights to hidden states `[tokens, hidden]` in place, as
/// stable-diffusion.cpp: multiply row `i` by `weights[i]`, then rescale everything by
/// `mean_before / mean_after` (skipped when either mean is not finite or the new mean is 0).
/// All-ones weights leave the tensor untouched.
pub fn apply_token_weights(
    hidden: &mut Tensor<f32>,
    weights: &[f32],
) -> Result<(), ConditioningError> {
    let shape = hidden.shape().to_vec();
    let tokens = match shape.as_slice() {
        [t, _] => *t,
        [t] => *t,
        _ => 0,
    };
    if shape.is_empty() || shape.len() > 2 || tokens != weights.len() {
        return Err(ConditioningError::WeightCount {
            weights: weights.len(),
            shape,
        });
    }
    if weights.iter().all(|&w| w == 1.0) {
        return Ok(());
    }
    let original_mean = hidden.mean();
    let width = shape.get(1).copied().unwrap_or(1);
    if width > 0 {
        for (row, &w) in hidden.data_mut().chunks_mut(width).zip(weights) {
            row.iter_mut().for_each(|v| *v *= w);
        }
    }
    let new_mean = hidden.mean();
    if original_mean.is_finite() && new_mean.is_finite() && new_mean != 0.0 {
        let s = original_mean / new_mean;
        hidden.data_mut().iter_mut().for_each(|v| *v *= s);
    }
    Ok(())
}

/// Encodes tokenized chunks: the weighted context `[77 n, hidden]`.
pub fn encode_tokens<F, E>(
    tokens: &WeightedTokens,
    mut encoder: F,
) -> Result<Tensor<f32>, ConditioningError>
where
    F: FnMut(&[i32]) -> Result<Tensor<f32>, E>,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    let mut hidden_size = None;
    let mut data: Vec<f32> = Vec::new();
    let mut total_tokens = 0;
    for (chunk, (ids, weights)) in tokens.chunks().enumerate() {
        let out = encoder(ids).map_err(|e| ConditioningError::Encoder {
            chunk,
            source: e.into(),
        })?;
        let mut out = match out.shape() {
            [1, t, h] if *t == CHUNK_LEN => {
                let h = *h;
                out.reshape([CHUNK_LEN, h])?
            }
            [t, _] if *t == CHUNK_LEN => out,
            s => {
                return Err(ConditioningError::EncoderShape {
                    chunk,
                    shape: s.to_vec(),
                    tokens: CHUNK_LEN,
                })
            }
        };
        let h = out.shape()[1];
        match hidden_size {
            None => hidden_size = Some(h),
            Some(expected) if expected != h => {
                return Err(ConditioningError::HiddenMismatch {
                    chunk,
                    expected,
                    got: h,
                })
            }
            Some(_) => {}
        }
        apply_token_weights(&mut out, weights)?;
        data.extend_from_slice(out.data());
        total_tokens += CHUNK_LEN;
    }
    let h = hidden_size.unwrap_or(0);
    Ok(Tensor::new([total_tokens, h], data)?)
}

/// Tokenizes `prompt` (attention syntax included) and encodes it: the context `[77 n, hidden]`.
pub fn encode_prompt<F, E>(
    tokenizer: &ClipTokenizer,
    prompt: &str,
    encoder: F,
) -> Result<Tensor<f32>, ConditioningError>
where
    F: FnMut(&[i32]) -> Result<Tensor<f32>, E>,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    encode_tokens(&tokenizer.tokenize_weighted(prompt), encoder)
}

/// The conditioning pair of classifier-free guidance.
#[derive(Clone, Debug, PartialEq)]
pub struct CfgConditioning {
    /// Context of the negative prompt, `[T, hidden]`.
    pub uncond: Tensor<f32>,
    /// Context of the prompt, `[T, hidden]`.
    pub cond: Tensor<f32>,
}

impl CfgConditioning {
    /// `[2, T, hidden]`: uncond first, cond second.
    pub fn stacked(&self) -> Result<Tensor<f32>, ConditioningError> {
        stack_uncond_cond(&self.uncond, &self.cond, 1)
    }

    /// `[2 batch, T, hidden]`: `batch` copies of uncond, then `batch` copies of cond.
    pub fn batched(&self, batch: usize) -> Result<Tensor<f32>, ConditioningError> {
        stack_uncond_cond(&self.uncond, &self.cond, batch)
    }
}

/// Encodes a prompt and a negative prompt with the same number of chunks (the shorter one is
/// padded with empty chunks, as A1111 does), so that both contexts have the same shape.
pub fn encode_cfg<F, E>(
    tokenizer: &ClipTokenizer,
    prompt: &str,
    negative_prompt: &str,
    mut encoder: F,
) -> Result<CfgConditioning, ConditioningError>
where
    F: FnMut(&[i32]) -> Result<Tensor<f32>, E>,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    let mut cond = tokenizer.tokenize_weighted(prompt);
    let mut uncond = tokenizer.tokenize_weighted(negative_prompt);
    let n = cond.num_chunks().max(uncond.num_chunks());
    cond.pad_to_chunks(n);
    uncond.pad_to_chunks(n);
    let uncond = encode_tokens(&uncond, &mut encoder)?;
    let cond = encode_tokens(&cond, &mut encoder)?;
    Ok(CfgConditioning { uncond, cond })
}

/// Stacks `batch` copies of `uncond` then `batch` copies of `cond` (both `[T, hidden]`) into
/// `[2 batch, T, hidden]`, the layout of a batched classifier-free-guidance model call.
pub fn stack_uncond_cond(
    uncond: &Tensor<f32>,
    cond: &Tensor<f32>,
    batch: usize,
) -> Result<Tensor<f32>, ConditioningError> {
    let parts: Vec<&Tensor<f32>> = std::iter::repeat_n(uncond, batch)
        .chain(std::iter::repeat_n(cond, batch))
        .collect();
    Ok(Tensor::stack(&parts, 0)?)
}

/// Stacks `batch` copies of a context `[T, hidden]` into `[batch, T, hidden]`.
pub fn repeat_batch(context: &Tensor<f32>, batch: usize) -> Result<Tensor<f32>, ConditioningError> {
    let parts: Vec<&Tensor<f32>> = std::iter::repeat_n(context, batch).collect();
    Ok(Tensor::stack(&parts, 0)?)
}
