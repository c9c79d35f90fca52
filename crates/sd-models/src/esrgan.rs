//! ESRGAN's RRDBNet (ESRGAN, Real-ESRGAN x4plus / x2plus / anime 6B, BSRGAN, ESRGAN+).
//!
//! Parameters use Real-ESRGAN's (BasicSR `RRDBNet`) names: `conv_first`,
//! `body.N.rdbR.convC` (`R` in 1..=3, `C` in 1..=5; ESRGAN+ adds `body.N.rdbR.conv1x1`),
//! `conv_body`, `conv_upK` (one per 2x step), `conv_hr`, `conv_last`. Files in the original
//! ESRGAN layout (`model.0`, `model.1.sub.N.RDBR.convC.0`, `model.1.sub.<nb>`, `model.3`,
//! `model.6`, ..., as spandrel's `RRDBNet` keeps them) and the BSRGAN layout
//! (`RRDB_trunk.N.RDBR.convC`, `trunk_conv`, `upconvK`, `HRconv`) are renamed by
//! [`to_canonical_names`].
//!
//! Real-ESRGAN x2plus (and x1 models) feed the network a pixel-unshuffled input: 12 (or 48)
//! input channels for 3 output channels; the network then upsamples 4x, so the image scale
//! is 4 / shuffle factor (spandrel's rule).

use sd_formats::files::TensorCatalog;
use sd_tensor::ggml::GTensor;

use crate::nn::{pixel_unshuffle, Conv2d};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// Negative slope of every LeakyReLU of the network (spandrel `block.act`, BasicSR).
pub const LEAKY_SLOPE: f32 = 0.2;
/// Weight of the residual branches (`x5 * 0.2 + x`, `out * 0.2 + x`).
pub const RESIDUAL_SCALE: f32 = 0.2;

/// Configuration of an RRDBNet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EsrganConfig {
    /// Channels the network's first convolution takes (`in_nc`; 12 for x2plus).
    pub in_channels: usize,
    /// Output channels (`out_nc`).
    pub out_channels: usize,
    /// Feature width (`num_feat` / `nf`).
    pub num_filters: usize,
    /// RRDB blocks (`num_block`).
    pub num_blocks: usize,
    /// Growth width of the dense blocks (`num_grow_ch` / `gc`).
    pub growth: usize,
    /// 2x nearest-upsample + convolution steps (log2 of the network's scale).
    pub num_upsamples: usize,
    /// ESRGAN+ extra 1x1 paths (`conv1x1`).
    pub plus: bool,
    /// Pixel-unshuffle factor of the input (2 for x2plus, 4 for x1), if any.
    pub shuffle_factor: Option<usize>,
}

impl Default for EsrganConfig {
    /// Real-ESRGAN `RealESRGAN_x4plus` (`RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64,
    /// num_block=23, num_grow_ch=32, scale=4)`).
    fn default() -> Self {
        EsrganConfig {
            in_channels: 3,
            out_channels: 3,
            num_filters: 64,
            num_blocks: 23,
            growth: 32,
            num_upsamples: 2,
            plus: false,
            shuffle_factor: None,
        }
    }
}

impl EsrganConfig {
    /// Image scale: the network's `2^num_upsamples` divided by the shuffle factor.
    pub fn scale(&self) -> usize {
        (1 << self.num_upsamples) / self.shuffle_factor.unwrap_or(1)
    }

    /// Channels of the input image (`in_channels` before unshuffling).
    pub fn image_channels(&self) -> usize {
        let f = self.shuffle_factor.unwrap_or(1);
        self.in_channels / (f * f)
    }

