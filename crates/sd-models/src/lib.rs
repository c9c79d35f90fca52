//! `sd-models`: the model graphs of sd-rs.
//!
//! Each architecture lives in one file, in the style of candle's model files: a config
//! struct whose defaults cite the upstream configuration, module structs whose field paths
//! equal the checkpoint keys (canonical names, see [`sd_formats::names`]), and a forward
//! pass in numbered stages that only *builds* a ggml graph:
//!
//! - [`clip`]: the CLIP text encoder (SD1 CLIP-L, SD2 OpenCLIP-H in the transformers layout).
//! - [`vae`]: the AutoencoderKL encoder and decoder.
//! - [`wan_vae`]: the Wan-2.1 video VAE of Qwen-Image, as a 2-D network for single images.
//! - [`t5`]: the T5 v1.1 encoder (T5-XXL of FLUX.1 and SD3), relative position bias.
//! - [`llm`]: a decoder-only language model as a text encoder (Qwen2.5-VL-7B of Qwen-Image).
//! - [`unet`]: the SD1.x / SD2.x UNet, with graph-cut marks at block boundaries.
//! - [`flux`], [`mmdit`], [`qwen_image`]: the diffusion transformers (FLUX.1, SD3/SD3.5,
//!   Qwen-Image), on the shared blocks of [`dit`].
//! - [`diffusion`], [`text_encoder`], [`first_stage`]: the networks of each role as closed
//!   enums ([`diffusion::DiffusionNet`] fed one [`diffusion::DiffusionInputs`],
//!   [`text_encoder::TextEncoder`], [`first_stage::FirstStage`]), each stating its graph size.
//! - [`esrgan`], [`srvgg`], [`mosr`]: image upscalers (RRDBNet, SRVGGNetCompact, MoSR), with
//!   architecture detection in [`upscaler`].
//!
//! Parameters are declared through a [`ParamBuilder`] ([`weights`]): every tensor is
//! registered by canonical name in a no-alloc parameter context, its dtype taken from the
//! model file; where the weights live is decided elsewhere (a residency manager, or
//! [`weights::load_all_to_cpu`] for tests and the CLI). Model code never allocates.
//!
//! Forward passes take a [`GraphCtx`]: the compute context, the [`CutMarks`] the graph
//! planner reads, and the auxiliary inputs (masks) a model needs filled in before
//! execution. [`run::run_cpu`] executes such a graph on the CPU backend (tests, tools);
//! [`bench`] builds synthetic full-size models for benchmarks.

#![warn(missing_docs)]

pub mod bench;
pub mod clip;
pub mod diffusion;
pub mod dit;
pub mod esrgan;
pub mod first_stage;
pub mod flux;
pub mod llm;
pub mod mmdit;
pub mod mosr;
pub mod nn;
pub mod qwen_image;
pub mod run;
pub mod srvgg;
pub mod t5;
pub mod text_encoder;
pub mod unet;
pub mod upscaler;
pub mod vae;
pub mod wan_vae;
pub mod weights;

use sd_graphcut::CutMarks;
use sd_tensor::ggml::{Context, GTensor};
use sd_tensor::{DType, GgmlError};
use thiserror::Error;

pub use weights::{load_all_to_cpu, ParamBuilder, Params};

