//! Upscaling: `sd upscale` / `-M upscale` (an image file through an upscaler model) and
//! `--upscale-model` after generation. Both run the upscaler's tiles through a [`Runtime`],
//! so `--backend`, `--params-backend` and `--max-vram` apply.
//!
//! Flags (stable-diffusion.cpp's names): `--upscale-model PATH` (ESRGAN / Real-ESRGAN /
//! Compact / MoSR, `.pth` or `.safetensors`), `--upscale-repeats N` (default 1),
//! `--upscale-tile-size N` (input pixels per tile, default 128; 0: the whole image at once).

use std::path::Path;

use sd_formats::files::TensorCatalog;
use sd_pipeline::generate::Pipeline;
use sd_pipeline::runtime::{Runtime, RuntimeOptions};
use sd_pipeline::upscale::{upscale_image, RuntimeTiles, UpscaleOptions, UpscalerModel};
use sd_tensor::Image;

use crate::cli::{self, Cli};
use crate::progress::Progress;
use crate::{mem_available, output, Fail};

/// Largest output side (pixels) of an upscale.
const MAX_OUTPUT_SIDE: usize = 65536;

/// An upscaler added to a runtime, with the options of the command line.
pub struct Attached {
    model: UpscalerModel,
    opts: UpscaleOptions,
    name: String,
}

impl Attached {
    fn open(rt: &mut Runtime, path: &Path, cli: &Cli) -> Result<Attached, Fail> {
        let model =
            UpscalerModel::add(rt, path).map_err(|e| Fail::Run(format!("--upscale-model: {e}")))?;
        tracing::info!(
            path = %path.display(),
            arch = model.arch.id(),
            scale = model.arch.scale(),
            "upscaler"
        );
        Ok(Attached {
            model,
            opts: UpscaleOptions {
                tile_size: cli
                    .upscale_tile_size
                    .map_or(UpscaleOptions::default().tile_size, |t| t as usize),
                repeats: cli.upscale_repeats.map_or(1, |r| r as usize),
            },
            name: path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        })
    }

    /// Adds `path` to the pipeline's runtime (the same device and budget as the diffusion
    /// models); its weights are read when the first tile needs them.
    pub fn add(pipeline: &mut Pipeline, path: &Path, cli: &Cli) -> Result<Attached, Fail> {
        Attached::open(pipeline.runtime_mut(), path, cli)
    }

    /// The output size for a `w` x `h` input, refused when too large for memory.
    pub fn check_size(&self, w: usize, h: usize) -> Result<(usize, usize), Fail> {
        let factor = (self.model.arch.scale() as u128).pow(self.opts.repeats as u32);
        let (ow, oh) = (w as u128 * factor, h as u128 * factor);
        let too_big = |why: String| {
            Fail::Usage(format!(
                "--upscale-repeats {}: a {w}x{h} image would become {ow}x{oh}; {why}",
                self.opts.repeats
            ))
        };
        if ow > MAX_OUTPUT_SIDE as u128 || oh > MAX_OUTPUT_SIDE as u128 {
            return Err(too_big(format!("at most {MAX_OUTPUT_SIDE} pixels a side")));
        }
        // The output planes, their weights and the image (f32 x 3 planes x ~3 copies).
        let need = ow * oh * 3 * 4 * 3;
        if let Some(avail) = mem_available() {
            if need > avail as u128 {
                return Err(too_big(format!(
                    "that needs about {} MiB, {} MiB are available",
                    need >> 20,
                    avail >> 20
                )));
            }
        }
        Ok((ow as usize, oh as usize))
    }

    /// Upscales one image through `rt`, then releases the model's device memory.
    fn run(&self, rt: &mut Runtime, image: &Image) -> Result<Image, Fail> {
        let mut tiles = RuntimeTiles {
            rt: &mut *rt,
            model: &self.model,
        };
        let out = upscale_image(&mut tiles, image, &self.opts)
            .map_err(|e| Fail::Run(format!("upscaling failed: {e}")))?;
        rt.release(self.model.handle)
            .map_err(|e| Fail::Run(format!("upscaling failed: {e}")))?;
        Ok(out)
    }

    /// Upscales a generated image in the pipeline's runtime.
    pub fn upscale(&self, pipeline: &mut Pipeline, image: &Image) -> Result<Image, Fail> {
        let start = std::time::Instant::now();
        let out = self.run(pipeline.runtime_mut(), image)?;
        tracing::info!(
            "upscaled 1 image(s) with {} ({} x{}) in {:.1} s",
            self.name,
            self.model.arch.id(),
            self.model.arch.scale(),
            start.elapsed().as_secs_f64()
        );
        Ok(out)
    }

