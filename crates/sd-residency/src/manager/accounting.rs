//! Accounting: the device bytes the manager holds (buffers at their footprints), the
//! runtime residency owners report, and the capacity answer for a request.

use super::*;

impl ModelManager {
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

    pub(super) fn runtime_bytes(&self, device: &Device, except: Option<OwnerId>) -> u64 {
        self.runtime
            .iter()
            .filter(|((o, b), _)| Some(*o) != except && self.device_of(*b) == Some(*device))
            .fold(0u64, |acc, (_, v)| acc.saturating_add(*v))
    }

    /// Device-side bytes `p` still needs on its compute device (0 when resident there).
    pub(super) fn missing_bytes(&self, s: &ParamState) -> u64 {
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
        let mut pooled: Vec<(u64, bool)> = Vec::new();
        for p in params {
            let s = self.state(*p)?;
            if s.compute_backend == request.backend {
                let m = self.missing_bytes(s);
                if pool.is_some() && m > 0 && !self.is_direct(s) {
                    pooled.push((m, self.pool_high.contains(p)));
                } else {
                    missing = missing.saturating_add(m);
                }
            }
        }
        if !assume_pool_room && pool.is_some_and(|p| !p.fits_all(pooled.iter().copied())) {
            missing = missing.saturating_add(pooled.iter().map(|(m, _)| m).sum());
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
        let others = self.runtime_bytes(&device, Some(request.owner));
        let tracked_weight_bytes = self.resident_bytes(&device);
        let tracked_runtime_bytes = others.saturating_add(request.runtime_resident_bytes);
        let mem = {
            let _span = tracing::debug_span!("device_memory_report").entered();
            device.memory()
        };
        let budget = match (self.device_budget(&device), request.max_backend_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let state = DeviceState {
            class,
            reported_free: (mem.total > 0).then_some(mem.free),
            reported_total: mem.total,
            tracked_weight_bytes,
            tracked_runtime_bytes,
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
