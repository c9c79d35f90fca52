//! `sd`: the sd-rs command-line tool.
//!
//! Generates images from a prompt (and an init image) with an SD1.x / SD2.x checkpoint
//! (`-m MODEL -p PROMPT`), upscales images (`sd upscale`, `-M upscale`), lists the compute
//! devices ggml sees (`--list-devices`) and runs a tensor self-check (`--self-check`). Flag
//! names follow stable-diffusion.cpp's `sd-cli` ([`cli`]).
//!
//! Exit codes: 0 success; 1 a missing or corrupt model or image file, or a failed run; 2 bad
//! flags or values, answered before any work where they can be known.

mod cli;
mod devices;
mod input;
mod lora;
mod output;
mod progress;
mod upscale;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::CommandFactory;
use cli::{Cli, Mode};
use output::Target;
use progress::Progress;
use sd_pipeline::generate::{GenerateError, LoadOptions, Pipeline, Txt2Img};
use sd_pipeline::runtime::{ComputeDevice, RuntimeOptions};
use sd_pipeline::schedule::Scheduler;
use sd_pipeline::vae_tiling::VaeTiling;
use sd_tensor::ggml::{Backend, BufferType, Context, Gallocr, Graph};
use sd_tensor::{DType, Image};

/// Why a run stopped: a usage error (exit code 2) or a failure (exit code 1).
#[derive(Debug)]
pub enum Fail {
    /// Bad flags or values.
    Usage(String),
    /// A missing or corrupt file, or a failed run.
    Run(String),
}

impl Fail {
    fn code(&self) -> ExitCode {
        match self {
            Fail::Usage(_) => ExitCode::from(2),
            Fail::Run(_) => ExitCode::FAILURE,
        }
    }
}

fn main() -> ExitCode {
    devices::load_modules();
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.is_empty() {
        eprintln!(
            "{}\nRun 'sd --help' for every flag.",
            Cli::command().render_usage()
        );
        return ExitCode::from(2);
    }
    let cli = match cli::parse(args) {
        Ok(c) => c,
        Err(e) => return flag_error(e),
    };
    init_logging(cli.verbose);
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let (Fail::Usage(m) | Fail::Run(m)) = &f;
            eprintln!("error: {m}");
            f.code()
        }
    }
}

/// Prints a clap error as one line (plus clap's tip, if any, and a hint); exit code 2. Help
/// goes to stdout with exit code 0.
fn flag_error(e: clap::Error) -> ExitCode {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    if e.kind() == ErrorKind::UnknownArgument {
        if let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) {
            let flag = arg.split('=').next().unwrap_or(arg);
            if cli::UNSUPPORTED.iter().any(|(f, _)| *f == flag) {
                eprintln!(
                    "error: {flag}: a stable-diffusion.cpp flag that sd-rs does not support yet"
                );
                eprintln!("hint: 'sd --help' lists the flags sd-rs takes");
                return ExitCode::from(2);
            }
        }
    }
    let text = e.render().to_string();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or("error: bad command line");
    eprintln!("{first}");
    for l in lines {
        if let Some(tip) = l.trim().strip_prefix("tip:") {
            eprintln!("hint:{tip}");
        }
    }
    eprintln!("hint: 'sd --help' lists the flags");
    ExitCode::from(2)
}

/// Logs to stderr: warnings by default, `-v` info, `-vv` debug; `RUST_LOG` overrides.
fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

