//! ggml's backend scheduler: one graph over several backends.

use std::os::raw::c_void;
use std::ptr::NonNull;

use ggml_sys as sys;

use super::backend::Backend;
use super::context::Context;
use super::error::{status_name, GgmlError, Result};
use super::graph::Graph;
use super::tensor::GTensor;

/// Called for every node the scheduler evaluates: `(tensor, ask)`. When `ask` is true the
/// callback answers whether it wants to observe that node; when false the node has just been
/// computed and the callback returns whether to continue.
pub type EvalCallback = Box<dyn FnMut(&GTensor, bool) -> bool + Send>;

/// A backend scheduler (`ggml_backend_sched`) over borrowed backends. The last backend must
/// be the CPU backend (ggml's rule); tensors it allocated forget their memory on reset/drop.
pub struct Scheduler<'b> {
    ptr: NonNull<sys::ggml_backend_sched>,
    backends: Vec<&'b Backend>,
    allocated: Vec<GTensor>,
    callback: Option<Box<EvalCallback>>,
    /// Set after a failed reservation or allocation: ggml's graph allocator then keeps the
    /// new plan but no buffers, and the scheduler's next allocation would place tensors in
    /// NULL buffers (a crash), so the next allocation reserves first.
    needs_reserve: bool,
    /// Tensors pinned with `set_tensor_backend` since the last reset (ggml forgets them on
    /// reset), re-applied after the reservation that recovers from a failure.
    pins: Vec<(GTensor, sys::ggml_backend_t)>,
    /// The original sources of the nodes of the graph being split: ggml's scheduler rewrites
    /// them in place to point at its own input copies, which would make a second split of
    /// the same graph read stale copies (and leave the graph pointing into the scheduler's
    /// memory once it is gone); they are put back whenever the allocation is let go.
    sources: Vec<(GTensor, [*mut sys::ggml_tensor; sys::GGML_MAX_SRC as usize])>,
    /// Whether ggml holds an allocated graph (a second allocation must reset first, or
    /// ggml asserts).
    is_alloc: bool,
    /// Node and leaf capacity the scheduler was created for.
    graph_size: usize,
}

// SAFETY: used from one thread at a time through `&mut self`.
unsafe impl Send for Scheduler<'_> {}

impl Drop for Scheduler<'_> {
    fn drop(&mut self) {
        self.forget_allocations();
        // SAFETY: owned scheduler freed once.
        unsafe { sys::ggml_backend_sched_free(self.ptr.as_ptr()) }
    }
}

unsafe extern "C" fn eval_trampoline(
    t: *mut sys::ggml_tensor,
    ask: bool,
    user: *mut c_void,
) -> bool {
    // SAFETY: user is the Box<EvalCallback> owned by the scheduler, alive while it computes.
    let cb = unsafe { &mut *(user as *mut EvalCallback) };
    match Context::resolve(t) {
        Some(t) => {
            // A panic must not unwind into C.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(&t, ask))).unwrap_or(false)
        }
        None => !ask,
    }
}

