//! Diffusers `AutoencoderKLQwenImage` (the Wan-2.1 video VAE of Qwen-Image) names to the
//! original Wan names, the canonical layout (ComfyUI's `qwen_image_vae.safetensors`,
//! stable-diffusion.cpp's `wan.hpp`).
//!
//! | diffusers | original |
//! |---|---|
//! | `*.conv_in` | `*.conv1` |
//! | `encoder.down_blocks.i` (flat list of resnets and resamples) | `encoder.downsamples.i` |
//! | `decoder.up_blocks.i.resnets.j` | `decoder.upsamples.{i * S + j}` |
//! | `decoder.up_blocks.i.upsamplers.0` | `decoder.upsamples.{i * S + S - 1}` |
//! | `*.mid_block.resnets.0` / `attentions.0` / `resnets.1` | `*.middle.0` / `middle.1` / `middle.2` |
//! | `*.norm_out` / `*.conv_out` | `*.head.0` / `*.head.2` |
//! | `quant_conv` / `post_quant_conv` | `conv1` / `conv2` |
//! | resnet `norm1`, `conv1`, `norm2`, `conv2`, `conv_shortcut` | `residual.0`, `residual.2`, `residual.3`, `residual.6`, `shortcut` |
//!
//! `S` is the stride of the decoder's flat list, one more than the resnets per up block
//! (`num_res_blocks + 2`: the resnets and the upsampler), read from the names
//! ([`WanVaeLayout::scan`]). Resample (`resample.1`, `time_conv`) and attention (`norm`,
//! `to_qkv`, `proj`) parts keep their names. Names relative to the autoencoder; tensors keep
//! their shapes (the causal 3-D kernels stay `[out, in, 3, 3, 3]`).

use super::split_index;

/// The decoder structure of a diffusers Wan VAE, read from its own names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WanVaeLayout {
    /// Entries per decoder level in the original flat list (`num_res_blocks + 2`).
    stride: u64,
}

impl Default for WanVaeLayout {
    /// Wan 2.1 / Qwen-Image: `num_res_blocks = 2`.
    fn default() -> Self {
        WanVaeLayout { stride: 4 }
    }
}

impl WanVaeLayout {
    /// Reads the layout from autoencoder-relative names.
    pub(crate) fn scan<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let resnets = names
            .into_iter()
            .filter_map(|n| n.strip_prefix("decoder.up_blocks."))
            .filter_map(split_index)
            .filter_map(|(_, rest)| rest.strip_prefix("resnets.").and_then(split_index))
            .map(|(j, _)| j.saturating_add(1))
            .max();
        resnets.map_or_else(WanVaeLayout::default, |r| WanVaeLayout {
            stride: r.saturating_add(1),
        })
    }
}

const RESNET_MAP: [(&str, &str); 5] = [
    ("norm1.", "residual.0."),
    ("conv1.", "residual.2."),
    ("norm2.", "residual.3."),
    ("conv2.", "residual.6."),
    ("conv_shortcut.", "shortcut."),
];

/// Parts of a resample block (or, in the encoder's flat list, a resnet) that keep their name.
const RESAMPLE_PARTS: [&str; 2] = ["resample.1.", "time_conv."];

const ATTENTION_PARTS: [&str; 3] = ["norm.", "to_qkv.", "proj."];

/// A resnet part (renamed) or a resample part (kept), `None` otherwise.
fn block_part(rest: &str) -> Option<String> {
    if let Some(r) = super::swap_prefix(rest, &RESNET_MAP) {
        return Some(r);
    }
    RESAMPLE_PARTS
        .iter()
        .any(|p| rest.strip_prefix(p).is_some_and(|x| !x.is_empty()))
        .then(|| rest.to_owned())
}

