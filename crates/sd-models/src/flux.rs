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
//! Sizes come from the tensors: width from `img_in`, head width from the QK-norm scale,
//! block counts from the names, dev vs schnell from `guidance_in`. The RoPE axes are not in
//! the weights: FLUX.1's (d/8, 7d/16, 7d/16) of the head width d ((16, 56, 56) at 128).

use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::nn::{attention, gelu_tanh_exact, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, HostData, ModelError, Result};

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
        let shape = |name: &str| -> Result<Vec<usize>> {
            pb.file_shape(name)
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
        let count = |p: &str| {
            (0..)
                .take_while(|i| pb.contains(&format!("{p}.{i}.{}", first_tensor(p))))
                .count()
        };
        self.in_channels = img_in[1];
        self.context_in_dim = txt_in[1];
        self.vec_in_dim = vec_in[1];
        self.hidden_size = hidden;
        self.num_heads = hidden / d;
        self.mlp_ratio = mlp[0] as f32 / hidden as f32;
        self.depth = count("double_blocks");
        self.depth_single_blocks = count("single_blocks");
        self.axes_dim = [d / 8, 7 * d / 16, 7 * d / 16];
        self.guidance_embed = pb.contains("guidance_in.in_layer.weight");
        Ok(self)
    }
}

/// A tensor every block of a kind has (to count the blocks).
fn first_tensor(kind: &str) -> &'static str {
    if kind == "double_blocks" {
        "img_mod.lin.weight"
    } else {
        "linear1.weight"
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
    fn new(pb: &ParamBuilder<'_>, in_dim: usize, hidden: usize) -> Result<Self> {
        Ok(MlpEmbedder {
            in_layer: Linear::new(&pb.pp("in_layer"), in_dim, hidden, true)?,
            out_layer: Linear::new(&pb.pp("out_layer"), hidden, hidden, true)?,
        })
    }

    fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let h = ctx.silu(&self.in_layer.forward(ctx, x)?)?;
        self.out_layer.forward(ctx, &h)
    }
}

/// One stream of a double block (`img_*` or `txt_*`).
#[derive(Clone, Debug)]
pub struct StreamParams {
    /// `*_mod.lin` (6 x width).
    pub modulation: Linear,
    /// `*_attn.qkv`.
    pub qkv: Linear,
    /// `*_attn.norm.query_norm.scale`.
    pub query_norm: GTensor,
    /// `*_attn.norm.key_norm.scale`.
    pub key_norm: GTensor,
    /// `*_attn.proj`.
    pub proj: Linear,
    /// `*_mlp.0`.
    pub mlp_in: Linear,
    /// `*_mlp.2`.
    pub mlp_out: Linear,
}

/// `double_blocks.N`.
#[derive(Clone, Debug)]
pub struct DoubleBlock {
    /// The image stream.
    pub img: StreamParams,
    /// The text stream.
    pub txt: StreamParams,
}

