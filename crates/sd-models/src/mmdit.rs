//! The SD3 / SD3.5 transformer: Stability AI's MMDiT (`sd3/mmditx.py`), the network of
//! diffusers' `SD3Transformer2DModel`, with MMDiT-X's second self-attention (SD3.5 Medium).
//!
//! Parameters live under the diffusion prefix with Stability's single-file names
//! (`sd3.5_large.safetensors`): `pos_embed` `[1, M*M, hidden]` (a fixed 2-D sin-cos table
//! stored in the checkpoint), `x_embedder.proj` (a `p` x `p` stride-`p` convolution),
//! `t_embedder.mlp.{0,2}`, `y_embedder.mlp.{0,2}`, `context_embedder`,
//! `joint_blocks.N.{context_block,x_block}.{adaLN_modulation.1, attn.qkv, attn.proj,
//! attn.ln_q, attn.ln_k, mlp.fc1, mlp.fc2}`, `joint_blocks.N.x_block.attn2.*` (MMDiT-X),
//! `final_layer.{adaLN_modulation.1, linear}`. The last block's context block is
//! "pre-only": its modulation gives (shift, scale) alone and it has no `attn.proj` or MLP.
//!
//! Forward, on latents `[W, H, C, B]` (W and H multiples of the patch size):
//! 1. prelude: `x = x_embedder(patches) + pos_embed` (the table's centre crop to the patch
//!    grid), `c = t_embedder(emb(t)) + y_embedder(pooled)` (`emb`: 256-wide sinusoid, cos
//!    first; SiLU between the two layers of each embedder), `ctx = context_embedder(context)`;
//! 2. joint blocks: per stream, `(shift, scale, gate) x 2 = adaLN_modulation(silu(c))`
//!    (x_block of MMDiT-X: a third triple for `attn2`), attention over `[ctx; x]` of the
//!    modulated layer-normed streams (q/k RMS-normed per head when `ln_q` exists),
//!    `s += gate1 * proj(attn_s)`, MMDiT-X: `x += gate3 * attn2(modulate(ln(x_in), shift3,
//!    scale3))` (self-attention over the image alone), `s += gate2 * mlp(modulate(ln(s)))`
//!    (GELU tanh);
//! 3. final layer: `(shift, scale) = adaLN_modulation.1(silu(c))`, `linear(modulate(ln(x)))`,
//!    then unpatchify (features of a token ordered `(row, column, channel)` in the patch).
//!
//! diffusers' names (`SD3Transformer2DModel`: `pos_embed.proj`, `time_text_embed.*`,
//! `transformer_blocks.N.{norm1, norm1_context, attn.to_q, attn.add_q_proj, attn.norm_q,
//! attn.to_out.0, attn.to_add_out, attn2.*, ff, ff_context}`, `norm_out`, `proj_out`) are
//! read as they are ([`MmditLayout`]): q, k and v as three projections, and the (scale,
//! shift) order of `norm_out` and the pre-only `norm1_context` taken as stored (diffusers'
//! single-file converter swaps these halves; stable-diffusion.cpp's name map does not).
//!
//! The timestep is what the SD3 pipelines pass: sigma x 1000. Sizes come from the tensors:
//! width and patch from `x_embedder.proj`, block count from the names, the head width from
//! `ln_q` when the model has QK norm (SD3.5), else 64 (SD3 Medium's 24 x 64; the heads are
//! width / 64, which is stable-diffusion.cpp's "heads = depth" for every released model).

use sd_tensor::ggml::{Context, GTensor};

pub use crate::dit::QkvProj;
use crate::dit::{chunks, gelu, modulate, qk_norm, split_tokens, TextTokens};
use crate::nn::{attention, pixel_shuffle, pixel_unshuffle, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};
use sd_graphcut::{LEVEL_LAYER, LEVEL_SUBLAYER};

/// Width of the sinusoidal timestep embedding.
const TIME_DIM: usize = 256;
/// Head width of models without QK norm (SD3 Medium).
const DEFAULT_HEAD_DIM: usize = 64;

/// The parameter names of a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MmditLayout {
    /// Stability's single files (`joint_blocks.N.x_block.attn.qkv`, ...).
    #[default]
    Stability,
    /// diffusers' `SD3Transformer2DModel` (`transformer_blocks.N.attn.to_q`, ...): q, k and
    /// v apart, and the final layer's and the pre-only context block's modulation stored
    /// as (scale, shift).
    Diffusers,
}

