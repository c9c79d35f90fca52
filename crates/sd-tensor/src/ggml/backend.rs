//! Backends, devices, buffer types and buffers.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use ggml_sys as sys;

use super::context::Context;
use super::error::{status_name, GgmlError, Result};
use super::graph::Graph;
use super::tensor::GTensor;

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: ggml returns NUL-terminated strings that outlive the call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The kind of a device, as ggml reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host CPU.
    Cpu,
    /// Discrete GPU.
    Gpu,
    /// Integrated GPU sharing host memory.
    IntegratedGpu,
    /// An accelerator used alongside the CPU (BLAS and the like).
    Accelerator,
    /// Anything else.
    Other,
}

/// Free and total memory of a device in bytes, as its backend reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// A ggml backend device (from ggml's registry). Devices are static for the process.
#[derive(Clone, Copy)]
pub struct Device {
    ptr: NonNull<sys::ggml_backend_device>,
}

// SAFETY: device handles are process-global and immutable.
unsafe impl Send for Device {}
// SAFETY: see above.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({}, {:?})", self.name(), self.kind())
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr
    }
}
impl Eq for Device {}

impl Device {
    /// All devices ggml knows, in registry order.
    pub fn all() -> Vec<Device> {
        // SAFETY: registry queries.
        let n = unsafe { sys::ggml_backend_dev_count() };
        (0..n)
            .filter_map(|i| NonNull::new(unsafe { sys::ggml_backend_dev_get(i) }))
            .map(|ptr| Device { ptr })
            .collect()
    }

    /// A device by name (case-insensitive, e.g. `CPU`, `CUDA0`).
    pub fn by_name(name: &str) -> Result<Device> {
        Self::all()
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| GgmlError::NoSuchBackend(name.to_string()))
    }

    /// The CPU device.
    pub fn cpu() -> Result<Device> {
        // SAFETY: registry query.
        let p = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        NonNull::new(p)
            .map(|ptr| Device { ptr })
            .ok_or_else(|| GgmlError::NoSuchBackend("CPU".into()))
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_dev_t {
        self.ptr.as_ptr()
    }

    /// The device name (`CPU`, `CUDA0`, ...).
    pub fn name(&self) -> String {
        // SAFETY: live device.
        cstr(unsafe { sys::ggml_backend_dev_name(self.raw()) })
    }

    /// A human description (the CPU model, the GPU name).
    pub fn description(&self) -> String {
        // SAFETY: live device.
        cstr(unsafe { sys::ggml_backend_dev_description(self.raw()) })
    }

    /// The device kind.
    pub fn kind(&self) -> DeviceKind {
        // SAFETY: live device.
        match unsafe { sys::ggml_backend_dev_type(self.raw()) } {
            sys::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
            sys::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
            sys::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
            sys::GGML_BACKEND_DEVICE_TYPE_ACCEL => DeviceKind::Accelerator,
            _ => DeviceKind::Other,
        }
    }

    /// Free and total memory as reported now.
    pub fn memory(&self) -> DeviceMemory {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: live device, valid out pointers.
        unsafe { sys::ggml_backend_dev_memory(self.raw(), &mut free, &mut total) };
        DeviceMemory {
            free: free as u64,
            total: total as u64,
        }
    }

    /// The device's default buffer type.
    pub fn buffer_type(&self) -> Result<BufferType> {
        // SAFETY: live device.
        BufferType::from_raw(unsafe { sys::ggml_backend_dev_buffer_type(self.raw()) })
    }

    /// A pinned host buffer type for fast uploads to this device, if it has one.
    pub fn host_buffer_type(&self) -> Option<BufferType> {
        // SAFETY: live device.
        BufferType::from_raw(unsafe { sys::ggml_backend_dev_host_buffer_type(self.raw()) }).ok()
    }

    /// Starts a backend on this device.
    pub fn init_backend(&self) -> Result<Backend> {
        // SAFETY: live device; NULL params.
        let p = unsafe { sys::ggml_backend_dev_init(self.raw(), std::ptr::null()) };
        Backend::from_raw(p, &self.name())
    }
}