/// Converts one autoencoder-relative diffusers name to the original Wan name; `None` when
/// it is not a diffusers Wan VAE name (original names included).
pub(crate) fn diffusers_to_original(rel: &str, layout: WanVaeLayout) -> Option<String> {
    if let Some(x) = rel.strip_prefix("quant_conv.") {
        return nonempty(format!("conv1.{x}"), x);
    }
    if let Some(x) = rel.strip_prefix("post_quant_conv.") {
        return nonempty(format!("conv2.{x}"), x);
    }
    let (side, inner) = if let Some(inner) = rel.strip_prefix("encoder.") {
        ("encoder", inner)
    } else {
        ("decoder", rel.strip_prefix("decoder.")?)
    };
    let heads = [
        ("conv_in.", "conv1."),
        ("norm_out.", "head.0."),
        ("conv_out.", "head.2."),
    ];
    let mapped = if let Some(m) = super::swap_prefix(inner, &heads) {
        m
    } else if let Some(rest) = inner.strip_prefix("mid_block.resnets.") {
        match split_index(rest)? {
            (0, x) => format!("middle.0.{}", super::swap_prefix(x, &RESNET_MAP)?),
            (1, x) => format!("middle.2.{}", super::swap_prefix(x, &RESNET_MAP)?),
            _ => return None,
        }
    } else if let Some(x) = inner.strip_prefix("mid_block.attentions.0.") {
        ATTENTION_PARTS
            .iter()
            .any(|p| x.strip_prefix(p).is_some_and(|y| !y.is_empty()))
            .then(|| format!("middle.1.{x}"))?
    } else if let Some((i, rest)) = inner
        .strip_prefix("down_blocks.")
        .and_then(split_index)
        .filter(|_| side == "encoder")
    {
        format!("downsamples.{i}.{}", block_part(rest)?)
    } else if let Some((i, rest)) = inner
        .strip_prefix("up_blocks.")
        .and_then(split_index)
        .filter(|_| side == "decoder")
    {
        let s = layout.stride;
        if let Some((j, x)) = rest.strip_prefix("resnets.").and_then(split_index) {
            if j.saturating_add(1) >= s {
                return None;
            }
            let n = i.checked_mul(s)?.checked_add(j)?;
            format!("upsamples.{n}.{}", super::swap_prefix(x, &RESNET_MAP)?)
        } else {
            let x = rest.strip_prefix("upsamplers.0.")?;
            let n = i.checked_mul(s)?.checked_add(s - 1)?;
            let part = RESAMPLE_PARTS
                .iter()
                .any(|p| x.strip_prefix(p).is_some_and(|y| !y.is_empty()))
                .then(|| x.to_owned())?;
            format!("upsamples.{n}.{part}")
        }
    } else {
        return None;
    };
    Some(format!("{side}.{mapped}"))
}

fn nonempty(name: String, rest: &str) -> Option<String> {
    (!rest.is_empty()).then_some(name)
}

