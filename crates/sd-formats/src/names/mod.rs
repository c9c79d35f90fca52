//! Canonical tensor names and model version detection.
//!
//! # The canonical layout
//!
//! sd-rs names every tensor the way the original single-file checkpoints (and
//! stable-diffusion.cpp) do:
//!
//! | component | canonical prefix | layout |
//! |---|---|---|
//! | diffusion UNet | [`UNET_PREFIX`] `model.diffusion_model.` | LDM: `input_blocks.N.M`, `middle_block`, `output_blocks`, `time_embed`, `label_emb` (SDXL), `out` |
//! | autoencoder | [`VAE_PREFIX`] `first_stage_model.` | LDM: `encoder.down.N.block.M`, `mid.attn_1.{q,k,v,proj_out}` as `[C, C, 1, 1]`, `decoder.up.N`, `quant_conv`, `post_quant_conv` |
//! | Wan / Qwen-Image autoencoder | [`VAE_PREFIX`] `first_stage_model.` | original Wan: `encoder.conv1`, `encoder.downsamples.N.residual.{0,2,3,6}`, `*.middle.{0,1,2}`, `*.head.{0,2}`, `decoder.upsamples.N`, `conv1`, `conv2` (see `wan_vae.rs`) |
//! | first text encoder | [`CLIP_PREFIX`] `cond_stage_model.transformer.` | transformers `CLIPTextModel`: `text_model.*` |
//! | SDXL's OpenCLIP-G | [`CLIP_G_PREFIX`] `cond_stage_model.1.transformer.` | transformers `CLIPTextModel`: `text_model.*` |
//! | T5 encoder (FLUX.1, SD3) | [`T5_PREFIX`] `text_encoders.t5xxl.transformer.` | transformers `T5EncoderModel`: `shared`, `encoder.block.N.layer.{0,1}.*`, `encoder.final_layer_norm` |
//! | LLM text encoder (Qwen-Image) | [`LLM_PREFIX`] `text_encoders.llm.` | the Hugging Face checkpoint: `model.embed_tokens`, `model.layers.N.*`, `model.norm` (llama.cpp GGUF names converted, see `llm.rs`) |
//!
//! [`convert_to_canonical`] brings other layouts there: diffusers UNets and autoencoders
//! (see `unet.rs` and `vae.rs` for the tables), OpenCLIP text towers (SD2's
//! `cond_stage_model.model.*`, SDXL's `conditioner.embedders.1.model.*`, with the fused
//! `in_proj` split into q/k/v by offsets), SDXL's `conditioner.embedders.0.transformer.*`,
//! and transformers text encoders (see `clip.rs`), T5 encoders from llama.cpp GGUF names,
//! bare files, diffusers folders and stable-diffusion.cpp's `te3.` (see `t5.rs`).
//!
//! # Two names for the text projection
//!
//! OpenCLIP stores the pooled-output projection as a matrix `P`, `[width, proj]`, applied as
//! `x @ P`; transformers stores a `Linear` weight `W = P^T`, `[proj, width]`. For bigG both
//! are `[1280, 1280]`: the shape cannot tell them apart and a rename cannot transpose. So
//! they keep distinct canonical names under the slot prefix: [`TEXT_PROJECTION_OPENCLIP`]
//! `text_model.text_projection` (holds `P`; stable-diffusion.cpp's name) and
//! [`TEXT_PROJECTION_LINEAR`] `text_projection.weight` (holds `W`). A model must accept
//! either and transpose `P`.
//!
//! # Where diffusers names may come from
//!
//! A diffusers pipeline is a folder of per-component files whose names carry no component
//! prefix. Readers should prefix each with its folder name, [`DIFFUSERS_UNET`] `unet.`,
//! [`DIFFUSERS_VAE`] `vae.`, [`DIFFUSERS_TEXT_ENCODER`] `text_encoder.`,
//! [`DIFFUSERS_TEXT_ENCODER_2`] `text_encoder_2.`, which settles every ambiguity. Diffusers
//! UNet names under `model.diffusion_model.` and autoencoder names under
//! `first_stage_model.` (single files written by some tools) are converted as well. A single
//! component file read without any prefix is recognised by a marker tensor it always has:
//! `conv_in.weight` (a diffusers UNet; `input_blocks.0.0.weight` for an original one),
//! `encoder.conv_in.weight` / `decoder.conv_in.weight` (an autoencoder in either layout),
//! `encoder.head.0.gamma` / `decoder.head.0.gamma` (a Wan VAE in the original layout) and
//! `text_model.*` / `embeddings.token_embedding.weight` (a transformers text encoder, put in
//! the second slot when 1280 wide, else the first).
//!
//! For DiT models (SD3, Flux, Qwen-Image) the CLIP encoders under Stability's
//! `text_encoders.clip_l.transformer.` / `text_encoders.clip_g.transformer.` and a diffusers
//! folder's `text_encoder.` / `text_encoder_2.` go to the canonical CLIP slots, and a
//! diffusers folder's `transformer.` moves under `model.diffusion_model.` as it is (the DiT
//! reads diffusers' names itself).
//!
//! Anything else keeps its name: LoRA and other adapter tensors, DiT tensors, `logit_scale`,
//! EMA copies. Structural renames
//! do apply to adapter tensors that use the layouts above, e.g. a PEFT LoRA's
//! `unet.down_blocks.0.attentions.0....to_q.lora_A.weight`.

