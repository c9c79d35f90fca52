//! A simulated discrete device for memory-logic tests.
//!
//! [`SimDevice`] is a real ggml backend implemented in Rust through ggml's backend interface
//! (`ggml-backend-impl.h`): a registry object, a device, a buffer type, buffers and backends
//! whose vtables point at the callbacks of this module. Everything in ggml works with it: the
//! graph allocator, the scheduler, `ggml_backend_tensor_set/get/copy`.
//!
//! It behaves like a discrete GPU of `total_bytes` bytes:
//! - its buffer type is not host memory (`is_host` is false), so ggml moves data in and out
//!   through explicit set/get/copy calls, which the device counts per direction;
//! - every buffer is its own heap allocation (freed when the buffer is freed), and an
//!   allocation that would take the live bytes past `total_bytes` fails with a NULL buffer
//!   (an error in the safe layer, never an abort);
//! - it keeps its own accounting: live bytes, the high-water mark, allocation counts;
//! - it reports free/total memory from its live bytes, optionally lagging behind by a number
//!   of allocation events or wrapped past `total` (as Vulkan's budget underflow does);
//! - its backend computes only on tensors that live in its own buffers (a graph that touches
//!   any other memory fails with a compute error and counts a fault); the arithmetic is done
//!   by an internal ggml CPU backend, since the memory is host memory underneath, so results
//!   are bit-identical to the CPU backend with the same thread count.
//!
//! Lifetimes: the counters and options live in a shared state held by the [`SimDevice`]
//! handle, by every buffer and by every backend made from it, so they outlive all of them.
//! The ggml descriptors (registry object, device, buffer type: a few hundred bytes) stay
//! allocated for the rest of the process, because the safe layer's [`Device`] and
//! [`BufferType`] are plain `Copy` pointers that may be kept anywhere; once the state is gone
//! they report zero memory and refuse allocations and backends. A simulated device is not
//! added to ggml's global registry, so [`Device::all`] does not list it.

#![deny(unsafe_op_in_unsafe_fn)]

use std::alloc::Layout;
use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use ggml_sys as sys;

use super::backend::{Backend, BufferType, Device, DeviceMemory};
use super::error::{GgmlError, Result};
use super::tensor::GTensor;

/// How a [`SimDevice`] behaves beyond its size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Report the device as an integrated GPU (`DeviceKind::IntegratedGpu`) instead of a
    /// discrete one (`DeviceKind::Gpu`). The memory stays separate either way.
    pub integrated: bool,
    /// When `n > 0`, the reported free memory is the value it had `n` allocation/free events
    /// ago (the initial value `total` until `n` events have happened), like a driver whose
    /// reports lag behind. The allocation limit itself always uses the true live bytes.
    pub lagging_reports: usize,
    /// When true, the reported free memory is wrapped past `total` the way an unsigned
    /// `budget - usage` underflow reports it on Vulkan: the device reports
    /// `free - total - 1` computed in `size_t`, that is `usize::MAX - used`, which is always
    /// greater than `total`. Applied after `lagging_reports`.
    pub wrapped_reports: bool,
    /// Alignment of tensor placements in the device's buffers (a power of two).
    pub alignment: usize,
    /// Largest single buffer the device allocates (`None`: only `total_bytes` limits it).
    pub max_buffer_size: Option<usize>,
    /// Threads of the internal CPU backend that does the arithmetic (at least 1).
    pub threads: usize,
    /// Byte that fresh device memory is filled with (`None`: zeroed). A value such as `0xFF`
    /// (f32 NaN) makes reads of never-written memory visible.
    pub fill_byte: Option<u8>,
    /// ggml op names (`ggml_op_name`, e.g. `"MUL_MAT"`, or `ggml_op_desc` for unary ops,
    /// e.g. `"GELU"`) that the device claims not to support, so that the scheduler has to
    /// run them elsewhere.
    pub unsupported_ops: Vec<String>,
    /// Give the device's backends queued host-to-device copies (`set_tensor_async`) and
    /// events, as a GPU's streams have. A queued copy is deferred: it takes effect only
    /// when something orders after it (an event recorded after it is waited on or
    /// synchronised, its backend is synchronised, computes or is freed), so a reader that
    /// is not ordered after an upload sees the memory as it was. The source bytes are read
    /// when the copy is queued.
    ///
    /// A graph computed with `ggml_backend_graph_compute_async` on such a backend is then
    /// *in flight* until the host waits for it (the backend is synchronised, or an event
    /// recorded after it is synchronised), as a GPU's queued kernels are: the arithmetic is
    /// done at the call, but any access that a real device would let race with the graph
    /// counts a fault: the host reading memory the graph writes, the host writing or
    /// freeing memory it reads or writes, or a copy queued on another backend (stream) into
    /// that memory without first waiting on an event recorded after the graph.
    pub async_transfers: bool,
    /// Unit every buffer's memory is charged in (0 or 1: exact sizes): a buffer of `n`
    /// bytes takes `n` rounded up to it from the device, in the live bytes, the peak and
    /// the free memory reports, as `cudaMalloc`'s 2 MiB pages do on a GPU.
    pub allocation_granularity: usize,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            integrated: false,
            lagging_reports: 0,
            wrapped_reports: false,
            alignment: 128,
            max_buffer_size: None,
            threads: 1,
            fill_byte: None,
            unsupported_ops: Vec::new(),
            async_transfers: false,
            allocation_granularity: 0,
        }
    }
}

/// A snapshot of a [`SimDevice`]'s own accounting. Byte counts are exact: a buffer counts
/// the size that was requested for it (rounded up to [`SimOptions::allocation_granularity`]),
/// a transfer the bytes it moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Device size in bytes.
    pub total_bytes: u64,
    /// Bytes held by live buffers now.
    pub live_bytes: u64,
    /// Highest `live_bytes` seen since creation or the last reset.
    pub peak_bytes: u64,
    /// Number of live buffers now.
    pub live_buffers: u64,
    /// Successful buffer allocations.
    pub allocations: u64,
    /// Refused buffer allocations (no room, too large, or failed on purpose).
    pub failed_allocations: u64,
    /// Buffers freed.
    pub frees: u64,
    /// Buffers freed while a graph was in flight ([`SimOptions::async_transfers`]), its
    /// memory or not: a GPU runtime may wait for the device to go idle first (`cudaFree`
    /// does), so each is a stall a queued pipeline should avoid.
    pub frees_in_flight: u64,
    /// Bytes written from host memory into device memory (`tensor_set`).
    pub host_to_device_bytes: u64,
    /// Number of host-to-device transfers.
    pub host_to_device_copies: u64,
    /// Host-to-device copies that were queued (`set_tensor_async` with
    /// [`SimOptions::async_transfers`]); each is also counted in `host_to_device_copies`
    /// when it takes effect.
    pub queued_host_to_device_copies: u64,
    /// Bytes read from device memory into host memory (`tensor_get`).
    pub device_to_host_bytes: u64,
    /// Number of device-to-host transfers.
    pub device_to_host_copies: u64,
    /// Bytes copied between two tensors of this device (`tensor_copy` on the device).
    pub device_to_device_bytes: u64,
    /// Number of device-to-device copies.
    pub device_to_device_copies: u64,
    /// Graphs (or scheduler splits) computed by the device's backends.
    pub graph_computes: u64,
    /// Refused accesses: a transfer outside a buffer, or a graph touching memory that is not
    /// this device's. Zero in a correct program.
    pub faults: u64,
}

