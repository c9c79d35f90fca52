//! The LDM UNet (`openaimodel.UNetModel`) of SD1.x, SD2.x, SDXL and the SDXL refiner.
//!
//! Parameters live under `model.diffusion_model.` in the original layout: `time_embed.{0,2}`,
//! `input_blocks.N.M` (`N` = 0 is `conv_in`; a `ResBlock` at `M` = 0, its
//! `SpatialTransformer` at `M` = 1, or a `Downsample` as `input_blocks.N.0.op`),
//! `middle_block.{0,1,2}`, `output_blocks.N.M` (`ResBlock`, optional `SpatialTransformer`,
//! optional `Upsample` as `.conv`), `out.{0,2}`. Inside a `SpatialTransformer`: `norm`,
//! `proj_in`, `transformer_blocks.K.{norm1,attn1,norm2,attn2,norm3,ff}`, `proj_out`.
//!
//! SDXL adds a per-level transformer depth (`[0, 2, 10]`: none at the first level) and
//! `label_emb.0.{0,2}` (`adm_in_channels` to the time-embedding width, SiLU between),
//! whose output is added to the time embedding: it embeds the vector `y` (pooled text
//! and sinusoidal embeddings of the size conditioning, see [`crate::nn::sinusoidal_embedding`]).
//! [`UnetConfig::from_catalog`] reads every width and depth from the tensors.
//!
//! The forward pass marks a graph cut ([`sd_graphcut::CutMarks`]) at the output of every
//! input block (`input_blocks.N|h`), of the middle block (`middle_block|h`) and of every
//! output block (`output_blocks.N|h`); skip connections cross cuts.

use sd_formats::names::UNET_PREFIX;
use sd_graphcut::{LEVEL_LAYER, LEVEL_SUBLAYER};
use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::nn::{attention, Conv2d, GroupNorm, LayerNorm, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

mod infer;

/// How attention heads are sized (serialized as `{"Heads": n}` / `{"HeadDim": d}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum HeadSpec {
    /// A fixed number of heads at every width (LDM `num_heads`; SD1: 8).
    Heads(usize),
    /// A fixed head width (LDM `num_head_channels`; SD2: 64).
    HeadDim(usize),
}

impl HeadSpec {
    /// `(heads, head_dim)` at `channels`.
    pub fn split(self, channels: usize) -> Result<(usize, usize)> {
        let (h, d) = match self {
            HeadSpec::Heads(h) if h > 0 => (h, channels / h),
            HeadSpec::HeadDim(d) if d > 0 => (channels / d, d),
            _ => (0, 0),
        };
        if h == 0 || d == 0 || h * d != channels {
            return Err(ModelError::Config(format!(
                "{self:?} does not divide {channels} channels"
            )));
        }
        Ok((h, d))
    }
}