/// Whether `rel` (relative to the autoencoder) is an original-layout Wan VAE name.
pub(crate) fn is_original_name(rel: &str) -> bool {
    if rel.starts_with("conv1.") || rel.starts_with("conv2.") {
        return true;
    }
    let Some(inner) = rel
        .strip_prefix("encoder.")
        .or_else(|| rel.strip_prefix("decoder."))
    else {
        return false;
    };
    ["conv1.", "downsamples.", "upsamples.", "middle.", "head."]
        .iter()
        .any(|h| inner.starts_with(h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every parameter name of diffusers' `AutoencoderKLQwenImage(base_dim=8, z_dim=16,
    /// dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])`
    /// (its `state_dict()` keys; any width has the same names).
    fn diffusers_names() -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        let resnet = |v: &mut Vec<String>, p: &str, shortcut: bool| {
            for part in ["norm1.gamma", "conv1.weight", "conv1.bias", "norm2.gamma"] {
                v.push(format!("{p}.{part}"));
            }
            v.push(format!("{p}.conv2.weight"));
            v.push(format!("{p}.conv2.bias"));
            if shortcut {
                v.push(format!("{p}.conv_shortcut.weight"));
                v.push(format!("{p}.conv_shortcut.bias"));
            }
        };
        let conv = |v: &mut Vec<String>, p: &str| {
            v.push(format!("{p}.weight"));
            v.push(format!("{p}.bias"));
        };
        conv(&mut v, "encoder.conv_in");
        // Encoder: per level two resnets then a resample (none after the last level).
        let mut idx = 0;
        for level in 0..4 {
            for r in 0..2 {
                resnet(
                    &mut v,
                    &format!("encoder.down_blocks.{idx}"),
                    r == 0 && (level == 1 || level == 2),
                );
                idx += 1;
            }
            if level < 3 {
                conv(&mut v, &format!("encoder.down_blocks.{idx}.resample.1"));
                if level > 0 {
                    conv(&mut v, &format!("encoder.down_blocks.{idx}.time_conv"));
                }
                idx += 1;
            }
        }
        for side in ["encoder", "decoder"] {
            v.push(format!("{side}.mid_block.attentions.0.norm.gamma"));
            conv(&mut v, &format!("{side}.mid_block.attentions.0.to_qkv"));
            conv(&mut v, &format!("{side}.mid_block.attentions.0.proj"));
            resnet(&mut v, &format!("{side}.mid_block.resnets.0"), false);
            resnet(&mut v, &format!("{side}.mid_block.resnets.1"), false);
            v.push(format!("{side}.norm_out.gamma"));
            conv(&mut v, &format!("{side}.conv_out"));
        }
        conv(&mut v, "quant_conv");
        conv(&mut v, "post_quant_conv");
        conv(&mut v, "decoder.conv_in");
        for i in 0..4 {
            for j in 0..3 {
                resnet(
                    &mut v,
                    &format!("decoder.up_blocks.{i}.resnets.{j}"),
                    j == 0 && i == 1,
                );
            }
            if i < 3 {
                conv(
                    &mut v,
                    &format!("decoder.up_blocks.{i}.upsamplers.0.resample.1"),
                );
                if i < 2 {
                    conv(
                        &mut v,
                        &format!("decoder.up_blocks.{i}.upsamplers.0.time_conv"),
                    );
                }
            }
        }
        v
    }

    #[test]
    fn every_diffusers_name_maps_without_collision() {
        let names = diffusers_names();
        assert_eq!(names.len(), 194, "the tiny model's state_dict has 194 keys");
        let layout = WanVaeLayout::scan(names.iter().map(String::as_str));
        assert_eq!(layout, WanVaeLayout { stride: 4 });
        let mut seen: HashMap<String, &str> = HashMap::new();
        for n in &names {
            let m =
                diffusers_to_original(n, layout).unwrap_or_else(|| panic!("`{n}` does not map"));
            assert!(is_original_name(&m), "`{m}` (from `{n}`) is not original");
            assert_eq!(diffusers_to_original(&m, layout), None, "`{m}` maps again");
            if let Some(first) = seen.insert(m.clone(), n) {
                panic!("`{first}` and `{n}` both map to `{m}`");
            }
        }
    }

    #[test]
    fn maps_structure() {
        let l = WanVaeLayout::default();
        let m = |n: &str| diffusers_to_original(n, l);
        let cases = [
            ("encoder.conv_in.weight", "encoder.conv1.weight"),
            ("quant_conv.bias", "conv1.bias"),
            ("post_quant_conv.weight", "conv2.weight"),
            (
                "encoder.down_blocks.3.conv_shortcut.weight",
                "encoder.downsamples.3.shortcut.weight",
            ),
            (
                "encoder.down_blocks.5.time_conv.bias",
                "encoder.downsamples.5.time_conv.bias",
            ),
            (
                "encoder.down_blocks.0.norm2.gamma",
                "encoder.downsamples.0.residual.3.gamma",
            ),
            (
                "decoder.mid_block.resnets.1.conv2.weight",
                "decoder.middle.2.residual.6.weight",
            ),
            (
                "decoder.mid_block.attentions.0.to_qkv.weight",
                "decoder.middle.1.to_qkv.weight",
            ),
            ("decoder.norm_out.gamma", "decoder.head.0.gamma"),
            ("encoder.conv_out.bias", "encoder.head.2.bias"),
            (
                "decoder.up_blocks.1.resnets.2.conv1.bias",
                "decoder.upsamples.6.residual.2.bias",
            ),
            (
                "decoder.up_blocks.2.upsamplers.0.resample.1.weight",
                "decoder.upsamples.11.resample.1.weight",
            ),
            (
                "decoder.up_blocks.3.resnets.0.norm1.gamma",
                "decoder.upsamples.12.residual.0.gamma",
            ),
        ];
        for (from, to) in cases {
            assert_eq!(m(from).as_deref(), Some(to), "{from}");
        }
        for bad in [
            "encoder.up_blocks.0.resnets.0.conv1.weight",
            "decoder.down_blocks.0.conv1.weight",
            "encoder.down_blocks.0.resnets.0.conv1.weight",
            "decoder.up_blocks.0.resnets.3.conv1.weight",
            "decoder.mid_block.resnets.2.conv1.weight",
            "decoder.mid_block.attentions.0.to_q.weight",
            "encoder.conv_in.",
            "quant_conv.",
            "encoder.conv1.weight",
        ] {
            assert_eq!(m(bad), None, "{bad}");
        }
    }

    #[test]
    fn scan_reads_the_stride() {
        let names = ["decoder.up_blocks.0.resnets.0.conv1.weight"];
        assert_eq!(WanVaeLayout::scan(names).stride, 2);
        assert_eq!(WanVaeLayout::scan(["x"]), WanVaeLayout::default());
    }
}