// ---------------------------------------------------------------------------------------------
// Shared state
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Counters {
    live: u64,
    peak: u64,
    live_buffers: u64,
    allocations: u64,
    failed_allocations: u64,
    frees: u64,
    frees_in_flight: u64,
    h2d_bytes: u64,
    h2d_copies: u64,
    queued_h2d: u64,
    d2h_bytes: u64,
    d2h_copies: u64,
    d2d_bytes: u64,
    d2d_copies: u64,
    graph_computes: u64,
    faults: u64,
    fail_next: u64,
    /// True free values before the most recent events (oldest first), at most
    /// `lagging_reports` of them.
    history: VecDeque<u64>,
    /// Live buffers' memory: base address -> size (where a queued copy may land).
    regions: std::collections::BTreeMap<usize, usize>,
    /// Graphs computed asynchronously that the host has not waited for yet.
    in_flight: Vec<InFlightGraph>,
    /// (waiting backend, computing backend) -> the computing backend's last graph that the
    /// waiting backend's later work is ordered after (an event wait).
    ordered: std::collections::HashMap<(u64, u64), u64>,
}

/// Device memory `[start, end)`.
type Range = (usize, usize);

/// The memory of a graph in flight ([`SimOptions::async_transfers`]): the ranges its
/// nodes write and its sources read.
struct InFlightGraph {
    backend: u64,
    /// The graph's number on its backend (1, 2, ...).
    seq: u64,
    writes: Vec<Range>,
    reads: Vec<Range>,
}

impl InFlightGraph {
    fn overlaps(ranges: &[Range], start: usize, end: usize) -> bool {
        ranges.iter().any(|&(s, e)| s < end && start < e)
    }

    /// Whether an access to `[start, end)` races with the graph: a read with its writes,
    /// a write with any of its memory.
    fn races(&self, start: usize, end: usize, write: bool) -> bool {
        Self::overlaps(&self.writes, start, end)
            || (write && Self::overlaps(&self.reads, start, end))
    }
}

#[derive(Clone, Copy)]
enum Dir {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// The ggml descriptors of one simulated device. Allocated once and never freed (see the
/// module docs); immutable after construction, so shared references are sound while ggml
/// holds raw pointers into it.
struct Shell {
    reg: sys::ggml_backend_reg,
    dev: sys::ggml_backend_device,
    buft: sys::ggml_backend_buffer_type,
    guid: sys::ggml_guid,
    name: CString,
    description: CString,
    kind: sys::ggml_backend_dev_type,
    alignment: usize,
    max_size: usize,
    cpu_dev: sys::ggml_backend_dev_t,
    state: Weak<State>,
}

struct ShellPtr(#[allow(dead_code)] NonNull<Shell>);
// SAFETY: the pointer is only stored (to keep leaked shells reachable), never dereferenced.
unsafe impl Send for ShellPtr {}

/// Every shell ever made, so that they stay reachable for leak checkers.
fn shells() -> &'static Mutex<Vec<ShellPtr>> {
    static S: OnceLock<Mutex<Vec<ShellPtr>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(Vec::new()))
}

struct State {
    shell: NonNull<Shell>,
    name: String,
    total: u64,
    opts: SimOptions,
    counters: Mutex<Counters>,
}

// SAFETY: `shell` points to an immutable, never-freed descriptor; the counters are behind a
// mutex; everything else is immutable.
unsafe impl Send for State {}
// SAFETY: see above.
unsafe impl Sync for State {}

impl State {
    fn shell(&self) -> &Shell {
        // SAFETY: the shell is never freed and never written after construction.
        unsafe { self.shell.as_ref() }
    }

