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
//!
//! # Files
//!
//! This one holds the manager's state, its blocks and pools and the prefetch transfers;
//! `config.rs` its configuration (backends, budgets, switches), `registration.rs` the
//! parameters' registration, `accounting.rs` the device bytes and the capacity answer,
//! `engine_api.rs` the [`DeviceResidencyManager`] implementation the engine drives;
//! `loading.rs`, `staging.rs`, `transfer.rs`, `pool.rs`, `eviction.rs`, `lora.rs` what their
//! names say.

mod accounting;
mod blocks;
mod config;
mod engine_api;
pub mod eviction;
mod loading;
mod lora;
mod lycoris;
mod pool;
mod registration;
mod sources;
mod staging;
mod state;
mod transfer;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use sd_tensor::ggml::{Backend, Buffer, CopyStream, Device, DeviceKind, GTensor, TensorId};

pub use blocks::MAX_RESIDENCY_BLOCK_BYTES;
pub use config::UploadOptions;
pub use lora::LoraSpec;
pub use state::{Component, ParamSpec, ResidencyMode};
pub use transfer::UploadSpan;

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
    /// See [`DeviceResidencyManager::set_uploads_wait_for_compute`].
    uploads_wait_for_compute: bool,
    async_uploads: bool,
    /// Where transfer threads record when they ran (see [`ModelManager::set_upload_log`]).
    pub(crate) upload_log: Option<transfer::UploadLog>,
    upload_bytes: u64,
    /// Weights placed at the staging pools' high end (see
    /// [`DeviceResidencyManager::keep_at_pool_end`]).
    pub(crate) pool_high: std::collections::HashSet<ParamId>,
    /// See [`ModelManager::set_stable_placement`].
    pub(crate) stable_placement: bool,
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
            coalesce_uploads: true,
            uploads_wait_for_compute: true,
            async_uploads: false,
            upload_log: None,
            upload_bytes: 0,
            pool_high: Default::default(),
            stable_placement: false,
        }
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
    /// work (it waits on their events in its queue); those that cannot be ordered so
    /// (thread jobs, failures) are waited for on the host instead. Other transfers go on.
    pub(crate) fn order_transfers(&mut self, blocks: &[BlockId]) {
        let fills = |j: &transfer::TransferJob| j.blocks.iter().any(|b| blocks.contains(b));
        let mut host_wait = false;
        for job in &mut self.transfers {
            if fills(job) && !job.order_before() {
                host_wait = true;
            }
        }
        if host_wait {
            self.finish_transfers_where(|j| fills(j) && !j.is_ordered());
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
}

#[cfg(test)]
mod tests {
    #[test]
    fn manager_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::ModelManager>();
    }
}