/// Configuration of the UNet (the `unet_config` params of LDM's inference YAMLs).
///
/// Deserializes from the LDM key names; missing keys keep [`UnetConfig::sd1`]'s values.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default = "UnetConfig::sd1", deny_unknown_fields)]
pub struct UnetConfig {
    /// Latent channels in (`in_channels`).
    pub in_channels: usize,
    /// Latent channels out (`out_channels`).
    pub out_channels: usize,
    /// Base width (`model_channels`).
    pub model_channels: usize,
    /// Width multipliers per level (`channel_mult`).
    pub channel_mult: Vec<usize>,
    /// Residual blocks per level (`num_res_blocks`).
    pub num_res_blocks: usize,
    /// Downsampling factors with attention (`attention_resolutions`; level `l` has factor
    /// `2^l`).
    pub attention_resolutions: Vec<usize>,
    /// Attention head sizing (`num_heads` / `num_head_channels`).
    pub heads: HeadSpec,
    /// Transformer blocks per `SpatialTransformer` (`transformer_depth`): one number for
    /// every level (LDM's integer form, SD1/SD2/the refiner; a JSON number deserializes
    /// to it) or one entry per level (SDXL's `[0, 2, 10]`; 0: no attention at that level
    /// even if `attention_resolutions` names it).
    #[serde(deserialize_with = "one_or_many")]
    pub transformer_depth: Vec<usize>,
    /// Transformer blocks of the middle block's `SpatialTransformer`
    /// (`transformer_depth_middle`; `None`: the last entry of `transformer_depth`, LDM's
    /// default).
    pub transformer_depth_middle: Option<usize>,
    /// Width of the `y` vector embedded by `label_emb` (`adm_in_channels`; SDXL 2816, the
    /// refiner 2560); `None`: no `label_emb`.
    pub adm_in_channels: Option<usize>,
    /// Width of the cross-attention context (`context_dim`).
    pub context_dim: usize,
    /// Linear instead of 1x1-conv `proj_in`/`proj_out` (`use_linear_in_transformer`).
    pub use_linear_in_transformer: bool,
    /// Group count of every GroupNorm (32 in LDM).
    pub norm_groups: usize,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl UnetConfig {
    /// SD1.x (`configs/stable-diffusion/v1-inference.yaml`: `model_channels: 320,
    /// attention_resolutions: [4, 2, 1], num_res_blocks: 2, channel_mult: [1, 2, 4, 4],
    /// num_heads: 8, transformer_depth: 1, context_dim: 768`).
    pub fn sd1() -> Self {
        UnetConfig {
            in_channels: 4,
            out_channels: 4,
            model_channels: 320,
            channel_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attention_resolutions: vec![4, 2, 1],
            heads: HeadSpec::Heads(8),
            transformer_depth: vec![1],
            transformer_depth_middle: None,
            adm_in_channels: None,
            context_dim: 768,
            use_linear_in_transformer: false,
            norm_groups: 32,
            prefix: UNET_PREFIX.trim_end_matches('.').to_string(),
        }
    }

    /// SD2.x (`configs/stable-diffusion/v2-inference.yaml`: as SD1 but
    /// `num_head_channels: 64, context_dim: 1024, use_linear_in_transformer: True`).
    pub fn sd2() -> Self {
        UnetConfig {
            heads: HeadSpec::HeadDim(64),
            context_dim: 1024,
            use_linear_in_transformer: true,
            ..Self::sd1()
        }
    }

    /// SDXL base (`sgm` `configs/inference/sd_xl_base.yaml`: `model_channels: 320,
    /// channel_mult: [1, 2, 4], attention_resolutions: [4, 2], num_res_blocks: 2,
    /// num_head_channels: 64, transformer_depth: [1, 2, 10]` (level 0 has no attention, so
    /// its depth is 0 here), `context_dim: 2048, adm_in_channels: 2816,
    /// use_linear_in_transformer: True`).
    pub fn sdxl() -> Self {
        UnetConfig {
            channel_mult: vec![1, 2, 4],
            attention_resolutions: vec![4, 2],
            heads: HeadSpec::HeadDim(64),
            transformer_depth: vec![0, 2, 10],
            transformer_depth_middle: None,
            adm_in_channels: Some(2816),
            context_dim: 2048,
            use_linear_in_transformer: true,
            ..Self::sd1()
        }
    }

    /// SDXL refiner (`sgm` `configs/inference/sd_xl_refiner.yaml`: `model_channels: 384,
    /// channel_mult: [1, 2, 4, 4], attention_resolutions: [4, 2], num_head_channels: 64,
    /// transformer_depth: 4, context_dim: 1280, adm_in_channels: 2560`).
    pub fn sdxl_refiner() -> Self {
        UnetConfig {
            model_channels: 384,
            channel_mult: vec![1, 2, 4, 4],
            transformer_depth: vec![4],
            transformer_depth_middle: None,
            adm_in_channels: Some(2560),
            context_dim: 1280,
            ..Self::sdxl()
        }
    }

    /// Transformer blocks of level `level`'s `SpatialTransformer`s (0: none).
    pub fn depth_at(&self, level: usize) -> usize {
        match self.transformer_depth[..] {
            [d] => d,
            ref per_level => per_level.get(level).copied().unwrap_or(0),
        }
    }

    /// Transformer blocks of the middle block.
    pub fn middle_depth(&self) -> usize {
        self.transformer_depth_middle
            .unwrap_or_else(|| self.transformer_depth.last().copied().unwrap_or(0))
    }

    /// Whether level `level` (downsampling factor `ds`) has `SpatialTransformer`s.
    fn has_attention(&self, level: usize, ds: usize) -> bool {
        self.attention_resolutions.contains(&ds) && self.depth_at(level) > 0
    }

    /// Width of the time embedding (`4 * model_channels`).
    pub fn time_embed_dim(&self) -> usize {
        4 * self.model_channels
    }

    fn validate(&self) -> Result<()> {
        if self.channel_mult.is_empty()
            || self.model_channels == 0
            || self.num_res_blocks == 0
            || !(self.transformer_depth.len() == 1
                || self.transformer_depth.len() == self.channel_mult.len())
            || self.middle_depth() == 0
            || self.adm_in_channels == Some(0)
            || self.norm_groups == 0
        {
            return Err(ModelError::Config(format!("UNet config {self:?}")));
        }
        Ok(())
    }
}

/// `transformer_depth` as LDM writes it: a number (every level) or a list (per level).
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<usize>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(usize),
        Many(Vec<usize>),
    }
    Ok(match serde::Deserialize::deserialize(d)? {
        OneOrMany::One(n) => vec![n],
        OneOrMany::Many(v) => v,
    })
}

