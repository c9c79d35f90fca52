//! AutoencoderKL (the LDM `first_stage_model`): encoder to latent moments, decoder back
//! to pixels.
//!
//! Parameters live under `first_stage_model.` in the original layout: `encoder.conv_in`,
//! `encoder.down.N.block.M.{norm1,conv1,norm2,conv2,nin_shortcut}`,
//! `encoder.down.N.downsample.conv`, `encoder.mid.{block_1,attn_1,block_2}`,
//! `encoder.{norm_out,conv_out}`, `quant_conv`, `post_quant_conv`, and the decoder's
//! mirror with `decoder.up.N.upsample.conv`. The mid-block attention's `q`, `k`, `v` and
//! `proj_out` are `[C, C, 1, 1]` 1x1 convolutions (a file's `[C, C]` linear form is
//! accepted). The latent scaling factor (0.18215 for SD1/SD2) is the caller's business.

use sd_formats::names::VAE_PREFIX;
use sd_tensor::ggml::GTensor;

use crate::nn::{attention, Conv2d, GroupNorm};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// Configuration of an AutoencoderKL (the `ddconfig` of LDM's `first_stage_config`).
///
/// Deserializes from the LDM `ddconfig` key names; missing keys keep the defaults.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VaeConfig {
    /// Image channels (`in_channels`).
    pub in_channels: usize,
    /// Output image channels (`out_ch`).
    pub out_channels: usize,
    /// Base width (`ch`).
    pub ch: usize,
    /// Width multipliers per level (`ch_mult`).
    pub ch_mult: Vec<usize>,
    /// Residual blocks per encoder level (`num_res_blocks`; the decoder has one more).
    pub num_res_blocks: usize,
    /// Latent channels (`z_channels`; `embed_dim` is the same for SD).
    pub z_channels: usize,
    /// Group count of every GroupNorm (32 in LDM).
    pub norm_groups: usize,
    /// GroupNorm epsilon (1e-6 in LDM).
    pub eps: f32,
    /// Whether `quant_conv` / `post_quant_conv` exist (true for SD).
    pub use_quant_conv: bool,
    /// Whether the encoder is declared (false for decode-only use; set by the loader).
    #[serde(skip)]
    pub with_encoder: bool,
    /// Whether the decoder is declared (set by the loader).
    #[serde(skip)]
    pub with_decoder: bool,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl Default for VaeConfig {
    /// SD1.x / SD2.x: `configs/stable-diffusion/v1-inference.yaml` `first_stage_config`
    /// (`ch: 128, ch_mult: [1, 2, 4, 4], num_res_blocks: 2, z_channels: 4, embed_dim: 4`).
    fn default() -> Self {
        VaeConfig {
            in_channels: 3,
            out_channels: 3,
            ch: 128,
            ch_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            z_channels: 4,
            norm_groups: 32,
            eps: 1e-6,
            use_quant_conv: true,
            with_encoder: true,
            with_decoder: true,
            prefix: VAE_PREFIX.trim_end_matches('.').to_string(),
        }
    }
}

impl VaeConfig {
    fn validate(&self) -> Result<()> {
        if self.ch_mult.is_empty() || self.ch == 0 || self.z_channels == 0 {
            return Err(ModelError::Config(format!("VAE config {self:?}")));
        }
        Ok(())
    }

    /// The spatial downsampling factor (8 for SD).
    pub fn downsample_factor(&self) -> usize {
        1 << (self.ch_mult.len() - 1)
    }
}

