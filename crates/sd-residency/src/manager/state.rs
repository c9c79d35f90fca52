//! Per-parameter state.

use sd_tensor::ggml::GTensor;
use sd_tensor::DType;

use crate::residency::{BackendId, BlockId, OwnerId, SourceId};

/// Which model component a parameter belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// The diffusion model (UNet, DiT).
    Diffusion,
    /// A text encoder.
    TextEncoder,
    /// The autoencoder.
    Vae,
    /// A ControlNet.
    ControlNet,
    /// An image upscaler (auxiliary model source).
    Upscaler,
    /// A latent upsampler.
    LatentUpsampler,
    /// Anything else.
    Other,
}

impl Component {
    /// Whether LoRAs may patch this component's weights.
    pub fn accepts_lora(self) -> bool {
        !matches!(self, Component::Upscaler | Component::LatentUpsampler)
    }
}

/// Where a parameter's params copy lives between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResidencyMode {
    /// Loaded from the files when needed; its buffers are freed after use.
    Disk,
    /// Loaded once to the params backend and resident for the manager's life.
    ParamBackend,
}

/// How to register a group of parameters (see
/// [`ModelManager::register_params`](super::ModelManager::register_params)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// The component.
    pub component: Component,
    /// Residency mode.
    pub mode: ResidencyMode,
    /// Where the params copy lives.
    pub params_backend: BackendId,
    /// Where the parameters are computed.
    pub compute_backend: BackendId,
    /// The catalog the tensors are read from.
    pub source: SourceId,
}

/// Where a loaded params copy is: a storage descriptor placed in a storage block.
#[derive(Clone, Debug)]
pub(crate) struct StorageLoc {
    pub block: BlockId,
    /// The storage descriptor (same dtype and shape as the registered tensor).
    pub desc: GTensor,
    /// Its byte offset in the block's buffer.
    pub offset: usize,
}

/// One registered parameter.
#[derive(Clone, Debug)]
pub(crate) struct ParamState {
    /// Name of the tensor in the source's catalog.
    pub name: String,
    /// The registered descriptor (its identity never changes).
    pub tensor: GTensor,
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    pub component: Component,
    pub mode: ResidencyMode,
    pub params_backend: BackendId,
    pub compute_backend: BackendId,
    pub source: SourceId,
    pub pin_count: u32,
    pub last_use_epoch: u64,
    /// The LoRA epoch whose patch the current memory of `tensor` carries.
    pub lora_epoch: Option<u64>,
    /// The params copy, when loaded.
    pub storage: Option<StorageLoc>,
    /// `tensor` itself is placed over its params copy (params and compute share memory).
    pub bound: bool,
    /// `tensor` is placed in this staging block (a copy on the compute device).
    pub staged: Option<BlockId>,
    /// `tensor` is placed in a prefetch chunk of this owner, not yet activated.
    pub prefetched: Option<(OwnerId, BlockId)>,
    /// Whether `tensor` is a view (never for registered weights; kept for the rules).
    pub view: bool,
    /// Whether the params copy is split across devices (row split; not implemented yet).
    pub split: bool,
}

impl ParamState {
    /// Whether the params copy is a zero-copy file mapping (set by the manager).
    pub fn is_resident_on_compute(&self) -> bool {
        self.bound || self.staged.is_some()
    }
}
