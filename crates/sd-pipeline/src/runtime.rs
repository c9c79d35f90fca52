//! The model runtime: every model graph of a pipeline runs through one memory-budgeted
//! [`ExecutionEngine`] over one [`ModelManager`].
//!
//! A [`Runtime`] owns the engine, the CPU backend (where parameters live between uses) and
//! the compute backend (the CPU, a named ggml device, or a [`SimDevice`] for tests). Each
//! model (text encoder, UNet, VAE, an upscaler from another file...) is added with
//! [`Runtime::add_model`]: its parameters are declared through a [`ParamBuilder`] over the
//! model's catalog (a *model source* of the manager), registered with the manager, and the
//! model gets its own execution session, on the compute device or, where
//! [`RuntimeOptions::placement`] says so for its component, on another device (the CPU for
//! `--vae-on-cpu`), with that device's budget. [`Runtime::run`] builds a graph for a model in a
//! fresh [`GraphCtx`] and executes it through the engine, which stages the weights on the
//! compute device and runs the graph whole or in segments at its graph cuts to stay within
//! the budget (`--max-vram`).
//!
//! Model code never decides residency or devices: the [`RuntimeOptions`] do (params in RAM
//! or read from disk at each use, file mappings, budget, each component's device), and the
//! engine and manager carry them out.

use std::str::FromStr;
use std::sync::Arc;

use sd_exec::{
    ComputeResult, ComputeTask, EngineOptions, ExecError, ExecTiming, ExecutionEngine, PlanSummary,
    SegmentReport, SegmentationPolicy, SessionConfig, SessionId, StreamingOptions,
    DEFAULT_PLANNING_HEADROOM,
};
use sd_formats::files::TensorCatalog;

use crate::runner_cache::{Constant, RunnerCache};
use sd_models::{ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder, Params};
use sd_residency::capacity::{MaxVram, MaxVramError};
use sd_residency::{
    BackendId, Component, DeviceResidencyManager, ModelManager, ParamId, ParamSpec, ResidencyError,
    ResidencyMode, SourceId, UploadOptions,
};
use sd_tensor::ggml::{
    Backend, Context, Device, DeviceKind, GTensor, Graph, SimDevice, SimOptions,
};
use sd_tensor::{DType, GgmlError};
use thiserror::Error;

/// Where models compute (`--backend`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ComputeDevice {
    /// The ggml CPU backend (`cpu`).
    Cpu,
    /// A ggml device by name, as `sd --list-devices` prints it (`CUDA0`, `Vulkan0`...).
    Named(String),
    /// A simulated discrete GPU of this many bytes (`sim:<size>`, `sim:<size>/<page>`): a real
    /// ggml backend whose arithmetic is the CPU's, with fixed memory and peak tracking (tests,
    /// budget studies).
    Sim {
        /// Device memory in bytes.
        bytes: u64,
        /// The unit its allocator rounds every buffer up to, as `cudaMalloc` rounds to 2 MiB
        /// pages (`sim:2G/2M`); 0: exact sizes.
        page: u64,
    },
}

pub use sd_residency::capacity::{parse_size, SizeError};

impl FromStr for ComputeDevice {
    type Err = String;

    /// `cpu`, `sim:<size>` (size in MiB without a unit; `sim:512`, `sim:1.5G`),
    /// `sim:<size>/<page>` (buffers rounded up to pages of that size, in bytes without a unit;
    /// `sim:2G/2M`), or a ggml device name.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        if t.is_empty() {
            return Err("empty backend name".into());
        }
        if t.eq_ignore_ascii_case("cpu") {
            return Ok(ComputeDevice::Cpu);
        }
        if let Some(spec) = t.strip_prefix("sim:").or_else(|| t.strip_prefix("SIM:")) {
            let (size, page) = match spec.split_once('/') {
                Some((size, page)) => (size, Some(page)),
                None => (spec, None),
            };
            let bytes = parse_size(size, 20).map_err(|e| format!("sim:<size>: {e}"))?;
            if bytes == 0 {
                return Err("sim:<size>: the simulated device needs a positive size".into());
            }
            let page = match page {
                None => 0,
                Some(p) => {
                    let page = parse_size(p, 0).map_err(|e| format!("sim:<size>/<page>: {e}"))?;
                    if page == 0 || page > bytes {
                        return Err(format!(
                            "sim:<size>/<page>: the page ({p}) must be positive and at most the device's size"
                        ));
                    }
                    page
                }
            };
            return Ok(ComputeDevice::Sim { bytes, page });
        }
        Ok(ComputeDevice::Named(t.to_string()))
    }
}

/// Parameters per load call when [`Runtime::preload`] reads a model's RAM copies for a
/// device: enough tensors for every load thread, few enough for the progress bar to move.
const PRELOAD_BATCH: usize = 256;

/// Where parameters live between uses (`--params-backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ParamsLocation {
    /// [`ParamsLocation::Device`] for a model whose device is not the CPU, has no budget
    /// (`--max-vram`), is not layer-split and has room for it (the weights of the models
    /// placed there within three quarters of its free memory); [`ParamsLocation::Ram`]
    /// otherwise (`auto`, the default). As stable-diffusion.cpp without `--offload-to-cpu`: a run
    /// that keeps every weight on the GPU reads the files straight into device memory, in
    /// parallel, instead of through a copy in RAM.
    #[default]
    Auto,
    /// Loaded once to host memory and kept there (`cpu`, `ram`; `--offload-to-cpu`).
    Ram,
    /// Read from the model files whenever a graph needs them, freed after use (`disk`).
    Disk,
    /// Loaded once straight into the memory of the device that computes with them and kept
    /// there (`device`); under memory pressure they are dropped and read from the files
    /// again. The CPU's models keep theirs in RAM.
    Device,
}

impl FromStr for ParamsLocation {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" | "ram" => Ok(ParamsLocation::Ram),
            "disk" => Ok(ParamsLocation::Disk),
            "device" | "gpu" | "vram" => Ok(ParamsLocation::Device),
            "auto" => Ok(ParamsLocation::Auto),
            other => Err(format!(
                "unknown params backend '{other}' (known: cpu, ram, disk, device, auto)"
            )),
        }
    }
}

