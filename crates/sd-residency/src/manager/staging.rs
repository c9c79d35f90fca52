//! Staging params copies to compute devices, prepare, and prefetch.

use std::collections::BTreeMap;

use sd_tensor::ggml::{Backend, BufferUsage, DeviceKind};

use super::blocks::{plan_chunks, StagingBlock, StagingMem};
use super::transfer::{TransferJob, WeightCopy};
use super::ModelManager;
use crate::residency::{
    BackendId, BlockId, OwnerId, ParamId, ResidencyError, Result, SourceId, WeightPrefetchResult,
};

impl ModelManager {
    /// Allocates staging chunks on the compute devices of `params` (those not direct, not
    /// staged, not prefetched, with a loaded params copy), places the registered tensors in
    /// them and copies the params copies in. With `owner`, the chunks are a prefetch of that
    /// owner. Returns the blocks created; on error they are freed again.
    ///
    /// Blocks are per call: the chunks hold only parameters of this call (at most
    /// [`MAX_RESIDENCY_BLOCK_BYTES`](super::MAX_RESIDENCY_BLOCK_BYTES) each), never
    /// parameters staged by another call, so a caller that prepares one segment's
    /// weights per call gets blocks that can be evicted segment by segment.
    pub(crate) fn stage(
        &mut self,
        params: &[ParamId],
        owner: Option<OwnerId>,
    ) -> Result<Vec<BlockId>> {
        self.stage_with(params, owner, None)
    }

    /// [`stage`](Self::stage), collecting the copies into `deferred` instead of doing them
    /// when it is given (a prefetch hands them to a transfer thread).
    fn stage_with(
        &mut self,
        params: &[ParamId],
        owner: Option<OwnerId>,
        deferred: Option<&mut Vec<WeightCopy>>,
    ) -> Result<Vec<BlockId>> {
        let mut groups: BTreeMap<(BackendId, SourceId), Vec<ParamId>> = BTreeMap::new();
        for p in params {
            let Some(s) = self.states.get(p) else {
                continue;
            };
            if s.staged.is_some()
                || s.prefetched.is_some()
                || s.bound
                || s.storage.is_none()
                || self.is_direct(s)
            {
                continue;
            }
            let list = groups.entry((s.compute_backend, s.source)).or_default();
            if !list.contains(p) {
                list.push(*p);
            }
        }
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        let _span = tracing::debug_span!("stage_params", groups = groups.len()).entered();
        let mut created = Vec::new();
        let result = self.stage_groups(groups, owner, &mut created, deferred);
        if let Err(e) = result {
            for id in &created {
                self.drop_staging_block(*id);
            }
            return Err(e);
        }
        Ok(created)
    }

