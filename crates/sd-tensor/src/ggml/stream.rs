//! Events and copy streams: host-to-device uploads queued on a second backend of a device
//! while its compute backend works, ordered against compute with events.
//!
//! A [`CopyStream`] is a second backend instance on the compute backend's device (on CUDA a
//! second `ggml_backend_dev_init`: its own stream; buffers of the device's buffer type are
//! usable from both). Copies queued on it with [`CopyStream::upload`] run while the compute
//! backend computes; an [`Event`] recorded after them ([`CopyStream::record`]) is what the
//! compute backend waits on ([`Backend::wait_event`]) before computing with the uploaded
//! tensors, and what the host waits on ([`Event::synchronize`]) before freeing or reusing
//! their memory. [`CopyStream::after`] orders the stream's later copies after the compute
//! queued so far (an upload into memory a graph still reads waits for that graph).
//!
//! Backends without asynchronous copies or events (the CPU backend, a simulated device
//! made without [`SimOptions::async_transfers`](super::SimOptions::async_transfers)) have no
//! copy stream: [`CopyStream::new`] returns `None` and callers copy synchronously.

use std::ptr::NonNull;

use ggml_sys as sys;

use super::backend::{coalesced_runs, with_span, Backend, CopyRun, Device};
use super::error::{GgmlError, Result};
use super::tensor::GTensor;

/// A ggml backend event (RAII: freed on drop). Recorded on a backend's queue, it completes
/// when the work queued before the record has.
pub struct Event {
    ptr: NonNull<sys::ggml_backend_event>,
}

// SAFETY: ggml events are device objects usable from any thread (CUDA events are).
unsafe impl Send for Event {}
// SAFETY: see above; recording and waiting go through the backends' own synchronisation.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:p})", self.ptr)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: owned event freed once.
        unsafe { sys::ggml_backend_event_free(self.ptr.as_ptr()) }
    }
}

impl Event {
    /// A new event on `device`, or `None` when the device has no events.
    pub fn new(device: Device) -> Option<Event> {
        // SAFETY: live device; NULL when the device has no events.
        NonNull::new(unsafe { sys::ggml_backend_event_new(device.raw()) }).map(|ptr| Event { ptr })
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_event_t {
        self.ptr.as_ptr()
    }

    /// Records the event after the work queued on `backend` so far.
    pub fn record(&self, backend: &Backend) -> Result<()> {
        if !backend.supports_events() {
            return Err(GgmlError::Mismatch(format!(
                "backend {} has no events",
                backend.name()
            )));
        }
        // SAFETY: live event and backend with an `event_record`.
        unsafe { sys::ggml_backend_event_record(self.raw(), backend.raw()) };
        Ok(())
    }

    /// Blocks the calling thread until the work recorded before the event is done.
    pub fn synchronize(&self) {
        // SAFETY: live event of a device with `event_synchronize` (an event exists only
        // where `event_new` does; see `Backend::supports_events`).
        unsafe { sys::ggml_backend_event_synchronize(self.raw()) }
    }
}

/// A second backend on a compute backend's device, for uploads that overlap compute (see
/// the module docs). Dropping it waits for the copies queued on it.
pub struct CopyStream {
    backend: Backend,
    device: Device,
    /// Recorded on the compute backend by [`CopyStream::after`].
    compute_done: Event,
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyStream({})", self.backend.name())
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        self.backend.synchronize();
    }
}

impl CopyStream {
    /// A copy stream for `compute`: a second backend on its device, when both have events
    /// and the new one queues host-to-device copies; `None` otherwise (copy synchronously).
    pub fn new(compute: &Backend) -> Option<CopyStream> {
        if !compute.supports_events() {
            return None;
        }
        let device = compute.device()?;
        let backend = device.init_backend().ok()?;
        if !backend.supports_events() || !backend.supports_async_set() {
            return None;
        }
        let compute_done = Event::new(device)?;
        Some(CopyStream {
            backend,
            device,
            compute_done,
        })
    }

    /// The stream's backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The device it copies to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Makes the copies queued after this call wait for the work queued on `compute` so far
    /// (in the device's queues; the host does not wait).
    pub fn after(&self, compute: &Backend) -> Result<()> {
        self.compute_done.record(compute)?;
        self.backend.wait_event(&self.compute_done)
    }

    /// Records a new event after the copies queued so far.
    pub fn record(&self) -> Result<Event> {
        let event = Event::new(self.device).ok_or_else(|| {
            GgmlError::Mismatch(format!("device {} has no events", self.device.name()))
        })?;
        event.record(&self.backend)?;
        Ok(event)
    }

    /// Whether [`upload`](Self::upload) queues the copy `src -> dst` (rather than doing it
    /// synchronously): `src` in a host buffer, `dst` in a buffer of the stream's device
    /// type, both allocated, same layout.
    pub fn queues(&self, src: &GTensor, dst: &GTensor) -> bool {
        let buft = self.backend.buffer_type();
        src.is_allocated()
            && dst.is_allocated()
            && src.has_buffer()
            && src.is_host()
            && dst.has_buffer()
            && dst.view_src().is_none()
            && dst.buffer_type_raw() == buft.raw()
            && src.nbytes() == dst.nbytes()
            && src.dtype() == dst.dtype()
            && src.ne() == dst.ne()
    }

    /// Queues the copies `(src, dst)`: with `coalesce`, runs laid out alike in one copy
    /// each as [`Backend::copy_tensors`] merges them. A pair the stream cannot queue (see
    /// [`queues`](Self::queues)) is copied synchronously after the stream's earlier
    /// copies. Returns the number of copies queued.
    ///
    /// # Safety
    /// Until an event recorded after this call ([`record`](Self::record)) has completed,
    /// every source's memory must stay allocated and unchanged, and every destination's
    /// memory allocated and neither read nor written by anything not ordered after that
    /// event.
    pub unsafe fn upload(&self, pairs: &[(GTensor, GTensor)], coalesce: bool) -> Result<usize> {
        let runs = if coalesce {
            coalesced_runs(pairs)
        } else {
            (0..pairs.len()).map(CopyRun::One).collect()
        };
        let mut queued = 0;
        for run in runs {
            let (first, len) = match run {
                CopyRun::One(i) => (i, pairs[i].0.nbytes()),
                CopyRun::Span { first, len } => (first, len),
            };
            let (s, d) = (&pairs[first].0, &pairs[first].1);
            if !self.queues(s, d) {
                // Merged runs are made of queueable pairs only: this is a lone pair.
                self.backend.synchronize();
                Backend::copy_tensor(s, d)?;
                continue;
            }
            let src = s.data_addr() as *const std::ffi::c_void;
            if len == d.nbytes() {
                // SAFETY: both allocated, same size; the destination is in a buffer of the
                // stream's device type (checked by `queues`); the caller keeps the memory.
                unsafe {
                    sys::ggml_backend_tensor_set_async(self.backend.raw(), d.raw(), src, 0, len)
                };
            } else {
                with_span(d, len, |span| {
                    // SAFETY: the run lies inside the destination buffer (`coalesced_runs`)
                    // and the source run in one live host buffer; see above.
                    unsafe {
                        sys::ggml_backend_tensor_set_async(self.backend.raw(), span, src, 0, len)
                    };
                })?;
            }
            queued += 1;
        }
        Ok(queued)
    }
}
