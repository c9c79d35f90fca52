//! MoSR ("MambaOut super-resolution"), as spandrel 0.4's `MoSR` architecture.
//!
//! Parameters: `gblocks.0` (3x3 convolution, input to `dim`), `gblocks.1..=n` gated CNN
//! blocks (`norm` channel LayerNorm, `fc1` 3x3 to `2 * hidden`, `conv` depthwise `k` x `k`
//! over the last `conv_ch` channels, `fc2` 3x3 back to `dim`), then `gblocks.{n+1}` (3x3,
//! `dim` to `2 dim`), Mish, `gblocks.{n+3}` (3x3 back), Mish, `gblocks.{n+5}` (1x1); a
//! `shortcut` ConvBlock (`block.0`, Mish, `block.2`, Mish, plus `conv11` 1x1) from the input;
//! and the upsampler: `upsampler.0` + pixel shuffle (`ps`) or `upsampler.in_to_k` averaged
//! over 8 groups + pixel shuffle (`gps`). The DySample upsampler (`dys`, `grid_sample`) is not
//! supported.

use sd_formats::files::TensorCatalog;
use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::esrgan::seq_len;
use crate::nn::{contiguous, mish, pixel_shuffle, Conv2d};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, HostData, ModelError, Result};

/// Epsilon of the channel LayerNorm (spandrel `mosr_arch.LayerNorm`, 1e-6).
pub const NORM_EPS: f32 = 1e-6;
/// Groups averaged by the geo-ensemble pixel shuffle (`GPS`).
pub const GPS_GROUPS: usize = 8;

/// The upsampler of a MoSR network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MosrUpsampler {
    /// Convolution then pixel shuffle (`ps`).
    PixelShuffle,
    /// Geo-ensemble pixel shuffle (`gps`): convolution to 8 groups, their mean, pixel
    /// shuffle.
    GeoEnsemble,
}

/// Configuration of a MoSR network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MosrConfig {
    /// Input (and output) channels (`in_ch`).
    pub in_channels: usize,
    /// Scale (`upscale`).
    pub scale: usize,
    /// Gated blocks (`n_block`).
    pub n_block: usize,
    /// Width (`dim`).
    pub dim: usize,
    /// Hidden width of a gated block (`int(expansion_ratio * dim)`).
    pub hidden: usize,
    /// Channels of the depthwise convolution (`int(conv_ratio * dim)`).
    pub conv_channels: usize,
    /// Depthwise kernel size (`kernel_size`).
    pub kernel_size: usize,
    /// Upsampler.
    pub upsampler: MosrUpsampler,
    /// Kernel size of the upsampler's convolution (3).
    pub upsampler_kernel: usize,
}

impl Default for MosrConfig {
    /// spandrel `MoSR()` defaults: `in_ch=3, upscale=4, n_block=24, dim=64, upsampler="ps",
    /// kernel_size=7, expansion_ratio=1.5, conv_ratio=1.0`.
    fn default() -> Self {
        MosrConfig {
            in_channels: 3,
            scale: 4,
            n_block: 24,
            dim: 64,
            hidden: 96,
            conv_channels: 64,
            kernel_size: 7,
            upsampler: MosrUpsampler::PixelShuffle,
            upsampler_kernel: 3,
        }
    }
}

fn shape(catalog: &TensorCatalog, name: &str, dims: usize) -> Result<Vec<usize>> {
    let t = catalog.get(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.to_string(),
    })?;
    if t.shape.len() != dims {
        return Err(ModelError::Config(format!(
            "MoSR: `{name}` has shape {:?}, expected {dims} dimensions",
            t.shape
        )));
    }
    Ok(t.shape.iter().map(|&d| d as usize).collect())
}

impl MosrConfig {
    /// Reads the configuration from a catalog (spandrel's `MoSRArch` rules).
    pub fn detect(catalog: &TensorCatalog) -> Result<Self> {
        let n_block = seq_len(catalog, "gblocks.", ".")
            .checked_sub(6)
            .ok_or_else(|| ModelError::Config("MoSR: fewer than 6 `gblocks` layers".into()))?;
        let first = shape(catalog, "gblocks.0.weight", 4)?;
        let fc1 = shape(catalog, "gblocks.1.fc1.weight", 4)?;
        let conv = shape(catalog, "gblocks.1.conv.weight", 4)?;
        let (dim, in_channels) = (first[0], first[1]);
        if catalog.get("upsampler.init_pos").is_some() {
            return Err(ModelError::Config(
                "MoSR with the DySample upsampler (`upsampler.init_pos`) is not supported".into(),
            ));
        }
        let (upsampler, up, per_scale) = if catalog.get("upsampler.in_to_k.weight").is_some() {
            let s = shape(catalog, "upsampler.in_to_k.weight", 4)?;
            (MosrUpsampler::GeoEnsemble, s, GPS_GROUPS * in_channels)
        } else {
            let s = shape(catalog, "upsampler.0.weight", 4)?;
            (MosrUpsampler::PixelShuffle, s, in_channels)
        };
        let scale = (up[0] / per_scale.max(1)).isqrt();
        if scale == 0 || scale * scale * per_scale != up[0] {
            return Err(ModelError::Config(format!(
                "MoSR: the upsampler's {} channels are not scale^2 * {per_scale}",
                up[0]
            )));
        }
        Ok(MosrConfig {
            in_channels,
            scale,
            n_block,
            dim,
            hidden: fc1[0] / 2,
            conv_channels: conv[0],
            kernel_size: conv[2],
            upsampler,
            upsampler_kernel: up[2],
        })
    }
}