mod clip;
mod llm;
mod t5;
mod unet;
mod vae;
mod version;
mod wan_vae;

use std::collections::HashMap;

use thiserror::Error;

use crate::TensorStorage;

pub use clip::{CLIP_G_PREFIX, CLIP_PREFIX, TEXT_PROJECTION_LINEAR, TEXT_PROJECTION_OPENCLIP};
pub use llm::LLM_PREFIX;
pub use t5::{detect_text_encoder, TextEncoderKind, T5_PREFIX};
pub use unet::UNET_PREFIX;
pub use vae::VAE_PREFIX;
pub use version::{detect_version, detect_version_of, SdVersion};

use clip::{OpenClipTarget, Slot};
use unet::UnetLayout;
use vae::VaeLayout;
use wan_vae::WanVaeLayout;

/// Prefix a reader gives the tensors of a diffusers pipeline's `unet/` folder.
pub const DIFFUSERS_UNET: &str = "unet.";
/// Prefix a reader gives the tensors of a diffusers pipeline's `vae/` folder.
pub const DIFFUSERS_VAE: &str = "vae.";
/// Prefix a reader gives the tensors of a diffusers pipeline's `text_encoder/` folder.
pub const DIFFUSERS_TEXT_ENCODER: &str = "text_encoder.";
/// Prefix a reader gives the tensors of a diffusers pipeline's `text_encoder_2/` folder.
pub const DIFFUSERS_TEXT_ENCODER_2: &str = "text_encoder_2.";
/// Name prefix of a diffusers pipeline's DiT (its `transformer/` folder).
pub const DIFFUSERS_TRANSFORMER: &str = "transformer.";

/// Why a set of tensors could not be brought to canonical names.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NameError {
    /// Two source tensors convert to the same canonical name (a file holding one component in
    /// two layouts, or a duplicate).
    #[error("tensors `{first}` and `{second}` both map to `{target}`")]
    Collision {
        /// The canonical name both map to.
        target: String,
        /// The source name seen first.
        first: String,
        /// The source name seen second.
        second: String,
    },
    /// A fused q/k/v tensor cannot be split into three equal parts along its outer dimension.
    #[error("cannot split fused tensor `{name}` of shape {shape:?} ({size} bytes) into q, k, v")]
    Split {
        /// The fused tensor's name.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
        /// Its byte size.
        size: u64,
    },
}

/// The result of [`convert_to_canonical_report`]: the converted storages and what was done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conversion {
    /// The storages under canonical names, in input order (a split tensor's parts in its
    /// place, q then k then v).
    pub tensors: Vec<TensorStorage>,
    /// How many input tensors got a new name (split ones not counted).
    pub renamed: usize,
    /// Canonical names of the tensors whose 2-D `[C, C]` shape is now viewed as the
    /// `[C, C, 1, 1]` of a 1x1 convolution (autoencoder mid-block attention projections).
    /// Same bytes, same order: only `shape` changed.
    pub reshaped: Vec<String>,
    /// Source names of the fused q/k/v tensors split into three storages.
    pub split: Vec<String>,
}

