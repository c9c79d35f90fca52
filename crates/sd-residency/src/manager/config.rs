//! The manager's configuration: backends, budgets and reserves (`--max-vram`), block
//! sizes, mapping, segmentation and prefetch switches, upload modes, load threads.

use super::*;

/// How weights go to their compute device: the three upload switches of a
/// [`ModelManager`] in one value (`sd_pipeline`'s `RuntimeOptions` carries one; see
/// [`ModelManager::set_upload_options`]). The default is the manager's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UploadOptions {
    /// See [`ModelManager::set_pinned_host_params`] (default on).
    pub pinned_host_params: bool,
    /// See [`ModelManager::set_coalesce_uploads`] (default on).
    pub coalesce: bool,
    /// See [`ModelManager::set_async_uploads`] (default off).
    pub copy_stream: bool,
    /// See [`ModelManager::set_stable_placement`] (default off).
    pub stable_placement: bool,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions {
            pinned_host_params: true,
            coalesce: true,
            copy_stream: false,
            stable_placement: false,
        }
    }
}

impl ModelManager {
    /// Sets the upload switches of `options`.
    pub fn set_upload_options(&mut self, options: UploadOptions) {
        self.set_pinned_host_params(options.pinned_host_params);
        self.set_coalesce_uploads(options.coalesce);
        self.set_async_uploads(options.copy_stream);
        self.set_stable_placement(options.stable_placement);
    }

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

    /// Bytes of `device`'s budget kept for backend operator temporaries so far (see
    /// [`DeviceResidencyManager::reserve_backend_temporaries`]; 0 when none): with
    /// [`ModelManager::runtime_reserve`], what a `--max-vram` budget holds beyond the
    /// engine's limit.
    pub fn backend_temporaries(&self, device: &Device) -> u64 {
        let key = device.name().to_ascii_lowercase();
        self.temporaries.get(&key).copied().unwrap_or(0)
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
    /// the transfer thread alike. Default: on (off: one copy per tensor): with prefetches
    /// several segments ahead, SD1.5 budgeted steps on an H100 were 1-10% faster with
    /// coalesced uploads in each of six interleaved pairs (docs/benchmarks.md).
    pub fn set_coalesce_uploads(&mut self, on: bool) {
        self.coalesce_uploads = on;
    }

    /// Whether a weight staged in a staging pool again goes back to the offset it had last
    /// time when that region is free (default: off). A sampling loop then reads every
    /// step's weights where the step before did, so that a segment's kept graph is the
    /// same graph at the same addresses from step to step, which ggml's CUDA backend
    /// replays as one CUDA graph; off, first fit places them wherever the step's order of
    /// evictions left room. Off by default: on the H100 (and on the simulated device with
    /// CUDA's 2 MiB allocation unit) the weights streamed through the window still went
    /// elsewhere every step, the evictions' order differing from step to step, and SDXL's
    /// budgeted steps were slower (`docs/benchmarks.md`, fifteenth session); a static
    /// placement of the window is what replays need.
    pub fn set_stable_placement(&mut self, on: bool) {
        self.stable_placement = on;
    }

    /// Whether prefetch uploads are queued on a copy stream of the compute device (a second
    /// backend of the device, ordered against compute with events; see `transfer`) where
    /// the backend has queued copies and events (default: off: on an H200 the copy stream
    /// slowed the kernels beside it, FLUX.1-dev's 8 GiB step 967 ms against 761 ms with
    /// synchronous uploads; `docs/benchmarks.md`; measured again on an H100 in the
    /// twenty-second session: SD1.5 at 0.75 / 0.5 / 0.25 of its weights as fast or up to 15%
    /// slower, SDXL at 0.5 190.4 ms a step against 159.3). Off, or on backends without them
    /// (the CPU), a prefetch copies synchronously on a transfer thread.
    pub fn set_async_uploads(&mut self, on: bool) {
        if !on {
            self.finish_transfers();
            self.copy_streams.clear();
        }
        self.async_uploads = on;
    }

    /// Whether transfer threads record when each of their jobs ran (for timelines of a
    /// step, see [`take_upload_spans`](Self::take_upload_spans); default off). Uploads on
    /// a copy stream and synchronous staging are not recorded.
    pub fn set_upload_log(&mut self, on: bool) {
        self.upload_log = on.then(Default::default);
    }

    /// The [`UploadSpan`](super::UploadSpan)s recorded since the last call (empty with the
    /// log off), in the order the jobs finished.
    pub fn take_upload_spans(&mut self) -> Vec<super::UploadSpan> {
        self.upload_log.as_ref().map_or_else(Vec::new, |log| {
            std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()))
        })
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
}
