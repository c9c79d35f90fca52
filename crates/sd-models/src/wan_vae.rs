//! The Wan-2.1 causal video VAE (Qwen-Image's autoencoder; diffusers
//! `AutoencoderKLQwenImage`, stable-diffusion.cpp `wan.hpp`) as a 2-D network for single
//! images.
//!
//! # Why 2-D
//!
//! Every 3-D convolution is causal in time: `2 p` zero frames are padded in front, none
//! behind. An image is one frame (T = 1), so a `3 x 3 x 3` kernel only ever meets data with
//! its last temporal tap and equals the 2-D convolution with `weight[:, :, -1]`; `1 x 1 x 1`
//! kernels are 1x1 convolutions. For the first (here only) chunk diffusers skips the
//! resamples' `time_conv` (the "Rep" / first-chunk cache path), so those weights are never
//! read and are not declared. The causal caches start empty (zeros), which is the same
//! padding. The parity test checks all of this against diffusers.
//!
//! The kernels stay in the file's 5-D layout (ggml `ne = [kw, kh, kt, ic * oc]`, see
//! [`crate::weights`]); the graph takes a view of the last temporal slice (no copy of the
//! parameter) and makes it contiguous for ggml's convolution, which reshapes its kernel
//! (a copy of a third of the kernel in the compute buffer; views need a float weight type,
//! quantized kernels are refused).
//!
//! # Layout
//!
//! Canonical names are the original Wan ones under `first_stage_model.` (see
//! `sd_formats::names`, which converts diffusers' names): `encoder.conv1`,
//! `encoder.downsamples.N` (a flat list of residual blocks `residual.{0,2,3,6}` + `shortcut`
//! and resamples `resample.1`), `encoder.middle.{0,1,2}` (residual, attention `norm`,
//! `to_qkv`, `proj`, residual), `encoder.head.{0,2}`, `conv1` (quant), `conv2`
//! (post-quant), and the decoder's mirror with `decoder.upsamples.N`. Norms are `RMS_norm`:
//! `F.normalize` over the channels times `sqrt(C)` times `gamma` (no bias).
//!
//! Latents are normalised per channel for the diffusion model, `z_dit = (z - mean_c) /
//! std_c` ([`WanVaeConfig::normalize_latents`]); that is the caller's business.

use sd_formats::names::VAE_PREFIX;
use sd_tensor::ggml::{Context, GTensor};

use crate::nn::{attention, Conv2d};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// Wan-2.1's per-channel latent means (diffusers `AutoencoderKLQwenImage` config default
/// `latents_mean`; stable-diffusion.cpp `WanVAERunner::get_latents_mean_std`).
pub const WAN21_LATENTS_MEAN: [f32; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
];

/// Wan-2.1's per-channel latent standard deviations (diffusers `latents_std`).
pub const WAN21_LATENTS_STD: [f32; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
    1.6382, 1.1253, 2.8251, 1.9160,
];

