//! Building blocks shared by the models: layers holding their parameter tensors and the
//! ggml code of their forward passes.

use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::weights::ParamBuilder;
use crate::{ComputeOptions, GraphCtx, Result};

/// `nn.Linear`: `weight` `[out, in]` (ggml `[in, out]`), optional `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// Weight.
    pub weight: GTensor,
    /// Bias.
    pub bias: Option<GTensor>,
}

impl Linear {
    /// Declares `weight` (and `bias` if `bias`) under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        Ok(Linear {
            weight: pb.tensor("weight", &[out_dim, in_dim])?,
            bias: if bias {
                Some(pb.tensor("bias", &[out_dim])?)
            } else {
                None
            },
        })
    }

    /// `x @ W^T + b` over `ne[0]` of `x`.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        // `mul_mat` + `add`, or one CPU kernel where the context allows it.
        Ok(ctx.linear(&self.weight, x, self.bias.as_ref())?)
    }
}

/// `nn.Conv2d`: `weight` `[oc, ic, kh, kw]` (ggml `[kw, kh, ic, oc]`), `bias` `[oc]`.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// Kernel.
    pub weight: GTensor,
    /// Bias.
    pub bias: Option<GTensor>,
    /// Stride.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
}

impl Conv2d {
    /// Declares a `k` x `k` convolution with bias under `pb`.
    pub fn new(
        pb: &ParamBuilder<'_>,
        in_ch: usize,
        out_ch: usize,
        k: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        Ok(Conv2d {
            weight: pb.tensor("weight", &[out_ch, in_ch, k, k])?,
            bias: Some(pb.tensor("bias", &[out_ch])?),
            stride,
            padding,
        })
    }

    /// Like [`Conv2d::new`] with the kernel kept in f32 whatever the file stores (exact f32
    /// convolutions; the upscalers use this). `bias`: whether a bias exists.
    #[allow(clippy::too_many_arguments)]
    pub fn new_f32(
        pb: &ParamBuilder<'_>,
        in_ch: usize,
        out_ch: usize,
        k: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        Ok(Conv2d {
            weight: pb.tensor_f32("weight", &[out_ch, in_ch, k, k])?,
            bias: if bias {
                Some(pb.tensor_f32("bias", &[out_ch])?)
            } else {
                None
            },
            stride,
            padding,
        })
    }

    /// Convolves `x` `[W, H, C, N]`.
    pub fn forward(&self, g: &GraphCtx, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let kn = self.weight.ne();
        let pointwise = kn[0] == 1 && kn[1] == 1 && self.stride == 1 && self.padding == 0;
        // The CPU kernels take 1x1 convolutions too (their transposes are ggml's slowest
        // copies) when their im2col keeps the precision of the matmul path: f16 and bf16
        // kernels (ggml converts the activations to the kernel's type either way; bf16 ones
        // run on AMX tiles where the CPU has them), f32 kernels with exact numerics.
        let wt = self.weight.dtype();
        let host = g.opts.host_kernels
            && (!pointwise
                || matches!(wt, Some(DType::F16 | DType::BF16))
                || (wt == Some(DType::F32) && g.opts.exact));
        let direct = !host && ctx.direct_conv() && wt == Some(DType::F16);
        let y = if direct {
            ctx.conv_2d_direct(
                &self.weight,
                x,
                (self.stride, self.stride),
                (self.padding, self.padding),
                (1, 1),
            )?
        } else if pointwise && !host {
            // 1x1: a matmul over channels.
            let xn = x.ne();
            let w = ctx.reshape(&self.weight, &[kn[2], kn[3]])?;
            let xt = ctx.cont(&ctx.permute(x, [1, 2, 0, 3])?)?; // [C, W, H, N]
            let y = ctx.mul_mat(&w, &ctx.reshape(&xt, &[xn[2], xn[0] * xn[1] * xn[3]])?)?;
            let y = ctx.reshape(&y, &[kn[3], xn[0], xn[1], xn[3]])?;
            ctx.cont(&ctx.permute(&y, [2, 0, 1, 3])?)?
        } else if host {
            // The CPU's own kernels add the bias in the convolution's epilogue.
            return Ok(ctx.conv_2d_host(
                &self.weight,
                x,
                self.bias.as_ref(),
                (self.stride, self.stride),
                (self.padding, self.padding),
                (1, 1),
                g.opts.exact,
            )?);
        } else {
            ctx.conv_2d(
                &self.weight,
                x,
                (self.stride, self.stride),
                (self.padding, self.padding),
                (1, 1),
                g.opts.exact,
            )?
        };
        Ok(match &self.bias {
            Some(b) => {
                let oc = b.ne()[0];
                ctx.add(&y, &ctx.reshape(b, &[1, 1, oc, 1])?)?
            }
            None => y,
        })
    }
}

