//! A decoder-only language model used as a text encoder: Qwen2.5-VL-7B's language model
//! (transformers `Qwen2_5_VLTextModel`, the text part of
//! `Qwen2_5_VLForConditionalGeneration`) as Qwen-Image conditions on it.
//!
//! Parameters live under the slot prefix ([`sd_formats::names::LLM_PREFIX`],
//! `text_encoders.llm.`), with the Hugging Face checkpoint's names: `model.embed_tokens.weight`,
//! `model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
//! mlp.{gate,up,down}_proj}`, `model.norm.weight`. `lm_head` and the vision tower (`visual.*`)
//! are not used. llama.cpp GGUF names are converted to these by `sd_formats::names` (`llm.rs`).
//!
//! The computation, as transformers does it (`modeling_qwen2_5_vl.py`):
//! - pre-norm layers: `x += o_proj(attn(rms_norm(x)))`, `x += mlp(rms_norm(x))`, and a final
//!   `model.norm`; the output is that normed last hidden state (`hidden_states[-1]`, what
//!   diffusers' `QwenImagePipeline` and stable-diffusion.cpp's `LLMEmbedder` read);
//! - RMS norms with a weight and no bias (`Qwen2RMSNorm`, eps 1e-6);
//! - grouped-query attention: `num_attention_heads` query heads share `num_key_value_heads`
//!   key/value heads (query head `i` reads key/value head `i / (heads / kv_heads)`), q, k and v
//!   with a bias, o without; scores scaled by `1/sqrt(head_dim)`; a causal mask;
//! - rotary position embedding of q and k in the NEOX layout (the first half of a head's values
//!   rotated against the second half), frequencies `rope_theta^(-2j / head_dim)`. Qwen2.5-VL's
//!   multimodal RoPE gives every token three positions (time, height, width) and takes
//!   `mrope_section` frequency bands from each; for a text-only prompt the three are equal
//!   (the token index), so it is this ordinary RoPE;
//! - the SwiGLU feed-forward `down_proj(silu(gate_proj(x)) * up_proj(x))`.
//!
//! Right padding needs no mask beyond the causal one: a token attends to earlier tokens only,
//! so padding after a prompt does not change the prompt's hidden states.
//!
//! The sizes are read from the tensors ([`LlmConfig::with_shapes_of`]); the head width is not
//! in them (Qwen2.5-VL and Qwen3 use 128, the default) and the RoPE base and norm epsilon come
//! from the config.

use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::DType;

use crate::nn::Linear;
use crate::weights::ParamBuilder;
use crate::{GraphCtx, HostData, ModelError, Result};

/// Configuration of a decoder-only LLM encoder.
///
/// Deserializes from transformers' `Qwen2_5_VLTextConfig` key names; missing keys keep
/// [`LlmConfig::qwen2_5_vl_7b`]'s values. [`LlmConfig::with_shapes_of`] replaces every
/// dimension the tensors determine (all but `head_dim`, `rms_norm_eps` and `rope_theta`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default = "LlmConfig::qwen2_5_vl_7b", deny_unknown_fields)]
pub struct LlmConfig {
    /// Vocabulary rows of `embed_tokens` (`vocab_size`).
    pub vocab_size: usize,
    /// Width (`hidden_size`).
    pub hidden_size: usize,
    /// Feed-forward width (`intermediate_size`).
    pub intermediate_size: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key/value heads (`num_key_value_heads`); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one head (`head_dim`; Qwen2.5-VL derives it as `hidden_size /
    /// num_attention_heads` = 128).
    pub head_dim: usize,
    /// Whether q, k and v have biases (Qwen2: yes; Qwen3: no). Read from the tensors.
    pub attention_bias: bool,
    /// RMS norm epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f32,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f32,
    /// The longest token sequence the family passes (sd-rs, not a transformers key: diffusers'
    /// Qwen-Image pipeline truncates at 1024 prompt tokens plus the 34 template tokens it
    /// drops). Used to plan memory before a prompt is known.
    pub max_tokens: usize,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl Default for LlmConfig {
    fn default() -> Self {
        Self::qwen2_5_vl_7b()
    }
}

impl LlmConfig {
    /// Qwen2.5-VL-7B-Instruct's language model (`Qwen/Qwen2.5-VL-7B-Instruct` `config.json`:
    /// `vocab_size` 152064, `hidden_size` 3584, `intermediate_size` 18944, 28 layers, 28
    /// attention heads, 4 key/value heads, `rms_norm_eps` 1e-6, `rope_theta` 1e6,
    /// `mrope_section` [16, 24, 24]); head width 3584 / 28 = 128; 1058 tokens (diffusers'
    /// `tokenizer_max_length` 1024 plus the 34 template tokens).
    pub fn qwen2_5_vl_7b() -> Self {
        LlmConfig {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            head_dim: 128,
            attention_bias: true,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_tokens: 1058,
            prefix: sd_formats::names::LLM_PREFIX
                .trim_end_matches('.')
                .to_string(),
        }
    }

