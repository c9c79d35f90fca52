//! The staging pool of a segmented run: its size under the limit, allocated once and kept
//! from step to step, so that streamed weights are sub-allocated instead of allocated and
//! freed inside a step.

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// The staging pool plan `p` runs with (see [`sd_residency::DeviceResidencyManager::set_staging_pool`]):
    /// `None` unless it is segmented under a limit on one device other than the CPU, with
    /// [`SessionConfig::staging_pool`](crate::SessionConfig::staging_pool) on. Its size is
    /// the limit less the largest non-weight need of a segment (workspace, live cuts,
    /// outputs, the runner cache) and a 1/64 slack for what the plan does not see (ggml
    /// rounding in the compute buffer), at most the plan's weight bytes; `None` too when
    /// that does not hold the largest segment's weights (the segments then stage into
    /// buffers of their own, as without a pool).
    pub(crate) fn staging_pool_size(&self, p: &Prepared, segmented: bool) -> Option<u64> {
        let cfg = &self.session.config;
        if !segmented || !cfg.staging_pool || self.session.is_layer_split() || cfg.backend.is_cpu()
        {
            return None;
        }
        let limit = self.segment_limit()?;
        let nonweight = (0..p.plan.segments.len())
            .map(|k| {
                let d = crate::refine::segment_plan(p, k);
                tracing::trace!(
                    segment = k,
                    need = d.need,
                    weights = d.weight_bytes,
                    "segment need"
                );
                d.need.saturating_sub(d.weight_bytes)
            })
            .max()?
            .saturating_add(self.session.slots[0].runner_cache.bytes() as u64);
        let largest = p.segment_weight_bytes.iter().copied().max()?;
        let weights: u64 = p.param_bytes.values().sum();
        let size = limit
            .checked_sub(nonweight)?
            .checked_sub(limit / 64)?
            .min(weights);
        // Whole allocation units, so that the pool's footprint is its size.
        let g = self
            .session
            .config
            .backend
            .buffer_type()
            .allocation_granularity();
        let size = if size >= g { size / g * g } else { size };
        if size == 0 || size < largest {
            tracing::debug!(
                limit,
                nonweight,
                largest,
                size,
                "no staging pool: it would not hold the largest segment's weights"
            );
            return None;
        }
        Some(size)
    }

    /// Gives the session's device the staging pool `p` runs with (allocated once: a pool of
    /// the same size is kept from run to run), making room for it first; without one, frees
    /// the session's own pool. A pool that does not fit is skipped (best effort).
    pub(super) fn setup_staging_pool(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        segmented: bool,
    ) -> Result<()> {
        let owner = self.session.id.owner();
        let backend = self.session.config.backend_id;
        let current = self.manager.staging_pool(backend);
        let Some(size) = self.staging_pool_size(p, segmented) else {
            if current.is_some_and(|(o, _)| o == owner) {
                self.manager.set_staging_pool(owner, backend, None)?;
            }
            return Ok(());
        };
        if current == Some((owner, size)) {
            return Ok(());
        }
        if let Some((o, _)) = current {
            self.manager.set_staging_pool(o, backend, None)?;
        }
        // A workspace kept from a larger graph would not leave the pool its room.
        let ws = &mut self.session.slots[0].workspace;
        if ws.bytes()
            > ws.buffer_type()
                .footprint(p.plan.max_compute_buffer() as u64)
        {
            ws.release();
            self.session.sync(self.manager);
        }
        let request = self.request(0, size);
        let preferred = eviction_order(&p.segment_params, 0);
        let room = ensure_capacity(
            self.manager,
            self.others,
            &CapacityAsk {
                what: format!("staging pool of '{}'", task.description),
                backend_name: self.session.config.backend.name().to_string(),
                request,
                required: &[],
                preferred: &preferred,
                protected: &[],
                pending_unless_pooled: false,
            },
            self.log,
        );
        if let Err(e) = room {
            tracing::debug!(size, error = %e, "no room for a staging pool: staging without one");
            return Ok(());
        }
        if let Err(e) = self.manager.set_staging_pool(owner, backend, Some(size)) {
            tracing::warn!(size, error = %e, "staging pool not allocated: staging without one");
        }
        Ok(())
    }
}
