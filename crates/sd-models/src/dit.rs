//! Building blocks shared by the diffusion transformers (FLUX.1, MMDiT, Qwen-Image): adaLN
//! modulation, modulation chunks, token and feature slicing, per-head QK RMS norm, GELU (tanh
//! form), rotary position embedding of adjacent pairs, and the dual-stream block with joint
//! attention that FLUX.1's double blocks and Qwen-Image's blocks share.
//!
//! Layout: token tensors are `[width, tokens, B]` (ggml order); modulation vectors
//! `[width, 1, B]` broadcast over the tokens.

use sd_graphcut::{LEVEL_LAYER, LEVEL_SUBLAYER};
use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::nn::{attention, gelu_tanh_exact, Linear};
use crate::{GraphCtx, HostData, ModelError, Result};

/// LayerNorm eps of the affine-free norms of the DiT blocks (`norm1`, `norm2`,
/// `norm_final`: 1e-6 in BFL's FLUX, SAI's MMDiT and diffusers).
pub const LN_EPS: f32 = 1e-6;
/// RMSNorm eps of the QK norms.
pub const RMS_EPS: f32 = 1e-6;

/// The text tokens a DiT pass reads.
#[derive(Clone, Copy, Debug)]
pub enum TextTokens<'a> {
    /// The text encoder's states `[context_dim, n_txt, B]`: the pass embeds them.
    States(&'a GTensor),
    /// States already embedded by the network (its `embed_text`, `[hidden, n_txt, B]`): the
    /// same for every step of a run, so a caller may compute them once.
    Embedded(&'a GTensor),
}

impl<'a> TextTokens<'a> {
    /// The tensor, whichever form it is in.
    pub fn tensor(&self) -> &'a GTensor {
        match *self {
            TextTokens::States(t) | TextTokens::Embedded(t) => t,
        }
    }
}

/// GELU, tanh form: with `opts.exact` in f32 (one pass on the project's CPU kernel where
/// the graph runs on the CPU, else the formula in ggml's ops), ggml's kernel otherwise.
/// `x` may be a view with contiguous rows (the project's kernel reads it in place; ggml's
/// ops get a contiguous copy).
pub fn gelu(g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
    if g.opts.exact {
        if let Some(y) = g.ctx.gelu_tanh_host(x, None)? {
            return Ok(y);
        }
    }
    let x = crate::nn::contiguous(&g.ctx, x)?;
    if g.opts.exact {
        gelu_tanh_exact(&g.ctx, &x)
    } else {
        Ok(g.ctx.gelu(&x)?)
    }
}

/// Latents `[W, H, C, B]` as tokens of 2x2 patches: `[4C, (H/2) * (W/2), B]`, `(c, row,
/// column)` within a token and tokens row-major, as diffusers' `_pack_latents` (FLUX,
/// Qwen-Image). `model` names the network in the error for odd sizes or a channel count other
/// than `channels`. Returns the tokens and the patch grid `(h2, w2)`.
pub fn pack_2x2(
    ctx: &Context,
    x: &GTensor,
    channels: usize,
    model: &str,
) -> Result<(GTensor, (usize, usize))> {
    let [w, h, c, b] = x.ne();
    if w % 2 != 0 || h % 2 != 0 || c != channels {
        return Err(ModelError::Input {
            name: "x",
            detail: format!(
                "latents {:?}: {model} packs even-sized latents of {channels} channels",
                x.ne()
            ),
        });
    }
    let (w2, h2) = (w / 2, h / 2);
    let packed = crate::nn::pixel_unshuffle(ctx, x, 2)?; // [w2, h2, 4c, B]
    let packed = ctx.cont(&ctx.permute(&packed, [1, 2, 0, 3])?)?; // [4c, w2, h2, B]
    Ok((ctx.reshape(&packed, &[4 * c, w2 * h2, b])?, (h2, w2)))
}

/// The inverse of [`pack_2x2`]: tokens `[4C, h2 * w2, B]` back to latents `[2 w2, 2 h2, C, B]`.
pub fn unpack_2x2(ctx: &Context, tokens: &GTensor, (h2, w2): (usize, usize)) -> Result<GTensor> {
    let [c4, _, b, _] = tokens.ne();
    let out = ctx.reshape(tokens, &[c4, w2, h2, b])?;
    let out = ctx.cont(&ctx.permute(&out, [2, 0, 1, 3])?)?; // [w2, h2, 4c, B]
    crate::nn::pixel_shuffle(ctx, &out, 2)
}