fn run(cli: &Cli) -> Result<(), Fail> {
    if cli.version {
        println!(
            "sd {} (ggml {})",
            env!("CARGO_PKG_VERSION"),
            sd_tensor::ggml::version()
        );
        return Ok(());
    }
    match cli.mode {
        Mode::ImgGen | Mode::Upscale => {}
        other => {
            let name = clap::ValueEnum::to_possible_value(&other)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default();
            return Err(Fail::Usage(format!(
                "-M/--mode {name}: not supported yet (img_gen, upscale)"
            )));
        }
    }
    if cli.upscale_model.is_none()
        && (cli.upscale_repeats.is_some() || cli.upscale_tile_size.is_some())
    {
        return Err(Fail::Usage(
            "--upscale-repeats and --upscale-tile-size need --upscale-model".into(),
        ));
    }
    let threads = cli::threads(cli.threads);
    if cli.list_devices {
        devices::list();
    }
    if cli.self_check {
        self_check(threads).map_err(|e| Fail::Run(format!("self-check failed: {e}")))?;
    }
    if cli.mode == Mode::Upscale {
        return upscale::run(cli, threads);
    }
    if cli.model.is_some() || cli.diffusion_model.is_some() {
        return generate(cli, threads);
    }
    if cli.list_devices || cli.self_check {
        return Ok(());
    }
    Err(Fail::Usage(
        "nothing to generate: give -m/--model (or --diffusion-model) and -p/--prompt".to_string(),
    ))
}

/// The command-line flag of a [`GenerateError::InvalidSetting`].
fn flag_name(setting: &str) -> &str {
    match setting {
        "width" => "-W/--width",
        "height" => "-H/--height",
        "steps" => "--steps",
        "cfg-scale" => "--cfg-scale",
        "batch-count" => "-b/--batch-count",
        "strength" => "--strength",
        "init-img" => "-i/--init-img",
        "clip-skip" => "--clip-skip",
        "model" => "-m/--model",
        other => other,
    }
}

/// A pipeline error: invalid settings are usage errors, the rest failures.
fn generate_fail(e: GenerateError) -> Fail {
    match &e {
        GenerateError::InvalidSetting { flag, message } => {
            Fail::Usage(format!("{}: {message}", flag_name(flag)))
        }
        _ => Fail::Run(e.to_string()),
    }
}

/// A seed for `-s` < 0 (stable-diffusion.cpp draws one in `[0, 2^31)`).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish() & 0x7fff_ffff
}