/// Allocation granularities recorded per buffer type (by descriptor address; buffer types
/// live for the whole process).
fn granularities() -> &'static Mutex<HashMap<usize, u64>> {
    static MAP: OnceLock<Mutex<HashMap<usize, u64>>> = OnceLock::new();
    MAP.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A buffer type: how and where a backend allocates memory. Buffer types are static.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BufferType {
    ptr: NonNull<sys::ggml_backend_buffer_type>,
}

// SAFETY: buffer types are process-global and immutable.
unsafe impl Send for BufferType {}
// SAFETY: see above.
unsafe impl Sync for BufferType {}

impl std::fmt::Debug for BufferType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufferType({})", self.name())
    }
}

impl BufferType {
    pub(crate) fn from_raw(p: sys::ggml_backend_buffer_type_t) -> Result<BufferType> {
        NonNull::new(p)
            .map(|ptr| BufferType { ptr })
            .ok_or_else(|| GgmlError::NoSuchBackend("buffer type".into()))
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_buffer_type_t {
        self.ptr.as_ptr()
    }

    /// Sets the allocation granularity of this buffer type's memory: the unit its
    /// allocator rounds every buffer up to (`cudaMalloc` reserves whole 2 MiB pages, for
    /// example). ggml does not report it; a runtime measures it
    /// (`sd_exec::reserve::measure_allocation_granularity`) and records it here, so that
    /// every budget check counts a buffer at its [`footprint`](Self::footprint). Values
    /// below 2 mean "exact sizes" (the default).
    pub fn set_allocation_granularity(&self, bytes: u64) {
        let mut map = granularities().lock().unwrap_or_else(|e| e.into_inner());
        if bytes < 2 {
            map.remove(&(self.raw() as usize));
        } else {
            map.insert(self.raw() as usize, bytes);
        }
    }

    /// The allocation granularity recorded for this buffer type (1: exact sizes).
    pub fn allocation_granularity(&self) -> u64 {
        let map = granularities().lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(self.raw() as usize)).copied().unwrap_or(1)
    }

    /// The device memory a buffer of `bytes` bytes of this type takes: `bytes` rounded up
    /// to the [`allocation_granularity`](Self::allocation_granularity) (saturating).
    pub fn footprint(&self, bytes: u64) -> u64 {
        let g = self.allocation_granularity();
        if g < 2 || bytes == 0 {
            return bytes;
        }
        bytes.div_ceil(g).saturating_mul(g)
    }

    /// The CPU (host) buffer type.
    pub fn cpu() -> BufferType {
        // SAFETY: static buffer type.
        BufferType::from_raw(unsafe { sys::ggml_backend_cpu_buffer_type() })
            .expect("CPU buffer type")
    }

    /// The CPU device's extra buffer types, in ggml's order of preference: buffers whose
    /// tensors the CPU backend multiplies with its own kernels after repacking them when they
    /// are written (`AMX`: int8 tiles on a CPU with AMX, for q8_0 / q4_0 / q4_K ... weights;
    /// `CPU_REPACK`: interleaved rows for the AVX2 / NEON quantized products). Empty when ggml
    /// was built without them or the CPU lacks the instructions.
    pub fn cpu_extra() -> Vec<BufferType> {
        type ExtraBufts =
            unsafe extern "C" fn(sys::ggml_backend_dev_t) -> *mut sys::ggml_backend_buffer_type_t;
        // SAFETY: the CPU registry and device are static; the proc address, when present,
        // is ggml's `ggml_backend_dev_get_extra_bufts_t`, which returns a NULL-terminated
        // static array.
        unsafe {
            let reg = sys::ggml_backend_cpu_reg();
            let dev = sys::ggml_backend_reg_dev_get(reg, 0);
            let f = sys::ggml_backend_reg_get_proc_address(
                reg,
                c"ggml_backend_dev_get_extra_bufts".as_ptr(),
            );
            if f.is_null() || dev.is_null() {
                return Vec::new();
            }
            let f: ExtraBufts = std::mem::transmute(f);
            let mut p = f(dev);
            let mut out = Vec::new();
            while !p.is_null() && !(*p).is_null() {
                out.extend(BufferType::from_raw(*p).ok());
                p = p.add(1);
            }
            out
        }
    }