/// `nn.LayerNorm` over `ne[0]` with affine parameters.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Scale.
    pub weight: GTensor,
    /// Shift.
    pub bias: GTensor,
    /// Epsilon.
    pub eps: f32,
}

impl LayerNorm {
    /// Declares `weight` and `bias` of size `dim` under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, dim: usize, eps: f32) -> Result<Self> {
        Ok(LayerNorm {
            weight: pb.tensor("weight", &[dim])?,
            bias: pb.tensor("bias", &[dim])?,
            eps,
        })
    }

    /// Normalises `x` over `ne[0]`.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let y = ctx.norm(x, self.eps)?;
        let y = ctx.mul(&y, &self.weight)?;
        Ok(ctx.add(&y, &self.bias)?)
    }
}

/// `nn.GroupNorm` of a `[W, H, C, N]` tensor with affine parameters.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    /// Scale.
    pub weight: GTensor,
    /// Shift.
    pub bias: GTensor,
    /// Number of groups.
    pub groups: usize,
    /// Epsilon.
    pub eps: f32,
}

impl GroupNorm {
    /// Declares `weight` and `bias` of size `channels` under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, channels: usize, groups: usize, eps: f32) -> Result<Self> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(crate::ModelError::Config(format!(
                "{} ({channels} channels) do not split into {groups} groups",
                pb.prefix()
            )));
        }
        Ok(GroupNorm {
            weight: pb.tensor("weight", &[channels])?,
            bias: pb.tensor("bias", &[channels])?,
            groups,
            eps,
        })
    }

    /// Normalises `x` `[W, H, C, N]`.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        self.forward_then(ctx, x, false)
    }

    /// `silu(self.forward(x))`: one op on the CPU with this crate's kernels
    /// ([`Context::group_norm_host`]).
    pub fn forward_silu(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        self.forward_then(ctx, x, true)
    }

    fn forward_then(&self, ctx: &Context, x: &GTensor, silu: bool) -> Result<GTensor> {
        let fused =
            ctx.group_norm_host(x, self.groups, self.eps, &self.weight, &self.bias, silu)?;
        if let Some(y) = fused {
            return Ok(y);
        }
        let y = ctx.group_norm(x, self.groups, self.eps)?;
        let y = ctx.channel_affine(&y, Some(&self.weight), Some(&self.bias))?;
        Ok(if silu { ctx.silu(&y)? } else { y })
    }
}

/// Activation functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x * sigmoid(1.702 x)` (CLIP's `quick_gelu`).
    QuickGelu,
    /// GELU, exact erf form (PyTorch's default `gelu`).
    Gelu,
    /// `x * sigmoid(x)`.
    Silu,
}

impl Activation {
    /// Applies the activation. With `opts.exact` the formulas are computed in f32; without,
    /// ggml's table-based kernels are used.
    pub fn forward(self, ctx: &Context, x: &GTensor, opts: ComputeOptions) -> Result<GTensor> {
        Ok(match (self, opts.exact) {
            (Activation::QuickGelu, true) => {
                let s = ctx.sigmoid(&ctx.scale(x, 1.702)?)?;
                ctx.mul(x, &s)?
            }
            (Activation::QuickGelu, false) => ctx.gelu_quick(x)?,
            (Activation::Gelu, true) => ctx.gelu_erf(x)?,
            (Activation::Gelu, false) => ctx.gelu(x)?,
            (Activation::Silu, _) => ctx.silu(x)?,
        })
    }
}

