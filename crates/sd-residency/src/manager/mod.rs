//! [`ModelManager`]: the implementation of [`DeviceResidencyManager`].
//!
//! # Storage, staging and identity
//!
//! Every registered parameter is a [`GTensor`] descriptor built by a model (no memory of its
//! own) and a `ParamState`. The manager gives it memory in two ways:
//! - **params copy**: a *storage descriptor* of the same dtype and shape, placed in a
//!   storage block on the params backend (a buffer of at most [`MAX_RESIDENCY_BLOCK_BYTES`]
//!   on devices, or a zero-copy mapping of the whole model file); bytes are streamed from the
//!   files into it, converted to the registered dtype;
//! - **compute copy**: when the params memory is usable by the compute backend (same device,
//!   or host memory for the CPU), the registered tensor is placed over the params copy
//!   ("bound"); otherwise it is placed in a staging block on the compute device and the
//!   params copy is copied into it.
//!
//! The registered descriptor never changes identity: the graph keeps referring to it while
//! its memory moves. Upstream swaps buffer/data between the managed and a staging tensor;
//! here the registered tensor is placed directly (it has no memory when unstaged), so every
//! buffer clears exactly the descriptors placed in it when it is dropped (RAII), and no
//! unsafe swap is needed.
//!
//! # Accounting
//!
//! The bytes resident on a device are the sizes of the distinct storage, staging and
//! prefetch buffers on it (host buffers for the CPU device): a file mapping counts once at
//! its full size, however many tensors it serves; so does a staging pool (`pool`: one
//! buffer per compute backend, set by the engine, from which staging copies are
//! sub-allocated instead of allocating a buffer per staged group). Capacity checks add the runtime residency
//! owners report, and use [`inspect_capacity`] with the device's report, the tracked bytes
//! and the budget.

mod blocks;
pub mod eviction;
mod loading;
mod lora;
mod lycoris;
mod pool;
mod sources;
mod staging;
mod state;
mod transfer;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use sd_tensor::ggml::{Backend, Buffer, CopyStream, Device, DeviceKind, GTensor, TensorId};

pub use blocks::MAX_RESIDENCY_BLOCK_BYTES;
pub use lora::LoraSpec;
pub use state::{Component, ParamSpec, ResidencyMode};

use crate::capacity::{
    inspect_capacity, DeviceClass, DeviceMemoryCapacity, DeviceMemoryRequest, DeviceState, MaxVram,
    CUDA_RUNTIME_RESERVE_BYTES, DEVICE_RESERVE_BYTES,
};
use crate::residency::{
    BackendId, BackendMemoryRequest, BlockId, DeviceResidencyManager, OwnerId, ParamId,
    ResidencyError, Result, SourceId, WeightPrefetchResult, WeightResidencyBlock,
};
use blocks::{AnyBlock, StagingBlock, StagingMem, StorageBlock};
use sd_formats::files::TensorCatalog;
use state::ParamState;

/// Whether a buffer lives on `device` (host buffers for the CPU device).
pub(crate) fn buffer_on_device(buffer: &Buffer, device: &Device) -> bool {
    if device.kind() == DeviceKind::Cpu {
        return buffer.is_host();
    }
    !buffer.is_host()
        && buffer
            .buffer_type()
            .ok()
            .and_then(|t| t.device())
            .is_some_and(|d| d == *device)
}

/// A read-only view of one parameter's residency, for diagnostics and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Name in its source's catalog.
    pub name: String,
    /// Component.
    pub component: Component,
    /// Residency mode (eviction may demote `ParamBackend` to `Disk`).
    pub mode: ResidencyMode,
    /// Params backend.
    pub params_backend: BackendId,
    /// Compute backend.
    pub compute_backend: BackendId,
    /// Source catalog.
    pub source: SourceId,
    /// Pins held.
    pub pin_count: u32,
    /// Last-use epoch.
    pub last_use_epoch: u64,
    /// LoRA epoch of the patch its current memory carries.
    pub lora_epoch: Option<u64>,
    /// Whether the params copy is loaded.
    pub loaded: bool,
    /// Whether the params copy is a zero-copy file mapping.
    pub mmapped: bool,
    /// Whether a staging copy is current on the compute device.
    pub staged: bool,
    /// Whether the registered tensor has memory usable by its compute backend.
    pub resident_on_compute: bool,
}

