//! Diffusers `UNet2DConditionModel` names to the original LDM UNet names.
//!
//! The mapping is structural rather than a fixed table, so it covers SD1.x/SD2.x (4 down
//! blocks, attention in the first three), SDXL (3 down blocks, attention in the last two,
//! transformer depth 1/2/10) and the slimmer variants alike. With `L` resnets per down block
//! (2 for every released SD model; up blocks have `L + 1`), `S = L + 1`:
//!
//! | diffusers | original |
//! |---|---|
//! | `conv_in` | `input_blocks.0.0` |
//! | `time_embedding.linear_1` / `linear_2` | `time_embed.0` / `time_embed.2` |
//! | `add_embedding.linear_1` / `linear_2` (SDXL) | `label_emb.0.0` / `label_emb.0.2` |
//! | `down_blocks.i.resnets.j` | `input_blocks.{S*i+j+1}.0` |
//! | `down_blocks.i.attentions.j` | `input_blocks.{S*i+j+1}.1` |
//! | `down_blocks.i.downsamplers.0.conv` | `input_blocks.{S*(i+1)}.0.op` |
//! | `mid_block.resnets.0` / `attentions.0` / `resnets.1` | `middle_block.0` / `.1` / `.2` |
//! | `up_blocks.i.resnets.j` | `output_blocks.{S*i+j}.0` |
//! | `up_blocks.i.attentions.j` | `output_blocks.{S*i+j}.1` |
//! | `up_blocks.i.upsamplers.0` | `output_blocks.{S*i+L}.1`, or `.2` when up block `i` has attention |
//! | `conv_norm_out` / `conv_out` | `out.0` / `out.2` |
//!
//! Inside a resnet: `norm1` -> `in_layers.0`, `conv1` -> `in_layers.2`, `norm2` ->
//! `out_layers.0`, `conv2` -> `out_layers.3`, `time_emb_proj` -> `emb_layers.1`,
//! `conv_shortcut` -> `skip_connection`. Inside an attention block (`norm`, `proj_in`,
//! `transformer_blocks.M.{norm1,attn1,norm2,attn2,norm3,ff}`, `proj_out`) the names are the
//! same in both layouts. `proj_in`/`proj_out` are 1x1 convolutions in SD1.x and linear layers
//! in SD2.x/SDXL in *both* layouts, so no reshape is needed.

use std::collections::BTreeSet;

use super::{split_index, swap_prefix};

/// The canonical prefix of the diffusion model.
pub const UNET_PREFIX: &str = "model.diffusion_model.";

/// First segments of diffusers UNet names.
const DIFFUSERS_HEADS: [&str; 8] = [
    "conv_in.",
    "conv_out.",
    "conv_norm_out.",
    "time_embedding.",
    "add_embedding.",
    "down_blocks.",
    "up_blocks.",
    "mid_block.",
];

/// Whether `rel` (a name relative to the UNet) starts like a diffusers UNet name.
pub(crate) fn is_diffusers_name(rel: &str) -> bool {
    DIFFUSERS_HEADS.iter().any(|h| rel.starts_with(h))
}

/// Whether `rel` (a name relative to the UNet) starts like an original UNet name.
pub(crate) fn is_original_name(rel: &str) -> bool {
    [
        "input_blocks.",
        "middle_block.",
        "output_blocks.",
        "time_embed.",
        "label_emb.",
        "out.",
    ]
    .iter()
    .any(|h| rel.starts_with(h))
}

/// The block structure of a diffusers UNet, read from its own names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnetLayout {
    /// Resnets per down block (`L`).
    layers_per_block: u64,
    /// Up blocks that hold attention layers.
    up_blocks_with_attention: BTreeSet<u64>,
}

impl Default for UnetLayout {
    fn default() -> Self {
        UnetLayout {
            layers_per_block: 2,
            up_blocks_with_attention: BTreeSet::new(),
        }
    }
}

impl UnetLayout {
    /// Reads the layout from UNet-relative diffusers names.
    pub(crate) fn scan<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut down_resnets = 0u64;
        let mut up_resnets = 0u64;
        let mut with_attention = BTreeSet::new();
        for name in names {
            if let Some((_, rest)) = name.strip_prefix("down_blocks.").and_then(split_index) {
                if let Some((j, _)) = rest.strip_prefix("resnets.").and_then(split_index) {
                    down_resnets = down_resnets.max(j.saturating_add(1));
                }
            } else if let Some((i, rest)) = name.strip_prefix("up_blocks.").and_then(split_index) {
                if let Some((j, _)) = rest.strip_prefix("resnets.").and_then(split_index) {
                    up_resnets = up_resnets.max(j.saturating_add(1));
                } else if rest.starts_with("attentions.") {
                    with_attention.insert(i);
                }
            }
        }
        let layers_per_block = if down_resnets > 0 {
            down_resnets
        } else if up_resnets > 1 {
            up_resnets - 1
        } else {
            2
        };
        UnetLayout {
            layers_per_block,
            up_blocks_with_attention: with_attention,
        }
    }
}

/// Resnet sub-module renames (diffusers -> original).
const RESNET_MAP: [(&str, &str); 6] = [
    ("norm1.", "in_layers.0."),
    ("conv1.", "in_layers.2."),
    ("norm2.", "out_layers.0."),
    ("conv2.", "out_layers.3."),
    ("time_emb_proj.", "emb_layers.1."),
    ("conv_shortcut.", "skip_connection."),
];