    fn buft_ptr(&self) -> sys::ggml_backend_buffer_type_t {
        // SAFETY: field address inside the live shell (no reference is created).
        unsafe { ptr::addr_of_mut!((*self.shell.as_ptr()).buft) }
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Free and total memory as the device reports them (lag and wrap applied).
    fn reported_memory(&self) -> (usize, usize) {
        let c = self.counters();
        let true_free = self.total - c.live;
        let free = if self.opts.lagging_reports > 0 {
            c.history.front().copied().unwrap_or(true_free)
        } else {
            true_free
        };
        let total = self.total as usize;
        let free = if self.opts.wrapped_reports {
            (free as usize).wrapping_sub(total).wrapping_sub(1)
        } else {
            free as usize
        };
        (free, total)
    }

    /// Records a change of the live bytes (one allocation/free event).
    fn set_live(&self, c: &mut Counters, live: u64) {
        let lag = self.opts.lagging_reports;
        if lag > 0 {
            c.history.push_back(self.total - c.live);
            while c.history.len() > lag {
                c.history.pop_front();
            }
        }
        c.live = live;
        c.peak = c.peak.max(live);
    }

    fn count(&self, dir: Dir, bytes: usize) {
        let mut c = self.counters();
        let b = bytes as u64;
        match dir {
            Dir::HostToDevice => {
                c.h2d_bytes += b;
                c.h2d_copies += 1;
            }
            Dir::DeviceToHost => {
                c.d2h_bytes += b;
                c.d2h_copies += 1;
            }
            Dir::DeviceToDevice => {
                c.d2d_bytes += b;
                c.d2d_copies += 1;
            }
        }
    }

    fn fault(&self, what: std::fmt::Arguments<'_>) {
        tracing::error!(device = %self.name, "simulated device fault: {what}");
        self.counters().faults += 1;
    }

    /// Checks a host access (not queued on a backend) to device memory `[start, start +
    /// len)` against the graphs in flight: a fault when one races with it.
    fn check_host_access(&self, start: usize, len: usize, write: bool, what: &str) {
        if len == 0 {
            return;
        }
        let racing = self
            .counters()
            .in_flight
            .iter()
            .any(|g| g.races(start, start + len, write));
        if racing {
            self.fault(format_args!(
                "{what} of {len} bytes races with a graph still in flight (the host did not wait for it)"
            ));
        }
    }

    /// Forgets the graphs in flight on `backend` up to its graph `seq` (the host waited).
    fn graphs_done(&self, backend: u64, seq: u64) {
        self.counters()
            .in_flight
            .retain(|g| g.backend != backend || g.seq > seq);
    }

    /// Allocates a buffer of `size` bytes, or returns NULL when the device has no room.
    fn alloc_buffer(
        self: &Arc<Self>,
        buft: sys::ggml_backend_buffer_type_t,
        size: usize,
    ) -> sys::ggml_backend_buffer_t {
        let mut c = self.counters();
        if c.fail_next > 0 {
            c.fail_next -= 1;
            c.failed_allocations += 1;
            tracing::debug!(device = %self.name, size, "simulated allocation failure (on request)");
            return ptr::null_mut();
        }
        let room = self.total - c.live;
        if self.charged(size) > room || size > self.shell().max_size {
            c.failed_allocations += 1;
            tracing::debug!(device = %self.name, size, room, "simulated device out of memory");
            return ptr::null_mut();
        }
        let Ok(layout) = Layout::from_size_align(size.max(1), self.shell().alignment) else {
            c.failed_allocations += 1;
            return ptr::null_mut();
        };
        // SAFETY: the layout has a non-zero size.
        let mem = unsafe {
            match self.opts.fill_byte {
                None => std::alloc::alloc_zeroed(layout),
                Some(v) => {
                    let p = std::alloc::alloc(layout);
                    if !p.is_null() {
                        ptr::write_bytes(p, v, layout.size());
                    }
                    p
                }
            }
        };
        let Some(base) = NonNull::new(mem) else {
            c.failed_allocations += 1;
            return ptr::null_mut();
        };
        let ctx = Box::into_raw(Box::new(SimBuffer {
            state: Arc::clone(self),
            base,
            layout,
            size,
        }));
        // SAFETY: `buft` is this device's buffer type; ggml copies the interface and keeps
        // `ctx`, which `buffer_free` reclaims.
        let buf = unsafe { sys::ggml_backend_buffer_init(buft, BUFFER_IFACE, ctx.cast(), size) };
        if buf.is_null() {
            // SAFETY: ggml did not take `ctx`; it and the memory are still ours.
            unsafe {
                drop(Box::from_raw(ctx));
                std::alloc::dealloc(base.as_ptr(), layout);
            }
            c.failed_allocations += 1;
            return ptr::null_mut();
        }
        let live = c.live + self.charged(size);
        tracing::trace!(device = %self.name, size, live, "simulated allocation");
        self.set_live(&mut c, live);
        c.regions.insert(base.as_ptr() as usize, size);
        c.allocations += 1;
        c.live_buffers += 1;
        buf
    }

    /// Device bytes a buffer of `size` bytes takes (see [`SimOptions::allocation_granularity`]).
    fn charged(&self, size: usize) -> u64 {
        let g = self.opts.allocation_granularity.max(1) as u64;
        (size as u64).div_ceil(g) * g
    }

    /// Counts the free of the buffer at `base`; `release` frees its memory while the
    /// counters are locked (so that no queued copy lands in it meanwhile).
    fn on_free(&self, base: usize, size: usize, release: impl FnOnce()) {
        let mut c = self.counters();
        c.regions.remove(&base);
        release();
        let live = c.live.saturating_sub(self.charged(size));
        self.set_live(&mut c, live);
        c.frees += 1;
        if !c.in_flight.is_empty() {
            c.frees_in_flight += 1;
        }
        c.live_buffers = c.live_buffers.saturating_sub(1);
    }

    /// Whether `t`'s data lies inside one of this device's buffers.
    ///
    /// # Safety
    /// `t` is null or points to a live tensor whose `buffer`/`view_src` are null or live.
    unsafe fn is_resident(&self, t: *const sys::ggml_tensor) -> bool {
        if t.is_null() {
            return false;
        }
        // SAFETY: live tensor (caller contract).
        let tr = unsafe { &*t };
        let buf = if tr.view_src.is_null() {
            tr.buffer
        } else {
            // SAFETY: a view's source is a live tensor.
            unsafe { (*tr.view_src).buffer }
        };
        // SAFETY: live buffer or null.
        if buf.is_null() || unsafe { (*buf).buft } != self.buft_ptr() {
            return false;
        }
        // SAFETY: live buffer.
        let Some(b) = (unsafe { sim_buffer(buf) }) else {
            return false;
        };
        // SAFETY: live tensor.
        let n = unsafe { sys::ggml_nbytes(t) };
        b.region(tr.data, 0, n).is_some()
    }
}

/// The context of one device buffer: its own heap allocation.
struct SimBuffer {
    state: Arc<State>,
    base: NonNull<u8>,
    layout: Layout,
    size: usize,
}

impl SimBuffer {
    /// The device address of `data + offset .. + size` if it lies inside this buffer,
    /// derived from the buffer's own allocation.
    fn region(&self, data: *const c_void, offset: usize, size: usize) -> Option<*mut u8> {
        if data.is_null() {
            return None;
        }
        let base = self.base.as_ptr() as usize;
        let start = (data as usize).checked_add(offset)?;
        let end = start.checked_add(size)?;
        if start < base || end > base.checked_add(self.size)? {
            return None;
        }
        Some(self.base.as_ptr().wrapping_add(start - base))
    }
}

/// The context of one backend (stream) on the device.
struct SimBackend {
    state: Arc<State>,
    cpu: NonNull<sys::ggml_backend>,
    lock: Mutex<()>,
    /// Copies queued on this backend (stream), in order.
    queue: Arc<Mutex<CopyQueue>>,
    /// A number unique among the process's simulated backends.
    id: u64,
    /// Graphs computed so far (the last one's number).
    graphs: std::sync::atomic::AtomicU64,
}

/// The next [`SimBackend::id`].
fn next_backend_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A backend's queued copies ([`SimOptions::async_transfers`]).
#[derive(Default)]
struct CopyQueue {
    /// Not yet done: (sequence number, destination address, source bytes).
    pending: VecDeque<(u64, usize, Vec<u8>)>,
    /// Copies queued so far (the next sequence number).
    queued: u64,
}

impl CopyQueue {
    /// Makes the copies queued before sequence number `until` take effect.
    fn run_until(&mut self, state: &State, until: u64) {
        while self.pending.front().is_some_and(|(seq, _, _)| *seq < until) {
            let Some((_, dst, bytes)) = self.pending.pop_front() else {
                break;
            };
            let mut c = state.counters();
            let inside = c
                .regions
                .range(..=dst)
                .next_back()
                .is_some_and(|(base, size)| dst + bytes.len() <= base + size);
            if !inside {
                drop(c);
                state.fault(format_args!(
                    "queued copy of {} bytes into memory that is no longer allocated",
                    bytes.len()
                ));
                continue;
            }
            // SAFETY: the destination lies inside a live buffer of this device, which
            // cannot be freed while the counters are locked (see `State::on_free`).
            unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len()) };
            c.h2d_bytes += bytes.len() as u64;
            c.h2d_copies += 1;
        }
    }

    /// Makes every queued copy take effect.
    fn run_all(&mut self, state: &State) {
        let until = self.queued;
        self.run_until(state, until);
    }
}

/// Where an event was last recorded: a backend's copy queue and sequence number, and the
/// backend's last graph at that time.
#[derive(Clone)]
struct Recorded {
    queue: Arc<Mutex<CopyQueue>>,
    seq: u64,
    backend: u64,
    graph: u64,
}

/// The context of one event.
struct SimEvent {
    state: Arc<State>,
    recorded: Mutex<Option<Recorded>>,
}

impl SimEvent {
    fn recorded(&self) -> Option<Recorded> {
        self.recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes the copies queued before the record take effect; returns the record.
    fn complete(&self) -> Option<Recorded> {
        let r = self.recorded()?;
        r.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .run_until(&self.state, r.seq);
        Some(r)
    }
}

// ---------------------------------------------------------------------------------------------
// Public handle
// ---------------------------------------------------------------------------------------------

/// A simulated discrete device of a fixed size (see the module docs). Cloning is cheap and
/// shares the device.
#[derive(Clone)]
pub struct SimDevice {
    state: Arc<State>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.stats();
        write!(
            f,
            "SimDevice({}, {} of {} bytes live, peak {})",
            self.state.name, s.live_bytes, s.total_bytes, s.peak_bytes
        )
    }
}

const SIM_GUID: sys::ggml_guid = [
    0x73, 0x64, 0x2d, 0x72, 0x73, 0x2d, 0x73, 0x69, 0x6d, 0x64, 0x65, 0x76, 0x00, 0x00, 0x00, 0x01,
];