/// The model manager: owns parameter states, their buffers on params and compute backends,
/// model sources and LoRAs, and answers capacity questions (see the module docs).
pub struct ModelManager {
    /// Prefetch copies in flight. First field: dropped (joined) before any buffer.
    pub(crate) transfers: Vec<transfer::TransferJob>,
    /// Copy streams by compute backend (`None`: the backend has none), made on first use.
    /// Dropped (their copies finished) after the transfers, before any buffer.
    pub(crate) copy_streams: BTreeMap<BackendId, Option<CopyStream>>,
    backends: Vec<(Arc<Backend>, Device)>,
    pub(crate) sources: BTreeMap<SourceId, TensorCatalog>,
    next_source: u32,
    pub(crate) states: BTreeMap<ParamId, ParamState>,
    by_tensor: HashMap<TensorId, ParamId>,
    next_param: u64,
    pub(crate) storage: BTreeMap<BlockId, StorageBlock>,
    pub(crate) staging: BTreeMap<BlockId, StagingBlock>,
    /// Staging pools by compute backend (see `pool`).
    pub(crate) pools: BTreeMap<BackendId, pool::StagingPool>,
    next_block: u64,
    owners: BTreeSet<OwnerId>,
    runtime: HashMap<(OwnerId, BackendId), u64>,
    budgets: HashMap<String, u64>,
    /// Per device (lower-case name): bytes of its budget kept for backend temporaries
    /// (see [`DeviceResidencyManager::reserve_backend_temporaries`]).
    temporaries: HashMap<String, u64>,
    /// Bytes of each `--max-vram` budget left to the backend runtime (`None`: the default
    /// of [`ModelManager::runtime_reserve`]).
    runtime_reserve: Option<u64>,
    reserve_bytes: u64,
    max_block_bytes: u64,
    epoch: u64,
    pub(crate) lora: lora::LoraState,
    mmap: bool,
    segmented: bool,
    prefetch: bool,
    load_threads: usize,
    pinned_host_params: bool,
    coalesce_uploads: bool,
    async_uploads: bool,
    upload_bytes: u64,
}

impl std::fmt::Debug for ModelManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelManager")
            .field("params", &self.states.len())
            .field("storage_blocks", &self.storage.len())
            .field("staging_blocks", &self.staging.len())
            .field(
                "staging_pools",
                &self
                    .pools
                    .iter()
                    .map(|(b, p)| (*b, p.size()))
                    .collect::<Vec<_>>(),
            )
            .field("owners", &self.owners)
            .finish()
    }
}

impl ModelManager {
    /// A manager reading weights from `loader` (the main catalog, [`SourceId::MAIN`]).
    pub fn new(loader: TensorCatalog) -> Self {
        let mut sources = BTreeMap::new();
        sources.insert(SourceId::MAIN, loader);
        ModelManager {
            transfers: Vec::new(),
            copy_streams: BTreeMap::new(),
            backends: Vec::new(),
            sources,
            next_source: 1,
            states: BTreeMap::new(),
            by_tensor: HashMap::new(),
            next_param: 0,
            storage: BTreeMap::new(),
            staging: BTreeMap::new(),
            pools: BTreeMap::new(),
            next_block: 0,
            owners: BTreeSet::new(),
            runtime: HashMap::new(),
            budgets: HashMap::new(),
            temporaries: HashMap::new(),
            runtime_reserve: None,
            reserve_bytes: DEVICE_RESERVE_BYTES,
            max_block_bytes: MAX_RESIDENCY_BLOCK_BYTES,
            epoch: 0,
            lora: lora::LoraState::default(),
            mmap: false,
            segmented: false,
            prefetch: false,
            load_threads: 0,
            pinned_host_params: true,
            coalesce_uploads: false,
            async_uploads: false,
            upload_bytes: 0,
        }
    }

    // ---- configuration ----

    /// Registers a backend the manager may place weights on or compute with.
    pub fn add_backend(&mut self, backend: Arc<Backend>) -> Result<BackendId> {
        let device = backend.device().ok_or_else(|| ResidencyError::BadTensor {
            name: backend.name().to_string(),
            detail: "the backend has no device".into(),
        })?;
        let id = BackendId(self.backends.len() as u32);
        self.backends.push((backend, device));
        Ok(id)
    }

    /// A registered backend.
    pub fn backend(&self, id: BackendId) -> Option<&Arc<Backend>> {
        self.backends.get(id.0 as usize).map(|(b, _)| b)
    }

    pub(crate) fn device_of(&self, id: BackendId) -> Option<Device> {
        self.backends.get(id.0 as usize).map(|(_, d)| *d)
    }

    pub(crate) fn backend_res(&self, id: BackendId) -> Result<(&Arc<Backend>, Device)> {
        self.backends
            .get(id.0 as usize)
            .map(|(b, d)| (b, *d))
            .ok_or(ResidencyError::UnknownBackend(id))
    }

    /// Sets (or with `None` removes) the weight + runtime budget of a device, shared by all
    /// owners on it (`--max-vram`).
    pub fn set_device_budget(&mut self, device: &Device, bytes: Option<u64>) {
        let key = device.name().to_ascii_lowercase();
        match bytes {
            Some(b) => {
                self.budgets.insert(key, b);
            }
            None => {
                self.budgets.remove(&key);
            }
        }
    }

    /// Resolves `--max-vram` for every registered non-CPU backend's device, against its free
    /// memory now.
    pub fn apply_max_vram(&mut self, max_vram: &MaxVram) {
        let devices: Vec<Device> = self.backends.iter().map(|(_, d)| *d).collect();
        for d in devices {
            if d.kind() == DeviceKind::Cpu {
                continue;
            }
            let reserve = self.runtime_reserve(&d);
            let budget = max_vram
                .for_device(&d.name())
                .and_then(|spec| spec.resolve(Some(d.memory().free)))
                .map(|b| {
                    if reserve > 0 {
                        tracing::info!(
                            device = %d.name(),
                            budget = b,
                            reserve,
                            "leaving part of the budget to the backend runtime"
                        );
                    }
                    let kept = self
                        .temporaries
                        .get(&d.name().to_ascii_lowercase())
                        .copied()
                        .unwrap_or(0);
                    b.saturating_sub(reserve).saturating_sub(kept)
                });
            self.set_device_budget(&d, budget);
        }
    }

