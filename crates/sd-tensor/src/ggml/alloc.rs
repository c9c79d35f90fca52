//! ggml's graph allocator.

use std::ptr::NonNull;

use ggml_sys as sys;

use super::backend::BufferType;
use super::error::{GgmlError, Result};
use super::graph::Graph;
use super::tensor::GTensor;

/// A graph allocator (`ggml_gallocr`): measures a graph's compute buffer and allocates its
/// intermediate tensors in one reused buffer of one buffer type.
///
/// Tensors it allocated forget their memory when it allocates another graph or is dropped.
pub struct Gallocr {
    ptr: NonNull<sys::ggml_gallocr>,
    buft: BufferType,
    allocated: Vec<GTensor>,
    /// Set after a failed reservation: ggml then keeps the new plan but no buffer, and its
    /// `alloc_graph` of the same graph would place tensors in a NULL buffer (a crash), so the
    /// next allocation reserves first.
    needs_reserve: bool,
    /// The graph the current plan was made for (context serial, graph slot, node count).
    /// ggml reuses the previous plan (offsets by node index) whenever node counts and sizes
    /// match, even for a different topology, which silently aliases memory; a different
    /// graph is therefore always re-planned first.
    planned_for: Option<(u64, usize, usize)>,
    /// Counts the buffers ggml may have put in place of the last one (see
    /// [`generation`](Self::generation)).
    generation: u64,
}

// SAFETY: used from one thread at a time through `&mut self`.
unsafe impl Send for Gallocr {}

impl std::fmt::Debug for Gallocr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Gallocr({}, {} bytes)",
            self.buft.name(),
            self.buffer_size()
        )
    }
}

impl Drop for Gallocr {
    fn drop(&mut self) {
        self.forget_allocations();
        // SAFETY: owned allocator freed once.
        unsafe { sys::ggml_gallocr_free(self.ptr.as_ptr()) }
    }
}

impl Gallocr {
    /// An allocator for buffers of type `buft`.
    pub fn new(buft: BufferType) -> Result<Gallocr> {
        // SAFETY: live buffer type.
        let p = unsafe { sys::ggml_gallocr_new(buft.raw()) };
        let ptr = NonNull::new(p).ok_or_else(|| GgmlError::AllocationFailed {
            what: "gallocr".into(),
            buffer_type: buft.name(),
            bytes: 0,
        })?;
        Ok(Gallocr {
            ptr,
            buft,
            allocated: Vec::new(),
            needs_reserve: false,
            planned_for: None,
            generation: 0,
        })
    }

    fn key(graph: &Graph) -> (u64, usize, usize) {
        (
            graph.context().serial(),
            graph.raw() as usize,
            graph.n_nodes(),
        )
    }

    fn forget_allocations(&mut self) {
        for t in self.allocated.drain(..) {
            t.clear_allocation();
        }
    }

    /// Measures `graph` and reserves a buffer large enough for it; returns the buffer size.
    pub fn reserve(&mut self, graph: &Graph) -> Result<usize> {
        self.forget_allocations();
        let before = self.buffer_size();
        // SAFETY: live allocator and graph.
        let ok = unsafe { sys::ggml_gallocr_reserve(self.ptr.as_ptr(), graph.raw()) };
        self.note_buffer(before, ok);
        self.needs_reserve = !ok;
        self.planned_for = ok.then(|| Self::key(graph));
        if !ok {
            return Err(GgmlError::AllocationFailed {
                what: "compute buffer reservation".into(),
                buffer_type: self.buft.name(),
                bytes: self.measure(graph),
            });
        }
        Ok(self.buffer_size())
    }

    /// The compute buffer bytes `graph` needs, without allocating.
    pub fn measure(&self, graph: &Graph) -> usize {
        // Measured with a throwaway allocator: ggml's measuring reservation re-plans the
        // allocator and, when the graph needs more than the current buffer, frees that buffer
        // (under the tensors this allocator placed in it).
        // SAFETY: live buffer type; NULL on failure.
        let Some(tmp) = NonNull::new(unsafe { sys::ggml_gallocr_new(self.buft.raw()) }) else {
            return 0;
        };
        let mut size = 0usize;
        // SAFETY: one buffer type, so one size; the node/leaf buffer ids may be null; the
        // throwaway allocator is freed once.
        unsafe {
            sys::ggml_gallocr_reserve_n_size(
                tmp.as_ptr(),
                graph.raw(),
                std::ptr::null(),
                std::ptr::null(),
                &mut size,
            );
            sys::ggml_gallocr_free(tmp.as_ptr());
        }
        size
    }

    /// Allocates every tensor of `graph` that has no memory yet.
    pub fn alloc_graph(&mut self, graph: &Graph) -> Result<()> {
        self.forget_allocations();
        self.allocated = self.alloc_pending(graph)?;
        Ok(())
    }

    /// [`alloc_graph`](Self::alloc_graph), except that the tensors keep their memory when
    /// this allocator allocates another graph: several graphs that run one after another
    /// share the buffer, each laid out on its own. Their memory stays valid while the
    /// [`generation`](Self::generation) is the one they were allocated in; the caller
    /// drops them (never computes them) once it changed.
    pub fn alloc_graph_kept(&mut self, graph: &Graph) -> Result<()> {
        self.forget_allocations();
        self.alloc_pending(graph).map(drop)
    }

    /// Changes whenever ggml may have freed the buffer and allocated another one (it grew,
    /// or a reservation failed), and on every allocation for a buffer type whose buffers
    /// ggml may split into chunks (a finite maximum size: a chunk may be replaced while the
    /// total stays the same). Tensors of [`alloc_graph_kept`](Self::alloc_graph_kept) have
    /// valid memory only while it has not changed.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn note_buffer(&mut self, before: usize, ok: bool) {
        if !ok || before == 0 || self.buffer_size() != before || self.buft.max_size() != usize::MAX
        {
            self.generation += 1;
        }
    }

    fn alloc_pending(&mut self, graph: &Graph) -> Result<Vec<GTensor>> {
        let pending = graph.unallocated_tensors();
        let before = self.buffer_size();
        // SAFETY: live allocator and graph; both return false on failure.
        let replan = self.needs_reserve || self.planned_for != Some(Self::key(graph));
        let ok = unsafe {
            (!replan || sys::ggml_gallocr_reserve(self.ptr.as_ptr(), graph.raw()))
                && sys::ggml_gallocr_alloc_graph(self.ptr.as_ptr(), graph.raw())
        };
        self.note_buffer(before, ok);
        self.needs_reserve = !ok;
        self.planned_for = ok.then(|| Self::key(graph));
        if !ok {
            for t in &pending {
                t.clear_allocation();
            }
            return Err(GgmlError::AllocationFailed {
                what: "compute graph".into(),
                buffer_type: self.buft.name(),
                bytes: self.measure(graph),
            });
        }
        Ok(pending)
    }

    /// Whether `graph` is the graph this allocator placed last and its tensors still have
    /// that memory (no other graph was allocated or reserved since), so that it can be
    /// computed again without allocating.
    pub fn holds(&self, graph: &Graph) -> bool {
        !self.needs_reserve && self.planned_for == Some(Self::key(graph))
    }

    /// Current size of the allocator's buffer.
    pub fn buffer_size(&self) -> usize {
        // SAFETY: live allocator; buffer 0 exists.
        unsafe { sys::ggml_gallocr_get_buffer_size(self.ptr.as_ptr(), 0) }
    }

    /// The buffer type it allocates from.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }
}
