//! Hires fix: generate at the base size, upscale, then denoise again at the target size.
//!
//! The second pass is an img2img run ([`Pipeline::img2img`]) from the upscaled first-pass
//! image with `strength` (A1111's "denoising strength") and its own step count. The upscale
//! step is one of:
//!
//! - [`HiresUpscaler::Latent`] / [`HiresUpscaler::LatentNearest`]: the first-pass image's
//!   latents (its VAE encoding: [`Pipeline`] hands images, not latents, between calls)
//!   resized bilinearly / nearest, decoded;
//! - [`HiresUpscaler::Bilinear`]: the decoded image resized bilinearly;
//! - [`HiresUpscaler::Model`]: an upscaler model ([`crate::upscale`]) run through the
//!   pipeline's runtime (same device and `--max-vram` budget as the diffusion models), its
//!   output resized bilinearly to the target size when the model's scale does not land on it.

use std::path::PathBuf;

use sd_tensor::Image;

use crate::generate::{GenerateError, Pipeline, Txt2Img};
use crate::upscale::{upscale_image, RuntimeTiles, UpscaleOptions, UpscalerModel};

/// How the first-pass image is brought to the target size.
#[derive(Clone, Debug, PartialEq)]
pub enum HiresUpscaler {
    /// Bilinear resize of the latents.
    Latent,
    /// Nearest-neighbour resize of the latents.
    LatentNearest,
    /// Bilinear resize of the image.
    Bilinear,
    /// An upscaler model file, with its tiling options.
    Model {
        /// The model file.
        path: PathBuf,
        /// Tiling (repeats are applied as given).
        options: UpscaleOptions,
    },
}

/// Settings of the second pass.
#[derive(Clone, Debug, PartialEq)]
pub struct HiresFix {
    /// Target width (a multiple of the model's size multiple).
    pub width: usize,
    /// Target height.
    pub height: usize,
    /// Second-pass sampling steps (0: the first pass's).
    pub steps: usize,
    /// Denoising strength of the second pass, 0..=1.
    pub strength: f32,
    /// The upscale step.
    pub upscaler: HiresUpscaler,
}

fn setting(flag: &'static str, message: String) -> GenerateError {
    GenerateError::InvalidSetting { flag, message }
}

/// Brings `image` (a first-pass output) to the hires target size with `hires.upscaler`.
pub fn hires_upscale(
    p: &mut Pipeline,
    image: &Image,
    hires: &HiresFix,
    tiling: Option<crate::vae_tiling::VaeTiling>,
) -> Result<Image, GenerateError> {
    let (w, h) = (hires.width, hires.height);
    match &hires.upscaler {
        HiresUpscaler::Bilinear => Ok(image.resize_bilinear(w, h)?),
        HiresUpscaler::Latent | HiresUpscaler::LatentNearest => {
            let f = p.spec().first_stage.1.downsample_factor();
            if !w.is_multiple_of(f) || !h.is_multiple_of(f) {
                return Err(setting(
                    "hires-size",
                    format!("{w}x{h} is not a multiple of the VAE factor {f}"),
                ));
            }
            let z = p.encode(image, tiling)?;
            let z = if hires.upscaler == HiresUpscaler::Latent {
                z.interpolate_bilinear(h / f, w / f, false)?
            } else {
                z.interpolate_nearest(h / f, w / f)?
            };
            p.decode(&z, tiling)
        }
        HiresUpscaler::Model { path, options } => {
            let rt = p.runtime_mut();
            let model = UpscalerModel::add(rt, path)
                .map_err(|e| setting("hires-upscaler", e.to_string()))?;
            let up = {
                let mut tiles = RuntimeTiles {
                    rt: &mut *rt,
                    model: &model,
                };
                upscale_image(&mut tiles, image, options)
                    .map_err(|e| setting("hires-upscaler", e.to_string()))?
            };
            rt.release(model.handle)
                .map_err(|e| setting("hires-upscaler", e.to_string()))?;
            Ok(up.resize_bilinear(w, h)?)
        }
    }
}

/// txt2img with a hires fix: `params` at its size, then each image upscaled
/// ([`hires_upscale`]) and denoised again at `hires.width` x `hires.height`
/// (seed `params.seed + i` for image `i`).
pub fn txt2img_hires(
    p: &mut Pipeline,
    params: &Txt2Img,
    hires: &HiresFix,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Image>, GenerateError> {
    if !(0.0..=1.0).contains(&hires.strength) {
        return Err(setting(
            "hires-strength",
            format!("{} is not between 0 and 1", hires.strength),
        ));
    }
    let _span = tracing::info_span!("hires fix", w = hires.width, h = hires.height).entered();
    let first = p.txt2img(params, progress)?;
    let mut out = Vec::with_capacity(first.len());
    for (i, image) in first.iter().enumerate() {
        let up = hires_upscale(p, image, hires, params.vae_tiling)?;
        let second = Txt2Img {
            width: hires.width,
            height: hires.height,
            steps: if hires.steps == 0 {
                params.steps
            } else {
                hires.steps
            },
            seed: params.seed.wrapping_add(i as u64),
            batch: 1,
            ..params.clone()
        };
        out.extend(p.img2img(&second, &up, hires.strength, progress)?);
    }
    Ok(out)
}