    /// Sets how many bytes of each `--max-vram` budget are left to the backend runtime's own
    /// allocations, which no tracked tensor accounts for (`None`: the default, see
    /// [`ModelManager::runtime_reserve`]). Applies to later [`ModelManager::apply_max_vram`]
    /// calls.
    pub fn set_runtime_reserve(&mut self, bytes: Option<u64>) {
        self.runtime_reserve = bytes;
    }

    /// Bytes of a `--max-vram` budget on `device` left to its backend runtime: the value set
    /// with [`ModelManager::set_runtime_reserve`], else [`CUDA_RUNTIME_RESERVE_BYTES`] on
    /// CUDA devices and 0 elsewhere (the CPU is not budgeted; the simulated device allocates
    /// nothing behind the manager's back; other GPU runtimes are not measured yet).
    pub fn runtime_reserve(&self, device: &Device) -> u64 {
        match self.runtime_reserve {
            Some(b) => b,
            None if device.name().to_ascii_uppercase().starts_with("CUDA") => {
                CUDA_RUNTIME_RESERVE_BYTES
            }
            None => 0,
        }
    }

    /// The budget of a device, if any.
    pub fn device_budget(&self, device: &Device) -> Option<u64> {
        self.budgets
            .get(&device.name().to_ascii_lowercase())
            .copied()
    }

    /// Bytes of free device memory capacity checks leave unused (default
    /// [`DEVICE_RESERVE_BYTES`]).
    pub fn set_device_reserve(&mut self, bytes: u64) {
        self.reserve_bytes = bytes;
    }

    /// Largest device buffer for weights (default [`MAX_RESIDENCY_BLOCK_BYTES`]; at least
    /// one byte).
    pub fn set_max_block_bytes(&mut self, bytes: u64) {
        self.max_block_bytes = bytes.max(1);
    }

    /// Whether `ParamBackend` weights with host params may be mapped from their files
    /// without copies.
    pub fn set_mmap(&mut self, on: bool) {
        self.mmap = on;
    }

    /// Turns segmented compute on or off.
    pub fn set_segmented_compute(&mut self, on: bool) {
        self.segmented = on;
    }

