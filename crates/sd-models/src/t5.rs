//! The T5 v1.1 encoder (transformers `T5EncoderModel`) as FLUX.1 and SD3/3.5 use it
//! (T5-XXL: `google/t5-v1_1-xxl`).
//!
//! Parameters live under the slot prefix ([`sd_formats::names::T5_PREFIX`],
//! `text_encoders.t5xxl.transformer.`), with transformers' names:
//! `shared.weight` (or its tied copy `encoder.embed_tokens.weight`),
//! `encoder.block.N.layer.0.{layer_norm, SelfAttention.{q,k,v,o}}`,
//! `encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight` (block 0 only),
//! `encoder.block.N.layer.1.{layer_norm, DenseReluDense.{wi_0,wi_1,wo}}` and
//! `encoder.final_layer_norm.weight`. llama.cpp GGUF names are converted to these by
//! `sd_formats::names` (`t5.rs`).
//!
//! What differs from a BERT-style encoder, as transformers computes it
//! (`modeling_t5.py`):
//! - no position embeddings: every layer adds a learned bias to its attention scores, looked
//!   up by a bucket of the relative position `key - query` (bidirectional: 16 buckets per
//!   sign of which 8 are exact, the rest log-spaced up to `max_distance`); the table lives
//!   in block 0 only and block 0's bias is shared by every block;
//! - attention scores are **not** scaled by `1/sqrt(d_kv)` (the scale is folded into the
//!   initialisation of `q`);
//! - `T5LayerNorm` is an RMS norm without mean subtraction or bias;
//! - the feed-forward is gated: `wo(gelu_new(wi_0 x) * wi_1 x)` (`gelu_new` is the tanh
//!   approximation).
//!
//! No attention mask: FLUX's and SD3's diffusers pipelines call the encoder with the padded
//! ids only (`_get_t5_prompt_embeds`), so padding tokens take part in attention and the
//! output depends on the padded length; so does stable-diffusion.cpp.
//!
//! f16: activations are f32 in the graph, but matrix products with f16 weights round their
//! input to f16 (ggml's CPU kernels; cuBLAS). The gated product entering `wo` is the one
//! that exceeds f16's range in T5-XXL (transformers keeps `wo` in f32 and clamps f16
//! activations for that reason), so it is multiplied by 1/32 before `wo` and the result by
//! 32 after (powers of two: exact in f32), as stable-diffusion.cpp does, and `wo` asks for
//! f32 accumulation.

use sd_tensor::ggml::{Context, GTensor, Precision};
use sd_tensor::DType;

use crate::nn::{gelu_tanh_exact, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, HostData, ModelError, Result};

/// Configuration of a T5 encoder.
///
/// Deserializes from transformers' `T5Config` key names; missing keys keep
/// [`T5Config::xxl`]'s values. [`T5Config::with_shapes_of`] replaces every dimension the
/// tensors determine (all but `relative_attention_max_distance` and `layer_norm_epsilon`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default = "T5Config::xxl", deny_unknown_fields)]
pub struct T5Config {
    /// Vocabulary rows of `shared` (`vocab_size`).
    pub vocab_size: usize,
    /// Width (`d_model`).
    pub d_model: usize,
    /// Width of one attention head (`d_kv`).
    pub d_kv: usize,
    /// Feed-forward width (`d_ff`).
    pub d_ff: usize,
    /// Encoder blocks (`num_layers`).
    pub num_layers: usize,
    /// Attention heads (`num_heads`).
    pub num_heads: usize,
    /// Relative-position buckets (`relative_attention_num_buckets`).
    pub relative_attention_num_buckets: usize,
    /// Distance from which all positions share the last bucket
    /// (`relative_attention_max_distance`).
    pub relative_attention_max_distance: usize,
    /// RMS norm epsilon (`layer_norm_epsilon`).
    pub layer_norm_epsilon: f32,
    /// The longest token sequence the family passes (sd-rs, not a transformers key: the
    /// encoder has no position limit; FLUX.1-dev 512, FLUX.1-schnell and SD3 256 in
    /// diffusers). Used to plan memory before a prompt is known.
    pub max_tokens: usize,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl Default for T5Config {
    fn default() -> Self {
        Self::xxl()
    }
}

impl T5Config {
    /// T5 v1.1 XXL's encoder (`google/t5-v1_1-xxl` `config.json`: `d_model` 4096, `d_kv` 64,
    /// `d_ff` 10240, 24 layers, 64 heads, 32 buckets, max distance 128, `layer_norm_epsilon`
    /// 1e-6, `vocab_size` 32128, `feed_forward_proj` `gated-gelu`); 512 tokens (FLUX.1-dev).
    pub fn xxl() -> Self {
        T5Config {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            max_tokens: 512,
            prefix: sd_formats::names::T5_PREFIX
                .trim_end_matches('.')
                .to_string(),
        }
    }