/// Channel LayerNorm of a `[W, H, C, N]` tensor.
#[derive(Clone, Debug)]
pub struct ChannelNorm {
    /// Scale `[C]`.
    pub weight: GTensor,
    /// Shift `[C]`.
    pub bias: GTensor,
}

impl ChannelNorm {
    fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        // [W, H, C, N] -> [C, W, H, N], normalise over C, and back.
        let t = ctx.cont(&ctx.permute(x, [1, 2, 0, 3])?)?;
        let t = ctx.norm(&t, NORM_EPS)?;
        let t = ctx.add(&ctx.mul(&t, &self.weight)?, &self.bias)?;
        Ok(ctx.cont(&ctx.permute(&t, [2, 0, 1, 3])?)?)
    }
}

/// Channels `[from, from + len)` of a contiguous `[W, H, C, N]` tensor.
fn channels(ctx: &Context, x: &GTensor, from: usize, len: usize) -> Result<GTensor> {
    let ne = x.ne();
    let nb = x.nb();
    let v = ctx.view(
        x,
        [ne[0], ne[1], len, ne[3]],
        [nb[1], nb[2], nb[3]],
        from * nb[2],
    )?;
    contiguous(ctx, &v)
}

/// `GatedCNNBlock`.
#[derive(Clone, Debug)]
pub struct GatedBlock {
    /// `norm`.
    pub norm: ChannelNorm,
    /// `fc1`.
    pub fc1: Conv2d,
    /// `conv` (depthwise), kernel `[k, k, 1, conv_channels]`.
    pub conv_weight: GTensor,
    /// `conv.bias`.
    pub conv_bias: GTensor,
    /// `fc2`.
    pub fc2: Conv2d,
    hidden: usize,
    conv_channels: usize,
    kernel_size: usize,
}

impl GatedBlock {
    fn new(pb: &ParamBuilder<'_>, c: &MosrConfig) -> Result<Self> {
        let (dim, hidden, cc, k) = (c.dim, c.hidden, c.conv_channels, c.kernel_size);
        if cc > hidden || k.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "MoSR: {cc} conv channels of {hidden} hidden, kernel {k}"
            )));
        }
        Ok(GatedBlock {
            norm: ChannelNorm {
                weight: pb.tensor_f32("norm.weight", &[dim])?,
                bias: pb.tensor_f32("norm.bias", &[dim])?,
            },
            fc1: Conv2d::new_f32(&pb.pp("fc1"), dim, 2 * hidden, 3, 1, 1, true)?,
            conv_weight: pb.tensor_f32("conv.weight", &[cc, 1, k, k])?,
            conv_bias: pb.tensor_f32("conv.bias", &[cc])?,
            fc2: Conv2d::new_f32(&pb.pp("fc2"), hidden, dim, 3, 1, 1, true)?,
            hidden,
            conv_channels: cc,
            kernel_size: k,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor, minus_half: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let (hidden, cc) = (self.hidden, self.conv_channels);
        // 1. Norm and fc1, split into gate g, identity i and convolved c.
        let f = self.fc1.forward(g, &self.norm.forward(ctx, x)?)?;
        let gate = channels(ctx, &f, 0, hidden)?;
        let conv_in = channels(ctx, &f, 2 * hidden - cc, cc)?;
        // 2. Depthwise convolution of c.
        let p = self.kernel_size / 2;
        let c = ctx.conv_2d_dw_direct(&self.conv_weight, &conv_in, (1, 1), (p, p), (1, 1))?;
        let c = ctx.add(&c, &ctx.reshape(&self.conv_bias, &[1, 1, cc, 1])?)?;
        let ic = if hidden > cc {
            ctx.concat(&channels(ctx, &f, hidden, hidden - cc)?, &c, 2)?
        } else {
            c
        };
        // 3. Gating, fc2, Mish, residual minus one half.
        let y = ctx.mul(&mish(ctx, &gate)?, &ic)?;
        let y = mish(ctx, &self.fc2.forward(g, &y)?)?;
        Ok(ctx.add(&y, &ctx.add(x, minus_half)?)?)
    }
}

