//! LoRA application with epochs.
//!
//! A LoRA file holds, per target weight `W` (`[out, in...]`), a down matrix `[rank, in...]`,
//! an up matrix `[out, rank, 1...]` and optionally a scalar `alpha`; the patch is
//! `W += up @ down * (alpha / rank) * multiplier` (without alpha the scale is the
//! multiplier). Key forms understood, for a weight named `B.weight`:
//! - kohya: `lora_unet_<B relative to model.diffusion_model., dots as underscores>`, or
//!   `lora_unet_<the diffusers module path, dots as underscores>` (what kohya's sd-scripts
//!   write for SD1/SD2: `lora_unet_down_blocks_0_attentions_0_proj_in`, brought to the
//!   diffusers path and then to canonical names, see [`kohya_unet_to_diffusers`]),
//!   `lora_te_` / `lora_te1_` (first text encoder) and `lora_te2_` (second), followed by
//!   `.lora_down.weight`, `.lora_up.weight`, `.alpha`;
//! - diffusers / PEFT: `B.lora_A.weight` (down), `B.lora_B.weight` (up), or
//!   `B.lora.down.weight` / `B.lora.up.weight`, with `B.alpha`. Diffusers layouts are first
//!   brought to canonical names (see [`sd_formats::names`]);
//! - LyCORIS LoHa and LoKr under the same stems (`.hada_w1_a`, `.lokr_w1`, ...; see
//!   [`super::lycoris`] for their deltas and scales).
//!
//! Deltas are computed on the host in f32 and written into the memory the registered tensor
//! uses now (its staging copy, or its params copy when bound); a state remembers the epoch of
//! the patch its memory carries and loses it with that memory. Changing the LoRA set bumps
//! the epoch and frees every patched copy, so weights are reloaded and patched again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use sd_tensor::{convert, DType};

use super::lycoris::{self, Delta, Named};
use super::state::ParamState;
use super::ModelManager;
use crate::residency::{ParamId, ResidencyError, Result, SourceId};
use sd_formats::files::TensorCatalog;

/// One LoRA to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// The LoRA file.
    pub path: PathBuf,
    /// Strength.
    pub multiplier: f32,
}

#[derive(Clone, Debug)]
pub(crate) struct Patch {
    lora: usize,
    kind: PatchKind,
    scale: f32,
}

#[derive(Clone, Debug)]
enum PatchKind {
    /// `up @ down`.
    LowRank {
        up: String,
        down: String,
        rank: usize,
    },
    /// A LyCORIS delta (LoHa, LoKr).
    Lycoris(Box<Delta>),
}

#[derive(Debug, Default)]
pub(crate) struct LoraState {
    pub epoch: u64,
    specs: Vec<LoraSpec>,
    loaders: Vec<TensorCatalog>,
    patches: HashMap<ParamId, Vec<Patch>>,
    targeted: HashSet<String>,
}

impl LoraState {
    /// Whether the current LoRAs patch this state.
    pub fn targets(&self, s: &ParamState) -> bool {
        s.source == SourceId::MAIN && self.targeted.contains(&s.name)
    }

    /// Whether any weight has LoRA patches to apply.
    pub fn has_patches(&self) -> bool {
        !self.patches.is_empty()
    }

    pub fn forget(&mut self, params: &[ParamId]) {
        for p in params {
            self.patches.remove(p);
        }
    }
}

const KOHYA: [(&str, &str); 4] = [
    ("model.diffusion_model.", "lora_unet_"),
    ("cond_stage_model.transformer.", "lora_te_"),
    ("cond_stage_model.transformer.", "lora_te1_"),
    ("cond_stage_model.1.transformer.", "lora_te2_"),
];

