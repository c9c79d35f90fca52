//! `sd-bench`: measurements of the execution engine on a named ggml backend, printed as JSON
//! lines (one object per run). Driven on the GPU machine by `scripts/device/cuda_run.sh`.
//!
//! ```text
//! sd-bench write-weights DIR [--config sd15|sdxl|tiny|sd35-large|sd35-medium|flux-dev|qwen-image|qwen25vl-7b]
//!                                                       random f16 weights (checkpoint names)
//! sd-bench unet --weights FILE --backend NAME [--max-vram FRAC|BYTES] [--params MODE]
//!               [--steps N] [--flash-attn auto|on|off] [--dump DIR] [--config NAME]
//!               [--runtime-reserve BYTES] [--direct on] [--type q8_0|q4_K|...] [--reuse-graphs on|off]
//!               [--async-compute on|off] [--segments-in-flight N]
//!               [--refine-for-residency on|off] [--segment-weight-share N]
//! sd-bench check --backend NAME                         tiny UNet: backend vs CPU, resident
//!                                                       and streamed through a budget
//! sd-bench copy-bw --backend NAME [--mib N]             host->device copy bandwidth
//! ```
//!
//! Every command first loads the ggml backend modules named by `--module PATH` (repeatable)
//! or the `SD_BACKEND_MODULES` environment variable (`:`-separated); see
//! [`Device::load_module`]. This binary is linked with `--export-dynamic` (see `build.rs`) so
//! that a module's ggml symbols resolve to the copy linked into it.
//!
//! `unet` runs one UNet step (the SD1.5 UNet by default: 512x512, batch 2, 77x768 context)
//! through `sd-pipeline`'s [`Runtime`], the path `sd` runs its models on (one execution
//! engine over one residency manager, the model in its own session, the step's graph built
//! at each call as a sampling loop builds it); its switches are the runtime's options
//! ([`RuntimeOptions::streaming`], [`RuntimeOptions::uploads`],
//! [`RuntimeOptions::runtime_reserve`]):
//! - `--params device` (default without `--max-vram`): weights loaded once into device
//!   memory (resident);
//! - `--params pinned`: weights in host RAM in the device's pinned host buffer type,
//!   streamed per segment; `--params ram`: the same in pageable host memory;
//! - `--params disk`: weights read from the file for each use (page cache permitting).
//!
//! With `--max-vram` (a fraction of the weight bytes such as `0.25`, or bytes) the device
//! has that budget (as `sd --max-vram`; not the CPU: `--backend sim:MiB` studies streaming
//! without a GPU) and the step runs in segments with prefetch. Reported per run: the median step
//! time, the weight bytes uploaded per step (the manager's counter), the peak device memory
//! used as CUDA reports it (`cudaMemGetInfo` through `ggml_backend_dev_memory`, sampled
//! every 0.2 ms from a thread, relative to the free memory before the run, and as all the
//! device memory in use at that moment, the runtime's context included), and the engine's
//! own largest segment footprint. `--runtime-reserve` takes that many bytes of the budget
//! away from the engine for the backend's own allocations (default with `--max-vram`:
//! measured after a warm-up graph, as `sd` does: `sd_exec::measure_runtime_reserve`);
//! `--direct on` times the step without the engine (one graph allocation, `compute` only).
//! `RUST_LOG=sd_exec=debug` prints the engine's segment, prefetch and eviction decisions.

// The unet command's JSON object has more fields than json!'s default recursion allows.
#![recursion_limit = "256"]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};

mod sd_bench {
    pub mod attn;
    pub mod span_times;
}
use sd_exec::{ExecError, StreamingOptions};
use sd_formats::files::{FileError, TensorCatalog};
use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
use sd_models::flux::FluxConfig;
use sd_models::llm::{LlmConfig, LlmModel};
use sd_models::mmdit::MmditConfig;
use sd_models::qwen_image::QwenImageConfig;
use sd_models::unet::{HeadSpec, UnetConfig};
use sd_models::weights::DEFAULT_PARAM_CAPACITY;
use sd_models::{ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder, Params};
use sd_pipeline::runtime::{
    BuiltGraph, ComputeDevice, GraphKey, KeyedGraph, ModelHandle, ParamsLocation, RunOutput,
    Runtime, RuntimeError, RuntimeOptions,
};
use sd_residency::capacity::{BudgetSpec, MaxVram};
use sd_residency::{Component, ResidencyError, SourceId, UploadOptions};
use sd_tensor::ggml::{
    Backend, BufferType, Context, Device, GTensor, GgmlError, SimDevice, SimOptions,
};
use sd_tensor::DType;
use serde_json::json;

/// Errors of the benchmark tool.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Check(String),
    #[error(transparent)]
    Ggml(#[from] GgmlError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, BenchError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |source| BenchError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where the UNet's parameters live between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ParamsMode {
    /// Loaded once into the compute device's memory.
    Device,
    /// Host RAM, pinned (the device's host buffer type).
    Pinned,
    /// Host RAM, pageable.
    Ram,
    /// Read from the file for each use.
    Disk,
}

impl ParamsMode {
    fn name(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Pinned => "pinned",
            Self::Ram => "ram",
            Self::Disk => "disk",
        }
    }
}

/// The command line (clap).
#[derive(Debug, Parser)]
#[command(
    name = "sd-bench",
    about = "Measurements of the execution engine on a named ggml backend (JSON lines).",
    max_term_width = 100
)]
struct Args {
    /// A ggml backend module to load first (repeatable; also SD_BACKEND_MODULES=PATH:PATH)
    #[arg(long = "module", value_name = "PATH", global = true)]
    module: Vec<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The UNet configuration to benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ConfigName {
    /// The SD1.5 UNet.
    Sd15,
    /// A small UNet of the SD1 architecture (head widths 64 and 128).
    Tiny,
    /// The SDXL base UNet (1024x1024: 128x128 latents, 2048-wide context, `y` of 2816).
    Sdxl,
    /// The SD3.5 Large MMDiT (8.1 B; 1024x1024 with CFG: batch 2, 333x4096 context,
    /// pooled 2048).
    #[value(name = "sd35-large")]
    Sd35Large,
    /// The SD3.5 Medium MMDiT-X (2.5 B; inputs as `sd35-large`).
    #[value(name = "sd35-medium")]
    Sd35Medium,
    /// The FLUX.1-dev transformer (11.9 B; 1024x1024 without CFG: batch 1, 512x4096 T5
    /// context, pooled 768, guidance 3.5).
    #[value(name = "flux-dev")]
    FluxDev,
    /// The Qwen-Image transformer (20.4 B; 1024x1024, one pass of CFG's two: batch 1, a
    /// 128-token Qwen2.5-VL context of width 3584).
    #[value(name = "qwen-image")]
    QwenImage,
    /// The Qwen2.5-VL-7B language model, Qwen-Image's text encoder (7.6 B): one prompt of 128
    /// tokens (the chat template and the prompt), the last hidden state.
    #[value(name = "qwen25vl-7b")]
    Qwen25Vl7b,
    /// A small language model of the Qwen2.5-VL architecture (4 layers of 128, grouped-query
    /// attention 4/2, vocabulary 1000; 32 tokens): the LLM path on any machine.
    #[value(name = "tiny-llm")]
    TinyLlm,
    /// A small SD3.5-style MMDiT (2 blocks of 128, QK norm, MMDiT-X attention in block 0;
    /// 16x16 latents, 8x64 context): the DiT path on any machine.
    #[value(name = "tiny-dit")]
    TinyDit,
}

/// `--flash-attn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FlashAttn {
    /// As `sd`: the head widths the backend supports on a GPU, none on the CPU and the
    /// simulated device.
    Auto,
    /// The head widths the backend supports, on any device (`--direct on`: every width).
    On,
    /// None.
    Off,
}

/// `--direct`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    /// Yes.
    On,
    /// No.
    Off,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Random f16 UNet weights (LDM layout) into DIR/unet.safetensors
    WriteWeights {
        /// The directory
        dir: PathBuf,
        /// The UNet
        #[arg(long, value_enum, default_value = "sd15")]
        config: ConfigName,
        /// Blocks of a DiT (FLUX: N double and 2N single) or layers of an LLM (default: the
        /// configuration's); `unet` reads
        /// the count back from the file, so a smaller model of the same widths can stand in
        /// for the whole one
        #[arg(long, value_name = "N")]
        blocks: Option<usize>,
    },
    /// One UNet step through the engine (or directly with --direct on)
    Unet(UnetArgs),
    /// The tiny UNet: backend vs CPU, resident and streamed through a budget
    Check {
        /// The ggml backend
        #[arg(long, value_name = "NAME")]
        backend: String,
        /// CPU threads (default: all cores)
        #[arg(long, default_value_t = all_cores())]
        threads: usize,
    },
    /// Host->device copy bandwidth
    CopyBw {
        /// The ggml backend
        #[arg(long, value_name = "NAME")]
        backend: String,
        /// MiB per copy
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Also time pinned copies made of smaller copies, and copies on a thread while
        /// the backend computes long products or many tiny ops (what slows a budgeted
        /// step's uploads)
        #[arg(long, value_enum, default_value = "off")]
        contention: OnOff,
    },
    /// One attention of a model's shape, timed alone in the layouts the models can build
    /// (flash attention through permuted views, per-head contiguous, f16 Q; products and
    /// softmax)
    Attn {
        /// The ggml backend
        #[arg(long, value_name = "NAME", default_value = "CPU")]
        backend: String,
        /// `d,heads,tokens,batch` (repeatable; default: the models' largest attentions)
        #[arg(long, value_name = "D,HEADS,TOKENS,BATCH", value_parser = sd_bench::attn::AttnShape::parse)]
        shape: Vec<sd_bench::attn::AttnShape>,
        /// Variants to time (repeatable; default: all)
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(sd_bench::attn::VARIANTS))]
        variant: Vec<String>,
        /// Timed computes per variant (the median is reported)
        #[arg(long, default_value_t = 10)]
        iters: usize,
        /// CPU threads (default: all cores)
        #[arg(long, default_value_t = all_cores())]
        threads: usize,
    },
}