impl SimDevice {
    /// A device named `name` (for example `SIM0`) with `total_bytes` of memory.
    pub fn new(name: &str, total_bytes: u64, options: SimOptions) -> Result<SimDevice> {
        let bad =
            |detail: String| GgmlError::BackendInit(format!("simulated device '{name}': {detail}"));
        let cname = CString::new(name).map_err(|_| bad("the name contains NUL".into()))?;
        if name.is_empty() {
            return Err(bad("empty name".into()));
        }
        if total_bytes > (isize::MAX as u64) / 2 {
            return Err(bad(format!("{total_bytes} bytes is too large")));
        }
        if !options.alignment.is_power_of_two() {
            return Err(bad(format!(
                "alignment {} is not a power of two",
                options.alignment
            )));
        }
        let kind = if options.integrated {
            sys::GGML_BACKEND_DEVICE_TYPE_IGPU
        } else {
            sys::GGML_BACKEND_DEVICE_TYPE_GPU
        };
        let description = CString::new(format!(
            "simulated {} GPU, {total_bytes} bytes",
            if options.integrated {
                "integrated"
            } else {
                "discrete"
            }
        ))
        .map_err(|_| bad("description".into()))?;
        // SAFETY: registry query; the CPU device is static.
        let cpu_dev = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        if cpu_dev.is_null() {
            return Err(GgmlError::NoSuchBackend("CPU".into()));
        }
        let max_size = options.max_buffer_size.unwrap_or(usize::MAX);
        let alignment = options.alignment;
        let async_transfers = options.async_transfers;
        let state = Arc::new_cyclic(|weak: &Weak<State>| {
            let shell = NonNull::from(Box::leak(Box::new(Shell {
                reg: sys::ggml_backend_reg::default(),
                dev: sys::ggml_backend_device::default(),
                buft: sys::ggml_backend_buffer_type::default(),
                guid: SIM_GUID,
                name: cname,
                description,
                kind,
                alignment,
                max_size,
                cpu_dev,
                state: weak.clone(),
            })));
            let p = shell.as_ptr();
            // SAFETY: `p` is a fresh, exclusively owned allocation; the descriptors point at
            // each other and at the shell, which is never freed.
            unsafe {
                (*p).reg = sys::ggml_backend_reg {
                    api_version: sys::GGML_BACKEND_API_VERSION as i32,
                    iface: REG_IFACE,
                    context: p.cast(),
                };
                (*p).dev = sys::ggml_backend_device {
                    iface: if async_transfers {
                        DEVICE_IFACE_ASYNC
                    } else {
                        DEVICE_IFACE
                    },
                    reg: ptr::addr_of_mut!((*p).reg),
                    context: p.cast(),
                };
                (*p).buft = sys::ggml_backend_buffer_type {
                    iface: BUFT_IFACE,
                    device: ptr::addr_of_mut!((*p).dev),
                    context: p.cast(),
                };
            }
            State {
                shell,
                name: name.to_string(),
                total: total_bytes,
                opts: options,
                counters: Mutex::new(Counters::default()),
            }
        });
        shells()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ShellPtr(state.shell));
        Ok(SimDevice { state })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// The device size in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.state.total
    }

    /// The options the device was made with.
    pub fn options(&self) -> &SimOptions {
        &self.state.opts
    }

    /// The device's buffer type (non-host memory of this device).
    pub fn buffer_type(&self) -> BufferType {
        BufferType::from_raw(self.state.buft_ptr()).expect("the shell's buffer type is not null")
    }

    /// The device as a ggml device (kind, memory reports, buffer type, backends).
    pub fn device(&self) -> Device {
        self.buffer_type()
            .device()
            .expect("the simulated buffer type has a device")
    }

    /// A new backend (stream) on this device, computing with its own internal CPU backend.
    pub fn backend(&self) -> Result<Backend> {
        self.device().init_backend()
    }

    /// Free and total memory as the device reports them to ggml (lag and wrap applied).
    pub fn memory(&self) -> DeviceMemory {
        self.device().memory()
    }

    /// The device's own accounting now.
    pub fn stats(&self) -> SimStats {
        let c = self.state.counters();
        SimStats {
            total_bytes: self.state.total,
            live_bytes: c.live,
            peak_bytes: c.peak,
            live_buffers: c.live_buffers,
            allocations: c.allocations,
            failed_allocations: c.failed_allocations,
            frees: c.frees,
            frees_in_flight: c.frees_in_flight,
            host_to_device_bytes: c.h2d_bytes,
            host_to_device_copies: c.h2d_copies,
            queued_host_to_device_copies: c.queued_h2d,
            device_to_host_bytes: c.d2h_bytes,
            device_to_host_copies: c.d2h_copies,
            device_to_device_bytes: c.d2d_bytes,
            device_to_device_copies: c.d2d_copies,
            graph_computes: c.graph_computes,
            faults: c.faults,
        }
    }

    /// Bytes held by live buffers now.
    pub fn live_bytes(&self) -> u64 {
        self.state.counters().live
    }

    /// The high-water mark of live bytes since creation or the last reset.
    pub fn peak_bytes(&self) -> u64 {
        self.state.counters().peak
    }

    /// Restarts the high-water mark from the current live bytes.
    pub fn reset_peak(&self) {
        let mut c = self.state.counters();
        c.peak = c.live;
    }

    /// Zeroes the event counters (allocations, frees, transfers, computes, faults) and
    /// restarts the high-water mark; live bytes and buffers are kept.
    pub fn reset_counters(&self) {
        let mut c = self.state.counters();
        let keep = Counters {
            live: c.live,
            peak: c.live,
            live_buffers: c.live_buffers,
            fail_next: c.fail_next,
            history: std::mem::take(&mut c.history),
            regions: std::mem::take(&mut c.regions),
            in_flight: std::mem::take(&mut c.in_flight),
            ordered: std::mem::take(&mut c.ordered),
            ..Counters::default()
        };
        *c = keep;
    }

    /// Makes the next `n` buffer allocations fail whatever room is left.
    pub fn fail_next_allocations(&self, n: u64) {
        self.state.counters().fail_next = n;
    }

    /// Whether `buft` is this device's buffer type.
    pub fn owns_buffer_type(&self, buft: BufferType) -> bool {
        buft.raw() == self.state.buft_ptr()
    }

    /// Whether `t`'s data lives in this device's memory.
    pub fn owns_tensor(&self, t: &GTensor) -> bool {
        // SAFETY: a live descriptor whose buffer fields are reset when the memory goes.
        unsafe { self.state.is_resident(t.raw()) }
    }
}

// ---------------------------------------------------------------------------------------------
// Vtables
// ---------------------------------------------------------------------------------------------

/// Runs `f`, returning `default` instead of unwinding into C.
fn ffi<T>(default: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}

/// The shell behind a descriptor's `context`.
///
/// # Safety
/// `ctx` is null or the context of one of this module's descriptors.
unsafe fn shell_at(ctx: *mut c_void) -> Option<&'static Shell> {
    // SAFETY: contexts of our descriptors point at a never-freed shell.
    unsafe { (ctx as *const Shell).as_ref() }
}

/// # Safety
/// `dev` is null or one of this module's devices.
unsafe fn dev_shell(dev: sys::ggml_backend_dev_t) -> Option<&'static Shell> {
    if dev.is_null() {
        return None;
    }
    // SAFETY: live device of this module.
    unsafe { shell_at((*dev).context) }
}

/// # Safety
/// `buft` is null or this module's buffer type.
unsafe fn buft_shell(buft: sys::ggml_backend_buffer_type_t) -> Option<&'static Shell> {
    if buft.is_null() {
        return None;
    }
    // SAFETY: live buffer type of this module.
    unsafe { shell_at((*buft).context) }
}

/// The SimBuffer behind `buffer`, if it is a buffer made by `alloc_buffer`. Buffers of the
/// simulated buffer type that ggml makes itself (zero-size dummies, multi-buffers wrapping
/// several device buffers) have other interfaces and contexts and yield `None`.
///
/// # Safety
/// `buffer` is null or a live buffer.
unsafe fn sim_buffer<'a>(buffer: sys::ggml_backend_buffer_t) -> Option<&'a SimBuffer> {
    if buffer.is_null() {
        return None;
    }
    let ours: unsafe extern "C" fn(sys::ggml_backend_buffer_t) = buffer_free;
    // SAFETY: live buffer.
    let free = unsafe { (*buffer).iface.free_buffer };
    if !free.is_some_and(|f| ptr::fn_addr_eq(f, ours)) {
        return None;
    }
    // SAFETY: a buffer with this module's interface has a `SimBuffer` context (or null once
    // freed).
    unsafe { ((*buffer).context as *const SimBuffer).as_ref() }
}