impl MmditLayout {
    /// The layout of the tensors under `pb`.
    fn of(pb: &ParamBuilder<'_>) -> MmditLayout {
        if pb.contains("transformer_blocks.0.attn.to_q.weight") {
            MmditLayout::Diffusers
        } else {
            MmditLayout::Stability
        }
    }

    /// The name in this layout of what Stability calls `sai` (relative to the prefix, no
    /// `.weight`/`.bias`; q, k and v apart as `attn.q`, `attn.k`, `attn.v`).
    pub fn name(self, sai: &str) -> String {
        if self == MmditLayout::Stability {
            return sai.to_string();
        }
        if let Some(rest) = sai.strip_prefix("joint_blocks.") {
            let (i, rel) = rest.split_once('.').unwrap_or((rest, ""));
            let rel = match rel {
                "x_block.adaLN_modulation.1" => "norm1.linear".to_string(),
                "context_block.adaLN_modulation.1" => "norm1_context.linear".to_string(),
                "x_block.attn.proj" => "attn.to_out.0".to_string(),
                "context_block.attn.proj" => "attn.to_add_out".to_string(),
                "x_block.attn2.proj" => "attn2.to_out.0".to_string(),
                "x_block.mlp.fc1" => "ff.net.0.proj".to_string(),
                "x_block.mlp.fc2" => "ff.net.2".to_string(),
                "context_block.mlp.fc1" => "ff_context.net.0.proj".to_string(),
                "context_block.mlp.fc2" => "ff_context.net.2".to_string(),
                other => {
                    let (stream, leaf) = other.rsplit_once('.').unwrap_or(("", other));
                    match (stream, leaf) {
                        ("x_block.attn", "ln_q" | "ln_k") => format!("attn.norm_{}", &leaf[3..]),
                        ("context_block.attn", "ln_q" | "ln_k") => {
                            format!("attn.norm_added_{}", &leaf[3..])
                        }
                        ("x_block.attn2", "ln_q" | "ln_k") => {
                            format!("attn2.norm_{}", &leaf[3..])
                        }
                        ("x_block.attn", "q" | "k" | "v") => format!("attn.to_{leaf}"),
                        ("context_block.attn", "q" | "k" | "v") => format!("attn.add_{leaf}_proj"),
                        ("x_block.attn2", "q" | "k" | "v") => format!("attn2.to_{leaf}"),
                        _ => other.to_string(),
                    }
                }
            };
            return format!("transformer_blocks.{i}.{rel}");
        }
        match sai {
            "pos_embed" => "pos_embed.pos_embed",
            "x_embedder.proj" => "pos_embed.proj",
            "t_embedder.mlp.0" => "time_text_embed.timestep_embedder.linear_1",
            "t_embedder.mlp.2" => "time_text_embed.timestep_embedder.linear_2",
            "y_embedder.mlp.0" => "time_text_embed.text_embedder.linear_1",
            "y_embedder.mlp.2" => "time_text_embed.text_embedder.linear_2",
            "final_layer.adaLN_modulation.1" => "norm_out.linear",
            "final_layer.linear" => "proj_out",
            other => other,
        }
        .to_string()
    }
}

/// Configuration of an MMDiT (`MMDiTX.__init__` in Stability's `sd3/mmditx.py`; defaults:
/// SD3.5 Large, `stabilityai/stable-diffusion-3.5-large` `transformer/config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct MmditConfig {
    /// Name prefix of the parameters (set by the loader; the diffusion slot's).
    pub prefix: String,
    /// Latent channels read (`in_channels`, 16).
    pub in_channels: usize,
    /// Latent channels predicted (`out_channels`, 16).
    pub out_channels: usize,
    /// Patch size (`patch_size`, 2).
    pub patch_size: usize,
    /// Model width (`num_attention_heads * attention_head_dim`, 38 x 64 = 2432).
    pub hidden_size: usize,
    /// Attention heads (38).
    pub num_heads: usize,
    /// Joint blocks (`num_layers`, 38).
    pub depth: usize,
    /// Width of the text context (`joint_attention_dim`, 4096).
    pub context_dim: usize,
    /// Width of the pooled text vector (`pooled_projection_dim`, 2048).
    pub pooled_dim: usize,
    /// Side of the position table (`pos_embed_max_size`, 192).
    pub pos_embed_max_size: usize,
    /// RMS QK norm (`qk_norm: "rms_norm"`; SD3.5).
    pub qk_norm: bool,
    /// Blocks whose image stream has MMDiT-X's second attention (`dual_attention_layers`;
    /// SD3.5 Medium: 0..=12).
    pub dual_attention_layers: Vec<usize>,
    /// The parameter names (read from the tensors).
    pub layout: MmditLayout,
}

