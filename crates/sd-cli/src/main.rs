//! `sd`: the sd-rs command-line tool.
//!
//! Generates images from a prompt (and an init image) with an SD1.x / SD2.x checkpoint
//! (`-m MODEL -p PROMPT`), upscales images (`sd upscale`, `-M upscale`), prints the memory
//! plan of a generation without running it (`sd plan`, `-M plan`, [`plan`]), lists the compute
//! devices ggml sees (`--list-devices`) and runs a tensor self-check (`--self-check`). Flag
//! names follow stable-diffusion.cpp's `sd-cli` ([`cli`]).
//!
//! Exit codes: 0 success; 1 a missing or corrupt model or image file, or a failed run; 2 bad
//! flags or values, answered before any work where they can be known.

mod cli;
mod devices;
mod encode;
mod input;
mod lora;
mod output;
mod plan;
mod progress;
mod upscale;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::CommandFactory;
use cli::{Cli, Mode};
use output::Target;
use progress::Progress;
use sd_pipeline::generate::{GenerateError, LoadOptions, ModelFiles, Pipeline, Txt2Img};
use sd_pipeline::hires::hires_upscale;
use sd_pipeline::params::SkipLayerGuidance;
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
        Mode::ImgGen | Mode::Upscale | Mode::Plan => {}
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
    if cli.mode == Mode::Plan {
        return Err(Fail::Usage(
            "plan mode needs -m/--model (or --diffusion-model)".into(),
        ));
    }
    if cli.json {
        return Err(Fail::Usage("--json is for plan mode (sd plan ...)".into()));
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
        "refiner" => "--refiner",
        "refiner-start" => "--refiner-start",
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

/// Where the memory preflight looks for a model: host memory when the model computes on
/// the CPU, else its device.
struct MemoryLimit {
    /// Bytes available to the largest buffers (`MemAvailable`, or the device's free memory
    /// within the `--max-vram` budget).
    available: u64,
    /// Where, for messages (`the CPU`, `SIM0`, `CUDA0`).
    place: String,
    /// Whether the model computes on the CPU (the VAE decode's activations are in host
    /// memory; on a device the preflight tiles a decode that does not fit).
    cpu: bool,
}

impl MemoryLimit {
    /// The limit of the device model `h` of `pipeline` computes on, if known.
    fn of(pipeline: &Pipeline, h: sd_pipeline::runtime::ModelHandle) -> Option<MemoryLimit> {
        let rt = pipeline.runtime();
        let backend = rt.model_backend(h)?;
        if backend.is_cpu() {
            return Some(MemoryLimit {
                available: mem_available()?,
                place: "the CPU".into(),
                cpu: true,
            });
        }
        let device = backend.device()?;
        let free = device.memory().free;
        let available = match rt.model_budget(h) {
            Some(b) => b.min(free),
            None => free,
        };
        let place = match rt.model_budget(h) {
            Some(b) if b < free => format!("{} within its --max-vram budget", device.name()),
            _ => device.name().to_string(),
        };
        (available > 0).then_some(MemoryLimit {
            available,
            place,
            cpu: false,
        })
    }
}

/// Bytes of the UNet's largest attention-score tensor (f32, CFG batch of 2) for `lw` x
/// `lh` latents: at the finest level with attention, `heads x tokens x tokens` per image.
fn attention_scores_bytes(ucfg: &sd_models::unet::UnetConfig, lw: usize, lh: usize) -> f64 {
    let mut worst = 0.0f64;
    for (level, mult) in ucfg.channel_mult.iter().enumerate() {
        let ds = 1usize << level;
        if !ucfg.attention_resolutions.contains(&ds) {
            continue;
        }
        let heads = ucfg
            .heads
            .split(ucfg.model_channels * mult)
            .map_or(8, |(h, _)| h);
        let tokens = (lw as f64 / ds as f64).ceil() * (lh as f64 / ds as f64).ceil();
        worst = worst.max(tokens * tokens * heads as f64 * 2.0 * 4.0);
    }
    worst
}

/// Refuses sizes whose largest buffers cannot fit, before any weight is read: the UNet's
/// attention scores without flash attention (one tensor: no cut splits it), on the
/// diffusion model's device (`limit`), and the VAE decoder's full-resolution activations
/// without tiling when the VAE computes on the CPU (`vae`; a device's decode is tiled by
/// the preflight when it does not fit whole); the decoded image's planes always need host
/// memory. The decoder estimate is for SD's 128 channels at full resolution; a usage error
/// naming -W/-H.
fn memory_preflight(
    limit: &MemoryLimit,
    vae: Option<&MemoryLimit>,
    spec: &sd_pipeline::family::ModelSpec,
    w: usize,
    h: usize,
    flash: bool,
    tiled: bool,
) -> Result<(), Fail> {
    let f = spec.first_stage.1.downsample_factor().max(1);
    // Sizes in GiB, or MiB below 1 GiB (a small --max-vram must not read "0.0 GiB").
    let size = |b: f64| {
        if b >= (1u64 << 30) as f64 {
            format!("{:.1} GiB", b / (1u64 << 30) as f64)
        } else {
            format!("{:.1} MiB", b / (1u64 << 20) as f64)
        }
    };
    let too_big = |need: f64, what: &str, avail: f64, place: &str, hints: &str| {
        Fail::Usage(format!(
            "-W/--width, -H/--height: {w}x{h} needs about {} of memory on {place} \
             ({what}), {} are available; use a smaller size{hints}",
            size(need),
            size(avail),
        ))
    };
    let attention = match &spec.diffusion.1 {
        sd_models::diffusion::DiffusionArch::Unet(ucfg) if !flash => {
            attention_scores_bytes(ucfg, w / f, h / f)
        }
        // FLUX's joint attention: heads x (text + image tokens)^2 f32 scores, batch 1
        // (its guidance is distilled) over 512 T5 tokens.
        sd_models::diffusion::DiffusionArch::Flux(fc) if !flash => {
            let n = (w / f / 2) as f64 * (h / f / 2) as f64 + 512.0;
            fc.num_heads as f64 * n * n * 4.0
        }
        // SD3's joint attention over 2x2 patches and 333 text tokens, cond and uncond.
        sd_models::diffusion::DiffusionArch::Mmdit(mc) if !flash => {
            let n = (w / f / mc.patch_size) as f64 * (h / f / mc.patch_size) as f64 + 333.0;
            2.0 * mc.num_heads as f64 * n * n * 4.0
        }
        _ => 0.0,
    };
    let vae_on_cpu = vae.is_some_and(|v| v.cpu);
    let decode = if tiled || !vae_on_cpu {
        0.0
    } else {
        w as f64 * h as f64 * 128.0 * 4.0 * 3.0
    };
    let hints = if flash { "" } else { ", --diffusion-fa" };
    if attention > limit.available as f64 {
        return Err(too_big(
            attention,
            "attention scores",
            limit.available as f64,
            &limit.place,
            hints,
        ));
    }
    if let Some(v) = vae.filter(|v| decode > v.available as f64) {
        return Err(too_big(
            decode,
            "VAE decode",
            v.available as f64,
            &v.place,
            ", --vae-tiling",
        ));
    }
    // The decoded image in host memory: f32 planes and their copy.
    if !vae_on_cpu {
        if let Some(avail) = mem_available() {
            let planes = w as f64 * h as f64 * 3.0 * 4.0 * 2.0;
            if planes > avail as f64 {
                return Err(too_big(
                    planes,
                    "the decoded image",
                    avail as f64,
                    "the host",
                    "",
                ));
            }
        }
    }
    Ok(())
}

fn generate(cli: &Cli, threads: usize) -> Result<(), Fail> {
    // Everything that can be known from the command line, before any file is read.
    let planning = cli.mode == Mode::Plan;
    if cli.json && !planning {
        return Err(Fail::Usage("--json is for plan mode (sd plan ...)".into()));
    }
    // A plan does not need the prompt (the text encoders run on their full token count).
    let prompt = match (&cli.prompt, planning) {
        (Some(p), _) => p.clone(),
        (None, true) => String::new(),
        (None, false) => return Err(Fail::Usage("a model needs -p/--prompt".into())),
    };
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
    // A plan writes nothing: its output goes to stdout.
    let target = if planning {
        Target::Stdout
    } else {
        output::check(&cli.output, batch).map_err(|e| Fail::Usage(e.to_string()))?
    };
    let seed = if cli.seed < 0 && !planning {
        let s = random_seed();
        say(&target, &format!("seed: {s} (random)"));
        s
    } else {
        cli.seed.max(0) as u64
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
        placement: place.placement,
        params: params_location,
        mmap: cli.mmap,
        max_vram: cli.max_vram.clone(),
        threads,
        weight_type: cli.weight_type,
        ..RuntimeOptions::default()
    };
    runtime.compute_options.flash_attn = flash;
    runtime.exact = cli::exact_from_env().map_err(Fail::Usage)?;
    runtime.host_kernels = cli::host_kernels_from_env().map_err(Fail::Usage)?;
    runtime.f32_products = cli::f32_products_from_env().map_err(Fail::Usage)?;
    if !cli::bands_from_env().map_err(Fail::Usage)? {
        runtime.band_divisor = None;
    }
    let on_cpu = matches!(runtime.compute, ComputeDevice::Cpu);
    if cli.max_vram.is_some() && on_cpu {
        tracing::warn!("--max-vram budgets a GPU (--backend); the CPU backend ignores it");
    }
    if on_cpu && cli.weight_type.is_none() && sd_tensor::ggml::cpu_amx_bf16() {
        tracing::info!(
            "this CPU has AMX-BF16 tiles: with f16 or f32 weights, `--type bf16` runs the \
             UNet step about 2x faster and a DiT step about 3x, at bf16's precision \
             (`--type q8_0` uses the tiles too, in half the memory)"
        );
    } else if on_cpu && cli.weight_type.is_none() && devices::cpu_has_bf16_products() {
        tracing::info!(
            "this CPU has bf16 dot products (AVX512_BF16): with f16 or f32 weights, \
             `--type bf16` computes about 1.3-1.45x faster, at bf16's precision"
        );
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
    match (&cli.refiner, cli.refiner_start) {
        (Some(path), start) => {
            progress.phase("loading", "refiner");
            pipeline
                .add_refiner(&ModelFiles::single(path), start.unwrap_or(0.8))
                .map_err(generate_fail)?;
        }
        (None, Some(_)) => {
            return Err(Fail::Usage("--refiner-start needs --refiner".into()));
        }
        (None, None) => {}
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
    let hires = cli::hires_fix(cli, width, height, multiple).map_err(Fail::Usage)?;
    if !planning {
        let models = pipeline.handles();
        if let Some(limit) = MemoryLimit::of(&pipeline, models.unet) {
            let vae = MemoryLimit::of(&pipeline, models.vae);
            let mut sizes = vec![(width, height)];
            sizes.extend(hires.as_ref().map(|h| (h.width, h.height)));
            for (w, h) in sizes {
                memory_preflight(
                    &limit,
                    vae.as_ref(),
                    &spec,
                    w,
                    h,
                    flash || pipeline.runtime().flash_attention(),
                    cli.vae_tiling,
                )?;
            }
        }
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
    let sampler = cli.sampler.unwrap_or(defaults.sampler);
    let slg = match cli.slg_scale {
        Some(scale) if scale != 0.0 => {
            let d = SkipLayerGuidance::default();
            Some(SkipLayerGuidance {
                scale,
                layers: cli.skip_layers.clone().map_or(d.layers, |l| l.0),
                start: cli.skip_layer_start.unwrap_or(d.start),
                end: cli.skip_layer_end.unwrap_or(d.end),
            })
        }
        _ => {
            if cli.skip_layers.is_some()
                || cli.skip_layer_start.is_some()
                || cli.skip_layer_end.is_some()
            {
                return Err(Fail::Usage(
                    "--skip-layers, --skip-layer-start and --skip-layer-end need --slg-scale"
                        .into(),
                ));
            }
            None
        }
    };
    let params = Txt2Img {
        prompt,
        negative: cli.negative.clone(),
        width,
        height,
        steps: cli.steps.map_or(defaults.steps, |s| s as usize),
        cfg_scale: cli.cfg_scale.unwrap_or(defaults.cfg_scale),
        guidance: cli.guidance.unwrap_or(3.5),
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
        slg,
        flow_shift: cli.flow_shift,
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
    if planning {
        progress.finish();
        return print_plan(
            cli,
            &mut pipeline,
            &params,
            init.as_ref(),
            upscaler.as_ref(),
        );
    }
    pipeline
        .preload(&mut |d, t| progress.update(d, t))
        .map_err(generate_fail)?;
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
        if let Some(hf) = &hires {
            progress.phase("hires fix", "steps");
            let up =
                hires_upscale(&mut pipeline, &image, hf, one.vae_tiling).map_err(generate_fail)?;
            let second = Txt2Img {
                width: hf.width,
                height: hf.height,
                steps: if hf.steps == 0 { one.steps } else { hf.steps },
                ..one.clone()
            };
            let mut last2 = (0, 0);
            let mut step2 = |s: usize, t: usize| {
                last2 = (s, t);
                progress.update(s.saturating_sub(1), t);
            };
            let result = pipeline.img2img(&second, &up, hf.strength, &mut step2);
            image = match result.map(|mut v| v.pop()) {
                Ok(Some(img)) => img,
                Ok(None) => return Err(Fail::Run("the hires pass made no image".into())),
                Err(e) => {
                    progress.abandon();
                    return Err(generate_fail(e));
                }
            };
            progress.update(last2.1, last2.1);
            progress.finish();
        }
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
        if let Some(hf) = &hires {
            text.push_str(&format!(
                ", Hires resize: {}x{}, Hires steps: {}, Hires upscaler: {}, Hires denoising \
                 strength: {}",
                hf.width,
                hf.height,
                if hf.steps == 0 { one.steps } else { hf.steps },
                cli.hires_upscaler.as_deref().unwrap_or("Latent"),
                hf.strength
            ));
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

/// Plans the run of `params` (and the upscaler's tiles) and prints the plan (see [`plan`]).
fn print_plan(
    cli: &Cli,
    pipeline: &mut Pipeline,
    params: &Txt2Img,
    init: Option<&Image>,
    upscaler: Option<&upscale::Attached>,
) -> Result<(), Fail> {
    let mut models = pipeline.plan_run(params, init).map_err(generate_fail)?;
    if let Some(up) = upscaler {
        models.push(up.plan(pipeline, params.width, params.height)?);
    }
    let report = plan::Report {
        width: params.width,
        height: params.height,
        steps: params.steps,
        cfg_scale: params.cfg_scale,
        batch: cli.batch as usize,
        ..plan::Report::new(pipeline.runtime(), models)
    };
    if cli.json {
        println!("{:#}", report.json());
    } else {
        print!("{}", report.table());
    }
    if report.fits() {
        Ok(())
    } else {
        Err(Fail::Run(
            "the run does not fit the budget (see the plan above)".into(),
        ))
    }
}

/// Encodes `image` in `target`'s format with a `parameters` text and writes it as image `i`
/// of `target`.
pub fn save(target: &Target, i: usize, image: &Image, text: String) -> Result<(), Fail> {
    let bytes = encode::encode(image, target.format(), &[("parameters".to_string(), text)])
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
    for sim in rt.placed_sim_devices() {
        eprintln!(
            "simulated device {} (model placement) peak: {:.2} MiB",
            sim.name(),
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