/// GroupNorm epsilon of ResBlocks and the output (`GroupNorm32` default).
const RES_EPS: f32 = 1e-5;
/// GroupNorm epsilon of `SpatialTransformer.norm` (`Normalize`).
const ST_EPS: f32 = 1e-6;
/// LayerNorm epsilon inside transformer blocks.
const LN_EPS: f32 = 1e-5;

/// `ResBlock` with a time-embedding projection.
#[derive(Clone, Debug)]
pub struct ResBlock {
    /// `in_layers.0`.
    pub in_norm: GroupNorm,
    /// `in_layers.2`.
    pub in_conv: Conv2d,
    /// `emb_layers.1`.
    pub emb_proj: Linear,
    /// `out_layers.0`.
    pub out_norm: GroupNorm,
    /// `out_layers.3`.
    pub out_conv: Conv2d,
    /// `skip_connection` (1x1, when the width changes).
    pub skip_connection: Option<Conv2d>,
}

impl ResBlock {
    fn new(pb: &ParamBuilder<'_>, cin: usize, cout: usize, cfg: &UnetConfig) -> Result<Self> {
        Ok(ResBlock {
            in_norm: GroupNorm::new(&pb.pp("in_layers.0"), cin, cfg.norm_groups, RES_EPS)?,
            in_conv: Conv2d::new(&pb.pp("in_layers.2"), cin, cout, 3, 1, 1)?,
            emb_proj: Linear::new(&pb.pp("emb_layers.1"), cfg.time_embed_dim(), cout, true)?,
            out_norm: GroupNorm::new(&pb.pp("out_layers.0"), cout, cfg.norm_groups, RES_EPS)?,
            out_conv: Conv2d::new(&pb.pp("out_layers.3"), cout, cout, 3, 1, 1)?,
            skip_connection: if cin != cout {
                Some(Conv2d::new(&pb.pp("skip_connection"), cin, cout, 1, 1, 0)?)
            } else {
                None
            },
        })
    }

    /// `x` `[W, H, Cin, B]`, `emb` `[time_embed_dim, B]`.
    fn forward(&self, g: &mut GraphCtx, x: &GTensor, emb: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let h = self.in_norm.forward_silu(ctx, x)?;
        let h = self.in_conv.forward(g, &h)?;
        let e = self.emb_proj.forward(ctx, &ctx.silu(emb)?)?; // [Cout, B]
        let h = ctx.channel_affine(&h, None, Some(&e))?;
        g.marks.mark_fine(&h, LEVEL_SUBLAYER, "in_layers")?;
        let h = self.out_norm.forward_silu(ctx, &h)?;
        let h = self.out_conv.forward(g, &h)?;
        let skip = match &self.skip_connection {
            Some(c) => c.forward(g, x)?,
            None => x.clone(),
        };
        Ok(ctx.add(&skip, &h)?)
    }
}

/// `CrossAttention` (`attn1`: self, `attn2`: over the context).
#[derive(Clone, Debug)]
pub struct CrossAttention {
    /// `to_q` (no bias).
    pub to_q: Linear,
    /// `to_k` (no bias).
    pub to_k: Linear,
    /// `to_v` (no bias).
    pub to_v: Linear,
    /// `to_out.0`.
    pub to_out: Linear,
    heads: usize,
}

