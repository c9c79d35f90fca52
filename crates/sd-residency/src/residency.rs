//! The [`DeviceResidencyManager`] trait: what the execution layer asks of the weight
//! residency layer, and the ids, requests and results it speaks in.
//!
//! The method set follows stable-diffusion.cpp's `DeviceResidencyManager`
//! (`src/device_residency_manager.h`): segmented-compute and prefetch switches, runtime owners, capacity checks,
//! eviction candidates, prefetch, prepare/pin/release of parameters, compute backend
//! assignment and runtime residency of owners. Where upstream passes `ggml_tensor*` and
//! owner addresses, sd-rs passes [`ParamId`] and [`OwnerId`] newtypes; a graph refers to a
//! parameter through its [`GTensor`](sd_tensor::ggml::GTensor) descriptor, whose identity
//! ([`TensorId`]) never changes while the manager moves its storage between devices.

use std::fmt;
use std::path::PathBuf;

use sd_tensor::ggml::TensorId;
use sd_tensor::GgmlError;
use thiserror::Error;

use crate::capacity::DeviceMemoryCapacity;
use sd_formats::files::FileError;

/// A registered parameter (weight) of the manager. Ids are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub u64);

/// A runtime owner (a runner or execution session): holds workspaces and caches on devices
/// and counts as "running" while registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u64);

/// A compute or params backend registered with the manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(pub u32);

/// A residency block (one device or host buffer holding weights). Ids are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u64);

/// A model source: the main catalog ([`SourceId::MAIN`]) or an auxiliary model's catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceId(pub u32);

impl SourceId {
    /// The manager's main catalog.
    pub const MAIN: SourceId = SourceId(0);
}

impl fmt::Display for ParamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "param#{}", self.0)
    }
}

impl fmt::Display for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "backend#{}", self.0)
    }
}

impl fmt::Display for SourceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "source#{}", self.0)
    }
}

/// Outcome of [`DeviceResidencyManager::prefetch_params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightPrefetchResult {
    /// Staging copies were made; activate them with
    /// [`DeviceResidencyManager::activate_prefetched_params`].
    Scheduled,
    /// Every parameter that could be prefetched is already resident on its compute device.
    AlreadyResident,
    /// Prefetch is off, the compute device is the CPU, or some parameters need a
    /// synchronous load that prefetch does not do.
    Unsupported,
    /// The parameters have different compute backends, or loading / allocating failed.
    Failed,
}

/// One evictable weight buffer on a compute backend's device (stable-diffusion.cpp's
/// `WeightResidencyBlock`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightResidencyBlock {
    /// The block.
    pub id: BlockId,
    /// The backend whose device the block lives on (the one asked about).
    pub backend: BackendId,
    /// Parameters whose storage is in the block.
    pub params: Vec<ParamId>,
    /// Bytes freed by evicting it.
    pub bytes: u64,
    /// Latest last-use epoch of its members.
    pub last_use_epoch: u64,
    /// Whether evicting it switches device-resident `ParamBackend` weights to `Disk` mode
    /// for good (they are reloaded from their files when next needed).
    pub requires_demotion: bool,
    /// Whether it is a region of a staging pool: evicting it makes room in the pool and
    /// frees no device memory (`bytes` is the room).
    pub pooled: bool,
}

/// A capacity question about one compute backend (stable-diffusion.cpp's `DeviceMemoryRequest`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendMemoryRequest {
    /// The compute backend.
    pub backend: BackendId,
    /// Who asks (its own runtime residency is not counted as "other owners'").
    pub owner: OwnerId,
    /// New runtime bytes the work needs (workspaces, caches) besides weights.
    pub pending_bytes: u64,
    /// Runtime bytes the owner already holds on the device.
    pub runtime_resident_bytes: u64,
    /// A budget for this request (`None`: only the manager's per-device budget applies;
    /// with both, the smaller one).
    pub max_backend_bytes: Option<u64>,
}

impl BackendMemoryRequest {
    /// A request with nothing pending.
    pub fn new(backend: BackendId, owner: OwnerId) -> Self {
        BackendMemoryRequest {
            backend,
            owner,
            pending_bytes: 0,
            runtime_resident_bytes: 0,
            max_backend_bytes: None,
        }
    }
}

