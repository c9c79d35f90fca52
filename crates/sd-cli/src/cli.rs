//! The command line (clap derive), with stable-diffusion.cpp's flag names and spellings.
//!
//! The flags of stable-diffusion.cpp's `sd-cli` that sd-rs has a meaning for are accepted
//! with that meaning; the others are answered "not supported yet" ([`UNSUPPORTED`]).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{ArgAction, Parser, ValueEnum};
use sd_pipeline::generate::ModelFiles;
use sd_pipeline::hires::{HiresFix, HiresUpscaler};
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::{parse_size, ComputeDevice, ParamsLocation};
use sd_pipeline::sampling::{Prediction, SampleMethod};
use sd_pipeline::schedule::{AysTable, Scheduler};
use sd_pipeline::upscale::UpscaleOptions;
use sd_residency::capacity::MaxVram;
use sd_residency::Component;
use sd_tensor::DType;

/// Largest `-W`/`-H` (pixels).
pub const MAX_SIZE: u32 = 16384;
/// Most `--steps`.
pub const MAX_STEPS: u32 = 1000;
/// Most images in a batch (`-b`).
pub const MAX_BATCH: u32 = 1000;
/// Most `-t` threads.
pub const MAX_THREADS: i64 = 1024;
/// Most `--upscale-repeats`.
pub const MAX_UPSCALE_REPEATS: u32 = 4;

const AFTER_HELP: &str = "\
Flags of stable-diffusion.cpp's sd-cli that sd-rs does not implement yet are refused with a
message naming them. RUST_LOG (e.g. RUST_LOG=sd_exec=debug) overrides -v.

Exit codes: 0 success; 1 a missing or corrupt model or image file, or a failed run;
2 bad flags or values (checked before any work).";

/// The run mode (`-M/--mode`, or `sd upscale`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Text to image, or image to image with -i.
    #[value(name = "img_gen")]
    ImgGen,
    /// Upscale -i with --upscale-model.
    #[value(name = "upscale")]
    Upscale,
    /// The plan of an img_gen run with the same flags (segments, bytes, budget), running
    /// nothing heavy (sd-rs only; also `sd plan ...`).
    #[value(name = "plan")]
    Plan,
    /// stable-diffusion.cpp's model conversion (not supported yet).
    #[value(name = "convert")]
    Convert,
    /// Video generation (not supported yet).
    #[value(name = "vid_gen")]
    VidGen,
    /// ADetailer (not supported yet).
    #[value(name = "adetailer")]
    Adetailer,
    /// PNG metadata inspection (not supported yet).
    #[value(name = "metadata")]
    Metadata,
}

/// `--rng` (stable-diffusion.cpp's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RngArg {
    /// torch CUDA Philox randn (the A1111 web UI; stable-diffusion.cpp's default).
    #[value(name = "cuda")]
    Cuda,
    /// torch CPU randn (ComfyUI).
    #[value(name = "cpu")]
    Cpu,
    /// C++ std::default_random_engine with std::normal_distribution (libstdc++'s)
    #[value(name = "std_default")]
    StdDefault,
}

/// The `sd` command line.
#[derive(Debug, Parser)]
#[command(
    name = "sd",
    about = "Generates and upscales images with diffusion models within a memory budget.",
    override_usage = "sd -m MODEL -p PROMPT [options]            text to image (-i INIT for image to image)\n       \
                      sd upscale --upscale-model MODEL -i IMAGE [-o OUT.png]   (also -M upscale)\n       \
                      sd plan -m MODEL [generation flags] [--json]   the run's memory plan (also -M plan)\n       \
                      sd --list-devices | --self-check | --version",
    disable_version_flag = true,
    args_override_self = true,
    after_help = AFTER_HELP,
    max_term_width = 100
)]
pub struct Cli {
    /// Run mode: img_gen (default), upscale, or plan (sd-rs: the memory plan of the img_gen
    /// run, nothing run); convert, vid_gen, adetailer and metadata are not supported yet
    #[arg(short = 'M', long = "mode", value_enum, default_value = "img_gen")]
    pub mode: Mode,