/// `count` equal chunks of `[count * h, 1, B]` along the first axis, each `[h, 1, B]`.
pub fn chunks(ctx: &Context, x: &GTensor, count: usize) -> Result<Vec<GTensor>> {
    let h = x.ne()[0] / count;
    (0..count).map(|i| rows(ctx, x, i * h, h)).collect()
}

/// Rows `start..start + len` of the first axis of `[n0, n1, n2]`, contiguous.
pub fn rows(ctx: &Context, x: &GTensor, start: usize, len: usize) -> Result<GTensor> {
    Ok(ctx.cont(&row_view(ctx, x, start, len)?)?)
}

/// Rows `start..start + len` of the first axis of `[n0, n1, n2]` as a view (the strides of
/// `x`).
pub fn row_view(ctx: &Context, x: &GTensor, start: usize, len: usize) -> Result<GTensor> {
    let ne = x.ne();
    let nb = x.nb();
    Ok(ctx.view(
        x,
        [len, ne[1], ne[2], ne[3]],
        [nb[1], nb[2], nb[3]],
        start * nb[0],
    )?)
}

/// The first `n_txt` tokens and the rest of `[h, n, B]`.
pub fn split_tokens(ctx: &Context, x: &GTensor, n_txt: usize) -> Result<(GTensor, GTensor)> {
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

/// `ln(x) * (1 + scale) + shift` (scale and shift `[h, 1, B]`, broadcast over tokens): three
/// passes over the tokens (the `1 + scale` is one vector).
pub fn modulate(ctx: &Context, x: &GTensor, shift: &GTensor, scale: &GTensor) -> Result<GTensor> {
    let n = ctx.norm(x, LN_EPS)?;
    let scaled = ctx.mul(&n, &ctx.scale_bias(scale, 1.0, 1.0)?)?;
    Ok(ctx.add(&scaled, shift)?)
}

/// RMS norm over each head's width with a learned scale: `[heads * d, n, B]` in (f32 rows,
/// any row stride: a view of a fused projection's rows is read in place), contiguous out.
/// The product follows the norm directly, which ggml's CUDA backend fuses (the weights of a
/// segment graph precede its ops).
pub fn qk_norm(ctx: &Context, x: &GTensor, scale: &GTensor, heads: usize) -> Result<GTensor> {
    let [w, n, b, _] = x.ne();
    let d = w / heads;
    let es = x.dtype().map_or(0, |t| t.type_size());
    let x = if es > 0 && x.nb()[0] == es {
        let nb = x.nb();
        ctx.view(x, [d, heads, n, b], [d * es, nb[1], nb[2]], 0)?
    } else {
        ctx.reshape(&ctx.cont(x)?, &[d, heads, n, b])?
    };
    let x = ctx.mul(&ctx.rms_norm(&x, RMS_EPS)?, scale)?;
    Ok(ctx.reshape(&x, &[w, n, b])?)
}

/// The q, k, v projections of an attention: fused (`qkv`, BFL's and Stability's files) or
/// apart (`to_q`, `to_k`, `to_v`, diffusers').
#[derive(Clone, Debug)]
pub enum QkvProj {
    /// One `[3h, h]` projection.
    Fused(Linear),
    /// Three `[h, h]` projections.
    Split([Linear; 3]),
}

impl QkvProj {
    /// q, k and v of `x` `[h, n, B]`, each `[h, n, B]`: for the fused form views of the one
    /// projection's rows (contiguous rows, not contiguous tensors).
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<[GTensor; 3]> {
        Ok(match self {
            QkvProj::Fused(l) => {
                let qkv = l.forward(ctx, x)?;
                let h = qkv.ne()[0] / 3;
                [
                    row_view(ctx, &qkv, 0, h)?,
                    row_view(ctx, &qkv, h, h)?,
                    row_view(ctx, &qkv, 2 * h, h)?,
                ]
            }
            QkvProj::Split([q, k, v]) => {
                [q.forward(ctx, x)?, k.forward(ctx, x)?, v.forward(ctx, x)?]
            }
        })
    }
}

/// One stream of a dual-stream block (FLUX.1's `img_*`/`txt_*`, Qwen-Image's `img_*`/`txt_*`
/// and `attn.*`/`attn.add_*`).
#[derive(Clone, Debug)]
pub struct StreamParams {
    /// The modulation (6 x width: shift, scale, gate for attention and MLP).
    pub modulation: Linear,
    /// q, k, v.
    pub qkv: QkvProj,
    /// Per-head RMS norm scale of q.
    pub query_norm: GTensor,
    /// Per-head RMS norm scale of k.
    pub key_norm: GTensor,
    /// The attention output projection.
    pub proj: Linear,
    /// The MLP's first layer (GELU tanh after it).
    pub mlp_in: Linear,
    /// The MLP's second layer.
    pub mlp_out: Linear,
}

impl StreamParams {
    /// q, k (laid out for `rope` and RMS-normed per head) and v (contiguous) of `x`.
    fn qkv(&self, ctx: &Context, x: &GTensor, heads: usize, rope: &Rope) -> Result<[GTensor; 3]> {
        let [q, k, v] = self.qkv.forward(ctx, x)?;
        let q = rope.normed(ctx, &q, &self.query_norm, heads)?;
        let k = rope.normed(ctx, &k, &self.key_norm, heads)?;
        Ok([q, k, crate::nn::contiguous(ctx, &v)?])
    }

    /// The gated MLP output (to add to `x`) from the modulation chunks `m` (3: shift, 4:
    /// scale, 5: gate), its hidden layer a fine cut `fc1_<stream>`.
    fn mlp_delta(
        &self,
        g: &mut GraphCtx,
        x: &GTensor,
        m: &[GTensor],
        stream: &str,
    ) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let h = modulate(&ctx, x, &m[3], &m[4])?;
        let h = gelu(g, &self.mlp_in.forward(&ctx, &h)?)?;
        g.marks
            .mark_fine_output(&h, LEVEL_SUBLAYER, &format!("fc1_{stream}"), "h")?;
        let h = self.mlp_out.forward(&ctx, &h)?;
        Ok(ctx.mul(&h, &m[5])?)
    }
}