/// Configuration of a Wan-2.1 VAE.
///
/// Deserializes from diffusers' `vae/config.json` key names (`base_dim`, `z_dim`,
/// `dim_mult`, `num_res_blocks`, `input_channels`, `latents_mean`, `latents_std`); other keys
/// (`_class_name`, `attn_scales`, `temperal_downsample`, `dropout`: nothing an image uses)
/// are ignored, missing keys keep the defaults.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct WanVaeConfig {
    /// Base width (`base_dim`).
    pub base_dim: usize,
    /// Latent channels (`z_dim`; the encoder outputs twice as many moments).
    pub z_dim: usize,
    /// Width multipliers per level (`dim_mult`).
    pub dim_mult: Vec<usize>,
    /// Residual blocks per encoder level (`num_res_blocks`; the decoder has one more).
    pub num_res_blocks: usize,
    /// Image channels (`input_channels`).
    pub input_channels: usize,
    /// Per-channel latent means (`latents_mean`, `z_dim` values).
    pub latents_mean: Vec<f32>,
    /// Per-channel latent standard deviations (`latents_std`, `z_dim` values).
    pub latents_std: Vec<f32>,
    /// Epsilon of the RMS norms (`F.normalize`'s 1e-12 on the norm; stable-diffusion.cpp
    /// uses 1e-12 in `ggml_rms_norm`).
    pub eps: f32,
    /// Whether the encoder (and `conv1`) is declared (false for decode-only use).
    #[serde(skip)]
    pub with_encoder: bool,
    /// Whether the decoder (and `conv2`) is declared.
    #[serde(skip)]
    pub with_decoder: bool,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl Default for WanVaeConfig {
    /// Qwen-Image: diffusers `AutoencoderKLQwenImage` defaults (`base_dim: 96, z_dim: 16,
    /// dim_mult: [1, 2, 4, 4], num_res_blocks: 2, input_channels: 3`, the Wan-2.1 latent
    /// tables).
    fn default() -> Self {
        WanVaeConfig {
            base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            input_channels: 3,
            latents_mean: WAN21_LATENTS_MEAN.to_vec(),
            latents_std: WAN21_LATENTS_STD.to_vec(),
            eps: 1e-12,
            with_encoder: true,
            with_decoder: true,
            prefix: VAE_PREFIX.trim_end_matches('.').to_string(),
        }
    }
}

fn config_err(what: impl Into<String>) -> ModelError {
    ModelError::Config(what.into())
}

impl WanVaeConfig {
    fn validate(&self) -> Result<()> {
        if self.dim_mult.is_empty()
            || self.dim_mult.contains(&0)
            || self.base_dim == 0
            || self.z_dim == 0
            || self.input_channels == 0
            || self.num_res_blocks == 0
        {
            return Err(config_err(format!("Wan VAE config {self:?}")));
        }
        // The decoder's upsamplers halve the width: every level above the first must be even.
        if self.dim_mult[1..]
            .iter()
            .any(|m| !(self.base_dim * m).is_multiple_of(2))
        {
            return Err(config_err(format!(
                "Wan VAE widths {:?} x {} do not halve",
                self.dim_mult, self.base_dim
            )));
        }
        Ok(())
    }

    /// The spatial downsampling factor (8 for Qwen-Image).
    pub fn downsample_factor(&self) -> usize {
        1 << self.dim_mult.len().saturating_sub(1)
    }

