//! The Qwen-Image transformer: diffusers' `QwenImageTransformer2DModel`
//! (`transformer_qwenimage.py`), the 20 B dual-stream DiT of `Qwen/Qwen-Image`.
//!
//! Parameters live under the diffusion prefix with diffusers' names, which are also the names
//! of the single files users download (ComfyUI's `qwen_image_bf16.safetensors`, the GGUFs):
//! `img_in`, `txt_norm`, `txt_in`, `time_text_embed.timestep_embedder.linear_{1,2}`,
//! `transformer_blocks.N.{img_mod.1, txt_mod.1, attn.{to_q, to_k, to_v, add_q_proj,
//! add_k_proj, add_v_proj, norm_q, norm_k, norm_added_q, norm_added_k, to_out.0, to_add_out},
//! img_mlp.net.{0.proj, 2}, txt_mlp.net.{0.proj, 2}}`, `norm_out.linear`, `proj_out`.
//!
//! Forward, on packed latents (2x2 patches of the 16-channel latent, 64 values a token, as
//! diffusers' `_pack_latents`):
//! 1. prelude: `img = img_in(x)`, `txt = txt_in(rms_norm(context) * txt_norm)`, `temb =
//!    linear_2(silu(linear_1(emb(1000 t))))` (`emb`: 256-wide sinusoidal, cos first; `t` is
//!    the sigma);
//! 2. blocks: FLUX.1's double block ([`DoubleBlock`]) with q, k, v apart: per stream
//!    `(shift, scale, gate) x 2 = mod.1(silu(temb))`, joint attention over `[txt; img]` (q/k
//!    RMS-normed per head, RoPE), gated residual attention and GELU-tanh MLP;
//! 3. output: `(scale, shift) = norm_out.linear(silu(temb))` (this order, unlike FLUX's
//!    BFL final layer), `proj_out(ln(img) * (1 + scale) + shift)`.
//!
//! RoPE (`QwenEmbedRope(scale_rope=True)`): an image patch at row `r`, column `c` of an
//! `h x w` patch grid has ids `(0, r - (h - h/2), c - (w - w/2))` (centred); text token `i`
//! has `s + i` on all three axes, with `s = max(h/2, w/2)`; axes `(d/8, 7d/16, 7d/16)` of the
//! head width d ((16, 56, 56) at 128), base 10000.
//!
//! Sizes come from the tensors: width from `img_in`, head width from `attn.norm_q`, block
//! count from the names, MLP width from `img_mlp.net.0.proj`, context width from `txt_in`,
//! output channels from `proj_out`. stable-diffusion.cpp fixes 24 heads x 128 and a 3584
//! context; reading them lets tiny models serve as parity fixtures.
//!
//! Graph cuts: `qwen_image.prelude` (img, txt, and the timestep embedding, which
//! stable-diffusion.cpp recomputes in every segment instead) and `transformer_blocks.N`
//! (img, txt), with the double block's fine cuts inside.

use sd_tensor::ggml::GTensor;

use crate::dit::{chunks, modulate, DoubleBlock, QkvProj, Rope, StreamParams, TextTokens};
use crate::nn::Linear;
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// Configuration of a Qwen-Image transformer (`QwenImageTransformer2DModel`'s defaults:
/// `Qwen/Qwen-Image` `transformer/config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct QwenImageConfig {
    /// Name prefix of the parameters (set by the loader; the diffusion slot's).
    pub prefix: String,
    /// Values of a packed latent token (`in_channels`, 64 = 16 channels x 2 x 2).
    pub in_channels: usize,
    /// Latent channels of the output (`out_channels`, 16; `proj_out` gives 2 x 2 of them).
    pub out_channels: usize,
    /// Width of the text encoder's states (`joint_attention_dim`, 3584: Qwen2.5-VL-7B).
    pub joint_attention_dim: usize,
    /// Model width (`num_attention_heads * attention_head_dim`, 3072).
    pub hidden_size: usize,
    /// Attention heads (`num_attention_heads`, 24).
    pub num_heads: usize,
    /// Blocks (`num_layers`, 60).
    pub num_layers: usize,
    /// MLP width (`FeedForward` default: 4 x width, 12288).
    pub mlp_hidden: usize,
    /// RoPE widths per position axis (`axes_dims_rope`, [16, 56, 56]).
    pub axes_dim: [usize; 3],
    /// RoPE base (10000).
    pub theta: f32,
}