/// A dual-stream block: image and text streams, each modulated from the conditioning vector,
/// attending jointly over `[txt; img]`.
#[derive(Clone, Debug)]
pub struct DoubleBlock {
    /// The image stream.
    pub img: StreamParams,
    /// The text stream.
    pub txt: StreamParams,
}

impl DoubleBlock {
    /// One block on `img` `[h, n_img, B]` and `txt` `[h, n_txt, B]` with `silu_vec` `[h, 1,
    /// B]` (the SiLU of the conditioning vector): per stream `(shift, scale, gate) x 2 =
    /// mod(silu_vec)`, joint attention of the modulated layer-normed streams (q, k
    /// RMS-normed per head, rotated by `rope`), `s += gate1 * proj(attn_s)`, `s += gate2 *
    /// mlp(modulate(ln(s)))`. The outputs are the graph cut `name` (img, txt); inside,
    /// fine cuts (used only when a whole block does not fit its budget): the modulation
    /// vectors, the joint q/k/v, both streams after attention, each MLP's hidden layer, the
    /// image MLP's gated output.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        g: &mut GraphCtx,
        name: &str,
        img: &GTensor,
        txt: &GTensor,
        silu_vec: &GTensor,
        rope: &Rope,
        heads: usize,
    ) -> Result<(GTensor, GTensor)> {
        let ctx = g.ctx.clone();
        let n_txt = txt.ne()[1];
        g.marks.set_scope(name);
        let imod = self.img.modulation.forward(&ctx, silu_vec)?;
        g.marks
            .mark_fine_output(&imod, LEVEL_SUBLAYER, "mod_img", "m")?;
        let tmod = self.txt.modulation.forward(&ctx, silu_vec)?;
        g.marks
            .mark_fine_output(&tmod, LEVEL_SUBLAYER, "mod_txt", "m")?;
        let (im, tm) = (chunks(&ctx, &imod, 6)?, chunks(&ctx, &tmod, 6)?);
        let img_n = modulate(&ctx, img, &im[0], &im[1])?;
        let txt_n = modulate(&ctx, txt, &tm[0], &tm[1])?;
        let [iq, ik, iv] = self.img.qkv(&ctx, &img_n, heads, rope)?;
        let [tq, tk, tv] = self.txt.qkv(&ctx, &txt_n, heads, rope)?;
        let q = rope.apply(&ctx, &ctx.concat(&tq, &iq, 1)?, heads)?;
        let k = rope.apply(&ctx, &ctx.concat(&tk, &ik, 1)?, heads)?;
        let v = ctx.concat(&tv, &iv, 1)?;
        for (t, o) in [(&q, "q"), (&k, "k"), (&v, "v")] {
            g.marks.mark_fine_output(t, LEVEL_SUBLAYER, "qkv", o)?;
        }
        let a = attention(g, &q, &k, &v, heads, None)?;
        let (ta, ia) = split_tokens(&ctx, &a, n_txt)?;
        let gated = |s: &StreamParams, x: &GTensor, a: &GTensor, gate: &GTensor| {
            Ok::<_, ModelError>(ctx.add(x, &ctx.mul(&s.proj.forward(&ctx, a)?, gate)?)?)
        };
        let img_a = gated(&self.img, img, &ia, &im[2])?;
        let txt_a = gated(&self.txt, txt, &ta, &tm[2])?;
        g.marks
            .mark_fine_output(&img_a, LEVEL_LAYER, "attn", "img")?;
        g.marks
            .mark_fine_output(&txt_a, LEVEL_LAYER, "attn", "txt")?;
        let d_img = self.img.mlp_delta(g, &img_a, &im, "img")?;
        g.marks
            .mark_fine_output(&d_img, LEVEL_SUBLAYER, "mlp_img", "d")?;
        let d_txt = self.txt.mlp_delta(g, &txt_a, &tm, "txt")?;
        g.marks.set_scope("");
        let img = ctx.add(&img_a, &d_img)?;
        let txt = ctx.add(&txt_a, &d_txt)?;
        g.marks.mark(&img, name, "img")?;
        g.marks.mark(&txt, name, "txt")?;
        Ok((img, txt))
    }
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