    /// Reads the configuration from a catalog in canonical names (spandrel's `ESRGANArch`
    /// rules: widths from `conv_first`, blocks and upsamplers counted, unshuffling when the
    /// input has 4 or 16 times the output channels).
    pub fn detect(catalog: &TensorCatalog) -> Result<Self> {
        let shape = |name: &str| -> Result<Vec<u64>> {
            catalog
                .get(name)
                .map(|t| t.shape.clone())
                .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
        };
        let first = shape("conv_first.weight")?;
        let last = shape("conv_last.weight")?;
        let grow = shape("body.0.rdb1.conv1.weight")?;
        if first.len() != 4 || last.len() != 4 || grow.len() != 4 {
            return Err(ModelError::Config(format!(
                "ESRGAN: convolution kernels must be 4-D (conv_first {first:?}, conv_last \
                 {last:?}, body.0.rdb1.conv1 {grow:?})"
            )));
        }
        let in_channels = first[1] as usize;
        let out_channels = last[0] as usize;
        let shuffle_factor = if in_channels == out_channels * 4 {
            Some(2)
        } else if in_channels == out_channels * 16 {
            Some(4)
        } else {
            None
        };
        // `conv_upK` counts from 1.
        let num_upsamples = seq_len(catalog, "conv_up", "").saturating_sub(1);
        if num_upsamples > 3 {
            return Err(ModelError::Config(format!(
                "ESRGAN: {num_upsamples} upsampling steps (scale {}) is not supported",
                1 << num_upsamples
            )));
        }
        Ok(EsrganConfig {
            in_channels,
            out_channels,
            num_filters: first[0] as usize,
            num_blocks: seq_len(catalog, "body.", "."),
            growth: grow[0] as usize,
            num_upsamples,
            plus: catalog.get("body.0.rdb1.conv1x1.weight").is_some(),
            shuffle_factor,
        })
    }
}

/// Number of entries `prefix<i><sep>...` (1 + the largest `i`), as spandrel's `get_seq_len`.
pub(crate) fn seq_len(catalog: &TensorCatalog, prefix: &str, sep: &str) -> usize {
    catalog
        .names_with_prefix(prefix)
        .filter_map(|n| {
            let rest = &n[prefix.len()..];
            let end = if sep.is_empty() {
                rest.find('.')
            } else {
                rest.find(sep)
            }?;
            rest[..end].parse::<usize>().ok()
        })
        .max()
        .map_or(0, |m| m + 1)
}

/// Renames an original-ESRGAN (`model.N...`) or BSRGAN (`RRDB_trunk...`) catalog to the
/// Real-ESRGAN names this module uses. Catalogs already in those names are left alone.
pub fn to_canonical_names(catalog: &mut TensorCatalog) -> Result<()> {
    if catalog.get("model.0.weight").is_some() {
        // Old arch: model.0 conv, model.1 shortcut (RRDBs then the trunk conv), then per 2x
        // step [upsample, conv, lrelu], then conv_hr, lrelu, conv_last.
        let seq = seq_len(catalog, "model.", "");
        if seq < 5 || !(seq - 5).is_multiple_of(3) {
            return Err(ModelError::Config(format!(
                "ESRGAN: `model.*` has {seq} layers, not 5 + 3 per 2x step"
            )));
        }
        let ups = (seq - 5) / 3;
        let nb = seq_len(catalog, "model.1.sub.", ".").saturating_sub(1);
        let (hr, last) = (3 * ups + 2, 3 * ups + 4);
        catalog.rename(|t| {
            let mut t = t.clone();
            if let Some(new) = old_arch_name(&t.name, nb, ups, hr, last) {
                t.name = new;
            }
            vec![t]
        })?;
    } else if catalog.get("RRDB_trunk.0.RDB1.conv1.weight").is_some() {
        catalog.rename(|t| {
            let mut t = t.clone();
            if let Some(new) = bsrgan_name(&t.name) {
                t.name = new;
            }
            vec![t]
        })?;
    }
    Ok(())
}