    fn stage_groups(
        &mut self,
        groups: BTreeMap<(BackendId, SourceId), Vec<ParamId>>,
        owner: Option<OwnerId>,
        created: &mut Vec<BlockId>,
        mut deferred: Option<&mut Vec<WeightCopy>>,
    ) -> Result<()> {
        for ((backend, _), members) in groups {
            let buft = self.backend_res(backend)?.0.buffer_type();
            let align = buft.alignment() as u64;
            let sizes: Vec<(ParamId, u64)> = members
                .iter()
                .map(|p| (*p, buft.alloc_size(&self.states[p].tensor) as u64))
                .collect();
            // The backend's staging pool first: a region of it per tensor, all or none,
            // where each had it last time if free (stable placement), else first fit in
            // order; it fits when first fit fits (as the capacity check simulates it).
            let high = &self.pool_high;
            let stable = self.stable_placement;
            let pooled = self.pools.get_mut(&backend).and_then(|pool| {
                let items: Vec<(ParamId, u64, bool)> = sizes
                    .iter()
                    .map(|&(p, bytes)| (p, bytes, high.contains(&p)))
                    .collect();
                let offsets = pool.place(&items, stable)?;
                Some(
                    offsets
                        .into_iter()
                        .zip(&sizes)
                        .map(|(off, &(_, bytes))| (off, bytes))
                        .collect::<Vec<(u64, u64)>>(),
                )
            });
            if pooled.is_none() && owner.is_some() && self.pools.contains_key(&backend) {
                // A prefetch stays inside the pool: the room outside it is the runtime's
                // (the next segment's workspace).
                return Err(ResidencyError::Ggml {
                    context: "prefetching into the staging pool".into(),
                    source: sd_tensor::GgmlError::Mismatch(format!(
                        "no free region of the pool holds {} weight(s)",
                        members.len()
                    )),
                });
            }
            let chunks: Vec<(StagingMem, Vec<(ParamId, u64)>)> = match pooled {
                Some(regions) => {
                    let placements = sizes
                        .iter()
                        .zip(&regions)
                        .map(|(&(p, _), &(off, _))| (p, off))
                        .collect();
                    vec![(StagingMem::Pool { backend, regions }, placements)]
                }
                None => {
                    if self.pools.contains_key(&backend) {
                        tracing::debug!(
                            params = members.len(),
                            "staging pool full: staging in buffers of their own"
                        );
                    }
                    let cap = if buft.is_host() {
                        buft.max_size() as u64
                    } else {
                        self.max_block_bytes.min(buft.max_size() as u64)
                    };
                    let mut chunks = Vec::new();
                    for (placements, size) in plan_chunks(&sizes, align, cap) {
                        let buffer = buft
                            .alloc(size as usize)
                            .map_err(ResidencyError::ggml("allocating a staging block"))?;
                        buffer.set_usage(BufferUsage::Weights);
                        chunks.push((StagingMem::Own(buffer), placements));
                    }
                    chunks
                }
            };
            for (mem, placements) in chunks {
                let mut now = Vec::new();
                let id = self.new_block_id();
                self.staging.insert(
                    id,
                    StagingBlock {
                        mem,
                        members: Vec::with_capacity(placements.len()),
                        prefetch_owner: owner,
                    },
                );
                created.push(id);
                for (p, off) in placements {
                    let s = &self.states[&p];
                    let buffer = match &self.staging[&id].mem {
                        StagingMem::Own(b) => b,
                        StagingMem::Pool { backend, .. } => {
                            &self
                                .pools
                                .get(backend)
                                .ok_or(ResidencyError::UnknownBackend(*backend))?
                                .buffer
                        }
                    };
                    buffer
                        .place(&s.tensor, off as usize)
                        .map_err(ResidencyError::ggml(format!("staging `{}`", s.name)))?;
                    let src = s.storage.as_ref().map(|l| l.desc.clone());
                    let name = s.name.clone();
                    let tensor = s.tensor.clone();
                    self.staging
                        .get_mut(&id)
                        .expect("inserted above")
                        .members
                        .push(p);
                    if let Some(s) = self.states.get_mut(&p) {
                        match owner {
                            Some(o) => s.prefetched = Some((o, id)),
                            None => s.staged = Some(id),
                        }
                    }
                    let src = src.ok_or(ResidencyError::UnknownParam(p))?;
                    let copy = WeightCopy {
                        src,
                        dst: tensor,
                        name,
                    };
                    match deferred.as_deref_mut() {
                        Some(list) => list.push(copy),
                        None => now.push(copy),
                    }
                }
                self.upload_now(&now)?;
            }
        }
        Ok(())
    }

    /// Copies `copies` on this thread (one copy per run of tensors laid out alike when
    /// [`set_coalesce_uploads`](ModelManager::set_coalesce_uploads) is on) and counts them.
    fn upload_now(&mut self, copies: &[WeightCopy]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        if self.coalesce_uploads {
            let pairs: Vec<_> = copies
                .iter()
                .map(|c| (c.src.clone(), c.dst.clone()))
                .collect();
            Backend::copy_tensors(&pairs).map_err(ResidencyError::ggml(format!(
                "uploading `{}` and {} more",
                copies[0].name,
                copies.len() - 1
            )))?;
        } else {
            for c in copies {
                Backend::copy_tensor(&c.src, &c.dst)
                    .map_err(ResidencyError::ggml(format!("uploading `{}`", c.name)))?;
            }
        }
        self.upload_bytes += copies.iter().map(|c| c.dst.nbytes() as u64).sum::<u64>();
        Ok(())
    }

    /// Turns a prefetch block into a regular staging block: its members become staged.
    pub(crate) fn promote_prefetch_block(&mut self, id: BlockId) {
        let Some(block) = self.staging.get_mut(&id) else {
            return;
        };
        block.prefetch_owner = None;
        for m in block.members.clone() {
            if let Some(s) = self.states.get_mut(&m) {
                s.prefetched = None;
                s.staged = Some(id);
            }
        }
    }

    pub(crate) fn prepare_inner(&mut self, params: &[ParamId]) -> Result<()> {
        self.check_known(params)?;
        let prefetched_blocks = |m: &ModelManager| -> Vec<BlockId> {
            params
                .iter()
                .filter_map(|p| m.states[p].prefetched.map(|(_, b)| b))
                .collect()
        };
        // Uploads of these parameters' prefetched copies are ordered before the compute
        // backend's later work (queued copies) or waited for (a transfer thread); other
        // prefetches (for later segments) go on: staging here frees only blocks no
        // transfer fills, or waits for it (`drop_staging_block`). LoRAs read and write the
        // staged copies on the host: everything is finished first.
        self.order_transfers(&prefetched_blocks(self));
        if self.lora.has_patches() {
            self.finish_transfers();
        }
        let _span = tracing::info_span!("prepare_params", params = params.len()).entered();
        // Prefetched copies of these parameters become current.
        let prefetched = prefetched_blocks(self);
        for b in prefetched {
            self.promote_prefetch_block(b);
        }
        let created_storage = self.load_to_params(params)?;
        let undo = |m: &mut ModelManager, staging: &[BlockId]| {
            for id in staging {
                m.drop_staging_block(*id);
            }
            for id in &created_storage {
                m.drop_storage_block(*id);
            }
        };
        if let Err(e) = self.bind_direct(params) {
            undo(self, &[]);
            return Err(e);
        }
        let created_staging = match self.stage(params, None) {
            Ok(c) => c,
            Err(e) => {
                undo(self, &[]);
                return Err(e);
            }
        };
        // Pins are taken before LoRA application, as upstream does.
        for p in params {
            if let Some(s) = self.states.get_mut(p) {
                s.pin_count = s.pin_count.saturating_add(1);
            }
        }
        self.stamp_params(params);
        if let Err(e) = self.apply_loras(params) {
            for p in params {
                if let Some(s) = self.states.get_mut(p) {
                    s.pin_count = s.pin_count.saturating_sub(1);
                }
            }
            undo(self, &created_staging);
            return Err(e);
        }
        Ok(())
    }