impl<'b> Scheduler<'b> {
    /// A scheduler over `backends` (the CPU backend last) for graphs of up to `graph_size`
    /// nodes.
    pub fn new(
        backends: &[&'b Backend],
        graph_size: usize,
        parallel: bool,
    ) -> Result<Scheduler<'b>> {
        let last = backends
            .last()
            .ok_or_else(|| GgmlError::Mismatch("scheduler needs at least one backend".into()))?;
        if !last.is_cpu() {
            return Err(GgmlError::Mismatch(format!(
                "the scheduler's last backend must be the CPU, got {}",
                last.name()
            )));
        }
        let mut raws: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.raw()).collect();
        // SAFETY: live backends; NULL bufts means defaults.
        let p = unsafe {
            sys::ggml_backend_sched_new(
                raws.as_mut_ptr(),
                std::ptr::null_mut(),
                raws.len() as i32,
                graph_size.max(16),
                parallel,
                false,
            )
        };
        let ptr = NonNull::new(p).ok_or_else(|| GgmlError::AllocationFailed {
            what: "scheduler".into(),
            buffer_type: "-".into(),
            bytes: 0,
        })?;
        Ok(Scheduler {
            ptr,
            backends: backends.to_vec(),
            allocated: Vec::new(),
            callback: None,
            needs_reserve: false,
            pins: Vec::new(),
            sources: Vec::new(),
            is_alloc: false,
            graph_size: graph_size.max(16),
        })
    }

    /// Refuses graphs larger than the scheduler's hash set (ggml asserts on them).
    fn check_size(&self, graph: &Graph) -> Result<()> {
        let need = graph.n_nodes() + graph.n_leafs();
        if need > self.graph_size {
            return Err(GgmlError::GraphFull {
                needed: need,
                capacity: self.graph_size,
            });
        }
        Ok(())
    }

    fn forget_allocations(&mut self) {
        for t in self.allocated.drain(..) {
            t.clear_allocation();
        }
        self.restore_sources();
    }

    fn save_sources(&mut self, graph: &Graph) {
        self.restore_sources();
        self.sources = graph
            .nodes()
            .into_iter()
            .map(|t| {
                // SAFETY: live descriptor.
                let src = unsafe { (*t.raw()).src };
                (t, src)
            })
            .collect();
    }

    fn restore_sources(&mut self) {
        for (t, src) in self.sources.drain(..) {
            let _g = t.context().lock();
            // SAFETY: live descriptor (the handle keeps its context alive); only the source
            // pointers the scheduler replaced are written back, under the context lock.
            unsafe { (*t.raw()).src = src };
        }
    }

    fn check_backend(&self, b: &Backend) -> Result<()> {
        if self.backends.iter().any(|x| std::ptr::eq(*x, b)) {
            Ok(())
        } else {
            Err(GgmlError::Mismatch(format!(
                "backend {} is not part of this scheduler",
                b.name()
            )))
        }
    }

    /// Reserves buffers for the worst case of `graph`.
    pub fn reserve(&mut self, graph: &Graph) -> Result<()> {
        self.check_size(graph)?;
        self.forget_allocations();
        self.is_alloc = false;
        self.save_sources(graph);
        // SAFETY: live scheduler and graph.
        let ok = unsafe { sys::ggml_backend_sched_reserve(self.ptr.as_ptr(), graph.raw()) };
        self.restore_sources();
        self.needs_reserve = !ok;
        if ok {
            // ggml resets the scheduler after a reservation, which drops the pins.
            self.pins.clear();
            Ok(())
        } else {
            Err(GgmlError::AllocationFailed {
                what: "scheduler reservation".into(),
                buffer_type: "-".into(),
                bytes: 0,
            })
        }
    }

    /// Compute buffer bytes reserved for `backend`.
    pub fn buffer_size(&self, backend: &Backend) -> Result<usize> {
        self.check_backend(backend)?;
        // SAFETY: backend belongs to the scheduler.
        Ok(unsafe { sys::ggml_backend_sched_get_buffer_size(self.ptr.as_ptr(), backend.raw()) })
    }

    /// Pins `t` to `backend`.
    pub fn set_tensor_backend(&mut self, t: &GTensor, backend: &Backend) -> Result<()> {
        self.check_backend(backend)?;
        // SAFETY: backend belongs to the scheduler.
        unsafe {
            sys::ggml_backend_sched_set_tensor_backend(self.ptr.as_ptr(), t.raw(), backend.raw())
        };
        self.pins.push((t.clone(), backend.raw()));
        Ok(())
    }

    /// Allocates `graph`'s tensors across the backends.
    pub fn alloc_graph(&mut self, graph: &Graph) -> Result<()> {
        self.check_size(graph)?;
        self.forget_allocations();
        if self.is_alloc {
            // SAFETY: live scheduler; the pinned tensors and their backends are alive.
            unsafe {
                sys::ggml_backend_sched_reset(self.ptr.as_ptr());
                for (t, b) in &self.pins {
                    sys::ggml_backend_sched_set_tensor_backend(self.ptr.as_ptr(), t.raw(), *b);
                }
            }
            self.is_alloc = false;
        }
        let pending = graph.unallocated_tensors();
        let mut ok = true;
        if self.needs_reserve {
            self.save_sources(graph);
            // SAFETY: live scheduler and graph; the pinned tensors and their backends are
            // alive (held by `pins` and borrowed for 'b).
            unsafe {
                ok = sys::ggml_backend_sched_reserve(self.ptr.as_ptr(), graph.raw());
                for (t, b) in &self.pins {
                    sys::ggml_backend_sched_set_tensor_backend(self.ptr.as_ptr(), t.raw(), *b);
                }
            }
            self.restore_sources();
        }
        if ok {
            self.save_sources(graph);
            // SAFETY: live scheduler and graph; false on failure.
            ok = unsafe { sys::ggml_backend_sched_alloc_graph(self.ptr.as_ptr(), graph.raw()) };
        }
        self.needs_reserve = !ok;
        if !ok {
            self.restore_sources();
            for t in &pending {
                t.clear_allocation();
            }
            return Err(GgmlError::AllocationFailed {
                what: "scheduled graph".into(),
                buffer_type: "-".into(),
                bytes: 0,
            });
        }
        self.allocated = pending;
        self.is_alloc = true;
        Ok(())
    }

    /// Computes `graph` (allocating it first if needed).
    pub fn compute(&mut self, graph: &Graph) -> Result<()> {
        if self.allocated.is_empty() {
            self.alloc_graph(graph)?;
        }
        // SAFETY: graph allocated by this scheduler.
        let status =
            unsafe { sys::ggml_backend_sched_graph_compute(self.ptr.as_ptr(), graph.raw()) };
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::ComputeFailed {
                backend: "scheduler".into(),
                status: status_name(status),
            });
        }
        Ok(())
    }

    /// Number of backend splits of the last graph.
    pub fn n_splits(&self) -> usize {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_get_n_splits(self.ptr.as_ptr()) as usize }
    }

    /// Number of tensor copies between backends of the last graph.
    pub fn n_copies(&self) -> usize {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_get_n_copies(self.ptr.as_ptr()) as usize }
    }

    /// Resets the allocation (the next graph is allocated anew).
    pub fn reset(&mut self) {
        self.forget_allocations();
        self.pins.clear();
        self.is_alloc = false;
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_reset(self.ptr.as_ptr()) }
    }

    /// Installs an evaluation callback (see [`EvalCallback`]).
    pub fn set_eval_callback(&mut self, cb: EvalCallback) {
        let mut boxed: Box<EvalCallback> = Box::new(cb);
        let user = (&mut *boxed) as *mut EvalCallback as *mut c_void;
        // SAFETY: the box is kept in self and outlives every compute call.
        unsafe {
            sys::ggml_backend_sched_set_eval_callback(
                self.ptr.as_ptr(),
                Some(eval_trampoline),
                user,
            )
        };
        self.callback = Some(boxed);
    }
}