    /// This config with the dimensions the tensors under `pb`'s prefix plus
    /// [`T5Config::prefix`] determine: vocabulary and width from `shared.weight`, heads and
    /// buckets from block 0's `relative_attention_bias.weight` (`[buckets, heads]`), `d_kv`
    /// from `q` (`[heads * d_kv, d_model]`), `d_ff` from `wi_0`, layers by counting blocks.
    /// Without a catalog (synthetic parameters) it is returned unchanged.
    pub fn with_shapes_of(&self, pb: &ParamBuilder<'_>) -> Result<T5Config> {
        let p = pb.pp(&self.prefix);
        let shape = |name: &str| p.file_shape(name);
        let Some(shared) = shape(SHARED).or_else(|| shape(EMBED_TOKENS)) else {
            return Ok(self.clone());
        };
        let mut c = self.clone();
        let dims = |name: &str, want: usize| -> Result<Vec<usize>> {
            match shape(name) {
                Some(s) if s.len() == want => Ok(s.iter().map(|&d| d as usize).collect()),
                Some(s) => Err(ModelError::ShapeMismatch {
                    name: format!("{}.{name}", p.prefix()),
                    file: s,
                    expected: vec![0; want],
                }),
                None => Err(ModelError::MissingTensor {
                    name: format!("{}.{name}", p.prefix()),
                }),
            }
        };
        if shared.len() != 2 {
            return Err(ModelError::Config(format!(
                "T5 embedding `{}` of shape {shared:?}, expected [vocab, d_model]",
                p.prefix()
            )));
        }
        c.vocab_size = shared[0] as usize;
        c.d_model = shared[1] as usize;
        let bias = dims(REL_BIAS, 2)?;
        c.relative_attention_num_buckets = bias[0];
        c.num_heads = bias[1];
        let q = dims("encoder.block.0.layer.0.SelfAttention.q.weight", 2)?;
        if c.num_heads == 0 || !q[0].is_multiple_of(c.num_heads) {
            return Err(ModelError::Config(format!(
                "T5: q of {} rows does not split into {} heads",
                q[0], c.num_heads
            )));
        }
        c.d_kv = q[0] / c.num_heads;
        c.d_ff = dims("encoder.block.0.layer.1.DenseReluDense.wi_0.weight", 2)?[0];
        c.num_layers = (0..)
            .take_while(|i| {
                shape(&format!("encoder.block.{i}.layer.0.layer_norm.weight")).is_some()
            })
            .count();
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if self.num_heads == 0
            || self.d_kv == 0
            || self.num_layers == 0
            || self.relative_attention_num_buckets < 4
            || self.relative_attention_max_distance < self.relative_attention_num_buckets / 4
            || self.max_tokens == 0
        {
            return Err(ModelError::Config(format!("T5 config {self:?}")));
        }
        Ok(())
    }
}

const SHARED: &str = "shared.weight";
const EMBED_TOKENS: &str = "encoder.embed_tokens.weight";
const REL_BIAS: &str = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";

/// The bucket of relative position `key - query`, as transformers'
/// `T5Attention._relative_position_bucket` with `bidirectional=True` computes it (in f32,
/// truncating).
pub fn relative_position_bucket(relative: i64, num_buckets: usize, max_distance: usize) -> usize {
    let half = num_buckets / 2;
    let mut bucket = if relative > 0 { half } else { 0 };
    let n = relative.unsigned_abs() as usize;
    let max_exact = half / 2;
    if n < max_exact {
        bucket += n;
    } else {
        let ratio = ((n as f32 / max_exact as f32).ln()
            / (max_distance as f32 / max_exact as f32).ln())
            * (half - max_exact) as f32;
        let large = max_exact + ratio as usize;
        bucket += large.min(half - 1);
    }
    bucket
}

/// `layer.0.SelfAttention`.
#[derive(Clone, Debug)]
pub struct T5Attention {
    /// `q` (no bias).
    pub q: Linear,
    /// `k`.
    pub k: Linear,
    /// `v`.
    pub v: Linear,
    /// `o`.
    pub o: Linear,
}

/// `layer.1.DenseReluDense` (gated-GELU).
#[derive(Clone, Debug)]
pub struct T5DenseGatedGelu {
    /// `wi_0`, the GELU branch.
    pub wi_0: Linear,
    /// `wi_1`, the linear branch.
    pub wi_1: Linear,
    /// `wo`.
    pub wo: Linear,
}

/// `encoder.block.N`.
#[derive(Clone, Debug)]
pub struct T5Block {
    /// `layer.0.layer_norm.weight`.
    pub attn_norm: GTensor,
    /// `layer.0.SelfAttention`.
    pub attention: T5Attention,
    /// `layer.1.layer_norm.weight`.
    pub ff_norm: GTensor,
    /// `layer.1.DenseReluDense`.
    pub ff: T5DenseGatedGelu,
}

/// The T5 encoder stack.
#[derive(Clone, Debug)]
pub struct T5EncoderModel {
    /// Configuration (dimensions as read from the tensors).
    pub config: T5Config,
    /// `shared.weight`, ggml `[d_model, vocab]`.
    pub shared: GTensor,
    /// Block 0's `relative_attention_bias.weight`, ggml `[heads, buckets]` (f32).
    pub relative_attention_bias: GTensor,
    /// `encoder.block`.
    pub blocks: Vec<T5Block>,
    /// `encoder.final_layer_norm.weight`.
    pub final_layer_norm: GTensor,
}

/// 1/32: the input scale of `wo` that keeps T5-XXL's feed-forward inside f16's range.
const WO_INPUT_SCALE: f32 = 1.0 / 32.0;

impl T5EncoderModel {
    /// Declares the parameters under `config.prefix` of `pb`, with the dimensions read from
    /// the tensors ([`T5Config::with_shapes_of`]).
    pub fn new(pb: &ParamBuilder<'_>, config: T5Config) -> Result<Self> {
        let config = config.with_shapes_of(pb)?;
        config.validate()?;
        let pb = pb.pp(&config.prefix);
        let (d, inner, ff) = (config.d_model, config.num_heads * config.d_kv, config.d_ff);
        let shared_name = if !pb.contains(SHARED) && pb.contains(EMBED_TOKENS) {
            EMBED_TOKENS
        } else {
            SHARED
        };
        let shared = pb.tensor(shared_name, &[config.vocab_size, d])?;
        let relative_attention_bias = pb.tensor_f32(
            REL_BIAS,
            &[config.relative_attention_num_buckets, config.num_heads],
        )?;
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let b = pb.pp(format!("encoder.block.{i}"));
            let a = b.pp("layer.0.SelfAttention");
            let f = b.pp("layer.1.DenseReluDense");
            blocks.push(T5Block {
                attn_norm: b.pp("layer.0.layer_norm").tensor("weight", &[d])?,
                attention: T5Attention {
                    q: Linear::new(&a.pp("q"), d, inner, false)?,
                    k: Linear::new(&a.pp("k"), d, inner, false)?,
                    v: Linear::new(&a.pp("v"), d, inner, false)?,
                    o: Linear::new(&a.pp("o"), inner, d, false)?,
                },
                ff_norm: b.pp("layer.1.layer_norm").tensor("weight", &[d])?,
                ff: T5DenseGatedGelu {
                    wi_0: Linear::new(&f.pp("wi_0"), d, ff, false)?,
                    wi_1: Linear::new(&f.pp("wi_1"), d, ff, false)?,
                    wo: Linear::new(&f.pp("wo"), ff, d, false)?,
                },
            });
        }
        let final_layer_norm = pb.pp("encoder.final_layer_norm").tensor("weight", &[d])?;
        Ok(T5EncoderModel {
            config,
            shared,
            relative_attention_bias,
            blocks,
            final_layer_norm,
        })
    }

