//! Building blocks shared by the diffusion transformers (FLUX.1, MMDiT): adaLN modulation,
//! modulation chunks, token and feature slicing, per-head QK RMS norm, GELU (tanh form).
//!
//! Layout: token tensors are `[width, tokens, B]` (ggml order); modulation vectors
//! `[width, 1, B]` broadcast over the tokens.

use sd_tensor::ggml::{Context, GTensor};

use crate::nn::{gelu_tanh_exact, Linear};
use crate::{GraphCtx, Result};

/// LayerNorm eps of the affine-free norms of the DiT blocks (`norm1`, `norm2`,
/// `norm_final`: 1e-6 in BFL's FLUX, SAI's MMDiT and diffusers).
pub const LN_EPS: f32 = 1e-6;
/// RMSNorm eps of the QK norms.
pub const RMS_EPS: f32 = 1e-6;

/// GELU, tanh form: f32 formula with `opts.exact`, ggml's kernel otherwise.
pub fn gelu(g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
    if g.opts.exact {
        gelu_tanh_exact(&g.ctx, x)
    } else {
        Ok(g.ctx.gelu(x)?)
    }
}

/// `count` equal chunks of `[count * h, 1, B]` along the first axis, each `[h, 1, B]`.
pub fn chunks(ctx: &Context, x: &GTensor, count: usize) -> Result<Vec<GTensor>> {
    let h = x.ne()[0] / count;
    (0..count).map(|i| rows(ctx, x, i * h, h)).collect()
}

/// Rows `start..start + len` of the first axis of `[n0, n1, n2]`, contiguous.
pub fn rows(ctx: &Context, x: &GTensor, start: usize, len: usize) -> Result<GTensor> {
    let ne = x.ne();
    let nb = x.nb();
    let v = ctx.view(
        x,
        [len, ne[1], ne[2], ne[3]],
        [nb[1], nb[2], nb[3]],
        start * nb[0],
    )?;
    Ok(ctx.cont(&v)?)
}

/// The first `n_txt` tokens and the rest of `[h, n, B]`.
pub fn split_tokens(ctx: &Context, x: &GTensor, n_txt: usize) -> Result<(GTensor, GTensor)> {
    let ne = x.ne();
    let nb = x.nb();
    let txt = ctx.view(x, [ne[0], n_txt, ne[2], ne[3]], [nb[1], nb[2], nb[3]], 0)?;
    let img = ctx.view(
        x,
        [ne[0], ne[1] - n_txt, ne[2], ne[3]],
        [nb[1], nb[2], nb[3]],
        n_txt * nb[1],
    )?;
    Ok((ctx.cont(&txt)?, ctx.cont(&img)?))
}

/// `ln(x) * (1 + scale) + shift` (scale and shift `[h, 1, B]`, broadcast over tokens).
pub fn modulate(ctx: &Context, x: &GTensor, shift: &GTensor, scale: &GTensor) -> Result<GTensor> {
    let n = ctx.norm(x, LN_EPS)?;
    let scaled = ctx.add(&n, &ctx.mul(&n, scale)?)?;
    Ok(ctx.add(&scaled, shift)?)
}

/// RMS norm over each head's width with a learned scale: `[heads * d, n, B]` in and out.
pub fn qk_norm(ctx: &Context, x: &GTensor, scale: &GTensor, heads: usize) -> Result<GTensor> {
    let [w, n, b, _] = x.ne();
    let d = w / heads;
    let x = ctx.reshape(x, &[d, heads, n, b])?;
    let x = ctx.mul(&ctx.rms_norm(&x, RMS_EPS)?, scale)?;
    Ok(ctx.reshape(&x, &[w, n, b])?)
}

/// The q, k, v projections of an attention: fused (`qkv`, BFL's and Stability's files) or
/// apart (`to_q`, `to_k`, `to_v`, diffusers').
#[derive(Clone, Debug)]
pub enum QkvProj {
    /// One `[3h, h]` projection.
    Fused(Linear),
    /// Three `[h, h]` projections.
    Split([Linear; 3]),
}

impl QkvProj {
    /// q, k and v of `x` `[h, n, B]`, each `[h, n, B]`.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<[GTensor; 3]> {
        Ok(match self {
            QkvProj::Fused(l) => {
                let qkv = l.forward(ctx, x)?;
                let h = qkv.ne()[0] / 3;
                [
                    rows(ctx, &qkv, 0, h)?,
                    rows(ctx, &qkv, h, h)?,
                    rows(ctx, &qkv, 2 * h, h)?,
                ]
            }
            QkvProj::Split([q, k, v]) => {
                [q.forward(ctx, x)?, k.forward(ctx, x)?, v.forward(ctx, x)?]
            }
        })
    }
}
