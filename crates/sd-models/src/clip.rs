//! The CLIP text encoder (transformers `CLIPTextModel` layout) as used by SD1.x, SD2.x and
//! SDXL (CLIP-L and OpenCLIP-bigG).
//!
//! Parameters live under `cond_stage_model.transformer.text_model.` (canonical names; SD2's
//! and SDXL's OpenCLIP checkpoints are converted to this layout by `sd_formats::names`;
//! bigG lives under `cond_stage_model.1.transformer.text_model.`):
//! `embeddings.{token,position}_embedding.weight`, `encoder.layers.N.{layer_norm1,
//! self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`, `final_layer_norm`.
//!
//! With a projection ([`ClipTextConfig::projection_dim`], SDXL's bigG) the model also gives
//! the pooled output of `CLIPTextModelWithProjection`: the last layer's hidden state at the
//! end-of-text token, final layer norm, then the text projection, stored either as
//! transformers' `text_projection.weight` (`[proj, width]`, next to `text_model`) or as
//! OpenCLIP's `text_model.text_projection` (`[width, proj]`, transposed here); see
//! [`sd_formats::names::TEXT_PROJECTION_LINEAR`].

use sd_formats::names::{
    CLIP_G_PREFIX, CLIP_PREFIX, TEXT_PROJECTION_LINEAR, TEXT_PROJECTION_OPENCLIP,
};
use sd_tensor::ggml::GTensor;
use sd_tensor::DType;

use crate::nn::{attention, Activation, LayerNorm, Linear};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, HostData, ModelError, Result};

/// Configuration of a CLIP text encoder.
///
/// Deserializes from the transformers key names; missing keys keep [`ClipTextConfig::sd1`]'s
/// values.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default = "ClipTextConfig::sd1", deny_unknown_fields)]
pub struct ClipTextConfig {
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Width (`hidden_size`).
    pub hidden_size: usize,
    /// MLP width (`intermediate_size`).
    pub intermediate_size: usize,
    /// Number of transformer layers in the checkpoint (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Attention heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Positions (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// MLP activation (`hidden_act`).
    pub hidden_act: Activation,
    /// LayerNorm epsilon (`layer_norm_eps`).
    pub layer_norm_eps: f32,
    /// stable-diffusion.cpp's clip skip: the output is that of layer
    /// `num_hidden_layers - (clip_skip - 1)`; 1 uses every layer. (diffusers' `clip_skip`
    /// is this minus one.)
    pub clip_skip: usize,
    /// Apply `final_layer_norm` to the selected hidden state (SD1 and SD2 do; SDXL's
    /// encoders do not).
    pub final_layer_norm: bool,
    /// Width of the pooled text projection (`projection_dim` of
    /// `CLIPTextModelWithProjection`; SDXL's bigG: 1280). `Some`: every layer, the final
    /// layer norm and the projection are declared, and
    /// [`ClipTextModel::forward_with_pooled`] is available.
    pub projection_dim: Option<usize>,
    /// Name prefix of the parameters (set by the loader, never read from a config).
    #[serde(skip)]
    pub prefix: String,
}

impl ClipTextConfig {
    /// SD1.x's CLIP ViT-L/14 text tower (`openai/clip-vit-large-patch14` `config.json`:
    /// 12 layers, 768 wide, 12 heads, MLP 3072, `quick_gelu`, 77 positions, vocab 49408).
    pub fn sd1() -> Self {
        ClipTextConfig {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: Activation::QuickGelu,
            layer_norm_eps: 1e-5,
            clip_skip: 1,
            final_layer_norm: true,
            projection_dim: None,
            prefix: format!("{CLIP_PREFIX}text_model"),
        }
    }

    /// SDXL's first encoder: CLIP ViT-L/14 as SD1's, its penultimate layer without the final
    /// layer norm (`sgm` `FrozenCLIPEmbedder`, `layer: hidden, layer_idx: 11`).
    pub fn sdxl_clip_l() -> Self {
        ClipTextConfig {
            clip_skip: 2,
            final_layer_norm: false,
            ..Self::sd1()
        }
    }

    /// SDXL's second encoder (the refiner's only one): OpenCLIP ViT-bigG/14
    /// (`stabilityai/stable-diffusion-xl-base-1.0` `text_encoder_2/config.json`: 32 layers,
    /// 1280 wide, 20 heads, MLP 5120, `gelu`, `projection_dim: 1280`). The context is the
    /// penultimate layer without the final layer norm (`FrozenOpenCLIPEmbedder2`, `layer:
    /// penultimate`); the pooled output is projected.
    pub fn sdxl_clip_g() -> Self {
        ClipTextConfig {
            vocab_size: 49408,
            hidden_size: 1280,
            intermediate_size: 5120,
            num_hidden_layers: 32,
            num_attention_heads: 20,
            max_position_embeddings: 77,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            clip_skip: 2,
            final_layer_norm: false,
            projection_dim: Some(1280),
            prefix: format!("{CLIP_G_PREFIX}text_model"),
        }
    }