/// Errors of the residency layer. Every message names what is wrong (the tensor, its file,
/// both shapes) so that a user can act on it.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ResidencyError {
    /// A parameter id the manager does not know (never registered, or unregistered).
    #[error("unknown parameter {0}")]
    UnknownParam(ParamId),
    /// A backend id the manager does not know.
    #[error("unknown backend {0}")]
    UnknownBackend(BackendId),
    /// A model source the manager does not know.
    #[error("unknown model source {0}")]
    UnknownSource(SourceId),
    /// A tensor the model needs is in none of the source's files.
    #[error("tensor `{name}` is missing from the model files of {source_id}")]
    MissingTensor {
        /// The tensor's name in the files.
        name: String,
        /// The source searched.
        source_id: SourceId,
    },
    /// The file's tensor has another shape than the model's.
    #[error("tensor `{name}`: the model expects shape {expected:?} but the file ({}) holds {found:?}", path.display())]
    ShapeMismatch {
        /// The tensor's name.
        name: String,
        /// The model's shape, outermost first.
        expected: Vec<u64>,
        /// The file's shape, outermost first.
        found: Vec<u64>,
        /// The file.
        path: PathBuf,
    },
    /// A registered tensor cannot be managed (a view, already allocated, unknown dtype...).
    #[error("tensor `{name}` cannot be registered: {detail}")]
    BadTensor {
        /// The tensor's name.
        name: String,
        /// Why.
        detail: String,
    },
    /// Reading a model or LoRA file failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// A ggml operation (allocation, placement, copy) failed.
    #[error("{context}: {source}")]
    Ggml {
        /// What the manager was doing.
        context: String,
        /// The ggml error.
        #[source]
        source: GgmlError,
    },
    /// The operation is refused while owners run or weights are pinned.
    #[error("{0} is refused while an owner is running or weights are pinned")]
    Busy(&'static str),
    /// A pinned parameter cannot be changed (reassigned, unregistered).
    #[error("parameter `{name}` is pinned")]
    Pinned {
        /// The parameter's name.
        name: String,
    },
    /// A model source still has registered weights, or is already known.
    #[error("model source {source_id}: {detail}")]
    Source {
        /// The source.
        source_id: SourceId,
        /// What is wrong.
        detail: String,
    },
    /// A LoRA file names weights the model does not have.
    #[error("LoRA {}: {} tensor(s) name weights the model does not have: {}", path.display(), names.len(), names.join(", "))]
    LoraUnknownWeights {
        /// The LoRA file.
        path: PathBuf,
        /// The LoRA tensor names without a target (sorted).
        names: Vec<String>,
    },
    /// A LoRA tensor that is malformed or of an unsupported kind.
    #[error("LoRA {}: tensor `{name}`: {detail}", path.display())]
    LoraTensor {
        /// The LoRA file.
        path: PathBuf,
        /// The LoRA tensor.
        name: String,
        /// What is wrong.
        detail: String,
    },
}

impl ResidencyError {
    pub(crate) fn ggml(context: impl Into<String>) -> impl FnOnce(GgmlError) -> ResidencyError {
        let context = context.into();
        move |source| ResidencyError::Ggml { context, source }
    }
}

/// Result of the residency layer.
pub type Result<T, E = ResidencyError> = std::result::Result<T, E>;

/// What the execution layer asks of the weight residency layer.
///
/// Capacity requests select their backend's weights (parameters computed elsewhere are
/// ignored); protection spans all backends.
pub trait DeviceResidencyManager {
    /// Whether graphs may be computed in segments (weights streamed per segment).
    fn segmented_compute_enabled(&self) -> bool;
    /// Whether weights may be prefetched to compute devices ahead of use.
    fn prefetch_enabled(&self) -> bool;
    /// The budget set for a backend's device (`--max-vram`), if any.
    fn backend_budget(&self, _backend: BackendId) -> Option<u64> {
        None
    }

    /// Keeps `bytes` more of the backend's budget for the operator temporaries its runtime
    /// allocates outside tracked buffers (ggml's CUDA pool keeps its high-water mark), beyond
    /// what the runtime reserve already covers. Monotone: the budget is lowered by the
    /// largest amount asked for so far. Default: nothing (no budget to lower).
    fn reserve_backend_temporaries(&mut self, _backend: BackendId, _bytes: u64) {}

    /// Registers a runtime owner: while any is registered, LoRA changes are refused.
    fn register_runtime_owner(&mut self, owner: OwnerId);
    /// Removes an owner, its runtime residency and its prefetched weights.
    fn remove_runtime_owner(&mut self, owner: OwnerId);

    /// Whether the request and the missing bytes of `required` fit the backend's device now
    /// (no reclamation needed, report not wrapped).
    fn fits_compute_backend_capacity(
        &self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
    ) -> Result<bool>;
    /// The full capacity answer for the request and `params`.
    fn inspect_compute_backend_capacity(
        &self,
        request: &BackendMemoryRequest,
        params: &[ParamId],
    ) -> Result<DeviceMemoryCapacity>;
    /// Blocks on `backend`'s device that could be evicted now (see
    /// [`WeightResidencyBlock`]).
    fn evictable_compute_backend_blocks(
        &self,
        backend: BackendId,
        protected: &[ParamId],
    ) -> Vec<WeightResidencyBlock>;
    /// Evicts a block returned by
    /// [`evictable_compute_backend_blocks`](Self::evictable_compute_backend_blocks), if it
    /// is still evictable as described; returns whether it was.
    fn evict_compute_backend_block(&mut self, block: &WeightResidencyBlock) -> bool;