    /// Reads the sizes from the shapes of the tensors under `prefix` in `pb`'s catalog
    /// (decoder first, else the encoder): `base_dim` and the image channels from
    /// `decoder.head.2` (`encoder.conv1`), `z_dim` from `decoder.conv1` (`encoder.head.2`),
    /// `num_res_blocks` from where the first resample sits in the flat lists, `dim_mult` from
    /// the residual blocks' widths. Latent tables and `eps` keep the defaults; with/without
    /// encoder and decoder follow what the file holds.
    pub fn from_tensors(pb: &ParamBuilder<'_>, prefix: &str) -> Result<Self> {
        let pb = pb.pp(prefix.trim_end_matches('.'));
        let shape = |name: &str| pb.file_shape(name);
        let dim = |name: &str, i: usize| -> Result<usize> {
            shape(name)
                .and_then(|s| s.get(i).copied())
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| config_err(format!("Wan VAE: no usable `{prefix}.{name}`")))
        };
        let has_dec = shape("decoder.conv1.weight").is_some();
        let has_enc = shape("encoder.conv1.weight").is_some();
        let mut c = WanVaeConfig {
            with_encoder: has_enc,
            with_decoder: has_dec,
            prefix: prefix.trim_end_matches('.').to_string(),
            ..WanVaeConfig::default()
        };
        // The flat list's first resample sits after the first level's residual blocks.
        let first_resample = |list: &str| {
            (0..64).find(|i| shape(&format!("{list}.{i}.resample.1.weight")).is_some())
        };
        let resamples = |list: &str, stride: usize| {
            (0..16)
                .take_while(|l| {
                    shape(&format!(
                        "{list}.{}.resample.1.weight",
                        l * stride + stride - 1
                    ))
                    .is_some()
                })
                .count()
        };
        if has_dec {
            c.z_dim = dim("decoder.conv1.weight", 1)?;
            c.base_dim = dim("decoder.head.2.weight", 1)?;
            c.input_channels = dim("decoder.head.2.weight", 0)?;
            let list = "decoder.upsamples";
            let first = first_resample(list).unwrap_or(0);
            if first < 2 {
                return Err(config_err("Wan VAE: no decoder upsampler found"));
            }
            c.num_res_blocks = first - 1;
            let stride = first + 1;
            let levels = resamples(list, stride) + 1;
            // Level l (deepest first) ends at base * dim_mult[levels - 1 - l].
            let mut mult = vec![0; levels];
            for (l, m) in mult.iter_mut().rev().enumerate() {
                let w = dim(&format!("{list}.{}.residual.2.weight", l * stride), 0)?;
                *m = w / c.base_dim.max(1);
            }
            c.dim_mult = mult;
        } else if has_enc {
            c.base_dim = dim("encoder.conv1.weight", 0)?;
            c.input_channels = dim("encoder.conv1.weight", 1)?;
            c.z_dim = dim("encoder.head.2.weight", 0)? / 2;
            let list = "encoder.downsamples";
            let first = first_resample(list)
                .ok_or_else(|| config_err("Wan VAE: no encoder downsampler found"))?;
            c.num_res_blocks = first;
            let stride = first + 1;
            let levels = resamples(list, stride) + 1;
            c.dim_mult = (0..levels)
                .map(|l| {
                    dim(&format!("{list}.{}.residual.2.weight", l * stride), 0)
                        .map(|w| w / c.base_dim.max(1))
                })
                .collect::<Result<_>>()?;
        } else {
            return Err(config_err(format!(
                "no Wan VAE under `{prefix}` (no `encoder.conv1` / `decoder.conv1`)"
            )));
        }
        c.validate()?;
        Ok(c)
    }

    fn tables(&self) -> Result<(&[f32], &[f32])> {
        let (m, s) = (&self.latents_mean, &self.latents_std);
        if m.len() != self.z_dim || s.len() != self.z_dim || s.contains(&0.0) {
            return Err(config_err(format!(
                "latent tables of {} / {} values for {} channels (or a zero std)",
                m.len(),
                s.len(),
                self.z_dim
            )));
        }
        Ok((m, s))
    }

    fn per_channel(
        &self,
        z: &mut [f32],
        plane: usize,
        f: impl Fn(f32, f32, f32) -> f32,
    ) -> Result<()> {
        let (mean, std) = self.tables()?;
        let per_image = plane.checked_mul(self.z_dim).unwrap_or(0);
        if per_image == 0 || !z.len().is_multiple_of(per_image) {
            return Err(ModelError::Input {
                name: "latent",
                detail: format!(
                    "{} values are not whole images of {} channels x {plane}",
                    z.len(),
                    self.z_dim
                ),
            });
        }
        for image in z.chunks_exact_mut(per_image) {
            for (c, ch) in image.chunks_exact_mut(plane).enumerate() {
                for v in ch {
                    *v = f(*v, mean[c], std[c]);
                }
            }
        }
        Ok(())
    }

    /// VAE latents to the diffusion model's: `(z - mean_c) / std_c` in place, for planar
    /// latents (ggml `[w, h, z_dim, B]`: `plane = w * h` values per channel).
    pub fn normalize_latents(&self, z: &mut [f32], plane: usize) -> Result<()> {
        self.per_channel(z, plane, |v, m, s| (v - m) / s)
    }

    /// The inverse of [`WanVaeConfig::normalize_latents`]: `z * std_c + mean_c`, before
    /// decoding.
    pub fn denormalize_latents(&self, z: &mut [f32], plane: usize) -> Result<()> {
        self.per_channel(z, plane, |v, m, s| v * s + m)
    }
}

/// `RMS_norm` over the channels of `[W, H, C, N]`: `x / ||x|| * sqrt(C) * gamma`.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// `gamma` (`[C, 1, 1, 1]` or `[C, 1, 1]` in files; `[C]` here).
    pub gamma: GTensor,
    /// Epsilon.
    pub eps: f32,
}