// ---- registry ----

const REG_IFACE: sys::ggml_backend_reg_i = sys::ggml_backend_reg_i {
    get_name: Some(reg_get_name),
    get_device_count: Some(reg_get_device_count),
    get_device: Some(reg_get_device),
    get_proc_address: None,
};

unsafe extern "C" fn reg_get_name(_reg: sys::ggml_backend_reg_t) -> *const c_char {
    c"SIM".as_ptr()
}

unsafe extern "C" fn reg_get_device_count(_reg: sys::ggml_backend_reg_t) -> usize {
    1
}

unsafe extern "C" fn reg_get_device(
    reg: sys::ggml_backend_reg_t,
    index: usize,
) -> sys::ggml_backend_dev_t {
    if reg.is_null() || index != 0 {
        return ptr::null_mut();
    }
    // SAFETY: our registry object; its context is the shell, whose device we return by
    // address.
    unsafe {
        let shell = (*reg).context as *mut Shell;
        if shell.is_null() {
            return ptr::null_mut();
        }
        ptr::addr_of_mut!((*shell).dev)
    }
}

// ---- device ----

const DEVICE_IFACE: sys::ggml_backend_device_i = sys::ggml_backend_device_i {
    get_name: Some(dev_get_name),
    get_description: Some(dev_get_description),
    get_memory: Some(dev_get_memory),
    get_type: Some(dev_get_type),
    get_props: Some(dev_get_props),
    init_backend: Some(dev_init_backend),
    get_buffer_type: Some(dev_get_buffer_type),
    get_host_buffer_type: None,
    buffer_from_host_ptr: None,
    supports_op: Some(dev_supports_op),
    supports_buft: Some(dev_supports_buft),
    offload_op: None,
    event_new: None,
    event_free: None,
    event_synchronize: None,
};

/// [`DEVICE_IFACE`] with events ([`SimOptions::async_transfers`]).
const DEVICE_IFACE_ASYNC: sys::ggml_backend_device_i = sys::ggml_backend_device_i {
    event_new: Some(dev_event_new),
    event_free: Some(dev_event_free),
    event_synchronize: Some(dev_event_synchronize),
    ..DEVICE_IFACE
};

unsafe extern "C" fn dev_event_new(dev: sys::ggml_backend_dev_t) -> sys::ggml_backend_event_t {
    ffi(ptr::null_mut(), || {
        // SAFETY: ggml passes our device.
        let Some(state) = (unsafe { dev_shell(dev) }).and_then(|s| s.state.upgrade()) else {
            return ptr::null_mut();
        };
        let ctx = Box::into_raw(Box::new(SimEvent {
            state,
            recorded: Mutex::new(None),
        }));
        // The event and its context are reclaimed by `dev_event_free`.
        Box::into_raw(Box::new(sys::ggml_backend_event {
            device: dev,
            context: ctx.cast(),
        }))
    })
}

unsafe extern "C" fn dev_event_free(
    _dev: sys::ggml_backend_dev_t,
    event: sys::ggml_backend_event_t,
) {
    if event.is_null() {
        return;
    }
    ffi((), || {
        // SAFETY: ggml frees each event once; both boxes were made by `dev_event_new`.
        unsafe {
            let ctx = (*event).context as *mut SimEvent;
            if !ctx.is_null() {
                drop(Box::from_raw(ctx));
            }
            drop(Box::from_raw(event));
        }
    })
}

/// The SimEvent of `event`.
///
/// # Safety
/// `event` is null or an event made by `dev_event_new`, not yet freed.
unsafe fn sim_event<'a>(event: sys::ggml_backend_event_t) -> Option<&'a SimEvent> {
    if event.is_null() {
        return None;
    }
    // SAFETY: see above.
    unsafe { ((*event).context as *const SimEvent).as_ref() }
}

unsafe extern "C" fn dev_event_synchronize(
    _dev: sys::ggml_backend_dev_t,
    event: sys::ggml_backend_event_t,
) {
    ffi((), || {
        // SAFETY: ggml passes one of our events.
        if let Some(e) = unsafe { sim_event(event) } {
            // The host waited: the graphs recorded before the event are done too.
            if let Some(r) = e.complete() {
                e.state.graphs_done(r.backend, r.graph);
            }
        }
    })
}

unsafe extern "C" fn dev_get_name(dev: sys::ggml_backend_dev_t) -> *const c_char {
    // SAFETY: ggml passes our device.
    match unsafe { dev_shell(dev) } {
        Some(s) => s.name.as_ptr(),
        None => c"SIM?".as_ptr(),
    }
}

unsafe extern "C" fn dev_get_description(dev: sys::ggml_backend_dev_t) -> *const c_char {
    // SAFETY: ggml passes our device.
    match unsafe { dev_shell(dev) } {
        Some(s) => s.description.as_ptr(),
        None => c"simulated device".as_ptr(),
    }
}

/// (free, total) as reported; zeros once the device state is gone.
fn reported(shell: Option<&Shell>) -> (usize, usize) {
    shell
        .and_then(|s| s.state.upgrade())
        .map(|st| st.reported_memory())
        .unwrap_or((0, 0))
}

unsafe extern "C" fn dev_get_memory(
    dev: sys::ggml_backend_dev_t,
    free: *mut usize,
    total: *mut usize,
) {
    // SAFETY: ggml passes our device.
    let (f, t) = ffi((0, 0), || reported(unsafe { dev_shell(dev) }));
    // SAFETY: non-null out pointers from the caller.
    unsafe {
        if !free.is_null() {
            *free = f;
        }
        if !total.is_null() {
            *total = t;
        }
    }
}

unsafe extern "C" fn dev_get_type(dev: sys::ggml_backend_dev_t) -> sys::ggml_backend_dev_type {
    // SAFETY: ggml passes our device.
    unsafe { dev_shell(dev) }.map_or(sys::GGML_BACKEND_DEVICE_TYPE_GPU, |s| s.kind)
}

unsafe extern "C" fn dev_get_props(
    dev: sys::ggml_backend_dev_t,
    props: *mut sys::ggml_backend_dev_props,
) {
    if props.is_null() {
        return;
    }
    // SAFETY: ggml passes our device.
    let shell = unsafe { dev_shell(dev) };
    let (free, total) = ffi((0, 0), || reported(shell));
    let queues = shell
        .and_then(|s| s.state.upgrade())
        .is_some_and(|st| st.opts.async_transfers);
    // SAFETY: `props` is a valid out pointer; the strings live in the never-freed shell.
    unsafe {
        *props = sys::ggml_backend_dev_props {
            name: dev_get_name(dev),
            description: dev_get_description(dev),
            memory_free: free,
            memory_total: total,
            type_: dev_get_type(dev),
            device_id: ptr::null(),
            caps: sys::ggml_backend_dev_caps {
                async_: queues,
                host_buffer: false,
                buffer_from_host_ptr: false,
                events: queues,
                mmap_support: false,
            },
        };
    }
}