    /// Full checkpoint (safetensors, GGUF, .ckpt)
    #[arg(short = 'm', long = "model", help_heading = "Model files")]
    pub model: Option<PathBuf>,
    /// Diffusion model (UNet) alone, replacing the checkpoint's
    #[arg(long = "diffusion-model", help_heading = "Model files")]
    pub diffusion_model: Option<PathBuf>,
    /// Autoencoder alone, replacing the checkpoint's
    #[arg(long = "vae", help_heading = "Model files")]
    pub vae: Option<PathBuf>,
    /// CLIP-L text encoder alone, replacing the checkpoint's
    #[arg(long = "clip_l", help_heading = "Model files")]
    pub clip_l: Option<PathBuf>,
    /// OpenCLIP-bigG text encoder alone (SDXL base and refiner)
    #[arg(long = "clip_g", help_heading = "Model files")]
    pub clip_g: Option<PathBuf>,
    /// OpenCLIP-H text encoder alone (SD2.x)
    #[arg(long = "clip_h", help_heading = "Model files")]
    pub clip_h: Option<PathBuf>,
    /// T5-XXL text encoder (FLUX.1)
    #[arg(long = "t5xxl", help_heading = "Model files")]
    pub t5xxl: Option<PathBuf>,
    /// LLM text encoder (Qwen-Image: Qwen2.5-VL-7B's language model)
    #[arg(long = "llm", help_heading = "Model files")]
    pub llm: Option<PathBuf>,
    /// Convert weights when loading: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_K..q6_K
    /// (quantized types apply to linear weights; default: the files' types)
    #[arg(long = "type", value_name = "TYPE", value_parser = parse_weight_type, help_heading = "Model files")]
    pub weight_type: Option<DType>,
    /// Directory of LoRA files named by <lora:NAME:WEIGHT> in the prompt
    #[arg(
        long = "lora-model-dir",
        value_name = "DIR",
        help_heading = "Model files"
    )]
    pub lora_model_dir: Option<PathBuf>,
    /// When LoRAs are applied: auto or immediately (sd-rs merges them into each weight as it
    /// is loaded for compute, in f32; stable-diffusion.cpp's at_runtime is refused)
    #[arg(long = "lora-apply-mode", value_name = "MODE", value_parser = parse_lora_apply_mode, help_heading = "Model files")]
    pub lora_apply_mode: Option<String>,
    /// Upscaler (ESRGAN / Real-ESRGAN / Compact / MoSR; .pth, .safetensors); with -m it
    /// upscales the generated images in the same runtime and budget
    #[arg(
        long = "upscale-model",
        value_name = "PATH",
        help_heading = "Model files"
    )]
    pub upscale_model: Option<PathBuf>,
    /// Refiner (an SDXL refiner, or any model sampling the same latents): takes over
    /// sampling after --refiner-start of the steps, in the same runtime and budget (sd-rs)
    #[arg(long = "refiner", value_name = "PATH", help_heading = "Model files")]
    pub refiner: Option<PathBuf>,
    /// Fraction of the steps the base model runs before the refiner takes over, strictly
    /// between 0 and 1 (default 0.8; diffusers' denoising_end/denoising_start)
    #[arg(long = "refiner-start", value_name = "FRACTION", value_parser = parse_refiner_start, help_heading = "Model files")]
    pub refiner_start: Option<f32>,

    /// Prompt ((word:1.2) attention syntax)
    #[arg(short = 'p', long = "prompt", help_heading = "Generation")]
    pub prompt: Option<String>,
    /// Negative prompt
    #[arg(
        short = 'n',
        long = "negative-prompt",
        default_value = "",
        hide_default_value = true,
        help_heading = "Generation"
    )]
    pub negative: String,
    /// Output PNG ('-': standard output; a batch writes OUT, then NAME_2.png, ...)
    #[arg(
        short = 'o',
        long = "output",
        default_value = "output.png",
        help_heading = "Generation"
    )]
    pub output: PathBuf,
    /// Width in pixels (default: the model's, or the init image's)
    #[arg(short = 'W', long = "width", value_parser = clap::value_parser!(u32).range(1..=MAX_SIZE as i64), help_heading = "Generation")]
    pub width: Option<u32>,
    /// Height in pixels (default: the model's, or the init image's)
    #[arg(short = 'H', long = "height", value_parser = clap::value_parser!(u32).range(1..=MAX_SIZE as i64), help_heading = "Generation")]
    pub height: Option<u32>,
    /// Sampling steps (default: the model's: 20 for SD1/SD2/SDXL, 28 for FLUX.1-dev, 4 for
    /// schnell)
    #[arg(long = "steps", value_parser = clap::value_parser!(u32).range(1..=MAX_STEPS as i64), help_heading = "Generation")]
    pub steps: Option<u32>,
    /// Guidance scale (default: the model's, else 7)
    #[arg(long = "cfg-scale", value_parser = parse_cfg_scale, help_heading = "Generation")]
    pub cfg_scale: Option<f32>,
    /// Distilled guidance of FLUX.1-dev (default 3.5; other models ignore it)
    #[arg(long = "guidance", value_parser = parse_cfg_scale, help_heading = "Generation")]
    pub guidance: Option<f32>,
    /// Timestep shift of flow models (default the model's: SD3 3; for FLUX.1 a fixed `mu`
    /// replacing the resolution-dependent shift, as stable-diffusion.cpp)
    #[arg(long = "flow-shift", value_parser = parse_cfg_scale, help_heading = "Generation")]
    pub flow_shift: Option<f32>,
    /// Skip-layer guidance strength, SD3 models (default 0: off; 2.5 suggested for SD3.5
    /// Medium)
    #[arg(long = "slg-scale", value_parser = parse_cfg_scale, help_heading = "Generation")]
    pub slg_scale: Option<f32>,
    /// The blocks skip-layer guidance leaves out (default [7,8,9])
    #[arg(long = "skip-layers", value_name = "LIST", value_parser = parse_layers, help_heading = "Generation")]
    pub skip_layers: Option<LayerList>,
    /// Fraction of the steps after which skip-layer guidance starts (default 0.01)
    #[arg(long = "skip-layer-start", value_name = "FRACTION", value_parser = parse_fraction, help_heading = "Generation")]
    pub skip_layer_start: Option<f32>,
    /// Fraction of the steps before which skip-layer guidance stops (default 0.2)
    #[arg(long = "skip-layer-end", value_name = "FRACTION", value_parser = parse_fraction, help_heading = "Generation")]
    pub skip_layer_end: Option<f32>,
    /// Seed; negative: a random seed, printed (image i of a batch uses SEED+i)
    #[arg(
        short = 's',
        long = "seed",
        default_value_t = 42,
        allow_negative_numbers = true,
        help_heading = "Generation"
    )]
    pub seed: i64,
    /// Number of images
    #[arg(short = 'b', long = "batch-count", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH as i64), help_heading = "Generation")]
    pub batch: u32,
    /// Sampler: euler, euler_a, heun, dpm2, dpm++2s_a, dpm++2m, dpm++2mv2, ipndm, ipndm_v,
    /// lcm, ddim_trailing, tcd (default euler)
    #[arg(long = "sampling-method", value_name = "NAME", value_parser = parse_sampler, help_heading = "Generation")]
    pub sampler: Option<SampleMethod>,
    /// Scheduler: discrete, karras, exponential, ays, sgm_uniform, simple, lcm (default: the
    /// sampler's)
    #[arg(long = "scheduler", value_name = "NAME", value_parser = parse_scheduler, help_heading = "Generation")]
    pub scheduler: Option<Scheduler>,
    /// Noise generator
    #[arg(
        long = "rng",
        value_enum,
        default_value = "cuda",
        help_heading = "Generation"
    )]
    pub rng: RngArg,
    /// Use the text encoder layer N from the end (<= 0: the model's)
    #[arg(
        long = "clip-skip",
        allow_negative_numbers = true,
        help_heading = "Generation"
    )]
    pub clip_skip: Option<i64>,
    /// What the UNet predicts: eps or v (default: the model's)
    #[arg(long = "prediction", value_parser = parse_prediction, help_heading = "Generation")]
    pub prediction: Option<Prediction>,
    /// Init image (PNG or JPEG) for image to image, or the image to upscale
    #[arg(short = 'i', long = "init-img", help_heading = "Generation")]
    pub init: Option<PathBuf>,
    /// Image-to-image noise strength in [0, 1] (default 0.75)
    #[arg(long = "strength", value_parser = parse_strength, help_heading = "Generation")]
    pub strength: Option<f32>,
    /// VAE-decode (and encode) in overlapping tiles
    #[arg(long = "vae-tiling", help_heading = "Generation")]
    pub vae_tiling: bool,
    /// Apply the upscaler N times (default 1)
    #[arg(long = "upscale-repeats", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_UPSCALE_REPEATS as i64), help_heading = "Generation")]
    pub upscale_repeats: Option<u32>,
    /// Upscaler tile size in input pixels (default 128; 0: the whole image)
    #[arg(long = "upscale-tile-size", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=4096), help_heading = "Generation")]
    pub upscale_tile_size: Option<u32>,

    /// Hires fix: generate at -W x -H, upscale, then denoise again at the hires size
    #[arg(long = "hires", help_heading = "Hires fix")]
    pub hires: bool,
    /// Hires width (0 or absent: the width times --hires-scale)
    #[arg(long = "hires-width", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=MAX_SIZE as i64), help_heading = "Hires fix")]
    pub hires_width: Option<u32>,
    /// Hires height (0 or absent: the height times --hires-scale)
    #[arg(long = "hires-height", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=MAX_SIZE as i64), help_heading = "Hires fix")]
    pub hires_height: Option<u32>,
    /// Hires scale of the first pass's size (default 2)
    #[arg(long = "hires-scale", value_name = "X", value_parser = parse_hires_scale, help_heading = "Hires fix")]
    pub hires_scale: Option<f32>,
    /// Second-pass steps (0 or absent: --steps)
    #[arg(long = "hires-steps", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=MAX_STEPS as i64), help_heading = "Hires fix")]
    pub hires_steps: Option<u32>,
    /// Second-pass denoising strength in [0, 1] (default 0.7)
    #[arg(long = "hires-denoising-strength", value_name = "S", value_parser = parse_strength, help_heading = "Hires fix")]
    pub hires_strength: Option<f32>,
    /// Upscale step: Latent (default), "Latent (antialiased)", "Latent (bicubic)", "Latent
    /// (bicubic antialiased)", "Latent (nearest)", "Latent (nearest-exact)", Lanczos,
    /// Nearest, Bilinear (sd-rs), or an upscaler model file (a path, or a name in
    /// --hires-upscalers-dir)
    #[arg(
        long = "hires-upscaler",
        value_name = "NAME",
        help_heading = "Hires fix"
    )]
    pub hires_upscaler: Option<String>,
    /// Directory of upscaler models named by --hires-upscaler
    #[arg(
        long = "hires-upscalers-dir",
        value_name = "DIR",
        help_heading = "Hires fix"
    )]
    pub hires_upscalers_dir: Option<PathBuf>,
    /// Tile size of an upscaler model in the hires fix, in input pixels (default 128; 0: the
    /// whole image at once)
    #[arg(long = "hires-upscale-tile-size", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=4096), help_heading = "Hires fix")]
    pub hires_upscale_tile_size: Option<u32>,

    /// Compute device: cpu (default), a device from --list-devices (cuda0, Vulkan0...),
    /// sim:SIZE (a simulated GPU; sim:SIZE/PAGE rounds its buffers up to pages), A&B (the diffusion model layer-split across A and B), or
    /// module assignments as stable-diffusion.cpp takes them (diffusion=cuda0,te=cpu,vae=cpu;
    /// modules: diffusion, te, vae, upscaler; a bare device is the default of the others)
    #[arg(
        long = "backend",
        value_name = "SPEC",
        help_heading = "Devices and memory"
    )]
    pub backend: Option<String>,
    /// Where weights live between uses: cpu/ram (loaded once), disk (read at each use),
    /// device (loaded once into the computing device's memory) or auto (the default: device
    /// when it has no --max-vram budget, else ram)
    #[arg(
        long = "params-backend",
        value_name = "WHERE",
        help_heading = "Devices and memory"
    )]
    pub params_backend: Option<String>,
    /// Device budget: GiB (4, 3.5) or with a unit (512M, 6G); 0: none; negative: free
    /// memory minus that much; per device: cuda0=6,cuda1=8; models on the CPU are not
    /// counted
    #[arg(long = "max-vram", value_name = "SIZE", allow_hyphen_values = true, value_parser = parse_max_vram, help_heading = "Devices and memory")]
    pub max_vram: Option<MaxVram>,
    /// Map weights from the files instead of copying them
    #[arg(long = "mmap", help_heading = "Devices and memory")]
    pub mmap: bool,
    /// Weights in RAM, loaded into VRAM when needed (same as --params-backend cpu; the
    /// default under --max-vram)
    #[arg(long = "offload-to-cpu", help_heading = "Devices and memory")]
    pub offload_to_cpu: bool,
    /// Run the VAE on the CPU (same as --backend vae=cpu; not counted in --max-vram)
    #[arg(long = "vae-on-cpu", help_heading = "Devices and memory")]
    pub vae_on_cpu: bool,
    /// Run the text encoders on the CPU (same as --backend te=cpu; not counted in
    /// --max-vram)
    #[arg(long = "clip-on-cpu", help_heading = "Devices and memory")]
    pub clip_on_cpu: bool,
    /// Flash attention in the diffusion model
    #[arg(long = "diffusion-fa", help_heading = "Devices and memory")]
    pub diffusion_fa: bool,
    /// Flash attention (sd-rs applies it to the diffusion model)
    #[arg(long = "fa", help_heading = "Devices and memory")]
    pub fa: bool,
    /// Read all weights at load time (sd-rs always does)
    #[arg(long = "eager-load", help_heading = "Devices and memory")]
    pub eager_load: bool,
    /// Stream weights per segment within --max-vram (sd-rs always does when a model does
    /// not fit)
    #[arg(long = "stream-layers", help_heading = "Devices and memory")]
    pub stream_layers: bool,
    /// CPU threads (<= 0: all cores)
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(..=MAX_THREADS), help_heading = "Devices and memory")]
    pub threads: i64,

    /// More log output: -v info, -vv debug (default: warnings)
    #[arg(short = 'v', long = "verbose", action = ArgAction::Count, help_heading = "Other")]
    pub verbose: u8,
    /// List the ggml compute devices
    #[arg(long = "list-devices", help_heading = "Other")]
    pub list_devices: bool,
    /// Run a small matmul on the CPU backend
    #[arg(long = "self-check", help_heading = "Other")]
    pub self_check: bool,
    /// Print the version
    #[arg(long = "version", help_heading = "Other")]
    pub version: bool,
    /// With plan mode: print the plan as JSON
    #[arg(long = "json", help_heading = "Other")]
    pub json: bool,
}

