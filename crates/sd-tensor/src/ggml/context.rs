//! ggml contexts: RAII arenas that hold tensor descriptors (and, when allocating, data).

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use ggml_sys as sys;

use super::error::{GgmlError, Result};
use super::tensor::GTensor;
use crate::dtype::DType;

static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

pub(crate) struct ContextInner {
    pub(crate) ptr: NonNull<sys::ggml_context>,
    pub(crate) serial: u64,
    pub(crate) no_alloc: bool,
    base: usize,
    size: usize,
    pub(crate) lock: Mutex<()>,
    /// Whether graphs built here run on the CPU backend (see [`Context::set_host_kernels`]).
    pub(crate) host_kernels: std::sync::atomic::AtomicBool,
    /// Whether the attention kernel runs its products in bf16 (see
    /// [`Context::set_bf16_attention`]).
    pub(crate) bf16_attention: std::sync::atomic::AtomicBool,
    /// Whether host convolutions and linear layers may run as f32 products of this crate (see
    /// [`Context::set_f32_products`]).
    pub(crate) f32_products: std::sync::atomic::AtomicBool,
    /// Whether convolutions with f16 kernels run as ggml's direct convolution (see
    /// [`Context::set_direct_conv`]).
    pub(crate) direct_conv: std::sync::atomic::AtomicBool,
    /// The most bytes one intermediate of a banded op may take (0: no limit; see
    /// [`Context::set_band_bytes`]).
    pub(crate) band_bytes: std::sync::atomic::AtomicUsize,
}

// SAFETY: a ggml context is plain memory; every mutation (new tensors, names, flags,
// allocation fields) goes through `lock`, so sharing between threads is sound.
unsafe impl Send for ContextInner {}
// SAFETY: see above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        registry_remove(self.base, self.serial);
        // SAFETY: the context was created by ggml_init and is freed once.
        unsafe { sys::ggml_free(self.ptr.as_ptr()) }
    }
}

/// A ggml context. Cloning is cheap and shares the same context; the context is freed when
/// the last clone and the last [`GTensor`] of it are dropped.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("serial", &self.inner.serial)
            .field("no_alloc", &self.inner.no_alloc)
            .field("mem_size", &self.inner.size)
            .finish()
    }
}