/// GELU's tanh approximation (transformers' `gelu_new`, PyTorch's `gelu(approximate="tanh")`)
/// in f32 ops: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (ggml's CPU `gelu` reads an
/// f16 table).
pub fn gelu_tanh_exact(ctx: &Context, x: &GTensor) -> Result<GTensor> {
    let x3 = ctx.mul(&ctx.mul(x, x)?, x)?;
    let inner = ctx.add(x, &ctx.scale(&x3, 0.044715)?)?;
    let t = ctx.tanh(&ctx.scale(&inner, (2.0f32 / std::f32::consts::PI).sqrt())?)?;
    let half = ctx.scale(x, 0.5)?;
    Ok(ctx.add(&half, &ctx.mul(&half, &t)?)?)
}

/// Scaled dot-product attention over `heads` heads.
///
/// `q` is `[heads * d, n_q, B]`, `k` `[heads * d, n_kv, B]`, `v` `[heads * d_v, n_kv, B]`;
/// `mask` (f32 `[n_kv, n_q]`, added to the scores) is optional. Returns
/// `[heads * d_v, n_q, B]`. Without a mask on the CPU (`host_kernels`), the project's
/// attention kernel (`Context::attention_host`); else `mul_mat` + `soft_max_ext` in f32, or
/// `flash_attn_ext` with f16 K/V when `opts.flash_attn` is set and there is no mask.
pub fn attention(
    g: &GraphCtx,
    q: &GTensor,
    k: &GTensor,
    v: &GTensor,
    heads: usize,
    mask: Option<&GTensor>,
) -> Result<GTensor> {
    let ctx = &g.ctx;
    let (qn, kn, vn) = (q.ne(), k.ne(), v.ne());
    if heads == 0
        || !qn[0].is_multiple_of(heads)
        || qn[0] != kn[0]
        || !vn[0].is_multiple_of(heads)
        || kn[1] != vn[1]
    {
        return Err(crate::ModelError::Config(format!(
            "attention: q {qn:?}, k {kn:?}, v {vn:?} with {heads} heads"
        )));
    }
    let (d, dv, nq, nkv, b) = (qn[0] / heads, vn[0] / heads, qn[1], kn[1], qn[2]);
    let scale = 1.0 / (d as f32).sqrt();
    if ctx.host_kernels() && mask.is_none() {
        // On the CPU: the project's kernel, heads read in place, all f32.
        if let Some(o) = ctx.attention_host(q, k, v, heads, scale)? {
            return Ok(o);
        }
    }
    // A copy only where the layout needs one (ggml's `cont` always copies).
    let dense = |t: &GTensor| -> Result<GTensor> {
        Ok(if t.is_contiguous() {
            t.clone()
        } else {
            ctx.cont(t)?
        })
    };
    // [d, h, n, B] -> [d, n, h, B]
    let split = |t: &GTensor, dd: usize, n: usize| -> Result<GTensor> {
        let t = ctx.reshape(&dense(t)?, &[dd, heads, n, b])?;
        Ok(ctx.cont(&ctx.permute(&t, [0, 2, 1, 3])?)?)
    };
    // Head widths under the backend's fast flash-attention kernels (`flash_attn_pad_to`)
    // run as those kernels' width, zeros appended to every head of Q, K and V: the
    // products and the softmax see the same values (the scale stays the true width's),
    // and the output's padded columns are zero and dropped.
    let pad = g
        .flash_attn_pad_to
        .filter(|&p| d < p && dv == d && g.flash_attn_for(p) && mask.is_none());
    if let Some(p) = pad {
        // [d, h, n, B] padded to [p, h, n, B], then viewed as [p, n, h, B].
        let widen = |t: &GTensor, n: usize| -> Result<GTensor> {
            let t = ctx.reshape(&dense(t)?, &[d, heads, n, b])?;
            Ok(ctx.pad(&t, [p - d, 0, 0, 0])?)
        };
        let heads_view = |t: &GTensor| -> Result<GTensor> { Ok(ctx.permute(t, [0, 2, 1, 3])?) };
        let qp = heads_view(&widen(q, nq)?)?;
        let kp = heads_view(&ctx.cast(&widen(k, nkv)?, DType::F16)?)?;
        let vp = heads_view(&ctx.cast(&widen(v, nkv)?, DType::F16)?)?;
        let o = ctx.flash_attn_ext(&qp, &kp, &vp, None, scale)?; // [p, h, n_q, B]
        let on = o.nb();
        let o = ctx.cont(&ctx.view(&o, [d, heads, nq, b], [on[1], on[2], on[3]], 0)?)?;
        return Ok(ctx.reshape(&o, &[d * heads, nq, b])?);
    }
    if g.flash_attn_for(d) && mask.is_none() {
        // Q read in place through a permuted view; K and V cast to f16 in their own layout
        // (a contiguous conversion) and read through permuted views too. (Casting the
        // permuted views made the cast a strided copy: ggml's CUDA element-wise copy, 0.27
        // ms for one FLUX attention's K on an H100 against about 0.04 for the contiguous
        // conversion.)
        let heads_view = |t: &GTensor, dd: usize, n: usize| -> Result<GTensor> {
            let t = ctx.reshape(&dense(t)?, &[dd, heads, n, b])?;
            Ok(ctx.permute(&t, [0, 2, 1, 3])?)
        };
        let qh = heads_view(q, d, nq)?;
        let kh = heads_view(&ctx.cast(&dense(k)?, DType::F16)?, d, nkv)?;
        let vh = heads_view(&ctx.cast(&dense(v)?, DType::F16)?, dv, nkv)?;
        let o = ctx.flash_attn_ext(&qh, &kh, &vh, None, scale)?; // [dv, h, n_q, B]
        return Ok(ctx.reshape(&o, &[dv * heads, nq, b])?);
    }
    let qh = split(q, d, nq)?;
    let kh = split(k, d, nkv)?;
    let scores = ctx.mul_mat(&kh, &qh)?; // [n_kv, n_q, h, B]
    let probs = ctx.soft_max_ext(&scores, mask, scale)?;
    // v: [dv, h, n_kv, B] -> [n_kv, dv, h, B]
    let vt = ctx.reshape(&dense(v)?, &[dv, heads, nkv, b])?;
    let vt = ctx.cont(&ctx.permute(&vt, [1, 2, 0, 3])?)?;
    let o = ctx.mul_mat(&vt, &probs)?; // [dv, n_q, h, B]
    let o = ctx.cont(&ctx.permute(&o, [0, 2, 1, 3])?)?; // [dv, h, n_q, B]
    Ok(ctx.reshape(&o, &[dv * heads, nq, b])?)
}

