//! Reading a UNet's widths and depths from its tensors (canonical names).
//!
//! Everything structural is in the shapes and names: `input_blocks.0.0.weight`
//! `[model_channels, in_channels, 3, 3]`, one `ResBlock` per `input_blocks.N.0.out_layers.3`
//! (its output width gives the level's multiplier), a `Downsample` per `input_blocks.N.0.op`
//! (a level boundary), `transformer_blocks.K` under `input_blocks.N.1` (the level's depth)
//! and `middle_block.1`, `attn2.to_k.weight` `[inner, context_dim]`, a 2-D `proj_in` (linear
//! projections), `label_emb.0.0.weight` `[time_embed_dim, adm_in_channels]`. What is not in
//! the tensors (head sizing, group count, prefix) comes from the caller's template.

use sd_formats::files::TensorCatalog;

use super::UnetConfig;
use crate::{ModelError, Result};

/// Where the next tensor lookups go.
struct Probe<F> {
    shape_of: F,
    prefix: String,
}

impl<F: Fn(&str) -> Option<Vec<usize>>> Probe<F> {
    fn shape(&self, rel: &str) -> Option<Vec<usize>> {
        (self.shape_of)(&format!("{}{rel}", self.prefix))
    }

    fn need(&self, rel: &str) -> Result<Vec<usize>> {
        self.shape(rel).ok_or_else(|| ModelError::MissingTensor {
            name: format!("{}{rel}", self.prefix),
        })
    }

    /// Number of `transformer_blocks.K` under `block` (a `SpatialTransformer` path).
    fn depth(&self, block: &str) -> usize {
        (0..)
            .take_while(|k| {
                self.shape(&format!("{block}.transformer_blocks.{k}.norm1.weight"))
                    .is_some()
            })
            .count()
    }
}

fn bad(detail: String) -> ModelError {
    ModelError::Config(format!("UNet structure from tensors: {detail}"))
}

impl UnetConfig {
    /// The configuration of the UNet whose tensors (canonical names under
    /// `template.prefix`) are in `loader`: channels, levels, residual blocks, attention
    /// levels and per-level transformer depth, middle depth, context width, projection kind
    /// and `label_emb` width are read from the tensors; `heads`, `norm_groups` and `prefix`
    /// are kept from `template` (the family's defaults).
    pub fn from_catalog(loader: &TensorCatalog, template: &UnetConfig) -> Result<UnetConfig> {
        Self::from_shapes(
            |name| {
                let s = loader.get(name)?;
                Some(s.shape.iter().map(|&d| d as usize).collect())
            },
            template,
        )
    }

    /// [`UnetConfig::from_catalog`] over any lookup of shapes (outermost first) by
    /// canonical name.
    pub fn from_shapes(
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
        template: &UnetConfig,
    ) -> Result<UnetConfig> {
        let p = Probe {
            shape_of,
            prefix: format!("{}.", template.prefix.trim_end_matches('.')),
        };
        let conv_in = p.need("input_blocks.0.0.weight")?;
        let (mc, in_channels) = match conv_in[..] {
            [mc, ic, ..] if mc > 0 => (mc, ic),
            _ => return Err(bad(format!("input_blocks.0.0.weight shape {conv_in:?}"))),
        };
        let out_channels = p.need("out.2.weight")?[0];

        // Walk the input blocks: res blocks (with attention or not) until a downsample.
        let mut channel_mult = Vec::new();
        let mut depths = Vec::new();
        let mut res_per_level = Vec::new();
        let (mut width, mut res, mut depth) = (mc, 0usize, 0usize);
        let mut context_dim = None;
        let mut linear = None;
        let mut n = 1;
        loop {
            let block = format!("input_blocks.{n}");
            let is_down = p.shape(&format!("{block}.0.op.weight")).is_some();
            let res_out = p.shape(&format!("{block}.0.out_layers.3.weight"));
            if is_down || res_out.is_none() {
                if res == 0 {
                    break;
                }
                if !width.is_multiple_of(mc) {
                    return Err(bad(format!(
                        "level width {width} is not a multiple of {mc}"
                    )));
                }
                channel_mult.push(width / mc);
                depths.push(depth);
                res_per_level.push(res);
                (res, depth) = (0, 0);
                if !is_down {
                    break;
                }
            } else if let Some(s) = res_out {
                width = s[0];
                res += 1;
                let attn = format!("{block}.1");
                if let Some(proj) = p.shape(&format!("{attn}.proj_in.weight")) {
                    linear.get_or_insert(proj.len() == 2);
                    let d = p.depth(&attn);
                    if d == 0 || (depth != 0 && d != depth) {
                        return Err(bad(format!("{attn}: {d} transformer blocks")));
                    }
                    depth = d;
                    if context_dim.is_none() {
                        context_dim = p
                            .shape(&format!("{attn}.transformer_blocks.0.attn2.to_k.weight"))
                            .map(|s| s[1]);
                    }
                }
            }
            n += 1;
        }
        let num_res_blocks = match res_per_level.first() {
            Some(&r) if res_per_level.iter().all(|&x| x == r) => r,
            _ => return Err(bad(format!("residual blocks per level {res_per_level:?}"))),
        };
        // Largest factor first, as LDM's configs list them.
        let attention_resolutions = depths
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, &d)| d > 0)
            .map(|(level, _)| 1usize << level)
            .collect();
        let transformer_depth_middle = p.depth("middle_block.1");
        if transformer_depth_middle == 0 {
            return Err(bad("no transformer blocks in middle_block.1".into()));
        }
        let context_dim = match context_dim {
            Some(c) => c,
            None => p.need("middle_block.1.transformer_blocks.0.attn2.to_k.weight")?[1],
        };
        let use_linear_in_transformer = match linear {
            Some(l) => l,
            None => p.need("middle_block.1.proj_in.weight")?.len() == 2,
        };
        let adm_in_channels = p.shape("label_emb.0.0.weight").map(|s| s[1]);
        // LDM's forms: one depth for every attention level when they agree with the middle
        // block (SD1, SD2, the refiner), else one per level with the middle given only
        // where it is not the last level's.
        let attn_depths: Vec<usize> = depths.iter().copied().filter(|&d| d > 0).collect();
        let (transformer_depth, transformer_depth_middle) =
            if attn_depths.iter().all(|&d| d == transformer_depth_middle) {
                (vec![transformer_depth_middle], None)
            } else if depths.last() == Some(&transformer_depth_middle) {
                (depths, None)
            } else {
                (depths, Some(transformer_depth_middle))
            };
        let cfg = UnetConfig {
            in_channels,
            out_channels,
            model_channels: mc,
            channel_mult,
            num_res_blocks,
            attention_resolutions,
            heads: template.heads,
            transformer_depth,
            transformer_depth_middle,
            adm_in_channels,
            context_dim,
            use_linear_in_transformer,
            norm_groups: template.norm_groups,
            prefix: template.prefix.clone(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