fn old_arch_name(name: &str, nb: usize, ups: usize, hr: usize, last: usize) -> Option<String> {
    let rest = name.strip_prefix("model.")?;
    let (idx, tail) = rest.split_once('.')?;
    let idx: usize = idx.parse().ok()?;
    match idx {
        0 => Some(format!("conv_first.{tail}")),
        1 => {
            let sub = tail.strip_prefix("sub.")?;
            let (n, tail) = sub.split_once('.')?;
            let n: usize = n.parse().ok()?;
            if n == nb {
                return Some(format!("conv_body.{tail}"));
            }
            // RDB<r>.conv<c>.0.<kind> or RDB<r>.conv1x1.<kind>
            let (rdb, tail) = tail.split_once('.')?;
            let r = rdb.strip_prefix("RDB")?;
            let (conv, tail) = tail.split_once('.')?;
            let kind = tail.strip_prefix("0.").unwrap_or(tail);
            Some(format!("body.{n}.rdb{r}.{conv}.{kind}"))
        }
        i if i == hr => Some(format!("conv_hr.{tail}")),
        i if i == last => Some(format!("conv_last.{tail}")),
        i if i % 3 == 0 && (1..=ups).contains(&(i / 3)) => Some(format!("conv_up{}.{tail}", i / 3)),
        _ => None,
    }
}

fn bsrgan_name(name: &str) -> Option<String> {
    if let Some(rest) = name.strip_prefix("RRDB_trunk.") {
        // N.RDB<r>.conv<c>.<kind>
        let (n, tail) = rest.split_once('.')?;
        let r = tail.strip_prefix("RDB")?;
        return Some(format!("body.{n}.rdb{r}"));
    }
    for (old, new) in [
        ("trunk_conv.", "conv_body."),
        ("HRconv.", "conv_hr."),
        ("upconv", "conv_up"),
    ] {
        if let Some(rest) = name.strip_prefix(old) {
            return Some(format!("{new}{rest}"));
        }
    }
    None
}

/// A "same" convolution of a channels-innermost activation `x` `[C, W, H, 1]` (see
/// [`Esrgan::forward`]) followed by the optional LeakyReLU, returning `[OC, W, H, 1]`:
/// the input zero-padded, then [`sd_tensor::ggml::Context::conv_2d_cwh`].
fn conv_cwh(g: &GraphCtx, conv: &Conv2d, x: &GTensor, slope: Option<f32>) -> Result<GTensor> {
    let ctx = &g.ctx;
    let [kw, kh, c, _] = conv.weight.ne();
    let [xc, _, _, n] = x.ne();
    if xc != c || n != 1 || kw != kh || conv.stride != 1 || 2 * conv.padding + 1 != kw {
        return Err(ModelError::Input {
            name: "conv",
            detail: format!("kernel {:?} on {:?}", conv.weight.ne(), x.ne()),
        });
    }
    let p = conv.padding;
    let xp = if p > 0 {
        ctx.pad_ext(x, [(0, 0), (p, p), (p, p), (0, 0)])?
    } else {
        x.clone()
    };
    Ok(ctx.conv_2d_cwh(&conv.weight, &[&xp], conv.bias.as_ref(), slope, false)?)
}

/// Nearest 2x upsampling of a channels-innermost `[C, W, H, 1]` activation.
fn upsample2_cwh(ctx: &sd_tensor::ggml::Context, x: &GTensor) -> Result<GTensor> {
    let [c, w, h, _] = x.ne();
    let shape = |ne: &[usize]| ctx.new_tensor(sd_tensor::DType::F32, ne);
    let t = ctx.reshape(x, &[c, 1, w, h])?;
    let t = ctx.repeat(&t, &shape(&[c, 2, w, h])?)?;
    let t = ctx.reshape(&t, &[2 * c * w, 1, h])?;
    let t = ctx.repeat(&t, &shape(&[2 * c * w, 2, h])?)?;
    Ok(ctx.reshape(&t, &[c, 2 * w, 2 * h, 1])?)
}