/// Prints an informational line on stdout, or on stderr when images go to stdout.
fn say(target: &Target, line: &str) {
    if *target == Target::Stdout {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// Bytes of host memory the kernel says are available (`MemAvailable`), if known.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses sizes whose largest buffers cannot fit in host memory when computing on the CPU:
/// the UNet's attention scores at the latent resolution (without flash attention) and the
/// VAE decoder's full-resolution activations (without tiling). Estimates for SD1.x widths
/// (8 heads, 128 decoder channels); a usage error naming -W/-H.
fn memory_preflight(
    downsample: usize,
    w: usize,
    h: usize,
    flash: bool,
    tiled: bool,
) -> Result<(), Fail> {
    let Some(avail) = mem_available() else {
        return Ok(());
    };
    let f = downsample.max(1) as f64;
    let tokens = (w as f64 / f) * (h as f64 / f);
    let attention = if flash {
        0.0
    } else {
        tokens * tokens * 8.0 * 2.0 * 4.0
    };
    let decode = if tiled {
        0.0
    } else {
        w as f64 * h as f64 * 128.0 * 4.0 * 3.0
    };
    let need = attention.max(decode);
    if need > avail as f64 {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        return Err(Fail::Usage(format!(
            "-W/--width, -H/--height: {w}x{h} needs about {:.1} GiB of memory on the CPU \
             ({} ), {:.1} GiB are available; use a smaller size{}{}",
            gib(need),
            if attention >= decode {
                "attention scores"
            } else {
                "VAE decode"
            },
            gib(avail as f64),
            if flash { "" } else { ", --diffusion-fa" },
            if tiled { "" } else { ", --vae-tiling" },
        )));
    }
    Ok(())
}

fn generate(cli: &Cli, threads: usize) -> Result<(), Fail> {
    // Everything that can be known from the command line, before any file is read.
    let prompt = cli
        .prompt
        .clone()
        .ok_or_else(|| Fail::Usage("a model needs -p/--prompt".into()))?;
    let (prompt, lora_tags) =
        lora::extract(&prompt).map_err(|e| Fail::Usage(format!("-p/--prompt: {e}")))?;
    let loras = match (&cli.lora_model_dir, lora_tags.is_empty()) {
        (_, true) => Vec::new(),
        (Some(dir), false) => lora::specs(dir, &lora_tags).map_err(Fail::Run)?,
        (None, false) => {
            return Err(Fail::Usage(
                "-p/--prompt: <lora:NAME:WEIGHT> tags need --lora-model-dir".into(),
            ))
        }
    };
    let files = cli::model_files(cli).map_err(Fail::Usage)?;
    let rng = cli::rng_kind(cli.rng).map_err(Fail::Usage)?;
    let place = cli::placement(cli).map_err(|e| Fail::Usage(format!("--backend: {e}")))?;
    let params_location =
        cli::params_location(cli).map_err(|e| Fail::Usage(format!("--params-backend: {e}")))?;
    if cli.strength.is_some() && cli.init.is_none() {
        return Err(Fail::Usage("--strength needs -i/--init-img".into()));
    }
    let batch = cli.batch as usize;
    let target = output::check(&cli.output, batch).map_err(|e| Fail::Usage(e.to_string()))?;
    let seed = if cli.seed < 0 {
        let s = random_seed();
        say(&target, &format!("seed: {s} (random)"));
        s
    } else {
        cli.seed as u64
    };
    let init = match &cli.init {
        Some(path) => Some(
            input::load(path)
                .map_err(|e| Fail::Run(format!("-i/--init-img: {e}")))?
                .image
                .to_rgb(),
        ),
        None => None,
    };
    let flash = cli.diffusion_fa || cli.fa;
    let mut runtime = RuntimeOptions {
        compute: place.compute,
        split: place.split,
        params: params_location,
        mmap: cli.mmap,
        max_vram: cli.max_vram.clone(),
        threads,
        weight_type: cli.weight_type,
        ..RuntimeOptions::default()
    };
    runtime.compute_options.flash_attn = flash;
    let on_cpu = matches!(runtime.compute, ComputeDevice::Cpu);
    if cli.max_vram.is_some() && on_cpu {
        tracing::warn!("--max-vram budgets a GPU (--backend); the CPU backend ignores it");
    }

    let mut progress = Progress::new();
    progress.phase("loading", "tensors");
    let mut pipeline = Pipeline::open(
        &files,
        LoadOptions {
            runtime,
            clip_skip: cli.clip_skip.filter(|n| *n > 0).map(|n| n as usize),
            prediction: cli.prediction,
        },
    )
    .map_err(generate_fail)?;
    if !loras.is_empty() {
        for l in &loras {
            tracing::info!(path = %l.path.display(), multiplier = l.multiplier, "LoRA");
        }
        pipeline
            .runtime_mut()
            .set_loras(loras)
            .map_err(|e| Fail::Run(format!("LoRA: {e}")))?;
    }
    let spec = pipeline.spec().clone();
    let defaults = spec.defaults;
    let (native_w, native_h) = init
        .as_ref()
        .map(|i| (i.width(), i.height()))
        .unwrap_or((defaults.width, defaults.height));
    let width = cli.width.map_or(native_w, |w| w as usize);
    let height = cli.height.map_or(native_h, |h| h as usize);
    let multiple = spec.size_multiple();
    for (flag, v) in [("-W/--width", width), ("-H/--height", height)] {
        if v % multiple != 0 {
            return Err(Fail::Usage(format!(
                "{flag}: {v} is not a multiple of {multiple} (this model's size step)"
            )));
        }
    }
    if on_cpu {
        memory_preflight(
            spec.first_stage.1.downsample_factor(),
            width,
            height,
            flash,
            cli.vae_tiling,
        )?;
    }
    // A bad upscaler is known before the steps.
    let upscaler = match &cli.upscale_model {
        Some(path) => Some(
            upscale::Attached::add(&mut pipeline, path, cli)
                .and_then(|u| u.check_size(width, height).map(|_| u))?,
        ),
        None => None,
    };
    let init = match init {
        Some(img) if (img.width(), img.height()) != (width, height) => {
            eprintln!(
                "notice: the init image is {}x{}; resized to {width}x{height}",
                img.width(),
                img.height()
            );
            Some(
                img.resize_bilinear(width, height)
                    .map_err(|e| Fail::Run(format!("-i/--init-img: {e}")))?,
            )
        }
        other => other,
    };
    pipeline
        .preload(&mut |d, t| progress.update(d, t))
        .map_err(generate_fail)?;
    let sampler = cli.sampler.unwrap_or(defaults.sampler);
    let params = Txt2Img {
        prompt,
        negative: cli.negative.clone(),
        width,
        height,
        steps: cli.steps as usize,
        cfg_scale: cli.cfg_scale.unwrap_or(defaults.cfg_scale),
        seed,
        sampler,
        // `ays` takes the family's table, known only now.
        scheduler: match cli.scheduler {
            Some(s) => Scheduler::from_name(s.name(), defaults.ays).unwrap_or(s),
            None => defaults
                .scheduler
                .unwrap_or_else(|| sampler.default_scheduler()),
        },
        threads,
        batch: 1,
        rng,
        vae_tiling: cli.vae_tiling.then(VaeTiling::default),
    };
    let name = if spec.name.is_empty() {
        files
            .primary()
            .and_then(|m| m.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        spec.name.clone()
    };
    let strength = cli.strength.unwrap_or(0.75);
    // One image at a time, each saved as soon as it is decoded (image i uses seed + i).
    for i in 0..batch {
        let one = Txt2Img {
            seed: seed.wrapping_add(i as u64),
            ..params.clone()
        };
        let label = if batch > 1 {
            format!("image {}/{batch}", i + 1)
        } else {
            "sampling".to_string()
        };
        progress.phase(label, "steps");
        let mut last = (0, 0);
        let mut step = |s: usize, t: usize| {
            last = (s, t);
            progress.update(s.saturating_sub(1), t);
        };
        let result = match &init {
            Some(img) => pipeline.img2img(&one, img, strength, &mut step),
            None => pipeline.txt2img(&one, &mut step),
        };
        let mut images = match result {
            Ok(v) => v,
            Err(e) => {
                progress.abandon();
                return Err(generate_fail(e));
            }
        };
        progress.update(last.1, last.1);
        progress.finish();
        let Some(mut image) = images.pop() else {
            return Err(Fail::Run("no image was generated".into()));
        };
        if let Some(up) = &upscaler {
            progress.phase("upscaling", "images");
            image = up.upscale(&mut pipeline, &image)?;
            progress.update(1, 1);
            progress.finish();
        }
        let mut text = parameters_text(&one, &name);
        if init.is_some() {
            text.push_str(&format!(", Denoising strength: {strength}"));
        }
        if let Some(up) = &upscaler {
            text.push_str(&up.parameters_note());
        }
        save(&target, i, &image, text)?;
        say(
            &target,
            &format!(
                "saved {} ({}x{}, {} steps, seed {}, {:.1} s)",
                target.display(i),
                image.width(),
                image.height(),
                params.steps,
                one.seed,
                progress.elapsed()
            ),
        );
    }
    if cli.verbose > 0 {
        report_memory(&pipeline);
    }
    Ok(())
}

/// Encodes `image` as PNG with a `parameters` text and writes it as image `i` of `target`.
pub fn save(target: &Target, i: usize, image: &Image, text: String) -> Result<(), Fail> {
    let bytes = image
        .encode_png(&[("parameters".to_string(), text)])
        .map_err(|e| Fail::Run(format!("cannot encode {}: {e}", target.display(i))))?;
    output::write(target, i, &bytes).map_err(|e| Fail::Run(e.to_string()))
}

/// Prints (with `-v`) how each model ran last and the simulated device's peak.
fn report_memory(p: &Pipeline) {
    let rt = p.runtime();
    let h = p.handles();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    if let Some(b) = rt.budget() {
        eprintln!(
            "budget on {}: {:.1} MiB",
            rt.compute_backend().name(),
            mib(b)
        );
    }
    for m in [h.text_encoder, h.unet, h.vae] {
        let r = rt.last_segments(m);
        let peak = r.iter().map(|s| s.footprint()).max().unwrap_or(0);
        let devices = r.iter().map(|s| s.device).max().unwrap_or(0) + 1;
        let split = if devices > 1 {
            let per: Vec<String> = (0..devices)
                .map(|d| r.iter().filter(|s| s.device == d).count().to_string())
                .collect();
            let copied: u64 = r.iter().map(|s| s.copied_bytes).sum();
            format!(
                ", layer split {} per device, {:.2} MiB copied between devices",
                per.join("+"),
                mib(copied)
            )
        } else {
            String::new()
        };
        eprintln!(
            "{}: {} segment(s) in its last run, largest footprint {:.1} MiB{split}",
            rt.model_name(m).unwrap_or("?"),
            r.len(),
            mib(peak)
        );
    }
    if let Some(sim) = rt.sim_device() {
        eprintln!("simulated device peak: {:.2} MiB", mib(sim.peak_bytes()));
    }
    for (i, sim) in rt.split_sim_devices().iter().enumerate() {
        eprintln!(
            "simulated split device SIM{} peak: {:.2} MiB",
            i + 1,
            mib(sim.peak_bytes())
        );
    }
}

/// The A1111-style `parameters` text of a PNG.
fn parameters_text(p: &Txt2Img, model: &str) -> String {
    let mut s = p.prompt.clone();
    if !p.negative.is_empty() {
        s.push_str(&format!("\nNegative prompt: {}", p.negative));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model: {model}",
        p.steps,
        p.sampler.name(),
        p.cfg_scale,
        p.seed,
        p.width,
        p.height
    ));
    if p.scheduler != p.sampler.default_scheduler() {
        s.push_str(&format!(", Schedule type: {}", p.scheduler.name()));
    }
    s
}

/// Multiplies two small matrices on the CPU backend and checks the result.
fn self_check(threads: usize) -> Result<(), sd_tensor::GgmlError> {
    let ctx = Context::new_descriptors(8, 8, 1)?;
    let a = ctx.new_tensor(DType::F32, &[16, 8])?;
    let b = ctx.new_tensor(DType::F32, &[16, 4])?;
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx)?;
    let av: Vec<f32> = (0..128).map(|i| (i % 7) as f32).collect();
    let bv: Vec<f32> = (0..64).map(|i| (i % 5) as f32).collect();
    a.write_f32(&av)?;
    b.write_f32(&bv)?;
    let c = ctx.mul_mat(&a, &b)?;
    c.set_output();
    let mut g = Graph::new(&ctx, 8)?;
    g.build_forward_expand(&c)?;
    let backend = Backend::cpu(threads)?;
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&g)?;
    backend.compute(&g)?;
    let got = c.read_f32()?;
    for j in 0..4 {
        for i in 0..8 {
            let want: f32 = (0..16).map(|k| av[i * 16 + k] * bv[j * 16 + k]).sum();
            if (got[j * 8 + i] - want).abs() > 1e-4 {
                return Err(sd_tensor::GgmlError::Mismatch(format!(
                    "c[{j},{i}] = {} != {want}",
                    got[j * 8 + i]
                )));
            }
        }
    }
    println!(
        "self-check: 8x16 @ 16x4 matmul on {} ({} threads) ok",
        backend.name(),
        threads
    );
    Ok(())
}
