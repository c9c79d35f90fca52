//! Image upscaler models: architecture detection from a state dict and one front for the
//! networks ([`Upscaler`]).
//!
//! Detection follows spandrel 0.4's key conditions, in the order its registry tries them for
//! these architectures:
//!
//! - **Compact** (`SRVGGNetCompact`): `body.0.weight` and `body.1.weight`;
//! - **ESRGAN** (RRDBNet): `model.0.weight` + `model.1.sub.0.RDB1.conv1.0.weight` (original),
//!   `conv_first.weight` + `body.0.rdb1.conv1.weight` + `conv_body.weight` +
//!   `conv_last.weight` (Real-ESRGAN), `conv_first.weight` + `RRDB_trunk.0.RDB1.conv1.weight` +
//!   `trunk_conv.weight` + `conv_last.weight` (BSRGAN), `model.0.weight` +
//!   `model.1.sub.0.RDB1.conv1x1.weight` (ESRGAN+);
//! - **MoSR**: `gblocks.0.weight` and the tensors of `gblocks.1`.
//!
//! Before detection, a `module.` or `netG.` prefix common to every name is removed (spandrel's
//! `canonicalize_state_dict`; the `params_ema` / `params` wrappers of BasicSR `.pth` files are
//! unwrapped by the PyTorch reader).

use std::path::Path;

use sd_formats::files::TensorCatalog;
use sd_tensor::ggml::GTensor;

use crate::esrgan::{self, Esrgan, EsrganConfig};
use crate::mosr::{Mosr, MosrConfig};
use crate::srvgg::{Compact, CompactConfig};
use crate::weights::ParamBuilder;
use crate::{GraphCtx, ModelError, Result};

/// A detected upscaler architecture with its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpscalerArch {
    /// RRDBNet (ESRGAN, Real-ESRGAN, BSRGAN, ESRGAN+).
    Esrgan(EsrganConfig),
    /// SRVGGNetCompact.
    Compact(CompactConfig),
    /// MoSR.
    Mosr(MosrConfig),
}

impl UpscalerArch {
    /// spandrel's architecture id (`"ESRGAN"`, `"Compact"`, `"MoSR"`).
    pub fn id(&self) -> &'static str {
        match self {
            UpscalerArch::Esrgan(_) => "ESRGAN",
            UpscalerArch::Compact(_) => "Compact",
            UpscalerArch::Mosr(_) => "MoSR",
        }
    }

    /// Image scale factor.
    pub fn scale(&self) -> usize {
        match self {
            UpscalerArch::Esrgan(c) => c.scale(),
            UpscalerArch::Compact(c) => c.scale,
            UpscalerArch::Mosr(c) => c.scale,
        }
    }

    /// Channels of the input image.
    pub fn input_channels(&self) -> usize {
        match self {
            UpscalerArch::Esrgan(c) => c.image_channels(),
            UpscalerArch::Compact(c) => c.in_channels,
            UpscalerArch::Mosr(c) => c.in_channels,
        }
    }

    /// Channels of the output image.
    pub fn output_channels(&self) -> usize {
        match self {
            UpscalerArch::Esrgan(c) => c.out_channels,
            UpscalerArch::Compact(c) => c.out_channels,
            UpscalerArch::Mosr(c) => c.in_channels,
        }
    }

    /// Input width and height must be multiples of this (the pixel-unshuffle factor).
    pub fn size_multiple(&self) -> usize {
        match self {
            UpscalerArch::Esrgan(c) => c.shuffle_factor.unwrap_or(1),
            _ => 1,
        }
    }

    /// spandrel's descriptor tags (`["64nf", "23nb"]`, `["64nf", "32nc"]`, ...).
    pub fn tags(&self) -> Vec<String> {
        match self {
            UpscalerArch::Esrgan(c) => {
                let mut t = vec![
                    format!("{}nf", c.num_filters),
                    format!("{}nb", c.num_blocks),
                ];
                if c.plus {
                    t.insert(0, "ESRGAN+".into());
                }
                if c.shuffle_factor.is_some() {
                    t.push("unshuffle".into());
                }
                t
            }
            UpscalerArch::Compact(c) => {
                vec![format!("{}nf", c.num_feat), format!("{}nc", c.num_conv)]
            }
            UpscalerArch::Mosr(_) => Vec::new(),
        }
    }
}

fn has_all(catalog: &TensorCatalog, names: &[&str]) -> bool {
    names.iter().all(|n| catalog.get(n).is_some())
}