/// `ResidualDenseBlock_5C`: five 3x3 convolutions over the growing concatenation.
#[derive(Clone, Debug)]
pub struct DenseBlock {
    /// `conv1`..`conv5`.
    pub convs: Vec<Conv2d>,
    /// ESRGAN+ `conv1x1` (no bias).
    pub conv1x1: Option<Conv2d>,
}

impl DenseBlock {
    fn new(pb: &ParamBuilder<'_>, cfg: &EsrganConfig) -> Result<Self> {
        let (nf, gc) = (cfg.num_filters, cfg.growth);
        let mut convs = Vec::with_capacity(5);
        for i in 0..5 {
            let out = if i == 4 { nf } else { gc };
            convs.push(Conv2d::new_f32(
                &pb.pp(format!("conv{}", i + 1)),
                nf + i * gc,
                out,
                3,
                1,
                1,
                true,
            )?);
        }
        let conv1x1 = if cfg.plus {
            Some(Conv2d::new_f32(&pb.pp("conv1x1"), nf, gc, 1, 1, 0, false)?)
        } else {
            None
        };
        Ok(DenseBlock { convs, conv1x1 })
    }

    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        // The growing concatenation is kept as zero-padded pieces: each convolution's output
        // comes out padded (ready to be a piece), and the CPU kernel reads the pieces in place.
        // ggml's ops (other backends) take one concatenation, grown by one piece a convolution.
        let xp = ctx.pad_ext(x, [(0, 0), (1, 1), (1, 1), (0, 0)])?;
        let in_place = ctx.host_kernels();
        let mut pieces = vec![xp.clone()];
        let mut feats: Vec<GTensor> = Vec::with_capacity(4);
        for (i, conv) in self.convs.iter().enumerate().take(4) {
            let (w, b) = (&conv.weight, conv.bias.as_ref());
            let mut y = ctx.conv_2d_cwh(
                w,
                &pieces.iter().collect::<Vec<_>>(),
                b,
                Some(LEAKY_SLOPE),
                true,
            )?;
            if let Some(c11) = &self.conv1x1 {
                // Padded like y: a 1x1 convolution without bias keeps the zero border.
                if i == 1 {
                    let skip = ctx.conv_2d_cwh(&c11.weight, &[&xp], None, None, false)?;
                    y = ctx.add(&y, &skip)?;
                } else if i == 3 {
                    y = ctx.add(&y, &feats[1])?;
                }
            }
            if in_place {
                pieces.push(y.clone());
            } else {
                pieces = vec![ctx.concat(&pieces[0], &y, 0)?];
            }
            feats.push(y);
        }
        let c5 = &self.convs[4];
        let x5 = ctx.conv_2d_cwh(
            &c5.weight,
            &pieces.iter().collect::<Vec<_>>(),
            c5.bias.as_ref(),
            None,
            false,
        )?;
        Ok(ctx.add(&ctx.scale(&x5, RESIDUAL_SCALE)?, x)?)
    }
}

/// `RRDB`: three dense blocks and a scaled residual.
#[derive(Clone, Debug)]
pub struct Rrdb {
    /// `rdb1`, `rdb2`, `rdb3`.
    pub rdb: [DenseBlock; 3],
}

impl Rrdb {
    fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let mut h = x.clone();
        for b in &self.rdb {
            h = b.forward(g, &h)?;
        }
        Ok(g.ctx.add(&g.ctx.scale(&h, RESIDUAL_SCALE)?, x)?)
    }
}

/// The RRDB network.
#[derive(Clone, Debug)]
pub struct Esrgan {
    /// Configuration.
    pub config: EsrganConfig,
    /// `conv_first`.
    pub conv_first: Conv2d,
    /// `body.N`.
    pub body: Vec<Rrdb>,
    /// `conv_body`.
    pub conv_body: Conv2d,
    /// `conv_upK` (K from 1).
    pub conv_up: Vec<Conv2d>,
    /// `conv_hr`.
    pub conv_hr: Conv2d,
    /// `conv_last`.
    pub conv_last: Conv2d,
}