/// stable-diffusion.cpp flags sd-rs does not implement yet: `(flag, takes a value)`.
pub const UNSUPPORTED: &[(&str, bool)] = &[
    ("--clip_vision", true),
    ("--llm_vision", true),
    ("--qwen2vl", true),
    ("--qwen2vl_vision", true),
    ("--high-noise-diffusion-model", true),
    ("--uncond-diffusion-model", true),
    ("--vae-format", true),
    ("--taesd", true),
    ("--tae", true),
    ("--control-net", true),
    ("--control-net-cpu", false),
    ("--control-image", true),
    ("--control-strength", true),
    ("--ip-adapter", true),
    ("--motion-module", true),
    ("--embd-dir", true),
    ("--tensor-type-rules", true),
    ("--photo-maker", true),
    ("--split-mode", true),
    ("--rpc-servers", true),
    ("--auto-fit", false),
    ("--diffusion-conv-direct", false),
    ("--vae-conv-direct", false),
    ("--sampler-rng", true),
    ("--mask", true),
    ("--end-img", true),
    ("--ref-image", true),
    ("--img-cfg-scale", true),
    ("--eta", true),
    ("--sigmas", true),
    ("--vae-tile-size", true),
    ("--vae-tile-overlap", true),
    ("--vae-relative-tile-size", true),
    ("--prompt-file", true),
    ("--negative-prompt-file", true),
    ("--cache-mode", true),
    ("--circular", false),
    ("--disable-image-metadata", false),
    ("--preview", true),
    ("--preview-path", true),
    ("--color", false),
    ("--canny", false),
    ("--video-frames", true),
];