    /// Builds the forward pass of `input_ids` (I32 `[n_tokens, B]`, no attention mask, as
    /// the FLUX and SD3 pipelines run it). Returns `last_hidden_state` `[d_model, n_tokens,
    /// B]` (final layer norm applied). Graph cuts: `shared` after the embedding and
    /// `encoder.block.N` after every block; the relative position bias is recomputed in each
    /// segment from its small table (`[buckets, heads]`) and the host-made bucket ids.
    pub fn forward(&self, g: &mut GraphCtx, input_ids: &GTensor) -> Result<GTensor> {
        let ctx = g.ctx.clone();
        let c = &self.config;
        let idn = input_ids.ne();
        let (n, b) = (idn[0], idn[1]);
        if input_ids.dtype() != Some(DType::I32) || idn[2] != 1 || idn[3] != 1 || n == 0 {
            return Err(ModelError::Input {
                name: "input_ids",
                detail: format!("{:?} {idn:?}, expected I32 [n, B]", input_ids.dtype()),
            });
        }
        let (d, h) = (c.d_model, c.num_heads);

        // 1. Token embedding.
        let ids = ctx.reshape(input_ids, &[n * b])?;
        let x = ctx.get_rows(&self.shared, &ids)?;
        let mut x = ctx.reshape(&x, &[d, n, b])?;
        g.marks.mark(&x, "shared", "h")?;

        // 2. Relative position bias [n_k, n_q, heads]: bucket ids of (key - query) made on the
        //    host, rows of the bias table gathered by them.
        let mut buckets = Vec::with_capacity(n * n);
        for q in 0..n {
            for k in 0..n {
                let bucket = relative_position_bucket(
                    k as i64 - q as i64,
                    c.relative_attention_num_buckets,
                    c.relative_attention_max_distance,
                );
                buckets.push(bucket as i32);
            }
        }
        let buckets = g.aux_input(
            "t5.relative_buckets",
            DType::I32,
            &[n * n],
            HostData::I32(buckets),
        )?;
        let bias = ctx.get_rows(&self.relative_attention_bias, &buckets)?; // [h, n_k * n_q]
        let bias = ctx.reshape(&bias, &[h, n, n])?;
        let bias = ctx.cont(&ctx.permute(&bias, [2, 0, 1, 3])?)?; // [n_k, n_q, h]

        // 3. Blocks (pre-norm residuals); a graph cut after each.
        for (i, blk) in self.blocks.iter().enumerate() {
            let r = rms_norm(&ctx, &x, &blk.attn_norm, c.layer_norm_epsilon)?;
            let a = &blk.attention;
            let o = self.attention(
                &ctx,
                &a.q.forward(&ctx, &r)?,
                &a.k.forward(&ctx, &r)?,
                &a.v.forward(&ctx, &r)?,
                &bias,
            )?;
            x = ctx.add(&x, &a.o.forward(&ctx, &o)?)?;
            let r = rms_norm(&ctx, &x, &blk.ff_norm, c.layer_norm_epsilon)?;
            x = ctx.add(&x, &self.feed_forward(g, &blk.ff, &r)?)?;
            g.marks.mark(&x, &format!("encoder.block.{i}"), "h")?;
        }

        // 4. Final RMS norm.
        rms_norm(&ctx, &x, &self.final_layer_norm, c.layer_norm_epsilon)
    }

