//! `sd upscale` (or `-M upscale`): upscales a PNG with an upscaler model, and the
//! `--upscale-model` flags that upscale a generated image after generation.
//!
//! Flags (stable-diffusion.cpp's names): `--upscale-model PATH` (ESRGAN / Real-ESRGAN /
//! Compact / MoSR, `.pth` or `.safetensors`), `--upscale-repeats N` (default 1),
//! `--upscale-tile-size N` (input pixels per tile, default 128; 0: the whole image at once);
//! in upscale mode also `-i/--init-img INPUT.png`, `-o/--output OUTPUT.png` (default
//! `output.png`), `-t/--threads N`, `-v`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sd_pipeline::generate::Pipeline;
use sd_pipeline::upscale::{
    upscale_image, CpuUpscaler, RuntimeTiles, TileExecutor, UpscaleOptions, UpscalerModel,
};
use sd_tensor::Image;

/// Usage lines of the upscale flags.
pub const USAGE: &str = "
upscaling:
  sd upscale --upscale-model MODEL -i INPUT.png [-o OUTPUT.png] [--upscale-repeats N]
     [--upscale-tile-size N] [-t THREADS] [-v]      (also -M upscale)
  --upscale-model PATH        ESRGAN / Real-ESRGAN / Compact / MoSR model (.pth, .safetensors);
                              with -m/-p it upscales the generated images, in the same
                              runtime and --max-vram budget as the diffusion models
  --upscale-repeats N         apply the model N times (default 1)
  --upscale-tile-size N       tile size in input pixels (default 128; 0: whole image)";

/// The upscale flags found on a command line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UpscaleArgs {
    /// `sd upscale` / `-M upscale`.
    pub mode: bool,
    /// `--upscale-model`.
    pub model: Option<PathBuf>,
    /// `--upscale-repeats`.
    pub repeats: Option<usize>,
    /// `--upscale-tile-size`.
    pub tile_size: Option<usize>,
    /// `-i/--init-img` (upscale mode).
    pub input: Option<PathBuf>,
    /// `-o/--output` (upscale mode).
    pub output: Option<PathBuf>,
    /// `-t/--threads` (upscale mode).
    pub threads: Option<usize>,
    /// `-v` (upscale mode).
    pub verbose: bool,
}

impl UpscaleArgs {
    /// The upscaling options of these flags.
    pub fn options(&self) -> UpscaleOptions {
        let d = UpscaleOptions::default();
        UpscaleOptions {
            tile_size: self.tile_size.unwrap_or(d.tile_size),
            repeats: self.repeats.unwrap_or(d.repeats),
        }
    }
}

fn value<'a>(args: &'a [String], i: usize, flag: &str) -> Result<&'a str, String> {
    args.get(i + 1)
        .map(String::as_str)
        .ok_or_else(|| format!("{flag} needs a value"))
}

fn count(text: &str, flag: &str, min: usize) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("{flag} needs an integer >= {min}, got '{text}'")),
    }
}