impl Esrgan {
    /// Declares the parameters (f32) under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: EsrganConfig) -> Result<Self> {
        let c = &config;
        if c.num_filters == 0 || c.growth == 0 || c.in_channels == 0 || c.out_channels == 0 {
            return Err(ModelError::Config(format!("ESRGAN config {c:?}")));
        }
        let nf = c.num_filters;
        let conv =
            |name: &str, i: usize, o: usize| Conv2d::new_f32(&pb.pp(name), i, o, 3, 1, 1, true);
        let mut body = Vec::with_capacity(c.num_blocks);
        for n in 0..c.num_blocks {
            let b = pb.pp(format!("body.{n}"));
            body.push(Rrdb {
                rdb: [
                    DenseBlock::new(&b.pp("rdb1"), c)?,
                    DenseBlock::new(&b.pp("rdb2"), c)?,
                    DenseBlock::new(&b.pp("rdb3"), c)?,
                ],
            });
        }
        let mut conv_up = Vec::with_capacity(c.num_upsamples);
        for k in 1..=c.num_upsamples {
            conv_up.push(conv(&format!("conv_up{k}"), nf, nf)?);
        }
        Ok(Esrgan {
            conv_first: conv("conv_first", c.in_channels, nf)?,
            body,
            conv_body: conv("conv_body", nf, nf)?,
            conv_up,
            conv_hr: conv("conv_hr", nf, nf)?,
            conv_last: conv("conv_last", nf, c.out_channels)?,
            config,
        })
    }

    /// Builds the forward pass of an image `x` `[W, H, image_channels, 1]` in [0, 1] (W and
    /// H multiples of the shuffle factor). Returns `[W * s, H * s, out_channels, 1]`.
    ///
    /// Inside, activations are channels-innermost (`[C, W, H]`): a 3x3 convolution is then
    /// nine matrix products over contiguous shifted copies, which ggml's CPU backend runs
    /// several times faster than its im2col.
    pub fn forward(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        let c = &self.config;
        let f = c.shuffle_factor.unwrap_or(1);
        let n = x.ne();
        if n[2] != c.image_channels()
            || n[3] != 1
            || !n[0].is_multiple_of(f)
            || !n[1].is_multiple_of(f)
        {
            return Err(ModelError::Input {
                name: "image",
                detail: format!(
                    "{n:?}, expected [W, H, {}, 1] with W and H multiples of {f}",
                    c.image_channels()
                ),
            });
        }
        let ctx = g.ctx.clone();
        // 1. Pixel unshuffle (x2plus, x1), channels innermost.
        let x = pixel_unshuffle(&ctx, x, f)?;
        let x = ctx.cont(&ctx.permute(&x, [1, 2, 0, 3])?)?;
        // 2. First convolution.
        let fea = conv_cwh(g, &self.conv_first, &x, None)?;
        // 3. RRDB trunk and its convolution, added to the features.
        let mut h = fea.clone();
        for (i, b) in self.body.iter().enumerate() {
            h = b.forward(g, &h)?;
            g.marks.mark(&h, &format!("body.{i}"), "h")?;
        }
        let mut h = ctx.add(&fea, &conv_cwh(g, &self.conv_body, &h, None)?)?;
        // 4. Upsampling: nearest 2x, convolution, LeakyReLU.
        for up in &self.conv_up {
            h = conv_cwh(g, up, &upsample2_cwh(&ctx, &h)?, Some(LEAKY_SLOPE))?;
        }
        // 5. conv_hr, LeakyReLU, conv_last, back to [W, H, C].
        let h = conv_cwh(g, &self.conv_hr, &h, Some(LEAKY_SLOPE))?;
        let y = conv_cwh(g, &self.conv_last, &h, None)?;
        Ok(ctx.cont(&ctx.permute(&y, [2, 0, 1, 3])?)?)
    }
}