    /// Unscaled softmax attention of `q`, `k`, `v` (`[heads * d_kv, n, B]`) with the
    /// position bias added to the scores.
    fn attention(
        &self,
        ctx: &Context,
        q: &GTensor,
        k: &GTensor,
        v: &GTensor,
        bias: &GTensor,
    ) -> Result<GTensor> {
        let (h, dk) = (self.config.num_heads, self.config.d_kv);
        let [_, n, b, _] = q.ne();
        // [dk, h, n, B] -> [dk, n, h, B]
        let split = |t: &GTensor| -> Result<GTensor> {
            let t = ctx.reshape(t, &[dk, h, n, b])?;
            Ok(ctx.cont(&ctx.permute(&t, [0, 2, 1, 3])?)?)
        };
        let (qh, kh) = (split(q)?, split(k)?);
        let scores = ctx.mul_mat(&kh, &qh)?; // [n_k, n_q, h, B]
        let scores = ctx.add(&scores, bias)?;
        let probs = ctx.soft_max_ext(&scores, None, 1.0)?;
        // v: [dk, h, n, B] -> [n, dk, h, B]
        let vt = ctx.reshape(v, &[dk, h, n, b])?;
        let vt = ctx.cont(&ctx.permute(&vt, [1, 2, 0, 3])?)?;
        let o = ctx.mul_mat(&vt, &probs)?; // [dk, n_q, h, B]
        let o = ctx.cont(&ctx.permute(&o, [0, 2, 1, 3])?)?; // [dk, h, n_q, B]
        Ok(ctx.reshape(&o, &[dk * h, n, b])?)
    }

