//! The FLUX.1 transformer (dev and schnell): Black Forest Labs' `Flux` model
//! (`flux/model.py`), the network of diffusers' `FluxTransformer2DModel`.
//!
//! Parameters live under the diffusion prefix with BFL's checkpoint names (the layout of
//! `flux1-dev.safetensors`): `img_in`, `txt_in`, `time_in.{in,out}_layer`,
//! `vector_in.{in,out}_layer`, `guidance_in.*` (dev only), `double_blocks.N.{img,txt}_mod.lin`,
//! `.{img,txt}_attn.{qkv, norm.query_norm.scale, norm.key_norm.scale, proj}`,
//! `.{img,txt}_mlp.{0,2}`, `single_blocks.N.{linear1, linear2, modulation.lin,
//! norm.query_norm.scale, norm.key_norm.scale}`, `final_layer.{linear, adaLN_modulation.1}`.
//!
//! Forward, on packed latents (2x2 patches of the 16-channel latent, 64 values a token):
//! 1. prelude: `img = img_in(x)`, `txt = txt_in(context)`, `vec = time_in(emb(1000 t)) +
//!    guidance_in(emb(1000 g)) + vector_in(pooled)` (`emb`: 256-wide sinusoidal, cos first;
//!    each embedder `out_layer(silu(in_layer(.)))`);
//! 2. double blocks: per stream, `(shift, scale, gate) x 2 = mod.lin(silu(vec))`, attention
//!    over `[txt; img]` of the modulated layer-normed streams (q/k RMS-normed per head, RoPE),
//!    `s += gate1 * proj(attn_s)`, `s += gate2 * mlp(modulate(ln(s)))` (GELU tanh);
//! 3. single blocks on `x = [txt; img]`: `linear1` gives q, k, v and the MLP input at once,
//!    `x += gate * linear2([attn; gelu(mlp)])`;
//! 4. final layer: `(shift, scale) = adaLN_modulation.1(silu(vec))`, `linear(modulate(ln(img)))`.
//!
//! RoPE (`EmbedND`): every token has 3 position ids (text: 0, 0, 0; image patch at row r,
//! column c: 0, r, c); axis `a` of width `d_a` rotates `d_a / 2` adjacent pairs of each head by
//! `id_a * theta^(-2j / d_a)`. The cos/sin tables are made on the host (auxiliary inputs, so
//! every segment of a streamed run reads the same ones).
//!
//! diffusers' names (`FluxTransformer2DModel`: `x_embedder`, `time_text_embed.*`,
//! `transformer_blocks.N.{norm1, attn.to_q, attn.add_q_proj, attn.norm_q, ff, ...}`,
//! `single_transformer_blocks.N.{norm.linear, attn.to_q, proj_mlp, proj_out}`, `norm_out`,
//! `proj_out`) are read as they are ([`FluxLayout`]): q, k, v and a single block's MLP input
//! as separate projections, `norm_out`'s (scale, shift) order taken as stored.
//!
//! Sizes come from the tensors: width from `img_in`, head width from the QK-norm scale,
//! block counts from the names, dev vs schnell from `guidance_in`. The RoPE axes are not in
//! the weights: FLUX.1's (d/8, 7d/16, 7d/16) of the head width d ((16, 56, 56) at 128).

use sd_tensor::ggml::{Context, GTensor};

pub use crate::dit::rope_tables;
use crate::dit::{
    chunks, gelu, modulate, row_view, rows, split_tokens, DoubleBlock, QkvProj, Rope, StreamParams,
    TextTokens,
};
use crate::nn::{attention, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};
use sd_graphcut::LEVEL_SUBLAYER;

/// The parameter names of a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FluxLayout {
    /// Black Forest Labs' (`flux1-dev.safetensors`: `double_blocks.N.img_attn.qkv`, ...).
    #[default]
    Bfl,
    /// diffusers' `FluxTransformer2DModel` (`transformer_blocks.N.attn.to_q`,
    /// `single_transformer_blocks.N.proj_mlp`, ...): q, k, v (and a single block's MLP
    /// input) apart, the final modulation stored as (scale, shift).
    Diffusers,
}