    pub(crate) fn stamp_params(&mut self, params: &[ParamId]) {
        self.epoch += 1;
        let e = self.epoch;
        for p in params {
            if let Some(s) = self.states.get_mut(p) {
                s.last_use_epoch = e;
            }
        }
    }

    pub(crate) fn prefetch_inner(
        &mut self,
        owner: OwnerId,
        params: &[ParamId],
    ) -> WeightPrefetchResult {
        if !self.prefetch || self.check_known(params).is_err() {
            return if self.prefetch {
                WeightPrefetchResult::Failed
            } else {
                WeightPrefetchResult::Unsupported
            };
        }
        let mut backend = None;
        let mut wanted = Vec::new();
        let mut needs_sync_load = false;
        for p in params {
            let s = &self.states[p];
            if self.is_direct(s) {
                needs_sync_load |= s.storage.is_none();
                continue;
            }
            if s.staged.is_some() || s.prefetched.is_some() || s.pin_count > 0 {
                continue;
            }
            if s.split {
                return WeightPrefetchResult::Unsupported;
            }
            match backend {
                None => backend = Some(s.compute_backend),
                Some(b) if b != s.compute_backend => return WeightPrefetchResult::Failed,
                Some(_) => {}
            }
            wanted.push(*p);
        }
        let Some(backend) = backend else {
            return if needs_sync_load {
                WeightPrefetchResult::Unsupported
            } else {
                WeightPrefetchResult::AlreadyResident
            };
        };
        if self
            .device_of(backend)
            .is_none_or(|d| d.kind() == DeviceKind::Cpu)
        {
            return WeightPrefetchResult::Unsupported;
        }
        if let Some(pool) = self.pools.get(&backend) {
            let buft = pool.buffer.buffer_type();
            let fits = pool.fits_all(wanted.iter().map(|p| {
                let bytes = buft
                    .as_ref()
                    .map_or(0, |t| t.alloc_size(&self.states[p].tensor) as u64);
                (bytes, self.pool_high.contains(p))
            }));
            if !fits {
                // A prefetch stays inside the pool (see `stage_groups`).
                tracing::debug!(
                    params = wanted.len(),
                    "prefetch skipped: the staging pool is full"
                );
                return WeightPrefetchResult::Failed;
            }
        }
        let _span =
            tracing::debug_span!("prefetch", owner = owner.0, params = wanted.len()).entered();
        let created_storage = match self.load_to_params(&wanted) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "prefetch failed to load weights");
                return WeightPrefetchResult::Failed;
            }
        };
        let mut copies = Vec::new();
        match self.stage_with(&wanted, Some(owner), Some(&mut copies)) {
            Ok(blocks) => {
                // The copies run on the device's copy stream, or on a transfer thread,
                // while the caller computes.
                self.upload_bytes += copies.iter().map(|c| c.dst.nbytes() as u64).sum::<u64>();
                let coalesce = self.coalesce_uploads;
                let after_compute = self.uploads_wait_for_compute;
                let compute = self.backend(backend).cloned();
                let _span = tracing::debug_span!("transfer_job_start").entered();
                let job = match (compute, self.copy_stream(backend)) {
                    (Some(compute), Some(stream)) => {
                        TransferJob::queue(stream, compute, copies, blocks, coalesce, after_compute)
                    }
                    // After the thread jobs still in flight: the first segment's
                    // weights are not slowed down by a later segment's.
                    _ => {
                        let after = self.transfers.iter().rev().find_map(|j| j.completion());
                        let log = self.upload_log.clone();
                        TransferJob::spawn(copies, blocks, coalesce, after, log)
                    }
                };
                self.transfers.push(job);
                WeightPrefetchResult::Scheduled
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefetch failed to stage weights");
                for id in created_storage {
                    self.drop_storage_block(id);
                }
                WeightPrefetchResult::Failed
            }
        }
    }
}