/// `sd-bench unet`.
#[derive(Debug, clap::Args)]
struct UnetArgs {
    /// The weights (from write-weights)
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// The ggml backend
    #[arg(long, value_name = "NAME", default_value = "CPU")]
    backend: String,
    /// Budget: a fraction of the weight bytes (<= 1, e.g. 0.25) or bytes
    #[arg(long = "max-vram", value_name = "FRAC|BYTES")]
    max_vram: Option<String>,
    /// Where the weights live (default: device without --max-vram, else pinned)
    #[arg(long, value_enum)]
    params: Option<ParamsMode>,
    /// Timed steps
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Flash attention
    #[arg(long = "flash-attn", value_enum, default_value = "auto")]
    flash_attn: FlashAttn,
    /// Write the inputs and the output as raw f32 into DIR
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// The UNet
    #[arg(long, value_enum, default_value = "sd15")]
    config: ConfigName,
    /// CPU threads (default: all cores, as `sd -t`)
    #[arg(long, default_value_t = all_cores())]
    threads: usize,
    /// Bytes of the budget left to the backend's own allocations (default: the manager's)
    #[arg(long = "runtime-reserve", value_name = "BYTES")]
    runtime_reserve: Option<u64>,
    /// The latent side (default: the model's usual, 64 for SD1.5); smaller for quick runs
    /// on a simulated device
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(2..))]
    latent: Option<u32>,
    /// Time the step without the engine
    #[arg(long, value_enum, default_value = "off")]
    direct: OnOff,
    /// The staging pool of streamed weights (one device buffer per session)
    #[arg(long = "staging-pool", value_enum, default_value = "on")]
    staging_pool: OnOff,
    /// Run the graph kept from the previous step when the graph runs whole (nothing
    /// built or allocated; CUDA graphs replay it); off: a new graph copy each step
    #[arg(long = "reuse-graphs", value_enum, default_value = "on")]
    reuse_graphs: OnOff,
    /// Queue each segment's compute and prepare the next one on the host while it runs
    /// (where the backend queues work); off: wait for each segment before the next
    #[arg(long = "async-compute", value_enum, default_value = "on")]
    async_compute: OnOff,
    /// With async compute, the most segments queued and not waited for (1: wait for the
    /// segment in flight before queueing the next; see `StreamingOptions::segments_in_flight`)
    #[arg(long = "segments-in-flight", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    segments_in_flight: u32,
    /// Prefetch uploads queued on a copy stream of the device (a second backend, ordered
    /// against compute with events) where the backend has one; off: copied on a transfer
    /// thread
    #[arg(long = "async-upload", value_enum, default_value = "off")]
    async_upload: OnOff,
    /// How many segments ahead weights are prefetched under a budget (1: only the next
    /// segment's; default: as far as the budget has room)
    #[arg(long = "prefetch-depth", value_name = "SEGMENTS", value_parser = clap::value_parser!(u32).range(1..))]
    prefetch_depth: Option<u32>,
    /// Under a budget with a staging pool, keep a fixed set of segments' weights on the
    /// device from step to step and stream the rest (off: evict the least recently used)
    #[arg(long = "resident-set", value_enum, default_value = "on")]
    resident_set: OnOff,
    /// The resident set weighs each segment's streamed share by the compute before it (see
    /// `StreamingOptions::compute_aware_residency`)
    #[arg(long = "compute-aware-residency", value_enum, default_value = "off")]
    compute_aware_residency: OnOff,
    /// Merged segments' weights within a quarter of the pool's room (see
    /// `StreamingOptions::pool_sized_segments`)
    #[arg(long = "pool-sized-segments", value_enum, default_value = "on")]
    pool_sized_segments: OnOff,
    /// `--segment-weight-share N`: a merged segment's weights within 1/N of the room for
    /// weights (`StreamingOptions::segment_weight_share`).
    #[arg(long = "segment-weight-share", default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    segment_weight_share: usize,
    /// `--refine-for-residency on`: finer segments for a larger resident set
    /// (`StreamingOptions::refine_for_residency`).
    #[arg(long = "refine-for-residency", value_enum, default_value = "off")]
    refine_for_residency: OnOff,
    /// How many segments' weights the staging pool is to hold at once (the one computing
    /// and those prefetched behind it; see `StreamingOptions::stream_window`)
    #[arg(long = "stream-window", value_name = "SEGMENTS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    stream_window: u32,
    /// With segments in flight, let the next segments' prefetches evict (unpinned weights)
    /// at once instead of after the segments before the current one are done (see
    /// `StreamingOptions::evict_in_flight`)
    #[arg(long = "evict-in-flight", value_enum, default_value = "on")]
    evict_in_flight: OnOff,
    /// The last segments of a step also prefetch the next step's first segments (see
    /// `StreamingOptions::next_pass_prefetch`)
    #[arg(long = "next-pass-prefetch", value_enum, default_value = "on")]
    next_pass_prefetch: OnOff,
    /// Streamed weights go back to the staging-pool offsets they had the step before (see
    /// `ModelManager::set_stable_placement`)
    #[arg(long = "stable-placement", value_enum, default_value = "off")]
    stable_placement: OnOff,
    /// Cuts go back to the cut-cache buffers they had the step before, the cache keeping
    /// a spare quota per size (see `StreamingOptions::stable_cuts`)
    #[arg(long = "stable-cuts", value_enum, default_value = "off")]
    stable_cuts: OnOff,
    /// Report the last step's timeline: per segment when it was prepared, launched and
    /// done on the device, and when each transfer thread job copied (see
    /// `StreamingOptions::timeline`, `ModelManager::set_upload_log`)
    #[arg(long = "timeline", value_enum, default_value = "off")]
    timeline: OnOff,
    /// Keep the step's graph from step to step and feed it new inputs, as `sd`'s sampling
    /// loop does (`Runtime::run_keyed`: nothing built, captured or planned after the first
    /// step); off: built again at every step
    #[arg(long = "keep-graph", value_enum, default_value = "on")]
    keep_graph: OnOff,
    /// On a GPU, convolutions with f16 kernels as ggml's direct convolution (an implicit
    /// GEMM on CUDA; see `RuntimeOptions::direct_conv`) instead of im2col + product
    #[arg(long = "conv-direct", value_enum, default_value = "off")]
    conv_direct: OnOff,
    /// Under a budget on a GPU, convolutions whose im2col exceeds the budget / N run in
    /// row bands, feed-forwards in chunks of tokens (see `RuntimeOptions::band_divisor`);
    /// 0: whole ops
    #[arg(long = "band-divisor", default_value_t = 8)]
    band_divisor: u64,
    /// On a GPU, flash attention of head widths under 64 at width 64, zeros appended (see
    /// `RuntimeOptions::flash_attn_pad`), in the engine's runs and the bare graph alike
    #[arg(long = "flash-pad", value_enum, default_value = "on")]
    flash_pad: OnOff,
    /// How many of the next step's first segments the last segments may prefetch (see
    /// `StreamingOptions::next_pass_segments`)
    #[arg(long = "next-pass-segments", default_value_t = 2)]
    next_pass_segments: usize,
    /// How many prefetches preparing one segment may queue (see
    /// `StreamingOptions::prefetches_per_segment`)
    #[arg(long = "prefetches-per-segment", default_value_t = 2)]
    prefetches_per_segment: usize,
    /// A deep prefetch may evict weights of segments after its target (see
    /// `StreamingOptions::evict_later_uses`)
    #[arg(long = "evict-later-uses", value_enum, default_value = "off")]
    evict_later_uses: OnOff,
    /// Convert the linear weights when loading (as `sd --type`: bf16, q8_0, q4_K, f16...;
    /// default: the file's)
    #[arg(long = "type", value_name = "TYPE")]
    weight_type: Option<String>,
    /// On the CPU backend, this project's CPU kernels where they replace ggml's (the
    /// convolutions' im2col), as `sd` uses them; off: ggml's own
    #[arg(long = "host-kernels", value_enum, default_value = "on")]
    host_kernels: OnOff,
}

/// The default CPU thread count: the cores the process may use (ggml's threads spin at
/// their barriers, so more threads than cores costs several times the step).
fn all_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Whether uploads are coalesced: the manager's default (on) unless `SD_BENCH_COALESCE=0`.
fn coalesce_uploads() -> bool {
    std::env::var("SD_BENCH_COALESCE").map_or(true, |v| v != "0")
}