/// How to build a [`Runtime`].
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// The compute device: where every model computes unless [`RuntimeOptions::placement`]
    /// puts its component elsewhere.
    pub compute: ComputeDevice,
    /// Extra devices the diffusion model is layer-split across (`--backend "a&b"`): its
    /// segments run on the compute device first, then on these in order, in contiguous
    /// ranges within each device's budget (`--max-vram` per device). The other models stay
    /// on their own device (see [`RuntimeOptions::placement`]).
    pub split: Vec<ComputeDevice>,
    /// Per-component compute devices overriding [`RuntimeOptions::compute`]
    /// (`--clip-on-cpu`, `--vae-on-cpu`, `--backend te=cpu,vae=cuda1`): a model of a listed
    /// component computes on that device (the CPU, or a device the runtime can create),
    /// in its own session there; the last entry of a component wins. A model on the CPU has
    /// no budget: `--max-vram` limits the devices that are not the CPU (the compute device
    /// and, per device name, the others), so models moved to the CPU are not counted in the
    /// compute device's budget. Exact convolutions and flash attention are resolved per
    /// device as for the compute device ([`RuntimeOptions::exact`],
    /// [`RuntimeOptions::flash_attn`]).
    pub placement: Vec<(Component, ComputeDevice)>,
    /// Where parameters live between uses.
    pub params: ParamsLocation,
    /// Map host parameters from their files without copies where possible (`--mmap`).
    pub mmap: bool,
    /// The device budget (`--max-vram`), applied to the compute device when it is not the CPU.
    pub max_vram: Option<MaxVram>,
    /// CPU threads (compute on the CPU and the simulated device).
    pub threads: usize,
    /// When graphs run in segments (automatic: only when they do not fit).
    pub segmentation: SegmentationPolicy,
    /// Prefetch the next segment's weights while a segment computes.
    pub prefetch: bool,
    /// Bytes a whole-graph run must leave free (`None`: the engine's default).
    pub planning_headroom: Option<u64>,
    /// Numerical options of the graphs built by [`Runtime::run`] (`exact` is resolved with
    /// [`RuntimeOptions::exact`]).
    pub compute_options: ComputeOptions,
    /// Exact f32 numerics ([`ComputeOptions::exact`]: f32 im2col in every convolution).
    /// `None`: `compute_options.exact` on the CPU and simulated devices (exact by default,
    /// what the parity tests compare), off on real GPUs, where the f32 im2col path is what
    /// made a UNet step slower than stable-diffusion.cpp's (ggml's f16 im2col + GEMM, its
    /// default). `Some` forces it either way (`sd` reads `SD_EXACT=1|0`). Resolved once,
    /// in [`Runtime::new`] ([`Runtime::exact`]).
    pub exact: Option<bool>,
    /// Flash attention (`flash_attn_ext`, K/V in f16) for unmasked attention, for the head
    /// widths the compute backend (and every split device) supports. `None`: on for real
    /// GPU devices (its attention workspace is what lets a 512x512 UNet run under a 1 GiB
    /// budget), off on the CPU and simulated devices (exact numerics).
    pub flash_attn: Option<bool>,
    /// Convert weights to this type when loading (`--type`; `None`: the files' types). See
    /// [`ParamBuilder::set_weight_type`] for which tensors it applies to.
    pub weight_type: Option<DType>,
    /// For models computed on the CPU, the project's CPU kernels where they beat ggml's
    /// ([`ComputeOptions::host_kernels`]: convolutions, per-channel affine, attention). Off:
    /// ggml's ops only, the bits every other backend and the simulated device compute.
    pub host_kernels: bool,
    /// With [`RuntimeOptions::host_kernels`]: the products of f16 / f32 weights in large
    /// enough convolutions (stride 1, without an im2col) and linear layers as f32 products
    /// of the project's CPU kernels (`sd_tensor`'s `Context::set_f32_products`: faster, the
    /// activations kept in f32, a smaller compute buffer). Off: ggml's f16 product after the
    /// im2col kernel (ggml's bits). On by default.
    pub f32_products: bool,
    /// On a GPU, convolutions with f16 kernels as ggml's direct convolution (`sd_tensor`'s
    /// `Context::set_direct_conv`: an implicit GEMM on CUDA's tensor cores, no im2col
    /// buffer) instead of im2col + matrix product. Off by default: slower on an H100 (the
    /// SD1.5 UNet's bare graph 48.1 ms against 40.6, SDXL's 224.0 against 182.9;
    /// docs/benchmarks.md, nineteenth session).
    pub direct_conv: bool,
    /// On a device with a budget other than the CPU, the most bytes one large
    /// intermediate may take, as a fraction of the budget: `Some(d)` computes convolutions
    /// whose im2col exceeds `budget / d` (at least [`RuntimeOptions::band_min_bytes`]) in row bands and
    /// UNet feed-forwards in chunks of tokens (`sd_tensor`'s `Context::set_band_bytes`):
    /// the same values with a smaller compute buffer, which leaves the staging pool the
    /// room. `None`: whole ops. Default: `Some(8)`: on an H100 (`sd-bench unet
    /// --band-divisor 8|16|0`, docs/benchmarks.md, twentieth session) SD1.5 at a quarter of
    /// its weights 79.7 ms a step against 85.6 whole (a 158 MiB staging pool against 110),
    /// SDXL at a quarter 196 ms against 230, SD1.5 at 0.2 and 0.15 of its weights runs at
    /// all (whole ops need more); at 0.5 / 0.75 nothing is banded (as fast as whole ops,
    /// where a divisor of 16 took 2-4% longer: smaller products, no gain from the pool).
    pub band_divisor: Option<u64>,
    /// The least bytes [`RuntimeOptions::band_divisor`] bands an intermediate down to (a
    /// tiny budget does not cut ops into slivers). Default: [`MIN_BAND_BYTES`].
    pub band_min_bytes: u64,
    /// On a device other than the CPU with flash attention, head widths under 64 (SD1's
    /// 40) run flash attention at width 64, zeros appended to each head
    /// (`sd_models::GraphCtx::flash_attn_pad_to`): the same values on ggml's tensor-core
    /// kernels instead of its generic tile kernel. Default: on.
    pub flash_attn_pad: bool,
    /// How every model's session streams weights under a budget (staging pool, window,
    /// prefetch depth, segments in flight, graph reuse; `sd-bench unet`'s switches). The
    /// default is the measured best of each.
    pub streaming: StreamingOptions,
    /// How weights are uploaded (pinned host copies, coalesced copies, a copy stream).
    pub uploads: UploadOptions,
    /// Bytes of a GPU's `--max-vram` budget left to its runtime's own allocations (context,
    /// BLAS workspaces, kernels, ggml's pool). `None` (the default): measured after a
    /// warm-up graph ([`sd_exec::measure_runtime_reserve`]).
    pub runtime_reserve: Option<u64>,
}

impl Default for RuntimeOptions {
    /// CPU compute, parameters where [`ParamsLocation::Auto`] puts them (RAM for the
    /// CPU), no mapping, no budget, all cores, automatic segmentation with prefetch, exact
    /// numerics, the project's CPU kernels.
    fn default() -> Self {
        RuntimeOptions {
            compute: ComputeDevice::Cpu,
            split: Vec::new(),
            placement: Vec::new(),
            params: ParamsLocation::Auto,
            mmap: false,
            max_vram: None,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            segmentation: SegmentationPolicy::Auto,
            prefetch: true,
            planning_headroom: None,
            compute_options: ComputeOptions::default(),
            exact: None,
            flash_attn: None,
            weight_type: None,
            host_kernels: true,
            f32_products: true,
            direct_conv: false,
            band_divisor: Some(8),
            band_min_bytes: MIN_BAND_BYTES,
            flash_attn_pad: true,
            streaming: StreamingOptions::default(),
            uploads: UploadOptions::default(),
            runtime_reserve: None,
        }
    }
}

impl RuntimeOptions {
    /// The compute device of `component`'s models: its [`RuntimeOptions::placement`]
    /// entry, else [`RuntimeOptions::compute`].
    pub fn device_of(&self, component: Component) -> &ComputeDevice {
        self.placement
            .iter()
            .rev()
            .find(|(c, _)| *c == component)
            .map_or(&self.compute, |(_, d)| d)
    }
}