    /// Loads `params` and uploads staging copies to their compute device without making
    /// them current (see [`WeightPrefetchResult`]).
    fn prefetch_params(&mut self, owner: OwnerId, params: &[ParamId]) -> WeightPrefetchResult;
    /// Makes the owner's prefetched copies of `params` current (staged): the prefetch
    /// blocks holding any of them, waiting (in the device's queue where it can, else on
    /// the host) only for the transfers that fill those blocks; the owner's other
    /// prefetches (for later segments) stay in flight. Returns whether any was found.
    fn activate_prefetched_params(&mut self, owner: OwnerId, params: &[ParamId]) -> Result<bool>;
    /// Frees the owner's prefetched copies that were not activated.
    fn clear_prefetched_params(&mut self, owner: OwnerId);

    /// Loads `params` to their params backend, stages them to their compute backend, applies
    /// LoRAs and pins them (one pin each). On error nothing this call allocated stays.
    fn prepare_params(&mut self, params: &[ParamId]) -> Result<()>;
    /// Takes one pin on each parameter (pinned weights are never evicted).
    fn pin_params(&mut self, params: &[ParamId]) -> Result<()>;
    /// Drops one pin from each parameter.
    fn unpin_params(&mut self, params: &[ParamId]) -> Result<()>;
    /// Frees staging blocks all of whose members are in `params` and unpinned.
    fn release_compute_backend_params(&mut self, params: &[ParamId]) -> Result<()>;
    /// Frees `Disk`-mode storage blocks all of whose members are in `params`, unpinned and
    /// unstaged. `ParamBackend` storage stays resident.
    fn release_params_backend_params(&mut self, params: &[ParamId]) -> Result<()>;
    /// Moves the computation of unpinned `params` to `backend`.
    fn assign_compute_backend(&mut self, params: &[ParamId], backend: BackendId) -> Result<()>;
    /// Records the runtime bytes (workspaces, caches) an owner holds on a backend's device.
    fn update_runtime_residency(&mut self, owner: OwnerId, backend: BackendId, bytes: u64);
    /// The parameter a graph tensor stands for.
    fn resolve_param(&self, tensor: TensorId) -> Option<ParamId>;

    /// Gives `backend` a staging pool of `bytes` for `owner` (`None`: frees its pool): one
    /// device buffer, allocated once, from which staging copies are sub-allocated instead of
    /// a device buffer per staged group, so that streaming weights allocates nothing inside
    /// a step. A pool of that size and owner is kept as is; any other pool on the backend is
    /// freed first (with the staging copies in it). The pool counts in the device's weight
    /// bytes at its full size; the caller makes room for it first. Returns whether the
    /// backend has a pool now (never for the CPU, or where the manager has no pools).
    fn set_staging_pool(
        &mut self,
        _owner: OwnerId,
        _backend: BackendId,
        _bytes: Option<u64>,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Whether the request fits once the staging copies of `required` that go to the
    /// backend's staging pool find room in it (what evicting blocks of the pool can
    /// achieve): when it does not, evicting pool blocks cannot make it fit. Without a pool,
    /// [`fits_compute_backend_capacity`](Self::fits_compute_backend_capacity).
    fn fits_with_pool_room(
        &self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
    ) -> Result<bool> {
        self.fits_compute_backend_capacity(request, required)
    }

    /// Whether the backend's staging pool has free regions for the staging copies of
    /// `params` that would go to it (placed in order, as staging places them); `true`
    /// without a pool or when none would go to it. When it is `false` they would be staged
    /// in buffers of their own, next to a pool the plan counted them in.
    fn pool_holds(&self, backend: BackendId, params: &[ParamId]) -> Result<bool> {
        let _ = (backend, params);
        Ok(true)
    }

    /// Weight bytes copied from params copies to compute devices so far (staging and
    /// prefetch uploads), for per-run traffic figures; 0 where not counted.
    fn weight_upload_bytes(&self) -> u64 {
        0
    }

    /// Weights a runtime keeps staged from step to step (its resident set): staged at the
    /// high end of the staging pools, so that the weights it streams through the pool find
    /// one contiguous region at the low end instead of holes between kept blocks. Replaces
    /// the previous set (empty: none). Default: ignored.
    fn keep_at_pool_end(&mut self, _params: &[ParamId]) {}

    /// The owner and size of `backend`'s staging pool, if it has one.
    fn staging_pool(&self, _backend: BackendId) -> Option<(OwnerId, u64)> {
        None
    }

    /// Whether uploads queued on a device's copy stream wait, in the device's queues, for
    /// the compute queued on it so far (default: on). A caller that keeps every weight a
    /// queued compute reads pinned until that compute is done (so that no memory freed for
    /// an upload is read by queued compute) turns it off, so that uploads overlap the
    /// queued compute. Default: ignored.
    fn set_uploads_wait_for_compute(&mut self, _on: bool) {}

    /// Waits on the host for the queued uploads of the prefetches made current so far
    /// (those a compute backend already waits on in its queue); the caller calls it just
    /// before computing and times it as the upload wait: the part of the asynchronous
    /// uploads that the previous compute did not hide. No-op where uploads are not queued.
    fn wait_for_uploads(&mut self) {}
}