/// Removes a `module.` or `netG.` prefix common to every tensor name.
fn strip_common_prefix(catalog: &mut TensorCatalog) -> Result<()> {
    for prefix in ["module.", "netG."] {
        if !catalog.is_empty() && catalog.tensors().all(|t| t.name.starts_with(prefix)) {
            catalog.strip_prefix(prefix)?;
        }
    }
    Ok(())
}

/// Detects the architecture of the upscaler in `catalog` and renames its tensors to the
/// names the model code uses (see [`esrgan::to_canonical_names`]).
pub fn detect(catalog: &mut TensorCatalog) -> Result<UpscalerArch> {
    strip_common_prefix(catalog)?;
    if has_all(catalog, &["body.0.weight", "body.1.weight"]) {
        return Ok(UpscalerArch::Compact(CompactConfig::detect(catalog)?));
    }
    let esrgan = [
        &["model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight"][..],
        &[
            "conv_first.weight",
            "body.0.rdb1.conv1.weight",
            "conv_body.weight",
            "conv_last.weight",
        ],
        &[
            "conv_first.weight",
            "RRDB_trunk.0.RDB1.conv1.weight",
            "trunk_conv.weight",
            "conv_last.weight",
        ],
        &["model.0.weight", "model.1.sub.0.RDB1.conv1x1.weight"],
    ];
    if esrgan.iter().any(|keys| has_all(catalog, keys)) {
        esrgan::to_canonical_names(catalog)?;
        return Ok(UpscalerArch::Esrgan(EsrganConfig::detect(catalog)?));
    }
    let mosr = [
        "gblocks.0.weight",
        "gblocks.0.bias",
        "gblocks.1.norm.weight",
        "gblocks.1.norm.bias",
        "gblocks.1.fc1.weight",
        "gblocks.1.fc1.bias",
        "gblocks.1.conv.weight",
        "gblocks.1.conv.bias",
        "gblocks.1.fc2.weight",
        "gblocks.1.fc2.bias",
    ];
    if has_all(catalog, &mosr) {
        return Ok(UpscalerArch::Mosr(MosrConfig::detect(catalog)?));
    }
    let sample: Vec<&str> = catalog.tensors().take(4).map(|t| t.name.as_str()).collect();
    Err(ModelError::Config(format!(
        "not a supported upscaler (ESRGAN/Real-ESRGAN RRDBNet, Real-ESRGAN Compact, MoSR): \
         {} tensors, first names {sample:?}",
        catalog.len()
    )))
}

/// Opens an upscaler file (`.pth`, `.safetensors`, ...) and detects its architecture.
pub fn open(path: impl AsRef<Path>) -> Result<(TensorCatalog, UpscalerArch)> {
    let mut catalog = TensorCatalog::new();
    catalog.add_file(path.as_ref(), None)?;
    let arch = detect(&mut catalog)?;
    Ok((catalog, arch))
}

/// An upscaler network with its parameters declared.
#[derive(Clone, Debug)]
pub enum Upscaler {
    /// RRDBNet.
    Esrgan(Esrgan),
    /// SRVGGNetCompact.
    Compact(Compact),
    /// MoSR.
    Mosr(Mosr),
}

impl Upscaler {
    /// Declares the parameters of `arch` under `pb` (all f32).
    pub fn new(pb: &ParamBuilder<'_>, arch: &UpscalerArch) -> Result<Self> {
        Ok(match arch {
            UpscalerArch::Esrgan(c) => Upscaler::Esrgan(Esrgan::new(pb, c.clone())?),
            UpscalerArch::Compact(c) => Upscaler::Compact(Compact::new(pb, c.clone())?),
            UpscalerArch::Mosr(c) => Upscaler::Mosr(Mosr::new(pb, c.clone())?),
        })
    }

    /// The architecture and configuration.
    pub fn arch(&self) -> UpscalerArch {
        match self {
            Upscaler::Esrgan(m) => UpscalerArch::Esrgan(m.config.clone()),
            Upscaler::Compact(m) => UpscalerArch::Compact(m.config.clone()),
            Upscaler::Mosr(m) => UpscalerArch::Mosr(m.config.clone()),
        }
    }

    /// Builds the forward pass of `x` `[W, H, C, N]` (values in [0, 1]); returns
    /// `[W * scale, H * scale, C_out, N]` (not clamped).
    pub fn forward(&self, g: &mut GraphCtx, x: &GTensor) -> Result<GTensor> {
        match self {
            Upscaler::Esrgan(m) => m.forward(g, x),
            Upscaler::Compact(m) => m.forward(g, x),
            Upscaler::Mosr(m) => m.forward(g, x),
        }
    }
}
