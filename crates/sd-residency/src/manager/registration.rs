//! Registering and unregistering parameters, and what the manager tells about them.

use super::*;

impl ModelManager {
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
    pub(super) fn free_blocks_holding(
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

    pub(super) fn check_unpinned(&self, members: &[ParamId]) -> Result<()> {
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
}