/// [`rope_tables`] laid out per value of a head: `cos` repeated for both values of a pair,
/// `sin` negated for the first (`[n][d]` each, token-major), so that a rotation is
/// `x * cos + swap(x) * sin` with `swap` exchanging the values of each pair.
fn pair_tables(ids: &[[f32; 3]], axes: [usize; 3], theta: f32) -> (Vec<f32>, Vec<f32>) {
    let (cos, sin) = rope_tables(ids, axes, theta);
    let cos2 = cos.iter().flat_map(|&c| [c, c]).collect();
    let sin2 = sin.iter().flat_map(|&s| [-s, s]).collect();
    (cos2, sin2)
}

/// The frequency factors of [`Rope`]'s sections form, `[d / 2]`: ggml's multi-section rope
/// turns pair `i` by `p * theta^(-2i/d) / f[i]`; pair `i` is pair `j` of its axis `a` (width
/// `d_a`), which turns by `p * theta^(-2j / d_a)`, so `f[i] = theta^(2j / d_a - 2i / d)`.
pub fn section_freq_factors(axes: [usize; 3], theta: f32, d: usize) -> Vec<f32> {
    let ln = (theta as f64).ln();
    let mut f = Vec::with_capacity(d / 2);
    for (a, &da) in axes.iter().enumerate() {
        let start: usize = axes[..a].iter().sum::<usize>() / 2;
        for j in 0..da / 2 {
            let i = start + j;
            f.push((ln * (2.0 * j as f64 / da as f64 - 2.0 * i as f64 / d as f64)).exp() as f32);
        }
    }
    f
}

/// The integer position ids of `ids`, section-major as ggml's multi-section rope reads them
/// (`[4 n]`: every token's axis-0 id, then axis 1, axis 2, and zeros for the unused fourth
/// section); `None` when an id is not an integer of at most 2^24 in magnitude.
fn section_positions(ids: &[[f32; 3]]) -> Option<Vec<i32>> {
    let n = ids.len();
    let mut pos = vec![0i32; 4 * n];
    for (t, id) in ids.iter().enumerate() {
        for (a, &v) in id.iter().enumerate() {
            if v.fract() != 0.0 || v.abs() > (1 << 24) as f32 {
                return None;
            }
            pos[a * n + t] = v as i32;
        }
    }
    Some(pos)
}

