//! T5 encoder names: llama.cpp GGUF and the per-tool prefixes to the canonical layout.
//!
//! The canonical T5 layout is transformers' `T5EncoderModel` under [`T5_PREFIX`]
//! `text_encoders.t5xxl.transformer.` (stable-diffusion.cpp's prefix for FLUX.1 and SD3
//! bundles): `shared.weight`, `encoder.block.N.layer.0.{layer_norm, SelfAttention.{q,k,v,o,
//! relative_attention_bias}}`, `encoder.block.N.layer.1.{layer_norm,
//! DenseReluDense.{wi_0,wi_1,wo}}`, `encoder.final_layer_norm.weight`
//! (`encoder.embed_tokens.weight`, the tied copy of `shared` some files carry, keeps its
//! name; the model takes either).
//!
//! Sources:
//!
//! | source | example |
//! |---|---|
//! | canonical (stable-diffusion.cpp, ComfyUI bundles) | `text_encoders.t5xxl.transformer.shared.weight` |
//! | stable-diffusion.cpp's short prefix | `te3.encoder.block.0....` |
//! | diffusers pipeline folders (FLUX `text_encoder_2/`, SD3 `text_encoder_3/`) | `text_encoder_2.encoder.block.0....` |
//! | a bare `T5EncoderModel` file (`t5xxl_fp16.safetensors`) | `encoder.block.0....`, `shared.weight` |
//! | llama.cpp GGUF (`general.architecture` `t5encoder`), bare or under a prefix | `enc.blk.0.attn_q.weight`, `token_embd.weight` |
//!
//! The GGUF table (llama.cpp's `LLM_ARCH_T5ENCODER` tensor names; stable-diffusion.cpp's
//! `t5_name_map` in `name_conversion.cpp` is the same): `token_embd` -> `shared`,
//! `enc.output_norm` -> `encoder.final_layer_norm`, and under `enc.blk.N.` ->
//! `encoder.block.N.`: `attn_norm` -> `layer.0.layer_norm`, `attn_{q,k,v,o}` ->
//! `layer.0.SelfAttention.{q,k,v,o}`, `attn_rel_b` ->
//! `layer.0.SelfAttention.relative_attention_bias`, `ffn_norm` -> `layer.1.layer_norm`,
//! `ffn_gate` -> `layer.1.DenseReluDense.wi_0`, `ffn_up` -> `wi_1`, `ffn_down` -> `wo`.
//! Quantized GGUF tensors keep their storage type: only names change.

use super::split_index;

/// The canonical prefix of the T5 encoder (FLUX.1's and SD3's `--t5xxl` slot).
pub const T5_PREFIX: &str = "text_encoders.t5xxl.transformer.";

/// Prefixes under which T5 names are found, besides [`T5_PREFIX`] and the bare layout.
pub(crate) const T5_SOURCE_PREFIXES: [&str; 3] = ["te3.", "text_encoder_2.", "text_encoder_3."];

/// The GGUF marker of a T5 encoder (present in every llama.cpp T5 encoder file).
pub(crate) const GGUF_MARKER: &str = "enc.blk.0.attn_q.weight";
/// The transformers marker of a T5 encoder.
pub(crate) const HF_MARKER: &str = "encoder.block.0.layer.0.SelfAttention.q.weight";

const GGUF_BLOCK: [(&str, &str); 10] = [
    ("attn_norm.", "layer.0.layer_norm."),
    ("attn_q.", "layer.0.SelfAttention.q."),
    ("attn_k.", "layer.0.SelfAttention.k."),
    ("attn_v.", "layer.0.SelfAttention.v."),
    ("attn_o.", "layer.0.SelfAttention.o."),
    (
        "attn_rel_b.",
        "layer.0.SelfAttention.relative_attention_bias.",
    ),
    ("ffn_norm.", "layer.1.layer_norm."),
    ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
    ("ffn_up.", "layer.1.DenseReluDense.wi_1."),
    ("ffn_down.", "layer.1.DenseReluDense.wo."),
];

/// Whether `rel` (relative to a T5 prefix, or a bare name) is a T5 encoder name in the
/// transformers layout.
pub(crate) fn is_hf_name(rel: &str) -> bool {
    rel == "shared.weight"
        || rel == "encoder.embed_tokens.weight"
        || rel.starts_with("encoder.final_layer_norm.")
        || rel
            .strip_prefix("encoder.block.")
            .and_then(split_index)
            .is_some_and(|(_, rest)| rest.starts_with("layer."))
}