unsafe extern "C" fn dev_init_backend(
    dev: sys::ggml_backend_dev_t,
    _params: *const c_char,
) -> sys::ggml_backend_t {
    ffi(ptr::null_mut(), || {
        // SAFETY: ggml passes our device.
        let Some(shell) = (unsafe { dev_shell(dev) }) else {
            return ptr::null_mut();
        };
        let Some(state) = shell.state.upgrade() else {
            return ptr::null_mut();
        };
        // SAFETY: plain constructor; NULL on failure.
        let Some(cpu) = NonNull::new(unsafe { sys::ggml_backend_cpu_init() }) else {
            return ptr::null_mut();
        };
        let threads = state.opts.threads.clamp(1, i32::MAX as usize) as i32;
        // SAFETY: `cpu` is a CPU backend.
        unsafe { sys::ggml_backend_cpu_set_n_threads(cpu.as_ptr(), threads) };
        let iface = if state.opts.async_transfers {
            BACKEND_IFACE_ASYNC
        } else {
            BACKEND_IFACE
        };
        let ctx = Box::into_raw(Box::new(SimBackend {
            state,
            cpu,
            lock: Mutex::new(()),
            queue: Arc::default(),
            id: next_backend_id(),
            graphs: Default::default(),
        }));
        // SAFETY: `dev` is our device, whose context is the never-freed shell; the guid
        // lives in it. The backend struct and `ctx` are reclaimed by `backend_free`.
        unsafe {
            let shell_ptr = (*dev).context as *mut Shell;
            Box::into_raw(Box::new(sys::ggml_backend {
                guid: ptr::addr_of_mut!((*shell_ptr).guid),
                iface,
                device: dev,
                context: ctx.cast(),
            }))
        }
    })
}

unsafe extern "C" fn dev_get_buffer_type(
    dev: sys::ggml_backend_dev_t,
) -> sys::ggml_backend_buffer_type_t {
    if dev.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: our device; its context is the shell, whose buffer type we return by address.
    unsafe {
        let shell = (*dev).context as *mut Shell;
        if shell.is_null() {
            return ptr::null_mut();
        }
        ptr::addr_of_mut!((*shell).buft)
    }
}

unsafe extern "C" fn dev_supports_op(
    dev: sys::ggml_backend_dev_t,
    op: *const sys::ggml_tensor,
) -> bool {
    ffi(false, || {
        // SAFETY: ggml passes our device.
        let Some(shell) = (unsafe { dev_shell(dev) }) else {
            return false;
        };
        if op.is_null() {
            return false;
        }
        if let Some(state) = shell.state.upgrade() {
            if !state.opts.unsupported_ops.is_empty() {
                // SAFETY: live tensor; ggml returns static strings.
                let (name, desc) = unsafe {
                    (
                        CStr::from_ptr(sys::ggml_op_name((*op).op)),
                        CStr::from_ptr(sys::ggml_op_desc(op)),
                    )
                };
                let (name, desc) = (name.to_string_lossy(), desc.to_string_lossy());
                if state
                    .opts
                    .unsupported_ops
                    .iter()
                    .any(|u| u.eq_ignore_ascii_case(&name) || u.eq_ignore_ascii_case(&desc))
                {
                    return false;
                }
            }
        }
        // SAFETY: the CPU device is static; the op is a live tensor.
        unsafe { sys::ggml_backend_dev_supports_op(shell.cpu_dev, op) }
    })
}

unsafe extern "C" fn dev_supports_buft(
    dev: sys::ggml_backend_dev_t,
    buft: sys::ggml_backend_buffer_type_t,
) -> bool {
    // SAFETY: `dev_get_buffer_type` only computes a field address of our shell.
    !buft.is_null() && unsafe { dev_get_buffer_type(dev) } == buft
}

// ---- buffer type ----

const BUFT_IFACE: sys::ggml_backend_buffer_type_i = sys::ggml_backend_buffer_type_i {
    get_name: Some(buft_get_name),
    alloc_buffer: Some(buft_alloc_buffer),
    alloc_buffer_n: None,
    get_alignment: Some(buft_get_alignment),
    get_max_size: Some(buft_get_max_size),
    get_alloc_size: None,
    get_alloc_size_n: None,
    is_host: Some(buft_is_host),
};

unsafe extern "C" fn buft_get_name(buft: sys::ggml_backend_buffer_type_t) -> *const c_char {
    // SAFETY: ggml passes our buffer type.
    match unsafe { buft_shell(buft) } {
        Some(s) => s.name.as_ptr(),
        None => c"SIM?".as_ptr(),
    }
}

unsafe extern "C" fn buft_alloc_buffer(
    buft: sys::ggml_backend_buffer_type_t,
    size: usize,
) -> sys::ggml_backend_buffer_t {
    ffi(ptr::null_mut(), || {
        // SAFETY: ggml passes our buffer type.
        let Some(shell) = (unsafe { buft_shell(buft) }) else {
            return ptr::null_mut();
        };
        match shell.state.upgrade() {
            Some(state) => state.alloc_buffer(buft, size),
            None => ptr::null_mut(),
        }
    })
}

unsafe extern "C" fn buft_get_alignment(buft: sys::ggml_backend_buffer_type_t) -> usize {
    // SAFETY: ggml passes our buffer type.
    unsafe { buft_shell(buft) }.map_or(128, |s| s.alignment)
}

unsafe extern "C" fn buft_get_max_size(buft: sys::ggml_backend_buffer_type_t) -> usize {
    // SAFETY: ggml passes our buffer type.
    unsafe { buft_shell(buft) }.map_or(0, |s| s.max_size)
}

unsafe extern "C" fn buft_is_host(_buft: sys::ggml_backend_buffer_type_t) -> bool {
    false
}

// ---- buffer ----

const BUFFER_IFACE: sys::ggml_backend_buffer_i = sys::ggml_backend_buffer_i {
    free_buffer: Some(buffer_free),
    get_base: Some(buffer_get_base),
    init_tensor: None,
    memset_tensor: Some(buffer_memset_tensor),
    set_tensor: Some(buffer_set_tensor),
    get_tensor: Some(buffer_get_tensor),
    set_tensor_2d: None,
    get_tensor_2d: None,
    cpy_tensor: Some(buffer_cpy_tensor),
    clear: Some(buffer_clear),
    reset: None,
};

unsafe extern "C" fn buffer_free(buffer: sys::ggml_backend_buffer_t) {
    if buffer.is_null() {
        return;
    }
    ffi((), || {
        // SAFETY: ggml frees each buffer once; the context is the SimBuffer made by
        // `alloc_buffer`, reclaimed here exactly once (and cleared against reuse).
        let ctx = unsafe {
            let ctx = (*buffer).context as *mut SimBuffer;
            (*buffer).context = ptr::null_mut();
            ctx
        };
        if ctx.is_null() {
            return;
        }
        // SAFETY: see above.
        let b = unsafe { Box::from_raw(ctx) };
        b.state
            .check_host_access(b.base.as_ptr() as usize, b.size, true, "freeing a buffer");
        // SAFETY: the memory was allocated with this layout and is no longer referenced by
        // ggml (the buffer is being freed).
        b.state
            .on_free(b.base.as_ptr() as usize, b.size, || unsafe {
                std::alloc::dealloc(b.base.as_ptr(), b.layout)
            });
    })
}

unsafe extern "C" fn buffer_get_base(buffer: sys::ggml_backend_buffer_t) -> *mut c_void {
    // SAFETY: ggml passes our buffer.
    unsafe { sim_buffer(buffer) }.map_or(ptr::null_mut(), |b| b.base.as_ptr().cast())
}