/// Parses `args` (without the program name); `sd upscale ...` is `sd -M upscale ...`, `sd
/// plan ...` is `sd -M plan ...`.
pub fn parse(args: Vec<OsString>) -> Result<Cli, clap::Error> {
    let mut argv = vec![OsString::from("sd")];
    let mut rest = args.into_iter().peekable();
    if let Some(mode) = rest
        .peek()
        .and_then(|a| a.to_str())
        .filter(|a| ["upscale", "plan"].contains(a))
        .map(str::to_string)
    {
        rest.next();
        argv.extend(["-M".into(), mode.into()]);
    }
    argv.extend(rest);
    Cli::try_parse_from(argv)
}

/// The model files of the command line (the one place the model-file flags map onto the
/// pipeline's [`ModelFiles`]).
pub fn model_files(cli: &Cli) -> Result<ModelFiles, String> {
    let mut files = ModelFiles {
        model: cli.model.clone(),
        ..ModelFiles::default()
    };
    // Slot names of the model families (`sd_pipeline::family`): the flag without its dashes.
    for (slot, path) in [
        ("diffusion-model", &cli.diffusion_model),
        ("vae", &cli.vae),
        ("clip_l", &cli.clip_l),
        ("clip_h", &cli.clip_h),
        ("clip_g", &cli.clip_g),
        ("t5xxl", &cli.t5xxl),
        ("llm", &cli.llm),
    ] {
        if let Some(p) = path {
            files = files.with(slot, p.clone());
        }
    }
    Ok(files)
}

/// The noise generator of `--rng`.
pub fn rng_kind(rng: RngArg) -> Result<RngKind, String> {
    match rng {
        RngArg::Cuda => Ok(RngKind::Cuda),
        RngArg::Cpu => Ok(RngKind::Cpu),
        RngArg::StdDefault => Ok(RngKind::StdDefault),
    }
}

/// The threads of `-t` (<= 0: all cores).
pub fn threads(t: i64) -> usize {
    if t > 0 {
        t as usize
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
}

/// A model of stable-diffusion.cpp's `--backend` module assignments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Module {
    Diffusion,
    TextEncoder,
    Vae,
    Upscaler,
}

fn module(name: &str) -> Result<Module, String> {
    let n: String = name
        .chars()
        .filter(|c| *c != '-' && *c != '_')
        .collect::<String>()
        .to_ascii_lowercase();
    Ok(match n.as_str() {
        "diffusion" | "model" | "unet" | "dit" => Module::Diffusion,
        "te" | "clip" | "text" | "textencoder" | "textencoders" | "conditioner" | "cond"
        | "llm" | "t5" | "t5xxl" => Module::TextEncoder,
        "vae" | "firststage" | "autoencoder" | "tae" => Module::Vae,
        "upscaler" | "esrgan" | "hires" => Module::Upscaler,
        "controlnet" | "control" | "clipvision" | "vision" | "photomaker" | "photomakerid"
        | "pmid" | "photo" => {
            return Err(format!(
                "module '{name}': not supported yet (sd-rs has no such model)"
            ))
        }
        _ => {
            return Err(format!(
                "unknown module '{name}' (known: diffusion, te, vae, upscaler)"
            ))
        }
    })
}

fn device(text: &str) -> Result<ComputeDevice, String> {
    // Device names match case-insensitively (sd.cpp's cuda0 is ggml's CUDA0).
    text.parse()
}

/// Where the models run: the diffusion model's compute device (plus devices it is
/// layer-split across), and the devices of the other models where they differ.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The compute device: the diffusion model's, and every other model's unless
    /// `placement` says otherwise.
    pub compute: ComputeDevice,
    /// Further devices of the diffusion model's layer split.
    pub split: Vec<ComputeDevice>,
    /// Per-component devices of the other models (text encoders, VAE, upscaler), in the
    /// order given (the last of a component wins); see
    /// [`sd_pipeline::runtime::RuntimeOptions::placement`].
    pub placement: Vec<(Component, ComputeDevice)>,
}