    /// The CPU's `AMX` extra buffer type (see [`cpu_extra`](Self::cpu_extra)), when ggml
    /// was built with AMX-INT8 and the CPU has it.
    pub fn cpu_amx() -> Option<BufferType> {
        Self::cpu_extra().into_iter().find(|b| b.name() == "AMX")
    }

    /// The buffer type's name.
    pub fn name(&self) -> String {
        // SAFETY: live buffer type.
        cstr(unsafe { sys::ggml_backend_buft_name(self.raw()) })
    }

    /// Alignment of allocations.
    pub fn alignment(&self) -> usize {
        // SAFETY: live buffer type.
        unsafe { sys::ggml_backend_buft_get_alignment(self.raw()) }
    }

    /// Largest single allocation.
    pub fn max_size(&self) -> usize {
        // SAFETY: live buffer type.
        unsafe { sys::ggml_backend_buft_get_max_size(self.raw()) }
    }

    /// Whether its memory is host memory.
    pub fn is_host(&self) -> bool {
        // SAFETY: live buffer type.
        unsafe { sys::ggml_backend_buft_is_host(self.raw()) }
    }

    /// Bytes a tensor takes in a buffer of this type (may exceed `nbytes` for padding).
    pub fn alloc_size(&self, t: &GTensor) -> usize {
        // SAFETY: live buffer type and descriptor.
        unsafe { sys::ggml_backend_buft_get_alloc_size(self.raw(), t.raw()) }
    }

    /// The device this buffer type allocates on, if any.
    pub fn device(&self) -> Option<Device> {
        // SAFETY: live buffer type.
        NonNull::new(unsafe { sys::ggml_backend_buft_get_device(self.raw()) })
            .map(|ptr| Device { ptr })
    }

    /// Allocates a buffer of `size` bytes.
    pub fn alloc(&self, size: usize) -> Result<Buffer> {
        // SAFETY: live buffer type; NULL on failure.
        let p = unsafe { sys::ggml_backend_buft_alloc_buffer(self.raw(), size) };
        NonNull::new(p)
            .map(|ptr| Buffer {
                ptr,
                placed: Mutex::new(Vec::new()),
            })
            .ok_or_else(|| GgmlError::AllocationFailed {
                what: "buffer".into(),
                buffer_type: self.name(),
                bytes: size,
            })
    }

    /// Allocates one buffer holding every tensor of `ctx` that has no data yet.
    pub fn alloc_context_tensors(&self, ctx: &Context) -> Result<Buffer> {
        let _g = ctx.lock();
        let mut pending = Vec::new();
        // SAFETY: iterating a live context's tensors under its lock.
        unsafe {
            let mut p = sys::ggml_get_first_tensor(ctx.raw());
            while !p.is_null() {
                if (*p).data.is_null() {
                    pending.push(p);
                }
                p = sys::ggml_get_next_tensor(ctx.raw(), p);
            }
        }
        drop(_g);
        let total: usize = pending
            .iter()
            .map(|&p| unsafe { sys::ggml_backend_buft_get_alloc_size(self.raw(), p) })
            .sum();
        // SAFETY: live context and buffer type; NULL on failure (or when nothing to allocate).
        let p = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.raw(), self.raw()) };
        let ptr = NonNull::new(p).ok_or_else(|| GgmlError::AllocationFailed {
            what: "context tensors".into(),
            buffer_type: self.name(),
            bytes: total,
        })?;
        let placed = pending
            .into_iter()
            .map(|p| GTensor::from_raw(ctx.clone(), p))
            .collect();
        Ok(Buffer {
            ptr,
            placed: Mutex::new(placed),
        })
    }
}

/// How a buffer is used (a hint some backends act on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferUsage {
    /// Any use.
    Any,
    /// Model weights.
    Weights,
    /// Compute scratch.
    Compute,
}

/// A backend buffer (device or host memory). Freed on drop; tensors placed in it through
/// this type forget their memory at that point.
pub struct Buffer {
    ptr: NonNull<sys::ggml_backend_buffer>,
    placed: Mutex<Vec<GTensor>>,
}

