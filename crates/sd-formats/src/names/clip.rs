//! CLIP text encoder names: OpenCLIP and the transformers layouts to the canonical one.
//!
//! The canonical text encoder layout is transformers' `CLIPTextModel` under a slot prefix,
//! the names stable-diffusion.cpp uses:
//!
//! * [`CLIP_PREFIX`] `cond_stage_model.transformer.`: the first (or only) text encoder, CLIP
//!   ViT-L for SD1.x and SDXL, OpenCLIP ViT-H for SD2.x;
//! * [`CLIP_G_PREFIX`] `cond_stage_model.1.transformer.`: SDXL's OpenCLIP ViT-bigG (also the
//!   refiner's only encoder).
//!
//! followed by `text_model.embeddings.{token_embedding,position_embedding}.weight`,
//! `text_model.encoder.layers.N.{self_attn.{q,k,v,out}_proj,layer_norm1,layer_norm2,mlp.fc1,mlp.fc2}.*`
//! and `text_model.final_layer_norm.*`.
//!
//! Sources:
//!
//! | source | slot |
//! |---|---|
//! | `cond_stage_model.transformer.*` (SD1 original; already canonical) | first |
//! | `cond_stage_model.model.*` (SD2 original, OpenCLIP) | first |
//! | `conditioner.embedders.N.transformer.*` (SDXL original, CLIP-L) | first |
//! | `conditioner.embedders.N.model.*` (SDXL original, OpenCLIP-G) | second |
//! | `text_encoder.*` / `text_encoder_2.*` (diffusers pipeline folders, transformers names) | first / second |
//! | bare `text_model.*` (a transformers file) | second if 1280 wide (bigG), else first |
//!
//! transformers >= 5 saves a bare `CLIPTextModel` without the `text_model.` level
//! (`embeddings.*`, `encoder.layers.*`, `final_layer_norm.*`); it is put back.
//!
//! OpenCLIP renames: `token_embedding.weight` -> `embeddings.token_embedding.weight`,
//! `positional_embedding` -> `embeddings.position_embedding.weight`, `ln_final` ->
//! `final_layer_norm`, `transformer.resblocks.N` -> `encoder.layers.N` with `ln_1`/`ln_2` ->
//! `layer_norm1`/`layer_norm2`, `mlp.c_fc`/`mlp.c_proj` -> `mlp.fc1`/`mlp.fc2`,
//! `attn.out_proj` -> `self_attn.out_proj`, and the fused `attn.in_proj_weight` `[3C, C]` /
//! `attn.in_proj_bias` `[3C]` split (by byte offsets, no copy) into `self_attn.q_proj`,
//! `k_proj`, `v_proj` in that order. `logit_scale` and anything else pass unchanged.
//!
//! # The text projection: two layouts, two names
//!
//! OpenCLIP's `text_projection` is a plain matrix `P` of shape `[width, proj]` applied as
//! `x @ P`; transformers' `text_projection.weight` is a `Linear` weight `W` of shape
//! `[proj, width]` applied as `x @ W^T`, so `W = P^T`. For bigG both are `[1280, 1280]`,
//! so the shape cannot tell them apart, and renaming cannot transpose. They keep distinct
//! canonical names:
//!
//! * [`TEXT_PROJECTION_OPENCLIP`] `text_model.text_projection` (the name stable-diffusion.cpp
//!   uses) holds `P`, `[width, proj]`, from original checkpoints;
//! * [`TEXT_PROJECTION_LINEAR`] `text_projection.weight` holds `W = P^T`, `[proj, width]`,
//!   from transformers / diffusers files.
//!
//! A model loading the pooled projection must accept either and transpose `P`.

use super::{split_index, swap_prefix};

/// The canonical prefix of the first (or only) CLIP text encoder.
pub const CLIP_PREFIX: &str = "cond_stage_model.transformer.";
/// The canonical prefix of SDXL's second text encoder, OpenCLIP ViT-bigG.
pub const CLIP_G_PREFIX: &str = "cond_stage_model.1.transformer.";
/// Slot-relative name of OpenCLIP's projection `P` (`[width, proj]`, used as `x @ P`).
pub const TEXT_PROJECTION_OPENCLIP: &str = "text_model.text_projection";
/// Slot-relative name of the transformers `Linear` projection `W = P^T` (`[proj, width]`).
pub const TEXT_PROJECTION_LINEAR: &str = "text_projection.weight";

/// Which canonical text encoder slot a tensor belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// [`CLIP_PREFIX`].
    First,
    /// [`CLIP_G_PREFIX`].
    Second,
}

impl Slot {
    pub(crate) fn prefix(self) -> &'static str {
        match self {
            Slot::First => CLIP_PREFIX,
            Slot::Second => CLIP_G_PREFIX,
        }
    }

    /// The slot of a bare transformers text encoder of hidden width `hidden`.
    pub(crate) fn for_hidden(hidden: Option<u64>) -> Slot {
        if hidden == Some(1280) {
            Slot::Second
        } else {
            Slot::First
        }
    }
}

