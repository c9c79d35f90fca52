//! Tensor handles: a ggml tensor descriptor kept alive with its context.

use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;

use ggml_sys as sys;

use super::context::Context;
use super::error::{GgmlError, Result};
use crate::dtype::DType;

/// A stable identity of a tensor: its context's serial and its position in that context's
/// arena (an offset, not an address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId {
    /// Serial of the owning context.
    pub context: u64,
    /// Byte position of the descriptor inside the context arena.
    pub slot: usize,
}

/// A handle to a ggml tensor. It keeps its context alive; cloning is cheap.
#[derive(Clone)]
pub struct GTensor {
    ctx: Context,
    ptr: NonNull<sys::ggml_tensor>,
}

// SAFETY: the descriptor is only mutated under the context lock (see `Context`).
unsafe impl Send for GTensor {}
// SAFETY: see above.
unsafe impl Sync for GTensor {}

impl PartialEq for GTensor {
    fn eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr
    }
}
impl Eq for GTensor {}
impl std::hash::Hash for GTensor {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.id().hash(state)
    }
}

impl fmt::Debug for GTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GTensor('{}', {:?} {:?}, {})",
            self.name(),
            self.dtype_raw(),
            self.ne(),
            self.op_name()
        )
    }
}

impl GTensor {
    pub(crate) fn from_raw(ctx: Context, ptr: *mut sys::ggml_tensor) -> GTensor {
        GTensor {
            ctx,
            ptr: NonNull::new(ptr).expect("ggml returned a null tensor"),
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_tensor {
        self.ptr.as_ptr()
    }

    fn t(&self) -> &sys::ggml_tensor {
        // SAFETY: the context (and so the descriptor) is alive while self is.
        unsafe { self.ptr.as_ref() }
    }

    /// The context this tensor lives in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Stable identity of this tensor.
    pub fn id(&self) -> TensorId {
        TensorId {
            context: self.ctx.serial(),
            // SAFETY: live context.
            slot: (self.ptr.as_ptr() as usize)
                .wrapping_sub(unsafe { sys::ggml_get_mem_buffer(self.ctx.raw()) } as usize),
        }
    }

    /// ggml dimensions, innermost first (always 4 entries).
    pub fn ne(&self) -> [usize; 4] {
        let ne = self.t().ne;
        [
            ne[0] as usize,
            ne[1] as usize,
            ne[2] as usize,
            ne[3] as usize,
        ]
    }

    /// Strides in bytes, innermost first.
    pub fn nb(&self) -> [usize; 4] {
        self.t().nb
    }

    /// Number of dimensions ggml reports (trailing ones dropped, at least 1).
    pub fn n_dims(&self) -> usize {
        // SAFETY: live descriptor.
        unsafe { sys::ggml_n_dims(self.raw()) as usize }
    }

    /// Shape outermost first with `n` dims (host order, e.g. `[N, C, H, W]` for n = 4).
    pub fn shape(&self, n: usize) -> Vec<usize> {
        let ne = self.ne();
        (0..n.min(4)).rev().map(|i| ne[i]).collect()
    }

    /// Element count.
    pub fn nelements(&self) -> usize {
        self.ne().iter().product()
    }

    /// Bytes the tensor's data spans.
    pub fn nbytes(&self) -> usize {
        // SAFETY: live descriptor.
        unsafe { sys::ggml_nbytes(self.raw()) }
    }

    /// Element type, if sd-rs knows it.
    pub fn dtype(&self) -> Option<DType> {
        DType::from_ggml(self.t().type_)
    }

    fn dtype_raw(&self) -> String {
        self.dtype()
            .map(|d| d.to_string())
            .unwrap_or_else(|| format!("type{}", self.t().type_))
    }

    /// Whether the data is laid out contiguously.
    pub fn is_contiguous(&self) -> bool {
        // SAFETY: live descriptor.
        unsafe { sys::ggml_is_contiguous(self.raw()) }
    }

    /// Whether the rows are contiguous and the dimensions above the second are laid out
    /// contiguously over it (ggml's `ggml_is_contiguous_1`, which its GLU ops need).
    pub fn is_contiguous_1(&self) -> bool {
        // SAFETY: live descriptor.
        unsafe { sys::ggml_is_contiguous_1(self.raw()) }
    }

    /// The tensor's name.
    pub fn name(&self) -> String {
        // SAFETY: name is a NUL-terminated fixed array.
        unsafe { CStr::from_ptr(self.t().name.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// Sets the name (truncated to ggml's limit).
    pub fn set_name(&self, name: &str) -> &Self {
        let mut bytes: Vec<u8> = name.bytes().filter(|&b| b != 0).collect();
        bytes.truncate(sys::GGML_MAX_NAME as usize - 1);
        bytes.push(0);
        let _g = self.ctx.lock();
        // SAFETY: NUL-terminated string; ggml copies at most GGML_MAX_NAME bytes.
        unsafe { sys::ggml_set_name(self.raw(), bytes.as_ptr().cast()) };
        self
    }

    /// The operation that produces this tensor (`NONE` for leafs).
    pub fn op_name(&self) -> &'static str {
        op_name_of(self.t().op)
    }

    /// The raw op code (for fingerprints).
    pub fn op_code(&self) -> u32 {
        self.t().op
    }

    /// The op parameters as raw words (for fingerprints).
    pub fn op_params(&self) -> &[i32] {
        &self.t().op_params
    }

    /// Whether this tensor is a leaf (no op).
    pub fn is_leaf(&self) -> bool {
        self.t().op == sys::GGML_OP_NONE
    }

    /// The `i`-th source of this tensor's op.
    pub fn src(&self, i: usize) -> Option<GTensor> {
        let p = *self.t().src.get(i)?;
        if p.is_null() {
            return None;
        }
        Context::resolve(p)
    }

    /// All sources that resolve to a live context, in order (empty slots and sources
    /// from contexts no longer alive are skipped; `source_slots` in `graph_ext` keeps slot
    /// positions and reports unresolvable sources).
    pub fn srcs(&self) -> Vec<GTensor> {
        (0..sys::GGML_MAX_SRC as usize)
            .filter_map(|i| self.src(i))
            .collect()
    }

    /// The tensor this one is a view of, if any.
    pub fn view_src(&self) -> Option<GTensor> {
        let p = self.t().view_src;
        if p.is_null() {
            None
        } else {
            Context::resolve(p)
        }
    }

    /// Marks the tensor as a graph input.
    pub fn set_input(&self) -> &Self {
        let _g = self.ctx.lock();
        // SAFETY: live descriptor.
        unsafe { sys::ggml_set_input(self.raw()) };
        self
    }

    /// Marks the tensor as a graph output (its memory is not reused by the allocator).
    ///
    /// ggml also flags every view source up the chain of a view, which may belong to other
    /// graphs (inputs, weights); use `set_output_only` (in `graph_ext`) to flag just this one.
    pub fn set_output(&self) -> &Self {
        let _g = self.ctx.lock();
        // SAFETY: live descriptor.
        unsafe { sys::ggml_set_output(self.raw()) };
        self
    }

    /// Marks the tensor as a parameter (weight).
    pub fn set_param(&self) -> &Self {
        let _g = self.ctx.lock();
        // SAFETY: live descriptor; ggml_set_param only sets a flag on a leaf.
        unsafe { sys::ggml_set_param(self.raw()) };
        self
    }

    /// Raw ggml flags (input/output/param/loss).
    pub fn flags(&self) -> i32 {
        self.t().flags
    }

    /// Whether the tensor is flagged as a graph output.
    pub fn is_output(&self) -> bool {
        self.t().flags & sys::GGML_TENSOR_FLAG_OUTPUT as i32 != 0
    }

    /// Whether the tensor is flagged as a parameter.
    pub fn is_param(&self) -> bool {
        self.t().flags & sys::GGML_TENSOR_FLAG_PARAM as i32 != 0
    }

    /// Whether the tensor has memory (in a buffer or in its context).
    pub fn is_allocated(&self) -> bool {
        !self.t().data.is_null()
    }

    /// The address of the tensor's data (0 when unallocated): for coalescing copies, and
    /// to tell whether a tensor moved; not for access.
    pub fn data_addr(&self) -> usize {
        self.t().data as usize
    }

    /// Whether both tensors are allocated at the same address (one is placed in the
    /// other's memory).
    pub fn same_data(&self, other: &GTensor) -> bool {
        self.is_allocated() && self.data_addr() == other.data_addr()
    }

    /// Whether the tensor's memory is in a backend buffer.
    pub fn has_buffer(&self) -> bool {
        !self.t().buffer.is_null()
    }

    /// Whether the tensor's memory is host memory the CPU can read directly.
    pub fn is_host(&self) -> bool {
        let b = self.t().buffer;
        // SAFETY: a non-null buffer field points to a live buffer (reset on free).
        b.is_null() && !self.t().data.is_null()
            || !b.is_null() && unsafe { sys::ggml_backend_buffer_is_host(b) }
    }

    pub(crate) fn buffer_raw(&self) -> sys::ggml_backend_buffer_t {
        self.t().buffer
    }

    /// The buffer type of the tensor's buffer (null without a buffer).
    pub(crate) fn buffer_type_raw(&self) -> sys::ggml_backend_buffer_type_t {
        let b = self.t().buffer;
        if b.is_null() {
            return std::ptr::null_mut();
        }
        // SAFETY: a non-null buffer field points to a live buffer (reset on free).
        unsafe { sys::ggml_backend_buffer_get_type(b) }
    }

    /// Makes this tensor (not a view; the same type, dimensions and strides as `of`) read
    /// and write `of`'s memory: its buffer and data become `of`'s. Nothing owns the memory
    /// through it: the caller uses it only while `of`'s memory lives (a segment graph's
    /// stand-in for a cut-cache entry, pointed at the entry of each run).
    pub fn alias_memory(&self, of: &GTensor) -> Result<()> {
        if !self.t().view_src.is_null()
            || self.type_code() != of.type_code()
            || self.ne() != of.ne()
            || self.nb() != of.nb()
        {
            return Err(GgmlError::Mismatch(format!(
                "'{}' cannot alias '{}': another layout, or a view",
                self.name(),
                of.name()
            )));
        }
        if !of.is_allocated() {
            return Err(GgmlError::NotAllocated { name: of.name() });
        }
        let _g = self.ctx.lock();
        // SAFETY: live descriptors; only pointers are written (same layout, so the same
        // extent).
        unsafe {
            let t = self.ptr.as_ptr();
            let o = of.raw();
            (*t).buffer = (*o).buffer;
            (*t).data = (*o).data;
        }
        Ok(())
    }

    /// Points a view at its source's memory as it is now (the source's buffer, its data
    /// plus the view's offset), as ggml does when it allocates a graph: for a graph kept
    /// from one run to the next while the tensors it views moved. Returns `false`, changing
    /// nothing, for a tensor that is not a view or whose source has no memory.
    pub fn rebase_view(&self) -> bool {
        let _g = self.ctx.lock();
        // SAFETY: live descriptors (a view keeps its source's context alive through the
        // graph that holds both); only pointers are written, inside the source's memory
        // (ggml checked the view's extent against its source when it made the view).
        unsafe {
            let t = self.ptr.as_ptr();
            let src = (*t).view_src;
            if src.is_null() || (*src).data.is_null() {
                return false;
            }
            (*t).buffer = (*src).buffer;
            (*t).data = (*src).data.cast::<u8>().add((*t).view_offs).cast();
        }
        true
    }

    /// Forgets this tensor's memory (the memory's owner is letting it go).
    pub(crate) fn clear_allocation(&self) {
        let _g = self.ctx.lock();
        // SAFETY: live descriptor; we only reset pointers, never free.
        unsafe {
            let t = self.ptr.as_ptr();
            (*t).buffer = std::ptr::null_mut();
            (*t).data = std::ptr::null_mut();
            (*t).extra = std::ptr::null_mut();
        }
    }

    fn check_io(&self, bytes: usize, offset: usize) -> Result<()> {
        if !self.is_allocated() {
            return Err(GgmlError::NotAllocated { name: self.name() });
        }
        let n = self.nbytes();
        if offset.checked_add(bytes).is_none_or(|e| e > n) {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: format!("{bytes} bytes at offset {offset} exceed its {n} bytes"),
            });
        }
        Ok(())
    }

    /// Writes raw bytes at `offset` (the tensor must be contiguous when writing more than
    /// one row).
    pub fn write_bytes(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.check_io(bytes.len(), offset)?;
        if super::mapped::is_read_only(self.buffer_raw()) {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: "its memory is a read-only mapping".into(),
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        if self.has_buffer() {
            // SAFETY: bounds checked, tensor allocated in a live buffer.
            unsafe {
                sys::ggml_backend_tensor_set(self.raw(), bytes.as_ptr().cast(), offset, bytes.len())
            };
        } else {
            // SAFETY: context-allocated host data, bounds checked.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    (self.t().data as *mut u8).add(offset),
                    bytes.len(),
                )
            };
        }
        Ok(())
    }

    /// Reads raw bytes at `offset` into `out`.
    pub fn read_bytes_into(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_io(out.len(), offset)?;
        if out.is_empty() {
            return Ok(());
        }
        if self.has_buffer() {
            // SAFETY: bounds checked, tensor allocated in a live buffer.
            unsafe {
                sys::ggml_backend_tensor_get(self.raw(), out.as_mut_ptr().cast(), offset, out.len())
            };
        } else {
            // SAFETY: context-allocated host data, bounds checked.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.t().data as *const u8).add(offset),
                    out.as_mut_ptr(),
                    out.len(),
                )
            };
        }
        Ok(())
    }

    /// Reads all of the tensor's bytes.
    pub fn read_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.nbytes()];
        self.read_bytes_into(0, &mut v)?;
        Ok(v)
    }

    /// Writes f32 values, converting to the tensor's type (f32, f16, bf16 or quantized).
    pub fn write_f32(&self, values: &[f32]) -> Result<()> {
        let dtype = self.dtype().ok_or_else(|| self.type_err())?;
        if values.len() != self.nelements() {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: format!("{} values for {} elements", values.len(), self.nelements()),
            });
        }
        if !self.is_contiguous() {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: "not contiguous".into(),
            });
        }
        let bytes = crate::convert::from_f32(dtype, values, self.ne()[0].max(1)).map_err(|e| {
            GgmlError::DataMismatch {
                name: self.name(),
                detail: e.to_string(),
            }
        })?;
        self.write_bytes(0, &bytes)
    }

    /// Reads the values as f32 (converting from the tensor's type).
    pub fn read_f32(&self) -> Result<Vec<f32>> {
        let dtype = self.dtype().ok_or_else(|| self.type_err())?;
        if !self.is_contiguous() {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: "not contiguous".into(),
            });
        }
        let bytes = self.read_bytes()?;
        crate::convert::to_f32(dtype, &bytes).map_err(|e| GgmlError::DataMismatch {
            name: self.name(),
            detail: e.to_string(),
        })
    }

    /// Writes i32 values (the tensor must be I32).
    pub fn write_i32(&self, values: &[i32]) -> Result<()> {
        if self.dtype() != Some(DType::I32) || values.len() != self.nelements() {
            return Err(GgmlError::DataMismatch {
                name: self.name(),
                detail: format!(
                    "{} i32 values for a {:?} tensor of {} elements",
                    values.len(),
                    self.dtype(),
                    self.nelements()
                ),
            });
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write_bytes(0, &bytes)
    }

    fn type_err(&self) -> GgmlError {
        GgmlError::DataMismatch {
            name: self.name(),
            detail: format!("unsupported type {}", self.dtype_raw()),
        }
    }
}

/// ggml's name of op `op` (`"?"` for one it does not know), from a table made on first use:
/// capturing a graph asks it of every node of every step.
fn op_name_of(op: u32) -> &'static str {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..sys::GGML_OP_COUNT)
            .map(|o| {
                // SAFETY: ggml's static string of each op below GGML_OP_COUNT.
                unsafe { CStr::from_ptr(sys::ggml_op_name(o)) }
                    .to_str()
                    .unwrap_or("?")
            })
            .collect()
    });
    names.get(op as usize).copied().unwrap_or("?")
}
