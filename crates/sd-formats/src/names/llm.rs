//! Decoder-only LLM text encoder names (Qwen2.5-VL's language model for Qwen-Image):
//! llama.cpp GGUF names to the canonical transformers layout.
//!
//! The canonical layout is the Hugging Face checkpoint's, under [`LLM_PREFIX`]
//! `text_encoders.llm.` (stable-diffusion.cpp's prefix, its `--llm` slot):
//! `model.embed_tokens.weight`, `model.layers.N.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
//! `model.norm.weight` (and `lm_head.weight`, unused by an encoder).
//!
//! Sources:
//!
//! | source | example |
//! |---|---|
//! | canonical (a transformers / ComfyUI file such as `qwen_2.5_vl_7b.safetensors` given for the slot) | `text_encoders.llm.model.layers.0.self_attn.q_proj.weight` |
//! | llama.cpp GGUF (`general.architecture` `qwen2vl`, `qwen2`, `qwen3`, `llama`) given for the slot | `text_encoders.llm.blk.0.attn_q.weight` |
//! | a Qwen-Image diffusers folder's `text_encoder/` (transformers 4.52+ nest the language model) | `text_encoder.model.language_model.layers.0.self_attn.q_proj.weight` |
//!
//! The GGUF table (llama.cpp's tensor names; stable-diffusion.cpp's `llm_name_map` in
//! `name_conversion.cpp` is the same): `token_embd` -> `model.embed_tokens`, `output_norm` ->
//! `model.norm`, `output` -> `lm_head`, and under `blk.N.` -> `model.layers.N.`: `attn_norm`
//! -> `input_layernorm`, `attn_{q,k,v}` -> `self_attn.{q,k,v}_proj`, `attn_output` ->
//! `self_attn.o_proj`, `attn_q_norm` / `attn_k_norm` -> `self_attn.{q,k}_norm` (Qwen3),
//! `ffn_norm` -> `post_attention_layernorm`, `ffn_{gate,up,down}` -> `mlp.{gate,up,down}_proj`.
//! Qwen2 and Qwen3 GGUFs keep q and k in the checkpoint's row order (llama.cpp permutes them
//! only for the `llama` architecture, which sd-rs does not load yet). Quantized GGUF tensors
//! keep their storage type: only names change.

use super::split_index;

/// The canonical prefix of the LLM text encoder (Qwen-Image's `--llm` slot).
pub const LLM_PREFIX: &str = "text_encoders.llm.";

const GGUF_LAYER: [(&str, &str); 11] = [
    ("attn_norm.", "input_layernorm."),
    ("attn_q_norm.", "self_attn.q_norm."),
    ("attn_k_norm.", "self_attn.k_norm."),
    ("attn_q.", "self_attn.q_proj."),
    ("attn_k.", "self_attn.k_proj."),
    ("attn_v.", "self_attn.v_proj."),
    ("attn_output.", "self_attn.o_proj."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("ffn_gate.", "mlp.gate_proj."),
    ("ffn_up.", "mlp.up_proj."),
    ("ffn_down.", "mlp.down_proj."),
];

/// Whether `rel` is a name of a transformers decoder-only LLM checkpoint
/// (`Qwen2_5_VLForConditionalGeneration` as saved by transformers before and after 4.52:
/// `model.layers.N...` or `model.language_model.layers.N...`, `lm_head`, the vision tower
/// under `visual.` or `model.visual.`), not a CLIP text model's (`text_model.`).
pub(crate) fn is_transformers_name(rel: &str) -> bool {
    ["model.", "lm_head.", "visual."]
        .iter()
        .any(|p| rel.starts_with(p))
}

/// The canonical (prefix-relative) name of `rel`, a transformers LLM name: transformers 4.52
/// and later save a multimodal model's language model under `model.language_model.`, which
/// reads as `model.`; every other name is already canonical.
pub(crate) fn transformers_to_canonical(rel: &str) -> std::borrow::Cow<'_, str> {
    match rel.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}").into(),
        None => rel.into(),
    }
}

/// The canonical (prefix-relative) name of `rel`, a llama.cpp GGUF LLM name; `None` when it
/// is not one (names in the transformers layout are already canonical).
pub(crate) fn gguf_to_canonical(rel: &str) -> Option<String> {
    if let Some(rest) = rel.strip_prefix("token_embd.") {
        return Some(format!("model.embed_tokens.{rest}"));
    }
    if let Some(rest) = rel.strip_prefix("output_norm.") {
        return Some(format!("model.norm.{rest}"));
    }
    if let Some(rest) = rel.strip_prefix("output.") {
        return Some(format!("lm_head.{rest}"));
    }
    let (n, rest) = rel.strip_prefix("blk.").and_then(split_index)?;
    GGUF_LAYER.iter().find_map(|(from, to)| {
        rest.strip_prefix(from)
            .filter(|r| !r.is_empty())
            .map(|r| format!("model.layers.{n}.{to}{r}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_transformers_names() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.0.attn_q.weight",
                "model.layers.0.self_attn.q_proj.weight",
            ),
            ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
            (
                "blk.12.attn_k.bias",
                "model.layers.12.self_attn.k_proj.bias",
            ),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.27.attn_output.weight",
                "model.layers.27.self_attn.o_proj.weight",
            ),
            (
                "blk.1.attn_q_norm.weight",
                "model.layers.1.self_attn.q_norm.weight",
            ),
            (
                "blk.1.attn_k_norm.weight",
                "model.layers.1.self_attn.k_norm.weight",
            ),
            (
                "blk.1.ffn_norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (
                "blk.1.ffn_gate.weight",
                "model.layers.1.mlp.gate_proj.weight",
            ),
            ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
            (
                "blk.1.ffn_down.weight",
                "model.layers.1.mlp.down_proj.weight",
            ),
        ];
        for (gguf, hf) in cases {
            assert_eq!(gguf_to_canonical(gguf).as_deref(), Some(hf), "{gguf}");
            assert_eq!(gguf_to_canonical(hf), None, "{hf}");
        }
        for other in [
            "blk.0.attn_x.weight",
            "blk.x.attn_q.weight",
            "blk.01.attn_q.weight",
            "enc.blk.0.attn_q.weight",
            "blk.0.attn_q.",
        ] {
            assert_eq!(gguf_to_canonical(other), None, "{other}");
        }
    }
}