/// Takes the upscale flags out of `args`. In upscale mode (`upscale` first, or `-M/--mode
/// upscale`) every flag is read here and nothing is returned for the generation parser;
/// otherwise the remaining arguments are returned. Errors are usage errors (exit code 2).
pub fn take_flags(args: &[String]) -> Result<(Vec<String>, UpscaleArgs), String> {
    let mut up = UpscaleArgs::default();
    let mut rest = Vec::with_capacity(args.len());
    let mut i = 0;
    up.mode = args.first().is_some_and(|a| a == "upscale")
        || args
            .windows(2)
            .any(|w| matches!(w[0].as_str(), "-M" | "--mode") && w[1] == "upscale");
    if args.first().is_some_and(|a| a == "upscale") {
        i = 1;
    }
    while i < args.len() {
        let flag = args[i].as_str();
        let mut takes_value = true;
        match flag {
            "--upscale-model" => up.model = Some(value(args, i, flag)?.into()),
            "--upscale-repeats" => up.repeats = Some(count(value(args, i, flag)?, flag, 1)?),
            "--upscale-tile-size" => up.tile_size = Some(count(value(args, i, flag)?, flag, 0)?),
            "-M" | "--mode" if up.mode => {
                let v = value(args, i, "-M/--mode")?;
                if v != "upscale" {
                    return Err(format!("-M/--mode: unknown mode '{v}'"));
                }
            }
            "-i" | "--init-img" if up.mode => {
                up.input = Some(value(args, i, "-i/--init-img")?.into())
            }
            "-o" | "--output" if up.mode => up.output = Some(value(args, i, "-o/--output")?.into()),
            "-t" | "--threads" if up.mode => {
                up.threads = Some(count(value(args, i, "-t/--threads")?, "-t/--threads", 1)?)
            }
            "-v" | "--verbose" if up.mode => {
                up.verbose = true;
                takes_value = false;
            }
            other if up.mode => {
                return Err(format!("unknown argument '{other}' in upscale mode"));
            }
            _ => {
                rest.push(args[i].clone());
                takes_value = false;
            }
        }
        i += if takes_value { 2 } else { 1 };
    }
    if up.mode {
        if up.model.is_none() {
            return Err("upscale mode needs --upscale-model".into());
        }
        if up.input.is_none() {
            return Err("upscale mode needs -i/--init-img".into());
        }
    } else if up.model.is_none() && (up.repeats.is_some() || up.tile_size.is_some()) {
        return Err("--upscale-repeats and --upscale-tile-size need --upscale-model".into());
    }
    Ok((rest, up))
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Upscales `input` to `output` (keeping the PNG's text chunks, with the upscaler added to
/// `parameters`).
fn upscale_file(
    up: &UpscaleArgs,
    input: &Path,
    output: &Path,
    threads: usize,
) -> Result<(usize, usize), String> {
    let model = up.model.as_deref().unwrap_or(Path::new(""));
    let (image, mut text) = Image::load_png_with_text(input)
        .map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    let mut exec = CpuUpscaler::open(model, threads).map_err(|e| e.to_string())?;
    if up.verbose {
        let arch = exec.arch();
        eprintln!(
            "upscaler {}: {} x{} ({:?})",
            model.display(),
            arch.id(),
            arch.scale(),
            arch.tags()
        );
    }
    let opts = up.options();
    let out = upscale_image(&mut exec, &image, &opts).map_err(|e| e.to_string())?;
    let note = parameters_note(up);
    match text.iter_mut().find(|(k, _)| k == "parameters") {
        Some((_, v)) => v.push_str(&note),
        None => text.push(("parameters".into(), note.trim_start_matches(", ").into())),
    }
    out.save_png(output, &text)
        .map_err(|e| format!("cannot write {}: {e}", output.display()))?;
    Ok((out.width(), out.height()))
}

/// Runs upscale mode.
pub fn run(up: &UpscaleArgs) -> ExitCode {
    let threads = up.threads.unwrap_or_else(default_threads);
    let input = up.input.clone().unwrap_or_default();
    let output = up.output.clone().unwrap_or_else(|| "output.png".into());
    let start = std::time::Instant::now();
    match upscale_file(up, &input, &output, threads) {
        Ok((w, h)) => {
            println!(
                "saved {} ({w}x{h}, {:.1} s)",
                output.display(),
                start.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `, Upscaler: NAME, Upscale repeats: N` for a PNG's `parameters` text (empty without
/// `--upscale-model`).
pub fn parameters_note(up: &UpscaleArgs) -> String {
    let Some(model) = &up.model else {
        return String::new();
    };
    let name = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(
        ", Upscaler: {name}, Upscale repeats: {}",
        up.options().repeats
    )
}

/// Upscales generated images with `--upscale-model` through the pipeline's runtime (the
/// upscaler shares the diffusion models' device and budget). Without the flag the images
/// are returned as they are. On failure the error is printed and the exit code returned.
pub fn after_generation(
    up: &UpscaleArgs,
    pipeline: &mut Pipeline,
    images: Vec<Image>,
    verbose: bool,
) -> Result<Vec<Image>, ExitCode> {
    let Some(path) = &up.model else {
        return Ok(images);
    };
    let fail = |e: String| {
        eprintln!("error: {e}");
        ExitCode::FAILURE
    };
    let start = std::time::Instant::now();
    let rt = pipeline.runtime_mut();
    let model = UpscalerModel::add(rt, path).map_err(|e| fail(e.to_string()))?;
    let opts = up.options();
    let mut out = Vec::with_capacity(images.len());
    for image in &images {
        let mut tiles = RuntimeTiles {
            rt: &mut *rt,
            model: &model,
        };
        out.push(upscale_image(&mut tiles, image, &opts).map_err(|e| fail(e.to_string()))?);
    }
    rt.release(model.handle).map_err(|e| fail(e.to_string()))?;
    if verbose {
        eprintln!(
            "upscaled {} image(s) with {} ({} x{}) in {:.1} s",
            out.len(),
            path.display(),
            model.arch.id(),
            model.arch.scale(),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(out)
}
