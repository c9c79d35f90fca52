//! [`DeviceResidencyManager`] for [`ModelManager`]: the interface the execution engine drives
//! (capacity, eviction candidates, prefetch, staging, pinning, runtime residency).

use super::*;

impl DeviceResidencyManager for ModelManager {
    fn segmented_compute_enabled(&self) -> bool {
        self.segmented
    }

    fn backend_budget(&self, backend: BackendId) -> Option<u64> {
        self.device_of(backend).and_then(|d| self.device_budget(&d))
    }

    fn reserve_backend_temporaries(&mut self, backend: BackendId, bytes: u64) {
        // The CPU is not budgeted: nothing to keep room in.
        let Some(d) = self
            .device_of(backend)
            .filter(|d| d.kind() != DeviceKind::Cpu)
        else {
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

    fn keep_at_pool_end(&mut self, params: &[ParamId]) {
        if params.len() != self.pool_high.len()
            || params.iter().any(|p| !self.pool_high.contains(p))
        {
            self.pool_high = params.iter().copied().collect();
        }
    }

    fn set_uploads_wait_for_compute(&mut self, on: bool) {
        self.uploads_wait_for_compute = on;
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
                    pooled.push((m, self.pool_high.contains(p)));
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
        // The owner's prefetch blocks holding any of `params`: prefetches for later
        // segments stay in flight.
        let wanted: std::collections::HashSet<ParamId> = params.iter().copied().collect();
        let prefetch_blocks = |m: &ModelManager| -> Vec<BlockId> {
            m.staging
                .iter()
                .filter(|(_, b)| {
                    b.prefetch_owner == Some(owner) && b.members.iter().any(|p| wanted.contains(p))
                })
                .map(|(id, _)| *id)
                .collect()
        };
        // The compute backend waits for their uploads in its queue (queued copies), or the
        // host waits here for the transfers filling them (a transfer thread; the blocks of
        // a failed one are dropped). Other transfers go on.
        self.order_transfers(&prefetch_blocks(self));
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