/// `nn.PReLU` with one slope per channel: `weight` `[C]`, applied to `[W, H, C, N]`.
#[derive(Clone, Debug)]
pub struct PRelu {
    /// Slopes of the negative part.
    pub weight: GTensor,
}

impl PRelu {
    /// Declares `weight` of size `channels` (f32) under `pb`.
    pub fn new(pb: &ParamBuilder<'_>, channels: usize) -> Result<Self> {
        Ok(PRelu {
            weight: pb.tensor_f32("weight", &[channels])?,
        })
    }

    /// `max(x, 0) + a * min(x, 0)` per channel.
    pub fn forward(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let c = self.weight.ne()[0];
        let pos = ctx.relu(x)?;
        let neg = ctx.sub(x, &pos)?;
        let neg = ctx.mul(&neg, &ctx.reshape(&self.weight, &[1, 1, c, 1])?)?;
        Ok(ctx.add(&pos, &neg)?)
    }
}

/// Mish, `x * tanh(softplus(x))`.
pub fn mish(ctx: &Context, x: &GTensor) -> Result<GTensor> {
    Ok(ctx.mul(x, &ctx.tanh(&ctx.softplus(x)?)?)?)
}

/// `x` itself when contiguous, else a contiguous copy.
pub fn contiguous(ctx: &Context, x: &GTensor) -> Result<GTensor> {
    Ok(if x.is_contiguous() {
        x.clone()
    } else {
        ctx.cont(x)?
    })
}

fn check_shuffle(what: &'static str, x: &GTensor, r: usize, ok: bool) -> Result<()> {
    if r == 0 || !ok {
        return Err(crate::ModelError::Input {
            name: what,
            detail: format!("{:?} with factor {r}", x.ne()),
        });
    }
    Ok(())
}