    /// Turns prefetch on or off.
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
    }

    /// Whether params copies in host memory for a compute device other than the CPU use that
    /// device's pinned host buffer type (`ggml_backend_dev_host_buffer_type`; CUDA's
    /// `cudaMallocHost`), so uploads run at the link's speed (default: on). Off: plain
    /// pageable host memory (the CPU buffer type), for comparison.
    pub fn set_pinned_host_params(&mut self, on: bool) {
        self.pinned_host_params = on;
    }

    /// Whether uploads into a staging block merge runs of tensors laid out alike in storage
    /// and staging into one copy ([`Backend::copy_tensors`]), on the calling thread and on
    /// the transfer thread alike. Default: off (one copy per tensor), until a side-by-side
    /// measurement shows a gain (see docs/benchmarks.md).
    pub fn set_coalesce_uploads(&mut self, on: bool) {
        self.coalesce_uploads = on;
    }

    /// Whether prefetch uploads are queued on a copy stream of the compute device (a second
    /// backend of the device, ordered against compute with events; see `transfer`) where
    /// the backend has queued copies and events (default: off: on an H200 the copy stream
    /// slowed the kernels beside it, FLUX.1-dev's 8 GiB step 967 ms against 761 ms with
    /// synchronous uploads; `docs/benchmarks.md`). Off, or on backends without them (the
    /// CPU), a prefetch copies synchronously on a transfer thread.
    pub fn set_async_uploads(&mut self, on: bool) {
        if !on {
            self.finish_transfers();
            self.copy_streams.clear();
        }
        self.async_uploads = on;
    }

    /// Whether prefetch uploads to `backend` are queued on a copy stream (the setting is
    /// on and the backend has one).
    pub fn uploads_async(&mut self, backend: BackendId) -> bool {
        self.copy_stream(backend).is_some()
    }

    /// The copy stream of `backend`, made on first use; `None` when async uploads are off
    /// or the backend has no queued copies or events.
    pub(crate) fn copy_stream(&mut self, backend: BackendId) -> Option<&CopyStream> {
        if !self.async_uploads {
            return None;
        }
        if !self.copy_streams.contains_key(&backend) {
            let stream = self.backend(backend).and_then(|b| CopyStream::new(b));
            tracing::debug!(
                backend = backend.0,
                copy_stream = stream.is_some(),
                "weight uploads {}",
                if stream.is_some() {
                    "queued on a copy stream"
                } else {
                    "on a transfer thread (no queued copies or events)"
                }
            );
            self.copy_streams.insert(backend, stream);
        }
        self.copy_streams.get(&backend).and_then(Option::as_ref)
    }

    /// Bytes copied from params copies into staging or prefetch blocks on another device
    /// since the manager was created (host-to-device traffic of weights).
    pub fn upload_bytes(&self) -> u64 {
        self.upload_bytes
    }

    /// Threads used to read files (0: one per core).
    pub fn set_load_threads(&mut self, threads: usize) {
        self.load_threads = threads;
    }

    // ---- registration ----

    /// Registers `tensors` (`(name in the source's catalog, descriptor)`) with one spec.
    ///
    /// Each descriptor must have no memory, not be a view, and have a known dtype; its name
    /// must be in the source's catalog with the same shape (the file's dtype may differ: it is
    /// converted when loading). On error nothing is registered.
    pub fn register_params(
        &mut self,
        spec: ParamSpec,
        tensors: &[(String, GTensor)],
    ) -> Result<Vec<ParamId>> {
        self.backend_res(spec.params_backend)?;
        self.backend_res(spec.compute_backend)?;
        let loader = self
            .sources
            .get(&spec.source)
            .ok_or(ResidencyError::UnknownSource(spec.source))?;
        let mut seen = HashSet::new();
        let mut new_states = Vec::with_capacity(tensors.len());
        for (name, t) in tensors {
            let bad = |detail: &str| ResidencyError::BadTensor {
                name: name.clone(),
                detail: detail.to_string(),
            };
            if t.view_src().is_some() {
                return Err(bad("it is a view"));
            }
            if t.is_allocated() {
                return Err(bad("it already has memory"));
            }
            if self.by_tensor.contains_key(&t.id()) || !seen.insert(t.id()) {
                return Err(bad("it is already registered"));
            }
            let dtype = t
                .dtype()
                .ok_or_else(|| bad("its element type is unknown"))?;
            let shape: Vec<u64> = t.shape(t.n_dims()).iter().map(|&d| d as u64).collect();
            loading::validate_against_file(loader, spec.source, name, &shape)?;
            new_states.push(ParamState {
                name: name.clone(),
                tensor: t.clone(),
                dtype,
                shape,
                component: spec.component,
                mode: spec.mode,
                params_backend: spec.params_backend,
                compute_backend: spec.compute_backend,
                source: spec.source,
                pin_count: 0,
                last_use_epoch: 0,
                lora_epoch: None,
                storage: None,
                bound: false,
                staged: None,
                prefetched: None,
                view: false,
                split: false,
            });
        }
        let mut ids = Vec::with_capacity(new_states.len());
        for s in new_states {
            let id = ParamId(self.next_param);
            self.next_param += 1;
            self.by_tensor.insert(s.tensor.id(), id);
            self.states.insert(id, s);
            ids.push(id);
        }
        Ok(ids)
    }

    /// Unregisters unpinned parameters, freeing every block that holds any of them (other
    /// members of those blocks are reloaded when next needed).
    pub fn unregister_params(&mut self, params: &[ParamId]) -> Result<()> {
        for p in params {
            let s = self.state(*p)?;
            if s.pin_count > 0 {
                return Err(ResidencyError::Pinned {
                    name: s.name.clone(),
                });
            }
        }
        self.free_blocks_holding(params, params, true)?;
        for p in params {
            if let Some(s) = self.states.remove(p) {
                self.by_tensor.remove(&s.tensor.id());
            }
        }
        self.lora.forget(params);
        Ok(())
    }

    /// Frees staging (and prefetch) blocks holding any of `params` and storage blocks holding
    /// any of `storage_params`; refuses if a member of such a block is pinned (when
    /// `check_pins`).
    fn free_blocks_holding(
        &mut self,
        params: &[ParamId],
        storage_params: &[ParamId],
        check_pins: bool,
    ) -> Result<()> {
        let set: HashSet<ParamId> = params.iter().copied().collect();
        let storage_set: HashSet<ParamId> = storage_params.iter().copied().collect();
        let staging: Vec<BlockId> = self
            .staging
            .iter()
            .filter(|(_, b)| b.members.iter().any(|m| set.contains(m)))
            .map(|(id, _)| *id)
            .collect();
        let storage: Vec<BlockId> = self
            .storage
            .iter()
            .filter(|(_, b)| b.members.iter().any(|m| storage_set.contains(m)))
            .map(|(id, _)| *id)
            .collect();
        if check_pins {
            for id in &staging {
                self.check_unpinned(&self.staging[id].members)?;
            }
            for id in &storage {
                self.check_unpinned(&self.storage[id].members)?;
            }
        }
        for id in staging {
            self.drop_staging_block(id);
        }
        for id in storage {
            self.drop_storage_block(id);
        }
        Ok(())
    }

    fn check_unpinned(&self, members: &[ParamId]) -> Result<()> {
        for m in members {
            if let Some(s) = self.states.get(m) {
                if s.pin_count > 0 {
                    return Err(ResidencyError::Pinned {
                        name: s.name.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Number of registered parameters.
    pub fn param_count(&self) -> usize {
        self.states.len()
    }

    /// The registered descriptor of a parameter.
    pub fn tensor(&self, p: ParamId) -> Option<&GTensor> {
        self.states.get(&p).map(|s| &s.tensor)
    }

    /// Diagnostics for one parameter.
    pub fn param_info(&self, p: ParamId) -> Option<ParamInfo> {
        let s = self.states.get(&p)?;
        Some(ParamInfo {
            name: s.name.clone(),
            component: s.component,
            mode: s.mode,
            params_backend: s.params_backend,
            compute_backend: s.compute_backend,
            source: s.source,
            pin_count: s.pin_count,
            last_use_epoch: s.last_use_epoch,
            lora_epoch: s.lora_epoch,
            loaded: s.storage.is_some(),
            mmapped: self.is_mmapped(s),
            staged: s.staged.is_some(),
            resident_on_compute: s.is_resident_on_compute(),
        })
    }

    pub(crate) fn is_mmapped(&self, s: &ParamState) -> bool {
        s.storage
            .as_ref()
            .and_then(|l| self.storage.get(&l.block))
            .is_some_and(|b| b.mapped.is_some())
    }

    /// Number of live storage and staging (including prefetch) blocks.
    pub fn block_counts(&self) -> (usize, usize) {
        (self.storage.len(), self.staging.len())
    }

    pub(crate) fn state(&self, p: ParamId) -> Result<&ParamState> {
        self.states.get(&p).ok_or(ResidencyError::UnknownParam(p))
    }

    pub(crate) fn check_known(&self, params: &[ParamId]) -> Result<()> {
        for p in params {
            self.state(*p)?;
        }
        Ok(())
    }

    pub(crate) fn new_block_id(&mut self) -> BlockId {
        let id = BlockId(self.next_block);
        self.next_block += 1;
        id
    }

    pub(crate) fn all_blocks(&self) -> impl Iterator<Item = AnyBlock<'_>> + '_ {
        self.storage
            .iter()
            .map(|(id, b)| AnyBlock::Storage(*id, b))
            .chain(self.staging.iter().map(|(id, b)| AnyBlock::Staging(*id, b)))
    }

    /// Whether a block's memory is on `device` (a block in a staging pool: the pool's).
    pub(crate) fn block_on_device(&self, block: &AnyBlock<'_>, device: &Device) -> bool {
        match block {
            AnyBlock::Staging(
                _,
                StagingBlock {
                    mem: StagingMem::Pool { backend, .. },
                    ..
                },
            ) => self
                .pools
                .get(backend)
                .is_some_and(|p| buffer_on_device(&p.buffer, device)),
            _ => block
                .own_buffer()
                .is_some_and(|b| buffer_on_device(b, device)),
        }
    }

    /// Drops a storage block; its members lose their params copy (and bound tensors their
    /// memory).
    pub(crate) fn drop_storage_block(&mut self, id: BlockId) {
        self.finish_transfers();
        let Some(block) = self.storage.remove(&id) else {
            return;
        };
        for m in &block.members {
            if let Some(s) = self.states.get_mut(m) {
                if s.storage.as_ref().is_some_and(|l| l.block == id) {
                    s.storage = None;
                    if s.bound {
                        s.bound = false;
                        s.lora_epoch = None;
                    }
                }
            }
        }
        drop(block);
    }

    /// Drops a staging (or prefetch) block; its members lose their compute copy (a block in
    /// a staging pool unplaces them and returns its region to the pool).
    pub(crate) fn drop_staging_block(&mut self, id: BlockId) {
        // Only a transfer filling this block writes to its memory: any other may go on
        // (the block's last reader, a synchronous compute, is done).
        if self.transfers.iter().any(|j| j.blocks.contains(&id)) {
            self.finish_transfers();
        }
        let Some(block) = self.staging.remove(&id) else {
            return;
        };
        if let StagingMem::Pool { backend, regions } = &block.mem {
            if let Some(pool) = self.pools.get_mut(backend) {
                for m in &block.members {
                    if let Some(s) = self.states.get(m) {
                        pool.buffer.unplace(&s.tensor);
                    }
                }
                for &(offset, bytes) in regions {
                    pool.free(offset, bytes);
                }
            }
        }
        for m in &block.members {
            if let Some(s) = self.states.get_mut(m) {
                if s.staged == Some(id) {
                    s.staged = None;
                    s.lora_epoch = None;
                }
                if s.prefetched.is_some_and(|(_, b)| b == id) {
                    s.prefetched = None;
                }
            }
        }
        drop(block);
    }

    /// Frees the staging pool of `backend` and every staging block in it (their members
    /// lose their compute copies). Refused while one of them is pinned.
    pub(crate) fn release_pool(&mut self, backend: BackendId) -> Result<()> {
        if !self.pools.contains_key(&backend) {
            return Ok(());
        }
        let in_pool: Vec<BlockId> = self
            .staging
            .iter()
            .filter(|(_, b)| matches!(b.mem, StagingMem::Pool { backend: pb, .. } if pb == backend))
            .map(|(id, _)| *id)
            .collect();
        for id in &in_pool {
            self.check_unpinned(&self.staging[id].members)?;
        }
        for id in in_pool {
            self.drop_staging_block(id);
        }
        if let Some(pool) = self.pools.remove(&backend) {
            tracing::debug!(
                backend = backend.0,
                bytes = pool.size(),
                "staging pool released"
            );
        }
        Ok(())
    }

    /// Allocates the staging pool of `backend` for `owner` (see [`DeviceResidencyManager::set_staging_pool`]).
    fn set_pool_inner(
        &mut self,
        owner: OwnerId,
        backend: BackendId,
        bytes: Option<u64>,
    ) -> Result<bool> {
        let (b, device) = self.backend_res(backend)?;
        let Some(bytes) = bytes.filter(|_| device.kind() != DeviceKind::Cpu) else {
            self.release_pool(backend)?;
            return Ok(false);
        };
        if self
            .pools
            .get(&backend)
            .is_some_and(|p| p.owner == owner && p.size() == bytes)
        {
            return Ok(true);
        }
        let buft = b.buffer_type();
        self.release_pool(backend)?;
        let buffer = buft
            .alloc(bytes.max(1) as usize)
            .map_err(ResidencyError::ggml("allocating the staging pool"))?;
        buffer.set_usage(sd_tensor::ggml::BufferUsage::Weights);
        tracing::debug!(backend = backend.0, bytes, "staging pool allocated");
        self.pools
            .insert(backend, pool::StagingPool::new(buffer, owner));
        Ok(true)
    }

    /// The size of `backend`'s staging pool and its free bytes, if it has one.
    pub fn staging_pool_bytes(&self, backend: BackendId) -> Option<(u64, u64)> {
        self.pools.get(&backend).map(|p| (p.size(), p.free_bytes()))
    }

    /// Waits for every prefetch copy in flight; the blocks of a failed one are dropped
    /// (their parameters lose the prefetched copy and load synchronously when prepared).
    pub(crate) fn finish_transfers(&mut self) {
        self.finish_transfers_where(|_| true);
    }

    /// Orders the transfers filling any of `blocks` before the compute backend's later
    /// work (it waits on their events in its queue); transfers that cannot be ordered so
    /// (thread jobs, failures) are waited for on the host instead.
    pub(crate) fn order_transfers(&mut self, blocks: &[BlockId]) {
        let mut host_wait = false;
        for job in &mut self.transfers {
            if job.blocks.iter().any(|b| blocks.contains(b)) && !job.order_before() {
                host_wait = true;
            }
        }
        if host_wait {
            self.finish_transfers_where(|j| !j.is_ordered());
        }
    }

    /// [`finish_transfers`](Self::finish_transfers) of the jobs `pick` selects.
    pub(crate) fn finish_transfers_where(&mut self, pick: impl Fn(&transfer::TransferJob) -> bool) {
        if self.transfers.is_empty() {
            return;
        }
        let (jobs, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.transfers)
            .into_iter()
            .partition(|j| pick(j));
        self.transfers = keep;
        for job in jobs {
            let blocks = job.blocks.clone();
            match job.wait() {
                Ok(bytes) => tracing::trace!(bytes, "prefetch transfer done"),
                Err(e) => {
                    tracing::warn!(error = %e, "prefetch transfer failed; dropping its blocks");
                    for b in blocks {
                        self.drop_staging_block(b);
                    }
                }
            }
        }
    }

    // ---- accounting ----

    /// Bytes of weight buffers the manager holds on `device` (host buffers for the CPU):
    /// each distinct buffer counts once at its footprint (its size rounded up to the
    /// allocation granularity of its type, [`sd_tensor::ggml::Buffer::footprint`]).
    /// A staging pool counts once at its full size; the blocks in it add nothing.
    pub fn resident_bytes(&self, device: &Device) -> u64 {
        let blocks = self
            .all_blocks()
            .filter_map(|b| b.own_buffer().filter(|buf| buffer_on_device(buf, device)))
            .fold(0u64, |acc, buf| acc.saturating_add(buf.footprint()));
        let pools = self
            .pools
            .values()
            .filter(|p| buffer_on_device(&p.buffer, device))
            .fold(0u64, |acc, p| acc.saturating_add(p.buffer.footprint()));
        blocks.saturating_add(pools)
    }

    fn runtime_bytes(&self, device: &Device, except: Option<OwnerId>) -> u64 {
        self.runtime
            .iter()
            .filter(|((o, b), _)| Some(*o) != except && self.device_of(*b) == Some(*device))
            .fold(0u64, |acc, (_, v)| acc.saturating_add(*v))
    }

    /// Device-side bytes `p` still needs on its compute device (0 when resident there).
    fn missing_bytes(&self, s: &ParamState) -> u64 {
        if s.is_resident_on_compute() || s.prefetched.is_some() {
            return 0;
        }
        if self.is_direct(s) {
            if s.storage.is_some() {
                return 0;
            }
            let buft = self.params_buffer_type(s);
            return blocks::align_up(buft.alloc_size(&s.tensor) as u64, buft.alignment() as u64);
        }
        match self.backend(s.compute_backend) {
            Some(b) => {
                let buft = b.buffer_type();
                blocks::align_up(buft.alloc_size(&s.tensor) as u64, buft.alignment() as u64)
            }
            None => 0,
        }
    }

    /// The capacity answer; with `assume_pool_room`, staging copies going to the staging
    /// pool count as placed (see [`DeviceResidencyManager::fits_with_pool_room`]).
    pub(crate) fn inspect_inner(
        &self,
        request: &BackendMemoryRequest,
        params: &[ParamId],
        assume_pool_room: bool,
    ) -> Result<DeviceMemoryCapacity> {
        let (_, device) = self.backend_res(request.backend)?;
        let mut missing = 0u64;
        // Staging copies that would go to the backend's staging pool: no device bytes when
        // they fit in its free regions, placed one by one in `params` order as staging
        // places them (callers pass the parameters in the order they prepare them); else
        // they would get buffers of their own.
        let pool = self.pools.get(&request.backend);
        let mut pooled: Vec<u64> = Vec::new();
        for p in params {
            let s = self.state(*p)?;
            if s.compute_backend == request.backend {
                let m = self.missing_bytes(s);
                if pool.is_some() && m > 0 && !self.is_direct(s) {
                    pooled.push(m);
                } else {
                    missing = missing.saturating_add(m);
                }
            }
        }
        if !assume_pool_room && pool.is_some_and(|p| !p.fits_all(pooled.iter().copied())) {
            missing = missing.saturating_add(pooled.iter().sum());
        }
        // Weights outside the pool get buffers of their own (chunks of at most
        // `max_block_bytes`), each rounded up to the allocation granularity.
        if missing > 0 {
            if let Some(b) = self.backend(request.backend) {
                let g = b.buffer_type().allocation_granularity();
                let buffers = 1 + missing / self.max_block_bytes.max(1);
                missing = missing.saturating_add(g.saturating_sub(1).saturating_mul(buffers));
            }
        }
        let class = match device.kind() {
            DeviceKind::Cpu => DeviceClass::Host,
            DeviceKind::IntegratedGpu => DeviceClass::Integrated,
            _ => DeviceClass::Discrete,
        };
        let mem = device.memory();
        let others = self.runtime_bytes(&device, Some(request.owner));
        let budget = match (self.device_budget(&device), request.max_backend_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let state = DeviceState {
            class,
            reported_free: (mem.total > 0).then_some(mem.free),
            reported_total: mem.total,
            tracked_weight_bytes: self.resident_bytes(&device),
            tracked_runtime_bytes: others.saturating_add(request.runtime_resident_bytes),
            other_owners_runtime_bytes: others,
            budget,
            reserve_bytes: self.reserve_bytes,
        };
        let req = DeviceMemoryRequest {
            pending_bytes: request.pending_bytes,
            missing_weight_bytes: missing,
            owner_runtime_bytes: request.runtime_resident_bytes,
        };
        Ok(inspect_capacity(&state, &req))
    }

    pub(crate) fn running(&self) -> bool {
        !self.owners.is_empty() || self.states.values().any(|s| s.pin_count > 0)
    }
}

impl DeviceResidencyManager for ModelManager {
    fn segmented_compute_enabled(&self) -> bool {
        self.segmented
    }

    fn backend_budget(&self, backend: BackendId) -> Option<u64> {
        self.device_of(backend).and_then(|d| self.device_budget(&d))
    }

    fn reserve_backend_temporaries(&mut self, backend: BackendId, bytes: u64) {
        let Some(d) = self.device_of(backend) else {
            return;
        };
        let key = d.name().to_ascii_lowercase();
        let kept = self.temporaries.get(&key).copied().unwrap_or(0);
        if bytes <= kept {
            return;
        }
        self.temporaries.insert(key.clone(), bytes);
        if let Some(b) = self.budgets.get_mut(&key) {
            let lowered = b.saturating_sub(bytes - kept);
            tracing::info!(
                device = %d.name(),
                temporaries = bytes,
                budget = lowered,
                "keeping part of the budget for the backend's operator temporaries"
            );
            *b = lowered;
        }
    }

    fn prefetch_enabled(&self) -> bool {
        self.prefetch
    }

    fn register_runtime_owner(&mut self, owner: OwnerId) {
        self.owners.insert(owner);
    }

    fn remove_runtime_owner(&mut self, owner: OwnerId) {
        self.owners.remove(&owner);
        self.runtime.retain(|(o, _), _| *o != owner);
        self.clear_prefetched_params(owner);
        let pools: Vec<BackendId> = self
            .pools
            .iter()
            .filter(|(_, p)| p.owner == owner)
            .map(|(b, _)| *b)
            .collect();
        for b in pools {
            if let Err(e) = self.release_pool(b) {
                tracing::warn!(error = %e, "staging pool kept: a weight in it is pinned");
            }
        }
    }

    fn set_staging_pool(
        &mut self,
        owner: OwnerId,
        backend: BackendId,
        bytes: Option<u64>,
    ) -> Result<bool> {
        self.set_pool_inner(owner, backend, bytes)
    }

    fn weight_upload_bytes(&self) -> u64 {
        self.upload_bytes
    }

    fn staging_pool(&self, backend: BackendId) -> Option<(OwnerId, u64)> {
        self.pools.get(&backend).map(|p| (p.owner, p.size()))
    }

    fn wait_for_uploads(&mut self) {
        self.finish_transfers_where(|j| j.is_ordered());
    }

    fn fits_compute_backend_capacity(
        &self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
    ) -> Result<bool> {
        Ok(self.inspect_inner(request, required, false)?.fits(false))
    }

    fn fits_with_pool_room(
        &self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
    ) -> Result<bool> {
        Ok(self.inspect_inner(request, required, true)?.fits(true))
    }

    fn pool_holds(&self, backend: BackendId, params: &[ParamId]) -> Result<bool> {
        let Some(pool) = self.pools.get(&backend) else {
            return Ok(true);
        };
        let mut pooled = Vec::new();
        for p in params {
            let s = self.state(*p)?;
            if s.compute_backend == backend && !self.is_direct(s) {
                let m = self.missing_bytes(s);
                if m > 0 {
                    pooled.push(m);
                }
            }
        }
        Ok(pooled.is_empty() || pool.fits_all(pooled))
    }

    fn inspect_compute_backend_capacity(
        &self,
        request: &BackendMemoryRequest,
        params: &[ParamId],
    ) -> Result<DeviceMemoryCapacity> {
        self.inspect_inner(request, params, false)
    }

    fn evictable_compute_backend_blocks(
        &self,
        backend: BackendId,
        protected: &[ParamId],
    ) -> Vec<WeightResidencyBlock> {
        self.evictable_inner(backend, &protected.iter().copied().collect())
    }

    fn evict_compute_backend_block(&mut self, block: &WeightResidencyBlock) -> bool {
        self.evict_block_inner(block)
    }

    fn prefetch_params(&mut self, owner: OwnerId, params: &[ParamId]) -> WeightPrefetchResult {
        self.prefetch_inner(owner, params)
    }

    fn activate_prefetched_params(&mut self, owner: OwnerId, params: &[ParamId]) -> Result<bool> {
        self.check_known(params)?;
        let prefetch_blocks = |m: &ModelManager| -> Vec<BlockId> {
            m.staging
                .iter()
                .filter(|(_, b)| b.prefetch_owner == Some(owner))
                .map(|(id, _)| *id)
                .collect()
        };
        // The compute backend waits for their uploads in its queue (queued copies), or the
        // host waits here (a transfer thread); other transfers are finished (the blocks of
        // a failed one are dropped).
        self.order_transfers(&prefetch_blocks(self));
        self.finish_transfers_where(|j| !j.is_ordered());
        let ids = prefetch_blocks(self);
        if ids.is_empty() {
            return Ok(false);
        }
        let mut members = Vec::new();
        for id in ids {
            self.promote_prefetch_block(id);
            members.extend(self.staging[&id].members.iter().copied());
        }
        self.stamp_params(&members);
        Ok(true)
    }

    fn clear_prefetched_params(&mut self, owner: OwnerId) {
        self.finish_transfers();
        let ids: Vec<BlockId> = self
            .staging
            .iter()
            .filter(|(_, b)| b.prefetch_owner == Some(owner))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_staging_block(id);
        }
    }

    fn prepare_params(&mut self, params: &[ParamId]) -> Result<()> {
        self.prepare_inner(params)
    }

    fn pin_params(&mut self, params: &[ParamId]) -> Result<()> {
        self.check_known(params)?;
        for p in params {
            if let Some(s) = self.states.get_mut(p) {
                s.pin_count = s.pin_count.saturating_add(1);
            }
        }
        Ok(())
    }

    fn unpin_params(&mut self, params: &[ParamId]) -> Result<()> {
        self.check_known(params)?;
        for p in params {
            if let Some(s) = self.states.get_mut(p) {
                s.pin_count = s.pin_count.saturating_sub(1);
            }
        }
        Ok(())
    }

    fn release_compute_backend_params(&mut self, params: &[ParamId]) -> Result<()> {
        self.check_known(params)?;
        let set: HashSet<ParamId> = params.iter().copied().collect();
        let ids: Vec<BlockId> = self
            .staging
            .iter()
            .filter(|(_, b)| {
                b.prefetch_owner.is_none()
                    && b.members.iter().all(|m| {
                        set.contains(m) && self.states.get(m).is_none_or(|s| s.pin_count == 0)
                    })
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_staging_block(id);
        }
        Ok(())
    }

    fn release_params_backend_params(&mut self, params: &[ParamId]) -> Result<()> {
        self.check_known(params)?;
        let set: HashSet<ParamId> = params.iter().copied().collect();
        let ids: Vec<BlockId> = self
            .storage
            .iter()
            .filter(|(_, b)| {
                b.mapped.is_none()
                    && b.members.iter().all(|m| {
                        set.contains(m)
                            && self.states.get(m).is_none_or(|s| {
                                s.pin_count == 0
                                    && s.staged.is_none()
                                    && s.prefetched.is_none()
                                    && s.mode == ResidencyMode::Disk
                            })
                    })
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_storage_block(id);
        }
        Ok(())
    }

    fn assign_compute_backend(&mut self, params: &[ParamId], backend: BackendId) -> Result<()> {
        self.backend_res(backend)?;
        for p in params {
            let s = self.state(*p)?;
            if s.pin_count > 0 {
                return Err(ResidencyError::Pinned {
                    name: s.name.clone(),
                });
            }
        }
        let changing: Vec<ParamId> = params
            .iter()
            .copied()
            .filter(|p| self.states[p].compute_backend != backend)
            .collect();
        // Current compute copies (staged, prefetched, or bound params copies) belong to the
        // old backend; unbound params copies stay.
        let bound: Vec<ParamId> = changing
            .iter()
            .copied()
            .filter(|p| self.states[p].bound)
            .collect();
        self.free_blocks_holding(&changing, &bound, true)?;
        for p in &changing {
            if let Some(s) = self.states.get_mut(p) {
                s.compute_backend = backend;
            }
        }
        Ok(())
    }

    fn update_runtime_residency(&mut self, owner: OwnerId, backend: BackendId, bytes: u64) {
        if bytes == 0 {
            self.runtime.remove(&(owner, backend));
        } else {
            self.runtime.insert((owner, backend), bytes);
        }
    }

    fn resolve_param(&self, tensor: TensorId) -> Option<ParamId> {
        self.by_tensor.get(&tensor).copied()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn manager_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::ModelManager>();
    }
}