impl CrossAttention {
    fn new(
        pb: &ParamBuilder<'_>,
        dim: usize,
        kv_dim: usize,
        heads: usize,
        inner: usize,
    ) -> Result<Self> {
        Ok(CrossAttention {
            to_q: Linear::new(&pb.pp("to_q"), dim, inner, false)?,
            to_k: Linear::new(&pb.pp("to_k"), kv_dim, inner, false)?,
            to_v: Linear::new(&pb.pp("to_v"), kv_dim, inner, false)?,
            to_out: Linear::new(&pb.pp("to_out.0"), inner, dim, true)?,
            heads,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor, kv: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let q = self.to_q.forward(ctx, x)?;
        let k = self.to_k.forward(ctx, kv)?;
        let v = self.to_v.forward(ctx, kv)?;
        let o = attention(g, &q, &k, &v, self.heads, None)?;
        self.to_out.forward(ctx, &o)
    }
}

/// `BasicTransformerBlock`: self-attention, cross-attention, GEGLU feed-forward.
#[derive(Clone, Debug)]
pub struct BasicTransformerBlock {
    /// `norm1`.
    pub norm1: LayerNorm,
    /// `attn1`.
    pub attn1: CrossAttention,
    /// `norm2`.
    pub norm2: LayerNorm,
    /// `attn2`.
    pub attn2: CrossAttention,
    /// `norm3`.
    pub norm3: LayerNorm,
    /// `ff.net.0.proj` (to twice the inner width: value and gate).
    pub ff_proj: Linear,
    /// `ff.net.2`.
    pub ff_out: Linear,
}

impl BasicTransformerBlock {
    fn new(pb: &ParamBuilder<'_>, dim: usize, heads: usize, cfg: &UnetConfig) -> Result<Self> {
        let ff_inner = 4 * dim;
        Ok(BasicTransformerBlock {
            norm1: LayerNorm::new(&pb.pp("norm1"), dim, LN_EPS)?,
            attn1: CrossAttention::new(&pb.pp("attn1"), dim, dim, heads, dim)?,
            norm2: LayerNorm::new(&pb.pp("norm2"), dim, LN_EPS)?,
            attn2: CrossAttention::new(&pb.pp("attn2"), dim, cfg.context_dim, heads, dim)?,
            norm3: LayerNorm::new(&pb.pp("norm3"), dim, LN_EPS)?,
            ff_proj: Linear::new(&pb.pp("ff.net.0.proj"), dim, 2 * ff_inner, true)?,
            ff_out: Linear::new(&pb.pp("ff.net.2"), ff_inner, dim, true)?,
        })
    }

    /// `x` `[dim, n, B]`, `context` `[context_dim, n_ctx, B]`; `label` names its fine
    /// cuts (after `attn1`, `attn2` and `ff`).
    fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        context: &GTensor,
        label: &str,
    ) -> Result<GTensor> {
        let ctx = &g.ctx;
        let n = self.norm1.forward(ctx, x)?;
        let x = ctx.add(x, &self.attn1.forward(g, &n, &n)?)?;
        g.marks
            .mark_fine(&x, LEVEL_SUBLAYER, &format!("{label}.attn1"))?;
        let ctx = &g.ctx;
        let n = self.norm2.forward(ctx, &x)?;
        let x = ctx.add(&x, &self.attn2.forward(g, &n, context)?)?;
        g.marks
            .mark_fine(&x, LEVEL_SUBLAYER, &format!("{label}.attn2"))?;
        let ctx = &g.ctx;
        let n = self.norm3.forward(ctx, &x)?;
        // GEGLU: value * gelu(gate), value the first half of the projection (one op: this
        // crate's CPU kernel, or ggml's GLU).
        if let Some(out) = self.chunked_ff(ctx, &n, g.opts.exact)? {
            let out = ctx.add(&x, &out)?;
            g.marks
                .mark_fine(&out, LEVEL_SUBLAYER, &format!("{label}.ff"))?;
            return Ok(out);
        }
        let p = self.ff_proj.forward(ctx, &n)?;
        if let Some(y) = ctx.geglu_host(&p)? {
            let f = self.ff_out.forward(ctx, &y)?;
            let out = ctx.add(&x, &f)?;
            g.marks
                .mark_fine(&out, LEVEL_SUBLAYER, &format!("{label}.ff"))?;
            return Ok(out);
        }
        let y = ctx.geglu(&p, g.opts.exact)?;
        let f = self.ff_out.forward(ctx, &y)?;
        let out = ctx.add(&x, &f)?;
        g.marks
            .mark_fine(&out, LEVEL_SUBLAYER, &format!("{label}.ff"))?;
        Ok(out)
    }

    /// The feed-forward of `n` `[dim, tokens, B]` in chunks of tokens when its projection
    /// would take more than the context's band limit (`Context::band_bytes`), each
    /// chunk's projection within it: the same values, a smaller compute buffer (the
    /// projection of SD1.5's top level at 512x512, batch 2, is 84 MB). `None` without a
    /// limit, under it, or with this crate's CPU kernels (the caller runs it whole).
    fn chunked_ff(&self, ctx: &Context, n: &GTensor, exact: bool) -> Result<Option<GTensor>> {
        let Some(limit) = ctx.band_bytes() else {
            return Ok(None);
        };
        let [dim, tokens, b, _] = n.ne();
        let rows = tokens * b;
        let row_bytes = self.ff_proj.weight.ne()[1] * DType::F32.type_size();
        if ctx.host_kernels() || rows < 2 || row_bytes * rows <= limit || !n.is_contiguous() {
            return Ok(None);
        }
        // Equal chunks, as few as keep each projection within the limit.
        let chunks = (row_bytes * rows).div_ceil(limit.max(1)).min(rows);
        let per = rows.div_ceil(chunks);
        let flat = ctx.reshape(n, &[dim, rows])?;
        let esz = DType::F32.type_size();
        let mut out: Option<GTensor> = None;
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + per).min(rows);
            let part = ctx.view(
                &flat,
                [dim, r1 - r0, 1, 1],
                [dim * esz, dim * esz * (r1 - r0), dim * esz * (r1 - r0)],
                r0 * dim * esz,
            )?;
            let y = ctx.geglu(&self.ff_proj.forward(ctx, &part)?, exact)?;
            let f = self.ff_out.forward(ctx, &y)?;
            out = Some(match out {
                None => f,
                Some(o) => ctx.concat(&o, &f, 1)?,
            });
            r0 = r1;
        }
        Ok(match out {
            Some(o) => Some(ctx.reshape(&o, &[dim, tokens, b])?),
            None => None,
        })
    }
}

