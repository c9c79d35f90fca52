//! Eviction candidates and evicting one block. The ranking of candidates (which block goes
//! first) is the execution engine's policy (`sd-exec`'s `ensure_capacity`), not the
//! manager's.
//!
//! The candidate rules are a pure function of [`BlockFacts`] ([`evictable_blocks`]), so that
//! they can be tested over arbitrary states and reused by the execution engine:
//! - only blocks whose buffer lives on the asked device (host buffers when the device is the
//!   CPU) and that are not zero-copy file mappings (freeing those reclaims nothing);
//! - never a block with a pinned, protected or prefetching member;
//! - a staging block is evicted as is (its members fall back to their params copies);
//! - a storage block is evictable when every member is unstaged and either in `Disk` mode or
//!   demotable: a `ParamBackend` weight resident on a non-CPU device that is also its
//!   compute device, reloadable from its file, without LoRA patch, not mapped, not a view
//!   and not split. Such a block `requires_demotion`: evicting it switches its members to
//!   `Disk` mode for good.

use std::collections::HashSet;

use super::state::ResidencyMode;
use super::ModelManager;
use crate::residency::{BackendId, BlockId, ParamId, WeightResidencyBlock};

/// Kind of a residency block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Compute staging copies.
    Staging,
    /// Params copies.
    Storage,
}

/// What the candidate rules need to know about one member of a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberFacts {
    /// The parameter.
    pub param: ParamId,
    /// Its residency mode.
    pub mode: ResidencyMode,
    /// Pinned (in use by a computation).
    pub pinned: bool,
    /// Protected by the caller.
    pub protected: bool,
    /// In a prefetch not yet activated.
    pub prefetching: bool,
    /// Has a staging copy on its compute device.
    pub staged: bool,
    /// Its compute device is the asked device.
    pub computed_here: bool,
    /// Its bytes can be read again from a model file.
    pub reloadable: bool,
    /// Its current memory carries a LoRA patch.
    pub lora_applied: bool,
    /// Its params copy is a zero-copy file mapping.
    pub mmapped: bool,
    /// It is a view of another tensor.
    pub view: bool,
    /// Its params copy is split across devices.
    pub split: bool,
    /// Last-use epoch.
    pub last_use_epoch: u64,
}

/// What the candidate rules need to know about one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockFacts {
    /// The block.
    pub id: BlockId,
    /// Its kind.
    pub kind: BlockKind,
    /// Its buffer lives on the asked device.
    pub on_device: bool,
    /// The asked device is the CPU.
    pub host_query: bool,
    /// It is a zero-copy file mapping.
    pub mapped: bool,
    /// Its buffer size.
    pub bytes: u64,
    /// Its members.
    pub members: Vec<MemberFacts>,
}

/// Whether a `ParamBackend` member may be demoted to `Disk` mode.
pub fn demotable(m: &MemberFacts, host_query: bool) -> bool {
    !host_query
        && m.computed_here
        && m.reloadable
        && !m.lora_applied
        && !m.mmapped
        && !m.view
        && !m.split
}

/// The evictable blocks among `blocks`, reported for `backend`.
pub fn evictable_blocks(backend: BackendId, blocks: &[BlockFacts]) -> Vec<WeightResidencyBlock> {
    let mut out = Vec::new();
    'blocks: for b in blocks {
        if !b.on_device || b.mapped || b.members.is_empty() {
            continue;
        }
        let mut requires_demotion = false;
        for m in &b.members {
            if m.pinned || m.protected || m.prefetching {
                continue 'blocks;
            }
            if b.kind == BlockKind::Storage {
                if m.staged || m.mmapped {
                    continue 'blocks;
                }
                if m.mode != ResidencyMode::Disk {
                    if !demotable(m, b.host_query) {
                        continue 'blocks;
                    }
                    requires_demotion = true;
                }
            }
        }
        out.push(WeightResidencyBlock {
            id: b.id,
            backend,
            params: b.members.iter().map(|m| m.param).collect(),
            bytes: b.bytes,
            last_use_epoch: b
                .members
                .iter()
                .map(|m| m.last_use_epoch)
                .max()
                .unwrap_or(0),
            requires_demotion,
            pooled: false,
        });
    }
    out
}