/// Top-level module renames (diffusers -> original).
const TOP_MAP: [(&str, &str); 8] = [
    ("conv_in.", "input_blocks.0.0."),
    ("time_embedding.linear_1.", "time_embed.0."),
    ("time_embedding.linear_2.", "time_embed.2."),
    ("add_embedding.linear_1.", "label_emb.0.0."),
    ("add_embedding.linear_2.", "label_emb.0.2."),
    ("conv_norm_out.", "out.0."),
    ("conv_out.", "out.2."),
    ("mid_block.attentions.0.", "middle_block.1."),
];

fn resnet(block: String, rest: &str) -> Option<String> {
    swap_prefix(rest, &RESNET_MAP).map(|r| block + &r)
}

/// Converts one UNet-relative diffusers name to the original name (also UNet-relative);
/// `None` when the name is not a diffusers UNet tensor this mapping knows.
pub(crate) fn diffusers_to_original(rel: &str, layout: &UnetLayout) -> Option<String> {
    if let Some(mapped) = swap_prefix(rel, &TOP_MAP) {
        return Some(mapped);
    }
    let l = layout.layers_per_block;
    let stride = l.checked_add(1)?;
    if let Some((i, rest)) = rel.strip_prefix("down_blocks.").and_then(split_index) {
        let base = stride.checked_mul(i)?;
        if let Some((j, x)) = rest.strip_prefix("resnets.").and_then(split_index) {
            if j >= l {
                return None;
            }
            return resnet(
                format!("input_blocks.{}.0.", base.checked_add(j)?.checked_add(1)?),
                x,
            );
        }
        if let Some((j, x)) = rest.strip_prefix("attentions.").and_then(split_index) {
            if j >= l || x.is_empty() {
                return None;
            }
            return Some(format!(
                "input_blocks.{}.1.{x}",
                base.checked_add(j)?.checked_add(1)?
            ));
        }
        let x = rest.strip_prefix("downsamplers.0.conv.")?;
        let index = base.checked_add(stride)?;
        return (!x.is_empty()).then(|| format!("input_blocks.{index}.0.op.{x}"));
    }
    if let Some((i, rest)) = rel.strip_prefix("up_blocks.").and_then(split_index) {
        let base = stride.checked_mul(i)?;
        if let Some((j, x)) = rest.strip_prefix("resnets.").and_then(split_index) {
            if j > l {
                return None;
            }
            return resnet(format!("output_blocks.{}.0.", base.checked_add(j)?), x);
        }
        if let Some((j, x)) = rest.strip_prefix("attentions.").and_then(split_index) {
            if j > l || x.is_empty() {
                return None;
            }
            return Some(format!("output_blocks.{}.1.{x}", base.checked_add(j)?));
        }
        let x = rest.strip_prefix("upsamplers.0.")?;
        let slot = if layout.up_blocks_with_attention.contains(&i) {
            2
        } else {
            1
        };
        let index = base.checked_add(l)?;
        return (!x.is_empty()).then(|| format!("output_blocks.{index}.{slot}.{x}"));
    }
    if let Some(rest) = rel.strip_prefix("mid_block.resnets.") {
        let (j, x) = split_index(rest)?;
        return match j {
            0 => resnet("middle_block.0.".to_owned(), x),
            1 => resnet("middle_block.2.".to_owned(), x),
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sd1() -> UnetLayout {
        UnetLayout::scan([
            "down_blocks.0.resnets.1.conv1.weight",
            "up_blocks.1.attentions.0.proj_in.weight",
        ])
    }

    #[test]
    fn layout_defaults_and_scan() {
        let l = UnetLayout::scan(std::iter::empty());
        assert_eq!(l, UnetLayout::default());
        let l = UnetLayout::scan(["up_blocks.0.resnets.3.conv1.weight"]);
        assert_eq!(l.layers_per_block, 3);
    }

    #[test]
    fn maps_structure() {
        let l = sd1();
        let m = |n: &str| diffusers_to_original(n, &l);
        assert_eq!(
            m("conv_in.weight").as_deref(),
            Some("input_blocks.0.0.weight")
        );
        assert_eq!(
            m("down_blocks.1.resnets.0.conv_shortcut.weight").as_deref(),
            Some("input_blocks.4.0.skip_connection.weight")
        );
        assert_eq!(
            m("down_blocks.2.downsamplers.0.conv.bias").as_deref(),
            Some("input_blocks.9.0.op.bias")
        );
        assert_eq!(
            m("up_blocks.0.upsamplers.0.conv.weight").as_deref(),
            Some("output_blocks.2.1.conv.weight")
        );
        assert_eq!(
            m("up_blocks.1.upsamplers.0.conv.weight").as_deref(),
            Some("output_blocks.5.2.conv.weight")
        );
        assert_eq!(
            m("mid_block.resnets.1.time_emb_proj.weight").as_deref(),
            Some("middle_block.2.emb_layers.1.weight")
        );
        assert_eq!(
            m("mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0.weight").as_deref(),
            Some("middle_block.1.transformer_blocks.0.attn1.to_out.0.weight")
        );
    }

    #[test]
    fn rejects_unknown_and_out_of_range() {
        let l = sd1();
        let m = |n: &str| diffusers_to_original(n, &l);
        assert_eq!(m("down_blocks.0.resnets.2.conv1.weight"), None);
        assert_eq!(m("up_blocks.0.resnets.3.conv1.weight"), None);
        assert_eq!(m("down_blocks.0.resnets.0.weird.weight"), None);
        assert_eq!(m("mid_block.resnets.2.conv1.weight"), None);
        assert_eq!(m("down_blocks.x.resnets.0.conv1.weight"), None);
        assert_eq!(
            m("down_blocks.99999999999999999999.resnets.0.conv1.weight"),
            None
        );
        assert_eq!(
            m("down_blocks.18446744073709551615.attentions.0.norm.weight"),
            None
        );
    }
}
