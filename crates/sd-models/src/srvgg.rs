//! Real-ESRGAN's compact network, `SRVGGNetCompact` (realesr-general-x4v3,
//! realesr-animevideov3).
//!
//! Parameters: `body.0` (3x3 convolution, input to features), `body.1` (PReLU slopes), then
//! `num_conv` pairs `body.{2k}` convolution / `body.{2k+1}` PReLU, and the last convolution
//! `body.{2 num_conv + 2}` to `out * scale^2` channels, pixel-shuffled; the nearest-upsampled
//! input is added (the network learns the residual).

use sd_formats::files::TensorCatalog;
use sd_tensor::ggml::{GTensor, Interpolation};

use crate::esrgan::seq_len;
use crate::nn::{pixel_shuffle, Conv2d, PRelu};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// Configuration of an SRVGGNetCompact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactConfig {
    /// Input channels (`num_in_ch`).
    pub in_channels: usize,
    /// Output channels (`num_out_ch`).
    pub out_channels: usize,
    /// Feature width (`num_feat`).
    pub num_feat: usize,
    /// Body convolutions (`num_conv`).
    pub num_conv: usize,
    /// Scale (`upscale`).
    pub scale: usize,
}

impl Default for CompactConfig {
    /// realesr-general-x4v3 (`SRVGGNetCompact(num_in_ch=3, num_out_ch=3, num_feat=64,
    /// num_conv=32, upscale=4, act_type='prelu')`).
    fn default() -> Self {
        CompactConfig {
            in_channels: 3,
            out_channels: 3,
            num_feat: 64,
            num_conv: 32,
            scale: 4,
        }
    }
}

impl CompactConfig {
    /// Reads the configuration from a catalog (spandrel's `CompactArch` rules; the scale and
    /// output channels solve `scale^2 * out = channels of the last convolution`, trying the
    /// input channels, then 3, 4, 1).
    pub fn detect(catalog: &TensorCatalog) -> Result<Self> {
        let first = catalog
            .get("body.0.weight")
            .ok_or_else(|| ModelError::MissingTensor {
                name: "body.0.weight".into(),
            })?
            .shape
            .clone();
        if first.len() != 4 {
            return Err(ModelError::Config(format!(
                "Compact: body.0.weight has shape {first:?}"
            )));
        }
        let highest = seq_len(catalog, "body.", ".").saturating_sub(1);
        if highest < 2 || !highest.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "Compact: last body layer {highest} is not 2 * num_conv + 2"
            )));
        }
        let last_bias = format!("body.{highest}.bias");
        let shuffled = catalog
            .get(&last_bias)
            .ok_or(ModelError::MissingTensor { name: last_bias })?
            .shape
            .first()
            .copied()
            .unwrap_or(0) as usize;
        let in_channels = first[1] as usize;
        let (scale, out_channels) = [in_channels, 3, 4, 1]
            .into_iter()
            .find_map(|c| {
                if c == 0 || !shuffled.is_multiple_of(c) {
                    return None;
                }
                let s = (shuffled / c).isqrt();
                (s * s == shuffled / c && s > 0).then_some((s, c))
            })
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "Compact: {shuffled} channels before the pixel shuffle are not scale^2 \
                     times 1, 3 or 4 outputs"
                ))
            })?;
        Ok(CompactConfig {
            in_channels,
            out_channels,
            num_feat: first[0] as usize,
            num_conv: (highest - 2) / 2,
            scale,
        })
    }
}

/// The compact network.
#[derive(Clone, Debug)]
pub struct Compact {
    /// Configuration.
    pub config: CompactConfig,
    /// `body.{2k}`: the convolutions, first and last included.
    pub convs: Vec<Conv2d>,
    /// `body.{2k+1}`: the activations after every convolution but the last.
    pub acts: Vec<PRelu>,
}

impl Compact {
    /// Declares the parameters (f32) under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: CompactConfig) -> Result<Self> {
        let c = &config;
        if c.num_feat == 0 || c.scale == 0 || c.in_channels == 0 || c.out_channels == 0 {
            return Err(ModelError::Config(format!("Compact config {c:?}")));
        }
        let nf = c.num_feat;
        let mut convs = Vec::with_capacity(c.num_conv + 2);
        let mut acts = Vec::with_capacity(c.num_conv + 1);
        for k in 0..=c.num_conv {
            let cin = if k == 0 { c.in_channels } else { nf };
            convs.push(Conv2d::new_f32(
                &pb.pp(format!("body.{}", 2 * k)),
                cin,
                nf,
                3,
                1,
                1,
                true,
            )?);
            acts.push(PRelu::new(&pb.pp(format!("body.{}", 2 * k + 1)), nf)?);
        }
        convs.push(Conv2d::new_f32(
            &pb.pp(format!("body.{}", 2 * c.num_conv + 2)),
            nf,
            c.out_channels * c.scale * c.scale,
            3,
            1,
            1,
            true,
        )?);
        Ok(Compact {
            config,
            convs,
            acts,
        })
    }

    /// Builds the forward pass of `x` `[W, H, in_channels, N]`; returns
    /// `[W * s, H * s, out_channels, N]`.
    pub fn forward(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        let c = &self.config;
        let n = x.ne();
        if n[2] != c.in_channels {
            return Err(ModelError::Input {
                name: "image",
                detail: format!("{n:?}, expected [W, H, {}, N]", c.in_channels),
            });
        }
        if c.out_channels != c.in_channels {
            return Err(ModelError::Config(format!(
                "Compact: the residual adds the {}-channel input to {} output channels",
                c.in_channels, c.out_channels
            )));
        }
        let ctx = g.ctx.clone();
        // 1. Convolutions with PReLU.
        let mut h = x.clone();
        for (i, (conv, act)) in self.convs.iter().zip(&self.acts).enumerate() {
            h = act.forward(&ctx, &conv.forward(g, &h)?)?;
            if i % 8 == 7 {
                g.marks.mark(&h, &format!("body.{}", 2 * i + 1), "h")?;
            }
        }
        // 2. Last convolution and pixel shuffle.
        let last = self.convs.last().expect("at least one convolution");
        let h = pixel_shuffle(&ctx, &last.forward(g, &h)?, c.scale)?;
        // 3. Plus the nearest-upsampled input.
        let base = ctx.interpolate(x, n[0] * c.scale, n[1] * c.scale, Interpolation::Nearest)?;
        Ok(ctx.add(&h, &base)?)
    }
}