impl MmditConfig {
    /// SD3.5 Large.
    pub fn sd35_large() -> Self {
        MmditConfig {
            prefix: sd_formats::names::UNET_PREFIX
                .trim_end_matches('.')
                .to_string(),
            in_channels: 16,
            out_channels: 16,
            patch_size: 2,
            hidden_size: 2432,
            num_heads: 38,
            depth: 38,
            context_dim: 4096,
            pooled_dim: 2048,
            pos_embed_max_size: 192,
            qk_norm: true,
            dual_attention_layers: Vec::new(),
            layout: MmditLayout::Stability,
        }
    }

    /// SD3 Medium (`stabilityai/stable-diffusion-3-medium-diffusers`: 24 blocks of 1536, no
    /// QK norm).
    pub fn sd3_medium() -> Self {
        MmditConfig {
            hidden_size: 1536,
            num_heads: 24,
            depth: 24,
            qk_norm: false,
            ..Self::sd35_large()
        }
    }

    /// SD3.5 Medium (24 blocks of 1536, QK norm, MMDiT-X attention in blocks 0 to 12, a
    /// 384 x 384 position table).
    pub fn sd35_medium() -> Self {
        MmditConfig {
            qk_norm: true,
            pos_embed_max_size: 384,
            dual_attention_layers: (0..13).collect(),
            ..Self::sd3_medium()
        }
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }

    /// This configuration with every size the tensors under `pb` determine.
    pub fn with_shapes_of(mut self, pb: &ParamBuilder<'_>) -> Result<Self> {
        let layout = MmditLayout::of(pb);
        let key = |sai: &str, leaf: &str| format!("{}.{leaf}", layout.name(sai));
        let shape = |name: &str| -> Result<Vec<usize>> {
            pb.file_shape(name)
                .map(|s| s.iter().map(|&d| d as usize).collect())
                .ok_or_else(|| {
                    ModelError::Config(format!("MMDiT: no tensor `{}.{name}`", pb.prefix()))
                })
        };
        let proj = shape(&key("x_embedder.proj", "weight"))?; // [hidden, C, p, p]
        let pos = shape(&layout.name("pos_embed"))?; // [1, M*M, hidden]
        let ctx = shape(&key("context_embedder", "weight"))?;
        let y = shape(&key("y_embedder.mlp.0", "weight"))?;
        let out = shape(&key("final_layer.linear", "weight"))?;
        if proj.len() != 4 || proj[2] != proj[3] || proj[2] == 0 {
            return Err(ModelError::Config(format!(
                "MMDiT: the patch embedding {proj:?} is not a square patch kernel"
            )));
        }
        let (hidden, p) = (proj[0], proj[2]);
        let ln_q = key("joint_blocks.0.x_block.attn.ln_q", "weight");
        let qk_norm = pb.contains(&ln_q);
        let head = if qk_norm {
            shape(&ln_q)?[0]
        } else {
            DEFAULT_HEAD_DIM
        };
        // [1, M*M, hidden] (or [M*M, hidden] where a writer dropped the leading 1).
        let cells: usize = pos[..pos.len().saturating_sub(1)].iter().product();
        let side = (cells as f64).sqrt().round() as usize;
        if head == 0 || hidden % head != 0 || side * side != cells || out[0] % (p * p) != 0 {
            return Err(ModelError::Config(format!(
                "MMDiT: width {hidden}, head width {head}, position table {pos:?}, output \
                 {out:?} (the width must be a multiple of the head width, the table square)"
            )));
        }
        let q_of = |i: usize, attn: &str| match layout {
            MmditLayout::Stability => {
                key(&format!("joint_blocks.{i}.x_block.{attn}.qkv"), "weight")
            }
            MmditLayout::Diffusers => key(&format!("joint_blocks.{i}.x_block.{attn}.q"), "weight"),
        };
        self.depth = (0..).take_while(|&i| pb.contains(&q_of(i, "attn"))).count();
        self.dual_attention_layers = (0..self.depth)
            .filter(|&i| pb.contains(&q_of(i, "attn2")))
            .collect();
        self.in_channels = proj[1];
        self.patch_size = p;
        self.hidden_size = hidden;
        self.num_heads = hidden / head;
        self.out_channels = out[0] / (p * p);
        self.context_dim = ctx[1];
        self.pooled_dim = y[1];
        self.pos_embed_max_size = side;
        self.qk_norm = qk_norm;
        self.layout = layout;
        Ok(self)
    }
}