impl RmsNorm {
    fn new(pb: &ParamBuilder<'_>, c: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            gamma: pb.tensor("gamma", &[c])?,
            eps,
        })
    }

    /// Normalises `x` `[W, H, C, N]` over C.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let t = ctx.cont(&ctx.permute(x, [1, 2, 0, 3])?)?; // [C, W, H, N]
        let t = ctx.mul(&ctx.rms_norm(&t, self.eps)?, &self.gamma)?;
        Ok(ctx.cont(&ctx.permute(&t, [2, 0, 1, 3])?)?)
    }
}

/// `CausalConv3d` applied to one frame: a 2-D convolution with the kernel's last temporal
/// slice (cubic kernels, stride 1, spatial padding `k / 2`).
#[derive(Clone, Debug)]
pub struct CausalConv {
    /// Kernel, ggml `[kw, kh, kt, ic * oc]` (the file's `[oc, ic, kt, kh, kw]`).
    pub weight: GTensor,
    /// Bias `[oc]`.
    pub bias: GTensor,
    /// Input channels.
    pub in_ch: usize,
    /// Output channels.
    pub out_ch: usize,
}

impl CausalConv {
    fn new(pb: &ParamBuilder<'_>, in_ch: usize, out_ch: usize, k: usize) -> Result<Self> {
        Ok(CausalConv {
            weight: pb.tensor("weight", &[out_ch, in_ch, k, k, k])?,
            bias: pb.tensor("bias", &[out_ch])?,
            in_ch,
            out_ch,
        })
    }

    /// The 2-D kernel `[kw, kh, ic, oc]`: the last temporal slice of the weight (a strided
    /// view made contiguous; the whole weight, reshaped, for `kt = 1`).
    pub fn kernel_2d(&self, ctx: &Context) -> Result<GTensor> {
        let [kw, kh, kt, _] = self.weight.ne();
        let shape = [kw, kh, self.in_ch, self.out_ch];
        if kt == 1 {
            return Ok(ctx.reshape(&self.weight, &shape)?);
        }
        let nb = self.weight.nb();
        let per_pair = nb[3]; // one (oc, ic) pair's kt * kh * kw elements
        let view = ctx.view(
            &self.weight,
            shape,
            [nb[1], per_pair, per_pair * self.in_ch],
            (kt - 1) * nb[2],
        )?;
        Ok(ctx.cont(&view)?)
    }

    /// Convolves one frame `x` `[W, H, in_ch, N]`.
    pub fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let k = self.kernel_2d(&g.ctx)?;
        let padding = k.ne()[0] / 2;
        Conv2d {
            weight: k,
            bias: Some(self.bias.clone()),
            stride: 1,
            padding,
        }
        .forward(g, x)
    }
}

/// `ResidualBlock`: `residual` = (RMS_norm, SiLU, conv, RMS_norm, SiLU, dropout, conv) plus
/// the (1x1x1 `shortcut`) input.
#[derive(Clone, Debug)]
pub struct ResidualBlock {
    /// `residual.0`.
    pub norm1: RmsNorm,
    /// `residual.2`.
    pub conv1: CausalConv,
    /// `residual.3`.
    pub norm2: RmsNorm,
    /// `residual.6`.
    pub conv2: CausalConv,
    /// `shortcut` (when the width changes).
    pub shortcut: Option<CausalConv>,
}

