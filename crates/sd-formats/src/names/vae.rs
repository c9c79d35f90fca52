//! Diffusers `AutoencoderKL` names to the original LDM autoencoder names.
//!
//! | diffusers | original |
//! |---|---|
//! | `encoder.down_blocks.i.resnets.j` | `encoder.down.i.block.j` |
//! | `encoder.down_blocks.i.downsamplers.0` | `encoder.down.i.downsample` |
//! | `decoder.up_blocks.i.resnets.j` | `decoder.up.{N-1-i}.block.j` (`N` up blocks: reversed order) |
//! | `decoder.up_blocks.i.upsamplers.0` | `decoder.up.{N-1-i}.upsample` |
//! | `*.mid_block.resnets.0` / `resnets.1` | `*.mid.block_1` / `mid.block_2` |
//! | `*.mid_block.attentions.0` | `*.mid.attn_1` |
//! | `*.conv_norm_out` | `*.norm_out` |
//! | resnet `conv_shortcut` | `nin_shortcut` |
//! | attention `group_norm`, `to_q`/`query`, `to_k`/`key`, `to_v`/`value`, `to_out.0`/`proj_attn` | `norm`, `q`, `k`, `v`, `proj_out` |
//!
//! `conv_in`, `conv_out`, `quant_conv`, `post_quant_conv` and the resnets' `norm1`, `conv1`,
//! `norm2`, `conv2` keep their names.
//!
//! The original mid-block attention projections are 1x1 convolutions, `[C, C, 1, 1]`, while
//! diffusers stores them as linear weights, `[C, C]`. Renaming cannot change data, but the two
//! hold the same bytes in the same order, so the conversion only views the contiguous tensor
//! with the conv shape (see [`needs_conv_view`]); the same applies to original-named
//! checkpoints that were saved with 2-D projections.

use super::{split_index, swap_prefix};

/// The canonical prefix of the autoencoder.
pub const VAE_PREFIX: &str = "first_stage_model.";

/// Sub-module heads inside `encoder.` / `decoder.` of the diffusers layout (with `mid_block.`).
const SIDE_HEADS: [&str; 5] = [
    "conv_in.",
    "conv_norm_out.",
    "down_blocks.",
    "up_blocks.",
    "mid_block.",
];

/// Sub-module heads inside `encoder.` / `decoder.` in the original layout.
const ORIGINAL_SIDE_HEADS: [&str; 6] =
    ["conv_in.", "conv_out.", "norm_out.", "down.", "up.", "mid."];

/// Whether `rel` (a name relative to the autoencoder) looks like an autoencoder tensor in
/// either layout.
pub(crate) fn is_vae_name(rel: &str) -> bool {
    is_original_name(rel)
        || side_inner(rel).is_some_and(|inner| SIDE_HEADS.iter().any(|h| inner.starts_with(h)))
}

/// Whether `rel` (a name relative to the autoencoder) is an original-layout autoencoder name.
pub(crate) fn is_original_name(rel: &str) -> bool {
    if rel.starts_with("quant_conv.") || rel.starts_with("post_quant_conv.") {
        return true;
    }
    side_inner(rel).is_some_and(|inner| ORIGINAL_SIDE_HEADS.iter().any(|h| inner.starts_with(h)))
}

/// The part of `rel` after `encoder.` or `decoder.`.
fn side_inner(rel: &str) -> Option<&str> {
    rel.strip_prefix("encoder.")
        .or_else(|| rel.strip_prefix("decoder."))
}

/// Whether `rel` marks a non-KL autoencoder (the Wan / Qwen-Image video VAE), whose diffusers
/// names overlap these but map differently (`wan_vae.rs` converts such files).
pub(crate) fn is_foreign_vae_marker(rel: &str) -> bool {
    rel.ends_with(".gamma") || rel.contains(".to_qkv.") || rel.contains(".time_conv.")
}

/// The decoder structure of a diffusers autoencoder, read from its own names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VaeLayout {
    /// Number of decoder up blocks (`N`).
    up_blocks: u64,
}

impl Default for VaeLayout {
    fn default() -> Self {
        VaeLayout { up_blocks: 4 }
    }
}

impl VaeLayout {
    /// Reads the layout from autoencoder-relative names.
    pub(crate) fn scan<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let up_blocks = names
            .into_iter()
            .filter_map(|n| n.strip_prefix("decoder.up_blocks.").and_then(split_index))
            .map(|(i, _)| i.saturating_add(1))
            .max();
        VaeLayout {
            up_blocks: up_blocks.unwrap_or(4),
        }
    }
}

const RESNET_MAP: [(&str, &str); 5] = [
    ("conv_shortcut.", "nin_shortcut."),
    ("norm1.", "norm1."),
    ("conv1.", "conv1."),
    ("norm2.", "norm2."),
    ("conv2.", "conv2."),
];

const ATTENTION_MAP: [(&str, &str); 9] = [
    ("group_norm.", "norm."),
    ("to_q.", "q."),
    ("query.", "q."),
    ("to_k.", "k."),
    ("key.", "k."),
    ("to_v.", "v."),
    ("value.", "v."),
    ("to_out.0.", "proj_out."),
    ("proj_attn.", "proj_out."),
];

fn resnet(block: String, rest: &str) -> Option<String> {
    swap_prefix(rest, &RESNET_MAP).map(|r| block + &r)
}