impl Module {
    /// The residency component of the module's models.
    fn component(self) -> Component {
        match self {
            Module::Diffusion => Component::Diffusion,
            Module::TextEncoder => Component::TextEncoder,
            Module::Vae => Component::Vae,
            Module::Upscaler => Component::Upscaler,
        }
    }
}

/// Resolves `--backend` (a device, `A&B`, or `module=device,...` assignments, a bare
/// device being the default of the modules not assigned) together with `--vae-on-cpu` and
/// `--clip-on-cpu`. The diffusion model's device is the compute device; the text encoders,
/// the VAE and the upscaler may each run on another device or the CPU. A layer split
/// (`A&B`) is for the diffusion model only.
pub fn placement(cli: &Cli) -> Result<Placement, String> {
    let mut default: Option<Vec<ComputeDevice>> = None;
    let mut assigned: Vec<(Module, String, Vec<ComputeDevice>)> = Vec::new();
    if let Some(spec) = &cli.backend {
        for item in spec.split(',') {
            let item = item.trim();
            let (m, devs) = match item.split_once('=') {
                Some((m, d)) => (Some((module(m)?, m.trim().to_string())), d),
                None => (None, item),
            };
            let mut list = Vec::new();
            for d in devs.split('&') {
                list.push(device(d)?);
            }
            match m {
                Some((m, name)) => assigned.push((m, name, list)),
                None if default.is_none() => default = Some(list),
                None => return Err(format!("two default devices in '{spec}'")),
            }
        }
    }
    if cli.vae_on_cpu {
        assigned.push((Module::Vae, "--vae-on-cpu".into(), vec![ComputeDevice::Cpu]));
    }
    if cli.clip_on_cpu {
        assigned.push((
            Module::TextEncoder,
            "--clip-on-cpu".into(),
            vec![ComputeDevice::Cpu],
        ));
    }
    let diffusion = assigned
        .iter()
        .rev()
        .find(|(m, _, _)| *m == Module::Diffusion)
        .map(|(_, _, l)| l.clone())
        .or_else(|| default.clone())
        .unwrap_or_else(|| vec![ComputeDevice::Cpu]);
    let compute = diffusion[0].clone();
    let mut placement = Vec::new();
    // A default device besides an assigned diffusion device is the other modules'.
    if let Some(d) = default.filter(|d| d[0] != compute) {
        for m in [Module::TextEncoder, Module::Vae, Module::Upscaler] {
            if !assigned.iter().any(|(a, _, _)| *a == m) {
                if d.len() > 1 {
                    return Err(format!(
                        "the default '{}': a layer split is for the diffusion model only",
                        d.iter().map(label).collect::<Vec<_>>().join("&")
                    ));
                }
                placement.push((m.component(), d[0].clone()));
            }
        }
    }
    for (m, name, list) in &assigned {
        if *m == Module::Diffusion {
            continue;
        }
        if list.len() > 1 {
            return Err(format!(
                "{name}: a layer split is for the diffusion model only"
            ));
        }
        placement.push((m.component(), list[0].clone()));
    }
    Ok(Placement {
        compute,
        split: diffusion[1..].to_vec(),
        placement,
    })
}

fn label(d: &ComputeDevice) -> String {
    match d {
        ComputeDevice::Cpu => "cpu".into(),
        ComputeDevice::Named(n) => n.clone(),
        ComputeDevice::Sim { bytes, page: 0 } => format!("sim:{}M", bytes >> 20),
        ComputeDevice::Sim { bytes, page } => format!("sim:{}M/{page}", bytes >> 20),
    }
}

/// `--params-backend`: `cpu`/`ram`/`disk`, or sd.cpp's `module=where` assignments when every
/// module names the same place.
pub fn params_location(cli: &Cli) -> Result<ParamsLocation, String> {
    let Some(spec) = &cli.params_backend else {
        return Ok(if cli.offload_to_cpu {
            ParamsLocation::Ram
        } else {
            ParamsLocation::default()
        });
    };
    let mut found: Option<ParamsLocation> = None;
    for item in spec.split(',') {
        let place = match item.split_once('=') {
            Some((m, p)) => {
                module(m)?;
                p
            }
            None => item,
        };
        let p: ParamsLocation = place.parse()?;
        if found.is_some_and(|f| f != p) {
            return Err(format!(
                "'{spec}': different places per module are not supported yet"
            ));
        }
        found = Some(p);
    }
    let found = found.unwrap_or_default();
    if cli.offload_to_cpu && !matches!(found, ParamsLocation::Ram | ParamsLocation::Disk) {
        return Err(format!(
            "'{spec}' contradicts --offload-to-cpu (weights in RAM)"
        ));
    }
    Ok(found)
}

fn parse_weight_type(text: &str) -> Result<DType, String> {
    match DType::parse_weight_type(text) {
        Some(d) => Ok(d),
        None => Err(format!(
            "unknown weight type '{text}' (known: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_K, \
             q3_K, q4_K, q5_K, q6_K)"
        )),
    }
}

fn parse_cfg_scale(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(s) if s.is_finite() && (0.0..=100.0).contains(&s) => Ok(s),
        _ => Err(format!("needs a number in [0, 100], got '{text}'")),
    }
}

fn parse_lora_apply_mode(text: &str) -> Result<String, String> {
    match text {
        "auto" | "immediately" => Ok(text.to_string()),
        "at_runtime" => Err(
            "at_runtime is not supported: sd-rs merges LoRAs into the weights \
                             as they are loaded for compute (use auto or immediately)"
                .into(),
        ),
        _ => Err(format!(
            "needs auto, immediately or at_runtime, got '{text}'"
        )),
    }
}

fn parse_strength(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(s) if (0.0..=1.0).contains(&s) => Ok(s),
        _ => Err(format!("needs a number between 0 and 1, got '{text}'")),
    }
}

fn parse_hires_scale(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 16.0 => Ok(s),
        _ => Err(format!("needs a number in (0, 16], got '{text}'")),
    }
}