/// `nn.PixelShuffle(r)`: `[W, H, C * r * r, N]` to `[W * r, H * r, C, N]`, input channel
/// `c * r * r + i * r + j` going to output pixel `(x * r + j, y * r + i)` of channel `c`.
pub fn pixel_shuffle(ctx: &Context, x: &GTensor, r: usize) -> Result<GTensor> {
    let [w, h, cr, n] = x.ne();
    check_shuffle("pixel_shuffle", x, r, r > 0 && cr.is_multiple_of(r * r))?;
    if r == 1 {
        return Ok(x.clone());
    }
    let c = cr / (r * r);
    // [W, H, j, (i, C, N)] -> [j, W, H, (i, C, N)]
    let t = ctx.reshape(&contiguous(ctx, x)?, &[w, h, r, r * c * n])?;
    let t = ctx.cont(&ctx.permute(&t, [1, 2, 0, 3])?)?;
    // [(j, W), H, i, (C, N)] -> [(j, W), i, H, (C, N)]
    let t = ctx.reshape(&t, &[r * w, h, r, c * n])?;
    let t = ctx.cont(&ctx.permute(&t, [0, 2, 1, 3])?)?;
    Ok(ctx.reshape(&t, &[r * w, r * h, c, n])?)
}

/// `pixel_unshuffle(r)`, the inverse of [`pixel_shuffle`]: `[W * r, H * r, C, N]` to
/// `[W, H, C * r * r, N]` (W and H multiples of `r`).
pub fn pixel_unshuffle(ctx: &Context, x: &GTensor, r: usize) -> Result<GTensor> {
    let [wr, hr, c, n] = x.ne();
    check_shuffle(
        "pixel_unshuffle",
        x,
        r,
        r > 0 && wr.is_multiple_of(r) && hr.is_multiple_of(r),
    )?;
    if r == 1 {
        return Ok(x.clone());
    }
    let (w, h) = (wr / r, hr / r);
    // [(j, W), i, H, (C, N)] -> [(j, W), H, i, (C, N)]
    let t = ctx.reshape(&contiguous(ctx, x)?, &[wr, r, h, c * n])?;
    let t = ctx.cont(&ctx.permute(&t, [0, 2, 1, 3])?)?;
    // [j, W, H, (i, C, N)] -> [W, H, j, (i, C, N)]
    let t = ctx.reshape(&t, &[r, w, h, r * c * n])?;
    let t = ctx.cont(&ctx.permute(&t, [2, 0, 1, 3])?)?;
    Ok(ctx.reshape(&t, &[w, h, r * r * c, n])?)
}