impl FluxLayout {
    /// The layout of the tensors under `pb`.
    fn of(pb: &ParamBuilder<'_>) -> FluxLayout {
        if pb.contains("transformer_blocks.0.attn.to_q.weight")
            || pb.contains("single_transformer_blocks.0.attn.to_q.weight")
        {
            FluxLayout::Diffusers
        } else {
            FluxLayout::Bfl
        }
    }

    /// The name in this layout of the tensor BFL calls `bfl` (relative to the prefix, with
    /// its `.weight`/`.bias`/`.scale`; q, k, v apart as `img_attn.q.weight`, ...,
    /// `single_blocks.N.mlp_in.weight` for a single block's MLP input).
    pub fn name(self, bfl: &str) -> String {
        if self == FluxLayout::Bfl {
            return bfl.to_string();
        }
        let (stem, leaf) = bfl.rsplit_once('.').unwrap_or((bfl, ""));
        let block = |kind: &str, rest: &str| -> Option<(String, String)> {
            let rest = rest.strip_prefix(kind)?.strip_prefix('.')?;
            let (i, rel) = rest.split_once('.')?;
            Some((i.to_string(), rel.to_string()))
        };
        let leaf_w = if leaf == "scale" { "weight" } else { leaf };
        if let Some((i, rel)) = block("double_blocks", stem) {
            let rel = match rel.as_str() {
                "img_mod.lin" => "norm1.linear".to_string(),
                "txt_mod.lin" => "norm1_context.linear".to_string(),
                "img_attn.norm.query_norm" => "attn.norm_q".to_string(),
                "img_attn.norm.key_norm" => "attn.norm_k".to_string(),
                "txt_attn.norm.query_norm" => "attn.norm_added_q".to_string(),
                "txt_attn.norm.key_norm" => "attn.norm_added_k".to_string(),
                "img_attn.proj" => "attn.to_out.0".to_string(),
                "txt_attn.proj" => "attn.to_add_out".to_string(),
                "img_mlp.0" => "ff.net.0.proj".to_string(),
                "img_mlp.2" => "ff.net.2".to_string(),
                "txt_mlp.0" => "ff_context.net.0.proj".to_string(),
                "txt_mlp.2" => "ff_context.net.2".to_string(),
                "img_attn.q" | "img_attn.k" | "img_attn.v" => format!("attn.to_{}", &rel[9..]),
                "txt_attn.q" | "txt_attn.k" | "txt_attn.v" => {
                    format!("attn.add_{}_proj", &rel[9..])
                }
                other => other.to_string(),
            };
            return format!("transformer_blocks.{i}.{rel}.{leaf_w}");
        }
        if let Some((i, rel)) = block("single_blocks", stem) {
            let rel = match rel.as_str() {
                "modulation.lin" => "norm.linear".to_string(),
                "norm.query_norm" => "attn.norm_q".to_string(),
                "norm.key_norm" => "attn.norm_k".to_string(),
                "linear2" => "proj_out".to_string(),
                "q" | "k" | "v" => format!("attn.to_{rel}"),
                "mlp_in" => "proj_mlp".to_string(),
                other => other.to_string(),
            };
            return format!("single_transformer_blocks.{i}.{rel}.{leaf_w}");
        }
        let stem = match stem {
            "img_in" => "x_embedder",
            "txt_in" => "context_embedder",
            "time_in.in_layer" => "time_text_embed.timestep_embedder.linear_1",
            "time_in.out_layer" => "time_text_embed.timestep_embedder.linear_2",
            "vector_in.in_layer" => "time_text_embed.text_embedder.linear_1",
            "vector_in.out_layer" => "time_text_embed.text_embedder.linear_2",
            "guidance_in.in_layer" => "time_text_embed.guidance_embedder.linear_1",
            "guidance_in.out_layer" => "time_text_embed.guidance_embedder.linear_2",
            "final_layer.linear" => "proj_out",
            "final_layer.adaLN_modulation.1" => "norm_out.linear",
            other => other,
        };
        format!("{stem}.{leaf_w}")
    }
}