/// Converts one autoencoder-relative diffusers name to the original name; `None` when it is
/// not a diffusers name this mapping knows (original names included).
pub(crate) fn diffusers_to_original(rel: &str, layout: VaeLayout) -> Option<String> {
    let (side, inner) = if let Some(inner) = rel.strip_prefix("encoder.") {
        ("encoder.", inner)
    } else {
        ("decoder.", rel.strip_prefix("decoder.")?)
    };
    let mapped = if let Some(x) = inner.strip_prefix("conv_norm_out.") {
        format!("norm_out.{x}")
    } else if let Some((i, rest)) = inner
        .strip_prefix("down_blocks.")
        .and_then(split_index)
        .filter(|_| side == "encoder.")
    {
        if let Some((j, x)) = rest.strip_prefix("resnets.").and_then(split_index) {
            resnet(format!("down.{i}.block.{j}."), x)?
        } else {
            format!(
                "down.{i}.downsample.{}",
                rest.strip_prefix("downsamplers.0.")?
            )
        }
    } else if let Some((i, rest)) = inner
        .strip_prefix("up_blocks.")
        .and_then(split_index)
        .filter(|_| side == "decoder.")
    {
        let level = layout.up_blocks.checked_sub(1)?.checked_sub(i)?;
        if let Some((j, x)) = rest.strip_prefix("resnets.").and_then(split_index) {
            resnet(format!("up.{level}.block.{j}."), x)?
        } else {
            format!(
                "up.{level}.upsample.{}",
                rest.strip_prefix("upsamplers.0.")?
            )
        }
    } else if let Some(rest) = inner.strip_prefix("mid_block.resnets.") {
        match split_index(rest)? {
            (0, x) => resnet("mid.block_1.".to_owned(), x)?,
            (1, x) => resnet("mid.block_2.".to_owned(), x)?,
            _ => return None,
        }
    } else {
        let x = inner.strip_prefix("mid_block.attentions.0.")?;
        format!("mid.attn_1.{}", swap_prefix(x, &ATTENTION_MAP)?)
    };
    if mapped.ends_with('.') {
        return None;
    }
    Some(format!("{side}{mapped}"))
}

/// Whether the original autoencoder-relative name `rel` is a mid-block attention projection
/// weight, which the original layout stores as a 1x1 convolution `[C, C, 1, 1]`.
pub(crate) fn needs_conv_view(rel: &str) -> bool {
    let Some(inner) = rel
        .strip_prefix("encoder.")
        .or_else(|| rel.strip_prefix("decoder."))
    else {
        return false;
    };
    matches!(
        inner,
        "mid.attn_1.q.weight"
            | "mid.attn_1.k.weight"
            | "mid.attn_1.v.weight"
            | "mid.attn_1.proj_out.weight"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_structure() {
        let l = VaeLayout::default();
        let m = |n: &str| diffusers_to_original(n, l);
        assert_eq!(
            m("decoder.up_blocks.0.resnets.2.conv1.weight").as_deref(),
            Some("decoder.up.3.block.2.conv1.weight")
        );
        assert_eq!(
            m("decoder.up_blocks.2.upsamplers.0.conv.weight").as_deref(),
            Some("decoder.up.1.upsample.conv.weight")
        );
        assert_eq!(
            m("encoder.down_blocks.1.resnets.0.conv_shortcut.bias").as_deref(),
            Some("encoder.down.1.block.0.nin_shortcut.bias")
        );
        assert_eq!(
            m("encoder.mid_block.attentions.0.query.weight").as_deref(),
            Some("encoder.mid.attn_1.q.weight")
        );
        assert_eq!(
            m("decoder.mid_block.attentions.0.to_out.0.bias").as_deref(),
            Some("decoder.mid.attn_1.proj_out.bias")
        );
        assert_eq!(
            m("encoder.conv_norm_out.weight").as_deref(),
            Some("encoder.norm_out.weight")
        );
        assert_eq!(m("decoder.up_blocks.4.resnets.0.conv1.weight"), None);
        assert_eq!(m("encoder.down.0.block.0.conv1.weight"), None);
        assert_eq!(m("encoder.mid_block.attentions.0.to_q."), None);
        assert_eq!(m("encoder.up_blocks.0.resnets.0.conv1.weight"), None);
        assert_eq!(m("decoder.down_blocks.0.resnets.0.conv1.weight"), None);
    }

    #[test]
    fn conv_view_names() {
        assert!(needs_conv_view("decoder.mid.attn_1.proj_out.weight"));
        assert!(!needs_conv_view("decoder.mid.attn_1.proj_out.bias"));
        assert!(!needs_conv_view("decoder.mid.attn_1.norm.weight"));
    }

    #[test]
    fn classifies() {
        assert!(is_vae_name("encoder.down.0.block.0.conv1.weight"));
        assert!(is_vae_name("post_quant_conv.bias"));
        assert!(!is_vae_name(
            "encoder.block.0.layer.0.SelfAttention.q.weight"
        ));
        assert!(!is_vae_name("encoder.final_layer_norm.weight"));
        assert!(is_foreign_vae_marker(
            "decoder.up_blocks.0.resnets.0.norm1.gamma"
        ));
        assert!(is_vae_name("decoder.mid_block.resnets.0.conv1.weight"));
        assert!(!is_original_name(
            "decoder.mid_block.resnets.0.conv1.weight"
        ));
        assert!(is_original_name("decoder.mid.block_1.conv1.weight"));
    }
}