/// An error of the runtime.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// The compute backend could not be created.
    #[error("backend '{name}': {source}")]
    Backend {
        /// The backend asked for.
        name: String,
        /// Why.
        #[source]
        source: GgmlError,
    },
    /// A budget cannot be applied.
    #[error(transparent)]
    MaxVram(#[from] MaxVramError),
    /// Declaring a model's parameters or building its graph failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The residency manager refused (unknown tensor, bad file, shape...).
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    /// Executing a graph failed (capacity, allocation, compute).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// A handle from another runtime, or a model source this runtime does not have.
    #[error("unknown {0}")]
    Unknown(String),
    /// The output of a graph is not what the caller reads.
    #[error("model '{model}': output of '{task}' {detail}")]
    Output {
        /// The model.
        model: String,
        /// The task.
        task: String,
        /// What is wrong.
        detail: String,
    },
}

/// Convenience alias.
pub type Result<T> = std::result::Result<T, RuntimeError>;

/// A model added to a [`Runtime`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelHandle(usize);

struct ModelSlot {
    name: String,
    session: SessionId,
    // Keeps the parameter descriptors' context alive while the manager holds them.
    params: Params,
    ids: Vec<ParamId>,
    /// Index of the model's device in [`Runtime::devices`].
    device: usize,
    /// Whether its parameters live in its (non-CPU) device's memory ([`ParamsLocation`]).
    on_device: bool,
    /// The model's constant inputs kept on the device ([`Runtime::keep_constants`]).
    constants: RunnerCache,
    /// Graphs kept by [`Runtime::run_keyed`], most recent last.
    kept: Vec<KeptTask>,
}

/// At most this many graphs are kept per model by [`Runtime::run_keyed`] (a step's
/// guided pass, one pass per prompt where the contexts differ in length, the skip-layer
/// pass).
const MAX_KEPT_GRAPHS: usize = 4;

/// Names the structure of a graph that a caller builds again and again with new input
/// data (every step of a sampling loop), for [`Runtime::run_keyed`]: two builds under one
/// key must give the same graph (the same ops, shapes and constants); only the data of
/// the inputs may differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey(pub u64);

impl GraphKey {
    /// The key of everything `parts` hashes (shapes, switches, a pass's name).
    pub fn of(parts: &impl std::hash::Hash) -> GraphKey {
        use std::hash::Hasher;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parts.hash(&mut h);
        GraphKey(h.finish())
    }
}

/// What the build of [`Runtime::run_keyed`] returns: the output and the input leaves, in
/// the order of the data the caller passes.
#[derive(Debug)]
pub struct KeyedGraph {
    /// The tensor whose values are returned.
    pub output: GTensor,
    /// The input leaves the caller feeds at every run.
    pub inputs: Vec<GTensor>,
}

/// A task kept by [`Runtime::run_keyed`]: built once, run again with new input data.
struct KeptTask {
    key: GraphKey,
    task: ComputeTask,
    output: GTensor,
    /// The caller's input leaves: `task.inputs[..fed]`, in order.
    fed: usize,
    /// The constant inputs, fed at every run (kept on the device or uploaded).
    constants: Vec<Constant>,
    /// The graph's context (kept alive with it).
    _g: GraphCtx,
}

/// The output of [`Runtime::run`] as f32 values.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutput {
    /// The values, ggml order.
    pub data: Vec<f32>,
    /// The output's dimensions, ggml order (innermost first).
    pub ne: [usize; 4],
    /// Whether the graph ran in segments.
    pub segmented: bool,
    /// One report per segment run.
    pub segments: Vec<SegmentReport>,
    /// Where the execution's time went.
    pub timing: ExecTiming,
    /// Weight bytes uploaded to devices during the execution.
    pub weight_upload_bytes: u64,
    /// Whether the engine ran the plan kept from the model's last run (a graph kept by
    /// [`Runtime::run_keyed`] run again: nothing built, captured or planned).
    pub plan_kept: bool,
}

impl RunOutput {
    /// The dimensions outermost first (PyTorch order), four of them.
    pub fn shape(&self) -> [usize; 4] {
        [self.ne[3], self.ne[2], self.ne[1], self.ne[0]]
    }
}

/// The graph a [`Runtime::run`] build closure returns: the output tensor and host data for
/// the input leaves it created (auxiliary inputs in the [`GraphCtx`] are added too).
#[derive(Debug)]
pub struct BuiltGraph {
    /// The tensor to read back.
    pub output: GTensor,
    /// Input leaves and their data.
    pub inputs: Vec<(GTensor, HostData)>,
}

/// One engine and one residency manager shared by every model of a pipeline (see the
/// module documentation).
pub struct Runtime {
    // Field order is drop order: sessions and weight buffers go before the devices.
    engine: ExecutionEngine<ModelManager>,
    models: Vec<ModelSlot>,
    /// The devices models compute on: the compute device first, then the other devices of
    /// [`RuntimeOptions::placement`].
    devices: Vec<ModelDevice>,
    cpu_id: BackendId,
    /// Layer-split devices of the diffusion model: backend, id, budget.
    split: Vec<(Arc<Backend>, BackendId, Option<u64>)>,
    options: RuntimeOptions,
    sim: Option<SimDevice>,
    split_sims: Vec<SimDevice>,
    /// Simulated devices of [`RuntimeOptions::placement`] other than the compute device.
    placed_sims: Vec<SimDevice>,
    /// The measured runtime reserve left out of `--max-vram` on a GPU (0: none).
    runtime_reserve: u64,
}

/// A device models compute on, with the policies the runtime resolved for it.
struct ModelDevice {
    /// The device as the options name it.
    device: ComputeDevice,
    backend: Arc<Backend>,
    id: BackendId,
    /// The `--max-vram` budget on it (`None` on the CPU).
    budget: Option<u64>,
    /// [`RuntimeOptions::exact`] resolved for this device.
    exact: bool,
    /// Head widths that use flash attention (`None`: off); see [`RuntimeOptions::flash_attn`].
    flash_attn_dims: Option<Vec<usize>>,
    /// Weight bytes of the models placed in this device's memory ([`ParamsLocation::Auto`]).
    weights_placed: u64,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("compute", &self.devices[0].backend.name())
            .field("budget", &self.devices[0].budget)
            .field("models", &self.models.len())
            .field("engine", &self.engine)
            .finish()
    }
}