impl ResidualBlock {
    fn new(pb: &ParamBuilder<'_>, cin: usize, cout: usize, eps: f32) -> Result<Self> {
        Ok(ResidualBlock {
            norm1: RmsNorm::new(&pb.pp("residual.0"), cin, eps)?,
            conv1: CausalConv::new(&pb.pp("residual.2"), cin, cout, 3)?,
            norm2: RmsNorm::new(&pb.pp("residual.3"), cout, eps)?,
            conv2: CausalConv::new(&pb.pp("residual.6"), cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(CausalConv::new(&pb.pp("shortcut"), cin, cout, 1)?)
            } else {
                None
            },
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let h = self
            .conv1
            .forward(g, &ctx.silu(&self.norm1.forward(ctx, x)?)?)?;
        let h = self
            .conv2
            .forward(g, &ctx.silu(&self.norm2.forward(ctx, &h)?)?)?;
        let skip = match &self.shortcut {
            Some(s) => s.forward(g, x)?,
            None => x.clone(),
        };
        Ok(ctx.add(&h, &skip)?)
    }
}

/// `AttentionBlock`: single-head spatial self-attention, fused 1x1 `to_qkv`, 1x1 `proj`.
#[derive(Clone, Debug)]
pub struct AttentionBlock {
    /// `norm`.
    pub norm: RmsNorm,
    /// `to_qkv` (`[3 C, C, 1, 1]`: q, k, v along the output channels).
    pub to_qkv: Conv2d,
    /// `proj`.
    pub proj: Conv2d,
}

impl AttentionBlock {
    fn new(pb: &ParamBuilder<'_>, c: usize, eps: f32) -> Result<Self> {
        Ok(AttentionBlock {
            norm: RmsNorm::new(&pb.pp("norm"), c, eps)?,
            to_qkv: Conv2d::new(&pb.pp("to_qkv"), c, 3 * c, 1, 1, 0)?,
            proj: Conv2d::new(&pb.pp("proj"), c, c, 1, 1, 0)?,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let [w, h, c, b] = x.ne();
        let qkv = self.to_qkv.forward(g, &self.norm.forward(ctx, x)?)?; // [W, H, 3C, B]
        let nb = qkv.nb();
        // Part i of [W, H, 3C, B] as tokens [C, W*H, B].
        let part = |i: usize| -> Result<GTensor> {
            let t =
                ctx.cont(&ctx.view(&qkv, [w, h, c, b], [nb[1], nb[2], nb[3]], i * c * nb[2])?)?;
            let t = ctx.reshape(&t, &[w * h, c, b])?;
            Ok(ctx.cont(&ctx.transpose(&t)?)?)
        };
        let o = attention(g, &part(0)?, &part(1)?, &part(2)?, 1, None)?; // [C, W*H, B]
        let o = ctx.cont(&ctx.transpose(&o)?)?;
        let o = ctx.reshape(&o, &[w, h, c, b])?;
        Ok(ctx.add(&self.proj.forward(g, &o)?, x)?)
    }
}

/// `middle`: residual block, attention, residual block.
#[derive(Clone, Debug)]
pub struct Middle {
    /// `middle.0`.
    pub res_0: ResidualBlock,
    /// `middle.1`.
    pub attn: AttentionBlock,
    /// `middle.2`.
    pub res_2: ResidualBlock,
}

impl Middle {
    fn new(pb: &ParamBuilder<'_>, c: usize, eps: f32) -> Result<Self> {
        Ok(Middle {
            res_0: ResidualBlock::new(&pb.pp("0"), c, c, eps)?,
            attn: AttentionBlock::new(&pb.pp("1"), c, eps)?,
            res_2: ResidualBlock::new(&pb.pp("2"), c, c, eps)?,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let h = self.res_0.forward(g, x)?;
        let h = self.attn.forward(g, &h)?;
        self.res_2.forward(g, &h)
    }
}

/// One entry of the encoder's `downsamples` / the decoder's `upsamples` list.
#[derive(Clone, Debug)]
pub enum Layer {
    /// A residual block.
    Residual(ResidualBlock),
    /// `resample.1` of a downsampler: zero-pad right and bottom by one, 3x3 stride 2.
    Down(Conv2d),
    /// `resample.1` of an upsampler: 2x nearest, 3x3 halving the width.
    Up(Conv2d),
}

impl Layer {
    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        match self {
            Layer::Residual(r) => r.forward(g, x),
            Layer::Down(c) => c.forward(g, &g.ctx.pad(x, [1, 1, 0, 0])?),
            Layer::Up(c) => c.forward(g, &g.ctx.upscale(x, 2)?),
        }
    }
}

/// `encoder` / `decoder`: `conv1`, the flat resampling list, `middle`, `head`.
#[derive(Clone, Debug)]
pub struct Coder {
    /// `conv1`.
    pub conv1: CausalConv,
    /// `downsamples.N` (encoder) / `upsamples.N` (decoder).
    pub layers: Vec<Layer>,
    /// `middle`.
    pub middle: Middle,
    /// `head.0`.
    pub head_norm: RmsNorm,
    /// `head.2`.
    pub head_conv: CausalConv,
}

/// The autoencoder.
#[derive(Clone, Debug)]
pub struct WanVae {
    /// Configuration.
    pub config: WanVaeConfig,
    /// `encoder` (if configured).
    pub encoder: Option<Coder>,
    /// `decoder` (if configured).
    pub decoder: Option<Coder>,
    /// `conv1`: the quant conv (moments to moments, 1x1x1), with the encoder.
    pub quant_conv: Option<CausalConv>,
    /// `conv2`: the post-quant conv (latent to latent, 1x1x1), with the decoder.
    pub post_quant_conv: Option<CausalConv>,
}

impl WanVae {
    /// Declares the parameters under `config.prefix` of `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: WanVaeConfig) -> Result<Self> {
        // Sizes from the tensors when there is a file (a family's default config names the
        // release's); whether the encoder is built stays the caller's choice.
        let config = if pb.has_catalog() {
            WanVaeConfig {
                with_encoder: config.with_encoder,
                ..WanVaeConfig::from_tensors(pb, &config.prefix)?
            }
        } else {
            config
        };
        config.validate()?;
        let cfg = &config;
        let pb = pb.pp(&cfg.prefix);
        let eps = cfg.eps;
        let dims: Vec<usize> = cfg.dim_mult.iter().map(|m| cfg.base_dim * m).collect();
        let levels = dims.len();
        let top = dims[levels - 1];
        let z2 = 2 * cfg.z_dim;

        let encoder = if cfg.with_encoder {
            let e = pb.pp("encoder");
            let mut layers = Vec::new();
            let mut cin = cfg.base_dim;
            for (i, &cout) in dims.iter().enumerate() {
                for _ in 0..cfg.num_res_blocks {
                    let p = e.pp(format!("downsamples.{}", layers.len()));
                    layers.push(Layer::Residual(ResidualBlock::new(&p, cin, cout, eps)?));
                    cin = cout;
                }
                if i + 1 != levels {
                    let p = e.pp(format!("downsamples.{}.resample.1", layers.len()));
                    layers.push(Layer::Down(Conv2d::new(&p, cout, cout, 3, 2, 0)?));
                }
            }
            Some(Coder {
                conv1: CausalConv::new(&e.pp("conv1"), cfg.input_channels, cfg.base_dim, 3)?,
                layers,
                middle: Middle::new(&e.pp("middle"), top, eps)?,
                head_norm: RmsNorm::new(&e.pp("head.0"), top, eps)?,
                head_conv: CausalConv::new(&e.pp("head.2"), top, z2, 3)?,
            })
        } else {
            None
        };

        let decoder = if cfg.with_decoder {
            let d = pb.pp("decoder");
            let mut layers = Vec::new();
            let mut cin = top;
            for (i, &cout) in dims.iter().rev().enumerate() {
                for _ in 0..=cfg.num_res_blocks {
                    let p = d.pp(format!("upsamples.{}", layers.len()));
                    layers.push(Layer::Residual(ResidualBlock::new(&p, cin, cout, eps)?));
                    cin = cout;
                }
                if i + 1 != levels {
                    let p = d.pp(format!("upsamples.{}.resample.1", layers.len()));
                    layers.push(Layer::Up(Conv2d::new(&p, cout, cout / 2, 3, 1, 1)?));
                    cin = cout / 2;
                }
            }
            Some(Coder {
                conv1: CausalConv::new(&d.pp("conv1"), cfg.z_dim, top, 3)?,
                layers,
                middle: Middle::new(&d.pp("middle"), top, eps)?,
                head_norm: RmsNorm::new(&d.pp("head.0"), cfg.base_dim, eps)?,
                head_conv: CausalConv::new(&d.pp("head.2"), cfg.base_dim, cfg.input_channels, 3)?,
            })
        } else {
            None
        };

        let quant_conv = if cfg.with_encoder {
            Some(CausalConv::new(&pb.pp("conv1"), z2, z2, 1)?)
        } else {
            None
        };
        let post_quant_conv = if cfg.with_decoder {
            Some(CausalConv::new(&pb.pp("conv2"), cfg.z_dim, cfg.z_dim, 1)?)
        } else {
            None
        };
        Ok(WanVae {
            config,
            encoder,
            decoder,
            quant_conv,
            post_quant_conv,
        })
    }

    fn check_input(
        &self,
        name: &'static str,
        x: &GTensor,
        channels: usize,
        align: usize,
    ) -> Result<()> {
        let n = x.ne();
        if n[2] != channels
            || n.contains(&0)
            || !n[0].is_multiple_of(align)
            || !n[1].is_multiple_of(align)
        {
            return Err(ModelError::Input {
                name,
                detail: format!(
                    "{n:?}, expected [W, H, {channels}, B] with W and H multiples of {align}"
                ),
            });
        }
        Ok(())
    }

    /// Builds the encoder pass of images `x` `[W, H, input_channels, B]` in [-1, 1] (W and H
    /// multiples of the downsampling factor). Returns the moments `[W/f, H/f, 2 z_dim, B]`:
    /// mean then log-variance along the channels (diffusers `_encode`, unclamped).
    pub fn encode(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        let (enc, quant) = match (&self.encoder, &self.quant_conv) {
            (Some(e), Some(q)) => (e, q),
            _ => return Err(config_err("the encoder was not declared")),
        };
        self.check_input(
            "image",
            x,
            self.config.input_channels,
            self.config.downsample_factor(),
        )?;
        let ctx = g.ctx.clone();
        // 1. conv1.
        let mut h = enc.conv1.forward(g, x)?;
        // 2. The flat list of residual blocks and downsamplers.
        for (i, layer) in enc.layers.iter().enumerate() {
            h = layer.forward(g, &h)?;
            if matches!(layer, Layer::Down(_)) {
                g.marks.mark(&h, &format!("encoder.downsamples.{i}"), "h")?;
            }
        }
        // 3. Middle.
        h = enc.middle.forward(g, &h)?;
        g.marks.mark(&h, "encoder.middle", "h")?;
        // 4. Head: RMS_norm, SiLU, conv; then the quant conv.
        h = enc
            .head_conv
            .forward(g, &ctx.silu(&enc.head_norm.forward(&ctx, &h)?)?)?;
        quant.forward(g, &h)
    }

    /// Builds the decoder pass of latents `z` `[w, h, z_dim, B]` (VAE latents: already
    /// denormalised). Returns images `[w f, h f, input_channels, B]` clamped to [-1, 1] (as
    /// diffusers' `_decode`).
    pub fn decode(&self, g: &mut GraphCtx, z: &GTensor) -> Result<GTensor> {
        let (dec, post) = match (&self.decoder, &self.post_quant_conv) {
            (Some(d), Some(p)) => (d, p),
            _ => return Err(config_err("the decoder was not declared")),
        };
        self.check_input("latent", z, self.config.z_dim, 1)?;
        let ctx = g.ctx.clone();
        // 1. Post-quant conv, conv1.
        let mut h = post.forward(g, z)?;
        h = dec.conv1.forward(g, &h)?;
        // 2. Middle.
        h = dec.middle.forward(g, &h)?;
        g.marks.mark(&h, "decoder.middle", "h")?;
        // 3. The flat list of residual blocks and upsamplers.
        for (i, layer) in dec.layers.iter().enumerate() {
            h = layer.forward(g, &h)?;
            if matches!(layer, Layer::Up(_)) {
                g.marks.mark(&h, &format!("decoder.upsamples.{i}"), "h")?;
            }
        }
        // 4. Head: RMS_norm, SiLU, conv, clamp.
        h = dec
            .head_conv
            .forward(g, &ctx.silu(&dec.head_norm.forward(&ctx, &h)?)?)?;
        Ok(ctx.clamp(&h, -1.0, 1.0)?)
    }
}