/// Renames (and splits, and reshapes) tensors into the canonical sd-rs layout.
///
/// `version` is the model family when the caller knows it; when `None` it is detected from
/// the storages with [`detect_version_of`]. It matters only to stay out of the way of
/// non-UNet families: for DiT models (SD3, Flux, Qwen-Image) UNet and CLIP conversions are
/// skipped. Autoencoder names that carry the Wan markers (`.gamma`, `to_qkv`, `time_conv`:
/// Qwen-Image's video VAE) are converted as the Wan VAE (see `wan_vae.rs`).
///
/// Names already canonical and names this module does not know pass unchanged. Returns
/// [`NameError::Collision`] when two tensors end up with one name and [`NameError::Split`]
/// when a fused OpenCLIP `in_proj` does not split in three.
pub fn convert_to_canonical(
    storages: Vec<TensorStorage>,
    version: Option<SdVersion>,
) -> Result<Vec<TensorStorage>, NameError> {
    convert_to_canonical_report(storages, version).map(|c| c.tensors)
}

/// [`convert_to_canonical`], also reporting what was renamed, reshaped and split.
pub fn convert_to_canonical_report(
    storages: Vec<TensorStorage>,
    version: Option<SdVersion>,
) -> Result<Conversion, NameError> {
    let version = version.or_else(|| detect_version_of(&storages));
    let bare = BareMarkers::scan(&storages);
    let dit = version.is_some_and(|v| !v.is_unet());
    let plans: Vec<Plan> = storages
        .iter()
        .map(|s| classify(&s.name, &bare, dit))
        .collect();

    let rels = |want: fn(&Plan) -> Option<usize>| {
        plans
            .iter()
            .zip(&storages)
            .filter_map(move |(p, s)| want(p).map(|start| &s.name[start..]))
    };
    let unet_layout = UnetLayout::scan(rels(|p| match p {
        Plan::Unet(start) => Some(*start),
        _ => None,
    }));
    let vae_rels = || {
        rels(|p| match p {
            Plan::Vae(start) => Some(*start),
            _ => None,
        })
    };
    // Wan VAE files always carry the markers (every norm is a `gamma`); the family alone
    // does not decide, so that converting twice changes nothing.
    let wan_vae = vae_rels().any(vae::is_foreign_vae_marker);
    let vae_layout = VaeLayout::scan(vae_rels());
    let wan_layout = WanVaeLayout::scan(vae_rels());

    let mut out = Conversion {
        tensors: Vec::with_capacity(storages.len()),
        ..Conversion::default()
    };
    let mut sources: HashMap<String, String> = HashMap::with_capacity(storages.len());
    for (mut storage, plan) in storages.into_iter().zip(plans) {
        let source = storage.name.clone();
        let target = match plan {
            Plan::Keep => Target::Name(source.clone()),
            Plan::Unet(start) => {
                match unet::diffusers_to_original(&source[start..], &unet_layout) {
                    Some(c) => Target::Name(format!("{UNET_PREFIX}{c}")),
                    None => Target::Name(source.clone()),
                }
            }
            Plan::UnetPrefix => Target::Name(format!("{UNET_PREFIX}{source}")),
            Plan::Transformer(start) => Target::Name(format!("{UNET_PREFIX}{}", &source[start..])),
            Plan::T5(start) => match t5::to_canonical(&source[start..]) {
                Some(c) => Target::Name(format!("{T5_PREFIX}{c}")),
                None => Target::Name(source.clone()),
            },
            Plan::Llm(start) => {
                let rel = &source[start..];
                let c = llm::gguf_to_canonical(rel)
                    .unwrap_or_else(|| llm::transformers_to_canonical(rel).to_string());
                Target::Name(format!("{LLM_PREFIX}{c}"))
            }
            Plan::Vae(start) if wan_vae => {
                let rel = &source[start..];
                match wan_vae::diffusers_to_original(rel, wan_layout)
                    .or_else(|| wan_vae::is_original_name(rel).then(|| rel.to_owned()))
                {
                    Some(c) => Target::Name(format!("{VAE_PREFIX}{c}")),
                    None => Target::Name(source.clone()),
                }
            }
            Plan::Vae(start) => {
                let rel = &source[start..];
                let canonical_rel = vae::diffusers_to_original(rel, vae_layout)
                    .or_else(|| vae::is_original_name(rel).then(|| rel.to_owned()));
                match canonical_rel {
                    Some(c) => {
                        if vae::needs_conv_view(&c) && storage.shape.len() == 2 {
                            storage.shape.extend([1, 1]);
                            out.reshaped.push(format!("{VAE_PREFIX}{c}"));
                        }
                        Target::Name(format!("{VAE_PREFIX}{c}"))
                    }
                    None => Target::Name(source.clone()),
                }
            }
            Plan::ClipTransformers(slot, start) => {
                match clip::transformers_to_canonical(&source[start..]) {
                    Some(c) => Target::Name(format!("{}{c}", slot.prefix())),
                    None => Target::Name(source.clone()),
                }
            }
            Plan::ClipOpen(slot, start) => match clip::openclip_to_canonical(&source[start..]) {
                Some(OpenClipTarget::Rename(c)) => Target::Name(format!("{}{c}", slot.prefix())),
                Some(OpenClipTarget::Split(parts)) => {
                    Target::Split(parts.map(|p| format!("{}{p}", slot.prefix())))
                }
                None => Target::Name(source.clone()),
            },
        };
        match target {
            Target::Name(name) => {
                if name != source {
                    out.renamed += 1;
                }
                claim(&mut sources, &name, &source)?;
                storage.name = name;
                out.tensors.push(storage);
            }
            Target::Split(names) => {
                let parts = storage
                    .split_outer(3, &names)
                    .ok_or_else(|| NameError::Split {
                        name: source.clone(),
                        shape: storage.shape.clone(),
                        size: storage.size,
                    })?;
                for part in parts {
                    claim(&mut sources, &part.name, &source)?;
                    out.tensors.push(part);
                }
                out.split.push(source);
            }
        }
    }
    Ok(out)
}