    /// Plans the upscaler's largest tile for a `w` x `h` image (over its repeats) without
    /// running it.
    pub fn plan(
        &self,
        pipeline: &mut Pipeline,
        w: usize,
        h: usize,
    ) -> Result<sd_pipeline::run_plan::ModelPlan, Fail> {
        let s = self.model.arch.scale();
        let (mut tile, mut runs) = ((0, 0), 0);
        let (mut iw, mut ih) = (w, h);
        for _ in 0..self.opts.repeats {
            let (tw, th, n) = self.model.tiles(iw, ih, self.opts.tile_size);
            if tw * th > tile.0 * tile.1 {
                tile = (tw, th);
            }
            runs += n;
            (iw, ih) = (iw * s, ih * s);
        }
        let rt = pipeline.runtime_mut();
        let planned = self.model.plan_tile(rt, tile.0, tile.1);
        sd_pipeline::run_plan::ModelPlan::new(
            format!("upscaler ({} x{})", self.model.arch.id(), s),
            format!("{}x{} px tiles", tile.0, tile.1),
            runs,
            (rt, self.model.handle),
            planned,
        )
        .map_err(|e| Fail::Run(format!("--upscale-model: {e}")))
    }

    /// `, Upscaler: NAME, Upscale repeats: N` for a PNG's `parameters` text.
    pub fn parameters_note(&self) -> String {
        format!(
            ", Upscaler: {}, Upscale repeats: {}",
            self.name, self.opts.repeats
        )
    }
}

/// Runs upscale mode: `-i` through `--upscale-model` to `-o`, keeping the input PNG's text
/// chunks (with the upscaler added to `parameters`).
pub fn run(cli: &Cli, threads: usize) -> Result<(), Fail> {
    let model_path = cli
        .upscale_model
        .as_deref()
        .ok_or_else(|| Fail::Usage("upscale mode needs --upscale-model".into()))?;
    let input_path = cli
        .init
        .as_deref()
        .ok_or_else(|| Fail::Usage("upscale mode needs -i/--init-img".into()))?;
    let place = cli::placement(cli).map_err(|e| Fail::Usage(format!("--backend: {e}")))?;
    if !place.split.is_empty() {
        return Err(Fail::Usage(
            "--backend: a layer split is for the diffusion model; upscale mode runs on one device"
                .into(),
        ));
    }
    let params =
        cli::params_location(cli).map_err(|e| Fail::Usage(format!("--params-backend: {e}")))?;
    let target = output::check(&cli.output, 1).map_err(|e| Fail::Usage(e.to_string()))?;
    let start = std::time::Instant::now();
    let loaded =
        crate::input::load(input_path).map_err(|e| Fail::Run(format!("-i/--init-img: {e}")))?;
    let options = RuntimeOptions {
        compute: place.compute,
        placement: place.placement,
        params,
        mmap: cli.mmap,
        max_vram: cli.max_vram.clone(),
        threads,
        exact: crate::cli::exact_from_env().map_err(Fail::Usage)?,
        host_kernels: crate::cli::host_kernels_from_env().map_err(Fail::Usage)?,
        f32_products: crate::cli::f32_products_from_env().map_err(Fail::Usage)?,
        ..RuntimeOptions::default()
    };
    let mut rt = Runtime::new(options, TensorCatalog::new())
        .map_err(|e| Fail::Run(format!("--backend: {e}")))?;
    let up = Attached::open(&mut rt, model_path, cli)?;
    let (w, h) = (loaded.image.width(), loaded.image.height());
    up.check_size(w, h)?;
    let mut progress = Progress::new();
    progress.phase("upscaling", "images");
    let out = up.run(&mut rt, &loaded.image)?;
    progress.update(1, 1);
    progress.finish();
    let mut text = loaded.text;
    let note = up.parameters_note();
    match text.iter_mut().find(|(k, _)| k == "parameters") {
        Some((_, v)) => v.push_str(&note),
        None => text.push(("parameters".into(), note.trim_start_matches(", ").into())),
    }
    let bytes = crate::encode::encode(&out, target.format(), &text)
        .map_err(|e| Fail::Run(format!("cannot encode {}: {e}", target.display(0))))?;
    output::write(&target, 0, &bytes).map_err(|e| Fail::Run(e.to_string()))?;
    let line = format!(
        "saved {} ({}x{}, {:.1} s)",
        target.display(0),
        out.width(),
        out.height(),
        start.elapsed().as_secs_f64()
    );
    if target == output::Target::Stdout {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    Ok(())
}