/// `proj_in` / `proj_out`: a 1x1 convolution (SD1) or a linear layer (SD2).
#[derive(Clone, Debug)]
pub enum Projection {
    /// 1x1 convolution on `[W, H, C, B]`.
    Conv(Conv2d),
    /// Linear on tokens `[C, W*H, B]`.
    Linear(Linear),
}

/// `SpatialTransformer`.
#[derive(Clone, Debug)]
pub struct SpatialTransformer {
    /// `norm`.
    pub norm: GroupNorm,
    /// `proj_in`.
    pub proj_in: Projection,
    /// `transformer_blocks.K`.
    pub transformer_blocks: Vec<BasicTransformerBlock>,
    /// `proj_out`.
    pub proj_out: Projection,
}

impl SpatialTransformer {
    fn new(pb: &ParamBuilder<'_>, ch: usize, depth: usize, cfg: &UnetConfig) -> Result<Self> {
        let (heads, _) = cfg.heads.split(ch)?;
        let proj = |name: &str, i: usize, o: usize| -> Result<Projection> {
            Ok(if cfg.use_linear_in_transformer {
                Projection::Linear(Linear::new(&pb.pp(name), i, o, true)?)
            } else {
                Projection::Conv(Conv2d::new(&pb.pp(name), i, o, 1, 1, 0)?)
            })
        };
        let mut transformer_blocks = Vec::with_capacity(depth);
        for k in 0..depth {
            transformer_blocks.push(BasicTransformerBlock::new(
                &pb.pp(format!("transformer_blocks.{k}")),
                ch,
                heads,
                cfg,
            )?);
        }
        Ok(SpatialTransformer {
            norm: GroupNorm::new(&pb.pp("norm"), ch, cfg.norm_groups, ST_EPS)?,
            proj_in: proj("proj_in", ch, ch)?,
            transformer_blocks,
            proj_out: proj("proj_out", ch, ch)?,
        })
    }