/// Which part of a LoRA pair a tensor name is, and its stem.
fn split_key(name: &str) -> Option<(&str, Part)> {
    const FORMS: [(&str, Part); 7] = [
        (".lora_down.weight", Part::Down),
        (".lora_up.weight", Part::Up),
        (".lora_A.weight", Part::Down),
        (".lora_B.weight", Part::Up),
        (".lora.down.weight", Part::Down),
        (".lora.up.weight", Part::Up),
        (".alpha", Part::Alpha),
    ];
    FORMS
        .iter()
        .find_map(|(suffix, part)| name.strip_suffix(suffix).map(|stem| (stem, *part)))
        .or_else(|| {
            let (stem, suffix) = name.rsplit_once('.')?;
            let known = lycoris::SUFFIXES.iter().find(|s| **s == suffix)?;
            Some((stem, Part::Lycoris(known)))
        })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Down,
    Up,
    Alpha,
    Lycoris(&'static str),
}

/// The tensors of one LoRA module.
#[derive(Default)]
struct Pair {
    down: Option<String>,
    up: Option<String>,
    alpha: Option<String>,
    lycoris: BTreeMap<&'static str, String>,
}

impl Pair {
    fn names(&self) -> impl Iterator<Item = &String> {
        [&self.down, &self.up, &self.alpha]
            .into_iter()
            .flatten()
            .chain(self.lycoris.values())
    }
}

fn to_f32(loader: &TensorCatalog, name: &str) -> Result<Vec<f32>> {
    let bytes = loader.read_converted(name, DType::F32)?;
    convert::to_f32(DType::F32, &bytes).map_err(|e| ResidencyError::LoraTensor {
        path: PathBuf::new(),
        name: name.to_string(),
        detail: e.to_string(),
    })
}

/// Module names of the diffusers UNet that contain an underscore, longest first: a kohya
/// key joins every part with `_`, so these are matched as one part.
const DIFFUSERS_COMPOUNDS: [&str; 19] = [
    "transformer_blocks",
    "time_embedding",
    "conv_norm_out",
    "add_embedding",
    "conv_shortcut",
    "time_emb_proj",
    "down_blocks",
    "downsamplers",
    "upsamplers",
    "mid_block",
    "up_blocks",
    "proj_out",
    "linear_1",
    "linear_2",
    "conv_out",
    "proj_in",
    "conv_in",
    "to_out",
    "to_q",
];

/// The diffusers module path of a kohya UNet stem in diffusers form (the part after
/// `lora_unet_`, e.g. `down_blocks_0_attentions_1_transformer_blocks_0_attn2_to_k` is
/// `down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k`); `None` for the original
/// (LDM) form (`input_blocks_1_1_proj_in`).
pub fn kohya_unet_to_diffusers(rest: &str) -> Option<String> {
    const ROOTS: [&str; 7] = [
        "down_blocks_",
        "up_blocks_",
        "mid_block_",
        "conv_in",
        "conv_out",
        "conv_norm_out",
        "time_embedding_",
    ];
    if !ROOTS.iter().any(|r| rest.starts_with(r)) {
        return None;
    }
    let compounds = DIFFUSERS_COMPOUNDS.iter().chain(&["to_k", "to_v"]);
    let mut parts = Vec::new();
    let mut s = rest;
    while !s.is_empty() {
        let part = compounds
            .clone()
            .find(|c| s.starts_with(**c) && matches!(s.as_bytes().get(c.len()), None | Some(b'_')))
            .map(|c| &s[..c.len()])
            .unwrap_or_else(|| s.split('_').next().unwrap_or(s));
        parts.push(part);
        s = s[part.len()..]
            .strip_prefix('_')
            .unwrap_or(&s[part.len()..]);
    }
    Some(parts.join("."))
}

/// Brings kohya UNet keys in diffusers form to `unet.<diffusers path>` keys, which
/// [`canonicalize`] then renames as any diffusers LoRA.
fn kohya_diffusers_to_unet(loader: &mut TensorCatalog) -> Result<()> {
    loader.rename(|t| {
        let mut t = t.clone();
        if let Some(rest) = t.name.strip_prefix("lora_unet_") {
            let (stem, suffix) = match rest.find('.') {
                Some(i) => rest.split_at(i),
                None => (rest, ""),
            };
            if let Some(path) = kohya_unet_to_diffusers(stem) {
                t.name = format!("{}{path}{suffix}", sd_formats::names::DIFFUSERS_UNET);
            }
        }
        vec![t]
    })?;
    Ok(())
}

/// Brings diffusers-layout LoRA names to canonical names (best effort).
fn canonicalize(loader: &mut TensorCatalog) {
    if let Err(e) = kohya_diffusers_to_unet(loader) {
        tracing::warn!(error = %e, "cannot rename kohya LoRA keys; using them as they are");
    }
    let before: Vec<_> = loader.tensors().cloned().collect();
    let Ok(after) = sd_formats::names::convert_to_canonical(before.clone(), None) else {
        return;
    };
    if after.len() != before.len() {
        return;
    }
    let map: HashMap<String, String> = before
        .into_iter()
        .zip(after)
        .map(|(b, a)| (b.name, a.name))
        .collect();
    if let Err(e) = loader.rename(|t| {
        let mut t = t.clone();
        if let Some(n) = map.get(&t.name) {
            t.name = n.clone();
        }
        vec![t]
    }) {
        tracing::warn!(error = %e, "cannot canonicalize LoRA names; using them as they are");
    }
}

impl ModelManager {
    /// The current LoRA epoch (bumped by every change of the LoRA set).
    pub fn lora_epoch(&self) -> u64 {
        self.lora.epoch
    }

    /// Replaces the set of LoRAs. Refused while an owner is running or weights are pinned.
    /// Every LoRA tensor must target a registered weight of the main source, with matching
    /// shapes; on error the previous set stays.
    pub fn set_loras(&mut self, specs: Vec<LoraSpec>) -> Result<()> {
        if specs == self.lora.specs {
            return Ok(());
        }
        self.finish_transfers();
        if self.running() {
            return Err(ResidencyError::Busy("changing LoRAs"));
        }
        let _span = tracing::info_span!("set_loras", loras = specs.len()).entered();
        // Stems of every patchable weight.
        let mut stems: HashMap<String, ParamId> = HashMap::new();
        for (id, s) in &self.states {
            if s.source != SourceId::MAIN || !s.component.accepts_lora() {
                continue;
            }
            let Some(base) = s.name.strip_suffix(".weight") else {
                continue;
            };
            stems.entry(base.to_string()).or_insert(*id);
            for (prefix, kohya) in KOHYA {
                if let Some(rel) = base.strip_prefix(prefix) {
                    stems
                        .entry(format!("{kohya}{}", rel.replace('.', "_")))
                        .or_insert(*id);
                }
            }
        }
        let mut loaders = Vec::with_capacity(specs.len());
        let mut patches: HashMap<ParamId, Vec<Patch>> = HashMap::new();
        for (li, spec) in specs.iter().enumerate() {
            let mut loader = TensorCatalog::new();
            loader.add_file(&spec.path, None)?;
            // The file's own names, for errors (renames keep a tensor's place in its file).
            let original: HashMap<(sd_formats::FileId, u64), String> = loader
                .tensors()
                .map(|t| ((t.file, t.offset), t.name.clone()))
                .collect();
            canonicalize(&mut loader);
            let own_name = |name: &str| {
                loader
                    .get(name)
                    .and_then(|t| original.get(&(t.file, t.offset)))
                    .cloned()
                    .unwrap_or_else(|| name.to_string())
            };
            let bad = |name: &str, detail: String| ResidencyError::LoraTensor {
                path: spec.path.clone(),
                name: name.to_string(),
                detail,
            };
            let mut pairs: BTreeMap<String, Pair> = BTreeMap::new();
            for t in loader.tensors() {
                let (stem, part) = split_key(&t.name).ok_or_else(|| {
                    bad(
                        &own_name(&t.name),
                        "not a LoRA (down/up/alpha), LoHa (hada_*) or LoKr (lokr_*) tensor".into(),
                    )
                })?;
                let pair = pairs.entry(stem.to_string()).or_default();
                let slot = match part {
                    Part::Down => &mut pair.down,
                    Part::Up => &mut pair.up,
                    Part::Alpha => &mut pair.alpha,
                    Part::Lycoris(k) => {
                        pair.lycoris.insert(k, t.name.clone());
                        continue;
                    }
                };
                *slot = Some(t.name.clone());
            }
            let unknown: Vec<String> = pairs
                .iter()
                .filter(|(stem, _)| !stems.contains_key(*stem))
                .flat_map(|(_, p)| p.names())
                .map(|n| own_name(n))
                .collect();
            if !unknown.is_empty() {
                return Err(ResidencyError::LoraUnknownWeights {
                    path: spec.path.clone(),
                    names: unknown,
                });
            }
            for (stem, pair) in &pairs {
                let param = stems[stem];
                let w = &self.states[&param];
                let alpha = match &pair.alpha {
                    Some(a) => Some(
                        *to_f32(&loader, a)?
                            .first()
                            .ok_or_else(|| bad(a, "alpha has no value".into()))?,
                    ),
                    None => None,
                };
                if !pair.lycoris.is_empty() {
                    let first = pair.lycoris.values().next().cloned().unwrap_or_default();
                    if pair.down.is_some() || pair.up.is_some() {
                        return Err(bad(
                            &own_name(&first),
                            "mixes LoRA and LyCORIS tensors for one module".into(),
                        ));
                    }
                    let parts = pair
                        .lycoris
                        .iter()
                        .map(|(k, n)| {
                            let shape = loader.get(n).map(|t| t.shape.clone()).unwrap_or_default();
                            (
                                *k,
                                Named {
                                    name: n.clone(),
                                    shape,
                                },
                            )
                        })
                        .collect();
                    let w_out = w.shape.first().copied().unwrap_or(0);
                    let delta = Delta::from_parts(&parts)
                        .and_then(|d| d.check(w_out, w.shape.iter().product()).map(|()| d))
                        .map_err(|e| {
                            bad(
                                &own_name(&first),
                                format!("{e} (for `{}` of shape {:?})", w.name, w.shape),
                            )
                        })?;
                    patches.entry(param).or_default().push(Patch {
                        lora: li,
                        scale: delta.scale(alpha) * spec.multiplier,
                        kind: PatchKind::Lycoris(Box::new(delta)),
                    });
                    continue;
                }
                let (Some(down), Some(up)) = (&pair.down, &pair.up) else {
                    let which = pair
                        .down
                        .as_ref()
                        .or(pair.up.as_ref())
                        .or(pair.alpha.as_ref());
                    return Err(bad(
                        which.map_or(stem.as_str(), |s| s.as_str()),
                        "has no matching down/up partner".into(),
                    ));
                };
                let ds = loader
                    .get(down)
                    .map(|t| t.shape.clone())
                    .unwrap_or_default();
                let us = loader.get(up).map(|t| t.shape.clone()).unwrap_or_default();
                let rank = ds.first().copied().unwrap_or(0);
                let w_out = w.shape.first().copied().unwrap_or(0);
                let w_numel: u64 = w.shape.iter().product();
                let d_in: u64 = ds.iter().skip(1).product();
                let u_rest: u64 = us.iter().skip(2).product();
                let ok = rank > 0
                    && us.len() >= 2
                    && us[0] == w_out
                    && us[1] == rank
                    && u_rest == 1
                    && w_out.checked_mul(d_in) == Some(w_numel);
                if !ok {
                    return Err(bad(
                        down,
                        format!(
                            "down {ds:?} and up {us:?} do not make a delta for `{}` of shape {:?}",
                            w.name, w.shape
                        ),
                    ));
                }
                let scale = match alpha {
                    Some(alpha) => alpha / rank as f32 * spec.multiplier,
                    None => spec.multiplier,
                };
                patches.entry(param).or_default().push(Patch {
                    lora: li,
                    kind: PatchKind::LowRank {
                        up: up.clone(),
                        down: down.clone(),
                        rank: rank as usize,
                    },
                    scale,
                });
            }
            loaders.push(loader);
        }
        // Free every patched copy, and mappings that new targets would need to write.
        let targeted: HashSet<String> = patches
            .keys()
            .map(|p| self.states[p].name.clone())
            .collect();
        let patched: Vec<ParamId> = self
            .states
            .iter()
            .filter(|(_, s)| {
                s.lora_epoch.is_some() || (targeted.contains(&s.name) && self.is_mmapped(s))
            })
            .map(|(id, _)| *id)
            .collect();
        let staging: Vec<_> = self
            .staging
            .iter()
            .filter(|(_, b)| b.members.iter().any(|m| patched.contains(m)))
            .map(|(id, _)| *id)
            .collect();
        for id in staging {
            self.drop_staging_block(id);
        }
        let storage: Vec<_> = self
            .storage
            .iter()
            .filter(|(_, b)| {
                b.members.iter().any(|m| {
                    patched.contains(m)
                        && self
                            .states
                            .get(m)
                            .is_some_and(|s| s.bound || b.mapped.is_some())
                })
            })
            .map(|(id, _)| *id)
            .collect();
        for id in storage {
            self.drop_storage_block(id);
        }
        self.lora = LoraState {
            epoch: self.lora.epoch + 1,
            specs,
            loaders,
            patches,
            targeted,
        };
        Ok(())
    }

    /// Patches the resident compute memory of `params` with the current LoRAs.
    pub(crate) fn apply_loras(&mut self, params: &[ParamId]) -> Result<()> {
        let epoch = self.lora.epoch;
        for p in params {
            let Some(patches) = self.lora.patches.get(p) else {
                continue;
            };
            let s = &self.states[p];
            if s.lora_epoch == Some(epoch) || !s.is_resident_on_compute() {
                continue;
            }
            let _span = tracing::debug_span!("apply_lora", tensor = %s.name).entered();
            let ggml = |what: &str| ResidencyError::ggml(format!("{what} `{}`", s.name));
            let mut w = s.tensor.read_f32().map_err(ggml("reading"))?;
            for patch in patches {
                let loader = &self.lora.loaders[patch.lora];
                let (up, down, rank) = match &patch.kind {
                    PatchKind::Lycoris(delta) => {
                        let mut read = |n: &str| to_f32(loader, n);
                        delta.add_to(&mut w, patch.scale, &mut read)?;
                        continue;
                    }
                    PatchKind::LowRank { up, down, rank } => (up, down, *rank),
                };
                let up_v = to_f32(loader, up)?;
                let down_v = to_f32(loader, down)?;
                let out = up_v.len() / rank.max(1);
                let inner = down_v.len() / rank.max(1);
                if out * inner != w.len() {
                    return Err(ResidencyError::LoraTensor {
                        path: self.lora.specs[patch.lora].path.clone(),
                        name: down.clone(),
                        detail: format!("delta of {out}x{inner} for {} values", w.len()),
                    });
                }
                for i in 0..out {
                    let row = &mut w[i * inner..(i + 1) * inner];
                    for r in 0..rank {
                        let u = up_v[i * rank + r] * patch.scale;
                        if u == 0.0 {
                            continue;
                        }
                        let d = &down_v[r * inner..(r + 1) * inner];
                        for (x, y) in row.iter_mut().zip(d) {
                            *x += u * y;
                        }
                    }
                }
            }
            s.tensor.write_f32(&w).map_err(ggml("writing"))?;
            if let Some(s) = self.states.get_mut(p) {
                s.lora_epoch = Some(epoch);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::kohya_unet_to_diffusers as k;

    #[test]
    fn kohya_diffusers_stems_become_module_paths() {
        assert_eq!(
            k("down_blocks_0_attentions_1_transformer_blocks_0_attn2_to_k").as_deref(),
            Some("down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k")
        );
        assert_eq!(
            k("up_blocks_1_attentions_0_transformer_blocks_0_ff_net_0_proj").as_deref(),
            Some("up_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj")
        );
        assert_eq!(
            k("mid_block_attentions_0_transformer_blocks_0_attn1_to_out_0").as_deref(),
            Some("mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0")
        );
        assert_eq!(
            k("down_blocks_1_resnets_0_conv_shortcut").as_deref(),
            Some("down_blocks.1.resnets.0.conv_shortcut")
        );
        assert_eq!(
            k("down_blocks_0_resnets_0_time_emb_proj").as_deref(),
            Some("down_blocks.0.resnets.0.time_emb_proj")
        );
        assert_eq!(
            k("time_embedding_linear_1").as_deref(),
            Some("time_embedding.linear_1")
        );
        assert_eq!(k("input_blocks_1_1_proj_in"), None);
        assert_eq!(k("out_2"), None);
    }
}