/// Whether `rel` is a llama.cpp GGUF T5 encoder name.
pub(crate) fn is_gguf_name(rel: &str) -> bool {
    rel.starts_with("token_embd.")
        || rel.starts_with("enc.blk.")
        || rel.starts_with("enc.output_norm.")
}

/// The canonical (prefix-relative) name of `rel`, a T5 name in either layout; `None` when it
/// is not one.
pub(crate) fn to_canonical(rel: &str) -> Option<String> {
    if is_hf_name(rel) {
        return Some(rel.to_owned());
    }
    if let Some(rest) = rel.strip_prefix("token_embd.") {
        return Some(format!("shared.{rest}"));
    }
    if let Some(rest) = rel.strip_prefix("enc.output_norm.") {
        return Some(format!("encoder.final_layer_norm.{rest}"));
    }
    let (n, rest) = rel.strip_prefix("enc.blk.").and_then(split_index)?;
    GGUF_BLOCK.iter().find_map(|(from, to)| {
        rest.strip_prefix(from)
            .filter(|r| !r.is_empty())
            .map(|r| format!("encoder.block.{n}.{to}{r}"))
    })
}

/// What kind of text encoder a set of tensor names holds, by their marker tensors (names as
/// a component file has them, before conversion; prefixes of the known sources allowed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextEncoderKind {
    /// A CLIP text transformer (transformers or OpenCLIP layout).
    Clip,
    /// A T5 encoder (transformers or llama.cpp GGUF layout).
    T5,
}

/// Tells a T5 file from a CLIP one by their marker tensors: `encoder.block.0` /
/// `enc.blk.0` / `shared.weight` (T5) against `token_embedding` / `resblocks` (CLIP), under
/// any prefix. `None` when neither is there (a UNet, a VAE, something else).
pub fn detect_text_encoder<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> Option<TextEncoderKind> {
    let (mut t5, mut clip) = (false, false);
    for name in names {
        t5 |= name.ends_with(HF_MARKER) || name.ends_with(GGUF_MARKER);
        clip |= name.ends_with("embeddings.token_embedding.weight")
            || name.ends_with("transformer.resblocks.0.attn.in_proj_weight");
    }
    match (t5, clip) {
        (true, false) => Some(TextEncoderKind::T5),
        (false, true) => Some(TextEncoderKind::Clip),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_transformers_names() {
        let cases = [
            ("token_embd.weight", "shared.weight"),
            ("enc.output_norm.weight", "encoder.final_layer_norm.weight"),
            (
                "enc.blk.0.attn_q.weight",
                "encoder.block.0.layer.0.SelfAttention.q.weight",
            ),
            (
                "enc.blk.3.attn_o.weight",
                "encoder.block.3.layer.0.SelfAttention.o.weight",
            ),
            (
                "enc.blk.0.attn_rel_b.weight",
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            ),
            (
                "enc.blk.23.attn_norm.weight",
                "encoder.block.23.layer.0.layer_norm.weight",
            ),
            (
                "enc.blk.1.ffn_norm.weight",
                "encoder.block.1.layer.1.layer_norm.weight",
            ),
            (
                "enc.blk.1.ffn_gate.weight",
                "encoder.block.1.layer.1.DenseReluDense.wi_0.weight",
            ),
            (
                "enc.blk.1.ffn_up.weight",
                "encoder.block.1.layer.1.DenseReluDense.wi_1.weight",
            ),
            (
                "enc.blk.1.ffn_down.weight",
                "encoder.block.1.layer.1.DenseReluDense.wo.weight",
            ),
        ];
        for (gguf, hf) in cases {
            assert_eq!(to_canonical(gguf).as_deref(), Some(hf), "{gguf}");
            assert_eq!(to_canonical(hf).as_deref(), Some(hf), "{hf}");
        }
        for other in [
            "enc.blk.0.attn_x.weight",
            "enc.blk.x.attn_q.weight",
            "blk.0.attn_q.weight",
        ] {
            assert_eq!(to_canonical(other), None, "{other}");
        }
    }

    #[test]
    fn markers_tell_t5_from_clip() {
        let t5 = ["shared.weight", HF_MARKER];
        assert_eq!(detect_text_encoder(t5), Some(TextEncoderKind::T5));
        assert_eq!(
            detect_text_encoder(["token_embd.weight", GGUF_MARKER]),
            Some(TextEncoderKind::T5)
        );
        let clip = ["text_model.embeddings.token_embedding.weight"];
        assert_eq!(detect_text_encoder(clip), Some(TextEncoderKind::Clip));
        assert_eq!(detect_text_encoder(["encoder.conv_in.weight"]), None);
    }
}