    fn forward(&self, g: &mut GraphCtx, x: &GTensor, context: &GTensor) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let ctx = &ctx;
        let [w, h, c, b] = x.ne();
        let to_tokens = |t: &GTensor| -> Result<GTensor> {
            let t = ctx.reshape(t, &[w * h, c, b])?;
            Ok(ctx.cont(&ctx.transpose(&t)?)?)
        };
        let from_tokens = |t: &GTensor| -> Result<GTensor> {
            let t = ctx.cont(&ctx.transpose(t)?)?;
            Ok(ctx.reshape(&t, &[w, h, c, b])?)
        };
        // A 1x1 projection on tokens: a product over channels, as the convolution's own
        // 1x1 path computes it, without its transposes back and forth (ggml's ops; this
        // crate's CPU kernels keep the convolution).
        let pointwise_on_tokens = |conv: &Conv2d| {
            let kn = conv.weight.ne();
            !ctx.host_kernels() && kn[0] == 1 && kn[1] == 1 && conv.stride == 1 && conv.padding == 0
        };
        let on_tokens = |conv: &Conv2d, tokens: &GTensor| -> Result<GTensor> {
            let kn = conv.weight.ne();
            let w = ctx.reshape(&conv.weight, &[kn[2], kn[3]])?;
            let y = ctx.mul_mat(&w, tokens)?; // [OC, tokens, B]
            Ok(match &conv.bias {
                Some(b) => ctx.add(&y, b)?,
                None => y,
            })
        };
        let mut t = self.norm.forward(ctx, x)?;
        t = match &self.proj_in {
            Projection::Conv(conv) if pointwise_on_tokens(conv) => {
                on_tokens(conv, &to_tokens(&t)?)?
            }
            Projection::Conv(conv) => to_tokens(&conv.forward(g, &t)?)?,
            Projection::Linear(lin) => lin.forward(ctx, &to_tokens(&t)?)?,
        };
        for (k, block) in self.transformer_blocks.iter().enumerate() {
            t = block.forward(g, &t, context, &format!("transformer_blocks.{k}"))?;
        }
        let t = match &self.proj_out {
            Projection::Conv(conv) if pointwise_on_tokens(conv) => {
                from_tokens(&on_tokens(conv, &t)?)?
            }
            Projection::Conv(conv) => conv.forward(g, &from_tokens(&t)?)?,
            Projection::Linear(lin) => from_tokens(&lin.forward(ctx, &t)?)?,
        };
        Ok(ctx.add(&t, x)?)
    }
}

/// One layer of a UNet block.
#[derive(Clone, Debug)]
pub enum Layer {
    /// `input_blocks.0.0`: the input convolution.
    ConvIn(Conv2d),
    /// A `ResBlock`.
    Res(ResBlock),
    /// A `SpatialTransformer`.
    Attn(SpatialTransformer),
    /// `Downsample`: 3x3 convolution with stride 2 (`op`).
    Down(Conv2d),
    /// `Upsample`: 2x nearest, then a 3x3 convolution (`conv`).
    Up(Conv2d),
}

impl Layer {
    fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        emb: &GTensor,
        context: &GTensor,
    ) -> Result<GTensor> {
        match self {
            Layer::ConvIn(c) | Layer::Down(c) => c.forward(g, x),
            Layer::Res(r) => r.forward(g, x, emb),
            Layer::Attn(a) => a.forward(g, x, context),
            Layer::Up(c) => c.forward(g, &g.ctx.upscale(x, 2)?),
        }
    }
}

/// The UNet.
#[derive(Clone, Debug)]
pub struct UnetModel {
    /// Configuration.
    pub config: UnetConfig,
    /// `time_embed.0`.
    pub time_embed_0: Linear,
    /// `time_embed.2`.
    pub time_embed_2: Linear,
    /// `label_emb.0.0` and `label_emb.0.2` (SDXL): the embedding of `y`.
    pub label_emb: Option<(Linear, Linear)>,
    /// `input_blocks.N`.
    pub input_blocks: Vec<Vec<Layer>>,
    /// `middle_block`.
    pub middle_block: Vec<Layer>,
    /// `output_blocks.N`.
    pub output_blocks: Vec<Vec<Layer>>,
    /// `out.0`.
    pub out_norm: GroupNorm,
    /// `out.2`.
    pub out_conv: Conv2d,
}

/// Runs the layers of block `name`, marking a fine cut between layers (level
/// [`LEVEL_LAYER`]) and letting each layer mark cuts inside it (scope `name.i`). The block's
/// own boundary is marked by the caller.
fn forward_block(
    g: &mut GraphCtx,
    layers: &[Layer],
    name: &str,
    x: &GTensor,
    emb: &GTensor,
    context: &GTensor,
) -> Result<GTensor> {
    let mut hs = x.clone();
    for (i, layer) in layers.iter().enumerate() {
        g.marks.set_scope(&format!("{name}.{i}"));
        hs = layer.forward(g, &hs, emb, context)?;
        if i + 1 < layers.len() {
            g.marks.mark_fine(&hs, LEVEL_LAYER, "out")?;
        }
    }
    g.marks.set_scope("");
    Ok(hs)
}

impl UnetModel {
    /// Declares the parameters under `config.prefix` of `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: UnetConfig) -> Result<Self> {
        config.validate()?;
        let cfg = &config;
        let pb = pb.pp(&cfg.prefix);
        let mc = cfg.model_channels;
        let ted = cfg.time_embed_dim();
        let levels = cfg.channel_mult.len();