// SAFETY: ggml buffers may be used from any thread; `placed` is behind a mutex.
unsafe impl Send for Buffer {}
// SAFETY: see above.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({}, {} bytes)", self.name(), self.size())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        for t in self
            .placed
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            if t.buffer_raw() == self.ptr.as_ptr() {
                t.clear_allocation();
            }
        }
        // SAFETY: owned buffer freed once.
        unsafe { sys::ggml_backend_buffer_free(self.ptr.as_ptr()) }
        super::mapped::release(self.ptr.as_ptr());
    }
}

impl Buffer {
    pub(crate) fn raw(&self) -> sys::ggml_backend_buffer_t {
        self.ptr.as_ptr()
    }

    /// Wraps host memory owned elsewhere as a CPU buffer. The caller keeps the memory alive
    /// and unchanged in place for the buffer's lifetime (used for memory maps).
    ///
    /// # Safety
    /// `ptr..ptr+size` must stay valid (and not be moved) until the buffer is dropped.
    pub unsafe fn from_host_ptr(ptr: *mut u8, size: usize) -> Result<Buffer> {
        // ggml asserts on unaligned pointers (TENSOR_ALIGNMENT is 32).
        if ptr.is_null() || !(ptr as usize).is_multiple_of(32) {
            return Err(GgmlError::AllocationFailed {
                what: format!(
                    "host pointer buffer at an address not aligned to 32 bytes ({ptr:p})"
                ),
                buffer_type: "CPU".into(),
                bytes: size,
            });
        }
        // SAFETY: the pointer is non-null and aligned (checked above); the caller keeps the
        // memory valid for the buffer's lifetime.
        let p = unsafe { sys::ggml_backend_cpu_buffer_from_ptr(ptr.cast(), size) };
        NonNull::new(p)
            .map(|ptr| Buffer {
                ptr,
                placed: Mutex::new(Vec::new()),
            })
            .ok_or_else(|| GgmlError::AllocationFailed {
                what: "host pointer buffer".into(),
                buffer_type: "CPU".into(),
                bytes: size,
            })
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_get_size(self.raw()) }
    }

    /// The buffer's name.
    pub fn name(&self) -> String {
        // SAFETY: live buffer.
        cstr(unsafe { sys::ggml_backend_buffer_name(self.raw()) })
    }

    /// Whether the memory is host memory.
    pub fn is_host(&self) -> bool {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_is_host(self.raw()) }
    }

    /// The device memory the buffer takes: its size rounded up to its type's allocation
    /// granularity ([`BufferType::footprint`]).
    pub fn footprint(&self) -> u64 {
        let size = self.size() as u64;
        self.buffer_type().map_or(size, |t| t.footprint(size))
    }

    /// The buffer's type.
    pub fn buffer_type(&self) -> Result<BufferType> {
        // SAFETY: live buffer.
        BufferType::from_raw(unsafe { sys::ggml_backend_buffer_get_type(self.raw()) })
    }

    /// Fills the whole buffer with `value`.
    pub fn clear(&self, value: u8) {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_clear(self.raw(), value) }
    }

    /// Sets the usage hint.
    pub fn set_usage(&self, usage: BufferUsage) {
        let u = match usage {
            BufferUsage::Any => sys::GGML_BACKEND_BUFFER_USAGE_ANY,
            BufferUsage::Weights => sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
            BufferUsage::Compute => sys::GGML_BACKEND_BUFFER_USAGE_COMPUTE,
        };
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_set_usage(self.raw(), u) }
    }

    /// Bytes `t` takes in this buffer.
    pub fn alloc_size(&self, t: &GTensor) -> usize {
        // SAFETY: live buffer and descriptor.
        unsafe { sys::ggml_backend_buffer_get_alloc_size(self.raw(), t.raw()) }
    }

    /// Alignment of tensor placements.
    pub fn alignment(&self) -> usize {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_get_alignment(self.raw()) }
    }

    /// Places `t` (which must have no memory yet and not be a view) at byte `offset` of this
    /// buffer. `offset` must be aligned and the tensor must fit.
    pub fn place(&self, t: &GTensor, offset: usize) -> Result<()> {
        if t.is_allocated() {
            return Err(GgmlError::Mismatch(format!(
                "tensor '{}' already has memory",
                t.name()
            )));
        }
        if t.view_src().is_some() {
            return Err(GgmlError::Mismatch(format!(
                "tensor '{}' is a view",
                t.name()
            )));
        }
        let align = self.alignment().max(1);
        let need = self.alloc_size(t);
        if !offset.is_multiple_of(align) || offset.checked_add(need).is_none_or(|e| e > self.size())
        {
            return Err(GgmlError::AllocationFailed {
                what: format!("placing '{}' at offset {offset} (align {align})", t.name()),
                buffer_type: self.name(),
                bytes: need,
            });
        }
        let _g = t.context().lock();
        // SAFETY: checked above; base + offset lies inside the buffer.
        let status = unsafe {
            let base = sys::ggml_backend_buffer_get_base(self.raw()) as *mut u8;
            sys::ggml_backend_tensor_alloc(self.raw(), t.raw(), base.add(offset).cast())
        };
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::AllocationFailed {
                what: format!("placing '{}': {}", t.name(), status_name(status)),
                buffer_type: self.name(),
                bytes: need,
            });
        }
        drop(_g);
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.clone());
        Ok(())
    }

    /// Takes back the memory of `t`, placed in this buffer by [`Buffer::place`]: the tensor
    /// forgets its memory (it can be placed again, here or elsewhere) while the buffer stays
    /// allocated, so that its bytes can be reused (a sub-allocated staging pool). Returns
    /// whether `t` had memory in this buffer.
    pub fn unplace(&self, t: &GTensor) -> bool {
        let mut placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = placed.iter().position(|p| p.id() == t.id()) else {
            return false;
        };
        let p = placed.swap_remove(i);
        drop(placed);
        if p.buffer_raw() != self.ptr.as_ptr() {
            return false;
        }
        p.clear_allocation();
        true
    }

    /// Tensors placed in this buffer through [`Buffer::place`] or
    /// [`BufferType::alloc_context_tensors`].
    pub fn placed_tensors(&self) -> Vec<GTensor> {
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A compute backend (CPU, CUDA, RPC, ...). Freed on drop.
pub struct Backend {
    ptr: NonNull<sys::ggml_backend>,
    name: String,
}

// SAFETY: a backend is used by one thread at a time (`&mut` or external locking for compute).
unsafe impl Send for Backend {}
// SAFETY: shared access only queries immutable properties or performs synchronized copies.
unsafe impl Sync for Backend {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.name)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: owned backend freed once.
        unsafe { sys::ggml_backend_free(self.ptr.as_ptr()) }
    }
}