/// A self-attention of one stream: q/k/v, optional per-head RMS norms, optional `proj`.
#[derive(Clone, Debug)]
pub struct SelfAttention {
    /// `qkv`.
    pub qkv: QkvProj,
    /// `ln_q.weight`.
    pub ln_q: Option<GTensor>,
    /// `ln_k.weight`.
    pub ln_k: Option<GTensor>,
    /// `proj` (absent in the pre-only context block).
    pub proj: Option<Linear>,
}

impl SelfAttention {
    /// The attention Stability names `base` (`joint_blocks.N.x_block.attn`).
    fn new(pb: &ParamBuilder<'_>, c: &MmditConfig, base: &str, with_proj: bool) -> Result<Self> {
        let (h, d) = (c.hidden_size, c.head_dim());
        let n = |leaf: &str| c.layout.name(&format!("{base}.{leaf}"));
        let norm = |leaf: &str| -> Result<Option<GTensor>> {
            if c.qk_norm {
                Ok(Some(pb.tensor(&format!("{}.weight", n(leaf)), &[d])?))
            } else {
                Ok(None)
            }
        };
        let qkv = match c.layout {
            MmditLayout::Stability => {
                QkvProj::Fused(Linear::new(&pb.pp(n("qkv")), h, 3 * h, true)?)
            }
            MmditLayout::Diffusers => QkvProj::Split([
                Linear::new(&pb.pp(n("q")), h, h, true)?,
                Linear::new(&pb.pp(n("k")), h, h, true)?,
                Linear::new(&pb.pp(n("v")), h, h, true)?,
            ]),
        };
        Ok(SelfAttention {
            qkv,
            ln_q: norm("ln_q")?,
            ln_k: norm("ln_k")?,
            proj: if with_proj {
                Some(Linear::new(&pb.pp(n("proj")), h, h, true)?)
            } else {
                None
            },
        })
    }

    /// q and k (normed when the model has QK norm) and v of `x` `[h, n, B]`.
    fn qkv(&self, ctx: &Context, x: &GTensor, heads: usize) -> Result<[GTensor; 3]> {
        let [q, k, v] = self.qkv.forward(ctx, x)?;
        let dense = |t: &GTensor| crate::nn::contiguous(ctx, t);
        let (mut q, mut k, v) = (dense(&q)?, dense(&k)?, dense(&v)?);
        if let Some(w) = &self.ln_q {
            q = qk_norm(ctx, &q, w, heads)?;
        }
        if let Some(w) = &self.ln_k {
            k = qk_norm(ctx, &k, w, heads)?;
        }
        Ok([q, k, v])
    }
}

/// `mlp`: `fc2(gelu_tanh(fc1(x)))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `fc1` (width to 4 x width).
    pub fc1: Linear,
    /// `fc2`.
    pub fc2: Linear,
}

/// One stream of a joint block (`context_block` or `x_block`; SAI's `DismantledBlock`).
#[derive(Clone, Debug)]
pub struct StreamBlock {
    /// `adaLN_modulation.1`: 2, 6 or 9 x width.
    pub modulation: Linear,
    /// `attn`.
    pub attn: SelfAttention,
    /// `attn2` (MMDiT-X image streams).
    pub attn2: Option<SelfAttention>,
    /// `mlp` (absent when pre-only).
    pub mlp: Option<Mlp>,
}

/// `joint_blocks.N`.
#[derive(Clone, Debug)]
pub struct JointBlock {
    /// `context_block`.
    pub context: StreamBlock,
    /// `x_block`.
    pub x: StreamBlock,
}

/// The MMDiT.
#[derive(Clone, Debug)]
pub struct MmditModel {
    /// Configuration (sizes as read from the tensors).
    pub config: MmditConfig,
    /// `pos_embed` `[1, M*M, hidden]`.
    pub pos_embed: GTensor,
    /// `x_embedder.proj` (kernel `[hidden, C, p, p]`), applied as a matrix over flattened
    /// patches.
    pub x_embedder: Linear,
    /// `t_embedder.mlp.0`.
    pub t_in: Linear,
    /// `t_embedder.mlp.2`.
    pub t_out: Linear,
    /// `y_embedder.mlp.0`.
    pub y_in: Linear,
    /// `y_embedder.mlp.2`.
    pub y_out: Linear,
    /// `context_embedder`.
    pub context_embedder: Linear,
    /// `joint_blocks`.
    pub joint_blocks: Vec<JointBlock>,
    /// `final_layer.adaLN_modulation.1` (shift, scale).
    pub final_modulation: Linear,
    /// `final_layer.linear`.
    pub final_linear: Linear,
}