    /// This config with the dimensions the tensors under `pb`'s prefix plus
    /// [`LlmConfig::prefix`] determine: vocabulary and width from `model.embed_tokens.weight`,
    /// query and key/value heads from layer 0's `q_proj` and `k_proj` rows over
    /// [`LlmConfig::head_dim`], the feed-forward width from `gate_proj`, the q/k/v bias from
    /// `q_proj.bias`, layers by counting them. Without a catalog (synthetic parameters) it is
    /// returned unchanged.
    pub fn with_shapes_of(&self, pb: &ParamBuilder<'_>) -> Result<LlmConfig> {
        let p = pb.pp(&self.prefix);
        let shape = |name: &str| p.file_shape(name);
        let Some(embed) = shape(EMBED_TOKENS) else {
            return Ok(self.clone());
        };
        let mut c = self.clone();
        let dims = |name: &str| -> Result<Vec<usize>> {
            match shape(name) {
                Some(s) if s.len() == 2 => Ok(s.iter().map(|&d| d as usize).collect()),
                Some(s) => Err(ModelError::ShapeMismatch {
                    name: format!("{}.{name}", p.prefix()),
                    file: s,
                    expected: vec![0; 2],
                }),
                None => Err(ModelError::MissingTensor {
                    name: format!("{}.{name}", p.prefix()),
                }),
            }
        };
        if embed.len() != 2 {
            return Err(ModelError::Config(format!(
                "LLM embedding `{}.{EMBED_TOKENS}` of shape {embed:?}, expected [vocab, hidden]",
                p.prefix()
            )));
        }
        c.vocab_size = embed[0] as usize;
        c.hidden_size = embed[1] as usize;
        let heads = |name: &str| -> Result<usize> {
            let rows = dims(&format!("model.layers.0.self_attn.{name}.weight"))?[0];
            if c.head_dim == 0 || !rows.is_multiple_of(c.head_dim) {
                return Err(ModelError::Config(format!(
                    "LLM: {name} of {rows} rows does not split into heads of {}",
                    c.head_dim
                )));
            }
            Ok(rows / c.head_dim)
        };
        c.num_attention_heads = heads("q_proj")?;
        c.num_key_value_heads = heads("k_proj")?;
        c.intermediate_size = dims("model.layers.0.mlp.gate_proj.weight")?[0];
        c.attention_bias = shape("model.layers.0.self_attn.q_proj.bias").is_some();
        c.num_hidden_layers = (0..)
            .take_while(|i| shape(&format!("model.layers.{i}.input_layernorm.weight")).is_some())
            .count();
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if self.hidden_size == 0
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
            || self.num_hidden_layers == 0
            || self.intermediate_size == 0
            || self.max_tokens == 0
            || !self.rope_theta.is_finite()
            || self.rope_theta <= 1.0
        {
            return Err(ModelError::Config(format!("LLM config {self:?}")));
        }
        Ok(())
    }
}

const EMBED_TOKENS: &str = "model.embed_tokens.weight";

/// The cos and sin tables of the NEOX-style rotation of `n` tokens at positions `0..n`,
/// `[n][head_dim]` each (token-major): value `i` of a head turns by `pos * theta^(-2j /
/// head_dim)` with `j = i mod head_dim / 2`, as transformers' `rotate_half` pairs value `j`
/// with value `j + head_dim / 2`.
pub fn rope_tables(n: usize, head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(n * head_dim);
    let mut sin = Vec::with_capacity(n * head_dim);
    for pos in 0..n {
        for i in 0..head_dim {
            let j = i % half;
            // As transformers: `inv_freq = 1 / theta^(arange(0, d, 2) / d)` and the angle
            // `pos * inv_freq` in f32 (the angle's rounding matters at long positions).
            let inv_freq = 1.0 / theta.powf(2.0 * j as f32 / head_dim as f32);
            let angle = (pos as f32 * inv_freq) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// `model.layers.N.self_attn`.
#[derive(Clone, Debug)]
pub struct LlmAttention {
    /// `q_proj` (with a bias in Qwen2).
    pub q_proj: Linear,
    /// `k_proj`.
    pub k_proj: Linear,
    /// `v_proj`.
    pub v_proj: Linear,
    /// `o_proj` (no bias).
    pub o_proj: Linear,
}

/// `model.layers.N.mlp` (SwiGLU).
#[derive(Clone, Debug)]
pub struct LlmMlp {
    /// `gate_proj`, the SiLU branch.
    pub gate_proj: Linear,
    /// `up_proj`, the linear branch.
    pub up_proj: Linear,
    /// `down_proj`.
    pub down_proj: Linear,
}

/// `model.layers.N`.
#[derive(Clone, Debug)]
pub struct LlmLayer {
    /// `input_layernorm.weight`.
    pub input_layernorm: GTensor,
    /// `self_attn`.
    pub self_attn: LlmAttention,
    /// `post_attention_layernorm.weight`.
    pub post_attention_layernorm: GTensor,
    /// `mlp`.
    pub mlp: LlmMlp,
}

/// The decoder stack used as an encoder (`model.*`).
#[derive(Clone, Debug)]
pub struct LlmModel {
    /// Configuration (dimensions as read from the tensors).
    pub config: LlmConfig,
    /// `model.embed_tokens.weight`, ggml `[hidden, vocab]`.
    pub embed_tokens: GTensor,
    /// `model.layers`.
    pub layers: Vec<LlmLayer>,
    /// `model.norm.weight`.
    pub norm: GTensor,
}

impl LlmModel {
    /// Declares the parameters under `config.prefix` of `pb`, with the dimensions read from
    /// the tensors ([`LlmConfig::with_shapes_of`]).
    pub fn new(pb: &ParamBuilder<'_>, config: LlmConfig) -> Result<Self> {
        let config = config.with_shapes_of(pb)?;
        config.validate()?;
        let pb = pb.pp(&config.prefix);
        let d = config.hidden_size;
        let (q, kv) = (
            config.num_attention_heads * config.head_dim,
            config.num_key_value_heads * config.head_dim,
        );
        let (ff, bias) = (config.intermediate_size, config.attention_bias);
        let embed_tokens = pb.tensor(EMBED_TOKENS, &[config.vocab_size, d])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let l = pb.pp(format!("model.layers.{i}"));
            let a = l.pp("self_attn");
            let m = l.pp("mlp");
            layers.push(LlmLayer {
                input_layernorm: l.pp("input_layernorm").tensor("weight", &[d])?,
                self_attn: LlmAttention {
                    q_proj: Linear::new(&a.pp("q_proj"), d, q, bias)?,
                    k_proj: Linear::new(&a.pp("k_proj"), d, kv, bias)?,
                    v_proj: Linear::new(&a.pp("v_proj"), d, kv, bias)?,
                    o_proj: Linear::new(&a.pp("o_proj"), q, d, false)?,
                },
                post_attention_layernorm: l
                    .pp("post_attention_layernorm")
                    .tensor("weight", &[d])?,
                mlp: LlmMlp {
                    gate_proj: Linear::new(&m.pp("gate_proj"), d, ff, false)?,
                    up_proj: Linear::new(&m.pp("up_proj"), d, ff, false)?,
                    down_proj: Linear::new(&m.pp("down_proj"), ff, d, false)?,
                },
            });
        }
        let norm = pb.pp("model.norm").tensor("weight", &[d])?;
        Ok(LlmModel {
            config,
            embed_tokens,
            layers,
            norm,
        })
    }

    /// Builds the forward pass of `input_ids` (I32 `[n_tokens, B]`, positions `0..n_tokens`,
    /// causal attention). Returns the last hidden state `[hidden, n_tokens, B]` with the final
    /// norm applied. Graph cuts: `model.embed_tokens` after the embedding and
    /// `model.layers.N` after every layer; the RoPE tables and the causal mask are host-made
    /// inputs every segment reads.
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
        let d = c.hidden_size;

        // 1. Token embedding.
        let ids = ctx.reshape(input_ids, &[n * b])?;
        let x = ctx.get_rows(&self.embed_tokens, &ids)?;
        let mut x = ctx.reshape(&x, &[d, n, b])?;
        g.marks.mark(&x, "model.embed_tokens", "h")?;

        // 2. RoPE tables [head_dim, 1, n] and the causal mask [n_k, n_q] (0 on and below the
        //    diagonal, -inf above), made on the host.
        let (cos, mut sin) = rope_tables(n, c.head_dim, c.rope_theta);
        let half = c.head_dim / 2;
        for row in sin.chunks_exact_mut(c.head_dim) {
            row[..half].iter_mut().for_each(|s| *s = -*s);
        }
        let ne = [c.head_dim, 1, n];
        let cos = g.aux_input("llm.rope_cos", DType::F32, &ne, HostData::F32(cos))?;
        let sin = g.aux_input("llm.rope_sin", DType::F32, &ne, HostData::F32(sin))?;
        let mut mask = Vec::with_capacity(n * n);
        for q in 0..n {
            mask.extend((0..n).map(|k| if k <= q { 0.0 } else { f32::NEG_INFINITY }));
        }
        let mask = g.aux_input("llm.causal_mask", DType::F32, &[n, n], HostData::F32(mask))?;
        let rope = Rope { cos, sin };

        // 3. Layers (pre-norm residuals); a graph cut after each.
        for (i, layer) in self.layers.iter().enumerate() {
            let r = rms_norm(&ctx, &x, &layer.input_layernorm, c.rms_norm_eps)?;
            let o = self.attention(&ctx, &layer.self_attn, &r, &rope, &mask)?;
            x = ctx.add(&x, &o)?;
            let r = rms_norm(&ctx, &x, &layer.post_attention_layernorm, c.rms_norm_eps)?;
            x = ctx.add(&x, &mlp(&ctx, &layer.mlp, &r)?)?;
            g.marks.mark(&x, &format!("model.layers.{i}"), "h")?;
        }

        // 4. Final RMS norm.
        rms_norm(&ctx, &x, &self.norm, c.rms_norm_eps)
    }

    /// Causal grouped-query self-attention of `x` (`[hidden, n, B]`), `o_proj` applied.
    fn attention(
        &self,
        ctx: &Context,
        a: &LlmAttention,
        x: &GTensor,
        rope: &Rope,
        mask: &GTensor,
    ) -> Result<GTensor> {
        let c = &self.config;
        let (hd, h, hkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let [_, n, b, _] = x.ne();
        // [hd * heads, n, B] -> rotated [hd, heads, n, B] -> [hd, n, heads, B]
        let heads = |t: &GTensor, heads: usize, rotate: bool| -> Result<GTensor> {
            let t = ctx.reshape(&ctx.cont(t)?, &[hd, heads, n, b])?;
            let t = if rotate { rope.apply(ctx, &t)? } else { t };
            Ok(ctx.cont(&ctx.permute(&t, [0, 2, 1, 3])?)?)
        };
        let qh = heads(&a.q_proj.forward(ctx, x)?, h, true)?;
        let kh = heads(&a.k_proj.forward(ctx, x)?, hkv, true)?;
        // ggml broadcasts the key/value heads over the query heads as GQA groups them: query
        // head i meets key/value head i / (h / hkv).
        let scores = ctx.mul_mat(&kh, &qh)?; // [n_k, n_q, h, B]
        let probs = ctx.soft_max_ext(&scores, Some(mask), 1.0 / (hd as f32).sqrt())?;
        // v: [hd, hkv, n, B] -> [n, hd, hkv, B]
        let v = ctx.reshape(&a.v_proj.forward(ctx, x)?, &[hd, hkv, n, b])?;
        let vt = ctx.cont(&ctx.permute(&v, [1, 2, 0, 3])?)?;
        let o = ctx.mul_mat(&vt, &probs)?; // [hd, n_q, h, B]
        let o = ctx.cont(&ctx.permute(&o, [0, 2, 1, 3])?)?; // [hd, h, n_q, B]
        a.o_proj.forward(ctx, &ctx.reshape(&o, &[hd * h, n, b])?)
    }

    /// Descriptor and node capacity of one evaluation (about 50 nodes per layer).
    pub fn graph_size(&self) -> usize {
        4096usize.max((64 * self.layers.len()).next_power_of_two())
    }
}

/// NEOX-style rotary embedding with host-made tables `[head_dim, 1, n]` ([`rope_tables`],
/// `sin` negated in the first half of a head): `x * cos + rotate_half(x) * sin` with
/// `rotate_half(x) = [-x2, x1]` for the halves `x1`, `x2` of a head, computed as
/// `x * cos + [x2, x1] * [-sin, sin]`.
struct Rope {
    cos: GTensor,
    sin: GTensor,
}

impl Rope {
    /// Rotates `[head_dim, heads, n, B]` (contiguous).
    fn apply(&self, ctx: &Context, x: &GTensor) -> Result<GTensor> {
        let [hd, h, n, b] = x.ne();
        let nb = x.nb();
        let half = hd / 2;
        let part = |offset: usize| ctx.view(x, [half, h, n, b], [nb[1], nb[2], nb[3]], offset);
        let x1 = part(0)?;
        let x2 = part(half * nb[0])?;
        let swapped = ctx.concat(&x2, &x1, 0)?;
        let o = ctx.add(&ctx.mul(x, &self.cos)?, &ctx.mul(&swapped, &self.sin)?)?;
        Ok(o)
    }
}

/// `down_proj(silu(gate_proj(x)) * up_proj(x))`.
fn mlp(ctx: &Context, m: &LlmMlp, x: &GTensor) -> Result<GTensor> {
    let gate = ctx.silu(&m.gate_proj.forward(ctx, x)?)?;
    let hidden = ctx.mul(&gate, &m.up_proj.forward(ctx, x)?)?;
    m.down_proj.forward(ctx, &hidden)
}

/// `Qwen2RMSNorm`: `weight * x / sqrt(mean(x^2) + eps)`.
fn rms_norm(ctx: &Context, x: &GTensor, weight: &GTensor, eps: f32) -> Result<GTensor> {
    Ok(ctx.mul(&ctx.rms_norm(x, eps)?, weight)?)
}

#[cfg(test)]
mod tests {
    use super::rope_tables;

    #[test]
    fn rope_tables_pair_value_j_with_value_j_plus_half() {
        let (cos, sin) = rope_tables(3, 8, 1e6);
        assert_eq!(cos.len(), 24);
        // Position 0 does not turn.
        assert!(cos[..8].iter().all(|&c| c == 1.0) && sin[..8].iter().all(|&s| s == 0.0));
        // Position 1: frequency 1 for j = 0, theta^(-1/4) for j = 1; both halves alike.
        assert!((sin[8] - 1f32.sin()).abs() < 1e-7);
        assert!((sin[9] - (1e6f32.powf(-0.25)).sin()).abs() < 1e-7);
        assert_eq!(&cos[8..12], &cos[12..16]);
        assert_eq!(&sin[16..20], &sin[20..24]);
    }
}