impl ModelManager {
    /// The facts of the blocks on `backend`'s device, not mapped, that `pick` selects
    /// (the only ones [`evictable_blocks`] can evict from it).
    pub(crate) fn block_facts_where(
        &self,
        backend: BackendId,
        protected: &HashSet<ParamId>,
        pick: impl Fn(BlockId) -> bool,
    ) -> Vec<BlockFacts> {
        let Some(device) = self.device_of(backend) else {
            return Vec::new();
        };
        let host_query = device.kind() == sd_tensor::ggml::DeviceKind::Cpu;
        let mut out = Vec::new();
        for block in self.all_blocks() {
            let (id, kind, mapped, members) = match &block {
                super::blocks::AnyBlock::Storage(id, b) => {
                    (*id, BlockKind::Storage, b.mapped.is_some(), &b.members)
                }
                super::blocks::AnyBlock::Staging(id, b) => {
                    (*id, BlockKind::Staging, false, &b.members)
                }
            };
            if !pick(id) {
                continue;
            }
            let on_device = self.block_on_device(&block, &device);
            // Only what `evictable_blocks` can evict: blocks elsewhere (weights in host
            // RAM, most of them when params are pinned) and mappings are skipped before
            // their members' facts are gathered.
            if !on_device || mapped {
                continue;
            }
            let members = members
                .iter()
                .filter_map(|p| {
                    let s = self.states.get(p)?;
                    let mmapped = s
                        .storage
                        .as_ref()
                        .and_then(|l| self.storage.get(&l.block))
                        .is_some_and(|b| b.mapped.is_some());
                    Some(MemberFacts {
                        param: *p,
                        mode: s.mode,
                        pinned: s.pin_count > 0,
                        protected: protected.contains(p),
                        prefetching: s.prefetched.is_some(),
                        staged: s.staged.is_some(),
                        computed_here: self.device_of(s.compute_backend) == Some(device),
                        reloadable: true,
                        lora_applied: s.lora_epoch.is_some(),
                        mmapped,
                        view: s.view,
                        split: s.split,
                        last_use_epoch: s.last_use_epoch,
                    })
                })
                .collect();
            out.push(BlockFacts {
                id,
                kind,
                on_device,
                host_query,
                mapped,
                bytes: block.bytes(),
                members,
            });
        }
        out
    }

    pub(crate) fn evictable_inner(
        &self,
        backend: BackendId,
        protected: &HashSet<ParamId>,
    ) -> Vec<WeightResidencyBlock> {
        self.evictable_where(backend, protected, |_| true)
    }

    /// [`evictable_inner`](Self::evictable_inner) among the blocks `pick` selects.
    fn evictable_where(
        &self,
        backend: BackendId,
        protected: &HashSet<ParamId>,
        pick: impl Fn(BlockId) -> bool,
    ) -> Vec<WeightResidencyBlock> {
        let mut out = evictable_blocks(backend, &self.block_facts_where(backend, protected, pick));
        for b in &mut out {
            b.pooled = self
                .staging
                .get(&b.id)
                .is_some_and(|s| matches!(s.mem, super::blocks::StagingMem::Pool { .. }));
        }
        out
    }

    pub(crate) fn evict_block_inner(&mut self, block: &WeightResidencyBlock) -> bool {
        // (Only this block's facts: an eviction loop asks once per block it evicts.)
        let found = self
            .evictable_where(block.backend, &HashSet::new(), |id| id == block.id)
            .into_iter()
            .any(|c| {
                c.id == block.id
                    && c.params == block.params
                    && c.requires_demotion == block.requires_demotion
                    && c.pooled == block.pooled
            });
        if !found {
            return false;
        }
        let _span =
            tracing::debug_span!("evict_block", block = block.id.0, bytes = block.bytes).entered();
        if self.staging.contains_key(&block.id) {
            self.drop_staging_block(block.id);
            return true;
        }
        if block.requires_demotion {
            for p in &block.params {
                if let Some(s) = self.states.get_mut(p) {
                    s.mode = ResidencyMode::Disk;
                }
            }
            tracing::info!(
                params = block.params.len(),
                bytes = block.bytes,
                "demoted device-resident weights to disk mode"
            );
        }
        self.drop_storage_block(block.id);
        true
    }
}