/// RoPE axes must be even and sum to the head width `d`.
fn check_axes(model: &str, axes: [usize; 3], d: usize) -> Result<()> {
    if axes.iter().sum::<usize>() != d || axes.iter().any(|a| a % 2 != 0) {
        return Err(ModelError::Config(format!(
            "{model}: RoPE axes {axes:?} for head width {d} (even widths summing to it)"
        )));
    }
    Ok(())
}

/// A constant auxiliary input `<model>.rope_<what>` of [`Rope`].
fn rope_constant(
    g: &mut GraphCtx,
    model: &str,
    what: &str,
    dtype: DType,
    ne: &[usize],
    data: HostData,
) -> Result<GTensor> {
    g.constant_input(&format!("{model}.rope_{what}"), dtype, ne, data)
}

/// How a [`Rope`] turns its pairs.
enum RopeForm {
    /// ggml's multi-section rope (`Context::rope_sections`), one op: it turns value `i`
    /// of a head with value `i + d / 2`, so q and k are first laid out that way
    /// ([`Rope::lay_out`]).
    Sections {
        /// Positions `[4 n]` (I32).
        pos: GTensor,
        /// Frequency factors `[d / 2]` ([`section_freq_factors`]).
        freq: GTensor,
        /// Pairs per section.
        sections: [usize; 4],
        /// The base.
        theta: f32,
    },
    /// Host-made tables `[d, 1, n, 1]` ([`pair_tables`]) and the pair swap as a `[2, 2]`
    /// matrix product: `x * cos + swap(x) * sin`, for ids that are not integers.
    Tables {
        cos: GTensor,
        sin: GTensor,
        swap: GTensor,
    },
}

/// Rotary position embedding of adjacent pairs: `(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1
/// cos)` per head, the angle of pair `j` of axis `a` being `id_a * theta^(-2j / d_a)`.
///
/// With integer position ids (FLUX.1's, Qwen-Image's) it is ggml's multi-section rope, one
/// op that turns value `i` of a head with value `i + d / 2`: q and k are laid out for it by
/// [`Rope::lay_out`], each head's values reordered (the first value of every pair, then the
/// second; the same permutation of q and k, which leaves their products and so the
/// attention unchanged) in a copy, after the QK norm, which does not depend on their order
/// ([`Rope::normed`]). Otherwise host-made cos/sin tables with the pair swap as a `[2, 2]`
/// product (every element-wise operation keeping the head width innermost:
/// splitting the pairs into one-value rows made the GPU kernels crawl, 2.4 s against 0.62 s
/// for FLUX.1-dev's step on an H200); there the layout is the checkpoint's own. The
/// sections form replaced the tables for integer ids after an H100 census of a FLUX step
/// (the tables' f32 product, products and sums took about 10% of the GPU time).
pub struct Rope {
    form: RopeForm,
}

impl Rope {
    /// The rotation for tokens with position ids `ids` (3 axes of widths `axes`, summing to
    /// the head width `d`), its data constant auxiliary inputs `<model>.rope_*` (every
    /// segment of a streamed run reads the same ones, and so does every step).
    pub fn new(
        g: &mut GraphCtx,
        model: &str,
        ids: &[[f32; 3]],
        axes: [usize; 3],
        theta: f32,
        d: usize,
    ) -> Result<Rope> {
        check_axes(model, axes, d)?;
        if let Some(pos) = section_positions(ids) {
            let pos = rope_constant(
                g,
                model,
                "pos",
                DType::I32,
                &[4 * ids.len()],
                HostData::I32(pos),
            )?;
            let freq = HostData::F32(section_freq_factors(axes, theta, d));
            let freq = rope_constant(g, model, "freq", DType::F32, &[d / 2], freq)?;
            let sections = [axes[0] / 2, axes[1] / 2, axes[2] / 2, 0];
            return Ok(Rope {
                form: RopeForm::Sections {
                    pos,
                    freq,
                    sections,
                    theta,
                },
            });
        }
        Self::new_tables(g, model, ids, axes, theta, d)
    }