/// The hires fix of the command line for a first pass of `width` x `height` on a model
/// whose sizes are multiples of `multiple` (`None` without `--hires`; an error naming the
/// flag for hires flags without `--hires`, a size that is not a multiple, an unknown
/// upscaler).
pub fn hires_fix(
    cli: &Cli,
    width: usize,
    height: usize,
    multiple: usize,
) -> Result<Option<HiresFix>, String> {
    if !cli.hires {
        let given = [
            ("--hires-width", cli.hires_width.is_some()),
            ("--hires-height", cli.hires_height.is_some()),
            ("--hires-scale", cli.hires_scale.is_some()),
            ("--hires-steps", cli.hires_steps.is_some()),
            ("--hires-denoising-strength", cli.hires_strength.is_some()),
            ("--hires-upscaler", cli.hires_upscaler.is_some()),
            ("--hires-upscalers-dir", cli.hires_upscalers_dir.is_some()),
            (
                "--hires-upscale-tile-size",
                cli.hires_upscale_tile_size.is_some(),
            ),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            return Err(format!("{flag} needs --hires"));
        }
        return Ok(None);
    }
    let scale = cli.hires_scale.unwrap_or(2.0);
    let size = |given: Option<u32>, base: usize, flag: &str| -> Result<usize, String> {
        let v = match given.filter(|v| *v > 0) {
            Some(v) => v as usize,
            // Rounded to the model's size step, as the first pass's sizes are.
            None => ((base as f32 * scale / multiple as f32).round() as usize).max(1) * multiple,
        };
        if v % multiple != 0 || v > MAX_SIZE as usize {
            return Err(format!(
                "{flag}: {v} is not a multiple of {multiple} (this model's size step) up to \
                 {MAX_SIZE}"
            ));
        }
        Ok(v)
    };
    let w = size(cli.hires_width, width, "--hires-width")?;
    let h = size(cli.hires_height, height, "--hires-height")?;
    let name = cli.hires_upscaler.as_deref().unwrap_or("Latent");
    let upscaler = match HiresUpscaler::builtin(name) {
        Some(u) => u,
        None => {
            let path = match &cli.hires_upscalers_dir {
                Some(dir) => dir.join(name),
                None => PathBuf::from(name),
            };
            if !path.is_file() {
                let names: Vec<String> = HiresUpscaler::builtin_names()
                    .map(|n| format!("\"{n}\""))
                    .collect();
                return Err(format!(
                    "--hires-upscaler: '{name}' is neither a built-in upscaler ({}) nor an \
                     upscaler model file ({} does not exist)",
                    names.join(", "),
                    path.display()
                ));
            }
            HiresUpscaler::Model {
                path,
                options: UpscaleOptions {
                    tile_size: cli
                        .hires_upscale_tile_size
                        .map_or(UpscaleOptions::default().tile_size, |t| t as usize),
                    ..UpscaleOptions::default()
                },
            }
        }
    };
    if cli.hires_upscale_tile_size.is_some() && !matches!(upscaler, HiresUpscaler::Model { .. }) {
        return Err(format!(
            "--hires-upscale-tile-size is for upscaler models; '{name}' is a built-in resize"
        ));
    }
    Ok(Some(HiresFix {
        width: w,
        height: h,
        steps: cli.hires_steps.unwrap_or(0) as usize,
        strength: cli.hires_strength.unwrap_or(0.7),
        upscaler,
    }))
}

/// Block indices, as stable-diffusion.cpp writes them (`[7,8,9]`; brackets optional).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerList(pub Vec<usize>);

fn parse_layers(text: &str) -> Result<LayerList, String> {
    let inner = text.trim().trim_start_matches('[').trim_end_matches(']');
    let layers: Result<Vec<usize>, _> = inner
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::parse::<usize>)
        .collect();
    match layers {
        Ok(v) if !v.is_empty() => Ok(LayerList(v)),
        _ => Err(format!("needs block numbers like [7,8,9], got '{text}'")),
    }
}

fn parse_fraction(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(s) if (0.0..=1.0).contains(&s) => Ok(s),
        _ => Err(format!("needs a number from 0 to 1, got '{text}'")),
    }
}

fn parse_refiner_start(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(s) if s > 0.0 && s < 1.0 => Ok(s),
        _ => Err(format!(
            "needs a number strictly between 0 and 1, got '{text}'"
        )),
    }
}

fn parse_prediction(text: &str) -> Result<Prediction, String> {
    match text {
        "eps" => Ok(Prediction::Eps),
        "v" => Ok(Prediction::V),
        "edm_v" | "sd3_flow" | "flux_flow" | "sefi_flow" => {
            Err(format!("'{text}' is not supported yet (eps, v)"))
        }
        _ => Err(format!("needs eps or v, got '{text}'")),
    }
}

fn parse_sampler(text: &str) -> Result<SampleMethod, String> {
    text.parse().map_err(|_| {
        let names: Vec<&str> = SampleMethod::ALL.iter().map(|m| m.name()).collect();
        format!("unknown method '{text}' (known: {})", names.join(", "))
    })
}

fn parse_scheduler(text: &str) -> Result<Scheduler, String> {
    let name = if text == "normal" { "discrete" } else { text };
    Scheduler::from_name(name, AysTable::Sd15).map_err(|_| {
        format!(
            "unknown scheduler '{text}' (known: discrete, karras, exponential, ays, \
             sgm_uniform, simple, lcm)"
        )
    })
}

/// `--max-vram`: GiB numbers as [`MaxVram::parse`] reads them, where each value may also
/// carry a unit (`512M`, `6G`, `1.5GiB`).
pub fn parse_max_vram(text: &str) -> Result<MaxVram, String> {
    let mut items = Vec::new();
    for item in text.split(',') {
        let (key, val) = match item.split_once('=') {
            Some((k, v)) => (Some(k.trim()), v.trim()),
            None => (None, item.trim()),
        };
        let has_unit = val.ends_with(|c: char| c.is_ascii_alphabetic());
        let val = if has_unit {
            let (neg, mag) = match val.strip_prefix('-') {
                Some(m) => (true, m),
                None => (false, val),
            };
            let bytes = parse_size(mag, 30).map_err(|e| e.to_string())?;
            let gib = bytes as f64 / (1u64 << 30) as f64;
            format!("{}{gib}", if neg { "-" } else { "" })
        } else {
            val.to_string()
        };
        items.push(match key {
            Some(k) => format!("{k}={val}"),
            None => val,
        });
    }
    MaxVram::parse(&items.join(",")).map_err(|e| e.to_string())
}