        // Input blocks, recording each block's width for the skip connections.
        let mut input_blocks = vec![vec![Layer::ConvIn(Conv2d::new(
            &pb.pp("input_blocks.0.0"),
            cfg.in_channels,
            mc,
            3,
            1,
            1,
        )?)]];
        let mut skip_chans = vec![mc];
        let (mut ch, mut ds) = (mc, 1usize);
        for (level, &mult) in cfg.channel_mult.iter().enumerate() {
            for _ in 0..cfg.num_res_blocks {
                let b = pb.pp(format!("input_blocks.{}", input_blocks.len()));
                let mut layers = vec![Layer::Res(ResBlock::new(&b.pp("0"), ch, mult * mc, cfg)?)];
                ch = mult * mc;
                if cfg.has_attention(level, ds) {
                    let depth = cfg.depth_at(level);
                    layers.push(Layer::Attn(SpatialTransformer::new(
                        &b.pp("1"),
                        ch,
                        depth,
                        cfg,
                    )?));
                }
                input_blocks.push(layers);
                skip_chans.push(ch);
            }
            if level + 1 != levels {
                let b = pb.pp(format!("input_blocks.{}", input_blocks.len()));
                input_blocks.push(vec![Layer::Down(Conv2d::new(
                    &b.pp("0.op"),
                    ch,
                    ch,
                    3,
                    2,
                    1,
                )?)]);
                skip_chans.push(ch);
                ds *= 2;
            }
        }

        let m = pb.pp("middle_block");
        let middle_block = vec![
            Layer::Res(ResBlock::new(&m.pp("0"), ch, ch, cfg)?),
            Layer::Attn(SpatialTransformer::new(
                &m.pp("1"),
                ch,
                cfg.middle_depth(),
                cfg,
            )?),
            Layer::Res(ResBlock::new(&m.pp("2"), ch, ch, cfg)?),
        ];

        let mut output_blocks = Vec::new();
        for (level, &mult) in cfg.channel_mult.iter().enumerate().rev() {
            for i in 0..=cfg.num_res_blocks {
                let b = pb.pp(format!("output_blocks.{}", output_blocks.len()));
                let skip = skip_chans
                    .pop()
                    .ok_or_else(|| ModelError::Config("skip connections exhausted".into()))?;
                let mut layers = vec![Layer::Res(ResBlock::new(
                    &b.pp("0"),
                    ch + skip,
                    mc * mult,
                    cfg,
                )?)];
                ch = mc * mult;
                if cfg.has_attention(level, ds) {
                    let depth = cfg.depth_at(level);
                    layers.push(Layer::Attn(SpatialTransformer::new(
                        &b.pp("1"),
                        ch,
                        depth,
                        cfg,
                    )?));
                }
                if level != 0 && i == cfg.num_res_blocks {
                    let idx = layers.len();
                    layers.push(Layer::Up(Conv2d::new(
                        &b.pp(format!("{idx}.conv")),
                        ch,
                        ch,
                        3,
                        1,
                        1,
                    )?));
                    ds /= 2;
                }
                output_blocks.push(layers);
            }
        }