/// Configuration of a FLUX.1 transformer (`FluxParams` in BFL's `flux/model.py`; defaults:
/// `flux1-dev`).
#[derive(Clone, Debug, PartialEq)]
pub struct FluxConfig {
    /// Name prefix of the parameters (set by the loader; the diffusion slot's).
    pub prefix: String,
    /// Values of a packed latent token (`in_channels`, 64 = 16 channels x 2 x 2).
    pub in_channels: usize,
    /// Width of the T5 context (`context_in_dim`, 4096).
    pub context_in_dim: usize,
    /// Width of the pooled CLIP vector (`vec_in_dim`, 768).
    pub vec_in_dim: usize,
    /// Model width (`hidden_size`, 3072).
    pub hidden_size: usize,
    /// MLP width over model width (`mlp_ratio`, 4).
    pub mlp_ratio: f32,
    /// Attention heads (`num_heads`, 24).
    pub num_heads: usize,
    /// Double-stream blocks (`depth`, 19).
    pub depth: usize,
    /// Single-stream blocks (`depth_single_blocks`, 38).
    pub depth_single_blocks: usize,
    /// RoPE widths per position axis (`axes_dim`, [16, 56, 56]); they sum to the head width.
    pub axes_dim: [usize; 3],
    /// RoPE base (`theta`, 10000).
    pub theta: f32,
    /// Whether the model embeds a distilled guidance scale (`guidance_embed`: dev yes,
    /// schnell no).
    pub guidance_embed: bool,
    /// The parameter names (read from the tensors).
    pub layout: FluxLayout,
}

impl FluxConfig {
    /// FLUX.1-dev (`black-forest-labs/FLUX.1-dev`).
    pub fn dev() -> Self {
        FluxConfig {
            prefix: sd_formats::names::UNET_PREFIX
                .trim_end_matches('.')
                .to_string(),
            in_channels: 64,
            context_in_dim: 4096,
            vec_in_dim: 768,
            hidden_size: 3072,
            mlp_ratio: 4.0,
            num_heads: 24,
            depth: 19,
            depth_single_blocks: 38,
            axes_dim: [16, 56, 56],
            theta: 10_000.0,
            guidance_embed: true,
            layout: FluxLayout::Bfl,
        }
    }

    /// FLUX.1-schnell: dev without the guidance embedding.
    pub fn schnell() -> Self {
        FluxConfig {
            guidance_embed: false,
            ..Self::dev()
        }
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }

    /// MLP width.
    pub fn mlp_hidden(&self) -> usize {
        (self.hidden_size as f32 * self.mlp_ratio) as usize
    }

    /// This configuration with every size the tensors under `pb` determine (widths, head
    /// width, block counts, guidance embedding); the RoPE axes follow the head width.
    pub fn with_shapes_of(mut self, pb: &ParamBuilder<'_>) -> Result<Self> {
        let layout = FluxLayout::of(pb);
        let n = |bfl: &str| layout.name(bfl);
        let shape = |bfl: &str| -> Result<Vec<usize>> {
            let name = n(bfl);
            pb.file_shape(&name)
                .map(|s| s.iter().map(|&d| d as usize).collect())
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "FLUX transformer: no tensor `{}.{name}`",
                        pb.prefix()
                    ))
                })
        };
        let img_in = shape("img_in.weight")?;
        let txt_in = shape("txt_in.weight")?;
        let vec_in = shape("vector_in.in_layer.weight")?;
        let head = shape("double_blocks.0.img_attn.norm.query_norm.scale")?;
        let mlp = shape("double_blocks.0.img_mlp.0.weight")?;
        let (hidden, d) = (img_in[0], head[0]);
        if d == 0 || hidden % d != 0 || d % 16 != 0 {
            return Err(ModelError::Config(format!(
                "FLUX transformer: width {hidden} and head width {d} (the width must be a \
                 multiple of the head width, the head width of 16)"
            )));
        }
        let count = |kind: &str, probe: &str| {
            (0..)
                .take_while(|i| pb.contains(&n(&format!("{kind}.{i}.{probe}"))))
                .count()
        };
        self.in_channels = img_in[1];
        self.context_in_dim = txt_in[1];
        self.vec_in_dim = vec_in[1];
        self.hidden_size = hidden;
        self.num_heads = hidden / d;
        self.mlp_ratio = mlp[0] as f32 / hidden as f32;
        self.depth = count("double_blocks", "img_mod.lin.weight");
        self.depth_single_blocks = count("single_blocks", "modulation.lin.weight");
        self.axes_dim = [d / 8, 7 * d / 16, 7 * d / 16];
        self.guidance_embed = pb.contains(&n("guidance_in.in_layer.weight"));
        self.layout = layout;
        Ok(self)
    }
}