/// `single_blocks.N`.
#[derive(Clone, Debug)]
pub struct SingleBlock {
    /// `linear1`: q, k, v and the MLP input.
    pub linear1: Linear,
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

/// LayerNorm without affine parameters, eps 1e-6 (BFL's `norm1`, `norm2`, `pre_norm`,
/// `norm_final`).
const LN_EPS: f32 = 1e-6;
/// RMSNorm eps of the QK norms.
const RMS_EPS: f32 = 1e-6;
/// Width of the sinusoidal time and guidance embeddings.
const TIME_DIM: usize = 256;

/// The packed inputs of one FLUX forward pass.
pub struct FluxInputs<'a> {
    /// Packed latents `[in_channels, n_img, B]`.
    pub img: &'a GTensor,
    /// T5 states `[context_in_dim, n_txt, B]`.
    pub txt: &'a GTensor,
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
        let c = config.with_shapes_of(pb)?;
        let (h, m) = (c.hidden_size, c.mlp_hidden());
        let d = c.head_dim();
        let stream = |b: &ParamBuilder<'_>, s: &str| -> Result<StreamParams> {
            Ok(StreamParams {
                modulation: Linear::new(&b.pp(format!("{s}_mod.lin")), h, 6 * h, true)?,
                qkv: Linear::new(&b.pp(format!("{s}_attn.qkv")), h, 3 * h, true)?,
                query_norm: b.tensor(&format!("{s}_attn.norm.query_norm.scale"), &[d])?,
                key_norm: b.tensor(&format!("{s}_attn.norm.key_norm.scale"), &[d])?,
                proj: Linear::new(&b.pp(format!("{s}_attn.proj")), h, h, true)?,
                mlp_in: Linear::new(&b.pp(format!("{s}_mlp.0")), h, m, true)?,
                mlp_out: Linear::new(&b.pp(format!("{s}_mlp.2")), m, h, true)?,
            })
        };
        let mut double_blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = pb.pp(format!("double_blocks.{i}"));
            double_blocks.push(DoubleBlock {
                img: stream(&b, "img")?,
                txt: stream(&b, "txt")?,
            });
        }
        let mut single_blocks = Vec::with_capacity(c.depth_single_blocks);
        for i in 0..c.depth_single_blocks {
            let b = pb.pp(format!("single_blocks.{i}"));
            single_blocks.push(SingleBlock {
                linear1: Linear::new(&b.pp("linear1"), h, 3 * h + m, true)?,
                linear2: Linear::new(&b.pp("linear2"), h + m, h, true)?,
                query_norm: b.tensor("norm.query_norm.scale", &[d])?,
                key_norm: b.tensor("norm.key_norm.scale", &[d])?,
                modulation: Linear::new(&b.pp("modulation.lin"), h, 3 * h, true)?,
            });
        }
        Ok(FluxModel {
            img_in: Linear::new(&pb.pp("img_in"), c.in_channels, h, true)?,
            txt_in: Linear::new(&pb.pp("txt_in"), c.context_in_dim, h, true)?,
            time_in: MlpEmbedder::new(&pb.pp("time_in"), TIME_DIM, h)?,
            vector_in: MlpEmbedder::new(&pb.pp("vector_in"), c.vec_in_dim, h)?,
            guidance_in: if c.guidance_embed {
                Some(MlpEmbedder::new(&pb.pp("guidance_in"), TIME_DIM, h)?)
            } else {
                None
            },
            double_blocks,
            single_blocks,
            final_modulation: Linear::new(
                &pb.pp("final_layer.adaLN_modulation.1"),
                h,
                2 * h,
                true,
            )?,
            final_linear: Linear::new(&pb.pp("final_layer.linear"), h, c.in_channels, true)?,
            config: c,
        })
    }

    /// Graph nodes a forward pass needs (generous).
    pub fn graph_size(&self) -> usize {
        2048 + 160 * (self.double_blocks.len() + self.single_blocks.len())
    }

    /// The forward pass on packed tokens; returns `[in_channels, n_img, B]`. Graph cuts:
    /// `flux.prelude` (img, txt, vec), `double_blocks.N` (img, txt) and `single_blocks.N`.
    pub fn forward_tokens(&self, g: &mut GraphCtx, inp: &FluxInputs<'_>) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let c = &self.config;
        let [_, n_img, b, _] = inp.img.ne();
        let n_txt = inp.txt.ne()[1];
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
        let txt = self.txt_in.forward(&ctx, inp.txt)?;
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
        g.marks.mark(&txt, "flux.prelude", "txt")?;
        g.marks.mark(&vec, "flux.prelude", "vec")?;

        // RoPE tables for [txt; img], [1, d/2, 1, n] each.
        let ids: Vec<[f32; 3]> = inp.txt_ids.iter().chain(inp.img_ids).copied().collect();
        let (cos, sin) = rope_tables(&ids, c.axes_dim, c.theta);
        let half = c.head_dim() / 2;
        let n = ids.len();
        let cos = g.aux_input(
            "flux.rope_cos",
            DType::F32,
            &[1, half, 1, n],
            HostData::F32(cos),
        )?;
        let sin = g.aux_input(
            "flux.rope_sin",
            DType::F32,
            &[1, half, 1, n],
            HostData::F32(sin),
        )?;
        let rope = Rope { cos, sin };

        // 2. Double-stream blocks.
        let silu_vec = ctx.silu(&vec)?;
        for (i, blk) in self.double_blocks.iter().enumerate() {
            let im = chunks(&ctx, &blk.img.modulation.forward(&ctx, &silu_vec)?, 6)?;
            let tm = chunks(&ctx, &blk.txt.modulation.forward(&ctx, &silu_vec)?, 6)?;
            let img_n = modulate(&ctx, &img, &im[0], &im[1])?;
            let txt_n = modulate(&ctx, &txt, &tm[0], &tm[1])?;
            let (iq, ik, iv) = self.qkv(&ctx, &blk.img, &img_n)?;
            let (tq, tk, tv) = self.qkv(&ctx, &blk.txt, &txt_n)?;
            let q = rope.apply(&ctx, &ctx.concat(&tq, &iq, 1)?, c.num_heads)?;
            let k = rope.apply(&ctx, &ctx.concat(&tk, &ik, 1)?, c.num_heads)?;
            let v = ctx.concat(&tv, &iv, 1)?;
            let a = attention(g, &q, &k, &v, c.num_heads, None)?;
            let (ta, ia) = split_tokens(&ctx, &a, n_txt)?;
            img = self.stream_out(g, &blk.img, &img, &ia, &im)?;
            txt = self.stream_out(g, &blk.txt, &txt, &ta, &tm)?;
            g.marks.mark(&img, &format!("double_blocks.{i}"), "img")?;
            g.marks.mark(&txt, &format!("double_blocks.{i}"), "txt")?;
        }

        // 3. Single-stream blocks on [txt; img].
        let (h, m) = (c.hidden_size, c.mlp_hidden());
        let mut x = ctx.concat(&txt, &img, 1)?;
        for (i, blk) in self.single_blocks.iter().enumerate() {
            let md = chunks(&ctx, &blk.modulation.forward(&ctx, &silu_vec)?, 3)?;
            let xm = modulate(&ctx, &x, &md[0], &md[1])?;
            let l1 = blk.linear1.forward(&ctx, &xm)?; // [3h + m, n, B]
            let q = rows(&ctx, &l1, 0, h)?;
            let k = rows(&ctx, &l1, h, h)?;
            let v = rows(&ctx, &l1, 2 * h, h)?;
            let mlp = rows(&ctx, &l1, 3 * h, m)?;
            let q = rope.apply(
                &ctx,
                &qk_norm(&ctx, &q, &blk.query_norm, c.num_heads)?,
                c.num_heads,
            )?;
            let k = rope.apply(
                &ctx,
                &qk_norm(&ctx, &k, &blk.key_norm, c.num_heads)?,
                c.num_heads,
            )?;
            let a = attention(g, &q, &k, &v, c.num_heads, None)?;
            let cat = ctx.concat(&a, &gelu(g, &mlp)?, 0)?;
            let out = blk.linear2.forward(&ctx, &cat)?;
            x = ctx.add(&x, &ctx.mul(&out, &md[2])?)?;
            g.marks.mark(&x, &format!("single_blocks.{i}"), "x")?;
        }
        let (_, img) = split_tokens(&ctx, &x, n_txt)?;

        // 4. Final layer.
        let fm = chunks(&ctx, &self.final_modulation.forward(&ctx, &silu_vec)?, 2)?;
        let y = modulate(&ctx, &img, &fm[0], &fm[1])?;
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
        context: &GTensor,
        y: &GTensor,
        guidance: Option<&GTensor>,
    ) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let [w, h, c, b] = x.ne();
        if w % 2 != 0 || h % 2 != 0 || c * 4 != self.config.in_channels {
            return Err(ModelError::Input {
                name: "x",
                detail: format!(
                    "latents {:?}: FLUX packs even-sized latents of {} channels",
                    x.ne(),
                    self.config.in_channels / 4
                ),
            });
        }
        let (w2, h2) = (w / 2, h / 2);
        let packed = crate::nn::pixel_unshuffle(&ctx, x, 2)?; // [w2, h2, 4c, B]
        let packed = ctx.cont(&ctx.permute(&packed, [1, 2, 0, 3])?)?; // [4c, w2, h2, B]
        let img = ctx.reshape(&packed, &[4 * c, w2 * h2, b])?;
        let img_ids: Vec<[f32; 3]> = (0..h2)
            .flat_map(|r| (0..w2).map(move |col| [0.0, r as f32, col as f32]))
            .collect();
        let txt_ids = vec![[0.0; 3]; context.ne()[1]];
        let out = self.forward_tokens(
            g,
            &FluxInputs {
                img: &img,
                txt: context,
                timesteps,
                y,
                guidance,
                img_ids: &img_ids,
                txt_ids: &txt_ids,
            },
        )?;
        let out = ctx.reshape(&out, &[4 * c, w2, h2, b])?;
        let out = ctx.cont(&ctx.permute(&out, [2, 0, 1, 3])?)?; // [w2, h2, 4c, B]
        crate::nn::pixel_shuffle(&ctx, &out, 2)
    }

    /// q, k (RMS-normed per head) and v of one stream.
    fn qkv(
        &self,
        ctx: &Context,
        s: &StreamParams,
        x: &GTensor,
    ) -> Result<(GTensor, GTensor, GTensor)> {
        let h = self.config.hidden_size;
        let heads = self.config.num_heads;
        let qkv = s.qkv.forward(ctx, x)?;
        let q = qk_norm(ctx, &rows(ctx, &qkv, 0, h)?, &s.query_norm, heads)?;
        let k = qk_norm(ctx, &rows(ctx, &qkv, h, h)?, &s.key_norm, heads)?;
        Ok((q, k, rows(ctx, &qkv, 2 * h, h)?))
    }

    /// The residual updates of one stream after attention: projection and MLP, each gated.
    fn stream_out(
        &self,
        g: &GraphCtx,
        s: &StreamParams,
        x: &GTensor,
        attn: &GTensor,
        m: &[GTensor],
    ) -> Result<GTensor> {
        let ctx = &g.ctx;
        let x = ctx.add(x, &ctx.mul(&s.proj.forward(ctx, attn)?, &m[2])?)?;
        let h = modulate(ctx, &x, &m[3], &m[4])?;
        let h = s
            .mlp_out
            .forward(ctx, &gelu(g, &s.mlp_in.forward(ctx, &h)?)?)?;
        Ok(ctx.add(&x, &ctx.mul(&h, &m[5])?)?)
    }
}