impl Runtime {
    /// A runtime whose main model source is `main` (the checkpoint and component files,
    /// already canonicalized).
    pub fn new(options: RuntimeOptions, main: TensorCatalog) -> Result<Runtime> {
        let threads = options.threads.max(1);
        let backend_err = |name: &str| {
            let name = name.to_string();
            move |source| RuntimeError::Backend { name, source }
        };
        let cpu = Arc::new(Backend::cpu(threads).map_err(backend_err("cpu"))?);
        // A backend for `device`, with its simulated device if it is one; simulated devices
        // are named SIM0, SIM1, ... in order of creation.
        let mut sim_count = 0usize;
        let mut make = |device: &ComputeDevice| -> Result<(Arc<Backend>, Option<SimDevice>)> {
            Ok(match device {
                ComputeDevice::Cpu => (cpu.clone(), None),
                ComputeDevice::Named(name) => {
                    let b = Backend::by_name(name).map_err(backend_err(name))?;
                    if b.is_cpu() {
                        b.set_threads(threads);
                    }
                    (Arc::new(b), None)
                }
                ComputeDevice::Sim { bytes, page } => {
                    let name = format!("sim:{}", bytes >> 20);
                    let s = SimDevice::new(
                        &format!("SIM{sim_count}"),
                        *bytes,
                        SimOptions {
                            threads,
                            // Queued copies and events, as a GPU has: streamed weights
                            // take the copy-stream path (see `sd_tensor::ggml::CopyStream`).
                            async_transfers: true,
                            allocation_granularity: usize::try_from(*page).unwrap_or(usize::MAX),
                            ..SimOptions::default()
                        },
                    )
                    .map_err(backend_err(&name))?;
                    sim_count += 1;
                    let b = s.backend().map_err(backend_err(&name))?;
                    // No runtime to measure, but the allocator may round buffers up
                    // (`sim:<size>/<page>`): recorded as a GPU's measured unit is, so that
                    // every budget on this device counts the bytes it takes.
                    b.buffer_type().set_allocation_granularity((*page).max(1));
                    (Arc::new(b), Some(s))
                }
            })
        };
        let (compute, sim) = make(&options.compute)?;
        let primary_sim = sim.is_some();
        let mut split_backends = Vec::new();
        let mut split_sims = Vec::new();
        for d in &options.split {
            let (b, s) = make(d)?;
            if b.is_cpu() || Arc::ptr_eq(&b, &compute) {
                return Err(RuntimeError::Unknown(format!(
                    "layer split device '{}': split devices must be distinct GPUs (or sim:SIZE)",
                    b.name()
                )));
            }
            split_backends.push(b);
            split_sims.extend(s);
        }
        // The other devices of the placement, each once: the CPU is the params backend, a
        // split device is shared with the diffusion model's split, others are created.
        let mut placed: Vec<(ComputeDevice, Arc<Backend>)> = Vec::new();
        let mut placed_sims = Vec::new();
        for (_, d) in &options.placement {
            if *d == options.compute || placed.iter().any(|(p, _)| p == d) {
                continue;
            }
            let b = match options.split.iter().position(|s| s == d) {
                Some(i) => split_backends[i].clone(),
                None => {
                    let (b, s) = make(d)?;
                    placed_sims.extend(s);
                    b
                }
            };
            placed.push((d.clone(), b));
        }
        let mut mm = ModelManager::new(main);
        mm.set_upload_options(options.uploads);
        mm.set_mmap(options.mmap);
        mm.set_segmented_compute(true);
        mm.set_prefetch(options.prefetch);
        if primary_sim || !split_sims.is_empty() || !placed_sims.is_empty() {
            // The simulated device is exactly its size: no driver reserve.
            mm.set_device_reserve(0);
        }
        let cpu_id = mm.add_backend(cpu.clone())?;
        let compute_id = if Arc::ptr_eq(&cpu, &compute) {
            cpu_id
        } else {
            mm.add_backend(compute.clone())?
        };
        let mut split_ids = Vec::new();
        for b in &split_backends {
            split_ids.push(mm.add_backend(b.clone())?);
        }
        let mut placed_ids = Vec::new();
        for (_, b) in &placed {
            let id = if Arc::ptr_eq(b, &cpu) {
                cpu_id
            } else if let Some(i) = split_backends.iter().position(|s| Arc::ptr_eq(s, b)) {
                split_ids[i]
            } else {
                mm.add_backend(b.clone())?
            };
            placed_ids.push(id);
        }
        let mut budget = None;
        let mut runtime_reserve = 0;
        if let Some(mv) = &options.max_vram {
            if !primary_sim && !compute.is_cpu() {
                // What the GPU's runtime holds for itself (context, BLAS, kernels, pools)
                // counts against the budget too: measure it instead of guessing.
                let r = match options.runtime_reserve {
                    // Given: only the allocator's rounding unit is measured.
                    Some(reserve) => {
                        let granularity =
                            sd_exec::reserve::measure_allocation_granularity(&compute)
                                .map_err(RuntimeError::Exec)?;
                        compute
                            .buffer_type()
                            .set_allocation_granularity(granularity);
                        Some(sd_exec::RuntimeReserve {
                            measured: reserve,
                            reserve,
                            granularity,
                        })
                    }
                    None => {
                        sd_exec::measure_runtime_reserve(&compute).map_err(RuntimeError::Exec)?
                    }
                };
                if let Some(r) = r {
                    tracing::info!(
                        device = %compute.name(),
                        runtime_mib = r.measured >> 20,
                        reserve_mib = r.reserve >> 20,
                        allocation_granularity = r.granularity,
                        "the backend runtime's own device memory is left out of --max-vram"
                    );
                    mm.set_runtime_reserve(Some(r.reserve));
                    runtime_reserve = r.reserve;
                }
            }
            mm.apply_max_vram(mv);
            if let Some(d) = compute.device() {
                budget = mm.device_budget(&d);
            }
        }
        // A budget applies to devices that are not the CPU.
        let budget_of = |b: &Backend| {
            if b.is_cpu() {
                None
            } else {
                b.device().and_then(|d| mm.device_budget(&d))
            }
        };
        let split: Vec<_> = split_backends
            .into_iter()
            .zip(split_ids)
            .map(|(b, id)| {
                let budget = budget_of(&b);
                (b, id, budget)
            })
            .collect();
        let placed_budgets: Vec<Option<u64>> = placed.iter().map(|(_, b)| budget_of(b)).collect();
        let engine = ExecutionEngine::new(
            mm,
            EngineOptions {
                planning_headroom: options
                    .planning_headroom
                    .unwrap_or(DEFAULT_PLANNING_HEADROOM),
            },
        );
        let is_gpu = |b: &Backend| {
            b.device()
                .is_some_and(|d| matches!(d.kind(), DeviceKind::Gpu | DeviceKind::IntegratedGpu))
        };
        let on_gpu = !primary_sim && split_sims.is_empty() && is_gpu(&compute);
        let flash_attn_dims = if options.flash_attn.unwrap_or(on_gpu) {
            let mut backends = vec![compute.as_ref()];
            backends.extend(split.iter().map(|(b, _, _)| b.as_ref()));
            Some(flash_attn_head_dims(&backends)?)
        } else {
            None
        };
        let exact = resolve_exact(options.exact, options.compute_options.exact, on_gpu);
        if !exact && on_gpu {
            tracing::debug!("GPU: fast convolutions (f16 im2col); SD_EXACT=1 for exact f32");
        }
        let mut devices = vec![ModelDevice {
            device: options.compute.clone(),
            backend: compute,
            id: compute_id,
            budget,
            exact,
            flash_attn_dims,
            weights_placed: 0,
        }];
        for (((device, backend), id), budget) in
            placed.into_iter().zip(placed_ids).zip(placed_budgets)
        {
            // A simulated device computes as the CPU does: exact, like the compute device.
            let on_gpu = !matches!(device, ComputeDevice::Sim { .. }) && is_gpu(&backend);
            let flash_attn_dims = if options.flash_attn.unwrap_or(on_gpu) {
                Some(flash_attn_head_dims(&[backend.as_ref()])?)
            } else {
                None
            };
            let exact = resolve_exact(options.exact, options.compute_options.exact, on_gpu);
            tracing::info!(
                device = %backend.name(),
                budget = ?budget,
                exact,
                "a device of the model placement"
            );
            devices.push(ModelDevice {
                device,
                backend,
                id,
                budget,
                exact,
                flash_attn_dims,
                weights_placed: 0,
            });
        }
        Ok(Runtime {
            runtime_reserve,
            engine,
            models: Vec::new(),
            devices,
            cpu_id,
            split,
            options,
            sim,
            split_sims,
            placed_sims,
        })
    }