    /// SD2.x's OpenCLIP ViT-H/14 text tower (`stabilityai/stable-diffusion-2-1`
    /// `text_encoder/config.json`: 23 of 24 layers, 1024 wide, 16 heads, MLP 4096, `gelu`).
    /// The checkpoint has 24 layers; SD2 uses the penultimate one (`layer: penultimate` in
    /// the v2 inference config), so `clip_skip` is 2.
    pub fn sd2() -> Self {
        ClipTextConfig {
            vocab_size: 49408,
            hidden_size: 1024,
            intermediate_size: 4096,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            max_position_embeddings: 77,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            clip_skip: 2,
            final_layer_norm: true,
            projection_dim: None,
            prefix: format!("{CLIP_PREFIX}text_model"),
        }
    }

    /// Number of layers the forward pass runs.
    pub fn layers_used(&self) -> usize {
        self.num_hidden_layers
            .saturating_sub(self.clip_skip.max(1) - 1)
    }

    /// Number of layers declared: all of them with a projection (the pooled output reads
    /// the last one), else [`ClipTextConfig::layers_used`].
    pub fn layers_declared(&self) -> usize {
        if self.projection_dim.is_some() {
            self.num_hidden_layers
        } else {
            self.layers_used()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.num_attention_heads == 0
            || self.projection_dim == Some(0)
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
            || self.layers_used() == 0
            || self.max_position_embeddings == 0
        {
            return Err(ModelError::Config(format!("CLIP config {self:?}")));
        }
        Ok(())
    }
}

/// `self_attn`.
#[derive(Clone, Debug)]
pub struct ClipAttention {
    /// `q_proj`.
    pub q_proj: Linear,
    /// `k_proj`.
    pub k_proj: Linear,
    /// `v_proj`.
    pub v_proj: Linear,
    /// `out_proj`.
    pub out_proj: Linear,
    heads: usize,
}

/// `mlp`.
#[derive(Clone, Debug)]
pub struct ClipMlp {
    /// `fc1`.
    pub fc1: Linear,
    /// `fc2`.
    pub fc2: Linear,
    act: Activation,
}

/// `encoder.layers.N`.
#[derive(Clone, Debug)]
pub struct ClipEncoderLayer {
    /// `layer_norm1`.
    pub layer_norm1: LayerNorm,
    /// `self_attn`.
    pub self_attn: ClipAttention,
    /// `layer_norm2`.
    pub layer_norm2: LayerNorm,
    /// `mlp`.
    pub mlp: ClipMlp,
}

/// `embeddings`.
#[derive(Clone, Debug)]
pub struct ClipEmbeddings {
    /// `token_embedding.weight`, ggml `[hidden, vocab]`.
    pub token_embedding: GTensor,
    /// `position_embedding.weight`, ggml `[hidden, positions]` (f32).
    pub position_embedding: GTensor,
}

/// The CLIP text transformer.
#[derive(Clone, Debug)]
pub struct ClipTextModel {
    /// Configuration.
    pub config: ClipTextConfig,
    /// `embeddings`.
    pub embeddings: ClipEmbeddings,
    /// `encoder.layers` (only those the forward pass uses are declared).
    pub layers: Vec<ClipEncoderLayer>,
    /// `final_layer_norm`.
    pub final_layer_norm: Option<LayerNorm>,
    /// The pooled-output projection, when configured.
    pub text_projection: Option<TextProjection>,
}

/// The pooled-output projection in one of its two stored layouts.
#[derive(Clone, Debug)]
pub enum TextProjection {
    /// transformers' `text_projection.weight` `W` `[proj, width]`, applied as `x W^T`.
    Linear(Linear),
    /// OpenCLIP's `text_projection` `P` `[width, proj]`, applied as `x P`.
    OpenClip(GTensor),
}

impl TextProjection {
    fn forward(&self, ctx: &sd_tensor::ggml::Context, x: &GTensor) -> Result<GTensor> {
        match self {
            TextProjection::Linear(l) => l.forward(ctx, x),
            TextProjection::OpenClip(p) => {
                let pt = ctx.cont(&ctx.transpose(p)?)?;
                Ok(ctx.mul_mat(&pt, x)?)
            }
        }
    }
}

impl ClipTextModel {
    /// Declares the parameters under `config.prefix` of `pb`.
    pub fn new(pb: &ParamBuilder<'_>, config: ClipTextConfig) -> Result<Self> {
        config.validate()?;
        let root = pb.clone();
        let pb = pb.pp(&config.prefix);
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let e = pb.pp("embeddings");
        let embeddings = ClipEmbeddings {
            token_embedding: e
                .pp("token_embedding")
                .tensor("weight", &[config.vocab_size, h])?,
            position_embedding: e
                .pp("position_embedding")
                .tensor_f32("weight", &[config.max_position_embeddings, h])?,
        };
        let mut layers = Vec::with_capacity(config.layers_declared());
        for i in 0..config.layers_declared() {
            let l = pb.pp(format!("encoder.layers.{i}"));
            let a = l.pp("self_attn");
            let m = l.pp("mlp");
            layers.push(ClipEncoderLayer {
                layer_norm1: LayerNorm::new(&l.pp("layer_norm1"), h, eps)?,
                self_attn: ClipAttention {
                    q_proj: Linear::new(&a.pp("q_proj"), h, h, true)?,
                    k_proj: Linear::new(&a.pp("k_proj"), h, h, true)?,
                    v_proj: Linear::new(&a.pp("v_proj"), h, h, true)?,
                    out_proj: Linear::new(&a.pp("out_proj"), h, h, true)?,
                    heads: config.num_attention_heads,
                },
                layer_norm2: LayerNorm::new(&l.pp("layer_norm2"), h, eps)?,
                mlp: ClipMlp {
                    fc1: Linear::new(&m.pp("fc1"), h, config.intermediate_size, true)?,
                    fc2: Linear::new(&m.pp("fc2"), config.intermediate_size, h, true)?,
                    act: config.hidden_act,
                },
            });
        }
        let final_layer_norm = if config.final_layer_norm || config.projection_dim.is_some() {
            Some(LayerNorm::new(&pb.pp("final_layer_norm"), h, eps)?)
        } else {
            None
        };
        let text_projection = match config.projection_dim {
            None => None,
            Some(proj) => {
                // The slot prefix: `text_model`'s parent.
                let slot = config
                    .prefix
                    .strip_suffix("text_model")
                    .unwrap_or(&config.prefix)
                    .trim_end_matches('.');
                let slot = root.pp(slot);
                let open_clip = TEXT_PROJECTION_OPENCLIP;
                let linear = TEXT_PROJECTION_LINEAR.trim_end_matches(".weight");
                if !slot.contains(TEXT_PROJECTION_LINEAR) && slot.contains(open_clip) {
                    Some(TextProjection::OpenClip(
                        slot.tensor(open_clip, &[h, proj])?,
                    ))
                } else {
                    Some(TextProjection::Linear(Linear::new(
                        &slot.pp(linear),
                        h,
                        proj,
                        false,
                    )?))
                }
            }
        };
        Ok(ClipTextModel {
            config,
            embeddings,
            layers,
            final_layer_norm,
            text_projection,
        })
    }