/// `MLPEmbedder`: `out_layer(silu(in_layer(x)))`.
#[derive(Clone, Debug)]
pub struct MlpEmbedder {
    /// `in_layer`.
    pub in_layer: Linear,
    /// `out_layer`.
    pub out_layer: Linear,
}

impl MlpEmbedder {
    fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let h = ctx.silu(&self.in_layer.forward(ctx, x)?)?;
        self.out_layer.forward(ctx, &h)
    }
}

/// A single block's input projection: BFL's fused `linear1` (q, k, v, MLP input) or
/// diffusers' `to_q`, `to_k`, `to_v`, `proj_mlp`.
#[derive(Clone, Debug)]
pub enum SingleIn {
    /// `linear1` `[3h + m, h]`.
    Fused(Linear),
    /// q, k, v and the MLP input apart.
    Split {
        /// `attn.to_q`, `attn.to_k`, `attn.to_v`.
        qkv: [Linear; 3],
        /// `proj_mlp`.
        mlp: Linear,
    },
}

/// `single_blocks.N`.
#[derive(Clone, Debug)]
pub struct SingleBlock {
    /// `linear1`: q, k, v and the MLP input.
    pub linear1: SingleIn,
    /// `linear2`: attention and MLP output to the width.
    pub linear2: Linear,
    /// `norm.query_norm.scale`.
    pub query_norm: GTensor,
    /// `norm.key_norm.scale`.
    pub key_norm: GTensor,
    /// `modulation.lin` (3 x width).
    pub modulation: Linear,
}

/// The FLUX.1 transformer.
#[derive(Clone, Debug)]
pub struct FluxModel {
    /// Configuration (sizes as read from the tensors).
    pub config: FluxConfig,
    /// `img_in`.
    pub img_in: Linear,
    /// `txt_in`.
    pub txt_in: Linear,
    /// `time_in`.
    pub time_in: MlpEmbedder,
    /// `vector_in`.
    pub vector_in: MlpEmbedder,
    /// `guidance_in` (dev).
    pub guidance_in: Option<MlpEmbedder>,
    /// `double_blocks`.
    pub double_blocks: Vec<DoubleBlock>,
    /// `single_blocks`.
    pub single_blocks: Vec<SingleBlock>,
    /// `final_layer.adaLN_modulation.1` (shift, scale).
    pub final_modulation: Linear,
    /// `final_layer.linear`.
    pub final_linear: Linear,
}

/// Width of the sinusoidal time and guidance embeddings.
const TIME_DIM: usize = 256;

/// The packed inputs of one FLUX forward pass.
pub struct FluxInputs<'a> {
    /// Packed latents `[in_channels, n_img, B]`.
    pub img: &'a GTensor,
    /// T5 states `[context_in_dim, n_txt, B]`, or their embedding ([`FluxModel::embed_text`]).
    pub txt: TextTokens<'a>,
    /// Sigmas in [0, 1] `[B]`.
    pub timesteps: &'a GTensor,
    /// Pooled CLIP vectors `[vec_in_dim, B]`.
    pub y: &'a GTensor,
    /// Distilled guidance scales `[B]` (dev; ignored by schnell).
    pub guidance: Option<&'a GTensor>,
    /// Position ids of the image tokens, `(axis0, row, column)` each.
    pub img_ids: &'a [[f32; 3]],
    /// Position ids of the text tokens.
    pub txt_ids: &'a [[f32; 3]],
}