/// Records that `source` maps to `target`, failing if another source already does.
fn claim(
    sources: &mut HashMap<String, String>,
    target: &str,
    source: &str,
) -> Result<(), NameError> {
    if let Some(first) = sources.get(target) {
        return Err(NameError::Collision {
            target: target.to_owned(),
            first: first.clone(),
            second: source.to_owned(),
        });
    }
    sources.insert(target.to_owned(), source.to_owned());
    Ok(())
}

/// What one tensor's canonical name will be.
enum Target {
    Name(String),
    Split([String; 3]),
}

/// How one name is to be converted; the `usize` is where its component-relative part starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// Leave unchanged.
    Keep,
    /// A UNet name (diffusers layout, possibly), relative part from the offset.
    Unet(usize),
    /// A bare original UNet name: only the canonical prefix is missing.
    UnetPrefix,
    /// An autoencoder name in either layout.
    Vae(usize),
    /// A transformers CLIP text encoder name for this slot.
    ClipTransformers(Slot, usize),
    /// An OpenCLIP text tower name (relative to the OpenCLIP model) for this slot.
    ClipOpen(Slot, usize),
    /// A T5 encoder name (transformers or GGUF layout), relative part from the offset.
    T5(usize),
    /// A name under [`LLM_PREFIX`] (llama.cpp GGUF names converted), relative part from the
    /// offset.
    Llm(usize),
    /// A diffusers DiT name (`transformer.` folder): moved under the diffusion prefix as
    /// it is (the network reads diffusers' names itself), relative part from the offset.
    Transformer(usize),
}

/// Marker tensors that make prefix-less names of a single component file safe to convert.
#[derive(Debug, Default)]
struct BareMarkers {
    unet_diffusers: bool,
    unet_original: bool,
    vae: bool,
    wan_vae: bool,
    text_model: bool,
    text_bare: bool,
    text_hidden: Option<u64>,
    t5: bool,
}