    /// Builds the forward pass of `input_ids` (I32 `[n_tokens, B]`, `n_tokens` at most
    /// `max_position_embeddings`). Returns the hidden states `[hidden, n_tokens, B]` of the
    /// layer selected by `clip_skip`, final layer norm applied if configured.
    pub fn forward(&self, g: &mut GraphCtx, input_ids: &GTensor) -> Result<GTensor> {
        let (hidden, _) = self.encode(g, input_ids, self.config.layers_used())?;
        Ok(hidden)
    }

    /// Like [`ClipTextModel::forward`], and also the pooled output: the last layer's hidden
    /// state of sequence `b` at token `pool_at[b]` (the first end-of-text token: transformers
    /// and OpenCLIP take the position of the largest id, which is end-of-text in the CLIP
    /// vocabulary), final layer norm, then the text projection when the model has one
    /// (`[projection_dim, B]`; bigG's `text_embeds`), else unprojected (`[hidden, B]`;
    /// transformers' `pooler_output`, what FLUX.1 takes from CLIP-L). Needs the final layer
    /// norm.
    pub fn forward_with_pooled(
        &self,
        g: &mut GraphCtx,
        input_ids: &GTensor,
        pool_at: &[usize],
    ) -> Result<(GTensor, GTensor)> {
        let Some(ln) = &self.final_layer_norm else {
            return Err(ModelError::Config(
                "pooled output asked of a CLIP text model without its final layer norm".into(),
            ));
        };
        let [n, b, _, _] = input_ids.ne();
        if pool_at.len() != b || pool_at.iter().any(|&p| p >= n) {
            return Err(ModelError::Input {
                name: "pool_at",
                detail: format!("{pool_at:?}, expected {b} positions below {n}"),
            });
        }
        let (hidden, last) = self.encode(g, input_ids, self.config.num_hidden_layers)?;
        let ctx = g.ctx.clone();
        let h = self.config.hidden_size;
        let rows: Vec<i32> = pool_at
            .iter()
            .enumerate()
            .map(|(i, &p)| (i * n + p) as i32)
            .collect();
        let idx = g.aux_input("clip.pool_index", DType::I32, &[b], HostData::I32(rows))?;
        let flat = ctx.reshape(&last, &[h, n * b])?;
        let pooled = ctx.get_rows(&flat, &idx)?; // [h, B]
        let pooled = ln.forward(&ctx, &pooled)?;
        match &self.text_projection {
            Some(proj) => Ok((hidden, proj.forward(&ctx, &pooled)?)),
            None => Ok((hidden, pooled)),
        }
    }