impl Backend {
    fn from_raw(p: sys::ggml_backend_t, what: &str) -> Result<Backend> {
        let ptr = NonNull::new(p).ok_or_else(|| GgmlError::BackendInit(what.to_string()))?;
        // SAFETY: live backend.
        let name = cstr(unsafe { sys::ggml_backend_name(ptr.as_ptr()) });
        Ok(Backend { ptr, name })
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_t {
        self.ptr.as_ptr()
    }

    /// Wraps a raw backend from an init function (NULL is an error naming `what`).
    #[allow(dead_code)]
    pub(crate) fn from_raw_backend(p: sys::ggml_backend_t, what: &str) -> Result<Backend> {
        Self::from_raw(p, what)
    }

    /// The CPU backend with `threads` worker threads.
    pub fn cpu(threads: usize) -> Result<Backend> {
        // SAFETY: NULL on failure.
        let b = Self::from_raw(unsafe { sys::ggml_backend_cpu_init() }, "CPU")?;
        // SAFETY: b is a CPU backend.
        unsafe { sys::ggml_backend_cpu_set_n_threads(b.raw(), threads.max(1) as i32) };
        Ok(b)
    }

    /// A backend by device name (`CPU`, `CUDA0`, ...).
    pub fn by_name(name: &str) -> Result<Backend> {
        let c = CString::new(name).map_err(|_| GgmlError::NoSuchBackend(name.into()))?;
        // SAFETY: NUL-terminated name; NULL on failure.
        let p = unsafe { sys::ggml_backend_init_by_name(c.as_ptr(), std::ptr::null()) };
        if p.is_null() {
            return Err(GgmlError::NoSuchBackend(name.into()));
        }
        Self::from_raw(p, name)
    }

    /// The backend's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this is the CPU backend.
    pub fn is_cpu(&self) -> bool {
        self.device().is_some_and(|d| d.kind() == DeviceKind::Cpu)
    }

    /// Sets the CPU thread count (no effect on other backends).
    pub fn set_threads(&self, threads: usize) {
        if self.is_cpu() {
            // SAFETY: CPU backend.
            unsafe { sys::ggml_backend_cpu_set_n_threads(self.raw(), threads.max(1) as i32) };
        }
    }

    /// The backend's device.
    pub fn device(&self) -> Option<Device> {
        // SAFETY: live backend.
        NonNull::new(unsafe { sys::ggml_backend_get_device(self.raw()) }).map(|ptr| Device { ptr })
    }

    /// The default buffer type.
    pub fn buffer_type(&self) -> BufferType {
        // SAFETY: live backend.
        BufferType::from_raw(unsafe { sys::ggml_backend_get_default_buffer_type(self.raw()) })
            .expect("backend has a buffer type")
    }

    /// Whether the backend can compute `t`'s op.
    pub fn supports_op(&self, t: &GTensor) -> bool {
        // SAFETY: live backend and descriptor.
        unsafe { sys::ggml_backend_supports_op(self.raw(), t.raw()) }
    }

    /// Whether the backend can use buffers of type `buft`.
    pub fn supports_buffer_type(&self, buft: BufferType) -> bool {
        // SAFETY: live backend and buffer type.
        unsafe { sys::ggml_backend_supports_buft(self.raw(), buft.raw()) }
    }

    /// Computes a graph whose tensors all have memory.
    pub fn compute(&self, graph: &Graph) -> Result<()> {
        self.check_allocated(graph)?;
        // SAFETY: every node and source has memory.
        let status = unsafe { sys::ggml_backend_graph_compute(self.raw(), graph.raw()) };
        self.status(status)
    }

    /// Queues a graph whose tensors all have memory and returns without waiting for it
    /// where the backend queues work (a GPU stream; the CPU backend computes at the call).
    /// The ggml graph and its context may be dropped once this returns.
    ///
    /// # Safety
    /// Until the backend is [synchronised](Self::synchronize) (or an event recorded on it
    /// after this call has completed), the memory of the graph's tensors must stay
    /// allocated, nothing not ordered after the graph on this backend may write it, and
    /// nothing may read what the graph writes.
    pub unsafe fn compute_async(&self, graph: &Graph) -> Result<()> {
        self.check_allocated(graph)?;
        // SAFETY: every node and source has memory; the caller keeps it (see above).
        let status = unsafe { sys::ggml_backend_graph_compute_async(self.raw(), graph.raw()) };
        self.status(status)
    }

    /// Whether [`write_queued`](Self::write_queued) can queue a write into `dst`: the
    /// backend queues copies and `dst` is allocated in a buffer of its type.
    pub fn queues_write(&self, dst: &GTensor) -> bool {
        self.supports_async_set()
            && dst.is_allocated()
            && dst.has_buffer()
            && dst.buffer_type_raw() == self.buffer_type().raw()
    }

    /// Queues a write of `bytes` at the start of `dst` on this backend's queue
    /// (`ggml_backend_tensor_set_async`): it lands after the work queued before it and
    /// before the work queued after it, without the host waiting for either. `dst` must be
    /// in a buffer of this backend's type, contiguous where it is written, and the
    /// backend must queue copies ([`supports_async_set`](Self::supports_async_set)).
    ///
    /// # Safety
    /// `bytes` must stay allocated and unchanged until the backend is
    /// [synchronised](Self::synchronize) (or an event recorded on it after this call has
    /// completed): a GPU may read pinned host memory when the copy runs, not at the call.
    pub unsafe fn write_queued(&self, dst: &GTensor, bytes: &[u8]) -> Result<()> {
        if !dst.is_allocated() || !dst.has_buffer() {
            return Err(GgmlError::NotAllocated { name: dst.name() });
        }
        if bytes.len() > dst.nbytes() {
            return Err(GgmlError::DataMismatch {
                name: dst.name(),
                detail: format!("{} bytes exceed its {} bytes", bytes.len(), dst.nbytes()),
            });
        }
        if dst.buffer_type_raw() != self.buffer_type().raw() || !self.supports_async_set() {
            return Err(GgmlError::Mismatch(format!(
                "backend {} cannot queue a write into '{}'",
                self.name,
                dst.name()
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: live backend and allocated tensor of its buffer type, bounds checked; the
        // caller keeps `bytes` until the copy ran (see above).
        unsafe {
            sys::ggml_backend_tensor_set_async(
                self.raw(),
                dst.raw(),
                bytes.as_ptr().cast(),
                0,
                bytes.len(),
            )
        };
        Ok(())
    }

    fn check_allocated(&self, graph: &Graph) -> Result<()> {
        for t in graph.nodes() {
            if !t.is_allocated() {
                return Err(GgmlError::NotAllocated { name: t.name() });
            }
            for s in t.srcs() {
                if !s.is_allocated() {
                    return Err(GgmlError::NotAllocated { name: s.name() });
                }
            }
        }
        Ok(())
    }

    fn status(&self, status: sys::ggml_status) -> Result<()> {
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::ComputeFailed {
                backend: self.name.clone(),
                status: status_name(status),
            });
        }
        Ok(())
    }

    /// Whether the backend queues host-to-device copies (`ggml_backend_tensor_set_async`
    /// has a backend implementation; without one ggml synchronises and copies).
    pub fn supports_async_set(&self) -> bool {
        // SAFETY: live backend; its interface is immutable.
        unsafe { (*self.raw()).iface.set_tensor_async.is_some() }
    }

    /// Whether the backend and its device implement events: recording, waiting on them
    /// in the backend's queue, creating and synchronising them on the device.
    pub fn supports_events(&self) -> bool {
        // SAFETY: live backend and device; their interfaces are immutable.
        unsafe {
            let b = &*self.raw();
            let dev = b.device;
            b.iface.event_record.is_some()
                && b.iface.event_wait.is_some()
                && !dev.is_null()
                && (*dev).iface.event_new.is_some()
                && (*dev).iface.event_free.is_some()
                && (*dev).iface.event_synchronize.is_some()
        }
    }

    /// Makes the work queued on this backend after this call wait until `event` completes
    /// (on a GPU: in the device's queue, without blocking the host).
    pub fn wait_event(&self, event: &super::stream::Event) -> Result<()> {
        if !self.supports_events() {
            return Err(GgmlError::Mismatch(format!(
                "backend {} has no events",
                self.name
            )));
        }
        // SAFETY: live backend with an `event_wait`; live event.
        unsafe { sys::ggml_backend_event_wait(self.raw(), event.raw()) };
        Ok(())
    }

    /// Waits for queued work.
    pub fn synchronize(&self) {
        // SAFETY: live backend.
        unsafe { sys::ggml_backend_synchronize(self.raw()) }
    }

    /// Copies each `(src, dst)` pair like [`Backend::copy_tensor`], merging runs of pairs
    /// whose sources lie in one host buffer and whose destinations lie in one buffer at the
    /// same relative offsets (as when a staging block mirrors a storage block's layout), each
    /// destination at the first aligned address after the previous one, into one
    /// `ggml_backend_tensor_set` each: on CUDA one `cudaMemcpy` per run instead of one
    /// synchronous copy per tensor. The alignment padding between merged destinations is
    /// overwritten too; it can hold no tensor. Returns the number of copies issued.
    pub fn copy_tensors(pairs: &[(GTensor, GTensor)]) -> Result<usize> {
        let runs = coalesced_runs(pairs);
        for run in &runs {
            match *run {
                CopyRun::One(i) => Self::copy_tensor(&pairs[i].0, &pairs[i].1)?,
                CopyRun::Span { first, len } => {
                    let (s, d) = (&pairs[first].0, &pairs[first].1);
                    with_span(d, len, |span| {
                        // SAFETY: the run lies inside the destination buffer and the source
                        // run in one live host buffer (see `coalesced_runs`).
                        unsafe {
                            sys::ggml_backend_tensor_set(span, s.data_addr() as *const _, 0, len)
                        };
                    })?;
                }
            }
        }
        Ok(runs.len())
    }

    /// Copies `src`'s data into `dst` (same shape and type, any backends).
    pub fn copy_tensor(src: &GTensor, dst: &GTensor) -> Result<()> {
        if !src.is_allocated() {
            return Err(GgmlError::NotAllocated { name: src.name() });
        }
        if !dst.is_allocated() {
            return Err(GgmlError::NotAllocated { name: dst.name() });
        }
        if src.nbytes() != dst.nbytes() || src.dtype() != dst.dtype() || src.ne() != dst.ne() {
            return Err(GgmlError::Mismatch(format!(
                "copy {:?} into {:?}",
                src, dst
            )));
        }
        if !src.has_buffer() || !dst.has_buffer() {
            let bytes = src.read_bytes()?;
            return dst.write_bytes(0, &bytes);
        }
        // SAFETY: both allocated in live buffers, same layout.
        unsafe { sys::ggml_backend_tensor_copy(src.raw(), dst.raw()) };
        Ok(())
    }
}

/// One copy of [`coalesced_runs`]: a pair copied alone, or a run of pairs starting at
/// `first` copied as `len` bytes from the first source's address to the first
/// destination's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyRun {
    /// Pair `i` alone.
    One(usize),
    /// The pairs from `first` on, `len` bytes in one copy.
    Span {
        /// The first pair of the run.
        first: usize,
        /// Bytes of the run (sources back to back, with the destination's padding).
        len: usize,
    },
}

/// Splits `pairs` into the copies [`Backend::copy_tensors`] issues (see there).
pub(crate) fn coalesced_runs(pairs: &[(GTensor, GTensor)]) -> Vec<CopyRun> {
    let mergeable = |s: &GTensor, d: &GTensor| {
        s.is_allocated()
            && d.is_allocated()
            && s.is_host()
            && s.has_buffer()
            && d.has_buffer()
            && s.is_contiguous()
            && d.is_contiguous()
            && s.nbytes() == d.nbytes()
            && s.dtype() == d.dtype()
            && s.ne() == d.ne()
    };
    let mut runs = Vec::new();
    let mut i = 0;
    while i < pairs.len() {
        let (s0, d0) = &pairs[i];
        if !mergeable(s0, d0) {
            runs.push(CopyRun::One(i));
            i += 1;
            continue;
        }
        let (sb, db) = (s0.buffer_raw(), d0.buffer_raw());
        let (s_start, d_start) = (s0.data_addr(), d0.data_addr());
        // SAFETY: live buffer.
        let align = unsafe { sys::ggml_backend_buffer_get_alignment(db) }.max(1);
        let mut end = s_start + s0.nbytes();
        let mut j = i + 1;
        while j < pairs.len() {
            let (s, d) = &pairs[j];
            if !mergeable(s, d) || s.buffer_raw() != sb || d.buffer_raw() != db {
                break;
            }
            let (so, dof) = (s.data_addr(), d.data_addr());
            // Same relative offsets, and in the destination the next tensor sits at the
            // first aligned address after the previous one, so the padding copied in
            // between can hold no other tensor.
            let d_end = d_start + (end - s_start);
            if so < end
                || so - s_start != dof.wrapping_sub(d_start)
                || dof != d_end.next_multiple_of(align)
            {
                break;
            }
            end = so + s.nbytes();
            j += 1;
        }
        if j == i + 1 {
            runs.push(CopyRun::One(i));
        } else {
            runs.push(CopyRun::Span {
                first: i,
                len: end - s_start,
            });
        }
        i = j;
    }
    runs
}

/// Calls `f` with a byte descriptor of `len` bytes placed at `dst`'s address in `dst`'s
/// buffer (the destination of a coalesced run).
pub(crate) fn with_span(
    dst: &GTensor,
    len: usize,
    f: impl FnOnce(*mut sys::ggml_tensor),
) -> Result<()> {
    let ctx = Context::new_descriptors(1, 1, 0)?;
    let span = ctx.new_tensor(crate::DType::I8, &[len])?;
    // SAFETY: the caller's run lies inside the destination buffer (every merged destination
    // does, at the same offsets as in the source run, which ends at the last merged
    // tensor's end).
    let status = unsafe {
        sys::ggml_backend_tensor_alloc(dst.buffer_raw(), span.raw(), dst.data_addr() as *mut _)
    };
    if status != sys::GGML_STATUS_SUCCESS {
        return Err(GgmlError::Mismatch(format!(
            "coalesced copy of {len} bytes: {}",
            status_name(status)
        )));
    }
    f(span.raw());
    Ok(())
}