/// Sinusoidal embeddings of scalars, computed on the host: for each value `v`, `dim` numbers
/// `[cos(v f_0), .., cos(v f_{h-1}), sin(v f_0), .., sin(v f_{h-1})]` with `h = dim / 2` and
/// `f_i = exp(-ln(10000) i / h)` (cos first: LDM's `timestep_embedding`, diffusers'
/// `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)`), concatenated value after
/// value. SDXL embeds its size and crop conditioning (and the refiner its aesthetic score)
/// this way, 256 numbers each. An odd `dim` ends with a zero, as upstream pads.
pub fn sinusoidal_embedding(values: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f64.ln()) * i as f64 / half as f64).exp() as f32)
        .collect();
    let mut out = Vec::with_capacity(values.len() * dim);
    for &v in values {
        out.extend(freqs.iter().map(|&f| (v * f).cos()));
        out.extend(freqs.iter().map(|&f| (v * f).sin()));
        if dim % 2 == 1 {
            out.push(0.0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ComputeOptions;

    /// Flash attention of 40-wide heads padded to 64 (`GraphCtx::flash_attn_pad_to`) gives
    /// the unpadded flash attention's output within f16 rounding (K and V rounded to f16
    /// alike), self- and cross-attention shapes, and runs the op at width 64; 64-wide heads
    /// and heads the padded width is not allowed for are left as they are.
    #[test]
    fn narrow_heads_padded_for_flash_attention_give_the_same_output() {
        use sd_tensor::ggml::{Backend, BufferType, Gallocr, Graph};
        let opts = ComputeOptions {
            exact: false,
            flash_attn: true,
            host_kernels: false,
        };
        let heads = 8;
        for (d, nq, nkv, pad, padded) in [
            (40, 50, 50, true, true),
            (40, 33, 7, true, true),
            (64, 20, 20, true, false),
            (40, 20, 20, false, false),
        ] {
            let mut outs = Vec::new();
            for pad_to in [None, Some(64)] {
                let mut g = GraphCtx::new(256, 256, opts).unwrap();
                if !pad {
                    g.flash_attn_head_dims = Some(vec![40]);
                }
                g.flash_attn_pad_to = pad_to;
                let q = g.ctx.new_tensor(DType::F32, &[heads * d, nq, 2]).unwrap();
                let k = g.ctx.new_tensor(DType::F32, &[heads * d, nkv, 2]).unwrap();
                let v = g.ctx.new_tensor(DType::F32, &[heads * d, nkv, 2]).unwrap();
                let buf = BufferType::cpu().alloc_context_tensors(&g.ctx).unwrap();
                for (i, t) in [&q, &k, &v].into_iter().enumerate() {
                    let n = t.nelements();
                    let vals: Vec<f32> = (0..n)
                        .map(|j| ((j * 7919 + i * 104_729) % 2001) as f32 / 1000.0 - 1.0)
                        .collect();
                    t.write_f32(&vals).unwrap();
                }
                let o = attention(&g, &q, &k, &v, heads, None).unwrap();
                assert_eq!(o.ne(), [heads * d, nq, 2, 1]);
                let mut graph = Graph::new(&g.ctx, 256).unwrap();
                o.set_output();
                graph.build_forward_expand(&o).unwrap();
                let width = graph
                    .nodes()
                    .iter()
                    .find(|n| n.op_name() == "FLASH_ATTN_EXT")
                    .map(|n| n.src(0).unwrap().ne()[0]);
                let want = if pad_to.is_some() && padded { 64 } else { d };
                assert_eq!(width, Some(want), "d {d}, pad {pad_to:?}");
                let backend = Backend::cpu(2).unwrap();
                let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
                galloc.alloc_graph(&graph).unwrap();
                backend.compute(&graph).unwrap();
                outs.push(o.read_f32().unwrap());
                drop(buf);
            }
            let diff = outs[0]
                .iter()
                .zip(&outs[1])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(outs[0].iter().any(|v| *v != 0.0));
            // ggml's CPU kernel sums V in f16 and the scores' dot products over 40 or 64
            // lanes in another order: f16 rounding apart.
            assert!(diff <= 1e-3, "d {d} nq {nq} nkv {nkv}: max diff {diff}");
        }
    }

    /// With `Context::set_direct_conv`, 3x3 and 1x1 convolutions with f16 kernels are
    /// ggml's `CONV_2D` (bias added after); f32 kernels, and every kernel without it, take
    /// the im2col / matrix-product path.
    #[test]
    fn direct_convolutions_are_ggmls_conv_2d_for_f16_kernels() {
        let opts = ComputeOptions {
            exact: false,
            flash_attn: false,
            host_kernels: false,
        };
        for (direct, dtype, k, want) in [
            (true, DType::F16, 3, true),
            (true, DType::F16, 1, true),
            (true, DType::F32, 3, false),
            (false, DType::F16, 3, false),
            (false, DType::F16, 1, false),
        ] {
            let g = GraphCtx::new(64, 64, opts).unwrap();
            g.ctx.set_direct_conv(direct);
            let conv = Conv2d {
                weight: g.ctx.new_tensor(dtype, &[k, k, 4, 8]).unwrap(),
                bias: Some(g.ctx.new_tensor(DType::F32, &[8]).unwrap()),
                stride: 1,
                padding: k / 2,
            };
            let x = g.ctx.new_tensor(DType::F32, &[6, 6, 4, 2]).unwrap();
            let y = conv.forward(&g, &x).unwrap();
            assert_eq!(y.ne(), [6, 6, 8, 2]);
            assert_eq!(y.op_name(), "ADD", "the bias");
            let z = y.src(0).unwrap();
            assert_eq!(
                z.op_name() == "CONV_2D",
                want,
                "direct {direct}, {dtype:?} {k}x{k}: {}",
                z.op_name()
            );
        }
    }
}