    /// Runs `run` layers; returns the hidden state of layer `layers_used` (final layer norm
    /// applied if configured) and that of the last layer run (no norm).
    fn encode(
        &self,
        g: &mut GraphCtx,
        input_ids: &GTensor,
        run: usize,
    ) -> Result<(GTensor, GTensor)> {
        let ctx = g.ctx.clone();
        let idn = input_ids.ne();
        let (n, b) = (idn[0], idn[1]);
        if input_ids.dtype() != Some(DType::I32)
            || idn[2] != 1
            || idn[3] != 1
            || n == 0
            || n > self.config.max_position_embeddings
        {
            return Err(ModelError::Input {
                name: "input_ids",
                detail: format!(
                    "{:?} {:?}, expected I32 [n <= {}, B]",
                    input_ids.dtype(),
                    idn,
                    self.config.max_position_embeddings
                ),
            });
        }
        let h = self.config.hidden_size;

        // 1. Embeddings: token rows plus the first n position rows.
        let ids = ctx.reshape(input_ids, &[n * b])?;
        let x = ctx.get_rows(&self.embeddings.token_embedding, &ids)?;
        let x = ctx.reshape(&x, &[h, n, b])?;
        let pe = &self.embeddings.position_embedding;
        let pos = ctx.view(pe, [h, n, 1, 1], [pe.nb()[1], pe.nb()[2], pe.nb()[3]], 0)?;
        let mut x = ctx.add(&x, &pos)?;
        g.marks.mark(&x, "embeddings", "h")?;

        // 2. Causal mask: 0 on and below the diagonal, -inf above.
        let mut mask = vec![0f32; n * n];
        for (q, row) in mask.chunks_mut(n).enumerate() {
            for v in &mut row[q + 1..] {
                *v = f32::NEG_INFINITY;
            }
        }
        let mask = g.aux_input("clip.causal_mask", DType::F32, &[n, n], HostData::F32(mask))?;

        // 3. Encoder layers (pre-norm), up to the clip-skip layer (or all of them for the
        //    pooled output); a graph cut after each.
        let used = self.config.layers_used();
        let mut selected = None;
        for (i, layer) in self.layers.iter().take(run).enumerate() {
            let r = layer.layer_norm1.forward(&ctx, &x)?;
            let a = &layer.self_attn;
            let q = a.q_proj.forward(&ctx, &r)?;
            let k = a.k_proj.forward(&ctx, &r)?;
            let v = a.v_proj.forward(&ctx, &r)?;
            let o = attention(g, &q, &k, &v, a.heads, Some(&mask))?;
            x = ctx.add(&x, &a.out_proj.forward(&ctx, &o)?)?;
            let r = layer.layer_norm2.forward(&ctx, &x)?;
            let r = layer.mlp.fc1.forward(&ctx, &r)?;
            let r = layer.mlp.act.forward(&ctx, &r, g.opts)?;
            x = ctx.add(&x, &layer.mlp.fc2.forward(&ctx, &r)?)?;
            g.marks.mark(&x, &format!("encoder.layers.{i}"), "h")?;
            if i + 1 == used {
                selected = Some(x.clone());
            }
        }
        let mut hidden = selected.unwrap_or_else(|| x.clone());

        // 4. Final layer norm of the selected layer.
        if let (true, Some(ln)) = (self.config.final_layer_norm, &self.final_layer_norm) {
            hidden = ln.forward(&ctx, &hidden)?;
        }
        Ok((hidden, x))
    }
}