        Ok(UnetModel {
            time_embed_0: Linear::new(&pb.pp("time_embed.0"), mc, ted, true)?,
            time_embed_2: Linear::new(&pb.pp("time_embed.2"), ted, ted, true)?,
            label_emb: match cfg.adm_in_channels {
                Some(adm) => Some((
                    Linear::new(&pb.pp("label_emb.0.0"), adm, ted, true)?,
                    Linear::new(&pb.pp("label_emb.0.2"), ted, ted, true)?,
                )),
                None => None,
            },
            input_blocks,
            middle_block,
            output_blocks,
            out_norm: GroupNorm::new(&pb.pp("out.0"), ch, cfg.norm_groups, RES_EPS)?,
            out_conv: Conv2d::new(&pb.pp("out.2"), ch, cfg.out_channels, 3, 1, 1)?,
            config,
        })
    }

    /// Builds the forward pass: `x` latents `[W, H, in_channels, B]` (W and H multiples of
    /// `2^(levels - 1)`), `timesteps` f32 `[B]`, `context` `[context_dim, n_ctx, B]`, and
    /// `y` f32 `[adm_in_channels, B]`, required exactly when the model has `label_emb`
    /// (SDXL). Returns the model output `[W, H, out_channels, B]` (noise or v prediction).
    pub fn forward(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        timesteps: &GTensor,
        context: &GTensor,
        y: Option<&GTensor>,
    ) -> Result<GTensor> {
        let cfg = &self.config;
        let ctx = g.ctx.clone();
        let [w, h, c, b] = x.ne();
        let align = 1usize << (cfg.channel_mult.len() - 1);
        if c != cfg.in_channels
            || b == 0
            || w == 0
            || h == 0
            || !w.is_multiple_of(align)
            || !h.is_multiple_of(align)
        {
            return Err(ModelError::Input {
                name: "x",
                detail: format!(
                    "{:?}, expected [W, H, {}, B], W and H multiples of {align}",
                    x.ne(),
                    cfg.in_channels
                ),
            });
        }
        if timesteps.ne() != [b, 1, 1, 1] || timesteps.dtype() != Some(DType::F32) {
            return Err(ModelError::Input {
                name: "timesteps",
                detail: format!(
                    "{:?} {:?}, expected f32 [{b}]",
                    timesteps.dtype(),
                    timesteps.ne()
                ),
            });
        }
        let cn = context.ne();
        if cn[0] != cfg.context_dim || cn[2] != b || cn[3] != 1 {
            return Err(ModelError::Input {
                name: "context",
                detail: format!("{cn:?}, expected [{}, n, {b}]", cfg.context_dim),
            });
        }

        let y = match (&self.label_emb, y, cfg.adm_in_channels) {
            (Some(_), Some(y), Some(adm)) => {
                if y.ne() != [adm, b, 1, 1] || y.dtype() != Some(DType::F32) {
                    return Err(ModelError::Input {
                        name: "y",
                        detail: format!("{:?} {:?}, expected f32 [{adm}, {b}]", y.dtype(), y.ne()),
                    });
                }
                Some(y)
            }
            (None, None, _) => None,
            (Some(_), None, _) => {
                return Err(ModelError::Input {
                    name: "y",
                    detail: "this UNet has `label_emb` (SDXL) and needs its `y` vector".into(),
                })
            }
            _ => {
                return Err(ModelError::Input {
                    name: "y",
                    detail: "given, but this UNet has no `label_emb`".into(),
                })
            }
        };

        // 1. Time embedding: sinusoidal (cos first), Linear, SiLU, Linear; plus the label
        //    embedding of `y` (Linear, SiLU, Linear) when there is one.
        let t = ctx.timestep_embedding(timesteps, cfg.model_channels, 10000)?;
        let t = self.time_embed_0.forward(&ctx, &t)?;
        let mut emb = self.time_embed_2.forward(&ctx, &ctx.silu(&t)?)?;
        if let (Some((l0, l2)), Some(y)) = (&self.label_emb, y) {
            let l = l0.forward(&ctx, y)?;
            emb = ctx.add(&emb, &l2.forward(&ctx, &ctx.silu(&l)?)?)?;
        }
        // A cut of its own: computed once, read by every later segment (and copied, not
        // recomputed, on every device of a layer split, so its weights live on one).
        g.marks.mark(&emb, "time_embed", "emb")?;

        // 2. Input blocks, keeping every output for the skip connections.
        let mut skips = Vec::with_capacity(self.input_blocks.len());
        let mut hs = x.clone();
        for (n, block) in self.input_blocks.iter().enumerate() {
            hs = forward_block(g, block, &format!("input_blocks.{n}"), &hs, &emb, context)?;
            g.marks.mark(&hs, &format!("input_blocks.{n}"), "h")?;
            skips.push(hs.clone());
        }

        // 3. Middle block.
        hs = forward_block(g, &self.middle_block, "middle_block", &hs, &emb, context)?;
        g.marks.mark(&hs, "middle_block", "h")?;

        // 4. Output blocks, each on the concatenation with the matching skip.
        for (n, block) in self.output_blocks.iter().enumerate() {
            let skip = skips
                .pop()
                .ok_or_else(|| ModelError::Config("skip connections exhausted".into()))?;
            hs = ctx.concat(&hs, &skip, 2)?;
            let name = format!("output_blocks.{n}");
            hs = forward_block(g, block, &name, &hs, &emb, context)?;
            g.marks.mark(&hs, &format!("output_blocks.{n}"), "h")?;
        }

        // 5. Output: GroupNorm, SiLU, conv.
        self.out_conv
            .forward(g, &self.out_norm.forward_silu(&ctx, &hs)?)
    }
}