fn main() -> ExitCode {
    // The engine's decisions (segments, prefetches, evictions) with RUST_LOG, on stderr;
    // with SD_BENCH_SPAN_TIMES=1, the host time of the engine's spans per timed step
    // (`span_times` in the JSON line).
    {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        use tracing_subscriber::Layer;
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::from_default_env());
        let spans = std::env::var("SD_BENCH_SPAN_TIMES")
            .is_ok_and(|v| v == "1")
            .then(|| {
                let targets = tracing_subscriber::filter::Targets::new()
                    .with_target("sd_exec", tracing::Level::DEBUG)
                    .with_target("sd_residency", tracing::Level::DEBUG)
                    .with_target("sd_pipeline", tracing::Level::DEBUG);
                sd_bench::span_times::SpanTimes.with_filter(targets)
            });
        let _ = tracing_subscriber::registry()
            .with(fmt)
            .with(spans)
            .try_init();
    }
    let args = match Args::try_parse_from(std::env::args_os()) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(BenchError::Usage(m)) => {
            eprintln!("sd-bench: {m}\nhint: 'sd-bench --help' lists the commands");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("sd-bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> Result<()> {
    let mut loaded = Device::load_modules_from_env()?;
    for m in &args.module {
        loaded.extend(Device::load_module(m)?);
    }
    if !loaded.is_empty() {
        eprintln!("sd-bench: backend modules added devices {loaded:?}");
    }
    match args.cmd {
        Cmd::WriteWeights {
            dir,
            config,
            blocks,
        } => {
            let cfg = with_blocks(config_of(config), blocks)?;
            let path = dir.join("unet.safetensors");
            let t0 = Instant::now();
            let bytes = write_weights(&cfg, &path, 1)?;
            println!(
                "{}",
                json!({"cmd": "write-weights", "path": path, "weight_bytes": bytes,
                       "seconds": t0.elapsed().as_secs_f64()})
            );
            Ok(())
        }
        Cmd::Unet(a) => cmd_unet(&a),
        Cmd::Check { backend, threads } => cmd_check(&backend, threads),
        Cmd::CopyBw {
            backend,
            mib,
            contention,
        } => cmd_copy_bw(&backend, mib, contention == OnOff::On),
        Cmd::Attn {
            backend,
            shape,
            variant,
            iters,
            threads,
        } => {
            let shapes: Vec<(String, sd_bench::attn::AttnShape)> = if shape.is_empty() {
                sd_bench::attn::MODEL_SHAPES
                    .iter()
                    .map(|(l, s)| (l.to_string(), *s))
                    .collect()
            } else {
                shape
                    .iter()
                    .map(|s| (format!("{},{},{},{}", s.d, s.heads, s.tokens, s.batch), *s))
                    .collect()
            };
            let variants: Vec<String> = if variant.is_empty() {
                sd_bench::attn::VARIANTS
                    .iter()
                    .map(|v| v.to_string())
                    .collect()
            } else {
                variant
            };
            sd_bench::attn::cmd_attn(&backend, &shapes, &variants, iters, threads)
        }
    }
}

/// What a benchmark configuration builds: a diffusion network, or a decoder-only language
/// model used as a text encoder.
enum BenchArch {
    Diffusion(DiffusionArch),
    Llm(LlmConfig),
}

/// The network declared from a [`BenchArch`].
enum BenchNet {
    Diffusion(Box<DiffusionNet>),
    Llm(LlmModel),
}

impl BenchArch {
    /// Latent channels (the LLM: 1).
    fn in_channels(&self) -> usize {
        match self {
            BenchArch::Diffusion(d) => d.in_channels(),
            BenchArch::Llm(_) => 1,
        }
    }
}

/// `cfg` with `blocks` transformer blocks (DiTs) or layers (LLMs); UNets have none to set.
fn with_blocks(cfg: BenchArch, blocks: Option<usize>) -> Result<BenchArch> {
    let Some(n) = blocks else {
        return Ok(cfg);
    };
    if n == 0 {
        return Err(BenchError::Usage("--blocks must be at least 1".into()));
    }
    Ok(match cfg {
        BenchArch::Llm(l) => BenchArch::Llm(LlmConfig {
            num_hidden_layers: n,
            ..l
        }),
        BenchArch::Diffusion(DiffusionArch::QwenImage(q)) => {
            BenchArch::Diffusion(DiffusionArch::QwenImage(QwenImageConfig {
                num_layers: n,
                ..q
            }))
        }
        BenchArch::Diffusion(DiffusionArch::Mmdit(m)) => {
            BenchArch::Diffusion(DiffusionArch::Mmdit(MmditConfig { depth: n, ..m }))
        }
        // FLUX: N double-stream and 2N single-stream blocks (the whole model's 19 and 38).
        BenchArch::Diffusion(DiffusionArch::Flux(f)) => {
            BenchArch::Diffusion(DiffusionArch::Flux(FluxConfig {
                depth: n,
                depth_single_blocks: 2 * n,
                ..f
            }))
        }
        _ => {
            return Err(BenchError::Usage(
                "--blocks applies to flux-dev, qwen-image, the SD3 configurations and the LLMs"
                    .into(),
            ))
        }
    })
}

fn config_of(name: ConfigName) -> BenchArch {
    match name {
        ConfigName::Qwen25Vl7b => return BenchArch::Llm(LlmConfig::qwen2_5_vl_7b()),
        ConfigName::TinyLlm => {
            return BenchArch::Llm(LlmConfig {
                vocab_size: 1000,
                hidden_size: 128,
                intermediate_size: 256,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 32,
                ..LlmConfig::qwen2_5_vl_7b()
            })
        }
        _ => {}
    }
    BenchArch::Diffusion(match name {
        ConfigName::Sd15 => DiffusionArch::Unet(UnetConfig::sd1()),
        ConfigName::Tiny => DiffusionArch::Unet(tiny_config()),
        ConfigName::Sdxl => DiffusionArch::Unet(UnetConfig::sdxl()),
        ConfigName::Sd35Large => DiffusionArch::Mmdit(MmditConfig::sd35_large()),
        ConfigName::Sd35Medium => DiffusionArch::Mmdit(MmditConfig::sd35_medium()),
        ConfigName::FluxDev => DiffusionArch::Flux(FluxConfig::dev()),
        ConfigName::QwenImage => DiffusionArch::QwenImage(QwenImageConfig::default()),
        ConfigName::TinyDit => DiffusionArch::Mmdit(MmditConfig {
            hidden_size: 128,
            num_heads: 2,
            depth: 2,
            context_dim: 64,
            pooled_dim: 64,
            pos_embed_max_size: 16,
            dual_attention_layers: vec![0],
            ..MmditConfig::sd35_large()
        }),
        ConfigName::Qwen25Vl7b | ConfigName::TinyLlm => unreachable!("handled above"),
    })
}

/// A small UNet of the SD1 architecture whose head widths (64, 128) every backend's flash
/// attention supports: two levels, attention at both.
fn tiny_config() -> UnetConfig {
    UnetConfig {
        model_channels: 128,
        channel_mult: vec![1, 2],
        num_res_blocks: 1,
        attention_resolutions: vec![1, 2],
        heads: HeadSpec::Heads(2),
        context_dim: 64,
        ..UnetConfig::sd1()
    }
}

/// Declares the network's parameters (from `catalog`, or synthetic f32 without one).
/// `unet --type`: the type the linear weights are converted to when loaded (set once, before
/// any model is declared; `write-weights` always writes f16).
static WEIGHT_TYPE: std::sync::OnceLock<DType> = std::sync::OnceLock::new();

/// `--conv-direct on`: convolutions with f16 kernels as ggml's direct convolution on a GPU
/// (`RuntimeOptions::direct_conv`), in the engine's runs and the bare graph alike.
static CONV_DIRECT: AtomicBool = AtomicBool::new(false);

/// `--flash-pad on|off`: see `RuntimeOptions::flash_attn_pad`.
static FLASH_PAD: AtomicBool = AtomicBool::new(true);

/// `--band-divisor N` (0: off): see `RuntimeOptions::band_divisor`.
static BAND_DIVISOR: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(8);

fn declare(cfg: &BenchArch, catalog: Option<&TensorCatalog>) -> Result<(BenchNet, Params)> {
    let pb = ParamBuilder::new(catalog, DEFAULT_PARAM_CAPACITY)?;
    if catalog.is_some() {
        pb.set_weight_type(WEIGHT_TYPE.get().copied());
    }
    let model = declare_in(&pb, cfg)?;
    Ok((model, pb.finish()))
}

/// Declares the network's parameters in `pb`.
fn declare_in(pb: &ParamBuilder<'_>, cfg: &BenchArch) -> std::result::Result<BenchNet, ModelError> {
    Ok(match cfg {
        BenchArch::Diffusion(d) => BenchNet::Diffusion(Box::new(DiffusionNet::new(pb, d)?)),
        BenchArch::Llm(c) => BenchNet::Llm(LlmModel::new(pb, c.clone())?),
    })
}

/// A deterministic uniform stream in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Writes random f16 weights for `cfg` in the LDM layout (`model.diffusion_model.*`, as SD1.5
/// checkpoints store them) to `path`; returns the data bytes. Matrices and kernels are
/// uniform with variance 1/(3 fan_in); norm gains 1 ± 0.1; biases ± 0.02.
fn write_weights(cfg: &BenchArch, path: &Path, seed: u64) -> Result<u64> {
    let (_, params) = declare(cfg, None)?;
    let mut header = String::from("{");
    let mut offset = 0u64;
    let mut shapes = Vec::new();
    for (i, (name, t)) in params.tensors.iter().enumerate() {
        let shape = t.shape(t.n_dims());
        let n: usize = shape.iter().product();
        let end = offset + 2 * n as u64;
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"F16\",\"shape\":{shape:?},\"data_offsets\":[{offset},{end}]}}"
        ));
        shapes.push((name.clone(), shape));
        offset = end;
    }
    header.push('}');
    while (8 + header.len()) % 64 != 0 {
        header.push(' ');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let tmp = path.with_extension("tmp");
    let file = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(header.as_bytes()))
        .map_err(io_err(&tmp))?;
    let mut rng = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    let mut buf = Vec::new();
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        let (base, scale) = if shape.len() >= 2 {
            (0.0, (1.0 / fan_in as f32).sqrt())
        } else if name.ends_with(".weight") {
            (1.0, 0.1)
        } else {
            (0.0, 0.02)
        };
        buf.clear();
        buf.reserve(2 * n);
        for _ in 0..n {
            let v = half::f16::from_f32(base + scale * rng.next());
            buf.extend_from_slice(&v.to_le_bytes());
        }
        w.write_all(&buf).map_err(io_err(&tmp))?;
    }
    w.flush().map_err(io_err(&tmp))?;
    drop(w);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(offset)
}