impl MmditModel {
    /// Declares the parameters under `config.prefix` of `pb`, sizes read from the tensors
    /// ([`MmditConfig::with_shapes_of`]).
    pub fn new(pb: &ParamBuilder<'_>, config: MmditConfig) -> Result<Self> {
        let pb = &pb.pp(&config.prefix);
        // Sizes from the tensors; without a catalog (synthetic weights), the configuration's.
        let c = if pb.has_catalog() {
            config.with_shapes_of(pb)?
        } else {
            config
        };
        let (h, p) = (c.hidden_size, c.patch_size);
        let n = |sai: &str| c.layout.name(sai);
        let lin = |sai: &str, i: usize, o: usize| Linear::new(&pb.pp(n(sai)), i, o, true);
        let mlp = |base: &str| -> Result<Mlp> {
            Ok(Mlp {
                fc1: lin(&format!("{base}.fc1"), h, 4 * h)?,
                fc2: lin(&format!("{base}.fc2"), 4 * h, h)?,
            })
        };
        let mut joint_blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = format!("joint_blocks.{i}");
            let pre_only = i + 1 == c.depth;
            let dual = c.dual_attention_layers.contains(&i);
            joint_blocks.push(JointBlock {
                context: StreamBlock {
                    modulation: lin(
                        &format!("{b}.context_block.adaLN_modulation.1"),
                        h,
                        if pre_only { 2 } else { 6 } * h,
                    )?,
                    attn: SelfAttention::new(
                        pb,
                        &c,
                        &format!("{b}.context_block.attn"),
                        !pre_only,
                    )?,
                    attn2: None,
                    mlp: if pre_only {
                        None
                    } else {
                        Some(mlp(&format!("{b}.context_block.mlp"))?)
                    },
                },
                x: StreamBlock {
                    modulation: lin(
                        &format!("{b}.x_block.adaLN_modulation.1"),
                        h,
                        if dual { 9 } else { 6 } * h,
                    )?,
                    attn: SelfAttention::new(pb, &c, &format!("{b}.x_block.attn"), true)?,
                    attn2: if dual {
                        Some(SelfAttention::new(
                            pb,
                            &c,
                            &format!("{b}.x_block.attn2"),
                            true,
                        )?)
                    } else {
                        None
                    },
                    mlp: Some(mlp(&format!("{b}.x_block.mlp"))?),
                },
            });
        }
        let m = c.pos_embed_max_size;
        // As stored: [1, M*M, hidden], or [M*M, hidden] from writers that drop the 1.
        let pos_shape = match pb.file_shape(&n("pos_embed")) {
            Some(s) if s.len() == 2 => vec![m * m, h],
            _ => vec![1, m * m, h],
        };
        let proj = pb.pp(n("x_embedder.proj"));
        Ok(MmditModel {
            pos_embed: pb.tensor(&n("pos_embed"), &pos_shape)?,
            x_embedder: Linear {
                weight: proj.tensor("weight", &[h, c.in_channels, p, p])?,
                bias: Some(proj.tensor("bias", &[h])?),
            },
            t_in: lin("t_embedder.mlp.0", TIME_DIM, h)?,
            t_out: lin("t_embedder.mlp.2", h, h)?,
            y_in: lin("y_embedder.mlp.0", c.pooled_dim, h)?,
            y_out: lin("y_embedder.mlp.2", h, h)?,
            context_embedder: lin("context_embedder", c.context_dim, h)?,
            joint_blocks,
            final_modulation: lin("final_layer.adaLN_modulation.1", h, 2 * h)?,
            final_linear: lin("final_layer.linear", h, p * p * c.out_channels)?,
            config: c,
        })
    }

    /// Graph nodes a forward pass needs (generous).
    pub fn graph_size(&self) -> usize {
        2048 + 192 * self.joint_blocks.len()
    }

    /// The forward pass: latents `x` `[W, H, C, B]`, timesteps (sigma x 1000) `[B]`, text
    /// context `[context_dim, L, B]`, pooled text `y` `[pooled_dim, B]`; returns the
    /// prediction `[W, H, out_channels, B]`. Graph cuts: `mmdit.prelude` (x, ctx, c) and
    /// `joint_blocks.N` (x, ctx), with fine cuts inside the blocks (see `joint_block`).
    pub fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        timesteps: &GTensor,
        context: &GTensor,
        y: &GTensor,
    ) -> Result<GTensor> {
        self.forward_skipping(g, x, timesteps, TextTokens::States(context), y, &[])
    }

    /// The text stream's input, `context_embedder(states)`: `[context_dim, L, B]` in,
    /// `[hidden_size, L, B]` out. It depends on the prompt alone, so a caller may compute it
    /// once per run and pass it as [`TextTokens::Embedded`].
    pub fn embed_text(&self, g: &mut GraphCtx, states: &GTensor) -> Result<GTensor> {
        let width = self.config.context_dim;
        if states.ne()[0] != width {
            return Err(ModelError::Input {
                name: "context",
                detail: format!("text width {} (the model's is {width})", states.ne()[0]),
            });
        }
        self.context_embedder.forward(&g.ctx, states)
    }

    /// [`MmditModel::forward`] without the joint blocks listed in `skip` (skip-layer
    /// guidance's pass: a skipped block passes both streams through unchanged, as
    /// diffusers' `skip_layers`).
    pub fn forward_skipping(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        timesteps: &GTensor,
        text: TextTokens<'_>,
        y: &GTensor,
        skip: &[usize],
    ) -> Result<GTensor> {
        if let Some(&i) = skip.iter().find(|&&i| i >= self.joint_blocks.len()) {
            return Err(ModelError::Input {
                name: "skip_blocks",
                detail: format!(
                    "block {i} to skip: the MMDiT has {} joint blocks (0 to {})",
                    self.joint_blocks.len(),
                    self.joint_blocks.len().saturating_sub(1)
                ),
            });
        }
        let ctx = g.ctx.clone();
        let c = &self.config;
        let p = c.patch_size;
        let [w, h, ch, b] = x.ne();
        if w % p != 0 || h % p != 0 || ch != c.in_channels {
            return Err(ModelError::Input {
                name: "x",
                detail: format!(
                    "latents {:?}: the MMDiT reads {} channels, sides a multiple of {p}",
                    x.ne(),
                    c.in_channels
                ),
            });
        }
        let (wp, hp) = (w / p, h / p);
        let m = c.pos_embed_max_size;
        if wp > m || hp > m {
            return Err(ModelError::Input {
                name: "x",
                detail: format!(
                    "{wp} x {hp} patches: the position table covers {m} x {m} (latents up \
                     to {} x {})",
                    m * p,
                    m * p
                ),
            });
        }
        let n_txt = text.tensor().ne()[1];

        // 1. Prelude: patches in (channel, row, column) order, as the convolution kernel.
        let patches = pixel_unshuffle(&ctx, x, p)?; // [wp, hp, C p p, B]
        let patches = ctx.cont(&ctx.permute(&patches, [1, 2, 0, 3])?)?; // [C p p, wp, hp, B]
        let patches = ctx.reshape(&patches, &[ch * p * p, wp * hp, b])?;
        let kernel = ctx.reshape(&self.x_embedder.weight, &[ch * p * p, c.hidden_size])?;
        let mut xt = ctx.mul_mat(&kernel, &patches)?;
        if let Some(bias) = &self.x_embedder.bias {
            xt = ctx.add(&xt, bias)?;
        }
        xt = ctx.add(&xt, &self.cropped_pos_embed(&ctx, wp, hp)?)?;
        let t = ctx.timestep_embedding(timesteps, TIME_DIM, 10_000)?;
        let te = self
            .t_out
            .forward(&ctx, &ctx.silu(&self.t_in.forward(&ctx, &t)?)?)?;
        let ye = self
            .y_out
            .forward(&ctx, &ctx.silu(&self.y_in.forward(&ctx, y)?)?)?;
        let cvec = ctx.reshape(&ctx.add(&te, &ye)?, &[c.hidden_size, 1, b])?;
        let (mut txt, embedded) = match text {
            TextTokens::States(states) => (self.embed_text(g, states)?, false),
            TextTokens::Embedded(t) => (t.clone(), true),
        };
        g.marks.mark(&xt, "mmdit.prelude", "x")?;
        if !embedded {
            // (An embedded input is a leaf every segment reads, not a cut.)
            g.marks.mark(&txt, "mmdit.prelude", "ctx")?;
        }
        g.marks.mark(&cvec, "mmdit.prelude", "c")?;

        // 2. Joint blocks.
        let silu_c = ctx.silu(&cvec)?;
        for (i, blk) in self.joint_blocks.iter().enumerate() {
            if skip.contains(&i) {
                continue;
            }
            let name = format!("joint_blocks.{i}");
            g.marks.set_scope(&name);
            let (x, t) = self.joint_block(g, blk, &xt, &txt, &silu_c, n_txt)?;
            g.marks.set_scope("");
            g.marks.mark(&x, &name, "x")?;
            if let Some(t) = &t {
                g.marks.mark(t, &name, "ctx")?;
            }
            xt = x;
            txt = t.unwrap_or(txt);
        }

        // 3. Final layer, then patches back to latents: a token's features are ordered
        //    (row, column, channel); reorder to (channel, row, column) for the shuffle.
        let fm = chunks(&ctx, &self.final_modulation.forward(&ctx, &silu_c)?, 2)?;
        let (shift, scale) = self.shift_scale(&fm);
        let out = self
            .final_linear
            .forward(&ctx, &modulate(&ctx, &xt, shift, scale)?)?;
        let co = c.out_channels;
        let out = ctx.reshape(&out, &[co, p * p, wp * hp * b, 1])?;
        let out = ctx.cont(&ctx.permute(&out, [1, 0, 2, 3])?)?; // [p p, C, n B]
        let out = ctx.reshape(&out, &[co * p * p, wp, hp, b])?;
        let out = ctx.cont(&ctx.permute(&out, [2, 0, 1, 3])?)?; // [wp, hp, C p p, B]
        pixel_shuffle(&ctx, &out, p)
    }

    /// One joint block on the image tokens `x` and the text tokens `txt`; returns both
    /// streams (the text stream `None` after the pre-only block). Fine cuts, used by the
    /// engine only when a whole block does not fit its budget: the modulation vectors
    /// (level 2), the joint q/k/v (level 2), both streams after attention (level 1),
    /// MMDiT-X's second attention (level 2), and each MLP's hidden layer and output
    /// (level 2).
    fn joint_block(
        &self,
        g: &mut GraphCtx,
        blk: &JointBlock,
        x: &GTensor,
        txt: &GTensor,
        silu_c: &GTensor,
        n_txt: usize,
    ) -> Result<(GTensor, Option<GTensor>)> {
        let ctx = g.ctx.clone();
        let heads = self.config.num_heads;
        let pre_only = blk.context.mlp.is_none();
        let xmod = blk.x.modulation.forward(&ctx, silu_c)?;
        g.marks
            .mark_fine_output(&xmod, LEVEL_SUBLAYER, "mod_x", "m")?;
        let cmod = blk.context.modulation.forward(&ctx, silu_c)?;
        g.marks
            .mark_fine_output(&cmod, LEVEL_SUBLAYER, "mod_ctx", "m")?;
        let h = silu_c.ne()[0];
        let xm = chunks(&ctx, &xmod, xmod.ne()[0] / h)?;
        let cm = chunks(&ctx, &cmod, cmod.ne()[0] / h)?;

        // Joint attention over [txt; x].
        let x_n = modulate(&ctx, x, &xm[0], &xm[1])?;
        let (c_shift, c_scale) = if pre_only {
            self.shift_scale(&cm)
        } else {
            (&cm[0], &cm[1])
        };
        let c_n = modulate(&ctx, txt, c_shift, c_scale)?;
        let [xq, xk, xv] = blk.x.attn.qkv(&ctx, &x_n, heads)?;
        let [cq, ck, cv] = blk.context.attn.qkv(&ctx, &c_n, heads)?;
        let q = ctx.concat(&cq, &xq, 1)?;
        let k = ctx.concat(&ck, &xk, 1)?;
        let v = ctx.concat(&cv, &xv, 1)?;
        for (t, o) in [(&q, "q"), (&k, "k"), (&v, "v")] {
            g.marks.mark_fine_output(t, LEVEL_SUBLAYER, "qkv", o)?;
        }
        let a = attention(g, &q, &k, &v, heads, None)?;
        let (ca, xa) = split_tokens(&ctx, &a, n_txt)?;
        let mut xt = gated(&ctx, x, &blk.x.attn.proj, &xa, &xm[2])?;
        let mut tt = if pre_only {
            None
        } else {
            Some(gated(&ctx, txt, &blk.context.attn.proj, &ca, &cm[2])?)
        };
        g.marks.mark_fine_output(&xt, LEVEL_LAYER, "attn", "x")?;
        if let Some(t) = &tt {
            g.marks.mark_fine_output(t, LEVEL_LAYER, "attn", "ctx")?;
        }

        // MMDiT-X: self-attention over the image, from the block's input.
        if let Some(a2) = &blk.x.attn2 {
            let x2 = modulate(&ctx, x, &xm[6], &xm[7])?;
            let [q2, k2, v2] = a2.qkv(&ctx, &x2, heads)?;
            let o2 = attention(g, &q2, &k2, &v2, heads, None)?;
            xt = gated(&ctx, &xt, &a2.proj, &o2, &xm[8])?;
            g.marks
                .mark_fine_output(&xt, LEVEL_SUBLAYER, "attn2", "x")?;
        }

        // MLPs.
        // (The image MLP's gated output is a fine cut, not its sum: the sum is the block's
        // output, which the block cut marks.)
        let dx = mlp_delta(g, &blk.x, &xt, &xm, "x")?;
        if let Some(t) = &tt {
            g.marks
                .mark_fine_output(&dx, LEVEL_SUBLAYER, "mlp_x", "d")?;
            let dt = mlp_delta(g, &blk.context, t, &cm, "ctx")?;
            tt = Some(ctx.add(t, &dt)?);
        }
        Ok((ctx.add(&xt, &dx)?, tt))
    }

    /// (shift, scale) of a two-chunk modulation: Stability stores (shift, scale), diffusers
    /// (scale, shift) (`AdaLayerNormContinuous`).
    fn shift_scale<'m>(&self, m: &'m [GTensor]) -> (&'m GTensor, &'m GTensor) {
        match self.config.layout {
            MmditLayout::Stability => (&m[0], &m[1]),
            MmditLayout::Diffusers => (&m[1], &m[0]),
        }
    }

    /// The centre `wp` x `hp` crop of the position table, `[hidden, wp * hp, 1]`.
    fn cropped_pos_embed(&self, ctx: &Context, wp: usize, hp: usize) -> Result<GTensor> {
        let m = self.config.pos_embed_max_size;
        let (top, left) = ((m - hp) / 2, (m - wp) / 2);
        let nb = self.pos_embed.nb();
        let v = ctx.view(
            &self.pos_embed,
            [self.config.hidden_size, wp, hp, 1],
            [nb[1], nb[1] * m, nb[2]],
            (top * m + left) * nb[1],
        )?;
        // The table keeps the file's type (f32 would double a bf16 table: 358 MB for
        // SD3.5 Large's); the crop is made f32 to add to the activations.
        let v = match self.pos_embed.dtype() {
            Some(sd_tensor::DType::F32) => ctx.cont(&v)?,
            _ => ctx.cast(&v, sd_tensor::DType::F32)?,
        };
        Ok(ctx.reshape(&v, &[self.config.hidden_size, wp * hp, 1])?)
    }
}