/// Errors of model construction and graph building.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A parameter the model needs is not in the model file.
    #[error("missing tensor `{name}`")]
    MissingTensor {
        /// Canonical name of the tensor.
        name: String,
    },
    /// A parameter's shape in the file differs from what the config implies.
    #[error("tensor `{name}`: shape in file {file:?}, model expects {expected:?}")]
    ShapeMismatch {
        /// Canonical name of the tensor.
        name: String,
        /// Shape in the file (outermost first).
        file: Vec<u64>,
        /// Shape the model declares (outermost first).
        expected: Vec<usize>,
    },
    /// A parameter was declared twice.
    #[error("tensor `{name}` declared twice")]
    Duplicate {
        /// Canonical name of the tensor.
        name: String,
    },
    /// The configuration is inconsistent.
    #[error("invalid config: {0}")]
    Config(String),
    /// An input tensor has the wrong shape or type.
    #[error("invalid input `{name}`: {detail}")]
    Input {
        /// Which input.
        name: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A ggml operation rejected its operands, or allocation/compute failed.
    #[error(transparent)]
    Ggml(#[from] GgmlError),
    /// A model file could not be read.
    #[error(transparent)]
    File(#[from] sd_formats::files::FileError),
    /// A graph-cut mark was rejected.
    #[error(transparent)]
    Cut(#[from] sd_graphcut::GraphCutError),
    /// Name conversion failed.
    #[error(transparent)]
    Names(#[from] sd_formats::names::NameError),
}

/// Convenience alias.
pub type Result<T> = std::result::Result<T, ModelError>;

/// Host data for a graph input.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 values (converted to the tensor's type when written).
    F32(Vec<f32>),
    /// i32 values (the tensor must be I32).
    I32(Vec<i32>),
}

impl HostData {
    /// Writes the data into an allocated tensor.
    pub fn write_to(&self, t: &GTensor) -> Result<()> {
        match self {
            HostData::F32(v) => t.write_f32(v)?,
            HostData::I32(v) => t.write_i32(v)?,
        }
        Ok(())
    }
}

/// An input tensor a model created while building its graph (an attention mask), with the
/// data to write into it once the graph is allocated.
#[derive(Clone, Debug)]
pub struct AuxInput {
    /// The input tensor (flagged as a graph input).
    pub tensor: GTensor,
    /// Its data.
    pub data: HostData,
    /// Whether the data stays the same across the runs of one phase for graphs of the same
    /// shapes (RoPE tables, an embedded text prompt): a runtime may keep it on the device
    /// between runs instead of uploading it each time.
    pub constant: bool,
}

/// Numerical choices of a forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeOptions {
    /// Exact f32 numerics: f32 im2col in convolutions and exact activation formulas
    /// (ggml's CPU `gelu` and `gelu_quick` read f16 lookup tables). Off: ggml's fast paths,
    /// as stable-diffusion.cpp uses them.
    pub exact: bool,
    /// Use `flash_attn_ext` (K and V rounded to f16) for unmasked attention instead of
    /// `mul_mat` + `soft_max_ext` in f32.
    pub flash_attn: bool,
    /// The graph is computed by ggml's CPU backend: use this crate family's CPU kernels
    /// (ggml custom ops, which only the CPU backend runs) where they beat ggml's
    /// ([`GraphCtx::new`] sets the context's flag). With ggml's bits: the convolutions'
    /// im2col and epilogue (`sd_tensor`'s `conv_2d_host`) and the per-channel scale and
    /// shift of group norms and time embeddings (`channel_affine`). Within f32 rounding of
    /// ggml's: unmasked attention (`attention_host`, all f32) and the upscalers'
    /// channels-innermost convolutions (`conv_2d_cwh`). With `exact`, the DiTs' and T5's
    /// tanh GELU in one pass (`gelu_tanh_host`: within 1e-6 of the formula in ggml's f32
    /// ops, closer to it in f64 where those cancel).
    pub host_kernels: bool,
}

impl Default for ComputeOptions {
    /// Exact numerics, no flash attention, ggml's kernels only.
    fn default() -> Self {
        ComputeOptions {
            exact: true,
            flash_attn: false,
            host_kernels: false,
        }
    }
}

/// What a forward pass builds into: the compute context, the cut marks and the auxiliary
/// inputs the caller must fill after allocating the graph.
#[derive(Debug)]
pub struct GraphCtx {
    /// The no-alloc compute context the graph's tensors are created in.
    pub ctx: Context,
    /// Graph-cut marks set by the model at block boundaries.
    pub marks: CutMarks,
    /// Inputs the model created, with their data.
    pub aux: Vec<AuxInput>,
    /// Numerical options.
    pub opts: ComputeOptions,
    /// With `opts.flash_attn`: the head widths that use `flash_attn_ext` (`None`: all).
    /// Backends' kernels cover some widths only (ggml's CUDA backend has none for 160, an
    /// SD1.5 UNet width); other widths fall back to `mul_mat` attention.
    pub flash_attn_head_dims: Option<Vec<usize>>,
    /// With `opts.flash_attn`: head widths below this run flash attention at this width,
    /// zeros appended to each head (the same values; `None`: each at its own width).
    /// ggml's CUDA backend runs widths under 64 (SD1's 40) on a generic tile kernel about
    /// ten times slower per FLOP than its tensor-core kernels for 64 and up.
    pub flash_attn_pad_to: Option<usize>,
}

impl GraphCtx {
    /// A graph context with a fresh no-alloc compute context of `max_tensors` descriptors
    /// and room for one graph of `graph_size` nodes.
    pub fn new(max_tensors: usize, graph_size: usize, opts: ComputeOptions) -> Result<GraphCtx> {
        let ctx = Context::new_descriptors(max_tensors, graph_size, 1)?;
        ctx.set_host_kernels(opts.host_kernels);
        Ok(GraphCtx {
            ctx,
            marks: CutMarks::new(),
            aux: Vec::new(),
            opts,
            flash_attn_head_dims: None,
            flash_attn_pad_to: None,
        })
    }

    /// Whether attention with head width `d` (and no mask) uses `flash_attn_ext`.
    pub fn flash_attn_for(&self, d: usize) -> bool {
        self.opts.flash_attn
            && self
                .flash_attn_head_dims
                .as_ref()
                .is_none_or(|dims| dims.contains(&d))
    }

    /// Creates an input tensor (flagged as input) named `name` whose data is `data`.
    pub fn aux_input(
        &mut self,
        name: &str,
        dtype: DType,
        ne: &[usize],
        data: HostData,
    ) -> Result<GTensor> {
        let t = self.ctx.new_tensor(dtype, ne)?;
        t.set_name(name);
        t.set_input();
        self.aux.push(AuxInput {
            tensor: t.clone(),
            data,
            constant: false,
        });
        Ok(t)
    }

    /// Like [`GraphCtx::aux_input`], for data that stays the same across the runs of one
    /// phase ([`AuxInput::constant`]).
    pub fn constant_input(
        &mut self,
        name: &str,
        dtype: DType,
        ne: &[usize],
        data: HostData,
    ) -> Result<GTensor> {
        let t = self.aux_input(name, dtype, ne, data)?;
        if let Some(a) = self.aux.last_mut() {
            a.constant = true;
        }
        Ok(t)
    }
}