/// Samples the lowest free memory of a device from a thread.
struct PeakSampler {
    stop: Arc<AtomicBool>,
    min_free: Arc<AtomicU64>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl PeakSampler {
    fn start(device: Device) -> PeakSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let min_free = Arc::new(AtomicU64::new(device.memory().free));
        let (s, m) = (stop.clone(), min_free.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                m.fetch_min(device.memory().free, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        PeakSampler {
            stop,
            min_free,
            handle: Some(handle),
        }
    }
    fn min_free(&self) -> u64 {
        self.min_free.load(Ordering::Relaxed)
    }
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Deterministic inputs of one step: latents `[W, H, C, B]`, timesteps `[B]`, context
/// `[D, N, B]`, and what the network also reads.
struct Inputs {
    w: usize,
    b: usize,
    n_ctx: usize,
    /// Latent channels.
    c: usize,
    /// Context width.
    d: usize,
    x: Vec<f32>,
    t: Vec<f32>,
    ctx: Vec<f32>,
    /// The class / pooled vector `[width, B]` of models with one (SDXL, SD3, FLUX).
    y: Option<(usize, Vec<f32>)>,
    /// The distilled guidance `[B]` (FLUX.1-dev).
    guidance: Option<Vec<f32>>,
    /// Token ids `[W]` (the LLM's only input; empty for diffusion networks).
    ids: Vec<i32>,
}

impl Inputs {
    /// `w` is the latent side, or the LLM's token count.
    fn new(cfg: &BenchArch, w: usize, b: usize, n_ctx: usize) -> Inputs {
        let mut rng = Rng(77);
        let cfg = match cfg {
            BenchArch::Diffusion(d) => d,
            BenchArch::Llm(l) => {
                let vocab = l.vocab_size as f32;
                let ids = (0..w * b)
                    .map(|_| ((rng.next() * 0.5 + 0.5) * vocab).min(vocab - 1.0) as i32)
                    .collect();
                return Inputs {
                    w,
                    b,
                    n_ctx: 0,
                    c: 1,
                    d: 0,
                    x: Vec::new(),
                    t: Vec::new(),
                    ctx: Vec::new(),
                    y: None,
                    guidance: None,
                    ids,
                };
            }
        };
        let c = cfg.in_channels();
        let x = (0..w * w * c * b).map(|_| rng.next()).collect();
        // The network's time: a DDPM timestep, sigma x 1000 (SD3) or sigma (FLUX).
        let (d, y, t, guidance) = match cfg {
            DiffusionArch::Unet(u) => (
                u.context_dim,
                u.adm_in_channels,
                (0..b).map(|i| 999.0 - 500.0 * i as f32).collect(),
                None,
            ),
            DiffusionArch::Mmdit(m) => (m.context_dim, Some(m.pooled_dim), vec![700.0; b], None),
            DiffusionArch::Flux(f) => (
                f.context_in_dim,
                Some(f.vec_in_dim),
                vec![0.7; b],
                f.guidance_embed.then(|| vec![3.5; b]),
            ),
            DiffusionArch::QwenImage(q) => (q.joint_attention_dim, None, vec![0.7; b], None),
        };
        let ctx = (0..d * n_ctx * b).map(|_| rng.next()).collect();
        let y = y.map(|n| (n, (0..n * b).map(|_| rng.next()).collect()));
        Inputs {
            w,
            b,
            n_ctx,
            c,
            d,
            x,
            t,
            ctx,
            y,
            guidance,
            ids: Vec::new(),
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One step of the benchmarked network through a [`Runtime`]: the path `sd` runs (one engine,
/// one residency manager, the model's own session; the step's graph kept from step to step
/// and fed new inputs, as `sd`'s sampling loop does, or built again at each call).
struct Rig {
    rt: Runtime,
    model_handle: ModelHandle,
    model: BenchNet,
    /// Matrix-product and attention FLOPs of one step, counted from the graph.
    flops: f64,
    /// Whether the step's graph is kept ([`Runtime::run_keyed`]).
    keep_graph: bool,
}

/// How to build a [`Rig`].
struct RigOptions<'a> {
    cfg: &'a BenchArch,
    weights: &'a Path,
    /// The compute device (`CPU`, `sim:MiB`, or a ggml device name).
    device: ComputeDevice,
    mode: ParamsMode,
    /// The `--max-vram` budget in bytes (the backend runtime's reserve included).
    budget: Option<u64>,
    flash_attn: FlashAttn,
    threads: usize,
    /// How the session streams weights under the budget.
    streaming: StreamingOptions,
    /// Whether prefetch uploads go to the device's copy stream where it has one.
    async_upload: bool,
    /// Whether streamed weights keep their staging-pool offsets from step to step.
    stable_placement: bool,
    /// Bytes of the budget left to the backend runtime (`None`: measured, as `sd` does).
    runtime_reserve: Option<u64>,
    /// This project's CPU kernels where the CPU backend computes.
    host_kernels: bool,
    /// Whether the step's graph is kept from step to step.
    keep_graph: bool,
}

impl RigOptions<'_> {
    /// The runtime's options (`sd`'s, with the benchmark's switches).
    fn runtime_options(&self) -> Result<RuntimeOptions> {
        if self.budget.is_some() && self.device == ComputeDevice::Cpu {
            return Err(BenchError::Usage(
                "--max-vram budgets a device that is not the CPU (for a CPU study: --backend sim:MiB)"
                    .into(),
            ));
        }
        Ok(RuntimeOptions {
            compute: self.device.clone(),
            params: match self.mode {
                ParamsMode::Device => ParamsLocation::Device,
                ParamsMode::Pinned | ParamsMode::Ram => ParamsLocation::Ram,
                ParamsMode::Disk => ParamsLocation::Disk,
            },
            max_vram: self.budget.map(|b| MaxVram {
                default: Some(BudgetSpec::Bytes(b)),
                per_device: Vec::new(),
            }),
            threads: self.threads,
            flash_attn: match self.flash_attn {
                FlashAttn::Auto => None,
                FlashAttn::On => Some(true),
                FlashAttn::Off => Some(false),
            },
            weight_type: WEIGHT_TYPE.get().copied(),
            host_kernels: self.host_kernels,
            f32_products: sd_models::bench::f32_products(),
            direct_conv: CONV_DIRECT.load(Ordering::Relaxed),
            flash_attn_pad: FLASH_PAD.load(Ordering::Relaxed),
            band_divisor: match BAND_DIVISOR.load(Ordering::Relaxed) {
                0 => None,
                d => Some(d),
            },
            streaming: self.streaming.clone(),
            uploads: UploadOptions {
                pinned_host_params: self.mode != ParamsMode::Ram,
                // A/B switch for the coalesced uploads (SD_BENCH_COALESCE=0: off).
                coalesce: coalesce_uploads(),
                copy_stream: self.async_upload,
                stable_placement: self.stable_placement,
            },
            runtime_reserve: self.runtime_reserve,
            ..RuntimeOptions::default()
        })
    }
}

/// The runtime of a rig, before any weight is placed (its reserve measured): device memory
/// is sampled from here on.
fn start_runtime(o: &RigOptions<'_>) -> Result<Runtime> {
    let mut loader = TensorCatalog::new();
    loader.add_file(o.weights, None)?;
    Ok(Runtime::new(o.runtime_options()?, loader)?)
}

/// Adds the network to `rt` (its weights as the runtime places them) and counts the step's
/// FLOPs from one graph built apart.
fn build_rig(o: &RigOptions<'_>, mut rt: Runtime, inputs: &Inputs) -> Result<Rig> {
    let component = match o.cfg {
        BenchArch::Diffusion(_) => Component::Diffusion,
        BenchArch::Llm(_) => Component::TextEncoder,
    };
    let (model_handle, model) = rt.add_model("unet", component, SourceId::MAIN, |pb| {
        declare_in(pb, o.cfg)
    })?;
    let flops = {
        let (_g, graph, _, _) = unet_graph(&model, inputs, &[], false)?;
        sd_models::bench::graph_flops(&graph)
    };
    Ok(Rig {
        rt,
        model_handle,
        model,
        flops,
        keep_graph: o.keep_graph,
    })
}

impl Rig {
    /// One step: the graph built and executed through the runtime.
    fn step(&mut self, inputs: &Inputs) -> Result<RunOutput> {
        let model = &self.model;
        if !self.keep_graph {
            return Ok(self.rt.run(self.model_handle, "unet step", GRAPH, |g| {
                step_graph(g, model, inputs)
            })?);
        }
        Ok(self.rt.run_keyed(
            self.model_handle,
            "unet step",
            GRAPH,
            GraphKey(0),
            step_data(model, inputs),
            |g| {
                let built = step_graph(g, model, inputs)?;
                Ok(KeyedGraph {
                    output: built.output,
                    inputs: built.inputs.into_iter().map(|(t, _)| t).collect(),
                })
            },
        )?)
    }
}

/// The data of [`step_graph`]'s inputs, in its order.
fn step_data(model: &BenchNet, inputs: &Inputs) -> Vec<HostData> {
    if let BenchNet::Llm(_) = model {
        return vec![HostData::I32(inputs.ids.clone())];
    }
    let mut data = vec![
        HostData::F32(inputs.x.clone()),
        HostData::F32(inputs.t.clone()),
        HostData::F32(inputs.ctx.clone()),
    ];
    if let Some((_, y)) = &inputs.y {
        data.push(HostData::F32(y.clone()));
    }
    if let Some(g) = &inputs.guidance {
        data.push(HostData::F32(g.clone()));
    }
    data
}

const GRAPH: usize = 32768;

/// Builds one step of `model` in `g`: the output and the input leaves with their data
/// (latents, timesteps, context, `y`, guidance; token ids for the LLM).
fn step_graph(
    g: &mut GraphCtx,
    model: &BenchNet,
    inputs: &Inputs,
) -> std::result::Result<BuiltGraph, ModelError> {
    let ctx = g.ctx.clone();
    let input = |name: &str, ne: &[usize]| -> std::result::Result<GTensor, ModelError> {
        let t = ctx.new_tensor(DType::F32, ne)?;
        t.set_name(name);
        t.set_input();
        Ok(t)
    };
    let model = match model {
        BenchNet::Diffusion(d) => d,
        BenchNet::Llm(llm) => {
            let ids = ctx.new_tensor(DType::I32, &[inputs.w, inputs.b])?;
            ids.set_name("input_ids");
            ids.set_input();
            let output = llm.forward(g, &ids)?;
            return Ok(BuiltGraph {
                output,
                inputs: vec![(ids, HostData::I32(inputs.ids.clone()))],
            });
        }
    };
    let x = input("x", &[inputs.w, inputs.w, inputs.c, inputs.b])?;
    let t = input("timesteps", &[inputs.b])?;
    let c = input("context", &[inputs.d, inputs.n_ctx, inputs.b])?;
    let y = match &inputs.y {
        Some((n, _)) => Some(input("y", &[*n, inputs.b])?),
        None => None,
    };
    let gd = match &inputs.guidance {
        Some(_) => Some(input("guidance", &[inputs.b])?),
        None => None,
    };
    let mut di = DiffusionInputs::new(&x, &t);
    di.context = Some(&c);
    di.y = y.as_ref();
    di.guidance = gd.as_ref();
    let output = model.forward(g, &di)?;
    let mut feeds = vec![
        (x.clone(), HostData::F32(inputs.x.clone())),
        (t.clone(), HostData::F32(inputs.t.clone())),
        (c.clone(), HostData::F32(inputs.ctx.clone())),
    ];
    if let (Some(y), Some((_, data))) = (y, &inputs.y) {
        feeds.push((y, HostData::F32(data.clone())));
    }
    if let (Some(gd), Some(data)) = (gd, &inputs.guidance) {
        feeds.push((gd, HostData::F32(data.clone())));
    }
    Ok(BuiltGraph {
        output,
        inputs: feeds,
    })
}

/// The step's graph apart from any runtime (the direct timing, FLOP counts): its context
/// (with cut marks), the graph, the output and the input leaves with their data (auxiliary
/// inputs too). `on_cpu`: the CPU backend computes it (its own kernels, as `sd` uses them).
#[allow(clippy::type_complexity)]
fn unet_graph(
    model: &BenchNet,
    inputs: &Inputs,
    flash_attn: &[usize],
    on_cpu: bool,
) -> Result<(
    GraphCtx,
    sd_tensor::ggml::Graph,
    GTensor,
    Vec<(GTensor, HostData)>,
)> {
    let mut g = GraphCtx::new(
        GRAPH,
        GRAPH,
        ComputeOptions {
            exact: false,
            flash_attn: !flash_attn.is_empty(),
            host_kernels: on_cpu,
        },
    )?;
    g.flash_attn_head_dims = Some(flash_attn.to_vec());
    if !on_cpu && FLASH_PAD.load(Ordering::Relaxed) {
        g.flash_attn_pad_to = Some(sd_pipeline::runtime::FLASH_ATTN_PAD_WIDTH);
    }
    g.ctx
        .set_direct_conv(!on_cpu && CONV_DIRECT.load(Ordering::Relaxed));
    let built = step_graph(&mut g, model, inputs)?;
    let out = built.output;
    out.set_output();
    let mut graph = sd_tensor::ggml::Graph::new(&g.ctx, GRAPH)?;
    graph.build_forward_expand(&out)?;
    // With the host-made inputs the network added (RoPE tables, masks).
    let mut feeds = built.inputs;
    feeds.extend(g.aux.iter().map(|a| (a.tensor.clone(), a.data.clone())));
    Ok((g, graph, out, feeds))
}

/// The same step without the engine: weights in one device buffer, the graph allocated once
/// with ggml's graph allocator, then `compute` + `synchronize` timed `steps` times (the
/// engine's per-step overhead is the difference to the resident engine step).
fn direct_step_ms(
    cfg: &BenchArch,
    weights: &Path,
    backend: &Backend,
    inputs: &Inputs,
    flash_attn: &[usize],
    host_kernels: bool,
    steps: usize,
) -> Result<Vec<f64>> {
    let mut loader = TensorCatalog::new();
    loader.add_file(weights, None)?;
    let (model, params) = declare(cfg, Some(&loader))?;
    let _wbuf = backend.buffer_type().alloc_context_tensors(&params.ctx)?;
    for (name, t) in &params.tensors {
        let dtype = t
            .dtype()
            .ok_or_else(|| BenchError::Check(format!("`{name}` has no dtype")))?;
        t.write_bytes(0, &loader.read_converted(name, dtype)?)?;
    }
    let (_g, graph, _out, feeds) = unet_graph(&model, inputs, flash_attn, host_kernels)?;
    let mut galloc = sd_tensor::ggml::Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&graph)?;
    for (t, data) in &feeds {
        data.write_to(t)?;
    }
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 2 {
        let t0 = Instant::now();
        backend.compute(&graph)?;
        backend.synchronize();
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(times)
}

/// The head widths of `cfg` whose `flash_attn_ext` (f32 Q, f16 K/V) `backend` runs.
fn flash_attn_dims(backend: &Backend, cfg: &BenchArch) -> Result<Vec<usize>> {
    let ctx = Context::new_descriptors(64, 1, 0)?;
    let mut dims = Vec::new();
    for d in all_head_dims(cfg)? {
        let q = ctx.new_tensor(DType::F32, &[d, 256, 2, 1])?;
        let k = ctx.new_tensor(DType::F16, &[d, 256, 2, 1])?;
        let v = ctx.new_tensor(DType::F16, &[d, 256, 2, 1])?;
        let o = ctx.flash_attn_ext(&q, &k, &v, None, 0.125)?;
        if backend.supports_op(&o) {
            dims.push(d);
        }
    }
    Ok(dims)
}

/// Every head width of `cfg` whose attention can use flash attention (the LLM's: none), and
/// with `--flash-pad on` the width narrower heads are padded to.
fn all_head_dims(cfg: &BenchArch) -> Result<Vec<usize>> {
    let mut dims = Vec::new();
    let cfg = match cfg {
        BenchArch::Diffusion(d) => d,
        BenchArch::Llm(_) => return Ok(dims),
    };
    match cfg {
        DiffusionArch::Unet(u) => {
            for mult in &u.channel_mult {
                let d = u.heads.split(u.model_channels * mult)?.1;
                if !dims.contains(&d) {
                    dims.push(d);
                }
            }
        }
        DiffusionArch::Mmdit(m) => dims.push(m.head_dim()),
        DiffusionArch::Flux(f) => dims.push(f.head_dim()),
        DiffusionArch::QwenImage(q) => dims.push(q.head_dim()),
    }
    // `--flash-pad on`: narrower heads run at the padded width, which must be allowed too.
    let pad = sd_pipeline::runtime::FLASH_ATTN_PAD_WIDTH;
    if FLASH_PAD.load(Ordering::Relaxed) && dims.iter().any(|&d| d < pad) && !dims.contains(&pad) {
        dims.push(pad);
    }
    Ok(dims)
}

fn parse_budget(s: &str, weight_bytes: u64) -> Result<u64> {
    let v: f64 = s
        .parse()
        .map_err(|_| BenchError::Usage(format!("--max-vram: `{s}` is not a number")))?;
    if v.is_nan() || v <= 0.0 {
        return Err(BenchError::Usage(format!("--max-vram: `{s}` must be > 0")));
    }
    Ok(if v <= 1.0 {
        (v * weight_bytes as f64) as u64
    } else {
        v as u64
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The device `--backend` names, read as `sd` reads it (`cpu`, `sim:<size>`: a simulated
/// device of that size, MiB without a unit; or a ggml device name).
fn parse_device(name: &str) -> Result<ComputeDevice> {
    name.parse().map_err(|e: String| {
        BenchError::Usage(format!(
            "--backend {name}: {e} (sim:<size> takes a positive size: MiB, or a number with a unit)"
        ))
    })
}

/// The backend of `device` for `--direct on` (a simulated device: the CPU computing, its
/// memory counted and capped) and its simulated device.
fn direct_backend(
    device: &ComputeDevice,
    threads: usize,
) -> Result<(Arc<Backend>, Option<SimDevice>)> {
    let (backend, sim) = match device {
        ComputeDevice::Cpu => (Backend::cpu(threads)?, None),
        ComputeDevice::Named(name) => (Backend::by_name(name)?, None),
        ComputeDevice::Sim { bytes, page } => {
            let opts = SimOptions {
                threads,
                allocation_granularity: usize::try_from(*page).unwrap_or(usize::MAX),
                ..Default::default()
            };
            let sim = SimDevice::new("SIM0", *bytes, opts)?;
            (sim.backend()?, Some(sim))
        }
    };
    if backend.is_cpu() {
        backend.set_threads(threads);
    }
    Ok((Arc::new(backend), sim))
}

fn cmd_unet(a: &UnetArgs) -> Result<()> {
    CONV_DIRECT.store(a.conv_direct == OnOff::On, Ordering::Relaxed);
    BAND_DIVISOR.store(a.band_divisor, Ordering::Relaxed);
    FLASH_PAD.store(a.flash_pad == OnOff::On, Ordering::Relaxed);
    let weights = a.weights.clone();
    let backend_name = a.backend.as_str();
    let cfg = config_of(a.config);
    if let Some(t) = &a.weight_type {
        let dtype = DType::parse_weight_type(t)
            .ok_or_else(|| BenchError::Usage(format!("--type {t}: not a weight type")))?;
        let _ = WEIGHT_TYPE.set(dtype);
    }
    let steps: usize = a.steps.max(1);
    let threads: usize = a.threads;
    // `sim:MiB`: a simulated device of that size (the CPU computes; its memory is counted
    // and capped, uploads queued on a copy stream), to study streaming without a GPU.
    let device = parse_device(backend_name)?;
    let weight_bytes = {
        let mut l = TensorCatalog::new();
        l.add_file(&weights, None)?;
        let (_, p) = declare(&cfg, Some(&l))?;
        p.nbytes() as u64
    };
    let budget = a
        .max_vram
        .as_deref()
        .map(|s| parse_budget(s, weight_bytes))
        .transpose()?;
    let mode = match a.params {
        Some(m) => m,
        None if budget.is_some() => ParamsMode::Pinned,
        None => ParamsMode::Device,
    };
    if mode == ParamsMode::Device && budget.is_some() {
        return Err(BenchError::Usage(
            "--params device keeps every weight on the device: it takes no --max-vram".into(),
        ));
    }
    let (w, b, n_ctx) = match a.config {
        ConfigName::Sd15 => (64, 2, 77),
        ConfigName::Sdxl => (128, 2, 77),
        ConfigName::Tiny => (16, 2, 8),
        ConfigName::Sd35Large | ConfigName::Sd35Medium => (128, 2, 333),
        ConfigName::FluxDev => (128, 1, 512),
        ConfigName::QwenImage => (128, 1, 128),
        ConfigName::TinyDit => (16, 2, 8),
        ConfigName::Qwen25Vl7b => (128, 1, 0),
        ConfigName::TinyLlm => (32, 1, 0),
    };
    let w = a.latent.map_or(w, |l| l as usize);
    let inputs = Inputs::new(&cfg, w, b, n_ctx);

    if a.direct == OnOff::On {
        let (backend, _sim) = direct_backend(&device, threads)?;
        let flash_attn = match a.flash_attn {
            FlashAttn::On => all_head_dims(&cfg)?,
            FlashAttn::Off => Vec::new(),
            FlashAttn::Auto => flash_attn_dims(&backend, &cfg)?,
        };
        let host_kernels = a.host_kernels == OnOff::On && backend.is_cpu();
        let times = direct_step_ms(
            &cfg,
            &weights,
            &backend,
            &inputs,
            &flash_attn,
            host_kernels,
            steps,
        )?;
        println!(
            "{}",
            json!({"cmd": "unet-direct", "backend": backend.name(), "flash_attn_head_dims": flash_attn,
                   "steps": steps, "step_ms_median": median(times.clone()),
                   "step_ms_min": times.iter().cloned().fold(f64::MAX, f64::min)})
        );
        return Ok(());
    }
    let streaming = StreamingOptions {
        staging_pool: a.staging_pool == OnOff::On,
        reuse_graphs: a.reuse_graphs == OnOff::On,
        async_compute: a.async_compute == OnOff::On,
        segments_in_flight: a.segments_in_flight as usize,
        prefetch_depth: a.prefetch_depth.map_or(usize::MAX, |d| d as usize),
        resident_set: a.resident_set == OnOff::On,
        compute_aware_residency: a.compute_aware_residency == OnOff::On,
        pool_sized_segments: a.pool_sized_segments == OnOff::On,
        segment_weight_share: a.segment_weight_share,
        refine_for_residency: a.refine_for_residency == OnOff::On,
        stream_window: a.stream_window as usize,
        evict_in_flight: a.evict_in_flight == OnOff::On,
        next_pass_prefetch: a.next_pass_prefetch == OnOff::On,
        stable_cuts: a.stable_cuts == OnOff::On,
        timeline: a.timeline == OnOff::On,
        next_pass_segments: a.next_pass_segments,
        prefetches_per_segment: a.prefetches_per_segment,
        evict_later_uses: a.evict_later_uses == OnOff::On,
        ..StreamingOptions::default()
    };
    let options = RigOptions {
        cfg: &cfg,
        weights: &weights,
        device,
        mode,
        budget,
        flash_attn: a.flash_attn,
        threads,
        streaming,
        async_upload: a.async_upload == OnOff::On,
        stable_placement: a.stable_placement == OnOff::On,
        runtime_reserve: a.runtime_reserve,
        host_kernels: a.host_kernels == OnOff::On,
        keep_graph: a.keep_graph == OnOff::On,
    };
    // The runtime measures its backend's own memory (the reserve left out of the budget)
    // before anything of the model is placed; device memory is sampled from then on.
    let rt = start_runtime(&options)?;
    let backend = rt.compute_backend().clone();
    let dev = rt
        .compute_device()
        .ok_or_else(|| BenchError::Usage(format!("backend {backend_name} has no device")))?;
    let reserve = rt.runtime_reserve();
    let granularity = backend.buffer_type().allocation_granularity();
    let flash_attn = if rt.flash_attention() {
        flash_attn_dims(&backend, &cfg)?
    } else {
        Vec::new()
    };
    let host_kernels = options.host_kernels && backend.is_cpu();
    let free_before = dev.memory().free;
    let sampler = PeakSampler::start(dev);
    let t_setup = Instant::now();
    let mut rig = build_rig(&options, rt, &inputs)?;
    let first = rig.step(&inputs)?;
    let setup_s = t_setup.elapsed().as_secs_f64();
    rig.step(&inputs)?;
    let up0 = rig.rt.engine().manager().upload_bytes();
    let sim0 = rig.rt.sim_device().map(|s| s.stats());
    let mut times = Vec::with_capacity(steps);
    let mut last = first.clone();
    let mut unmoved = 0usize;
    let timeline = a.timeline == OnOff::On;
    if timeline {
        rig.rt.engine_mut().manager_mut().set_upload_log(true);
    }
    // The last two steps' transfer thread jobs (the first segments' weights of a step are
    // copied during the step before it).
    let (mut prev_spans, mut last_spans) = (Vec::new(), Vec::new());
    let mut last_t0 = Instant::now();
    sd_bench::span_times::reset();
    for _ in 0..steps {
        let t0 = Instant::now();
        last = rig.step(&inputs)?;
        times.push(t0.elapsed().as_secs_f64());
        unmoved += last.segments.iter().filter(|s| s.graph_unmoved).count();
        last_t0 = t0;
        prev_spans = std::mem::replace(
            &mut last_spans,
            rig.rt.engine_mut().manager_mut().take_upload_spans(),
        );
    }
    let last_end = last_t0 + Duration::from_secs_f64(times.last().copied().unwrap_or(0.0));
    let span_times = sd_bench::span_times::per_step_json(steps);
    let uploaded = rig.rt.engine().manager().upload_bytes() - up0;
    // The simulated device's buffer allocations and frees per timed step.
    let sim_churn = rig.rt.sim_device().zip(sim0).map(|(s, s0)| {
        let s1 = s.stats();
        (
            (s1.allocations - s0.allocations) as f64 / steps as f64,
            (s1.frees - s0.frees) as f64 / steps as f64,
            (s1.frees_in_flight - s0.frees_in_flight) as f64 / steps as f64,
        )
    });
    let sim_faults = rig.rt.sim_device().map(|s| s.stats().faults);
    let session = rig.rt.session_of(rig.model_handle);
    let backend_id = session.and_then(|id| rig.rt.engine().session(id).map(|s| s.backend_id()));
    let copy_stream =
        backend_id.is_some_and(|id| rig.rt.engine_mut().manager_mut().uploads_async(id));
    let staging_pool_bytes = backend_id.and_then(|id| {
        rig.rt
            .engine()
            .manager()
            .staging_pool_bytes(id)
            .map(|p| p.0)
    });
    let peak_used = free_before.saturating_sub(sampler.min_free());
    // Everything in use on the device at the peak, the runtime's context included (what a
    // --max-vram budget counts; other processes' memory too, if any).
    let device_used_peak = dev.memory().total.saturating_sub(sampler.min_free());
    drop(sampler);
    // What one device memory report costs (every capacity check of the engine asks one).
    let t = Instant::now();
    for _ in 0..100 {
        std::hint::black_box(dev.memory());
    }
    let memory_query_us = t.elapsed().as_secs_f64() * 1e6 / 100.0;
    let out = &last.data;
    let finite = out.iter().all(|v| v.is_finite());
    let max_footprint = last
        .segments
        .iter()
        .map(|s| s.footprint())
        .max()
        .unwrap_or(0);
    if let Some(dir) = &a.dump {
        let dir = dir.as_path();
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        for (name, v) in [
            ("x.f32", &inputs.x),
            ("t.f32", &inputs.t),
            ("ctx.f32", &inputs.ctx),
            ("out.f32", out),
        ] {
            let p = dir.join(name);
            std::fs::write(&p, f32_bytes(v)).map_err(io_err(&p))?;
        }
    }
    let repeat_diff = first
        .data
        .iter()
        .zip(out)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let timing = &last.timing;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{}",
        json!({
            "cmd": "unet",
            // The step runs through sd-pipeline's Runtime, as `sd` runs its models.
            "path": "runtime",
            "backend": backend.name(),
            "params": mode.name(),
            "budget_bytes": budget,
            "runtime_reserve_bytes": reserve,
            "allocation_granularity": granularity,
            "coalesced_uploads": coalesce_uploads(),
            "async_upload": a.async_upload == OnOff::On,
            "async_compute": a.async_compute == OnOff::On,
            "segments_in_flight": a.segments_in_flight,
            "prefetch_depth": a.prefetch_depth,
            "resident_set": a.resident_set == OnOff::On,
            "compute_aware_residency": a.compute_aware_residency == OnOff::On,
            "pool_sized_segments": a.pool_sized_segments == OnOff::On,
            "segment_weight_share": a.segment_weight_share,
            "refine_for_residency": a.refine_for_residency == OnOff::On,
            "stream_window": a.stream_window,
            "evict_in_flight": a.evict_in_flight == OnOff::On,
            "next_pass_prefetch": a.next_pass_prefetch == OnOff::On,
            "host_kernels": host_kernels,
            // Whether prefetch uploads went to a copy stream (the backend has one).
            "copy_stream": copy_stream,
            "weight_bytes": weight_bytes,
            "graph_tflops": rig.flops / 1e12,
            "flash_attn_head_dims": flash_attn,
            "latent": [b, cfg.in_channels(), w, w],
            "steps": steps,
            "step_ms_median": median(times.clone()) * 1e3,
            "step_ms_min": times.iter().cloned().fold(f64::MAX, f64::min) * 1e3,
            "setup_and_first_step_s": setup_s,
            "h2d_bytes_per_step": uploaded / steps as u64,
            "segmented": last.segmented,
            "segments": last.segments.len(),
            "prefetched": last.segments.iter().filter(|s| s.prefetched).count(),
            "max_prefetches_ahead": last.segments.iter().map(|s| s.prefetches_ahead).max().unwrap_or(0),
            "graphs_reused": last.segments.iter().filter(|s| s.graph_reused).count(),
            "stable_placement": a.stable_placement == OnOff::On,
            "stable_cuts": a.stable_cuts == OnOff::On,
            "keep_graph": a.keep_graph == OnOff::On,
            "conv_direct": a.conv_direct == OnOff::On,
            "band_divisor": a.band_divisor,
            "flash_pad": a.flash_pad == OnOff::On,
            "next_pass_segments": a.next_pass_segments,
            "prefetches_per_segment": a.prefetches_per_segment,
            "evict_later_uses": a.evict_later_uses == OnOff::On,
            // Segment runs of the timed steps whose graph read and wrote the same addresses
            // as their previous run (ggml's CUDA backend replays those as CUDA graphs).
            "graphs_unmoved_per_step": unmoved as f64 / steps as f64,
            "segments_overlapped": last.segments.iter().filter(|s| s.overlapped).count(),
            "segments_queued_behind": last.segments.iter().filter(|s| s.queued_behind > 0).count(),
            // The simulated device's faults (accesses a GPU would let race or fail; 0 in a correct run).
            "sim_faults": sim_faults,
            "sim_allocations_per_step": sim_churn.map(|c| c.0),
            "sim_frees_per_step": sim_churn.map(|c| c.1),
            "sim_frees_in_flight_per_step": sim_churn.map(|c| c.2),
            "engine_max_footprint_bytes": max_footprint,
            "device_memory_query_us": memory_query_us,
            "peak_device_used_bytes": peak_used,
            "device_used_peak_bytes": device_used_peak,
            "output_finite": finite,
            "output_rms": (out.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / out.len().max(1) as f64).sqrt(),
            "max_abs_diff_first_vs_last": repeat_diff,
            // Where the last step's time went (the engine's ExecTiming; the graph's build
            // before the engine is outside it, in the step time).
            "span_times": span_times,
            "last_step_timing_ms": {
                "plan": ms(timing.plan),
                "capacity": ms(timing.capacity),
                "staging": ms(timing.staging),
                "wait": ms(timing.wait),
                "prefetch": ms(timing.prefetch),
                "upload_wait": ms(timing.upload_wait),
                "build": ms(timing.build),
                "allocate": ms(timing.allocate),
                "compute": ms(timing.compute),
                "compute_wait": ms(timing.compute_wait),
                "overhead": ms(timing.overhead),
                "total": ms(timing.total),
            },
            "staging_pool_bytes": staging_pool_bytes,
            // The last step per segment: [index, weight MB, prefetched, ms the host waited
            // for its prefetched weights, segments queued ahead of it].
            // With --timeline on, ms from the last step's start: per segment [index, weight
            // MB, prepared, staging ms, launched, returned, done on the device (null: not
            // seen)], the step's end, and the transfer thread jobs of the last two steps
            // [MB, queued, started, finished].
            "last_step_timeline": timeline.then(|| {
                let rel = |t: Instant| {
                    let ms = if t >= last_t0 {
                        ms(t - last_t0)
                    } else {
                        -ms(last_t0 - t)
                    };
                    (ms * 1e3).round() / 1e3
                };
                json!({
                    "end": rel(last_end),
                    "segments": last.segments.iter().map(|s| json!([
                        s.index,
                        (s.weight_bytes as f64 / 1e6 * 10.0).round() / 10.0,
                        rel(s.times.prepared),
                        (ms(s.times.staging) * 1e3).round() / 1e3,
                        rel(s.times.launched),
                        rel(s.times.returned),
                        s.times.done.map(rel),
                    ])).collect::<Vec<_>>(),
                    "uploads": prev_spans.iter().chain(&last_spans).map(|u| json!([
                        (u.bytes as f64 / 1e6 * 10.0).round() / 10.0,
                        rel(u.queued),
                        rel(u.started),
                        rel(u.finished),
                    ])).collect::<Vec<_>>(),
                })
            }),
            "last_step_segments": last.segments.iter().map(|s| json!([
                s.index,
                (s.weight_bytes as f64 / 1e6 * 10.0).round() / 10.0,
                s.prefetched,
                (s.prefetch_wait.as_secs_f64() * 1e4).round() / 10.0,
                s.queued_behind,
            ])).collect::<Vec<_>>(),
        })
    );
    Ok(())
}

fn rel_l2(a: &[f32], r: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(r) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    if a.len() != r.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

/// The tiny UNet on the CPU and on `--backend`: resident (mul_mat and flash attention) and
/// streamed from pinned/pageable RAM or disk through a budget of half the weights; every
/// result must match the CPU's within f16 tolerance.
fn cmd_check(name: &str, threads: usize) -> Result<()> {
    let cfg = BenchArch::Diffusion(DiffusionArch::Unet(tiny_config()));
    let dir = std::env::temp_dir().join(format!("sd-bench-check-{}", std::process::id()));
    let weights = dir.join("unet.safetensors");
    let weight_bytes = write_weights(&cfg, &weights, 5)?;
    let inputs = Inputs::new(&cfg, 16, 2, 8);
    let run = |device: ComputeDevice,
               mode,
               budget,
               flash_attn: FlashAttn,
               async_upload: bool|
     -> Result<Vec<f32>> {
        let options = RigOptions {
            cfg: &cfg,
            weights: &weights,
            device,
            mode,
            budget,
            flash_attn,
            threads,
            streaming: StreamingOptions::default(),
            async_upload,
            stable_placement: false,
            // The tiny UNet's budget is all the engine's.
            runtime_reserve: Some(0),
            host_kernels: true,
            keep_graph: true,
        };
        let rt = start_runtime(&options)?;
        let mut rig = build_rig(&options, rt, &inputs)?;
        Ok(rig.step(&inputs)?.data)
    };
    let dev = Backend::by_name(name)?;
    let device = ComputeDevice::Named(name.to_string());
    let off = FlashAttn::Off;
    let reference = run(ComputeDevice::Cpu, ParamsMode::Device, None, off, true)?;
    let fa = flash_attn_dims(&dev, &cfg)?;
    let on = if fa.is_empty() {
        FlashAttn::Off
    } else {
        FlashAttn::On
    };
    let reference_fa = run(ComputeDevice::Cpu, ParamsMode::Device, None, on, true)?;
    let half = Some(weight_bytes / 2);
    let mut cases = vec![
        ("resident", ParamsMode::Device, None, off, true),
        ("pinned, budget 1/2", ParamsMode::Pinned, half, off, true),
        (
            "pinned, budget 1/2, synchronous uploads",
            ParamsMode::Pinned,
            half,
            off,
            false,
        ),
        ("ram, budget 1/2", ParamsMode::Ram, half, off, true),
        ("disk, budget 1/2", ParamsMode::Disk, half, off, true),
    ];
    if !fa.is_empty() {
        cases.push((
            "resident, flash attention",
            ParamsMode::Device,
            None,
            on,
            true,
        ));
        cases.push((
            "pinned, budget 1/2, flash attention",
            ParamsMode::Pinned,
            half,
            on,
            true,
        ));
    }
    drop(dev);
    let mut worst = 0.0f64;
    for (label, mode, budget, flash, async_upload) in cases {
        let out = run(device.clone(), mode, budget, flash, async_upload)?;
        let err = rel_l2(
            &out,
            if flash == FlashAttn::Off {
                &reference
            } else {
                &reference_fa
            },
        );
        worst = worst.max(err);
        println!(
            "{}",
            json!({"cmd": "check", "backend": name, "case": label, "rel_l2_vs_cpu": err,
                   "elements": out.len()})
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    const TOL: f64 = 2e-2;
    if worst > TOL {
        return Err(BenchError::Check(format!(
            "{name} differs from the CPU: relative L2 error {worst:.3e} > {TOL:.0e}"
        )));
    }
    println!(
        "{}",
        json!({"cmd": "check", "backend": name, "ok": true, "worst_rel_l2": worst,
               "flash_attn_head_dims": fa})
    );
    Ok(())
}

/// Host->device copy bandwidth: one `--mib` MiB tensor copied from a pinned host buffer (the
/// device's host buffer type) and from a pageable one into device memory; best of 5.
fn cmd_copy_bw(name: &str, mib: usize, contention: bool) -> Result<()> {
    let n = mib << 20;
    let backend = Backend::by_name(name)?;
    let device = backend
        .device()
        .ok_or_else(|| BenchError::Usage(format!("{name} has no device")))?;
    let ctx = Context::new_descriptors(4, 1, 0)?;
    let dst = ctx.new_tensor(DType::I8, &[n])?;
    let _dbuf = backend.buffer_type().alloc_context_tensors(&ctx)?;
    let mut results = serde_json::Map::new();
    let pinned = device.host_buffer_type();
    for (label, buft) in [("pinned", pinned), ("pageable", Some(BufferType::cpu()))] {
        let Some(buft) = buft else {
            results.insert(label.into(), serde_json::Value::Null);
            continue;
        };
        let hctx = Context::new_descriptors(2, 1, 0)?;
        let src = hctx.new_tensor(DType::I8, &[n])?;
        let _hbuf = buft.alloc_context_tensors(&hctx)?;
        src.write_bytes(0, &vec![0x5a; n])?;
        let mut best = Duration::MAX;
        for _ in 0..5 {
            backend.synchronize();
            let t0 = Instant::now();
            Backend::copy_tensor(&src, &dst)?;
            backend.synchronize();
            best = best.min(t0.elapsed());
        }
        results.insert(
            label.into(),
            json!({"buffer_type": buft.name(), "gb_per_s": n as f64 / best.as_secs_f64() / 1e9}),
        );
    }
    let (idle_us, busy_us, busy_ms) = memory_query_cost(&backend, &device)?;
    // (A device without pinned host memory copies from pageable memory here.)
    let contention = if contention {
        copy_contention(&backend, pinned.unwrap_or_else(BufferType::cpu))?
    } else {
        serde_json::Value::Null
    };
    println!(
        "{}",
        json!({"cmd": "copy-bw", "backend": backend.name(), "bytes": n, "results": results,
               "contention": contention,
               // One device memory report, idle and with a long graph queued: whether the
               // engine's capacity checks wait for the device.
               "memory_query_idle_us": idle_us, "memory_query_busy_us": busy_us,
               "busy_graph_ms": busy_ms})
    );
    Ok(())
}

/// `copy_contention`'s pieces: host tensors and their device copies (the tensors keep
/// their contexts; the buffers are kept here).
struct Pieces {
    src: Vec<GTensor>,
    dst: Vec<GTensor>,
    _buffers: [sd_tensor::ggml::Buffer; 2],
}

/// `copy-bw --contention`: pinned host-to-device copies of 256 MiB as copies of 1, 4, 16
/// and 64 MiB one after the other (each synchronous, as a transfer thread copies), and
/// the same 64 MiB copies made on a thread, alone, while the calling thread computes
/// long matrix products on `backend`, and while it computes graphs of many tiny ops
/// (kernel launches): GB/s each, best of 3 (the concurrent ones: one pass of 4 x 256
/// MiB).
fn copy_contention(backend: &Backend, pinned: BufferType) -> Result<serde_json::Value> {
    const TOTAL: usize = 256 << 20;
    let pieces = |chunk: usize| -> Result<Pieces> {
        let k = TOTAL / chunk;
        let hctx = Context::new_descriptors(k, 1, 0)?;
        let dctx = Context::new_descriptors(k, 1, 0)?;
        let src: Vec<GTensor> = (0..k)
            .map(|_| hctx.new_tensor(DType::I8, &[chunk]))
            .collect::<std::result::Result<_, _>>()?;
        let dst: Vec<GTensor> = (0..k)
            .map(|_| dctx.new_tensor(DType::I8, &[chunk]))
            .collect::<std::result::Result<_, _>>()?;
        let hb = pinned.alloc_context_tensors(&hctx)?;
        let db = backend.buffer_type().alloc_context_tensors(&dctx)?;
        for t in &src {
            t.write_bytes(0, &vec![0x5a; chunk])?;
        }
        Ok(Pieces {
            src,
            dst,
            _buffers: [hb, db],
        })
    };
    let copy_all = |src: &[GTensor], dst: &[GTensor]| -> Result<Duration> {
        let t0 = Instant::now();
        for (s, d) in src.iter().zip(dst) {
            Backend::copy_tensor(s, d)?;
        }
        Ok(t0.elapsed())
    };
    let gbps = |bytes: usize, t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let mut sizes = serde_json::Map::new();
    for chunk_mib in [1usize, 4, 16, 64] {
        let p = pieces(chunk_mib << 20)?;
        let mut best = Duration::MAX;
        for _ in 0..3 {
            backend.synchronize();
            best = best.min(copy_all(&p.src, &p.dst)?);
        }
        sizes.insert(format!("{chunk_mib}_mib"), json!(gbps(TOTAL, best)));
    }
    // Long products: 8 chained 4096x4096 f32 products a graph (256x256 on the CPU, where
    // the probe only checks itself).
    let side = if backend.is_cpu() { 256 } else { 4096 };
    let (products, _gbuf) = chained_products(backend, side, 8)?;
    // Many tiny ops: 2000 chained adds of 256 values.
    let tctx = Context::new_descriptors(2100, 2048, 1)?;
    let b = tctx.new_tensor(DType::F32, &[256])?;
    let mut y = tctx.new_tensor(DType::F32, &[256])?;
    let tiny_inputs = [b.clone(), y.clone()];
    for _ in 0..2000 {
        y = tctx.add(&y, &b)?;
    }
    let mut tiny = sd_tensor::ggml::Graph::new(&tctx, 2048)?;
    tiny.build_forward_expand(&y)?;
    let _tbuf = backend.buffer_type().alloc_context_tensors(&tctx)?;
    for t in &tiny_inputs {
        t.write_bytes(0, &f32_bytes(&[0.0; 256]))?;
    }
    let p = pieces(64 << 20)?;
    let mut concurrent = serde_json::Map::new();
    for (label, graph) in [
        ("alone", None),
        ("products", Some(&products)),
        ("tiny_ops", Some(&tiny)),
    ] {
        backend.synchronize();
        let done = std::sync::atomic::AtomicBool::new(false);
        let mut graphs = 0usize;
        let elapsed = std::thread::scope(|scope| -> Result<Duration> {
            let copier = scope.spawn(|| -> Result<Duration> {
                let copied = (0..4).try_fold(Duration::ZERO, |t, _| {
                    Ok::<_, BenchError>(t + copy_all(&p.src, &p.dst)?)
                });
                // Also on a failed copy: the computing loop below stops on it.
                done.store(true, std::sync::atomic::Ordering::Release);
                copied
            });
            if let Some(g) = graph {
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    backend.compute(g)?;
                    graphs += 1;
                }
            }
            copier
                .join()
                .map_err(|_| BenchError::Usage("the copy thread panicked".into()))?
        })?;
        concurrent.insert(
            label.into(),
            json!({"gb_per_s": gbps(4 * TOTAL, elapsed), "graphs": graphs}),
        );
    }
    Ok(json!({"host_buffer_type": pinned.name(), "sizes": sizes, "concurrent_64_mib": concurrent}))
}

/// A graph of `count` chained `side`x`side` f32 products on `backend` (inputs of
/// `1/side`, so every product stays finite), with the buffer its tensors live in.
fn chained_products(
    backend: &Backend,
    side: usize,
    count: usize,
) -> Result<(sd_tensor::ggml::Graph, sd_tensor::ggml::Buffer)> {
    let ctx = Context::new_descriptors(count + 2, 64, 1)?;
    let a = ctx.new_tensor(DType::F32, &[side, side])?;
    let mut x = ctx.new_tensor(DType::F32, &[side, side])?;
    let inputs = [a.clone(), x.clone()];
    for _ in 0..count {
        x = ctx.mul_mat(&a, &x)?;
    }
    let mut graph = sd_tensor::ggml::Graph::new(&ctx, 64)?;
    graph.build_forward_expand(&x)?;
    let buf = backend.buffer_type().alloc_context_tensors(&ctx)?;
    let ones = f32_bytes(&vec![1.0 / side as f32; side * side]);
    for t in &inputs {
        t.write_bytes(0, &ones)?;
    }
    Ok((graph, buf))
}

/// The time of one device memory report with the device idle, and with a queued graph of 16
/// chained 4096x4096 f32 products still computing (and that graph's time): a report that
/// waits for queued work takes about as long as the graph. The CPU computes at the call:
/// only the idle time.
fn memory_query_cost(
    backend: &Backend,
    device: &Device,
) -> Result<(f64, Option<f64>, Option<f64>)> {
    let t = Instant::now();
    for _ in 0..100 {
        std::hint::black_box(device.memory());
    }
    let idle_us = t.elapsed().as_secs_f64() * 1e6 / 100.0;
    if backend.is_cpu() {
        return Ok((idle_us, None, None));
    }
    let (graph, _buf) = chained_products(backend, 4096, 16)?;
    backend.compute(&graph)?;
    backend.synchronize();
    let t = Instant::now();
    backend.compute(&graph)?;
    backend.synchronize();
    let busy_ms = t.elapsed().as_secs_f64() * 1e3;
    // SAFETY: the graph's tensors live in `_buf` until after the synchronize below.
    unsafe { backend.compute_async(&graph) }?;
    let t = Instant::now();
    std::hint::black_box(device.memory());
    let busy_us = t.elapsed().as_secs_f64() * 1e6;
    backend.synchronize();
    Ok((idle_us, Some(busy_us), Some(busy_ms)))
}