impl Default for QwenImageConfig {
    fn default() -> Self {
        QwenImageConfig {
            prefix: sd_formats::names::UNET_PREFIX
                .trim_end_matches('.')
                .to_string(),
            in_channels: 64,
            out_channels: 16,
            joint_attention_dim: 3584,
            hidden_size: 3072,
            num_heads: 24,
            num_layers: 60,
            mlp_hidden: 12288,
            axes_dim: [16, 56, 56],
            theta: 10_000.0,
        }
    }
}

impl QwenImageConfig {
    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }

    /// This configuration with every size the tensors under `pb` determine.
    pub fn with_shapes_of(mut self, pb: &ParamBuilder<'_>) -> Result<Self> {
        let shape = |name: &str| -> Result<Vec<usize>> {
            pb.file_shape(name)
                .map(|s| s.iter().map(|&d| d as usize).collect())
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "Qwen-Image transformer: no tensor `{}.{name}`",
                        pb.prefix()
                    ))
                })
        };
        let img_in = shape("img_in.weight")?;
        let txt_in = shape("txt_in.weight")?;
        let head = shape("transformer_blocks.0.attn.norm_q.weight")?;
        let mlp = shape("transformer_blocks.0.img_mlp.net.0.proj.weight")?;
        let proj_out = shape("proj_out.weight")?;
        let (hidden, d) = (img_in[0], head[0]);
        if d == 0 || hidden % d != 0 || d % 16 != 0 || proj_out[0] % 4 != 0 {
            return Err(ModelError::Config(format!(
                "Qwen-Image transformer: width {hidden}, head width {d}, output {} (the width \
                 must be a multiple of the head width, the head width of 16, the output of 4)",
                proj_out[0]
            )));
        }
        self.in_channels = img_in[1];
        self.joint_attention_dim = txt_in[1];
        self.hidden_size = hidden;
        self.num_heads = hidden / d;
        self.mlp_hidden = mlp[0];
        self.out_channels = proj_out[0] / 4;
        self.num_layers = (0..)
            .take_while(|i| pb.contains(&format!("transformer_blocks.{i}.img_mod.1.weight")))
            .count();
        self.axes_dim = [d / 8, 7 * d / 16, 7 * d / 16];
        Ok(self)
    }
}

/// The Qwen-Image transformer.
#[derive(Clone, Debug)]
pub struct QwenImageModel {
    /// Configuration (sizes as read from the tensors).
    pub config: QwenImageConfig,
    /// `img_in`.
    pub img_in: Linear,
    /// `txt_norm.weight` (RMS norm of the text states).
    pub txt_norm: GTensor,
    /// `txt_in`.
    pub txt_in: Linear,
    /// `time_text_embed.timestep_embedder.linear_1`.
    pub time_linear_1: Linear,
    /// `time_text_embed.timestep_embedder.linear_2`.
    pub time_linear_2: Linear,
    /// `transformer_blocks`.
    pub blocks: Vec<DoubleBlock>,
    /// `norm_out.linear` (scale, shift).
    pub norm_out: Linear,
    /// `proj_out`.
    pub proj_out: Linear,
}

/// Width of the sinusoidal timestep embedding.
const TIME_DIM: usize = 256;
/// RMS norm eps of `txt_norm`.
const TXT_NORM_EPS: f32 = 1e-6;