impl BareMarkers {
    fn scan(storages: &[TensorStorage]) -> Self {
        let mut m = BareMarkers::default();
        for s in storages {
            match s.name.as_str() {
                "conv_in.weight" => m.unet_diffusers = true,
                "input_blocks.0.0.weight" => m.unet_original = true,
                "encoder.conv_in.weight" | "decoder.conv_in.weight" => m.vae = true,
                "encoder.head.0.gamma" | "decoder.head.0.gamma" => m.wan_vae = true,
                t5::HF_MARKER | t5::GGUF_MARKER => m.t5 = true,
                "text_model.embeddings.token_embedding.weight"
                | "embeddings.token_embedding.weight" => {
                    m.text_bare |= !s.name.starts_with("text_model.");
                    if s.shape.len() == 2 {
                        m.text_hidden = Some(s.shape[1]);
                    }
                }
                _ => {}
            }
            m.text_model |= s.name.starts_with("text_model.");
        }
        m
    }
}

/// Where Stability's SD3 single files keep CLIP-L (transformers names below it).
pub const SAI_CLIP_L_PREFIX: &str = "text_encoders.clip_l.transformer.";
/// Where Stability's SD3 single files keep OpenCLIP bigG (transformers names below it).
pub const SAI_CLIP_G_PREFIX: &str = "text_encoders.clip_g.transformer.";

/// Decides how `name` is converted. `dit`: the model is not a UNet family, so UNet and CLIP
/// conversions stay off.
fn classify(name: &str, bare: &BareMarkers, dit: bool) -> Plan {
    if name.starts_with(LLM_PREFIX) {
        return Plan::Llm(LLM_PREFIX.len());
    }
    if let Some(plan) = classify_t5(name, bare) {
        return plan;
    }
    if name.starts_with(VAE_PREFIX) {
        return Plan::Vae(VAE_PREFIX.len());
    }
    if let Some(rel) = name.strip_prefix(DIFFUSERS_VAE) {
        return if vae::is_vae_name(rel) {
            Plan::Vae(DIFFUSERS_VAE.len())
        } else {
            Plan::Keep
        };
    }
    // A Qwen-Image diffusers folder keeps its LLM (`Qwen2_5_VLForConditionalGeneration`) in
    // `text_encoder/`, where other DiT folders keep CLIP-L.
    if let Some(rel) = name.strip_prefix(DIFFUSERS_TEXT_ENCODER) {
        if dit && llm::is_transformers_name(rel) {
            return Plan::Llm(DIFFUSERS_TEXT_ENCODER.len());
        }
    }
    // Stability's SD3 files (and FLUX files that bundle their encoders) keep the CLIP
    // encoders under their own prefixes; a DiT's diffusers folder its CLIP encoders under
    // the folders' names (T5 in `text_encoder_2/3` was claimed above).
    let dit_clips: &[(&str, Slot)] = if dit {
        &[
            (SAI_CLIP_L_PREFIX, Slot::First),
            (SAI_CLIP_G_PREFIX, Slot::Second),
            (DIFFUSERS_TEXT_ENCODER, Slot::First),
            (DIFFUSERS_TEXT_ENCODER_2, Slot::Second),
        ]
    } else {
        &[
            (SAI_CLIP_L_PREFIX, Slot::First),
            (SAI_CLIP_G_PREFIX, Slot::Second),
        ]
    };
    for &(prefix, slot) in dit_clips {
        if name.starts_with(prefix) {
            return Plan::ClipTransformers(slot, prefix.len());
        }
    }
    if dit {
        // (Not names a UNet has: those would read as a UNet's once moved.)
        return match name.strip_prefix(DIFFUSERS_TRANSFORMER) {
            Some(rel) if !unet::is_diffusers_name(rel) && !unet::is_original_name(rel) => {
                Plan::Transformer(DIFFUSERS_TRANSFORMER.len())
            }
            _ => Plan::Keep,
        };
    }
    for prefix in [UNET_PREFIX, DIFFUSERS_UNET] {
        if let Some(rel) = name.strip_prefix(prefix) {
            return if unet::is_diffusers_name(rel) {
                Plan::Unet(prefix.len())
            } else {
                Plan::Keep
            };
        }
    }
    let slots = [
        (CLIP_PREFIX, Slot::First, false),
        (CLIP_G_PREFIX, Slot::Second, false),
        ("cond_stage_model.model.", Slot::First, true),
        ("cond_stage_model.1.model.", Slot::Second, true),
        (DIFFUSERS_TEXT_ENCODER, Slot::First, false),
        (DIFFUSERS_TEXT_ENCODER_2, Slot::Second, false),
    ];
    for (prefix, slot, openclip) in slots {
        if name.starts_with(prefix) {
            return if openclip {
                Plan::ClipOpen(slot, prefix.len())
            } else {
                Plan::ClipTransformers(slot, prefix.len())
            };
        }
    }
    if let Some((_, rest)) = name
        .strip_prefix("conditioner.embedders.")
        .and_then(split_index)
    {
        let start = name.len() - rest.len();
        if rest.starts_with("transformer.") {
            return Plan::ClipTransformers(Slot::First, start + "transformer.".len());
        }
        if rest.starts_with("model.") {
            return Plan::ClipOpen(Slot::Second, start + "model.".len());
        }
        return Plan::Keep;
    }
    // Prefix-less names of a single component file.
    if bare.unet_diffusers && unet::is_diffusers_name(name) {
        return Plan::Unet(0);
    }
    if bare.unet_original && unet::is_original_name(name) {
        return Plan::UnetPrefix;
    }
    if bare.vae && vae::is_vae_name(name) {
        return Plan::Vae(0);
    }
    if bare.wan_vae && wan_vae::is_original_name(name) {
        return Plan::Vae(0);
    }
    let text_slot = Slot::for_hidden(bare.text_hidden);
    if name.starts_with("text_model.") || (bare.text_model && name == TEXT_PROJECTION_LINEAR) {
        return Plan::ClipTransformers(text_slot, 0);
    }
    if bare.text_bare && clip::is_bare_text_name(name) {
        return Plan::ClipTransformers(text_slot, 0);
    }
    Plan::Keep
}