/// The environment variable that forces exact f32 numerics (`1`) or ggml's fast paths (`0`)
/// over the device's default (see `RuntimeOptions::exact`).
pub const EXACT_ENV: &str = "SD_EXACT";

/// [`EXACT_ENV`]'s value as `RuntimeOptions::exact`: unset or empty is the device's default.
pub fn exact_override(value: Option<&str>) -> Result<Option<bool>, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some("1" | "true" | "on" | "yes") => Ok(Some(true)),
        Some("0" | "false" | "off" | "no") => Ok(Some(false)),
        Some(other) => Err(format!(
            "{EXACT_ENV}={other}: expected 1 (exact f32 numerics) or 0 (fast GPU paths)"
        )),
    }
}

/// [`exact_override`] of the process environment.
pub fn exact_from_env() -> Result<Option<bool>, String> {
    exact_override(std::env::var(EXACT_ENV).ok().as_deref())
}

/// An on/off switch's value from environment variable `name`: unset, empty or `1`, `true`,
/// `on`, `yes` is on; `0`, `false`, `off`, `no` off; anything else an error naming the
/// variable and what each value means.
fn on_off_setting(name: &str, value: Option<&str>, on: &str, off: &str) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("") | Some("1" | "true" | "on" | "yes") => Ok(true),
        Some("0" | "false" | "off" | "no") => Ok(false),
        Some(other) => Err(format!("{name}={other}: expected 1 ({on}) or 0 ({off})")),
    }
}

/// The environment variable that turns the project's CPU kernels off (`0`: ggml's ops only,
/// the bits of every other backend) or on (`1`, the default; see
/// `RuntimeOptions::host_kernels`).
pub const HOST_KERNELS_ENV: &str = "SD_HOST_KERNELS";

/// [`HOST_KERNELS_ENV`]'s value as `RuntimeOptions::host_kernels`: unset or empty is on.
pub fn host_kernels_setting(value: Option<&str>) -> Result<bool, String> {
    on_off_setting(
        HOST_KERNELS_ENV,
        value,
        "the project's CPU kernels",
        "ggml's ops only",
    )
}

/// [`host_kernels_setting`] of the process environment.
pub fn host_kernels_from_env() -> Result<bool, String> {
    host_kernels_setting(std::env::var(HOST_KERNELS_ENV).ok().as_deref())
}

/// The environment variable that sends the CPU's convolutions and linear layers of f16 / f32
/// weights back to ggml's f16 product (`0`; convolutions through the im2col) instead of the
/// project's f32 product kernels (`1`, the default; see `RuntimeOptions::f32_products`).
pub const F32_PRODUCTS_ENV: &str = "SD_F32_PRODUCTS";

/// [`F32_PRODUCTS_ENV`]'s value as `RuntimeOptions::f32_products`: unset or empty is on.
pub fn f32_products_setting(value: Option<&str>) -> Result<bool, String> {
    on_off_setting(
        F32_PRODUCTS_ENV,
        value,
        "the project's f32 products",
        "ggml's f16 product, convolutions through the im2col",
    )
}

/// [`f32_products_setting`] of the process environment.
pub fn f32_products_from_env() -> Result<bool, String> {
    f32_products_setting(std::env::var(F32_PRODUCTS_ENV).ok().as_deref())
}

/// The environment variable that turns banding off (`0`: every convolution and
/// feed-forward whole, the bits of an unbudgeted run) or on (`1`, the default: under a
/// budget on a device other than the CPU, large intermediates in bands; see
/// `RuntimeOptions::band_divisor`).
pub const BANDS_ENV: &str = "SD_BANDS";

/// [`BANDS_ENV`]'s value: whether bands are on (unset or empty: on).
pub fn bands_setting(value: Option<&str>) -> Result<bool, String> {
    on_off_setting(
        BANDS_ENV,
        value,
        "large intermediates in bands under a budget",
        "whole ops",
    )
}