/// Position ids of an `h x w` grid of image patches followed by `n_txt` text tokens
/// (`QwenEmbedRope(scale_rope=True)`): image ids centred, text ids from `max(h/2, w/2)`.
pub fn position_ids(h: usize, w: usize, n_txt: usize) -> (Vec<[f32; 3]>, Vec<[f32; 3]>) {
    let (r0, c0) = ((h - h / 2) as f32, (w - w / 2) as f32);
    let img = (0..h)
        .flat_map(|r| (0..w).map(move |c| [0.0, r as f32 - r0, c as f32 - c0]))
        .collect();
    let s = (h / 2).max(w / 2);
    let txt = (0..n_txt).map(|i| [(s + i) as f32; 3]).collect();
    (img, txt)
}

impl QwenImageModel {
    /// Declares the parameters under `config.prefix` of `pb`, sizes read from the tensors.
    pub fn new(pb: &ParamBuilder<'_>, config: QwenImageConfig) -> Result<Self> {
        let pb = &pb.pp(&config.prefix);
        let c = if pb.has_catalog() {
            config.with_shapes_of(pb)?
        } else {
            config
        };
        let (h, m, d) = (c.hidden_size, c.mlp_hidden, c.head_dim());
        let lin = |stem: &str, i: usize, o: usize| -> Result<Linear> {
            Ok(Linear {
                weight: pb.tensor(&format!("{stem}.weight"), &[o, i])?,
                bias: Some(pb.tensor(&format!("{stem}.bias"), &[o])?),
            })
        };
        let mut blocks = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let b = format!("transformer_blocks.{i}");
            let stream = |s: &str, q: &str, k: &str, v: &str, norm: &str, out: &str| {
                Ok::<_, ModelError>(StreamParams {
                    modulation: lin(&format!("{b}.{s}_mod.1"), h, 6 * h)?,
                    qkv: QkvProj::Split([
                        lin(&format!("{b}.attn.{q}"), h, h)?,
                        lin(&format!("{b}.attn.{k}"), h, h)?,
                        lin(&format!("{b}.attn.{v}"), h, h)?,
                    ]),
                    query_norm: pb.tensor(&format!("{b}.attn.norm_{norm}q.weight"), &[d])?,
                    key_norm: pb.tensor(&format!("{b}.attn.norm_{norm}k.weight"), &[d])?,
                    proj: lin(&format!("{b}.attn.{out}"), h, h)?,
                    mlp_in: lin(&format!("{b}.{s}_mlp.net.0.proj"), h, m)?,
                    mlp_out: lin(&format!("{b}.{s}_mlp.net.2"), m, h)?,
                })
            };
            blocks.push(DoubleBlock {
                img: stream("img", "to_q", "to_k", "to_v", "", "to_out.0")?,
                txt: stream(
                    "txt",
                    "add_q_proj",
                    "add_k_proj",
                    "add_v_proj",
                    "added_",
                    "to_add_out",
                )?,
            });
        }
        let t = "time_text_embed.timestep_embedder";
        Ok(QwenImageModel {
            img_in: lin("img_in", c.in_channels, h)?,
            txt_norm: pb.tensor("txt_norm.weight", &[c.joint_attention_dim])?,
            txt_in: lin("txt_in", c.joint_attention_dim, h)?,
            time_linear_1: lin(&format!("{t}.linear_1"), TIME_DIM, h)?,
            time_linear_2: lin(&format!("{t}.linear_2"), h, h)?,
            blocks,
            norm_out: lin("norm_out.linear", h, 2 * h)?,
            proj_out: lin("proj_out", h, 4 * c.out_channels)?,
            config: c,
        })
    }

    /// Graph nodes a forward pass needs (generous).
    pub fn graph_size(&self) -> usize {
        2048 + 256 * self.blocks.len()
    }

    /// The text stream's input, `txt_in(txt_norm(states))`: `[joint_attention_dim, n_txt, B]`
    /// in, `[hidden_size, n_txt, B]` out. It depends on the prompt alone, so a caller may
    /// compute it once per run and pass it as [`TextTokens::Embedded`].
    pub fn embed_text(&self, g: &mut GraphCtx, states: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let width = self.config.joint_attention_dim;
        if states.ne()[0] != width {
            return Err(ModelError::Input {
                name: "context",
                detail: format!("text width {} (the model's is {width})", states.ne()[0]),
            });
        }
        let normed = ctx.mul(&ctx.rms_norm(states, TXT_NORM_EPS)?, &self.txt_norm)?;
        self.txt_in.forward(ctx, &normed)
    }

    /// The forward pass on packed tokens: `img` `[in_channels, h * w, B]` (an `h x w` grid of
    /// patches, row-major), `txt` the text (states `[joint_attention_dim, n_txt, B]` or
    /// their embedding), `timesteps` (sigmas) `[B]`; returns `[4 * out_channels, h * w, B]`.
    pub fn forward_tokens(
        &self,
        g: &mut GraphCtx,
        img: &GTensor,
        txt: TextTokens<'_>,
        timesteps: &GTensor,
        grid: (usize, usize),
    ) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let c = &self.config;
        let [_, n_img, b, _] = img.ne();
        let n_txt = txt.tensor().ne()[1];
        let (gh, gw) = grid;
        let width = match txt {
            TextTokens::States(_) => c.joint_attention_dim,
            TextTokens::Embedded(_) => c.hidden_size,
        };
        if gh * gw != n_img || txt.tensor().ne()[0] != width {
            return Err(ModelError::Input {
                name: "tokens",
                detail: format!(
                    "{n_img} image tokens for a {gh}x{gw} grid, text width {} (the model's is {width})",
                    txt.tensor().ne()[0],
                ),
            });
        }

        // 1. Prelude.
        let mut img = self.img_in.forward(&ctx, img)?;
        let (mut txt, embedded) = match txt {
            TextTokens::States(states) => (self.embed_text(g, states)?, false),
            TextTokens::Embedded(t) => (t.clone(), true),
        };
        let t = ctx.timestep_embedding(&ctx.scale(timesteps, 1000.0)?, TIME_DIM, 10_000)?;
        let temb = self
            .time_linear_2
            .forward(&ctx, &ctx.silu(&self.time_linear_1.forward(&ctx, &t)?)?)?;
        let temb = ctx.reshape(&temb, &[c.hidden_size, 1, b])?;
        g.marks.mark(&img, "qwen_image.prelude", "img")?;
        if !embedded {
            // (An embedded input is a leaf every segment reads, not a cut.)
            g.marks.mark(&txt, "qwen_image.prelude", "txt")?;
        }
        g.marks.mark(&temb, "qwen_image.prelude", "temb")?;

        // RoPE tables for [txt; img].
        let (img_ids, txt_ids) = position_ids(gh, gw, n_txt);
        let ids: Vec<[f32; 3]> = txt_ids.iter().chain(&img_ids).copied().collect();
        let rope = Rope::new(g, "qwen_image", &ids, c.axes_dim, c.theta, c.head_dim())?;

        // 2. Blocks.
        let silu_temb = ctx.silu(&temb)?;
        for (i, blk) in self.blocks.iter().enumerate() {
            let name = format!("transformer_blocks.{i}");
            (img, txt) = blk.forward(g, &name, &img, &txt, &silu_temb, &rope, c.num_heads)?;
        }

        // 3. Output: norm_out's modulation is (scale, shift).
        let fm = chunks(&ctx, &self.norm_out.forward(&ctx, &silu_temb)?, 2)?;
        let y = modulate(&ctx, &img, &fm[1], &fm[0])?;
        self.proj_out.forward(&ctx, &y)
    }

    /// The forward pass on latents `[W, H, C, B]` (W and H even): packed into 2x2 patches
    /// (`(c, row, column)` within a token, tokens row-major, as diffusers' `_pack_latents`),
    /// unpacked after.
    pub fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        timesteps: &GTensor,
        text: TextTokens<'_>,
    ) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let (img, grid) = crate::dit::pack_2x2(&ctx, x, self.config.in_channels / 4, "Qwen-Image")?;
        let out = self.forward_tokens(g, &img, text, timesteps, grid)?;
        crate::dit::unpack_2x2(&ctx, &out, grid)
    }
}