/// The MoSR network.
#[derive(Clone, Debug)]
pub struct Mosr {
    /// Configuration.
    pub config: MosrConfig,
    /// `gblocks.0`.
    pub conv_in: Conv2d,
    /// `gblocks.1..=n`.
    pub blocks: Vec<GatedBlock>,
    /// `gblocks.{n+1}`, `gblocks.{n+3}`, `gblocks.{n+5}`.
    pub tail: [Conv2d; 3],
    /// `shortcut.block.0`, `shortcut.block.2`, `shortcut.conv11`.
    pub shortcut: [Conv2d; 3],
    /// `upsampler.0` or `upsampler.in_to_k`.
    pub up: Conv2d,
}

impl Mosr {
    /// Declares the parameters (f32) under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: MosrConfig) -> Result<Self> {
        let c = &config;
        if c.dim == 0 || c.in_channels == 0 || c.scale == 0 || c.hidden == 0 {
            return Err(ModelError::Config(format!("MoSR config {c:?}")));
        }
        let (n, d, inc) = (c.n_block, c.dim, c.in_channels);
        let gb = |i: usize| pb.pp(format!("gblocks.{i}"));
        let mut blocks = Vec::with_capacity(n);
        for i in 1..=n {
            blocks.push(GatedBlock::new(&gb(i), c)?);
        }
        let (up_name, up_out) = match c.upsampler {
            MosrUpsampler::PixelShuffle => ("upsampler.0", inc * c.scale * c.scale),
            MosrUpsampler::GeoEnsemble => {
                ("upsampler.in_to_k", GPS_GROUPS * inc * c.scale * c.scale)
            }
        };
        let uk = c.upsampler_kernel;
        Ok(Mosr {
            conv_in: Conv2d::new_f32(&gb(0), inc, d, 3, 1, 1, true)?,
            blocks,
            tail: [
                Conv2d::new_f32(&gb(n + 1), d, 2 * d, 3, 1, 1, true)?,
                Conv2d::new_f32(&gb(n + 3), 2 * d, d, 3, 1, 1, true)?,
                Conv2d::new_f32(&gb(n + 5), d, d, 1, 1, 0, true)?,
            ],
            shortcut: [
                Conv2d::new_f32(&pb.pp("shortcut.block.0"), inc, d, 3, 1, 1, true)?,
                Conv2d::new_f32(&pb.pp("shortcut.block.2"), d, d, 3, 1, 1, true)?,
                Conv2d::new_f32(&pb.pp("shortcut.conv11"), inc, d, 1, 1, 0, true)?,
            ],
            up: Conv2d::new_f32(&pb.pp(up_name), d, up_out, uk, 1, uk / 2, true)?,
            config,
        })
    }

    /// Builds the forward pass of `x` `[W, H, in_channels, N]`; returns
    /// `[W * s, H * s, in_channels, N]`.
    pub fn forward(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        let c = &self.config;
        let n = x.ne();
        if n[2] != c.in_channels {
            return Err(ModelError::Input {
                name: "image",
                detail: format!("{n:?}, expected [W, H, {}, N]", c.in_channels),
            });
        }
        let minus_half = g.aux_input(
            "mosr.minus_half",
            DType::F32,
            &[1],
            HostData::F32(vec![-0.5]),
        )?;
        let ctx = g.ctx.clone();
        // 1. Gated blocks.
        let mut h = self.conv_in.forward(g, x)?;
        for (i, b) in self.blocks.iter().enumerate() {
            h = b.forward(g, &h, &minus_half)?;
            g.marks.mark(&h, &format!("gblocks.{}", i + 1), "h")?;
        }
        // 2. Tail convolutions.
        h = mish(&ctx, &self.tail[0].forward(g, &h)?)?;
        h = mish(&ctx, &self.tail[1].forward(g, &h)?)?;
        h = self.tail[2].forward(g, &h)?;
        // 3. Shortcut from the input, minus one half.
        let s = mish(&ctx, &self.shortcut[0].forward(g, x)?)?;
        let s = mish(&ctx, &self.shortcut[1].forward(g, &s)?)?;
        let s = ctx.add(&s, &self.shortcut[2].forward(g, x)?)?;
        let h = ctx.add(&h, &ctx.add(&s, &minus_half)?)?;
        // 4. Upsampler.
        let y = self.up.forward(g, &h)?;
        let y = match c.upsampler {
            MosrUpsampler::PixelShuffle => y,
            MosrUpsampler::GeoEnsemble => {
                let m = c.in_channels * c.scale * c.scale;
                let mut acc = channels(&ctx, &y, 0, m)?;
                for k in 1..GPS_GROUPS {
                    acc = ctx.add(&acc, &channels(&ctx, &y, k * m, m)?)?;
                }
                ctx.scale(&acc, 1.0 / GPS_GROUPS as f32)?
            }
        };
        pixel_shuffle(&ctx, &y, c.scale)
    }
}