/// T5 names: under [`T5_PREFIX`] (GGUF names there too), under one of the other prefixes
/// T5 files are found with when the relative name is a T5 one, or bare in a file that has
/// a T5 marker tensor.
fn classify_t5(name: &str, bare: &BareMarkers) -> Option<Plan> {
    let is_t5 = |rel: &str| t5::is_hf_name(rel) || t5::is_gguf_name(rel);
    if name.starts_with(T5_PREFIX) {
        return Some(Plan::T5(T5_PREFIX.len()));
    }
    for prefix in t5::T5_SOURCE_PREFIXES {
        if name.strip_prefix(prefix).is_some_and(is_t5) {
            return Some(Plan::T5(prefix.len()));
        }
    }
    (bare.t5 && is_t5(name)).then_some(Plan::T5(0))
}

/// Splits `"N.rest"` into `(N, "rest")`; `N` is a plain decimal index (no sign, no leading
/// zero), `rest` may be empty.
pub(crate) fn split_index(s: &str) -> Option<(u64, &str)> {
    let (idx, rest) = s.split_once('.')?;
    let plain = !idx.is_empty()
        && idx.bytes().all(|b| b.is_ascii_digit())
        && (idx == "0" || !idx.starts_with('0'));
    if !plain {
        return None;
    }
    Some((idx.parse().ok()?, rest))
}

/// Replaces the first matching prefix of `s` from `map` (`(from, to)` pairs); `None` when none
/// matches or nothing follows the prefix.
pub(crate) fn swap_prefix(s: &str, map: &[(&str, &str)]) -> Option<String> {
    map.iter().find_map(|(from, to)| {
        s.strip_prefix(from)
            .filter(|rest| !rest.is_empty())
            .map(|rest| format!("{to}{rest}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_index_accepts_plain_indices_only() {
        assert_eq!(split_index("12.rest"), Some((12, "rest")));
        assert_eq!(split_index("0."), Some((0, "")));
        assert_eq!(split_index("01.rest"), None);
        assert_eq!(split_index("-1.rest"), None);
        assert_eq!(split_index("1"), None);
        assert_eq!(split_index("99999999999999999999999.x"), None);
    }

    #[test]
    fn swap_prefix_needs_a_remainder() {
        let map = [("a.", "b.")];
        assert_eq!(swap_prefix("a.x", &map).as_deref(), Some("b.x"));
        assert_eq!(swap_prefix("a.", &map), None);
        assert_eq!(swap_prefix("c.x", &map), None);
    }
}
