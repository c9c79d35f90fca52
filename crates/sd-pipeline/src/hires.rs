//! Hires fix: generate at the base size, upscale, then denoise again at the target size.
//!
//! The second pass is an img2img run ([`Pipeline::img2img`]) from the upscaled first-pass
//! image with `strength` (A1111's "denoising strength") and its own step count. The upscale
//! step is one of the upscalers A1111 and stable-diffusion.cpp name (`--hires-upscaler`):
//!
//! - [`HiresUpscaler::Latent`]: the first-pass image's latents (its VAE encoding: [`Pipeline`]
//!   hands images, not latents, between calls; A1111 resizes the sampler's latents) resized
//!   as torch `F.interpolate` does in one of A1111's modes ([`LatentResize`]), then decoded;
//! - [`HiresUpscaler::Lanczos`] / [`HiresUpscaler::Nearest`]: the decoded image resized as
//!   PIL's `LANCZOS` / `NEAREST` (A1111's upscalers of those names);
//! - [`HiresUpscaler::Bilinear`]: the decoded image resized bilinearly (torch, sd-rs's own);
//! - [`HiresUpscaler::Model`]: an upscaler model ([`crate::upscale`]) run through the
//!   pipeline's runtime (same device and `--max-vram` budget as the diffusion models), its
//!   output resized with Lanczos to the target size when the model's scale does not land on
//!   it (A1111 does the same).

use std::path::PathBuf;

use sd_tensor::host::ResampleFilter;
use sd_tensor::Image;

use crate::generate::{GenerateError, Pipeline, Txt2Img};
use crate::upscale::{upscale_image, RuntimeTiles, UpscaleOptions, UpscalerModel};

/// How latents are resized: A1111's `latent_upscale_modes`, each a torch `F.interpolate`
/// mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatentResize {
    /// "Latent": `bilinear`, no antialiasing.
    Bilinear,
    /// "Latent (antialiased)": `bilinear` with `antialias=True`.
    BilinearAntialiased,
    /// "Latent (bicubic)": `bicubic`, no antialiasing.
    Bicubic,
    /// "Latent (bicubic antialiased)": `bicubic` with `antialias=True`.
    BicubicAntialiased,
    /// "Latent (nearest)": `nearest`.
    Nearest,
    /// "Latent (nearest-exact)": `nearest-exact`.
    NearestExact,
}

impl LatentResize {
    /// Resizes `z` (`[N, C, H, W]` latents) to `h` x `w`.
    pub fn apply(
        self,
        z: &sd_tensor::Tensor<f32>,
        h: usize,
        w: usize,
    ) -> Result<sd_tensor::Tensor<f32>, sd_tensor::host::ShapeError> {
        match self {
            LatentResize::Bilinear => z.interpolate_bilinear(h, w, false),
            LatentResize::BilinearAntialiased => {
                z.interpolate_filtered(h, w, ResampleFilter::Triangle)
            }
            LatentResize::Bicubic => z.interpolate_bicubic(h, w, false),
            LatentResize::BicubicAntialiased => z.interpolate_filtered(h, w, ResampleFilter::Cubic),
            LatentResize::Nearest => z.interpolate_nearest(h, w),
            LatentResize::NearestExact => z.interpolate_nearest_exact(h, w),
        }
    }
}

/// How the first-pass image is brought to the target size.
#[derive(Clone, Debug, PartialEq)]
pub enum HiresUpscaler {
    /// The latents resized.
    Latent(LatentResize),
    /// PIL's Lanczos resize of the image.
    Lanczos,
    /// PIL's nearest-neighbour resize of the image.
    Nearest,
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

/// The built-in upscalers by the names A1111 and stable-diffusion.cpp give them.
const BUILTIN: [(&str, HiresUpscaler); 9] = [
    ("Latent", HiresUpscaler::Latent(LatentResize::Bilinear)),
    (
        "Latent (antialiased)",
        HiresUpscaler::Latent(LatentResize::BilinearAntialiased),
    ),
    (
        "Latent (bicubic)",
        HiresUpscaler::Latent(LatentResize::Bicubic),
    ),
    (
        "Latent (bicubic antialiased)",
        HiresUpscaler::Latent(LatentResize::BicubicAntialiased),
    ),
    (
        "Latent (nearest)",
        HiresUpscaler::Latent(LatentResize::Nearest),
    ),
    (
        "Latent (nearest-exact)",
        HiresUpscaler::Latent(LatentResize::NearestExact),
    ),
    ("Lanczos", HiresUpscaler::Lanczos),
    ("Nearest", HiresUpscaler::Nearest),
    ("Bilinear", HiresUpscaler::Bilinear),
];

impl HiresUpscaler {
    /// The built-in upscaler called `name` (A1111's and stable-diffusion.cpp's spelling,
    /// compared without case), or `None` for a model name.
    pub fn builtin(name: &str) -> Option<HiresUpscaler> {
        BUILTIN
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.trim()))
            .map(|(_, u)| u.clone())
    }

    /// The names [`HiresUpscaler::builtin`] knows.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        BUILTIN.iter().map(|(n, _)| *n)
    }
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
        HiresUpscaler::Lanczos => Ok(image.resize_filtered(w, h, ResampleFilter::Lanczos3)?),
        HiresUpscaler::Nearest => Ok(image.resize_nearest(w, h)?),
        HiresUpscaler::Latent(mode) => {
            let f = p.spec().first_stage.1.downsample_factor();
            if !w.is_multiple_of(f) || !h.is_multiple_of(f) {
                return Err(setting(
                    "hires-size",
                    format!("{w}x{h} is not a multiple of the VAE factor {f}"),
                ));
            }
            let z = p.encode(image, tiling)?;
            let z = mode.apply(&z, h / f, w / f)?;
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
            if (up.width(), up.height()) == (w, h) {
                Ok(up)
            } else {
                Ok(up.resize_filtered(w, h, ResampleFilter::Lanczos3)?)
            }
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