/// `x + gate * proj(a)`.
fn gated(
    ctx: &Context,
    x: &GTensor,
    proj: &Option<Linear>,
    a: &GTensor,
    gate: &GTensor,
) -> Result<GTensor> {
    let proj = proj.as_ref().ok_or_else(|| {
        ModelError::Config("MMDiT: an attention output without its projection".into())
    })?;
    Ok(ctx.add(x, &ctx.mul(&proj.forward(ctx, a)?, gate)?)?)
}

/// `gate_mlp * mlp(modulate(ln(x), shift_mlp, scale_mlp))` with the modulation chunks `m`
/// (3: shift, 4: scale, 5: gate), to add to `x`; the hidden layer is a fine cut
/// `fc1_<stream>`.
fn mlp_delta(
    g: &mut GraphCtx,
    s: &StreamBlock,
    x: &GTensor,
    m: &[GTensor],
    stream: &str,
) -> Result<GTensor> {
    let ctx = g.ctx.clone();
    let mlp = s
        .mlp
        .as_ref()
        .ok_or_else(|| ModelError::Config("MMDiT: a stream block without its MLP".into()))?;
    let h = modulate(&ctx, x, &m[3], &m[4])?;
    let h = gelu(g, &mlp.fc1.forward(&ctx, &h)?)?;
    g.marks
        .mark_fine_output(&h, LEVEL_SUBLAYER, &format!("fc1_{stream}"), "h")?;
    let h = mlp.fc2.forward(&ctx, &h)?;
    Ok(ctx.mul(&h, &m[5])?)
}