impl Context {
    /// Declares that the graphs built in this context run on ggml's CPU backend, so that
    /// operations with a CPU kernel of this crate (ggml custom ops, which only the CPU
    /// backend runs) use it: [`Context::channel_affine`]. Off by default.
    pub fn set_host_kernels(&self, on: bool) {
        self.inner
            .host_kernels
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Declares that the attention kernel of this crate ([`Context::attention_host`]) may run
    /// its two products on bf16 dot products (Q, K, V and the softmax numerators rounded to
    /// bf16, f32 sums) where the CPU has AVX512-BF16: for graphs of bf16 weights, whose
    /// precision is bf16's already. Off by default (all f32).
    pub fn set_bf16_attention(&self, on: bool) {
        self.inner
            .bf16_attention
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// With [`Context::set_host_kernels`] on, lets graphs built here run f16 / f32 weights'
    /// products as f32 products of this crate's CPU kernels (the `gemm` crate) instead of
    /// ggml's f16 product: [`Context::conv_2d_host`]'s stride-1 convolutions over large enough
    /// images, as products over shifted views of the padded input without an im2col
    /// (`host_conv_implicit.rs`: no `KH KW` copies of the input in the compute buffer), and
    /// [`Context::linear`] over at least 512 columns (`host_linear.rs`). The activations stay
    /// f32 (ggml's f16 product rounds them to f16): results agree with ggml's f32 ops to f32
    /// rounding, not bit for bit. On by default.
    pub fn set_f32_products(&self, on: bool) {
        self.inner
            .f32_products
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether networks built here run their convolutions with f16 kernels as ggml's direct
    /// convolution ([`Context::conv_2d_direct`], ggml's `CONV_2D`: on CUDA an implicit GEMM
    /// on tensor cores over f16 activations, the patches expanded in shared memory only,
    /// and 1x1 convolutions as one cuBLAS product per image) instead of `im2col` + matrix
    /// product. For graphs computed on a GPU; off by default.
    pub fn set_direct_conv(&self, on: bool) {
        self.inner
            .direct_conv
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`Context::set_direct_conv`] is on.
    pub fn direct_conv(&self) -> bool {
        self.inner
            .direct_conv
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most bytes one large intermediate of an op built here in bands may take
    /// (`None`: no limit, the default). [`Context::conv_2d`] computes a convolution whose
    /// im2col would take more in bands of output rows, each band's im2col within the limit
    /// (at least one row a band), the bands concatenated; networks read it to run
    /// token-wise layers (a feed-forward's projection) in chunks of tokens. The same
    /// values, a smaller compute buffer: for graphs that run under a device budget, where
    /// a top-resolution intermediate (94 MB for the im2col of a 640-channel 3x3
    /// convolution of SD1.5 at 512x512, batch 2; 84 MB for its feed-forward's projection)
    /// takes room the weights could use.
    pub fn set_band_bytes(&self, limit: Option<usize>) {
        self.inner
            .band_bytes
            .store(limit.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// The limit [`Context::set_band_bytes`] set.
    pub fn band_bytes(&self) -> Option<usize> {
        match self
            .inner
            .band_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            n => Some(n),
        }
    }

    /// Whether [`Context::set_f32_products`] is on.
    pub fn f32_products(&self) -> bool {
        self.inner
            .f32_products
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`Context::set_bf16_attention`] is on.
    pub fn bf16_attention(&self) -> bool {
        self.inner
            .bf16_attention
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`Context::set_host_kernels`] is on.
    pub fn host_kernels(&self) -> bool {
        self.inner
            .host_kernels
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A context that holds only tensor descriptors (data lives in backend buffers), with
    /// room for `max_tensors` tensors and `max_graphs` graphs of `graph_size` nodes.
    pub fn new_descriptors(
        max_tensors: usize,
        graph_size: usize,
        max_graphs: usize,
    ) -> Result<Self> {
        // SAFETY: pure size queries.
        let per_tensor = unsafe { sys::ggml_tensor_overhead() };
        let per_graph = unsafe { sys::ggml_graph_overhead_custom(graph_size.max(1), false) };
        let size = per_tensor
            .checked_mul(max_tensors)
            .and_then(|t| {
                per_graph
                    .checked_mul(max_graphs)
                    .and_then(|g| t.checked_add(g))
            })
            .ok_or_else(|| GgmlError::ContextFull {
                what: "context size".into(),
                needed: usize::MAX,
                available: 0,
            })?;
        Self::with_size(size + 1024, true)
    }

    /// A context of `mem_size` bytes. With `no_alloc` false, tensors created in it get their
    /// data inside the context memory (host memory usable by the CPU backend).
    pub fn with_size(mem_size: usize, no_alloc: bool) -> Result<Self> {
        let params = sys::ggml_init_params {
            mem_size,
            mem_buffer: std::ptr::null_mut(),
            no_alloc,
        };
        // SAFETY: ggml_init allocates its own buffer; it returns NULL on failure.
        let ptr = unsafe { sys::ggml_init(params) };
        let ptr = NonNull::new(ptr).ok_or_else(|| GgmlError::ContextFull {
            what: "ggml_init".into(),
            needed: mem_size,
            available: 0,
        })?;
        // SAFETY: ptr is a live context.
        let base = unsafe { sys::ggml_get_mem_buffer(ptr.as_ptr()) } as usize;
        let inner = Arc::new(ContextInner {
            ptr,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            no_alloc,
            base,
            size: mem_size,
            lock: Mutex::new(()),
            host_kernels: std::sync::atomic::AtomicBool::new(false),
            bf16_attention: std::sync::atomic::AtomicBool::new(false),
            f32_products: std::sync::atomic::AtomicBool::new(true),
            direct_conv: std::sync::atomic::AtomicBool::new(false),
            band_bytes: std::sync::atomic::AtomicUsize::new(0),
        });
        registry_add(&inner);
        Ok(Context { inner })
    }

    /// Whether tensors of this context get no data in the context itself.
    pub fn is_no_alloc(&self) -> bool {
        self.inner.no_alloc
    }

    /// Bytes of context memory still free.
    pub fn free_bytes(&self) -> usize {
        let _g = self.lock();
        // SAFETY: live context.
        let used = unsafe { sys::ggml_used_mem(self.inner.ptr.as_ptr()) };
        self.inner.size.saturating_sub(used)
    }

    /// Total bytes of context memory.
    pub fn mem_size(&self) -> usize {
        self.inner.size
    }

    /// A unique serial number of this context (for ids and fingerprints).
    pub fn serial(&self) -> u64 {
        self.inner.serial
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_context {
        self.inner.ptr.as_ptr()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.inner.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks that the context has room for `tensors` more descriptors and `data` bytes.
    pub(crate) fn ensure_room(&self, what: &str, tensors: usize, data: usize) -> Result<()> {
        // SAFETY: pure size query / live context.
        let per_tensor = unsafe { sys::ggml_tensor_overhead() };
        let used = unsafe { sys::ggml_used_mem(self.raw()) };
        let data = if self.inner.no_alloc {
            0
        } else {
            data + 64 * tensors
        };
        let needed = per_tensor.saturating_mul(tensors).saturating_add(data);
        let available = self.inner.size.saturating_sub(used);
        if needed > available {
            return Err(GgmlError::ContextFull {
                what: what.to_string(),
                needed,
                available,
            });
        }
        Ok(())
    }

    /// A new tensor of `dtype` with ggml dimensions `ne` (innermost first, 1 to 4 dims).
    pub fn new_tensor(&self, dtype: DType, ne: &[usize]) -> Result<GTensor> {
        if ne.is_empty() || ne.len() > super::MAX_DIMS {
            return Err(GgmlError::InvalidOperands {
                op: "new_tensor",
                detail: format!("{} dimensions (1 to 4 allowed)", ne.len()),
            });
        }
        if !ne[0].is_multiple_of(dtype.block_size()) {
            return Err(GgmlError::InvalidOperands {
                op: "new_tensor",
                detail: format!("row of {} elements is not whole {} blocks", ne[0], dtype),
            });
        }
        let mut bytes = dtype.row_size(ne[0]).unwrap_or(usize::MAX);
        for &d in &ne[1..] {
            bytes = bytes.saturating_mul(d);
        }
        if bytes == usize::MAX || ne.iter().any(|&d| d > i64::MAX as usize) {
            return Err(GgmlError::InvalidOperands {
                op: "new_tensor",
                detail: format!("shape {ne:?} overflows"),
            });
        }
        let _g = self.lock();
        self.ensure_room("new_tensor", 1, bytes)?;
        let ne64: Vec<i64> = ne.iter().map(|&d| d as i64).collect();
        // SAFETY: room checked; dims valid.
        let t = unsafe {
            sys::ggml_new_tensor(self.raw(), dtype.to_ggml(), ne.len() as i32, ne64.as_ptr())
        };
        Ok(GTensor::from_raw(self.clone(), t))
    }

    /// A new f32 tensor with the given data (an allocating context is required), ggml
    /// dimensions `ne`.
    pub fn new_f32_with_data(&self, ne: &[usize], data: &[f32]) -> Result<GTensor> {
        if self.inner.no_alloc {
            return Err(GgmlError::Mismatch(
                "new_f32_with_data needs an allocating context".into(),
            ));
        }
        let t = self.new_tensor(DType::F32, ne)?;
        t.write_f32(data)?;
        Ok(t)
    }

    /// Resolves a raw tensor pointer that belongs to some live context.
    pub(crate) fn resolve(ptr: *mut sys::ggml_tensor) -> Option<GTensor> {
        let addr = ptr as usize;
        let ctx = registry_find(addr)?;
        Some(GTensor::from_raw(ctx, ptr))
    }
}

// ---- registry of live contexts, to map a raw source pointer back to its context ----
//
// Keyed by the start of each context's memory (contexts never overlap; a context leaves the
// registry before its memory is freed), so that a pointer is found by one ordered lookup:
// capturing a graph resolves every node and source, and a process holds hundreds of
// contexts (weights, cut-cache entries, kept graphs).

struct Entry {
    serial: u64,
    size: usize,
    ctx: Weak<ContextInner>,
}

fn registry() -> &'static Mutex<BTreeMap<usize, Entry>> {
    static R: OnceLock<Mutex<BTreeMap<usize, Entry>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn registry_add(inner: &Arc<ContextInner>) {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.insert(
        inner.base,
        Entry {
            serial: inner.serial,
            size: inner.size,
            ctx: Arc::downgrade(inner),
        },
    );
}

fn registry_remove(base: usize, serial: u64) {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    if r.get(&base).is_some_and(|e| e.serial == serial) {
        r.remove(&base);
    }
}

fn registry_find(addr: usize) -> Option<Context> {
    let r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.range(..=addr)
        .next_back()
        .filter(|(base, e)| addr < **base + e.size)
        .and_then(|(_, e)| e.ctx.upgrade())
        .map(|inner| Context { inner })
}