unsafe extern "C" fn buffer_memset_tensor(
    buffer: sys::ggml_backend_buffer_t,
    tensor: *mut sys::ggml_tensor,
    value: u8,
    offset: usize,
    size: usize,
) {
    ffi((), || {
        // SAFETY: ggml passes our buffer.
        let Some(b) = (unsafe { sim_buffer(buffer) }) else {
            return;
        };
        if tensor.is_null() {
            return b.state.fault(format_args!("memset of a null tensor"));
        }
        // SAFETY: live tensor.
        let data = unsafe { (*tensor).data };
        match b.region(data, offset, size) {
            Some(dst) => {
                b.state
                    .check_host_access(dst as usize, size, true, "memset_tensor");
                // SAFETY: the region lies inside the buffer's allocation.
                unsafe { ptr::write_bytes(dst, value, size) }
            }
            None => b
                .state
                .fault(format_args!("memset of {size} bytes outside the buffer")),
        }
    })
}

unsafe extern "C" fn buffer_set_tensor(
    buffer: sys::ggml_backend_buffer_t,
    tensor: *mut sys::ggml_tensor,
    data: *const c_void,
    offset: usize,
    size: usize,
) {
    ffi((), || {
        // SAFETY: ggml passes our buffer.
        let Some(b) = (unsafe { sim_buffer(buffer) }) else {
            return;
        };
        if tensor.is_null() || data.is_null() {
            return b
                .state
                .fault(format_args!("tensor_set with a null pointer"));
        }
        // SAFETY: live tensor.
        let tdata = unsafe { (*tensor).data };
        match b.region(tdata, offset, size) {
            Some(dst) => {
                b.state
                    .check_host_access(dst as usize, size, true, "tensor_set");
                // SAFETY: `data` holds `size` readable bytes (caller contract); `dst` lies
                // inside the buffer. `copy` tolerates overlap.
                unsafe { ptr::copy(data.cast::<u8>(), dst, size) };
                b.state.count(Dir::HostToDevice, size);
            }
            None => b.state.fault(format_args!(
                "tensor_set of {size} bytes outside the buffer"
            )),
        }
    })
}

unsafe extern "C" fn buffer_get_tensor(
    buffer: sys::ggml_backend_buffer_t,
    tensor: *const sys::ggml_tensor,
    data: *mut c_void,
    offset: usize,
    size: usize,
) {
    ffi((), || {
        // SAFETY: ggml passes our buffer.
        let Some(b) = (unsafe { sim_buffer(buffer) }) else {
            return;
        };
        if tensor.is_null() || data.is_null() {
            return b
                .state
                .fault(format_args!("tensor_get with a null pointer"));
        }
        // SAFETY: live tensor.
        let tdata = unsafe { (*tensor).data };
        match b.region(tdata, offset, size) {
            Some(src) => {
                b.state
                    .check_host_access(src as usize, size, false, "tensor_get");
                // SAFETY: `data` holds `size` writable bytes (caller contract); `src` lies
                // inside the buffer. `copy` tolerates overlap.
                unsafe { ptr::copy(src, data.cast::<u8>(), size) };
                b.state.count(Dir::DeviceToHost, size);
            }
            None => b.state.fault(format_args!(
                "tensor_get of {size} bytes outside the buffer"
            )),
        }
    })
}

/// Copies into `dst` (in `buffer`) from `src` when `src` is in this same device's memory;
/// returns false otherwise, and ggml then stages the copy through host memory with
/// `tensor_get` on the source and `tensor_set` here.
unsafe extern "C" fn buffer_cpy_tensor(
    buffer: sys::ggml_backend_buffer_t,
    src: *const sys::ggml_tensor,
    dst: *mut sys::ggml_tensor,
) -> bool {
    ffi(false, || {
        // SAFETY: ggml passes our buffer.
        let Some(b) = (unsafe { sim_buffer(buffer) }) else {
            return false;
        };
        if src.is_null() || dst.is_null() {
            return false;
        }
        // SAFETY: live tensors; their buffers are live or null.
        unsafe {
            let s = &*src;
            let src_buf = if s.view_src.is_null() {
                s.buffer
            } else {
                (*s.view_src).buffer
            };
            if src_buf.is_null() || (*src_buf).buft != (*buffer).buft {
                return false;
            }
            let Some(sb) = sim_buffer(src_buf) else {
                return false;
            };
            let n = sys::ggml_nbytes(src);
            match (sb.region(s.data, 0, n), b.region((*dst).data, 0, n)) {
                (Some(from), Some(to)) => {
                    b.state
                        .check_host_access(from as usize, n, false, "tensor_copy (source)");
                    b.state
                        .check_host_access(to as usize, n, true, "tensor_copy (destination)");
                    // Both regions lie inside live allocations of this device.
                    ptr::copy(from, to, n);
                    b.state.count(Dir::DeviceToDevice, n);
                    true
                }
                _ => {
                    b.state
                        .fault(format_args!("device copy of {n} bytes outside a buffer"));
                    false
                }
            }
        }
    })
}

unsafe extern "C" fn buffer_clear(buffer: sys::ggml_backend_buffer_t, value: u8) {
    // SAFETY: ggml passes our buffer.
    if let Some(b) = unsafe { sim_buffer(buffer) } {
        b.state
            .check_host_access(b.base.as_ptr() as usize, b.size, true, "buffer_clear");
        // SAFETY: the whole allocation is writable.
        unsafe { ptr::write_bytes(b.base.as_ptr(), value, b.size) };
    }
}

// ---- backend ----

const BACKEND_IFACE: sys::ggml_backend_i = sys::ggml_backend_i {
    get_name: Some(backend_get_name),
    free: Some(backend_free),
    // Transfers are synchronous: ggml falls back to the buffer's set/get/copy.
    set_tensor_async: None,
    get_tensor_async: None,
    set_tensor_2d_async: None,
    get_tensor_2d_async: None,
    cpy_tensor_async: None,
    synchronize: None,
    graph_plan_create: None,
    graph_plan_free: None,
    graph_plan_update: None,
    graph_plan_compute: None,
    graph_compute: Some(backend_graph_compute),
    event_record: None,
    event_wait: None,
    graph_optimize: None,
};

/// [`BACKEND_IFACE`] with queued copies and events ([`SimOptions::async_transfers`]).
const BACKEND_IFACE_ASYNC: sys::ggml_backend_i = sys::ggml_backend_i {
    set_tensor_async: Some(backend_set_tensor_async),
    synchronize: Some(backend_synchronize),
    event_record: Some(backend_event_record),
    event_wait: Some(backend_event_wait),
    ..BACKEND_IFACE
};

/// # Safety
/// `backend` is null or one of this module's backends.
unsafe fn sim_backend<'a>(backend: sys::ggml_backend_t) -> Option<&'a SimBackend> {
    if backend.is_null() {
        return None;
    }
    // SAFETY: our backend; its context is the SimBackend made by `dev_init_backend`.
    unsafe { ((*backend).context as *const SimBackend).as_ref() }
}

unsafe extern "C" fn backend_set_tensor_async(
    backend: sys::ggml_backend_t,
    tensor: *mut sys::ggml_tensor,
    data: *const c_void,
    offset: usize,
    size: usize,
) {
    ffi((), || {
        // SAFETY: ggml passes our backend.
        let Some(ctx) = (unsafe { sim_backend(backend) }) else {
            return;
        };
        if tensor.is_null() || data.is_null() {
            return ctx
                .state
                .fault(format_args!("set_tensor_async with a null pointer"));
        }
        // SAFETY: live tensor; its buffer (or its view source's) is live or null.
        let (buf, tdata) = unsafe {
            let t = &*tensor;
            let buf = if t.view_src.is_null() {
                t.buffer
            } else {
                (*t.view_src).buffer
            };
            (buf, t.data)
        };
        // SAFETY: live buffer or null.
        let region = unsafe { sim_buffer(buf) }
            .filter(|b| Arc::ptr_eq(&b.state, &ctx.state))
            .and_then(|b| b.region(tdata, offset, size));
        let Some(dst) = region else {
            return ctx.state.fault(format_args!(
                "set_tensor_async of {size} bytes outside this device's buffers"
            ));
        };
        // Another stream's graph in flight that this stream is not ordered after races
        // with the copy.
        let racing = {
            let c = ctx.state.counters();
            let (start, end) = (dst as usize, dst as usize + size);
            c.in_flight.iter().any(|g| {
                g.backend != ctx.id
                    && g.seq > c.ordered.get(&(ctx.id, g.backend)).copied().unwrap_or(0)
                    && g.races(start, end, true)
            })
        };
        if racing {
            ctx.state.fault(format_args!(
                "a copy of {size} bytes queued into memory a graph of another stream still uses, without waiting for it"
            ));
        }
        // SAFETY: `data` holds `size` readable bytes (caller contract).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) }.to_vec();
        let mut q = ctx.queue.lock().unwrap_or_else(|e| e.into_inner());
        let seq = q.queued;
        q.pending.push_back((seq, dst as usize, bytes));
        q.queued += 1;
        drop(q);
        ctx.state.counters().queued_h2d += 1;
    })
}