/// `ResnetBlock` of the autoencoder.
#[derive(Clone, Debug)]
pub struct ResnetBlock {
    /// `norm1`.
    pub norm1: GroupNorm,
    /// `conv1`.
    pub conv1: Conv2d,
    /// `norm2`.
    pub norm2: GroupNorm,
    /// `conv2`.
    pub conv2: Conv2d,
    /// `nin_shortcut` (when the width changes).
    pub nin_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    fn new(pb: &ParamBuilder<'_>, cin: usize, cout: usize, cfg: &VaeConfig) -> Result<Self> {
        Ok(ResnetBlock {
            norm1: GroupNorm::new(&pb.pp("norm1"), cin, cfg.norm_groups, cfg.eps)?,
            conv1: Conv2d::new(&pb.pp("conv1"), cin, cout, 3, 1, 1)?,
            norm2: GroupNorm::new(&pb.pp("norm2"), cout, cfg.norm_groups, cfg.eps)?,
            conv2: Conv2d::new(&pb.pp("conv2"), cout, cout, 3, 1, 1)?,
            nin_shortcut: if cin != cout {
                Some(Conv2d::new(&pb.pp("nin_shortcut"), cin, cout, 1, 1, 0)?)
            } else {
                None
            },
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let h = self.norm1.forward_silu(ctx, x)?;
        let h = self.conv1.forward(g, &h)?;
        let h = self.norm2.forward_silu(ctx, &h)?;
        let h = self.conv2.forward(g, &h)?;
        let skip = match &self.nin_shortcut {
            Some(c) => c.forward(g, x)?,
            None => x.clone(),
        };
        Ok(ctx.add(&skip, &h)?)
    }
}

/// `AttnBlock`: single-head spatial self-attention with 1x1 convolution projections.
#[derive(Clone, Debug)]
pub struct AttnBlock {
    /// `norm`.
    pub norm: GroupNorm,
    /// `q`.
    pub q: Conv2d,
    /// `k`.
    pub k: Conv2d,
    /// `v`.
    pub v: Conv2d,
    /// `proj_out`.
    pub proj_out: Conv2d,
}

impl AttnBlock {
    fn new(pb: &ParamBuilder<'_>, c: usize, cfg: &VaeConfig) -> Result<Self> {
        Ok(AttnBlock {
            norm: GroupNorm::new(&pb.pp("norm"), c, cfg.norm_groups, cfg.eps)?,
            q: Conv2d::new(&pb.pp("q"), c, c, 1, 1, 0)?,
            k: Conv2d::new(&pb.pp("k"), c, c, 1, 1, 0)?,
            v: Conv2d::new(&pb.pp("v"), c, c, 1, 1, 0)?,
            proj_out: Conv2d::new(&pb.pp("proj_out"), c, c, 1, 1, 0)?,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let [w, h, c, b] = x.ne();
        let hn = self.norm.forward(ctx, x)?;
        // [W, H, C, B] -> tokens [C, W*H, B]
        let tokens = |t: &GTensor| -> Result<GTensor> {
            let t = ctx.reshape(t, &[w * h, c, b])?;
            Ok(ctx.cont(&ctx.transpose(&t)?)?)
        };
        let q = tokens(&self.q.forward(g, &hn)?)?;
        let k = tokens(&self.k.forward(g, &hn)?)?;
        let v = tokens(&self.v.forward(g, &hn)?)?;
        let o = attention(g, &q, &k, &v, 1, None)?; // [C, W*H, B]
        let o = ctx.cont(&ctx.transpose(&o)?)?;
        let o = ctx.reshape(&o, &[w, h, c, b])?;
        Ok(ctx.add(x, &self.proj_out.forward(g, &o)?)?)
    }
}

/// `mid`: resnet, attention, resnet.
#[derive(Clone, Debug)]
pub struct MidBlock {
    /// `block_1`.
    pub block_1: ResnetBlock,
    /// `attn_1`.
    pub attn_1: AttnBlock,
    /// `block_2`.
    pub block_2: ResnetBlock,
}

impl MidBlock {
    fn new(pb: &ParamBuilder<'_>, c: usize, cfg: &VaeConfig) -> Result<Self> {
        Ok(MidBlock {
            block_1: ResnetBlock::new(&pb.pp("block_1"), c, c, cfg)?,
            attn_1: AttnBlock::new(&pb.pp("attn_1"), c, cfg)?,
            block_2: ResnetBlock::new(&pb.pp("block_2"), c, c, cfg)?,
        })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let h = self.block_1.forward(g, x)?;
        let h = self.attn_1.forward(g, &h)?;
        self.block_2.forward(g, &h)
    }
}

/// `encoder.down.N`.
#[derive(Clone, Debug)]
pub struct DownLevel {
    /// `block.M`.
    pub block: Vec<ResnetBlock>,
    /// `downsample.conv` (3x3, stride 2, after padding right and bottom by one).
    pub downsample: Option<Conv2d>,
}

/// `decoder.up.N`.
#[derive(Clone, Debug)]
pub struct UpLevel {
    /// `block.M`.
    pub block: Vec<ResnetBlock>,
    /// `upsample.conv` (after 2x nearest upsampling).
    pub upsample: Option<Conv2d>,
}

/// `encoder`.
#[derive(Clone, Debug)]
pub struct Encoder {
    /// `conv_in`.
    pub conv_in: Conv2d,
    /// `down.N`.
    pub down: Vec<DownLevel>,
    /// `mid`.
    pub mid: MidBlock,
    /// `norm_out`.
    pub norm_out: GroupNorm,
    /// `conv_out` (to `2 * z_channels`: mean and log-variance).
    pub conv_out: Conv2d,
}

/// `decoder`.
#[derive(Clone, Debug)]
pub struct Decoder {
    /// `conv_in`.
    pub conv_in: Conv2d,
    /// `mid`.
    pub mid: MidBlock,
    /// `up.N` (index = level; run from the last level down to 0).
    pub up: Vec<UpLevel>,
    /// `norm_out`.
    pub norm_out: GroupNorm,
    /// `conv_out`.
    pub conv_out: Conv2d,
}

/// The autoencoder.
#[derive(Clone, Debug)]
pub struct AutoencoderKl {
    /// Configuration.
    pub config: VaeConfig,
    /// `encoder` (if configured).
    pub encoder: Option<Encoder>,
    /// `decoder` (if configured).
    pub decoder: Option<Decoder>,
    /// `quant_conv` (moments to moments, 1x1).
    pub quant_conv: Option<Conv2d>,
    /// `post_quant_conv` (latent to latent, 1x1).
    pub post_quant_conv: Option<Conv2d>,
}

impl AutoencoderKl {
    /// Declares the parameters under `config.prefix` of `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: VaeConfig) -> Result<Self> {
        config.validate()?;
        let cfg = &config;
        let pb = pb.pp(&cfg.prefix);
        let levels = cfg.ch_mult.len();
        let top = cfg.ch * cfg.ch_mult[levels - 1];
        let z2 = 2 * cfg.z_channels;

        let encoder = if cfg.with_encoder {
            let e = pb.pp("encoder");
            let mut down = Vec::with_capacity(levels);
            let mut cin = cfg.ch;
            for (i, &m) in cfg.ch_mult.iter().enumerate() {
                let d = e.pp(format!("down.{i}"));
                let cout = cfg.ch * m;
                let mut block = Vec::with_capacity(cfg.num_res_blocks);
                for j in 0..cfg.num_res_blocks {
                    block.push(ResnetBlock::new(
                        &d.pp(format!("block.{j}")),
                        cin,
                        cout,
                        cfg,
                    )?);
                    cin = cout;
                }
                let downsample = if i + 1 != levels {
                    Some(Conv2d::new(&d.pp("downsample.conv"), cout, cout, 3, 2, 0)?)
                } else {
                    None
                };
                down.push(DownLevel { block, downsample });
            }
            Some(Encoder {
                conv_in: Conv2d::new(&e.pp("conv_in"), cfg.in_channels, cfg.ch, 3, 1, 1)?,
                down,
                mid: MidBlock::new(&e.pp("mid"), top, cfg)?,
                norm_out: GroupNorm::new(&e.pp("norm_out"), top, cfg.norm_groups, cfg.eps)?,
                conv_out: Conv2d::new(&e.pp("conv_out"), top, z2, 3, 1, 1)?,
            })
        } else {
            None
        };

        let decoder = if cfg.with_decoder {
            let d = pb.pp("decoder");
            let mut up: Vec<Option<UpLevel>> = vec![None; levels];
            let mut cin = top;
            for i in (0..levels).rev() {
                let u = d.pp(format!("up.{i}"));
                let cout = cfg.ch * cfg.ch_mult[i];
                let mut block = Vec::with_capacity(cfg.num_res_blocks + 1);
                for j in 0..=cfg.num_res_blocks {
                    block.push(ResnetBlock::new(
                        &u.pp(format!("block.{j}")),
                        cin,
                        cout,
                        cfg,
                    )?);
                    cin = cout;
                }
                let upsample = if i != 0 {
                    Some(Conv2d::new(&u.pp("upsample.conv"), cout, cout, 3, 1, 1)?)
                } else {
                    None
                };
                up[i] = Some(UpLevel { block, upsample });
            }
            let bottom = cfg.ch * cfg.ch_mult[0];
            Some(Decoder {
                conv_in: Conv2d::new(&d.pp("conv_in"), cfg.z_channels, top, 3, 1, 1)?,
                mid: MidBlock::new(&d.pp("mid"), top, cfg)?,
                up: up.into_iter().flatten().collect(),
                norm_out: GroupNorm::new(&d.pp("norm_out"), bottom, cfg.norm_groups, cfg.eps)?,
                conv_out: Conv2d::new(&d.pp("conv_out"), bottom, cfg.out_channels, 3, 1, 1)?,
            })
        } else {
            None
        };

        let (quant_conv, post_quant_conv) = if cfg.use_quant_conv {
            (
                if cfg.with_encoder {
                    Some(Conv2d::new(&pb.pp("quant_conv"), z2, z2, 1, 1, 0)?)
                } else {
                    None
                },
                if cfg.with_decoder {
                    Some(Conv2d::new(
                        &pb.pp("post_quant_conv"),
                        cfg.z_channels,
                        cfg.z_channels,
                        1,
                        1,
                        0,
                    )?)
                } else {
                    None
                },
            )
        } else {
            (None, None)
        };
        Ok(AutoencoderKl {
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
            || n[3] == 0
            || !n[0].is_multiple_of(align)
            || !n[1].is_multiple_of(align)
            || n[0] == 0
            || n[1] == 0
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

    /// Builds the encoder pass of images `x` `[W, H, in_channels, B]` (W and H multiples of
    /// the downsampling factor). Returns the moments `[W/f, H/f, 2 * z_channels, B]`: mean
    /// then log-variance along the channels (unclamped; sampling is the caller's).
    pub fn encode(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        let enc = self
            .encoder
            .as_ref()
            .ok_or_else(|| ModelError::Config("the encoder was not declared".into()))?;
        self.check_input(
            "image",
            x,
            self.config.in_channels,
            self.config.downsample_factor(),
        )?;
        let ctx = g.ctx.clone();
        // 1. conv_in.
        let mut h = enc.conv_in.forward(g, x)?;
        // 2. Down levels.
        for (i, level) in enc.down.iter().enumerate() {
            for block in &level.block {
                h = block.forward(g, &h)?;
            }
            if let Some(ds) = &level.downsample {
                h = ds.forward(g, &ctx.pad(&h, [1, 1, 0, 0])?)?;
            }
            g.marks.mark(&h, &format!("encoder.down.{i}"), "h")?;
        }
        // 3. Mid block.
        h = enc.mid.forward(g, &h)?;
        g.marks.mark(&h, "encoder.mid", "h")?;
        // 4. Output: GroupNorm, SiLU, conv_out, quant_conv.
        h = enc
            .conv_out
            .forward(g, &enc.norm_out.forward_silu(&ctx, &h)?)?;
        if let Some(q) = &self.quant_conv {
            h = q.forward(g, &h)?;
        }
        Ok(h)
    }

    /// Builds the decoder pass of latents `z` `[w, h, z_channels, B]` (already divided by
    /// the scaling factor). Returns images `[w*f, h*f, out_channels, B]` in about [-1, 1].
    pub fn decode(&self, g: &mut GraphCtx, z: &GTensor) -> Result<GTensor> {
        let dec = self
            .decoder
            .as_ref()
            .ok_or_else(|| ModelError::Config("the decoder was not declared".into()))?;
        self.check_input("latent", z, self.config.z_channels, 1)?;
        let ctx = g.ctx.clone();
        // 1. post_quant_conv, conv_in.
        let mut h = match &self.post_quant_conv {
            Some(p) => p.forward(g, z)?,
            None => z.clone(),
        };
        h = dec.conv_in.forward(g, &h)?;
        // 2. Mid block.
        h = dec.mid.forward(g, &h)?;
        g.marks.mark(&h, "decoder.mid", "h")?;
        // 3. Up levels, deepest first.
        for (i, level) in dec.up.iter().enumerate().rev() {
            for block in &level.block {
                h = block.forward(g, &h)?;
            }
            if let Some(us) = &level.upsample {
                h = us.forward(g, &ctx.upscale(&h, 2)?)?;
            }
            if i != 0 {
                g.marks.mark(&h, &format!("decoder.up.{i}"), "h")?;
            }
        }
        // 4. Output: GroupNorm, SiLU, conv_out.
        dec.conv_out
            .forward(g, &dec.norm_out.forward_silu(&ctx, &h)?)
    }
}