/// Children of `text_model.` that transformers >= 5 writes without that level.
const BARE_TEXT_HEADS: [&str; 3] = ["embeddings.", "encoder.layers.", "final_layer_norm."];

/// Whether `rel` is a bare transformers text-model name without the `text_model.` level.
pub(crate) fn is_bare_text_name(rel: &str) -> bool {
    BARE_TEXT_HEADS.iter().any(|h| rel.starts_with(h))
}

/// The slot-relative canonical name of a transformers `CLIPTextModel(WithProjection)` name;
/// `None` if it is not one.
pub(crate) fn transformers_to_canonical(rel: &str) -> Option<String> {
    if rel
        .strip_prefix("text_model.")
        .is_some_and(|r| !r.is_empty())
        || rel == TEXT_PROJECTION_LINEAR
    {
        return Some(rel.to_owned());
    }
    if is_bare_text_name(rel) {
        return Some(format!("text_model.{rel}"));
    }
    None
}

/// What becomes of one OpenCLIP tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum OpenClipTarget {
    /// A plain rename to this slot-relative name.
    Rename(String),
    /// A fused q/k/v projection of one layer: split into these three slot-relative names.
    Split([String; 3]),
}

const OPENCLIP_TOP: [(&str, &str); 4] = [
    (
        "token_embedding.weight",
        "text_model.embeddings.token_embedding.weight",
    ),
    (
        "positional_embedding",
        "text_model.embeddings.position_embedding.weight",
    ),
    ("ln_final.weight", "text_model.final_layer_norm.weight"),
    ("ln_final.bias", "text_model.final_layer_norm.bias"),
];

const OPENCLIP_RESBLOCK: [(&str, &str); 5] = [
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
    ("attn.out_proj.", "self_attn.out_proj."),
];

/// Maps one OpenCLIP text-tower name, relative to the OpenCLIP model (`model.`), to its
/// canonical slot-relative name(s); `None` if it is not a text-tower tensor this knows.
pub(crate) fn openclip_to_canonical(rel: &str) -> Option<OpenClipTarget> {
    if let Some((_, to)) = OPENCLIP_TOP.iter().find(|(from, _)| *from == rel) {
        return Some(OpenClipTarget::Rename((*to).to_owned()));
    }
    if rel == "text_projection" {
        return Some(OpenClipTarget::Rename(TEXT_PROJECTION_OPENCLIP.to_owned()));
    }
    let (layer, x) = rel
        .strip_prefix("transformer.resblocks.")
        .and_then(split_index)?;
    let layer_prefix = format!("text_model.encoder.layers.{layer}.");
    let fused = match x {
        "attn.in_proj_weight" => Some("weight"),
        "attn.in_proj_bias" => Some("bias"),
        _ => None,
    };
    if let Some(kind) = fused {
        let name = |p: &str| format!("{layer_prefix}self_attn.{p}_proj.{kind}");
        return Some(OpenClipTarget::Split([name("q"), name("k"), name("v")]));
    }
    swap_prefix(x, &OPENCLIP_RESBLOCK).map(|r| OpenClipTarget::Rename(layer_prefix + &r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transformers_names() {
        assert_eq!(
            transformers_to_canonical("text_model.final_layer_norm.bias").as_deref(),
            Some("text_model.final_layer_norm.bias")
        );
        assert_eq!(
            transformers_to_canonical("encoder.layers.3.mlp.fc1.weight").as_deref(),
            Some("text_model.encoder.layers.3.mlp.fc1.weight")
        );
        assert_eq!(transformers_to_canonical("text_model."), None);
        assert_eq!(transformers_to_canonical("logit_scale"), None);
    }

    #[test]
    fn openclip_names() {
        assert_eq!(
            openclip_to_canonical("transformer.resblocks.7.mlp.c_proj.bias"),
            Some(OpenClipTarget::Rename(
                "text_model.encoder.layers.7.mlp.fc2.bias".into()
            ))
        );
        assert_eq!(
            openclip_to_canonical("transformer.resblocks.0.attn.in_proj_bias"),
            Some(OpenClipTarget::Split([
                "text_model.encoder.layers.0.self_attn.q_proj.bias".into(),
                "text_model.encoder.layers.0.self_attn.k_proj.bias".into(),
                "text_model.encoder.layers.0.self_attn.v_proj.bias".into(),
            ]))
        );
        assert_eq!(
            openclip_to_canonical("text_projection"),
            Some(OpenClipTarget::Rename(TEXT_PROJECTION_OPENCLIP.into()))
        );
        assert_eq!(openclip_to_canonical("logit_scale"), None);
        assert_eq!(openclip_to_canonical("visual.proj"), None);
        assert_eq!(
            openclip_to_canonical("transformer.resblocks.0.attn.unknown"),
            None
        );
    }
}