    /// The table form whatever the ids (`Rope::new` takes it for ids that are not
    /// integers): q and k keep the checkpoint's layout.
    pub fn new_tables(
        g: &mut GraphCtx,
        model: &str,
        ids: &[[f32; 3]],
        axes: [usize; 3],
        theta: f32,
        d: usize,
    ) -> Result<Rope> {
        check_axes(model, axes, d)?;
        let (cos, sin) = pair_tables(ids, axes, theta);
        let shape = [d, 1, ids.len(), 1];
        let cos = rope_constant(g, model, "cos", DType::F32, &shape, HostData::F32(cos))?;
        let sin = rope_constant(g, model, "sin", DType::F32, &shape, HostData::F32(sin))?;
        let swap = HostData::F32(vec![0.0, 1.0, 1.0, 0.0]);
        let swap = rope_constant(g, model, "swap", DType::F32, &[2, 2], swap)?;
        Ok(Rope {
            form: RopeForm::Tables { cos, sin, swap },
        })
    }

    /// Whether this is ggml's multi-section rope (q and k laid out by [`Rope::lay_out`]).
    pub fn is_sections(&self) -> bool {
        matches!(self.form, RopeForm::Sections { .. })
    }

    /// q or k `[heads * d, n, B]` (f32 rows, any row stride: a view of a fused projection's
    /// rows will do) as a contiguous tensor laid out for [`Rope::apply`]: for the sections
    /// form each head's values `(x0, x1, x2, x3, ...)` become `(x0, x2, ..., x1, x3, ...)`
    /// (one copy), else the checkpoint's layout (a copy only where `x` is not contiguous).
    pub fn lay_out(&self, ctx: &Context, x: &GTensor, heads: usize) -> Result<GTensor> {
        if !self.is_sections() {
            return crate::nn::contiguous(ctx, x);
        }
        let [w, n, b, _] = x.ne();
        let d = w / heads.max(1);
        let es = x.dtype().map_or(0, |t| t.type_size());
        let nb = x.nb();
        // Contiguous rows, tokens and batch as one axis (the row stride carries over the
        // batch); else a contiguous copy first.
        let x = if es > 0 && nb[0] == es && nb[2] == n * nb[1] {
            x.clone()
        } else {
            ctx.cont(x)?
        };
        let es = x.nb()[0];
        let nb = x.nb();
        let pairs = ctx.view(&x, [2, d / 2, heads, n * b], [2 * es, d * es, nb[1]], 0)?;
        let laid = ctx.cont(&ctx.permute(&pairs, [1, 0, 2, 3])?)?;
        Ok(ctx.reshape(&laid, &[w, n, b])?)
    }

    /// q or k RMS-normed per head with `scale` ([`qk_norm`], reading a projection's view in
    /// place) and laid out by [`Rope::lay_out`]: what [`Rope::apply`] rotates. The norm goes
    /// first: it does not depend on the order of a head's values, and the checkpoint's scale
    /// then applies as it is (no reordering copy between the norm and its product, which
    /// ggml's CUDA backend fuses).
    pub fn normed(
        &self,
        ctx: &Context,
        x: &GTensor,
        scale: &GTensor,
        heads: usize,
    ) -> Result<GTensor> {
        let x = qk_norm(ctx, x, scale, heads)?;
        self.lay_out(ctx, &x, heads)
    }

    /// Rotates `[heads * d, n, B]`, laid out by [`Rope::lay_out`].
    pub fn apply(&self, ctx: &Context, x: &GTensor, heads: usize) -> Result<GTensor> {
        let [w, n, b, _] = x.ne();
        let d = w / heads;
        let x4 = ctx.reshape(&crate::nn::contiguous(ctx, x)?, &[d, heads, n, b])?;
        let o = match &self.form {
            RopeForm::Sections {
                pos,
                freq,
                sections,
                theta,
            } => ctx.rope_sections(&x4, pos, freq, *sections, *theta)?,
            RopeForm::Tables { cos, sin, swap } => {
                let pairs = ctx.reshape(&x4, &[2, w * n * b / 2])?;
                let swapped = ctx.reshape(&ctx.mul_mat(swap, &pairs)?, &[d, heads, n, b])?;
                ctx.add(&ctx.mul(&x4, cos)?, &ctx.mul(&swapped, sin)?)?
            }
        };
        Ok(ctx.reshape(&o, &[w, n, b])?)
    }
}