    /// Adds another model's files (an upscaler, a LoRA-free auxiliary model) as a model
    /// source; its models are added with [`Runtime::add_model`] and that source.
    pub fn add_source(&mut self, loader: TensorCatalog) -> Result<SourceId> {
        Ok(self.engine.manager_mut().register_model_source(loader)?)
    }

    /// The catalog of a model source ([`SourceId::MAIN`]: the one given to [`Runtime::new`]).
    pub fn catalog(&self, source: SourceId) -> Option<&TensorCatalog> {
        self.engine.manager().source(source)
    }

    /// Declares a model: `declare` builds the model struct from a [`ParamBuilder`] over
    /// `source`'s catalog (dtypes and shapes checked against the files); its parameters are
    /// registered with the manager (`component`, the runtime's residency options) and the
    /// model gets its own started execution session named `name`, on the component's device
    /// ([`RuntimeOptions::device_of`]) with that device's budget.
    pub fn add_model<T>(
        &mut self,
        name: &str,
        component: Component,
        source: SourceId,
        declare: impl FnOnce(&ParamBuilder<'_>) -> std::result::Result<T, ModelError>,
    ) -> Result<(ModelHandle, T)> {
        let device = self.device_index(component);
        let (model, params) = {
            let catalog = self
                .engine
                .manager()
                .source(source)
                .ok_or_else(|| RuntimeError::Unknown(format!("model source {source}")))?;
            let pb = ParamBuilder::new(Some(catalog), sd_models::weights::DEFAULT_PARAM_CAPACITY)?;
            pb.set_weight_type(self.options.weight_type);
            // Computed on the CPU with its kernels: what a quantized type leaves (the
            // convolution kernels) in bf16 where the CPU has AMX tiles.
            let host = self.options.host_kernels && self.devices[device].backend.is_cpu();
            pb.set_unquantized_type(sd_models::weights::unquantized_type_for(
                self.options.weight_type,
                host,
            ));
            let model = declare(&pb)?;
            (model, pb.finish())
        };
        let descs: Vec<(String, GTensor)> = params
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let mode = match self.options.params {
            ParamsLocation::Disk => ResidencyMode::Disk,
            _ => ResidencyMode::ParamBackend,
        };
        let dev = &self.devices[device];
        let (backend, backend_id, budget) = (dev.backend.clone(), dev.id, dev.budget);
        let split = component == Component::Diffusion && device == 0 && !self.split.is_empty();
        let model_bytes: u64 = descs.iter().map(|(_, t)| t.nbytes() as u64).sum();
        // Auto: only while the models placed there fit three quarters of the device's free
        // memory (the rest is for compute buffers); a model that does not fit streams from
        // RAM, as under a budget, instead of being read from the files again at each step.
        let room = backend
            .device()
            .map_or(0, |d| d.memory().free / 4 * 3)
            .saturating_sub(dev.weights_placed);
        let on_device = !backend.is_cpu()
            && !split
            && match self.options.params {
                ParamsLocation::Device => true,
                ParamsLocation::Auto => budget.is_none() && model_bytes <= room,
                ParamsLocation::Ram | ParamsLocation::Disk => false,
            };
        let ids = self.engine.manager_mut().register_params(
            ParamSpec {
                component,
                mode,
                params_backend: if on_device { backend_id } else { self.cpu_id },
                compute_backend: backend_id,
                source,
            },
            &descs,
        )?;
        let mut config = SessionConfig::new(name, backend.clone(), backend_id)
            .with_budget(budget)
            .with_segmentation(self.options.segmentation)
            .with_prefetch(self.options.prefetch)
            .with_streaming(self.options.streaming.clone())
            // The GPU whose runtime was measured: its operator pool counts in the budget.
            .with_runtime_temporaries(device == 0 && self.runtime_reserve > 0);
        if component == Component::Diffusion && device == 0 {
            for (b, id, budget) in &self.split {
                config = config.with_split_device(b.clone(), *id, *budget);
            }
        }
        if on_device {
            self.devices[device].weights_placed += model_bytes;
        }
        let session = self.engine.create_session(config);
        self.engine.start(session)?;
        tracing::debug!(
            model = name,
            params = ids.len(),
            device = %backend.name(),
            weights_on_device = on_device,
            "model added"
        );
        self.models.push(ModelSlot {
            name: name.to_string(),
            session,
            params,
            ids,
            device,
            on_device,
            constants: RunnerCache::default(),
            kept: Vec::new(),
        });
        Ok((ModelHandle(self.models.len() - 1), model))
    }

    /// The index in `devices` of `component`'s device (the runtime's one policy: the
    /// options decide, models never do).
    fn device_index(&self, component: Component) -> usize {
        let d = self.options.device_of(component);
        self.devices
            .iter()
            .position(|m| m.device == *d)
            .unwrap_or(0)
    }

    fn slot(&self, h: ModelHandle) -> Result<&ModelSlot> {
        self.models
            .get(h.0)
            .ok_or_else(|| RuntimeError::Unknown(format!("model handle {}", h.0)))
    }

    /// Builds a graph for model `h` with `build` (in a fresh [`GraphCtx`] of `graph_size`
    /// nodes and descriptors, with the compute options of the model's device) and executes it through
    /// the engine; returns the output as f32.
    pub fn run(
        &mut self,
        h: ModelHandle,
        description: &str,
        graph_size: usize,
        build: impl FnOnce(&mut GraphCtx) -> std::result::Result<BuiltGraph, ModelError>,
    ) -> Result<RunOutput> {
        let (mut task, output, _g, constants) =
            self.build_task(h, description, graph_size, build)?;
        self.execute_built(h, &mut task, &output, constants)
    }

    /// [`Runtime::run`] for a graph built again and again (every step of a sampling loop):
    /// the first run under `key` builds it with `build` and keeps it (the task, its plan
    /// in the engine, its segment graphs); a later run under the same key only feeds it
    /// `inputs`, in the order of [`KeyedGraph::inputs`], without building, capturing or
    /// planning anything. The model keeps its last [`MAX_KEPT_GRAPHS`] keys; they go with
    /// [`Runtime::release`] and [`Runtime::set_loras`].
    pub fn run_keyed(
        &mut self,
        h: ModelHandle,
        description: &str,
        graph_size: usize,
        key: GraphKey,
        inputs: Vec<HostData>,
        build: impl FnOnce(&mut GraphCtx) -> std::result::Result<KeyedGraph, ModelError>,
    ) -> Result<RunOutput> {
        self.slot(h)?;
        let found = self.models[h.0].kept.iter().position(|k| k.key == key);
        let mut kept = match found {
            Some(i) => {
                let mut k = self.models[h.0].kept.remove(i);
                if inputs.len() != k.fed {
                    return Err(RuntimeError::Output {
                        model: self.slot(h)?.name.clone(),
                        task: description.to_string(),
                        detail: format!(
                            "fed {} inputs to a graph kept with {}",
                            inputs.len(),
                            k.fed
                        ),
                    });
                }
                for ((t, bytes), data) in k.task.inputs.iter_mut().zip(&inputs) {
                    *bytes = host_bytes(t, data)?;
                }
                k.task.description = description.to_string();
                k
            }
            None => {
                let mut n = 0;
                let (task, output, g, constants) =
                    self.build_task(h, description, graph_size, |g| {
                        let built = build(g)?;
                        if built.inputs.len() != inputs.len() {
                            return Err(ModelError::Input {
                                name: "inputs",
                                detail: format!(
                                    "the graph has {} inputs, {} given",
                                    built.inputs.len(),
                                    inputs.len()
                                ),
                            });
                        }
                        n = inputs.len();
                        Ok(BuiltGraph {
                            output: built.output,
                            inputs: built.inputs.into_iter().zip(inputs).collect(),
                        })
                    })?;
                KeptTask {
                    key,
                    task,
                    output,
                    fed: n,
                    constants,
                    _g: g,
                }
            }
        };
        // What feeding the constants adds to the task goes again after the run.
        let (inputs_len, cached_len) = (kept.task.inputs.len(), kept.task.cached_inputs.len());
        let result = self.execute_built(h, &mut kept.task, &kept.output, kept.constants.clone());
        kept.task.inputs.truncate(inputs_len);
        kept.task.cached_inputs.truncate(cached_len);
        if result.is_ok() {
            let slot = &mut self.models[h.0];
            if slot.kept.len() >= MAX_KEPT_GRAPHS {
                slot.kept.remove(0);
            }
            slot.kept.push(kept);
        }
        result
    }

    /// Feeds `task` its `constants` (from the device where kept), executes it in model
    /// `h`'s session and returns `output` as f32.
    fn execute_built(
        &mut self,
        h: ModelHandle,
        task: &mut ComputeTask,
        output: &GTensor,
        constants: Vec<Constant>,
    ) -> Result<RunOutput> {
        let description = task.description.clone();
        let session = self.slot(h)?.session;
        let cache = &mut self.models[h.0].constants;
        let fed = cache.feed(&mut self.engine, session, task, constants);
        let result = match self.engine.execute(session, task) {
            Err(e) if e.is_out_of_memory() && !fed.is_empty() => {
                cache.fall_back(&mut self.engine, session, task, fed, &e)?;
                self.engine.execute(session, task)
            }
            other => other,
        }
        .map_err(|e| self.with_reserve(e))?;
        let data = result
            .output_f32()
            .filter(|_| output.dtype() == Some(DType::F32));
        let Some(data) = data else {
            return Err(RuntimeError::Output {
                model: self.slot(h)?.name.clone(),
                task: description,
                detail: format!("has type {:?}, not f32", output.dtype()),
            });
        };
        Ok(RunOutput {
            data,
            ne: result.ne,
            segmented: result.segmented,
            segments: result.segments,
            timing: result.timing,
            weight_upload_bytes: result.weight_upload_bytes,
            plan_kept: result.plan_kept,
        })
    }

    /// Builds a graph like [`Runtime::run`] and plans it against model `h`'s budget
    /// without running it ([`ExecutionEngine::plan`]): the preflight of a run.
    pub fn plan(
        &mut self,
        h: ModelHandle,
        description: &str,
        graph_size: usize,
        build: impl FnOnce(&mut GraphCtx) -> std::result::Result<BuiltGraph, ModelError>,
    ) -> Result<PlanSummary> {
        let (mut task, _, _g, constants) = self.build_task(h, description, graph_size, build)?;
        task.inputs
            .extend(constants.into_iter().map(|c| (c.tensor, c.bytes)));
        let session = self.slot(h)?.session;
        self.engine
            .plan(session, &task)
            .map_err(|e| self.with_reserve(e))
    }

    /// Adds the runtime reserve, and the operator temporaries kept from the budget since, to
    /// a budget shortfall, so its message names the `--max-vram` to ask for.
    fn with_reserve(&self, e: sd_exec::ExecError) -> RuntimeError {
        match e {
            sd_exec::ExecError::BudgetTooSmall(mut b) => {
                let kept = match (self.runtime_reserve, self.compute_device()) {
                    (r, Some(d)) if r > 0 => self.engine.manager().backend_temporaries(&d),
                    _ => 0,
                };
                b.runtime_reserve = self.runtime_reserve + kept;
                RuntimeError::Exec(sd_exec::ExecError::BudgetTooSmall(b))
            }
            other => RuntimeError::Exec(other),
        }
    }

    /// The task of [`Runtime::run`] for model `h`: the graph `build` makes (with the compute
    /// options of `h`'s device), its marks and inputs, and apart from them the constant
    /// inputs ([`sd_models::AuxInput::constant`]), not yet fed.
    fn build_task(
        &self,
        h: ModelHandle,
        description: &str,
        graph_size: usize,
        build: impl FnOnce(&mut GraphCtx) -> std::result::Result<BuiltGraph, ModelError>,
    ) -> Result<(ComputeTask, GTensor, GraphCtx, Vec<Constant>)> {
        let dev = &self.devices[self.slot(h)?.device];
        let mut opts = self.options.compute_options;
        opts.exact = dev.exact;
        opts.host_kernels = self.options.host_kernels && dev.backend.is_cpu();
        if dev.flash_attn_dims.is_some() {
            opts.flash_attn = true;
        }
        let mut g = GraphCtx::new(graph_size, graph_size, opts)?;
        g.ctx.set_f32_products(self.options.f32_products);
        g.ctx
            .set_direct_conv(self.options.direct_conv && !dev.backend.is_cpu());
        if let Some(dims) = &dev.flash_attn_dims {
            g.flash_attn_head_dims = Some(dims.clone());
            if self.options.flash_attn_pad && !dev.backend.is_cpu() {
                g.flash_attn_pad_to = Some(FLASH_ATTN_PAD_WIDTH);
            }
        }
        if !dev.backend.is_cpu() {
            g.ctx.set_band_bytes(band_bytes(
                dev.budget,
                self.options.band_divisor,
                self.options.band_min_bytes,
            ));
        }
        // Weights converted to bf16 (`--type bf16`), or quantized on a CPU with AMX tiles:
        // the CPU attention kernel runs its products in bf16 too.
        g.ctx
            .set_bf16_attention(sd_models::weights::bf16_attention_for(
                self.options.weight_type,
                opts.host_kernels,
            ));
        let built = build(&mut g)?;
        let mut graph = Graph::new(&g.ctx, graph_size).map_err(ModelError::from)?;
        built.output.set_output();
        graph
            .build_forward_expand(&built.output)
            .map_err(ModelError::from)?;
        let marks = std::mem::take(&mut g.marks);
        let mut task = ComputeTask::new(description, graph, built.output.clone()).with_marks(marks);
        let mut constants = Vec::new();
        let aux = g
            .aux
            .iter()
            .map(|a| (a.tensor.clone(), a.data.clone(), a.constant));
        let built_inputs = built.inputs.into_iter().map(|(t, d)| (t, d, false));
        for (t, data, constant) in built_inputs.chain(aux) {
            t.set_input();
            let bytes = host_bytes(&t, &data)?;
            if constant {
                constants.push(Constant { tensor: t, bytes });
            } else {
                task = task.with_input(&t, bytes);
            }
        }
        Ok((task, built.output, g, constants))
    }

    /// Executes a ready task in model `h`'s session.
    pub fn execute(&mut self, h: ModelHandle, task: &ComputeTask) -> Result<ComputeResult> {
        let session = self.slot(h)?.session;
        self.engine
            .execute(session, task)
            .map_err(|e| self.with_reserve(e))
    }

    /// Ends model `h`'s session (its workspace, caches and compute-device weight copies are
    /// released) and starts it again: call it when a phase that uses the model is over.
    pub fn release(&mut self, h: ModelHandle) -> Result<()> {
        let session = self.slot(h)?.session;
        self.engine.end(session)?;
        self.models[h.0].constants.forget();
        self.models[h.0].kept.clear();
        self.engine.start(session)?;
        Ok(())
    }

    /// Keeps model `h`'s constant inputs (RoPE tables, a prompt's text embedding) on the
    /// compute device between its runs, within the budget (see [`crate::runner_cache`]), or
    /// stops keeping them. Off by default; a failure for lack of memory switches it off for
    /// the model for good, and turning it on again is then ignored.
    pub fn keep_constants(&mut self, h: ModelHandle, on: bool) -> Result<()> {
        let session = self.slot(h)?.session;
        self.models[h.0]
            .constants
            .set_enabled(&mut self.engine, session, on)?;
        Ok(())
    }

    /// Model `h`'s constant inputs held on the device now, and why keeping them was
    /// switched off after a failure, if it was.
    pub fn constants_state(&self, h: ModelHandle) -> Result<(usize, Option<String>)> {
        let c = &self.slot(h)?.constants;
        Ok((c.entries(), c.disabled().map(str::to_string)))
    }

    /// Replaces the LoRAs applied to the main source's weights (the residency manager's
    /// `set_loras`, with its epochs): every model's session is ended first, so that no weight
    /// is in use, and started again after, whether or not the change succeeded.
    pub fn set_loras(&mut self, specs: Vec<sd_residency::LoraSpec>) -> Result<()> {
        let sessions: Vec<SessionId> = self.models.iter().map(|m| m.session).collect();
        for s in &sessions {
            self.engine.end(*s)?;
        }
        for m in &mut self.models {
            m.constants.forget();
            m.kept.clear();
        }
        let result = self.engine.manager_mut().set_loras(specs);
        for s in &sessions {
            self.engine.start(*s)?;
        }
        Ok(result?)
    }

    /// Loads model `h`'s weights now instead of at their first use, where they stay:
    /// parameters kept in RAM (computed on the CPU, or streamed from RAM to a device under
    /// a budget: then only the RAM copies load now, in batches over the load threads, and
    /// the device gets them as graphs need them, within the budget), or kept in their
    /// device's memory ([`ParamsLocation`]). Reports `progress(done, total)` in
    /// parameters; returns whether anything was loaded (parameters read from the files at
    /// each use are not).
    pub fn preload(
        &mut self,
        h: ModelHandle,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<bool> {
        let slot = self.slot(h)?;
        let ids = slot.ids.clone();
        let in_ram = self.options.params != ParamsLocation::Disk && !slot.on_device;
        let for_the_cpu = self.devices[slot.device].backend.is_cpu();
        if !in_ram && !slot.on_device {
            return Ok(false);
        }
        let _span = tracing::info_span!("preload", model = %self.slot(h)?.name).entered();
        let total = ids.len();
        let mut done = 0;
        progress(0, total);
        // RAM copies for a device: large batches (each one load call, its tensors read in
        // parallel); the others are prepared for compute, 64 at a time.
        let chunk = if in_ram && !for_the_cpu {
            PRELOAD_BATCH
        } else {
            64
        };
        for ids in ids.chunks(chunk) {
            let m = self.engine.manager_mut();
            if in_ram && !for_the_cpu {
                m.load_params_copies(ids)?;
            } else {
                m.prepare_params(ids)?;
                m.unpin_params(ids)?;
            }
            done += ids.len();
            progress(done, total);
        }
        Ok(true)
    }

    /// Bytes of the compute device's `--max-vram` budget left to its runtime (measured or
    /// [`RuntimeOptions::runtime_reserve`]; 0: none, as on the CPU or a simulated device).
    pub fn runtime_reserve(&self) -> u64 {
        self.runtime_reserve
    }

    /// Model `h`'s execution session in [`Runtime::engine`].
    pub fn session_of(&self, h: ModelHandle) -> Option<SessionId> {
        self.models.get(h.0).map(|m| m.session)
    }

    /// The name given to model `h`.
    pub fn model_name(&self, h: ModelHandle) -> Option<&str> {
        self.models.get(h.0).map(|s| s.name.as_str())
    }

    /// Whether model `h` keeps its weights in its (non-CPU) device's memory, read from the
    /// files straight there ([`ParamsLocation`]); `None` for an unknown handle.
    pub fn weights_on_device(&self, h: ModelHandle) -> Option<bool> {
        self.models.get(h.0).map(|m| m.on_device)
    }

    /// The declared parameters of model `h`.
    pub fn params(&self, h: ModelHandle) -> Option<&Params> {
        self.models.get(h.0).map(|s| &s.params)
    }

    /// The manager's ids of model `h`'s parameters.
    pub fn param_ids(&self, h: ModelHandle) -> Option<&[ParamId]> {
        self.models.get(h.0).map(|s| s.ids.as_slice())
    }

    /// The segment reports of model `h`'s last execution.
    pub fn last_segments(&self, h: ModelHandle) -> &[SegmentReport] {
        self.models
            .get(h.0)
            .and_then(|s| self.engine.session(s.session))
            .map_or(&[], |s| s.last_reports())
    }

    /// The compute backend ([`RuntimeOptions::compute`]; a model may compute elsewhere, see
    /// [`Runtime::model_backend`]).
    pub fn compute_backend(&self) -> &Arc<Backend> {
        &self.devices[0].backend
    }

    /// The compute device, if the backend has one.
    pub fn compute_device(&self) -> Option<Device> {
        self.devices[0].backend.device()
    }

    /// The budget in bytes on the compute device (from `--max-vram`), if any.
    pub fn budget(&self) -> Option<u64> {
        self.devices[0].budget
    }

    /// The backend model `h` computes on ([`RuntimeOptions::placement`]).
    pub fn model_backend(&self, h: ModelHandle) -> Option<&Arc<Backend>> {
        self.models
            .get(h.0)
            .map(|s| &self.devices[s.device].backend)
    }

    /// The budget in bytes on model `h`'s device (`None`: none, as on the CPU, or an
    /// unknown handle).
    pub fn model_budget(&self, h: ModelHandle) -> Option<u64> {
        self.models
            .get(h.0)
            .and_then(|s| self.devices[s.device].budget)
    }

    /// Whether model `h` computes on the CPU (its weights stay in host memory, nothing of
    /// it counts against a device budget); `false` for an unknown handle.
    pub fn model_on_cpu(&self, h: ModelHandle) -> bool {
        self.model_backend(h).is_some_and(|b| b.is_cpu())
    }

    /// The compute device `component`'s models get ([`RuntimeOptions::device_of`]), as
    /// the runtime resolved it: its backend.
    pub fn component_backend(&self, component: Component) -> &Arc<Backend> {
        &self.devices[self.device_index(component)].backend
    }

    /// The simulated layer-split devices (`--backend "sim:A&sim:B"`: SIM1, ...), for peak
    /// and live bytes in tests.
    pub fn split_sim_devices(&self) -> &[SimDevice] {
        &self.split_sims
    }

    /// The simulated device when computing on one (peak and live bytes for tests).
    pub fn sim_device(&self) -> Option<&SimDevice> {
        self.sim.as_ref()
    }

    /// The simulated devices of [`RuntimeOptions::placement`] other than the compute
    /// device and the split devices, in order of first mention.
    pub fn placed_sim_devices(&self) -> &[SimDevice] {
        &self.placed_sims
    }

    /// Whether graphs use flash attention (for some head widths on the compute device):
    /// [`RuntimeOptions::flash_attn`] resolved, or the compute options' own flag.
    pub fn flash_attention(&self) -> bool {
        self.devices[0].flash_attn_dims.is_some() || self.options.compute_options.flash_attn
    }

    /// Whether graphs on the compute device use exact f32 numerics
    /// ([`RuntimeOptions::exact`] resolved; see [`Runtime::model_exact`] for a model).
    pub fn exact(&self) -> bool {
        self.devices[0].exact
    }

    /// Whether model `h`'s graphs use exact f32 numerics ([`RuntimeOptions::exact`]
    /// resolved for its device); `None` for an unknown handle.
    pub fn model_exact(&self, h: ModelHandle) -> Option<bool> {
        self.models.get(h.0).map(|s| self.devices[s.device].exact)
    }

    /// The options the runtime was built with.
    pub fn options(&self) -> &RuntimeOptions {
        &self.options
    }

    /// The engine (reclaim log, sessions).
    pub fn engine(&self) -> &ExecutionEngine<ModelManager> {
        &self.engine
    }

    /// The engine, mutably.
    pub fn engine_mut(&mut self) -> &mut ExecutionEngine<ModelManager> {
        &mut self.engine
    }
}

/// The bytes of `data` in `t`'s element type.
fn host_bytes(t: &GTensor, data: &HostData) -> Result<Vec<u8>> {
    let dtype = t.dtype();
    let bad = |detail: String| {
        RuntimeError::Model(ModelError::Input {
            name: "graph input",
            detail: format!("`{}`: {detail}", t.name()),
        })
    };
    let bytes = match (data, dtype) {
        (HostData::I32(v), Some(DType::I32)) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (HostData::F32(v), Some(d)) if d.is_float() => {
            sd_tensor::convert::from_f32(d, v, t.ne()[0].max(1)).map_err(|e| bad(e.to_string()))?
        }
        (HostData::I32(_), d) => return Err(bad(format!("i32 host data for type {d:?}"))),
        (HostData::F32(_), d) => return Err(bad(format!("f32 host data for type {d:?}"))),
    };
    if bytes.len() != t.nbytes() {
        return Err(bad(format!(
            "{} bytes of data for a tensor of {} bytes",
            bytes.len(),
            t.nbytes()
        )));
    }
    Ok(bytes)
}

/// [`RuntimeOptions::exact`]: forced, or `base` (the compute options' own flag) off real
/// GPUs and fast numerics on them. The one place the default is decided.
fn resolve_exact(forced: Option<bool>, base: bool, on_gpu: bool) -> bool {
    forced.unwrap_or(base && !on_gpu)
}

/// The attention head widths (multiples of 8 up to 256) whose `flash_attn_ext` (f32 Q, f16
/// K/V, no mask) every one of `backends` runs; the others keep `mul_mat` attention.
/// The head width [`RuntimeOptions::flash_attn_pad`] pads narrower heads to.
pub const FLASH_ATTN_PAD_WIDTH: usize = 64;

/// The default of [`RuntimeOptions::band_min_bytes`].
pub const MIN_BAND_BYTES: u64 = 4 << 20;

/// The band limit of graphs on a device with `budget` (see
/// [`RuntimeOptions::band_divisor`]), at least `floor`: `None` without a budget or a
/// divisor.
fn band_bytes(budget: Option<u64>, divisor: Option<u64>, floor: u64) -> Option<usize> {
    let (b, d) = (budget?, divisor?);
    let limit = (b / d.max(1)).max(floor).max(1);
    Some(usize::try_from(limit).unwrap_or(usize::MAX))
}

fn flash_attn_head_dims(backends: &[&Backend]) -> Result<Vec<usize>> {
    let ctx = Context::new_descriptors(4 * 32, 1, 0).map_err(ModelError::from)?;
    let mut dims = Vec::new();
    for d in (8..=256).step_by(8) {
        let heads = 8;
        let q = ctx.new_tensor(DType::F32, &[d, 256, heads, 1]);
        let k = ctx.new_tensor(DType::F16, &[d, 256, heads, 1]);
        let v = ctx.new_tensor(DType::F16, &[d, 256, heads, 1]);
        let (q, k, v) = (
            q.map_err(ModelError::from)?,
            k.map_err(ModelError::from)?,
            v.map_err(ModelError::from)?,
        );
        let o = ctx
            .flash_attn_ext(&q, &k, &v, None, 1.0 / (d as f32).sqrt())
            .map_err(ModelError::from)?;
        if backends.iter().all(|b| b.supports_op(&o)) {
            dims.push(d);
        }
    }
    Ok(dims)
}

#[cfg(test)]
mod exact_tests {
    use super::{resolve_exact, ComputeDevice};

    #[test]
    fn gpus_default_to_fast_numerics_and_cpus_keep_the_compute_options() {
        assert!(
            resolve_exact(None, true, false),
            "CPU/sim: exact by default"
        );
        assert!(
            !resolve_exact(None, false, false),
            "CPU/sim: as the options say"
        );
        assert!(!resolve_exact(None, true, true), "GPU: fast by default");
        assert!(resolve_exact(Some(true), true, true), "SD_EXACT=1 on a GPU");
        assert!(
            !resolve_exact(Some(false), true, false),
            "forced fast on the CPU"
        );
    }

    #[test]
    fn sim_devices_parse_with_and_without_a_page() {
        let sim = |s: &str| s.parse::<ComputeDevice>();
        assert_eq!(
            sim("sim:512"),
            Ok(ComputeDevice::Sim {
                bytes: 512 << 20,
                page: 0
            })
        );
        assert_eq!(
            sim("sim:2G/2M"),
            Ok(ComputeDevice::Sim {
                bytes: 2 << 30,
                page: 2 << 20
            })
        );
        assert_eq!(
            sim("sim:64/4096"),
            Ok(ComputeDevice::Sim {
                bytes: 64 << 20,
                page: 4096
            })
        );
        for bad in ["sim:64/0", "sim:64/1G", "sim:64/x", "sim:0/2M"] {
            assert!(sim(bad).is_err(), "{bad} parsed");
        }
    }
}