impl FluxModel {
    /// Declares the parameters under `config.prefix` of `pb`, sizes read from the tensors
    /// ([`FluxConfig::with_shapes_of`]).
    pub fn new(pb: &ParamBuilder<'_>, config: FluxConfig) -> Result<Self> {
        let pb = &pb.pp(&config.prefix);
        // Sizes from the tensors; without a catalog (synthetic weights), the configuration's.
        let c = if pb.has_catalog() {
            config.with_shapes_of(pb)?
        } else {
            config
        };
        let (h, m) = (c.hidden_size, c.mlp_hidden());
        let d = c.head_dim();
        let n = |bfl: &str| c.layout.name(bfl);
        let lin = |stem: &str, i: usize, o: usize| -> Result<Linear> {
            Ok(Linear {
                weight: pb.tensor(&n(&format!("{stem}.weight")), &[o, i])?,
                bias: Some(pb.tensor(&n(&format!("{stem}.bias")), &[o])?),
            })
        };
        let split = c.layout == FluxLayout::Diffusers;
        let stream = |b: &str, s: &str| -> Result<StreamParams> {
            let a = format!("{b}.{s}_attn");
            Ok(StreamParams {
                modulation: lin(&format!("{b}.{s}_mod.lin"), h, 6 * h)?,
                qkv: if split {
                    QkvProj::Split([
                        lin(&format!("{a}.q"), h, h)?,
                        lin(&format!("{a}.k"), h, h)?,
                        lin(&format!("{a}.v"), h, h)?,
                    ])
                } else {
                    QkvProj::Fused(lin(&format!("{a}.qkv"), h, 3 * h)?)
                },
                query_norm: pb.tensor(&n(&format!("{a}.norm.query_norm.scale")), &[d])?,
                key_norm: pb.tensor(&n(&format!("{a}.norm.key_norm.scale")), &[d])?,
                proj: lin(&format!("{a}.proj"), h, h)?,
                mlp_in: lin(&format!("{b}.{s}_mlp.0"), h, m)?,
                mlp_out: lin(&format!("{b}.{s}_mlp.2"), m, h)?,
            })
        };
        let mut double_blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = format!("double_blocks.{i}");
            double_blocks.push(DoubleBlock {
                img: stream(&b, "img")?,
                txt: stream(&b, "txt")?,
            });
        }
        let mut single_blocks = Vec::with_capacity(c.depth_single_blocks);
        for i in 0..c.depth_single_blocks {
            let b = format!("single_blocks.{i}");
            single_blocks.push(SingleBlock {
                linear1: if split {
                    SingleIn::Split {
                        qkv: [
                            lin(&format!("{b}.q"), h, h)?,
                            lin(&format!("{b}.k"), h, h)?,
                            lin(&format!("{b}.v"), h, h)?,
                        ],
                        mlp: lin(&format!("{b}.mlp_in"), h, m)?,
                    }
                } else {
                    SingleIn::Fused(lin(&format!("{b}.linear1"), h, 3 * h + m)?)
                },
                linear2: lin(&format!("{b}.linear2"), h + m, h)?,
                query_norm: pb.tensor(&n(&format!("{b}.norm.query_norm.scale")), &[d])?,
                key_norm: pb.tensor(&n(&format!("{b}.norm.key_norm.scale")), &[d])?,
                modulation: lin(&format!("{b}.modulation.lin"), h, 3 * h)?,
            });
        }
        let embedder = |name: &str, i: usize| -> Result<MlpEmbedder> {
            Ok(MlpEmbedder {
                in_layer: lin(&format!("{name}.in_layer"), i, h)?,
                out_layer: lin(&format!("{name}.out_layer"), h, h)?,
            })
        };
        Ok(FluxModel {
            img_in: lin("img_in", c.in_channels, h)?,
            txt_in: lin("txt_in", c.context_in_dim, h)?,
            time_in: embedder("time_in", TIME_DIM)?,
            vector_in: embedder("vector_in", c.vec_in_dim)?,
            guidance_in: if c.guidance_embed {
                Some(embedder("guidance_in", TIME_DIM)?)
            } else {
                None
            },
            double_blocks,
            single_blocks,
            final_modulation: lin("final_layer.adaLN_modulation.1", h, 2 * h)?,
            final_linear: lin("final_layer.linear", h, c.in_channels)?,
            config: c,
        })
    }

    /// Graph nodes a forward pass needs (generous).
    pub fn graph_size(&self) -> usize {
        2048 + 256 * (self.double_blocks.len() + self.single_blocks.len())
    }

    /// The text stream's input, `txt_in(states)`: `[context_in_dim, n_txt, B]` in,
    /// `[hidden_size, n_txt, B]` out. It depends on the prompt alone, so a caller may compute
    /// it once per run and pass it as [`TextTokens::Embedded`].
    pub fn embed_text(&self, g: &mut GraphCtx, states: &GTensor) -> Result<GTensor> {
        let width = self.config.context_in_dim;
        if states.ne()[0] != width {
            return Err(ModelError::Input {
                name: "context",
                detail: format!("text width {} (the model's is {width})", states.ne()[0]),
            });
        }
        self.txt_in.forward(&g.ctx, states)
    }

    /// The forward pass on packed tokens; returns `[in_channels, n_img, B]`. Graph cuts:
    /// `flux.prelude` (img, txt, vec), `double_blocks.N` (img, txt) and `single_blocks.N`.
    pub fn forward_tokens(&self, g: &mut GraphCtx, inp: &FluxInputs<'_>) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let c = &self.config;
        let [_, n_img, b, _] = inp.img.ne();
        let n_txt = inp.txt.tensor().ne()[1];
        if inp.img_ids.len() != n_img || inp.txt_ids.len() != n_txt {
            return Err(ModelError::Input {
                name: "position ids",
                detail: format!(
                    "{} image and {} text ids for {n_img} image and {n_txt} text tokens",
                    inp.img_ids.len(),
                    inp.txt_ids.len()
                ),
            });
        }

        // 1. Prelude.
        let img = self.img_in.forward(&ctx, inp.img)?;
        let (txt, embedded) = match inp.txt {
            TextTokens::States(states) => (self.embed_text(g, states)?, false),
            TextTokens::Embedded(t) => (t.clone(), true),
        };
        let t = ctx.timestep_embedding(&ctx.scale(inp.timesteps, 1000.0)?, TIME_DIM, 10_000)?;
        let mut vec = self.time_in.forward(&ctx, &t)?;
        if let Some(gi) = &self.guidance_in {
            let gv = inp.guidance.ok_or(ModelError::Input {
                name: "guidance",
                detail: "FLUX.1-dev embeds a guidance scale; none given".into(),
            })?;
            let ge = ctx.timestep_embedding(&ctx.scale(gv, 1000.0)?, TIME_DIM, 10_000)?;
            vec = ctx.add(&vec, &gi.forward(&ctx, &ge)?)?;
        }
        vec = ctx.add(&vec, &self.vector_in.forward(&ctx, inp.y)?)?;
        let vec = ctx.reshape(&vec, &[c.hidden_size, 1, b])?;
        let (mut img, mut txt) = (img, txt);
        g.marks.mark(&img, "flux.prelude", "img")?;
        if !embedded {
            // (An embedded input is a leaf every segment reads, not a cut.)
            g.marks.mark(&txt, "flux.prelude", "txt")?;
        }
        g.marks.mark(&vec, "flux.prelude", "vec")?;

        // RoPE tables for [txt; img].
        let ids: Vec<[f32; 3]> = inp.txt_ids.iter().chain(inp.img_ids).copied().collect();
        let rope = Rope::new(g, "flux", &ids, c.axes_dim, c.theta, c.head_dim())?;

        // 2. Double-stream blocks.
        let silu_vec = ctx.silu(&vec)?;
        for (i, blk) in self.double_blocks.iter().enumerate() {
            let name = format!("double_blocks.{i}");
            (img, txt) = blk.forward(g, &name, &img, &txt, &silu_vec, &rope, c.num_heads)?;
        }

        // 3. Single-stream blocks on [txt; img].
        let (h, m) = (c.hidden_size, c.mlp_hidden());
        let mut x = ctx.concat(&txt, &img, 1)?;
        // Fine cuts: the modulation vector, and q, k, v and the MLP's hidden layer.
        for (i, blk) in self.single_blocks.iter().enumerate() {
            let name = format!("single_blocks.{i}");
            g.marks.set_scope(&name);
            let smod = blk.modulation.forward(&ctx, &silu_vec)?;
            g.marks
                .mark_fine_output(&smod, LEVEL_SUBLAYER, "mod", "m")?;
            let md = chunks(&ctx, &smod, 3)?;
            let xm = modulate(&ctx, &x, &md[0], &md[1])?;
            let (q, k, v, mlp) = match &blk.linear1 {
                SingleIn::Fused(l) => {
                    // q and k stay views: `Rope::lay_out` copies them.
                    let l1 = l.forward(&ctx, &xm)?; // [3h + m, n, B]
                    (
                        row_view(&ctx, &l1, 0, h)?,
                        row_view(&ctx, &l1, h, h)?,
                        rows(&ctx, &l1, 2 * h, h)?,
                        // Read in place by the GELU (a copy first where its kernel is
                        // ggml's).
                        row_view(&ctx, &l1, 3 * h, m)?,
                    )
                }
                SingleIn::Split {
                    qkv: [lq, lk, lv],
                    mlp,
                } => (
                    lq.forward(&ctx, &xm)?,
                    lk.forward(&ctx, &xm)?,
                    lv.forward(&ctx, &xm)?,
                    mlp.forward(&ctx, &xm)?,
                ),
            };
            let rotate = |t: &GTensor, scale: &GTensor| -> Result<GTensor> {
                let normed = rope.normed(&ctx, t, scale, c.num_heads)?;
                rope.apply(&ctx, &normed, c.num_heads)
            };
            let q = rotate(&q, &blk.query_norm)?;
            let k = rotate(&k, &blk.key_norm)?;
            let mlp = gelu(g, &mlp)?;
            for (t, o) in [(&q, "q"), (&k, "k"), (&v, "v"), (&mlp, "mlp")] {
                g.marks.mark_fine_output(t, LEVEL_SUBLAYER, "linear1", o)?;
            }
            let a = attention(g, &q, &k, &v, c.num_heads, None)?;
            let cat = ctx.concat(&a, &mlp, 0)?;
            let out = blk.linear2.forward(&ctx, &cat)?;
            g.marks.set_scope("");
            x = ctx.add(&x, &ctx.mul(&out, &md[2])?)?;
            g.marks.mark(&x, &name, "x")?;
        }
        let (_, img) = split_tokens(&ctx, &x, n_txt)?;

        // 4. Final layer.
        let fm = chunks(&ctx, &self.final_modulation.forward(&ctx, &silu_vec)?, 2)?;
        // BFL stores (shift, scale), diffusers' `norm_out` (scale, shift).
        let (shift, scale) = match c.layout {
            FluxLayout::Bfl => (&fm[0], &fm[1]),
            FluxLayout::Diffusers => (&fm[1], &fm[0]),
        };
        let y = modulate(&ctx, &img, shift, scale)?;
        self.final_linear.forward(&ctx, &y)
    }

    /// The forward pass on latents `[W, H, C, B]` (W and H even): packed into 2x2 patches
    /// (`(c, row, column)` within a token, tokens row-major, as diffusers' `_pack_latents`),
    /// position ids `(0, row, column)` for the image and zeros for the text, unpacked after.
    pub fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        timesteps: &GTensor,
        text: TextTokens<'_>,
        y: &GTensor,
        guidance: Option<&GTensor>,
    ) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let (img, (h2, w2)) = crate::dit::pack_2x2(&ctx, x, self.config.in_channels / 4, "FLUX")?;
        let img_ids: Vec<[f32; 3]> = (0..h2)
            .flat_map(|r| (0..w2).map(move |col| [0.0, r as f32, col as f32]))
            .collect();
        let txt_ids = vec![[0.0; 3]; text.tensor().ne()[1]];
        let out = self.forward_tokens(
            g,
            &FluxInputs {
                img: &img,
                txt: text,
                timesteps,
                y,
                guidance,
                img_ids: &img_ids,
                txt_ids: &txt_ids,
            },
        )?;
        crate::dit::unpack_2x2(&ctx, &out, (h2, w2))
    }
}