/// [`bands_setting`] of the process environment.
pub fn bands_from_env() -> Result<bool, String> {
    bands_setting(std::env::var(BANDS_ENV).ok().as_deref())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sd_bands_values() {
        use super::bands_setting;
        assert_eq!(bands_setting(None), Ok(true));
        assert_eq!(bands_setting(Some("0")), Ok(false));
        assert_eq!(bands_setting(Some(" on")), Ok(true));
        let e = bands_setting(Some("x")).unwrap_err();
        assert!(e.contains("SD_BANDS=x"), "{e}");
    }

    #[test]
    fn sd_exact_values() {
        use super::exact_override;
        assert_eq!(exact_override(None), Ok(None));
        assert_eq!(exact_override(Some("")), Ok(None));
        assert_eq!(exact_override(Some("1")), Ok(Some(true)));
        assert_eq!(exact_override(Some("0")), Ok(Some(false)));
        let e = exact_override(Some("maybe")).unwrap_err();
        assert!(e.contains("SD_EXACT=maybe"), "{e}");
    }

    #[test]
    fn sd_host_kernels_values() {
        use super::host_kernels_setting;
        assert_eq!(host_kernels_setting(None), Ok(true));
        assert_eq!(host_kernels_setting(Some("1")), Ok(true));
        assert_eq!(host_kernels_setting(Some(" off ")), Ok(false));
        let e = host_kernels_setting(Some("2")).unwrap_err();
        assert!(e.contains("SD_HOST_KERNELS=2"), "{e}");
    }

    #[test]
    fn sd_f32_products_values() {
        use super::f32_products_setting;
        assert_eq!(f32_products_setting(None), Ok(true));
        assert_eq!(f32_products_setting(Some("on")), Ok(true));
        assert_eq!(f32_products_setting(Some("0")), Ok(false));
        let e = f32_products_setting(Some("fast")).unwrap_err();
        assert!(e.contains("SD_F32_PRODUCTS=fast"), "{e}");
    }

    use super::*;
    use sd_residency::capacity::BudgetSpec;

    fn cli(args: &[&str]) -> Result<Cli, clap::Error> {
        parse(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn where_weights_live() {
        let loc = |a: &[&str]| params_location(&cli(a).unwrap());
        assert_eq!(loc(&["-p", "x"]), Ok(ParamsLocation::Auto));
        assert_eq!(loc(&["--offload-to-cpu"]), Ok(ParamsLocation::Ram));
        assert_eq!(
            loc(&["--params-backend", "device"]),
            Ok(ParamsLocation::Device)
        );
        assert_eq!(
            loc(&["--params-backend", "disk", "--offload-to-cpu"]),
            Ok(ParamsLocation::Disk)
        );
        let e = loc(&["--params-backend", "vram", "--offload-to-cpu"]).unwrap_err();
        assert!(e.contains("--offload-to-cpu"), "{e}");
        let e = loc(&["--params-backend", "tape"]).unwrap_err();
        assert!(e.contains("tape") && e.contains("device"), "{e}");
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn backend_module_assignments() {
        let p = |a: &[&str]| placement(&cli(a).unwrap());
        let sim64 = ComputeDevice::Sim {
            bytes: 64 << 20,
            page: 0,
        };
        let cuda0 = ComputeDevice::Named("cuda0".into());
        assert_eq!(
            p(&["--backend", "diffusion=sim:64&sim:32"]).unwrap(),
            Placement {
                compute: sim64.clone(),
                split: vec![ComputeDevice::Sim {
                    bytes: 32 << 20,
                    page: 0
                }],
                placement: Vec::new(),
            }
        );
        assert_eq!(
            p(&["--backend", "te=cuda0,vae=cuda0,diffusion=cuda0"])
                .unwrap()
                .compute,
            cuda0
        );
        assert_eq!(
            p(&["--backend", "cpu", "--vae-on-cpu", "--clip-on-cpu"])
                .unwrap()
                .compute,
            ComputeDevice::Cpu
        );
        // Text encoders and VAE on other devices than the diffusion model's.
        assert_eq!(
            p(&["--backend", "te=cpu,vae=cuda1,diffusion=cuda0"]).unwrap(),
            Placement {
                compute: cuda0.clone(),
                split: Vec::new(),
                placement: vec![
                    (Component::TextEncoder, ComputeDevice::Cpu),
                    (Component::Vae, ComputeDevice::Named("cuda1".into())),
                ],
            }
        );
        assert_eq!(
            p(&["--backend", "sim:64", "--vae-on-cpu", "--clip-on-cpu"]).unwrap(),
            Placement {
                compute: sim64.clone(),
                split: Vec::new(),
                placement: vec![
                    (Component::Vae, ComputeDevice::Cpu),
                    (Component::TextEncoder, ComputeDevice::Cpu),
                ],
            }
        );
        assert_eq!(
            p(&["--backend", "upscaler=cpu,sim:64"]).unwrap().placement,
            vec![(Component::Upscaler, ComputeDevice::Cpu)]
        );
        // A bare device besides an assigned diffusion device is the other modules' default.
        assert_eq!(
            p(&["--backend", "cpu,diffusion=sim:64,vae=sim:64"]).unwrap(),
            Placement {
                compute: sim64.clone(),
                split: Vec::new(),
                placement: vec![
                    (Component::TextEncoder, ComputeDevice::Cpu),
                    (Component::Upscaler, ComputeDevice::Cpu),
                    (Component::Vae, sim64.clone()),
                ],
            }
        );
        // A layer split stays the diffusion model's.
        let e = p(&["--backend", "vae=cpu&sim:64,diffusion=sim:64"]).unwrap_err();
        assert!(e.contains("vae") && e.contains("layer split"), "{e}");
        let e = p(&["--backend", "sim:64&sim:32,diffusion=cpu"]).unwrap_err();
        assert!(e.contains("layer split"), "{e}");
        assert!(p(&["--backend", "warp=cpu"]).is_err());
        assert!(p(&["--backend", "sim:64&"]).is_err());
    }

    #[test]
    fn values() {
        assert_eq!(cli(&["-s", "-1"]).unwrap().seed, -1);
        assert_eq!(cli(&["-t", "-1"]).unwrap().threads, -1);
        assert!(cli(&["-t", "100000"]).is_err());
        assert!(cli(&["-W", "100000"]).is_err());
        assert!(cli(&["--steps", "1000000000"]).is_err());
        assert!(cli(&["--upscale-repeats", "6"]).is_err());
        assert_eq!(
            cli(&["--type", "bf16"]).unwrap().weight_type,
            Some(DType::BF16)
        );
        assert_eq!(
            cli(&["--type", "q8_0"]).unwrap().weight_type,
            Some(DType::Q8_0)
        );
        assert_eq!(cli(&["upscale"]).unwrap().mode, Mode::Upscale);
        assert_eq!(cli(&["plan", "--json"]).unwrap().mode, Mode::Plan);
        assert_eq!(cli(&["-M", "plan"]).unwrap().mode, Mode::Plan);
        assert_eq!(cli(&["-M", "img_gen"]).unwrap().mode, Mode::ImgGen);
        assert_eq!(cli(&[]).unwrap().rng, RngArg::Cuda);
        // stable-diffusion.cpp's default is cuda (Philox).
        assert_eq!(rng_kind(cli(&[]).unwrap().rng), Ok(RngKind::Cuda));
        assert_eq!(
            rng_kind(cli(&["--rng", "std_default"]).unwrap().rng),
            Ok(RngKind::StdDefault)
        );
        assert_eq!(
            cli(&["--scheduler", "normal"]).unwrap().scheduler,
            Some(Scheduler::Discrete)
        );
    }

    #[test]
    fn max_vram_takes_gib_and_units() {
        let gib = 1u64 << 30;
        let m = parse_max_vram("4").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(4 * gib)));
        let m = parse_max_vram("512M").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(512 << 20)));
        let m = parse_max_vram("cuda0=1.5G,sim0=-256M").unwrap();
        assert_eq!(m.for_device("CUDA0"), Some(BudgetSpec::Bytes(3 * gib / 2)));
        assert_eq!(m.for_device("SIM0"), Some(BudgetSpec::FreeMinus(256 << 20)));
        assert_eq!(
            parse_max_vram("0").unwrap().default,
            Some(BudgetSpec::Disabled)
        );
        for bad in ["", "x", "4Q", "nan", "1,2"] {
            assert!(parse_max_vram(bad).is_err(), "{bad}");
        }
    }
}