unsafe extern "C" fn backend_synchronize(backend: sys::ggml_backend_t) {
    ffi((), || {
        // SAFETY: ggml passes our backend.
        if let Some(ctx) = unsafe { sim_backend(backend) } {
            ctx.queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .run_all(&ctx.state);
            ctx.state.graphs_done(ctx.id, u64::MAX);
        }
    })
}

unsafe extern "C" fn backend_event_record(
    backend: sys::ggml_backend_t,
    event: sys::ggml_backend_event_t,
) {
    ffi((), || {
        // SAFETY: ggml passes our backend and one of our events.
        let (Some(ctx), Some(e)) = (unsafe { sim_backend(backend) }, unsafe { sim_event(event) })
        else {
            return;
        };
        let seq = ctx.queue.lock().unwrap_or_else(|e| e.into_inner()).queued;
        *e.recorded.lock().unwrap_or_else(|e| e.into_inner()) = Some(Recorded {
            queue: ctx.queue.clone(),
            seq,
            backend: ctx.id,
            graph: ctx.graphs.load(std::sync::atomic::Ordering::SeqCst),
        });
    })
}

/// Waiting in a backend's queue: the backend's later work (a compute, which runs at the
/// call) comes after the event's copies, so they take effect now; and its later copies
/// come after the graphs recorded before the event.
unsafe extern "C" fn backend_event_wait(
    backend: sys::ggml_backend_t,
    event: sys::ggml_backend_event_t,
) {
    ffi((), || {
        // SAFETY: ggml passes one of our events.
        if let Some(e) = unsafe { sim_event(event) } {
            if let (Some(r), Some(ctx)) = (e.complete(), unsafe { sim_backend(backend) }) {
                let mut c = ctx.state.counters();
                let after = c.ordered.entry((ctx.id, r.backend)).or_insert(0);
                *after = (*after).max(r.graph);
            }
        }
    })
}

unsafe extern "C" fn backend_get_name(backend: sys::ggml_backend_t) -> *const c_char {
    if backend.is_null() {
        return c"SIM?".as_ptr();
    }
    // SAFETY: our backend; its device is our device.
    unsafe { dev_get_name((*backend).device) }
}

unsafe extern "C" fn backend_free(backend: sys::ggml_backend_t) {
    if backend.is_null() {
        return;
    }
    ffi((), || {
        // SAFETY: ggml frees each backend once; the struct and its context were boxed by
        // `dev_init_backend`.
        unsafe {
            let ctx = (*backend).context as *mut SimBackend;
            if !ctx.is_null() {
                let c = Box::from_raw(ctx);
                // Freeing a backend finishes its queued copies and graphs.
                c.queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .run_all(&c.state);
                c.state.graphs_done(c.id, u64::MAX);
                sys::ggml_backend_free(c.cpu.as_ptr());
            }
            drop(Box::from_raw(backend));
        }
    })
}

unsafe extern "C" fn backend_graph_compute(
    backend: sys::ggml_backend_t,
    cgraph: *mut sys::ggml_cgraph,
) -> sys::ggml_status {
    ffi(sys::GGML_STATUS_FAILED, || {
        if backend.is_null() || cgraph.is_null() {
            return sys::GGML_STATUS_FAILED;
        }
        // SAFETY: our backend; its context is the SimBackend made by `dev_init_backend`.
        let Some(ctx) = (unsafe { ((*backend).context as *const SimBackend).as_ref() }) else {
            return sys::GGML_STATUS_FAILED;
        };
        let state = &ctx.state;
        // A discrete device computes only on its own memory.
        // SAFETY: live graph.
        let n = unsafe { sys::ggml_graph_n_nodes(cgraph) };
        for i in 0..n {
            // SAFETY: index in range; nodes and sources are live tensors.
            unsafe {
                let node = sys::ggml_graph_node(cgraph, i);
                if !state.is_resident(node) {
                    state.fault(format_args!(
                        "node '{}' is not in this device's memory",
                        tensor_name(node)
                    ));
                    return sys::GGML_STATUS_FAILED;
                }
                for &s in (*node).src.iter() {
                    if !s.is_null() && !state.is_resident(s) {
                        state.fault(format_args!(
                            "source '{}' of node '{}' is not in this device's memory",
                            tensor_name(s),
                            tensor_name(node)
                        ));
                        return sys::GGML_STATUS_FAILED;
                    }
                }
            }
        }
        // The backend's own queued copies come first (stream order).
        ctx.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .run_all(state);
        let _g = ctx.lock.lock().unwrap_or_else(|e| e.into_inner());
        state.counters().graph_computes += 1;
        // SAFETY: every tensor of the graph lies in host memory owned by this device, so the
        // CPU kernels can read and write it; the CPU backend is ours and used under `lock`.
        let status = unsafe { sys::ggml_backend_graph_compute(ctx.cpu.as_ptr(), cgraph) };
        if state.opts.async_transfers {
            // In flight until the host waits (`ggml_backend_graph_compute` synchronises
            // right after this call; `_async` does not).
            let seq = ctx.graphs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            // SAFETY: live graph (see above).
            let (writes, reads) = unsafe { graph_ranges(cgraph) };
            state.counters().in_flight.push(InFlightGraph {
                backend: ctx.id,
                seq,
                writes,
                reads,
            });
        }
        status
    })
}

/// The memory `[start, end)` a graph's nodes write and its sources read.
///
/// # Safety
/// `cgraph` is a live graph whose nodes and sources are live tensors.
unsafe fn graph_ranges(cgraph: *mut sys::ggml_cgraph) -> (Vec<Range>, Vec<Range>) {
    let range = |t: *const sys::ggml_tensor| {
        // SAFETY: live tensor (caller contract).
        let start = unsafe { (*t).data } as usize;
        // SAFETY: live tensor.
        (start, start + unsafe { sys::ggml_nbytes(t) })
    };
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    // SAFETY: live graph.
    let n = unsafe { sys::ggml_graph_n_nodes(cgraph) };
    for i in 0..n {
        // SAFETY: index in range; live node.
        let node = unsafe { sys::ggml_graph_node(cgraph, i) };
        writes.push(range(node));
        // SAFETY: live node; its sources are null or live.
        for &s in unsafe { (*node).src.iter() } {
            if !s.is_null() {
                reads.push(range(s));
            }
        }
    }
    (writes, reads)
}

/// # Safety
/// `t` is a live tensor.
unsafe fn tensor_name(t: *const sys::ggml_tensor) -> String {
    // SAFETY: the name is a NUL-terminated fixed array.
    unsafe { CStr::from_ptr((*t).name.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}