/// GELU, tanh form: f32 formula with `opts.exact`, ggml's kernel otherwise.
fn gelu(g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
    if g.opts.exact {
        gelu_tanh_exact(&g.ctx, x)
    } else {
        Ok(g.ctx.gelu(x)?)
    }
}

/// `count` equal chunks of `[count * h, 1, B]` along the first axis, each `[h, 1, B]`.
fn chunks(ctx: &Context, x: &GTensor, count: usize) -> Result<Vec<GTensor>> {
    let h = x.ne()[0] / count;
    (0..count).map(|i| rows(ctx, x, i * h, h)).collect()
}

/// Rows `start..start + len` of the first axis of `[n0, n1, n2]`, contiguous.
fn rows(ctx: &Context, x: &GTensor, start: usize, len: usize) -> Result<GTensor> {
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
fn split_tokens(ctx: &Context, x: &GTensor, n_txt: usize) -> Result<(GTensor, GTensor)> {
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
fn modulate(ctx: &Context, x: &GTensor, shift: &GTensor, scale: &GTensor) -> Result<GTensor> {
    let n = ctx.norm(x, LN_EPS)?;
    let scaled = ctx.add(&n, &ctx.mul(&n, scale)?)?;
    Ok(ctx.add(&scaled, shift)?)
}

/// RMS norm over each head's width with a learned scale: `[heads * d, n, B]` in and out.
fn qk_norm(ctx: &Context, x: &GTensor, scale: &GTensor, heads: usize) -> Result<GTensor> {
    let [w, n, b, _] = x.ne();
    let d = w / heads;
    let x = ctx.reshape(x, &[d, heads, n, b])?;
    let x = ctx.mul(&ctx.rms_norm(&x, RMS_EPS)?, scale)?;
    Ok(ctx.reshape(&x, &[w, n, b])?)
}

/// The cos and sin tables of [`Rope::apply`] for the tokens' position ids, `[n][d/2]` each
/// (token-major): axis `a`'s `d_a / 2` frequencies `theta^(-2j / d_a)` times the id.
pub fn rope_tables(ids: &[[f32; 3]], axes: [usize; 3], theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half: usize = axes.iter().sum::<usize>() / 2;
    let mut cos = Vec::with_capacity(ids.len() * half);
    let mut sin = Vec::with_capacity(ids.len() * half);
    for id in ids {
        for (a, &da) in axes.iter().enumerate() {
            for j in 0..da / 2 {
                let omega = 1.0 / (theta as f64).powf(2.0 * j as f64 / da as f64);
                let angle = id[a] as f64 * omega;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
    }
    (cos, sin)
}

/// Rotary position embedding of adjacent pairs: `(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1
/// cos)` per head, with host-made tables `[1, d/2, 1, n]`.
struct Rope {
    cos: GTensor,
    sin: GTensor,
}

impl Rope {
    /// Rotates `[heads * d, n, B]`.
    fn apply(&self, ctx: &Context, x: &GTensor, heads: usize) -> Result<GTensor> {
        let [w, n, b, _] = x.ne();
        let half = w / heads / 2;
        let x = ctx.reshape(&ctx.cont(x)?, &[2, half, heads, n * b])?;
        let nb = x.nb();
        let part = |i: usize| -> Result<GTensor> {
            let v = ctx.view(
                &x,
                [1, half, heads, n * b],
                [nb[1], nb[2], nb[3]],
                i * nb[0],
            )?;
            Ok(ctx.cont(&v)?)
        };
        let (x0, x1) = (part(0)?, part(1)?);
        let o0 = ctx.sub(&ctx.mul(&x0, &self.cos)?, &ctx.mul(&x1, &self.sin)?)?;
        let o1 = ctx.add(&ctx.mul(&x0, &self.sin)?, &ctx.mul(&x1, &self.cos)?)?;
        let o = ctx.concat(&o0, &o1, 0)?;
        Ok(ctx.reshape(&o, &[w, n, b])?)
    }
}