    /// `wo(gelu_new(wi_0 x) * wi_1 x)`, `wo`'s input scaled by 1/32 and its output by 32.
    fn feed_forward(&self, g: &GraphCtx, ff: &T5DenseGatedGelu, x: &GTensor) -> Result<GTensor> {
        let ctx = &g.ctx;
        let gate = ff.wi_0.forward(ctx, x)?;
        let value = ff.wi_1.forward(ctx, x)?;
        // Exact numerics on the CPU: the GELU and the product in one pass (the project's
        // kernel); else ggml's ops.
        let fused = if g.opts.exact {
            ctx.gelu_tanh_host(&gate, Some(&value))?
        } else {
            None
        };
        let hidden = match fused {
            Some(h) => h,
            None => {
                let gate = if g.opts.exact {
                    gelu_tanh_exact(ctx, &gate)?
                } else {
                    ctx.gelu(&gate)?
                };
                ctx.mul(&gate, &value)?
            }
        };
        let y = ctx.mul_mat(&ff.wo.weight, &ctx.scale(&hidden, WO_INPUT_SCALE)?)?;
        ctx.set_precision(&y, Precision::F32);
        Ok(ctx.scale(&y, 1.0 / WO_INPUT_SCALE)?)
    }

    /// Descriptor and node capacity of one evaluation (about 45 nodes per block).
    pub fn graph_size(&self) -> usize {
        4096usize.max((64 * self.blocks.len()).next_power_of_two())
    }
}

/// `T5LayerNorm`: `weight * x / sqrt(mean(x^2) + eps)`.
fn rms_norm(ctx: &Context, x: &GTensor, weight: &GTensor, eps: f32) -> Result<GTensor> {
    Ok(ctx.mul(&ctx.rms_norm(x, eps)?, weight)?)
}

#[cfg(test)]
mod tests {
    use super::relative_position_bucket;

    #[test]
    fn buckets_match_the_t5_rule_at_known_points() {
        // Bidirectional, 32 buckets, max distance 128: 0..7 exact, negative side 0..15,
        // positive side 16..31, log-spaced from 8 on, the last bucket from 128 on.
        let b = |r| relative_position_bucket(r, 32, 128);
        assert_eq!(b(0), 0);
        assert_eq!(b(-1), 1);
        assert_eq!(b(1), 17);
        assert_eq!(b(-7), 7);
        assert_eq!(b(7), 23);
        assert_eq!(b(-8), 8);
        assert_eq!(b(-127), 15);
        assert_eq!(b(-128), 15);
        assert_eq!(b(1000), 31);
    }
}
